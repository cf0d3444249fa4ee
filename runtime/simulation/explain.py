"""Why the GPUs waited: a root-cause chain for every stall (`fabric-run --explain`).

A run with evidence on (`RunOptions(explain=True)`) records every chunk's life as steps that
tile it in time (`servers.Step`: pending, held by a ``defer`` or ``rate`` decision,
waiting for a copy engine, queued at a link, sent, in flight) and what every link sent
(`Server.occupants`).  A stall (`prefill.Stall`) is a GPU waiting from ``start`` to ``end``
for the input that arrived last (or the all-reduce's ring).  Its chain splits that wait
exactly, by walking the life of the chunk that arrived last:

- before the transfer was issued: *blocked* (issued late: by the prefetch depth, or for an
  all-reduce by its fixed cost after the block's compute);
- held by ``defer``: *blocked*, naming the decision's line; held by ``rate``: *slowed*,
  naming its line;
- waiting at a link (queued, or waiting for its copy engine and its own earlier chunks, as the
  path's first link sends them, or a source host's memory reads them first): split by what
  the link (the memory, then the link) sent meanwhile.  Data of the same
  class issued no later (its own transfer, the other GPUs' weights of the same layer) is the
  link's bandwidth: *slowed, bandwidth-bound*.  Any other movement is competition: *slowed,
  queued behind* it, with its priority and the bytes it sent;
- its own transmission and flight: *slowed, bandwidth-bound* on the link, except where the
  path's first link sat idle just before the transfer was issued: then issuing it earlier
  would have moved it sooner, and that much is *blocked by the prefetch depth*.

Each step carries the time it explains; a chain's steps sum to its stall.  docs/explain.md
says how to read them.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from .servers import DEFAULT_PRIORITY, Step

COVER = 0.9            # the chains shown cover this share of all stall time, longest first
SHOWN = 5              # chains printed in the text (the JSON has every one)


@dataclass(frozen=True)
class Cause:
    """What a step of a chain blames: the key steps are summed by across chains."""
    kind: str                   # "blocked" | "slowed"
    cause: str                  # prefetch | collective | defer | rate | queued | bandwidth | latency | engine | untracked
    where: str = ""             # the link, island or copy engine
    movement: str = ""          # queued: the movement ahead; else the one waited for
    priority: int | None = None  # queued: the priority of the movement ahead
    later: bool = False         # queued: data of the same class for later layers, issued after it
    decision: str = ""          # defer, rate, prefetch: the decision and its source
    line: int | None = None     # ... the .fx line that made it (None: no program decided)
    file: str = ""


@dataclass
class ChainStep:
    cause: Cause
    ns: float
    bytes: int = 0              # queued: bytes of the movement ahead sent while this one waited

    def to_json(self, stall_ns: float) -> dict:
        c = self.cause
        return {"kind": c.kind, "cause": c.cause, "ms": round(self.ns / 1e6, 6),
                "share": round(self.ns / stall_ns, 4) if stall_ns else 0.0,
                **{k: v for k, v in (("where", c.where), ("movement", c.movement), ("priority", c.priority),
                                     ("later", c.later), ("decision", c.decision), ("line", c.line),
                                     ("file", c.file))
                   if v not in ("", None, False)},
                **({"bytes": self.bytes} if self.bytes else {}), "text": describe(c, self.bytes)}


@dataclass
class Chain:
    gpu: str                    # a GPU, or "all" for the group's all-reduce
    unit: tuple                 # (pass, layer, operator)
    movement: str               # the input waited for
    start: float                # ns
    end: float
    steps: list[ChainStep] = field(default_factory=list)

    @property
    def stall(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """blocked or slowed: whichever explains more of the stall."""
        blocked = sum(s.ns for s in self.steps if s.cause.kind == "blocked")
        return "blocked" if blocked * 2 >= sum(s.ns for s in self.steps) else "slowed"

    def to_json(self) -> dict:
        p, layer, op = self.unit
        return {"gpu": self.gpu, "pass": p, "layer": layer, "operator": op, "movement": self.movement,
                "start_ms": round(self.start / 1e6, 6), "stall_ms": round(self.stall / 1e6, 6), "kind": self.kind,
                "steps": [s.to_json(self.stall) for s in self.steps]}


class Explainer:
    """Builds chains from a run's evidence (``fabric``: the fabric model that ran); ``programs``:
    the manifest's, to name the line of each decision."""

    def __init__(self, fabric, programs: list[dict]):
        self.fabric = fabric
        self.programs = programs
        self._starts: dict[int, list[float]] = {}
        self._queued_causes: dict[tuple, Cause] = {}

    # -- the decisions' lines ----------------------------------------------------------------------
    def _handler(self, island: str | None, hooks, movement: int | None, decision: str) -> tuple:
        """(hook, line, file) of the first handler on ``island`` (None: any) at one of ``hooks``
        for the movement that sets ``decision`` (None, None, "" if none does)."""
        for prog in self.programs:
            if island is not None and prog["island"] != island or not hooks(prog["hook"]):
                continue
            for h in prog["handlers"]:
                lines = h.get("decides", {}).get(decision)
                if h.get("movement") in (movement, None) and lines:
                    return prog["hook"], lines[0], h.get("file", "")
        return None, None, ""

    def _hold(self, step, movement: int) -> Cause:
        at_issue = step.moment == "issue"
        hook, line, file = self._handler(step.where, (lambda h: h == "issue") if at_issue else
                                         (lambda h: h not in ("issue", "complete", "launch", "alloc", "tick")),
                                         movement, step.kind)
        return Cause("blocked" if step.kind == "defer" else "slowed", step.kind, where=step.where,
                     decision=f"{step.kind} at {step.where}.{hook or step.moment}", line=line, file=file)

    def _prefetch(self, gpu: str, prefetch: tuple) -> Cause:
        depth, by = prefetch
        if by is None:
            return Cause("blocked", "prefetch", where=gpu, decision=f"prefetch depth {depth} (the workload's)")
        hook, line, file = self._handler(gpu, lambda h: h == by[0], by[1], "prefetch")
        return Cause("blocked", "prefetch", where=gpu, decision=f"prefetch = {depth} at {gpu}.{hook or by[0]}",
                     line=line, file=file)

    # -- a chain ------------------------------------------------------------------------------------
    def chain(self, stall) -> Chain:
        t = stall.transfer
        ch = Chain(stall.gpu or "all", stall.unit, t.name, stall.start, stall.end)
        steps: dict[Cause, list] = {}

        def add(cause: Cause, ns: float, nbytes: float = 0.0) -> None:
            if ns > 0:
                acc = steps.setdefault(cause, [0.0, 0.0])
                acc[0] += ns
                acc[1] += nbytes

        if stall.gpu is None:
            late = Cause("blocked", "collective", where="all-reduce", movement=t.name,
                         decision="the all-reduce's fixed cost after the block (the stack's alpha)")
        elif stall.prefetch is not None:
            late = self._prefetch(stall.gpu, stall.prefetch)
        else:                   # issued when the run began: nothing held it back
            late = Cause("slowed", "untracked", movement=t.name)
        begin = max(stall.start, min(t.start, stall.end))
        add(late, begin - stall.start)
        self._walk(t, begin, stall.end, add)
        if stall.prefetch is not None:      # alone on its path, issued when it was, it would still be this late
            alone = self._walk(t, t.start, t.end, lambda *_: None)
            moved = min(t.start + alone, stall.end) - begin
            if moved > 0:
                add(late, self._take_from_own(steps, moved))
        ch.steps = sorted((ChainStep(c, ns, int(b)) for c, (ns, b) in steps.items() if ns > 0), key=lambda s: -s.ns)
        return ch

    def _walk(self, t, begin: float, end: float, add) -> float:
        """Split [begin, end] of the life of t's last chunk into causes (``add``); returns the
        time of that spent on t's own bytes (sent on a link the chunk waited for, or the chunk's
        own sending and flight): what the transfer takes alone on its path."""
        own = 0.0
        chunk = t.last_chunk
        trail = [Step(*entry) for entry in chunk.trail] if chunk is not None else []
        first = self._first_servers(t)
        holds = [st for st in trail if st.kind in ("defer", "rate")]
        # a first link idle while the chunk waited: held like it (its earlier chunks), else its copy engine
        idle = self._hold(max(holds, key=lambda st: st.end - st.start), t.movement_id) if holds else \
            Cause("slowed", "engine", where=self._engine_device(t), movement=t.name) if t.driver else \
            Cause("slowed", "untracked", movement=t.name)
        at = begin
        for st in trail:
            a, b = max(st.start, begin), min(st.end, end)
            if a > at:
                add(Cause("slowed", "untracked", movement=t.name), a - at)
            if b <= a:
                continue
            at = max(at, b)
            if st.kind in ("defer", "rate"):
                add(self._hold(st, t.movement_id), b - a)
            elif st.kind == "send":
                add(self._bandwidth(st.where, t), b - a)
                own += b - a
            elif st.kind == "latency":
                add(Cause("slowed", "latency", where=f"{st.where[0]}->{st.where[1]}", movement=t.name), b - a)
                own += b - a
            else:               # pending, engine: behind what the first stages send; queue: its own link
                own += self._occupancy([st.where] if st.kind == "queue" else first, t, a, b, add, idle)
        if end > at:
            add(Cause("slowed", "untracked", movement=t.name), end - at)
        return own

    def _first_servers(self, t) -> list:
        """What a copy engine's chunk goes through before the engine is free for the next:
        the source's memory or receive wire where it has one (`Fabric.sources`), then the
        path's first link."""
        path = t.path
        source = self.fabric.sources.get(path[0])
        return ([source] if source is not None else []) + \
            ([self.fabric.server(path[0], path[1])] if len(path) > 1 else [None])

    @staticmethod
    def _bandwidth(server, t) -> Cause:
        pace = f"at the collective's bus bandwidth, {min(t.pace, server.bw) / 1e9:,.0f} GB/s" if t.pace else ""
        return Cause("slowed", "bandwidth", where=server.name, movement=t.name, decision=pace)

    def _queued(self, server, other, priority: int, later: bool) -> Cause:
        """Queued behind ``other``: with the line of the decision that set its priority, if one did."""
        key = (server.name, other.movement_id, priority, later, other.name)
        if key not in self._queued_causes:
            hook, line, file = (None, None, "") if priority == DEFAULT_PRIORITY else \
                self._handler(None, lambda h: True, other.movement_id, "priority")
            self._queued_causes[key] = Cause("slowed", "queued", where=server.name, movement=other.name,
                                             priority=priority, later=later, line=line, file=file,
                                             decision=f"priority at {hook}" if hook else "")
        return self._queued_causes[key]

    def _engine_device(self, t) -> str:
        return t.src if t.src in self.fabric.engines else t.dst

    def _occupancy(self, servers: list, t, a: float, b: float, add, idle: Cause) -> float:
        """Blame [a, b] on what the first of ``servers`` sent then, the times it sent nothing
        on what the next sent, and so on (``idle`` where none sent anything); returns the time
        they sent t's own bytes."""
        if not servers:
            add(idle, b - a)
            return 0.0
        server, rest = servers[0], servers[1:]
        if server is None or server.occupants is None:
            add(Cause("slowed", "untracked", movement=t.name), b - a)
            return 0.0
        starts = self._interval_starts(server)
        ivs, occ = server.intervals, server.occupants
        i = max(0, bisect.bisect_right(starts, a) - 1)
        at, own = a, 0.0
        while i < len(ivs) and ivs[i][0] < b:
            s, e, nbytes = ivs[i]
            lo, hi = max(s, a), min(e, b)
            if hi > lo:
                if lo > at:
                    own += self._occupancy(rest, t, at, lo, add, idle)
                at = max(at, hi)
                other, prio, _, _ = occ[i]
                if other is t or (other.cls == t.cls and (other.start <= t.start or other.layer == t.layer)):
                    add(self._bandwidth(server, t), hi - lo)     # what is needed no later than t
                    own += hi - lo if other is t else 0.0
                else:
                    add(self._queued(server, other, prio, later=other.cls == t.cls),
                        hi - lo, nbytes * (hi - lo) / (e - s) if e > s else nbytes)
            i += 1
        if b > at:
            own += self._occupancy(rest, t, at, b, add, idle)
        return own

    def _interval_starts(self, server) -> list[float]:
        key = id(server)
        if key not in self._starts:
            self._starts[key] = [iv[0] for iv in server.intervals]
        return self._starts[key]

    @staticmethod
    def _take_from_own(steps: dict, ns: float) -> float:
        """Take up to ns from the transmission steps (flight first, then bandwidth); returns what
        it took (the window may hold less of them than the transfer's whole life did)."""
        taken = 0.0
        for cause in sorted((c for c in steps if c.cause in ("latency", "bandwidth")),
                            key=lambda c: c.cause != "latency"):
            take = min(ns - taken, steps[cause][0])
            steps[cause][0] -= take
            taken += take
            if taken >= ns:
                break
        return taken


