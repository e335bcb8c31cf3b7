"""The attack suite: each class of attack found on the daemon, replayed against one real daemon.

One ``modeld serve`` (root, the real runtime, tiny fixtures installed) is attacked by a
second uid through ``setpriv`` (``tests/support/hostile.py``), by hostile mirrors and by
hostile files. A watcher process (``tests/support/watcher.py``) polls it throughout. After
each attack, and over its whole course:

- ``/api/health`` answered every poll, each within ``HEALTH_BOUND`` (1 s);
- every attacker request got an answer, and no 5xx but a bound's own (503 ``busy`` with
  ``Retry-After``, 507 ``disk_full``);
- nothing was written outside ``MODELD_HOME``: the daemon held no file open for writing
  elsewhere, and the dirs an attacker can see (its own home, the daemon's ``TMPDIR`` and
  ``HOME``, the socket's dir, ``/tmp``) hold nothing new of the daemon's;
- the daemon's peak RSS (``VmHWM``) stayed under ``RSS_BOUND``;
- every blob still hashes to its name.

The daemon runs with smaller bounds than the defaults, so that the suite stays quick and
the RSS bound means something: bodies of 8 MiB, 32 MiB of bodies at once, 64 connections.
``pytest -m attack`` runs it (see docs/development.md).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import io
import json
import os
import re
import resource
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from modeld.daemon.apikeys import KeysFile
from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, daemon_env, serve_to_exit
from tests.support.faults import runner_pids
from tests.support.hub import hub
from tests.support.mirror import COMMIT, Faults, LoopThread, Mirror, SlowHeadMirror, pinned_path
from tests.support.peer import PEER_GID, PEER_UID, as_peer, needs_root, peer_cli
from tests.support.state import MODELS, REPO, install_fixture, write_entry
from tests.support.unix import unix_request
from tests.support.wait import wait_sync

pytestmark = [pytest.mark.attack, needs_root]

MiB = 1024 * 1024
# What the issue demands of /api/health during and after every attack.
HEALTH_BOUND = 1.0
# The daemon's peak resident set over the whole suite. Idle it is ~70 MiB; the bodies at
# once take it to ~170 MiB (32 MiB of bodies and their parse).
RSS_BOUND = 300 * MiB
MAX_BODY, BODY_MEMORY, MAX_CONNECTIONS = 8 * MiB, 32 * MiB, 64
# The idle connections of the flood: the issue's 20,000, or what the descriptor limit
# leaves the attacker's process.
FLOOD = min(20_000, resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 100)
# A uid in the socket's group that the allow-list refuses: it can connect, not talk.
OUTSIDER_UID = 4243
TOKEN = "hf_attack_secret"
NETRC_SECRET = "netrc-attack-secret"
TINY = MODELS / "tiny-text.litertlm"
OTHER = MODELS / "tiny-text-b.litertlm"  # another real model of the same size
PULLED = OTHER.read_bytes()  # what the mirrors serve
HUGE = 2 * shutil.disk_usage("/tmp").free
# MODELD_REQUEST_TIMEOUT of the attacked daemon: a request of a peer holds a model no longer.
REQUEST_TIMEOUT = 10.0


@dataclass
class Arena:
    """The attacked daemon, the mirrors it pulls from, and what the attacks saw."""

    root: Path
    daemon: DaemonProcess
    peer_home: Path
    bodies: Path
    tmpdir: Path
    daemon_home: Path
    watch_log: Path
    loop: LoopThread
    mirrors: dict[str, Mirror]
    urls: dict[str, str]
    # (attack, status, body[, Retry-After]) of every answer an attacker got.
    answers: list[tuple[Any, ...]] = field(default_factory=list)
    watched_from: int = 0
    # The TCP listener and a key of the lowest role (``use``) on it.
    tcp_port: int = 0
    use_key: str = ""

    @property
    def sock(self) -> Path:
        return self.daemon.socket

    @property
    def pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid

    def body(self, name: str, data: bytes) -> str:
        """Write a body file the attacker can read; its path."""
        path = self.bodies / name
        path.write_bytes(data)
        path.chmod(0o644)
        return str(path)

    def hostile_argv(self, attack: str, arg: Any, uid: int = PEER_UID) -> list[str]:
        """``tests/support/hostile.py ATTACK`` as ``uid``."""
        hostile = [sys.executable, "-m", "tests.support.hostile", attack, str(self.sock)]
        return [*_as(uid, *hostile), json.dumps(arg)]

    def hostile(self, attack: str, arg: Any, uid: int = PEER_UID) -> Any:
        """Run one attack as ``uid``; what it printed (its answers are recorded)."""
        done = subprocess.run(
            self.hostile_argv(attack, arg, uid),
            cwd=REPO,
            env=self.daemon.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.splitlines()[-1])
        for answer in out if attack in ("send", "together") else [out]:
            self.answers.append((attack, *answer))
        return out

    @contextlib.contextmanager
    def holding(self, attack: str, arg: Any, uid: int = PEER_UID) -> Iterator[HeldAttack]:
        """An attack that goes on (``flood``, ``swap``) until the block ends."""
        with subprocess.Popen(
            self.hostile_argv(attack, arg, uid),
            cwd=REPO,
            env=self.daemon.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None and proc.stdin is not None
            held = HeldAttack(json.loads(proc.stdout.readline()))
            try:
                yield held
                proc.stdin.close()
                held.result = json.loads(proc.stdout.read().splitlines()[-1])
            finally:
                proc.kill()

    def send(self, *requests: tuple[str, str, str | None]) -> list[tuple[int, Any]]:
        """Send ``requests`` one after the other as the peer: ``(status, body)`` each."""
        return [(s, b) for s, b, _ in self.hostile("send", [list(r) for r in requests])]

    def tcp(
        self, method: str, target: str, body: Any = None, timeout: float = 120.0
    ) -> tuple[int, Any]:
        """One request over TCP with the ``use`` key: ``(status, decoded body)`` (NDJSON and
        SSE as a list of their records); recorded as an attacker's answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.tcp_port, timeout=timeout)
        try:
            headers = {"Authorization": f"Bearer {self.use_key}"}
            payload = None if body is None else json.dumps(body)
            if payload is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, target, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read().decode(errors="replace")
        finally:
            conn.close()
        kind = resp.getheader("Content-Type") or ""
        decoded: Any = raw
        if "ndjson" in kind:
            decoded = [json.loads(line) for line in raw.splitlines() if line.strip()]
        elif "event-stream" in kind:
            lines = [x.removeprefix("data: ") for x in raw.split("\n\n") if x.strip()]
            decoded = [json.loads(x) for x in lines if x != "[DONE]"]
        elif raw:
            decoded = json.loads(raw)
        self.answers.append(("tcp", resp.status, decoded))
        return resp.status, decoded

    def samples(self) -> list[dict[str, Any]]:
        lines = self.watch_log.read_text().splitlines()
        return [json.loads(line) for line in lines[self.watched_from :] if line.endswith("}")]


