"""The ELF container of a BPF object: its sections, symbols and relocations (`ElfFile`).

Only what a relocatable 64-bit little-endian object holds and `elf` reads: no program
headers, no DWARF.  The file may be hostile: every header, name and table is checked
against the file's bounds before it is read, and every failure is an `ElfError` that says
which part is wrong.  Contents are sliced from the file only when asked for, so a file of
many sections that all claim the same large range allocates nothing for them.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import ArtifactError

ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
SYMBOL = struct.Struct("<IBBHQQ")               # name, info, other, shndx, value, size
REL = struct.Struct("<QQ")                      # offset, info (symbol << 32 | type)

SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_NOBITS, SHT_REL = 1, 2, 3, 8, 9
SHF_EXECINSTR = 0x4
STT_FUNC, STT_SECTION = 2, 3
STB_GLOBAL = 1
SHN_LORESERVE = 0xff00          # section indices from here on are special (or extended numbering)
MAX_SYMBOLS = 1 << 16           # far more than a BPF object has: keeps a hostile table's parse bounded
MAX_RELOCATIONS = 1 << 20       # ... and one of relocations (a program has at most 1M instructions)
MAX_NAME = 4096                 # bytes of a section's or a symbol's name


class ElfError(ArtifactError):
    """What is wrong with the file, naming the header, section or symbol (`elf.load_object`
    adds the file's name)."""


@dataclass(frozen=True, slots=True)
class Section:
    index: int
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    value: int
    size: int
    type: int       # STT_*
    bind: int       # STB_*
    shndx: int      # the section it is in (0: undefined)


@dataclass(frozen=True, slots=True)
class Relocation:
    offset: int
    type: int
    symbol: int     # index into the symbol table


class ElfFile:
    def __init__(self, data: bytes):
        self.data = data
        if len(data) < ELF_HEADER.size or data[:4] != b"\x7fELF":
            raise ElfError("not an ELF file (no ELF header)")
        (ident, _type, self.machine, _version, _entry, _phoff, shoff, _flags, _ehsize, _phentsize, _phnum,
         shentsize, shnum, shstrndx) = ELF_HEADER.unpack_from(data)
        if ident[4] != 2:
            raise ElfError(f"not an ELF64 file (class {ident[4]}): BPF objects are 64-bit")
        if ident[5] != 1:
            raise ElfError("big-endian objects are not supported")
        if shnum == 0 or shstrndx >= SHN_LORESERVE:
            raise ElfError("no section headers (or extended section numbering, which BPF objects do not use)")
        if shentsize != SECTION_HEADER.size or shoff + shnum * shentsize > len(data):
            raise ElfError(f"the section header table ({shnum} x {shentsize} bytes at offset {shoff}) "
                           f"does not lie in the {len(data)}-byte file")
        if shstrndx >= shnum:
            raise ElfError(f"the section names' table is section {shstrndx}, of {shnum}")
        headers = [SECTION_HEADER.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
        for i, (_n, type_, _f, _a, offset, size, *_) in enumerate(headers):
            if type_ != SHT_NOBITS and offset + size > len(data):
                raise ElfError(f"section {i} ({size} bytes at offset {offset}) extends past the end "
                               f"of the {len(data)}-byte file")
        names = headers[shstrndx]
        self.sections = [Section(i, self._string(names[4], names[5], h[0], f"section {i}'s name"),
                                 h[1], h[2], h[4], h[5], h[6], h[7]) for i, h in enumerate(headers)]
        self._symbols: list[Symbol] | None = None
        self._relocating: dict[int, list[Section]] = {}     # section index -> its SHT_REL sections
        for sec in self.sections:
            if sec.type == SHT_REL:
                self._relocating.setdefault(sec.info, []).append(sec)

    def _string(self, start: int, size: int, offset: int, what: str) -> str:
        """The NUL-terminated string at ``offset`` of the string table at ``start``."""
        if offset >= size:
            raise ElfError(f"{what} lies outside its string table ({offset} of {size} bytes)")
        end = self.data.find(b"\0", start + offset, min(start + size, start + offset + MAX_NAME))
        if end < 0:     # (bounded: a hostile table's every name may run to its end)
            raise ElfError(f"{what} is not NUL-terminated in its string table, or longer than {MAX_NAME:,} bytes")
        return self.data[start + offset:end].decode("utf-8", "replace")

    def content(self, section: Section) -> bytes:
        """What the file holds of ``section`` (a SHT_NOBITS section holds nothing)."""
        return b"" if section.type == SHT_NOBITS else self.data[section.offset:section.end]

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    @property
    def symtab(self) -> Section | None:
        return next((s for s in self.sections if s.type == SHT_SYMTAB), None)

    @property
    def symbols(self) -> list[Symbol]:
        """The symbol table's entries, in order (index 0 the null symbol); [] where there is none."""
        if self._symbols is None:
            self._symbols = self._read_symbols()
        return self._symbols

    def _read_symbols(self) -> list[Symbol]:
        tab = self.symtab
        if tab is None:
            return []
        if tab.size % SYMBOL.size or tab.size // SYMBOL.size > MAX_SYMBOLS:
            raise ElfError(f"the symbol table is {tab.size} bytes: not a whole number of symbols, "
                           f"or more than {MAX_SYMBOLS:,}")
        if tab.link >= len(self.sections) or self.sections[tab.link].type != SHT_STRTAB:
            raise ElfError(f"the symbol table's names are in section {tab.link}, which is no string table")
        names = self.sections[tab.link]
        return [Symbol(self._string(names.offset, names.size, name, f"symbol {i}'s name"), value, size,
                       info & 0xf, info >> 4, shndx)
                for i, (name, info, _other, shndx, value, size) in enumerate(SYMBOL.iter_unpack(self.content(tab)))]

    def symbol(self, index: int) -> Symbol:
        if not 0 <= index < len(self.symbols):
            raise ElfError(f"symbol {index} does not exist (the table has {len(self.symbols)})")
        return self.symbols[index]

    def relocations_of(self, section: Section):
        """The SHT_REL relocations that apply to ``section`` (of every such table), in order."""
        for rel in self._relocating.get(section.index, ()):
            if rel.size % REL.size or rel.size // REL.size > MAX_RELOCATIONS:
                raise ElfError(f"relocation section {rel.name} is {rel.size} bytes: not a whole number "
                               f"of {REL.size}-byte entries, or more than {MAX_RELOCATIONS:,}")
            for offset, info in REL.iter_unpack(self.content(rel)):
                yield Relocation(offset, info & 0xffffffff, info >> 32)
