"""Assembler for the textual eBPF syntax of uBPF and the bpf_conformance suite.

    mov32 %r0, 0            ldxb %r0, [%r1+0x2]      stxdw [%r10-8], %r0
    jeq %r1, 5, +1          jne %r0, 15, failed      call local fn
    lock fetch add [%r10-8], %r1                     lddw %r0, 0x123456789abcdef0
    be16 %r0                # comments; labels end with ':'
    lddw %r1, map 0         # the program's first map (a map reference)

It also reads the syntax `fabric-vm disasm` (`isa.disasm`) and llvm-objdump print, line by
line, with or without a listing's slot numbers and bytes (`_one_llvm`):

    r2 = *(u32 *)(r1 + 0x8)     if w2 == 0x1 goto +13     lock *(u64 *)(r0 + 0x0) += r6

Errors raise `AsmError` naming the line.
"""
from __future__ import annotations

import re

from . import isa as I
from .errors import InputError
from .isa import Insn

#: a listing's slot number and bytes before the instruction (`isa.disasm`, llvm-objdump -d)
LISTING = re.compile(r"^\s*\d+:\s+(?:[0-9a-f]{2}\s)*[0-9a-f]{2}(?:\s+|$)")
#: `fabric-vm disasm`'s line before each program: ``name (section syscall):``
HEADER = re.compile(r"[A-Za-z_.][\w.]* \(section [^()]*\):")

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
        self.line, self.msg = line, msg
        super().__init__(f"line {line}: {msg}")


_MEM = re.compile(r"^\[\s*%r(\d+)\s*(?:([+-])\s*(0x[0-9a-fA-F]+|\d+))?\s*\]$")


def _reg(tok: str, line: int) -> int:
    m = re.fullmatch(r"%r(\d+)", tok.strip())
    if not m or int(m[1]) > 10:
        hint = f" (write '%{tok.strip()}')" if re.fullmatch(r"r(10|\d)", tok.strip()) else ""
        raise AsmError(line, f"expected a register %r0..%r10, got '{tok}'{hint}")
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
        line = LISTING.sub("", raw.split("#", 1)[0].split("//", 1)[0]).strip()
        if not line or HEADER.fullmatch(line):
            continue
        if line.endswith(":") and re.fullmatch(r"[A-Za-z_.][\w.]*:", line):
            labels[line[:-1]] = slot
            continue
        lines.append((n, line, slot))
        slot += 2 if line.split()[0] == "lddw" or line.endswith(" ll") else 1
    out = []
    for n, line, at in lines:
        out.append(_one_llvm(n, line, at, labels) if LLVM_LINE.match(line) else _one(n, line, at, labels))
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


# ---- the syntax of isa.disasm and llvm-objdump ------------------------------------------------
#: a line in that syntax: an assignment to a register, a store, a conditional or plain goto,
#: an atomic, or a call of a local function (``call +3``) or through a register
LLVM_LINE = re.compile(r"^(?:[rw]\d+\s+\S*=|\*\(|if\s|goto\b|gotol\b|lock\s+\*\(|callx\b|call\s+[+-])")
_R = r"([rw])(\d+)"
_NUM = r"(-?(?:0x[0-9a-fA-F]+|\d+))"
_ADDR = r"\(r(\d+)\s*([+-])\s*(0x[0-9a-fA-F]+|\d+)\)"
_WIDTH = {"8": I.B, "16": I.H, "32": I.W, "64": I.DW}
_ALU_BY_SYMBOL = {sym: op for op, sym in I.ALU_SYMBOLS.items()} | {"s/=": I.DIV, "s%=": I.MOD}
_JMP_BY_SYMBOL = {sym: op for op, sym in I.JMP_SYMBOLS.items()}
_ATOMIC_BY = {"+=": I.ADD, "|=": I.OR, "&=": I.AND, "^=": I.XOR, "add": I.ADD, "or": I.OR, "and": I.AND,
              "xor": I.XOR}
_LLVM = [(name, re.compile(rx)) for name, rx in (
    ("lddw_map", r"r(\d+) = map\[(\d+)\] ll"),
    ("lddw_value", r"r(\d+) = map_value\[(\d+)\]\+(\d+) ll"),
    ("lddw", rf"r(\d+) = {_NUM} ll"),
    ("neg", rf"{_R} = -{_R}"),
    ("bswap", r"r(\d+) = bswap(16|32|64) r(\d+)"),
    ("endian", r"r(\d+) = (be|le)(16|32|64) r(\d+)"),
    ("movsx", rf"{_R} = \(s(8|16|32)\){_R}"),
    ("ldx", rf"r(\d+) = \*\(([us])(8|16|32|64) \*\){_ADDR}"),
    ("st", rf"\*\(u(8|16|32|64) \*\){_ADDR} = {_NUM}"),
    ("stx", rf"\*\(u(8|16|32|64) \*\){_ADDR} = {_R}"),
    ("lock", rf"lock \*\(u(32|64) \*\){_ADDR} (\+=|\|=|&=|\^=) {_R}"),
    ("fetch", rf"{_R} = atomic_fetch_(add|or|and|xor)\(\(u(32|64) \*\){_ADDR}, {_R}\)"),
    ("xchg", rf"{_R} = xchg_(32|64)\({_ADDR}, {_R}\)"),
    ("cmpxchg", rf"{_R} = cmpxchg_(32|64)\({_ADDR}, {_R}, {_R}\)"),
    ("jcond", rf"if {_R} (\S+) (?:{_R}|{_NUM}) goto (\S+)"),
    ("goto", r"(goto|gotol) (\S+)"),
    ("callx", r"callx r(\d+)"),
    ("call_local", r"call ([+-]\d+)"),
    ("alu", rf"{_R} (\S+) (?:{_R}|{_NUM})"),
)]


