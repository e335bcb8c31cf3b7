"""Resolving the backend plan (main/vision/audio) for one request on one file.

Who decides, strongest first: the request's explicit backends, the registry entry's
``[backends]``, the settings. The file's ``backend_constraint`` items decide what is
allowed. Vision and audio backends are the admin's or the caller's choice and are
never changed here: a mismatch is refused with the runtime's own terms, because the
runtime would refuse it anyway, only later and less clearly (inside ``Engine()``).
The one automatic change is the documented fallback ``main=gpu`` -> ``cpu``, taken
only when the file allows cpu for main and the GPU probe for this file failed.

Modalities a request does not use are planned as ``None``: the runtime checks no
constraint for them, which is how Gemma-3n (vision encoder requires gpu) serves text
on a CPU-only host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from modeld.config import Settings
from modeld.errors import BackendConstraint, BadRequest, Refused
from modeld.modelfile.header import ModelInfo, Role

BACKENDS = ("cpu", "gpu")
MODALITIES = frozenset({"text", "image", "audio"})
_MODALITY_ALIASES = {"vision": "image", "images": "image"}
Source = Literal["request", "entry", "settings"]
# backend -> True (works for this file), False (failed), None (not probed yet)
ProbeResults = Mapping[str, bool | None]

_ROLE_TITLE = {"main": "Main", "vision": "Vision", "audio": "Audio"}


@dataclass(frozen=True)
class Prefs:
    """One layer of backend wishes; None leaves the choice to the layer below."""

    main: str | None = None
    vision: str | None = None
    audio: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Prefs:
        # Audio has no setting: the field reports Gemma-4's audio encoder as cpu-only.
        return cls(main=settings.main_backend, vision=settings.vision_backend, audio="cpu")

    @classmethod
    def from_mapping(cls, backends: Mapping[str, Any] | None) -> Prefs:
        """From a registry entry's ``[backends]`` table or a request's ``backends`` object."""
        if not backends:
            return cls()
        unknown = set(backends) - {"main", "vision", "audio"}
        if unknown:
            raise BadRequest(
                f"unknown backend role {sorted(unknown)[0]!r}; use main, vision, audio"
            )
        return cls(**{k: v for k, v in backends.items() if v is not None})


@dataclass(frozen=True)
class Plan:
    """The backends one engine is created with; None means the modality is not loaded."""

    main: str
    vision: str | None = None
    audio: str | None = None
    fell_back: bool = False

    @property
    def key(self) -> str:
        """A stable string for keying engines, e.g. ``main=cpu,vision=none,audio=none``."""
        return f"main={self.main},vision={self.vision or 'none'},audio={self.audio or 'none'}"

    def backends(self) -> frozenset[str]:
        return frozenset(b for b in (self.main, self.vision, self.audio) if b is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "main": self.main,
            "vision": self.vision,
            "audio": self.audio,
            "fell_back": self.fell_back,
            "key": self.key,
        }


def normalize_modalities(modalities: Iterable[str]) -> frozenset[str]:
    """``{"text", "vision"}`` -> ``{"text", "image"}``; text is always included."""
    out = {"text"}
    for m in modalities:
        name = _MODALITY_ALIASES.get(m.lower(), m.lower())
        if name not in MODALITIES:
            raise BadRequest(f"unknown modality {m!r}; use text, image or audio")
        out.add(name)
    return frozenset(out)


def _pick(role: Role, layers: list[tuple[Source, Prefs]]) -> tuple[str, Source]:
    for source, prefs in layers:
        value = getattr(prefs, role)
        if value is None:
            continue
        backend = str(value).strip().lower()
        if backend not in BACKENDS:
            raise BadRequest(
                f"{role} backend {value!r} (from the {source}) is not one of {', '.join(BACKENDS)}"
            )
        return backend, source
    return ("gpu" if role == "main" else "cpu"), "settings"


def _fix(role: Role, backend: str, source: Source) -> str:
    if source == "request":
        return f"ask for {role} backend {backend}"
    if source == "entry":
        return f'set {role} = "{backend}" in the registry entry\'s [backends]'
    return f"set MODELD_{role.upper()}_BACKEND={backend}"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _allowed_text(allowed: frozenset[str]) -> str:
    return "[" + ", ".join(sorted(allowed)) + "]"


def _mismatch(model: str, role: Role, allowed: frozenset[str], asked: str) -> str:
    # The runtime's wording (liblitert-lm: "... backend constraint mismatch. Model
    # requires one of [...]"), so users can search for either and find the other.
    return (
        f"model {model}: {_ROLE_TITLE[role]} backend constraint mismatch: model requires "
        f"one of {_allowed_text(allowed)} but {role} backend is {asked}."
    )


def _check_modality(
    info: ModelInfo,
    model: str,
    role: Literal["vision", "audio"],
    layers: list[tuple[Source, Prefs]],
    probes: ProbeResults,
) -> str:
    backend, source = _pick(role, layers)
    allowed = info.constraint_for(role)
    text_only = "send a text-only request" if role == "vision" else "send a request without audio"
    if allowed is not None and backend not in allowed:
        usable = [b for b in BACKENDS if b in allowed]
        if usable:
            need = usable[0]
            hint = " (needs a GPU)" if need == "gpu" else ""
            fix = f"{_cap(_fix(role, need, source))}{hint} or {text_only}."
        else:
            fix = f"This host cannot run it; {text_only}."
        raise BackendConstraint(
            f"{_mismatch(model, role, allowed, backend)} {fix}",
            role=role,
            allowed=sorted(allowed),
            asked=backend,
        )
    if backend == "gpu" and probes.get("gpu") is False:
        fix = (
            f"{_cap(_fix(role, 'cpu', source))} or {text_only}."
            if allowed is None or "cpu" in allowed
            else f"This host cannot run its {role} encoder; {text_only}."
        )
        raise BackendConstraint(
            f"model {model}: {role} backend gpu was asked but the GPU probe for this file "
            f"failed on this host. {fix}",
            role=role,
            asked=backend,
        )
    return backend


def resolve(
    info: ModelInfo,
    *,
    model: str,
    settings: Prefs,
    entry: Prefs | None = None,
    request: Prefs | None = None,
    modalities: Iterable[str] = ("text",),
    probes: ProbeResults | None = None,
) -> Plan:
    """The plan for ``modalities`` on this file, or BackendConstraint/Refused saying why not.

    ``probes`` holds this file's GPU probe results; with ``gpu`` unknown the plan keeps
    gpu and the caller should probe first (see :func:`needs_probe`) and resolve again.
    """
    probes = probes or {}
    wanted = normalize_modalities(modalities)
    layers: list[tuple[Source, Prefs]] = [("request", request or Prefs())]
    layers += [("entry", entry or Prefs()), ("settings", settings)]

    main, source = _pick("main", layers)
    allowed = info.constraint_for("main")
    fell_back = False
    cpu_ok = allowed is None or "cpu" in allowed
    if main == "gpu" and probes.get("gpu") is False:
        # An explicit request for gpu is honoured or refused, never silently changed.
        if cpu_ok and source != "request":
            main, fell_back = "cpu", True
        else:
            if source == "request":
                why, fix = "the request asked for gpu", "Ask for main backend cpu"
            else:
                only = _allowed_text(allowed or frozenset())
                why, fix = f"the file allows only {only} for main", "Run it on a host with a GPU"
            raise BackendConstraint(
                f"model {model}: main backend gpu was asked but the GPU probe for this file "
                f"failed on this host, and {why}. {fix}.",
                role="main",
                asked="gpu",
            )
    elif allowed is not None and main not in allowed:
        usable = [b for b in BACKENDS if b in allowed]
        fix = (
            _cap(_fix("main", usable[0], source))
            + (" (needs a GPU)." if usable[0] == "gpu" else ".")
            if usable
            else "This host cannot run it; choose another model."
        )
        raise BackendConstraint(
            f"{_mismatch(model, 'main', allowed, main)} {fix}",
            role="main",
            allowed=sorted(allowed),
            asked=main,
        )

    vision = audio = None
    if "image" in wanted:
        if not info.has_vision:
            raise Refused(
                f"model {model} has no vision encoder, so it cannot take images; "
                "send a text-only request or choose a model with vision",
                modality="image",
            )
        vision = _check_modality(info, model, "vision", layers, probes)
    if "audio" in wanted:
        if not info.has_audio:
            raise Refused(
                f"model {model} has no audio encoder, so it cannot take audio; "
                "send a request without audio or choose a model with audio",
                modality="audio",
            )
        audio = _check_modality(info, model, "audio", layers, probes)
    return Plan(main=main, vision=vision, audio=audio, fell_back=fell_back)


def needs_probe(plan: Plan, probes: ProbeResults | None = None) -> frozenset[str]:
    """Backends of ``plan`` whose probe result for this file is still unknown.

    Only gpu is probed: the cpu backend has no host-dependent failure to find out.
    """
    probes = probes or {}
    return frozenset(b for b in plan.backends() if b == "gpu" and probes.get(b) is None)
