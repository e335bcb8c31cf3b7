"""Conversations that continue (issue 35): the first token of each turn of a growing chat.

One chat of ``--turns`` turns, the whole history sent with each turn as chat apps send it
(streamed ``/v1/chat/completions``, temperature 0, ``--reply-tokens`` tokens a reply), each
user turn about ``--turn-tokens`` tokens of text. Three contenders, one after the other:

(a) modeld with ``MODELD_KEPT_CONVERSATIONS=4`` (the default): each turn after the first
    continues the conversation the engine kept after the last reply;
(b) modeld with ``MODELD_KEPT_CONVERSATIONS=0``: each turn prefills the whole history;
(c) direct in-process ``litert_lm``: the same user turns sent to one runtime conversation
    that keeps its state (``send_message_async``, first chunk), as an app that holds its
    conversation would.

Each daemon loads the model and answers one short warm-up request before the chat (the
load is not the turn's). Figures are client-side seconds from the request to the first
content chunk, medians over ``--rounds`` chats; ratios are against each contender's own
first turn, and (a) against (c). (a) and (b) must give the same replies (greedy): the
script says whether they did. At the end: the goal (issue 35, the 10th turn's first token
at most 1.3 times the first's, with reuse), the engine's PSS at the end of (a) and (b)
(one conversation kept, or none), and ``ps``'s turn counts.

Usage: ``nice python bench/bench_continue.py [--model PATH] [--turns 10] [--rounds 1]``;
the default model is tests/models/tiny-text-long.litertlm (a 1,280-token window: the chat
is scaled down to fit it unless told otherwise); a real-size file from the cache
(``~/.cache/modeld-test-models``) takes ``--turn-tokens 130 --reply-tokens 16``: a random
model's reply, rendered as text, takes several times its decoded tokens, so 16 of them
bring the history to about 2,000 tokens by the tenth turn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_serve import UnixHTTPConnection  # noqa: E402

from modeld.config import default_cpu_threads  # noqa: E402
from tests.support.daemon import DaemonProcess, daemon_env  # noqa: E402
from tests.support.state import install_fixture  # noqa: E402
from tests.support.unix import unix_request  # noqa: E402

MODEL = REPO / "tests" / "models" / "tiny-text-long.litertlm"
GOAL = 1.3
SYSTEM = "You are a helpful assistant. Answer the user's questions in plain words."
WORDS = [
    *("the", "sea", "river", "mountain", "city", "light", "morning", "evening", "story"),
    *("history", "people", "music", "garden", "winter", "summer", "journey", "question"),
    *("answer", "reason", "window", "letter", "friend", "market", "harbor", "island"),
    *("forest", "machine", "language", "number", "voice", "memory", "travel", "bread"),
]


@dataclass
class Turn:
    first: float  # seconds to the first content chunk
    text: str
    prompt_tokens: int


def user_turns(engine: Any, turns: int, tokens: int, seed: int) -> list[str]:
    """``turns`` user messages of about ``tokens`` tokens each (the engine's tokenizer)."""
    rng = random.Random(seed)
    out = []
    for n in range(turns):
        words = [f"Question {n + 1}:"]
        while len(engine.tokenize(" ".join(words))) < tokens:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words) + "?")
    return out


