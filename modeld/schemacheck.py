"""JSON schemas that clients send, handled within bounds: the size first, then the time.

A request's schema (``response_format.json_schema``, a forced tool call's parameters) is
checked by the daemon before its job is sent (``check_schema``), and a strict reply is
validated against it by the runner (``reply_problem``). Both are bounded:

- a schema over ``MAX_SCHEMA_BYTES`` (counted as its strings, keys and values), or one with
  a regular expression (``pattern``, a ``patternProperties`` key) over ``MAX_PATTERN_CHARS``,
  is refused before anything compiles it: jsonschema compiles every pattern when it checks a
  schema, and a pattern of millions of alternatives held the event loop past systemd's
  watchdog (docs/security.md);
- a ``$ref`` that points outside the schema is refused (modeld fetches nothing), and so is a
  loop of references that comes back to a schema without reaching into the value
  (``{"$ref": "#"}``): validating it never ends (Python's RecursionError);
- a pattern can backtrack (``^(a|a)*$`` doubles its time with each character of a key), and
  Python's ``re`` can be stopped by nothing while it holds the GIL: a reply's patterns are
  matched with the ``regex`` module instead, which gives the GIL up while it matches and stops
  at a timeout, so that a whole check ends within ``CHECK_SECONDS`` (``CheckTimeout``):
  ``regex`` counts its timeout in the matching thread's CPU time, so on a loaded host the
  wall time is longer, but the CPU a check can take from others is bounded. The rest of
  validation is linear in the reply.

It imports only the standard library at module level (the runner child imports it).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# A schema's strings, keys and values counted as bytes: OpenAI's own limits on a strict
# schema (5,000 properties, 120,000 characters of names and values) come in well under it.
MAX_SCHEMA_BYTES = 256 * 1024
# A regular expression of a schema: the patterns of real schemas are a line long.
MAX_PATTERN_CHARS = 4096
# What validating one reply may take before it is stopped (a pattern that backtracks).
CHECK_SECONDS = 1.0

# Keywords whose subschemas apply to the same value as the schema that holds them: a loop of
# references through them alone never reaches into the value.
_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_MANY = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas",)
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaRefused(ValueError):
    """A schema modeld does not take; the message says why and what to change, ``at`` where
    in the schema (``.properties.a``; "" for the whole)."""

    def __init__(self, message: str, at: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.at = at


class CheckFailed(Exception):
    """A reply could not be checked against its schema; the message says why."""


class CheckTimeout(CheckFailed):
    """Validating a reply took longer than its bound (a pattern that backtracks)."""


def _nodes(schema: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container key or None, value) of ``schema``, without recursion."""
    stack: list[tuple[Any, Any]] = [(None, schema)]
    while stack:
        key, node = stack.pop()
        yield key, node
        if isinstance(node, dict):
            stack.extend(node.items())
        elif isinstance(node, list):
            stack.extend((None, v) for v in node)


def _patterns(schema: Any) -> Iterator[str]:
    """The regular expressions of ``schema``: ``pattern`` values, ``patternProperties`` keys."""
    for key, node in _nodes(schema):
        if key == "pattern" and isinstance(node, str):
            yield node
        elif key == "patternProperties" and isinstance(node, dict):
            yield from (k for k in node if isinstance(k, str))


def json_size(value: Any, limit: int) -> int:
    """The size of ``value`` (a JSON document) counted as its strings' and keys' characters
    and 1 for any other value, counting stops once past ``limit`` (nothing is copied)."""
    size = 0
    for key, node in _nodes(value):
        size += len(key) if isinstance(key, str) else 0
        size += len(node) if isinstance(node, str) else 1
        if size > limit:
            break
    return size


def check_size(schema: Any) -> None:
    """Refuse a schema over ``MAX_SCHEMA_BYTES`` or a pattern over ``MAX_PATTERN_CHARS``,
    stopping at the first byte past the bound (nothing is compiled or copied)."""
    if json_size(schema, MAX_SCHEMA_BYTES) > MAX_SCHEMA_BYTES:
        raise SchemaRefused(
            f"the schema is over {MAX_SCHEMA_BYTES // 1024} KiB; send a smaller one"
        )
    for pattern in _patterns(schema):
        if len(pattern) > MAX_PATTERN_CHARS:
            raise SchemaRefused(
                f"a pattern of {len(pattern)} characters is over the {MAX_PATTERN_CHARS} "
                "modeld takes; send a shorter regular expression"
            )


