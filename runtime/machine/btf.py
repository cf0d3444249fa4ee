"""Just enough BTF to read libbpf-style maps and line info (`parse_btf`, `parse_btf_ext`)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .errors import ArtifactError

BTF_MAGIC = 0xEB9F
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO, \
    VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(1, 20)
_VLEN_SIZE = {STRUCT: 12, UNION: 12, ENUM: 8, FUNC_PROTO: 8, DATASEC: 12, ENUM64: 12}
_EXTRA = {INT: 4, ARRAY: 12, VAR: 4, DECL_TAG: 4}


class BTFError(ArtifactError):
    pass


MAX_STRING = 4096      # bytes of a name or a source line read from the strings section


@dataclass
class BType:
    kind: int
    name: str
    size_or_type: int
    vlen: int
    members: list = field(default_factory=list)   # (name, type, offset) / (type, offset, size) for datasec
    array: tuple | None = None                    # (elem type, index type, nelems)


@dataclass
class BTF:
    types: list[BType]     # index = type id (0 is void)
    strings: bytes
    _resolved: dict[int, BType] = field(default_factory=dict, repr=False, compare=False)

    def string(self, off: int) -> str:
        """The string at ``off``, up to its NUL or `MAX_STRING` bytes (a hostile table's
        strings may run to its end, and every type may name the same one)."""
        end = self.strings.find(b"\0", off, off + MAX_STRING)
        return self.strings[off:end if end >= 0 else off + MAX_STRING].decode(errors="replace")

    def resolve(self, tid: int) -> BType:
        """The type ``tid`` names through typedefs and qualifiers (a cycle of them is an error,
        not a loop without end).  Each type on the way is remembered: a hostile object's maps
        may each name the head of one long chain."""
        path, t = [], self.types[tid]
        while t.kind in (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG):
            if tid in self._resolved:
                t = self._resolved[tid]
                break
            if len(path) >= len(self.types):
                raise BTFError(f"type {path[0]} names itself through typedefs or qualifiers")
            path.append(tid)
            tid = t.size_or_type
            t = self.types[tid]
        for step in path:
            self._resolved[step] = t
        return t

    def size_of(self, tid: int) -> int:
        size, seen = 1, set()
        while True:             # arrays of arrays: a loop, with a cycle an error
            t = self.resolve(tid)
            if t.kind in (INT, STRUCT, UNION, ENUM, FLOAT, ENUM64, DATASEC):
                return size * t.size_or_type
            if t.kind == PTR:
                return size * 8
            if t.kind != ARRAY or tid in seen:
                raise BTFError(f"type {tid} has no size")
            seen.add(tid)
            size, tid = size * t.array[2], t.array[0]

    def datasec(self, name: str) -> BType | None:
        return next((t for t in self.types[1:] if t.kind == DATASEC and t.name == name), None)


def parse_btf(data: bytes) -> BTF:
    if len(data) < 24:
        raise BTFError("section .BTF is truncated")
    magic, ver, flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
    if magic != BTF_MAGIC:
        raise BTFError(f"section .BTF has bad magic {magic:#x}")
    tbase, sbase = hdr_len + type_off, hdr_len + str_off
    if tbase + type_len > len(data) or sbase + str_len > len(data):
        raise BTFError("section .BTF is truncated")
    strings = data[sbase:sbase + str_len]
    btf = BTF([BType(0, "void", 0, 0)], strings)
    off, end = tbase, tbase + type_len
    while off < end:
        name_off, info, st = struct.unpack_from("<III", data, off)
        off += 12
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        t = BType(kind, btf.string(name_off), st, vlen)
        if kind == ARRAY:
            t.array = struct.unpack_from("<III", data, off)
        elif kind in (STRUCT, UNION):
            for i in range(vlen):
                n, ty, mo = struct.unpack_from("<III", data, off + 12 * i)
                t.members.append((btf.string(n), ty, mo))
        elif kind == DATASEC:
            for i in range(vlen):
                t.members.append(struct.unpack_from("<III", data, off + 12 * i))
        if kind not in range(1, 20):
            raise BTFError(f"section .BTF: unknown type kind {kind}")
        off += _EXTRA.get(kind, 0) + _VLEN_SIZE.get(kind, 0) * vlen
        btf.types.append(t)
    return btf


def map_def(btf: BTF, var_type: int) -> dict:
    """A BTF-defined map's attributes from its struct (``__uint(type, ..)`` and friends)."""
    st = btf.resolve(var_type)
    if st.kind != STRUCT:
        raise BTFError("map definition is not a struct")
    out = {}
    for name, ty, _ in st.members:
        t = btf.resolve(ty)
        if name in ("type", "max_entries", "key_size", "value_size", "map_flags", "pinning"):
            if t.kind != PTR or btf.resolve(t.size_or_type).kind != ARRAY:
                raise BTFError(f"map field '{name}' must be a pointer to an array")
            out[name] = btf.resolve(t.size_or_type).array[2]
        elif name in ("key", "value"):
            if t.kind != PTR:
                raise BTFError(f"map field '{name}' must be a pointer")
            out[name + "_size"] = btf.size_of(t.size_or_type)
    return out


LINE_INFO_SIZE = 16     # a line record: instruction offset, file, line text, line and column


def parse_btf_ext_lines(data: bytes, btf: BTF) -> dict[str, list[tuple[int, str, str, int, int]]]:
    """section name -> [(insn byte offset, file, source text, line, col)] from .BTF.ext."""
    if len(data) < 24:
        return {}
    magic, ver, flags, hdr_len = struct.unpack_from("<HBBI", data)
    if magic != BTF_MAGIC:
        raise BTFError(f"section .BTF.ext has bad magic {magic:#x}")
    _, _, li_off, li_len = struct.unpack_from("<IIII", data, 8)
    base = hdr_len + li_off
    out: dict[str, list] = {}
    if li_len == 0:
        return out
    rec_size = struct.unpack_from("<I", data, base)[0]
    off, end = base + 4, min(base + li_len, len(data))
    if rec_size < LINE_INFO_SIZE:
        raise BTFError(f"section .BTF.ext: line records of {rec_size} bytes; they are at least {LINE_INFO_SIZE}")
    while off < end:
        sec_off, num = struct.unpack_from("<II", data, off)
        off += 8
        if off + num * rec_size > end:      # (checked before the records are read: num is the file's word)
            raise BTFError(f"section .BTF.ext: {num} line records of {rec_size} bytes run past its end")
        recs = out.setdefault(btf.string(sec_off), [])
        for i in range(num):
            insn_off, file_off, line_off, line_col = struct.unpack_from("<IIII", data, off + i * rec_size)
            recs.append((insn_off, btf.string(file_off), btf.string(line_off), line_col >> 10, line_col & 0x3FF))
        off += num * rec_size
    return out