def _one_llvm(n: int, line: str, at: int, labels) -> Insn:
    """One instruction in the syntax `isa.disasm_insn` prints (the inverse of it)."""
    for name, rx in _LLVM:
        m = rx.fullmatch(line)
        if m:
            return _BUILD[name](m.groups(), n, at, labels)
    raise AsmError(n, f"cannot read '{line}' as an instruction")


def _cls(w: str) -> int:
    return I.ALU if w == "w" else I.ALU64


def _off(sign: str, num: str) -> int:
    return -int(num, 0) if sign == "-" else int(num, 0)


def _alu(g, n, at, labels) -> Insn:
    w, dst, sym, _, src, imm = g
    if sym not in _ALU_BY_SYMBOL:
        raise AsmError(n, f"unknown operator '{sym}'")
    op, off = _ALU_BY_SYMBOL[sym], 1 if sym in ("s/=", "s%=") else 0
    if src is not None:
        return Insn(_cls(w) | op | I.X, dst=int(dst), src=int(src), off=off)
    return Insn(_cls(w) | op | I.K, dst=int(dst), imm=int(imm, 0), off=off)


def _jcond(g, n, at, labels) -> Insn:
    w, dst, sym, _, src, imm, target = g
    if sym not in _JMP_BY_SYMBOL:
        raise AsmError(n, f"unknown comparison '{sym}'")
    cls, off = I.JMP32 if w == "w" else I.JMP, _target(target, at, labels, n)
    if src is not None:
        return Insn(cls | _JMP_BY_SYMBOL[sym] | I.X, dst=int(dst), src=int(src), off=off)
    return Insn(cls | _JMP_BY_SYMBOL[sym] | I.K, dst=int(dst), imm=int(imm, 0), off=off)


def _goto(g, n, at, labels) -> Insn:
    t = _target(g[1], at, labels, n)
    return Insn(I.JMP32 | I.JA, imm=t) if g[0] == "gotol" else Insn(I.JMP | I.JA, off=t)


def _store(_width, base, sign, off) -> dict:
    """The base register and offset of a store's ``*(uN *)(rB +- off)`` (its width apart)."""
    return {"dst": int(base), "off": _off(sign, off)}


_BUILD = {
    "lddw_map": lambda g, *_: Insn(I.LD | I.IMM | I.DW, dst=int(g[0]), src=I.PSEUDO_MAP_FD, imm=int(g[1])),
    "lddw_value": lambda g, *_: Insn(I.LD | I.IMM | I.DW, dst=int(g[0]), src=I.PSEUDO_MAP_VALUE, imm=int(g[1]),
                                     next_imm=int(g[2])),
    "lddw": lambda g, *_: Insn(I.LD | I.IMM | I.DW, dst=int(g[0]), imm=int(g[1], 0) & I.MASK64),
    "neg": lambda g, *_: Insn(_cls(g[0]) | I.NEG, dst=int(g[1])),
    "bswap": lambda g, *_: Insn(I.ALU64 | I.END | I.K, dst=int(g[0]), imm=int(g[1])),
    "endian": lambda g, *_: Insn(I.ALU | I.END | (I.X if g[1] == "be" else I.K), dst=int(g[0]), imm=int(g[2])),
    "movsx": lambda g, *_: Insn(_cls(g[0]) | I.MOV | I.X, dst=int(g[1]), src=int(g[4]), off=int(g[2])),
    "ldx": lambda g, *_: Insn(I.LDX | (I.MEMSX if g[1] == "s" else I.MEM) | _WIDTH[g[2]], dst=int(g[0]),
                              src=int(g[3]), off=_off(g[4], g[5])),
    "st": lambda g, *_: Insn(I.ST | I.MEM | _WIDTH[g[0]], **_store(*g[:4]), imm=int(g[4], 0)),
    "stx": lambda g, *_: Insn(I.STX | I.MEM | _WIDTH[g[0]], **_store(*g[:4]), src=int(g[5])),
    "lock": lambda g, *_: Insn(I.STX | I.ATOMIC | _WIDTH[g[0]], **_store(*g[:4]), src=int(g[6]),
                               imm=_ATOMIC_BY[g[4]]),
    "fetch": lambda g, *_: Insn(I.STX | I.ATOMIC | _WIDTH[g[3]], **_store(*g[3:7]), src=int(g[8]),
                                imm=_ATOMIC_BY[g[2]] | I.FETCH),
    "xchg": lambda g, *_: Insn(I.STX | I.ATOMIC | _WIDTH[g[2]], **_store(*g[2:6]), src=int(g[7]), imm=I.XCHG),
    "cmpxchg": lambda g, *_: Insn(I.STX | I.ATOMIC | _WIDTH[g[2]], **_store(*g[2:6]), src=int(g[9]),
                                  imm=I.CMPXCHG),
    "jcond": _jcond,
    "goto": _goto,
    "callx": lambda g, *_: Insn(I.JMP | I.CALL | I.X, dst=int(g[0])),
    "call_local": lambda g, *_: Insn(I.JMP | I.CALL, src=I.PSEUDO_CALL, imm=int(g[0])),
    "alu": _alu,
}