def _pointer(schema: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` names (``#``, ``#/a/b``, ``#name`` of an ``$anchor``),
    or None when it names none."""
    fragment = unquote(ref[1:])
    if not fragment.startswith("/"):
        if not fragment:
            return schema
        anchors = (
            node
            for _, node in _nodes(schema)
            if isinstance(node, dict)
            and fragment in (node.get("$anchor"), node.get("$dynamicAnchor"))
        )
        return next(anchors, None)
    node = schema
    for raw in fragment[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _in_place(schema: Any, node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The subschemas that apply to the value ``node`` applies to, with how they are reached."""
    for key in _REFS:
        ref = node.get(key)
        if isinstance(ref, str) and ref.startswith("#"):
            yield f"$ref {ref!r}", _pointer(schema, ref)
    for key in _IN_PLACE_ONE:
        yield key, node.get(key)
    for key in _IN_PLACE_MANY:
        items = node.get(key)
        if isinstance(items, list):
            yield from ((key, item) for item in items)
    for key in _IN_PLACE_MAP:
        items = node.get(key)
        if isinstance(items, dict):
            yield from ((key, item) for item in items.values())


def check_refs(schema: Any) -> None:
    """Refuse a ``$ref`` outside ``schema``, and a loop of references that never reaches into
    the value (it would be followed for ever)."""
    for key, node in _nodes(schema):
        if key in _REFS and isinstance(node, str) and not node.startswith("#"):
            raise SchemaRefused(
                f"$ref {node!r} points outside the schema, and modeld fetches nothing; put "
                'what it names under "$defs" and refer to it as "#/$defs/NAME"'
            )
    done: set[int] = set()
    for _, start in _nodes(schema):
        if not isinstance(start, dict) or id(start) in done:
            continue
        # Depth first along in-place edges; a schema met again on the path is a loop.
        path: list[int] = []
        stack: list[tuple[Any, str, bool]] = [(start, "", False)]
        while stack:
            node, how, leaving = stack.pop()
            if leaving:
                path.pop()
                done.add(id(node))
                continue
            if not isinstance(node, dict) or id(node) in done:
                continue
            if id(node) in path:
                raise SchemaRefused(
                    f"{how} leads back to a schema that refers to it without reaching into "
                    "the value, so checking a value against it never ends; refer to a schema "
                    "from inside properties or items"
                )
            path.append(id(node))
            stack.append((node, how, True))
            stack.extend((sub, via, False) for via, sub in _in_place(schema, node))


def check_schema(schema: Any) -> None:
    """Refuse (``SchemaRefused``) what is not a JSON schema modeld takes: too large, a
    pattern too long, a reference outside it or in a loop, or not valid against its draft's
    meta-schema (which compiles each pattern: the size is checked first)."""
    check_size(schema)
    check_refs(schema)
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    with warnings.catch_warnings():
        # An unknown "$schema" is checked against the latest draft (jsonschema warns).
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            validator_for(schema, default=Draft202012Validator).check_schema(schema)
        except SchemaError as e:
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
            raise SchemaRefused(f"is not a valid JSON schema: {e.message}", at) from None


class _Clock:
    """What is left of one check's CPU time on this thread (the time ``regex`` counts its
    timeouts in); ``TimeoutError`` once it is spent."""

    def __init__(self, seconds: float) -> None:
        self.ends = time.thread_time() + seconds

    def left(self) -> float:
        left = self.ends - time.thread_time()
        if left <= 0:
            raise TimeoutError
        return left


def _bounded_validator(schema: Any, clock: _Clock) -> Any:
    """jsonschema's validator for ``schema``'s draft, with ``pattern`` and
    ``patternProperties`` matched by ``regex`` within ``clock``'s time."""
    import jsonschema
    import regex
    from jsonschema import ValidationError

    def search(pattern: str, text: str) -> bool:
        return regex.search(pattern, text, timeout=clock.left(), concurrent=True) is not None

    def pattern(validator: Any, patrn: str, instance: Any, _schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(
        validator: Any, patterns: dict[str, Any], instance: Any, _schema: Any
    ) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for key, value in instance.items():
                if search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    base = jsonschema.validators.validator_for(schema)
    keywords = {"pattern": pattern, "patternProperties": pattern_properties}
    extended = jsonschema.validators.extend(base, keywords)  # type: ignore[no-untyped-call]
    return extended(schema)


def reply_problem(schema: Any, doc: Any, seconds: float = CHECK_SECONDS) -> str | None:
    """Where and why ``doc`` does not match ``schema`` (jsonschema's best match), or None
    when it matches. Raises ``CheckFailed`` when that cannot be told: ``CheckTimeout`` when
    the check took over ``seconds`` (a pattern that backtracks)."""
    import jsonschema

    clock = _Clock(seconds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        validator = _bounded_validator(schema, clock)
        try:
            found = jsonschema.exceptions.best_match(validator.iter_errors(doc))
        except RecursionError:
            raise CheckFailed("the schema refers to itself too deeply to check a reply") from None
        except TimeoutError:
            raise CheckTimeout(f"the check took over {seconds:g} s") from None
    if found is None:
        return None
    where = "/".join(str(p) for p in found.absolute_path) or "(root)"
    return f"at {where}: {found.message}"
