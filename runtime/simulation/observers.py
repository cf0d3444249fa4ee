"""Programs that only watch (*observers*): which they are (`mark_observers`) and where their
events wait to be run (`Batch`).

An observer is not run at its events: its shim keeps each event's context and the batch runs
them later, in the order they happened, since nothing in the run can tell when they ran.  What
it decides is checked after the batch (nothing, or the bundle does not hold together).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..machine import helpers as H
from ..machine.errors import InputError
from ..machine.flow import CANNOT_FAIL, helpers_called, may_fault
from ..machine.isa import PSEUDO_MAP_FD, PSEUDO_MAP_VALUE, RUN_BUDGET
from ..machine.program import Program, VMFault

# helpers whose effect reaches no further than the program's own maps and does not depend on
# when the program runs (the clock and the random numbers do): an observer calls only these
ORDER_FREE = CANNOT_FAIL - {H.KTIME_GET_NS, H.GET_PRANDOM_U32}


@dataclass(frozen=True, slots=True, eq=False)
class Watch:
    """What a shim's program on a hook watches (``movements``; None: every event) and the batch
    it keeps those events for; a batch's events name theirs (one per program, told apart by
    identity).  Programs of one ``kin`` are the same code on the same maps for the same hook,
    so either gives an event what the other would, and their events run in one call
    (`Batch.flush`)."""
    shim: object
    hook: str
    kin: object
    batch: Batch
    movements: frozenset | None


class Batch:
    """The events of a group of observers that share maps with each other and with no other
    program (one observer, mostly), kept in the order they happened (`Shim.keep` adds them)
    and run in that order, at the latest once `shims.PENDING_ROWS` wait."""
    __slots__ = ("rows", "times", "owners", "starts", "kin")

    def __init__(self):
        self.rows = bytearray()         # the events' contexts, one after another
        self.times: list[float] = []    # when each happened
        self.owners: list[Watch] = []   # whose each is
        self.starts: list[int] = []     # the first event of each run of events of one kin
        self.kin = None                 # the last run's kin

    def flush(self) -> None:
        """Run every event kept, in order: each run of events of kin programs in one call (a
        program that faults runs none of its later ones)."""
        rows, times, owners, starts = self.rows, self.times, self.owners, self.starts
        self.rows, self.times, self.owners, self.starts, self.kin = bytearray(), [], [], [], None
        data = np.frombuffer(rows, dtype=np.uint8)
        offset = 0
        for first, last in zip(starts, [*starts[1:], len(times)]):
            size = owners[first].shim.codecs[owners[first].hook].size
            ctxs = data[offset:offset + (last - first) * size].reshape(last - first, size)
            _run_kin(ctxs, times[first:last], owners[first:last])
            offset += (last - first) * size


def _run_kin(ctxs: np.ndarray, times: list[float], owners: list[Watch]) -> None:
    """Run kin programs' events (``owners``: each event's program) in one call, and where one
    faults, the others' after it in another; each program counts its own runs and its share of
    the time."""
    while owners:
        if not all(o.shim.has(o.hook) for o in set(owners)):      # one faulted: its events go
            attached = [o.shim.has(o.hook) for o in owners]
            ctxs = ctxs[np.array(attached, dtype=bool)]
            times = [t for t, a in zip(times, attached) if a]
            owners = [o for o, a in zip(owners, attached) if a]
            if not owners:
                return
        shim, hook = owners[0].shim, owners[0].hook
        t0 = time.perf_counter_ns()
        try:
            shim.backend.run_batch(shim.handles[hook], ctxs)
            ran, fault = len(times), None
        except VMFault as e:
            ran, fault = e.row, e
        ns = time.perf_counter_ns() - t0
        runs = ran + (fault is not None)        # the faulting run counts as an invocation
        for owner, n in Counter(owners[:runs]).items():
            owner.shim.count(owner.hook, n, ns * n // runs)
        codec = shim.codecs[hook]
        row = codec.first_decided(ctxs[:ran])
        if row is not None:
            owner = owners[row]
            raise InputError(
                f"{owner.shim.island}.{owner.hook}: its program decided {codec.changed(ctxs[row])} for the "
                f"event at {times[row]:.0f} ns, where the manifest's handler list says it decides nothing; "
                "the bundle does not hold together: compile it again with fabricc")
        if fault is None:
            return
        owners[ran].shim.fault(owners[ran].hook, fault, times[ran])
        ctxs, times, owners = ctxs[ran + 1:], times[ran + 1:], owners[ran + 1:]


@dataclass(frozen=True)
class _Unit:
    """What one program does for the events of some movements (the handlers named for them):
    the smallest part of a program that `mark_observers` batches."""
    shim: object
    hook: str
    movements: frozenset | None     # None: every event of the hook
    maps: frozenset                 # the maps its handlers touch
    watches: bool                   # it decides nothing and calls only `ORDER_FREE` helpers


def mark_observers(shims: dict) -> None:
    """Make every program that only watches an observer, where nothing in the run could tell
    when it ran: it decides nothing (the manifest's list: checked after each batch), calls only
    `ORDER_FREE` helpers, and the programs it shares maps with (the maps its code names),
    directly or through others, are observers too; those keep their events in one `Batch`.

    A program whose handlers decide for some movements and only watch others is an observer of
    those others, on the same terms (here the maps each handler touches are the manifest's, as
    for the ticks run before an event), where none of its runs can fault (`flow.may_fault`): a
    fault would detach it, deciding handlers and all, at an event the batch reaches only later.
    Its watching handlers share one batch.  Call it once every program is attached (the engine
    does, as it loads them).  Ticks batch themselves (`ticks.py`)."""
    units = [u for shim in shims.values() for hook, prog in shim.programs.items() for u in _units(shim, hook, prog)]
    group = list(range(len(units)))      # union-find over units that share a map or a batch

    def root(i):
        while group[i] != i:
            group[i] = i = group[group[i]]
        return i
    first: dict = {}
    for i, u in enumerate(units):
        for name in u.maps | ({(u.shim, u.hook)} if u.watches else set()):
            group[root(i)] = root(first.setdefault(name, i))
    groups: dict[int, list[_Unit]] = {}
    for i, u in enumerate(units):
        groups.setdefault(root(i), []).append(u)
    units_of = Counter((u.shim, u.hook) for u in units)
    kins: dict[tuple, object] = {}
    for members in groups.values():
        if not all(u.watches for u in members):
            continue
        programs: dict[tuple, list[_Unit]] = {}
        for u in members:
            programs.setdefault((u.shim, u.hook), []).append(u)
        whole = {key: len(mine) == units_of[key] for key, mine in programs.items()}
        if not all(whole[key] or _faultless(*key) for key in programs):
            continue
        batch = Batch()
        for (shim, hook), mine in programs.items():
            prog = shim.programs[hook]
            kin = kins.setdefault((prog.code, tuple(map(id, prog.maps)), id(prog.hook)), object())
            movements = None if whole[shim, hook] else frozenset().union(*(u.movements for u in mine))
            shim.watch(Watch(shim, hook, kin, batch, movements))


def _units(shim, hook: str, prog: Program) -> list[_Unit]:
    """The program as units: one per movement its handlers name, where each names one (the
    maps its code names that no handler lists go with every unit); else one, the whole."""
    handlers = shim.handlers.get(hook) or []
    orderly = helpers_called(prog) <= ORDER_FREE and hook != "tick"
    code_maps = frozenset(_maps_used(prog))
    if not handlers or prog.hook is None or prog.hook.field("movement") is None \
            or any(h.get("movement") is None for h in handlers):
        return [_Unit(shim, hook, None, code_maps,
                      orderly and bool(handlers) and all(h.get("decides") == {} for h in handlers))]
    unlisted = code_maps - {m for h in handlers for m in h.get("maps", ())}
    by_movement: dict[int, list[dict]] = {}
    for h in handlers:
        by_movement.setdefault(h["movement"], []).append(h)
    return [_Unit(shim, hook, frozenset({m}), frozenset(x for h in hs for x in h.get("maps", ())) | unlisted,
                  orderly and all(h.get("decides") == {} for h in hs))
            for m, hs in by_movement.items()]


def _faultless(shim, hook: str) -> bool:
    """No run of the program on ``hook`` can fault, on this shim's backend (`flow.may_fault`)."""
    backend = shim.backend
    return backend.host_maps and may_fault(shim.programs[hook], getattr(backend, "budget", RUN_BUDGET)) is None


def _maps_used(prog: Program) -> set[str]:
    """The maps the program's code names (an object's programs share its map list; the
    verifier checked each index): a map is reached only through a handle or value address
    loaded by ``lddw``."""
    return {prog.maps[ins.imm].name
            for ins in prog.insns if ins.is_lddw and ins.src in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE)}
