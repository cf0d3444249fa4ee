"""The reference interpreter: the specification of eBPF semantics for fabric_ext.

Every memory access is checked against the regions the program may touch:
its 512-byte stack per frame, the context (writes only to decision bytes of
its hook), map values, ringbuf records and the memory given to it.  Division
by zero gives 0 and modulo by zero the dividend (RFC 9669); shift amounts are
masked; 32-bit results zero-extend.  An instruction budget bounds every run.

With ``check_proofs`` (or ``FABRIC_EXT_CHECK_PROOFS=1`` in the environment) the
interpreter also checks the verifier's claims: an access the verifier proved
in bounds (where the JIT emits no check) must land in the kind of memory it was
proven in, and a fault there is reported as `ProofViolation`, a verifier defect.
"""
from __future__ import annotations

import os
import struct

from . import helpers as Hl
from . import isa as I
from .maptypes import RINGBUF
from .program import Backend, Program, ProofViolation, VMFault
from .semantics import Fault, alu, ctx_write_mask, s32, s64

M64, M32 = I.MASK64, I.MASK32
STACK_SIZE, MAX_FRAMES, MAP_HANDLE = I.STACK_SIZE, I.MAX_FRAMES, I.MAP_HANDLE
STACK_BASE = 0x7F00_0000_0000
FRAME_STRIDE = 0x10000          # frame i's stack lies at STACK_BASE + i * FRAME_STRIDE
CTX_BASE = 0x1000_0000_0000
MEM_BASE = 0x2000_0000_0000
MAP_BASE = 0x5000_0000_0000        # + map index << 32
RECORD_BASE = 0x6000_0000_0000     # ringbuf records, + n << 24
_PACK = {1: struct.Struct("<B"), 2: struct.Struct("<H"), 4: struct.Struct("<I"), 8: struct.Struct("<Q")}
_SPACK = {1: struct.Struct("<b"), 2: struct.Struct("<h"), 4: struct.Struct("<i"), 8: struct.Struct("<q")}


class Region:
    """Memory a run may touch; ``kind`` names it as the verifier's proofs do."""
    __slots__ = ("lo", "hi", "buf", "name", "kind", "wmask", "readonly")

    def __init__(self, lo, buf, name, kind, wmask=None, readonly=False):
        self.lo, self.hi, self.buf, self.name, self.kind = lo, lo + len(buf), buf, name, kind
        self.wmask, self.readonly = wmask, readonly


