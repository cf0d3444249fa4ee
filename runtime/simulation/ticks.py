"""Telemetry ticks, run lazily: counters read back from the servers' records, ticks run in batches.

A tick at time T gives its program one context per port of the island: the bytes
the port sent over the last period (and that as a utilisation of its capacity),
and the bytes queued at it, as they stood just before T — a tick runs before every
other event at its time.  Tick programs decide nothing; their only effect is on
maps.  So nothing can observe a tick until a program that shares a map with it
runs, or the maps are read at the end: the engine lets ticks pile up and calls
`TickSource.catch_up` at those moments.  It rebuilds every pending tick's counters
from one flat record the island's servers append to (the time, lane and size of
every transmission start and every enqueue: one append per event) and runs the
ticks in native batches (a catch-up that runs one tick per period, the common case
once ticks are elided, counts in plain Python: numpy's cost per call would outweigh
the work); where the compiler marked a period's handlers `last_wins`
(each run overwrites everything the one before it wrote), only the last due tick of
the period runs, the others are counted as passed over.  Islands whose tick programs
share a map are caught up together, tick time by tick time (`catch_up_together`).
The outcome is the same as running each tick at its time (`tests/test_ticks.py`
checks both against each other and against counters sampled one tick at a time), at
a small fraction of the cost: a 10 us tick on 11 ports over a 2 s prefill is 2.4
million program runs.
"""
from __future__ import annotations

import bisect
import struct
from itertools import chain, repeat

import numpy as np

BLOCK = 4096               # ticks of the shortest period per batch
ROW_FIELDS = ("now", "port", "peer", "util_pct", "bytes", "queue_bytes", "period")   # in offset order


