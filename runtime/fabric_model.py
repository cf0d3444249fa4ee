"""The fabric model: a discrete-event simulation of chunks moving hop by hop.

Every directed link is a server with per-priority queues: strict priority
between classes (7 first), round-robin between flows within a class, so two
equal flows each get half and a high-priority flow gets all it asks for.  A
chunk is sent whole (bytes / bandwidth) and arrives after the link's latency.
The two directions of the link to switch-attached memory share one server:
a memory device's bandwidth is shared by reads and writes.  A chunk that ends
at a DPU/NIC leaves on its wire (line rate, plus a per-chunk overhead).

Hooks are not called here: the fabric asks a `HookSite` at the moments a
program may decide (a chunk issued, entering an island, delivered) and applies
what comes back: ``priority``, ``rate`` (a token bucket at that island),
``defer``, ``route`` (the next hop), ``coalesce`` (merge small chunks) and
``tier`` (redirect the data to another memory).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import networkx as nx

DEFAULT_PRIORITY = 3
APPLIED = frozenset({"priority", "defer", "rate", "route", "tier"})   # what `Fabric._apply` acts on


#: ~50x the events of the largest bundled run (Llama-3-70B, 32k tokens: ~420,000); a few minutes of run
DEFAULT_MAX_EVENTS = 20_000_000


class EventLimit(RuntimeError):
    """A run that passed its limit on events (``Sim.max_events``)."""


class Sim:
    """A minimal event loop: callbacks at simulated times (ns).  ``max_events`` bounds a run
    (None: no bound), so that no input can make one endless."""

    def __init__(self, max_events: int | None = None):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.events = 0
        self.max_events = max_events

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        limit = self.max_events if self.max_events is not None else float("inf")
        while heap:
            t, _, fn, args = heap[0]
            if until is not None and t > until:
                break
            heapq.heappop(heap)
            self.now = t
            self.events += 1
            if self.events > limit:
                raise EventLimit(f"the run passed {limit:,} events at {t / 1e6:.3f} ms of simulated time")
            fn(*args)


@dataclass(slots=True)
class Transfer:
    """One movement of bytes from src to dst; split into chunks."""
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
    ctx: dict = field(default_factory=dict)     # the hook site's context fields, the same for every chunk
    standing: dict = field(default_factory=dict)  # island -> `Standing` decisions there

    @property
    def flow(self) -> tuple:
        return (self.name, self.src, self.dst)


@dataclass(slots=True)
class Standing:
    """Decisions that hold for every chunk of a transfer on entering one island (the hook
    site found they depend on nothing per chunk): the fabric applies them to the chunks
    that follow the transfer's path without asking again, and counts them."""
    decisions: dict
    uses: int = 0


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
    parts: list = field(default_factory=list)   # chunks merged into this one by coalescing

    @property
    def last(self) -> bool:
        return self.index == self.transfer.chunks_total - 1


class Server:
    """A transmission resource: one directed link, or a memory channel both directions share."""

    def __init__(self, sim: Sim, name: str, bw: float, overhead: float = 0.0):
        self.sim, self.name, self.bw, self.overhead = sim, name, bw, overhead
        self.queues: dict[int, OrderedDict] = {}   # class -> flow -> chunks, only classes with chunks
        self.classes: list[int] = []               # those classes, negated and sorted: highest first
        self.busy = False
        self.bytes = 0
        self.intervals: list[tuple[float, float, int]] = []
        self.queued_bytes = 0          # bytes waiting, not yet on the link
        self.record: list | None = None           # where a watcher wants transmission starts
        self.sent_lane = 0
        self.enqueued_lane: int | None = None     # ... and enqueues, if it does

    def watch(self, record: list | None, sent_lane: int, enqueued_lane: int | None = None) -> None:
        """Append time, lane and bytes to ``record`` at every transmission start, and at every
        enqueue if given a lane for those: flat, so a tick source converts it in one call.
        A record of None stops it."""
        self.record, self.sent_lane = record, sent_lane
        self.enqueued_lane = enqueued_lane if record is not None else None

    def enqueue(self, chunk: Chunk, done) -> None:
        chunk.enqueued = self.sim.now
        self.queued_bytes += chunk.bytes
        if self.enqueued_lane is not None:
            self.record.extend((chunk.enqueued, self.enqueued_lane, chunk.bytes))
        q = self.queues.get(chunk.priority)
        if q is None:
            q = self.queues[chunk.priority] = OrderedDict()
            bisect.insort(self.classes, -chunk.priority)
        q.setdefault(chunk.transfer.flow, deque()).append((chunk, done))
        if not self.busy:
            self._start()

    def _start(self) -> None:
        if not self.classes:
            self.busy = False
            return
        prio = -self.classes[0]                # the highest class with a chunk waiting
        q = self.queues[prio]
        flow, d = next(iter(q.items()))
        chunk, done = d.popleft()
        q.move_to_end(flow)                    # round robin between flows of one class
        if not d:
            del q[flow]
            if not q:
                del self.queues[prio]
                self.classes.pop(0)
        self.busy = True
        now = self.sim.now
        chunk.waited += now - chunk.enqueued
        dt = chunk.bytes / self.bw * 1e9 + self.overhead
        self.bytes += chunk.bytes
        self.queued_bytes -= chunk.bytes
        self.intervals.append((now, now + dt, chunk.bytes))
        if self.record is not None:
            self.record.extend((now, self.sent_lane, chunk.bytes))
        self.sim.at(now + dt, self._finish, chunk, done)

    def _finish(self, chunk, done) -> None:
        done(chunk)
        self._start()


