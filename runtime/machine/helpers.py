"""Helper functions, numbered as in the Linux kernel.

`HELPERS` is the table the verifier checks calls against (argument kinds and
return kind); `call` runs one in the reference interpreter.
"""
from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .maptypes import RINGBUF
from .semantics import Fault

# argument kinds
MAP, KEY, VALUE, SCALAR, MEM, SIZE, RECORD, ANY = "map", "key", "value", "scalar", "mem", "size", "record", "any"
# return kinds
RET_SCALAR, RET_MAP_VALUE_OR_NULL, RET_RECORD_OR_NULL, RET_VOID = "scalar", "map_value_or_null", "record_or_null", "void"


@dataclass(frozen=True)
class HelperSpec:
    id: int
    name: str
    args: tuple[str, ...]
    ret: str


# helper ids (include/uapi/linux/bpf.h, enum bpf_func_id)
MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM = 1, 2, 3
KTIME_GET_NS, TRACE_PRINTK, GET_PRANDOM_U32, GET_SMP_PROCESSOR_ID = 5, 6, 7, 8
RINGBUF_OUTPUT, RINGBUF_RESERVE, RINGBUF_SUBMIT, RINGBUF_DISCARD = 130, 131, 132, 133

HELPERS = {h.id: h for h in (
    HelperSpec(MAP_LOOKUP_ELEM, "map_lookup_elem", (MAP, KEY), RET_MAP_VALUE_OR_NULL),
    HelperSpec(MAP_UPDATE_ELEM, "map_update_elem", (MAP, KEY, VALUE, SCALAR), RET_SCALAR),
    HelperSpec(MAP_DELETE_ELEM, "map_delete_elem", (MAP, KEY), RET_SCALAR),
    HelperSpec(KTIME_GET_NS, "ktime_get_ns", (), RET_SCALAR),
    HelperSpec(TRACE_PRINTK, "trace_printk", (MEM, SIZE), RET_SCALAR),
    HelperSpec(GET_PRANDOM_U32, "get_prandom_u32", (), RET_SCALAR),
    HelperSpec(GET_SMP_PROCESSOR_ID, "get_smp_processor_id", (), RET_SCALAR),
    HelperSpec(RINGBUF_OUTPUT, "ringbuf_output", (MAP, MEM, SIZE, SCALAR), RET_SCALAR),
    HelperSpec(RINGBUF_RESERVE, "ringbuf_reserve", (MAP, SCALAR, SCALAR), RET_RECORD_OR_NULL),
    HelperSpec(RINGBUF_SUBMIT, "ringbuf_submit", (RECORD, SCALAR), RET_VOID),
    HelperSpec(RINGBUF_DISCARD, "ringbuf_discard", (RECORD, SCALAR), RET_VOID),
)}


class HelperMemory(Protocol):
    """What a helper may do with a run's memory, as each backend provides it (the interpreter's
    `Machine`, the JIT's native memory): reads checked against the run's regions, maps by the
    handle a program holds, ringbuf records."""

    def read_bytes(self, addr: int, n: int) -> bytes: ...
    def map_of(self, handle: int): ...
    def map_value_addr(self, handle: int, mp, slot: int) -> int: ...
    def new_record(self, mp, size: int) -> int: ...
    def end_record(self, addr: int, submit: bool) -> None: ...


@dataclass
class HelperState:
    """What helpers keep across runs of one backend: the clock ktime_get_ns reads, the seeded
    prandom, the CPU number and what trace_printk printed."""
    clock: Callable[[], float] = lambda: 0
    seed: int = 1
    cpu: int = 0
    printk: list = field(default_factory=list)

    def __post_init__(self):
        self.rng = Prandom(self.seed)


class Prandom:
    """A seeded xorshift32, so runs are reproducible."""

    def __init__(self, seed: int):
        self.state = (seed or 1) & 0xFFFFFFFF

    def next(self) -> int:
        x = self.state
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        self.state = x
        return x


def call(vm: HelperState, m: HelperMemory, helper_id: int, regs: list[int]) -> int:
    """Run helper ``helper_id`` with r1..r5 on a run's memory ``m``; returns r0.  Clobbers
    nothing else here; the verifier treats r1-r5 as unreadable after a call."""
    r1, r2, r3, r4 = regs[1], regs[2], regs[3], regs[4]
    if helper_id in (MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM):
        mp = m.map_of(r1)
        key = m.read_bytes(r2, mp.key_size)
        if helper_id == MAP_LOOKUP_ELEM:
            slot = mp.lookup_slot(key, touch=True)
            return 0 if slot is None else m.map_value_addr(r1 & 0xFFFFFFFF, mp, slot)
        if helper_id == MAP_UPDATE_ELEM:
            return mp.update(key, m.read_bytes(r3, mp.value_size), r4)
        return mp.delete(key)
    if helper_id == KTIME_GET_NS:
        return int(vm.clock())
    if helper_id == TRACE_PRINTK:
        text = m.read_bytes(r1, r2).split(b"\0", 1)[0].decode(errors="replace")
        vm.printk.append(text)
        return len(text)
    if helper_id == GET_PRANDOM_U32:
        return vm.rng.next()
    if helper_id == GET_SMP_PROCESSOR_ID:
        return vm.cpu
    if helper_id == RINGBUF_OUTPUT:
        mp = m.map_of(r1)
        return mp.ringbuf_output(m.read_bytes(r2, r3))
    if helper_id == RINGBUF_RESERVE:
        mp = m.map_of(r1)
        if mp.type != RINGBUF:
            return 0
        return m.new_record(mp, r2) if mp.ringbuf_room(r2) else 0
    if helper_id in (RINGBUF_SUBMIT, RINGBUF_DISCARD):
        m.end_record(r1, submit=helper_id == RINGBUF_SUBMIT)
        return 0
    raise Fault(f"unknown helper {helper_id}")


__all__ = ["HELPERS", "HelperMemory", "HelperSpec", "HelperState", "Prandom", "call", "errno"]
