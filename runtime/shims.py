"""Device shims: where an island's programs are loaded, attached and run.

One small interface (`Shim`): attach a program to a hook, deliver an event as
a context struct and get the decisions back, expose the maps, count
invocations and time spent.  `BpftimeShim` (gpu and host islands) loads the
island's ``.bpftime.json`` handler table, as ``bpftimetool import`` would;
`DputimeShim` (dpu/nic and cxl_switch islands) loads ``.dputime.json``.  Both
run on whatever VM backend they are given.  A program that faults at run time
is detached from its hook, the island's defaults apply from then on, and the
fault is recorded for the report.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path

from fabric_ext.hooks import HOOKS

from .bundle import BundleError, load_runtime_json
from .context import ContextCodec
from .program import Program, SourceLine, VMFault
from .verifier import VerifierError, verify


class Shim:
    runtime = "?"
    suffix = "?"

    def __init__(self, island: str, kind: str, backend):
        self.island, self.kind, self.backend = island, kind, backend
        self.programs: dict[str, Program] = {}
        self.handles: dict[str, object] = {}
        self.codecs: dict[str, ContextCodec] = {}
        self.invocations: Counter = Counter()
        self.ns: Counter = Counter()
        self.decisions: dict[str, Counter] = defaultdict(Counter)
        self.faults: list[dict] = []
        self.maps: dict = {}

    # -- loading ------------------------------------------------------------------------
    def load(self, folder: Path, manifest: dict, maps: dict) -> None:
        """Load this island's programs from its runtime artifact, bound to the shared maps."""
        path = Path(folder) / f"{self.island}.{self.suffix}.json"
        map_specs, insns = load_runtime_json(path)
        bound = []
        for spec in map_specs:
            if spec.name not in maps:
                raise BundleError(f"{path}: map '{spec.name}' is not in manifest.json; recompile the policy")
            m = maps[spec.name]
            if (m.type, m.key_size, m.value_size, m.max_entries) != \
                    (spec.type, spec.key_size, spec.value_size, spec.max_entries):
                raise BundleError(f"{path}: map '{spec.name}' does not match manifest.json; recompile the policy")
            bound.append(m)
            self.maps[spec.name] = m
        for entry in manifest["programs"]:
            if entry["island"] != self.island:
                continue
            if entry["symbol"] not in insns:
                raise BundleError(f"{path}: program '{entry['symbol']}' is missing; recompile the policy")
            hook = HOOKS[self.kind, entry["hook"]]
            lines = {e["insn"]: SourceLine(e["file"], e["line"], e["col"])
                     for e in manifest.get("line_map", {}).get(entry["symbol"], [])}
            prog = Program(entry["symbol"], insns[entry["symbol"]], bound, hook, line_info=lines)
            try:
                verify(prog)
            except VerifierError as e:
                raise BundleError(f"{path}: {e}") from None
            self.attach(entry["hook"], prog)

    def attach(self, hook: str, prog: Program) -> None:
        self.programs[hook] = prog
        self.codecs[hook] = ContextCodec(prog.hook)
        self.handles[hook] = self.backend.load(prog)

    def detach(self, hook: str) -> None:
        self.programs.pop(hook, None)
        self.handles.pop(hook, None)

    def has(self, hook: str) -> bool:
        return hook in self.handles

    # -- events ----------------------------------------------------------------------------
    def deliver(self, hook: str, fields: dict, now: float = 0.0) -> dict | None:
        """Run the program on ``hook`` with a context built from ``fields``; return the
        decisions it changed (None if no program is attached or it faulted)."""
        handle = self.handles.get(hook)
        if handle is None:
            return None
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
        changed = codec.changed(ctx)
        for k, v in changed.items():
            self.decisions[f"{hook}.{k}"][v] += 1
        return changed

    def deliver_batch(self, hook: str, ctxs, now: float = 0.0) -> None:
        """Deliver events whose decisions nobody reads (telemetry ticks): a 2-D uint8 array
        of contexts, run in one native call where the backend has a batch entry."""
        handle = self.handles.get(hook)
        if handle is None:
            return
        t0 = time.perf_counter_ns()
        try:
            batch = getattr(self.backend, "run_batch", None)
            if batch is not None:
                batch(handle, ctxs)
            else:
                for row in ctxs:
                    self.backend.run(handle, bytearray(row.tobytes()))
        except VMFault as e:
            self._fault(hook, e, now)
        finally:
            self.ns[hook] += time.perf_counter_ns() - t0
            self.invocations[hook] += len(ctxs)

    def _fault(self, hook, e: VMFault, now):
        src = e.program.source_line(e.pc)
        self.faults.append({"island": self.island, "hook": hook, "program": e.program.name, "pc": e.pc,
                            "where": e.program.where(e.pc), "line": str(src) if src else None,
                            "reason": e.reason, "time_ns": now})
        self.detach(hook)

    def summary(self) -> dict:
        """Invocations, ns per invocation in the VM, and decision counts per value (with units)."""
        from fabric_ext.units import format_quantity
        n = sum(self.invocations.values())

        def label(key, value):
            hook, name = key.split(".", 1)
            f = HOOKS[self.kind, hook].field(name)
            return format_quantity(value, f.dim).replace(" ", "") if f is not None and f.dim else str(value)
        return {"name": self.island, "kind": self.kind, "runtime": self.runtime, "invocations": n,
                "per_hook": dict(self.invocations),
                "ns_per_invocation": round(sum(self.ns.values()) / n) if n else 0,
                "decisions": {k: {label(k, v): c for v, c in sorted(cnt.items())}
                              for k, cnt in sorted(self.decisions.items())}}


class BpftimeShim(Shim):
    """gpu and host islands: programs from the bpftime handler table."""
    runtime, suffix = "bpftime", "bpftime"


class DputimeShim(Shim):
    """dpu/nic and cxl_switch islands: programs from the dputime load file."""
    runtime, suffix = "dputime", "dputime"


SHIMS = {"bpftime": BpftimeShim, "dputime": DputimeShim}
