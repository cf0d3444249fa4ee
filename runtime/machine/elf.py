"""ELF loader for libbpf-style BPF objects, from our compiler or from clang (`load_object`).

Reads program sections and their function symbols (several per section),
applies relocations (``R_BPF_64_64`` map and global-data references,
``R_BPF_64_32`` calls, with ``.text`` subprograms appended as libbpf does),
BTF-defined maps in ``.maps``, global data in ``.data``/``.rodata``/``.bss``
as one-entry array maps, ``license``, and line info from ``.BTF.ext``.
"""
from __future__ import annotations

import struct
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import isa as I
from .btf import BTFError, map_def, parse_btf, parse_btf_ext_lines
from .elfread import SHF_EXECINSTR, SHT_NOBITS, SHT_PROGBITS, STB_GLOBAL, STT_FUNC, STT_SECTION, ElfError, ElfFile
from .errors import ArtifactError
from .fsutil import UnreadableFile, read_bounded
from .isa import MAX_MAP_BYTES, MAX_TOTAL_MAP_BYTES, map_bytes
from .maptypes import ARRAY, PERCPU_ARRAY, RINGBUF, TYPE_KIND
from .program import Program, SourceLine

if TYPE_CHECKING:
    from .maps import Map

R_BPF_64_64, R_BPF_64_ABS64, R_BPF_64_ABS32, R_BPF_64_NODYLD32, R_BPF_64_32 = 1, 2, 3, 4, 10
EM_BPF = 247
DATA_SECTIONS = (".data", ".rodata", ".bss")
MAX_OBJECT = 64 << 20           # an object file is read up to this size
MAX_OBJECT_INSNS = 1 << 20      # instructions of an object's programs together, each with the subprograms it calls


class ObjectError(ArtifactError):
    """A corrupt, truncated or unsupported object; names the file and section or relocation."""


def total_problem(total: int) -> str | None:
    """Why the runtime would not create maps of ``total`` bytes (`MapSpec.bytes`, each map
    fine) together, or None: each map is bounded, and so is what they take together."""
    if total > MAX_TOTAL_MAP_BYTES:
        return (f"its maps take {total:,} bytes together; the runtime allows "
                f"{MAX_TOTAL_MAP_BYTES >> 20} MiB for all the maps of one policy")
    return None


@dataclass
class MapSpec:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int = 0
    data: bytes | None = None     # initial value of a global-data map

    @property
    def kind(self) -> str:
        return TYPE_KIND.get(self.type, str(self.type))

    def problem(self) -> str | None:
        """Why the kernel would refuse this map, or None."""
        if self.type not in TYPE_KIND:
            return f"unsupported map type {self.type}"
        if self.max_entries < 1:
            return "max_entries must be at least 1"
        if self.type == RINGBUF:
            n = self.max_entries
            if n > MAX_MAP_BYTES:
                return f"ringbuf is too large (the runtime allows {MAX_MAP_BYTES >> 20} MiB per map)"
            return None if n >= 4096 and not n & (n - 1) else "ringbuf size must be a power of two of at least 4096"
        if self.key_size < 1 and self.type not in (ARRAY, PERCPU_ARRAY) or self.value_size < 1:
            return "key and value sizes must be at least 1"
        if self.type in (ARRAY, PERCPU_ARRAY) and self.key_size != 4:
            return "array maps need a 4-byte key"
        if (self.key_size + self.value_size) * self.max_entries > MAX_MAP_BYTES or self.key_size > 512:
            return f"map is too large (the runtime allows {MAX_MAP_BYTES >> 20} MiB per map)"
        return None

    @property
    def bytes(self) -> int:
        """What its keys and values (a ringbuf: its ring) take when created."""
        return map_bytes(self.type == RINGBUF, self.key_size, self.value_size, self.max_entries)

    def create(self, **kw) -> Map:
        from .maps import Map
        m = Map(self.name, self.type, self.key_size, self.value_size, self.max_entries, self.flags, **kw)
        if self.data is not None:
            m.update(b"\0\0\0\0", self.data.ljust(self.value_size, b"\0"))
        return m