@dataclass
class HeldAttack:
    started: Any  # what the attack printed once under way
    result: Any = None  # what it printed once stopped


def _as(uid: int, *argv: str) -> list[str]:
    if uid == PEER_UID:
        return as_peer(*argv)
    return ["setpriv", f"--reuid={uid}", f"--regid={PEER_GID}", "--clear-groups", *argv]


def _hf_like(path: str) -> str:
    return f"http://93.184.216.34{path}"


@pytest.fixture(scope="module")
def arena() -> Iterator[Arena]:
    root = Path(tempfile.mkdtemp(prefix="md-atk-", dir="/tmp"))
    root.chmod(0o755)
    home, registry, run = root / "home", root / "registry", root / "run"
    peer_home, bodies, tmpdir, daemon_home = (
        root / "peer",
        root / "bodies",
        root / "tmp",
        root / "daemon-home",
    )
    for made, mode in ((run, 0o755), (peer_home, 0o700), (bodies, 0o755), (tmpdir, 0o700)):
        made.mkdir(mode=mode)
    daemon_home.mkdir(mode=0o700)
    os.chown(peer_home, PEER_UID, PEER_GID)
    # netrc credentials for every host a mirror uses: none may ever be sent.
    netrc = daemon_home / ".netrc"
    netrc.write_text(
        "".join(
            f"machine {host} login attacked password {NETRC_SECRET}\n"
            for host in ("localhost", "127.0.0.1", "93.184.216.34", "huggingface.co")
        )
    )
    netrc.chmod(0o600)

    install_fixture(home, "tiny-text", TINY, registry=registry)
    install_fixture(home, "tiny-vision", MODELS / "tiny-vision.litertlm", registry=registry)
    install_fixture(home, "tiny-embed", MODELS / "tiny-embed.litertlm", registry=registry)
    keys = KeysFile(home / "api-keys")
    _, use_key = keys.add("attacker")
    # Verified by a hub once; its entry has no sha256, so only the install says what it is.
    install_fixture(home, "vouched", TINY, verified_by="huggingface.co X-Linked-Etag")
    write_entry(registry, "vouched", size=TINY.stat().st_size)
    write_entry(registry, "absent", size=1000)
    write_entry(registry, "loose", size=TINY.stat().st_size)
    write_entry(registry, "huge", size=HUGE)

    loop = LoopThread()
    sha = hashlib.sha256(PULLED).hexdigest()
    the_hub = loop.run(hub(PULLED))
    mirrors: dict[str, Mirror] = {
        # The issue's hostile mirror: a second mirror redirecting through a hub host that
        # vouches for another digest than the primary hub does.
        "hub": the_hub,
        "good": loop.run(Mirror(PULLED, Faults()).start()),
        # Every non-loopback URL goes through this proxy: public-looking mirror addresses
        # that redirect wherever a test says, and no request ever leaves the host.
        "proxy": loop.run(Mirror(PULLED, Faults(), path=pinned_path()).start()),
    }
    # The hub (HF_ENDPOINT's host and port) vouches for another digest in another repository.
    the_hub.add("org/lying", COMMIT, {"m.litertlm": PULLED})
    the_hub.repos["org/lying"].linked_sha256 = "0" * 64
    lying = f"{the_hub.endpoint}{pinned_path(repo='org/lying')}"
    mirrors["liar"] = loop.run(Mirror(PULLED, Faults(redirect_to=lying)).start())
    # One more header line every 0.2 s, for as long as it is asked.
    trickler = loop.run(SlowHeadMirror(PULLED, interval=0.2).start())
    urls = {"trickler": trickler.url}
    write_entry(
        registry, "conflict", size=len(PULLED), urls=[mirrors["hub"].url, mirrors["liar"].url]
    )
    write_entry(
        registry,
        "slowprobe",
        size=len(PULLED),
        sha256=sha,
        urls=[urls["trickler"], mirrors["good"].url],
    )
    write_entry(
        registry, "redirected", size=len(PULLED), sha256=sha, urls=[_hf_like(pinned_path())]
    )
    write_entry(
        registry,
        "hubhttp",
        size=len(PULLED),
        urls=[f"http://93.184.216.35{pinned_path()}"],
    )

    env = daemon_env(
        home,
        MODELD_SOCKET=str(run / "modeld.sock"),
        MODELD_REGISTRY=str(registry),
        MODELD_ADMIN_UIDS=f"0,{PEER_UID}",
        MODELD_ALLOW_UIDS=f"0,{PEER_UID}",
        MODELD_MAX_BODY=str(MAX_BODY),
        MODELD_BODY_MEMORY=str(BODY_MEMORY),
        MODELD_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        MODELD_HEADER_TIMEOUT="2s",
        MODELD_MEMORY_BUDGET="2GiB",
        MODELD_HF_TOKEN=TOKEN,
        MODELD_LOG_LEVEL="info",
        MODELD_PIECE_SIZE="64KiB",
        MODELD_DOWNLOAD_CONNECTIONS="4",
        MODELD_STALL_TIMEOUT="2s",
        HOME=str(daemon_home),
        TMPDIR=str(tmpdir),
        HTTP_PROXY=f"http://127.0.0.1:{mirrors['proxy'].port}",
        # The loopback hubs are hub hosts (token, X-Linked-Etag), as huggingface.co is.
        HF_ENDPOINT=f"http://localhost:{mirrors['hub'].port}",
        MODELD_LISTEN="127.0.0.1:0",
        MODELD_REQUEST_TIMEOUT=f"{REQUEST_TIMEOUT:g}s",
    )
    d = DaemonProcess(home=home, env=env)
    watch_log = root / "watch.jsonl"
    watcher: subprocess.Popen[bytes] | None = None
    try:
        d.start_quick()
        os.chown(d.socket, 0, PEER_GID)  # as SocketGroup= would
        assert d.proc is not None
        watch = [str(d.socket), str(d.proc.pid), str(home), str(watch_log)]
        watcher = subprocess.Popen(
            [sys.executable, "-m", "tests.support.watcher", *watch], cwd=REPO
        )
        arena = Arena(
            root, d, peer_home, bodies, tmpdir, daemon_home, watch_log, loop, mirrors, urls
        )
        port = re.search(r"listening address=127\.0\.0\.1:(\d+)", d.log())
        assert port, d.log()[-2000:]
        arena.tcp_port, arena.use_key = int(port.group(1)), use_key
        wait_sync(lambda: watch_log.exists() and watch_log.stat().st_size > 0, 30, "a first sample")
        yield arena
        # SIGTERM still stops it, promptly, after everything (a FIFO once hung it for good).
        assert d.stop(timeout=30) == 0, d.log()[-3000:]
        print(
            f"\nattack suite: {FIGURES.polls} health polls, worst "
            f"{FIGURES.worst * 1000:.0f} ms (bound {HEALTH_BOUND * 1000:.0f} ms); peak RSS "
            f"{FIGURES.rss / MiB:.0f} MiB (bound {RSS_BOUND / MiB:.0f} MiB); load {os.getloadavg()}"
        )
    finally:
        if watcher is not None:
            watcher.kill()
            watcher.wait()
        if d.proc is not None:
            d.stop()
        for m in mirrors.values():
            loop.run(m.stop())
        loop.run(trickler.stop())
        loop.close()
        shutil.rmtree(root, ignore_errors=True)


