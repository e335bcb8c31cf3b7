"""``bug-report ID [--output PATH]``: one Markdown file for an upstream issue."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from modeld.cli.common import (
    Ctx,
    Verbs,
    call,
    complete_model,
    completes,
    console,
    emit,
    json_flag,
)
from modeld.config import format_size
from modeld.errors import ModeldError
from modeld.logs import redact_url

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any


def _fence(text: str, lang: str = "") -> str:
    """``text`` in a code fence longer than any backtick run inside it."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def _cell(value: Any) -> str:
    text = "-" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in rows)]


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _plan_line(name: str, p: dict[str, Any]) -> str:
    if p.get("plan") is None:
        err = p.get("error") or {}
        return f"- {name}: none ({err.get('code')}: {err.get('message')})"
    plan = p["plan"]
    extra = " (fell back to cpu: the GPU probe failed)" if plan.get("fell_back") else ""
    if p.get("needs_probe"):
        extra += f" (not probed yet: {', '.join(p['needs_probe'])})"
    return f"- {name}: {plan['key']}{extra}"


def render(doc: dict[str, Any]) -> str:
    """The report as Markdown: tables of facts, then the logs in code fences."""
    host, runtime, model = doc["host"], doc["runtime"], doc["model"]
    gpu_probe = runtime.get("gpu_probe") or {}
    why = (gpu_probe.get("reason") or "probe failed").split(" | ", 1)[0]
    adapter = runtime.get("adapter") or (f"none ({why})" if gpu_probe else "not probed yet")
    out = [
        f"# modeld bug report: {model['id']}",
        "",
        f"Written {_when(doc['generated_at'])} by modeld {doc['modeld_version']}. It names "
        "this host and its paths (no token or key): read it before you post it.",
        "",
        "## Host and runtime",
        "",
        *_table(
            [
                ("host", host["hostname"]),
                ("OS", host["os"]),
                ("kernel", host["kernel"]),
                ("machine", f"{host['machine']}, {host['cpus']} CPUs"),
                ("Python", f"{host['python']} ({host['python_executable']})"),
                ("runtime", f"{runtime['package']} {runtime['version'] or '(not installed)'}"),
                ("GPU adapter", adapter),
                (
                    "backends",
                    f"main={doc['settings']['main_backend']} "
                    f"vision={doc['settings']['vision_backend']}",
                ),
            ]
        ),
        "",
        "## Model",
        "",
        *_table(
            [
                ("id", model["id"]),
                ("state", model["state"]),
                ("file", model["file_name"]),
                ("revision", model["revision"]),
                ("size", f"{model['size']} bytes" if model["size"] is not None else None),
                ("sha256", model["digest"]),
                ("verified by", model["verified_by"] or "nobody (unverified)"),
                ("registry", model["registry"]),
            ]
        ),
        "",
    ]
    if model["entry"]:
        entry = dict(model["entry"])
        if isinstance(entry.get("urls"), list):
            entry["urls"] = [redact_url(str(u)) for u in entry["urls"]]
        out += ["Registry entry:", "", _fence(json.dumps(entry, indent=2), "json"), ""]
    out += ["## Plans", ""]
    out += [_plan_line(name, p) for name, p in (doc["plans"] or {}).items()]
    header = doc.get("header")
    if header:
        out += ["", "Sections:", ""]
        for s in header["sections"]:
            kind = s["model_type"] or s["data_type"]
            constraint = ",".join(s["backend_constraint"] or []) or "-"
            out.append(f"- {s['index']}: {kind}, {format_size(s['size'])}, backends {constraint}")
    out += ["", "## Probes", ""]
    if not doc["probes"]:
        out.append("No probe has run for this file.")
    for backend, p in doc["probes"].items():
        result = "ok" if p["ok"] else f"failed: {p['reason']}"
        stale = "" if p["current"] else " (stale: an older probe or runtime; probed again)"
        out += [
            f"### {backend}: {result}{stale}",
            "",
            *_table(
                [
                    ("at", _when(p["at"])),
                    ("runtime", p["runtime"]),
                    ("adapter", p["adapter"]),
                ]
            ),
            "",
        ]
        if p.get("log"):
            out += ["Probe child's stderr:", "", _fence(p["log"]), ""]
    out += ["## Last runner", ""]
    runner = doc.get("runner")
    if runner is None:
        out.append("No runner has run this model since the daemon started.")
    else:
        state = "alive" if runner["alive"] else (runner["exit"] or "exited")
        out += [
            *_table(
                [
                    ("engine", runner["engine"]),
                    ("pid", runner["pid"]),
                    ("started", _when(runner["since"])),
                    ("state", state),
                ]
            ),
            "",
            "Its stderr:",
            "",
            _fence(runner["stderr"] or "(empty)"),
        ]
    for title, events in (
        ("Events of this model", doc["events"]),
        ("Recent events", doc["recent_events"]),
    ):
        out += ["", f"## {title}", ""]
        if not events:
            out.append("None.")
            continue
        out += ["| time | event | fields |", "|---|---|---|"]
        out += [
            f"| {_when(e['at'])} | {e['kind']} | {_cell(json.dumps(e['fields'], sort_keys=True))} |"
            for e in events
        ]
    out += ["", "## Settings", "", _fence(json.dumps(doc["settings"], indent=2), "json"), ""]
    return "\n".join(out)


def default_name(model_id: str, at: float) -> str:
    return f"modeld-bug-report-{model_id}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(at))}.md"


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a file beside it, then a rename. A path
    that cannot be written is one line saying to choose another (no traceback, no half file)."""
    if path.is_dir():
        raise ModeldError(
            f"cannot write the bug report to {path}: it is a directory; give a file name "
            "with --output"
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as f:
            f.write(text)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ModeldError(
            f"cannot write the bug report to {path} ({e.strerror or e}); choose a file you "
            "may write with --output"
        ) from None


def bug_report(ctx: Ctx, model_id: str, output: Path | None, as_json: bool) -> None:
    """Write one file with what an upstream issue about ID needs, and print its path.

    Host, OS, runtime version, GPU adapter, the entry and its revision, size, digest, what
    verified it, plans, probes, the last runner's whole stderr, and recent events.
    """
    doc = call(ctx, lambda c: c.bug_report(model_id))
    path = output or Path.cwd() / default_name(model_id, doc["generated_at"])
    text = render(doc)
    write_whole(path, text)
    result = {"path": str(path.resolve()), "size": len(text.encode())}
    emit(as_json, result, lambda r: console.print(r["path"], soft_wrap=True, highlight=False))


def bug_report_parser(verbs: Verbs) -> None:
    p = verbs.add("bug-report", bug_report)
    completes(p.add_argument("model_id", metavar="ID"), complete_model)
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        help="File to write (default: modeld-bug-report-ID-TIME.md in the current directory).",
    )
    json_flag(p)
