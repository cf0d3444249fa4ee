"""The verifier against the kernel's, on the same programs: steps and time side by side.

    python bench/verifier_bench.py [--budget 1000000] [--repeat 5]

Each program is verified here (steps it explored, wall seconds, or why it was refused) and,
where bpf(2) is permitted, loaded into the running kernel with BPF_LOG_STATS (`processed N
insns`, `verification time`), --repeat times each: the least seconds and, beside them, the
median (the machine's noise).  The programs: every bundled policy's, the prime
loop of 10,007 (widening), 2**20 paths differing in a number whose range decides nothing
(precision) or decides a branch (nothing to prune: the worst case), and generated policies
the kernel accepts (tests/fuzz/policy_verdicts.py).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzz.policy_verdicts import Policy, compile_unjudged  # noqa: E402

from fabric_ext.runtime.machine import kernel  # noqa: E402
from fabric_ext.runtime.machine.asm import assemble  # noqa: E402
from fabric_ext.runtime.machine.elf import load_object  # noqa: E402
from fabric_ext.runtime.machine.maps import ARRAY, Map  # noqa: E402
from fabric_ext.runtime.machine.program import Program  # noqa: E402
from fabric_ext.runtime.machine.verifier import VerifierError, verify  # noqa: E402

PRIME = ("mov %r0, 0\nmov %r1, 2\nouter:\nmov %r2, 2\ninner:\nmov %r3, %r2\nmul %r3, %r2\njgt %r3, %r1, prime\n"
         "mov %r4, %r1\nmod %r4, %r2\njeq %r4, 0, next\nadd %r2, 1\nja inner\nprime:\nadd %r0, 1\nnext:\n"
         "add %r1, 1\njlt %r1, 10007, outer\nexit")


STATS = ("processed ", "verification time", "stack depth")
LONG_S = 10.0           # a verification this long runs once: the refused worst case takes about 30 s


def diamonds(decided: bool = False) -> Program:
    """20 branches on bits of the input, each OR-ing its own bit into r7 on one path; r7 ends
    in a map value.  ``decided``: a branch on r7 first needs its range, so no two of the 2**20
    paths meet (the worst case: the whole budget explored, then refused)."""
    lines = ["ldxdw %r6, [%r1+0]", "mov %r7, 0"]
    for i in range(20):
        lines += [f"jset %r6, {1 << i}, j{i}", f"or %r7, {1 << i}", f"j{i}:"]
    if decided:
        lines.append("jgt %r7, 100000000, out")
    lines += ["stw [%r10-4], 0", "mov %r2, %r10", "add %r2, -4", "lddw %r1, map 0", "call 1",
              "jeq %r0, 0, out", "stxdw [%r0+0], %r7", "out:", "mov %r0, 0", "exit"]
    return Program("diamonds", assemble("\n".join(lines)), [Map("v", ARRAY, 4, 8, 1)], ctx_size=8)


def policy_programs(path: Path, names=None) -> list[Program]:
    res = compile_unjudged(path)
    out = []
    for file in sorted(n for n in res.files if n.endswith(".bpf.o")):
        out += [p for p in load_object(res.files[file], file).instantiate() if names is None or p.name in names]
    return out


def generated(seed: int, size: int, name: str) -> list[Program]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.fx"
        path.write_text(Policy(random.Random(seed), size).text())
        return policy_programs(path, {name})


def ours(progs: list[Program], budget: int, repeat: int) -> str:
    """Steps and seconds of verifying ``progs`` here, or why they were refused, over
    ``repeat`` runs (one, where a run takes more than LONG_S)."""
    times, steps, refused = [], 0, ""
    for _ in range(repeat):
        t, steps = time.perf_counter(), 0
        try:
            for p in progs:
                steps += verify(p, budget)
        except VerifierError as e:
            refused = e.msg.split(":")[0][:30]
        times.append(time.perf_counter() - t)
        if times[-1] > LONG_S:
            break
    return f"refused after {_spread(times)}: {refused}" if refused else f"{steps:,} steps, {_spread(times)}"


def theirs(progs: list[Program], repeat: int) -> str:
    """The same in the running kernel: its steps and its own verification time."""
    ok, why = kernel.permitted()
    if not ok:
        return why
    kb = kernel.KernelBackend()
    times = []
    try:
        for _ in range(repeat):
            steps = usec = 0
            for p in progs:
                try:
                    log = kernel.verifier_stats(kb.relocate(p), p.name)
                except kernel.KernelVerifierError:
                    return f"refused: {_why(kb.relocate(p), p.name)}"[:70]
                steps += int(re.search(r"processed (\d+) insns", log).group(1))
                usec += int(re.search(r"verification time (\d+) usec", log).group(1))
            times.append(usec / 1e6)
    finally:
        kb.close()
    return f"{steps:,} steps, {_spread(times)}"


def _spread(times: list[float]) -> str:
    """The least of the runs' seconds, and their median: the machine's noise."""
    if len(times) == 1:
        return f"{times[0]:.3f} s"
    return f"{min(times):.3f} s (median {statistics.median(times):.3f})"


def _why(insns, name) -> str:
    """The line of the kernel's full log that says why it refused the program."""
    try:
        os.close(kernel.load_program(insns, name))
        return "accepted on a second try"
    except kernel.KernelVerifierError as e:
        lines = [line for line in e.log.strip().splitlines() if not line.startswith(STATS)]
        return lines[-1] if lines else str(e)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=1_000_000, help="this verifier's instruction budget")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each program, least and median shown (default 5)")
    args = ap.parse_args(argv)
    bundled = [p for f in sorted((ROOT / "policies").glob("*.fx")) for p in policy_programs(f)]
    cases = [(f"the bundled policies' {len(bundled)} programs", bundled),
             ("prime loop of 10,007", [Program("prime", assemble(PRIME))]),
             ("2**20 paths, a number deciding nothing", [diamonds()]),
             ("2**20 paths, a number deciding a branch", [diamonds(decided=True)]),
             ("generated policy, seed 5: gpu0_issue", generated(5, 4, "gpu0_issue")),
             ("generated policy, seed 1: nic0_tx", generated(1, 4, "nic0_tx")),
             ("generated policy, seed 11: sw0_forward", generated(11, 3, "sw0_forward"))]
    print(f"{'program':44} {'this verifier':48} the kernel's")
    for name, progs in cases:
        print(f"{name:44} {ours(progs, args.budget, args.repeat):48} {theirs(progs, args.repeat)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
