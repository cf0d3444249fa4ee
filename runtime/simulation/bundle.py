"""Loading a compiled policy folder (`load_bundle`): manifest, maps, programs, hooks.

The manifest's schema version and every artifact's sha256 are checked, and
so are the policy sources when they are still where they were compiled from.
Maps are created once: a cross-island map is one store that every island
using it sees.  Each island's programs come from its ``.bpf.o``; the
``.bpftime.json`` / ``.dputime.json`` files carry the same instructions for
other loaders (`load_runtime_json` reads them back).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from fabric_ext.contract.hooks import HOOKS
from fabric_ext.runtime.machine.errors import ArtifactError
from fabric_ext.runtime.machine.fsutil import UnreadableFile, read_bounded

from ..machine import isa
from ..machine.elf import MapSpec, ObjectError, load_object
from ..machine.maps import Map
from ..machine.program import Program
from ..machine.verifier import VerifierError, verify
from .manifest_schema import SchemaError, validate

MANIFEST_SCHEMA = "fabric-manifest/2"   # 2: programs list their handlers
DPUTIME_SCHEMA = "dputime/1"


MAX_ARTIFACT = 64 << 20     # no file of a policy folder is read if it is larger


class BundleError(ArtifactError):
    """A missing, corrupt or mismatched artifact; the message names the file and what to do."""


def read_artifact(path: Path, what: str) -> bytes:
    """A file of a policy folder: a regular file (not a link out of it, nor a device), of
    bounded size."""
    try:
        return read_bounded(path, MAX_ARTIFACT, follow_links=False)
    except UnreadableFile as e:
        raise BundleError(f"{path}: {what}: {e}; recompile the policy") from None
    except FileNotFoundError:
        raise BundleError(f"{path}: missing {what}; compile the policy with 'fabricc compile POLICY -o "
                          f"{path.parent}'") from None
    except OSError as e:
        raise BundleError(f"{path}: cannot read {what}: {e.strerror or e}") from None


@dataclass
class IslandPrograms:
    name: str
    kind: str
    runtime: str
    programs: dict[str, Program] = field(default_factory=dict)   # hook -> program
    tick_periods: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Bundle:
    path: Path
    manifest: dict
    maps: dict[str, Map]
    islands: dict[str, IslandPrograms]

    @property
    def ids(self) -> dict:
        return self.manifest["ids"]

    def close(self):
        for m in self.maps.values():
            m.close()


def _read_json(path: Path, what: str) -> dict:
    return _parse_json(read_artifact(path, what), path, what)


def _parse_json(data: bytes, path: Path, what: str) -> dict:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: corrupt {what} ({e}); recompile the policy") from None
    except RecursionError:
        raise BundleError(f"{path}: corrupt {what} (nested too deeply); recompile the policy") from None


def load_manifest(folder: Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such folder; compile a policy first: fabricc compile POLICY -o {folder}")
    path = folder / "manifest.json"
    man = _read_json(path, "manifest.json")
    schema = man.get("schema") if isinstance(man, dict) else None
    if schema != MANIFEST_SCHEMA:
        raise BundleError(f"{path}: schema {str(schema)[:40]!r}, expected {MANIFEST_SCHEMA!r}; "
                          "recompile the policy with this version of fabricc")
    try:
        validate(man)
    except SchemaError as e:
        raise BundleError(f"{path}: {e}; recompile the policy") from None
    for name, digest in man["files"].items():
        p = folder / name
        if hashlib.sha256(read_artifact(p, "artifact")).hexdigest() != digest:
            raise BundleError(f"{p}: does not match manifest.json (changed or corrupt); recompile the policy")
    for src in man.get("sources", []):
        p = Path(src["path"])      # checked only where it is still a policy source of sane size
        try:
            text = read_bounded(p, MAX_ARTIFACT) if p.suffix == ".fx" else None
        except (OSError, UnreadableFile):
            text = None
        if text is not None and hashlib.sha256(text).hexdigest() != src["sha256"]:
            raise BundleError(f"{src['file']}: changed since {folder} was compiled; recompile it")
    return man


def load_bundle(folder: Path, shared_maps: bool = False, verify_programs: bool = True) -> Bundle:
    """Load every island's programs and create the maps once."""
    folder = Path(folder)
    man = load_manifest(folder)
    maps: dict[str, Map] = {}
    islands: dict[str, IslandPrograms] = {}
    info = {i["name"]: i for i in man["fabric"]["islands"]}
    by_object: dict[str, list[dict]] = {}
    for p in man["programs"]:
        by_object.setdefault(p["object"], []).append(p)
    for obj_name, progs in by_object.items():
        try:
            obj = load_object(folder / obj_name)
        except ObjectError as e:
            raise BundleError(f"{e}; recompile the policy") from None
        island = progs[0]["island"]
        kind = info[island]["kind"]
        hooks = {p["symbol"]: HOOKS[kind, p["hook"]] for p in progs}
        ip = islands.setdefault(island, IslandPrograms(island, kind, info[island]["runtime"]))
        for prog in obj.instantiate(maps, hooks=hooks, shared=shared_maps):
            entry = next((p for p in progs if p["symbol"] == prog.name), None)
            if entry is None:
                raise BundleError(f"{folder / obj_name}: program '{prog.name}' is not in manifest.json")
            if verify_programs:
                try:
                    verify(prog)
                except VerifierError as e:
                    raise BundleError(f"{folder / obj_name}: {e}") from None
            ip.programs[entry["hook"]] = prog
            ip.tick_periods[entry["hook"]] = entry.get("tick_periods_ns", [])
    maps.update(create_maps(man, shared_maps, skip=set(maps)))   # unused maps too, so reports show them
    return Bundle(folder, man, maps, islands)


