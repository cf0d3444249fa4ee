"""The soundness fuzzer: random programs that stress the verifier where it has been wrong.

Each program works on every kind of pointer (stack, context, memory given to a bare program,
array and hash map values, ringbuf records), moves them by scalars whose ranges hold 0, the
signed/unsigned boundaries and 2^63/2^64, calls helpers with good and bad arguments, calls
subprograms and runs bounded loops.  Most are rejected.  Each accepted one is run on the
reference interpreter with proof checking (`Interpreter(check_proofs=True)`) on inputs chosen
to hit the boundaries: a `ProofViolation` means the verifier proved an access that is not in
bounds, which is what lets the JIT touch host memory.  An accepted program that `flow.may_fault`
finds no way to fault must not fault on any of them either (the simulation runs such programs'
watching events late, on that word: `observers.mark_observers`).  Where bpf(2) is permitted,
accepted programs the kernel rejects (the suspicious ones) get many more inputs.

    python tests/fuzz/soundness.py --seed 1 --seconds 60 [--save tests/soundness_cases]

A failing case is saved as JSON (program bytes, maps, input) and replayed by the test suite.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fabric_ext.runtime.machine import isa as I
from fabric_ext.runtime.machine.asm import assemble
from fabric_ext.runtime.machine.elf import MapSpec
from fabric_ext.runtime.machine.flow import may_fault
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.maps import ARRAY, HASH, RINGBUF
from fabric_ext.runtime.machine.program import Program, ProofViolation, VMFault
from fabric_ext.runtime.machine.verifier import VerifierError, verify

MEM_SIZE = 64
BUDGET = 50_000         # instructions a run of a generated program may execute
WORK = ("%r6", "%r7", "%r8")      # callee-saved: they survive helper calls
BOUNDARY = [0, 1, 2, 7, 8, 255, 256, 0x7FFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32,
            (1 << 63) - 1, 1 << 63, (1 << 64) - 8, (1 << 64) - 1]
SMALL_IMMS = [0, 1, -1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 255, 256, 4096, -8, -256, 0x7FFFFFFF, -0x80000000]


@dataclass
class Case:
    """One generated program and what it runs with."""
    code: str                       # hex of the instructions
    maps: list[MapSpec]
    ctx: bool                       # r1 = a 64-byte context (else: bare, r1 = memory, r2 = its length)
    inputs: list[str] = field(default_factory=list)   # hex of each context or memory tried
    why: str = ""

    def program(self) -> Program:
        return Program("fuzz", I.decode(bytes.fromhex(self.code)), [m.create() for m in self.maps],
                       ctx_size=MEM_SIZE if self.ctx else 0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Case:
        d = json.loads(text)
        d["maps"] = [MapSpec(**m) for m in d["maps"]]
        return Case(**d)


class Generator:
    """Assembly text, gadget by gadget; labels are numbered so every program assembles."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def label(self) -> str:
        self.n += 1
        return f"L{self.n}"

    def case(self) -> Case:
        r = self.rng
        self.n = 0
        self.maps = [MapSpec("arr", ARRAY, 4, r.choice([8, 16, 64, 256]), r.choice([1, 4])),
                     MapSpec("hsh", HASH, 4, r.choice([8, 64]), 8),
                     MapSpec("rb", RINGBUF, 0, 0, 4096)]
        self.records: list[str] = []          # registers holding a reserved record
        self.subs: list[str] = []
        self.types = {w: "scalar" for w in WORK}
        lines = ["mov %r9, %r1"] + [f"stdw [%r10-{8 * i}], 0" for i in range(1, 9)]
        lines += [f"mov {w}, {r.choice(SMALL_IMMS)}" for w in WORK]
        for _ in range(r.randint(2, 9)):
            lines += self.gadget(depth=0)
        for rec in self.records:                # usually released, as a correct program does
            if r.random() < 0.9:
                lines += [f"mov %r1, {rec}", "mov %r2, 0", f"call {r.choice([132, 133])}"]
        lines += [f"mov %r0, {r.choice(WORK)}" if r.random() < 0.8 else "mov %r0, 0", "exit"]
        lines += self.subs
        code = I.encode(assemble("\n".join(lines))).hex()
        return Case(code, self.maps, ctx=r.random() < 0.5)

    def gadget(self, depth: int) -> list[str]:
        r = self.rng
        kinds = [self.load_scalar, self.alu, self.alu, self.bound, self.pointer, self.pointer,
                 self.arith, self.arith, self.access, self.access, self.helper, self.index, self.index]
        if depth < 2:
            kinds += [self.loop, self.call]
        return r.choice(kinds)(depth)

    def reg(self, want: str | None = None) -> str:
        """A working register; with ``want`` ('ptr' or 'scalar') mostly one believed to hold
        that (the belief is rough: a skipped branch or a call may have changed it)."""
        fit = [w for w in WORK if self.types[w] == want]
        if want and fit and self.rng.random() < 0.85:
            return self.rng.choice(fit)
        return self.rng.choice(WORK)

    def holds(self, reg: str, what: str) -> str:
        self.types[reg] = what
        return reg

    def imm(self) -> int:
        r = self.rng
        return r.choice(SMALL_IMMS) if r.random() < 0.7 else r.choice(BOUNDARY) - (1 << 64) * r.randint(0, 1)

    def load_scalar(self, depth):
        r = self.rng
        size = r.choice(["b", "h", "w", "dw"])
        off = r.randrange(0, MEM_SIZE - {"b": 1, "h": 2, "w": 4, "dw": 8}[size] + 1)
        if r.random() < 0.05:
            off = r.choice([-8, MEM_SIZE, MEM_SIZE - 2])
        d = self.holds(self.reg(), "scalar")
        return [f"ldx{size} {d}, [%r9{off:+d}]"]

    def alu(self, depth):
        r = self.rng
        op = r.choice(["add", "sub", "mul", "div", "mod", "and", "or", "xor", "lsh", "rsh", "arsh", "neg",
                       "mov", "sdiv", "smod"])
        width = r.choice(["", "32"])
        d = self.holds(self.reg("scalar"), "scalar")
        if op == "neg":
            return [f"neg{width} {d}"]
        if r.random() < 0.4:
            return [f"{op}{width} {d}, {self.reg()}"]
        v = self.imm()
        if op in ("lsh", "rsh", "arsh"):
            v = r.choice([0, 1, 3, 8, 31, 32, 63])
        if not -(1 << 31) <= v < 1 << 31:
            return [f"lddw %r5, {v & I.MASK64:#x}", f"{op}{width} {d}, %r5"]
        return [f"{op}{width} {d}, {v}"]

    def bound(self, depth):
        r = self.rng
        skip = self.label()
        op = r.choice(["jgt", "jge", "jlt", "jle", "jsgt", "jsge", "jslt", "jsle", "jeq", "jne", "jset"])
        width = r.choice(["", "", "32"])
        body = self.gadget(depth + 1) if depth < 2 else self.alu(depth)
        bound = self.imm() & 0xFFFFFFFF if width else r.choice(SMALL_IMMS)
        return [f"{op}{width} {self.reg('scalar')}, {bound}, {skip}", *body, f"{skip}:"]

    def pointer(self, depth):
        r = self.rng
        d = self.holds(self.reg("scalar"), "ptr")
        kind = r.choice(["stack", "ctx", "array", "hash", "record"])
        if kind == "stack":
            return [f"mov {d}, %r10", f"add {d}, {r.choice([-8, -16, -64, -512, -4, 0])}"]
        if kind == "ctx":
            return [f"mov {d}, %r9"]
        ok = self.label()
        if kind == "record":
            self.records.append(d)
            size = r.choice([8, 16, 64, 0, 4097])
            return ["lddw %r1, map 2", f"mov %r2, {size}", "mov %r3, 0", "call 131",
                    f"jne %r0, 0, {ok}", "mov %r0, 0", "exit", f"{ok}:", f"mov {d}, %r0"]
        index = 0 if kind == "array" else 1
        key = r.choice([0, 1, 3, 7])
        return [f"stw [%r10-4], {key}", "mov %r2, %r10", "add %r2, -4", f"lddw %r1, map {index}", "call 1",
                f"jne %r0, 0, {ok}", "mov %r0, 0", "exit", f"{ok}:", f"mov {d}, %r0"]

    def arith(self, depth):
        r = self.rng
        p, s = self.reg("ptr"), self.reg("scalar")
        form = r.random()
        if form < 0.4:
            return [f"add {p}, {s}"]
        if form < 0.6:
            return [f"sub {p}, {s}"]
        return [f"add {p}, {r.choice([-1, 1, 4, 8, -8, 64, 248, 252, 256, -512, 0x7FFFFFFF, -0x80000000])}"]

    def index(self, depth):
        """The classic pattern: a pointer moved by an index read from input, shaped by ALU
        (ranges with 0 and the 2^63 boundary), maybe bounded, then dereferenced."""
        r = self.rng
        ptrs = [w for w in WORK if self.types[w] == "ptr"]
        out = [] if ptrs and r.random() < 0.7 else self.pointer(depth)
        p = self.reg("ptr")
        s = self.rng.choice([w for w in WORK if w != p])
        out += self.load_scalar_into(s)
        for _ in range(r.randint(0, 2)):
            op = r.choice(["and", "div", "mod", "rsh", "or", "mul", "sub", "add", "lsh", "arsh", "sdiv"])
            operand = r.choice([str(r.choice(SMALL_IMMS + [1, 0xFF, 0x7FF])), r.choice(WORK)])
            out.append(f"{op}{r.choice(['', '', '32'])} {s}, {operand}")
        skip = self.label()
        bounded = r.random() < 0.5
        if bounded:
            out.append(f"{r.choice(['jgt', 'jge', 'jsgt', 'jsge', 'jgt32'])} {s}, {r.choice([0, 7, 255, 248, 0x7FFFFFFF])}, {skip}")
        out.append(f"{r.choice(['add', 'add', 'sub'])} {p}, {s}")
        out += self.access(depth, p)
        self.types[s] = "scalar"
        return out + ([f"{skip}:"] if bounded else [])

    def load_scalar_into(self, d):
        size = self.rng.choice(["b", "h", "w", "dw", "dw"])
        off = self.rng.randrange(0, MEM_SIZE - {"b": 1, "h": 2, "w": 4, "dw": 8}[size] + 1)
        return [f"ldx{size} {d}, [%r9+{off}]"]

    def access(self, depth, p=None):
        r = self.rng
        p = p or self.reg("ptr")
        size = r.choice(["b", "h", "w", "dw"])
        off = r.choice([0, 0, 0, 4, 8, -8, -4, 248, 252, 255, 60, 63])
        mem = f"[{p}{off:+d}]"
        form = r.random()
        if form < 0.4:
            return [f"ldx{size} {self.holds(self.reg('scalar'), 'scalar')}, {mem}"]
        if form < 0.7:
            return [f"stx{size} {mem}, {self.reg('scalar')}"]
        if form < 0.9:
            return [f"st{size} {mem}, {r.choice(SMALL_IMMS)}"]
        op = r.choice(["add", "xor", "fetch add", "xchg"]) + ("32" if size == "w" else "")
        return [f"lock {op} {mem}, {self.reg('scalar')}"]

    def helper(self, depth):
        r = self.rng
        form = r.random()
        if form < 0.4:      # update with a value from the stack or from a register's pointer
            value = r.choice(["%r10", self.reg("ptr")])
            adj = [f"add %r3, {r.choice([-64, -8, -256])}"] if value == "%r10" else []
            return ["stw [%r10-4], 1", "mov %r2, %r10", "add %r2, -4", f"mov %r3, {value}", *adj,
                    f"lddw %r1, map {r.randint(0, 1)}", "mov %r4, 0", "call 2"]
        if form < 0.7:      # ringbuf_output of a pointer and a size from a register
            return [f"mov %r2, {self.reg('ptr')}", f"mov %r3, {self.reg('scalar')}", "lddw %r1, map 2", "mov %r4, 0",
                    "call 130"]
        return [f"mov %r1, {self.reg('ptr')}", f"mov %r2, {r.choice([1, 8, 64, 65])}", "call 6"]

    def loop(self, depth):
        r = self.rng
        head = self.label()
        body = self.gadget(depth + 1)
        return ["mov %r5, 0", "stxdw [%r10-72], %r5", f"{head}:"] + body + [
            "ldxdw %r5, [%r10-72]", "add %r5, 1", "stxdw [%r10-72], %r5", f"jlt %r5, {r.randint(1, 4)}, {head}"]

    def call(self, depth):
        r = self.rng
        name = f"sub{len(self.subs)}_{self.label()}"
        arg, arg2 = self.reg("ptr"), self.reg("scalar")
        outer = self.types
        self.types = {"%r6": outer[arg], "%r7": outer[arg2], "%r8": "scalar"}
        body = [f"{name}:", "mov %r6, %r1", "mov %r7, %r2", "mov %r8, 0", "stdw [%r10-8], 0"]
        for _ in range(r.randint(1, 3)):
            body += self.gadget(depth + 1)
        ret = r.choice(["%r8", "%r6", "%r7"]) if r.random() < 0.3 else "%r8"
        body += [f"mov %r0, {ret}", "exit"]
        self.types = outer
        self.subs += body
        return [f"mov %r1, {arg}", f"mov %r2, {arg2}", f"call local {name}", f"mov {self.holds(self.reg(), 'scalar')}, %r0"]


