"""The conversations a runner keeps after a reply, so that the conversation's next turn
continues one instead of prefilling the whole history again.

A kept conversation is a bare session (``PlainSession``) at a checkpoint that holds exactly
the tokens a fresh conversation would prefill for its messages so far: the history and the
reply, rendered as the app sends them back (``Kept.text``). The runner (``child``) decides
what is kept and checks the rendered prompt before it continues one; this module files
them and finds them.

The match is an exact digest, computed by the runner from the job itself:

- ``history``: sha256 chained over the caller's scope and each message as the runtime
  receives it, in canonical JSON (sorted keys, no spaces, UTF-8):
  ``d_0 = H(VERSION || scope)``, ``d_i = H(d_{i-1} || message_i)``;
- ``settings``: sha256 of the job's ``kept_settings`` (its session's sampler and
  arguments, each set or not).

A job with messages ``m_1 .. m_n`` looks up ``(d_i, settings)`` for each earlier assistant
turn ``m_i``, the latest first: a hit is a conversation kept after exactly those ``i``
messages, for this caller, under these settings. The scope is in every digest, so one
caller's conversation is never found for another, and a miss is explained only with what
the caller's own digests show (``take``).

Like the child, this imports only the standard library.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modeld.engine.runner.job import GenerateJob, Message, Restart

# Bumped when what is hashed changes, so that no digest of the old form is ever matched.
VERSION = b"modeld-kept-1\x00"


def _canonical(value: Any) -> bytes:
    # surrogatepass: a lone surrogate in a message (valid JSON) hashes instead of failing.
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def root(scope: str) -> bytes:
    """``d_0``: the digest of a caller's empty history."""
    return hashlib.sha256(VERSION + _canonical(scope)).digest()


def chain(start: bytes, messages: Sequence[Message]) -> list[bytes]:
    """The history digest after each of ``messages``, continuing from ``start``."""
    out = []
    digest = start
    for message in messages:
        digest = hashlib.sha256(digest + _canonical(message)).digest()
        out.append(digest)
    return out


def settings_of(job: GenerateJob) -> bytes:
    return hashlib.sha256(_canonical(list(job.kept_settings()))).digest()


@dataclass
class Kept:
    """One kept conversation: its session at a checkpoint, and what that checkpoint holds."""

    session: Any  # a PlainSession
    # The rendered prompt the checkpoint holds, its tokens as the engine's tokenizer gives
    # them, and the tokens the session counted in its prefills (its BOS included).
    text: str
    ids: tuple[int, ...]
    tokens: int
    root: bytes
    history: bytes
    settings: bytes
    # What its reply is rendered from to be prefilled into its checkpoint while the engine
    # is idle (``child._settle``): the system message and the messages, reply included;
    # None: nothing waits (a first turn's reply is left to the next turn).
    settle: tuple[dict[str, Any], list[Any]] | None = None
    # Whether it has continued: a chat, where one never continued may be a one-shot request.
    continued: bool = False


class KeptConversations:
    """At most ``limit`` kept conversations (``keep`` says which go first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: OrderedDict[tuple[bytes, bytes], Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, job: GenerateJob, scope: str) -> tuple[Kept | None, Restart | None]:
        """The conversation kept for ``job`` (no longer kept: the caller keeps it again or
        closes it), or None and why none fits."""
        start = root(scope)
        messages = job.messages[:-1]
        digests = chain(start, messages)
        replies = [digests[i] for i in reversed(range(len(messages))) if _is_reply(messages[i])]
        if not replies:
            return None, "first"
        settings = settings_of(job)
        for digest in replies:
            found = self._kept.pop((digest, settings), None)
            if found is not None:
                return found, None
        if any(k.history in replies for k in self._kept.values()):
            return None, "options"
        if any(k.root == start and k.settings == settings for k in self._kept.values()):
            return None, "history"
        return None, "unknown"

    def unsettled(self) -> Kept | None:
        """The most recently used kept conversation whose reply waits to be settled."""
        return next((k for k in reversed(self._kept.values()) if k.settle is not None), None)

    def waiting(self) -> int:
        """How many kept conversations' replies wait to be settled; safe from another thread
        (the list is taken in one step under the GIL)."""
        return sum(k.settle is not None for k in list(self._kept.values()))

    def discard(self, kept: Kept) -> None:
        self._kept.pop((kept.history, kept.settings), None)

    def keep(self, kept: Kept) -> list[Kept]:
        """File ``kept`` as the most recently used; return the ones dropped to make room
        (the caller closes their sessions): the least recently used of the others that
        never continued first, so that one-shot requests (an app's title or tag requests
        between a chat's turns) do not push out the chats, then the least recently used."""
        key = (kept.history, kept.settings)
        dropped = []
        if key in self._kept:
            dropped.append(self._kept.pop(key))
        self._kept[key] = kept
        while len(self._kept) > self.limit:
            others = [k for k in self._kept if k != key]
            oldest = next((k for k in others if not self._kept[k].continued), others[0])
            dropped.append(self._kept.pop(oldest))
        return dropped


def _is_reply(message: Message) -> bool:
    return message["role"] == "assistant"


def has_reply(messages: Sequence[Message]) -> bool:
    """Whether ``messages`` hold a reply that a kept conversation may have ended with."""
    return any(_is_reply(m) for m in messages)
