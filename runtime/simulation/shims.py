"""Device shims: where an island's programs are loaded, attached and run.

One small interface (`Shim`): attach a program to a hook, `decide` an event
(delivered as a context struct, the decisions read back), expose the maps, count
invocations and time spent.  `BpftimeShim` (gpu and host islands) loads the
island's ``.bpftime.json`` handler table, as ``bpftimetool import`` would;
`DputimeShim` (dpu/nic and cxl_switch islands) loads ``.dputime.json``.  Both
run on whatever VM backend they are given.  A program that faults at run time
is detached from its hook, the island's defaults apply from then on, and the
fault is recorded for the report.

A program that only watches (an *observer*: `observers.py`) is not run at its events: the
shim keeps each event's context for a batch that runs them later, in the order they happened.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict

from fabric_ext.contract.bundle import island_programs
from fabric_ext.contract.context import SHARED_LIMIT, ContextCodec
from fabric_ext.contract.hooks import HOOKS

from ..machine.program import Program, VMFault
from .dispatch import Acting, Known, acting

OBSERVED = Known({}, kept=False)    # what an observer decides for any event: nothing
PENDING_ROWS = 4096     # events a batch keeps before it runs them: a bound on memory


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
        self.watching: dict[str, object] = {}   # hook -> what it watches and where it keeps it (`observers.Watch`)

    # -- loading ------------------------------------------------------------------------
    def load(self, artifacts, manifest: dict, maps: dict, verified: dict | None = None) -> None:
        """Load this island's programs from its runtime artifact (``artifacts``: a `Folder` or
        an in-memory `api.Bundle`), bound to the shared maps, and attach them (``verified``:
        as `island_programs` takes it)."""
        for loaded in island_programs(artifacts, manifest, maps, self.island, verified):
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
        self.watching.pop(hook, None)
        self.programs.pop(hook, None)
        self.handles.pop(hook, None)
        if self.on_detach is not None:      # decisions callers remember from before no longer hold
            self.on_detach(self.island)

    def flush(self, hook: str | None = None) -> None:
        """Run what the observer on ``hook`` (every observer here, with no ``hook``) was given
        and has not run yet, with the rest of its batch."""
        for batch in {id(w.batch): w.batch for h, w in self.watching.items() if hook in (None, h)}.values():
            batch.flush()

    def has(self, hook: str) -> bool:
        return hook in self.handles

    def watch(self, watch) -> None:
        """Keep the events of ``watch.movements`` on ``watch.hook`` for its batch instead of
        running them as they come (`observers.mark_observers`)."""
        self.watching[watch.hook] = watch
        self._acting.clear()

    def watches(self, hook: str, movement: int | None = None) -> bool:
        """Whether the events of ``movement`` on ``hook`` wait for a batch (None: whether all of
        its events do)."""
        w = self.watching.get(hook)
        return w is not None and (w.movements is None or movement in w.movements)

    def acting(self, hook: str, movement: int | None) -> Acting | None:
        """What the program on ``hook`` does for events of ``movement`` (None: nothing;
        see `dispatch.py`)."""
        key = (hook, movement)
        if key not in self._acting:
            prog = self.programs.get(hook)
            act = self._acting[key] = acting(hook, prog, self.handlers.get(hook), movement,
                                             self.backend.host_maps) if prog else None
            if act is not None:
                act.watched = self.watches(hook, movement)
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
        if act.watched:        # an observer of these events: it runs them with its batch
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
        if not self._run(hook, handle, ctx, now):
            return None
        outcome = codec.outcome(ctx)
        self.outcomes[hook][outcome] += 1
        known = act.remember(key, codec.changed_of(outcome)) if key is not None else None
        return known or self._unremembered(hook, outcome)

    def run(self, hook: str, fields: dict, now: float) -> bool:
        """Run the program on ``hook`` on one event's context, for its effect on maps alone
        (a tick's, run ahead of its batch: `TickSource.preview`); False if it faulted."""
        handle = self.handles.get(hook)
        if handle is None:
            return False
        ctx = self.codecs[hook].fill(fields)
        if self.tracer is not None:
            self.tracer(self.island, hook, bytes(ctx))
        return self._run(hook, handle, ctx, now)

    def _run(self, hook: str, handle, ctx, now: float) -> bool:
        """One run, counted and timed; a fault is recorded and detaches the program."""
        t0 = time.perf_counter_ns()
        try:
            self.backend.run(handle, ctx)
        except VMFault as e:
            self.fault(hook, e, now)
            return False
        finally:
            self.ns[hook] += time.perf_counter_ns() - t0
            self.invocations[hook] += 1
        return True

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
        w = self.watching.get(hook)
        if w is None:             # detached since
            return
        if self.tracer is not None:
            self.tracer(self.island, hook, bytes(ctx))
        batch = w.batch                 # (the batch's bookkeeping, here: once a watched event)
        if batch.kin is not w.kin:
            batch.kin = w.kin
            batch.starts.append(len(batch.times))
        batch.rows += ctx
        batch.times.append(now)
        batch.owners.append(w)
        if len(batch.times) >= PENDING_ROWS:
            batch.flush()

    def count(self, hook: str, runs: int, ns: int) -> None:
        """Count ``runs`` of the program on ``hook`` made elsewhere (a batch), taking ``ns``."""
        self.invocations[hook] += runs
        self.ns[hook] += ns

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
            self.fault(hook, e, row_time(e.row))
        finally:
            self.ns[hook] += time.perf_counter_ns() - t0
            self.invocations[hook] += n
        return ran

    def fault(self, hook, e: VMFault, now) -> None:
        """The program on ``hook`` faulted at ``now``: it is recorded and detached.  (It is named
        from this shim: a backend may run programs of the same code with one handle.)"""
        prog = self.programs.get(hook, e.program)
        src = prog.source_line(e.pc)
        self.faults.append({"island": self.island, "hook": hook, "program": prog.name, "pc": e.pc,
                            "where": prog.where(e.pc), "line": str(src) if src else None,
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


class BpftimeShim(Shim):
    """gpu and host islands: programs from the bpftime handler table."""
    runtime = "bpftime"


class DputimeShim(Shim):
    """dpu/nic and cxl_switch islands: programs from the dputime load file."""
    runtime = "dputime"


SHIMS = {"bpftime": BpftimeShim, "dputime": DputimeShim}
