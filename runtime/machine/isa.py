"""The eBPF instruction set (RFC 9669): encoding, decoding and disassembly.

An `Insn` is one 8-byte slot; ``lddw`` occupies two slots and is decoded as one
`Insn` whose ``imm`` holds the full 64-bit value (``next_imm`` the raw second
word).  Disassembly reads like ``llvm-objdump -d`` for BPF.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import InputError

# classes
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
# alu operations (high nibble)
ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR, MOV, ARSH, END = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0)
# jump operations
JA, JEQ, JGT, JGE, JSET, JNE, JSGT, JSGE, CALL, EXIT, JLT, JLE, JSLT, JSLE = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0)
K, X = 0x00, 0x08
# sizes and modes
W, H, B, DW = 0x00, 0x08, 0x10, 0x18
IMM, ABS, IND, MEM, MEMSX, ATOMIC = 0x00, 0x20, 0x40, 0x60, 0x80, 0xC0
SIZE_BYTES = {W: 4, H: 2, B: 1, DW: 8}
SIZE_NAME = {W: "w", H: "h", B: "b", DW: "dw"}
# atomic operations (imm)
FETCH, XCHG, CMPXCHG = 0x01, 0xE1, 0xF1
ATOMIC_OPS = {ADD: "add", OR: "or", AND: "and", XOR: "xor"}
# pseudo sources of lddw and call
PSEUDO_MAP_FD, PSEUDO_MAP_VALUE = 1, 2
PSEUDO_CALL = 1

ALU_NAMES = {ADD: "add", SUB: "sub", MUL: "mul", DIV: "div", OR: "or", AND: "and", LSH: "lsh",
             RSH: "rsh", NEG: "neg", MOD: "mod", XOR: "xor", MOV: "mov", ARSH: "arsh"}
ALU_SYMBOLS = {ADD: "+=", SUB: "-=", MUL: "*=", DIV: "/=", OR: "|=", AND: "&=", LSH: "<<=",
               RSH: ">>=", MOD: "%=", XOR: "^=", MOV: "=", ARSH: "s>>="}
JMP_NAMES = {JA: "ja", JEQ: "jeq", JGT: "jgt", JGE: "jge", JSET: "jset", JNE: "jne", JSGT: "jsgt",
             JSGE: "jsge", JLT: "jlt", JLE: "jle", JSLT: "jslt", JSLE: "jsle"}
JMP_SYMBOLS = {JEQ: "==", JGT: ">", JGE: ">=", JSET: "&", JNE: "!=", JSGT: "s>", JSGE: "s>=",
               JLT: "<", JLE: "<=", JSLT: "s<", JSLE: "s<="}

# the machine's limits: a frame's stack, how deep local calls nest
STACK_SIZE, MAX_FRAMES = 512, 8
# instructions one run may execute (the interpreter's and the JIT's run-time budget), and
# instructions the verifier may explore before it gives up on a program (the kernel's limit)
RUN_BUDGET = 1_000_000
VERIFY_BUDGET = 1_000_000
# what `lddw` src 1 leaves in a register at run time: a tag and the map's index
MAP_HANDLE = 0xFFFF_0000_0000_0000
MAX_MAP_BYTES = 64 * 2**20     # the largest map (keys and values) the machine creates
MAX_TOTAL_MAP_BYTES = 2**30    # all the maps of one policy or object together


def map_bytes(ringbuf: bool, key_size: int, value_size: int, max_entries: int) -> int:
    """What a map's keys and values (a ringbuf: its ring) take when created."""
    return max_entries if ringbuf else (key_size + value_size) * max_entries
MAX_USED_MAPS = 64             # the most maps one program may reference (the kernel's limit)

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1


class DecodeError(InputError):
    """A byte string that is not a valid eBPF program; names the slot."""


