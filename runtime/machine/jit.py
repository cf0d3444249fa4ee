"""The JIT backend: verified eBPF lifted to LLVM IR (`lift`), optimised, compiled to native code (MCJIT).

Native code is made once per program and map shapes: in a process it is shared by
every load, and across processes it is kept in the on-disk `codecache`, so a
policy run again starts without compiling.  Each load gets its own environment
and address table (its maps' buffers, its helper callback).  `run_batch` runs one
program over N contexts in a single native call.  Helpers the lifted code does
not do natively call back into the interpreter's implementations.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

import llvmlite.binding as llvm
import numpy as np

from . import helpers as Hl
from . import isa as I
from . import native_lib
from .codecache import CodeCache, default_dir, host_target
from .errors import InputError
from .flow import acyclic
from .lift import (
    FAULT_BUDGET,
    FAULT_HELPER,
    FAULT_OOB,
    FAULT_SHORT,
    FAULTS,
    MAP_HANDLE,
    MAX_FRAMES,
    NATIVE_HASH,
    STACK_SIZE,
    Env,
    Lifter,
    address_table,
    map_slot,
    mem_need,
)
from .maps import RINGBUF
from .program import JIT_CHECKS, Backend, Program, VMFault
from .semantics import ctx_write_mask

_BATCH = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                          ctypes.c_void_p)     # `native_lib`'s batch driver
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                            ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
_tiers: dict = {}
#: instruction slots of a program the JIT compiles, at most: LLVM's time and memory grow faster
#: than the program (200,000 branchy instructions: 19 s and 0.9 GB), and a program may have
#: 1,000,000.  The compiler's programs stay far below (`codegen.driver.MAX_LLVM_INSTRUCTIONS`).
MAX_JIT_SLOTS = 1 << 16
_native: dict[str, int] = {}   # code digest -> entry address in this process
_cache: CodeCache | None = None
_lib = None         # `native_lib`'s functions in this process (`_library`)


class _Tier:
    """An MCJIT engine and how it optimises.  Every program gets the same short IR pipeline
    (SROA, instcombine, CFG simplification, DCE); code generation differs: programs with
    loops get -O3 (the selection DAG, the greedy register allocator, loop strength
    reduction), where their time goes, and straight-line ones (every policy handler: a few
    dozen instructions per call) fast instruction selection, several times faster to
    compile for the same run time.  LLVM's -O2 pipeline and GVN cost compile time and bought
    the bench's programs no run time (docs/performance.md).  Both generate code for the CPU
    the process runs on (`codecache.host_target`), as llvmbpf does: tuned for an AMD Zen 4,
    LLVM divides 64-bit operands that fit in 32 bits with the faster 32-bit instruction,
    which a generic x86-64 target does not (the prime loop: 14 % faster)."""

    def __init__(self, loops: bool):
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        cpu, features = host_target()
        self.tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=cpu, features=features, opt=3 if loops else 0, jit=True)
        self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self.tm)

    def optimise(self, mod) -> None:
        mpm = llvm.create_new_module_pass_manager()
        mpm.add_sroa_pass()
        mpm.add_instruction_combine_pass()
        mpm.add_simplify_cfg_pass()
        mpm.add_dead_code_elimination_pass()
        mpm.run(mod, llvm.create_pass_builder(self.tm, llvm.create_pipeline_tuning_options()))


def _tier(loops: bool) -> _Tier:
    if loops not in _tiers:
        _tiers[loops] = _Tier(loops)
    return _tiers[loops]


def code_cache() -> CodeCache:
    """The process's on-disk code cache (its folder read from the environment on first use)."""
    global _cache
    if _cache is None:
        _cache = CodeCache(default_dir())
    return _cache


def _code_key(cache: CodeCache, prog: Program, proof: dict | None, counted: bool, short_mem: bool) -> str:
    """A digest of everything the lifter reads: equal digests, equal object code."""
    shapes = ";".join(f"{m.type},{m.key_size},{m.value_size},{m.max_entries},{m.cap},{m.values.nbytes}"
                      for m in prog.maps)
    mask = ctx_write_mask(prog.hook, prog.ctx_size) if prog.ctx_size else b""
    proven = "-" if proof is None else ";".join(f"{pc}:{','.join(sorted(k))}:{prog.mem_extent.get(pc, '')}"
                                                 for pc, k in sorted(proof.items())) + \
        ";calls:" + ",".join(f"{pc}={i}" for pc, i in sorted(prog.call_maps.items()))
    return cache.key(prog.code, shapes.encode(), mask, proven.encode(), b"counted" if counted else b"",
                     b"short" if short_mem else b"")