def chat_turn(sock: Path, model: str, messages: list[dict[str, Any]], tokens: int) -> Turn:
    doc = {
        "model": model,
        "messages": messages,
        "max_completion_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = UnixHTTPConnection(str(sock))
    try:
        began = time.perf_counter()
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(doc), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        first = None
        parts: list[str] = []
        prompt_tokens = 0
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - began
                    parts.append(piece)
            if chunk.get("usage"):
                prompt_tokens = int(chunk["usage"]["prompt_tokens"])
        return Turn(first or float("nan"), "".join(parts), prompt_tokens)
    finally:
        conn.close()


def engine_doc(sock: Path) -> dict[str, Any]:
    status, doc = unix_request(sock, "GET", "/api/engines")
    assert status == 200, doc
    (engine,) = doc["engines"]
    return dict(engine)


@dataclass
class Contender:
    name: str
    kept: int  # MODELD_KEPT_CONVERSATIONS; -1: direct runtime calls
    pause: float = 0.0  # seconds between a reply and the next turn


def daemon_chat(
    root: Path, model_id: str, who: Contender, threads: int, prompts: list[str], tokens: int
) -> tuple[list[Turn], dict[str, Any]]:
    """One chat through a fresh daemon keeping ``who.kept`` conversations, ``who.pause``
    seconds between a reply and the next turn: its turns, and its engine as ``ps`` shows
    it at the end."""
    home = root / "home"
    d = DaemonProcess(
        home=home,
        env=daemon_env(
            home,
            MODELD_REGISTRY=str(root / "registry"),
            MODELD_LOG_LEVEL="warning",
            MODELD_KEEP_ALIVE="-1",
            MODELD_CPU_THREADS=str(threads),
            MODELD_KEPT_CONVERSATIONS=str(who.kept),
        ),
    )
    d.start_quick()
    try:
        # The load and the first generation's one-time costs, apart from the chat.
        chat_turn(d.socket, model_id, [{"role": "user", "content": "Hello."}], 4)
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        turns: list[Turn] = []
        for prompt in prompts:
            if turns:
                time.sleep(who.pause)  # a reader's pause: the reply is prefilled meanwhile
            messages.append({"role": "user", "content": prompt})
            turn = chat_turn(d.socket, model_id, messages, tokens)
            messages.append({"role": "assistant", "content": turn.text})
            turns.append(turn)
            progress(who.name, turn)
        return turns, engine_doc(d.socket)
    finally:
        d.stop()


def direct_chat(engine: Any, prompts: list[str], tokens: int) -> list[Turn]:
    """The same user turns sent to one runtime conversation that keeps its state."""
    import litert_lm

    conversation = engine.create_conversation(
        system_message=SYSTEM,
        max_output_tokens=tokens,
        sampler_config=litert_lm.SamplerConfig(top_k=1, temperature=0.0, seed=1),
    )
    turns = []
    try:
        for prompt in prompts:
            began = time.perf_counter()
            first = None
            parts = []
            for message in conversation.send_message_async(prompt):
                first = first or time.perf_counter() - began
                data = message.to_json() if hasattr(message, "to_json") else message
                content = data.get("content")
                if isinstance(content, list):
                    parts += [str(c.get("text", "")) for c in content if isinstance(c, dict)]
            turns.append(Turn(first or float("nan"), "".join(parts), conversation.token_count))
            progress("direct", turns[-1])
    finally:
        conversation.close()
    return turns


def progress(name: str, turn: Turn) -> None:
    print(f"  {name}: {turn.prompt_tokens} tokens, first {turn.first:.3f} s", file=sys.stderr)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=None, help="tokens a user turn")
    parser.add_argument("--reply-tokens", type=int, default=None, help="max tokens a reply")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=default_cpu_threads())
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="also run the kept contender with this many seconds between turns",
    )
    args = parser.parse_args()
    import litert_lm

    from modeld.modelfile.runtime import CreateSpec, create_engine

    model: Path = args.model.expanduser().resolve()
    with litert_lm.ModelInfo(str(model)) as info:
        window = int(info.max_context_tokens or 1280)
    # What fits the window: the history grows by a turn and a reply each turn, and a reply
    # of random weights' tokens takes more tokens again once rendered as text.
    room = (window - 200) // args.turns
    turn_tokens = args.turn_tokens or min(130, room * 2 // 5)
    reply_tokens = args.reply_tokens or min(64, room // 4)
    model_id = "bench-continue"
    print(
        f"model {model.name} ({model.stat().st_size / 1e6:.0f} MB, window {window}), "
        f"{args.threads} CPU thread(s), {platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; {args.turns} turns of ~{turn_tokens} tokens, "
        f"replies of {reply_tokens} tokens at most, temperature 0; {args.rounds} round(s)"
    )
    contenders = [Contender("kept", 4)]
    if args.pause:
        contenders.append(Contender(f"kept, {args.pause:g} s pauses", 4, args.pause))
    contenders += [Contender("none", 0), Contender("direct", -1)]
    runs: dict[str, list[list[Turn]]] = {c.name: [] for c in contenders}
    engines: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mdc-", dir="/tmp") as tmp:
        root = Path(tmp)
        install_fixture(root / "home", model_id, model, registry=root / "registry")
        spec = CreateSpec(
            path=str(model),
            backend="cpu",
            cache_dir=str(root / "direct-cache"),
            max_tokens=window,
            threads=args.threads,
        )
        for n in range(args.rounds):
            engine = create_engine(spec)
            try:
                prompts = user_turns(engine, args.turns, turn_tokens, seed=n)
                # The direct engine's own one-time costs, apart from the chat.
                warm = engine.create_conversation(max_output_tokens=4)
                warm.send_message("Hello.")
                warm.close()
                runs["direct"].append(direct_chat(engine, prompts, reply_tokens))
            finally:
                engine.close()
            for who in contenders:
                if who.kept >= 0:
                    turns, engines[who.name] = daemon_chat(
                        root, model_id, who, args.threads, prompts, reply_tokens
                    )
                    runs[who.name].append(turns)
    report(args.turns, runs, engines)


def report(
    turns: int, runs: dict[str, list[list[Turn]]], engines: dict[str, dict[str, Any]]
) -> None:
    """The per-turn table, the goal, the equality of the replies, the engines at the end."""
    firsts = {
        name: [med([r[i].first for r in rounds]) for i in range(turns)]
        for name, rounds in runs.items()
    }
    names = list(runs)
    print("\nfirst token (s), and its ratio to the contender's own first turn:")
    print(f"{'turn':>4} {'prompt':>7}  " + "  ".join(f"{n:>22}" for n in names))
    for i in range(turns):
        cells = [f"{firsts[n][i]:>13.3f} {firsts[n][i] / firsts[n][0]:>7.2f}x" for n in names]
        print(f"{i + 1:>4} {runs['none'][0][i].prompt_tokens:>7}  " + "  ".join(cells))
    last = turns - 1
    for name in names:
        ratio = firsts[name][last] / firsts[name][0]
        against = firsts[name][last] / firsts["direct"][last]
        verdict = "met" if ratio <= GOAL else "NOT met"
        print(
            f"{name}: turn {turns}'s first token {ratio:.2f}x turn 1's (goal <= {GOAL}x: "
            f"{verdict}); {against:.2f}x direct calls' turn {turns}"
        )
    for name in names:
        if name in ("none", "direct"):
            continue
        same = all(
            [t.text for t in a] == [t.text for t in b]
            for a, b in zip(runs[name], runs["none"], strict=True)
        )
        print(f"replies of {name!r} equal replies without reuse: {'yes' if same else 'NO'}")
    for name, e in engines.items():
        pss = f"{e['pss'] / 2**20:.1f} MiB" if e["pss"] else "not measured"
        print(f"engine ({name}) at the end: PSS {pss}; {json.dumps(e['conversations'])}")


if __name__ == "__main__":
    main()