# --- the invariants ---------------------------------------------------------------------------

_TMP_NAMES = (".litertlm", ".partial", ".import-", "sha256-", "modeld", "netrc")


def _tmp_entries() -> dict[str, int]:
    """The names in /tmp that look like the daemon's, with their owner."""
    found = {}
    with os.scandir("/tmp") as entries:
        for entry in entries:
            if any(n in entry.name for n in _TMP_NAMES):
                with contextlib.suppress(OSError):
                    found[entry.name] = entry.stat(follow_symlinks=False).st_uid
    return found


def _owned_by(root: Path, uid: int) -> list[str]:
    """Paths under ``root`` owned by ``uid``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.lstat(path).st_uid == uid:
                out.append(path)
    return out


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _bad_blobs(home: Path) -> list[str]:
    bad = []
    for blob in (home / "blobs").iterdir():
        digest, _ = sha256_file(blob)
        if blob.name != f"sha256-{digest}":
            bad.append(blob.name)
    return bad


@dataclass
class Figures:
    """What the watcher saw over the suite, for the report at the end."""

    polls: int = 0
    worst: float = 0.0
    rss: int = 0
    per_test: dict[str, float] = field(default_factory=dict)


FIGURES = Figures()


@pytest.fixture(autouse=True)
def invariants(arena: Arena, request: pytest.FixtureRequest) -> Iterator[None]:
    arena.answers.clear()
    arena.watched_from = len(arena.watch_log.read_text().splitlines())
    tmp_before = _tmp_entries()
    yield
    # At least two polls after the attack: "after" is covered too.
    seen = len(arena.samples())
    wait_sync(lambda: len(arena.samples()) >= seen + 2, 30, "two polls after the attack")
    samples = arena.samples()
    assert samples, "the watcher took no sample"
    failed = [s for s in samples if s["status"] != 200]
    assert not failed, f"/api/health failed during the attack: {failed[:3]}"
    worst = max(s["health"] for s in samples)
    FIGURES.polls += len(samples)
    FIGURES.worst = max(FIGURES.worst, worst)
    FIGURES.per_test[request.node.name] = worst
    print(f"\n{request.node.name}: {len(samples)} polls, worst {worst * 1000:.0f} ms")
    assert worst < HEALTH_BOUND, f"/api/health took {worst:.2f} s (load {os.getloadavg()})"
    # A bound's answer is not a fault: 503 busy with Retry-After (the issue's "413 or 503"),
    # and 507 disk_full (a copy that cannot fit).
    server_errors = [a for a in arena.answers if not 0 < a[1] < 500 and not _bounded(a)]
    assert not server_errors, server_errors[:3]
    writes = sorted({w for s in samples for w in s["writes"]})
    assert not writes, f"the daemon wrote outside MODELD_HOME: {writes}"
    assert not os.listdir(arena.tmpdir), os.listdir(arena.tmpdir)
    assert sorted(os.listdir(arena.daemon_home)) == [".netrc"]
    assert os.listdir(arena.sock.parent) == [arena.sock.name]
    assert not _owned_by(arena.peer_home, 0), "the daemon (root) wrote in the peer's home"
    new_in_tmp = {n: u for n, u in _tmp_entries().items() if n not in tmp_before and u == 0}
    assert not new_in_tmp, new_in_tmp
    peak = _peak_rss(arena.pid)
    FIGURES.rss = max(FIGURES.rss, peak)
    assert peak < RSS_BOUND, f"peak RSS {peak / MiB:.0f} MiB"
    assert not _bad_blobs(arena.daemon.home)


def _bounded(answer: tuple[Any, ...]) -> bool:
    """A 503 ``busy`` with ``Retry-After``, or a 507 ``disk_full``."""
    _, status, body, *retry_after = answer
    code = body.get("error", {}).get("code") if isinstance(body, dict) else None
    return (status, code) == (507, "disk_full") or (
        (status, code) == (503, "busy") and retry_after == ["1"]
    )


def _error(answer: tuple[int, Any]) -> dict[str, Any]:
    body = answer[1]
    assert isinstance(body, dict) and "error" in body, answer
    err: dict[str, Any] = body["error"]
    return err


def _installed(arena: Arena, model_id: str) -> Any:
    status, body = unix_request(arena.sock, "GET", f"/api/models/{model_id}")
    assert status == 200, body
    return body["installed"]


def _pull(arena: Arena, model_id: str) -> list[Any]:
    """The peer (an admin) pulls ``model_id``; the NDJSON records (or the error answer)."""
    ((status, body),) = arena.send(("POST", f"/api/models/{model_id}/pull", None))
    return body if isinstance(body, list) else [{"status": status, **(body or {})}]


# --- requests and bodies ----------------------------------------------------------------------


def test_huge_prompt_teaches_nothing(arena: Arena) -> None:
    """A prompt of millions of tokens is refused before the runtime sees it; one just under
    the byte bound reaches the runtime and is refused there. Neither teaches the pool a peak:
    the model loads and answers afterwards, within a 2 GiB budget."""
    loaded = arena.send(
        ("POST", "/api/engines", arena.body("load.json", b'{"model": "tiny-text"}'))
    )
    assert loaded[0][0] == 200, loaded
    millions = json.dumps({"model": "tiny-text", "prompt": "word " * (MAX_BODY // 6)}).encode()
    window = json.dumps({"model": "tiny-text", "prompt": "zq " * 2700}).encode()  # < 8192 B
    huge, near = arena.send(
        ("POST", "/api/modeld/generate", arena.body("millions.json", millions)),
        ("POST", "/api/modeld/generate", arena.body("window.json", window)),
    )
    assert huge[0] == 400 and _error(huge)["code"] == "context_length_exceeded", huge
    # It answered 500 engine_error ("Input token ids are too long"): now the same refusal.
    assert near[0] == 400 and _error(near)["code"] == "context_length_exceeded", near
    assert "maximum context length is 256 tokens" in _error(near)["message"], near
    # Unload, then load again: a poisoned peak would make this over_budget, for good.
    engines = unix_request(arena.sock, "GET", "/api/engines")[1]["engines"]
    for engine in engines:
        assert unix_request(arena.sock, "DELETE", f"/api/engines/{engine['id']}")[0] == 200
    hello = json.dumps({"model": "tiny-text", "prompt": "hello", "max_tokens": 3}).encode()
    again = arena.send(("POST", "/api/modeld/generate", arena.body("hello.json", hello)))
    assert again[0][0] == 200 and again[0][1][-1].get("done"), again
    with sqlite3.connect(f"file:{arena.daemon.home / 'modeld.db'}?mode=ro", uri=True) as db:
        learned = [row[0] for row in db.execute("SELECT pss FROM memory")]
    assert all(pss < 2 * 1024 * MiB for pss in learned), learned


DEEP = b'{"force": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
NESTED_40 = b'{"force": ' + b"[" * 40 + b"]" * 40 + b"}"
LONG_INT = b'{"force": ' + b"7" * 5000 + b"}"


def test_deep_json_and_long_integers(arena: Arena) -> None:
    """Nesting past 32 levels and integers of 5,000 digits are 400s on every route with a
    body, rm and prune included (they answered 500); nothing is removed."""
    bodies = {
        "deep": arena.body("deep.json", DEEP),
        "nested": arena.body("nested.json", NESTED_40),
        "long": arena.body("long.json", LONG_INT),
    }
    targets = [
        ("POST", "/api/prune"),
        ("DELETE", "/api/models/tiny-text"),
        ("POST", "/api/modeld/generate"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/api/models/tiny-text/pull"),
    ]
    requests = [(m, t, path) for m, t in targets for path in bodies.values()]
    for request, answer in zip(requests, arena.send(*requests), strict=True):
        assert answer[0] == 400 and _error(answer)["code"] == "bad_request", (request, answer)
    assert _installed(arena, "tiny-text") is not None


def test_json_bomb_and_many_large_bodies_at_once(arena: Arena) -> None:
    """Sixteen bodies of MODELD_MAX_BODY at once: those past MODELD_BODY_MEMORY are 503 busy
    with the rest refused as they are read (413) or, read whole, as a prompt over the model's
    window (400 context_length_exceeded); an 8 MiB body of ``[]`` is a 413. Peak RSS stays
    under the bound (sixteen 63 MiB bodies took 1.1 GB)."""
    big = json.dumps({"model": "tiny-text", "prompt": "a" * (MAX_BODY - 100)}).encode()
    big = big[:-1] + b" " * (MAX_BODY - len(big)) + b"}"
    assert len(big) == MAX_BODY
    path = arena.body("big.json", big)
    answers = arena.hostile("together", [["POST", "/api/modeld/generate", path]] * 16)
    statuses = sorted(status for status, _, _ in answers)
    assert set(statuses) <= {400, 413, 503}, answers
    assert all(_error(a)["code"] == "context_length_exceeded" for a in answers if a[0] == 400)
    assert 503 in statuses, statuses  # more than BODY_MEMORY was asked for at once
    busy = [a for a in answers if a[0] == 503]
    assert all(_bounded(("together", *a)) for a in busy), busy
    bomb = b"[" + b"[]," * (MAX_BODY // 3 - 2) + b"[]]"
    ((status, body),) = arena.send(("POST", "/api/prune", arena.body("bomb.json", bomb)))
    assert status == 413 and "JSON values" in body["error"]["message"], (status, body)


def _png_bomb() -> bytes:
    out = io.BytesIO()
    Image.new("1", (13000, 13000)).save(out, format="PNG", optimize=True)
    return out.getvalue()


def test_image_bomb(arena: Arena) -> None:
    """A PNG that decodes to 13000 x 13000 is refused from its header: for a model not
    installed, for one whose plan takes no images, and for one that takes them (413)."""
    image = base64.b64encode(_png_bomb()).decode()
    requests = []
    for model in ("absent", "tiny-text", "tiny-vision"):
        body = {"model": model, "prompt": "what is this?", "images": [image]}
        requests.append(
            (
                "POST",
                "/api/modeld/generate",
                arena.body(f"bomb-{model}.json", json.dumps(body).encode()),
            )
        )
    chat = {
        "model": "tiny-vision",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                ],
            }
        ],
    }
    requests.append(
        ("POST", "/v1/chat/completions", arena.body("bomb-chat.json", json.dumps(chat).encode()))
    )
    answers = arena.send(*requests)
    codes = [(status, _error((status, body))["code"]) for status, body in answers]
    assert codes == [
        (404, "model_not_installed"),
        (422, "refused"),
        (413, "too_large"),
        (413, "too_large"),
    ], answers
    assert "13000x13000" in _error(answers[2])["message"]


def test_idle_connection_flood(arena: Arena) -> None:
    """A uid the allow-list refuses opens thousands of connections and sends nothing (20,000
    once took every descriptor): the daemon holds at most MODELD_MAX_CONNECTIONS of them,
    and its clients are served throughout."""
    before = len(os.listdir(f"/proc/{arena.pid}/fd"))
    with arena.holding("flood", FLOOD, uid=OUTSIDER_UID) as flood:
        assert flood.started == {"opened": FLOOD}

        # Closing the evicted ones takes the daemon a loop turn each: wait for it to settle.
        def held() -> int:
            return len(os.listdir(f"/proc/{arena.pid}/fd")) - before

        wait_sync(lambda: held() <= MAX_CONNECTIONS + 8, 30, "the daemon settling")
        # The allowed peer is served while the flood holds its connections.
        ((status, _),) = arena.send(("GET", "/api/models", None))
        assert status == 200
    result = flood.result
    assert result["closed_by_daemon"] >= FLOOD - MAX_CONNECTIONS - 8, result
    assert "connections_bounded" in arena.daemon.log()


# --- import -------------------------------------------------------------------------------------


def test_import_of_fifo_and_dev_zero(arena: Arena) -> None:
    """A FIFO or /dev/zero passed as the file to import is refused at once (a FIFO once hung
    the daemon for good, /dev/zero filled the disk); by path, only root may import, and a
    path that is swapped between a file and links to them while root imports it is either
    imported whole or refused, never followed."""
    fifo = arena.peer_home / "fifo"
    real = arena.peer_home / "real.litertlm"
    swapped = arena.peer_home / "swapped.litertlm"
    os.mkfifo(fifo)
    shutil.copyfile(TINY, real)
    for p in (fifo, real):
        os.chown(p, PEER_UID, PEER_GID)
    for path in (str(fifo), "/dev/zero"):
        status, body = arena.hostile(
            "import_fd", {"path": path, "name": "x.litertlm", "id": "loose"}
        )
        assert status == 400 and "not a regular file" in body["error"]["message"], (path, body)
    os.symlink(fifo, swapped)
    os.lchown(swapped, PEER_UID, PEER_GID)
    by_path = arena.body("by-path.json", json.dumps({"path": str(swapped), "id": "loose"}).encode())
    ((status, body),) = arena.send(("POST", "/api/models/import", by_path))
    assert status == 403 and "modeld import PATH" in body["error"]["message"], body
    # The race, with root (who may import by path) as the victim: the peer swaps the name
    # between its file and links to the FIFO and /dev/zero as fast as it can.
    outcomes: dict[int, int] = {}
    to = [str(real), str(fifo), "/dev/zero"]
    with arena.holding("swap", {"path": str(swapped), "to": to}) as swapper:
        assert swapper.started == {"swapping": True}
        for _ in range(20):
            status, body = unix_request(
                arena.sock, "POST", "/api/models/import", {"path": str(swapped), "id": "loose"}
            )
            arena.answers.append(("root import", status, body))
            assert status in (200, 400), body
            outcomes[status] = outcomes.get(status, 0) + 1
    swaps = swapper.result["swaps"]
    assert swaps > 20, swaps
    installed = _installed(arena, "loose")
    assert installed is None or installed["digest"] == sha256_file(TINY)[0], (outcomes, installed)
    assert not list((arena.daemon.home / "partial").glob("*.import-*"))


def test_sparse_import(arena: Arena) -> None:
    """A sparse file of a huge apparent size with a real header: 507 disk_full before a
    byte is copied."""
    sparse = arena.peer_home / "huge.litertlm"
    with sparse.open("wb") as f:
        f.write(TINY.read_bytes()[: 64 * 1024])
        f.truncate(HUGE)
    os.chown(sparse, PEER_UID, PEER_GID)
    status, body = arena.hostile(
        "import_fd", {"path": str(sparse), "name": "huge.litertlm", "id": "huge"}
    )
    assert status == 507 and body["error"]["code"] == "disk_full", body
    assert not list((arena.daemon.home / "partial").glob("*.import-*"))
    sparse.unlink()


def test_import_is_no_oracle(arena: Arena) -> None:
    """A peer learns nothing about files it cannot read: /etc/shadow and a missing file get
    the same answer by path, and the CLI (which opens the file as the user) says only that
    it is not readable."""
    shadow, missing = (
        arena.body(f"{n}.json", json.dumps({"path": p, "id": "loose"}).encode())
        for n, p in (("shadow", "/etc/shadow"), ("missing", "/etc/no-such-file"))
    )
    a, b = arena.send(
        ("POST", "/api/models/import", shadow), ("POST", "/api/models/import", missing)
    )
    assert a[0] == b[0] == 403 and a[1] == b[1], (a, b)
    cli = peer_cli(arena.daemon, "import", "/etc/shadow", "loose")
    assert cli.returncode != 0 and "is not readable" in cli.stderr, cli.stderr
    size = str(Path("/etc/shadow").stat().st_size)
    assert size not in cli.stderr, cli.stderr


def test_verified_model_is_not_replaced(arena: Arena) -> None:
    """An admin peer imports its own bytes under a verified model's id: refused (409 when
    only the install vouches for the file, 422 when the entry's sha256 does), the verified
    blob stays, and pull answers with it."""
    mine = arena.peer_home / "mine.litertlm"
    shutil.copyfile(OTHER, mine)
    os.chown(mine, PEER_UID, PEER_GID)
    for model_id, status, code in (
        ("vouched", 409, "replaces_verified"),
        ("tiny-text", 422, "integrity"),
    ):
        before = _installed(arena, model_id)
        attempt = {"path": str(mine), "name": "mine.litertlm", "id": model_id}
        answer = arena.hostile("import_fd", attempt)
        assert (answer[0], _error(answer)["code"]) == (status, code), answer
        assert _installed(arena, model_id) == before
        detached = arena.body("detach.json", b'{"detach": true}')
        ((got, pulled),) = arena.send(("POST", f"/api/models/{model_id}/pull", detached))
        assert got == 200 and pulled["installed"]["digest"] == before["digest"], pulled
    mine.unlink()


# --- mirrors ------------------------------------------------------------------------------------


def test_hostile_mirror_cannot_turn_verification_off(arena: Arena) -> None:
    """A second mirror redirecting through a hub host that vouches for another digest fails
    the pull with digest_conflict naming both digests; nothing is installed."""
    records = _pull(arena, "conflict")
    final = records[-1]
    text = json.dumps(final)
    assert "digest_conflict" in text, records[-3:]
    assert "0" * 64 in text and hashlib.sha256(PULLED).hexdigest() in text, final
    assert _installed(arena, "conflict") is None


def test_slow_mirror_probe(arena: Arena) -> None:
    """A mirror that trickles header lines does not hold the pull: the other mirror's bytes
    are installed, verified."""
    records = _pull(arena, "slowprobe")
    installed = _installed(arena, "slowprobe")
    assert installed is not None, records[-3:]
    assert installed["digest"] == hashlib.sha256(PULLED).hexdigest()
    assert installed["verified_by"] == "registry sha256"


@pytest.mark.parametrize(
    "target",
    ["http://169.254.169.254/cdn/f", "http://127.0.0.1:{port}/cdn/f", "http://10.1.2.3/cdn/f"],
)
def test_redirect_into_local_addresses(arena: Arena, target: str) -> None:
    """A mirror on a public address redirecting into link-local (cloud metadata), loopback
    or private ranges: the pull fails naming it, and the redirect is never followed."""
    proxy = arena.mirrors["proxy"]
    proxy.faults.redirect_to = target.format(port=proxy.port)
    proxy.requests.clear()
    try:
        records = _pull(arena, "redirected")
    finally:
        proxy.faults.redirect_to = None
    assert "local or private address" in json.dumps(records[-1]), records[-3:]
    assert proxy.requests, "the mirror was never asked"
    assert not [r for r in proxy.requests if r["path"].startswith("/cdn")], proxy.requests
    assert _installed(arena, "redirected") is None


def test_credentials_never_leave(arena: Arena) -> None:
    """The hub token goes only to the hub host over https or loopback: not over plain http
    after a mirror's redirect, not to mirrors or CDN hosts; netrc is never read; no runner
    or probe has the token in its environment."""
    _pull(arena, "conflict")  # the loopback hubs, a mirror, the CDN URLs they redirect to
    proxy = arena.mirrors["proxy"]
    proxy.faults.redirect_to = f"http://huggingface.co{pinned_path()}"
    proxy.requests.clear()
    try:
        _pull(arena, "hubhttp")
    finally:
        proxy.faults.redirect_to = None
    to_hub = [r for r in proxy.requests if r.get("Host") == "huggingface.co"]
    assert to_hub, proxy.requests
    assert not [r for r in to_hub if "Authorization" in r], to_hub
    # Every request any mirror saw: no netrc (Basic) credentials anywhere; the token only to
    # the (loopback) hub hosts' own URLs, never to a mirror or a CDN URL they redirect to.
    hub_paths = (pinned_path(), pinned_path(repo="org/lying"))
    for name, mirror in arena.mirrors.items():
        for r in mirror.requests:
            auth = r.get("Authorization")
            assert auth is None or auth == f"Bearer {TOKEN}", (name, r)
            hub_url = name == "hub" and r["path"] in hub_paths
            assert auth is None or hub_url, (name, r)
    assert [r for r in arena.mirrors["hub"].requests if r.get("Authorization")], (
        "hub never got the token"
    )
    # A runner: loaded by the peer, its environment read from /proc.
    load = arena.body("load.json", b'{"model": "tiny-text"}')
    assert arena.send(("POST", "/api/engines", load))[0][0] == 200
    pids = runner_pids(arena.daemon.home)
    assert pids
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert TOKEN.encode() not in environ and b"MODELD_HF_TOKEN" not in environ
        assert NETRC_SECRET.encode() not in environ


# --- start-up -----------------------------------------------------------------------------------


def test_socket_dir_of_another_user(arena: Arena) -> None:
    """A daemon pointed at a socket dir that the attacker owns stops with exit 2 and one
    line naming it, and makes no socket there."""
    trap = arena.peer_home / "run"
    trap.mkdir()
    os.chown(trap, PEER_UID, PEER_GID)
    home = arena.root / "second-home"
    result = serve_to_exit(daemon_env(home, MODELD_SOCKET=str(trap / "modeld.sock")))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"modeld: the socket's directory {trap} belongs to uid {PEER_UID}"), last
    assert not os.listdir(trap)
    shutil.rmtree(home, ignore_errors=True)
    trap.rmdir()


def test_corrupt_database_at_start(arena: Arena) -> None:
    """A modeld.db that is not SQLite: one line, exit 1, the file untouched."""
    home = arena.root / "corrupt-home"
    home.mkdir(mode=0o700)
    db = home / "modeld.db"
    garbage = os.urandom(16384)
    db.write_bytes(garbage)
    db.chmod(0o600)
    mtime = db.stat().st_mtime_ns
    result = serve_to_exit(daemon_env(home))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not an SQLite database" in lines[0], result.stderr
    assert db.read_bytes() == garbage and db.stat().st_mtime_ns == mtime
    shutil.rmtree(home)


# --- second round: content bounds, deadlines, roles, logs, names --------------------------------


def _chat(schema: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny-text",
        "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 120,
        **extra,
    }
    if schema is not None:
        fmt = {"name": "x", "schema": schema, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": fmt}
    return body


def test_schema_pattern_of_millions_is_refused_off_the_loop(arena: Arena) -> None:
    """A schema whose pattern holds millions of alternatives (in response_format, and as a
    forced tool call's parameters) is a 400 naming the bound, refused before anything
    compiles it; it was compiled on the event loop, which stopped answering /api/health."""
    pattern = "a|" * (MAX_BODY // 3)
    schema = {"type": "string", "pattern": pattern}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    forced = _chat(tools=[tool], tool_choice="required")
    for body in (_chat(schema), forced):
        status, answer = arena.tcp("POST", "/v1/chat/completions", body)
        assert status == 400, (status, str(answer)[:300])
        assert "the schema is over 256 KiB" in answer["error"]["message"], answer


def test_backtracking_strict_schema_holds_no_model(arena: Arena) -> None:
    """A strict schema whose patternProperties backtracks on the key the decoder is made to
    write (``^(a|a)*$`` against 40 a's and a '!'): the reply comes back unchecked once the
    check's bound passes, and the model answers the next request; the check held it for
    ever (each character doubled its time)."""
    key = "a" * 40 + "!"
    schema = {
        "type": "object",
        "properties": {key: {"type": "boolean"}},
        "required": [key],
        "additionalProperties": False,
        "maxProperties": 1,
        "patternProperties": {"^(a|a)*$": {"type": "boolean"}},
    }
    status, answer = arena.tcp("POST", "/v1/chat/completions", _chat(schema), timeout=60)
    assert status == 200, answer
    assert answer["modeld"]["json"]["status"] == "schema_unchecked", answer["modeld"]["json"]
    status, after = unix_request(
        arena.sock,
        "POST",
        "/api/modeld/generate",
        {"model": "tiny-text", "prompt": "hi", "max_tokens": 3},
    )
    assert status == 200 and after[-1]["done"], after


def test_recursive_ref_is_a_400(arena: Arena) -> None:
    """A strict schema that refers to itself without reaching into the value (``{"$ref":
    "#"}``, or through $defs and anyOf) is a 400 naming the loop; it was a 500 RecursionError
    from the runner. A recursive schema that does reach into the value is taken."""
    loops: list[dict[str, Any]] = [
        {"$ref": "#"},
        {
            "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a",
        },
    ]
    for schema in loops:
        status, answer = arena.tcp("POST", "/v1/chat/completions", _chat(schema))
        assert status == 400, answer
        assert "never ends" in answer["error"]["message"], answer
    tree = {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0}},
        "required": ["kids"],
        "additionalProperties": False,
    }
    status, answer = arena.tcp("POST", "/v1/chat/completions", _chat(tree))
    assert status == 200, answer


def test_embeddings_allow_unverified_needs_admin(arena: Arena) -> None:
    """``allow_unverified`` on /v1/embeddings from a ``use`` key is a 403, as on the other
    routes (it was a 200)."""
    body = {"model": "tiny-embed", "input": "hello", "allow_unverified": True}
    status, answer = arena.tcp("POST", "/v1/embeddings", body)
    assert status == 403 and "needs the admin role" in answer["error"]["message"], answer


def test_huge_embedding_input_is_refused_unread(arena: Arena) -> None:
    """One embedding input of megabytes is a 413 before the runtime tokenizes it (it was
    tokenized whole; a larger one took the runner down)."""
    body = {"model": "tiny-embed", "input": "word " * (MAX_BODY // 6)}
    status, answer = arena.tcp("POST", "/v1/embeddings", body)
    assert status == 413, str(answer)[:300]
    assert "before tokenizing" in answer["error"]["message"], answer
    status, ok = arena.tcp("POST", "/v1/embeddings", {"model": "tiny-embed", "input": "hello"})
    assert status == 200 and ok["data"][0]["embedding"], ok


def test_tools_count_against_the_prompt_bound(arena: Arena) -> None:
    """Tools of a hundred kilobytes and a tool call's arguments count against the prompt's
    byte bound: a 400 context_length_exceeded before the runtime renders them (they were not
    counted)."""
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 1000}}
        for i in range(100)
    ]
    status, answer = arena.tcp("POST", "/v1/chat/completions", _chat(tools=tools))
    assert status == 400 and "messages are over" in answer["error"]["message"], answer
    assert answer["error"]["code"] == "context_length_exceeded", answer
    arguments = json.dumps({"x": "y" * 100_000})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    body = {"model": "tiny-text", "messages": messages, "max_tokens": 3}
    status, answer = arena.tcp("POST", "/v1/chat/completions", body)
    assert status == 400 and "messages are over" in answer["error"]["message"], answer
    assert answer["error"]["code"] == "context_length_exceeded", answer


def test_keys_never_reach_the_log(arena: Arena) -> None:
    """A key sent with a stray CR or control byte makes aiohttp's parser fail and log the
    header line: the key is redacted there, as everywhere in the log (the whole working key
    went to stderr through logging.lastResort)."""
    assert arena.tcp("GET", "/api/health")[0] == 200  # the key works
    for stray in (b"\r", b"\x01"):
        with socket.create_connection(("127.0.0.1", arena.tcp_port), timeout=30) as s:
            s.sendall(
                b"GET /api/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + arena.use_key.encode()
                + stray
                + b"\r\n\r\n"
            )
            assert s.recv(100).startswith(b"HTTP/1.1 400") or True
    arena.daemon.wait_log("Error handling request", count=2)
    log = arena.daemon.log()
    assert arena.use_key not in log and arena.use_key[4:20] not in log
    assert TOKEN not in log


def test_control_characters_in_paths_are_escaped(arena: Arena) -> None:
    """A path with ESC, BEL and CR is logged with each as its escape, and ``modeld logs``
    prints no control character (it retitled and cleared the admin's terminal)."""
    path = "/api/%1b%5d0;X%07%1b%5b2J%0dforged"
    status, _ = arena.tcp("GET", path)
    assert status == 404
    log = arena.daemon.wait_log("forged")
    assert "\x1b" not in log and "\x07" not in log, log[-500:]
    assert "\\x1b]0;X\\x07\\x1b[2J\\rforged" in log, log[-500:]
    shown = subprocess.run(
        [sys.executable, "-m", "modeld", "logs", "-n", "50"],
        env=arena.daemon.env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert b"forged" in shown.stdout
    assert not re.search(rb"[\x00-\x08\x0b-\x1f\x7f]", shown.stdout), shown.stdout[-300:]


def test_hf_token_only_to_the_endpoints_port(arena: Arena) -> None:
    """An entry URL on HF_ENDPOINT's host at another port gets no HF token (the host was
    matched without its port)."""
    good = arena.mirrors["good"]
    registry = Path(arena.daemon.env["MODELD_REGISTRY"])
    write_entry(registry, "otherport", size=len(PULLED), urls=[f"http://localhost:{good.port}/f"])
    wait_sync(lambda: unix_request(arena.sock, "GET", "/api/models/otherport")[0] == 200, 10, "")
    good.requests.clear()
    _pull(arena, "otherport")
    assert good.requests, "the mirror was never asked"
    assert not [r for r in good.requests if "Authorization" in r], good.requests


def test_entry_urls_are_redacted_for_peers(arena: Arena) -> None:
    """An entry URL's user, password and signature are not shown to a ``use`` peer (they
    were returned verbatim; the bug report already redacted them)."""
    registry = Path(arena.daemon.env["MODELD_REGISTRY"])
    url = "http://bob:S3cretPw@127.0.0.1:9/m.litertlm?X-Amz-Signature=QSECRET42"
    write_entry(registry, "secreturl", size=1000, urls=[url])
    wait_sync(lambda: unix_request(arena.sock, "GET", "/api/models/secreturl")[0] == 200, 10, "")
    status, shown = arena.tcp("GET", "/api/models/secreturl")
    assert status == 200, shown
    text = json.dumps(shown)
    assert "S3cretPw" not in text and "QSECRET42" not in text and "bob" not in text, text
    assert shown["entry"]["urls"] == ["http://(credentials)@127.0.0.1:9/m.litertlm?(query)"]


def _registry_files(arena: Arena) -> list[str]:
    own = arena.daemon.home / "registry"
    return sorted(p.name for p in own.iterdir()) if own.exists() else []


def test_pull_of_a_bad_revision_or_name_writes_nothing(arena: Arena) -> None:
    """``pull hf://`` with a control character in its revision, or a newline after a name
    (``$`` let it through), is a 400 and leaves no entry (one was written that TOML
    refuses, and that ``rm --entry`` could not remove)."""
    before = _registry_files(arena)
    for source in ("hf://org/repo/m.litertlm@ma\u0001in", "hf://org\n/repo/m.litertlm"):
        body = arena.body("source.json", json.dumps({"source": source, "detach": True}).encode())
        ((status, answer),) = arena.send(("POST", "/api/models/pull", body))
        assert status == 400 and answer["error"]["code"] == "bad_request", answer
    assert _registry_files(arena) == before


def test_import_names_round_trip_or_are_refused(arena: Arena) -> None:
    """An import of a file named with a character past U+FFFF writes an entry that reads
    back as it was (TOML refused JSON's surrogate escapes); a name with ``..`` is a 400
    before anything is copied (it was a 500 with a pydantic traceback)."""
    emoji = arena.peer_home / "modelb\U0001f600.litertlm"
    dots = arena.peer_home / "a..b.litertlm"
    for p in (emoji, dots):
        shutil.copyfile(OTHER, p)
        os.chown(p, PEER_UID, PEER_GID)
    status, body = arena.hostile("import_fd", {"path": str(emoji), "name": emoji.name, "id": None})
    assert status == 200, body
    entry = arena.daemon.home / "registry" / f"{body['id']}.toml"
    doc = tomllib.loads(entry.read_text())
    assert doc["file_name"] == emoji.name, doc
    status, shown = arena.tcp("GET", f"/api/models/{body['id']}")
    assert status == 200 and shown["entry"]["file_name"] == emoji.name, shown
    before = _registry_files(arena)
    status, body = arena.hostile("import_fd", {"path": str(dots), "name": dots.name, "id": None})
    assert status == 400 and "'..'" in body["error"]["message"], body
    assert _registry_files(arena) == before
    assert not list((arena.daemon.home / "partial").glob("*.import-*"))
    for p in (emoji, dots):
        p.unlink()


def test_socket_grandparent_of_another_user(arena: Arena) -> None:
    """A socket dir of the daemon's own, inside a dir the attacker owns (who could swap
    it): exit 2 naming that dir, no socket made (it was accepted)."""
    outer = arena.peer_home / "outer"
    outer.mkdir()
    os.chown(outer, PEER_UID, PEER_GID)
    inner = outer / "run"
    inner.mkdir(mode=0o755)
    home = arena.root / "third-home"
    result = serve_to_exit(daemon_env(home, MODELD_SOCKET=str(inner / "modeld.sock")))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"is under {outer}, which belongs to uid {PEER_UID}" in last, last
    assert not os.listdir(inner)
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(outer)


def _hostile_daemon(path: Path) -> Any:
    """A daemon that answers status, show and rm with escape sequences in every string."""
    from aiohttp import web

    evil = "\x1b]0;pwned\x07\x1b[2J"

    async def status(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": evil,
                "uptime": 1,
                "settings": {
                    "socket": evil,
                    "home": evil,
                    "memory_budget": 1,
                    "main_backend": evil,
                    "vision_backend": evil,
                    "keep_alive": 1,
                },
                "engines": {"summary": evil, "problems": [evil]},
            }
        )

    async def remove(_: web.Request) -> web.Response:
        removed = {"kind": evil, "path": evil, "size": 1}
        return web.json_response(
            {
                "id": evil,
                "removed": [removed],
                "freed": 1,
                "unloaded": [evil],
                "cancelled_download": False,
            }
        )

    app = web.Application()
    app.router.add_get("/api/status", status)
    app.router.add_delete("/api/models/{id}", remove)
    return app, web, evil


def test_cli_escapes_what_a_hostile_daemon_says(arena: Arena) -> None:
    """``status`` prints a daemon's strings with their control characters escaped (it printed
    them raw; ``list`` and ``ps`` already escaped)."""
    del arena  # the invariants only: this daemon is a hostile stand-in
    sock = Path(tempfile.mkdtemp(prefix="md-evil-", dir="/tmp")) / "evil.sock"
    loop = LoopThread()
    app, web, _ = _hostile_daemon(sock)
    runner = web.AppRunner(app)

    async def start() -> None:
        await runner.setup()
        await web.UnixSite(runner, str(sock)).start()

    loop.run(start())
    try:
        for args in (["status"],):
            done = subprocess.run(
                [sys.executable, "-m", "modeld", "--socket", str(sock), *args],
                capture_output=True,
                timeout=60,
                check=False,
                cwd=REPO,
            )
            out = done.stdout + done.stderr
            assert b"\\x1b]0;pwned\\x07" in out, (args, out)
            assert not re.search(rb"[\x00-\x08\x0b-\x1f\x7f]", out), (args, out)
    finally:
        loop.run(runner.cleanup())
        loop.close()
        shutil.rmtree(sock.parent, ignore_errors=True)


def test_admin_fields_walk_every_use_route(arena: Arena) -> None:
    """Every POST route a ``use`` key may call refuses ``pin`` and ``allow_unverified``
    with a 403, whatever else its body holds (one rule, walked over the route table)."""
    from modeld.api.access import ADMIN_FIELDS, ROUTES, Role

    routes = [(m, p) for (m, p), rule in ROUTES.items() if rule.role is Role.USE and m == "POST"]
    assert routes
    for method, path in routes:
        for name in ADMIN_FIELDS:
            status, answer = arena.tcp(method, path.replace("{id}", "tiny-text"), {name: True})
            assert status == 403, (path, name, answer)
