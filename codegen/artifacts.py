"""Pass 8: the manifest of an output folder (`manifest`); the islands' runtime artifacts are
written by the contract's `runtime_json`.

See docs/artifacts.md for every file and field.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from fabric_ext import __version__
from fabric_ext.contract.bundle import MANIFEST_SCHEMA
from fabric_ext.contract.runtime_json import BPFTIME_SHM
from fabric_ext.graph import prop_value
from fabric_ext.graph_export import to_json as graph_json


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
                                           "per_port": h.per_port,
                                           "line": h.span.line, "file": h.span.file, "decides": h.decides()}
                                          for h in pir.handlers]})
    maps = []
    for name, info in sym.maps.items():
        used = map_islands.get(name, [])
        decl = info.decl
        maps.append({"name": name, "kind": info.kind, "key_size": info.key_size,
                     "value_size": info.value_size, "max_entries": info.max_entries,
                     "key_type": decl.key_type.name if decl.key_type else None,
                     "value_type": decl.value_type.name if decl.value_type else None,
                     "islands": used, "shared": len(used) > 1,
                     **({"records": info.records} if info.kind == "ringbuf" else {}),
                     **({"hist": info.hist} if info.hist else {})})
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
        "params": dict(analysis.params),
        "movements": movements, "programs": programs, "maps": maps,
        "ids": ids.to_json(), "hooks": hook_layouts(sorted(hooks, key=lambda h: (h.island_kind, h.name))),
        "placements": g["placements"], "line_map": line_map,
        "bpftime_shm": {"name": BPFTIME_SHM, "islands": [i["name"] for i in g["islands"] if i["runtime"] == "bpftime"
                                                         and any(p["island"] == i["name"] for p in programs)]},
        "files": {name: sha256(data) for name, data in sorted(files.items())},
    }
