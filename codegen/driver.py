"""`fabricc compile`: the whole pipeline from a .fx file to an output folder.

Everything is written to a temporary folder next to the output and renamed
into place at the end, so a failed compile leaves the previous output intact.
Output is deterministic: the same input gives byte-identical files.
"""
from __future__ import annotations

import json
from pathlib import Path

from fabric_ext.contract import runtime_json as rj
from fabric_ext.contract.ids import assign_ids
from fabric_ext.diagnostics import Diagnostics, Span
from fabric_ext.frontend import analyze
from fabric_ext.loader import display_path
from fabric_ext.runtime.machine import isa
from fabric_ext.runtime.machine.elf import ObjectError, load_object
from fabric_ext.runtime.machine.fsutil import printable
from fabric_ext.runtime.machine.gcutil import fewer_collections
from fabric_ext.runtime.machine.verifier import VerifierError, verify

from . import artifacts
from .c_listing import render_fabric_h, render_listing
from .llvm_emit import build_module, compile_module
from .lower import lower
from .twins import renamed, same_object, twin_of


class CompileResult:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.summary: list[str] = []
        self.manifest: dict | None = None


def _span_of(spec, pc, fallback):
    from fabric_ext.diagnostics import Span
    best = None
    for slot in sorted(spec.line_info):
        if slot <= pc:
            best = spec.line_info[slot]
    if best is None:
        return fallback
    return Span(display_path(Path(best.file)), best.line, best.col, best.line, best.col + 1)


def build(path: Path, opt: int = 2, mcpu: str = "v3", emit=(), kernel_verify: bool = False,
          diags: Diagnostics | None = None, text: str | None = None, include=(),
          defines: dict[str, str] | None = None) -> CompileResult | None:
    """Compile ``path`` (with ``text``: that source, named ``path``) in memory; returns None
    when ``diags`` has errors.  ``include``: folders imports are searched in (`loader`);
    ``defines``: param values over the declared ones (`params`)."""
    diags = diags if diags is not None else Diagnostics()
    try:
        with fewer_collections():       # the front end's trees, the lowered IR, llvmlite's IR objects
            return _build(path, opt, mcpu, emit, kernel_verify, diags, text, include, defines)
    except RecursionError:      # the parser's limits should keep every pass far from this
        diags.error(Span(display_path(Path(path)), 1, 1, 1, 2), "the policy nests too deeply to compile",
                    "split deep expressions and blocks into smaller ones")
        return None


def _build(path, opt, mcpu, emit, kernel_verify, diags, text=None, include=(), defines=None) -> CompileResult | None:
    from fabric_ext.runtime.simulation.workload import check_declaration
    a = analyze(path, diags, text, include, defines)
    if not a.program.unread:
        check_declaration(a.symbols, diags)
    if not a.ok:
        return None
    ids = assign_ids(a)
    programs = lower(a, ids, opt, diags)
    if diags.has_errors():
        return None
    res = CompileResult()
    by_island: dict[str, list] = {}
    for p in programs:
        by_island.setdefault(p.island, []).append(p)
    compiled = []
    bpftime_fds = rj.BpftimeFds()
    source = printable(str(path))
    objects: dict[str, tuple] = {}      # island -> (object, read back), compiled on its own
    for island, progs in by_island.items():
        twin = _twin_object(progs, objects, by_island) if "llvm" not in emit else None
        if twin is None:
            module, cut = build_module(island, progs, a.symbols.maps, source, MAX_LLVM_INSTRUCTIONS)
            if _too_large(module, cut, progs, island, diags):
                continue
            obj, llvm_text = compile_module(module, opt, mcpu)
            twin = objects[island] = obj, load_object(obj, f"{island}.bpf.o")
        obj, loaded = twin
        specs = {s.name: s for s in loaded.programs}
        pairs = [(p, specs[p.name]) for p in progs]
        hooks = {p.name: p.hook for p in progs}
        for prog in loaded.declared(hooks=hooks):
            try:
                verify(prog)
            except VerifierError as e:
                pir = next(p for p in progs if p.name == prog.name)
                diags.error(_span_of(specs[prog.name], e.pc, pir.handlers[0].span if pir.handlers else a.program.modules[0].span),
                            f"the program for {island}.{pir.hook.name} does not verify: {e.msg}",
                            f"at {prog.where(e.pc)}")
        verified = _kernel_verify(loaded, hooks, progs, specs, island, diags) if kernel_verify else None
        compiled.append((island, pairs))
        kind = a.graph.islands[island].kind
        res.files[f"{island}.bpf.o"] = obj
        entries = [rj.IslandProgram(spec.name, spec.insns, pir.hook.name, pir.hook.ctx_size,
                                    sorted({h.period for h in pir.handlers if h.period})) for pir, spec in pairs]
        runtime_json = rj.bpftime_json(entries, loaded.maps, bpftime_fds) \
            if a.graph.islands[island].runtime == "bpftime" else rj.dputime_json(island, kind, entries, loaded.maps)
        res.files[rj.artifact_name(island, kind)] = rj.encode(runtime_json)
        res.files[f"{island}.bpf.c"] = render_listing(island, progs, a.symbols.maps, source).encode()
        if "llvm" in emit:
            res.files[f"{island}.ll"] = llvm_text.encode()
        if "asm" in emit:
            res.files[f"{island}.s"] = "\n\n".join(
                f"{s.name}:\n" + isa.disasm(s.insns) for s in loaded.programs).encode() + b"\n"
        n_insns = sum(len(s.insns) for s in loaded.programs)
        res.summary.append(f"{island:<8} {kind:<10} {a.graph.islands[island].runtime:<8} "
                           f"{len(progs)} program{'s' * (len(progs) != 1)}, {n_insns} instructions, "
                           f"{len(loaded.maps)} map{'s' * (len(loaded.maps) != 1)}")
        if verified:
            res.summary.append(f"{'':<8} {verified}")
    if diags.has_errors():
        return None
    from fabric_ext.graph_export import to_json
    res.files["fabric.h"] = render_fabric_h(ids).encode()
    res.files["graph.json"] = (json.dumps(to_json(a), indent=1) + "\n").encode()
    res.manifest = artifacts.manifest(a, ids, compiled, opt, mcpu, res.files)
    res.files["manifest.json"] = (json.dumps(res.manifest, indent=1) + "\n").encode()
    return res