def _native_code(prog: Program, proof: dict | None, budget: int, stats: dict,
                 short_mem: bool = False) -> int:
    """The entry address of the program's native code: made in this process already, read
    from the code cache, or lifted, optimised and compiled (then cached)."""
    loops = not acyclic(prog)
    counted = loops or len(prog.slots) > budget
    cache = code_cache()
    key = _code_key(cache, prog, proof, counted, short_mem)
    if key in _native:
        stats["reused"] += 1
        return _native[key]
    tier = _tier(loops)
    name = f"fx{key[:20]}"
    t = time.perf_counter()
    obj, compiled = _object(cache, key, tier, lambda: Lifter(prog, name, proof, counted, short_mem).build())
    if compiled:
        stats["compiled"] += 1
        stats["compile_s"] += time.perf_counter() - t
    else:
        stats["cached"] += 1
    _native[key] = _add_object(tier, obj, f"{name}_f0")
    return _native[key]


def _object(cache: CodeCache, key: str, tier: _Tier, module) -> tuple[bytes, bool]:
    """The object code of entry ``key``: read from the cache, else made from ``module()`` (an
    IR module), optimised and compiled by the tier, and cached; and whether it was compiled."""
    obj = cache.get(key)
    if obj is not None:
        return obj, False
    mod = llvm.parse_assembly(str(module()))
    mod.verify()
    tier.optimise(mod)
    obj = tier.tm.emit_object(mod)
    cache.put(key, obj)
    return obj, True


def _add_object(tier: _Tier, obj: bytes, symbol: str) -> int:
    """Load object code into the tier's engine; the address of its function ``symbol``."""
    tier.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
    tier.engine.finalize_object()
    addr = tier.engine.get_function_address(symbol)
    if not addr:
        raise RuntimeError(f"native code lacks its entry point {symbol}")
    return addr


@dataclass(frozen=True)
class _Library:
    """`native_lib`'s functions in this process."""
    batch: object           # the batch driver, callable
    hash_ops: tuple         # the hash update's and delete's addresses, as the address table holds them
    tier: _Tier             # the engine that holds their code (kept alive with them)


def _library() -> _Library:
    """`native_lib`'s functions, compiled (or read from the code cache) once per process, when a
    batch or a program with a hash map first needs them."""
    global _lib
    if _lib is None:
        cache = code_cache()
        tier = _tier(True)      # the batch's loop and the probe: the code generator's best
        obj, _ = _object(cache, cache.key(b"runtime library"), tier, native_lib.module)
        batch = _BATCH(_add_object(tier, obj, native_lib.BATCH))
        _lib = _Library(batch, tuple(tier.engine.get_function_address(f)
                                     for f in (native_lib.HASH_UPDATE, native_lib.HASH_DELETE)), tier)
    return _lib


