"""Register liveness: which of r0-r9 each instruction, or one after it, may still read
before writing.

The verifier forgets dead registers where it compares states, as the kernel's does
(`clean_live_states`): paths that differ only in a value nothing reads again are one path
from there on.  A loop whose body leaves a different dead value behind on each of its
branches would otherwise be explored once per combination of branches.  Backward
dataflow over every function's instructions at once: `exit` reads r0 only (the caller's
registers are the caller frame's), a call reads its arguments r1-r5 and writes r0-r5.
A register taken for dead that a path does read reads as uninitialised there, which the
verifier refuses: a mistake here can reject a program, never prove an unsafe one.
"""
from __future__ import annotations

from . import isa as I

ARGS = 0b111110            # r1-r5
CLOBBERED = 0b111111       # r0-r5, written by a call


def _uses_defs(ins: I.Insn) -> tuple[int, int, list[int]]:
    """(registers read, registers written, successors as offsets: 1 falls through)."""
    c, op, d, s = ins.cls, ins.op, 1 << ins.dst, 1 << ins.src
    src = s if ins.opcode & I.X else 0
    if ins.is_lddw:
        return 0, d, [2]
    if c in (I.ALU, I.ALU64):
        if op == I.MOV:
            return src, d, [1]
        return d | src, d, [1]
    if c == I.LDX:
        return s, d, [1]
    if c == I.ST:
        return d, 0, [1]
    if c == I.STX:
        if ins.mode != I.ATOMIC:
            return d | s, 0, [1]
        if ins.imm == I.CMPXCHG:
            return d | s | 1, 1, [1]
        return d | s, (s if ins.imm & I.FETCH else 0), [1]
    if c == I.LD:                  # legacy packet loads: r6 the packet; they clobber r0-r5
        return (1 << 6) | (s if ins.mode == I.IND else 0), CLOBBERED, [1]
    if op == I.EXIT:
        return 1, 0, []
    if op == I.CALL:
        return ARGS | (d if ins.opcode & I.X else 0), CLOBBERED, [1]
    if op == I.JA:
        return 0, 0, [1 + ins.jump_offset]
    return d | src, 0, [1, 1 + ins.jump_offset]


def live_in(slots: list) -> list[int]:
    """Per instruction slot, the registers (a bit mask of r0-r9) live on entry; 0 for the
    second slot of an lddw."""
    n = len(slots)
    facts = [_uses_defs(ins) if ins is not None else (0, 0, []) for ins in slots]
    preds: list[list[int]] = [[] for _ in range(n)]
    for pc, (_, _, succ) in enumerate(facts):
        for off in succ:
            if 0 <= pc + off < n:
                preds[pc + off].append(pc)
    live = [0] * n
    work = [pc for pc in range(n) if slots[pc] is not None]
    queued = set(work)
    while work:
        pc = work.pop()
        queued.discard(pc)
        use, defs, succ = facts[pc]
        out = 0
        for off in succ:
            if 0 <= pc + off < n:
                out |= live[pc + off]
        new = (use | (out & ~defs)) & 0x3FF
        if new != live[pc]:
            live[pc] = new
            for p in preds[pc]:
                if p not in queued:
                    queued.add(p)
                    work.append(p)
    return live
