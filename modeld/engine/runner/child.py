"""The child process that owns one ``litert_lm.Engine`` (``python -m modeld.engine.runner.child``).

Why a child per engine: the runtime can SIGSEGV on a damaged file and SIGABRT on a GPU
failure, a freed engine's memory stays with its process (glibc), and the first engine fixes
process-wide runtime state. A process per engine turns each of those into "that runner
died" and gives each engine its own PSS to count against the budget.

Protocol (one socketpair, both ways): frames of a 4-byte big-endian length and a UTF-8
JSON object. Parent -> child ops, each with an ``id``:

- ``create``: path, backend, vision, audio, max_tokens, max_images, cache_dir, speculative
  (None: the runtime's default), threads (CPU backends), warm_up (one short generation
  after the engine is made) -> ``{"id", "ok": true, "seconds", "warm_up", "pss", "rss",
  "options"}``; ``seconds`` is ``litert_lm.Engine()`` alone, ``warm_up`` the warm-up
  generation's timings (None when not asked); ``options`` are the settings the engine was
  created with, read back from the runtime's ``Engine`` object (``engine_options``)
- ``generate``: a ``GenerateJob`` (``modeld.engine.runner.job``: messages, options, shape)
  -> token frames... then its ``Done``; with ``shape.stream`` false no token frames, and
  ``Done.text`` carries the whole reply
- ``count``: a ``CountJob`` (a ``GenerateJob`` whose prompt is counted, nothing decoded)
  -> one ``Counted``: the tokens its generation would prefill
- ``embed`` (an engine created with ``kind: "embedding"``): an ``EmbedJob`` -> one
  ``Embedded``, one vector per input in order (the runtime's ``compute_embedding_batch``:
  L2-normalised; ``dimensions`` truncates, then normalises) and each input's tokens, counted
  with the file's tokenizer (``modeld.modelfile.tokens``; absent where it cannot be read)
- ``cancel``: ``target`` (a generate id) -> no reply of its own; the generation ends
  with ``finish: "cancelled"``
- ``stats`` -> ``{"id", "ok": true, "pss", "rss", "ready", "busy", "kept", "settling"}``
  (``ready``: a conversation made ahead waits for the next job; ``busy``: a job runs, is
  still being closed or kept after its final record, or waits, or a kept conversation's
  reply is being prefilled; ``kept``: conversations kept for their next turn, ``settling``
  of them with a reply still to prefill)
- ``close`` -> ``{"id", "ok": true}``, then the process exits

Token frames skip JSON (they are most of the traffic): the length word has its top bit
set (``TOKEN_FLAG``) and the body is a 4-byte big-endian request id and the UTF-8 text;
``decode_frame`` turns one into ``{"id", "token"}``.

A failure answers ``{"id", "error": {"code", "message"}}`` where the message carries the
runtime's own reason (``litert_lm_get_last_error_message`` read on the failing thread; the
runtime prints it only to fd 2 and Python raises a generic RuntimeError).

At module level this imports nothing from modeld but ``modeld.proc`` (the standard library
only), so a spare runner starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import math
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, NamedTuple

import psutil

from modeld.engine.runner.job import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Counted,
    CountedBy,
    CountJob,
    Created,
    Done,
    Embedded,
    EmbedJob,
    Finish,
    GenerateJob,
    Job,
    Made,
    Message,
    Restart,
    RunnerTimings,
    ToolCall,
    WarmUp,
    job_of,
    record_to_wire,
)
from modeld.engine.runner.kept import Kept, KeptConversations, chain, has_reply, root, settings_of
from modeld.proc import die_with_parent

_HEADER = struct.Struct(">I")
_RID = struct.Struct(">I")
TOKEN_FLAG = 0x8000_0000
# Images travel as base64 inside generate frames: room for the largest body the API takes.
MAX_FRAME = 80 * 1024 * 1024


# The runtime's refusal of a prompt longer than the engine's window (after tokenizing it),
# and of an embedding input longer than the encoder's longest signature.
_PROMPT_TOO_LONG = ("Input token ids are too long", "exceeds maximum supported signature length")


# The runtime's refusal of a response format (a JSON schema) it cannot make a constraint of:
# one unsatisfiable (minimum over maximum), a pattern its regex engine does not take, ...
_NO_CONSTRAINT = "Failed to create LLGuidance constraint:"


def generate_error_code(exc: Exception, reason: str) -> str:
    """The code of a failed generation: the client's fault (4xx) or the engine's (500)."""
    if isinstance(exc, ValueError) or _NO_CONSTRAINT in reason:
        return "bad_request"
    # A prompt under the daemon's byte bound can still hold more tokens than the window.
    if any(text in reason for text in _PROMPT_TOO_LONG):
        return "too_large"
    return "engine_error"


def generate_error_message(exc: Exception, reason: str, job: Job) -> str:
    """What the client is told of a failed generation: for its own fault, what to change."""
    if isinstance(exc, ValueError):
        return str(exc)  # modeld's own refusal, worded for the client already
    if _NO_CONSTRAINT not in reason:
        return reason
    why = reason.split(_NO_CONSTRAINT, 1)[1].removesuffix(f" ({type(exc).__name__}: {exc})")
    # A regex error spans lines, with a line of carets under the pattern: one line here.
    why = " ".join(line.strip() for line in why.splitlines() if line.strip(" ^"))
    field = (job.shape.schema_of if isinstance(job, GenerateJob) else None) or "the JSON schema"
    return (
        f'"{field}": the runtime cannot constrain the reply to this schema ({why}); '
        "change the schema"
    )


class Queued(NamedTuple):
    """A job waiting for the generate thread, under its request id."""

    rid: int
    job: Job


class ProtocolError(Exception):
    """The other side sent something that is not a frame."""


def encode_frame(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(data)} bytes is over {MAX_FRAME}")
    return _HEADER.pack(len(data)) + data


def encode_token(rid: int, text: str) -> bytes:
    """A token frame: no JSON on either side, for the bulk of a generation's frames."""
    data = text.encode()
    return _HEADER.pack(TOKEN_FLAG | (_RID.size + len(data))) + _RID.pack(rid) + data