#: LLVM instructions of one program before optimisation, at most.  A BPF jump reaches 32,767
#: instructions, and past that LLVM's BPF backend aborts the process ("Branch target out of insn
#: range"), after minutes of optimising.  Programs come to at most one BPF instruction per LLVM
#: one (a map update's helper call, the most: 1.0; a condition and a decision, 0.3): half the
#: reach keeps them in it.
MAX_LLVM_INSTRUCTIONS = 16_384


def _too_large(module, cut: dict[str, int], progs, island: str, diags: Diagnostics) -> bool:
    """Whether a program of the island's module is past `MAX_LLVM_INSTRUCTIONS` (an error at
    its first handler).  ``cut``: programs whose building stopped once they were past it, with
    the handlers built by then (`llvm_emit.build_module`)."""
    sizes = {f.name: sum(len(b.instructions) for b in f.blocks) for f in module.functions}
    large = False
    for p in progs:
        if sizes.get(p.name, 0) > MAX_LLVM_INSTRUCTIONS:
            large = True
            n = len(p.handlers)
            some = f"first {cut[p.name]:,} of {n:,} handlers already come" if p.name in cut else \
                f"{n:,} handler{'s' * (n != 1)} come"
            diags.error(p.handlers[0].span, f"the program for {island}.{p.hook.name} is too large: its {some} "
                        f"to {sizes[p.name]:,} LLVM instructions, more than the {MAX_LLVM_INSTRUCTIONS:,} an eBPF "
                        "program's jumps can span",
                        "split them over movements or islands, or put what they compare in a map and look it up")
    return large


def _twin_object(progs, objects: dict[str, tuple], by_island: dict) -> tuple | None:
    """(object, read back) for an island whose programs an island compiled before has, but
    for the island's name (`twins`): that island's, renamed; None where there is none."""
    twin = twin_of(progs, {island: by_island[island] for island in objects})
    if twin is None:
        return None
    names = {theirs.name: mine.name for theirs, mine in zip(by_island[twin], progs)}
    obj = renamed(objects[twin][0], names)
    if obj is None:
        return None
    try:
        loaded = load_object(obj, f"{progs[0].island}.bpf.o")
    except ObjectError:         # a string the rename should not have touched (`same_object`)
        return None
    return (obj, loaded) if same_object(objects[twin][1], loaded, names) else None


def _kernel_verify(loaded, hooks, progs, specs, island, diags) -> str | None:
    """Load each program of the island into the running kernel; what was verified, for the
    summary (None where nothing was)."""
    import platform

    from fabric_ext.runtime.machine import kernel
    ok, why = kernel.permitted()
    if not ok:
        diags.warning(progs[0].handlers[0].span, f"--kernel-verify skipped: {why}")
        return None
    backend = kernel.KernelBackend()
    accepted = 0
    try:
        for prog in loaded.instantiate(hooks=hooks):
            try:
                backend.load(prog)
                accepted += 1
            except kernel.KernelVerifierError as e:
                pc = e.failing_insn() or 0
                pir = next(p for p in progs if p.name == prog.name)
                tail = "\n".join(e.log.strip().splitlines()[-3:])
                diags.error(_span_of(specs[prog.name], pc, pir.handlers[0].span),
                            f"the kernel verifier rejects {island}.{pir.hook.name}: {tail}")
            except kernel.KernelError as e:      # its maps, or the load itself (no verifier log)
                pir = next(p for p in progs if p.name == prog.name)
                diags.error(pir.handlers[0].span, f"--kernel-verify: the kernel refuses {island}.{pir.hook.name}: "
                                                  f"{e.strerror or e}")
    finally:
        backend.close()
    return (f"kernel verifier of Linux {platform.release()}: {accepted} of {len(progs)} "
            f"program{'s' * (len(progs) != 1)} accepted (loaded as BPF_PROG_TYPE_SYSCALL, maps created)")