def inputs(rng: random.Random, n: int) -> list[bytes]:
    """Contexts or memory that put boundary values where the program loads scalars."""
    out = [bytes(MEM_SIZE), b"\xff" * MEM_SIZE]
    while len(out) < n:
        buf = bytearray()
        while len(buf) < MEM_SIZE:
            v = rng.choice(BOUNDARY + [rng.getrandbits(64)])
            buf += v.to_bytes(8, "little")
        out.append(bytes(buf[:MEM_SIZE]))
    return out


def fill_maps(prog: Program, rng: random.Random):
    for m in prog.maps:
        if m.type == ARRAY:
            m.values[:] = [rng.getrandbits(8) for _ in range(len(m.values))]
        elif m.type == HASH:
            for k in (0, 1, 3):
                m.update(k.to_bytes(4, "little"), rng.randbytes(m.value_size), 0)


def accepts(case: Case) -> Program | bool | str:
    """The verified program (its proof set) if the verifier accepts ``case``, False if it
    rejects it, or what went wrong when it did neither (a verifier that raises anything but
    VerifierError is broken too)."""
    prog = case.program()
    try:
        verify(prog, max_insns=20_000)
        return prog
    except VerifierError:
        return False
    except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
        return f"verifier crashed: {type(e).__name__}: {e}"


