"""VM backends side by side: ns per run of the same programs on interp, jit, kernel and C.

    python bench/vm_bench.py [--quick]

Programs: a prime-counting loop, a byte-swap loop, two map-heavy counting loops (an array's
value added to in place; a hash map's looked up and written back), a memory-bound
loop (sum 512 u64 of a 4 KiB input with ``ldxdw``), and every compiled example policy replayed
on an event stream recorded from fabric-run.  Inputs come from memory (the byte-swap loop
starts from its input, the memory loop sums it) and a batch keeps every run's r0
(`JitBackend.batch_r0`), so LLVM can neither fold nor delete the work timed.  The prime loop's
bound is a constant: the verifier does not yet prove a loop bounded by its input.

Columns: ``jit_batch`` runs the contexts in one native call; ``jit_all`` is the batch again with
``--jit-checks all`` (run-time checks on proven accesses too, docs/security.md); ``kernel`` is
the kernel's own ``duration`` with ``repeat`` where the program type allows it (the loops,
loaded as XDP), else the wall time of one BPF_PROG_TEST_RUN from Python (the policy
programs: syscall programs take no repeat), marked ``*``; ``C`` is the memory loop compiled
by the system's C compiler at -O2, over the same rows.  Every figure is the minimum of the
repeats; ``noise`` is the JIT batch's median over its minimum.  ``compile ms`` is the least of
REPEATS compiles and ``compile med`` their median, the JIT's code cache off and nothing kept from the compile before (LLVM's
one-time set-up in the process is not counted).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ["FABRIC_EXT_JIT_CACHE"] = "off"     # load timings are compiles

from fabric_ext.runtime.machine import jit, kernel
from fabric_ext.runtime.machine.asm import assemble
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.jit import JitBackend
from fabric_ext.runtime.machine.maps import ARRAY, HASH, Map
from fabric_ext.runtime.machine.program import Program
from fabric_ext.runtime.machine.verifier import verify

ROOT = Path(__file__).resolve().parent.parent

PRIME = """
    mov %r0, 0          # primes found
    mov %r1, 2          # candidate
outer:
    mov %r2, 2          # divisor
inner:
    mov %r3, %r2
    mul %r3, %r2
    jgt %r3, %r1, prime
    mov %r4, %r1
    mod %r4, %r2
    jeq %r4, 0, next
    add %r2, 1
    ja inner
prime:
    add %r0, 1
next:
    add %r1, 1
    jlt %r1, 400, outer
    exit
"""
BSWAP = """
    ldxdw %r0, [%r1+0]      # from the input
    mov %r1, 0
loop:
    bswap64 %r0
    add %r0, %r1
    be32 %r0
    add %r1, 1
    jlt %r1, 256, loop
    exit
"""
# the loops that read their input, as XDP programs for the kernel: the byte-swap loop's input
# is the packet (its bounds checked first), the memory loop's a 4 KiB array map value (XDP's
# test packets are under 4 KiB)
BSWAP_XDP = """
    ldxw %r2, [%r1+0]
    ldxw %r3, [%r1+4]
    mov %r0, 0
    mov %r4, %r2
    add %r4, 8
    jgt %r4, %r3, out
    ldxdw %r0, [%r2+0]
    mov %r1, 0
loop:
    bswap64 %r0
    add %r0, %r1
    be32 %r0
    add %r1, 1
    jlt %r1, 256, loop
out:
    exit
"""
MEMSUM = """
    mov %r0, 0
    mov %r3, 0
loop:
    mov %r4, %r1
    add %r4, %r3
    ldxdw %r5, [%r4+0]
    add %r0, %r5
    add %r3, 8
    jlt %r3, 4096, loop
    exit
"""
MEMSUM_XDP = """
    mov %r6, 0
    stxw [%r10-4], %r6
    lddw %r1, 0
    mov %r2, %r10
    add %r2, -4
    call 1
    mov %r1, %r0
    mov %r0, 0
    jeq %r1, 0, out
    mov %r3, 0
loop:
    mov %r4, %r1
    add %r4, %r3
    ldxdw %r5, [%r4+0]
    add %r0, %r5
    add %r3, 8
    jlt %r3, 4096, loop
out:
    exit
"""
C_MEMSUM = """
#include <stdint.h>
uint64_t sum_rows(const uint64_t *rows, uint64_t n, uint64_t words) {
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++)
        for (uint64_t j = 0; j < words; j++)
            s += rows[i * words + j];
    return s;
}
"""
COUNT = """
    mov %r6, 0
loop:
    mov %r1, %r6
    and %r1, 3
    stxw [%r10-4], %r1
    lddw %r1, 0
    mov %r2, %r10
    add %r2, -4
    call 1
    jeq %r0, 0, skip
    mov %r1, 1
    lock add [%r0+0], %r1
skip:
    add %r6, 1
    jlt %r6, 64, loop
    mov %r0, 0
    exit
