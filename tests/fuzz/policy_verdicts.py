"""Random policies compiled and judged twice, by this verifier and by the running kernel's.

Each generated policy (prefill_qos's fabric, movements and maps, with random handlers on
the switch's forward, the GPUs' issue, the NIC's tx and a tick) is compiled; every
program is then verified here and loaded into the kernel (BPF_PROG_TYPE_SYSCALL). A
disagreement is printed with its seed: a program the kernel refuses and this verifier
accepts is a compatibility bug (the kernel is the judge); one the kernel accepts and this
verifier refuses is a gap (issue 16: "every program the kernel accepts within its
1M-instruction limit is accepted here too").  Needs bpf(2) (root).

    python tests/fuzz/policy_verdicts.py --seed 1 --count 50 [--size 4] [--budget 1000000]

Reproduce one case with ``--seed N --count 1 --write case.fx``.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from fabric_ext.codegen import driver
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine import kernel
from fabric_ext.runtime.machine.elf import load_object
from fabric_ext.runtime.machine.verifier import VerifierError, verify

POLICIES = Path(__file__).resolve().parents[2] / "policies"
COUNTS = ["ev.layer", "ev.out_port", "ev.in_port", "ev.chunk", "ev.hop", "ev.movement"]
MAPS = "map cnt : array<u32, u64>[64]\nmap h2 : hash<u64, u64>[128]\nmap lr : lru_hash<u64, u64>[32]\n" \
       "map ring : ringbuf[4096]\n"


class Policy:
    """One random policy: expressions of count fields, map reads, updates, emits, loops."""

    def __init__(self, rng: random.Random, size: int):
        self.r, self.size, self.lets = rng, size, 0

    def expr(self, d=0) -> str:
        r, k = self.r, self.r.random()
        if d > 3 or k < 0.3:
            return r.choice(COUNTS + ["1", "7", "4096"])
        if k < 0.5:
            return f"({self.expr(d + 1)} {r.choice(['+', '-', '*', '/', '%', '&', '|', '^', '<<', '>>'])} {self.expr(d + 1)})"
        if k < 0.65:
            return f"{r.choice(['cnt', 'h2', 'lr'])}[{self.expr(d + 1)} % 64] ?? {r.randint(0, 9)}"
        return f"{r.choice(['min', 'max'])}({self.expr(d + 1)}, {self.expr(d + 1)})"

    def stmt(self, decisions: list[str], d=0) -> str:
        r, k = self.r, self.r.random()
        if d < 3 and k < 0.2:
            return f"if {self.expr()} > {self.expr()} {{ {self.block(decisions, d + 1)} }} " \
                   f"else {{ {self.block(decisions, d + 1)} }}"
        if d < 2 and k < 0.28:
            return f"for i in 0..{r.choice([2, 8, 64, 300])} {{ cnt[i % 64] += {self.expr(d + 1)} }}"
        if k < 0.45:
            op = r.choice(["=", "+=", "-=", "|=", "&=", "max=", "min="])
            return f"{r.choice(['cnt', 'h2', 'lr'])}[{self.expr()} % 64] {op} {self.expr()}"
        if k < 0.55:
            self.lets += 1
            return f"let v{self.lets} = {self.expr()}"
        if k < 0.62:
            return f"emit ring({', '.join(self.expr() for _ in range(r.randint(1, 6)))})"
        if k < 0.7:
            return f"delete h2[{self.expr()}]"
        return r.choice(decisions)

    def block(self, decisions, d=0) -> str:
        return " ".join(self.stmt(decisions, d) for _ in range(self.r.randint(1, self.size)))

    def text(self) -> str:
        head = (POLICIES / "prefill_qos.fx").read_text().split("policy prefill_qos")[0]
        head = head.replace('import "fabrics/', f'import "{POLICIES}/fabrics/').replace("map kv_bytes", MAPS + "map kv_bytes")
        forward = ["priority = 1", "priority = 7", "rate = 16GB/s", "defer = 1us"]
        handlers = [f"on {m}.forward at sw0 {{ {self.block(forward)} }}" for m in ("kv_writeback", "kv_export")]
        handlers.append(f"on kv_writeback.issue at gpu* {{ {self.block(['stream = 2', 'coalesce = 4MiB'])} }}")
        handlers.append(f"on kv_export.tx at nic0 {{ {self.block(['rate = 25GB/s', 'queue = 1'])} }}")
        handlers.append("on sw0.tick(10us) { port_util[ev.port] = ev.util_pct }")
        return head + "policy fuzz {\n" + "".join(f"  {h}\n" for h in handlers) + "}\n"


def compile_unjudged(path: Path):
    """The policy's `CompileResult`, its programs not verified (None: not a valid policy)."""
    ours = driver.verify
    driver.verify = lambda prog: None
    try:
        return driver.build(path, diags=Diagnostics())
    finally:
        driver.verify = ours


def judge(path: Path, budget: int) -> list[str]:
    """Each program's disagreement between the two verifiers, as lines (none: they agree)."""
    res = compile_unjudged(path)
    if res is None:
        return []                             # not a valid policy: nothing to judge
    out = []
    kb = kernel.KernelBackend()
    try:
        for name in sorted(n for n in res.files if n.endswith(".bpf.o") and n.startswith(("sw0", "gpu0", "nic0"))):
            for prog in load_object(res.files[name], name).instantiate():
                t = time.perf_counter()
                try:
                    verify(prog, budget)
                    we = None
                except VerifierError as e:
                    we = e.msg
                took = time.perf_counter() - t
                try:
                    kb.load(prog)
                    they = None
                except kernel.KernelVerifierError as e:
                    they = e.log.strip().splitlines()[-2] if e.log.strip() else str(e)
                if (we is None) != (they is None):
                    out.append(f"{prog.name} ({len(prog.insns)} insns, ours {took:.1f} s): "
                               f"ours {'accepts' if we is None else 'rejects: ' + we[:200]}; "
                               f"the kernel {'accepts' if they is None else 'rejects: ' + they[:200]}")
    finally:
        kb.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--size", type=int, default=4, help="most statements per block")
    ap.add_argument("--budget", type=int, default=1_000_000, help="this verifier's instruction budget")
    ap.add_argument("--write", type=Path, help="write the (last) policy here")
    args = ap.parse_args(argv)
    ok, why = kernel.permitted()
    if not ok:
        print(f"policy_verdicts: {why}", file=sys.stderr)
        return 2
    found = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seed, args.seed + args.count):
            path = args.write or Path(tmp) / f"{seed}.fx"
            path.write_text(Policy(random.Random(seed), args.size).text())
            for line in judge(path, args.budget):
                found += 1
                print(f"seed {seed}: {line}", flush=True)
    print(f"{args.count} policies from seed {args.seed}: {found} disagreements")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
