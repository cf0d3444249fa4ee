"""What the machine's parts agree on: a fault inside a run, the ALU's arithmetic and which
context bytes a program may write.  The interpreter (the specification), the verifier (which
folds constants with the same arithmetic), the JIT and the helpers import this module; it
imports only the instruction set.
"""
from __future__ import annotations

from . import isa as I

M64, M32 = I.MASK64, I.MASK32


class Fault(Exception):
    """A run went wrong (an access out of bounds, a bad helper, a budget spent); the backend
    turns it into a `program.VMFault` naming the program and pc."""


def s64(v: int) -> int:
    return v - (1 << 64) if v & (1 << 63) else v


def s32(v: int) -> int:
    v &= M32
    return v - (1 << 32) if v & (1 << 31) else v


def ctx_write_mask(hook, size: int) -> bytes:
    """Per byte of the context: 1 where a program may write (decisions and padding)."""
    mask = bytearray(b"\x01" * size)
    if hook is not None:
        for off, f in hook.layout.values():
            if not f.decision:
                mask[off:off + f.size] = b"\x00" * f.size
    return bytes(mask)


def alu(ins, cls, regs) -> int:
    """The result of ALU instruction ``ins`` of class ``cls`` (ALU or ALU64) on ``regs``, masked
    to its width: what the interpreter computes and what the verifier folds constants with."""
    op = ins.opcode & 0xF0
    is64 = cls == I.ALU64
    mask = M64 if is64 else M32
    bits = 64 if is64 else 32
    d = regs[ins.dst] & mask
    s = (regs[ins.src] if ins.opcode & I.X else ins.imm & M64) & mask
    if op == I.ADD:
        r = d + s
    elif op == I.SUB:
        r = d - s
    elif op == I.MUL:
        r = d * s
    elif op == I.DIV:
        if ins.off == 1:
            sd, ss = (s64(d), s64(s)) if is64 else (s32(d), s32(s))
            r = 0 if ss == 0 else abs(sd) // abs(ss) * (1 if (sd < 0) == (ss < 0) else -1)
        else:
            r = d // s if s else 0
    elif op == I.MOD:
        if ins.off == 1:
            sd, ss = (s64(d), s64(s)) if is64 else (s32(d), s32(s))
            r = sd if ss == 0 else (abs(sd) % abs(ss)) * (1 if sd >= 0 else -1)
        else:
            r = d % s if s else d
    elif op == I.OR:
        r = d | s
    elif op == I.AND:
        r = d & s
    elif op == I.XOR:
        r = d ^ s
    elif op == I.LSH:
        r = d << (s & (bits - 1))
    elif op == I.RSH:
        r = d >> (s & (bits - 1))
    elif op == I.ARSH:
        sd = s64(d) if is64 else s32(d)
        r = sd >> (s & (bits - 1))
    elif op == I.NEG:
        r = -d
    elif op == I.MOV:
        if ins.off and ins.opcode & I.X:
            v = regs[ins.src] & ((1 << ins.off) - 1)
            r = v - (1 << ins.off) if v >> (ins.off - 1) else v
        else:
            r = s
    elif op == I.END:
        width = ins.imm
        if width not in (16, 32, 64):
            raise Fault(f"byte swap of width {width}")
        v = regs[ins.dst] & ((1 << width) - 1)
        if cls == I.ALU64 or ins.opcode & I.X:  # bswap / to big endian: swap
            v = int.from_bytes(v.to_bytes(width // 8, "little"), "big")
        return v
    else:
        raise Fault(f"unsupported ALU operation {op:#x}")
    return r & mask
