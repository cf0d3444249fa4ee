"""The event loop under the fabric model: callbacks at simulated times, a bound on events."""
from __future__ import annotations

import heapq
import itertools

from fabric_ext.runtime.machine.errors import InputError

#: ~100x the events of the largest bundled run (Llama-3-70B, 32k tokens, TP 8: ~200,000); a few minutes of run
DEFAULT_MAX_EVENTS = 20_000_000
#: the default where the run is traced: a trace holds about two of its events and 2 KB of memory
#: per simulated event (the 70B run's: 333,000 events, 64 MB of JSON), so 20 million would be 40 GB
TRACE_MAX_EVENTS = 1_000_000


def default_max_events(trace: bool) -> int:
    """The event limit of a run that names none (``trace``: one that records a trace)."""
    return TRACE_MAX_EVENTS if trace else DEFAULT_MAX_EVENTS


class EventLimit(InputError):
    """A run that passed its limit on events (``Sim.max_events``)."""


class Sim:
    """A minimal event loop: callbacks at simulated times (ns).  ``max_events`` bounds a run's
    events and tick programs' runs together (None: no bound), so that no input can make one
    endless."""

    def __init__(self, max_events: int | None = None):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.events = 0
        self.max_events = max_events
        self.ticks_run = 0        # tick times whose programs ran (`charge_ticks`): they count against the limit
        self._left = max_events if max_events is not None else float("inf")   # the limit less the ticks run

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def place(self) -> int:
        """A place in the order of events at one time, as an event scheduled now would have
        (`at_place`): for an event that stands in for one not scheduled."""
        return next(self._seq)

    def at_place(self, t: float, place: int, fn, *args) -> None:
        """`at`, ordered among events at time t as if scheduled when ``place`` was taken."""
        heapq.heappush(self._heap, (t, place, fn, args))

    def head(self) -> tuple | None:
        """The (time, place) of the next scheduled event (None: none is)."""
        return self._heap[0][:2] if self._heap else None

    def take(self, t: float) -> bool:
        """Count an event at time t that runs outside the loop (`trains`), and make t now;
        False, counting nothing, where it would pass the limit (the loop then stops the run)."""
        if self.events >= self._left:
            return False
        self.now = t
        self.events += 1
        return True

    def room(self) -> float:
        """How many more events `take` may count before the limit (inf: no limit)."""
        return max(0, self._left - self.events)

    def took(self, n: int, t: float) -> None:
        """Count ``n`` events that ran outside the loop, the last at time t (`trains`), within
        `room`."""
        self.events += n
        self.now = t

    def next_time(self) -> float | None:
        """When the next scheduled event is (None: none is)."""
        return self._heap[0][0] if self._heap else None

    def charge_ticks(self, n: int) -> None:
        """Count ``n`` tick times about to run against the limit: ticks run in batches outside
        the event loop, as many as simulated time allows (a short period over a long run)."""
        self.ticks_run += n
        self._left -= n
        if self.events > self._left:
            raise EventLimit(f"the run passed its limit of {self.max_events:,} events and ticks at "
                             f"{self.now / 1e6:.3f} ms of simulated time: {self.events:,} events, tick programs "
                             f"run at {self.ticks_run:,} tick times (a tick period short against the run's "
                             "simulated time): lengthen the period")

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        while heap:
            t, _, fn, args = heap[0]
            if until is not None and t > until:
                break
            heapq.heappop(heap)
            self.now = t
            self.events += 1
            if self.events > self._left:
                ticks = f", {self.ticks_run:,} of them tick runs" if self.ticks_run else ""
                raise EventLimit(f"the run passed {self.max_events:,} events at {t / 1e6:.3f} ms of simulated "
                                 f"time{ticks} (small transfer chunks, a long prompt): use larger chunks")
            fn(*args)


