"""Random policies run twice: with every shortcut the simulator takes, and as the reference.

The shortcuts keep a run's meaning and change only its time: trains and rings step a
server's round robin inside one event (`trains`), decisions stand for a transfer's chunks
(`HookSite`) or are remembered by their fields (`dispatch`), programs that only watch run in
batches (`observers`), and ticks run lazily, when something reads what they write (`ticks`).
The reference takes none: an event at every end of transmission and arrival, every program
run at its event, every tick at its time.  Each generated policy (prefill_qos's movements
and maps, on its fabric or on one of two switches, half the time with a movement or two routed
through a device `via`, and with their own chunk sizes; random handlers at every chunk hook with
decisions and map updates, conditions on fields that vary per chunk and on entries a tick
writes; under a random workload) runs both ways; any difference of the report, map contents
included, but for the timings and the loop's event count, is printed with its seed: a
shortcut that changes what a run computes.  With ``--kernel`` the run with shortcuts also
runs with its programs in the Linux kernel (root), which must give the same report but for
an LRU map's evictions; with ``--interp``, in the reference interpreter, which must give the
same report.

    python tests/fuzz/shortcuts.py --seed 1 --count 50 [--size 3] [--model llama3-8b] [--kernel] [--interp]

Reproduce one case with ``--seed N --count 1 --write case.fx``.
"""
from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
from pathlib import Path

from fabric_ext.codegen.driver import build
from fabric_ext.contract.bundle import create_maps, load_manifest, write_folder
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine.backends import get_backend
from fabric_ext.runtime.simulation import dispatch
from fabric_ext.runtime.simulation.engine import Engine, RunOptions
from fabric_ext.runtime.simulation.workload import WorkloadError

POLICIES = Path(__file__).resolve().parents[2] / "policies"
# more movements (KV read back: by a chunked prefill's later passes), and maps of every kind,
# small enough that an LRU evicts, a ring drops and their order shows
MORE = ("movement kv_reload = kv : pool0 -> gpu*\nmovement kv_spilled = kv : cpu0 -> gpu*\n"
        "map cnt : hash<u64, u64>[256]\nmap sizes : array<u32, size>[64]\nmap recent : lru_hash<u64, u64>[8]\n"
        "map each : percpu_array<u32, u64>[8]\nmap ring : ringbuf[4KiB]\nmap hsizes : hist<size>\n")
# what a chunk hook's handler reads: counts, and what varies with the fabric's state (compared)
CHUNK_COUNTS = ["ev.layer", "ev.chunk", "ev.hop", "ev.out_port", "ev.in_port", "ev.critical"]
CHUNK_COMPARED = [("ev.bytes", ["512KiB", "1MiB", "2MiB"]), ("ev.queue_bytes", ["0B", "2MiB", "8MiB"]),
                  ("ev.queued_ahead_hi", ["0B", "4MiB"]), ("now", ["50us", "1ms"]),
                  ("port_util[ev.out_port]", ["20%", "80%"]), ("port_util[ev.in_port]", ["50%"])]
