"""Lifting: verified eBPF bytecode to an LLVM IR module, one native function per subprogram
(written as text by `irtext`, which `llvm.parse_assembly` reads).

Registers are allocas that mem2reg promotes; basic blocks come from the jump
targets; every instruction keeps its exact semantics (32-bit results
zero-extend, shifts mask, x / 0 = 0, x % 0 = x, signed overflow defined).
Local calls become native functions with their own frame.  Memory safety is
the verifier's proof plus a run-time bounds check on every load and store it
did not prove (all of them for a program that was not verified): an address
must lie in the stack, the context (writes only to decision bytes), the given
memory, a map's value buffer or the reserved ringbuf record, so compiled code
can never touch anything else.  Array lookups and updates are address
arithmetic, hash and LRU lookups a native probe of the map's own buffers, their
updates and deletes calls of `native_lib`'s (its update leaves what it does not do
to Python); other helpers call back into Python.  An instruction budget holds as in the
interpreter: every block adds its instructions to the count, which is compared with the
budget where a backward jump lands (every cycle passes one) and at each exit, so a run over
the budget faults as the interpreter's does, at the next loop head or exit.

The code holds no address of the process that runs it: map buffers and the
helper callback are read from an address table the environment points to
(`address_table`), so the same object code serves any process with the same
program and map shapes, and can be cached on disk (`codecache`).
"""
from __future__ import annotations

import ctypes
import errno

import llvmlite.binding as llvm

from . import helpers as Hl
from . import irtext as L
from . import isa as I
from .flow import local_calls
from .maps import ARRAY, EMPTY, HASH, HASH_MULTIPLIER, LRU_HASH, PERCPU_ARRAY, PERCPU_HASH, RINGBUF, USED
from .program import Program
from .semantics import ctx_write_mask

I1, I8, I32, I64 = L.IntType(1), L.IntType(8), L.IntType(32), L.IntType(64)
PTR = L.PointerType()
STACK_SIZE, MAX_FRAMES, MAP_HANDLE = I.STACK_SIZE, I.MAX_FRAMES, I.MAP_HANDLE
FAULT_OOB, FAULT_BUDGET, FAULT_HELPER, FAULT_DEPTH, FAULT_SHORT = 1, 2, 3, 4, 5
FAULTS = {FAULT_OOB: "out-of-bounds access", FAULT_BUDGET: "instruction budget exhausted",
          FAULT_HELPER: "helper failed", FAULT_DEPTH: "call depth exceeds 8 frames",
          FAULT_SHORT: "given memory shorter than the proof assumes"}


class Env(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "budget", "executed", "fault", "fault_pc", "fault_addr", "stack", "ctx", "ctx_len", "mem", "mem_len",
        "rec", "rec_len", "addrs", "r0_sum")]     # r0_sum: what a batch's runs returned, summed


ENV_INDEX = {name: i for i, (name, _) in enumerate(Env._fields_)}
MAP_ADDRS = ("values", "state", "keys", "meta", "stamp")   # a map's buffers in the address table
#: the address table's first slots: the helper callback, `native_lib`'s hash update and delete
CALLBACK_SLOT, HASH_UPDATE_SLOT, HASH_DELETE_SLOT, FIRST_MAP_SLOT = 0, 1, 2, 3
#: what `native_lib`'s hash update answers where `maps.Map.update` must decide (it never returns 1)
ASK_PYTHON = 1


def error_return(code: int) -> int:
    """A helper's r0 for the error ``code`` (an errno name's number): -code, as 64 bits."""
    return (-code) & I.MASK64
#: the map types whose updates and deletes `native_lib` does
NATIVE_HASH = (HASH, LRU_HASH)
#: per map helper, the map types whose calls are native code (the rest call back into Python)
NATIVE_MAP_OPS = {Hl.MAP_LOOKUP_ELEM: (ARRAY, PERCPU_ARRAY, HASH, PERCPU_HASH, LRU_HASH),
                  Hl.MAP_UPDATE_ELEM: (ARRAY, PERCPU_ARRAY, *NATIVE_HASH),
                  Hl.MAP_DELETE_ELEM: NATIVE_HASH}


def map_slot(index: int, buffer: str) -> int:
    """Where map ``index``'s ``buffer`` (one of MAP_ADDRS) is in the address table."""
    return FIRST_MAP_SLOT + index * len(MAP_ADDRS) + MAP_ADDRS.index(buffer)


