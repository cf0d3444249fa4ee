"""Trains: a server's round robin over copy engines' streams, stepped ahead inside one event.

GPUs streaming weights from the CXL pool keep its memory channel busy with one chunk per
GPU and movement, served round robin, and every chunk takes the same steps.  At its end of
transmission its copy engine takes the transfer's next chunk, which enters the fabric and
queues at the channel again; the one after it is issued; the chunk leaves for the switch;
the channel sends the next flow's chunk.  At its arrival at the switch it goes out at once on
the idle link to its GPU and lands there without an event.

Where the chunks' transfers fit that pattern (a `_Flow` each: see `Trains._flow`) and no
program is asked on the way (the hook site's answers stand: `HookSite.standing`, a priority
at most, or nothing but programs that watch, which are shown each chunk), `Trains.finish`
takes these steps one after another inside the event of the first, for as long as each comes
before every event in the loop's queue.  Each step is the
loop's, with the calls between its parts left out: taken at its time and in its order, it
counts as an event (`Sim.take`), what it schedules takes its place in the order of events
(`Sim.place`), and it changes the same state (the server's queues, the copy engine's
streams, the hook site's counts, told before the site reads them: `Trains.tell`) in the
same way.  The first step that does not fit (a program to ask, a busy link, a chunk that
completes its transfer, an event due first) and those after it go to the loop as ordinary
events.

Where the class the server sends is a ring (each of its flows has one chunk queued and its
copy engine one issued, and nothing is asked of them on the way but to show them to programs
that watch them enter: `Trains._ring_of`), every step is the same few sums on the same kinds
of chunk: `Trains._ring` takes them in one loop of its own, with the server's queue and the
engines' streams kept in locals and written back when the ring stops.

Only the time a run takes changes: `Fabric(trains=False)` takes every step in the loop, and
the tests compare the two.
"""
from __future__ import annotations

import heapq
import operator
from collections import deque
from dataclasses import dataclass

from .servers import CLASS_STREAM, DEFAULT_PRIORITY

PRIORITY_ONLY = frozenset({"priority"})
_LAST_ISSUE = operator.attrgetter("last_issue")
_NEVER = object()       # what `Transfer.train` is kept under where no train can take it (`Trains._never`)


@dataclass(slots=True, eq=False)
class _Flow:
    """A transfer whose chunks a train may step: what each step needs of it, worked out once
    (kept on the transfer while what stands for it holds: `HookSite.stands_for`), and how often trains
    took what stands for it, told to the hook site when it asks (`Trains.tell`, `HookSite.took`)."""
    t: object
    server: object              # the first link of its path, shared (the pool's channel)
    link: object                # the link from the next device on, to the end of its path
    engine: object              # the copy engine its chunks are issued to (`Fabric._issue`)
    enter: str | None           # the island its chunks enter as its engine takes them (None: none)
    enter_standing: object      # what stands there (`HookSite.standing`; None: the site asks nothing)
    enter_priority: int | None  # ... the chunk's priority it gives (None: none)
    watched: bool               # ... nothing, but programs watch: each chunk is given to them there
    split: bool                 # ... and what it is given with reads the queue by class (`HookSite.standing`)
    ends: list                  # (island, what stands there) asked as a chunk is issued, where answers stand
    issue_priority: int | None  # ... the priority they give (None: none)
    shown: list                 # ... those where nothing stands but programs that watch (`HookSite.on_issue`)
    stream: int = 1             # its chunks' stream on that engine
    lat1: float = 0.0           # ns from the server to the next device
    lat2: float = 0.0           # ns from there to the end of its path
    next: object = None         # in a ring (`Trains._ring`): the chunk its engine takes next, or None
    entered: int = 0            # chunks trains entered since the flow was last told (`tell`)
    issued: int = 0             # ... and issued
    last_issue: float = -1.0    # when a train last issued one (the flows' prefetch words are told in that order)

    def tell(self, hooks) -> None:
        """Tell the hook site what trains took of what stands, and start counting anew."""
        if self.entered and self.enter_standing is not None:
            hooks.took(self.enter_standing, self.t, self.enter, self.entered)
        if self.issued:
            for island, standing in self.ends:
                hooks.took(standing, self.t, island, self.issued)
        self.entered = self.issued = 0


def _asks(server) -> bool:
    """Whether a chunk starting on ``server``'s link meets a program that is not only watching
    (one that watches is shown it as the step takes it: `Server._send`)."""
    return server.on_dequeue is not None and not server.watched


