"""The verifier's abstract values: one named type per kind of register or stack-slot content.

Each is an immutable named tuple, so a path's state hashes and compares as a whole; ``kind``
is its last field, so two values of different kinds never compare equal even where their
numbers do.  Offsets (``lo``..``hi``) are signed byte ranges from the start of the memory a
pointer points into; a scalar's range is unsigned.
"""
from __future__ import annotations

from typing import NamedTuple

M64 = (1 << 64) - 1


class Uninit(NamedTuple):
    """A register or slot never written on this path."""
    kind: str = "uninit"


class Scalar(NamedTuple):
    """A number in the unsigned range [lo, hi], a multiple of 2**align (as the kernel's tnum
    knows a value's low bits are zero: an index stepped by 8 from 0 is a multiple of 8, so a
    loop bounded by ``i < 4096`` reads at most at 4088).  A constant's align is 0: its value
    says it (`align_of`); made by `scalar`, a range's bounds are multiples of 2**align."""
    lo: int = 0
    hi: int = M64
    align: int = 0
    kind: str = "scalar"

    @property
    def constant(self) -> bool:
        return self.lo == self.hi


def align_of(v: Scalar) -> int:
    """How many low bits of every value of ``v`` are known to be zero (64 for the constant 0)."""
    if v.lo == v.hi:
        return (v.lo & -v.lo).bit_length() - 1 if v.lo else 64
    return v.align


def holds(a: Scalar, b: Scalar) -> bool:
    """Is every number ``b`` stands for one ``a`` stands for (its range inside, its known zero
    low bits at least as many)?"""
    return a.lo <= b.lo and b.hi <= a.hi and align_of(a) <= align_of(b)


def scalar(lo: int, hi: int, align: int = 0) -> Scalar | None:
    """The scalar of the multiples of 2**align in [lo, hi] (None: there are none)."""
    if align:
        step = 1 << min(align, 64)
        lo, hi = -(-lo // step) * step, hi // step * step
        if lo > hi:
            return None
    return Scalar(lo, hi, min(align, 64) if lo != hi else 0)


class Ctx(NamedTuple):
    """A pointer into the hook's context."""
    lo: int
    hi: int
    kind: str = "ctx"


class Mem(NamedTuple):
    """A pointer into the memory given to a bare program (its size known only at run time)."""
    lo: int
    hi: int
    kind: str = "mem"


class StackPtr(NamedTuple):
    """A pointer into the stack frame ``frame`` (0: the program's own)."""
    frame: int
    lo: int
    hi: int
    kind: str = "stack"


class MapValue(NamedTuple):
    """A pointer into a value of the program's map number ``map``."""
    map: int
    lo: int
    hi: int
    kind: str = "map_value"


class MapValueOrNull(NamedTuple):
    """What a map lookup returned, not yet compared with 0 (``id`` tells its copies apart)."""
    map: int
    id: int
    kind: str = "map_value_or_null"


class Record(NamedTuple):
    """A pointer into a reserved ringbuf record of ``size`` bytes, reference ``id``."""
    size: int
    id: int
    lo: int
    hi: int
    kind: str = "record"


class RecordOrNull(NamedTuple):
    """What bpf_ringbuf_reserve returned, not yet compared with 0."""
    size: int
    id: int
    kind: str = "record_or_null"


class MapPtr(NamedTuple):
    """A reference to the program's map number ``map`` (for helpers, not for access)."""
    map: int
    kind: str = "map_ptr"


class Released(NamedTuple):
    """A ringbuf record's pointer after the record was submitted or discarded at ``pc``."""
    pc: int
    kind: str = "released"


Value = Uninit | Scalar | Ctx | Mem | StackPtr | MapValue | MapValueOrNull | Record | RecordOrNull | MapPtr | Released
#: the pointers that may be moved by arithmetic and dereferenced (they have an offset range)
OFFSET_POINTERS = (Ctx, Mem, StackPtr, MapValue, Record)
UNINIT = Uninit()


def const(v: int) -> Scalar:
    return Scalar(v & M64, v & M64)


def is_ptr(v: Value) -> bool:
    return not isinstance(v, (Scalar, Uninit))