def address_table(prog: Program, callback_addr: int, hash_ops: tuple[int, int]) -> list[int]:
    """The addresses compiled code reads at run time: the helper callback, `native_lib`'s hash
    update and delete (0 where the program has no hash map), then each map's buffers in
    `MAP_ADDRS` order (0 where the map has none)."""
    table = [callback_addr, *hash_ops]
    for m in prog.maps:
        table += [0 if (buf := getattr(m, b)) is None else buf.ctypes.data for b in MAP_ADDRS]
    return table


def _const_bytes(m, name: str, data: bytes):
    """An internal constant byte array (one string literal in the IR, quick to build and print)."""
    ty = L.ArrayType(I8, len(data))
    g = L.GlobalVariable(m, ty, name)
    g.initializer = L.Constant(ty, bytearray(data))
    g.global_constant = True
    g.linkage = "internal"
    return g


def mem_need(prog: Program, proof: dict | None) -> int:
    """Bytes of given memory (r1's: the context, else the memory) that make every access the
    verifier proved to reach into it safe without a check: the native code is compiled for
    at least that much, and a backend runs a shorter one on code that checks those accesses
    (`Lifter`'s ``short_mem``).  0 where there is no such access, no proof, or a local call
    (a subprogram is compiled with every check)."""
    if proof is None or local_calls(prog.slots):
        return 0
    return max((n for pc, n in prog.mem_extent.items() if proof.get(pc) == {"mem"}), default=0)


def _env_arg(arg) -> None:
    """The env is always a whole `Env`, so LLVM may load its fields early.  It is not marked
    ``noalias``: the helper callback writes fields of it (a fault, a ringbuf record) through
    its own pointer, which ``noalias`` would make undefined; the fields fixed for a run are
    loaded once per function instead (`Lifter._function`)."""
    arg.attributes.dereferenceable = ctypes.sizeof(Env)