def chains(fabric, programs: list[dict], stalls: list) -> list[Chain]:
    """Every stall's chain, longest stall first."""
    ex = Explainer(fabric, programs)
    return sorted((ex.chain(s) for s in stalls), key=lambda c: -c.stall)


def summary(all_chains: list[Chain], cover: float = COVER) -> dict:
    """The JSON of `--explain`: every chain, the ones covering ``cover`` of the stall, and the
    time each cause explains over those."""
    total = sum(c.stall for c in all_chains)
    shown, acc = [], 0.0
    for c in all_chains:
        if acc >= cover * total:
            break
        shown.append(c)
        acc += c.stall
    causes: dict[Cause, float] = defaultdict(float)     # (no bytes: the GPUs' waits overlap in time)
    for c in shown:
        for s in c.steps:
            causes[s.cause] += s.ns
    return {"stall_ms": round(total / 1e6, 6), "covered_ms": round(acc / 1e6, 6), "cover": cover,
            "chains_covering": len(shown),
            "causes": [ChainStep(c, ns).to_json(acc) for c, ns in sorted(causes.items(), key=lambda kv: -kv[1])],
            "chains": [c.to_json() for c in all_chains]}


def describe(c: Cause, nbytes: int = 0) -> str:
    """One readable line for a cause."""
    at = f" ({c.file}:{c.line})" if c.line is not None else " (no program decided it)" \
        if c.cause in ("defer", "rate") else ""
    if c.cause == "prefetch":
        return f"issued late to {c.where}: {c.decision}{at}"
    if c.cause == "collective":
        return c.decision
    if c.cause in ("defer", "rate"):
        return f"held by {c.decision}{at}"
    if c.cause == "queued":
        size = f", {nbytes / 1e6:,.1f} MB of it" if nbytes else ""
        which = f"{c.movement} for later layers" if c.later else c.movement
        set_by = f", set at {c.file}:{c.line}" if c.line is not None else ""
        return f"queued at {c.where} behind {which} (priority {c.priority}{set_by}){size}"
    if c.cause == "bandwidth":
        if c.decision:      # a collective's ring send
            return f"bandwidth-bound on {c.where}: {c.movement} {c.decision}"
        return f"bandwidth-bound on {c.where}: {c.movement} and the data of its class needed no later"
    if c.cause == "latency":
        return f"in flight on {c.where} (its latency)"
    if c.cause == "engine":
        return f"waiting for a copy engine of {c.where} (busy with other streams)"
    return "not accounted for by the evidence"


