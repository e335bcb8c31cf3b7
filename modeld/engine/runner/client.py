"""The daemon's side of a runner process: start it, speak its protocol, notice its death.

A ``Runner`` is one child (``python -m modeld.engine.runner.child``) on one socketpair. Replies are
routed to the waiting call by request id. When the child dies, every waiting call gets
``RunnerDied`` at once with the signal and the runtime's last words from its stderr (the
runtime prints its reasons only to fd 2).
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import contextlib
import itertools
import os
import re
import resource
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from modeld.config import child_environ
from modeld.engine.runner.child import (
    ProtocolError,
    encode_frame,
    read_memory,
    read_rss,
    split_frames,
)
from modeld.engine.runner.job import Created, Job, Record, Token, record_of
from modeld.modelfile.runtime import CreateSpec

_STDERR_LINES = 200
# A runner's whole stderr is kept up to this many characters (a bug report quotes it);
# past it, the first quarter and the latest lines stay, with a marker between.
STDERR_LIMIT = 256 * 1024
START_TIMEOUT = 60.0
CANCEL_DRAIN_TIMEOUT = 10.0
_READ_SIZE = 1 << 18


class RunnerDied(Exception):
    """The runner process exited while requests were waiting on it."""

    def __init__(self, signal_name: str | None, returncode: int | None, reason: str | None) -> None:
        self.signal_name = signal_name
        self.returncode = returncode
        self.reason = reason
        how = f"killed by {signal_name}" if signal_name else f"exited with status {returncode}"
        if signal_name == "SIGKILL":
            how += " (the OOM killer or kill -9)"
        super().__init__(how + (f": {reason}" if reason else ""))

    @property
    def how(self) -> str:
        return str(self).split(": ", 1)[0]


class RunnerError(Exception):
    """The runner answered with an error: its code, and the runtime's own message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# glog severities E (error) and F (fatal): "F0000 00:00:1730000000.123456   12345 file.cc:12] ".
_SEVERE = re.compile(r"^[EF]\d{4} [\d:. ]+\s+\d+ [\w./-]+:\d+\] ")
_FATAL_WORDS = ("Check failed", "terminate called", "Fatal", "Aborted")
# TFLite's own logger (not glog), e.g. the XNNPack weight cache failing on a full disk:
# "ERROR: .../weight_cache.cc:151: could not write initial cache header ...".
_TFLITE_ERROR = "ERROR: "


def crash_reason(lines: collections.abc.Iterable[str], limit: int = 3) -> str | None:
    """The runtime's first and last error or fatal lines before a crash, joined by `` | ``."""
    picked = [
        _SEVERE.sub("", ln).strip()
        for ln in lines
        if _SEVERE.match(ln) or ln.startswith(_TFLITE_ERROR) or any(w in ln for w in _FATAL_WORDS)
    ]
    picked = [ln[:400] for ln in picked if ln]
    if len(picked) > limit:
        # The first error is usually the cause (e.g. "No space left on device"), the last
        # ones what the runtime died of: keep both ends.
        picked = [picked[0], *picked[-(limit - 1) :]] if limit > 1 else picked[-1:]
    return " | ".join(picked) if picked else None


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class StderrLog:
    """A process's stderr lines: all of them up to ``limit`` characters, then head and tail.

    The head holds the runtime's set-up (accelerators, the GPU adapter it selected), the
    tail what it said last (the reason it died): a bug report needs both.
    """

    def __init__(self, limit: int = STDERR_LIMIT) -> None:
        self.head_limit = limit // 4
        self.tail_limit = limit - self.head_limit
        self.head: list[str] = []
        self.head_size = 0
        self.tail: collections.deque[str] = collections.deque()
        self.tail_size = 0
        self.dropped = 0  # lines left out between head and tail

    def append(self, line: str) -> None:
        if not self.tail and self.head_size + len(line) <= self.head_limit:
            self.head.append(line)
            self.head_size += len(line) + 1
            return
        self.tail.append(line)
        self.tail_size += len(line) + 1
        while self.tail_size > self.tail_limit and len(self.tail) > 1:
            self.tail_size -= len(self.tail.popleft()) + 1
            self.dropped += 1

    def text(self) -> str:
        middle = [f"[... {self.dropped} lines left out ...]"] if self.dropped else []
        return "\n".join([*self.head, *middle, *self.tail])


