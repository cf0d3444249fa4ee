"""The prefill's schedule over the fabric (`Prefill`): per pass, layer and block, each GPU of
the tensor-parallel group waits for its inputs (weights unless in HBM; in a chunked prefill's
later passes the KV of the earlier ones), computes (`timing.Timing`), then the group
all-reduces over the ring; after attention each GPU writes its KV back and exports it without
waiting.  Weights are issued the prefetch depth ahead (the workload's, or what a program
decided).  It moves data and asks hooks only through the engine's hook site.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from .workload import kept_where_it_lands


class Progress(NamedTuple):
    """How far a run is, as the schedule reports it after each block."""
    fraction: float          # of the prefill's blocks begun
    events: int              # simulated events so far
    simulated_ms: float      # simulated time so far


class Stall(NamedTuple):
    """A wait of the GPUs, recorded with evidence on (`explain`): GPU ``gpu`` (None: the
    tensor-parallel group, in an all-reduce) waited from ``start`` to ``end`` ns for
    ``transfer``: the input that arrived last, or the ring's last send."""
    gpu: str | None
    unit: tuple                 # (pass, layer, operator)
    start: float
    end: float
    transfer: object            # servers.Transfer
    prefetch: tuple | None      # an input issued the prefetch depth ahead: (depth, (hook, movement) of
                                # the decision that set it, or None: the workload's); None: issued at the start