def faultless(case: Case, prog: Program) -> bool:
    """Whether `may_fault` finds no way for a run of ``prog`` (the verified program of
    ``case``) to fault: it is then held to that."""
    return bool(case.ctx) and may_fault(prog, BUDGET) is None


def check(case: Case, prog: Program, rng: random.Random, n_inputs: int, cannot_fault: bool | None = None) -> str | None:
    """Run ``prog``, the verified program of ``case``, under proof checking; the violation, if
    any, or a fault of a program that cannot fault (``cannot_fault``; None: `faultless` says)."""
    vm = Interpreter(budget=BUDGET, check_proofs=True)
    if cannot_fault is None:
        cannot_fault = faultless(case, prog)
    for data in [bytes.fromhex(h) for h in case.inputs] + inputs(rng, n_inputs):   # a saved case's own first
        fill_maps(prog, rng)
        buf = bytearray(data)
        try:
            if case.ctx:
                vm.run(prog, ctx=buf)
            else:
                vm.run(prog, mem=buf)
        except ProofViolation as e:
            case.inputs = [data.hex()]
            return str(e)
        except VMFault as e:
            if cannot_fault:
                case.inputs = [data.hex()]
                return f"may_fault found no way for it to fault, but it did: {e}"
    return None


def kernel_rejects(case: Case) -> bool:
    from fabric_ext.runtime.machine import kernel
    kb = kernel.KernelBackend()
    try:
        kb.load(case.program())
        return False
    except kernel.KernelError:
        return True
    finally:
        kb.close()


