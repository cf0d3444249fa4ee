"""The Python API: compile a policy into a bundle in memory, run it, read the report.

    import fabric_ext
    bundle = fabric_ext.compile("policies/prefill_qos.fx")      # or the text of a policy
    report = fabric_ext.run(bundle, model="llama3-8b", prompt=4096, tp=8, baseline=True)
    print(report.ttft_ms, report.baseline.ttft_ms, report.movement("kv_export").avg_gbps)
    bundle.write("out/")                                          # what `fabricc compile` writes

`fabricc compile` and `fabric-run` are layers over these two calls.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine.errors import InputError, UsageError


class PolicyError(InputError):
    """A policy that does not compile; ``diagnostics`` holds every error and warning."""

    def __init__(self, diagnostics: Diagnostics):
        self.diagnostics = diagnostics
        first = diagnostics.errors[0]
        more = len(diagnostics.errors) - 1
        super().__init__(f"{first.span}: {first.message}" + (f" (and {more} more errors)" if more else ""))


@dataclass(frozen=True)
class Bundle:
    """A compiled policy: its manifest and every artifact, in memory."""
    manifest: dict
    files: dict[str, bytes]
    name: str = "<memory>"
    diagnostics: Diagnostics | None = field(default=None, compare=False)   # the compiler's warnings
    summary: tuple[str, ...] = ()     # a line per island: kind, runtime, programs, instructions, maps

    def read(self, file: str) -> bytes:
        """An artifact by its file name (what the runtime's shims load programs from)."""
        from fabric_ext.contract.runtime_json import BundleError
        if file not in self.files:
            raise BundleError(f"{self.name}: no artifact '{file}'; recompile the policy")
        return self.files[file]

    def write(self, folder: str | Path) -> Path:
        """Write the bundle as a policy folder (replacing only an empty folder or an earlier output)."""
        from fabric_ext.contract.bundle import write_folder
        write_folder(self.files, Path(folder))
        return Path(folder)

    @classmethod
    def read_folder(cls, folder: str | Path) -> Bundle:
        """A policy folder `fabricc compile` wrote, every artifact checked against the manifest."""
        from fabric_ext.contract.bundle import Folder, load_manifest
        folder = Path(folder)
        man = load_manifest(folder)          # validated, and every artifact's digest checked
        source = Folder(folder)
        files = {name: source.read(name) for name in man["files"]}
        files["manifest.json"] = source.read("manifest.json")
        return cls(man, files, str(folder))


def compile(source: str | Path, *, opt: int = 2, mcpu: str = "v3", emit=(), kernel_verify: bool = False,
            werror: bool = False, include=(), params: dict[str, str] | None = None) -> Bundle:
    """Compile a policy: ``source`` is the path of a .fx file, or the text of one (its imports
    relative to the working folder).  ``emit`` adds listings ("llvm", "asm"); ``kernel_verify``
    also loads each program into the running kernel; ``werror`` makes warnings errors;
    ``include`` lists folders imports are looked for in (after the importing file's); ``params``
    overrides the policy's params ({"quota": "1GB/s"}, as ``-D``).  Raises
    `PolicyError` with every diagnostic."""
    from fabric_ext.codegen.driver import build
    diags = Diagnostics()
    path, text = Path(source), None
    if isinstance(source, str) and ("\n" in source or not source.endswith(".fx")):
        path, text = Path.cwd() / "<policy>.fx", source
    res = build(path, opt, mcpu, emit, kernel_verify, diags, text, tuple(str(d) for d in include), params)
    if werror:
        diags.warnings_as_errors()
    if res is None or diags.has_errors():
        raise PolicyError(diags)
    return Bundle(res.manifest, res.files, str(source) if text is None else "<policy>", diags, tuple(res.summary))


class Record(Mapping):
    """One row of a report (a movement, a link, an island), read only: its fields by key or
    as attributes (``record.avg_gbps``)."""

    def __init__(self, fields: dict):
        self._fields = fields

    def __getitem__(self, key):
        return self._fields[key]

    def __iter__(self):
        return iter(self._fields)

    def __len__(self):
        return len(self._fields)

    def __getattr__(self, name):
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self):
        return f"Record({self._fields!r})"