class Machine:
    """Per-run state: registers, frames and the memory regions of one run."""

    def __init__(self, vm: Interpreter, prog: Program, ctx, mem):
        self.vm, self.prog = vm, prog
        self.regions: list[Region] = []
        self.frames: list[bytearray] = []
        self.pc = 0
        # the proof holds for a whole context only (as the JIT uses it)
        whole = ctx is None or len(ctx) >= prog.ctx_size
        self.proven = prog.proof if vm.check_proofs and whole else None
        if ctx is not None:
            self.regions.append(Region(CTX_BASE, memoryview(ctx).cast("B"), "context", "ctx",
                                       ctx_write_mask(prog.hook, len(ctx))))
        if mem is not None:
            self.regions.append(Region(MEM_BASE, memoryview(mem).cast("B"), "memory", "mem"))
        for i, m in enumerate(prog.maps):
            if m.type != RINGBUF:
                self.regions.append(Region(MAP_BASE + (i << 32), memoryview(m.values), f"map '{m.name}'",
                                           "map_value"))
        self.records: dict[int, tuple[object, bytearray]] = {}
        self.next_record = 0

    def push_frame(self) -> int:
        if len(self.frames) >= MAX_FRAMES:
            raise Fault(f"call depth exceeds {MAX_FRAMES} frames")
        buf = bytearray(STACK_SIZE)
        base = STACK_BASE + len(self.frames) * FRAME_STRIDE
        self.frames.append(buf)
        self.regions.insert(0, Region(base, buf, f"stack frame {len(self.frames) - 1}", "stack"))
        return base + STACK_SIZE

    def pop_frame(self):
        self.frames.pop()
        self.regions.pop(0)

    def region(self, addr: int, size: int, write: bool) -> tuple[Region, int]:
        for r in self.regions:
            if r.lo <= addr and addr + size <= r.hi:
                off = addr - r.lo
                if write and (r.readonly or (r.wmask is not None and r.wmask.find(0, off, off + size) != -1)):
                    self.fault(f"write of {size} bytes to read-only {r.name} at offset {off}")
                if self.proven is not None:
                    kinds = self.proven.get(self.pc)
                    if kinds and "mem" not in kinds and r.kind not in kinds:
                        self.fault(f"it reached {r.name} ({r.kind})")
                return r, off
        what = "write" if write else "read"
        near = next((r for r in self.regions if r.lo <= addr < r.hi + 4096), None)
        where = f" ({near.name} is {near.hi - near.lo} bytes; offset {addr - near.lo})" if near else ""
        self.fault(f"out-of-bounds {what} of {size} bytes at {addr:#x}{where}")

    def fault(self, why: str):
        """Stop the run; where the verifier proved this access safe, the fault is its defect."""
        kinds = self.proven.get(self.pc) if self.proven is not None else None
        if kinds and "mem" not in kinds:
            raise _ProofViolation(f"verifier bug: the access was proven to stay in {'/'.join(sorted(kinds))}, "
                                  f"but {why}")
        raise Fault(why)

    def load(self, addr, size, signed=False):
        r, off = self.region(addr, size, False)
        return (_SPACK if signed else _PACK)[size].unpack_from(r.buf, off)[0]

    def store(self, addr, size, value):
        r, off = self.region(addr, size, True)
        _PACK[size].pack_into(r.buf, off, value & ((1 << (8 * size)) - 1))

    def read_bytes(self, addr, n) -> bytes:
        if n == 0:
            return b""
        r, off = self.region(addr, n, False)
        return bytes(r.buf[off:off + n])

    def map_of(self, handle: int):
        if handle & MAP_HANDLE != MAP_HANDLE or (handle & M32) >= len(self.prog.maps):
            raise Fault(f"{handle:#x} is not a map")
        return self.prog.maps[handle & M32]

    def map_value_addr(self, index: int, m, slot: int) -> int:
        return MAP_BASE + (index << 32) + m.value_offset(slot)

    def new_record(self, m, size) -> int:
        buf = bytearray(size)
        addr = RECORD_BASE + (self.next_record << 24)
        self.next_record += 1
        self.regions.append(Region(addr, buf, "ringbuf record", "record"))
        self.records[addr] = (m, buf)
        return addr

    def end_record(self, addr, submit: bool):
        if addr not in self.records:
            raise Fault(f"{addr:#x} is not a reserved ringbuf record")
        m, buf = self.records.pop(addr)
        self.regions = [r for r in self.regions if r.lo != addr]
        if submit:
            m.ringbuf_output(bytes(buf))


class _ProofViolation(Fault):
    pass


