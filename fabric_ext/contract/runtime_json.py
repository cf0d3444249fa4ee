"""The runtime artifacts of an island, both ways: ``ISLAND.bpftime.json`` (gpu and host) and
``ISLAND.dputime.json`` (dpu and cxl_switch) — the same maps and relocated instructions as the
island's ``.bpf.o``, in the forms their loaders read.

`bpftime_json` writes the handler table `bpftimetool import` reads; `dputime_json` our dputime
shim's format; `parse_runtime_json` reads either back, as untrusted bytes.  The compiler writes
through this module and the runtime reads through it, so the format is stated once.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fabric_ext.runtime.machine import isa
from fabric_ext.runtime.machine.elf import MapSpec, total_problem
from fabric_ext.runtime.machine.errors import ArtifactError
from fabric_ext.runtime.machine.kernel import PROG_TYPE_SYSCALL

from .hooks import ISLAND_RUNTIME

DPUTIME_SCHEMA = "dputime/1"
BPFTIME_SHM = "fabric_ext"     # the one bpftime shared memory every bpftime island is imported into
_LDDW_MAP = (isa.PSEUDO_MAP_FD, isa.PSEUDO_MAP_VALUE)


class BundleError(ArtifactError):
    """A missing, corrupt or mismatched artifact; the message names the file and what to do."""


def artifact_name(island: str, kind: str) -> str:
    """The runtime artifact of an island of ``kind``: ``gpu0.bpftime.json``, ``dpu0.dputime.json``."""
    return f"{island}.{ISLAND_RUNTIME[kind]}.json"


@dataclass(frozen=True)
class IslandProgram:
    """What a runtime artifact says of one program: its instructions (lddw src 1 and 2 carry a
    map's index in the island's map list), its hook and its tick periods."""
    name: str
    insns: list
    hook: str
    ctx_size: int
    tick_periods_ns: list[int]


# ---- writing -------------------------------------------------------------------------------
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


def bpftime_json(programs: list[IslandProgram], map_specs: list[MapSpec], fds: BpftimeFds) -> dict:
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
    for p in programs:
        insns = [isa.Insn(i.opcode, i.dst, i.src, i.off, fd_of[i.imm], i.next_imm)
                 if i.is_lddw and i.src in _LDDW_MAP else i for i in p.insns]
        code = b"".join(ins.encode() for ins in insns)
        out[str(fds.program())] = {"type": "bpf_prog_handler", "name": p.name,
                                   "attr": {"type": PROG_TYPE_SYSCALL, "cnt": len(code) // 8, "insns": code.hex(),
                                            "attach_fds": []}}
    return out


def dputime_json(island: str, kind: str, programs: list[IslandProgram], map_specs: list[MapSpec]) -> dict:
    """Our dputime shim's load format: the same maps and instructions, with hooks named."""
    return {
        "schema": DPUTIME_SCHEMA, "island": island, "kind": kind,
        "maps": [{"name": m.name, "map_type": m.type, "key_size": m.key_size, "value_size": m.value_size,
                  "max_entries": m.max_entries, "flags": m.flags} for m in map_specs],
        "programs": [{"name": p.name, "hook": p.hook, "ctx_size": p.ctx_size,
                      "cnt": sum(i.slots for i in p.insns), "insns": b"".join(i.encode() for i in p.insns).hex(),
                      "tick_periods_ns": p.tick_periods_ns}
                     for p in programs],
    }


def encode(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1) + "\n").encode()


# ---- reading -------------------------------------------------------------------------------
def parse_json(data: bytes, path: Path, what: str) -> dict:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: corrupt {what} ({e}); recompile the policy") from None
    except RecursionError:
        raise BundleError(f"{path}: corrupt {what} (nested too deeply); recompile the policy") from None


def parse_runtime_json(path: Path, raw: bytes) -> tuple[list[MapSpec], dict[str, list[isa.Insn]]]:
    """Maps and relocated instructions (lddw carries the map's index in the returned list) from
    the bytes of a .bpftime.json or .dputime.json file (``path`` names it in messages)."""
    data = parse_json(raw, path, path.name)
    try:
        maps, progs = _dputime(data) if data.get("schema") == DPUTIME_SCHEMA else _bpftime(path, data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, BundleError):
            raise
        raise BundleError(f"{path}: malformed ({type(e).__name__}: {str(e)[:80]}); recompile the policy") from None
    for spec in maps:
        why = spec.problem()
        if why:
            raise BundleError(f"{path}: map '{spec.name}': {why}; recompile the policy")
    why = total_problem(sum(m.bytes for m in maps))
    if why:
        raise BundleError(f"{path}: {why}; recompile the policy with smaller maps")
    return maps, progs


def _dputime(data):
    maps = [MapSpec(m["name"], m["map_type"], m["key_size"], m["value_size"], m["max_entries"], m["flags"])
            for m in data["maps"]]
    return maps, {p["name"]: isa.decode(bytes.fromhex(p["insns"])) for p in data["programs"]}


def _bpftime(path, data):
    maps, index, raw = [], {}, {}     # index: a map handler's fd -> its place in maps
    for fd in sorted(data, key=int):
        h = data[fd]
        if h["type"] == "bpf_map_handler":
            a = h["attr"]
            index[int(fd)] = len(maps)
            maps.append(MapSpec(h["name"], a["map_type"], a["key_size"], a["value_size"], a["max_entries"],
                                a.get("flags", 0)))
        elif h["type"] == "bpf_prog_handler":
            raw[h["name"]] = isa.decode(bytes.fromhex(h["attr"]["insns"]))
    progs = {}
    for name, insns in raw.items():     # lddw carries a map handler's fd: back to the map's index
        for ins in insns:
            if ins.is_lddw and ins.src in _LDDW_MAP and ins.imm not in index:
                raise BundleError(f"{path}: program '{name}' refers to fd {ins.imm}, which is no map handler here")
        progs[name] = [isa.Insn(i.opcode, i.dst, i.src, i.off, index[i.imm], i.next_imm)
                       if i.is_lddw and i.src in _LDDW_MAP else i for i in insns]
    return maps, progs