@dataclass
class Report:
    generated: int = 0
    accepted: int = 0
    faultless: int = 0          # accepted ones `may_fault` finds no way to fault
    kernel_rejected: int = 0
    failures: list[Case] = field(default_factory=list)


def fuzz(seed: int, seconds: float, max_programs: int | None = None, n_inputs: int = 6,
         use_kernel: bool | None = None) -> Report:
    """Generate and check programs for ``seconds`` (or ``max_programs``); deterministic per seed
    up to where time runs out."""
    from fabric_ext.runtime.machine import kernel
    if use_kernel is None:
        use_kernel = kernel.permitted()[0]
    rng = random.Random(seed)
    gen = Generator(rng)
    rep = Report()
    end = time.monotonic() + seconds
    while time.monotonic() < end and (max_programs is None or rep.generated < max_programs):
        case = gen.case()
        rep.generated += 1
        prog = accepts(case)
        if not isinstance(prog, Program):
            if prog:
                case.why = prog
                rep.failures.append(case)
            continue
        rep.accepted += 1
        cannot_fault = faultless(case, prog)
        rep.faultless += cannot_fault
        more = use_kernel and kernel_rejects(case)
        rep.kernel_rejected += more
        why = check(case, prog, rng, n_inputs * (8 if more else 1), cannot_fault)
        if why:
            case.why = why
            rep.failures.append(case)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--save", type=Path, help="folder to save failing cases in (as JSON)")
    args = ap.parse_args(argv)
    rep = fuzz(args.seed, args.seconds)
    print(f"seed {args.seed}: {rep.generated} programs, {rep.accepted} accepted, "
          f"{rep.kernel_rejected} of those rejected by the kernel, {rep.faultless} found unable to fault, "
          f"{len(rep.failures)} failures")
    for i, case in enumerate(rep.failures):
        print(f"  {case.why}")
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"seed{args.seed}_{i}.json").write_text(case.to_json())
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
