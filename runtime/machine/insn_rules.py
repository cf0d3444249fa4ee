"""Which encodings are instructions: the valid opcodes, and the fields each leaves reserved.

The structural pass of the verifier rejects anything else, as the kernel does, so that the
verifier and every backend read an instruction the same way.
"""
from __future__ import annotations

from . import isa as I

VALID_OPCODES = set()
for _c in (I.ALU, I.ALU64):
    for _op in (I.ADD, I.SUB, I.MUL, I.DIV, I.OR, I.AND, I.LSH, I.RSH, I.MOD, I.XOR, I.MOV, I.ARSH):
        VALID_OPCODES |= {_c | _op | I.K, _c | _op | I.X}
    VALID_OPCODES |= {_c | I.NEG, _c | I.END | I.K}
VALID_OPCODES.add(I.ALU | I.END | I.X)
for _c in (I.JMP, I.JMP32):
    for _op in (I.JEQ, I.JGT, I.JGE, I.JSET, I.JNE, I.JSGT, I.JSGE, I.JLT, I.JLE, I.JSLT, I.JSLE):
        VALID_OPCODES |= {_c | _op | I.K, _c | _op | I.X}
VALID_OPCODES |= {I.JMP | I.JA, I.JMP32 | I.JA, I.JMP | I.CALL, I.JMP | I.CALL | I.X, I.JMP | I.EXIT}
for _s in (I.B, I.H, I.W, I.DW):
    VALID_OPCODES |= {I.LDX | I.MEM | _s, I.ST | I.MEM | _s, I.STX | I.MEM | _s}
for _s in (I.B, I.H, I.W):
    VALID_OPCODES.add(I.LDX | I.MEMSX | _s)
VALID_OPCODES |= {I.STX | I.ATOMIC | I.W, I.STX | I.ATOMIC | I.DW, I.LD | I.IMM | I.DW}
ATOMIC_IMMS = {I.ADD, I.OR, I.AND, I.XOR, I.ADD | I.FETCH, I.OR | I.FETCH, I.AND | I.FETCH,
               I.XOR | I.FETCH, I.XCHG, I.CMPXCHG}


def reserved_fields(ins) -> str | None:
    """Why ``ins`` sets a field its opcode does not use (None if it sets none).

    The kernel rejects such instructions ("uses reserved fields"); so must we, or the verifier
    and a backend could read one instruction two ways (a ``mov`` with an ``off`` is a constant
    to the one and a sign extension to the other)."""
    c, op, x = ins.cls, ins.op, ins.opcode & I.X
    if ins.is_lddw:
        return "off must be 0" if ins.off else None
    if c in (I.ALU, I.ALU64):
        if op == I.NEG:
            return "src, off and imm must be 0" if (x or ins.src or ins.off or ins.imm) else None
        if op == I.END:
            return "src and off must be 0" if (ins.src or ins.off) else None
        if op == I.MOV:
            if x:
                widths = (0, 8, 16, 32) if c == I.ALU64 else (0, 8, 16)
                if ins.imm:
                    return "imm must be 0"
                return None if ins.off in widths else f"off {ins.off} is no sign-extension width"
            return "src and off must be 0" if (ins.src or ins.off) else None
        if ins.off not in ((0, 1) if op in (I.DIV, I.MOD) else (0,)):
            return f"off must be 0{' or 1 (signed)' if op in (I.DIV, I.MOD) else ''}"
        return ("imm must be 0" if ins.imm else None) if x else ("src must be 0" if ins.src else None)
    if c == I.LDX:
        return "imm must be 0" if ins.imm else None
    if c == I.ST:
        return "src must be 0" if ins.src else None
    if c == I.STX:
        return "imm must be 0" if ins.mode == I.MEM and ins.imm else None
    if c in (I.JMP, I.JMP32):
        if op == I.CALL:
            if x:       # callx: the helper id in dst
                return "src, off and imm must be 0" if (ins.src or ins.off or ins.imm) else None
            return "dst and off must be 0" if (ins.dst or ins.off) else None
        if op == I.EXIT:
            return "dst, src, off and imm must be 0" if (ins.dst or ins.src or ins.off or ins.imm or x) else None
        if op == I.JA:
            extra = ins.off if c == I.JMP32 else ins.imm
            return f"dst, src and {'off' if c == I.JMP32 else 'imm'} must be 0" if (ins.dst or ins.src or extra or x) else None
        return ("imm must be 0" if ins.imm else None) if x else ("src must be 0" if ins.src else None)
    return None
