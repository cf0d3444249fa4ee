"""Telemetry ticks, run lazily: counters read back from the links' own records, ticks run in batches.

A tick at time T gives its program one context per port of the island: the bytes
the port sent over the last period (and that as a utilisation of its capacity),
and the bytes queued at it, as they stood just before T — a tick runs before every
other event at its time.  Tick programs decide nothing; their only effect is on
maps.  So nothing can observe a tick until a program that shares a map with it
runs, or the maps are read at the end: the engine lets ticks pile up and calls
`TickSource.catch_up` at those moments.  It rebuilds every pending tick's counters
from what each port's link recorded of its transmissions (`servers.Intervals`: start,
stop, bytes; kept for the report anyway) and, where a handler reads the queue, from a
log of enqueues the servers append to, and runs the ticks in native batches (a
catch-up that runs one tick per period, the common case once ticks are elided, counts
in plain Python: numpy's cost per call would outweigh the work); where the compiler
marked a period's handlers `last_wins` (each run overwrites everything the one before
it wrote), only the last due tick of the period runs, the others are counted as
passed over; where they are also `per_port` (a port's run writes only that port's entries), a
check that reads one port's entry runs only that port's pending tick (`TickSource.preview`).
Islands whose tick programs share a map are caught up together, tick time by tick time
(`catch_up_together`).  The outcome is the same as running each
tick at its time (`tests/test_ticks.py` checks both against each other and against
counters sampled one tick at a time), at a small fraction of the cost: a 10 us tick
on 11 ports over a 2 s prefill is 2.4 million program runs.
"""
from __future__ import annotations

import bisect

import numpy as np

BLOCK = 4096               # ticks of the shortest period per batch


