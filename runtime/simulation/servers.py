"""What the fabric model moves and what moves it: transfers split into chunks, the servers that
send them (a directed link, or a memory channel both directions share) and the GPUs' copy engines.

A server has per-priority queues: strict priority between classes (7 first), round-robin
between flows within a class, so two equal flows each get half and a high-priority flow gets
all it asks for.  A chunk is sent whole (bytes / bandwidth, plus the link's fixed cost per
chunk) and never preempted.  A copy engine takes one chunk at a time and is busy with it
until it has left its first link.
"""
from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from fabric_ext.contract.hooks import PRIORITY

from .sim import Sim

DEFAULT_PRIORITY = PRIORITY.default      # the catalogue's: a chunk no program ranked
#: the copy-engine stream a chunk is issued on when no program chooses one: one per data class
CLASS_STREAM = {"weights": 1, "kv": 2, "activations": 3}


@dataclass(slots=True, eq=False)
class Transfer:
    """One movement of bytes from src to dst; split into chunks (each transfer is its own: equal
    by identity, so a hook site may key what it remembers by it)."""
    name: str                 # movement name ("" when no declared movement matches)
    movement_id: int
    cls: str
    operator: str
    src: str
    dst: str
    bytes: int
    layer: int = 0
    critical: bool = False
    on_done: object = None
    chunk_bytes: int = 2 << 20
    path: list = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    chunks_total: int = 0
    chunks_done: int = 0
    queue_waits: list = field(default_factory=list)
    ctx: tuple = ()           # the hook site's context fields, the same for every chunk (`TRANSFER_FIELDS`)
    standing: dict = field(default_factory=dict)   # the hook site's decisions that hold for every chunk
    train: tuple | None = None    # (what stood, its `trains._Flow` or None) as trains last worked it out;
                                  # (`trains._NEVER`, None) where no train can take it
    issued: int = 0               # chunks issued so far (`Fabric._issue` makes each as it goes)
    driver: list | None = None    # the copy engines that issue its chunks (None: issued at once)
    pace: float = 0.0             # B/s a collective's chunks cross each link at (0: the link's bandwidth)
    fixed_cost: bool = True       # whether its chunks pay the links' fixed cost (a collective's is in its alpha)
    last_chunk: object = None     # with evidence on: the chunk whose arrival ended it
    landing: float = 0.0          # when the last chunk counted before its arrival arrives (`Fabric._landed`)
    kept: bool = False            # its bytes stay in the memory it ends at (KV written back): a `tier` may move them
    elsewhere: dict | None = None  # ... bytes of it a tier sent to other memories, by memory (None: none)

    flow: tuple = field(init=False)    # what its chunks queue as at a link and are paced as: (name, src, dst)

    def __post_init__(self):
        self.flow = (self.name, self.src, self.dst)

    def next_chunk(self) -> Chunk:
        """Make the transfer's next chunk: each is made as it is issued, none wait in memory."""
        i = self.issued
        self.issued = i + 1
        return Chunk(self, i, min(self.chunk_bytes, self.bytes - i * self.chunk_bytes) if self.bytes else 0, self.path)

    def engine(self, stream: int):
        """The copy engine of its ``driver`` that runs ``stream``."""
        return self.driver[(stream - 1) % len(self.driver)]


class Step(NamedTuple):
    """One span of a chunk's life (``Fabric(evidence=True)``): a chunk's steps tile the time
    from its transfer's start to its delivery.  Recorded as plain tuples (``Step(*entry)``
    reads one): a run makes millions."""
    kind: str          # pending | defer | rate | engine | queue | send | latency
    start: float       # ns
    end: float
    where: object      # a Server (queue, send), an island (defer, rate), a CopyEngine, a (u, v) link
    moment: str = ""   # defer, rate: the moment of the decision ("issue" or "enter")


@dataclass(slots=True)
class Chunk:
    transfer: Transfer
    index: int
    bytes: int
    path: list
    hop: int = 0
    priority: int = DEFAULT_PRIORITY
    enqueued: float = 0.0
    waited: float = 0.0
    island: str | None = None
    parts: list | tuple = ()      # chunks merged into this one by coalescing (a list), else none
    queue: object = None      # the NIC transmit queue it leaves by (None: its flow's own)
    engine: object = None     # the copy engine busy with it until it leaves its first link
    trail: list | None = None  # with evidence on: its life, as `Step` tuples that tile it in time

    @property
    def last(self) -> bool:
        return self.index == self.transfer.chunks_total - 1