class Interpreter(Backend):
    """The reference backend.  ``clock`` gives ktime_get_ns; ``seed`` get_prandom_u32."""
    name = "interp"
    host_maps = True

    def __init__(self, budget: int = I.RUN_BUDGET, clock=None, seed: int = 1, cpu: int = 0, printk=None,
                 check_proofs: bool | None = None):
        self.budget = budget
        if check_proofs is None:
            check_proofs = os.environ.get("FABRIC_EXT_CHECK_PROOFS", "") not in ("", "0")
        self.check_proofs = check_proofs
        self.helpers = Hl.HelperState(clock or (lambda: 0), seed, cpu, printk if printk is not None else [])
        self.executed = 0  # instructions executed by the last run

    def run(self, prog: Program, ctx=None, mem=None) -> int:
        m = Machine(self, prog, ctx, mem)
        regs = [0] * 11
        regs[10] = m.push_frame()
        if ctx is not None:
            regs[1] = CTX_BASE
        elif mem is not None:
            regs[1], regs[2] = MEM_BASE, len(mem)
        try:
            return self._loop(prog, m, regs)
        except _ProofViolation as e:
            raise ProofViolation(prog, m.pc, str(e)) from None
        except Fault as e:
            raise VMFault(prog, m.pc, str(e)) from None

    def _loop(self, prog: Program, m: Machine, regs: list[int]) -> int:
        slots, n = prog.slots, len(prog.slots)
        calls: list[tuple[int, list[int]]] = []
        budget, pc, steps = self.budget, 0, 0
        while True:
            if pc < 0 or pc >= n or slots[pc] is None:
                m.pc = max(0, min(pc, n - 1))
                raise Fault(f"jump out of the program to pc {pc}")
            steps += 1
            if steps > budget:
                m.pc = pc
                self.executed = steps
                raise Fault(f"instruction budget of {budget} exhausted")
            ins = slots[pc]
            m.pc = pc
            op, cls = ins.opcode, ins.opcode & 7
            if cls == I.ALU64 or cls == I.ALU:
                regs[ins.dst] = alu(ins, cls, regs)
            elif cls == I.JMP or cls == I.JMP32:
                code = op & 0xF0
                if code == I.EXIT:
                    if not calls:
                        self.executed = steps
                        return regs[0]
                    pc, saved = calls.pop()
                    regs[6:10] = saved
                    m.pop_frame()
                    regs[10] = m.frames and (STACK_BASE + (len(m.frames) - 1) * FRAME_STRIDE + STACK_SIZE)
                    continue
                if code == I.CALL:
                    if ins.src == I.PSEUDO_CALL:
                        calls.append((pc + 1, regs[6:10]))
                        regs[10] = m.push_frame()
                        pc = pc + 1 + ins.imm
                        continue
                    hid = regs[ins.dst] if op & I.X else ins.imm      # callx: the id in a register
                    regs[0] = Hl.call(self.helpers, m, hid, regs) & M64
                    continue_pc = pc + 1
                    pc = continue_pc
                    continue
                if code == I.JA:
                    pc += 1 + ins.jump_offset
                    continue
                a = regs[ins.dst]
                b = regs[ins.src] if op & I.X else ins.imm & M64
                if cls == I.JMP32:
                    a, b = a & M32, b & M32
                    sa, sb = s32(a), s32(b)
                else:
                    sa, sb = s64(a), s64(b)
                if _taken(code, a, b, sa, sb):
                    pc += 1 + ins.off
                    continue
            elif cls == I.LDX:
                size = I.SIZE_BYTES[ins.size]
                v = m.load((regs[ins.src] + ins.off) & M64, size, signed=ins.mode == I.MEMSX)
                regs[ins.dst] = v & M64
            elif cls == I.STX:
                size = I.SIZE_BYTES[ins.size]
                addr = (regs[ins.dst] + ins.off) & M64
                if ins.mode == I.ATOMIC:
                    self._atomic(m, ins, addr, size, regs)
                else:
                    m.store(addr, size, regs[ins.src])
            elif cls == I.ST:
                m.store((regs[ins.dst] + ins.off) & M64, I.SIZE_BYTES[ins.size], ins.imm)
            elif ins.is_lddw:
                if ins.src == I.PSEUDO_MAP_FD:
                    regs[ins.dst] = MAP_HANDLE | ins.imm
                elif ins.src == I.PSEUDO_MAP_VALUE:
                    regs[ins.dst] = MAP_BASE + (ins.imm << 32) + ins.next_imm
                else:
                    regs[ins.dst] = ins.imm & M64
                pc += 2
                continue
            else:
                raise Fault(f"unsupported opcode {op:#04x}")
            pc += 1

    @staticmethod
    def _atomic(m, ins, addr, size, regs):
        mask = (1 << (8 * size)) - 1
        old = m.load(addr, size)
        src = regs[ins.src] & mask
        op = ins.imm
        if op == I.XCHG:
            m.store(addr, size, src)
            regs[ins.src] = old
            return
        if op == I.CMPXCHG:
            if old == regs[0] & mask:
                m.store(addr, size, src)
            regs[0] = old
            return
        base = op & ~I.FETCH
        new = {I.ADD: old + src, I.OR: old | src, I.AND: old & src, I.XOR: old ^ src}.get(base)
        if new is None:
            raise Fault(f"unsupported atomic operation {op:#x}")
        m.store(addr, size, new)
        if op & I.FETCH:
            regs[ins.src] = old


# conditional jumps: (unsigned a, unsigned b, signed a, signed b) -> taken?
_TAKEN = {
    I.JEQ: lambda a, b, sa, sb: a == b, I.JNE: lambda a, b, sa, sb: a != b,
    I.JGT: lambda a, b, sa, sb: a > b, I.JGE: lambda a, b, sa, sb: a >= b,
    I.JLT: lambda a, b, sa, sb: a < b, I.JLE: lambda a, b, sa, sb: a <= b,
    I.JSET: lambda a, b, sa, sb: bool(a & b),
    I.JSGT: lambda a, b, sa, sb: sa > sb, I.JSGE: lambda a, b, sa, sb: sa >= sb,
    I.JSLT: lambda a, b, sa, sb: sa < sb, I.JSLE: lambda a, b, sa, sb: sa <= sb,
}


def _taken(code, a, b, sa, sb) -> bool:
    test = _TAKEN.get(code)
    if test is None:
        raise Fault(f"unsupported jump operation {code:#x}")
    return test(a, b, sa, sb)
