"""Device shims: where an island's programs are loaded, attached and run.

One small interface (`Shim`): attach a program to a hook, `decide` an event
(delivered as a context struct, the decisions read back), expose the maps, count
invocations and time spent.  `BpftimeShim` (gpu and host islands) loads the
island's ``.bpftime.json`` handler table, as ``bpftimetool import`` would;
`DputimeShim` (dpu/nic and cxl_switch islands) loads ``.dputime.json``.  Both
run on whatever VM backend they are given.  A program that faults at run time
is detached from its hook, the island's defaults apply from then on, and the
fault is recorded for the report.

A program that only watches (an *observer*: `mark_observers`) is not run at its events: the
shim keeps each event's context and runs them later, in the order they happened, in batches
(`Batch`), since nothing in the run can tell when they ran.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict

import numpy as np

from fabric_ext.contract.bundle import island_programs
from fabric_ext.contract.context import SHARED_LIMIT, ContextCodec
from fabric_ext.contract.hooks import HOOKS

from ..machine import helpers as H
from ..machine.errors import InputError
from ..machine.isa import CALL, JMP, PSEUDO_MAP_FD, PSEUDO_MAP_VALUE
from ..machine.program import Program, VMFault
from .dispatch import Acting, Known, acting

# helpers whose effect reaches no further than the program's own maps and does not depend on
# when the program runs: an observer calls only these (`mark_observers`)
ORDER_FREE = frozenset({H.MAP_LOOKUP_ELEM, H.MAP_UPDATE_ELEM, H.MAP_DELETE_ELEM, H.GET_SMP_PROCESSOR_ID,
                        H.RINGBUF_OUTPUT, H.RINGBUF_RESERVE, H.RINGBUF_SUBMIT, H.RINGBUF_DISCARD})
PENDING_ROWS = 4096     # events a `Batch` keeps before it runs them: a bound on memory
OBSERVED = Known({}, kept=False)    # what an observer decides for any event: nothing


class Shim:
    runtime = "?"

    def __init__(self, island: str, kind: str, backend):
        self.island, self.kind, self.backend = island, kind, backend
        self.programs: dict[str, Program] = {}
        self.handles: dict[str, object] = {}
        self.codecs: dict[str, ContextCodec] = {}
        self.invocations: Counter = Counter()     # program runs, per hook
        self.passed: Counter = Counter()          # events whose run a later one's made moot, per hook
        self.ns: Counter = Counter()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)   # hook -> runs per `ContextCodec.outcome`
        self._unkept: dict[tuple, Known] = {}    # (hook, outcome) -> a run's decisions, as callers get them
        self.faults: list[dict] = []
        self.maps: dict = {}
        self.handlers: dict[str, list[dict]] = {}     # hook -> the manifest's handler list
        self._acting: dict[tuple, Acting | None] = {}
        self.on_detach = None       # called with the island after a program is detached
        # called with (island, hook, context bytes) for every event a program acts on, before a
        # remembered decision may serve it (a benchmark records what the programs see)
        self.tracer = None
        self.pending: dict[str, Batch] = {}     # hook -> where an observer's events wait (`Batch`)
        self._owners: dict[str, tuple] = {}     # hook -> (self, hook), what its stretches of a batch name

    # -- loading ------------------------------------------------------------------------
    def load(self, artifacts, manifest: dict, maps: dict) -> None:
        """Load this island's programs from its runtime artifact (``artifacts``: a `Folder` or
        an in-memory `api.Bundle`), bound to the shared maps, and attach them."""
        for loaded in island_programs(artifacts, manifest, maps, self.island):
            self.maps.update((m.name, m) for m in loaded.program.maps)
            self.attach(loaded.hook, loaded.program, loaded.handlers)

    def attach(self, hook: str, prog: Program, handlers: list[dict] | None = None) -> None:
        """Attach ``prog`` to ``hook``; ``handlers`` (the manifest's list) says which movements
        it acts on and which maps each touches (None: every event, every map it has)."""
        self.programs[hook] = prog
        if handlers is not None:
            self.handlers[hook] = handlers
        self._acting.clear()
        self.codecs[hook] = ContextCodec(prog.hook)
        self.handles[hook] = self.backend.load(prog)

    def detach(self, hook: str) -> None:
        self.flush(hook)        # what it was given to watch before it went
        self.pending.pop(hook, None)
        self.programs.pop(hook, None)
        self.handles.pop(hook, None)
        if self.on_detach is not None:      # decisions callers remember from before no longer hold
            self.on_detach(self.island)

    def flush(self, hook: str | None = None) -> None:
        """Run what the observer on ``hook`` (every observer here, with no ``hook``) was given
        and has not run yet, with the rest of its batch."""
        for batch in {id(b): b for h, b in self.pending.items() if hook in (None, h)}.values():
            batch.flush()

    def has(self, hook: str) -> bool:
        return hook in self.handles

    def acting(self, hook: str, movement: int | None) -> Acting | None:
        """What the program on ``hook`` does for events of ``movement`` (None: nothing;
        see `dispatch.py`)."""
        key = (hook, movement)
        if key not in self._acting:
            prog = self.programs.get(hook)
            self._acting[key] = acting(hook, prog, self.handlers.get(hook), movement,
                                       self.backend.host_maps) if prog else None
        return self._acting[key]

    def maps_for(self, hook: str, movement: int | None) -> frozenset | None:
        """The maps the program on ``hook`` may touch for an event of ``movement``, or None
        when no handler acts on it."""
        a = self.acting(hook, movement)
        return a.maps if a is not None else None

    # -- events ----------------------------------------------------------------------------
    def decide(self, hook: str, fields: dict, now: float = 0.0) -> Known | None:
        """The decisions for an event as a `Known` (read-only; None if no handler acts on it
        or the program faulted).  Decisions that depend only on the fields the handlers read
        come from memory after the first run; ``Known.hits`` counts the events they served."""
        handle = self.handles.get(hook)
        act = self.acting(hook, fields.get("movement")) if handle is not None else None
        if act is None:
            return None
        if hook in self.pending:        # an observer: it runs with its batch
            self.keep(hook, self.codecs[hook].fill(fields), now)
            return OBSERVED
        if self.tracer is not None:
            self.tracer(self.island, hook, bytes(self.codecs[hook].fill(fields)))
        key = act.key(fields) if act.key_fields is not None else None
        if key is not None:
            known = act.memo.get(key)
            if known is not None:
                known.hits += 1
                return known
        codec = self.codecs[hook]
        ctx = codec.fill(fields)
        t0 = time.perf_counter_ns()
        try:
            self.backend.run(handle, ctx)
        except VMFault as e:
            self._fault(hook, e, now)
            return None
        finally:
            self.ns[hook] += time.perf_counter_ns() - t0
            self.invocations[hook] += 1
        outcome = codec.outcome(ctx)
        self.outcomes[hook][outcome] += 1
        known = act.remember(key, codec.changed_of(outcome)) if key is not None else None
        return known or self._unremembered(hook, outcome)

    def _unremembered(self, hook: str, outcome: tuple) -> Known:
        """A run's decisions where they are not remembered for its fields: read-only, so runs
        that decided alike share one (as many as a codec shares `changed` dicts)."""
        known = self._unkept.get((hook, outcome))
        if known is None:
            known = Known(self.codecs[hook].changed_of(outcome), kept=False)
            if len(self._unkept) < SHARED_LIMIT:
                self._unkept[hook, outcome] = known
        return known

    def keep(self, hook: str, ctx, now: float) -> None:
        """An event of the observer on ``hook``, as its context: it runs with its batch."""
        batch = self.pending.get(hook)
        if batch is None:             # detached since
            return
        if self.tracer is not None:
            self.tracer(self.island, hook, bytes(ctx))
        owner = self._owners[hook]
        if batch.owner is not owner:
            batch.owner = owner
            batch.stretches.append((owner, len(batch.times)))
        batch.rows += ctx
        batch.times.append(now)
        if len(batch.times) >= PENDING_ROWS:
            batch.flush()

    def _run_kept(self, hook: str, rows: np.ndarray, times: list[float]) -> None:
        """Run the observer on ``hook`` over its kept events' contexts (`Batch.flush`), in one
        batch.  Its manifest says it decides nothing: a decision in the contexts after the
        batch means the bundle does not hold together."""
        if hook not in self.handles:        # it faulted on an earlier one: it runs no more
            return
        codec = self.codecs[hook]
        ctxs = rows.reshape(len(times), codec.size)
        row = codec.first_decided(ctxs[:self._run_batch(hook, ctxs, times.__getitem__)])
        if row is not None:
            raise InputError(
                f"{self.island}.{hook}: its program decided {codec.changed(ctxs[row])} for the event at "
                f"{times[row]:.0f} ns, where the manifest's handler list says it decides "
                "nothing; the bundle does not hold together: compile it again with fabricc")

    def pass_over(self, hook: str, n: int) -> None:
        """Count n events not run because the runs after them overwrite all they would do."""
        self.passed[hook] += n

    def deliver_batch(self, hook: str, ctxs, row_time=lambda row: 0.0) -> int:
        """Run the program on ``hook`` over a 2-D uint8 array of contexts, in order and in
        place, in one native call where the backend has one; returns the rows run (all of
        them unless the program faulted; ``row_time(row)`` is when the faulting event was)."""
        if self.tracer is not None and hook in self.handles:
            for row in ctxs:
                self.tracer(self.island, hook, row.tobytes())
        return self._run_batch(hook, ctxs, row_time)

    def _run_batch(self, hook: str, ctxs, row_time) -> int:
        handle = self.handles.get(hook)
        if handle is None:
            return 0
        t0 = time.perf_counter_ns()
        n = ran = len(ctxs)
        try:
            self.backend.run_batch(handle, ctxs)
        except VMFault as e:
            ran, n = e.row, e.row + 1          # the faulting run counts as an invocation
            self._fault(hook, e, row_time(e.row))
        finally:
            self.ns[hook] += time.perf_counter_ns() - t0
            self.invocations[hook] += n
        return ran

    def _fault(self, hook, e: VMFault, now):
        src = e.program.source_line(e.pc)
        self.faults.append({"island": self.island, "hook": hook, "program": e.program.name, "pc": e.pc,
                            "where": e.program.where(e.pc), "line": str(src) if src else None,
                            "reason": e.reason, "time_ns": now})
        self.detach(hook)

    def summary(self) -> dict:
        """Events per hook, program invocations (runs; the other events were served by
        decisions already known), ns per invocation in the VM, and decision counts per
        value (with units)."""
        from fabric_ext.units import format_quantity
        n = sum(self.invocations.values())
        events = Counter(self.invocations) + self.passed
        decisions = defaultdict(Counter)
        for hook, runs in self.outcomes.items():
            for outcome, count in runs.items():
                for k, v in self.codecs[hook].changed_of(outcome).items():
                    decisions[hook, k][v] += count
        for act in self._acting.values():
            for known in act.known() if act is not None else ():
                events[act.hook] += known.hits
                for k, v in known.decisions.items():
                    decisions[act.hook, k][v] += known.hits

        def label(hook, name, value):
            f = HOOKS[self.kind, hook].field(name)
            return format_quantity(value, f.dim).replace(" ", "") if f is not None and f.dim else str(value)
        return {"name": self.island, "kind": self.kind, "runtime": self.runtime,
                "events": sum(events.values()), "invocations": n, "per_hook": dict(events),
                "ns_per_invocation": round(sum(self.ns.values()) / n) if n else 0,
                "decisions": {f"{h}.{k}": {label(h, k, v): c for v, c in sorted(cnt.items()) if c}
                              for (h, k), cnt in sorted(decisions.items()) if any(cnt.values())}}


class Batch:
    """The events of a group of observers that share maps with each other and with no other
    program (one observer, mostly), kept in the order they happened and run in that order:
    each stretch of one program's events in one call (`Shim._run_kept`)."""
    __slots__ = ("rows", "times", "stretches", "owner")

    def __init__(self):
        self.rows = bytearray()         # the events' contexts, one after another
        self.times: list[float] = []    # when each happened
        self.stretches: list[tuple] = []    # ((shim, hook), its first event) of each run of one program's events
        self.owner = None               # the last stretch's (shim, hook)

    def flush(self) -> None:
        """Run every event kept, in order (a program that faults runs none of its later ones)."""
        rows, times, stretches = self.rows, self.times, self.stretches
        self.rows, self.times, self.stretches, self.owner = bytearray(), [], [], None
        start = 0
        for i, ((shim, hook), first) in enumerate(stretches):
            last = stretches[i + 1][1] if i + 1 < len(stretches) else len(times)
            end = start + (last - first) * shim.codecs[hook].size
            shim._run_kept(hook, np.frombuffer(rows, dtype=np.uint8, count=end - start, offset=start), times[first:last])
            start = end


def mark_observers(shims: dict[str, Shim]) -> None:
    """Make every program that only watches an observer, where nothing in the run could tell
    when it ran: each of its handlers decides nothing (the manifest's list: `Shim._run_kept`
    checks it), it calls only `ORDER_FREE` helpers, and the programs it shares maps with,
    directly or through others, are observers too; those keep their events in one `Batch`.
    Call it once every program is attached (the engine does, as it loads them).  Ticks batch
    themselves (`ticks.py`)."""
    programs = [(shim, hook, prog, _maps_used(prog)) for shim in shims.values() for hook, prog in shim.programs.items()]
    group = list(range(len(programs)))      # union-find over programs that share a map

    def root(i):
        while group[i] != i:
            group[i] = i = group[group[i]]
        return i
    first: dict[str, int] = {}
    for i, (*_, used) in enumerate(programs):
        for name in used:
            group[root(i)] = root(first.setdefault(name, i))
    groups: dict[int, list] = {}
    for i, (shim, hook, prog, _) in enumerate(programs):
        handlers = shim.handlers.get(hook)
        watches = hook != "tick" and bool(handlers) and all(h.get("decides") == {} for h in handlers) \
            and _helpers(prog) <= ORDER_FREE
        groups.setdefault(root(i), []).append((shim, hook) if watches else None)
    for members in groups.values():
        if None not in members:
            batch = Batch()
            for shim, hook in members:
                shim.pending[hook], shim._owners[hook] = batch, (shim, hook)


def _helpers(prog: Program) -> set[int]:
    return {ins.imm for ins in prog.insns if ins.opcode == JMP | CALL and ins.src == 0}


def _maps_used(prog: Program) -> set[str]:
    """The maps the program's code names (an object's programs share its map list; the
    verifier checked each index): a map is reached only through a handle or value address
    loaded by ``lddw``."""
    return {prog.maps[ins.imm].name
            for ins in prog.insns if ins.is_lddw and ins.src in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE)}


class BpftimeShim(Shim):
    """gpu and host islands: programs from the bpftime handler table."""
    runtime = "bpftime"


class DputimeShim(Shim):
    """dpu/nic and cxl_switch islands: programs from the dputime load file."""
    runtime = "dputime"


SHIMS = {"bpftime": BpftimeShim, "dputime": DputimeShim}
