"""Islands whose programs are the same but for the island's name compile once.

Handlers `at gpu*` give each of eight GPU islands the same programs, named after the island
(`gpu0_issue`, `gpu1_issue`, ...).  LLVM's objects for two such islands differ only in those
names, held in the object's string tables (the symbols', DWARF's and BTF's): so the second
island's object is the first's with the names rewritten there, where the names are of one
length (every string table offset stays as it was).  Where anything else differs, an old
name is left anywhere in the object after the rewrite, or the object read back is not the
first's but for the names (`same_object`), the island compiles on its own.
`tests/test_twins.py` compiles each twin directly too and compares the bytes.
"""
from __future__ import annotations

import dataclasses
import struct

from fabric_ext.runtime.machine.elfread import SHT_STRTAB, ElfFile

from . import ir

SHF_STRINGS = 0x20
BTF_HEADER = struct.Struct("<HBBIIIII")     # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len


def twin_of(progs: list[ir.ProgramIR], compiled: dict[str, list[ir.ProgramIR]]) -> str | None:
    """An island of ``compiled``, its name as long as theirs (`renamed`), whose programs are
    ``progs`` but for the island they are for."""
    island = progs[0].island
    for other, theirs in compiled.items():
        if len(theirs) == len(progs) and len(other) == len(island) and all(
                dataclasses.replace(theirs_p, island=island) == p for theirs_p, p in zip(theirs, progs)):
            return other
    return None


def renamed(obj: bytes, names: dict[str, str]) -> bytes | None:
    """``obj`` with each whole string of its string tables that is a key of ``names`` replaced
    by its value (of the same length); None where a name is not a symbol's, or is left
    anywhere in the object after the rewrite."""
    old = {k.encode(): v.encode() for k, v in names.items()}
    if any(len(k) != len(v) for k, v in old.items()):
        return None
    out = bytearray(obj)
    found = set()
    for start, end, is_symtab in _string_tables(obj):
        for name, new in old.items():
            at = obj.find(name + b"\0", start, end)
            while at >= 0:
                if at == start or obj[at - 1] == 0:
                    out[at:at + len(name)] = new
                    if is_symtab:
                        found.add(name)
                at = obj.find(name + b"\0", at + 1, end)
    if found != set(old) or any(name in out for name in old):
        return None
    return bytes(out)


def _string_tables(obj: bytes):
    """(start, end, whether it names the symbols) of each string table in the object."""
    elf = ElfFile(obj)
    symtab = elf.symtab
    names = symtab.link if symtab is not None else -1
    for sec in elf.sections:
        start, size = sec.offset, sec.size
        if sec.type == SHT_STRTAB or sec.flags & SHF_STRINGS:
            yield start, start + size, sec.index == names
        elif sec.name == ".BTF" and size >= BTF_HEADER.size:
            _, _, _, hdr_len, _, _, str_off, str_len = BTF_HEADER.unpack_from(obj, start)
            lo = start + hdr_len + str_off
            yield lo, min(lo + str_len, start + size), False


def same_object(first, twin, names: dict[str, str]) -> bool:
    """Whether ``twin`` (an `elf.ElfObject` read back) has ``first``'s maps, license and
    programs, each program renamed by ``names``.  It guards what the string tables hide: the
    symbols' table may end one string inside another (LLVM shares tails), so a map named
    `u0_issue` would be renamed along with `gpu0_issue`."""
    return first.maps == twin.maps and first.license == twin.license and \
        [dataclasses.replace(p, name=names.get(p.name)) for p in first.programs] == twin.programs