"""

# counting as C programs write it: look the key up, add one, write it back with an update
HASH_COUNT = """
    mov %r6, 0
loop:
    mov %r1, %r6
    and %r1, 3
    stxw [%r10-4], %r1
    lddw %r1, 0
    mov %r2, %r10
    add %r2, -4
    call 1
    mov %r1, 1
    jeq %r0, 0, put
    ldxdw %r1, [%r0+0]
    add %r1, 1
put:
    stxdw [%r10-16], %r1
    lddw %r1, 0
    mov %r2, %r10
    add %r2, -4
    mov %r3, %r10
    add %r3, -16
    mov %r4, 0
    call 2
    add %r6, 1
    jlt %r6, 64, loop
    mov %r0, 0
    exit
"""

def _map_fd(insns):
    """lddw 0 as the program's map 0."""
    from fabric_ext.runtime.machine import isa as I
    return [I.Insn(i.opcode, i.dst, I.PSEUDO_MAP_FD, i.off, 0) if i.is_lddw else i for i in insns]


def loop_programs():
    count = _map_fd(assemble(COUNT))
    words = np.arange(512, dtype=np.uint64).view(np.uint8)
    return [("prime loop", Program("prime", assemble(PRIME)), bytes(8), None),
            ("byte-swap loop", Program("bswap", assemble(BSWAP)), bytes(range(1, 9)), assemble(BSWAP_XDP)),
            ("map counting", Program("count", count, [Map("counts", ARRAY, 4, 8, 4)]), bytes(8), None),
            ("hash update counting", Program("hcount", _map_fd(assemble(HASH_COUNT)), [Map("counts", HASH, 4, 8, 8)]),
             bytes(8), None),
            ("memory loop 4 KiB", Program("memsum", assemble(MEMSUM)), words.tobytes(), _map_fd(assemble(MEMSUM_XDP)))]


REPEATS = 5


def compile_ms(prog) -> tuple[float, float]:
    """The least and the median of REPEATS compiles of ``prog``, each from nothing: the process
    keeps the code it made (`jit._native`), so it is dropped before each."""
    times = []
    for _ in range(REPEATS):
        jit._native.clear()
        jb = JitBackend()
        jb.load(prog)
        times.append(jb.stats["compile_s"] * 1e3)
    return min(times), float(np.median(times))


def timeit(fn, n):
    best = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best.append((time.perf_counter_ns() - t0) / n)
    return min(best)


