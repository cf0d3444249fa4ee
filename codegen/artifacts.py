"""Pass 8: the runtime artifacts of an output folder (`manifest`, `bpftime_json`, `dputime_json`).

See docs/artifacts.md for every file and field.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from fabric_ext import __version__
from fabric_ext.graph import prop_value
from fabric_ext.graph_export import to_json as graph_json
from fabric_ext.runtime.machine import isa as I
from fabric_ext.runtime.machine.kernel import PROG_TYPE_SYSCALL
from fabric_ext.runtime.simulation.bundle import DPUTIME_SCHEMA, MANIFEST_SCHEMA


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hook_layouts(hooks) -> dict:
    out = {}
    for h in hooks:
        out[f"{h.island_kind}.{h.name}"] = {
            "struct": h.struct_name, "size": h.ctx_size,
            "fields": [{"name": n, "offset": o, "type": f.ctype, "decision": f.decision,
                        "default": f.default, "dim": f.dim} for n, (o, f) in h.layout.items()]}
    return out


def _props(props) -> dict:
    return {p.name.name: prop_value([p], p.name.name, True) for p in props}


def manifest(analysis, ids, compiled, opt: int, mcpu: str, files: dict[str, bytes]) -> dict:
    """The manifest: everything the runtime needs besides the objects themselves.

    ``compiled`` is [(island, [(ProgramIR, ProgramSpec)])]; ``files`` the other
    artifacts by name, whose hashes the runtime checks."""
    sym = analysis.symbols
    g = graph_json(analysis)
    devices = [dict(d, id=ids.devices[d["name"]], props=_props(sym.devices[d["name"]].props))
               for d in g["devices"]]
    map_islands: dict[str, list[str]] = {}
    programs = []
    for island, progs in compiled:
        for pir, spec in progs:
            for m in pir.maps:
                map_islands.setdefault(m, [])
                if island not in map_islands[m]:
                    map_islands[m].append(island)
            periods = sorted({h.period for h in pir.handlers if h.period})
            programs.append({"island": island, "hook": pir.hook.name, "object": f"{island}.bpf.o",
                             "section": spec.section, "symbol": spec.name, "insns": len(spec.insns),
                             "ctx_size": pir.hook.ctx_size, "tick_periods_ns": periods,
                             "handlers": [{"movement": h.movement_id, "period": h.period, "maps": h.maps,
                                           "reads": h.reads, "map_reads": h.map_reads, "last_wins": h.last_wins,
                                           "line": h.span.line}
                                          for h in pir.handlers]})
    maps = []
    for name, info in sym.maps.items():
        used = map_islands.get(name, [])
        decl = info.decl
        maps.append({"name": name, "kind": info.kind, "key_size": info.key_size,
                     "value_size": info.value_size, "max_entries": info.max_entries,
                     "key_type": decl.key_type.name if decl.key_type else None,
                     "value_type": decl.value_type.name if decl.value_type else None,
                     "islands": used, "shared": len(used) > 1})
    movements = []
    for m in g["movements"]:
        decl = sym.movements[m["name"]]
        movements.append(dict(m, id=ids.movements[m["name"]], chunk=prop_value(decl.props, "chunk")))
    line_map = {}
    for _, progs in compiled:
        for _, spec in progs:
            line_map[spec.name] = [{"insn": slot, "file": sl.file, "line": sl.line, "col": sl.col}
                                   for slot, sl in sorted(spec.line_info.items())]
    hooks = {pir.hook for _, progs in compiled for pir, _ in progs}
    sources = [{"file": f, "path": str(Path(f).resolve()), "sha256": sha256(analysis.program.sources[f].encode())}
               for f in analysis.program.files]
    return {
        "schema": MANIFEST_SCHEMA, "compiler": f"fabricc {__version__}",
        "options": {"opt": opt, "mcpu": mcpu},
        "sources": sources,
        "fabric": {"name": sym.fabric.name.name if sym.fabric else None, "devices": devices,
                   "links": g["links"], "islands": g["islands"]},
        "workload": _props(sym.workload.props) if sym.workload else {},
        "movements": movements, "programs": programs, "maps": maps,
        "ids": ids.to_json(), "hooks": hook_layouts(sorted(hooks, key=lambda h: (h.island_kind, h.name))),
        "placements": g["placements"], "line_map": line_map,
        "bpftime_shm": {"name": BPFTIME_SHM, "islands": [i["name"] for i in g["islands"] if i["runtime"] == "bpftime"
                                                         and any(p["island"] == i["name"] for p in programs)]},
        "files": {name: sha256(data) for name, data in sorted(files.items())},
    }


BPFTIME_SHM = "fabric_ext"     # the one bpftime shared memory every bpftime island is imported into


class BpftimeFds:
    """Handler numbers (fds) for the islands that share one bpftime shared memory: `bpftimetool
    import` adds each handler at its own fd, so they are unique across every island's file, and
    a map used on several islands has one fd (one map) in all of them."""

    def __init__(self):
        self.maps: dict[str, int] = {}
        self.next = 0

    def map(self, name: str) -> int:
        if name not in self.maps:
            self.maps[name] = self._take()
        return self.maps[name]

    def _take(self) -> int:
        self.next += 1
        return self.next - 1

    def program(self) -> int:
        return self._take()


def bpftime_json(specs, map_specs, fds: BpftimeFds) -> dict:
    """The handler table `bpftimetool import` reads (runtime/src/bpftime_shm_json.cpp in bpftime):
    every field its importer reads, map handlers keyed by their fd (which lddw src 1 and 2 carry
    in imm), then one program handler per program."""
    out = {}
    fd_of = [fds.map(m.name) for m in map_specs]
    for fd, m in zip(fd_of, map_specs):
        out[str(fd)] = {"type": "bpf_map_handler", "name": m.name,
                        "attr": {"map_type": m.type, "key_size": m.key_size, "value_size": m.value_size,
                                 "max_entries": m.max_entries, "flags": m.flags, "ifindex": 0,
                                 "btf_vmlinux_value_type_id": 0, "btf_id": 0, "btf_key_type_id": 0,
                                 "btf_value_type_id": 0, "map_extra": 0, "kernel_bpf_map_id": 0}}
    for p in specs:
        insns = [I.Insn(i.opcode, i.dst, i.src, i.off, fd_of[i.imm], i.next_imm)
                 if i.is_lddw and i.src in (I.PSEUDO_MAP_FD, I.PSEUDO_MAP_VALUE) else i for i in p.insns]
        code = b"".join(ins.encode() for ins in insns)
        out[str(fds.program())] = {"type": "bpf_prog_handler", "name": p.name,
                                   "attr": {"type": PROG_TYPE_SYSCALL, "cnt": len(code) // 8, "insns": code.hex(),
                                            "attach_fds": []}}
    return out


def dputime_json(island: str, kind: str, compiled, map_specs) -> dict:
    """Our dputime shim's load format: the same maps and instructions, with hooks named."""
    return {
        "schema": DPUTIME_SCHEMA, "island": island, "kind": kind,
        "maps": [{"name": m.name, "map_type": m.type, "key_size": m.key_size, "value_size": m.value_size,
                  "max_entries": m.max_entries, "flags": m.flags} for m in map_specs],
        "programs": [{"name": spec.name, "hook": pir.hook.name, "ctx_size": pir.hook.ctx_size,
                      "cnt": sum(i.slots for i in spec.insns),
                      "insns": b"".join(i.encode() for i in spec.insns).hex(),
                      "tick_periods_ns": sorted({h.period for h in pir.handlers if h.period})}
                     for pir, spec in compiled],
    }