def _cause_of(step: dict) -> Cause:
    """A step's cause, back from its JSON."""
    return Cause(step["kind"], step["cause"], step.get("where", ""), step.get("movement", ""), step.get("priority"),
                 step.get("later", False), step.get("decision", ""), step.get("line"), step.get("file", ""))


def _groups(chains: list[dict]) -> list[list[dict]]:
    """Chains of one wait (the same unit and input, begun together: the GPUs of the group), the
    longest first in each, the longest groups first."""
    groups: dict[tuple, list[dict]] = {}
    for c in chains:
        groups.setdefault((c["pass"], c["layer"], c["operator"], c["movement"], c["start_ms"]), []).append(c)
    return sorted(groups.values(), key=lambda g: -sum(c["stall_ms"] for c in g))


def render(data: dict, shown: int = SHOWN) -> str:
    """The text of `--explain`: the longest waits (one chain each, for the GPU that waited
    longest), one line per step, then the causes over the stalls covering the share."""
    if not data["chains"]:
        return "Why the GPUs waited: they never did (no stall to explain)"
    lines = [f"Why the GPUs waited: {data['chains_covering']} stalls cover {data['covered_ms']:,.3f} of "
             f"{data['stall_ms']:,.3f} ms of stall ({data['cover']:.0%}); the longest waits:"]
    total = data["stall_ms"] or 1.0
    for i, group in enumerate(_groups(data["chains"])[:shown], 1):
        c, in_all = group[0], sum(x["stall_ms"] for x in group)
        more = f" (and {len(group) - 1} more GPUs: {in_all:,.3f} ms, {in_all / total:.1%} of all stall)" \
            if len(group) > 1 else f" ({in_all / total:.1%} of all stall)"
        block = f"{c['operator']} L{c['layer']} (pass {c['pass']})"
        what = f"the all-reduce after {block} held the GPUs {c['stall_ms']:,.3f} ms at {c['start_ms']:,.3f} ms" \
            if c["gpu"] == "all" else \
            f"{c['gpu']} waited {c['stall_ms']:,.3f} ms at {c['start_ms']:,.3f} ms before {block} for {c['movement']}"
        lines.append(f"{i:2}. {what}: {c['kind']}{more}")
        for s in c["steps"]:
            if s["share"] >= 0.001:     # the JSON has the rest
                lines.append(f"      {s['ms']:9,.3f} ms  {s['share']:6.1%}  {s['kind']:7}  {s['text']}")
    lines.append("Causes over those stalls:")
    for s in [s for s in data["causes"] if s["share"] >= 0.01][:10]:
        lines.append(f"  {s['ms']:10,.3f} ms  {s['share']:6.1%}  {s['kind']:7}  {s['text']}")
    return "\n".join(lines)


