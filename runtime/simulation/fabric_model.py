"""The fabric model: a discrete-event simulation of chunks moving hop by hop.

Every directed link is a server (`servers.Server`: strict priority between classes,
round robin between flows within one); a chunk is sent whole and arrives after the
link's latency.  The two directions of the link to switch-attached memory share one
server: a memory device's bandwidth is shared by reads and writes.  A chunk that ends
at a DPU/NIC leaves on its wire (line rate, plus a per-chunk overhead); one that starts
there is received on it first, as one from host memory is read first.  A GPU moves
its transfers' chunks with its copy engines, one chunk at a time per engine
(`servers.CopyEngine`).

Hooks are not called here: the fabric asks a `HookSite` at the moments a
program may decide (a chunk issued, entering an island, delivered) and applies
what comes back: ``priority``, ``rate`` (a token bucket at that island),
``defer``, ``route`` (the next hop), ``coalesce`` (merge small chunks),
``stream`` (the copy-engine stream), ``queue`` (the NIC transmit queue) and
``tier`` (redirect the data to another memory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from fabric_ext.contract import topology
from fabric_ext.contract.digraph import DiGraph
from fabric_ext.contract.hooks import TIER_KINDS, firing
from fabric_ext.runtime.machine.errors import InputError

from .servers import CLASS_STREAM, Chunk, CopyEngine, Server, Transfer
from .sim import Sim
from .trains import Trains

#: the decisions the fabric acts on (`Fabric._apply`, and at issue `stream` and `coalesce`)
APPLIED = frozenset({"priority", "defer", "rate", "route", "tier", "queue", "stream", "coalesce"})
#: ... those of a pace (`Fabric._pace`), which `_apply` takes without looking up the others
PACING = frozenset({"priority", "rate"})


class WireSpec(NamedTuple):
    """A DPU/NIC's network wire: its line rate (B/s), fixed cost per chunk (ns), and the time a
    chunk spends in the device before it has left on the wire (ns: the device's `latency`)."""
    bw: float
    overhead: float
    latency: float = 0.0


@dataclass(slots=True)
class _Held:
    """The chunks of one flow held at one place to be coalesced (`Fabric._coalesce`)."""
    chunks: list = field(default_factory=list)
    bytes: int = 0


class NoPath(InputError):
    """A transfer between devices the fabric does not connect."""


class HookSite:
    """What the fabric asks at decision points; the engine implements it with shims."""

    def asks(self, island: str, moment: str, transfer: Transfer | None = None) -> bool:
        """Whether the site may act on events at ``island`` at ``moment`` ("issue", "enter",
        "deliver"), of ``transfer``'s chunks on its own path where given: where it does not,
        the fabric need not ask, nor have an event to, and nothing is decided there."""
        return True

    def standing(self, transfer: Transfer, island: str, moment: str, role: str = ""):
        """What holds for every chunk of ``transfer`` at ``island`` at ``moment`` ("issue", with
        the island's role there, or "enter") with no program run: an object with the
        ``decisions`` (None, or a read-only dict) that asking gives, and ``watched``: True where
        programs there watch each chunk, so each must still be shown to the site (`on_enter`,
        `on_issue`), which takes what stands, and then ``split``: True where what a chunk is
        shown with reads the queue by class (`Server.queued_above`).  None: the site must be
        asked."""
        return None

    def starting(self, transfer: Transfer) -> None:
        """``transfer`` is about to issue its first chunk, on its path: what the site already
        knows to stand for its chunks may stand from now on (`standing`)."""
        return None

    def stands_for(self, transfer: Transfer) -> object:
        """A token of what stands for ``transfer`` (`standing`): the same object for as long as
        none of it changes, so what is worked out from it may be kept that long."""
        return None

    def untold(self) -> None:
        """Have what trains took and have not told yet told now (`trains.Trains.tell`, which they
        put in its place): the site calls it before it sets or reads anything `took` changes,
        which then is as if told at once."""
        return None

    def took(self, standing, transfer: Transfer, island: str, times: int) -> None:
        """``times`` more chunks of ``transfer`` took ``standing`` (what `standing` gave for
        them at ``island``) without asking (`trains`): count them as asking would have.  Trains
        tell it when the site asks (`untold`), later than their steps."""
        return None

    def finished(self, transfer: Transfer) -> None:
        """The transfer's last chunk has arrived: nothing more will be asked about it."""
        return None

    def on_issue(self, chunk: Chunk, island: str, role: str) -> dict | None:
        """A chunk is about to be issued at a GPU: its decisions, read only (None: nothing for
        the fabric to apply)."""
        return None

    def on_enter(self, chunk: Chunk, island: str) -> dict | None:
        """A chunk enters an island (``chunk.hop`` is the island's device): its decisions
        there, or None.  The fabric only reads what comes back."""
        return None

    def on_delivered(self, chunk: Chunk, island: str, latency: float) -> None:
        return None

    def on_dequeue(self, chunk: Chunk, island: str, wait: float) -> None:
        """A chunk leaves an egress queue at ``island`` after ``wait`` ns (`Fabric.watch_dequeue`)."""
        return None


class Room:
    """Bytes free in each memory that has a size, once the workload's data is in it: the GPUs
    of the tensor-parallel group under "hbm" (the least of theirs: each keeps its shard, and
    what goes to one is counted as if it were the fullest), every other memory under its name.
    A memory without a size has room for anything."""

    def __init__(self, free: dict[str, float] | None = None, group: set[str] = frozenset()):
        self.free, self.group = dict(free or {}), group

    def _key(self, dev: str) -> str:
        return "hbm" if dev in self.group else dev

    def take(self, dev: str, nbytes: float) -> bool:
        """Take ``nbytes`` of ``dev``'s memory ("hbm": the group's), if it has them."""
        key = self._key(dev)
        if key in self.free:
            if self.free[key] < nbytes:
                return False
            self.free[key] -= nbytes
        return True

    def give(self, dev: str, nbytes: float) -> None:
        key = self._key(dev)
        if key in self.free:
            self.free[key] += nbytes


class Fabric:
    """Devices and links from the compiled manifest, and the chunks moving over them."""

    def __init__(self, sim: Sim, graph: DiGraph, device_island: dict[str, str],
                 island_kind: dict[str, str], wires: dict[str, tuple],
                 memory_channels: dict[str, float], hooks: HookSite | None = None,
                 copy_engines: dict[str, int] | None = None, per_chunk_events: bool = False,
                 evidence: bool = False, trains: bool = True, host_memory: dict[str, float] | None = None,
                 room: Room | None = None):
        """``evidence``: record every chunk's life (`Chunk.trail`) and what each link sent
        (`Server.occupants`), for `explain`; off, nothing is recorded.  ``trains``: step a
        server's round robin over copy engines' streams ahead inside one event (`trains`;
        not with evidence, which it does not record, nor with ``per_chunk_events``).
        ``host_memory``: the bandwidth (B/s) of each host's memory that has one: a chunk is read
        from it as it starts (`_enter_fabric`), and written to it as it arrives (`_forward`).  ``room``:
        what each memory has free, which a `tier` takes from (none: every memory has room)."""
        self.sim, self.g = sim, graph
        self.room = room or Room()
        self.evidence = evidence
        self.per_chunk_events = per_chunk_events   # an event at every arrival too (see `_lands_quietly`)
        self.device_island, self.island_kind = device_island, island_kind
        self.hooks = hooks or HookSite()
        self.servers: dict[tuple[str, str], Server] = {}
        self.latency = {(u, v): e.get("latency") or 0 for u, v, e in graph.edges(data=True)}   # ns, per link
        shared: dict[str, Server] = {}
        for u, v, e in graph.edges(data=True):
            mem = u if u in memory_channels else v if v in memory_channels else None
            if mem is not None and e.get("kind") == "internal":
                if mem not in shared:
                    shared[mem] = Server(sim, f"{mem} memory", memory_channels[mem], per_chunk_events=per_chunk_events)
                    shared[mem].ends = (mem, "memory")
                self.servers[(u, v)] = shared[mem]
            else:
                self.servers[(u, v)] = Server(sim, f"{u}->{v}", e["bw"], e.get("setup") or 0.0, per_chunk_events)
                self.servers[(u, v)].ends = (u, v)
        specs = {dev: WireSpec(*spec) for dev, spec in wires.items()}
        self.wires = {dev: Server(sim, f"{dev}->wire", spec.bw, spec.overhead) for dev, spec in specs.items()}
        self.wire_latency = {dev: spec.latency for dev, spec in specs.items() if spec.latency}
        for dev, srv in self.wires.items():
            srv.ends = (dev, "wire")
        self.host_memory = {dev: Server(sim, f"{dev} memory", bw, per_chunk_events=per_chunk_events)
                            for dev, bw in (host_memory or {}).items()}
        for dev, srv in self.host_memory.items():
            srv.ends = (dev, "memory")
        # what a chunk goes through at the first device of its path, before it enters there: a
        # host's memory, read; a DPU/NIC's wire, received from the network (full duplex: its own)
        self.sources = dict(self.host_memory)
        for dev, spec in specs.items():
            self.sources[dev] = Server(sim, f"wire->{dev}", spec.bw, spec.overhead)
            self.sources[dev].ends = (dev, "wire in")
        if evidence:
            for srv in [*self.servers.values(), *self.wires.values(), *self.sources.values()]:
                srv.occupants = []
        self.trains = Trains(self) if trains and not evidence and not per_chunk_events else None
        if self.trains is not None:
            for srv in self.servers.values():
                srv.train = self.trains.finish
        self.engines = {dev: [CopyEngine(sim, f"{dev} copy engine {i}", self._taken) for i in range(n)]
                        for dev, n in (copy_engines or {}).items() if n > 0}
        self.buckets: dict[tuple, float] = {}
        self.refused = {"route": 0, "tier": 0}     # decisions refused (stats.REFUSED says why they may be)
        # what a tier may name (the catalogue's TIER_KINDS): switch-attached memory, and the
        # islands that are memories themselves (a GPU's HBM, the host's)
        self.memories = set(memory_channels) | {n for n, k in island_kind.items() if k in TIER_KINDS}
        self.coalescing: dict[tuple, _Held] = {}
        self.transfers: list[Transfer] = []
        self._ports: dict[str, list[str]] = {}
        self._port_index: dict[tuple[str, str], int] = {}
        self._routes: dict[tuple[str, str], list[str]] = {}
        self._ends_of: dict[tuple[str, str, str], list[tuple[str, str]]] = {}
        self._quiet: dict[tuple, bool] = {}     # (transfer's ends and movement, chunk's end, island it came from) -> `_nothing_asked`

    # -- paths ------------------------------------------------------------------------
    def route(self, src: str, dst: str) -> list[str] | None:
        """`topology.route`, cached: the graph is fixed."""
        key = (src, dst)
        if key not in self._routes:
            self._routes[key] = topology.route(self.g, src, dst)
        path = self._routes[key]
        return list(path) if path is not None else None

    def ports(self, device: str) -> list[str]:
        """The devices a device's ports lead to, in port-index order (`topology.ports`)."""
        if device not in self._ports:
            self._ports[device] = topology.ports(self.g, device)
        return self._ports[device]

    def port_index(self, device: str, peer: str) -> int:
        key = (device, peer)
        if key not in self._port_index:
            self._port_index[key] = topology.port_index(self.g, device, peer)
        return self._port_index[key]

    def ingress_port(self, path: list[str], hop: int) -> int:
        """The index of the port a chunk at ``hop`` of ``path`` came into its device by: the one
        from the device before, or, at a DPU/NIC that starts the path, its network port,
        numbered after its links (0 where it came in by none)."""
        dev = path[hop]
        if hop:
            return self.port_index(dev, path[hop - 1])
        return len(self.ports(dev)) if dev in self.wires else 0

    def egress_port(self, path: list[str], hop: int) -> int:
        """The index of the port a chunk at ``hop`` of ``path`` leaves its device by: the one to
        the next device, or, at a DPU/NIC that ends the path, its network port (0 where it
        leaves by none)."""
        dev = path[hop]
        if hop + 1 < len(path):
            return self.port_index(dev, path[hop + 1])
        return len(self.ports(dev)) if dev in self.wires else 0

    def server(self, u: str, v: str) -> Server:
        return self.servers[(u, v)]

    def watch_dequeue(self, islands: set[str], watching: set[str] = frozenset()) -> None:
        """Ask the hook site (`HookSite.on_dequeue`) whenever a chunk leaves a queue of a device
        of ``islands`` for its link or wire; the other servers ask nothing.  At ``watching``
        islands only programs that watch are asked (`Server.watched`: trains may step there)."""
        egress = [(u, srv) for (u, _), srv in self.servers.items()] + list(self.wires.items())
        for dev, srv in egress:
            if self.device_island.get(dev) in islands:
                srv.on_dequeue = self._dequeued
                srv.watched = self.device_island[dev] in watching

    def _dequeued(self, chunk: Chunk, wait: float) -> None:
        path = chunk.path
        isl = self.device_island.get(path[chunk.hop])     # the sending end (a memory: its island's)
        if isl is not None and firing(self.island_kind.get(isl, ""), "dequeue",
                                      topology.island_role(isl, path[0], path[-1], self.device_island)):
            self.hooks.on_dequeue(chunk, isl, wait)

    # -- transfers --------------------------------------------------------------------
    def start(self, t: Transfer) -> None:
        """Start a transfer: its chunks are made and issued from here on (`_issue`)."""
        t.start = self.sim.now
        t.path = t.path or self.route(t.src, t.dst)
        if t.path is None:
            raise NoPath(f"the fabric has no path from '{t.src}' to '{t.dst}' for {t.name}: link them")
        t.chunks_total = max(1, -(-t.bytes // t.chunk_bytes))
        self.transfers.append(t)
        t.driver = self._driver(t)
        self.hooks.starting(t)
        self._issue(t)

    def _driver(self, t: Transfer) -> list | None:
        """The copy engines of the GPU that moves a transfer: its source, else its destination.
        A collective has none: NCCL moves it from kernels on the SMs, every chunk at once."""
        if t.operator == "collective":
            return None
        return self.engines.get(t.src) or self.engines.get(t.dst)

    def _issue(self, t: Transfer) -> None:
        """The transfer's next chunk meets the issue hooks at its GPU ends and goes to a copy
        engine; the one after it meets them when an engine takes it.  A chunk held to be
        coalesced counts as taken.  Without copy engines every chunk follows at once."""
        while t.issued < t.chunks_total:
            chunk = t.next_chunk()
            if self.evidence:
                chunk.trail = []
            release, stream, coalesce = self.sim.now, 0, 0
            if chunk.trail is not None and release > t.start:
                chunk.trail.append(("pending", t.start, release, None))
            for isl, role in self._ends(t, "issue"):
                d = self.hooks.on_issue(chunk, isl, role)
                if d:
                    release = max(release, self._apply(chunk, isl, d, release, "issue"))
                    stream = d.get("stream") or stream
                    coalesce = d.get("coalesce") or coalesce
            if coalesce and chunk.bytes < coalesce or self._takes_held(chunk, ("issue", t)):
                chunk = self._coalesce(chunk, ("issue", t), coalesce)
                if chunk is None:
                    continue
            if t.driver is None:
                self.sim.at(release, self._enter_fabric, chunk)
                continue
            stream = stream or CLASS_STREAM.get(t.cls, 1)
            engine = t.engine(stream)
            if release > self.sim.now:
                self.sim.at(release, engine.submit, chunk, stream)
            else:
                engine.submit(chunk, stream)
            return

    def _taken(self, chunk: Chunk) -> None:
        """A copy engine took a chunk: it enters the fabric, and the next one is issued."""
        self._enter_fabric(chunk)
        self._issue(chunk.transfer)

    @staticmethod
    def _free_engine(chunk: Chunk) -> None:
        engine, chunk.engine = chunk.engine, None
        if engine is not None:
            engine.release()

    def _ends(self, t: Transfer, moment: str) -> list[tuple[str, str]]:
        """The islands at a transfer's ends whose hooks fire at ``moment`` (the catalogue's)
        and that the hook site asks there, with their role: the source first, then the
        destination (the order their programs see its chunks in).  Asked for every chunk, so
        kept per pair of ends and movement."""
        key = (t.path[0], t.path[-1], moment, t.movement_id)
        if key not in self._ends_of:
            ends = [(key[0], "src")] + ([(key[1], "dst")] if key[1] != key[0] else [])
            self._ends_of[key] = [(isl, role) for isl, role in ((self.device_island.get(e), r) for e, r in ends)
                                  if isl is not None and firing(self.island_kind.get(isl, ""), moment, role)
                                  and self.hooks.asks(isl, moment, t)]
        return self._ends_of[key]

    def _apply(self, chunk: Chunk, island: str, d: dict, now: float, moment: str = "enter") -> float:
        """Apply decisions (made at ``moment``: "issue" or "enter"); returns when the chunk
        may move on."""
        if "priority" in d:
            chunk.priority = d["priority"]
            if len(d) == 1:         # the usual decision: nothing else to look up
                return now
        if PACING.issuperset(d):     # the next most usual: a pace, and a rank at most
            rate = d.get("rate")
            return self._pace(chunk, island, rate, now, moment) if rate else now
        deferred = release = now + d.get("defer", 0)
        if chunk.trail is not None and deferred > now:
            chunk.trail.append(("defer", now, deferred, island, moment))
        if "queue" in d:
            chunk.queue = ("queue", d["queue"]) if d["queue"] else None
        rate = d.get("rate", 0)
        if rate:
            release = self._pace(chunk, island, rate, deferred, moment)
        nxt = d.get("route", 0)
        if nxt and chunk.hop + 1 < len(chunk.path):
            self._reroute(chunk, nxt)
        tier = d.get("tier", 0)
        if tier and tier != chunk.path[-1]:
            self._retarget(chunk, tier)
        return release

    def _pace(self, chunk: Chunk, island: str, rate: int, now: float, moment: str) -> float:
        """When a chunk paced at ``rate`` B/s from ``now`` on may move on: its flow's (or, where a
        NIC program chose one, its transmit queue's) bucket at the island passes each chunk
        after the one before it has had its bytes' time at the rate."""
        key = (island, chunk.queue or chunk.transfer.flow)
        buckets = self.buckets
        start = buckets.get(key, 0.0)
        if start < now:
            start = now
        buckets[key] = start + chunk.bytes / rate * 1e9
        if chunk.trail is not None and start > now:
            chunk.trail.append(("rate", now, start, island, moment))
        return start

    def _reroute(self, chunk, next_dev):
        here = chunk.path[chunk.hop]
        if next_dev == chunk.path[chunk.hop + 1]:
            return
        if not self.g.has_edge(here, next_dev):
            self.refused["route"] += 1
            return
        rest = self.route(next_dev, chunk.path[-1])
        if rest is None or not self._loop_free(chunk.path[:chunk.hop + 1], rest):
            self.refused["route"] += 1
            return
        chunk.path = chunk.path[:chunk.hop + 1] + rest

    @staticmethod
    def _loop_free(done: list[str], rest: list[str]) -> bool:
        """Whether a path on leaves out every device the chunk has crossed: a route back
        through one of them would loop (each time it got there, it would be sent back)."""
        return set(done).isdisjoint(rest)

    def _retarget(self, chunk, memory):
        """Send a chunk of data kept where it lands to ``memory`` instead, where that has room
        for it and a path leads there; its room where it was going is free again."""
        path = self.route(chunk.path[chunk.hop], memory) \
            if memory in self.memories and chunk.transfer.kept else None
        if path is None or not self._loop_free(chunk.path[:chunk.hop], path) or \
                not self.room.take(memory, chunk.bytes):
            self.refused["tier"] += 1
            return
        t, was = chunk.transfer, chunk.path[-1]
        self.room.give(was, chunk.bytes)
        t.elsewhere = t.elsewhere or {}
        for dev, n in ((was, -chunk.bytes), (memory, chunk.bytes)):
            if dev != t.dst:
                t.elsewhere[dev] = t.elsewhere.get(dev, 0) + n
        chunk.path = chunk.path[:chunk.hop] + path

    def _arrive(self, chunk: Chunk) -> None:
        isl = self.device_island.get(chunk.path[chunk.hop])
        release = self.sim.now
        if isl is not None and isl != chunk.island:
            chunk.island = isl
            d = self.hooks.on_enter(chunk, isl)
            coalesce = 0
            if d:
                release = self._apply(chunk, isl, d, release)
                coalesce = d.get("coalesce", 0)
            if coalesce and chunk.bytes < coalesce or self._takes_held(chunk, isl):
                chunk = self._coalesce(chunk, isl, coalesce)
                if chunk is None:
                    return
        if release > self.sim.now:
            self.sim.at(release, self._forward, chunk)
        else:
            self._forward(chunk)

    def _takes_held(self, chunk, where) -> bool:
        """Whether ``chunk`` is its transfer's last and its flow has chunks held at ``where``:
        they leave with it whatever it was decided itself (a decision that coalesces some
        chunks of a transfer and not its last would otherwise hold them for ever)."""
        return bool(self.coalescing) and chunk.last and (where, chunk.transfer.flow) in self.coalescing

    def _coalesce(self, chunk, where, size):
        """Hold the chunk with the flow's others held at ``where`` until together they reach
        ``size`` bytes (or the transfer's last chunk came): the merged chunk then, else None.
        A held chunk frees its copy engine, as if it had left."""
        if chunk.engine is not None:
            engine, chunk.engine = chunk.engine, None
            self.sim.at(self.sim.now, engine.release)
        key = (where, chunk.transfer.flow)
        held = self.coalescing.get(key)
        if held is None:
            held = self.coalescing[key] = _Held()
        held.chunks.append(chunk)
        held.bytes += chunk.bytes       # a running total: a buffer may hold a transfer's every chunk
        if held.bytes < size and not chunk.last:
            return None
        del self.coalescing[key]
        return Chunk(chunk.transfer, chunk.index, held.bytes, chunk.path, chunk.hop, chunk.priority,
                     island=chunk.island, parts=[p for c in held.chunks for p in (c.parts or [c])],
                     queue=chunk.queue, trail=chunk.trail)

    def _forward(self, chunk: Chunk) -> None:
        path, hop = chunk.path, chunk.hop
        if hop + 1 < len(path):     # on to the next device (every hop of every chunk comes here)
            self.servers[(path[hop], path[hop + 1])].enqueue(chunk, self._sent, self._handed_on)
        elif path[hop] in self.wires and chunk.island is not None:
            chunk.island = None  # leaves on the wire once
            self.wires[path[hop]].enqueue(chunk, self._off_the_wire)
        elif self.host_memory and path[hop] in self.host_memory:
            self.host_memory[path[hop]].enqueue(chunk, self._delivered)     # written to it as it arrives
        else:
            self._delivered(chunk)

    def _enter_fabric(self, chunk: Chunk) -> None:
        """A chunk starts on its path: read from its host's memory, or received off its NIC's
        wire, first where its source has one (`sources`), then it enters the source's island."""
        source = self.sources.get(chunk.path[0]) if self.sources else None
        if source is None:
            self._arrive(chunk)
        else:
            source.enqueue(chunk, self._from_source)

    def _from_source(self, chunk: Chunk) -> None:
        """Read, or received (there after the device's latency, where it has one)."""
        latency = self.wire_latency.get(chunk.path[0])
        if not latency:
            self._arrive(chunk)
            return
        now = self.sim.now
        if chunk.trail is not None:
            chunk.trail.append(("latency", now, now + latency, ("wire", chunk.path[0])))
        self.sim.at(now + latency, self._arrive, chunk)

    def _off_the_wire(self, chunk: Chunk) -> None:
        """The chunk's end of transmission on its NIC's wire: it has left on the network once
        the device's latency has passed (where it has one)."""
        latency = self.wire_latency.get(chunk.path[chunk.hop])
        if not latency:
            self._delivered(chunk)
            return
        now = self.sim.now
        if chunk.trail is not None:
            chunk.trail.append(("latency", now, now + latency, (chunk.path[chunk.hop], "wire")))
        self.sim.at(now + latency, self._delivered, chunk)

    def _sent(self, chunk: Chunk) -> None:
        """The chunk's end of transmission: it arrives at the next device a latency later."""
        if chunk.engine is not None:
            self._free_engine(chunk)
        arrival = self._leave(chunk, self.sim.now)
        if self.per_chunk_events or not self._lands_quietly(chunk, chunk.hop):
            self.sim.at(arrival, self._arrive, chunk)
        else:
            self._landed(chunk, arrival)

    def _handed_on(self, chunk: Chunk, end: float) -> bool:
        """A server offers to be done with the chunk as it starts (`Server`): taken where its
        arrival will be quiet, so that nothing it does after ``end`` has an event to order."""
        if not self._lands_quietly(chunk, chunk.hop + 1):
            return False
        self._landed(chunk, self._leave(chunk, end))
        return True

    def _leave(self, chunk: Chunk, end: float) -> float:
        """The chunk leaves its link at ``end`` for the next hop; when it arrives there."""
        u, v = chunk.path[chunk.hop], chunk.path[chunk.hop + 1]
        chunk.hop += 1
        chunk.queue = None          # a transmit queue holds at the NIC it was chosen at
        latency = self.latency[u, v]
        if chunk.trail is not None and latency:
            chunk.trail.append(("latency", end, end + latency, (u, v)))
        return end + latency

    def _lands_quietly(self, chunk: Chunk, hop: int) -> bool:
        """Whether the chunk's arrival at ``hop`` of its path would only count it as
        delivered: the end of its path, no hook to ask there, no wire to leave by, no copy
        engine to free, not a coalesced chunk (its parts may be of several transfers), and not
        the chunk that completes its transfer."""
        path, t = chunk.path, chunk.transfer
        if hop + 1 < len(path) or chunk.engine is not None or chunk.parts:
            return False
        key = (t.path[0], t.path[-1], t.movement_id, path[-1], chunk.island)
        quiet = self._quiet.get(key)
        if quiet is None:
            quiet = self._quiet[key] = self._nothing_asked(t, path[-1], chunk.island)
        return quiet and t.chunks_done + 1 < t.chunks_total

    def _nothing_asked(self, t: Transfer, dev: str, came_from: str | None) -> bool:
        """Whether arriving at ``dev`` from island ``came_from`` at the end of its path asks
        the hook site nothing for a chunk of ``t`` (`_arrive`, `_forward`, `_delivered`)."""
        isl = self.device_island.get(dev)
        if dev in self.wires or dev in self.host_memory or \
                (isl is not None and isl != came_from and self.hooks.asks(isl, "enter")):
            return False
        return not self._ends(t, "deliver")

    @staticmethod
    def _landed(chunk: Chunk, at: float) -> None:
        """Count a chunk as delivered before it arrives (at ``at``): nothing reads the count
        until its transfer completes, and the completion waits for the chunk (`_delivered`)."""
        t = chunk.transfer
        t.queue_waits.append(chunk.waited)
        t.chunks_done += 1
        if at > t.landing:
            t.landing = at
            if chunk.trail is not None:
                t.last_chunk = chunk        # the last to arrive so far

    def _delivered(self, chunk: Chunk) -> None:
        now = self.sim.now
        if chunk.engine is not None:
            self._free_engine(chunk)
        for part in chunk.parts or [chunk]:
            t = part.transfer
            t.queue_waits.append(chunk.waited + part.waited if chunk.parts else part.waited)
            t.chunks_done += 1
            for isl, _ in self._ends(t, "deliver"):
                self.hooks.on_delivered(part, isl, now - t.start)
            if t.chunks_done == t.chunks_total:
                if t.landing > now:     # a chunk counted ahead (`_landed`) is still on its way
                    self.sim.at(t.landing, self._complete, t)
                else:
                    if chunk.trail is not None:
                        t.last_chunk = chunk
                    self._complete(t)

    def _complete(self, t: Transfer) -> None:
        """The transfer's last chunk has arrived."""
        t.end = self.sim.now
        t.train = None          # (nothing more to step)
        self.hooks.finished(t)
        if t.on_done is not None:
            t.on_done(t)