class Prefill:
    def __init__(self, engine, on_finish, evidence: bool = False):
        self.e, self.sim, self.workload, self.gpus = engine, engine.sim, engine.workload, engine.gpus
        self.site = engine.site                   # where it asks hooks and starts transfers
        self.timing = engine.timing
        self.on_finish = on_finish               # called with the time the first token is out
        self.pass_start = 0.0
        self.layer_stats = defaultdict(lambda: defaultdict(float))
        self.stall_by_movement = defaultdict(float)
        self.finished = None
        self.kv_done = 0.0
        self.stalls: list[Stall] | None = [] if evidence else None
        self.issued_with: dict = {}               # with evidence: input transfer -> its `Stall.prefetch`
        self.kv_written: dict[tuple, list] = defaultdict(list)   # (gpu, layer) -> its KV's writeback transfers

    def place(self) -> None:
        """Where each layer's weights live, before the run (the host's `alloc` programs may move them)."""
        self.weight_src = self._placement()

    def start(self) -> None:
        """Issue the first inputs and begin the first block at time 0."""
        w = self.workload
        self.units = [(p, layer, op) for p in range(w.pass_count()) for layer in range(w.model.layers)
                      for op in ("attention", "ffn")]
        self.ready = {g: {} for g in self.gpus}       # unit -> arrival time of its inputs
        self.inputs_left: dict[tuple, int] = {}       # (gpu, unit) -> inputs still moving
        self.last_input: dict[tuple, object] = {}     # (gpu, unit) -> the transfer that arrived last
        self.issued = {g: 0 for g in self.gpus}       # units issued so far
        self.waiting = {}
        self.done_count = 0
        self.ar_pending = 0
        for g in self.gpus:
            self._issue_inputs(g, 0)
        self.sim.at(0, self._begin, 0)

    def _placement(self):
        """Where each layer's weights live: the workload's choice, or a host program's tier."""
        w = self.workload
        src = {}
        host = next((n for n, i in self.e.islands.items() if i["kind"] == "host"), None)
        for layer in range(w.model.layers):
            for op in ("attention", "ffn"):
                where = w.weights
                if host is not None:
                    m = self.site.movement_of("weights", op, w.weights, self.gpus[0]) \
                        if w.weights in self.e.devices else None
                    known = self.site.decide(host, "alloc", {"now": 0, "movement": m["id"] if m else 0,
                                                          "class": self.e.ids.get("classes", {}).get("weights", 0), "layer": layer,
                                                          "bytes": w.weight_bytes(op)})
                    tier = self.site.dev_by_id.get(known.decisions.get("tier")) if known is not None else None
                    if tier and tier not in self.e.fabric.memories:
                        self.e.fabric.refused["tier"] += 1
                    elif tier:
                        where = self._move_weights(op, "hbm" if self.e.devices[tier]["kind"] == "gpu" else tier)
                src[(layer, op)] = where
        return src

    def _move_weights(self, op: str, to: str) -> str:
        """Where a layer's ``op`` weights go on a host program's tier: ``to`` where that memory
        has room for them beside what it holds (`Engine.room`), else they stay where the
        workload keeps them (the decision refused and counted)."""
        w = self.workload
        if to == w.weights:
            return to
        need = w.weight_bytes(op) * (1 if to == "hbm" else w.tp)    # a GPU keeps its shard; a device, all
        if not self.e.room.take(to, need):
            self.e.fabric.refused["tier"] += 1
            return w.weights
        return to

    def _issue_inputs(self, g, current):
        """Issue what the units up to the prefetch depth ahead need on GPU g: their weights
        (unless in HBM) and, for attention in a later pass of a chunked prefill, the KV of
        the earlier passes from where it lives (unless in HBM)."""
        w = self.workload
        depth = max(1, self.site.prefetch_of(g)[0])
        while self.issued[g] < len(self.units) and self.issued[g] < current + 2 * depth:
            u = self.issued[g]
            self.issued[g] += 1
            p, layer, op = self.units[u]
            inputs = []
            where = self.weight_src[(layer, op)]
            if where not in ("hbm", "none", g):       # (what g keeps itself is in its HBM)
                inputs.append(("weights", op, where, w.weight_bytes(op)))
            first_token = w.pass_of(p)[0]
            if op == "attention" and first_token and w.kv not in ("hbm", "none"):
                inputs += [("kv", "attention", where, n)
                           for where, n in self._kv_lies(g, layer, w.attended_kv_bytes(first_token)) if where != g]
            if not inputs:
                self.ready[g][u] = 0.0
                continue
            self.inputs_left[(g, u)] = len(inputs)
            for cls, operator, src, nbytes in inputs:
                t = self.site.transfer(cls, operator, src, g, nbytes, layer,
                                       lambda t, g=g, u=u: self._input_arrived(g, u, t))
                if self.stalls is not None and self.sim.now > 0:
                    self.issued_with[t] = (depth, self.site.prefetch_of(g)[1])

    def _kv_lies(self, g, layer, nbytes: int) -> list[tuple[str, int]]:
        """Where ``nbytes`` of the KV GPU g wrote back for ``layer`` lie: in the workload's kv
        memory, less what a tier sent elsewhere, each memory's share in proportion."""
        kv = self.workload.kv
        at = {kv: 0}
        for t in self.kv_written[(g, layer)]:
            at[kv] += t.bytes
            for dev, n in (t.elsewhere or {}).items():
                at[kv] -= n
                at[dev] = at.get(dev, 0) + n
        total = sum(at.values())
        if len(at) == 1 or not total:
            return [(kv, nbytes)]
        parts = [(dev, nbytes * n // total) for dev, n in at.items() if n > 0]
        return [(parts[0][0], nbytes - sum(n for _, n in parts[1:]))] + parts[1:]    # rounding to the first

    def _input_arrived(self, g, u, t):
        """One input of unit u on GPU g arrived; the last one makes the unit ready (and is what
        a stall before it is charged to)."""
        self.inputs_left[(g, u)] -= 1
        if self.inputs_left[(g, u)]:
            return
        del self.inputs_left[(g, u)]
        self.ready[g][u] = self.sim.now
        self.last_input[(g, u)] = t
        if self.waiting.get(g) == u:
            del self.waiting[g]
            self._compute(g, u)

    def _begin(self, u):
        self.unit_start = self.sim.now
        if u == 0 or self.units[u - 1][0] != self.units[u][0]:
            self.pass_start = self.sim.now
        self.done_count = 0
        for g in self.gpus:
            if u in self.ready[g]:
                self._compute(g, u)
            else:
                self.waiting[g] = u
        if self.e.opts.progress:
            self.e.opts.progress(Progress(u / len(self.units), self.sim.events, self.sim.now / 1e6))

    def _compute(self, g, u):
        p, layer, op = self.units[u]
        ops = self.timing.block(p, op) if self.e.shims.get(g) is not None and self.e.shims[g].has("launch") else ()
        stall = self.sim.now - self.unit_start
        if stall > 0:      # charged to the input that arrived last
            t = self.last_input.get((g, u))
            self.stall_by_movement[t.name if t else f"(weights/{op})"] += stall
            if self.stalls is not None and t is not None:
                self.stalls.append(Stall(g, self.units[u], self.unit_start, self.sim.now, t, self.issued_with.get(t)))
        known = self.site.decide(g, "launch", {"now": int(self.sim.now), "layer": layer,
                                        "operator": self.e.ids.get("operators", {}).get(op, 0),
                                        "flops": int(sum(o.flops for o in ops)),
                                        "bytes": int(sum(o.bytes for o in ops)), "stall": int(stall)})
        if known is not None and known.decisions.get("prefetch"):
            self.site.set_prefetch(g, known.decisions["prefetch"], "launch", None)
        self._issue_inputs(g, u + 1)
        dur = self.timing.block_ns(g, p, op)
        if layer == 0 and op == "attention":
            dur += self.timing.pass_edges_ns(g, p, True, False)
        if self.e.opts.trace:
            self.site.spans.append((g, f"{op} L{layer}", self.sim.now, dur,
                                    {"pass": p, "layer": layer, "operator": op, "stall_us": round(stall / 1e3, 3)}))
        s = self.layer_stats[layer]
        s[f"{op}_ms"] += dur / 1e6 / len(self.gpus)
        s[f"{op}_stall_ms"] += stall / 1e6 / len(self.gpus)
        self.sim.at(self.sim.now + dur, self._computed, g, u)

    def _computed(self, g, u):
        self.done_count += 1
        if self.done_count < len(self.gpus):
            return
        if len(self.gpus) > 1:
            self._allreduce(u)
        else:
            self._after(u)

    def _allreduce(self, u):
        """A ring all-reduce of the block's output: each GPU sends 2 (t-1)/t of it to the next,
        at the bus bandwidth NCCL reaches at this TP degree, after its fixed cost (alpha: the
        call's launch and synchronisation, less what the fabric's links add)."""
        w = self.workload
        p, layer, _ = self.units[u]
        n = w.pass_of(p)[1]
        t = len(self.gpus)
        nbytes = 2 * (t - 1) * w.activation_bytes(n) // t
        self.ar_pending = t
        self.ar_start = self.sim.now
        for i, g in enumerate(self.gpus):
            nxt = self.gpus[(i + 1) % t]
            ar = self.timing.all_reduce(g, w.activation_bytes(n))
            hop = self.e.fabric.g.edges[g, nxt].get("latency") or 0.0 if self.e.fabric.g.has_edge(g, nxt) else 0.0
            self.sim.at(self.sim.now + max(0.0, ar.alpha_ns - hop), self._ring_send, g, nxt, nbytes, layer, u,
                        ar.busbw)

    def _ring_send(self, g, nxt, nbytes, layer, u, busbw):
        self.site.transfer("activations", "collective", g, nxt, nbytes, layer, lambda tr, u=u: self._ar_done(u, tr),
                           pace=busbw)

    def _ar_done(self, u, tr):
        self.ar_pending -= 1
        if self.ar_pending == 0:
            if self.stalls is not None:
                self.stalls.append(Stall(None, self.units[u], self.ar_start, self.sim.now, tr, None))
            m = self.site.movement_of("activations", "collective", self.gpus[0], self.gpus[1 % len(self.gpus)])
            self.stall_by_movement[m["name"] if m else "(activations/collective)"] += self.sim.now - self.ar_start
            self.layer_stats[self.units[u][1]]["allreduce_ms"] += (self.sim.now - self.ar_start) / 1e6
            self._after(u)

    def _after(self, u):
        w = self.workload
        p, layer, op = self.units[u]
        if op == "attention":
            n = w.pass_of(p)[1]
            for g in self.gpus:
                for where in dict.fromkeys((w.kv, w.kv_export)):      # (an export to kv's own device: once)
                    if where and where not in ("hbm", "none", g):
                        t = self.site.transfer("kv", None, g, where, w.kv_bytes(n), layer, self._kv_done,
                                               kept=kept_where_it_lands("kv", None, where, w.kv))
                        if t.kept:
                            self.kv_written[(g, layer)].append(t)
        if u + 1 < len(self.units) and self.units[u + 1][0] == p:
            self._begin(u + 1)
            return
        # the pass ends: the stack's CPU work per prompt, then its floor (a pass takes that at least)
        timing = self.timing
        floor_end = self.pass_start + timing.pass_floor_ns()
        cpu = timing.pass_cpu_ns()
        if u + 1 < len(self.units):
            self.sim.at(max(self.sim.now + cpu, floor_end), self._begin, u + 1)
        else:
            end = self.sim.now + timing.pass_edges_ns(self.gpus[0], p, False, True) + cpu + timing.stack.tail_ms * 1e6
            self.sim.at(max(end, floor_end), self._finish)

    def _kv_done(self, t):
        self.kv_done = max(self.kv_done, self.sim.now)

    def _finish(self):
        self.finished = self.sim.now
        self.on_finish(self.finished)

