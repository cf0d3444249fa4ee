"""The hook site (`ShimHookSite`): events at the fabric's decision points become hook contexts,
the islands' shims run their programs on them, and the decisions go back to the fabric.

It also starts transfers (their context fields are the same for every chunk: `Transfer.ctx`)
and serves the prefill's own hooks (`decide`: alloc, launch).  What it remembers between
events is `decisions.DecisionCache`; device decisions (route, tier) come back as names.
"""
from __future__ import annotations

from fabric_ext.contract.flows import MovementTable
from fabric_ext.contract.hooks import firing, hooks_of
from fabric_ext.contract.topology import island_role

from .decisions import AtHop, DecisionCache, HookPlan, Standing, Watched
from .dispatch import Known, entry_span
from .fabric_model import APPLIED, Fabric, HookSite
from .figures import figures
from .servers import Transfer
from .shims import OBSERVED

# context fields that are the same for every chunk of a transfer (`Transfer.ctx` holds their values)
TRANSFER_FIELDS = ("movement", "class", "operator", "src", "dst", "layer", "critical")
# what a standing issue decision is kept under, per role of the island (`DecisionCache.stand`)
ISSUE_MOMENT = {"src": "issue/src", "dst": "issue/dst"}
# ... and those that are also the same for every chunk of a transfer at one hop of its path
HOP_FIELDS = frozenset(TRANSFER_FIELDS) | {"in_port", "out_port"}
# context fields counted only for a handler that reads them (`ShimHookSite._queue_fields`)
QUEUE_SPLIT = frozenset({"queued_ahead_hi", "queued_ahead_lo"})
# the fields of a chunk issued or entering an island that differ between a transfer's chunks
# at one hop, in the order `ShimHookSite._show` gives them
PER_CHUNK = ("now", "chunk", "bytes", "queue_bytes", "queued_ahead_hi", "queued_ahead_lo")


