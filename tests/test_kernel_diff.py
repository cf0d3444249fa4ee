"""Differential tests against the Linux kernel: hypothesis generates straight-line and
branching programs; the kernel (BPF_PROG_TYPE_SYSCALL under BPF_PROG_TEST_RUN) and the
reference interpreter must leave the same r0 and the same memory."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric_ext.runtime import isa as I
from fabric_ext.runtime import kernel
from fabric_ext.runtime.interp import Interpreter
from fabric_ext.runtime.program import Program
from fabric_ext.runtime.verifier import verify

OK, WHY = kernel.permitted()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)
CTX = 64  # bytes of memory the program gets as its context; r0 is stored at offset 56

regs = st.integers(0, 5)
imm = st.integers(-(2**31), 2**31 - 1)
ALU = [I.ADD, I.SUB, I.MUL, I.DIV, I.OR, I.AND, I.LSH, I.RSH, I.MOD, I.XOR, I.MOV, I.ARSH]


@st.composite
def alu(draw):
    cls = draw(st.sampled_from([I.ALU, I.ALU64]))
    op = draw(st.sampled_from(ALU + [I.NEG]))
    dst = draw(regs)
    if op == I.NEG:
        return [I.Insn(cls | I.NEG, dst=dst)]
    if draw(st.booleans()):
        off = 1 if op in (I.DIV, I.MOD) and draw(st.booleans()) else 0
        if op == I.MOV and draw(st.booleans()):
            off = draw(st.sampled_from([8, 16] + ([32] if cls == I.ALU64 else [])))
        return [I.Insn(cls | op | I.X, dst=dst, src=draw(regs), off=off)]
    k = draw(imm)
    if op in (I.LSH, I.RSH, I.ARSH):
        k = draw(st.integers(0, 31 if cls == I.ALU else 63))
    if op in (I.DIV, I.MOD) and k == 0:
        k = 3
    off = 1 if op in (I.DIV, I.MOD) and draw(st.booleans()) else 0
    return [I.Insn(cls | op | I.K, dst=dst, imm=k, off=off)]


@st.composite
def mem(draw):
    size = draw(st.sampled_from([I.B, I.H, I.W, I.DW]))
    n = I.SIZE_BYTES[size]
    off = draw(st.integers(0, (56 - n) // n)) * n
    kind = draw(st.sampled_from(["ld", "ldsx", "st", "stx", "atomic", "stack"]))
    if kind == "ld":
        return [I.Insn(I.LDX | I.MEM | size, dst=draw(regs), src=9, off=off)]
    if kind == "ldsx" and size != I.DW:
        return [I.Insn(I.LDX | I.MEMSX | size, dst=draw(regs), src=9, off=off)]
    if kind == "st":
        return [I.Insn(I.ST | I.MEM | size, dst=9, off=off, imm=draw(imm))]
    if kind == "atomic" and n >= 4:  # atomics act on the stack (the kernel refuses them on ctx)
        op = draw(st.sampled_from([I.ADD, I.OR, I.AND, I.XOR, I.ADD | I.FETCH, I.XOR | I.FETCH, I.XCHG]))
        slot = -8 * draw(st.integers(1, 4))
        return [I.Insn(I.STX | I.MEM | I.DW, dst=10, src=draw(regs), off=slot),
                I.Insn(I.STX | I.ATOMIC | size, dst=10, src=draw(st.integers(1, 5)), off=slot, imm=op),
                I.Insn(I.LDX | I.MEM | I.DW, dst=draw(regs), src=10, off=slot)]
    if kind == "stack":
        slot = -8 * draw(st.integers(1, 4))
        return [I.Insn(I.STX | I.MEM | I.DW, dst=10, src=draw(regs), off=slot),
                I.Insn(I.LDX | I.MEM | I.DW, dst=draw(regs), src=10, off=slot)]
    return [I.Insn(I.STX | I.MEM | size, dst=9, src=draw(regs), off=off)]


@st.composite
def programs(draw):
    body = []
    for r in range(6):   # every register starts initialised
        body.append(I.Insn(I.ALU64 | I.MOV | I.K, dst=r, imm=draw(imm)))
    for _ in range(draw(st.integers(1, 24))):
        item = draw(st.one_of(alu(), mem(), st.just("jump")))
        body.extend([item] if item == "jump" else item)
    out = [I.Insn(I.ALU64 | I.MOV | I.X, dst=9, src=1)]
    out += [I.Insn(I.ST | I.MEM | I.DW, dst=10, off=-8 * k, imm=draw(imm)) for k in range(1, 5)]
    for i, ins in enumerate(body):
        if ins == "jump":  # a forward conditional jump over the next 0-3 instructions
            cls = draw(st.sampled_from([I.JMP, I.JMP32]))
            op = draw(st.sampled_from([I.JEQ, I.JGT, I.JGE, I.JSET, I.JNE, I.JSGT, I.JSGE, I.JLT, I.JLE,
                                       I.JSLT, I.JSLE]))
            rest = [x for x in body[i + 1:] if x != "jump"]
            skip = min(draw(st.integers(0, 3)), len(rest))
            if draw(st.booleans()):
                out.append(I.Insn(cls | op | I.X, dst=draw(regs), src=draw(regs), off=skip))
            else:
                out.append(I.Insn(cls | op | I.K, dst=draw(regs), imm=draw(imm), off=skip))
        else:
            out.append(ins)
    # skips count instructions, not jumps; drop jumps so a skip never lands past the end
    out = _fix_jumps(out)
    out += [I.Insn(I.STX | I.MEM | I.DW, dst=9, src=0, off=56), I.Insn(I.JMP | I.EXIT)]
    return out


def _fix_jumps(insns):
    fixed = []
    for i, ins in enumerate(insns):
        if ins.cls in (I.JMP, I.JMP32) and ins.op not in (I.CALL, I.EXIT):
            ins = I.Insn(ins.opcode, ins.dst, ins.src, min(ins.off, len(insns) - i - 1), ins.imm)
        fixed.append(ins)
    return fixed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.binary(min_size=CTX, max_size=CTX))
def test_kernel_and_interpreter_agree(insns, data):
    prog = Program("diff", insns, ctx_size=CTX)
    verify(prog)
    ours = bytearray(data)
    r0 = Interpreter().run(prog, ctx=ours)
    theirs = bytearray(data)
    fd = kernel.load_program(insns, "diff")
    try:
        kr0, _ = kernel.test_run(fd, theirs)
    finally:
        os.close(fd)
    assert (kr0, bytes(theirs)) == (r0 & 0xFFFFFFFF, bytes(ours)), I.disasm(insns)
