"""``list``, ``show`` and ``verify``."""

from __future__ import annotations

import time

from modeld.cli.common import (
    Ctx,
    Verbs,
    call,
    complete_installed,
    complete_model,
    completes,
    console,
    emit,
    err_console,
    escape,
    json_flag,
    table,
)
from modeld.cli.engines import continued_of
from modeld.config import format_duration, format_size
from modeld.errors import IntegrityError

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any

_STATE_STYLE = {
    "installed": "green",
    "outdated": "yellow",
    "missing": "red",
    "not_installed": "dim",
}


def _state(m: dict[str, Any]) -> str:
    label = m["state"].replace("_", " ")
    return f"[{_STATE_STYLE.get(m['state'], '')}]{label}[/]"


def _verified(inst: dict[str, Any] | None) -> str:
    if inst is None:
        return "-"
    return inst["verified_by"] if inst["verified"] else "[yellow]UNVERIFIED[/]"


def _ago(t: float | None) -> str:
    return "never" if t is None else f"{format_duration(time.time() - t)} ago"


def _print_list(doc: dict[str, Any]) -> None:
    t = table("ID", "SIZE", "STATE", "FITS", "VERIFIED", "LAST USED")
    for m in doc["models"]:
        inst = m["installed"]
        size = inst["size"] if inst else m["size"]
        t.add_row(
            m["id"] + ("" if m["in_catalog"] else " [dim](not in catalog)[/]"),
            format_size(size) if size is not None else "-",
            _state(m),
            _fits(m.get("fit")),
            _verified(inst),
            _ago(inst["last_used"]) if inst else "-",
        )
    if doc["models"]:
        console.print(t)
    else:
        console.print("no models")
    for p in doc["problems"]:
        err_console.print(f"[yellow]! registry: {escape(p)}[/]")


def _fits(fit: dict[str, Any] | None) -> str:
    """Whether the model's memory estimate is within the budget (the figures: --json, show)."""
    if fit is None:
        return "-"
    return "yes" if fit["fits"] else "[red]no[/]"


def list_(ctx: Ctx, installed: bool, as_json: bool) -> None:
    """List the catalog's models with their install state."""
    doc = call(ctx, lambda c: c.models(installed=installed))
    emit(as_json, doc, _print_list)


def list_parser(verbs: Verbs) -> None:
    p = verbs.add("list", list_)
    p.add_argument("--installed", action="store_true", help="Only installed models.")
    json_flag(p)


def _print_plan(name: str, p: dict[str, Any]) -> None:
    if p["plan"] is not None:
        plan = p["plan"]
        text = f"main={plan['main']} vision={plan['vision'] or 'none'}"
        if plan["fell_back"]:
            text += " [yellow](fell back to cpu: the GPU probe failed)[/]"
        if p.get("needs_probe"):
            text += f" [dim](not probed yet: {', '.join(p['needs_probe'])})[/]"
        if "image_probe" in p:
            img = p["image_probe"]
            if img is None:
                text += " [dim](not probed with an image yet)[/]"
            elif not img["ok"]:
                text += " [red](images refused: its image probe failed)[/]"
        console.print(f"    {name:<8} {text}")
    else:
        console.print(f"    {name:<8} [red]none[/]: {escape(p['error']['message'])}")


def _print_probe(backend: str, p: dict[str, Any]) -> None:
    result = "ok" if p["ok"] else f"[red]failed[/]: {escape(str(p['reason']))}"
    if p["adapter"]:
        result += f", adapter {escape(p['adapter'])}"
    when = f"{_ago(p['at'])}, {p['runtime'] or 'unknown runtime'}"
    stale = "" if p["current"] else " [yellow]stale: probed again at the next load[/]"
    console.print(f"    {backend:<4} {result} ({when}){stale}")


def _print_entry(m: dict[str, Any]) -> None:
    entry = m["entry"]
    if not entry:
        console.print("  [yellow]not in the catalog[/]")
        return
    console.print(f"  file      {escape(str(entry['file_name']))} ({format_size(entry['size'])})")
    console.print(f"  sha256    {escape(str(entry['sha256'] or '(none: the server vouches)'))}")
    for url in entry["urls"]:
        console.print(f"  url       {escape(url)}", overflow="ignore", crop=False)
    limits = {k: v for k, v in entry["limits"].items() if v is not None}
    if limits:
        console.print("  limits    " + escape(" ".join(f"{k}={v}" for k, v in limits.items())))
    if entry.get("min_runtime_version"):
        console.print(f"  needs     litert-lm >= {escape(str(entry['min_runtime_version']))}")
    console.print(f"  registry  {escape(str(m['source']))}")
    if entry.get("variants"):
        console.print(f"  variants  {escape(', '.join(map(str, entry['variants'])))}")


