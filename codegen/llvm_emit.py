"""Pass 7: the policy IR to LLVM IR with llvmlite.ir, then to a BPF object (`build_module`, `compile_module`).

Maps are globals in ``.maps`` described with DWARF so that LLVM emits
``.BTF``; every global has debug info, functions are ``nounwind`` and sit in
section ``syscall`` (``BPF_PROG_TYPE_SYSCALL`` for libbpf), statements carry
``DILocation``s so ``.BTF.ext`` maps instructions back to ``.fx`` lines.
Helpers are called through ``inttoptr(helper id)``; all allocas are in the
entry block (the BPF back end rejects dynamic stack allocation).
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
import llvmlite.ir as L

from fabric_ext import __version__
from fabric_ext.runtime.machine.helpers import HELPERS
from fabric_ext.runtime.machine.maptypes import KIND_TYPE

from . import ir

I1, I8, I32, I64 = L.IntType(1), L.IntType(8), L.IntType(32), L.IntType(64)
PTR = L.PointerType()
INT = {1: I8, 2: L.IntType(16), 4: I32, 8: I64}
HELPER = {h.name: h.id for h in HELPERS.values()}
BTF_MAX_COLUMN = 0x3FF        # a .BTF.ext line record's column field: 10 bits
_initialised = False


def _init_llvm():
    global _initialised
    if not _initialised:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        _initialised = True


class _Debug:
    """DWARF metadata for one module."""

    def __init__(self, m: L.Module, source: str):
        self.m = m
        d, f = os.path.split(os.path.abspath(source))
        self.file = m.add_debug_info("DIFile", {"filename": f, "directory": d})
        self.globals = []
        self.base = {}
        for name, bits, enc in (("int", 32, "DW_ATE_signed"), ("char", 8, "DW_ATE_signed_char"),
                                ("__u8", 8, "DW_ATE_unsigned"), ("__u16", 16, "DW_ATE_unsigned"),
                                ("__u32", 32, "DW_ATE_unsigned"), ("__u64", 64, "DW_ATE_unsigned")):
            self.base[name] = m.add_debug_info("DIBasicType", {"name": name, "size": bits,
                                                               "encoding": L.DIToken(enc)})

    def int_of_size(self, n):
        return self.base[{1: "__u8", 2: "__u16", 4: "__u32", 8: "__u64"}[n]]

    def array(self, base, count, bits_each):
        sub = self.m.add_debug_info("DISubrange", {"count": count})
        return self.m.add_debug_info("DICompositeType", {"tag": L.DIToken("DW_TAG_array_type"),
                                                         "baseType": base, "size": bits_each * count,
                                                         "elements": self.m.add_metadata([sub])})

    def ptr(self, base):
        return self.m.add_debug_info("DIDerivedType", {"tag": L.DIToken("DW_TAG_pointer_type"),
                                                       "baseType": base, "size": 64})

    def struct(self, members: list[tuple[str, object, int]], line: int, name: str | None = None):
        elems, off = [], 0
        for mname, ty, bits in members:
            elems.append(self.m.add_debug_info("DIDerivedType", {
                "tag": L.DIToken("DW_TAG_member"), "name": mname, "file": self.file, "line": line,
                "baseType": ty, "size": bits, "offset": off}))
            off += bits
        ops = {"tag": L.DIToken("DW_TAG_structure_type"), "file": self.file, "line": line,
               "size": off, "elements": self.m.add_metadata(elems)}
        if name:
            ops["name"] = name
        return self.m.add_debug_info("DICompositeType", ops)

    def global_var(self, gv, name, ty, line):
        var = self.m.add_debug_info("DIGlobalVariable", {
            "name": name, "scope": None, "file": self.file, "line": line, "type": ty,
            "isLocal": False, "isDefinition": True})
        gve = self.m.add_debug_info("DIGlobalVariableExpression", {
            "var": var, "expr": self.m.add_debug_info("DIExpression", {})})
        gv.set_metadata("dbg", gve)
        self.globals.append(gve)

    def finish(self, optimized: bool):
        cu = self.m.add_debug_info("DICompileUnit", {
            "language": L.DIToken("DW_LANG_C99"), "file": self.file, "producer": f"fabricc {__version__}",
            "isOptimized": optimized, "runtimeVersion": 0, "emissionKind": L.DIToken("FullDebug"),
            "globals": self.m.add_metadata(self.globals), "nameTableKind": L.DIToken("None")},
            is_distinct=True)
        for gve in self.globals:
            _close_cycle(gve.operands[0][1], "scope", cu)
        self.cu = cu
        self.m.add_named_metadata("llvm.dbg.cu", cu)
        self.m.add_named_metadata("llvm.module.flags", [I32(7), "Dwarf Version", I32(5)])
        self.m.add_named_metadata("llvm.module.flags", [I32(2), "Debug Info Version", I32(3)])
        return cu


class _FnEmitter:
    """Emits one program's function."""

    def __init__(self, mod: _ModuleEmitter, prog: ir.ProgramIR):
        self.mod, self.p = mod, prog
        self.fn = L.Function(mod.m, L.FunctionType(I32, [PTR]), name=prog.name)
        self.fn.section = "syscall"
        self.fn.attributes.add("nounwind")
        self.fn.args[0].name = "ctx"
        self.sp = None
        self.entry = self.fn.append_basic_block("entry")
        self.b = L.IRBuilder(self.entry)
        # every context access is a load or store at a constant offset from the context
        # pointer itself, as the kernel requires (a pointer moved off it may not be read
        # through): the marker keeps LLVM from reusing a moved pointer (BPFPreserveStaticOffset)
        self.ctx = self.b.call(mod.static_offset, [self.fn.args[0]], name="ctx.fixed")
        self.vars = {v: self.b.alloca(I64, name=v.name) for v in prog.vars}
        self.keys = {n: self.b.alloca(INT[n], name=f"key{n}") for n in (1, 2, 4, 8)}
        self.vals = {n: self.b.alloca(INT[n], name=f"val{n}") for n in (1, 2, 4, 8)}
        n_emit = max([len(s.args) for h in prog.handlers for s in ir.statements(h.body) if isinstance(s, ir.Emit)] or [1])
        self.emit_buf = self.b.alloca(L.ArrayType(I64, n_emit), name="record")

    def subprogram(self, line):
        dbg = self.mod.dbg
        ty = self.mod.m.add_debug_info("DISubroutineType", {"types": self.mod.m.add_metadata(
            [dbg.base["int"], dbg.ptr(self.mod.ctx_types[self.p.hook])])})
        # the kernel's BTF checker wants named arguments: LLVM takes them from the
        # subprogram's retained DILocalVariables, whose scope is the subprogram itself
        arg = self.mod.m.add_debug_info("DILocalVariable", {
            "name": "ctx", "arg": 1, "scope": dbg.file, "file": dbg.file, "line": line,
            "type": dbg.ptr(self.mod.ctx_types[self.p.hook])})
        self.sp = self.mod.m.add_debug_info("DISubprogram", {
            "name": self.p.name, "scope": dbg.file, "file": dbg.file, "line": line, "type": ty,
            "scopeLine": line, "spFlags": L.DIToken("DISPFlagDefinition | DISPFlagOptimized"),
            "unit": dbg.cu, "retainedNodes": self.mod.m.add_metadata([arg])}, is_distinct=True)
        _close_cycle(arg, "scope", self.sp)
        self.fn.set_metadata("dbg", self.sp)

    def loc(self, span):
        # .BTF.ext keeps a column in 10 bits under the line: a wider one would add to the line
        self.b.debug_metadata = self.mod.m.add_debug_info(
            "DILocation", {"line": max(span.line, 1), "column": min(max(span.col, 1), BTF_MAX_COLUMN),
                           "scope": self.sp})

    # -- values ---------------------------------------------------------------------
    def field_ptr(self, f: ir.CtxField):
        return self.b.gep(self.ctx, [I64(f.offset)], source_etype=I8)

    def value(self, e) -> L.Value:
        b = self.b
        if isinstance(e, ir.Const):
            return I64(e.value)
        if isinstance(e, ir.CtxField):
            ty = INT[4 if e.ctype == "u32" else 8]
            v = b.load(self.field_ptr(e), typ=ty)
            return b.zext(v, I64) if ty is not I64 else v
        if isinstance(e, ir.Var):
            return b.load(self.vars[e], typ=I64)
        if isinstance(e, ir.Not):
            return b.zext(b.icmp_unsigned("==", self.value(e.operand), I64(0)), I64)
        if isinstance(e, ir.MinMax):
            acc = self.value(e.args[0])
            for a in e.args[1:]:
                v = self.value(a)
                acc = b.select(b.icmp_unsigned("<" if e.op == "min" else ">", acc, v), acc, v)
            return acc
        if isinstance(e, ir.MapGet):
            return self.map_get(e)
        if isinstance(e, ir.Bin):
            return self.binop(e)
        raise TypeError(type(e).__name__)

    def binop(self, e):
        b = self.b
        x, y = self.value(e.left), self.value(e.right)
        op = e.op
        if op in ("==", "!=", "<", ">", "<=", ">="):
            return b.zext(b.icmp_unsigned(op, x, y), I64)
        if op in ("&&", "||"):
            bx, by = b.icmp_unsigned("!=", x, I64(0)), b.icmp_unsigned("!=", y, I64(0))
            return b.zext(b.and_(bx, by) if op == "&&" else b.or_(bx, by), I64)
        zero = b.icmp_unsigned("==", y, I64(0))
        if op == "-":   # subtraction stops at 0
            return b.select(b.icmp_unsigned(">=", x, y), b.sub(x, y), I64(0))
        if op == "/":   # x / 0 is 0, as in eBPF
            divisor = b.select(zero, I64(1), y)
            if not isinstance(y, L.Constant):
                divisor = self.opaque(divisor)
            return b.select(zero, I64(0), b.udiv(x, divisor))
        if op == "%":   # x % 0 is x, as in eBPF
            return b.select(zero, x, b.urem(x, b.select(zero, I64(1), y)))
        if op in ("<<", ">>"):
            y = b.and_(y, I64(63))
            return b.shl(x, y) if op == "<<" else b.lshr(x, y)
        return {"+": b.add, "*": b.mul, "&": b.and_, "|": b.or_, "^": b.xor}[op](x, y)

    def cond(self, e) -> L.Value:
        return self.b.icmp_unsigned("!=", self.value(e), I64(0))

    def opaque(self, v: L.Value) -> L.Value:
        """``v``, through an empty inline asm LLVM cannot see into (libbpf's ``barrier_var``).
        A divisor LLVM proves a power of two it divides by as a shift by its count of trailing
        zeros, which the BPF backend computes from a table in ``.rodata``: global data no
        policy map carries, so the runtime refuses the object (``x / ((1 & ev.hop) + 1)``)."""
        asm = L.InlineAsm(L.FunctionType(I64, [I64]), "", "=r,0", side_effect=False)
        return self.b.call(asm, [v])

    # -- maps --------------------------------------------------------------------------------
    def helper(self, name, ret, args):
        ty = L.FunctionType(ret, [a.type for a in args])
        fn = I64(HELPER[name]).inttoptr(PTR)
        fn.function_type = ty  # what llvmlite's call needs to type an indirect callee
        return self.b.call(fn, args)

    def key_ptr(self, mapname, key):
        info = self.mod.maps[mapname]
        kp = self.keys[info.key_size]
        self.b.store(self.b.trunc(key, INT[info.key_size]) if info.key_size < 8 else key, kp)
        return kp

    def lookup(self, mapname, key):
        return self.helper("map_lookup_elem", PTR, [self.mod.map_globals[mapname], self.key_ptr(mapname, key)])

    def load_value(self, mapname, ptr):
        n = self.mod.maps[mapname].value_size
        v = self.b.load(ptr, typ=INT[n])
        return self.b.zext(v, I64) if n < 8 else v

    def map_get(self, e: ir.MapGet):
        b = self.b
        key = self.value(e.key)
        default = self.value(e.default)
        ptr = self.lookup(e.map, key)
        found = b.icmp_unsigned("!=", ptr, PTR(None))
        with b.if_else(found) as (then, otherwise):
            with then:
                v_found = self.load_value(e.map, ptr)
                bb_found = b.block
            with otherwise:
                bb_default = b.block
        phi = b.phi(I64)
        phi.add_incoming(v_found, bb_found)
        phi.add_incoming(default, bb_default)
        return phi

    def map_update(self, s: ir.MapUpdate):
        b = self.b
        info = self.mod.maps[s.map]
        n = info.value_size
        key, val = self.value(s.key), self.value(s.value)
        g = self.mod.map_globals[s.map]
        if s.op == "=":
            vp = self.vals[n]
            b.store(b.trunc(val, INT[n]) if n < 8 else val, vp)
            self.helper("map_update_elem", I64, [g, self.key_ptr(s.map, key), vp, I64(0)])
            return
        ptr = self.lookup(s.map, key)
        found = b.icmp_unsigned("!=", ptr, PTR(None))
        with b.if_else(found) as (then, otherwise):
            with then:
                if s.op == "+=" and n in (4, 8):
                    b.atomic_rmw("add", ptr, b.trunc(val, INT[n]) if n < 8 else val, "monotonic")
                else:
                    old = self.load_value(s.map, ptr)
                    new = self.combine(s.op, old, val)
                    b.store(b.trunc(new, INT[n]) if n < 8 else new, ptr)
            with otherwise:
                new = self.combine(s.op, I64(ir.UPDATE_START[s.op]), val)
                vp = self.vals[n]
                b.store(b.trunc(new, INT[n]) if n < 8 else new, vp)
                self.helper("map_update_elem", I64, [g, self.key_ptr(s.map, key), vp, I64(0)])

    def combine(self, op, old, val):
        b = self.b
        if op == "+=":
            return b.add(old, val)
        if op == "-=":
            return b.select(b.icmp_unsigned(">=", old, val), b.sub(old, val), I64(0))
        if op == "|=":
            return b.or_(old, val)
        if op == "&=":
            return b.and_(old, val)
        if op == "max=":
            return b.select(b.icmp_unsigned(">", old, val), old, val)
        if op == "min=":
            return b.select(b.icmp_unsigned("<", old, val), old, val)
        raise ValueError(op)

    # -- statements ------------------------------------------------------------------------------
    def stmts(self, body):
        for s in body:
            self.loc(s.span)
            getattr(self, "s_" + type(s).__name__)(s)

    def s_SetField(self, s):
        ty = INT[4 if s.field.ctype == "u32" else 8]
        v = self.value(s.value)
        self.b.store(self.b.trunc(v, ty) if ty is not I64 else v, self.field_ptr(s.field))

    def s_SetVar(self, s):
        self.b.store(self.value(s.value), self.vars[s.var])

    def s_If(self, s):
        c = self.cond(s.cond)
        if s.orelse:
            with self.b.if_else(c) as (then, otherwise):
                with then:
                    self.stmts(s.then)
                with otherwise:
                    self.stmts(s.orelse)
        else:
            with self.b.if_then(c):
                self.stmts(s.then)

    def s_MapUpdate(self, s):
        self.map_update(s)

    def s_MapDelete(self, s):
        key = self.value(s.key)
        self.helper("map_delete_elem", I64, [self.mod.map_globals[s.map], self.key_ptr(s.map, key)])

    def s_Emit(self, s):
        b = self.b
        for i, a in enumerate(s.args):
            b.store(self.value(a), b.gep(self.emit_buf, [I64(0), I64(i)], inbounds=True))
        self.helper("ringbuf_output", I64, [self.mod.map_globals[s.map], self.emit_buf, I64(8 * len(s.args)), I64(0)])

    def s_Loop(self, s):
        b = self.b
        iv = self.vars[s.var]
        b.store(I64(s.lo), iv)
        head = self.fn.append_basic_block("loop")
        body = self.fn.append_basic_block("body")
        done = self.fn.append_basic_block("done")
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_unsigned("<", b.load(iv, typ=I64), I64(s.hi)), body, done)
        b.position_at_end(body)
        self.stmts(s.body)
        self.loc(s.span)
        b.store(b.add(b.load(iv, typ=I64), I64(1)), iv)
        b.branch(head)
        b.position_at_end(done)

    # -- the program --------------------------------------------------------------------------------
    def emit(self):
        b = self.b
        hook = self.p.hook
        line = self.p.handlers[0].span.line if self.p.handlers else 1
        self.subprogram(line)
        self.loc(self.p.handlers[0].span if self.p.handlers else _NoSpan)
        mid = self.value(ir.CtxField("movement", hook.offset("movement"), "u32")) \
            if hook.field("movement") else None
        period = self.value(ir.CtxField("period", hook.offset("period"), "u64")) \
            if hook.field("period") else None
        for k, h in enumerate(self.p.handlers):
            if k % SIZE_CHECK_EVERY == 0 and self.size() > self.mod.max_instructions:
                self.mod.cut[self.p.name] = k        # past the limit already: the rest cannot help
                break
            self.loc(h.span)
            checks = []
            if h.movement_id is not None and mid is not None:
                checks.append(b.icmp_unsigned("==", mid, I64(h.movement_id)))
            if h.period is not None and period is not None:
                checks.append(b.icmp_unsigned("==", period, I64(h.period)))
            c = checks[0] if checks else I1(1)
            for extra in checks[1:]:
                c = b.and_(c, extra)
            with b.if_then(c):
                if h.guard is not None:
                    with b.if_then(self.cond(h.guard)):
                        self.stmts(h.body)
                else:
                    self.stmts(h.body)
        b.ret(I32(0))

    def size(self) -> int:
        """LLVM instructions of the function so far."""
        return sum(len(bb.instructions) for bb in self.fn.blocks)