class Trains:
    def __init__(self, fabric):
        self.fabric, self.sim, self.hooks = fabric, fabric.sim, fabric.hooks
        self.sent, self.handed_on = fabric._sent, fabric._handed_on
        self.steps = 0          # steps taken ahead, over the run (the tests see it engage)
        self.ringed = 0         # ... of them, those taken in rings (`_ring`)
        self._told: dict = {}   # the flows trains stepped since they last told their counts (`tell`)
        fabric.hooks.untold = self.tell

    def finish(self, server, chunk, done) -> bool:
        """`Server._finish` asks first: True where this took the chunk's end of transmission,
        and the steps after it that fit."""
        if done != self.sent or server.on_dequeue is not None and not server.watched \
                or not self._takes(server, chunk):     # (`_asks`, inline: every end of transmission asks)
            return False
        sim, arriving = self.sim, []     # arriving: (time, place, chunk, None), a heap
        sending = self._finish(server, chunk, arriving)
        while True:
            due = sending
            if arriving and (due is None or arriving[0][:2] < due[:2]):
                due = arriving[0]
            if due is None:
                break
            head = sim.head()
            if head is not None and head < due[:2]:
                break
            t, _, c, d = due
            if due is sending:
                if d != self.sent or not self._takes(server, c):
                    break
                ring = None if arriving else self._ring(server, sending, head)
                if ring is not None:
                    sending, arriving = ring
                    continue
                if not sim.take(t):
                    break
                sending = self._finish(server, c, arriving)
            else:
                if not self._lands(c, t) or not sim.take(t):
                    break
                heapq.heappop(arriving)
                self._arrive(c, t)
            self.steps += 1
        if sending is not None:
            t, place, c, d = sending
            sim.at_place(t, place, server._finish, c, d)
        for t, place, c, _ in arriving:
            sim.at_place(t, place, self.fabric._arrive, c)
        return True

    def tell(self) -> None:
        """Tell the hook site what trains took of what stands since they last told (`_Flow.tell`),
        flow by flow in the order of their last issues, so that the latest word holds (a prefetch
        depth): the site calls this (`HookSite.untold`) before it sets or reads what telling
        changes, so a train's stop, far more frequent, need not."""
        if self._told:
            told, self._told = self._told, {}
            for flow in sorted(told, key=_LAST_ISSUE):
                flow.tell(self.hooks)

    # -- what fits -------------------------------------------------------------------------------
    def _takes(self, server, chunk) -> bool:
        """Whether the chunk's end of transmission at ``server`` is a step: its copy engine's
        next chunk is of a `_Flow` through this server, fresh from its issue."""
        engine = chunk.engine
        if engine is None or not engine.streams:
            return False
        nxt = next(iter(engine.streams.values()))[0]
        flow = self._flow(nxt.transfer)
        return flow is not None and flow.server is server and flow.engine is engine and nxt.hop == 0 \
            and nxt.island is None and nxt.path is flow.t.path

    def _lands(self, chunk, now) -> bool:
        """Whether the chunk arriving at the next device of its flow goes out at once on the
        idle link on, to land without an event (not the one that completes its transfer)."""
        flow = self._kept(chunk.transfer)
        if flow is None or chunk.path is not flow.t.path or chunk.hop != 1 or chunk.parts:
            # a coalesced chunk lands as its parts (`Fabric._delivered`).  It can be a flow's
            # only where coalescing took the transfer's last chunk, so none is left to issue: a
            # ring stops before landing it (no next chunk), and a train's landing is this one
            return False
        link, t = flow.link, flow.t
        return not link.busy and not link.classes and now >= link.free_at and t.chunks_done + 1 < t.chunks_total

    def _flow(self, t) -> _Flow | None:
        """``t`` as a flow of trains, where it fits: copy engines issue its chunks on its
        class's stream; its path crosses two links, the first two devices in one island (or
        none), nothing asked at the end; what its chunks are asked as they are issued and as
        they enter stands, a priority at most."""
        token, kept = self.hooks.stands_for(t), t.train
        if kept is None or kept[0] is not token and kept[0] is not _NEVER:
            kept = t.train = (_NEVER, None) if self._never(t) else (token, self._fits(t))
        return kept[1]

    def _kept(self, t) -> _Flow | None:
        """``t``'s flow as last worked out, if it fits and what stands for it still holds."""
        kept = t.train
        return kept[1] if kept is not None and kept[0] is self.hooks.stands_for(t) else None

    def _never(self, t) -> bool:
        """Whether ``t``'s path is no flow's, whatever stands for it: its chunks are not issued by
        copy engines, or it does not cross two links from a first two devices in one island."""
        fabric, path = self.fabric, t.path
        # (a source's memory or receive wire comes before its first link: no step goes past it;
        # its island is its own, so only a manifest without islands would get this far)
        return t.driver is None or not t.fixed_cost or len(path) != 3 or path[0] in fabric.sources \
            or fabric.device_island.get(path[0]) != fabric.device_island.get(path[1])

    def _fits(self, t) -> _Flow | None:
        fabric = self.fabric
        path = t.path
        island = fabric.device_island.get(path[0])
        link = fabric.servers[path[1], path[2]]
        if not fabric._nothing_asked(t, path[2], island) or _asks(link):
            return None
        entering, watched, split = {}, False, False   # where the site asks nothing of its chunks, nothing is decided
        stands = None
        if island is not None and self.hooks.asks(island, "enter", t):
            stands = self.hooks.standing(t, island, "enter")
            entering, watched = self._answer(stands), stands is not None and stands.watched
            split = watched and stands.split
        if entering is None:
            return None
        ends, shown, issue_priority = [], [], None
        if t.issued < t.chunks_total:
            for end in fabric._ends(t, "issue"):    # (the islands the site asks about its chunks there)
                standing = self.hooks.standing(t, end[0], "issue", end[1])
                answer = self._answer(standing)
                if answer is None:
                    return None
                if standing.watched:
                    shown.append(end)
                else:       # the last end's word holds (`Fabric._issue`)
                    ends.append((end[0], standing))
                    issue_priority = answer.get("priority", issue_priority)
        if shown and issue_priority is not None:    # (a watcher after it would see its priority)
            return None
        stream = CLASS_STREAM.get(t.cls, 1)
        return _Flow(t, fabric.servers[path[0], path[1]], link, t.engine(stream), island, stands,
                     entering.get("priority"), watched, split, ends, issue_priority, shown, stream,
                     fabric.latency[path[0], path[1]], fabric.latency[path[1], path[2]])

    @staticmethod
    def _answer(s) -> dict | None:
        """What asking gives where ``s`` stands (`HookSite.standing`) and a priority at most comes
        back; None otherwise."""
        if s is None:
            return None
        if s.decisions and not s.decisions.keys() <= PRIORITY_ONLY:
            return None
        return s.decisions or {}

    # -- the steps -------------------------------------------------------------------------------
    def _finish(self, server, chunk, arriving) -> tuple | None:
        """The chunk's end of transmission (`Fabric._sent`, then `Server._start`); returns the
        server's next end of transmission, (time, place, chunk, done), if it has one."""
        fabric, sim = self.fabric, self.sim
        now = sim.now
        # its copy engine takes the next chunk (`CopyEngine.release`), which enters the fabric
        # and queues here (`Fabric._taken`, `Server.enqueue`)
        engine, chunk.engine = chunk.engine, None
        taken = engine._pop()
        t = taken.transfer
        flow = t.train[1]           # (`_takes` worked it out)
        self._told[flow] = None
        if flow.enter is not None:
            self._enter(flow, taken)
        server._admit(taken)
        server._queue(taken, self.sent, self.handed_on)
        # and the transfer's next chunk is issued (`Fabric._issue`, `CopyEngine.submit`)
        if t.issued < t.chunks_total:
            engine.submit(self._issue(flow, now), flow.stream)     # (`flow.engine`: `_takes`)
        # the chunk leaves for the next device (`Fabric._sent`)
        arrival = fabric._leave(chunk, now)
        if fabric._lands_quietly(chunk, chunk.hop):
            fabric._landed(chunk, arrival)
        else:
            heapq.heappush(arriving, (arrival, sim.place(), chunk, None))
        # and the server sends its next (`Server._start`)
        picked = server._pick()
        if picked is None:
            return None
        nxt, done, handed_on = picked
        end = server._send(nxt)
        if handed_on is not None and not server.classes and handed_on(nxt, end):
            server._hand_off(end)
            return None
        return end, sim.place(), nxt, done

    def _enter(self, flow, chunk) -> None:
        """The chunk enters the island its flow's chunks enter as its engine takes it: asking
        there takes what stands (`HookSite.took`), or shows it to the programs that watch."""
        chunk.island = flow.enter
        if flow.watched:
            self.hooks.on_enter(chunk, flow.enter)
        else:
            flow.entered += 1
        if flow.enter_priority is not None:
            chunk.priority = flow.enter_priority

    def _issue(self, flow, now: float):
        """The flow's transfer's next chunk, issued at ``now`` (`Fabric._issue`): what stands at
        its ends taken, in the order of issues (`_Flow.last_issue`: a train's steps are the ends of
        transmission of one server, each later than the one before), shown to the programs that
        watch there, and its priority given."""
        chunk = flow.t.next_chunk()
        if flow.ends:
            flow.issued += 1
            flow.last_issue = now
        for island, role in flow.shown:
            self.hooks.on_issue(chunk, island, role)
        if flow.issue_priority is not None:
            chunk.priority = flow.issue_priority
        return chunk

    def _arrive(self, chunk, now) -> None:
        """Its arrival at the next device, where `_lands` (`Fabric._arrive`, `Server.enqueue`,
        `Fabric._handed_on`)."""
        flow = chunk.transfer.train[1]      # (`_lands` read it)
        link = flow.link
        link._admit(chunk)
        end = link._send(chunk)
        self.fabric._landed(chunk, self.fabric._leave(chunk, end))
        link._hand_off(end)

    # -- rings -----------------------------------------------------------------------------------
    def _ring(self, server, sending, head) -> tuple | None:
        """The steps from ``sending``'s end of transmission on (due before ``head``, the loop's
        next event), where the server's class being sent is a ring: each of its flows has one
        chunk queued and its copy engine one issued, and nothing is asked of their chunks on the
        way but to show them to programs that watch (`_ring_of`).  Then every step is the same
        few sums on the same kinds of chunk, taken here in the loop's order, with the server's
        queue and the engines' streams kept in locals and written back at the end (`_unring`):
        one loop, without the calls between a step's parts that `_finish` makes, since those
        calls are what a step costs.  Returns (sending, arriving) as the loop goes on with
        them; None where the class is no ring or no step was taken."""
        found = self._ring_of(server, sending[2])
        if found is None:
            return None
        cur, ring, q = found
        sim, place, landed = self.sim, self.sim.place, self.fabric._landed
        # where programs watch, a batch of theirs may run as a chunk is shown and change what
        # stands: each end of transmission then checks what its flow was worked out from, as
        # `_takes` does (an arrival that `_lands` would refuse for it lands as the ring lands it)
        watching = cur.watched or any(flow.watched for flow, _ in ring)
        stands_for = self.hooks.stands_for
        head_t = head[0] if head is not None else float("inf")
        room = sim.room()
        bw, overhead, enqueues, lane = server.bw, server.overhead, server.enqueues, server.lane
        sent_on = server.intervals.flat.extend
        entry = (self.sent, self.handed_on)
        T, _, x, _ = sending
        taken, arriving = 0, []
        while True:
            # x (of flow cur) ends its transmission at T: its engine takes the flow's next chunk,
            # which queues here, and issues the one after it (`_finish`)
            y = cur.next
            if y is None or T >= head_t or taken >= room or watching and cur.t.train[0] is not stands_for(cur.t):
                break
            taken, now = taken + 1, T
            engine, t, nb = cur.engine, cur.t, y.bytes
            x.engine = None
            engine.chunks += 1
            engine.bytes += nb
            y.waited += T - y.enqueued
            y.engine, y.enqueued = engine, T
            if cur.enter is not None:
                sim.now = T             # (a chunk shown is shown at its time)
                self._enter(cur, y)
            server.queued_bytes += nb
            if enqueues is not None:
                enqueues.extend((T, lane, nb))
            ring.append((cur, (y, *entry)))
            if t.issued < t.chunks_total:
                z = cur.next = self._issue(cur, T)
                z.enqueued = T
            else:
                cur.next = None
            # x leaves for the next device, and the server sends the next flow's chunk (`Server._send`)
            x.hop, x.queue = 1, None
            A, pa = T + cur.lat1, place()
            nxt, queued = ring.popleft()
            w = queued[0]
            w.waited += T - w.enqueued
            nw = w.bytes
            end = T + (nw / bw * 1e9 + overhead)
            server.bytes += nw
            server.queued_bytes -= nw
            sent_on((T, end, nw))
            pe = place()
            # x arrives before w's end, and lands (`_lands`, `_arrive`: not its transfer's last
            # chunk, since y came after it)
            link = cur.link
            if A > end or A >= head_t or taken >= room or A < link.free_at:
                arriving.append((A, pa, x, None))
                cur, x, T = nxt, w, end
                break
            taken, now, nx = taken + 1, A, x.bytes
            x.enqueued = A
            if link.enqueues is not None:
                link.enqueues.extend((A, link.lane, nx))
            e2 = A + (nx / link.bw * 1e9 + link.overhead)
            link.bytes += nx
            link.intervals.flat.extend((A, e2, nx))
            x.hop = 2
            landed(x, e2 + cur.lat2)
            link.free_at, link.free_place = e2, place()
            cur, x, T = nxt, w, end
        self._unring(q, ring, cur)
        if not taken:       # (at the event limit)
            return None
        sim.took(taken, now)
        self.steps += taken
        self.ringed += taken
        return (T, pe, x, self.sent), arriving

    def _ring_of(self, server, sending) -> tuple | None:
        """The flow of the chunk ``sending`` ends, the server's queued flows of the class it
        sends in round-robin order, each with its queue entry, and that class's queue, where
        they are a ring (`_ring`): each flow's chunks fit trains, no program watches the links
        (programs may watch the chunks enter, where what they are shown with does not read the
        queue), and their engines take each flow's next chunk into that same class."""
        if not server.classes or server.on_dequeue is not None:
            return None
        p = -server.classes[0]
        q = server.queues[p]
        cur = self._ring_flow(sending, server, p)
        if cur is None or cur[0].t.flow in q:
            return None
        ring, heads = deque(), [cur]
        for chunks in q.values():
            if len(chunks) != 1:
                return None
            entry = chunks[0]
            flow = self._ring_flow(entry[0], server, p)
            if flow is None or entry[1] != self.sent or entry[2] != self.handed_on:
                return None
            ring.append((flow[0], entry))
            heads.append(flow)
        for flow, head in heads:        # (set only for the ring: `_unring` clears them)
            flow.next = head
        return cur[0], ring, q

    def _ring_flow(self, chunk, server, p) -> tuple | None:
        """``chunk``'s flow where it may go round a ring at ``server``'s class ``p``, with the
        chunk its engine takes next (None: none), else None."""
        t = chunk.transfer
        flow = self._flow(t)
        if flow is None or flow.server is not server or chunk.engine is not flow.engine or flow.split \
                or flow.shown or chunk.path is not t.path or chunk.hop or chunk.queue is not None:
            return None
        priority = flow.enter_priority
        if priority is None:
            priority = flow.issue_priority if flow.issue_priority is not None else DEFAULT_PRIORITY
        link, engine = flow.link, flow.engine
        streams = engine.streams
        if priority != p or link.on_dequeue is not None or link.busy or link.classes or len(streams) > 1 \
                or engine.current.get(flow.stream) is not t:     # (what `_unring` leaves as it was)
            return None
        if not streams:
            return flow, None
        stream, chunks = next(iter(streams.items()))    # (chunks of the transfers after it wait behind it)
        nxt = chunks[0]
        if stream != flow.stream or nxt.transfer is not t or nxt.hop or nxt.island is not None \
                or nxt.path is not t.path or nxt.queue is not None \
                or flow.enter_priority is None and nxt.priority != p:
            return None
        return flow, nxt

    def _unring(self, q, ring, cur) -> None:
        """Write back what `_ring` kept in locals: the class's queue in round-robin order, and
        each flow's engine: the chunk its engine takes next heads its stream, in place of the
        one there when the ring began (the same where the flow did not step).  The flows are
        counted with the train's, to be told when the site asks (`tell`: one that did not step
        has nothing to tell).  ``cur``: the flow whose chunk the server sends.  Each engine took its last
        chunk from the stream it now takes from, and took it for the same transfer
        (`_ring_flow`), so `CopyEngine.current` stays as it was."""
        q.clear()
        for flow, entry in ring:
            q[flow.t.flow] = deque((entry,))
        for flow in [cur, *(flow for flow, _ in ring)]:
            self._told[flow] = None
            streams = flow.engine.streams
            chunks = streams.get(flow.stream)
            if chunks is not None:
                chunks.popleft()
                if flow.next is not None:
                    chunks.appendleft(flow.next)
                elif not chunks:
                    del streams[flow.stream]
            flow.next = None