def render_against(data: dict, baseline: dict, rows: int = 8) -> str:
    """What the policy changed in why the GPUs waited: each cause's time over all stalls
    with the policy and without, the largest differences first."""
    def totals(d):
        out: dict[str, float] = defaultdict(float)
        for c in d["chains"]:
            for s in c["steps"]:
                out[f"{s['kind']:7}  {describe(_cause_of(s))}"] += s["ms"]
        return out
    mine, base = totals(data), totals(baseline)
    keys = sorted((k for k in set(mine) | set(base) if abs(mine.get(k, 0.0) - base.get(k, 0.0)) >= 1e-3),
                  key=lambda k: -abs(mine.get(k, 0.0) - base.get(k, 0.0)))
    lines = [f"Against the baseline (all stalls: {data['stall_ms']:,.3f} ms with the policy, "
             f"{baseline['stall_ms']:,.3f} ms without):", f"  {'policy ms':>10} {'baseline ms':>11}  change   cause"]
    if not keys:
        lines.append("  (the same causes, for the same time)")
    for k in keys[:rows]:
        a, b = mine.get(k, 0.0), base.get(k, 0.0)
        change = "created" if not b else "removed" if not a else "less" if a < b else "more"
        lines.append(f"  {a:10,.3f} {b:11,.3f}  {change:7}  {k}")
    return "\n".join(lines)