class _NativeMemory:
    """A native run's memory as `helpers.call` uses it (`helpers.HelperMemory`): maps by handle, reads
    checked against the run's regions, one reserved ringbuf record at a time (the compiled
    bounds checks know one)."""

    def __init__(self, backend: JitBackend, c: _Compiled):
        self.backend, self.c, self.e = backend, c, c.env

    def _ok(self, addr, n):
        e = self.e
        for lo, ln in ((e.stack, STACK_SIZE * MAX_FRAMES), (e.ctx, e.ctx_len), (e.mem, e.mem_len), (e.rec, e.rec_len)):
            if lo and lo <= addr and addr + n <= lo + ln:
                return True
        return any(lo <= addr and addr + n <= lo + ln for lo, ln in self.c.map_regions)

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
        return self.c.values[index] + m.value_offset(slot)

    def new_record(self, m, size) -> int:
        if self.e.rec:          # the compiled checks know one record: a second is refused
            m.dropped += 1
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
    """One load of a program: shared native code with this load's environment and address table."""

    def __init__(self, prog, fn_addr, callback):
        self.prog = prog
        self.fn_addr = fn_addr
        self.fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(fn_addr)
        self.callback = callback
        hashed = any(m.type in NATIVE_HASH for m in prog.maps)
        table = address_table(prog, ctypes.cast(callback, ctypes.c_void_p).value,
                              _library().hash_ops if hashed else (0, 0))
        self.table = (ctypes.c_uint64 * len(table))(*table)
        self.values = [table[map_slot(i, "values")] for i in range(len(prog.maps))]   # by map index
        self.map_regions = [(a, m.values.nbytes) for a, m in zip(self.values, prog.maps) if m.type != RINGBUF]
        self.env = Env()
        self.env.addrs = ctypes.addressof(self.table)
        self.env_addr = ctypes.addressof(self.env)
        self.stack = ctypes.create_string_buffer(STACK_SIZE * MAX_FRAMES)
        self.fast = False     # env holds the fixed fields (budget, stack, no memory) of the hot path
        self.proof = None     # what the code was compiled with
        self.min_ctx = 0      # the code assumes a context of at least this many bytes ...
        self.min_mem = 0      # ... and this much given memory (r1's: the context, else the memory)
        self.min_given = 0    # the larger: a run given at least this much runs this code