def decode_body(data: bytes) -> dict[str, Any]:
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg


def split_frames(buf: bytearray) -> list[dict[str, Any]]:
    """Decode and remove every complete frame at the start of ``buf``."""
    out: list[dict[str, Any]] = []
    pos, end = 0, len(buf)
    while end - pos >= _HEADER.size:
        (word,) = _HEADER.unpack_from(buf, pos)
        length = word & ~TOKEN_FLAG
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes is over {MAX_FRAME}")
        start = pos + _HEADER.size
        if end - start < length:
            break
        if word & TOKEN_FLAG:
            (rid,) = _RID.unpack_from(buf, start)
            text = bytes(buf[start + _RID.size : start + length]).decode("utf-8", "replace")
            out.append({"id": rid, "token": text})
        else:
            out.append(decode_body(bytes(buf[start : start + length])))
        pos = start + length
    del buf[:pos]
    return out


_PAGE = os.sysconf("SC_PAGE_SIZE")


def read_rss(pid: int) -> int:
    """RSS in bytes from ``/proc/PID/statm``: no walk of the page tables, so microseconds
    where PSS takes milliseconds; 0 if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_bytes().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def read_memory(pid: int) -> tuple[int, int]:
    """``(pss, rss)`` in bytes (psutil reads ``/proc/PID/smaps_rollup``); (0, 0) if it is gone."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return 0, 0
    return int(info.pss), int(info.rss)


# --- the child -------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# Tokens that come within the window of the last token frame wait and leave together; the
# first token of a reply goes at once. The window starts at ``TOKEN_WINDOW`` and grows
# ``TOKEN_WINDOW_GROWTH`` times with each frame of the reply up to ``TOKEN_WINDOW_MAX``, short
# enough that no reader sees a stall. Every frame wakes the daemon and its client, which on a
# small machine take the CPU the decode itself needs; a real model's tokens are mostly
# further apart than the window, and those still leave one by one, at once (see
# docs/engines.md#the-runner-protocol).
TOKEN_WINDOW = 0.008
TOKEN_WINDOW_MAX = 0.032
TOKEN_WINDOW_GROWTH = 4


class _TokenBatcher:
    """Coalesces one generation's token frames within a growing window; see above."""

    def __init__(
        self, send: Any, window: float = TOKEN_WINDOW, longest: float = TOKEN_WINDOW_MAX
    ) -> None:
        self._send = send
        self.first_window = window
        self.longest = max(window, longest)
        self.window = window
        self.frames = 0  # sent for this reply
        self.cv = threading.Condition(threading.Lock())
        self.rid = 0
        self.parts: list[str] = []
        # No frame yet: the first token goes at once, whatever the clock (time.monotonic()
        # counts from boot, so on a host up for less than a window 0.0 would hold it back).
        self.last = -math.inf
        threading.Thread(target=self._flusher, name="tokens", daemon=True).start()

    def add(self, rid: int, text: str) -> None:
        with self.cv:
            now = time.monotonic()
            if self.rid != rid:
                if self.parts:
                    self._flush_locked(now)
                # A new reply's first token goes at once, however soon after the last one's,
                # and its window starts short again.
                self.rid, self.last, self.frames = rid, -math.inf, 0
            self.parts.append(text)
            if now - self.last >= self.window:
                self._flush_locked(now)
            elif len(self.parts) == 1:
                # The flusher sleeps until parts come: wake it to time this window. While
                # parts wait it is already timed, so later tokens cost no wake-up.
                self.cv.notify()

    def flush(self) -> None:
        """Send what waits now: before any other frame, so frames keep their order."""
        with self.cv:
            if self.parts:
                self._flush_locked(time.monotonic())

    def _flush_locked(self, now: float) -> None:
        text, self.parts = "".join(self.parts), []
        self.last = now
        # After the first frame: the first window, then TOKEN_WINDOW_GROWTH times as long.
        self.window = min(self.longest, self.first_window * TOKEN_WINDOW_GROWTH**self.frames)
        self.frames += 1
        self._send(encode_token(self.rid, text))

    def _flusher(self) -> None:
        with self.cv:
            while True:
                if not self.parts:
                    self.cv.wait()
                    continue
                delay = self.last + self.window - time.monotonic()
                if delay > 0:
                    self.cv.wait(delay)
                    continue
                with contextlib.suppress(OSError):
                    self._flush_locked(time.monotonic())


def _token_counter(path: str) -> Any:
    """The embedding model's token counter, or None when its tokenizer cannot be read (the
    reason goes to stderr, which a bug report quotes): its counts are then absent, never
    guessed."""
    try:
        from modeld.modelfile.tokens import token_counter

        return token_counter(path)
    except Exception as e:
        sys.stderr.write(f"runner: no token counts for {path}: {type(e).__name__}: {e}\n")
        return None


# Which waiting jobs get their conversation made during a decode (``_ahead_during_decode``).
Ahead = Literal["all", "streamed", "none"]


def _ahead_during_decode(backend: str, threads: int | None) -> Ahead:
    """Which waiting jobs get their conversation made while another job decodes: ``"all"``,
    ``"streamed"`` or ``"none"``.

    - ``"all"``: a CPU engine whose threads leave a core free.
    - ``"streamed"``: a CPU engine whose threads fill the machine. Making a conversation
      then slows the running decode, so it is done only for a streamed job, whose client
      waits on its first token; a client of a whole reply waits for the end, which the
      queue's throughput decides (docs/engines.md#the-runner-protocol has the figures).
    - ``"none"``: GPU engines make it in line (their sessions are not made while another
      decodes)."""
    from modeld.config import default_cpu_threads

    if backend != "cpu" or threads is None:
        return "none"
    return "all" if default_cpu_threads() > threads else "streamed"


# How long the engine waits, idle after a reply, before it prefills a kept conversation's
# reply into its checkpoint (``_Child._next_job``): longer than a client that sends its
# next turn at once takes to send it, far shorter than a reader's pause.
SETTLE_AFTER = 0.25


# The warm-up generation: a few tokens are enough to run every kernel of a prefill and
# a decode step once.
WARM_UP_PROMPT = "Hello"
WARM_UP_TOKENS = 4