def c_memsum():
    """The memory loop built by the system's C compiler at -O2 (None where there is none)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    d = Path(tempfile.mkdtemp(prefix="fx-bench-"))
    (d / "m.c").write_text(C_MEMSUM)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", d / "m.so", d / "m.c"], check=True)
    fn = ctypes.CDLL(str(d / "m.so")).sum_rows
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    return fn


def recorded_streams(quick):
    """(label, program, [ctx bytes]) for each program of each example, from a short run that
    records every context a program is given (the engine's context tracer)."""
    import fabric_ext
    from fabric_ext.contract.bundle import create_maps
    from fabric_ext.runtime.simulation.engine import Engine, RunOptions
    out = []
    for policy in ("prefill_qos", "kv_tiering", "nic_pacing", "telemetry"):
        bundle = fabric_ext.compile(ROOT / "policies" / f"{policy}.fx")
        streams = {}

        def record(island, hook, ctx, _streams=streams):
            rows = _streams.setdefault((island, hook), [])
            if len(rows) < 2000:
                rows.append(ctx)
        eng = Engine(bundle, bundle.manifest, create_maps(bundle.manifest), Interpreter(),
                     RunOptions(prompt=512 if quick else 2048, tp=4, context_tracer=record))
        eng.run()
        for (island, hook), ctxs in sorted(streams.items()):
            if ctxs and island in ("sw0", "gpu0", "nic0"):
                prog = eng.shims[island].programs[hook]
                out.append((f"{policy} {island}.{hook}", prog, ctxs))
    return out


def batch_ns(jb, prog, ctxs):
    """(min, median) ns per row of one native batch over ``ctxs`` (a fresh copy each time;
    the rows' results and the runs' r0 are kept, so nothing timed can be folded away)."""
    h = jb.load(prog)
    times = []
    for _ in range(REPEATS):
        rows = ctxs.copy()
        t0 = time.perf_counter_ns()
        jb.run_batch(h, rows)
        times.append((time.perf_counter_ns() - t0) / len(rows))
    return min(times), float(np.median(times))


def bench_loop(label, prog, data, xdp, ok_kernel, n, c_fn):
    verify(prog)
    row = {"program": label}
    vm = Interpreter()
    h = vm.load(prog)
    row["interp"] = timeit(lambda: vm.run(h, mem=bytearray(data)), max(1, n // 100))
    jb = JitBackend()
    hj = jb.load(prog)
    row["jit"] = timeit(lambda: jb.run(hj, mem=bytearray(data)), n)
    row["compile ms"], row["compile med"] = compile_ms(prog)
    ctxs = np.tile(np.frombuffer(data, np.uint8), (n, 1))
    row["jit_batch"], row["median"] = batch_ns(jb, prog, ctxs)
    row["jit_all"], _ = batch_ns(JitBackend(checks="all"), prog, ctxs)
    if c_fn is not None and label.startswith("memory"):
        rows = ctxs.copy()
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter_ns()
            c_fn(rows.ctypes.data, len(rows), rows.shape[1] // 8)
            times.append((time.perf_counter_ns() - t0) / len(rows))
        row["C"] = min(times)
    if ok_kernel:
        kb = kernel.KernelBackend()
        try:
            packet = bytes(64)
            if xdp is None:
                insns = kb.relocate(prog)
            elif len(data) > 64:              # the input in a map value
                table = Map("input", ARRAY, 4, len(data), 1)
                table.update((0).to_bytes(4, "little"), data)
                insns = kb.relocate(Program(prog.name, xdp, [table]))
            else:                             # the input in the packet
                insns, packet = kb.relocate(Program(prog.name, xdp)), data.ljust(64, b"\0")
            xfd = kernel.load_program(insns, prog.name, prog_type=kernel.PROG_TYPE_XDP)
            _, dur = kernel.test_run(xfd, data=packet, repeat=1000)
            row["kernel"] = float(dur)
            os.close(xfd)
        finally:
            kb.close()
    return row


def bench_stream(label, prog, ctxs, ok_kernel):
    row = {"program": label}
    bufs = [bytearray(c) for c in ctxs]
    vm = Interpreter()
    h = vm.load(prog)
    row["interp"] = timeit(lambda: [vm.run(h, bytearray(b)) for b in bufs[:200]], 1) / min(200, len(bufs))
    jb = JitBackend()
    hj = jb.load(prog)
    row["compile ms"], row["compile med"] = compile_ms(prog)
    row["jit"] = timeit(lambda: [jb.run(hj, bytearray(b)) for b in bufs], 1) / len(bufs)
    arr = np.frombuffer(b"".join(ctxs), dtype=np.uint8).reshape(len(ctxs), -1).copy()
    reps = max(1, 10000 // len(ctxs))
    big = np.tile(arr, (reps, 1))
    row["jit_batch"], row["median"] = batch_ns(jb, prog, big)
    row["jit_all"], _ = batch_ns(JitBackend(checks="all"), prog, big)
    if ok_kernel:
        kb = kernel.KernelBackend()
        try:
            hk = kb.load(prog)
            row["kernel"] = timeit(lambda: [kb.run(hk, bytearray(b)) for b in bufs[:500]], 1) / min(500, len(bufs))
            row["kernel_is_call"] = True
        finally:
            kb.close()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    ok, why = kernel.permitted()
    if not ok:
        print(f"kernel backend skipped: {why}")
    c_fn = c_memsum()
    if c_fn is None:
        print("C column skipped: no C compiler (cc, gcc or clang) on PATH")
    n = 200 if args.quick else 2000
    rows = [bench_loop(label, prog, data, xdp, ok, n, c_fn) for label, prog, data, xdp in loop_programs()]
    rows += [bench_stream(label, prog, ctxs, ok) for label, prog, ctxs in recorded_streams(args.quick)]
    cols = ["interp", "jit", "jit_batch", "jit_all", "kernel", "C", "compile ms", "compile med"]
    print(f"{'program':<34}" + "".join(f"{c:>12}" for c in cols) + f"{'jit/kernel':>12}{'jit/C':>8}"
          f"{'all/unproven':>14}{'noise':>8}")
    for r in rows:
        cells = "".join((f"{r[c]:>11.1f}" + ("*" if c == "kernel" and r.get("kernel_is_call") else " "))
                        if c in r else f"{'-':>11} " for c in cols)
        kern = r.get("kernel")
        mine = r["jit"] if r.get("kernel_is_call") else r["jit_batch"]
        ratio_k = f"{mine / kern:>12.2f}" if kern else f"{'-':>12}"
        ratio_c = f"{r['jit_batch'] / r['C']:>8.2f}" if "C" in r else f"{'-':>8}"
        print(f"{r['program']:<34}{cells}{ratio_k}{ratio_c}{r['jit_all'] / r['jit_batch']:>14.2f}"
              f"{r['median'] / r['jit_batch']:>8.2f}")
    print("\nns per run (minimum of the repeats); kernel: the kernel's own per-run duration with repeat=1000")
    print("(loops, as XDP); * the wall time of one BPF_PROG_TEST_RUN from Python (syscall programs take no")
    print("repeat). jit/kernel compares jit_batch with the kernel's duration, and jit with a * call;")
    print("noise is the JIT batch's median over its minimum; compile ms and compile med the least and the")
    print(f"median of {REPEATS} compiles, each from nothing (code cache off).")


if __name__ == "__main__":
    main()