@dataclass(frozen=True)
class Insn:
    opcode: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0
    next_imm: int = 0   # second word of lddw

    @property
    def cls(self) -> int:
        return self.opcode & 0x07

    @property
    def op(self) -> int:
        return self.opcode & 0xF0

    @property
    def source(self) -> int:
        return self.opcode & 0x08

    @property
    def size(self) -> int:
        return self.opcode & 0x18

    @property
    def mode(self) -> int:
        return self.opcode & 0xE0

    @property
    def jump_offset(self) -> int:
        """A jump's target, relative to the next instruction (gotol keeps it in imm)."""
        return self.imm if self.opcode == (JMP32 | JA) else self.off

    @property
    def is_lddw(self) -> bool:
        return self.opcode == (LD | IMM | DW)

    @property
    def slots(self) -> int:
        return 2 if self.is_lddw else 1

    def encode(self) -> bytes:
        regs = (self.src << 4) | self.dst
        if self.is_lddw:
            lo = self.imm & MASK32
            hi = (self.imm >> 32) & MASK32 if self.src == 0 else self.next_imm & MASK32
            return struct.pack("<BBhI", self.opcode, regs, self.off, lo) + struct.pack("<BBhI", 0, 0, 0, hi)
        return struct.pack("<BBhi", self.opcode, regs, self.off, _s32(self.imm))


def _s32(v: int) -> int:
    v &= MASK32
    return v - (1 << 32) if v & 0x80000000 else v


def decode(code: bytes) -> list[Insn]:
    """Decode a program into instructions; one entry per instruction (lddw is one)."""
    if len(code) % 8:
        raise DecodeError(f"program length {len(code)} is not a multiple of 8")
    out, i, n = [], 0, len(code) // 8
    while i < n:
        opcode, regs, off, imm = struct.unpack_from("<BBhi", code, i * 8)
        if opcode == (LD | IMM | DW):
            if i + 1 >= n:
                raise DecodeError(f"lddw at slot {i} is missing its second half")
            op2, regs2, off2, imm2 = struct.unpack_from("<BBhI", code, (i + 1) * 8)
            if op2 or regs2 or off2:
                raise DecodeError(f"lddw at slot {i} has a bad second half (its opcode, registers and "
                                  "offset must be 0)")
            src = regs >> 4
            full = (imm & MASK32) | (imm2 << 32) if src == 0 else imm & MASK32
            out.append(Insn(opcode, regs & 0xF, src, off, full, imm2 if src else 0))
            i += 2
        else:
            out.append(Insn(opcode, regs & 0xF, regs >> 4, off, imm))
            i += 1
    return out


def encode(insns: list[Insn]) -> bytes:
    return b"".join(i.encode() for i in insns)


def slot_index(insns: list[Insn]) -> tuple[list[int], dict[int, int]]:
    """(slot of each instruction, slot -> instruction index)."""
    slots, back, s = [], {}, 0
    for idx, ins in enumerate(insns):
        slots.append(s)
        back[s] = idx
        s += ins.slots
    return slots, back


def _reg(r: int, w32: bool = False) -> str:
    return f"w{r}" if w32 else f"r{r}"


