"""Which mirror fetches which piece: the shared piece queue, mirror choice and the endgame.

Pieces are whole blocks and sit in one queue in file order. The fastest mirror (per
connection) takes the queue's front, so the prefix hasher follows it closely. A near-best
slower mirror takes pieces off the queue's BACK: the two meet somewhere before the end, and
all the prefix hasher has left to catch up on at the end is the slower mirror's small region
(not everything written past a piece it held early in the file). Whatever a slower mirror
holds at the hash front (an early misjudged rate, a probe, a stall) is moved to the best
mirror at once: the slow one keeps only the block it is on, or loses the piece when even
that block would take it long; a connection of the best mirror that lags at the hash front
hands its rest to a fresh one. Pieces off the front are staggered, each cut to end a step
after the one before it, so the prefix grows a piece at a time rather than eight at once.
Near the end of the queue pieces taper to an even share per connection, so the connections
end close together. When the queue is empty (endgame), idle connections split in-flight
pieces at a block boundary so both parts end together, or take over their last block: on a
faster mirror, or over a fresh connection to the piece's own mirror when its connection has
been held up for a second; a healthy piece is left alone (the split would close a connection
with full socket buffers). While pieces are queued, a piece silent for a second is given up
when another mirror is ready.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from modeld.download.mirrors import Mirror, MirrorState
from modeld.download.rangeio import RangeConn

# Blocks in the first piece a mirror gets (its probe piece, which measures it). A single
# block is no measure: socket buffers hand over the first megabytes of any answer at once,
# so a slow mirror measured on one block was taken for the best mirror and given the file's
# front (the hash front) until its live rate showed (docs/benchmarks.md#mirrors-and-scheduling).
PROBE_BLOCKS = 4
# A piece silent this long counts as stalled for the endgame (its rate is 0), long before the
# stall timeout.
SILENT = 1.0
# A piece at the hash front is moved to a faster mirror only when the one holding it would
# need longer than this for it (shorter waits cost the hasher less than a restarted block).
FRONT_WAIT = 0.1
# A piece at the hash front that has run this long below half its own mirror's rate gives
# its rest to a fresh connection to that mirror. Not judged sooner: a fresh answer's first
# bytes come late, and each new connection would look slow in turn.
LAG = 0.25


@dataclass(eq=False)
class Piece:
    """``[start, end)`` of the file; ``pos`` is the next byte to fetch (block aligned at start)."""

    start: int
    end: int
    pos: int
    mirror: Mirror | None = None
    began: float = 0.0
    got: int = 0  # bytes received on the current attempt
    abandoned: bool = False
    stream: bool = False  # a plain GET from byte 0 (a mirror without ranges)
    resp: aiohttp.ClientResponse | None = None  # the open answer, closed on a takeover
    raw: RangeConn | None = None  # or the raw reader's connection, closed on a takeover
    crc: int = 0  # CRC-32 of [start of pos's block, pos): a piece may resume mid-block
    # The mirror that sent [start of pos's block, pos) when ``pos`` is mid-block: another
    # mirror restarts the block from its start, so each block's bytes come from one mirror
    # (the one its journal row names, which repair suspects).
    src: str | None = None
    marked: int = 0  # ``pos`` when the piece was last journaled in part (its mark)
    # A mirror's first piece (its probe): its size. The mirror's rate is measured once, over
    # the whole of it; not at all when it was cut short (a burst alone is no measure).
    probe: int = 0
    window: int = 0  # bytes not yet counted into the mirror's rate, since window_start
    window_start: float = 0.0
    last: float = 0.0  # when its last bytes came (or it began)

    def rate(self) -> float:
        """Bytes per second since the piece began; 0 once it has been silent for ``SILENT``
        seconds (a piece that stalled near its end keeps a high average for long)."""
        now = time.monotonic()
        if self.last and now - self.last > SILENT:
            return 0.0
        elapsed = now - self.began
        return self.got / elapsed if elapsed > 0 else 0.0


# A site cache in one of these states may still serve ranges: its origins wait for it.
_SERVING = frozenset({MirrorState.NEW, MirrorState.PROBING, MirrorState.OK, MirrorState.BACKOFF})


class Schedule:
    """The piece queue, the pieces in flight, and the choice of the next (mirror, piece)."""

    def __init__(
        self,
        *,
        size: int,
        block_size: int,
        piece_size: int,
        mirrors: list[Mirror],
        done: bytearray,
        connections: int = 1,
    ) -> None:
        self.size = size
        self.connections = connections
        self.block_size = block_size
        self.piece_blocks = max(1, piece_size // block_size)
        self.mirrors = mirrors
        self.done = done
        self.nblocks = len(done)
        self.prefix_blocks = 0  # blocks [0, prefix_blocks) are done: the hashable prefix
        # Blocks written in part before a resume (journaled marks, CRC-checked): block index
        # -> (bytes from its start, their CRC-32, the mirror that sent them). Used once, by
        # the first plan.
        self.partial: dict[int, tuple[int, int, str]] = {}
        # Of those, the ones whose bytes no piece has fetched again yet: block -> bytes kept.
        self.kept_marks: dict[int, int] = {}
        self.queue: deque[Piece] = deque()
        self.inflight: set[Piece] = set()
        self.splits = 0  # in-flight pieces split with a faster mirror
        self.takeovers = 0  # in-flight blocks taken over by a faster mirror
        self.front_moves = 0  # of those, moves of the piece holding the hash front
        self.last_front: Piece | None = None  # the piece last taken off the queue's front
        # Called once, with the site caches, when the origins behind them first get work.
        self.on_fallback: Callable[[list[Mirror]], None] | None = None
        self._fell_back = False

    def block_range(self, idx: int) -> tuple[int, int]:
        start = idx * self.block_size
        return start, min(self.size, start + self.block_size)

    def _plan(self) -> None:
        """Queue runs of missing blocks as pieces of at most ``piece_blocks`` blocks; a block
        written in part before a resume starts a piece, at its first byte missing."""
        partial, self.partial = self.partial, {}
        if partial:
            self.kept_marks = {i: length for i, (length, _, _) in partial.items()}
        i = 0
        while i < self.nblocks:
            if self.done[i]:
                i += 1
                continue
            j = i + 1
            while (
                j < self.nblocks
                and not self.done[j]
                and j not in partial
                and j - i < self.piece_blocks
            ):
                j += 1
            start, end = i * self.block_size, min(self.size, j * self.block_size)
            piece = Piece(start, end, start)
            if i in partial:
                length, crc, src = partial[i]
                piece.pos, piece.crc, piece.src = start + length, crc, src
            self.queue.append(piece)
            i = j

    def _abandon(self, p: Piece) -> None:
        """Stop fetching ``p`` (taken over, or no longer needed): close its connection now."""
        p.abandoned = True
        self.inflight.discard(p)
        if p.resp is not None:
            p.resp.close()  # its reader wakes with an error that is not held against the mirror
        if p.raw is not None:
            p.raw.abort()

    def in_play(self) -> list[Mirror]:
        """The mirrors work may go to: the origins behind a site cache only once no cache
        can serve ranges any more (dropped, banned, or one that ignores Range)."""
        if not any(m.fallback for m in self.mirrors):
            return self.mirrors
        front = [m for m in self.mirrors if not m.fallback]
        if any(m.state in _SERVING for m in front):
            return front
        if not self._fell_back:
            self._fell_back = True
            if self.on_fallback is not None:
                self.on_fallback([m for m in front if m.via is not None])
        return self.mirrors

    # --- rates -------------------------------------------------------------------------

    def _rate(self, m: Mirror) -> float | None:
        """Per-connection rate, lowered to what its pieces in flight get now (a stalled
        mirror's past rate must not keep attracting work)."""
        if m.conn_rate is None:
            return None
        now = time.monotonic()
        live = [p.rate() for p in self.inflight if p.mirror is m and now - p.began > 0.5]
        rate = min(m.conn_rate, max(live)) if live else m.conn_rate
        # A piece that got no bytes yet measures 0: the scheduler divides by rates, so a
        # stalled mirror counts as very slow (the floor below), never as infinitely slow.
        return max(rate, 1.0)

    def _rates(self) -> tuple[list[Mirror], dict[int, float]]:
        """The mirrors ready for a range request now, and the measured ones' rates."""
        now = time.monotonic()
        ready = [m for m in self.in_play() if m.usable and m.ranges and m.not_before <= now]
        return ready, {id(m): r for m in ready if (r := self._rate(m)) is not None}

    def _remaining(self) -> int:
        """Bytes not yet received: queued pieces plus the rest of those in flight."""
        left = sum(p.end - p.pos for p in self.queue)
        return left + sum(p.end - p.pos for p in self.inflight if not p.abandoned)

    def _time_left(self, exclude: Mirror) -> float:
        """How long the other mirrors would take for everything left (inf when unmeasured)."""
        rate = sum(m.current_speed() for m in self.mirrors if m is not exclude and m.usable)
        return self._remaining() / rate if rate > 0 else float("inf")

    # --- the queue ---------------------------------------------------------------------

    def _take(self, front: bool, blocks: int | None = None) -> Piece:
        """A piece off the queue's front (file order) or back, cut to ``blocks`` blocks."""
        piece = self.queue[0] if front else self.queue[-1]
        bs = self.block_size
        first = piece.pos // bs
        last = -(-piece.end // bs)
        if blocks is None or last - first <= blocks:
            if front:
                self.queue.popleft()
            else:
                self.queue.pop()
            return piece
        if front:
            cut = (first + blocks) * bs
            self.queue[0] = Piece(cut, piece.end, cut)
            return Piece(piece.pos, cut, piece.pos, crc=piece.crc, src=piece.src)
        cut = (last - blocks) * bs
        self.queue[-1] = Piece(piece.start, cut, piece.pos, crc=piece.crc, src=piece.src)
        return Piece(cut, piece.end, cut)

    def _front(self) -> Piece:
        """The next piece off the queue's front, staggered, and tapered near the end.

        Staggered: a piece is cut so that it ends a step (``piece_blocks / connections``
        blocks) after the piece taken off the front before it, at most a whole piece. The
        connections then end their pieces one after another, in file order, and the prefix
        hasher gets a piece every step. Pieces of one size, taken all at once (the start,
        after the probe), ended together: the prefix jumped by eight pieces at a time, and
        the hasher sat idle between the jumps with much left to do after the last byte
        (docs/benchmarks.md#mirrors-and-scheduling). From the second round on the stagger
        holds by itself: a connection takes its next piece a step after the one before it
        did, and a whole piece ends a step after.

        Tapered: once the queue holds less than two pieces per connection, a piece is at
        most half an even share of what is left per connection (at least a block). The
        connections then end close together, and the endgame has little to split: a split
        closes a connection whose socket buffers are full, and the server counts those bytes
        as sent. Half a share, not a whole one: pieces taken later then end later, so the
        hash front passes each piece as it ends (with whole shares every piece ended at
        once, and the hasher had everything above the oldest one left to do after the last
        byte)."""
        bs = self.block_size
        left = sum(p.end - p.pos for p in self.queue)
        share = -(-left // (2 * self.connections * bs))
        blocks = min(share, self._stagger())
        head = self._head(blocks)
        # The last piece queued goes whole when it is at most half a share longer (no sliver
        # left behind; before it, a sliver joins the next piece, ``_head``).
        length = -(-head.end // bs) - head.pos // bs
        if len(self.queue) == 1 and 2 * length <= 3 * blocks:
            piece = self._take(front=True)
        else:
            piece = self._take(front=True, blocks=blocks)
        self.last_front = piece
        return piece

    def _head(self, blocks: int) -> Piece:
        """The queue's head, joined with the pieces queued right after it (in the file and
        the queue) while it is shorter than ``blocks``: a stagger step is not lost to the
        remnant of a piece cut before."""
        bs = self.block_size
        head = self.queue[0]
        while len(self.queue) > 1 and -(-head.end // bs) - head.pos // bs < blocks:
            nxt = self.queue[1]
            if nxt.start != head.end or nxt.pos != nxt.start:
                break
            del self.queue[1]
            head = Piece(head.start, nxt.end, head.pos, crc=head.crc, src=head.src)
            self.queue[0] = head
        return head

    def _stagger(self) -> int:
        """Blocks for the next front piece to end a step after the last one taken off the
        front (the same mirror's connections fetch at about the same rate)."""
        prev = self.last_front
        step = max(1, self.piece_blocks // self.connections)
        if prev is None or prev.abandoned or prev.pos >= prev.end:
            return step
        bs = self.block_size
        return min(self.piece_blocks, -(-prev.end // bs) - prev.pos // bs + step)

    def _next_piece(self) -> tuple[Mirror, Piece] | None:
        """The next (mirror, piece) for a free connection, if any.

        A mirror not measured yet gets one connection and a probe piece of ``PROBE_BLOCKS``
        blocks (off the back unless it is the primary), measured as a whole. Otherwise the
        piece holding the hash front is moved off a slower mirror first (``_free_front``);
        then the fastest mirror per connection takes the queue's front. A mirror more than
        twice slower per connection gets no more work (the endgame takes over what it
        holds); a near-best one gets the back (``_spread``).
        """
        if not self.queue:
            return None
        ready, rates = self._rates()
        for m in ready:
            if m.conn_rate is None and m.active == 0:
                front = m is ready[0] and m.primary
                piece = self._take(front=front, blocks=min(PROBE_BLOCKS, self.piece_blocks))
                piece.probe = piece.end - piece.pos
                if front:
                    self.last_front = piece
                return m, piece
        measured = [m for m in ready if id(m) in rates]
        if not measured:
            return None  # only probes in flight: wait for a rate
        best = max(measured, key=lambda m: rates[id(m)])
        best_rate = rates[id(best)]
        moved = self._free_front(best, best_rate)
        if moved is not None:
            return moved
        # A slower mirror is worth a connection only while it is near the best per connection.
        others = [m for m in measured if m is not best and rates[id(m)] > 0.5 * best_rate]
        return self._spread(best, others)

    def _spread(self, best: Mirror, others: list[Mirror]) -> tuple[Mirror, Piece]:
        """Best mirror at the front, or a near-best one, with fewer connections per unit of
        rate, at the back; its piece cut to what it can fetch before the others would
        finish everything else."""
        best_rate = best.conn_rate or 1.0
        head = self.queue[0]
        if not others or (len(self.queue) == 1 and head.end - head.pos <= self.block_size):
            return best, self._front()
        slower = min(others, key=lambda m: m.active / (m.conn_rate or 1.0))
        rate = slower.conn_rate or 1.0
        if slower.active / rate >= best.active / best_rate:
            return best, self._front()
        left = self._time_left(slower)
        if left == float("inf"):  # the others' speed is not known yet: no bet on the slower
            return best, self._front()
        # At most half the time the others need for everything left, so it ends well before.
        blocks = int(min(0.5 * left * rate, self.piece_blocks * self.block_size) // self.block_size)
        if blocks < 1:
            return best, self._front()
        return slower, self._take(front=False, blocks=blocks)

    # --- moving work off slow connections ------------------------------------------------

    def _free_front(self, best: Mirror, rate_f: float) -> tuple[Mirror, Piece] | None:
        """Hash-front priority: the in-flight piece holding the prefix, when on a mirror
        that would finish it later than ``best`` could, is moved to ``best`` now (not only
        in the endgame): its holder keeps just the block it is on, or loses the piece when
        even that block would keep the hasher waiting.

        On ``best`` itself, a piece whose connection has run below half the mirror's rate
        for ``LAG`` seconds (a connection that lost its share, at the server or in the
        loop) gives the rest, past the block it is on, to a fresh connection. Otherwise
        the prefix waited on it while the other connections went on, and what was written
        above it was hashed after the last byte (docs/benchmarks.md#mirrors-and-scheduling)."""
        bs = self.block_size
        now = time.monotonic()
        front = self.prefix_blocks
        for p in self.inflight:
            if p.abandoned or p.stream or p.mirror is None:
                continue
            if p.pos // bs != front or now - p.began < 0.05 or p.pos >= p.end:
                continue
            rate_s = max(p.rate(), 1.0)
            cut = min(p.end, (front + 1) * bs)
            if p.mirror is best:
                if now - p.began < LAG or rate_s >= 0.5 * rate_f or cut >= p.end:
                    return None
            else:
                t_block = (cut - p.pos) / rate_s
                if t_block > FRONT_WAIT and t_block > 2 * (cut - front * bs) / rate_f:
                    self._abandon(p)
                    self.takeovers += 1
                    self.front_moves += 1
                    return best, Piece(front * bs, p.end, front * bs)
            t_rest = (p.end - cut) / rate_s
            if cut < p.end and t_rest > FRONT_WAIT and t_rest > 2 * (p.end - cut) / rate_f:
                new = Piece(cut, p.end, cut)
                p.end = cut
                self.splits += 1
                self.front_moves += 1
                return best, new
            return None
        return None

    def _rescue(self) -> None:
        """While pieces wait in the queue, or while no connection is free, a piece silent
        for ``SILENT`` seconds is given up when another mirror is ready: its rest goes to
        the queue's front and its connection takes other work. Otherwise every connection
        could sit on a mirror gone silent until the stall timeout, with none free to move
        the work (the endgame and the hash-front rule run on a free connection): with the
        queue empty and the last four pieces on a mirror that went silent, a pull waited
        the whole stall timeout. Its mirror's rate drops to what the piece got, so it
        gets no more work while a faster mirror is there; no strike. With the queue empty
        and a connection free, the endgame (``_steal``) moves the work instead."""
        busy = sum(1 for p in self.inflight if not p.abandoned)
        if not self.queue and busy < self.connections:
            return
        now = time.monotonic()
        ready, rates = self._rates()
        # Highest first: each rest goes to the queue's front, so they end up in file order.
        for p in sorted(self.inflight, key=lambda p: p.pos, reverse=True):
            m = p.mirror
            if p.abandoned or p.stream or m is None or not p.last or now - p.last < SILENT:
                continue
            if not any(o is not m and id(o) in rates for o in ready):
                continue
            self._abandon(p)
            self.takeovers += 1
            m.conn_rate = max(1.0, p.got / max(now - p.began, 1e-3))
            if p.pos < p.end:
                self.queue.appendleft(Piece(p.pos, p.end, p.pos, crc=p.crc, src=m.label))

    def _helper(self, p: Piece, ready: list[Mirror], rates: dict[int, float]) -> Mirror | None:
        """Who takes a share of ``p`` in the endgame, if anyone: another mirror that is
        faster per connection; else, when ``p``'s connection has run below half its mirror's
        rate for ``SILENT`` seconds (held up or stuck), the fastest other mirror, or a fresh
        connection to its own mirror when it is the only one.

        A piece whose connection is healthy is not split with its own mirror (nor handed in
        part to a slower one, whose share would end last): the split would close a
        connection with full socket buffers, whose bytes the mirror counts as sent, for no
        gain (the tapered queue already ends the pieces together). Nor is a piece judged on
        its first second: a fresh answer's first bytes come late (the request, the server's
        start), and judged at once, each fresh connection looked stuck in turn and was
        replaced by another (hundreds of requests for the last blocks of a resume)."""
        others = [m for m in ready if id(m) in rates and m is not p.mirror]
        best = max(others, key=lambda m: rates[id(m)], default=None)
        own = p.mirror
        if own is None or id(own) not in rates:
            return best
        if best is not None and rates[id(best)] > rates[id(own)]:
            return best
        if time.monotonic() - p.began < SILENT or p.rate() >= 0.5 * rates[id(own)]:
            return None
        return own if best is None and len(ready) == 1 else best

    def _steal(self) -> tuple[Mirror, Piece] | None:
        """Endgame: free the hash front, else split or take over an in-flight piece that
        would finish late.

        For each piece, lowest in the file first (it holds the prefix hasher back), the
        fastest mirror per connection (the piece's own too, over a fresh connection) gets
        the share it would finish first: the piece is split at a block boundary so both
        parts end together, or, inside its last block, taken over. Judged on the piece's
        current rate.
        """
        ready, rates = self._rates()
        if rates:
            best = max((m for m in ready if id(m) in rates), key=lambda m: rates[id(m)])
            moved = self._free_front(best, rates[id(best)])
            if moved is not None:
                return moved
        now = time.monotonic()
        bs = self.block_size
        for p in sorted(self.inflight, key=lambda p: p.pos):
            if p.abandoned or p.stream or p.mirror is None or now - p.began < 0.05:
                continue
            mirror = self._helper(p, ready, rates)
            if mirror is None:
                continue
            rate_f = rates[id(mirror)]  # never 0 (``_rate``)
            rate_s = max(p.rate(), 1.0)
            t_slow = (p.end - p.pos) / rate_s
            cur_block_end = min(p.end, (p.pos // bs + 1) * bs)
            ideal = p.pos + (p.end - p.pos) * rate_s / (rate_s + rate_f)
            split = max(cur_block_end, -(-int(ideal) // bs) * bs)
            if split < p.end:
                if (p.end - split) / rate_f > t_slow * 0.8:
                    continue
                new = Piece(split, p.end, split)
                p.end = split
                self.splits += 1
                return mirror, new
            restart = (p.pos // bs) * bs
            t_fast = (p.end - restart) / rate_f
            if t_slow < 0.05 or t_fast * 2 > t_slow:
                continue
            self._abandon(p)
            self.takeovers += 1
            return mirror, Piece(restart, p.end, restart)
        return None
