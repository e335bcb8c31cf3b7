"""``ps``, ``load``, ``unload`` and ``run``."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click
from rich.markup import escape

from modeld.cli.common import call, console, emit, err_console, json_option, table
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
    doc = call(ctx, lambda c: c.request("GET", "/api/engines"))
    emit(as_json, doc, _print_ps)


@click.command()
@click.argument("model_id")
@click.option("--main", type=_BACKEND, help="Backend for the text decoder.")
@click.option("--vision", type=_BACKEND, help="Also load the vision encoder on this backend.")
@click.option("--keep-alive", help="Idle time before it stops: 30s, 5m, 0, -1 (never).")
@click.option("--pin", is_flag=True, help="Never evict it for memory.")
@click.option(
    "--warm-up/--no-warm-up",
    default=None,
    help="Run one short generation at load (default: for gpu plans and --pin).",
)
@click.option("--allow-unverified", is_flag=True, help="Load a file no hash vouched for.")
@json_option
@click.pass_context
def load(  # noqa: PLR0917 (click passes every option positionally by name)
    ctx: click.Context,
    model_id: str,
    main: str | None,
    vision: str | None,
    keep_alive: str | None,
    pin: bool,
    warm_up: bool | None,
    allow_unverified: bool,
    as_json: bool,
) -> None:
    """Load MODEL_ID's engine now (instead of on the first request)."""
    body: dict[str, Any] = {"model": model_id, "pin": pin, "allow_unverified": allow_unverified}
    if warm_up is not None:
        body["warm_up"] = warm_up
    backends = {k: v for k, v in (("main", main), ("vision", vision)) if v}
    if backends:
        body["backends"] = backends
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    view = call(ctx, lambda c: c.request("POST", "/api/engines", body))
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
@click.argument("engine_or_model")
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
    quoted = quote(engine_or_model, safe="")

    async def go(c: Client) -> dict[str, Any]:
        if not forget_memory:
            doc: dict[str, Any] = await c.request("DELETE", f"/api/engines/{quoted}")
            return doc
        model = engine_or_model.split(":", 1)[0]
        forgot = await c.request("DELETE", f"/api/models/{quote(model, safe='')}/memory")
        try:
            unloaded = (await c.request("DELETE", f"/api/engines/{quoted}"))["unloaded"]
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


def _timings_line(final: dict[str, Any]) -> str:
    t = final.get("timings") or {}
    parts = []
    if t.get("image_prepare"):
        parts.append(f"image_prepare {t['image_prepare'] * 1000:.1f} ms")
    for key in ("load", "queue", "prefill", "first_token", "total"):
        if t.get(key) is not None:
            parts.append(f"{key} {t[key] * 1000:.1f} ms")
    if t.get("decode_tokens_per_second"):
        parts.append(f"decode {t['decode_tokens_per_second']:.1f} tok/s")
    return f"[{final.get('tokens')} tokens, {final.get('finish')}] " + ", ".join(parts)


@click.command()
@click.argument("model_id")
@click.argument("prompt")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["json"]), help="Ask for a JSON answer.")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Cap the reply's length.")
@click.option("--keep-alive", help="Idle time before the engine stops: 30s, 5m, 0, -1.")
@click.option("--allow-unverified", is_flag=True, help="Use a file no hash vouched for.")
@json_option
@click.pass_context
def run(  # noqa: PLR0917 (click passes every option positionally by name)
    ctx: click.Context,
    model_id: str,
    prompt: str,
    images: tuple[str, ...],
    fmt: str | None,
    max_tokens: int | None,
    keep_alive: str | None,
    allow_unverified: bool,
    as_json: bool,
) -> None:
    """Generate a reply: tokens stream to stdout, phase timings go to stderr."""
    body: dict[str, Any] = {"model": model_id, "prompt": prompt}
    if images:
        # The CLI reads the files itself and sends their bytes (the CLI's contract).
        body["images"] = [base64.b64encode(Path(p).read_bytes()).decode() for p in images]
    for key, value in (
        ("format", fmt),
        ("max_tokens", max_tokens),
        ("keep_alive", keep_alive),
    ):
        if value is not None:
            body[key] = value
    if allow_unverified:
        body["allow_unverified"] = True

    async def go(client: Client) -> dict[str, Any]:
        text: list[str] = []
        final: dict[str, Any] = {}
        async for rec in client.stream("POST", "/api/generate", body):
            if "token" in rec:
                text.append(rec["token"])
                if not as_json:
                    sys.stdout.write(rec["token"])
                    sys.stdout.flush()
            elif rec.get("done"):
                final = rec
        return {"text": "".join(text), **final}

    result = call(ctx, go)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
        return
    sys.stdout.write("\n")
    if "json" in result:
        err_console.print(f"json: {result['json']['status']}")
    err_console.print(_timings_line(result))
