"""VM backends side by side: ns per run of the same programs on interp, jit and kernel.

    python bench/vm_bench.py [--quick]

Programs: a prime-counting loop, a byte-swap loop, a map-heavy counting loop, and every
compiled example policy replayed on an event stream recorded from fabric-run.  For the
kernel, the wall time per BPF_PROG_TEST_RUN call from Python, and the kernel's own
``duration`` with ``repeat`` (the loops loaded as XDP programs, which accept repeat).
``jit_all`` is the batch again with ``--jit-checks all`` (run-time checks on proven accesses
too, docs/security.md); ``all/unproven`` is what that defence costs.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from fabric_ext.runtime.machine import kernel
from fabric_ext.runtime.machine.asm import assemble
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.jit import JitBackend
from fabric_ext.runtime.machine.maps import ARRAY, Map
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
    lddw %r0, 0x0102030405060708
    mov %r1, 0
loop:
    bswap64 %r0
    add %r0, %r1
    be32 %r0
    add %r1, 1
    jlt %r1, 256, loop
    exit
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


def loop_programs():
    count = assemble(COUNT)
    from fabric_ext.runtime.machine import isa as I
    count = [I.Insn(i.opcode, i.dst, I.PSEUDO_MAP_FD, i.off, 0) if i.is_lddw else i for i in count]
    return [("prime loop", Program("prime", assemble(PRIME)), None),
            ("byte-swap loop", Program("bswap", assemble(BSWAP)), None),
            ("map counting", Program("count", count, [Map("counts", ARRAY, 4, 8, 4)]), None)]


def timeit(fn, n):
    best = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best.append((time.perf_counter_ns() - t0) / n)
    return min(best)


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
    """ns per row of one native batch over ``ctxs`` (a fresh copy each time: results are kept
    in the rows, so nothing timed can be folded away); the best of three."""
    h = jb.load(prog)
    best = []
    for _ in range(3):
        rows = ctxs.copy()
        t0 = time.perf_counter_ns()
        jb.run_batch(h, rows)
        best.append((time.perf_counter_ns() - t0) / len(rows))
    return min(best)


def bench_loop(label, prog, ok_kernel, n):
    verify(prog)
    row = {"program": label}
    vm = Interpreter()
    h = vm.load(prog)
    row["interp"] = timeit(lambda: vm.run(h, mem=bytearray(8)), max(1, n // 100))
    jb = JitBackend()
    hj = jb.load(prog)
    row["jit"] = timeit(lambda: jb.run(hj, mem=bytearray(8)), n)
    ctxs = np.zeros((n, 8), dtype=np.uint8)
    row["jit_batch"] = batch_ns(jb, prog, ctxs)
    row["jit_all"] = batch_ns(JitBackend(checks="all"), prog, ctxs)
    if ok_kernel:
        kb = kernel.KernelBackend()
        try:
            insns = kb.relocate(prog)
            fd = kernel.load_program(insns, prog.name)
            row["kernel_call"] = timeit(lambda: kernel.test_run(fd, bytearray(8)), n)
            os.close(fd)
            xfd = kernel.load_program(insns, prog.name, prog_type=kernel.PROG_TYPE_XDP)
            _, dur = kernel.test_run(xfd, data=bytes(64), repeat=1000)
            row["kernel_duration"] = float(dur)
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
    row["jit"] = timeit(lambda: [jb.run(hj, bytearray(b)) for b in bufs], 1) / len(bufs)
    arr = np.frombuffer(b"".join(ctxs), dtype=np.uint8).reshape(len(ctxs), -1).copy()
    reps = max(1, 10000 // len(ctxs))
    big = np.tile(arr, (reps, 1))
    row["jit_batch"] = batch_ns(jb, prog, big)
    row["jit_all"] = batch_ns(JitBackend(checks="all"), prog, big)
    if ok_kernel:
        kb = kernel.KernelBackend()
        try:
            hk = kb.load(prog)
            row["kernel_call"] = timeit(lambda: [kb.run(hk, bytearray(b)) for b in bufs[:500]], 1) / min(500, len(bufs))
        finally:
            kb.close()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    ok, why = kernel.permitted()
    if not ok:
        print(f"kernel backend skipped: {why}")
    n = 200 if args.quick else 2000
    rows = [bench_loop(label, prog, ok, n) for label, prog, _ in loop_programs()]
    rows += [bench_stream(label, prog, ctxs, ok) for label, prog, ctxs in recorded_streams(args.quick)]
    cols = ["interp", "jit", "jit_batch", "jit_all", "kernel_call", "kernel_duration"]
    print(f"{'program':<34}" + "".join(f"{c:>16}" for c in cols) + f"{'jit/kernel':>12}{'interp/jit':>12}"
          f"{'all/unproven':>14}")
    for r in rows:
        cells = "".join(f"{r[c]:>16.1f}" if c in r else f"{'-':>16}" for c in cols)
        kern = r.get("kernel_duration") or r.get("kernel_call")
        mine = r["jit_batch"] if r.get("kernel_duration") else r["jit"]
        ratio_k = f"{mine / kern:>12.2f}" if kern else f"{'-':>12}"
        print(f"{r['program']:<34}{cells}{ratio_k}{r['interp'] / r['jit']:>12.1f}"
              f"{r['jit_all'] / r['jit_batch']:>14.2f}")
    print("\nns per run; kernel_call is wall time per BPF_PROG_TEST_RUN from Python, kernel_duration the kernel's")
    print("own per-run time with repeat=1000 (loops only, loaded as XDP); jit_batch runs >= 10,000 recorded")
    print("events (or the loops over 2,000 contexts) in one native call; jit/kernel compares jit_batch with")
    print("kernel_duration for the loops (both without the Python call) and jit with kernel_call otherwise.")


if __name__ == "__main__":
    main()
