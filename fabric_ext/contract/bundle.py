"""A compiled policy (a bundle): its manifest and artifacts, written as a folder and read back.

The one reader and the one writer of the format, for both sides: the compiler writes a folder
with `write_folder`; the runtime (`fabric-run`, the API, the tests) checks a manifest with
`load_manifest`, creates its maps with `create_maps` and loads each island's programs from its
runtime artifact with `island_programs`.  A folder is untrusted input (docs/security.md):
the manifest's schema and every artifact's sha256 are checked, and so are the policy sources
when they are still where they were compiled from.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fabric_ext.runtime.machine.elf import MapSpec
from fabric_ext.runtime.machine.fsutil import UnreadableFile, check_replaceable, read_bounded, replace_dir
from fabric_ext.runtime.machine.maptypes import KIND_TYPE
from fabric_ext.runtime.machine.program import Program, SourceLine
from fabric_ext.runtime.machine.verifier import VerifierError, verify

from .hooks import HOOKS
from .manifest_schema import SchemaError, validate
from .runtime_json import BundleError, artifact_name, parse_json, parse_runtime_json

if TYPE_CHECKING:
    from fabric_ext.runtime.machine.maps import Map

MANIFEST_SCHEMA = "fabric-manifest/2"   # 2: programs list their handlers
MAX_ARTIFACT = 64 << 20     # no file of a policy folder is read if it is larger


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


@dataclass(frozen=True)
class Folder:
    """The artifacts of a compiled policy folder, read as untrusted files (`read_artifact`);
    what programs are loaded from, as they are from an in-memory `api.Bundle`."""
    path: Path

    @property
    def name(self) -> str:
        return str(self.path)

    def read(self, file: str) -> bytes:
        return read_artifact(self.path / file, "artifact")


def write_folder(files: dict[str, bytes], out: Path) -> None:
    """Write a bundle's files as the folder ``out``, whole or not at all, replacing only an
    empty folder or an earlier output (`fsutil.check_replaceable`); raises `OutputError` (an
    OSError) where it cannot."""
    out = Path(out).resolve()
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, data in sorted(files.items()):
            (staging / name).write_bytes(data)
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_manifest(folder: Path) -> dict:
    """The manifest of a policy folder, validated, every artifact's digest checked."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise BundleError(f"{folder}: not a folder; give a policy folder from fabricc compile, or a .fx policy")
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such folder; compile a policy first: fabricc compile POLICY -o {folder}")
    path = folder / "manifest.json"
    man = parse_json(read_artifact(path, "manifest.json"), path, "manifest.json")
    check_manifest(man, path)
    for name, digest in man["files"].items():
        p = folder / name
        if hashlib.sha256(read_artifact(p, "artifact")).hexdigest() != digest:
            raise BundleError(f"{p}: does not match manifest.json (changed or corrupt); recompile the policy")
    for src, state in source_states(man):      # checked only where still a policy source of sane size
        if state == "changed":
            raise BundleError(f"{src['file']}: changed since {folder} was compiled; recompile it")
    return man


def source_states(man: dict):
    """(source, "same" | "changed" | "gone") for each policy source the manifest lists: whether
    the file is still there with the digest it was compiled from."""
    for src in man.get("sources", []):
        p = Path(src["path"])
        try:
            text = read_bounded(p, MAX_ARTIFACT) if p.suffix == ".fx" else None
        except (OSError, UnreadableFile):
            text = None
        if text is None:
            yield src, "gone"
        else:
            yield src, "same" if hashlib.sha256(text).hexdigest() == src["sha256"] else "changed"


def check_manifest(man, path) -> None:
    """The manifest's schema version and every key of it (`manifest_schema`)."""
    schema = man.get("schema") if isinstance(man, dict) else None
    if schema != MANIFEST_SCHEMA:
        raise BundleError(f"{path}: schema {str(schema)[:40]!r}, expected {MANIFEST_SCHEMA!r}; "
                          "recompile the policy with this version of fabricc")
    try:
        validate(man)
    except SchemaError as e:
        raise BundleError(f"{path}: {e}; recompile the policy") from None