class Intervals:
    """A link's transmissions, each (start ns, stop ns, bytes), held flat as doubles: a long run
    keeps millions of them, 24 bytes each here against about 100 as tuples of floats.  Reads
    give tuples, with the bytes as an int; `array` gives numpy an (n, 3) array of them."""
    __slots__ = ("flat",)

    def __init__(self, rows=()):
        self.flat = array("d", (x for row in rows for x in row))

    def __len__(self) -> int:
        return len(self.flat) // 3

    def __getitem__(self, i: int) -> tuple[float, float, int]:
        f, j = self.flat, 3 * i
        return f[j], f[j + 1], int(f[j + 2])

    def __iter__(self):
        f = self.flat
        return zip(f[0::3], f[1::3], map(int, f[2::3]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Intervals) and self.flat == other.flat

    def __repr__(self) -> str:
        return f"Intervals({list(self)})"

    def array(self):
        """The intervals as an (n, 3) numpy array of floats: a copy, one memcpy (a view would
        stop the link from sending more while it lived)."""
        import numpy as np
        return np.array(self.flat, dtype=np.float64).reshape(-1, 3)


class Server:
    """A transmission resource: one directed link, or a memory channel both directions share.
    Each chunk costs ``overhead`` ns on top of its bytes: the link's fixed cost per transfer
    (DMA descriptor and doorbell on PCIe/CXL, one message on NVLink, a frame on a wire).

    A chunk's end of transmission is an event only where something must happen then: a
    chunk queued behind it starts, its copy engine is freed, it arrives somewhere that
    asks.  A chunk that starts with nothing queued behind it is offered to the enqueuer's
    ``handed_on(chunk, end)``; where that takes it (nothing the chunk does after ``end``
    has an event), the link is done with it at once and stays busy until ``free_at``.  A
    chunk enqueued before then starts at ``free_at``, in the place among that time's events
    that the finish event would have had (`Sim.place`).  Transmission is never preempted,
    so this is the per-chunk model with fewer events, in the same order (``per_chunk_events``
    restores an event at every end; the tests compare the two)."""

    def __init__(self, sim: Sim, name: str, bw: float, overhead: float = 0.0, per_chunk_events: bool = False):
        self.sim, self.name, self.bw, self.overhead = sim, name, bw, overhead
        self.queues: dict[int, OrderedDict] = {}   # class -> flow -> chunks, only classes with chunks
        self.classes: list[int] = []               # those classes, negated and sorted: highest first
        self.busy = False              # True while a finish, or the start at free_at, is scheduled
        self.free_at = 0.0             # the end of a transmission that has no event of its own
        self.free_place = 0            # ... and the place its finish event would have had (`Sim.place`)
        self.per_chunk_events = per_chunk_events
        self.bytes = 0
        self.intervals = Intervals()
        self.queued_bytes = 0          # bytes waiting, not yet on the link
        self.on_dequeue = None         # callable(chunk, wait ns) as a chunk starts on the link, if watched
        self.watched = False           # ... by programs that only watch (`observers.mark_observers`)
        self.enqueues: list | None = None         # where a watcher wants every enqueue (`watch`)
        self.lane = 0
        self.occupants: list | None = None        # with evidence on, per interval: (transfer, priority,
                                                  # chunk index, when the chunk was enqueued)
        self.ends = ("", "")                      # (device, what it leads to: a device, "memory", "wire"; "wire in": from it)
        self.train = None                         # callable(server, chunk, done) -> bool, asked first at
                                                  # every end of transmission (`trains`)

    def watch(self, enqueues: list | None, lane: int = 0) -> None:
        """Append time, ``lane`` and bytes to ``enqueues`` at every enqueue: flat, so a tick
        source converts it in one call (what the link sent, it reads from `intervals`).
        None stops it."""
        self.enqueues, self.lane = enqueues, lane

    def enqueue(self, chunk: Chunk, done, handed_on=None) -> None:
        """Queue a chunk; ``done(chunk)`` runs at its end of transmission, unless
        ``handed_on(chunk, end)``, where given, takes it as it starts (see above)."""
        now = self._admit(chunk)
        if not self.busy and not self.classes and now >= self.free_at:
            self._transmit(chunk, done, handed_on)    # an idle link: it goes at once, past the queues
            return
        self._queue(chunk, done, handed_on)
        if not self.busy:
            if now < self.free_at:        # the link is still sending a handed-on chunk: start
                self.busy = True          # the next where its finish would have
                self.sim.at_place(self.free_at, self.free_place, self._start)
            else:
                self._start()

    def _admit(self, chunk: Chunk) -> float:
        """Count a chunk in as queued here (it may start at once); returns the time."""
        now = chunk.enqueued = self.sim.now
        self.queued_bytes += chunk.bytes
        if self.enqueues is not None:
            self.enqueues.extend((now, self.lane, chunk.bytes))
        return now

    def _queue(self, chunk: Chunk, done, handed_on) -> None:
        """Queue an admitted chunk behind its class and flow."""
        q = self.queues.get(chunk.priority)
        if q is None:
            q = self.queues[chunk.priority] = OrderedDict()
            bisect.insort(self.classes, -chunk.priority)
        q.setdefault(chunk.queue or chunk.transfer.flow, deque()).append((chunk, done, handed_on))

    def _start(self) -> None:
        picked = self._pick()
        if picked is not None:
            self._transmit(*picked)

    def _pick(self) -> tuple | None:
        """The next chunk to send, with its ``done`` and ``handed_on``, off the queues; None
        where none waits (the link is then idle)."""
        if not self.classes:
            self.busy = False
            return None
        prio = -self.classes[0]                # the highest class with a chunk waiting
        q = self.queues[prio]
        flow, d = next(iter(q.items()))
        picked = d.popleft()
        q.move_to_end(flow)                    # round robin between flows of one class
        if not d:
            del q[flow]
            if not q:
                del self.queues[prio]
                self.classes.pop(0)
        return picked

    def queued_above(self, priority: int) -> int:
        """Bytes queued in classes above ``priority``: they leave before a chunk of it."""
        return sum(c.bytes for p, q in self.queues.items() if p > priority
                   for chunks in q.values() for c, _, _ in chunks)

    def _transmit(self, chunk: Chunk, done, handed_on) -> None:
        end = self._send(chunk)
        if handed_on is not None and not self.classes and not self.per_chunk_events and handed_on(chunk, end):
            self._hand_off(end)
        else:
            self.sim.at(end, self._finish, chunk, done)

    def _hand_off(self, end: float) -> None:
        """The link is done with the chunk it sends as it starts: idle, free at ``end``, and a
        chunk queued later starts there in the place its finish event would have had."""
        self.busy, self.free_at, self.free_place = False, end, self.sim.place()

    def _send(self, chunk: Chunk) -> float:
        """Put the chunk on the link; returns the end of its transmission."""
        self.busy = True
        now = self.sim.now
        chunk.waited += now - chunk.enqueued
        if self.on_dequeue is not None:
            self.on_dequeue(chunk, now - chunk.enqueued)
        t = chunk.transfer
        if t.fixed_cost:
            dt = chunk.bytes / self.bw * 1e9 + self.overhead
        else:       # a collective: at its bus bandwidth (where below the link's), its fixed cost in its alpha
            dt = chunk.bytes / min(t.pace, self.bw) * 1e9
        self.bytes += chunk.bytes
        self.queued_bytes -= chunk.bytes
        self.intervals.flat.extend((now, now + dt, chunk.bytes))
        if self.occupants is not None:
            self.occupants.append((t, chunk.priority, chunk.index, chunk.enqueued))
        if chunk.trail is not None:
            if now > chunk.enqueued:
                chunk.trail.append(("queue", chunk.enqueued, now, self))
            chunk.trail.append(("send", now, now + dt, self))
        return now + dt

    def _finish(self, chunk, done) -> None:
        if self.train is not None and self.train(self, chunk, done):
            return
        done(chunk)
        self._start()


class CopyEngine:
    """One DMA engine of a GPU.  It takes one chunk at a time from its streams (round robin
    between streams) and is busy with it until the chunk has left the first link of its
    path; what waits for it counts as queueing.  A stream serves its transfers in order, one
    after another, as a CUDA stream does: the next chunk of the transfer it took from last
    goes first (a chunk held back by ``defer`` or ``rate`` lets the next transfer go)."""

    def __init__(self, sim: Sim, name: str, take):
        self.sim, self.name, self._take = sim, name, take
        self.streams: OrderedDict[int, deque] = OrderedDict()
        self.current: dict[int, Transfer] = {}     # stream -> the transfer it took from last
        self.busy = False
        self.chunks = 0
        self.bytes = 0

    def submit(self, chunk: Chunk, stream: int) -> None:
        chunk.enqueued = self.sim.now
        q = self.streams.setdefault(stream, deque())
        if self.current.get(stream) is chunk.transfer:
            q.appendleft(chunk)
        else:
            q.append(chunk)
        if not self.busy:
            self._next()

    def release(self) -> None:
        self.busy = False
        self._next()

    def _next(self) -> None:
        if self.streams:
            self._take(self._pop())

    def _pop(self) -> Chunk:
        """Take the next chunk of the streams (round robin between them), busy with it."""
        stream, q = next(iter(self.streams.items()))
        chunk = q.popleft()
        if q:
            self.streams.move_to_end(stream)
        else:
            del self.streams[stream]
        self.current[stream] = chunk.transfer
        self.busy = True
        self.chunks += 1
        self.bytes += chunk.bytes
        chunk.waited += self.sim.now - chunk.enqueued
        if chunk.trail is not None and self.sim.now > chunk.enqueued:
            chunk.trail.append(("engine", chunk.enqueued, self.sim.now, self))
        chunk.engine = self
        return chunk