#: handlers emitted between two measures of a program's size (`_FnEmitter.emit`)
SIZE_CHECK_EVERY = 16


class _IdentityHashed:
    """Mixed into a metadata node that closes a cycle, so llvmlite's structural hash terminates."""
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other


def _close_cycle(node, key, target):
    if not isinstance(node, _IdentityHashed):
        node.__class__ = type("Cyclic" + type(node).__name__, (_IdentityHashed, type(node)), {})
    node.operands = tuple((k, target if k == key else v) for k, v in node.operands)


class _NoSpan:
    line, col = 1, 1


class _ModuleEmitter:
    def __init__(self, island: str, programs: list[ir.ProgramIR], maps: dict, source: str,
                 max_instructions: float = float("inf")):
        self.max_instructions = max_instructions
        self.cut: dict[str, int] = {}       # program -> handlers emitted, where it grew past the maximum
        self.m = L.Module(name=island)
        self.m.triple = "bpfel"
        self.m.data_layout = "e-m:e-p:64:64-i64:64-i128:128-n32:64-S128"
        self.dbg = _Debug(self.m, source)
        self.maps = maps
        self.map_globals = {}
        self.ctx_types = {}
        self.static_offset = L.Function(self.m, L.FunctionType(PTR, [PTR]), name="llvm.preserve.static.offset")
        used = sorted({name for p in programs for name in p.maps})
        for name in used:
            self.map_global(name, maps[name])
        for p in programs:
            if p.hook not in self.ctx_types:
                self.ctx_types[p.hook] = self.ctx_struct(p.hook)
        lic = L.GlobalVariable(self.m, L.ArrayType(I8, 4), name="_license")
        lic.initializer = L.Constant(L.ArrayType(I8, 4), bytearray(b"GPL\0"))
        lic.section = "license"
        lic.global_constant = False
        self.dbg.global_var(lic, "_license", self.dbg.array(self.dbg.base["char"], 4, 8), 1)
        self.dbg.finish(True)
        self.programs = programs

    def ctx_struct(self, hook):
        members, off = [], 0
        for name, (o, f) in hook.layout.items():
            if o > off:
                members.append((f"__pad{off}", self.dbg.array(self.dbg.base["char"], o - off, 8), 8 * (o - off)))
            members.append((name, self.dbg.int_of_size(f.size), 8 * f.size))
            off = o + f.size
        if hook.ctx_size > off:
            members.append(("__pad_end", self.dbg.array(self.dbg.base["char"], hook.ctx_size - off, 8),
                            8 * (hook.ctx_size - off)))
        return self.dbg.struct(members, 1, hook.struct_name)

    def map_global(self, name, info):
        dbg = self.dbg
        fields = [("type", KIND_TYPE[info.kind])]
        if info.kind == "ringbuf":
            fields.append(("max_entries", info.max_entries))
            dtypes = [(n, dbg.ptr(dbg.array(dbg.base["int"], v, 32)), 64) for n, v in fields]
        else:
            fields.append(("max_entries", info.max_entries))
            dtypes = [("type", dbg.ptr(dbg.array(dbg.base["int"], fields[0][1], 32)), 64),
                      ("key", dbg.ptr(dbg.int_of_size(info.key_size)), 64),
                      ("value", dbg.ptr(dbg.int_of_size(info.value_size)), 64),
                      ("max_entries", dbg.ptr(dbg.array(dbg.base["int"], info.max_entries, 32)), 64)]
        sty = L.LiteralStructType([PTR] * len(dtypes))
        gv = L.GlobalVariable(self.m, sty, name=name)
        gv.initializer = L.Constant(sty, [PTR(None)] * len(dtypes))
        gv.section = ".maps"
        gv.align = 8
        line = info.decl.span.line if info.decl.span.line else 1
        dbg.global_var(gv, name, dbg.struct(dtypes, line), line)
        self.map_globals[name] = gv