CHUNK = (CHUNK_COUNTS, CHUNK_COMPARED)
LAUNCH = (["ev.layer", "ev.operator"], [("ev.stall", ["0ns", "10us"]), ("now", ["1ms"]), ("port_util[3]", ["50%"])])
TICK = (["ev.port"], [("ev.peer", ["gpu1"]), ("ev.util_pct", ["10%", "60%"]), ("ev.queue_bytes", ["0B", "4MiB"])])
ALLOC = (["ev.layer", "ev.class"], [("ev.bytes", ["16MiB", "64MiB"])])
# (event, decisions its hook takes, what it reads)
HANDLERS = [
    ("attn_weights.issue at gpu*", ["priority", "defer", "prefetch", "stream", "rate"], CHUNK),
    ("ffn_weights.issue at gpu*", ["priority", "prefetch", "coalesce", "stream"], CHUNK),
    ("attn_weights.forward at sw0", ["priority", "rate", "defer"], CHUNK),
    ("ffn_weights.forward at sw0", ["priority", "rate"], CHUNK),
    ("kv_writeback.issue at gpu*", ["priority", "rate", "defer", "coalesce", "stream"], CHUNK),
    ("kv_writeback.forward at sw0", ["priority", "rate", "defer", "route"], CHUNK),
    ("kv_export.forward at sw0", ["priority", "rate"], CHUNK),
    ("kv_reload.forward", ["priority", "rate", "defer"], CHUNK),
    ("kv_spilled.issue at gpu*", ["priority", "stream", "defer"], CHUNK),
    ("kv_reload.complete at gpu*", ["prefetch"], CHUNK),
    ("kv_export.tx at nic0", ["rate", "coalesce", "queue", "priority"], CHUNK),
    ("kv_export.complete at nic0", [], CHUNK),
    ("allreduce.issue at gpu*", ["priority", "stream"], CHUNK),
    ("allreduce.dequeue at gpu*", [], CHUNK),
    ("ffn_weights.complete at gpu*", ["prefetch"], CHUNK),
    ("kv_writeback.dequeue at sw0", [], CHUNK),
    ("attn_weights.dequeue at sw0", [], CHUNK),
    ("kv_writeback.mem_access at sw0", ["priority", "rate", "defer", "tier"], CHUNK),
    ("gpu*.launch", ["prefetch"], LAUNCH),
    ("gpu*.tick(20us)", [], TICK),
    ("nic0.tick(10us)", [], TICK),
    ("cpu0.alloc", ["tier"], ALLOC),
]
# a fabric of another shape than dgx_cxl, with the same device names: two switches, the pool
# behind the second, NVLink within each half only (so an all-reduce crosses both switches),
# a host memory with a bandwidth, a DPU with a latency, and links of drawn bandwidths
TWO_SWITCHES = """fabric two {{
  gpu gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7 {{ hbm: 80GiB }}
  cxl_switch sw0 {{ ports: 16; hop: 100ns }}
  cxl_switch sw1 {{ ports: 16; hop: 250ns }}
  cxl_mem pool0 at sw1 {{ capacity: 1TiB; bw: {pool}; latency: 250ns }}
  dpu nic0 {{ line_rate: 200Gbps; latency: 2us }}
  host cpu0 {{ dram: 512GiB; dram_bw: {dram} }}
  link sw0 <-> sw1 {{ bw: {trunk}; latency: 300ns; kind: cxl }}
  link nic0 <-> sw0 {{ bw: 63GB/s; latency: 600ns; kind: pcie }}
  link cpu0 <-> sw0 {{ bw: 63GB/s; latency: 600ns; kind: pcie }}
{links}}}
"""