class HookSite:
    """What the fabric asks at decision points; the engine implements it with shims."""

    def on_issue(self, chunks: list[Chunk], island: str, role: str) -> list | None:
        """A transfer's chunks are issued at a GPU: each chunk's decisions, read only (None:
        nothing for the fabric to apply)."""
        return None

    def on_enter(self, chunk: Chunk, island: str) -> dict | None:
        """A chunk enters an island (``chunk.hop`` is the island's device): its decisions
        there, or None.  The fabric only reads what comes back."""
        return None

    def on_delivered(self, chunk: Chunk, island: str, latency: float) -> None:
        return None


class Fabric:
    """Devices and links from the compiled manifest, and the chunks moving over them."""

    def __init__(self, sim: Sim, graph: nx.DiGraph, device_island: dict[str, str],
                 island_kind: dict[str, str], wires: dict[str, tuple[float, float]],
                 memory_channels: dict[str, float], hooks: HookSite | None = None):
        self.sim, self.g = sim, graph
        self.device_island, self.island_kind = device_island, island_kind
        self.hooks = hooks or HookSite()
        self.servers: dict[tuple[str, str], Server] = {}
        shared: dict[str, Server] = {}
        for u, v, e in graph.edges(data=True):
            mem = u if u in memory_channels else v if v in memory_channels else None
            if mem is not None and e.get("kind") == "internal":
                if mem not in shared:
                    shared[mem] = Server(sim, f"{mem} memory", memory_channels[mem])
                self.servers[(u, v)] = shared[mem]
            else:
                self.servers[(u, v)] = Server(sim, f"{u}->{v}", e["bw"])
        self.wires = {dev: Server(sim, f"{dev}->wire", bw, overhead) for dev, (bw, overhead) in wires.items()}
        self.buckets: dict[tuple, float] = {}
        self.coalescing: dict[tuple, list] = {}
        self.transfers: list[Transfer] = []
        self._ports: dict[str, list[str]] = {}
        self._port_index: dict[tuple[str, str], int] = {}
        self._routes: dict[tuple[str, str], list[str]] = {}
        self._ends: dict[tuple[str, str], list[tuple[str, str]]] = {}

    # -- paths ------------------------------------------------------------------------
    def route(self, src: str, dst: str) -> list[str]:
        """The lowest-latency path (fewest hops among equals); the graph is fixed, so cached."""
        key = (src, dst)
        if key not in self._routes:
            self._routes[key] = nx.shortest_path(self.g, src, dst, weight=lambda u, v, e: (e.get("latency") or 0) + 1)
        return list(self._routes[key])

    def ports(self, device: str) -> list[str]:
        """The devices a device's ports lead to, in port-index order."""
        if device not in self._ports:
            self._ports[device] = sorted(self.g.successors(device))
        return self._ports[device]

    def port_index(self, device: str, peer: str) -> int:
        key = (device, peer)
        if key not in self._port_index:
            ports = self.ports(device)
            self._port_index[key] = ports.index(peer) if peer in ports else 0
        return self._port_index[key]

    def server(self, u: str, v: str) -> Server:
        return self.servers[(u, v)]

    # -- transfers --------------------------------------------------------------------
    def start(self, t: Transfer) -> None:
        """Split a transfer into chunks and issue them now."""
        now = self.sim.now
        t.start = now
        t.path = t.path or self.route(t.src, t.dst)
        n = max(1, -(-t.bytes // t.chunk_bytes))
        t.chunks_total = n
        self.transfers.append(t)
        chunks = [Chunk(t, i, min(t.chunk_bytes, t.bytes - i * t.chunk_bytes) if t.bytes else 0, t.path)
                  for i in range(n)]
        release = [now] * n
        for isl, role in self._gpu_ends(t):
            for i, d in enumerate(self.hooks.on_issue(chunks, isl, role) or ()):
                if d and not APPLIED.isdisjoint(d):
                    release[i] = max(release[i], self._apply(chunks[i], isl, d, release[i]))
        for chunk, at in zip(chunks, release):
            self.sim.at(at, self._arrive, chunk)

    def _gpu_ends(self, t: Transfer) -> list[tuple[str, str]]:
        """The GPU islands at a transfer's ends, with their role: the source first, then the
        destination (the order their programs see its chunks in).  Asked for every chunk
        delivered, so kept per pair of ends."""
        key = (t.path[0], t.path[-1])
        if key not in self._ends:
            ends = [(key[0], "src")] + ([(key[1], "dst")] if key[1] != key[0] else [])
            self._ends[key] = [(isl, role) for isl, role in ((self.device_island.get(e), r) for e, r in ends)
                               if isl is not None and self.island_kind.get(isl) == "gpu"]
        return self._ends[key]

    def _apply(self, chunk: Chunk, island: str, d: dict, now: float) -> float:
        """Apply decisions; returns when the chunk may move on."""
        if "priority" in d:
            chunk.priority = d["priority"]
            if len(d) == 1:         # the usual decision: nothing else to look up
                return now
        release = now + d.get("defer", 0)
        rate = d.get("rate", 0)
        if rate:
            key = (island, chunk.transfer.flow)
            start = max(release, self.buckets.get(key, 0.0))
            self.buckets[key] = start + chunk.bytes / rate * 1e9
            release = start
        nxt = d.get("route", 0)
        if nxt and chunk.hop + 1 < len(chunk.path):
            self._reroute(chunk, nxt)
        tier = d.get("tier", 0)
        if tier and tier != chunk.path[-1] and tier in self.g and chunk.path[-1] in self.g:
            self._retarget(chunk, tier)
        return release

    def _reroute(self, chunk, next_dev):
        here = chunk.path[chunk.hop]
        if not self.g.has_edge(here, next_dev) or next_dev == chunk.path[chunk.hop + 1]:
            return
        try:
            rest = self.route(next_dev, chunk.path[-1])
        except nx.NetworkXNoPath:
            return
        chunk.path = chunk.path[:chunk.hop + 1] + rest

    def _retarget(self, chunk, memory):
        here = chunk.path[chunk.hop]
        try:
            chunk.path = chunk.path[:chunk.hop] + self.route(here, memory)
        except nx.NetworkXNoPath:
            pass

    def _arrive(self, chunk: Chunk) -> None:
        isl = self.device_island.get(chunk.path[chunk.hop])
        release = self.sim.now
        if isl is not None and isl != chunk.island:
            chunk.island = isl
            t = chunk.transfer
            standing = t.standing.get(isl)
            if standing is not None and chunk.path is t.path:
                standing.uses += 1
                d = standing.decisions
            else:
                d = self.hooks.on_enter(chunk, isl)
            if d:
                release = self._apply(chunk, isl, d, release)
                coalesce = d.get("coalesce", 0)
                if coalesce and chunk.bytes < coalesce:
                    chunk = self._coalesce(chunk, isl, coalesce)
                    if chunk is None:
                        return
        if release > self.sim.now:
            self.sim.at(release, self._forward, chunk)
        else:
            self._forward(chunk)

    def _coalesce(self, chunk, island, size):
        key = (island, chunk.transfer.flow)
        buf = self.coalescing.setdefault(key, [])
        buf.append(chunk)
        total = sum(c.bytes for c in buf)
        if total < size and not chunk.last:
            return None
        del self.coalescing[key]
        merged = Chunk(chunk.transfer, chunk.index, total, chunk.path, chunk.hop, chunk.priority,
                       island=chunk.island, parts=[p for c in buf for p in (c.parts or [c])])
        return merged

    def _forward(self, chunk: Chunk) -> None:
        path, hop = chunk.path, chunk.hop
        if hop + 1 < len(path):
            self.servers[(path[hop], path[hop + 1])].enqueue(chunk, self._sent)
        elif path[hop] in self.wires and chunk.island is not None:
            chunk.island = None  # leaves on the wire once
            self.wires[path[hop]].enqueue(chunk, self._delivered)
        else:
            self._delivered(chunk)

    def _sent(self, chunk: Chunk) -> None:
        u, v = chunk.path[chunk.hop], chunk.path[chunk.hop + 1]
        chunk.hop += 1
        self.sim.at(self.sim.now + (self.g.edges[u, v].get("latency") or 0), self._arrive, chunk)

    def _delivered(self, chunk: Chunk) -> None:
        now = self.sim.now
        for part in chunk.parts or [chunk]:
            t = part.transfer
            t.queue_waits.append(chunk.waited + part.waited if chunk.parts else part.waited)
            t.chunks_done += 1
            for isl, _ in self._gpu_ends(t):
                self.hooks.on_delivered(part, isl, now - t.start)
            if t.chunks_done == t.chunks_total:
                t.end = now
                if t.on_done is not None:
                    t.on_done(t)
