"""Assembler for the textual eBPF syntax of uBPF and the bpf_conformance suite.

    mov32 %r0, 0            ldxb %r0, [%r1+0x2]      stxdw [%r10-8], %r0
    jeq %r1, 5, +1          jne %r0, 15, failed      call local fn
    lock fetch add [%r10-8], %r1                     lddw %r0, 0x123456789abcdef0
    be16 %r0                # comments; labels end with ':'
    lddw %r1, map 0         # the program's first map (a map reference)

Errors raise `AsmError` naming the line.
"""
from __future__ import annotations

import re

from . import isa as I
from .errors import InputError
from .isa import Insn

ALU_OPS = {"add": I.ADD, "sub": I.SUB, "mul": I.MUL, "div": I.DIV, "or": I.OR, "and": I.AND,
           "lsh": I.LSH, "rsh": I.RSH, "neg": I.NEG, "mod": I.MOD, "xor": I.XOR, "mov": I.MOV,
           "arsh": I.ARSH, "sdiv": I.DIV, "smod": I.MOD}
JMP_OPS = {"jeq": I.JEQ, "jgt": I.JGT, "jge": I.JGE, "jset": I.JSET, "jne": I.JNE, "jsgt": I.JSGT,
           "jsge": I.JSGE, "jlt": I.JLT, "jle": I.JLE, "jslt": I.JSLT, "jsle": I.JSLE}
SIZES = {"b": I.B, "h": I.H, "w": I.W, "dw": I.DW}
MOVSX = {"movsx864": (8, I.ALU64), "movsx832": (8, I.ALU), "movsx1664": (16, I.ALU64),
         "movsx1632": (16, I.ALU), "movsx3264": (32, I.ALU64)}


class AsmError(InputError):
    def __init__(self, line: int, msg: str):
        self.line = line
        super().__init__(f"line {line}: {msg}")


_MEM = re.compile(r"^\[\s*%r(\d+)\s*(?:([+-])\s*(0x[0-9a-fA-F]+|\d+))?\s*\]$")


def _reg(tok: str, line: int) -> int:
    m = re.fullmatch(r"%r(\d+)", tok.strip())
    if not m or int(m[1]) > 10:
        raise AsmError(line, f"expected a register %r0..%r10, got '{tok}'")
    return int(m[1])


def _int(tok: str, line: int) -> int:
    tok = tok.strip()
    try:
        return int(tok, 0)
    except ValueError:
        raise AsmError(line, f"expected a number, got '{tok}'") from None


def _mem(tok: str, line: int) -> tuple[int, int]:
    m = _MEM.match(tok.strip())
    if not m:
        raise AsmError(line, f"expected a memory operand like [%r1+8], got '{tok}'")
    off = int(m[3], 0) if m[3] else 0
    return int(m[1]), -off if m[2] == "-" else off