class _Period:
    """One tick period's progress through the record: its next tick, the first record
    that tick has not yet counted, each port's transmission that may still be in service
    past the last tick (a port sends one chunk at a time, so there is at most one), and
    (when the queue is read) each port's bytes started and enqueued before its last tick.

    A tick at T sees its ports over [T - period, T): ``util_pct`` is the share of that
    window the port was busy (a chunk in service for half of it counts 50 %) and ``bytes``
    the bytes it sent in it, each chunk's bytes spread evenly over its service time (its
    bytes / bandwidth plus the link's fixed cost per chunk)."""

    def __init__(self, period: int, bw: np.ndarray, overhead: np.ndarray, last_wins: bool):
        self.period = period
        self.last_wins = last_wins      # only the last of several ticks in a row has an effect
        self.next_k = 1                                  # the next tick is at next_k * period
        self.cursor = 0                                  # records before this are all before the last tick
        self.before = [0.0] * (2 * len(bw))              # bytes started, then enqueued, per port
        self.bw, self.overhead = bw.tolist(), overhead.tolist()
        self.carry: list[tuple[float, float, float] | None] = [None] * len(bw)   # (start, service, bytes)

    def service(self, lane: int, size: float) -> float:
        """How long a chunk of ``size`` bytes keeps the port busy (as `Server` reckons it)."""
        bw = self.bw[lane]
        return (size / bw * 1e9 if bw > 0 else 0.0) + self.overhead[lane]

    @property
    def due(self) -> float:
        # a float, as every time it is compared with: Python compares a float with an int
        # above 2**30 (a time past 1.07 s in ns) through a slow exact path
        return float(self.next_k * self.period)

    def skip_to(self, record: list, t: float) -> None:
        """Move the cursor past the records before time t (the record is flat: time, lane,
        bytes), keeping each port's last transmission: it may still be in service at t."""
        n, lo = len(self.carry), self.cursor
        hi = lo + bisect.bisect_left(record[3 * lo::3], t)
        # only each port's last transmission counts (the dict keeps a lane's last index)
        last = {lane: i for i, lane in enumerate(record[3 * lo + 1:3 * hi:3], lo)}
        for lane, i in last.items():
            if lane < n:
                self.carry[lane] = (record[3 * i], self.service(lane, record[3 * i + 2]), record[3 * i + 2])
        self.cursor = hi

    def due_by(self, upto: float) -> int:
        """How many ticks are due by ``upto``."""
        return int(upto // self.period) - self.next_k + 1

    def runs(self, upto: float, elide: bool) -> int:
        """How many of the ticks due by ``upto`` run: all, or only the last when each run
        leaves only its own effect (the handlers are `last_wins`)."""
        due = self.due_by(upto)
        return min(due, 1) if elide and self.last_wins else due

    def util_pct(self, busy):
        """A busy time over the period as whole percent, rounded up from half (an array, or
        a float on the Python path: the same arithmetic without numpy's cost per call)."""
        if isinstance(busy, float):
            return min(busy * 100 / self.period + 0.5, 100)
        return np.minimum(busy * 100 / self.period + 0.5, 100)

    def fill(self, record: np.ndarray, upto: float, ctx: np.ndarray, queue_read: bool) -> np.ndarray:
        """Write the contexts of this period's last ``len(ctx)`` ticks up to ``upto`` into
        ``ctx`` (a (ticks, ports) view) and return their times; earlier ticks are passed over.

        Each transmission (the ports' carried ones first, then the record's in order) is
        spread over the tick windows its service time overlaps, and one bincount by
        (tick, port) sums the overlaps; the queue at T is everything enqueued before T less
        everything started before T, a running sum over ticks of the records binned by the
        first tick after them."""
        n, k1 = len(self.carry), int(upto // self.period)
        k0 = max(self.next_k, k1 - len(ctx))       # one tick more than run: it bounds the first run's bytes
        times = np.arange(k0, k1 + 1, dtype=np.float64) * self.period
        k = len(times)
        rec = record[self.cursor:record_end(record, self.cursor, times[-1])]
        starts = rec[rec[:, 1] < n]
        carried = [(lane, *c) for lane, c in enumerate(self.carry) if c is not None]
        lane = np.concatenate([[c[0] for c in carried], starts[:, 1]]).astype(np.int64)
        s = np.concatenate([[c[1] for c in carried], starts[:, 0]])
        size = np.concatenate([[c[3] for c in carried], starts[:, 2]])
        new = lane[len(carried):]
        bw = np.asarray(self.bw)[new]
        # `service`, in the same operations (the Python path must agree bit for bit)
        fresh = np.divide(size[len(carried):], bw, out=np.zeros_like(bw), where=bw > 0) * 1e9
        d = np.concatenate([[c[2] for c in carried], fresh + np.asarray(self.overhead)[new]])
        busy, sent = self._spread(times, lane, s, d, s + d, size, n)
        if len(lane):               # each port's last transmission may outlast the batch
            last = len(lane) - 1 - np.unique(lane[::-1], return_index=True)[1]
            for j in last.tolist():
                self.carry[lane[j]] = (float(s[j]), float(d[j]), float(size[j]))
        run = slice(k - len(ctx), None)
        ctx["now"] = times[run, None]
        ctx["period"] = self.period
        ctx["bytes"] = sent[run]
        ctx["util_pct"] = self.util_pct(busy[run])      # the cast to an integer floors it
        if queue_read:
            first = np.searchsorted(times, rec[:, 0], side="right")
            binned = np.bincount(first * (2 * n) + rec[:, 1].astype(np.int64), weights=rec[:, 2],
                                 minlength=2 * n * (k + 1)).reshape(k + 1, 2, n)[:k]
            sums = np.cumsum(binned, axis=0, dtype=np.float64)
            sums += np.reshape(self.before, (2, n))
            ctx["queue_bytes"] = sums[run, 1] - sums[run, 0]
            self.before = sums[-1].ravel().tolist()
        self.cursor += len(rec)
        self.next_k = k1 + 1
        return times[run]

    def _spread(self, times, lane, s, d, e, size, n):
        """Busy time and bytes of each (tick, port): every transmission [s, e) spread over the
        windows [T - period, T) it overlaps, summed in transmission order."""
        k, p = len(times), float(self.period)
        first = np.searchsorted(times, s, side="right")          # the first window ending after s
        last = np.searchsorted(times - p, e, side="left")         # windows starting before e
        count = np.maximum(last - first, 0)
        which = np.repeat(np.arange(len(s)), count)
        window = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
        hi = times[window]
        overlap = np.minimum(e[which], hi) - np.maximum(s[which], hi - p)
        bins = window * n + lane[which]
        busy = np.bincount(bins, weights=overlap, minlength=k * n).reshape(k, n)
        part = np.where(d[which] > 0, size[which] * overlap / np.where(d[which] > 0, d[which], 1), 0.0)
        sent = np.bincount(bins, weights=part, minlength=k * n).reshape(k, n)
        return busy, sent

    def last_tick(self, record: list, upto: float, queue_read: bool) -> tuple[int, list, list, list]:
        """`fill` for only the last tick due by ``upto``, counted from the flat record in
        Python: (its time, busy time per port, bytes sent per port, bytes queued per port,
        0 unless read), with the same arithmetic in the same order."""
        k1 = int(upto // self.period)
        t_run = float(k1 * self.period)         # floats, as the record's times (see `due`)
        lo = t_run - float(self.period)
        n = len(self.carry)
        busy, sent = [0.0] * n, [0.0] * n

        def spread(lane, start, service, size):
            end = start + service
            if start < t_run and end > lo:
                overlap = min(end, t_run) - max(start, lo)
                busy[lane] += overlap
                sent[lane] += size * overlap / service if service > 0 else 0.0
        for lane, c in enumerate(self.carry):
            if c is not None:
                spread(lane, *c)
        before = self.before
        i, end = self.cursor, len(record) // 3
        while i < end:
            t = record[3 * i]
            if t >= t_run:
                break
            lane, size = int(record[3 * i + 1]), record[3 * i + 2]
            if lane < n:      # lanes n and up are enqueues
                service = self.service(lane, size)
                spread(lane, t, service, size)
                self.carry[lane] = (t, service, size)
            before[lane] += size
            i += 1
        self.cursor, self.next_k = i, k1 + 1
        queued = [before[n + j] - before[j] for j in range(n)] if queue_read else [0.0] * n
        return k1 * self.period, busy, sent, queued


def record_end(record: np.ndarray, cursor: int, t: float) -> int:
    """The index past the records (from ``cursor``) before time t."""
    return cursor + int(np.searchsorted(record[cursor:, 0], t, side="left"))


class TickSource:
    """Every tick period of one island's tick program, over the island's ports."""

    def __init__(self, shim, island: str, periods: list[int], servers: list, peers: list[int], spans=None,
                 block: int = BLOCK, charge=None):
        """``charge(n)``: told of every n tick times about to run (`Sim.charge_ticks` bounds them)."""
        self.shim, self.island, self.block, self.charge = shim, island, block, charge
        self.end = float("inf")                          # no ticks after this time (the prefill's end)
        self.spans = spans                               # a list to record trace spans in, or None
        self.servers = servers
        n = len(servers)
        bw = np.array([srv.bw or 0.0 for srv in servers], dtype=np.float64)
        overhead = np.array([srv.overhead or 0.0 for srv in servers], dtype=np.float64)
        handlers = shim.handlers.get("tick")
        self.periods = [_Period(p, bw, overhead, handlers is not None and all(
            h.get("last_wins") for h in handlers if h["period"] == p)) for p in sorted({int(p) for p in periods})]
        self.elide = True                                # run only the last of `last_wins` ticks
        self.shortest = self.periods[0].period
        self.next_due = float(self.shortest)
        self.record: list = []                           # time, lane, bytes, ... from every port's server
        # lanes: port i's transmission starts are lane i, its enqueues lane n + i; the queue is
        # rebuilt from enqueues only if a tick handler reads it (else it reads 0)
        self.queue_read = handlers is None or any("queue_bytes" in h["reads"] for h in handlers)
        for port, srv in enumerate(servers):
            srv.watch(self.record, port, n + port if self.queue_read else None)
        codec = shim.codecs["tick"]
        self.dtype = codec.dtype()
        blank = codec.pack()
        self.template = np.frombuffer(blank, dtype=self.dtype)[0]
        self.ports, self.peers = list(range(n)), list(peers)
        self.row = codec.row_struct(ROW_FIELDS)
        if any(blank[self.row.size:]):   # `_rows_struct` packs what follows the inputs as zeros
            raise ValueError(f"{island}: a tick context must end with its inputs (tick hooks decide nothing)")
        self._rows: dict[int, struct.Struct] = {}
        self.buf = self.raw = None

    @property
    def active(self) -> bool:
        return self.shim.has("tick")

    @property
    def maps(self) -> frozenset:
        """The maps the tick program may touch."""
        return self.shim.maps_for("tick", None) or frozenset()

    def catch_up(self, t: float) -> None:
        """Run every tick due at or before t."""
        if not self.active:          # detached after a fault: stop recording
            for srv in self.servers:
                srv.watch(None, 0)
            del self.record[:]
            return
        t = min(t, self.end)
        # where only each period's last tick runs, one run covers any stretch (its cost is the
        # records'); else a block of ticks at a time, so a long quiet stretch needs no huge buffer
        one_run = self.elide and all(p.last_wins for p in self.periods)
        while self.next_due <= t:
            upto = t if one_run else min(t, self.next_due + (self.block - 1) * self.shortest)
            if not self._run(upto):
                return
            self.next_due = min(p.due for p in self.periods)

    def _run(self, upto: float) -> bool:
        """Build the contexts of the ticks up to ``upto`` and run them; False if the program faulted."""
        n = len(self.ports)
        due = [p for p in self.periods if p.due <= upto]
        if self.elide and not self.queue_read:
            for p in due:
                if p.last_wins:     # only its last tick runs: what came before its period is moot
                    p.skip_to(self.record, float((int(upto // p.period) - 1) * p.period))
        counts = [p.runs(upto, self.elide) for p in due]
        passed = sum(p.due_by(upto) for p in due) - sum(counts)
        if passed:
            self.shim.pass_over("tick", passed * n)
        times = self._last_ticks(due, upto) if max(counts) == 1 else self._many_ticks(due, counts, upto)
        self._trim()
        if self.charge is not None:
            self.charge(len(times))
        rows = self.raw[:len(times) * n]
        ran = self.shim.deliver_batch("tick", rows, lambda row: float(times[row // n]))
        if self.spans is not None:
            self.spans.extend((self.island, "tick", float(t), 0.0, None) for t in times[:-(-ran // n)])
        return ran == len(rows)

    def _many_ticks(self, due: list, counts: list, upto: float):
        """Write the contexts of each due period's last ``counts`` ticks into the buffer, with
        numpy; returns the tick times."""
        self._trim()
        record = np.fromiter(self.record, dtype=np.float64, count=len(self.record)).reshape(-1, 3)
        buf = self._buffer(sum(counts) * len(self.ports)).reshape(-1, len(self.ports))
        times, at = [], 0
        for p, k in zip(due, counts):
            times.append(p.fill(record, upto, buf[at:at + k], self.queue_read))
            at += k
        return times[0] if len(times) == 1 else self._in_time_order(buf, np.concatenate(times))

    def _last_ticks(self, due: list, upto: float):
        """`_many_ticks` for one tick per due period, counted and packed in Python."""
        n = len(self.ports)
        ticks = [p.last_tick(self.record, upto, self.queue_read) + (i, p) for i, p in enumerate(due)]
        if len(ticks) > 1:      # in time order; at one time the shorter period first (`due` is so)
            ticks.sort(key=lambda tick: (tick[0], tick[4]))
        values = []
        for t, busy, sent, queued, _, p in ticks:
            utils = [int(p.util_pct(b)) for b in busy]
            values += chain.from_iterable(zip(repeat(t, n), self.ports, self.peers, utils, map(int, sent),
                                              map(int, queued), repeat(p.period, n)))
        self._buffer(len(ticks) * n)
        self._rows_struct(len(ticks) * n).pack_into(self.raw, 0, *values)
        return [float(tick[0]) for tick in ticks]

    def _rows_struct(self, rows: int) -> struct.Struct:
        """`row` repeated for ``rows`` contexts, each padded to a whole context."""
        st = self._rows.get(rows)
        if st is None:
            pad = "x" * (self.dtype.itemsize - self.row.size)
            st = self._rows[rows] = struct.Struct("<" + (self.row.format[1:] + pad) * rows)
        return st

    @staticmethod
    def _in_time_order(buf: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Several periods' ticks, each period's in order, into one time order; at the same
        time the shorter period first (the periods were filled shortest first)."""
        order = np.argsort(times, kind="stable")
        buf[:] = buf[order]
        return times[order]

    def _trim(self) -> None:
        """Drop the records every period has counted: the record holds only what is pending."""
        done = min(p.cursor for p in self.periods)
        if done:
            del self.record[:3 * done]
            for p in self.periods:
                p.cursor -= done

    def _buffer(self, n):
        """The first n rows of a context buffer whose fixed fields (port, peer) are filled
        once; tick programs write no context fields."""
        if self.buf is None or len(self.buf) < n:
            rows = max(n, 2 * len(self.buf) if self.buf is not None else 0)
            buf = np.empty(rows, dtype=self.dtype)
            buf[:] = self.template
            reps = -(-rows // len(self.ports))
            buf["port"] = np.tile(np.array(self.ports, dtype=np.uint32), reps)[:rows]
            buf["peer"] = np.tile(np.array(self.peers, dtype=np.uint32), reps)[:rows]
            self.buf, self.raw = buf, buf.view(np.uint8).reshape(rows, -1)   # the rows as the VM takes them
        return self.buf[:n]


def catch_up_together(sources: tuple[TickSource, ...], t: float) -> None:
    """Run every tick due by t of sources whose programs share maps, in time order across
    them (at one time, in the order given), so that each sees the others' earlier ticks."""
    if len(sources) == 1:
        sources[0].catch_up(t)
        return
    while True:
        due = [s.next_due for s in sources if s.active and s.next_due <= min(t, s.end)]
        if not due:
            return
        at = min(due)
        for s in sources:
            s.catch_up(at)
