"""``ps``, ``load`` and ``unload`` (alias ``stop``)."""

from __future__ import annotations

import argparse

from modeld.cli.common import (
    Ctx,
    Verbs,
    call,
    complete_loaded,
    complete_model,
    completes,
    console,
    emit,
    err_console,
    escape,
    json_flag,
    keep_alive_arg,
    table,
)
from modeld.client import Client
from modeld.config import format_duration, format_size
from modeld.errors import EngineNotFound

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any

_BACKENDS = ["cpu", "gpu"]


def _size(n: int | None) -> str:
    return format_size(n) if n else "-"


def continued_of(turns: dict[str, Any]) -> str:
    """Turns that continued a kept conversation, of all (``ps``'s CONTINUED column)."""
    total = turns["continued"] + sum(turns["restarted"].values())
    return f"{turns['continued']}/{total}" if total else "-"


def turns_line(turns: dict[str, Any]) -> str:
    """Why an engine's turns did not continue a kept conversation, and how many it keeps;
    "" when every turn continued or was a first one."""
    why = {k: n for k, n in turns["restarted"].items() if k != "first"}
    if not why:
        return ""
    reasons = ", ".join(f"{k} {n}" for k, n in why.items())
    return (
        f"turns not continued: {reasons} (docs/engines.md#conversations-that-continue); "
        f"{turns['kept']} conversation(s) kept"
    )


def _print_ps(doc: dict[str, Any]) -> None:
    engines = doc["engines"]
    if not engines:
        console.print("no engines loaded")
    else:
        t = table(
            "ENGINE",
            "STATE",
            "THREADS",
            "PSS",
            "ESTIMATE",
            "IDLE",
            "EXPIRES",
            "REQUESTS",
            "CONTINUED",
            "LAST EVICTION",
        )
        for e in engines:
            t.add_row(
                e["id"],
                e["state"] + (" (pinned)" if e["pinned"] else ""),
                str(e.get("cpu_threads") or "-"),
                _size(e["pss"]),
                _size(e["pss_estimate"]),
                format_duration(e["idle_seconds"]) if e["idle_seconds"] is not None else "-",
                format_duration(e["expires_in"])
                if e["expires_in"] is not None
                else "never"
                if e["keep_alive"] < 0 or e["pinned"]
                else "-",
                str(e["requests"]),
                continued_of(e["conversations"]),
                e["last_eviction"] or "-",
            )
        console.print(t)
        for e in engines:
            if e["adapter"]:
                console.print(f"{e['id']}: GPU adapter {e['adapter']}", highlight=False)
            why = turns_line(e["conversations"])
            if why:
                console.print(f"{e['id']}: {why}", highlight=False)
    console.print(f"budget: {_size(doc['used'])} of {_size(doc['budget'])} in use")
    spare = doc.get("spare") or {}
    if spare.get("pid"):
        console.print(
            f"spare runner: pid {spare['pid']}, {_size(spare['pss'])} (a runtime started "
            "ahead, with no model, so that the next load skips its start; counted in the "
            "budget)",
            highlight=False,
        )
    runtime = doc["runtime"]
    console.print(
        f"runtime: {runtime['package']} {runtime['version'] or '(not installed)'}, "
        f"GPU adapter {runtime['adapter'] or 'none'}",
        highlight=False,
    )


def ps(ctx: Ctx, as_json: bool) -> None:
    """List loaded engines: plan, state, memory, idle time, expiry, requests served."""
    doc = call(ctx, lambda c: c.engines())
    emit(as_json, doc, _print_ps)


def ps_parser(verbs: Verbs) -> None:
    json_flag(verbs.add("ps", ps))


def load(
    ctx: Ctx,
    *,
    model_id: str,
    main: str | None,
    vision: str | None,
    keep_alive: str | None,
    pin: bool,
    allow_unverified: bool,
    warm_up: bool | None,
    as_json: bool,
) -> None:
    """Load MODEL_ID's engine now (instead of on the first request)."""
    view = call(
        ctx,
        lambda c: c.load(
            model_id,
            main=main,
            vision=vision,
            keep_alive=keep_alive,
            pin=pin,
            allow_unverified=allow_unverified,
            warm_up=warm_up,
        ),
    )
    emit(as_json, view, _print_loaded)


def load_parser(verbs: Verbs) -> None:
    p = verbs.add("load", load)
    completes(p.add_argument("model_id", metavar="MODEL_ID"), complete_model)
    p.add_argument("--main", choices=_BACKENDS, help="Backend for the text decoder.")
    p.add_argument(
        "--vision", choices=_BACKENDS, help="Also load the vision encoder on this backend."
    )
    p.add_argument(
        "--keep-alive",
        type=keep_alive_arg,
        help="Idle time before it stops: 30s, 5m, 0, -1 (never).",
    )
    p.add_argument("--pin", action="store_true", help="Never evict it for memory.")
    p.add_argument(
        "--allow-unverified", action="store_true", help="Load a file no hash vouched for."
    )
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Run one short generation at load (default: for gpu plans and --pin).",
    )
    json_flag(p)


def _print_loaded(v: dict[str, Any]) -> None:
    warm = v.get("warm_up_seconds")
    parts = [f"engine {format_duration(v.get('create_seconds') or 0)}"]
    if warm is not None:
        parts.append(f"warm-up {format_duration(warm)}")
    if v.get("cpu_threads"):
        n = v["cpu_threads"]
        parts.append(f"{n} CPU thread{'' if n == 1 else 's'}")
    console.print(
        f"loaded {v['id']} ({v['plan']['key']}) in {format_duration(v['load_seconds'] or 0)} "
        f"({', '.join(parts)}), PSS {_size(v['pss'])}"
    )
    probe = v.get("image_probe")
    if probe is not None and not probe["ok"]:
        err_console.print(
            f"[yellow]! images will be refused with this plan: its image probe failed at "
            f"{probe['stage'] or '?'}: {escape(str(probe['reason']))}[/]"
        )


def unload(
    ctx: Ctx, engine_or_model: str, grace: str | None, forget_memory: bool, as_json: bool
) -> None:
    """Stop an engine (or every engine of a model) after its in-flight requests."""

    def go(c: Client) -> dict[str, Any]:
        if not forget_memory:
            return c.unload(engine_or_model, grace)
        forgot = c.forget_memory(engine_or_model.split(":", 1)[0])
        try:
            unloaded = c.unload(engine_or_model, grace)["unloaded"]
        except EngineNotFound:
            unloaded = []
        return {"unloaded": unloaded, "memory": forgot}

    def human(d: dict[str, Any]) -> None:
        if d["unloaded"]:
            console.print("unloaded " + ", ".join(e["id"] for e in d["unloaded"]))
        if "memory" in d:
            console.print(
                f"forgot {d['memory']['forgot']} learned peak(s) of {d['memory']['id']}; "
                "its next load reserves the estimate from the file"
            )

    emit(as_json, call(ctx, go), human)


def unload_parser(verbs: Verbs) -> None:
    p = verbs.add("unload", unload)
    completes(p.add_argument("engine_or_model", metavar="ENGINE_OR_MODEL"), complete_loaded)
    p.add_argument(
        "--grace",
        metavar="D",
        help="How long the requests the engine has admitted may take to end (default 10s); "
        "what has not ended then is refused (503). 0 refuses it at once.",
    )
    p.add_argument(
        "--forget-memory",
        action="store_true",
        help="Also forget the memory learned for the model's file (admin); its next load "
        "reserves the estimate from the file again.",
    )
    json_flag(p)