def _after(flat, i: int, x: float, stop: bool) -> int:
    """The first of a link's transmissions (`servers.Intervals.flat`: start, stop, bytes), from
    the i-th on, whose stop is after x (``stop``), else whose start is at or after x.  A link
    sends one chunk at a time, so both its starts and its stops rise."""
    col = 1 if stop else 0
    keys = range(i, len(flat) // 3)
    if not keys or (flat[3 * i + col] > x if stop else flat[3 * i + col] >= x):
        return i            # the usual case: a catch-up moves on by a few transmissions
    find = bisect.bisect_right if stop else bisect.bisect_left
    return i + find(keys, x, key=lambda j: flat[3 * j + col])


class _Period:
    """One tick period's progress through the ports' transmissions: its next tick, per port
    the first transmission that may still reach into a tick window to come, and (when the
    queue is read) the bytes each port had started and had enqueued before its last tick.

    A tick at T sees its ports over [T - period, T): ``util_pct`` is the share of that
    window the port was busy (a chunk in service for half of it counts 50 %) and ``bytes``
    the bytes it sent in it, each chunk's bytes spread evenly over its service time (as the
    link recorded it: its bytes / bandwidth plus the link's fixed cost per chunk, or a
    collective's pace)."""

    def __init__(self, period: int, ports: int, last_wins: bool):
        self.period = period
        self.last_wins = last_wins      # only the last of several ticks in a row has an effect
        self.next_k = 1                 # the next tick is at next_k * period
        self.first = [0] * ports        # per port: transmissions before this ended before the next window
        self.started = [0] * ports      # per port: transmissions before this started before the last tick
        self.cursor = 0                 # enqueues (the source's log) before this came before the last tick
        self.before = [0.0] * (2 * ports)   # bytes started, then enqueued, per port, before the last tick

    @property
    def due(self) -> float:
        # a float, as every time it is compared with: Python compares a float with an int
        # above 2**30 (a time past 1.07 s in ns) through a slow exact path
        return float(self.next_k * self.period)

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

    def fill(self, flats: list, enqueues: list, upto: float, ctx: np.ndarray, queue_read: bool) -> np.ndarray:
        """Write the contexts of this period's last ``len(ctx)`` ticks up to ``upto`` into
        ``ctx`` (a (ticks, ports) view) and return their times; earlier ticks are passed over.

        Each transmission that reaches into their windows is spread over the windows its
        service time overlaps, and one bincount by (tick, port) sums the overlaps; the queue
        at T is everything enqueued before T less everything started before T, a running sum
        over ticks of the starts and enqueues binned by the first tick after them."""
        n, k1 = len(flats), int(upto // self.period)
        times = np.arange(k1 - len(ctx) + 1, k1 + 1, dtype=np.float64) * self.period
        lo, hi = float(times[0]) - self.period, float(times[-1])
        spans = []
        for port, flat in enumerate(flats):
            i = self.first[port] = _after(flat, self.first[port], lo, stop=True)
            spans.append((i, _after(flat, i, hi, stop=False)))
        rows = _rows(flats, spans)
        lane = np.repeat(np.arange(n), [j - i for i, j in spans])
        s, e, size = rows[:, 0], rows[:, 1], rows[:, 2]
        busy, sent = self._spread(times, lane, s, e - s, e, size, n)
        ctx["now"] = times[:, None]
        ctx["period"] = self.period
        ctx["bytes"] = sent
        ctx["util_pct"] = self.util_pct(busy)      # the cast to an integer floors it
        if queue_read:
            ctx["queue_bytes"] = self._queued_many(flats, enqueues, times)
        self.next_k = k1 + 1
        return times

    def _queued_many(self, flats: list, enqueues: list, times: np.ndarray) -> np.ndarray:
        """The bytes queued at each port just before each of ``times`` (the ticks of one batch)."""
        n, k, hi = len(flats), len(times), float(times[-1])
        spans = [(a, _after(flat, a, hi, stop=False)) for a, flat in zip(self.started, flats)]
        starts = _rows(flats, spans)
        end = self.cursor + bisect.bisect_left(enqueues[3 * self.cursor::3], hi)
        enq = np.array(enqueues[3 * self.cursor:3 * end], dtype=np.float64).reshape(-1, 3)
        at = np.concatenate([starts[:, 0], enq[:, 0]])
        lanes = np.concatenate([np.repeat(np.arange(n), [j - i for i, j in spans]), n + enq[:, 1].astype(np.int64)])
        first = np.searchsorted(times, at, side="right")
        binned = np.bincount(first * (2 * n) + lanes, weights=np.concatenate([starts[:, 2], enq[:, 2]]),
                             minlength=2 * n * (k + 1)).reshape(k + 1, 2, n)[:k]
        sums = np.cumsum(binned, axis=0, dtype=np.float64)
        sums += np.reshape(self.before, (2, n))
        self.before = sums[-1].ravel().tolist()
        self.started, self.cursor = [j for _, j in spans], end
        return sums[:, 1] - sums[:, 0]

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

    def last_tick(self, flats: list, enqueues: list, upto: float, queue_read: bool) -> tuple[int, list, list, list]:
        """`fill` for only the last tick due by ``upto``, counted in Python: (its time, busy
        time per port, bytes sent per port, bytes queued per port, 0 unless read), with the
        same arithmetic in the same order."""
        k1 = int(upto // self.period)
        t_run = float(k1 * self.period)         # floats, as the transmissions' times (see `due`)
        busy, sent = [], []
        for port, flat in enumerate(flats):
            b, bytes_ = self.window(flat, port, t_run)
            busy.append(b)
            sent.append(bytes_)
        self.next_k = k1 + 1
        queued = self._queued(flats, enqueues, t_run) if queue_read else [0.0] * len(flats)
        return k1 * self.period, busy, sent, queued

    def window(self, flat, port: int, t_run: float) -> tuple[float, float]:
        """A port's busy time and bytes sent in the window of its tick at ``t_run`` (a float),
        from ``flat``, its transmissions; later windows start from where this one did."""
        lo = t_run - float(self.period)
        i = self.first[port] = _after(flat, self.first[port], lo, stop=True)
        busy = sent = 0.0
        for j in range(3 * i, len(flat), 3):
            start = flat[j]
            if start >= t_run:
                break
            stop, size = flat[j + 1], flat[j + 2]
            overlap = min(stop, t_run) - max(start, lo)
            busy += overlap
            sent += size * overlap / (stop - start) if stop > start else 0.0
        return busy, sent

    def _queued(self, flats: list, enqueues: list, t: float) -> list:
        """The bytes queued at each port just before t (its last tick), counted on from the one before."""
        n, before = len(flats), self.before
        for port, flat in enumerate(flats):
            a = self.started[port]
            b = self.started[port] = _after(flat, a, t, stop=False)
            before[port] += sum(flat[3 * a + 2:3 * b:3])
        i, end = self.cursor, len(enqueues) // 3
        while i < end and enqueues[3 * i] < t:
            before[n + int(enqueues[3 * i + 1])] += enqueues[3 * i + 2]
            i += 1
        self.cursor = i
        return [before[n + j] - before[j] for j in range(n)]


class Refresher:
    """What brings some map entries up to date before they are read at a time (`__call__`):
    a tick source that can runs only the ports that write them (`TickSource.preview`), the
    others catch up.  Then no tick writes them again before the next tick time of any of the
    sources (``fresh_until``): a read before it needs nothing run, whichever decision reads."""
    __slots__ = ("deps", "ports", "catch_up", "fresh_until")

    def __init__(self, deps: list, entries: tuple, catch_up):
        """``deps``: the tick sources that share a map with the entries ((map, index) each);
        ``catch_up(sources, t)`` runs theirs due by t."""
        self.deps, self.catch_up = deps, catch_up
        self.ports = [(t, t.ports_of(entries)) for t in deps]
        self.fresh_until = -1.0

    def __call__(self, now: float) -> None:
        """Bring them up to date at ``now`` (at or after ``fresh_until``: the caller looks)."""
        for t, written in self.ports:
            if t.next_due <= now and not t.preview(written, now):
                self.catch_up(self.deps, now)
                break
        self.fresh_until = min(t.next_tick_after(now) for t in self.deps)


def _rows(flats: list, spans: list) -> np.ndarray:
    """The ports' transmissions [i, j) of each (i, j) in ``spans``, one port after another, as
    an (n, 3) array: start, stop, bytes."""
    parts = [np.frombuffer(flat[3 * i:3 * j], dtype=np.float64) for flat, (i, j) in zip(flats, spans) if j > i]
    return (np.concatenate(parts) if parts else np.empty(0)).reshape(-1, 3)


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
        handlers = shim.handlers.get("tick")
        self.periods = [_Period(p, n, handlers is not None and all(
            h.get("last_wins") for h in handlers if h["period"] == p)) for p in sorted({int(p) for p in periods})]
        self.elide = True                                # run only the last of `last_wins` ticks
        self.shortest = self.periods[0].period
        self.next_due = float(self.shortest)
        # what the ports sent is their links' own record (`Server.intervals`); the queue is
        # rebuilt from a log of enqueues (time, port, bytes, ...), kept only if a tick handler
        # reads it (else it reads 0)
        self.queue_read = handlers is None or any("queue_bytes" in h["reads"] for h in handlers)
        self.enqueues: list = []
        if self.queue_read:
            for port, srv in enumerate(servers):
                srv.watch(self.enqueues, port)
        codec = shim.codecs["tick"]
        self.dtype = codec.dtype()
        blank = codec.pack()
        self.template = np.frombuffer(blank, dtype=self.dtype)[0]
        self.ports, self.peers = list(range(n)), list(peers)
        self.buf = self.raw = None
        # one port's tick may run ahead of the others' (`preview`) where a port's run writes only
        # its own entries and each port is counted alone: one period, no queue read
        self.per_port = len(self.periods) == 1 and self.periods[0].last_wins and not self.queue_read \
            and all(h.get("per_port") for h in handlers)
        self.written = self.maps if self.per_port else frozenset()     # (what a port's run writes)
        self.ahead: dict[int, int] = {}     # port -> the tick (number) it ran ahead at, since the last catch-up
        self.runs_ahead = 0                 # runs ahead since the last catch-up

    @property
    def active(self) -> bool:
        return self.shim.has("tick")

    @property
    def grows(self) -> bool:
        """Whether a catch-up's work grows with the stretch of time it covers: the enqueues it
        counts are logged, or every tick due runs; else it runs each port's last tick whatever
        the stretch (its counters are read from the links' records, which the report keeps)."""
        return self.queue_read or not (self.elide and all(p.last_wins for p in self.periods))

    @property
    def maps(self) -> frozenset:
        """The maps the tick program may touch."""
        return self.shim.maps_for("tick", None) or frozenset()

    def catch_up(self, t: float) -> None:
        """Run every tick due at or before t."""
        if not self.active:          # detached after a fault: stop recording
            for srv in self.servers:
                srv.watch(None, 0)
            del self.enqueues[:]
            return
        t = min(t, self.end)
        # where only each period's last tick runs, one run covers any stretch; else a block of ticks at a time, so a long quiet stretch needs no huge buffer
        one_run = self.elide and all(p.last_wins for p in self.periods)
        while self.next_due <= t:
            upto = t if one_run else min(t, self.next_due + (self.block - 1) * self.shortest)
            if not self._run(upto):
                return
            self.next_due = min(p.due for p in self.periods)

    def next_tick_after(self, t: float) -> float:
        """When this source's first tick after t is (inf: none comes, past its end or detached)."""
        if not self.active:
            return float("inf")
        nxt = float(min((int(t // p.period) + 1) * p.period for p in self.periods))
        return nxt if nxt <= self.end else float("inf")

    def ports_of(self, entries) -> tuple[int, ...]:
        """The ports whose runs write the entries of ``entries`` ((map, index) each; an entry's
        index is its port) where the handlers are `per_port`: what `preview` is given."""
        return tuple(port for name, port in entries if name in self.written and port < len(self.ports))

    def preview(self, ports: tuple[int, ...], t: float) -> bool:
        """Bring the entries that the tick program writes for ``ports`` (`ports_of`) up to date
        by t, by running the last tick due of each port ahead of the other ports': True where
        that is all they need (the handlers are `per_port`: a port's run writes only its own
        entries), else False, and the caller catches everything up.  A port's run ahead stands
        for its tick: the catch-up that reaches that tick leaves the port out (`_run`)."""
        if not (self.per_port and self.elide and self.spans is None and self.active):
            return False
        t = min(t, self.end)
        if self.next_due > t:       # (one period: its next tick)
            return True
        p, ahead = self.periods[0], self.ahead
        k = int(t // p.period)
        for port in ports:
            if ahead.get(port) != k and not self._run_ahead(p, port, k):
                break       # (it faulted, and is detached)
        return True

    def _run_ahead(self, p: _Period, port: int, k: int) -> bool:
        """Run tick k for ``port`` alone; False if the program faulted."""
        t_run = float(k * p.period)
        busy, sent = p.window(self.servers[port].intervals.flat, port, t_run)
        self.ahead[port] = k
        self.runs_ahead += 1
        # the context a batch would give it (numbers cast to the fields' integers, as numpy does)
        return self.shim.run("tick", {"now": int(t_run), "port": port, "peer": self.peers[port], "period": p.period,
                                      "util_pct": int(p.util_pct(busy)), "bytes": int(sent)}, t_run)

    def _run(self, upto: float) -> bool:
        """Build the contexts of the ticks up to ``upto`` and run them; False if the program faulted."""
        n = len(self.ports)
        due = [p for p in self.periods if p.due <= upto]
        counts = [p.runs(upto, self.elide) for p in due]
        passed = (sum(p.due_by(upto) for p in due) - sum(counts)) * n - self.runs_ahead
        times = self._last_ticks(due, upto) if max(counts) == 1 else self._many_ticks(due, counts, upto)
        rows = self.raw[:len(times) * n]
        # each (tick, port) due ran ahead, runs now, or is passed over (a later run of its port overwrites it)
        ahead = sorted(port for port, k in self.ahead.items() if k == due[0].next_k - 1)   # (one period)
        passed += len(ahead)
        if passed:
            self.shim.pass_over("tick", passed)
        if ahead:
            rows = np.delete(rows, ahead, axis=0)
        self.ahead, self.runs_ahead = {}, 0
        self._trim()
        if self.charge is not None:
            self.charge(len(times))
        ran = self.shim.deliver_batch("tick", rows, lambda row: float(times[row // n]))
        if self.spans is not None:
            self.spans.extend((self.island, "tick", float(t), 0.0, None) for t in times[:-(-ran // n)])
        return ran == len(rows)

    def _many_ticks(self, due: list, counts: list, upto: float):
        """Write the contexts of each due period's last ``counts`` ticks into the buffer, with
        numpy; returns the tick times."""
        buf = self._buffer(sum(counts) * len(self.ports)).reshape(-1, len(self.ports))
        flats = self._flats()
        times, at = [], 0
        for p, k in zip(due, counts):
            times.append(p.fill(flats, self.enqueues, upto, buf[at:at + k], self.queue_read))
            at += k
        return times[0] if len(times) == 1 else self._in_time_order(buf, np.concatenate(times))

    def _last_ticks(self, due: list, upto: float):
        """`_many_ticks` for one tick per due period, counted in Python and written into the
        buffer a column at a time (its port and peer columns are filled once)."""
        n = len(self.ports)
        flats = self._flats()
        ticks = [p.last_tick(flats, self.enqueues, upto, self.queue_read) + (i, p) for i, p in enumerate(due)]
        if len(ticks) > 1:      # in time order; at one time the shorter period first (`due` is so)
            ticks.sort(key=lambda tick: (tick[0], tick[4]))
        buf = self._buffer(len(ticks) * n)
        for at, (t, busy, sent, queued, _, p) in enumerate(ticks):
            rows = buf[at * n:(at + 1) * n]
            rows["now"], rows["period"] = t, p.period
            rows["util_pct"] = [p.util_pct(b) for b in busy]     # (the cast floors them, as in `fill`)
            rows["bytes"], rows["queue_bytes"] = sent, queued
        return [float(tick[0]) for tick in ticks]

    @staticmethod
    def _in_time_order(buf: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Several periods' ticks, each period's in order, into one time order; at the same
        time the shorter period first (the periods were filled shortest first)."""
        order = np.argsort(times, kind="stable")
        buf[:] = buf[order]
        return times[order]

    def _flats(self) -> list:
        """Each port's transmissions, flat (`servers.Intervals`)."""
        return [srv.intervals.flat for srv in self.servers]

    def _trim(self) -> None:
        """Drop the enqueues every period has counted: the log holds only what is pending."""
        done = min(p.cursor for p in self.periods)
        if done:
            del self.enqueues[:3 * done]
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