@dataclass
class ProgramSpec:
    name: str
    section: str
    insns: list[I.Insn]           # relocated: lddw imm = index into ElfObject.maps
    line_info: dict[int, SourceLine] = field(default_factory=dict)


@dataclass
class ElfObject:
    path: str
    programs: list[ProgramSpec]
    maps: list[MapSpec]
    license: str

    def program(self, name: str) -> ProgramSpec:
        for p in self.programs:
            if p.name == name or p.section == name:
                return p
        raise KeyError(f"{self.path}: no program '{name}' (has: {', '.join(p.name for p in self.programs)})")

    def instantiate(self, maps: dict[str, Map] | None = None, hooks=None, **map_kw) -> list[Program]:
        """Programs bound to maps: those in ``maps`` by name are reused (cross-island
        maps), the others created.  ``hooks`` maps a program name to its hook."""
        maps = {} if maps is None else maps
        bound = []
        for spec in self.maps:
            if spec.name not in maps:
                maps[spec.name] = spec.create(**map_kw)
            bound.append(maps[spec.name])
        return self._bind(bound, hooks)

    def declared(self, hooks=None) -> list[Program]:
        """Programs bound to their maps' declarations (`MapSpec`), no map created: what
        verifying them needs (a map's kind, name and sizes)."""
        return self._bind(list(self.maps), hooks)

    def _bind(self, maps: list, hooks) -> list[Program]:
        return [Program(p.name, p.insns, maps, (hooks or {}).get(p.name), line_info=p.line_info,
                        section=p.section) for p in self.programs]


def load_object(source: str | Path | bytes, name: str | None = None) -> ElfObject:
    """Parse a BPF ELF object from a path or bytes; raises ObjectError on bad input."""
    if isinstance(source, (str, Path)):
        path = str(source)
        try:
            data = read_bounded(Path(source), MAX_OBJECT)
        except UnreadableFile as e:
            raise ObjectError(f"{path}: {e}") from None
        except OSError as e:
            raise ObjectError(f"{path}: cannot read: {e.strerror}") from None
    else:
        data, path = bytes(source), name or "<memory>"
    try:
        return _Loader(path, data).load()
    except ObjectError:
        raise
    except (ElfError, BTFError, ValueError, KeyError, IndexError, AssertionError, TypeError, struct.error,
            OverflowError) as e:
        raise ObjectError(f"{path}: corrupt or unsupported object: {e}") from None