def _print_show(m: dict[str, Any]) -> None:
    console.print(f"[bold]{escape(str(m['id']))}[/] {escape(m['display_name'])}  {_state(m)}")
    _print_entry(m)
    inst = m["installed"]
    if inst:
        console.print(f"  installed {escape(inst['path'])} ({format_size(inst['size'])})")
        console.print(f"  digest    sha256:{escape(str(inst['digest']))}")
        console.print(f"  verified  {_verified(inst)}")
        console.print(f"  last used {_ago(inst['last_used'])}")
        if inst["outdated"]:
            console.print(
                "  [yellow]outdated: the catalog now names another file; "
                f"`modeld pull {m['id']}` fetches it[/]"
            )
    header = m["header"]
    if header:
        llm = header["llm_metadata"] or {}
        console.print(
            escape(
                f"  format    LiteRT-LM {header['version']}, model type "
                f"{llm.get('model_type') or '?'}, max tokens {llm.get('max_num_tokens') or '?'}"
            )
        )
        console.print("  sections")
        for s in header["sections"]:
            kind = s["model_type"] or s["data_type"]
            constraint = s["backend_constraint"]
            where = f" backends={','.join(constraint)}" if constraint else ""
            line = f"    {s['index']:>2} {kind:<28} {format_size(s['size']):>10}{where}"
            console.print(escape(line))
    elif m["header_error"]:
        console.print(f"  [red]header: {escape(m['header_error']['message'])}[/]")
    fit = m.get("fit")
    if fit:
        verdict = "fits" if fit["fits"] else "[red]does not fit[/]"
        console.print(
            f"  memory    needs about {format_size(fit['needs'])} (from its {fit['source']}, "
            f"{fit['max_tokens']} tokens): {verdict} the budget {format_size(fit['budget'])}"
        )
    es = m.get("engine_settings")
    if es:
        loaded = "".join(
            f"; {engine} runs {n or 'the runtime default'} thread{'' if n == 1 else 's'}"
            for engine, n in es["loaded_cpu_threads"].items()
        )
        n = es["cpu_threads"]
        source = es["cpu_threads_from"]
        why = "the default: one per physical core" if source == "default" else f"from {source}"
        console.print(
            f"  engines   {n} CPU thread{'' if n == 1 else 's'} ({why}), "
            f"warm-up: {es['warm_up']}{loaded}"
        )
        console.print(
            f"  turns     a text engine keeps {es['kept_conversations']} conversation(s) for "
            "their next turn"
            + "".join(
                f"; {engine} continued {continued_of(turns)}"
                for engine, turns in es["loaded_conversations"].items()
            ),
            highlight=False,
        )
    runtime = m["runtime"]
    console.print(
        f"  runtime   {runtime['package']} {runtime['version'] or '(not installed)'}, "
        f"GPU adapter {escape(runtime['adapter'] or 'none')}"
    )
    console.print("  plans")
    for name, p in m["plans"].items():
        _print_plan(name, p)
    _print_probes(m)


def _print_probes(m: dict[str, Any]) -> None:
    if m["probes"]:
        console.print("  probes")
        for backend, p in m["probes"].items():
            _print_probe(backend, p)
    if m.get("image_probes"):
        console.print("  image probes")
        for key, p in m["image_probes"].items():
            if p["ok"]:
                result = "ok"
            else:
                result = f"[red]failed[/] at {p['stage'] or '?'}: {escape(str(p['reason']))}"
            console.print(f"    {key} {result} ({_ago(p['at'])})")


def show(ctx: Ctx, model_id: str, as_json: bool) -> None:
    """Show one model: entry, install state, sections, backend plans, probe results."""
    doc = call(ctx, lambda c: c.show(model_id))
    emit(as_json, doc, _print_show)


def show_parser(verbs: Verbs) -> None:
    p = verbs.add("show", show)
    completes(p.add_argument("model_id", metavar="ID"), complete_model)
    json_flag(p)


def _print_verify(doc: dict[str, Any]) -> None:
    if doc["ok"]:
        extra = f"; verified by {doc['verified_by']}" if doc["verified_by"] else "; UNVERIFIED"
        console.print(
            f"[green]ok[/] {doc['id']}: sha256 {doc['actual_digest']} "
            f"({format_size(doc['actual_size'])}, {doc['seconds']:.1f} s){extra}"
        )
        if doc["outdated"]:
            console.print(
                f"[yellow]outdated: the catalog now names another file; "
                f"`modeld pull {doc['id']}` fetches it[/]"
            )
        elif doc.get("hint"):
            console.print(f"[yellow]to make it verified: {escape(doc['hint'])}[/]")


def verify(ctx: Ctx, model_id: str, as_json: bool) -> None:
    """Re-hash an installed model's file; a mismatching file is quarantined (exit 1)."""
    doc = call(ctx, lambda c: c.verify(model_id))
    emit(as_json, doc, _print_verify)
    if not doc["ok"]:
        raise IntegrityError(doc["message"])


def verify_parser(verbs: Verbs) -> None:
    p = verbs.add("verify", verify)
    completes(p.add_argument("model_id", metavar="ID"), complete_installed)
    json_flag(p)