@dataclass
class Report:
    """What a run reports (docs/model.md, "Reading the report"): time to first token, one
    record per movement, link and island, and the baseline run when one was asked for."""
    data: dict
    baseline: Report | None = None
    _record: object = field(default=None, repr=False)     # what the trace is drawn from
    _manifest: dict | None = field(default=None, repr=False)   # the policy's, for the HTML page

    @property
    def ttft_ms(self) -> float:
        return self.data["ttft_ms"]

    @property
    def movements(self) -> list[Record]:
        return [Record(m) for m in self.data["movements"]]

    @property
    def links(self) -> list[Record]:
        return [Record(x) for x in self.data["links"]]

    @property
    def islands(self) -> list[Record]:
        return [Record(x) for x in self.data["islands"]]

    def movement(self, name: str) -> Record:
        """The movement ``name``; KeyError, naming those the run moved, where it moved none."""
        return _named(self.movements, name, "movement")

    def link(self, name: str) -> Record:
        """The link (or memory, or wire) ``name``, e.g. ``gpu0->sw0``; KeyError where there is none."""
        return _named(self.links, name, "link")

    def to_dict(self) -> dict:
        """The report as `fabric-run --json` writes it."""
        out = dict(self.data)
        if self.baseline is not None:
            out["baseline"] = self.baseline.to_dict()
            out["policy_speedup"] = round(self.baseline.ttft_ms / self.ttft_ms, 4)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def trace(self) -> dict:
        """A Chrome/Perfetto trace of the run, and of its baseline run if it has one (it must
        have been run with ``trace=True``)."""
        from fabric_ext.runtime.simulation.trace import trace
        return trace(self._record, self.baseline._record if self.baseline is not None else None)

    def html(self, trace: str | None = None) -> tuple[str, list[str]]:
        """The report as one self-contained HTML page (tables, plots inline where matplotlib is
        installed, the policy's source with the lines that decided), linking to ``trace`` if
        given; and the warnings (what it had to leave out)."""
        from fabric_ext.runtime.simulation import html_report
        data = self.to_dict()
        return html_report.render(data, self._manifest or {"programs": [], "sources": []}, trace)


def run(bundle: Bundle | str | Path, *, model: str | None = None, prompt: int | None = None,
        batch: int | None = None, tp: int | None = None, chunk: int | None = None, stack: str | None = None,
        backend: str = "auto", jit_checks: str | None = None, baseline: bool = False, trace: bool = False,
        max_events: int | None = None, progress=None, explain: bool = False) -> Report:
    """Run a compiled policy (a `Bundle`, or the path of a policy folder) on its fabric's
    prefill; the workload's properties unless given here.  ``baseline`` also runs the same
    prefill with no programs attached (``Report.baseline``).  ``progress`` is called after each
    block of the schedule with a `Progress` (fraction, events, simulated_ms).  ``explain``
    records the evidence for a root-cause chain of every GPU stall (the report's "explain",
    docs/explain.md)."""
    from fabric_ext.contract.bundle import create_maps
    from fabric_ext.runtime.machine.backends import get_backend
    from fabric_ext.runtime.simulation import stats
    from fabric_ext.runtime.simulation.engine import Engine, RunOptions
    from fabric_ext.runtime.simulation.sim import default_max_events
    if max_events is not None and max_events < 0:
        raise UsageError(f"max_events must be 0 (no limit) or more, not {max_events}")
    if not isinstance(bundle, Bundle):
        bundle = Bundle.read_folder(bundle)
    vm = get_backend(backend, jit_checks=jit_checks)
    reports = []
    try:
        for attach in [True, False] if baseline else [True]:
            opts = RunOptions(model, prompt, batch, tp, chunk, attach=attach, progress=progress if attach else None,
                              trace=trace, stack=stack, explain=explain,
                              max_events=default_max_events(trace) if max_events is None else (max_events or None))
            eng = Engine(bundle, bundle.manifest, create_maps(bundle.manifest), vm, opts)
            eng.simulate()
            record = eng.record()
            data = stats.collect(record)
            data["policy"] = bundle.name
            reports.append(Report(data, _record=record, _manifest=bundle.manifest))
    finally:
        vm.close()
    report = reports[0]
    if baseline:
        report.baseline = reports[1]
    return report


def _named(records: list[Record], name: str, what: str) -> Record:
    found = next((r for r in records if r["name"] == name), None)
    if found is None:
        raise KeyError(f"no {what} '{name}' in this report: it has {', '.join(r['name'] for r in records) or 'none'}")
    return found