def create_maps(manifest: dict, shared: bool = False) -> dict[str, Map]:
    """One store per map of the manifest: what every island using it sees."""
    return {m["name"]: MapSpec(m["name"], KIND_TYPE[m["kind"]], m["key_size"], m["value_size"],
                               m["max_entries"]).create(shared=shared)
            for m in manifest["maps"]}


@dataclass(frozen=True)
class LoadedProgram:
    """An island's program, bound to the shared maps and verified, with what the manifest says
    of it: the hook it is attached to and its handlers (which movements it acts on, which
    maps each touches)."""
    hook: str
    program: Program
    handlers: list[dict]


def island_programs(artifacts, manifest: dict, maps: dict[str, Map], island: str,
                    verified: dict | None = None) -> list[LoadedProgram]:
    """Every program of ``island`` (one with programs) from its runtime artifact (``artifacts``: a `Folder` or an
    in-memory `api.Bundle`), its maps bound to ``maps`` (`create_maps`), each verified.  ``verified``, where
    given, keeps what verifying found for the islands loaded before with the same ``maps``: a twin's
    program (the same instructions for the same hook on the same maps, as every GPU's of a policy
    for ``gpu*`` mostly is) takes it instead of being verified again."""
    kind = next(i["kind"] for i in manifest["fabric"]["islands"] if i["name"] == island)
    name = artifact_name(island, kind)
    path = Path(artifacts.name) / name
    map_specs, insns = parse_runtime_json(path, artifacts.read(name))
    bound = []
    for spec in map_specs:
        m = maps.get(spec.name)
        if m is None:
            raise BundleError(f"{path}: map '{spec.name}' is not in manifest.json; recompile the policy")
        if (m.type, m.key_size, m.value_size, m.max_entries) != \
                (spec.type, spec.key_size, spec.value_size, spec.max_entries):
            raise BundleError(f"{path}: map '{spec.name}' does not match manifest.json; recompile the policy")
        bound.append(m)
    out = []
    for entry in manifest["programs"]:
        if entry["island"] != island:
            continue
        if entry["symbol"] not in insns:
            raise BundleError(f"{path}: program '{entry['symbol']}' is missing; recompile the policy")
        lines = {e["insn"]: SourceLine(e["file"], e["line"], e["col"])
                 for e in manifest.get("line_map", {}).get(entry["symbol"], [])}
        prog = Program(entry["symbol"], insns[entry["symbol"]], bound, HOOKS[kind, entry["hook"]], line_info=lines)
        _verify(prog, path, verified)
        out.append(LoadedProgram(entry["hook"], prog, entry.get("handlers", [])))
    return out


def _verify(prog: Program, path: Path, verified: dict | None) -> None:
    """Verify ``prog``, or give it the proof of a program verified before that the verifier
    could not tell from it: everything it reads is in the key (the maps by identity: the
    caller's, alive while it keeps ``verified``)."""
    key = (prog.code, prog.hook, prog.ctx_size, tuple(id(m) for m in prog.maps))
    found = verified.get(key) if verified is not None else None
    if found is not None:
        prog.proof, prog.mem_extent, prog.call_maps = found
        return
    try:
        verify(prog)
    except VerifierError as e:
        raise BundleError(f"{path}: {e}") from None
    if verified is not None:
        verified[key] = (prog.proof, prog.mem_extent, prog.call_maps)


@dataclass
class LoadedBundle:
    """A policy folder loaded whole: its manifest, its maps, each island's programs by hook."""
    manifest: dict
    maps: dict[str, Map]
    islands: dict[str, dict[str, Program]]

    @property
    def ids(self) -> dict:
        return self.manifest["ids"]


def load_bundle(folder: Path) -> LoadedBundle:
    """Every island's programs of a policy folder, through the loader `fabric-run` uses."""
    man = load_manifest(folder)
    maps = create_maps(man)
    source = Folder(Path(folder))
    with_programs = dict.fromkeys(p["island"] for p in man["programs"])
    return LoadedBundle(man, maps, {island: {p.hook: p.program for p in island_programs(source, man, maps, island)}
                                    for island in with_programs})