class ShimHookSite(HookSite):
    def __init__(self, manifest: dict, shims: dict, sim, transfer_chunk: int, prefetch: dict[str, int],
                 trace: bool = False):
        self.shims, self.sim, self.transfer_chunk, self.trace = shims, sim, transfer_chunk, trace
        self.ids = manifest["ids"]
        self.dev_by_id = {v: k for k, v in self.ids["devices"].items()}
        self.devices = {d["name"]: d for d in manifest["fabric"]["devices"]}
        self.islands = {i["name"]: i for i in manifest["fabric"]["islands"]}
        self.device_island = {d["name"]: d["island"] for d in manifest["fabric"]["devices"] if d["island"]}
        self.movements = MovementTable(manifest["movements"])
        self.prefetch = prefetch          # per GPU: layers of weights issued ahead (a program may change it)
        self.prefetch_by: dict[str, tuple] = {}   # per GPU: (hook, movement id) of the decision that set it
        self.spans: list[tuple] = []      # for a trace: (track, name, start ns, duration ns, args or None)
        self.movement_names = {m["id"]: m["name"] for m in manifest["movements"]}
        self.handler_lines = {}           # (island, hook) -> [(movement id or None, .fx line)]
        for p in manifest["programs"]:
            self.handler_lines[p["island"], p["hook"]] = [(h.get("movement"), h.get("line")) for h in p["handlers"]]
        self.remembered = DecisionCache()
        self.fabric: Fabric | None = None     # the fabric that asks (`bind`)
        self.before_event = None          # callable(island, hook, movement) run before an event's program
        self.before_reading = None        # callable((island, hook, movement) each, (map, index) each):
                                          # what to run, given the time, before only those entries are read
        self._watched: dict[str, set] = {}     # moment -> islands with a program on one of its hooks
        self._points: dict[tuple, list] = {}   # (movement, path) -> where what stands may be shared (`starting`)
        for shim in shims.values():
            shim.on_detach = self.remembered.forget

    def bind(self, fabric: Fabric) -> None:
        self.fabric = fabric

    def movement_of(self, cls, operator, src, dst) -> dict | None:
        hit = self.movements.match(cls, operator, src, dst)
        return hit.movement if hit else None

    def transfer(self, cls, operator, src, dst, nbytes, layer, on_done, pace=0.0, kept=False) -> Transfer:
        hit = self.movements.match(cls, operator, src, dst)
        m = hit.movement if hit else None
        chunk = int(m["chunk"]) if m and m.get("chunk") else self.transfer_chunk
        if operator == "collective" and not (m and m.get("chunk")):    # (its movement's chunk: as asked)
            chunk = max(chunk, -(-int(nbytes) // figures()["defaults"]["collective_chunks"]))
        t = Transfer(m["name"] if m else f"({cls}{'/' + operator if operator else ''})",
                     m["id"] if m else 0, cls, operator or "", src, dst, int(nbytes), layer,
                     bool(m and m["critical"]), on_done, chunk, list(hit.path) if hit else [])
        if operator == "collective":
            t.pace, t.fixed_cost = pace, not pace
        t.kept = kept
        ids = self.ids
        t.ctx = (t.movement_id, ids.get("classes", {}).get(cls, 0), ids.get("operators", {}).get(t.operator, 0),
                 ids["devices"].get(src, 0), ids["devices"].get(dst, 0), layer, int(t.critical))
        self.fabric.start(t)
        return t

    # -- what the fabric asks ------------------------------------------------------------------
    def _chunk_fields(self, chunk):
        """The context fields every hook a chunk meets has: its transfer's (in the order of
        `TRANSFER_FIELDS`, as `transfer` keeps them) and its own."""
        movement, cls, operator, src, dst, layer, critical = chunk.transfer.ctx
        return {"movement": movement, "class": cls, "operator": operator, "src": src, "dst": dst, "layer": layer,
                "critical": critical, "now": int(self.sim.now), "chunk": chunk.index, "bytes": chunk.bytes,
                "hop": chunk.hop}

    def decide(self, island, hook, fields) -> Known | None:
        """The decisions the program on ``island``'s ``hook`` makes for an event (a `Known`:
        read-only, device decisions as ids), or None when none acts on it."""
        shim = self.shims.get(island)
        if shim is None or not shim.has(hook):
            return None
        if self.before_event is not None:
            self.before_event(island, hook, fields.get("movement"))
        known = shim.decide(hook, fields, self.sim.now)
        if self.trace:
            self.spans.append((island, hook, self.sim.now, 0.0, self._span_args(island, hook, fields, known)))
        return known

    def _span_args(self, island, hook, fields, known) -> dict:
        """What a trace shows of an event: its movement, layer, chunk and bytes, the decisions
        its program made and the lines of the handlers that ran for it."""
        movement = fields.get("movement")
        args = {k: fields[k] for k in ("layer", "chunk", "bytes") if k in fields}
        if movement is not None:
            args["movement"] = self.movement_names.get(movement, movement)
        args["decisions"] = dict(known.decisions) if known is not None else {}
        args["lines"] = [line for m, line in self.handler_lines.get((island, hook), ()) if m in (None, movement)]
        return args

    def _devices(self, d: dict) -> dict:
        """Route and tier decisions name devices by id; the fabric wants names."""
        if "route" in d or "tier" in d:
            d = dict(d)
            for k in ("route", "tier"):
                if k in d:
                    d[k] = self.dev_by_id.get(d[k], 0)
        return d

    def on_issue(self, chunk, island, role):
        t = chunk.transfer
        moment = ISSUE_MOMENT[role]
        standing = t.standing.get((island, moment))
        if standing is not None:
            if standing.__class__ is Watched:
                self._show(standing, chunk)
            else:
                self.took(standing, t, island, 1)
            return standing.decisions
        plan = self._one_hook_plan(island, "issue", t.movement_id)
        if not plan.hooks:
            return None
        if plan.observed and not self.trace:        # programs watch each chunk; nothing is decided
            self._show(self._watcher(plan, chunk, island, role), chunk)
            return None
        standing = self._shared(plan, t, chunk)
        if standing is not None:
            self.remembered.stand(t, island, moment, standing)
            self.took(standing, t, island, 1)
            return standing.decisions
        fields, queue = self._issue_fields(chunk, island, role)
        if queue is not None:
            self._queue_fields(fields, queue, chunk.priority, plan.queue_split)
        known = self.decide(island, "issue", fields)
        if known is None or known is OBSERVED:
            return None
        applied = self._issued(island, known.decisions, t.movement_id)
        if plan.static and not self.trace and known.kept:    # the same for every chunk of the transfer
            self._stand_shared(plan, t, chunk, island, moment,
                               Standing(applied, [known], known.decisions.get("prefetch", 0)))
        return applied

    def starting(self, t):
        """What transfers before ``t`` left standing at the points of its path (its ends' issue
        hooks, the islands it enters) stands for its chunks from the first on, in one change of
        what stands for it (`stands_for`), where each point's first chunk would take it there."""
        path = tuple(t.path)
        points = self._points.get((t.movement_id, path))
        if points is None:
            points = self._points[t.movement_id, path] = self._points_of(t)
        found = {}
        for island, moment, hop, plan in points:
            if plan.observed:
                standing = plan.watchers.get((moment, hop, path))
            else:
                standing = plan.shared.get(plan.key_of(t, hop, path)) if plan.shared else None
            if standing is not None:
                found[island, moment] = standing
        if found:
            self.remembered.stand_all(t, found)

    def _points_of(self, t) -> list[tuple]:
        """(island, moment, hop, plan) of each point of ``t``'s path where what stands may be
        shared: the issue hooks at its ends (hop 0), and each island its chunks enter, at the
        hop they enter it by (`Fabric._arrive`)."""
        points = [(island, ISSUE_MOMENT[role], 0, self._one_hook_plan(island, "issue", t.movement_id))
                  for island, role in self.fabric._ends(t, "issue")]
        entered = None
        for hop, device in enumerate(t.path):
            island = self.device_island.get(device)
            if island is not None and island != entered:
                entered = island
                if island in self._watching("enter"):
                    points.append((island, "enter", hop, self._enter_plan(island, t.path, t.movement_id)))
        return [p for p in points if p[3].hooks and (p[3].static or p[3].at_hop or p[3].observed)]

    def finished(self, t):
        """What watchers stood for is let go (the contexts' stamps); counted decisions stay."""
        if any(s.watched for s in t.standing.values()):
            t.standing = {k: s for k, s in t.standing.items() if not s.watched}

    def prefetch_of(self, gpu: str) -> tuple[int, tuple | None]:
        """The GPU's prefetch depth now, and the (hook, movement) of the decision that set it
        (None: the workload's)."""
        self.untold()
        return self.prefetch[gpu], self.prefetch_by.get(gpu)

    def settle(self) -> None:
        """Count the uses of what stood as hits of the decisions they repeat (`DecisionCache.settle`)."""
        self.untold()
        self.remembered.settle()

    def stands_for(self, t):
        return t.standing       # replaced, never changed in place (`DecisionCache`)

    def standing(self, t, island, moment, role=""):
        s = t.standing.get((island, ISSUE_MOMENT[role] if moment == "issue" else moment))
        return None if s.__class__ is AtHop else s     # one that holds at a hop is checked there

    def took(self, standing, t, island, times):
        """What taking a standing answer ``times`` does: its uses, and an issue hook's prefetch."""
        standing.uses += times
        if standing.prefetch:
            self.set_prefetch(island, standing.prefetch, "issue", t.movement_id)

    @staticmethod
    def _shared(plan: HookPlan, t, chunk) -> Standing | None:
        """What stands for every transfer with ``t``'s key (`HookPlan.key_of`) at the chunk's hop
        of its path, once one with it has asked; else None."""
        return plan.shared.get(plan.key_of(t, chunk.hop, tuple(chunk.path))) if plan.shared else None

    def _stand_shared(self, plan: HookPlan, t, chunk, island, moment, standing: Standing) -> None:
        """``standing`` holds for the transfer's later chunks, and for the transfers after it
        with the same key (`HookPlan.key_of`), while the programs that made it stay attached
        (`DecisionCache.forget`); not where a context tracer must see each transfer's first
        chunk reach the program."""
        shared = self.shims[island].tracer is None
        self.remembered.stand(t, island, moment, standing,
                              (plan, plan.key_of(t, chunk.hop, tuple(chunk.path))) if shared else None)

    def set_prefetch(self, gpu: str, depth: int, hook: str, movement: int | None) -> None:
        """A program's ``prefetch`` decision: the GPU's depth from now on (the latest word holds:
        the words trains took come first)."""
        self.untold()
        self.prefetch[gpu] = depth
        self.prefetch_by[gpu] = (hook, movement)

    def _issued(self, island, d, movement):
        """What the fabric applies of an issue hook's decisions; ``prefetch`` is the hook site's."""
        if d.get("prefetch"):
            self.set_prefetch(island, d["prefetch"], "issue", movement)
        return self._devices(d) if not APPLIED.isdisjoint(d) else None

    def _watching(self, moment: str) -> set:
        """The islands with a program on a hook that fires at ``moment`` ("issue", "enter", "deliver"),
        worked out at the first such event, as plans are: programs are attached before a run
        (a detach only makes the site ask in vain)."""
        if moment not in self._watched:
            self._watched[moment] = {isl for isl, shim in self.shims.items()
                                     if any(shim.has(h.name) for h in hooks_of(self.islands[isl]["kind"]).values()
                                            if h.moment == moment)}
        return self._watched[moment]

    def asks(self, island, moment, transfer=None):
        if island not in self._watching(moment):
            return False
        if transfer is None:
            return True
        movement = transfer.movement_id     # the plans say whether a handler there names it
        if moment == "enter":
            return bool(self._enter_plan(island, transfer.path, movement).hooks)
        return any(self._one_hook_plan(island, h.name, movement).hooks
                   for h in hooks_of(self.islands[island]["kind"]).values() if h.moment == moment)

    def on_enter(self, chunk, island):
        t, path = chunk.transfer, chunk.path
        if path is t.path:          # a decision stands only for the transfer's own path
            standing = t.standing.get((island, "enter"))
            if standing is not None:
                kind = standing.__class__
                if kind is Standing or kind is AtHop and self._holds(standing, chunk.hop):
                    standing.uses += 1
                    return standing.decisions
                if kind is Watched and standing.hop == chunk.hop:
                    self._show(standing, chunk)
                    return standing.decisions
        if island not in self._watching("enter"):
            return None
        plan = self._enter_plan(island, path, t.movement_id)
        hooks = plan.hooks
        if not hooks:
            return None
        if plan.observed and path is t.path and not self.trace:
            self._show(self._watcher(plan, chunk, island, ""), chunk)
            return {}
        standing = self._shared(plan, t, chunk) if path is t.path else None
        if standing is not None and (standing.__class__ is Standing or self._holds(standing, chunk.hop)):
            self.remembered.stand(t, island, "enter", standing)
            standing.uses += 1
            return standing.decisions
        fields = self._enter_fields(chunk, plan)
        each = [self.decide(island, h, fields) for h in hooks]
        if len(each) == 1:          # read-only, like every Known's decisions
            merged = each[0].decisions if each[0] is not None else {}
        else:
            merged = {}
            for known in each:
                if known is not None:
                    merged.update(known.decisions)
        merged = self._devices(merged)
        if path is t.path and not self.trace and each[0] is not None and each[0].kept \
                and all(k is not None and k.kept for k in each):
            # the same for every chunk of this transfer here (None: the program faulted) ...
            if plan.static:
                self._stand_shared(plan, t, chunk, island, "enter", Standing(merged, each))
            elif plan.at_hop:       # ... at this hop, while the entries read hold
                guard, entries = self._guard(island, hooks, t.movement_id, fields)
                refresh = self.before_reading(plan.watch, entries) if self.before_reading is not None else None
                self._stand_shared(plan, t, chunk, island, "enter", AtHop(
                    merged, each, hop=chunk.hop, guard=guard, refresh=refresh))
        return merged

    def _issue_fields(self, chunk, island, role) -> tuple[dict, object]:
        """The context fields of a chunk issued at ``island`` in ``role``, but what is queued, and
        where it queues (the first link of its path, from its source; None at its destination)."""
        fields, path = self._chunk_fields(chunk), chunk.path
        self._end_fields(fields, path, island)
        return fields, self.fabric.server(path[0], path[1]) if role == "src" and len(path) > 1 else None

    def _enter_fields(self, chunk, plan: HookPlan) -> dict:
        """The context fields of a chunk entering the island at its hop, for the plan's hooks."""
        fields = self._chunk_fields(chunk)
        path, hop = chunk.path, chunk.hop
        fields["in_port"] = self.fabric.ingress_port(path, hop)
        fields["out_port"] = self.fabric.egress_port(path, hop)
        queue = self._egress(chunk)
        if queue is not None:
            self._queue_fields(fields, queue, chunk.priority, plan.queue_split)
        if "mem_access" in plan.hooks:
            fields["write"] = int(self.devices[path[-1]]["kind"] == "cxl_mem")
        return fields

    def _egress(self, chunk):
        """Where the chunk queues on from its hop (None: nowhere)."""
        path, hop = chunk.path, chunk.hop
        if hop + 1 < len(path):
            return self.fabric.server(path[hop], path[hop + 1])
        return self.fabric.wires.get(path[hop])

    def _watcher(self, plan: HookPlan, chunk, island, role: str) -> Watched:
        """What stands for a transfer whose chunks only programs that watch act on
        (`HookPlan.observed`) as they are issued at ``island`` in ``role`` ("": as they enter
        it), from its first chunk on: the one every transfer on the chunk's path and hop
        shares (made at the first one's first chunk), whose stamps make the contexts
        `on_issue` or `_enter_fields` would from the fields of the hop, of the chunk's
        transfer and of the chunk."""
        t, path, hop = chunk.transfer, chunk.path, chunk.hop
        moment = ISSUE_MOMENT[role] if role else "enter"
        key = (moment, hop, tuple(path))
        watched = plan.watchers.get(key)
        if watched is None:
            if role:
                fields, queue = self._issue_fields(chunk, island, role)
            else:
                fields, queue = self._enter_fields(chunk, plan), self._egress(chunk)
            fixed = {k: v for k, v in fields.items() if k not in PER_CHUNK and k not in TRANSFER_FIELDS}
            shim = self.shims[island]
            watched = plan.watchers[key] = Watched(
                {}, [], hop=hop, split=plan.queue_split, queue=queue,
                stamps=tuple((shim, h, shim.codecs[h].stamp(fixed, TRANSFER_FIELDS + PER_CHUNK)) for h in plan.hooks))
        self.remembered.stand(t, island, moment, watched)
        return watched

    def _show(self, standing: Watched, chunk) -> None:
        """Give a chunk to the programs that watch it (`Watched`): its context as `on_issue` or
        `_enter_fields` would make it, kept for their batch."""
        now, queue = self.sim.now, standing.queue
        queued = queue.queued_bytes if queue is not None else 0
        above = queue.queued_above(chunk.priority) if standing.split and queue is not None else 0
        below = queued - above if standing.split else 0
        ctx = chunk.transfer.ctx
        for shim, hook, stamp in standing.stamps:
            shim.keep(hook, stamp(*ctx, int(now), chunk.index, chunk.bytes, queued, above, below), now)

    def _guard(self, island, hooks, movement, fields) -> tuple[tuple, tuple]:
        """The array entries the hooks' decisions for these fields depend on, as (the map's
        values, the entry's span, its bytes now), and as (map, index); one out of range finds
        nothing, whatever the map holds."""
        guard, entries = [], []
        for h in hooks:
            act = self.shims[island].acting(h, movement)
            for name, (values, size, *entry) in zip(act.entry_maps, act.entries):
                span = entry_span(fields, size, *entry)
                if span is not None:
                    guard.append((values, span, bytes(values[span])))
                    entries.append((name, span.start // size))
        return tuple(guard), tuple(entries)

    def _holds(self, standing, hop) -> bool:
        """Whether a standing that is `at_hop` holds for a chunk at ``hop``: the entries its
        decisions read, once the ticks that write them have run, are as they were."""
        if hop != standing.hop:
            return False
        refresh, now = standing.refresh, self.sim.now
        if refresh is not None and now >= refresh.fresh_until:     # (a tick may have written them)
            refresh(now)
        for values, span, then in standing.guard:
            if values[span] != then:
                return False
        return True

    @staticmethod
    def _queue_fields(fields: dict, server, priority: int, split: bool) -> None:
        """What is queued at the chunk's egress: all of it, and where a handler reads them, the
        bytes above its class and at or below it (counted then: a walk over the queues)."""
        fields["queue_bytes"] = queued = server.queued_bytes
        if split:
            fields["queued_ahead_hi"] = hi = server.queued_above(priority)
            fields["queued_ahead_lo"] = queued - hi

    def _plan(self, where, island, hooks, movement) -> HookPlan:
        """The hooks of ``island`` whose program acts on this movement's events, and whether
        all of them decide from the transfer's own fields alone (no map, nothing per chunk);
        kept for the next event at ``where``."""
        shim = self.shims.get(island)
        acting = [(h, shim.acting(h, movement)) for h in hooks] if shim else []
        acting = [(h, a) for h, a in acting if a is not None]
        static = all(a.key_fields is not None and not a.entries and set(a.key_fields).issubset(TRANSFER_FIELDS)
                     for _, a in acting)
        at_hop = not static and all(a.key_fields is not None and HOP_FIELDS.issuperset(a.key_fields)
                                    and all(e[3] is None or e[3] in HOP_FIELDS for e in a.entries) for _, a in acting)
        split = any(a.reads is None or not QUEUE_SPLIT.isdisjoint(a.reads) for _, a in acting)
        hooks = tuple(h for h, _ in acting)
        key = tuple(sorted({TRANSFER_FIELDS.index(f) for _, a in acting for f in a.key_fields
                            if f in TRANSFER_FIELDS})) if static or at_hop else None
        observed = bool(acting) and all(a.watched for _, a in acting)
        plan = self.remembered.plans[where] = HookPlan(hooks, static, split, at_hop,
                                                       tuple((island, h, movement) for h in hooks), key, observed)
        return plan

    def _enter_plan(self, island, path, movement) -> HookPlan:
        """The plan of a chunk on ``path`` entering ``island`` (kept per ends: they say the role)."""
        where = (island, path[0], path[-1], movement)
        return self.remembered.plans.get(where) or \
            self._plan(where, island, self._enter_hooks(island, path[0], path[-1]), movement)

    def _one_hook_plan(self, island, hook, movement) -> HookPlan:
        """The plan of an event only ``hook`` of ``island`` fires at (kept, as `_plan`'s)."""
        where = (island, hook, movement)
        return self.remembered.plans.get(where) or self._plan(where, island, (hook,), movement)

    def _enter_hooks(self, island, src, dst):
        """The hooks a chunk from src to dst meets on entering ``island`` (the catalogue's)."""
        return firing(self.islands[island]["kind"], "enter", island_role(island, src, dst, self.device_island))

    def on_delivered(self, chunk, island, latency):
        if island not in self._watching("deliver") or \
                not self._one_hook_plan(island, "complete", chunk.transfer.movement_id).hooks:
            return
        fields = self._chunk_fields(chunk)
        self._end_fields(fields, chunk.path, island)
        fields["latency"] = int(latency)
        known = self.decide(island, "complete", fields)
        if known is not None and known.decisions.get("prefetch"):     # (a GPU's: the others decide nothing)
            self.set_prefetch(island, known.decisions["prefetch"], "complete", chunk.transfer.movement_id)

    def _end_fields(self, fields: dict, path, island) -> None:
        """``hop``, ``in_port`` and ``out_port`` of a chunk at an end of its path in ``island`` (its
        issue, its completion), as a chunk entering the island has them: at its destination the
        hop and port it enters the island by, at its source hop 0 and the port it leaves by (a
        DPU/NIC's network port where it ends or starts there: `Fabric.ingress_port`)."""
        of = self.device_island.get
        if of(path[-1]) == island:
            hop = len(path) - 1
            while hop and of(path[hop - 1]) == island:
                hop -= 1
            fields["hop"], fields["out_port"] = hop, self.fabric.egress_port(path, len(path) - 1)
            fields["in_port"] = self.fabric.ingress_port(path, hop)
            return
        hop = 0
        while hop + 1 < len(path) and of(path[hop + 1]) == island:
            hop += 1
        fields["hop"], fields["in_port"] = 0, self.fabric.ingress_port(path, 0)
        fields["out_port"] = self.fabric.egress_port(path, hop)

    def on_dequeue(self, chunk, island, wait):
        if not self._one_hook_plan(island, "dequeue", chunk.transfer.movement_id).hooks:
            return
        fields = self._chunk_fields(chunk)
        path, hop = chunk.path, chunk.hop
        fields["in_port"] = self.fabric.ingress_port(path, hop)
        fields["out_port"] = self.fabric.egress_port(path, hop)
        fields["wait"] = int(wait)
        self.decide(island, "dequeue", fields)      # it decides nothing: telemetry, maps and emits