class JitBackend(Backend):
    """Native code through LLVM.  ``budget``, ``clock`` and ``seed`` as for the interpreter.

    ``checks``: ``unproven`` (the default) emits a run-time bounds check on every access the
    verifier did not prove; ``all`` keeps them on proven accesses too, so a verifier defect
    cannot reach host memory (defence in depth for programs from folders you do not trust;
    ``FABRIC_EXT_JIT_CHECKS=all`` sets it for a whole process)."""
    name = "jit"
    host_maps = True

    def __init__(self, budget: int = I.RUN_BUDGET, clock=None, seed: int = 1, cpu: int = 0,
                 checks: str | None = None):
        checks = checks or os.environ.get("FABRIC_EXT_JIT_CHECKS") or "unproven"
        if checks not in JIT_CHECKS:
            raise ValueError(f"JIT checks must be one of {', '.join(JIT_CHECKS)}, not '{checks}'")
        self.checks = checks
        self.budget = budget
        self.helpers = Hl.HelperState(clock or (lambda: 0), seed, cpu)
        self.current = None
        self.interrupted: BaseException | None = None   # what stopped a helper callback (`_callback`)
        self.batch_r0 = 0                 # the last batch's returns, summed
        self.records: dict[int, tuple] = {}
        self.compiled: dict[tuple, _Compiled] = {}   # per backend: helper callbacks are bound to it
        self.stats = {"compiled": 0, "cached": 0, "reused": 0, "compile_s": 0.0, "load_s": 0.0}

    # -- the Python side of helper calls ----------------------------------------------------------
    def _callback(self, hid, r1, r2, r3, r4, r5):
        """Helpers not done natively run the interpreter's implementations (`helpers.call`)
        on the native run's memory."""
        try:
            return Hl.call(self.helpers, _NativeMemory(self, self.current), hid, [0, r1, r2, r3, r4, r5]) \
                & I.MASK64
        except Exception as e:  # noqa: BLE001 - reported as a fault of the program
            self.current.env.fault = FAULT_HELPER
            self.helper_error = str(e)
            return 0
        except BaseException as e:     # Ctrl-C, or a signal's exit: ctypes would print it and go on
            self.current.env.fault = FAULT_HELPER       # the run stops at once ...
            self.interrupted = e                        # ... and `_check` raises it after
            return 0

    # -- backend interface ---------------------------------------------------------------------------------
    def load(self, prog: Program) -> _Compiled:
        if len(prog.slots) > MAX_JIT_SLOTS:
            raise InputError(f"{prog.name}: {len(prog.slots):,} instructions, more than the {MAX_JIT_SLOTS:,} the JIT "
                             "compiles (LLVM would take minutes and gigabytes): run it with --backend interp")
        return self._compile(prog, prog.proof if self.checks == "unproven" else None)

    def _compile(self, prog: Program, proof: dict | None, short_mem: bool = False) -> _Compiled:
        key = (prog.code, tuple((m.values.ctypes.data, m.values.nbytes) for m in prog.maps),
               ctx_write_mask(prog.hook, prog.ctx_size) if prog.ctx_size else b"", proof is not None, short_mem)
        if key in self.compiled:
            return self.compiled[key]
        t = time.perf_counter()
        compiled = _Compiled(prog, _native_code(prog, proof, self.budget, self.stats, short_mem),
                             CALLBACK(self._callback))
        self.stats["load_s"] += time.perf_counter() - t
        compiled.proof = proof
        compiled.min_ctx = prog.ctx_size if proof is not None else 0
        compiled.min_mem = 0 if short_mem else mem_need(prog, proof)
        compiled.min_given = max(compiled.min_ctx, compiled.min_mem)
        self.compiled[key] = compiled
        return compiled

    def load_stats(self) -> dict:
        """How this backend's programs were made ready: compiled, read from the code cache, or
        already in this process (loaded before, by this or another backend)."""
        st = self.stats
        return {"checks": self.checks, "compiled": st["compiled"], "from_cache": st["cached"], "in_process": st["reused"],
                "compile_ms": round(st["compile_s"] * 1e3, 3), "load_ms": round(st["load_s"] * 1e3, 3),
                "cache": str(code_cache().dir) if code_cache().dir else None}

    def _for_run(self, c: _Compiled, ctx_len: int | None, mem_len: int) -> _Compiled:
        """c, or where a run gives less than c assumes, the code compiled for that when the first
        such run comes: without the proof for a context shorter than the hook's (the proof
        assumes a whole one); with every access into the given memory checked for less of it
        than the proven accesses reach (`mem_need`)."""
        if c.min_ctx and (ctx_len is None or ctx_len < c.min_ctx):
            return self._compile(c.prog, None)
        given = ctx_len if ctx_len is not None else mem_len      # r1's: the context, else the memory
        if given < c.min_mem:
            return self._compile(c.prog, c.proof, short_mem=True)
        return c

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
        if c.min_given and (ctx is None or len(ctx) < c.min_given):
            c = self._for_run(c, len(ctx) if ctx is not None else None, len(mem) if mem is not None else 0)
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
        """Run the program on every row of a 2-D uint8 array of contexts, in place; returns rows
        run (``batch_r0`` is then the sum of what they returned, mod 2^64)."""
        flags = ctxs.flags
        if ctxs.ndim != 2 or ctxs.dtype != np.uint8 or not (flags.c_contiguous and flags.writeable):
            raise ValueError("contexts must be a writable C-contiguous 2-D uint8 array")
        if not ctxs.size:
            return 0
        if ctxs.shape[1] < c.min_given:
            c = self._for_run(c, ctxs.shape[1], 0)
        self.current = c
        if not c.fast:
            self._prepare(c, None, None)
            c.fast = True
        e = c.env
        e.fault, e.ctx_len, e.r0_sum = 0, ctxs.shape[1], 0
        base = ctypes.addressof(ctypes.c_char.from_buffer(ctxs))     # a third of ctxs.ctypes.data's cost
        n = (_lib or _library()).batch(c.env_addr, base, ctxs.shape[0], ctxs.shape[1], c.fn_addr)
        self.batch_r0 = e.r0_sum          # what the rows' runs returned, summed (mod 2^64)
        if e.fault:
            try:
                self._check(c)
            except VMFault as fault:
                fault.row = int(n)
                raise
        return n

    def _check(self, c):
        e = c.env
        if self.interrupted is not None:
            stop, self.interrupted = self.interrupted, None
            e.fault = 0
            raise stop
        if e.fault:
            why = FAULTS.get(e.fault, "fault")
            if e.fault == FAULT_OOB:
                why = f"out-of-bounds access at {e.fault_addr:#x}"
            elif e.fault == FAULT_BUDGET:
                why = f"instruction budget of {self.budget} exhausted"
            elif e.fault == FAULT_HELPER:
                why = f"helper call failed: {getattr(self, 'helper_error', '')}"
            elif e.fault == FAULT_SHORT:      # `_for_run` sends such a run to other code
                why = f"{e.fault_addr} bytes of given memory, less than the {c.min_mem} its code assumes"
            raise VMFault(c.prog, int(e.fault_pc), why)