class Runner:
    """One runner child process and its protocol; create with ``await Runner.start()``."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int = 0
        self.preload_seconds: float = 0.0
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self.stderr_log = StderrLog()
        self.died: RunnerDied | None = None
        self.closing = False
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue[dict[str, Any] | BaseException]] = {}
        # Called when a generation's last record arrives, read or not (``generate``).
        self._ended: dict[int, Callable[[float], None] | None] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._exited = asyncio.Event()
        self._hello: asyncio.Future[dict[str, Any]] | None = None

    @classmethod
    async def start(
        cls, *, env: dict[str, str] | None = None, data_limit: int | None = None
    ) -> Runner:
        """Start a child and wait until it has loaded the runtime (its ``hello``).

        The child gets a scrubbed environment (``config.child_environ``; ``env`` replaces
        it), no descriptor but its socket (``close_fds``), and with ``data_limit`` an
        ``RLIMIT_DATA`` (soft and hard), set before it is sent any model.
        """
        self = cls()
        if env is None:
            env = child_environ()
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "modeld.engine.runner.child",
                "--fd",
                str(child_sock.fileno()),
                "--parent",
                str(os.getpid()),
                close_fds=True,
                pass_fds=(child_sock.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                # Its own session: a terminal's Ctrl-C reaches only the daemon, which then
                # stops runners in order; PR_SET_PDEATHSIG covers the daemon dying.
                start_new_session=True,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        self.pid = self.proc.pid
        try:
            if data_limit is not None:
                resource.prlimit(self.pid, resource.RLIMIT_DATA, (data_limit, data_limit))
            reader, self._writer = await asyncio.open_unix_connection(sock=parent_sock)
            self._hello = asyncio.get_running_loop().create_future()
            self._tasks = [
                asyncio.create_task(self._read_frames(reader)),
                asyncio.create_task(self._read_stderr()),
            ]
            hello = await asyncio.wait_for(asyncio.shield(self._hello), START_TIMEOUT)
        except BaseException:
            # Whatever stopped the start (no hello, a limit refused, a cancel at any await
            # here): no child may outlive it.
            if self._writer is None:
                parent_sock.close()
            await self.kill()
            raise
        self.preload_seconds = float(hello.get("preload_seconds", 0.0))
        return self

    # --- reading -------------------------------------------------------------------------

    async def _read_frames(self, reader: asyncio.StreamReader) -> None:
        # One read takes everything that has arrived, and every complete frame in it is
        # routed before the consumers run: tokens that came together leave together.
        buf = bytearray()
        try:
            while True:
                chunk = await reader.read(_READ_SIZE)
                if not chunk:
                    break
                buf += chunk
                for msg in split_frames(buf):
                    self._route(msg)
        except (ConnectionError, ValueError, ProtocolError):
            pass
        finally:
            await self._on_exit()

    def _route(self, msg: dict[str, Any]) -> None:
        if msg.get("op") == "hello":
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)
            return
        rid = msg.get("id")
        q = self._pending.get(rid) if isinstance(rid, int) else None
        if q is not None:
            q.put_nowait(msg)
            if "token" not in msg and ("done" in msg or "error" in msg):
                ended = self._ended.pop(rid, None) if isinstance(rid, int) else None
                if ended is not None:
                    ended(time.monotonic())

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self.stderr_tail.append(line)
            self.stderr_log.append(line)

    async def _on_exit(self) -> None:
        try:
            await self._note_exit()
        finally:
            # Even when cancelled (a loop that ends while a runner is stopping).
            self._close_transport()

    def _close_transport(self) -> None:
        """Close the child's transport. asyncio closes it by itself only once the child's
        exit and its stderr's end have both been delivered, which a loop that ends right
        after (a daemon stopping) may never do; collected unclosed, it warns."""
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()

    async def _note_exit(self) -> None:
        assert self.proc is not None
        # The child closed its end, so nothing more can be written: close ours first, before
        # a wait below is cancelled by a daemon that stops meanwhile (an unclosed writer
        # warns when the loop is gone). kill() does the same.
        if self._writer is not None:
            self._writer.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)
        if self.proc.returncode is None:
            # The socket closed but the process lingers (stuck in teardown): end it.
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        # Let the last stderr lines arrive: they carry the runtime's reason for an abort.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._tasks[1]), 1.0)
        rc = self.proc.returncode
        reason = crash_reason(self.stderr_tail)
        self.died = RunnerDied(_signal_name(rc), rc, reason)
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(self.died)
            self._hello.exception()  # start() may be gone (cancelled): mark it retrieved
        for q in self._pending.values():
            q.put_nowait(self.died)
        self._exited.set()
        # Closed above, here and not only in kill(), which a crash noticed by the pool's
        # watcher never reaches.
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    def stderr_text(self) -> str:
        """Everything the child wrote to stderr so far (bounded: see ``StderrLog``)."""
        return self.stderr_log.text()

    async def wait_exit(self) -> RunnerDied:
        await self._exited.wait()
        assert self.died is not None
        return self.died

    # --- requests ------------------------------------------------------------------------

    async def _send(self, msg: dict[str, Any]) -> None:
        if self.died is not None or self._writer is None:
            raise self.died or RunnerDied(None, None, "not started")
        self._writer.write(encode_frame(msg))
        try:
            await self._writer.drain()
        except ConnectionError:
            await self._exited.wait()
            assert self.died is not None
            raise self.died from None

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, one reply (create, stats, close)."""
        rid = next(self._ids)
        q: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._pending[rid] = q
        try:
            await self._send({"op": op, "id": rid, **fields})
            reply = await q.get()
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, BaseException):
            raise reply
        if "error" in reply:
            err = reply["error"]
            raise RunnerError(str(err.get("code", "engine_error")), str(err.get("message", "")))
        return reply

    async def create(self, spec: CreateSpec) -> Created:
        return Created.from_wire(await self.call("create", **spec.to_json()))

    async def generate(
        self,
        job: Job,
        sent: Callable[[], None] | None = None,
        ended: Callable[[float], None] | None = None,
    ) -> AsyncGenerator[Record, None]:
        """``Token`` records, then the final ``Done`` (``Embedded`` for an ``EmbedJob``);
        leaving early cancels in the child.

        The child runs its jobs one at a time, in the order they were sent: one sent while
        another runs waits in the child, and starts the moment that one ends. ``sent`` is
        called once the job is on its way, ahead of any job sent after it; ``ended`` with
        the time its last record (done or an error) arrives from the child, whether or not
        the caller reads it: a caller that reads slowly (its client does not read) holds no
        later job.
        """
        rid = next(self._ids)
        q: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._pending[rid] = q
        self._ended[rid] = ended
        finished = False
        held: dict[str, Any] | BaseException | None = None
        try:
            await self._send({"op": job.op, "id": rid, **job.to_wire()})
            if sent is not None:
                sent()
            while True:
                rec = held if held is not None else await q.get()
                held = None
                if isinstance(rec, BaseException):
                    finished = True
                    raise rec
                if "token" in rec:
                    # Merge the tokens that are already here into one record: one write
                    # downstream instead of one per token (clients see fewer, longer pieces).
                    parts = [rec["token"]]
                    while not q.empty():
                        nxt = q.get_nowait()
                        if isinstance(nxt, dict) and "token" in nxt:
                            parts.append(nxt["token"])
                        else:
                            held = nxt
                            break
                    yield Token("".join(parts))
                    continue
                finished = True
                if "error" in rec:
                    err = rec["error"]
                    raise RunnerError(str(err.get("code")), str(err.get("message", "")))
                yield record_of(rec)
                return
        finally:
            # A record held back by the merge is always the last one (done, error, or the
            # runner's death): the generation is over and there is nothing to cancel.
            if not finished and held is None and self.alive:
                # The caller left (client gone, unload): stop the work in the child and wait
                # for its end, so the next request on this engine starts on a quiet engine.
                await asyncio.shield(self._cancel_and_drain(rid, q))
            self._pending.pop(rid, None)
            self._ended.pop(rid, None)

    async def _cancel_and_drain(
        self, rid: int, q: asyncio.Queue[dict[str, Any] | BaseException]
    ) -> None:
        try:
            await self._send({"op": "cancel", "id": 0, "target": rid})
            async with asyncio.timeout(CANCEL_DRAIN_TIMEOUT):
                while True:
                    rec = await q.get()
                    if isinstance(rec, BaseException) or "error" in rec or rec.get("done"):
                        return
        except TimeoutError:
            # A generation that ignores cancel would block the engine forever.
            await self.kill()
        except RunnerDied:
            return

    def memory(self) -> tuple[int, int]:
        """``(pss, rss)`` of the child, read from /proc by the daemon (no round trip)."""
        return read_memory(self.pid) if self.alive else (0, 0)

    def rss(self) -> int:
        """The child's RSS, cheap to read (``read_rss``); 0 once it is gone."""
        return read_rss(self.pid) if self.alive else 0

    async def close(self, grace: float = 5.0) -> None:
        """Ask the child to exit; kill it if it does not within ``grace`` seconds."""
        self.closing = True
        if self.alive:
            with contextlib.suppress(RunnerDied, RunnerError, ConnectionError, TimeoutError):
                async with asyncio.timeout(grace):
                    await self.call("close")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._exited.wait()
        await self.kill()

    async def kill(self) -> None:
        self.closing = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self._writer is not None:
            self._writer.close()  # before any wait, which a stopping daemon may cancel
        if self._tasks:
            await self._exited.wait()
        elif self.proc is not None:
            await self.proc.wait()
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        for t in self._tasks:
            if not t.done():
                t.cancel()
        self._close_transport()