class Lifter:
    """Builds the LLVM module for one program."""

    def __init__(self, prog: Program, name: str, proof: dict | None, counted: bool, short_mem: bool = False):
        """``counted``: the code counts instructions against the budget.  A program without
        cycles or calls runs each instruction at most once, so within a budget at least as
        long as itself it can never exhaust it and needs no count.  ``short_mem``: the code
        is for runs given less memory than its proven accesses reach (`mem_need`), each
        access into it checked; otherwise it runs only with all of it."""
        self.p, self.name, self.proof = prog, name, proof
        self.counted, self.short_mem = counted, short_mem
        self.m = L.Module(name=name)
        self.m.triple = llvm.get_default_triple()
        self.slots = prog.slots
        self.mask = ctx_write_mask(prog.hook, prog.ctx_size) if prog.ctx_size else b""
        self.mask_g = None
        if self.mask:
            self.mask_g = _const_bytes(self.m, "ctx_mask", self.mask)
        self.map_regions = [(i, m.values.nbytes) for i, m in enumerate(prog.maps) if m.type != RINGBUF]
        self.invariant = self.m.add_metadata([])
        self.funcs = {}
        self.mem_unchecked = False      # the code runs only with all the given memory it may reach (`mem_need`)

    # -- structure --------------------------------------------------------------------------
    def entries(self) -> list[int]:
        return sorted({0} | {pc + 1 + ins.imm for pc, ins in local_calls(self.slots)})

    def build(self):
        entries = self.entries()
        for e in entries:
            args = [PTR] if e == 0 else [PTR, I64, I64, I64, I64, I64, I64]
            fn = L.Function(self.m, L.FunctionType(I64, args), name=f"{self.name}_f{e}")
            fn.linkage = "internal" if e else "external"
            _env_arg(fn.args[0])
            self.funcs[e] = fn
        for e in entries:
            self._function(e, entries)
        return self.m

    def _reachable(self, entry, entries):
        """Slots of the subprogram starting at ``entry`` (up to the next entry)."""
        nxt = min([x for x in entries if x > entry] + [len(self.slots)])
        return range(entry, nxt)

    def _function(self, entry, entries):
        fn = self.funcs[entry]
        env = fn.args[0]
        body = self._reachable(entry, entries)
        leaders, heads = {entry}, set()
        for pc in body:
            ins = self.slots[pc]
            if ins is None or ins.cls not in (I.JMP, I.JMP32):
                continue
            if ins.op in (I.EXIT, I.CALL):
                if ins.op == I.CALL:
                    leaders.add(pc + 1)
                continue
            leaders |= {pc + 1 + ins.jump_offset, pc + 1}
            if ins.jump_offset < 0:
                heads.add(pc + 1 + ins.jump_offset)       # a backward jump's target: where the budget is checked
        self.heads = heads
        leaders = sorted(x for x in leaders if x in body)
        b0 = fn.append_basic_block("entry")
        b = L.IRBuilder(b0)
        self.b, self.env, self.fn = b, env, fn
        self.regs = [b.alloca(I64, name=f"r{i}") for i in range(11)]
        for r in self.regs:
            b.store(I64(0), r)
        # the instruction count lives in a register; env holds it across calls and at exit
        self.count = b.alloca(I64, name="executed")
        b.store(self.env_get("executed"), self.count)
        self.budget = self.env_get("budget")
        # the regions fixed for a run, loaded once (a ringbuf record's, which a helper call
        # may change, is loaded at each access)
        self.fixed = {name: self.env_get(name) for name in ("stack", "ctx", "ctx_len", "mem", "mem_len")}
        need = 0 if self.short_mem else mem_need(self.p, self.proof)
        if entry == 0:
            b.store(self.env_get("stack"), self.regs[10])
            b.store(b.add(self.env_get("stack"), I64(STACK_SIZE)), self.regs[10])
            ctx = self.env_get("ctx")
            has_ctx = b.icmp_unsigned("!=", ctx, I64(0))
            b.store(b.select(has_ctx, ctx, self.env_get("mem")), self.regs[1])
            b.store(self.env_get("mem_len"), self.regs[2])
            given = b.select(has_ctx, self.fixed["ctx_len"], self.fixed["mem_len"])    # r1's memory
        else:
            for i in range(1, 6):
                b.store(fn.args[i], self.regs[i])
            b.store(fn.args[6], self.regs[10])
        self.fault_bb = fn.append_basic_block("fault")
        entry_bb = b.block
        # where the given memory holds every byte the verifier proved an access may reach,
        # those accesses need no check; a run with less is the ``short_mem`` code's (the
        # backend's to choose): here it only faults
        self.mem_unchecked = bool(need)
        first = self._body(fn, leaders, body)
        b.position_at_end(entry_bb)
        if need:
            short = fn.append_basic_block("short")
            b.cbranch(b.icmp_unsigned(">=", given, I64(need)), first, short)
            b.position_at_end(short)
            self._set_fault(FAULT_SHORT, 0, given)
            b.ret(I64(0))
        else:
            b.branch(first)
        b.position_at_end(self.fault_bb)
        b.ret(I64(0))

    def _body(self, fn, leaders, body):
        """Emit the subprogram's blocks; returns its first block."""
        b = self.b
        blocks = {pc: fn.append_basic_block(f"pc{pc}") for pc in leaders}
        self.blocks = blocks
        for i, start in enumerate(leaders):
            end = leaders[i + 1] if i + 1 < len(leaders) else body.stop
            b.position_at_end(blocks[start])
            n = sum(1 for pc in range(start, end) if self.slots[pc] is not None)
            if self.counted:
                self._count(n, start, start in self.heads)
            terminated = False
            for pc in range(start, end):
                ins = self.slots[pc]
                if ins is None:
                    continue
                terminated = self._insn(pc, ins)
                if terminated:
                    break
            if not terminated:
                if end in blocks:
                    b.branch(blocks[end])
                else:
                    self._fault_at(FAULT_OOB, end, I64(0))
        return blocks[leaders[0]]

    # -- env ------------------------------------------------------------------------------------
    def env_ptr(self, name):
        return self.b.gep(self.env, [I64(ENV_INDEX[name] * 8)], source_etype=I8)

    def env_get(self, name):
        return self.b.load(self.env_ptr(name), typ=I64)

    def _invariant_load(self, ptr):
        """A load of memory that never changes while the code exists, which LLVM may
        hoist and merge (the address table, and env's pointer to it)."""
        v = self.b.load(ptr, typ=I64)
        v.set_metadata("invariant.load", self.invariant)
        return v

    def addr(self, slot: int):
        table = self.b.inttoptr(self._invariant_load(self.env_ptr("addrs")), PTR)
        return self._invariant_load(self.b.gep(table, [I64(slot * 8)], source_etype=I8))

    def map_addr(self, index: int, buffer: str, offset: int = 0):
        a = self.addr(map_slot(index, buffer))
        return self.b.add(a, I64(offset)) if offset else a

    def _count(self, n, pc, check: bool):
        """Add a block's ``n`` instructions to the count; where ``check`` (a loop head), fault
        if it passed the budget."""
        b = self.b
        ex = b.add(b.load(self.count, typ=I64), I64(n))
        b.store(ex, self.count)
        if check:
            self._check_budget(pc)

    def _check_budget(self, pc):
        b = self.b
        with b.if_then(b.icmp_unsigned(">", b.load(self.count, typ=I64), self.budget), likely=False):
            self._set_fault(FAULT_BUDGET, pc, I64(0))
            b.ret(I64(0))

    def _sync_count(self):
        self.b.store(self.b.load(self.count, typ=I64), self.env_ptr("executed"))

    def _ret(self, value):
        self._sync_count()
        self.b.ret(value)

    def _set_fault(self, code, pc, addr):
        b = self.b
        self._sync_count()
        b.store(I64(code), self.env_ptr("fault"))
        b.store(I64(pc), self.env_ptr("fault_pc"))
        b.store(addr, self.env_ptr("fault_addr"))

    def _fault_at(self, code, pc, addr):
        self._set_fault(code, pc, addr)
        self.b.ret(I64(0))

    def reg(self, r):
        return self.b.load(self.regs[r], typ=I64)

    def set(self, r, v):
        self.b.store(v, self.regs[r])

    # -- memory checks ------------------------------------------------------------------------------
    def _within(self, addr, size, lo, length):
        """[addr, addr+size) lies in [lo, lo+length), with no sum that can wrap: the offset
        addr - lo (huge when addr < lo) is at most length - size, and length holds size."""
        b = self.b
        off = b.sub(addr, lo)
        room = b.sub(length, I64(size))
        return b.and_(b.icmp_unsigned(">=", length, I64(size)), b.icmp_unsigned("<=", off, room))

    def checked(self, pc, addr, size, write):
        """Fault unless [addr, addr+size) is memory the program may touch; returns a pointer.

        No check where the verifier proved the access on every path (see `verify`).  A pointer
        into memory given at run time is checked against the regions the verifier found the
        pointer can point into and the context (with no proof, against every region), except
        where the code runs only with all the verifier proved the program reaches of that
        memory (`Program.mem_extent`, `mem_need`)."""
        b = self.b
        kinds = self.proof.get(pc) if self.proof is not None else None
        if kinds and "mem" not in kinds or self.mem_unchecked and kinds == {"mem"} and pc in self.p.mem_extent:
            return b.inttoptr(addr, PTR)
        # a bare program's memory may come as the context (a batch's rows, a caller's buffer)
        regions = set(kinds) | {"ctx"} if kinds else {"stack", "ctx", "mem", "record", "map_value"}
        ok = I1(0)
        if "stack" in regions:
            ok = b.or_(ok, self._within(addr, size, self.fixed["stack"], I64(STACK_SIZE * MAX_FRAMES)))
        if "ctx" in regions:
            ok = b.or_(ok, self._in_ctx(addr, size, write))
        ok = b.or_(ok, self._within(addr, size, self.fixed["mem"], self.fixed["mem_len"]))
        if "record" in regions:
            ok = b.or_(ok, self._within(addr, size, self.env_get("rec"), self.env_get("rec_len")))
        if "map_value" in regions:
            for index, length in self.map_regions:
                ok = b.or_(ok, self._within(addr, size, self.map_addr(index, "values"), I64(length)))
        with b.if_then(b.not_(ok), likely=False):
            self._set_fault(FAULT_OOB, pc, addr)
            b.ret(I64(0))
        return b.inttoptr(addr, PTR)

    def _in_ctx(self, addr, size, write):
        """[addr, addr+size) lies in the context, and a write touches only its writable bytes."""
        b = self.b
        ctx = self.fixed["ctx"]
        in_ctx = self._within(addr, size, ctx, self.fixed["ctx_len"])
        if write and self.mask_g is not None:
            off = b.sub(addr, ctx)
            allowed = I1(1)
            safe_off = b.select(in_ctx, off, I64(0))
            for k in range(size):
                idx = b.add(safe_off, I64(k))
                idx = b.select(b.icmp_unsigned("<", idx, I64(len(self.mask))), idx, I64(0))
                byte = b.load(b.gep(self.mask_g, [I64(0), idx], inbounds=True), typ=I8)
                allowed = b.and_(allowed, b.icmp_unsigned("!=", byte, I8(0)))
            in_ctx = b.and_(in_ctx, allowed)
        return in_ctx

    # -- instructions -----------------------------------------------------------------------------
    def _insn(self, pc, ins) -> bool:
        """Emit one instruction; True if it ended the block."""
        c = ins.cls
        b = self.b
        if c in (I.ALU, I.ALU64):
            self.set(ins.dst, self._alu(ins))
            return False
        if ins.is_lddw:
            if ins.src == I.PSEUDO_MAP_FD:
                self.set(ins.dst, I64(MAP_HANDLE | ins.imm))
            elif ins.src == I.PSEUDO_MAP_VALUE:
                self.set(ins.dst, self.map_addr(ins.imm, "values", ins.next_imm))
            else:
                self.set(ins.dst, I64(ins.imm & I.MASK64))
            return False
        if c == I.LDX:
            n = I.SIZE_BYTES[ins.size]
            addr = b.add(self.reg(ins.src), I64(ins.off & I.MASK64))
            v = b.load(self.checked(pc, addr, n, False), typ=L.IntType(8 * n))
            self.set(ins.dst, (b.sext if ins.mode == I.MEMSX else b.zext)(v, I64) if n < 8 else v)
            return False
        if c in (I.ST, I.STX):
            n = I.SIZE_BYTES[ins.size]
            addr = b.add(self.reg(ins.dst), I64(ins.off & I.MASK64))
            ptr = self.checked(pc, addr, n, True)
            if c == I.STX and ins.mode == I.ATOMIC:
                self._atomic(ins, ptr, n)
                return False
            v = self.reg(ins.src) if c == I.STX else I64(ins.imm & I.MASK64)
            b.store(b.trunc(v, L.IntType(8 * n)) if n < 8 else v, ptr)
            return False
        op = ins.op
        if op == I.EXIT:
            if self.counted:
                self._check_budget(pc)
            self._ret(self.reg(0))
            return True
        if op == I.CALL:
            if ins.src == I.PSEUDO_CALL:
                target = pc + 1 + ins.imm
                r10 = b.add(self.reg(10), I64(STACK_SIZE))
                limit = b.add(self.env_get("stack"), I64(STACK_SIZE * MAX_FRAMES))
                with b.if_then(b.icmp_unsigned(">", r10, limit), likely=False):
                    self._set_fault(FAULT_DEPTH, pc, I64(0))
                    b.ret(I64(0))
                self._sync_count()
                r0 = b.call(self.funcs[target], [self.env] + [self.reg(i) for i in range(1, 6)] + [r10])
                with b.if_then(b.icmp_unsigned("!=", self.env_get("fault"), I64(0)), likely=False):
                    b.ret(I64(0))
                b.store(self.env_get("executed"), self.count)
                self.set(0, r0)
            else:
                self.set(0, self._helper(pc, self.reg(ins.dst) if ins.opcode & I.X else ins.imm))
            return False
        if op == I.JA:
            b.branch(self.blocks[pc + 1 + ins.jump_offset])
            return True
        a = self.reg(ins.dst)
        x = self.reg(ins.src) if ins.opcode & I.X else I64(ins.imm & I.MASK64)
        if c == I.JMP32:
            a, x = b.trunc(a, I32), b.trunc(x, I32)
        cond = self._cmp(op, a, x)
        b.cbranch(cond, self.blocks[pc + 1 + ins.off], self.blocks[pc + 1])
        return True

    def _cmp(self, op, a, x):
        b = self.b
        if op == I.JSET:
            return b.icmp_unsigned("!=", b.and_(a, x), L.Constant(a.type, 0))
        signed = {I.JSGT: ">", I.JSGE: ">=", I.JSLT: "<", I.JSLE: "<="}
        if op in signed:
            return b.icmp_signed(signed[op], a, x)
        return b.icmp_unsigned({I.JEQ: "==", I.JNE: "!=", I.JGT: ">", I.JGE: ">=", I.JLT: "<",
                                I.JLE: "<="}[op], a, x)

    def _alu(self, ins):
        b = self.b
        is64 = ins.cls == I.ALU64
        T = I64 if is64 else I32
        bits = 64 if is64 else 32
        op = ins.op
        d = self.reg(ins.dst)
        s = self.reg(ins.src) if ins.opcode & I.X else I64(ins.imm & I.MASK64)
        if not is64:
            d, s = b.trunc(d, I32), b.trunc(s, I32)
        if op == I.MOV:
            if ins.off and ins.opcode & I.X:
                r = b.sext(b.trunc(s, L.IntType(ins.off)), T)
            else:
                r = s
        elif op == I.END:
            w = ins.imm
            v = b.trunc(self.reg(ins.dst), L.IntType(w)) if w < 64 else self.reg(ins.dst)
            if is64 or ins.opcode & I.X:
                v = b.bswap(v) if w > 8 else v
            return b.zext(v, I64) if w < 64 else v
        elif op == I.NEG:
            r = b.neg(d)
        elif op in (I.LSH, I.RSH, I.ARSH):
            s = b.and_(s, L.Constant(T, bits - 1))
            r = {I.LSH: b.shl, I.RSH: b.lshr, I.ARSH: b.ashr}[op](d, s)
        elif op in (I.DIV, I.MOD):
            zero = b.icmp_unsigned("==", s, L.Constant(T, 0))
            safe = b.select(zero, L.Constant(T, 1), s)
            if ins.off == 1:   # signed: also define INT_MIN / -1
                neg1 = b.icmp_signed("==", safe, L.Constant(T, -1))
                safe2 = b.select(neg1, L.Constant(T, 1), safe)
                if op == I.DIV:
                    q = b.select(neg1, b.neg(d), b.sdiv(d, safe2))
                    r = b.select(zero, L.Constant(T, 0), q)
                else:
                    q = b.select(neg1, L.Constant(T, 0), b.srem(d, safe2))
                    r = b.select(zero, d, q)
            elif op == I.DIV:
                r = b.select(zero, L.Constant(T, 0), b.udiv(d, safe))
            else:
                r = b.select(zero, d, b.urem(d, safe))
        else:
            r = {I.ADD: b.add, I.SUB: b.sub, I.MUL: b.mul, I.OR: b.or_, I.AND: b.and_, I.XOR: b.xor}[op](d, s)
        return r if is64 else b.zext(r, I64)

    def _atomic(self, ins, ptr, n):
        b = self.b
        T = L.IntType(8 * n)
        src = b.trunc(self.reg(ins.src), T) if n < 8 else self.reg(ins.src)
        if ins.imm == I.CMPXCHG:
            r0 = b.trunc(self.reg(0), T) if n < 8 else self.reg(0)
            pair = b.cmpxchg(ptr, r0, src, "seq_cst", "seq_cst")
            old = b.extract_value(pair, 0)
            self.set(0, b.zext(old, I64) if n < 8 else old)
            return
        opname = {I.ADD: "add", I.OR: "or", I.AND: "and", I.XOR: "xor"}.get(ins.imm & ~I.FETCH, "xchg")
        if ins.imm == I.XCHG:
            opname = "xchg"
        old = b.atomic_rmw(opname, ptr, src, "seq_cst")
        if ins.imm & I.FETCH:
            self.set(ins.src, b.zext(old, I64) if n < 8 else old)

    # -- helpers ------------------------------------------------------------------------------------
    def _callback(self, hid):
        """Call helper ``hid`` (a number, or an IR value for callx) in Python."""
        b = self.b
        ty = L.FunctionType(I64, [I64] * 6)
        fn = b.inttoptr(self.addr(CALLBACK_SLOT), ty.as_pointer())   # a typed pointer: the call reads its type
        return b.call(fn, [I64(hid) if isinstance(hid, int) else hid] + [self.reg(i) for i in range(1, 6)])

    def _helper(self, pc, hid):
        b = self.b
        if isinstance(hid, int) and hid in NATIVE_MAP_OPS:
            out = self._native_map_op(pc, hid)
            if out is not None:
                return out
        r0 = self._callback(hid)
        with b.if_then(b.icmp_unsigned("!=", self.env_get("fault"), I64(0)), likely=False):
            b.store(I64(pc), self.env_ptr("fault_pc"))
            b.ret(I64(0))
        return r0

    def _native_map_op(self, pc, hid):
        """Array lookup/update as address arithmetic, hash/LRU lookup as a native probe, hash/LRU
        update and delete calls of `native_lib`'s (the callback where the update answers
        ASK_PYTHON); per-CPU hash updates and deletes, and array deletes, go to the callback.
        Dispatches on the map index in r1."""
        b = self.b
        maps = self.p.maps
        if not maps:
            return None
        r1 = self.reg(1)
        idx = b.and_(r1, I64(0xFFFFFFFF))
        done = self.fn.append_basic_block(f"map{pc}_done")
        dflt = self.fn.append_basic_block(f"map{pc}_cb")
        sw = b.switch(idx, dflt)
        incoming = []
        # where the verifier proved which map r1 references, only that map's code
        only = self.p.call_maps.get(pc) if self.proof is not None else None
        for i, m in enumerate(maps):
            if m.type not in NATIVE_MAP_OPS[hid] or only is not None and i != only:
                continue
            bb = self.fn.append_basic_block(f"map{pc}_{i}")
            sw.add_case(I64(i), bb)
            b.position_at_end(bb)
            key_ptr = self.checked(pc, self.reg(2), m.key_size, False)
            if m.type in (ARRAY, PERCPU_ARRAY):
                key = b.zext(b.load(key_ptr, typ=I32), I64)
                inb = b.icmp_unsigned("<", key, I64(m.max_entries))
                addr = b.add(self.map_addr(i, "values"), b.mul(key, I64(m.value_size)))
                if hid == Hl.MAP_LOOKUP_ELEM:
                    v = b.select(inb, addr, I64(0))
                else:
                    v = self._array_update(pc, m, inb, addr)
            elif hid == Hl.MAP_LOOKUP_ELEM:
                v = self._hash_lookup(i, m, key_ptr)
            elif hid == Hl.MAP_DELETE_ELEM:
                v = self._hash_delete(i, m)
            else:
                v = self._hash_update(pc, i, m)
                incoming.append((v, b.block))
                b.cbranch(b.icmp_unsigned("==", v, I64(ASK_PYTHON)), dflt, done)
                continue
            incoming.append((v, b.block))
            b.branch(done)
        b.position_at_end(dflt)
        cb = self._callback(hid)
        with b.if_then(b.icmp_unsigned("!=", self.env_get("fault"), I64(0)), likely=False):
            b.store(I64(pc), self.env_ptr("fault_pc"))
            b.ret(I64(0))
        incoming.append((cb, b.block))
        b.branch(done)
        b.position_at_end(done)
        phi = b.phi(I64)
        for v, bb in incoming:
            phi.add_incoming(v, bb)
        return phi

    def _array_update(self, pc, m, inb, addr):
        b = self.b
        val = self.checked(pc, self.reg(3), m.value_size, False)
        flags = self.reg(4)
        ok = b.and_(inb, b.icmp_unsigned("!=", flags, I64(1)))   # BPF_NOEXIST fails on arrays
        with b.if_then(ok):
            dst = b.inttoptr(addr, PTR)
            for k in range(0, m.value_size):
                byte = b.load(b.gep(val, [I64(k)], source_etype=I8), typ=I8)
                b.store(byte, b.gep(dst, [I64(k)], source_etype=I8))
        return b.select(inb, b.select(ok, I64(0), I64(error_return(errno.EEXIST))), I64(error_return(errno.E2BIG)))

    def _hash_update(self, pc, index, m):
        """`native_lib`'s hash update on map ``index`` (its key checked by the caller, its value
        here)."""
        self.checked(pc, self.reg(3), m.value_size, False)
        return self._library_call(HASH_UPDATE_SLOT, index, [self.reg(2), self.reg(3), self.reg(4)] + [
            I64(x) for x in (m.key_size, m.value_size, m.cap, m.max_entries, int(m.type == LRU_HASH))])

    def _hash_delete(self, index, m):
        """`native_lib`'s hash delete on map ``index`` (its key checked by the caller)."""
        return self._library_call(HASH_DELETE_SLOT, index, [self.reg(2)] + [
            I64(x) for x in (m.key_size, m.value_size, m.cap)])

    def _library_call(self, slot: int, index: int, args: list):
        """A call of the `native_lib` function at address-table ``slot`` on map ``index``: its
        first argument the map's buffers' place in the address table, then ``args`` (i64 each)."""
        b = self.b
        fn = b.inttoptr(self.addr(slot), L.FunctionType(I64, [I64] * (1 + len(args))).as_pointer())
        bufs = b.add(self._invariant_load(self.env_ptr("addrs")), I64(map_slot(index, "values") * 8))
        return b.call(fn, [bufs, *args])

    def _hash_lookup(self, index, m, key_ptr):
        """Linear probe of the map's open-addressing table, hashing the key as maps.py does
        (`maps.hash_slot`): its 8-byte words, each loaded once, hashed and compared whole."""
        b = self.b
        fn = self.fn
        ks, cap = m.key_size, m.cap
        words = [self._le_word(key_ptr, off, min(8, ks - off)) for off in range(0, ks, 8)]
        h = I64(0)
        for k, w in enumerate(words):
            h = b.mul(b.xor(h, w) if k else w, I64(HASH_MULTIPLIER))
        h = b.lshr(h, I64(65 - cap.bit_length())) if cap > 1 else I64(0)     # (LLVM: a shift by 64 is poison)
        head = fn.append_basic_block("probe")
        body = fn.append_basic_block("probe_body")
        cmpb = fn.append_basic_block("probe_cmp")
        found = fn.append_basic_block("probe_found")
        miss = fn.append_basic_block("probe_miss")
        out = fn.append_basic_block("probe_out")
        pre = b.block
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64)
        i.add_incoming(I64(0), pre)
        b.cbranch(b.icmp_unsigned("<", i, I64(cap)), body, miss)
        b.position_at_end(body)
        s = b.and_(b.add(h, i), I64(cap - 1))
        st = b.load(b.gep(b.inttoptr(self.map_addr(index, "state"), PTR), [s], source_etype=I8), typ=I8)
        nxt = b.add(i, I64(1))
        is_empty = b.icmp_unsigned("==", st, I8(EMPTY))
        is_used = b.icmp_unsigned("==", st, I8(USED))
        b.cbranch(is_empty, miss, cmpb)
        b.position_at_end(cmpb)
        kbase = b.inttoptr(b.add(self.map_addr(index, "keys"), b.mul(s, I64(ks))), PTR)
        same = is_used
        for k, w in enumerate(words):
            same = b.and_(same, b.icmp_unsigned("==", self._le_word(kbase, 8 * k, min(8, ks - 8 * k)), w))
        i.add_incoming(nxt, cmpb)
        b.cbranch(same, found, head)
        b.position_at_end(found)
        if m.type == LRU_HASH:
            meta = b.inttoptr(self.map_addr(index, "meta", 8), PTR)
            clock = b.add(b.load(meta, typ=I64), I64(1))
            b.store(clock, meta)
            b.store(clock, b.inttoptr(b.add(self.map_addr(index, "stamp"), b.mul(s, I64(8))), PTR))
        addr = b.add(self.map_addr(index, "values"), b.mul(s, I64(m.value_size)))
        b.branch(out)
        b.position_at_end(miss)
        b.branch(out)
        b.position_at_end(out)
        phi = b.phi(I64)
        phi.add_incoming(addr, found)
        phi.add_incoming(I64(0), miss)
        return phi

    def _le_word(self, ptr, offset: int, size: int):
        """The ``size`` (1 to 8) bytes at ``ptr + offset`` as a little-endian i64, zero-extended:
        one load per power-of-two piece (a 7-byte tail is 4 + 2 + 1), none past the end, at
        any alignment."""
        b, word, shift = self.b, None, 0
        for width in (8, 4, 2, 1):
            if size - shift >= width:
                typ = L.IntType(8 * width)
                at = b.gep(ptr, [I64(offset + shift)], source_etype=I8)
                part = b.load(at, typ=typ, align=1)
                part = part if width == 8 else b.zext(part, I64)
                word = part if word is None else b.or_(word, b.shl(part, I64(8 * shift)))
                shift += width
        return word