def _split_operands(rest: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def assemble(text: str) -> list[Insn]:
    """Assemble a program; labels may be used as jump and local-call targets."""
    lines = []
    labels: dict[str, int] = {}
    slot = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split("//", 1)[0].strip()
        if not line:
            continue
        if line.endswith(":") and re.fullmatch(r"[A-Za-z_.][\w.]*:", line):
            labels[line[:-1]] = slot
            continue
        lines.append((n, line, slot))
        slot += 2 if line.split()[0] == "lddw" else 1
    out = []
    for n, line, at in lines:
        out.append(_one(n, line, at, labels))
    return out


def _target(tok: str, at: int, labels, n) -> int:
    tok = tok.strip()
    if tok in labels:
        return labels[tok] - at - 1
    if re.fullmatch(r"[+-]?(0x[0-9a-fA-F]+|\d+)", tok):
        return int(tok, 0)
    raise AsmError(n, f"unknown label '{tok}'")


def _one(n: int, line: str, at: int, labels) -> Insn:
    parts = line.split(None, 1)
    mnem, rest = parts[0].lower(), parts[1] if len(parts) > 1 else ""
    ops = _split_operands(rest)

    def want(k):
        if len(ops) != k:
            raise AsmError(n, f"'{mnem}' takes {k} operand{'s' * (k != 1)}, got {len(ops)}")

    if mnem == "exit":
        want(0)
        return Insn(I.JMP | I.EXIT)
    if mnem == "call":
        if rest.startswith("local"):
            return Insn(I.JMP | I.CALL, src=I.PSEUDO_CALL, imm=_target(rest[5:], at, labels, n))
        want(1)
        if ops[0].startswith("%"):    # callx: the helper's id in a register
            return Insn(I.JMP | I.CALL | I.X, dst=_reg(ops[0], n))
        return Insn(I.JMP | I.CALL, imm=_int(ops[0], n))
    if mnem in ("ja", "ja32", "gotol"):
        want(1)
        t = _target(ops[0], at, labels, n)
        return Insn(I.JMP32 | I.JA, imm=t) if mnem != "ja" else Insn(I.JMP | I.JA, off=t)
    if mnem == "lddw":
        want(2)
        ref = re.fullmatch(r"map\s+(\d+)", ops[1])
        if ref:     # the program's map by index (src 1), as libbpf's relocations leave it
            return Insn(I.LD | I.IMM | I.DW, dst=_reg(ops[0], n), src=I.PSEUDO_MAP_FD, imm=int(ref[1]))
        return Insn(I.LD | I.IMM | I.DW, dst=_reg(ops[0], n), imm=_int(ops[1], n) & I.MASK64)
    if mnem in MOVSX:
        want(2)
        bits, cls = MOVSX[mnem]
        return Insn(cls | I.MOV | I.X, dst=_reg(ops[0], n), src=_reg(ops[1], n), off=bits)
    m = re.fullmatch(r"(le|be|bswap)(16|32|64)", mnem)
    if m:
        want(1)
        cls, src = (I.ALU64, I.K) if m[1] == "bswap" else (I.ALU, I.X if m[1] == "be" else I.K)
        return Insn(cls | I.END | src, dst=_reg(ops[0], n), imm=int(m[2]))
    m = re.fullmatch(r"([a-z]+?)(32|64)?", mnem)
    if m and m[1] in ALU_OPS:
        cls = I.ALU if m[2] == "32" else I.ALU64
        op = ALU_OPS[m[1]]
        off = 1 if m[1] in ("sdiv", "smod") else 0
        if op == I.NEG:
            want(1)
            return Insn(cls | I.NEG, dst=_reg(ops[0], n))
        want(2)
        dst = _reg(ops[0], n)
        if ops[1].startswith("%"):
            return Insn(cls | op | I.X, dst=dst, src=_reg(ops[1], n), off=off)
        return Insn(cls | op | I.K, dst=dst, imm=_int(ops[1], n), off=off)
    m = re.fullmatch(r"(j[a-z]+?)(32)?", mnem)
    if m and m[1] in JMP_OPS:
        want(3)
        cls = I.JMP32 if m[2] else I.JMP
        dst, t = _reg(ops[0], n), _target(ops[2], at, labels, n)
        if ops[1].startswith("%"):
            return Insn(cls | JMP_OPS[m[1]] | I.X, dst=dst, src=_reg(ops[1], n), off=t)
        return Insn(cls | JMP_OPS[m[1]] | I.K, dst=dst, imm=_int(ops[1], n), off=t)
    m = re.fullmatch(r"ldx(s?)(b|h|w|dw)", mnem)
    if m:
        want(2)
        base, off = _mem(ops[1], n)
        mode = I.MEMSX if m[1] else I.MEM
        return Insn(I.LDX | mode | SIZES[m[2]], dst=_reg(ops[0], n), src=base, off=off)
    m = re.fullmatch(r"(stx?)(b|h|w|dw)", mnem)
    if m:
        want(2)
        base, off = _mem(ops[0], n)
        if m[1] == "stx":
            return Insn(I.STX | I.MEM | SIZES[m[2]], dst=base, src=_reg(ops[1], n), off=off)
        return Insn(I.ST | I.MEM | SIZES[m[2]], dst=base, off=off, imm=_int(ops[1], n))
    if mnem == "lock":
        return _atomic(n, rest)
    raise AsmError(n, f"unknown instruction '{mnem}'")


def _atomic(n: int, rest: str) -> Insn:
    fetch = rest.startswith("fetch ")
    if fetch:
        rest = rest[len("fetch "):].lstrip()
    op_tok, _, operands = rest.partition(" ")
    m = re.fullmatch(r"(add|or|and|xor|xchg|cmpxchg)(32)?", op_tok)
    if not m:
        raise AsmError(n, f"unknown atomic operation '{op_tok}'")
    ops = _split_operands(operands)
    if len(ops) != 2:
        raise AsmError(n, "atomic operations take [%rN+off], %rM")
    base, off = _mem(ops[0], n)
    size = I.W if m[2] else I.DW
    if m[1] == "xchg":
        imm = I.XCHG
    elif m[1] == "cmpxchg":
        imm = I.CMPXCHG
    else:
        imm = {"add": I.ADD, "or": I.OR, "and": I.AND, "xor": I.XOR}[m[1]] | (I.FETCH if fetch else 0)
    return Insn(I.STX | I.ATOMIC | size, dst=base, src=_reg(ops[1], n), off=off, imm=imm)