def disasm_insn(ins: Insn, pc: int | None = None) -> str:
    """One instruction in llvm-objdump's BPF syntax, e.g. ``r1 += 8``, ``if r0 == 0x0 goto +3``."""
    c, op = ins.cls, ins.op
    if ins.is_lddw:
        suffix = {1: " ll", 2: " ll"}.get(ins.src, " ll")
        if ins.src == PSEUDO_MAP_VALUE:
            return f"r{ins.dst} = map_value[{ins.imm}]+{ins.next_imm}{suffix}"
        if ins.src == PSEUDO_MAP_FD:
            return f"r{ins.dst} = map[{ins.imm}]{suffix}"
        return f"r{ins.dst} = {ins.imm:#x}{suffix}"
    if c in (ALU, ALU64):
        w32 = c == ALU
        d = _reg(ins.dst, w32)
        if op == NEG:
            return f"{d} = -{d}"
        if op == END:
            if c == ALU64:
                return f"{d.replace('w', 'r')} = bswap{ins.imm} {d.replace('w', 'r')}"
            kind = "be" if ins.source == X else "le"
            return f"r{ins.dst} = {kind}{ins.imm} r{ins.dst}"
        rhs = _reg(ins.src, w32) if ins.source == X else f"{ins.imm}" if op == MOV or ins.imm < 0 else f"{ins.imm:#x}"
        if op == MOV and ins.off in (8, 16, 32) and ins.source == X:
            return f"{d} = (s{ins.off}){_reg(ins.src, w32)}"
        sym = ALU_SYMBOLS.get(op, "?=")
        if op in (DIV, MOD) and ins.off == 1:
            sym = "s" + sym
        return f"{d} {sym} {rhs}"
    if c in (JMP, JMP32):
        if op == EXIT:
            return "exit"
        if op == CALL:
            if ins.source == X:
                return f"callx {_reg(ins.dst)}"
            return f"call {ins.imm:+d}" if ins.src == PSEUDO_CALL else f"call {ins.imm}"
        target = ins.jump_offset
        where = f"goto {target:+d}" if pc is None else f"goto {pc + 1 + target}"
        if op == JA:
            return ("gotol " if c == JMP32 else "goto ") + f"{target:+d}"
        w32 = c == JMP32
        rhs = _reg(ins.src, w32) if ins.source == X else f"{ins.imm:#x}" if ins.imm >= 0 else f"{ins.imm}"
        return f"if {_reg(ins.dst, w32)} {JMP_SYMBOLS.get(op, '?')} {rhs} {where}"
    size = {W: "u32", H: "u16", B: "u8", DW: "u64"}[ins.size]
    addr = lambda r: f"(r{r} {'+' if ins.off >= 0 else '-'} {abs(ins.off):#x})"  # noqa: E731
    if c == LDX:
        sx = "s" if ins.mode == MEMSX else "u"
        return f"r{ins.dst} = *({sx}{size[1:]} *){addr(ins.src)}"
    if c == ST:
        return f"*({size} *){addr(ins.dst)} = {ins.imm:#x}"
    if c == STX and ins.mode == ATOMIC:
        w = "w" if ins.size == W else "r"
        base = ins.imm & ~FETCH
        if ins.imm == XCHG:
            return f"{w}{ins.src} = xchg_{size[1:]}({addr(ins.dst)}, {w}{ins.src})"
        if ins.imm == CMPXCHG:
            return f"{w}0 = cmpxchg_{size[1:]}({addr(ins.dst)}, {w}0, {w}{ins.src})"
        name = ATOMIC_OPS.get(base, "?")
        if ins.imm & FETCH:
            return f"{w}{ins.src} = atomic_fetch_{name}(({size} *){addr(ins.dst)}, {w}{ins.src})"
        return f"lock *({size} *){addr(ins.dst)} {ALU_SYMBOLS.get(base, '?')} {w}{ins.src}"
    if c == STX:
        return f"*({size} *){addr(ins.dst)} = r{ins.src}" if ins.size == DW else \
            f"*({size} *){addr(ins.dst)} = w{ins.src}"
    return f"<unknown opcode {ins.opcode:#04x}>"


def disasm(insns: list[Insn], symbols: dict[int, str] | None = None) -> str:
    """A listing with slot numbers and raw bytes, like ``llvm-objdump -d``."""
    out = []
    slots, _ = slot_index(insns)
    for idx, ins in enumerate(insns):
        if symbols and slots[idx] in symbols:
            out.append(f"\n{symbols[slots[idx]]}:")
        raw = ins.encode()
        out.append(f"{slots[idx]:>6}:\t{' '.join(f'{b:02x}' for b in raw[:8])}\t{disasm_insn(ins)}")
        if ins.is_lddw:
            out.append(f"{slots[idx] + 1:>6}:\t{' '.join(f'{b:02x}' for b in raw[8:])}")
    return "\n".join(out).lstrip("\n")


def to_slots(insns: list[Insn]) -> list[Insn | None]:
    """One entry per 8-byte slot: jump offsets count slots; lddw's second slot is None."""
    out: list[Insn | None] = []
    for ins in insns:
        out.append(ins)
        if ins.is_lddw:
            out.append(None)
    return out
