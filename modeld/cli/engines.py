"""``ps``, ``load`` and ``unload`` (alias ``stop``)."""

from __future__ import annotations

from typing import Any

import click

from modeld.cli.common import (
    call,
    complete_loaded,
    complete_model,
    console,
    emit,
    err_console,
    escape,
    json_option,
    table,
)
from modeld.client import Client
from modeld.config import format_duration, format_size
from modeld.errors import EngineNotFound

_BACKEND = click.Choice(["cpu", "gpu"])


def _size(n: int | None) -> str:
    return format_size(n) if n else "-"


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
                e["last_eviction"] or "-",
            )
        console.print(t)
        for e in engines:
            if e["adapter"]:
                console.print(f"{e['id']}: GPU adapter {e['adapter']}", highlight=False)
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


@click.command()
@json_option
@click.pass_context
def ps(ctx: click.Context, as_json: bool) -> None:
    """List loaded engines: plan, state, memory, idle time, expiry, requests served."""
    doc = call(ctx, lambda c: c.engines())
    emit(as_json, doc, _print_ps)


@click.command()
@click.argument("model_id", shell_complete=complete_model)
@click.option("--main", type=_BACKEND, help="Backend for the text decoder.")
@click.option("--vision", type=_BACKEND, help="Also load the vision encoder on this backend.")
@click.option("--keep-alive", help="Idle time before it stops: 30s, 5m, 0, -1 (never).")
@click.option("--pin", is_flag=True, help="Never evict it for memory.")
@click.option("--allow-unverified", is_flag=True, help="Load a file no hash vouched for.")
@click.option(
    "--warm-up/--no-warm-up",
    default=None,
    help="Run one short generation at load (default: for gpu plans and --pin).",
)
@json_option
@click.pass_context
def load(  # noqa: PLR0917 (click passes every option positionally by name)
    ctx: click.Context,
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


@click.command()
@click.argument("engine_or_model", shell_complete=complete_loaded)
@click.option(
    "--forget-memory",
    is_flag=True,
    help="Also forget the memory learned for the model's file (admin); its next load "
    "reserves the estimate from the file again.",
)
@json_option
@click.pass_context
def unload(ctx: click.Context, engine_or_model: str, forget_memory: bool, as_json: bool) -> None:
    """Stop an engine (or every engine of a model) after its in-flight requests."""

    def go(c: Client) -> dict[str, Any]:
        if not forget_memory:
            return c.unload(engine_or_model)
        forgot = c.forget_memory(engine_or_model.split(":", 1)[0])
        try:
            unloaded = c.unload(engine_or_model)["unloaded"]
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