def build_module(island: str, programs: list[ir.ProgramIR], maps: dict, source: str,
                 max_instructions: int | None = None) -> tuple[L.Module, dict[str, int]]:
    """The LLVM module for one island: its maps and one function per program; and the
    programs found past ``max_instructions`` LLVM instructions as their handlers were emitted,
    each with the handlers emitted by then (the rest are left out: the module is not
    compiled)."""
    me = _ModuleEmitter(island, programs, maps, source, float("inf") if max_instructions is None else max_instructions)
    for p in programs:
        _FnEmitter(me, p).emit()
    return me.m, me.cut


def compile_module(module: L.Module, opt: int = 2, mcpu: str = "v3") -> tuple[bytes, str]:
    """(ELF object bytes, optimised LLVM IR text) for a module."""
    _init_llvm()
    mod = llvm.parse_assembly(str(module))
    mod.verify()
    target = llvm.Target.from_triple("bpfel")
    tm = target.create_target_machine(cpu=mcpu, opt=opt, reloc="static", codemodel="small")
    # at -O0 too: the BPF target's own passes turn the context accesses into the loads and
    # stores at constant offsets the kernel wants (`_FnEmitter.__init__`)
    pto = llvm.create_pipeline_tuning_options(speed_level=opt)
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return tm.emit_object(mod), str(mod)