def two_switches(r: random.Random) -> str:
    links = [f"  link gpu{g} <-> sw{g // 4} {{ bw: {r.choice(['32GB/s', '63GB/s'])}; latency: 600ns; kind: cxl }}\n"
             for g in range(8)]
    links += [f"  link gpu{a} <-> gpu{b} {{ bw: 450GB/s; latency: 1us; kind: nvlink }}\n"
              for a in range(8) for b in range(a + 1, 8) if a // 4 == b // 4]
    return TWO_SWITCHES.format(pool=r.choice(["32GB/s", "64GB/s"]), dram=r.choice(["50GB/s", "200GB/s"]),
                               trunk=r.choice(["32GB/s", "63GB/s", "126GB/s"]), links="".join(links))


# devices a movement's flows may be routed through (`via`): switches, and the devices a path
# does not usually cross (a GPU, the host, the DPU, the pool), where a chunk passes through an
# island, a wire's device or a memory on its way; sw1 on the two-switch fabric only
VIAS = {"kv_writeback": ["sw0", "sw1", "nic0", "cpu0", "gpu0"], "kv_export": ["sw1", "cpu0", "pool0", "gpu1"],
        "attn_weights": ["sw0", "sw1", "gpu0", "cpu0", "nic0"], "ffn_weights": ["nic0", "sw0"],
        "allreduce": ["sw0", "sw1", "gpu3"], "kv_reload": ["cpu0", "sw0"], "kv_spilled": ["pool0", "sw1"]}

VALUES = {
    "priority": lambda r: str(r.randint(0, 7)),
    "rate": lambda r: r.choice(["8GB/s", "16GB/s", "40GB/s", "64GB/s"]),
    "defer": lambda r: r.choice(["1us", "5us", "20us"]),
    "prefetch": lambda r: str(r.randint(1, 3)),
    "coalesce": lambda r: r.choice(["4MiB", "8MiB"]),
    "stream": lambda r: str(r.randint(1, 4)),
    "queue": lambda r: str(r.randint(0, 3)),
    "route": lambda r: r.choice(["pool0", "cpu0"]),
    "tier": lambda r: r.choice(["pool0", "cpu0", "gpu0"]),
}


class Policy:
    """One random policy over prefill_qos's movements and maps."""

    def __init__(self, rng: random.Random, size: int):
        self.r, self.size = rng, size
        self.counts, self.compared = CHUNK

    def expr(self, d=0) -> str:
        """A count."""
        r, k = self.r, self.r.random()
        if d > 2 or k < 0.5:
            return r.choice(self.counts + ["1", "3"])
        if k < 0.8:
            return f"({self.expr(d + 1)} {r.choice(['+', '-', '*', '/', '%', '&', '>>'])} {self.expr(d + 1)})"
        return f"(cnt[{self.expr(d + 1)} % 256] ?? {r.randint(0, 9)})"

    def cond(self) -> str:
        r = self.r
        if r.random() < 0.4:
            return f"{self.expr()} > {self.expr()}"
        field, bounds = r.choice(self.compared)
        return f"{field} > {r.choice(bounds)}"

    def stmt(self, decisions: list[str], d=0) -> str:
        r, k = self.r, self.r.random()
        if "ev.util_pct" in dict(self.compared) and r.random() < 0.15:
            return "port_util[ev.port] = ev.util_pct"       # a tick writes what others read
        if d < 2 and k < 0.3:
            return (f"if {self.cond()} {{ {self.block(decisions, d + 1)} }} "
                    f"else {{ {self.block(decisions, d + 1)} }}")
        if k < 0.4 or not decisions:
            op = r.choice(["=", "+=", "max=", "min="])
            return f"{r.choice(['cnt', 'cnt', 'recent', 'each'])}[{self.expr()} % 256] {op} {self.expr()}"
        if k < 0.45:
            return r.choice([f"emit ring({self.expr()}, now)",
                             f"hsizes = hist({r.choice([f for f, b in self.compared if b[0][-1] == 'B'] or ['1KiB'])})"])
        if k < 0.5:
            size = [f for f, bounds in self.compared if bounds[0][-1] == "B"]
            return f"sizes[{self.expr()} % 64] {r.choice(['+=', 'max='])} {r.choice(size or ['1KiB'])}"
        name = r.choice(decisions)
        return f"{name} = {VALUES[name](r)}"

    def block(self, decisions, d=0) -> str:
        return " ".join(self.stmt(decisions, d) for _ in range(self.r.randint(1, self.size)))

    def text(self) -> str:
        r = self.r
        head = (POLICIES / "prefill_qos.fx").read_text().split("policy prefill_qos")[0]
        head = head.replace('import "fabrics/', f'import "{POLICIES}/fabrics/').replace("map kv_bytes", MORE + "map kv_bytes")
        shaped = r.random() < 0.4
        if shaped:
            head = head.replace(f'import "{POLICIES}/fabrics/dgx_cxl.fx"', two_switches(r))
        head = head.replace("weights: pool0", f"weights: {r.choice(['pool0', 'pool0', 'hbm', 'cpu0'])}")
        head = head.replace("kv: pool0", f"kv: {r.choice(['pool0', 'pool0', 'hbm', 'cpu0'])}")
        head = head.replace("chunk: 2MiB", f"chunk: {r.choice(['512KiB', '1MiB', '2MiB'])}"
                            + r.choice(["", "", "; prefill_chunk: 256"]))
        handlers = [f"on sw0.tick({r.choice(['5us', '10us', '50us'])}) {{ port_util[ev.port] = ev.util_pct }}"]
        # drawn with replacement: two handlers of one event merge their decisions
        for event, decisions, (self.counts, self.compared) in r.choices(HANDLERS, k=r.randint(2, 6)):
            if shaped:
                event = event.replace("mem_access at sw0", "mem_access at sw1")
            when = f" when {self.cond()}" if r.random() < 0.2 else ""
            handlers.append(f"on {event}{when} {{ {self.block(decisions)} }}")
        return self.routed(head, shaped) + "policy fuzz {\n" + "".join(f"  {h}\n" for h in handlers) + "}\n"

    def routed(self, head: str, shaped: bool) -> str:
        """``head`` with, half the time each, one or two movements routed through a device
        (`VIAS`) and one or two given their own chunk size and criticality (drawn after the
        rest, so a seed's handlers are those it drew before these were)."""
        r = self.r
        if r.random() < 0.5:
            for name in r.sample(sorted(VIAS), r.randint(1, 2)):
                via = r.choice([d for d in VIAS[name] if shaped or d != "sw1"])
                head = re.sub(rf"(movement {name} .*?(->|<->)\s*\S+)", rf"\1 via {via}", head, count=1)
        if r.random() < 0.5:
            for name in r.sample(sorted(VIAS), r.randint(1, 2)):
                props = r.choice(["critical; ", ""]) + f"chunk: {r.choice(['256KiB', '1MiB', '4MiB'])}"
                head = re.sub(rf"(movement {name} [^{{\n]*?)\s*(\{{[^}}]*\}})?\n", rf"\1 {{ {props} }}\n", head, count=1)
        return head


def _timeless(report: dict) -> dict:
    """The report without what only the time a run takes, or the loop's events, may change."""
    return {**report, "events": 0, "backend": None, "backend_load": None,
            "islands": [{k: v for k, v in i.items() if k not in ("ns_per_invocation", "invocations")}
                        for i in report["islands"]]}


def _run(folder: Path, reference: bool, backend: str = "jit", **workload) -> dict:
    """The report of a run with every shortcut, or of the reference, on ``backend``."""
    man = load_manifest(folder)
    opts = RunOptions(**workload)
    if reference:
        opts = RunOptions(**workload, trace=True, eager_ticks=True, per_chunk_events=True,
                          trains=False, lazy_observers=False)
    memo, dispatch.MEMO_LIMIT = dispatch.MEMO_LIMIT, 0 if reference else dispatch.MEMO_LIMIT
    vm = get_backend(backend)
    try:
        return _timeless(Engine(folder, man, create_maps(man), vm, opts).run())
    finally:
        dispatch.MEMO_LIMIT = memo
        vm.close()


def _but_lru(report: dict) -> dict:
    """The report without the LRU map's contents: a full one evicts by the kernel's
    approximation of LRU on that backend (docs/security.md)."""
    return {**report, "maps": {k: v for k, v in report["maps"].items() if k != "recent"},
            "map_entries": {k: v for k, v in report["map_entries"].items() if k != "recent"}}


def differences(a, b, path="") -> list[str]:
    """Where two reports differ, as 'key: a != b' lines (the first few)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += differences(a.get(k), b.get(k), f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


def check(path: Path, workload: dict, kernel: bool = False, interp: bool = False) -> list[str] | None:
    """How the run with shortcuts differs from the reference (none: the same; None: the
    policy does not compile, as a random one may not: a constant divided by 0; or the
    workload cannot run: a TP degree the model's heads do not split over).  With ``kernel``,
    also how the run with its programs in the kernel differs (but for an LRU map's contents);
    with ``interp``, how it differs with its programs in the interpreter instead of the JIT."""
    res = build(path, diags=Diagnostics())
    if res is None:
        return None
    folder = path.with_suffix("")
    write_folder(res.files, folder)
    try:
        fast = _run(folder, False, **workload)
        out = differences(fast, _run(folder, True, **workload))
        if kernel:
            in_kernel = _run(folder, False, "kernel", **workload)
            out += [f"kernel: {d}" for d in differences(_but_lru(fast), _but_lru(in_kernel))]
        if interp:
            out += [f"interp: {d}" for d in differences(fast, _run(folder, False, "interp", **workload))]
        return out
    except WorkloadError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--size", type=int, default=3, help="most statements per block")
    ap.add_argument("--model", default="llama3-8b", help="the workload's model")
    ap.add_argument("--kernel", action="store_true", help="also run the programs in the kernel (root)")
    ap.add_argument("--interp", action="store_true", help="also run the programs in the interpreter")
    ap.add_argument("--write", type=Path, help="write the (last) policy here")
    args = ap.parse_args(argv)
    found = invalid = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seed, args.seed + args.count):
            rng = random.Random(seed)
            path = args.write or Path(tmp) / f"p{seed}.fx"
            path.write_text(Policy(rng, args.size).text())
            workload = dict(model=args.model, prompt=rng.choice([256, 512, 1024]), tp=rng.choice([2, 4, 8]),
                            batch=rng.choice([1, 1, 2]))
            diffs = check(path, workload, args.kernel, args.interp)
            invalid += diffs is None
            if diffs:
                found += 1
                print(f"seed {seed} ({workload}): {len(diffs)} differences", *diffs[:6], sep="\n  ", flush=True)
    print(f"{args.count} policies from seed {args.seed} ({invalid} not valid or not runnable): {found} differ")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