class _Loader:
    def __init__(self, path: str, data: bytes):
        self.path = path
        self.elf = ElfFile(data)
        if self.elf.machine != EM_BPF:
            raise ObjectError(f"{path}: not a BPF object (machine {self.elf.machine})")
        if self.elf.symtab is None:
            raise ObjectError(f"{path}: no symbol table")
        self.sections = self.elf.sections

    def err(self, msg):
        raise ObjectError(f"{self.path}: {msg}")

    def load(self) -> ElfObject:
        btf_sec = self.elf.section(".BTF")
        self.btf = parse_btf(self.elf.content(btf_sec)) if btf_sec is not None else None
        ext = self.elf.section(".BTF.ext")
        self.lines = parse_btf_ext_lines(self.elf.content(ext), self.btf) if ext is not None and self.btf else {}
        maps = self._maps()
        for m in maps:
            why = m.problem()
            if why:
                self.err(f"map '{m.name}': {why}")
        why = total_problem(sum(m.bytes for m in maps))
        if why:
            self.err(why)
        lic = self.elf.section("license")
        license = self.elf.content(lic).split(b"\0", 1)[0].decode() if lic is not None else ""
        progs = []
        text = self.elf.section(".text")
        text_idx = text.index if text is not None else None
        funcs = defaultdict(list)       # section index -> its programs' symbols (every lookup below is
        for sym in self.elf.symbols:    # indexed once: a hostile object may have 65,536 of each)
            if sym.type == STT_FUNC and sym.bind == STB_GLOBAL:
                funcs[sym.shndx].append(sym)
        self.relocs: dict[int, _ByOffset] = {}
        self.line_index = {name: _ByOffset(records) for name, records in self.lines.items()}
        self.insns_left = MAX_OBJECT_INSNS
        for sec in self.sections:
            if sec.type != SHT_PROGBITS or not sec.flags & SHF_EXECINSTR or sec.name == ".text":
                continue
            if sec.size % 8:
                self.err(f"section {sec.name}: size {sec.size} is not a multiple of 8")
            for sym in sorted(funcs.get(sec.index, ()), key=lambda s: s.value):
                progs.append(self._program(sym, sec.index, sec, text_idx, maps))
        return ElfObject(self.path, progs, maps, license)

    def _relocs_of(self, sec) -> _ByOffset:
        if sec.index not in self.relocs:
            self.relocs[sec.index] = _ByOffset([(r.offset, r.type, r.symbol) for r in self.elf.relocations_of(sec)])
        return self.relocs[sec.index]

    # -- maps -------------------------------------------------------------------------
    def _maps(self) -> list[MapSpec]:
        self.map_index: dict[tuple[int, int], int] = {}   # (section index, offset) -> map
        self.data_maps: dict[int, int] = {}                # data section index -> map
        out: list[MapSpec] = []
        maps_idx = next((s.index for s in self.sections if s.name == ".maps"), None)
        if maps_idx is not None:
            if self.btf is None:
                self.err("section .maps needs .BTF to describe the maps")
            ds = self.btf.datasec(".maps")
            if ds is None:
                self.err("section .BTF has no DATASEC for .maps")
            # the symbol table, not the DATASEC (whose offsets libbpf fixes up), says where each map is
            offsets = {s.name: s.value for s in self.elf.symbols if s.shndx == maps_idx}
            for var_id, _off, _size in ds.members:
                var = self.btf.types[var_id]
                if var.name not in offsets:
                    self.err(f"map '{var.name}' in .BTF has no symbol in .maps")
                off = offsets[var.name]
                try:
                    d = map_def(self.btf, var.size_or_type)
                except BTFError as e:
                    self.err(f"map '{var.name}' in .maps: {e}")
                if "type" not in d:
                    self.err(f"map '{var.name}' in .maps has no type")
                self.map_index[(maps_idx, off)] = len(out)
                out.append(MapSpec(var.name, d["type"], d.get("key_size", 0),
                                   d.get("value_size", 0), d.get("max_entries", 0), d.get("map_flags", 0)))
        for sec in self.sections:
            if sec.name in DATA_SECTIONS or any(sec.name.startswith(n + ".") for n in DATA_SECTIONS):
                if sec.size == 0:
                    continue
                if sec.size > I.MAX_MAP_BYTES:        # (a .bss's size is the file's word: nothing backs it)
                    self.err(f"section {sec.name} is {sec.size:,} bytes; global data is a map's "
                             f"value, at most {I.MAX_MAP_BYTES:,}")
                data = bytes(sec.size) if sec.type == SHT_NOBITS else self.elf.content(sec)
                self.data_maps[sec.index] = len(out)
                out.append(MapSpec(sec.name, ARRAY, 4, len(data), 1, data=data))
        return out

    # -- programs ------------------------------------------------------------------------
    def _program(self, sym, sec_idx, sec, text_idx, maps) -> ProgramSpec:
        start, size = sym.value, sym.size or sec.size - sym.value
        data = self.elf.content(sec)
        if start + size > len(data):
            self.err(f"section {sec.name}: symbol '{sym.name}' runs past the section end")
        code = bytearray(data[start:start + size])
        text = self.elf.content(self.sections[text_idx]) if text_idx is not None else b""
        relocs = [(o - start, t, s, sec_idx) for o, t, s in self._relocs_of(sec).within(start, start + size)]
        text_base = None
        if any(self._is_text_call(t, s, text_idx) for _, t, s, _ in relocs) and text:
            text_base = len(code)
            code += text
            relocs += [(o + text_base, t, s, text_idx) for o, t, s in self._relocs_of(self.sections[text_idx]).all]
        self.insns_left -= len(code) // 8
        if self.insns_left < 0:
            self.err(f"its programs, each with the subprograms it calls, come to more than {MAX_OBJECT_INSNS:,} "
                     f"instructions (at program '{sym.name}'): more than the runtime loads from one object")
        try:
            insns = I.decode(bytes(code))
        except I.DecodeError as e:
            self.err(f"section {sec.name}, program '{sym.name}': {e}")
        slots = I.to_slots(insns)
        for off, rtype, symi, from_sec in relocs:
            self._apply(slots, off, rtype, symi, from_sec, sec, text_base, text_idx)
        insns = [s for s in slots if s is not None]
        lines = {}
        for insn_off, file, src, line, col in self._lines(sec.name).within(start, start + size):
            lines[(insn_off - start) // 8] = SourceLine(file, line, col, src)
        if text_base is not None:
            for insn_off, file, src, line, col in self._lines(".text").all:
                lines[(insn_off + text_base) // 8] = SourceLine(file, line, col, src)
        return ProgramSpec(sym.name, sec.name, insns, lines)

    def _lines(self, section: str) -> _ByOffset:
        return self.line_index.get(section) or _ByOffset([])

    def _is_text_call(self, rtype, symi, text_idx):
        return rtype == R_BPF_64_32 and self.elf.symbol(symi).shndx == text_idx

    def _apply(self, slots, off, rtype, symi, from_sec, sec, text_base, text_idx):
        where = f"relocation at offset {off:#x} in {sec.name}"
        if off % 8 or off // 8 >= len(slots) or slots[off // 8] is None:
            self.err(f"{where}: offset is not an instruction")
        pc = off // 8
        ins = slots[pc]
        try:
            sym = self.elf.symbol(symi)
        except ElfError:
            self.err(f"{where}: symbol {symi} does not exist")
        target = sym.shndx
        if rtype == R_BPF_64_64:
            if not ins.is_lddw:
                self.err(f"{where}: R_BPF_64_64 on a non-lddw instruction")
            if (target, sym.value) in self.map_index:
                slots[pc] = I.Insn(ins.opcode, ins.dst, I.PSEUDO_MAP_FD, ins.off, self.map_index[(target, sym.value)])
            elif target in self.data_maps:
                addend = ins.imm & I.MASK32
                slots[pc] = I.Insn(ins.opcode, ins.dst, I.PSEUDO_MAP_VALUE, ins.off, self.data_maps[target],
                                   sym.value + addend)
            else:
                self.err(f"{where}: reference to '{sym.name}', which is not a map or global data")
        elif rtype == R_BPF_64_32:
            if ins.opcode != I.JMP | I.CALL:
                self.err(f"{where}: R_BPF_64_32 on a non-call instruction")
            if sym.type == STT_SECTION:
                dest_in_sec = (ins.imm + 1) * 8
            else:
                dest_in_sec = sym.value
            if target == text_idx and from_sec != text_idx:
                dest = text_base + dest_in_sec
            elif target == text_idx:
                dest = text_base + dest_in_sec
            else:
                dest = dest_in_sec
            slots[pc] = I.Insn(ins.opcode, ins.dst, I.PSEUDO_CALL, ins.off, dest // 8 - pc - 1)
        elif rtype in (R_BPF_64_ABS64, R_BPF_64_ABS32, R_BPF_64_NODYLD32):
            return  # data relocations in debug sections
        else:
            self.err(f"{where}: unsupported relocation type {rtype}")


class _ByOffset:
    """Records whose first field is an offset, in order of it (a stable sort: records at one
    offset keep their order), so that each program takes those of its own range by bisection."""

    def __init__(self, records: list[tuple]):
        self.all = sorted(records, key=lambda r: r[0])
        self._offsets = [r[0] for r in self.all]

    def within(self, lo: int, hi: int) -> list[tuple]:
        return self.all[bisect_left(self._offsets, lo):bisect_left(self._offsets, hi)]