class _Child:
    """The runner's state: one socket, at most one engine, one generation thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.engine: Any = None
        self.kind = "text"  # or "embedding": the ``create`` spec's kind
        self.dimension: int | None = None  # an embedding model's vector length
        # An embedding model's token counter (``modeld.modelfile.tokens``); None: its
        # tokenizer cannot be read here, and its records carry no counts.
        self.counter: Any = None
        self.max_tokens: int | None = None
        self.jobs: queue.Queue[Queued | None] = queue.Queue()
        self.cancelled: set[int] = set()
        self.current: tuple[int, Any] | None = None  # (generate id, conversation)
        # A conversation made ahead, on the ``ahead`` thread, for the job waiting next while
        # one runs (``prepare_queued``) or for a job like the last while the engine is idle
        # (``_prepare_next``): its key and the conversation to come (None: making it failed).
        # The runtime's sessions share one execution manager: a second live conversation
        # costs no memory, and one can be made while another decodes.
        self.ready: tuple[tuple[Any, ...], Future[Any]] | None = None
        self.ready_lock = threading.Lock()
        self.ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ahead")
        # Which waiting jobs' conversations are made during a decode (``prepare_queued``):
        # set by ``create`` (``_ahead_during_decode``).
        self.ahead_during_decode: Ahead = "none"
        self.current_lock = threading.Lock()
        # A CPU engine's template conversation: it renders the prompts of the jobs answered
        # on a bare session (``PlainSession``); None: every job gets a conversation.
        self.template: Any = None
        # The file's sampler (``sampler_defaults``): what a request's sampler fields go over.
        self.sampler_defaults: dict[str, Any] = {}
        # Conversations kept after a reply for their next turn (``_kept_for``, ``_keep``);
        # None: this engine keeps none.
        self.kept: KeptConversations | None = None
        # The generate thread's work after a final record (a close, a keep) or between jobs
        # (a settle) is under way: the runner is not idle yet (``stats``' ``busy``).
        self.tidying = False
        self._last_error: Any = None
        self._clear_error: Any = None
        self.worker = threading.Thread(target=self._work, name="generate", daemon=True)
        self.tokens = _TokenBatcher(self._send_frame)

    def _send_frame(self, frame: bytes) -> None:
        with self.send_lock:
            self.sock.sendall(frame)

    def send(self, msg: dict[str, Any]) -> None:
        frame = encode_frame(msg)
        self.tokens.flush()
        self._send_frame(frame)

    def send_final(self, rid: int, record: Done | Embedded | Counted) -> None:
        self.send({"id": rid, **record_to_wire(record)})

    def send_token(self, rid: int, text: str) -> None:
        self.tokens.add(rid, text)

    def error(self, rid: Any, code: str, message: str) -> None:
        self.send({"id": rid, "error": {"code": code, "message": message}})

    def _bind_errors(self) -> None:
        """Bind the runtime's own failure text (kept per thread; read on the failing thread).

        It is reached through ``litert_lm._ffi``, a private API: a runtime that moved it
        still runs, and its errors carry the Python exception's text alone (which may lose
        the ``backend_constraint`` code). tests/engine/test_runner.py fails on such an upgrade.
        """
        try:
            from litert_lm._ffi import _get_lib

            lib = _get_lib()
            last_error = lib.litert_lm_get_last_error_message
            clear_error = lib.litert_lm_clear_last_error
        except (ImportError, AttributeError, OSError) as e:
            sys.stderr.write(
                f"runner: the runtime's error text API is missing ({type(e).__name__}: {e}); "
                "errors carry the exception text alone\n"
            )
            return
        last_error.restype = ctypes.c_char_p
        last_error.argtypes = []
        clear_error.argtypes = []
        self._last_error, self._clear_error = last_error, clear_error

    def clear_error(self) -> None:
        if self._clear_error is not None:
            self._clear_error()

    def runtime_reason(self, exc: BaseException) -> str:
        text = None
        if self._last_error is not None:
            raw = self._last_error()
            text = raw.decode("utf-8", "replace").strip() if raw else None
        generic = f"{type(exc).__name__}: {exc}"
        return f"{text} ({generic})" if text and text not in generic else generic

    def _code_for(self, reason: str) -> str:
        # The runtime checks backend_constraint inside Engine(); keep its code stable.
        return "backend_constraint" if "constraint mismatch" in reason else "engine_error"

    # --- ops -----------------------------------------------------------------------------

    def create(self, msg: dict[str, Any]) -> None:
        rid = msg.get("id")
        if self.engine is not None:
            self.error(rid, "conflict", "this runner already has an engine")
            return
        started = time.perf_counter()
        self.clear_error()
        speculative = msg.get("speculative")
        try:
            from modeld.modelfile.runtime import CreateSpec, create_engine

            spec = CreateSpec.from_json(msg)
            self.engine = create_engine(spec)
            self.kind = spec.kind
            self.ahead_during_decode = _ahead_during_decode(spec.backend, spec.threads)
            if spec.kind == "embedding":
                import litert_lm

                embedding = litert_lm.ModelInfo(spec.path).embedding
                self.dimension = embedding.dimension if embedding is not None else None
                self.counter = _token_counter(spec.path)
        except Exception as e:
            reason = self.runtime_reason(e)
            if speculative:
                # 0.18.1 fails deep in executor creation (e.g. "embedding_lookup !=
                # nullptr") without naming the option that asked for it.
                reason += (
                    "; the engine was asked for speculative decoding (speculative_decoding ="
                    " true in the entry's [limits]), which this file may not support: remove"
                    " it or set it to false"
                )
            self.error(rid, self._code_for(reason), reason)
            return
        self.max_tokens = msg.get("max_tokens")
        seconds = time.perf_counter() - started
        self.template = self._template(spec)
        if spec.kind == "text":
            from modeld.engine.runner.generate import can_keep, sampler_defaults

            try:
                self.sampler_defaults = sampler_defaults(spec.path)
            except Exception:
                self.clear_error()
            # Kept conversations are bare sessions: only where plain jobs get those.
            if spec.kept_conversations > 0 and self.template is not None and can_keep(self.engine):
                self.kept = KeptConversations(spec.kept_conversations)
        warm_up = None
        if msg.get("warm_up"):
            try:
                warm_up = self._warm_up()
            except Exception as e:
                reason = self.runtime_reason(e)
                self.error(rid, self._code_for(reason), f"the warm-up generation failed: {reason}")
                return
        pss, rss = read_memory(os.getpid())
        created = Created(seconds, warm_up, pss, rss, self._options())
        self.send({"id": rid, **created.to_wire()})

    def _template(self, spec: Any) -> Any:
        """The conversation that renders plain jobs' prompts (``PlainSession``), or None.

        CPU text engines only: a GPU engine's sessions are not made while another lives,
        and a model that thinks gets its channels parsed by a conversation. A file whose
        template conversation cannot be made answers every job on a conversation of its own.
        """
        import litert_lm

        if spec.kind != "text" or spec.backend != "cpu":
            return None
        try:
            with litert_lm.ModelInfo(spec.path) as info:
                if info.llm is None or info.llm.supports_thinking():
                    return None
            return self.engine.create_conversation()
        except Exception:
            self.clear_error()
            return None

    def _warm_up(self) -> WarmUp:
        """One short generation, so that the first request does not pay the one-time costs.

        A GPU engine compiles its shaders and a CPU engine packs its weights and touches
        their pages at the first prefill and decode, not at ``Engine()``: a pinned engine
        that skips this makes its first user wait for all of that (docs/engines.md#warm-up-at-load).
        """
        started = time.perf_counter()
        if self.kind == "embedding":
            self.engine.compute_embedding(WARM_UP_PROMPT)
            seconds = time.perf_counter() - started
            return {"seconds": seconds, "prefill": seconds, "prompt_tokens": None, "tokens": 0}
        conversation = self.engine.create_conversation(max_output_tokens=WARM_UP_TOKENS)
        try:
            conversation.send_message(WARM_UP_PROMPT)
            info = None
            with contextlib.suppress(RuntimeError):
                info = conversation.get_benchmark_info()
        finally:
            conversation.close()
        prefill_tps = info.last_prefill_tokens_per_second if info else None
        prefill_tokens = info.last_prefill_token_count if info else 0
        return {
            "seconds": time.perf_counter() - started,
            "prefill": prefill_tokens / prefill_tps if prefill_tps else None,
            "prompt_tokens": prefill_tokens,
            "tokens": info.last_decode_token_count if info else None,
            "decode_tokens_per_second": info.last_decode_tokens_per_second if info else None,
        }

    def _options(self) -> dict[str, Any]:
        from modeld.modelfile.runtime import engine_options

        options = engine_options(self.engine)
        if self.kind == "embedding":
            options["embedding_dimension"] = self.dimension
        return options

    def stats(self) -> dict[str, Any]:
        """On the reader thread: the ``stats`` op's answer (see the module's docstring)."""
        pss, rss = read_memory(os.getpid())
        made = self.ready
        ready = made is not None and made[1].done()  # a conversation made ahead waits
        busy = self.current is not None or not self.jobs.empty() or self.tidying
        kept = self.kept
        return {
            "pss": pss,
            "rss": rss,
            "ready": ready,
            "busy": busy,
            "kept": len(kept) if kept is not None else 0,
            "settling": kept.waiting() if kept is not None else 0,
        }

    def accept(self, op: str, rid: Any, msg: dict[str, Any]) -> None:
        """On the reader thread: a ``generate``, ``count`` or ``embed`` frame, queued as its
        job or refused with the reason."""
        wanted = "embedding" if op == "embed" else "text"
        if self.engine is None:
            self.error(rid, "engine_error", f"{op} before create")
        elif self.kind != wanted:
            article = "an" if self.kind == "embedding" else "a"
            self.error(rid, "bad_request", f"{op} asked of {article} {self.kind} engine")
        elif not isinstance(rid, int):
            self.error(rid, "bad_request", f"a {op} frame needs an integer id")
        else:
            try:
                job = job_of(op, msg)
            except (ValueError, TypeError) as e:
                self.error(rid, "bad_request", f"a malformed {op} job: {e}")
                return
            self.enqueue(rid, job)

    def enqueue(self, rid: int, job: Job) -> None:
        """On the reader thread: ``job`` waits for the generate thread; while one runs, its
        conversation is made now."""
        self.jobs.put(Queued(rid, job))
        if self.current is not None:
            self.prepare_queued()

    def cancel(self, target: int) -> None:
        self.cancelled.add(target)
        with self.current_lock:
            if self.current is not None and self.current[0] == target:
                with contextlib.suppress(Exception):
                    self.current[1].cancel_process()

    def _work(self) -> None:
        while True:
            queued = self._next_job()
            if queued is None:
                return
            rid, job = queued
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                self.send_final(rid, Done(FINISH_CANCELLED))
                continue
            try:
                if isinstance(job, EmbedJob):
                    self._embed(rid, job)
                elif isinstance(job, CountJob):
                    self._count(rid, job)
                else:
                    self._generate(rid, job)
            except (BrokenPipeError, ConnectionError):
                return
            except Exception as e:
                reason = self.runtime_reason(e)
                message = generate_error_message(e, reason, job)
                self.error(rid, generate_error_code(e, reason), message)
            finally:
                self.tidying = False
                with self.current_lock:
                    left, self.current = self.current, None
                if left is not None:
                    # A job that failed half-way leaves its conversation open: close it here,
                    # on this thread, not whenever the collector gets to it.
                    with contextlib.suppress(Exception):
                        left[1].close()
                self.cancelled.discard(rid)

    # --- one generation, on the generate thread ---------------------------------------
    # ``send_message_async`` is a blocking generator over a queue filled by the runtime's
    # thread, so driving it from this thread keeps the socket reader free for ``cancel``.

    def _open(
        self, rid: int, kwargs: dict[str, Any], constrained: bool, key: tuple[Any, ...] | None
    ) -> tuple[Any, bool, bool]:
        """A conversation for ``rid``, registered so that ``cancel`` can reach it: the one
        made ahead for ``key`` when there is one (the last value: True), else one made now."""
        with self.ready_lock:
            ready, self.ready = self.ready, None
        # Waits for one still being made: the runtime would make ours after it anyway.
        made: Any = ready[1].result() if ready is not None else None
        reused = made is not None and key is not None and ready is not None and ready[0] == key
        conversation: Any = made if reused else None
        try:
            if conversation is None:
                if made is not None:
                    made.close()
                conversation = self.engine.create_conversation(**kwargs)
        except RuntimeError:
            if not constrained:
                raise
            # Constrained decoding needs the model's tokenizer support; fall back to plain.
            kwargs.pop("constrained_decoding_config")
            constrained = False
            conversation = self.engine.create_conversation(**kwargs)
        self._register(rid, conversation)
        return conversation, constrained, reused

    def _register(self, rid: int, conversation: Any) -> None:
        """Make ``conversation`` the one ``cancel`` reaches for ``rid``."""
        with self.current_lock:
            self.current = (rid, conversation)
        if rid in self.cancelled:
            conversation.cancel_process()

    def _open_session(self, rid: int, kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """A ``PlainSession`` for ``rid``, registered so that ``cancel`` can reach it: the one
        made ahead for it while the last job ran, if any (then True), else one made now."""
        from modeld.engine.runner.generate import PlainSession

        with self.ready_lock:
            ready = self.ready
            if ready is not None and ready[0] == _session_key(rid):
                self.ready = None
            else:
                ready = None
        session: Any = ready[1].result() if ready is not None else None
        reused = session is not None
        if session is None:
            session = PlainSession(self.engine, self.template, kwargs)
        self._register(rid, session)
        return session, reused

    def _reopen(
        self, rid: int, failed: Any, kwargs: dict[str, Any], constrained: bool
    ) -> tuple[Any, bool]:
        """A conversation made now for ``rid``, in place of ``failed`` (one whose reply the
        runtime refused): the reply is made again on it, and fails, if it does, with the
        runtime's own reason. The conversation and whether decoding is constrained."""
        self._close(failed)
        self.clear_error()
        conversation, constrained, _ = self._open(rid, kwargs, constrained, None)
        return conversation, constrained

    def _close(self, conversation: Any) -> None:
        """Close the job's conversation (or session) where ``cancel`` cannot reach it.

        ``cancel`` runs on the reader thread and calls ``cancel_process`` on ``current``; a
        client that leaves as its reply ends sends one while this thread closes it, and the
        runtime's cancel on a deleted conversation is a use after free (the runner died of
        SIGSEGV). Taken off ``current`` and closed under ``current_lock``, it is either
        cancelled before the close or not reached at all."""
        with self.current_lock:
            if self.current is not None and self.current[1] is conversation:
                self.current = None
            conversation.close()

    # --- conversations kept for their next turn (``modeld.engine.runner.kept``) ----------

    def _kept_for(
        self, job: GenerateJob, kwargs: dict[str, Any], last: Any
    ) -> tuple[Restart | None, Kept | None]:
        """Why ``job`` does not continue a kept conversation (None: it does), and the record
        of its session when that may be kept after the reply: the kept one it continues
        (its session set to prefill only what it does not hold yet), or one for a fresh
        session (no session yet; ``text``: its whole prompt, "" for one plain turn, which
        its session renders). Every check that fails leaves the job to the paths it had
        before."""
        from modeld.engine.runner.generate import prompt_of

        first = not has_reply(job.messages[:-1])
        why = self._unkeepable(job)
        if why is not None or self.kept is None or job.scope is None:
            return "first" if first else why, None
        found, why = (None, "first") if first else self.kept.take(job, job.scope)
        if found is None and job.session_plain():
            return why, Kept(None, "", (), 0, b"", b"", b"")
        try:
            prompt = prompt_of(self.engine, self.template, kwargs, last)
        except Exception:
            self.clear_error()
            prompt = ""
        if found is not None:
            if prompt and self._extends(found, prompt):
                return None, found
            self._drop([found])
            why = "prompt"
        return why, Kept(None, prompt, (), 0, b"", b"", b"") if prompt else None

    def _unkeepable(self, job: GenerateJob) -> Restart | None:
        """Why ``job``'s session could be neither continued nor kept; None: it could."""
        from modeld.engine.runner.generate import sampling

        if self.kept is None:
            return "off"
        if not job.session_turns():
            return "shape"
        if sampling(job.options, self.sampler_defaults) == "seeded":
            return "seeded"
        return "anonymous" if job.scope is None else None

    def _extends(self, kept: Kept, prompt: str) -> bool:
        """Whether ``prompt`` starts with what ``kept`` holds, token for token: then its
        session, sent the rest, holds what a fresh one would for the whole. On True, ``kept``
        is set to prefill the rest and says what it will hold."""
        rest = prompt[len(kept.text) :]
        if not rest or not prompt.startswith(kept.text):
            return False
        try:
            held = kept.ids or tuple(self.engine.tokenize(kept.text))
            ids = tuple(self.engine.tokenize(prompt))
            if ids != held + tuple(self.engine.tokenize(rest)):
                return False
        except Exception:
            self.clear_error()
            return False
        kept.text, kept.ids, kept.settle = prompt, ids, None
        kept.session.resume_at(rest)
        return True

    def _keep(
        self,
        kept: Kept,
        job: GenerateJob,
        last: Any,
        kwargs: dict[str, Any],
        reply: str,
        *,
        settle: bool,
    ) -> None:
        """After the final record: keep ``kept``'s session for the conversation's next turn,
        filed under its messages and ``reply`` as the app sends them back. ``settle``: the
        conversation has continued before, so its reply is to be prefilled into the
        checkpoint once the engine is idle (``_next_job``), for the next turn to prefill
        only its own text; else (or until then) the next turn prefills both. Anything that
        fails drops it."""
        assert self.kept is not None and job.scope is not None
        session = kept.session
        with self.current_lock:
            if self.current is not None and self.current[1] is session:
                self.current = None
        answer: Message = {"role": "assistant", "content": reply}
        # A fresh session's whole prompt, which it may have rendered itself.
        kept.text = kept.text or session.prompt
        try:
            if settle:
                preface = {k: v for k, v in kwargs.items() if k == "system_message"}
                kept.settle = (preface, [*kwargs.get("messages", ()), last, answer])
                kept.continued = True
            kept.root = root(job.scope)
            kept.history = chain(kept.root, (*job.messages, answer))[-1]
            kept.settings = settings_of(job)
            self._drop(self.kept.keep(kept))
        except Exception:
            self.clear_error()
            self._drop([kept])

    def _next_job(self) -> Queued | None:
        """The next job. While a kept conversation's reply waits to be settled and no job
        comes within ``SETTLE_AFTER``, it is settled (``_settle``): a client that sends its
        next turn at once gets it sooner with the reply prefilled along with its turn, in
        one prefill; one that pauses, as a reader does, finds it done."""
        while self.kept is not None and (kept := self.kept.unsettled()) is not None:
            try:
                return self.jobs.get(timeout=SETTLE_AFTER)
            except queue.Empty:
                self._settle(kept)
        return self.jobs.get()

    def _settle(self, kept: Kept) -> None:
        """Move ``kept``'s checkpoint past its reply: back to it (what the decode processed
        goes), the reply prefilled as the template renders it, a checkpoint there. Left
        where it was when the rendering does not extend what it holds, token for token;
        dropped when the runtime fails."""
        from modeld.engine.runner.generate import checkpoint, history_of, rewind

        assert self.kept is not None and kept.settle is not None
        (preface, messages), kept.settle = kept.settle, None
        self.tidying = True
        try:
            text = history_of(self.engine, preface, messages)
            rest = text[len(kept.text) :]
            if not rest or not text.startswith(kept.text):
                return
            held = kept.ids or tuple(self.engine.tokenize(kept.text))
            ids = tuple(self.engine.tokenize(text))
            if ids != held + tuple(self.engine.tokenize(rest)):
                return
            session = kept.session
            rewind(session.session, decoded=session.decoded)
            session.session.run_prefill([rest])
            checkpoint(session.session)
            session.decoded = False
            kept.text, kept.ids = text, ids
            kept.tokens += session.session.get_benchmark_info().last_prefill_token_count
        except Exception:
            self.clear_error()
            self.kept.discard(kept)
            self._drop([kept])
        finally:
            self.tidying = False

    def _kept_after(self, keep: bool) -> int:
        """How many conversations are kept once this job's session is (or is not)."""
        if self.kept is None:
            return 0
        return min(self.kept.limit, len(self.kept) + keep)

    def _drop(self, dropped: list[Kept]) -> None:
        for kept in dropped:
            with contextlib.suppress(Exception):
                kept.session.close()

    def _whole_reply(self, rid: int, conversation: Any, last: Any, **kw: Any) -> Any:
        """The reply message in one blocking call, or None when the runtime refused it.

        ``send_message`` is cheaper than ``send_message_async`` (no callback queue and no
        message object per token), and a non-streamed request's client sees nothing before
        the end anyway.
        """
        if rid in self.cancelled:
            return {"content": ""}
        try:
            return conversation.send_message(last, **kw)
        except RuntimeError:
            # Cancelled (the client left): nobody reads the text. Any other failure is retried
            # by the streaming path, which carries the runtime's own reason in its exception.
            return {"content": ""} if rid in self.cancelled else None

    def _embed(self, rid: int, job: EmbedJob) -> None:
        """One vector per input, in order, in one final record (nothing is streamed)."""
        import litert_lm

        started = time.perf_counter()
        self.clear_error()
        size = job.dimensions
        if size is not None and self.dimension is not None and size > self.dimension:
            raise ValueError(
                f"dimensions {size} is more than this model's {self.dimension}; ask for at "
                f"most {self.dimension}, or leave dimensions out"
            )
        options = litert_lm.EmbeddingOptions(output_size=size)
        batch = self.engine.compute_embedding_batch(list(job.inputs), options)
        vectors = [r.embedding for r in batch]
        seconds = time.perf_counter() - started
        # 0.18.1's embedding API reports no token counts: the file's tokenizer counts them.
        tokens = None if self.counter is None else self.counter.count(job.inputs)
        dimensions = len(vectors[0]) if vectors else size or self.dimension
        timings = RunnerTimings(prefill=seconds, embed=seconds)
        self.send_final(rid, Embedded(vectors, dimensions, timings, tokens))

    def _count(self, rid: int, job: CountJob) -> None:
        """The tokens the job's prompt takes, in one final record.

        A prompt of text is rendered with the model's template by a conversation made as the
        job's generation would make it (its system message, history and tools) and tokenized;
        the runtime puts the start token before every prompt it prefills, so that is one more
        (tests/engine/test_runner.py holds the count to the prefill's on the fixtures). A
        prompt with images is prefilled: an image's tokens are the vision encoder's.
        """
        from modeld.engine.runner.generate import conversation_args

        started = time.perf_counter()
        self.clear_error()
        kwargs, last, _, _ = conversation_args(job.job)
        for name in ("constrained_decoding_config", "sampler_config", "max_output_tokens"):
            kwargs.pop(name, None)
        images = any(
            isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
            for m in job.job.messages
        )
        if images:
            kwargs["max_output_tokens"] = 1
        conversation = self._conversation_beside_ready(kwargs)
        with self.current_lock:
            self.current = (rid, conversation)
        try:
            if images:
                conversation.send_message(last)
                tokens = conversation.get_benchmark_info().last_prefill_token_count
            else:
                prompt = conversation.render_message_to_string(last)
                if not prompt:
                    raise RuntimeError("the model's template rendered no prompt")
                start = 1 if self.engine.bos_token_id is not None else 0
                tokens = len(self.engine.tokenize(prompt)) + start
        finally:
            self._close(conversation)
        seconds = time.perf_counter() - started
        by: CountedBy = "prefilled" if images else "rendered"
        self.send_final(rid, Counted(int(tokens), by, RunnerTimings(generate=seconds)))

    def _conversation_beside_ready(self, kwargs: dict[str, Any]) -> Any:
        """A conversation made now; where the runtime refuses a second live one (a GPU
        engine), the one made ahead for the next job is closed first (it is made again)."""
        try:
            return self.engine.create_conversation(**kwargs)
        except RuntimeError:
            with self.ready_lock:
                ready, self.ready = self.ready, None
            if ready is None:
                raise
            _close_made(ready[1])
            self.clear_error()
            return self.engine.create_conversation(**kwargs)

    def _generate(self, rid: int, job: GenerateJob) -> None:  # noqa: PLR0912, PLR0915
        """Stream one reply for ``job`` to the parent, then a final record with timings.

        With ``"stream": false`` no token frame is sent: the final record carries the whole
        ``text`` (one frame, one wake-up of the daemon), and without stop strings the reply is
        made by one blocking call.
        """
        import litert_lm

        from modeld.engine.runner.generate import (
            StopFilter,
            calls_of,
            classify_json,
            conversation_args,
            stream_reply,
            text_of,
        )

        shape = job.shape
        streamed = shape.stream
        started = time.perf_counter()
        self.clear_error()
        kwargs, last, constrained, send_kwargs = conversation_args(job, self.sampler_defaults)
        # ``held``: the job's session may be kept after the reply; with a session already,
        # it continues a kept conversation (``restart`` None).
        restart, held = self._kept_for(job, kwargs, last)
        continued = held is not None and held.session is not None
        plain = self.template is not None and (held is not None or job.session_plain())
        key = None if plain else job.conversation_key()
        conversation: Any
        if held is not None and held.session is not None:
            conversation, reused = held.session, False
            self._register(rid, conversation)
        elif plain:
            conversation, reused = self._open_session(rid, kwargs)
            if held is not None:
                held.session = conversation
                conversation.prompt = held.text or conversation.prompt
                conversation.checkpointed = True
        else:
            conversation, constrained, reused = self._open(rid, kwargs, constrained, key)
        self.prepare_queued()
        if constrained:
            schema = shape.schema or {"type": "object"}
            send_kwargs["response_format"] = litert_lm.ResponseFormat.json(schema)
        stops = StopFilter(list(shape.stop))
        first_at: float | None = None
        chunks = 0
        text_parts: list[str] = []
        tool_calls: list[ToolCall] = []
        whole = None
        asked = time.perf_counter()
        if not streamed and not stops.stops:
            whole = self._whole_reply(rid, conversation, last, **send_kwargs)
            if whole is None:
                conversation, constrained = self._reopen(rid, conversation, kwargs, constrained)
                plain = False
        if whole is not None:
            text_parts.append(text_of(whole))
            tool_calls += calls_of(whole)
        else:

            def on_message(message: dict[str, Any]) -> bool:
                # On the runtime's thread, once per chunk: keep it short.
                nonlocal first_at, chunks
                if first_at is None:
                    first_at = time.perf_counter()
                chunks += 1
                if "tool_calls" in message:
                    tool_calls.extend(calls_of(message))
                piece = stops.feed(text_of(message))
                if piece:
                    text_parts.append(piece)
                    if streamed:
                        self.send_token(rid, piece)
                return stops.hit

            try:
                stream_reply(conversation, last, send_kwargs, on_message)
            except RuntimeError:
                if not plain or first_at is not None or rid in self.cancelled:
                    raise
                conversation, constrained = self._reopen(rid, conversation, kwargs, constrained)
                plain = False
                stream_reply(conversation, last, send_kwargs, on_message)
        tail = stops.flush()
        if tail:
            text_parts.append(tail)
            if streamed:
                self.send_token(rid, tail)
        ended = time.perf_counter()
        cancelled = rid in self.cancelled and not stops.hit
        info = None
        try:
            info = conversation.get_benchmark_info()
        except RuntimeError:
            info = None
        prefilled = info.last_prefill_token_count if info else 0
        if continued and not plain:
            # Its session failed before a token and a fresh conversation answered.
            continued, restart = False, "prompt"
        held_tokens = held.tokens if continued and held is not None else 0
        prefill_tokens = held_tokens + prefilled
        decode_tokens = info.last_decode_token_count if info else chunks
        max_out = job.options.max_tokens
        window = self.max_tokens
        finish: Finish
        if cancelled:
            finish = FINISH_CANCELLED
        elif stops.hit:
            finish = FINISH_STOP
        elif (max_out and decode_tokens >= int(max_out)) or (
            window and prefill_tokens + decode_tokens >= int(window)
        ):
            finish = FINISH_LENGTH
        else:
            finish = FINISH_STOP
        ttft = (first_at - started) if first_at is not None else None
        decode_seconds = (ended - first_at) if first_at is not None else 0.0
        prefill = (
            prefilled / info.last_prefill_tokens_per_second
            if info and info.last_prefill_tokens_per_second
            else None
        )
        if (
            whole is not None
            and prefill is not None
            and info
            and info.last_decode_tokens_per_second
        ):
            # One blocking call shows no first token: setup, prefill and one decode step.
            ttft = (asked - started) + prefill + 1 / info.last_decode_tokens_per_second
        timings = RunnerTimings(
            prefill=prefill,
            first_token=ttft,
            decode_tokens_per_second=(
                info.last_decode_tokens_per_second
                if info and info.last_decode_tokens_per_second
                else ((chunks - 1) / decode_seconds if chunks > 1 and decode_seconds > 0 else None)
            ),
            generate=ended - started,
        )
        made: Made | None = None
        if continued:
            made = "continued"
        elif plain:
            # A bare session answered (``PlainSession``), made ahead for the job or not.
            made = "none ready" if reused else "none"
        elif reused:
            made = "ready"
        text = "".join(text_parts)
        self.tidying = True
        # Kept only where the decode ended by itself: a session whose decode was cancelled
        # (a stop string, the client gone) is not one the runtime promises to go on with.
        keep = held is not None and plain and not cancelled and not stops.hit
        # No PSS here: reading smaps_rollup is slow on a big process, so the daemon measures
        # it from /proc off the request path.
        self.send_final(
            rid,
            Done(
                finish=finish,
                prompt_tokens=prefill_tokens,
                tokens=decode_tokens,
                timings=timings,
                constrained=constrained,
                text=None if streamed else text,
                tool_calls=tuple(tool_calls),
                json=(
                    classify_json(text, finish, shape.schema if shape.strict else None)
                    if shape.constrained
                    else None
                ),
                conversation=made,
                stop_sequence=stops.matched if stops.hit else None,
                continued_tokens=held_tokens,
                restart=restart,
                kept=self._kept_after(keep),
            ),
        )
        # After the final record, not before: closing or keeping is the runner's business,
        # not the client's wait (the next job runs on this same thread, so it starts after).
        if keep and held is not None:
            held.tokens += prefilled
            self._keep(held, job, last, kwargs, text, settle=continued)
        else:
            self._close(conversation)
        if key is not None and not cancelled:
            self._prepare_next(key, job)

    def _prepare_next(self, key: tuple[Any, ...], job: GenerateJob) -> None:
        """Make the next job's conversation now, while the engine is idle: a client sends
        its requests alike, and making one is a noticeable part of a short reply's time.
        Not when a job already waits (``prepare_queued`` made its own). Its arguments are
        made afresh: a job that names no seed drew a random one, which the next job must not
        get again."""
        from modeld.engine.runner.generate import conversation_args

        if self.jobs.empty():
            self._prepare(key, conversation_args(job, self.sampler_defaults)[0])

    def prepare_queued(self) -> None:
        """While a job runs, make the conversation of the job waiting next, so that it
        starts the moment this one ends (its first token comes sooner after its turn by the
        runtime's time to make one), as ``_ahead_during_decode`` allows; for a job answered
        on a bare session, its ``PlainSession`` with the prompt rendered. On the reader
        thread when a job comes, and on the generate thread when one starts: whichever sees
        it first. The look at the queue and the claim of the
        slot are one step under ``ready_lock``, which ``_open`` and ``_open_session`` take
        too: a job taken off the queue meanwhile finds what was made for it, never what
        was made for a job gone. One made ahead for other settings is closed."""
        from modeld.engine.runner.generate import conversation_args

        with self.ready_lock:
            with self.jobs.mutex:
                waiting = self.jobs.queue[0] if self.jobs.queue else None
            if waiting is None or not isinstance(waiting.job, GenerateJob):
                return
            wid, job = waiting.rid, waiting.job
            policy = self.ahead_during_decode
            if policy == "none" or (policy == "streamed" and not job.shape.stream):
                return
            if wid in self.cancelled:
                return
            try:
                if self.template is not None and job.session_plain():
                    # Answered on a bare session: made, its prompt rendered, ahead.
                    key = _session_key(wid)
                    make: Callable[[], Any] = functools.partial(
                        self._make_plain,
                        conversation_args(job, self.sampler_defaults)[0],
                        job.messages[0],
                    )
                else:
                    settings = job.conversation_key()
                    if settings is None:
                        return
                    key = settings
                    make = functools.partial(
                        self._make, conversation_args(job, self.sampler_defaults)[0]
                    )
            except Exception:
                return  # the job fails with the reason when its turn comes, alone
            if self.ready is not None:
                if self.ready[0] == key:
                    return
                # The one worker runs this after the stale one is made.
                self.ahead.submit(_close_made, self.ready[1])
            self.ready = (key, self.ahead.submit(make))

    def _prepare(self, key: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with self.ready_lock:
            if self.ready is None:
                self.ready = (key, self.ahead.submit(self._make, kwargs))

    def _make_plain(self, kwargs: dict[str, Any], turn: Any) -> Any:
        """On the ``ahead`` thread: a ``PlainSession`` with its prompt rendered, or None (the
        job makes its own, and says why if that fails too)."""
        from modeld.engine.runner.generate import PlainSession

        try:
            return PlainSession(self.engine, self.template, kwargs, turn)
        except Exception:
            self.clear_error()
            return None

    def _make(self, kwargs: dict[str, Any]) -> Any:
        """On the ``ahead`` thread: a conversation, or None (the job makes its own, and says
        why if that fails too)."""
        try:
            return self.engine.create_conversation(**kwargs)
        except Exception:
            self.clear_error()
            return None


def _session_key(rid: int) -> tuple[Any, ...]:
    """The ``ready`` key of a bare session made ahead for the waiting job ``rid``."""
    return ("session", rid)


def _close_made(made: Future[Any]) -> None:
    """On the ``ahead`` thread: close a conversation made ahead that no job will take."""
    conversation = made.result()
    if conversation is not None:
        conversation.close()


def child_main(fd: int, parent_pid: int) -> int:
    die_with_parent(parent_pid)
    # A terminal's Ctrl-C goes to the daemon, which stops runners in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    child = _Child(sock)
    started = time.perf_counter()
    # Loading the runtime (a large library) now is what makes a spare runner worth keeping.
    import litert_lm  # noqa: F401

    child._bind_errors()
    child.worker.start()
    child.send(
        {
            "op": "hello",
            "pid": os.getpid(),
            "preload_seconds": time.perf_counter() - started,
        }
    )
    while True:
        header = _recv_exact(sock, _HEADER.size)
        if header is None:
            break
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME:
            break
        body = _recv_exact(sock, length)
        if body is None:
            break
        msg = decode_body(body)
        op = msg.get("op")
        rid = msg.get("id")
        if op == "create":
            child.create(msg)
        elif op in ("generate", "embed", "count"):
            child.accept(op, rid, msg)
        elif op == "cancel":
            child.cancel(int(msg.get("target", -1)))
        elif op == "stats":
            child.send({"id": rid, "ok": True, **child.stats()})
        elif op == "close":
            running = child.current  # the generate thread may clear it meanwhile
            if running is not None:
                child.cancel(running[0])
            child.send({"id": rid, "ok": True})
            break
        else:
            child.error(rid, "bad_request", f"unknown op {op!r}")
    # Engine teardown has crashed in some runtime builds and frees nothing useful: the
    # process is about to go, so its memory returns to the system anyway.
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modeld.engine.runner.child")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    return child_main(args.fd, args.parent)


if __name__ == "__main__":
    sys.exit(main())
