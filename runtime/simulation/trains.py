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
streams, the hook site's counts) in the same way.  The first step that does not fit (a
program to ask, a busy link, a chunk that completes its transfer, an event due first) and
those after it go to the loop as ordinary events.

Only the time a run takes changes: `Fabric(trains=False)` takes every step in the loop, and
the tests compare the two.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from .servers import CLASS_STREAM

PRIORITY_ONLY = frozenset({"priority"})


@dataclass(slots=True, eq=False)
class _Flow:
    """A transfer whose chunks a train may step: what each step needs of it, worked out once
    (kept on the transfer while what stands for it holds: `HookSite.stands_for`), and how often a train
    took what stands for it, told to the hook site when the train stops (`HookSite.stood`)."""
    t: object
    server: object              # the first link of its path, shared (the pool's channel)
    link: object                # the link from the next device on, to the end of its path
    engine: object              # the copy engine its chunks are issued to (`Fabric._issue`)
    enter: str | None           # the island its chunks enter as its engine takes them (None: none)
    enter_priority: int | None  # what stands there: the chunk's priority (None: none)
    watched: bool               # ... nothing, but programs watch: each chunk is given to them there
    ends: list                  # (island, role) asked as a chunk is issued, where answers stand
    issue_priority: int | None  # ... the priority they give (None: none)
    shown: list                 # ... those where nothing stands but programs that watch (`HookSite.on_issue`)
    entered: int = 0            # chunks entered in this train
    issued: int = 0             # chunks issued in this train
    last_issue: int = -1        # when this train last issued one (prefetch words go in that order)

    def tell(self, hooks) -> None:
        """Tell the hook site what this train took of what stands, and start counting anew."""
        if self.entered:
            hooks.stood(self.t, self.enter, "enter", "", self.entered)
        if self.issued:
            for island, role in self.ends:
                hooks.stood(self.t, island, "issue", role, self.issued)
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
        self._told: dict = {}   # the flows this train stepped, to tell their counts (`_Flow.tell`)
        self._issues = 0        # issues taken ahead, numbered (`_Flow.last_issue`)

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
                if d != self.sent or not self._takes(server, c) or not sim.take(t):
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
        for flow in sorted(self._told, key=lambda f: f.last_issue):     # the latest prefetch word holds
            flow.tell(self.hooks)
        self._told.clear()
        return True

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
        if flow is None or chunk.path is not flow.t.path or chunk.hop != 1:
            return False
        link, t = flow.link, flow.t
        return not link.busy and not link.classes and now >= link.free_at and t.chunks_done + 1 < t.chunks_total

    def _flow(self, t) -> _Flow | None:
        """``t`` as a flow of trains, where it fits: copy engines issue its chunks on its
        class's stream; its path crosses two links, the first two devices in one island (or
        none), nothing asked at the end; what its chunks are asked as they are issued and as
        they enter stands, a priority at most."""
        token, kept = self.hooks.stands_for(t), t.train
        if kept is None or kept[0] is not token:
            kept = t.train = (token, self._fits(t))
        return kept[1]

    def _kept(self, t) -> _Flow | None:
        """``t``'s flow as last worked out, if it fits and what stands for it still holds."""
        kept = t.train
        return kept[1] if kept is not None and kept[0] is self.hooks.stands_for(t) else None

    def _fits(self, t) -> _Flow | None:
        fabric = self.fabric
        path = t.path
        if t.driver is None or not t.fixed_cost or len(path) != 3:
            return None
        island = fabric.device_island.get(path[0])
        link = fabric.servers[path[1], path[2]]
        if island != fabric.device_island.get(path[1]) or not fabric._nothing_asked(t, path[2], island) \
                or _asks(link):
            return None
        entering, watched = {}, False    # where the site asks nothing about its chunks, nothing is decided
        if island is not None and self.hooks.asks(island, "enter", t):
            standing = self.hooks.standing(t, island, "enter")
            entering, watched = self._answer(standing), standing is not None and standing.watched
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
                    ends.append(end)
                    issue_priority = answer.get("priority", issue_priority)
        if shown and issue_priority is not None:    # (a watcher after it would see its priority)
            return None
        return _Flow(t, fabric.servers[path[0], path[1]], link, t.engine(CLASS_STREAM.get(t.cls, 1)), island,
                     entering.get("priority"), watched, ends, issue_priority, shown)

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
        if flow.enter is not None:      # asking there takes what stands (`HookSite.stood`)
            taken.island = flow.enter
            if flow.watched:            # ... and gives the chunk to the programs that watch
                self.hooks.on_enter(taken, flow.enter)
            else:
                flow.entered += 1
            if flow.enter_priority is not None:
                taken.priority = flow.enter_priority
        server._admit(taken)
        server._queue(taken, self.sent, self.handed_on)
        # and the transfer's next chunk is issued (`Fabric._issue`, `CopyEngine.submit`)
        if t.issued < t.chunks_total:
            issued = t.next_chunk()
            if flow.ends:
                flow.issued += 1
                flow.last_issue = self._issues
                self._issues += 1
            if flow.shown:
                for island, role in flow.shown:     # (the watchers are given it: `Fabric._issue`)
                    self.hooks.on_issue(issued, island, role)
            if flow.issue_priority is not None:
                issued.priority = flow.issue_priority
            engine.submit(issued, CLASS_STREAM.get(t.cls, 1))     # (`flow.engine`: `_takes`)
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

    def _arrive(self, chunk, now) -> None:
        """Its arrival at the next device, where `_lands` (`Fabric._arrive`, `Server.enqueue`,
        `Fabric._handed_on`)."""
        flow = chunk.transfer.train[1]      # (`_lands` read it)
        link = flow.link
        link._admit(chunk)
        end = link._send(chunk)
        self.fabric._landed(chunk, self.fabric._leave(chunk, end))
        link._hand_off(end)