def create_maps(manifest: dict, shared: bool = False, skip=()) -> dict[str, Map]:
    """One store per map of the manifest (but those in ``skip``): what every island using it sees."""
    from ..machine.maps import KIND_TYPE
    return {m["name"]: MapSpec(m["name"], KIND_TYPE[m["kind"]], m["key_size"], m["value_size"],
                               m["max_entries"]).create(shared=shared)
            for m in manifest["maps"] if m["name"] not in skip}


def load_runtime_json(path: Path) -> tuple[list[MapSpec], dict[str, list[isa.Insn]]]:
    """Maps and relocated instructions from a .bpftime.json or .dputime.json file."""
    return parse_runtime_json(Path(path), read_artifact(Path(path), Path(path).name))


def parse_runtime_json(path: Path, raw: bytes) -> tuple[list[MapSpec], dict[str, list[isa.Insn]]]:
    """Maps and relocated instructions from the bytes of a .bpftime.json or .dputime.json file
    (``path`` names it in messages)."""
    data = _parse_json(raw, path, path.name)
    try:
        maps, progs = _runtime_json(path, data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, BundleError):
            raise
        raise BundleError(f"{path}: malformed ({type(e).__name__}: {str(e)[:80]}); recompile the policy") from None
    for spec in maps:
        why = spec.problem()
        if why:
            raise BundleError(f"{path}: map '{spec.name}': {why}; recompile the policy")
    return maps, progs


@dataclass(frozen=True)
class Folder:
    """The artifacts of a compiled policy folder, read as untrusted files (`read_artifact`);
    what the engine's shims load programs from (as they do from an in-memory `api.Bundle`)."""
    path: Path

    @property
    def name(self) -> str:
        return str(self.path)

    def read(self, file: str) -> bytes:
        return read_artifact(self.path / file, "artifact")


def _runtime_json(path, data):
    if data.get("schema") == DPUTIME_SCHEMA:
        maps = [MapSpec(m["name"], m["map_type"], m["key_size"], m["value_size"], m["max_entries"], m["flags"])
                for m in data["maps"]]
        progs = {p["name"]: isa.decode(bytes.fromhex(p["insns"])) for p in data["programs"]}
        return maps, progs
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
            if ins.is_lddw and ins.src in (isa.PSEUDO_MAP_FD, isa.PSEUDO_MAP_VALUE) and ins.imm not in index:
                raise BundleError(f"{path}: program '{name}' refers to fd {ins.imm}, which is no map handler here")
        progs[name] = [isa.Insn(i.opcode, i.dst, i.src, i.off, index[i.imm], i.next_imm)
                       if i.is_lddw and i.src in (isa.PSEUDO_MAP_FD, isa.PSEUDO_MAP_VALUE) else i for i in insns]
    return maps, progs
