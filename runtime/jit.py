"""The JIT backend: verified eBPF lifted to LLVM IR (`lift`), optimised, compiled to native code (MCJIT).

Compiled code is cached per program and map layout; `run_batch` runs one
program over N contexts in a single native call.  Helpers the lifted code does
not do natively call back into the interpreter's implementations.
"""
from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numpy as np

from . import helpers as Hl
from . import isa as I
from .interp import ctx_write_mask
from .lift import FAULT_BUDGET, FAULT_HELPER, FAULT_OOB, FAULTS, MAP_HANDLE, MAX_FRAMES, STACK_SIZE, Env, Lifter
from .maps import RINGBUF
from .program import Backend, Program, VMFault

CALLBACK = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                            ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
_tiers: dict = {}


class _Tier:
    """An MCJIT engine and how it optimises: programs with loops get LLVM's full -O2
    pipeline and -O3 code generation, because that is where their time goes; straight-line
    programs (every policy handler) run a few dozen instructions per call, so they get a
    short pipeline (SROA, instcombine, CFG simplification, GVN, DCE) and fast instruction
    selection, which compiles several times faster for the same run time per call."""

    def __init__(self, loops: bool):
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        self.loops = loops
        self.tm = llvm.Target.from_default_triple().create_target_machine(opt=3 if loops else 0, jit=True)
        self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self.tm)

    def optimise(self, mod) -> None:
        pb = llvm.create_pass_builder(self.tm, llvm.create_pipeline_tuning_options(speed_level=2 if self.loops else 0))
        if self.loops:
            pb.getModulePassManager().run(mod, pb)
            return
        mpm = llvm.create_new_module_pass_manager()
        mpm.add_sroa_pass()
        mpm.add_instruction_combine_pass()
        mpm.add_simplify_cfg_pass()
        mpm.add_new_gvn_pass()
        mpm.add_dead_code_elimination_pass()
        mpm.run(mod, pb)


def _tier(loops: bool) -> _Tier:
    if loops not in _tiers:
        _tiers[loops] = _Tier(loops)
    return _tiers[loops]



class _NativeMemory:
    """A native run's memory as `helpers.call` sees an interpreter's: maps by handle, reads
    checked against the run's regions, one reserved ringbuf record at a time (the compiled
    bounds checks know one)."""

    def __init__(self, backend: "JitBackend", c: "_Compiled"):
        self.backend, self.c, self.e = backend, c, c.env

    def _ok(self, addr, n):
        e = self.e
        for lo, ln in ((e.stack, STACK_SIZE * MAX_FRAMES), (e.ctx, e.ctx_len), (e.mem, e.mem_len), (e.rec, e.rec_len)):
            if lo and lo <= addr and addr + n <= lo + ln:
                return True
        return any(m.type != RINGBUF and m.values.ctypes.data <= addr
                   and addr + n <= m.values.ctypes.data + m.values.nbytes for m in self.c.prog.maps)

    def read_bytes(self, addr, n) -> bytes:
        if n == 0:
            return b""
        if not self._ok(addr, n):
            raise ValueError(f"helper argument {addr:#x} ({n} bytes) is outside the program's memory")
        return ctypes.string_at(addr, n)

    def map_of(self, handle):
        maps = self.c.prog.maps
        if handle & MAP_HANDLE != MAP_HANDLE or (handle & 0xFFFFFFFF) >= len(maps):
            raise ValueError(f"{handle:#x} is not a map")
        return maps[handle & 0xFFFFFFFF]

    def map_value_addr(self, index, m, slot) -> int:
        return m.values.ctypes.data + m.value_offset(slot)

    def new_record(self, m, size) -> int:
        if self.e.rec:
            return 0
        buf = ctypes.create_string_buffer(max(size, 1))
        self.e.rec, self.e.rec_len = ctypes.addressof(buf), size
        self.backend.records[self.e.rec] = (m, buf)
        return self.e.rec

    def end_record(self, addr, submit: bool):
        if addr != self.e.rec or addr not in self.backend.records:
            raise ValueError(f"{addr:#x} is not a reserved ringbuf record")
        m, buf = self.backend.records.pop(addr)
        if submit:
            m.ringbuf_output(buf.raw[:self.e.rec_len])
        self.e.rec = self.e.rec_len = 0


class _Compiled:
    def __init__(self, prog, fn_addr, batch_addr, module_ref, callback):
        self.prog = prog
        self.fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(fn_addr)
        self.batch = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                                      ctypes.c_uint64)(batch_addr)
        self.module_ref, self.callback = module_ref, callback
        self.env = Env()
        self.env_addr = ctypes.addressof(self.env)
        self.stack = ctypes.create_string_buffer(STACK_SIZE * MAX_FRAMES)
        self.fast = False     # env holds the fixed fields (budget, stack, no memory) of the hot path
        self.min_ctx = 0      # contexts shorter than this run the checked variant


class JitBackend(Backend):
    """Native code through LLVM.  ``budget``, ``clock`` and ``seed`` as for the interpreter."""
    name = "jit"

    def __init__(self, budget: int = 1_000_000, clock=None, seed: int = 1, cpu: int = 0):
        from .interp import Interpreter
        self.budget = budget
        self.helper_vm = Interpreter(budget, clock, seed, cpu)   # clock, prandom and printk state
        self.current = None
        self.records: dict[int, tuple] = {}
        self.compiled: dict[tuple, _Compiled] = {}   # per backend: helper callbacks are bound to it

    # -- the Python side of helper calls ----------------------------------------------------------
    def _callback(self, hid, r1, r2, r3, r4, r5):
        """Helpers not done natively run the interpreter's implementations (`helpers.call`)
        on the native run's memory."""
        try:
            return Hl.call(self.helper_vm, _NativeMemory(self, self.current), hid, [0, r1, r2, r3, r4, r5]) \
                & I.MASK64
        except Exception as e:  # noqa: BLE001 - reported as a fault of the program
            self.current.env.fault = FAULT_HELPER
            self.helper_error = str(e)
            return 0

    # -- backend interface ---------------------------------------------------------------------------------
    def load(self, prog: Program) -> _Compiled:
        return self._compile(prog, prog.proof)

    def _compile(self, prog: Program, proof: dict | None) -> _Compiled:
        key = (prog.code, tuple((m.values.ctypes.data, m.values.nbytes) for m in prog.maps),
               ctx_write_mask(prog.hook, prog.ctx_size) if prog.ctx_size else b"", proof is not None)
        if key in self.compiled:
            return self.compiled[key]
        cb = CALLBACK(self._callback)
        cb_addr = ctypes.cast(cb, ctypes.c_void_p).value
        name = f"fx{id(self) & 0xFFFFFF:x}_{len(self.compiled)}"
        lifter = Lifter(prog, name, cb_addr, proof, self.budget)
        tier = _tier(loops=not lifter.acyclic)
        mod = llvm.parse_assembly(str(lifter.build()))
        mod.verify()
        tier.optimise(mod)
        engine = tier.engine
        engine.add_module(mod)
        engine.finalize_object()
        compiled = _Compiled(prog, engine.get_function_address(f"{name}_f0"),
                             engine.get_function_address(f"{name}_batch"), mod, cb)
        # the proof assumes a whole context: a shorter one runs the checked code
        compiled.min_ctx = prog.ctx_size if proof is not None else 0
        self.compiled[key] = compiled
        return compiled

    def _checked(self, c: _Compiled) -> _Compiled:
        return self._compile(c.prog, None)

    def _prepare(self, c: _Compiled, ctx, mem):
        e = c.env
        e.budget, e.executed, e.fault, e.fault_pc, e.fault_addr = self.budget, 0, 0, 0, 0
        e.stack = ctypes.addressof(c.stack)
        e.rec = e.rec_len = 0
        keep = []
        if isinstance(ctx, ctypes.Array):      # a codec's reusable buffer: no copy, no wrapper
            e.ctx, e.ctx_len = ctypes.addressof(ctx), len(ctx)
        elif ctx is not None:
            cbuf = (ctypes.c_char * len(ctx)).from_buffer(ctx)
            keep.append(cbuf)
            e.ctx, e.ctx_len = ctypes.addressof(cbuf), len(ctx)
        else:
            e.ctx = e.ctx_len = 0
        if mem is not None and len(mem):
            mbuf = (ctypes.c_char * len(mem)).from_buffer(mem)
            keep.append(mbuf)
            e.mem, e.mem_len = ctypes.addressof(mbuf), len(mem)
        else:
            e.mem, e.mem_len = (1, 0) if mem is not None else (0, 0)
        return keep

    def run(self, c: _Compiled, ctx=None, mem=None) -> int:
        if c.min_ctx and (ctx is None or len(ctx) < c.min_ctx):
            c = self._checked(c)
        self.current = c
        e = c.env
        if mem is None and isinstance(ctx, ctypes.Array):   # the shims' hot path: a reused buffer
            if not c.fast:
                self._prepare(c, None, None)
                c.fast = True
            e.executed = e.fault = 0
            e.ctx, e.ctx_len = ctypes.addressof(ctx), len(ctx)
            r0 = c.fn(c.env_addr)
            if e.fault:
                self._check(c)
            return r0
        c.fast = False
        keep = self._prepare(c, ctx, mem)
        r0 = c.fn(c.env_addr)
        del keep
        self._check(c)
        return r0

    def run_batch(self, c: _Compiled, ctxs: np.ndarray) -> int:
        """Run the program on every row of a 2-D uint8 array of contexts, in place; returns rows run."""
        if ctxs.ndim != 2 or ctxs.dtype != np.uint8 or not ctxs.flags.c_contiguous:
            raise ValueError("contexts must be a C-contiguous 2-D uint8 array")
        if ctxs.shape[1] < c.min_ctx:
            c = self._checked(c)
        self.current = c
        if not c.fast:
            self._prepare(c, None, None)
            c.fast = True
        e = c.env
        e.fault, e.ctx_len = 0, ctxs.shape[1]
        n = c.batch(c.env_addr, ctxs.ctypes.data, ctxs.shape[0], ctxs.shape[1])
        if e.fault:
            try:
                self._check(c)
            except VMFault as fault:
                fault.row = int(n)
                raise
        return n

    def _check(self, c):
        e = c.env
        if e.fault:
            why = FAULTS.get(e.fault, "fault")
            if e.fault == FAULT_OOB:
                why = f"out-of-bounds access at {e.fault_addr:#x}"
            elif e.fault == FAULT_BUDGET:
                why = f"instruction budget of {self.budget} exhausted"
            elif e.fault == FAULT_HELPER:
                why = f"helper call failed: {getattr(self, 'helper_error', '')}"
            raise VMFault(c.prog, int(e.fault_pc), why)
