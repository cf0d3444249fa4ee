"""fabric-run wall time and its cost per simulated event, with and without the policy.

    python bench/run_bench.py [--backend jit,interp] [--quick] [--repeat N] [--instructions] [--policy NAME]

Configurations: Llama-3-8B 8k-token and Llama-3-70B 32k-token prefill, TP 8, on
policies/prefill_qos.fx (weights streamed from the CXL pool; --policy names another bundled
policy, e.g. telemetry, which only watches), each with the policy's
programs attached and with none (every island on its defaults); the ratio of the two wall
times is the policy's overhead.  Each run is a fresh process, as every fabric-run is (a
run leaves the allocator and the garbage collector in a state that slows the next one in
the same process by up to 30 %), timed from building the engine (programs loaded and
compiled) to the report; interpreter start and imports are the same for both and not
counted.  Each wall time is the best of --repeat runs, the two kinds taken in turn: on a
shared machine the speed drifts between runs, and the median beside each best shows how
much.  Where it drifts too much to tell a few per cent, --instructions also counts each
run's instructions under valgrind (cachegrind, no cache simulation: about 30x slower), less
those of a process that only starts up, each the least of --repeat counts, after one uncounted
run that fills the code cache for the CPU valgrind shows (another than the machine's): with a fixed
hash seed (PYTHONHASHSEED=0) and one BLAS thread (the counted runs have one) a run's count is
the same to a few hundred instructions from run to run, where its wall time varies by tens
of per cent; it does not see cache misses.

A run's cost per event divides its wall time by the events of the per-chunk model it
simulates: its count is that of a reference run in which every end of transmission and every
arrival is an event of the loop, no train steps ahead and no watcher waits for a batch (the
shortcuts off, as `tests/fuzz/shortcuts.py` runs it; ticks run lazily in both).  The shortcuts
give the same report but for the loop's own count of events, which they shrink: each event of
theirs stands for several of the model's, so wall time over that count would rise as they take
more events out ("loop ev" shows it beside the model's).

The JIT keeps compiled programs in an on-disk code cache (runtime/machine/codecache.py), as a
user's repeated runs do: the bench gives the runs a cache of their own, makes one run with
it empty ("cold s", compiling every program) and then the timed runs, which find it full.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from fabric_ext.codegen.driver import build  # noqa: E402
from fabric_ext.contract.bundle import create_maps, load_manifest, write_folder  # noqa: E402
from fabric_ext.runtime.machine.backends import get_backend  # noqa: E402
from fabric_ext.runtime.simulation.engine import Engine, RunOptions  # noqa: E402

CONFIGS = [("llama3-8b", 8192, 8), ("llama3-70b", 32768, 8)]


#: the shortcuts off: the per-chunk model, event by event (`tests/fuzz/shortcuts.py`'s reference)
PER_CHUNK_MODEL = {"per_chunk_events": True, "trains": False, "lazy_observers": False}


def run_once(folder, backend_name, model, prompt, tp, attach, reference=False) -> tuple[float, dict]:
    """One run in this process: (wall seconds, report); attach None: only start up;
    ``reference``: the per-chunk model (`PER_CHUNK_MODEL`)."""
    man = load_manifest(folder)
    backend = get_backend(backend_name)
    if attach is None:
        return 0.0, {"events": 0, "ttft_ms": 0.0}
    t0 = time.perf_counter()
    eng = Engine(folder, man, create_maps(man), backend, RunOptions(model, prompt, None, tp, None, attach,
                                                                  **(PER_CHUNK_MODEL if reference else {})))
    report = eng.run()
    wall = time.perf_counter() - t0
    backend.close()
    return wall, report


def _child(folder, backend_name, model, prompt, tp, attach, cache: Path, prefix=(), env=None, reference=False):
    """Run this script as a child that runs one configuration (under ``prefix``, if given).
    Its bytecode caches are the bench's own: stale ones beside the sources (from before an
    edit) would have it compile some modules again and count that."""
    return subprocess.run([*prefix, sys.executable, __file__, "--one", json.dumps(
        [str(folder), backend_name, model, prompt, tp, attach, reference])], capture_output=True, text=True,
        env=os.environ | {"FABRIC_EXT_JIT_CACHE": str(cache), "PYTHONPYCACHEPREFIX": str(cache.parent / "pycache")}
        | (env or {}))


def run_fresh(folder, backend_name, model, prompt, tp, attach, cache: Path, reference=False) -> tuple[float, dict]:
    """One run in a fresh process with the JIT code cache in ``cache``: (wall seconds, the
    report's events and TTFT)."""
    out = _child(folder, backend_name, model, prompt, tp, attach, cache, reference=reference)
    if out.returncode:
        raise SystemExit(f"run failed ({backend_name} {model}):\n{out.stderr}")
    wall, report = json.loads(out.stdout)
    return wall, report


def model_events(folder, backend_name, model, prompt, tp, attach, cache: Path, report: dict) -> int:
    """The events of the per-chunk model a run simulates: a reference run's count, which
    must give the same time to first token as the run with the shortcuts."""
    _, ref = run_fresh(folder, backend_name, model, prompt, tp, attach, cache, reference=True)
    if ref["ttft_ms"] != report["ttft_ms"]:
        raise SystemExit(f"the per-chunk model and the shortcuts disagree ({model}, programs {attach}): TTFT "
                         f"{ref['ttft_ms']} ms against {report['ttft_ms']} ms; run tests/fuzz/shortcuts.py")
    return ref["events"]


def instructions(folder, backend_name, model, prompt, tp, attach, cache: Path) -> int:
    """Instructions one fresh run executes (valgrind's count)."""
    # one BLAS thread: OpenBLAS's workers spin for a while after numpy's import, and under
    # valgrind (one thread at a time) their spinning adds 20-100 M instructions to a count
    out = _child(folder, backend_name, model, prompt, tp, attach, cache,
                 ("valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"),
                 {"OPENBLAS_NUM_THREADS": "1"})
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode or not found:
        raise SystemExit(f"valgrind run failed ({backend_name} {model}):\n{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def instruction_columns(folder, backend, model, prompt, tp, cache, repeat) -> str:
    def least(attach):
        return min(instructions(folder, backend, model, prompt, tp, attach, cache) for _ in range(repeat))
    # valgrind shows the process another CPU (fewer features: "haswell" on a Zen 4), and the JIT's
    # code cache is keyed by the CPU, so the cache the timed runs filled misses under it: one
    # uncounted run fills it for that CPU, and the counted runs compile nothing, as the timed ones
    instructions(folder, backend, model, prompt, tp, True, cache)
    start = least(None)
    pol, none = (least(a) - start for a in (True, False))
    return f"{pol / 1e9:>9.2f}{none / 1e9:>9.2f}{pol / none - 1:>9.1%}"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="jit", help="comma-separated backends (jit, interp, kernel)")
    ap.add_argument("--quick", action="store_true", help="only the 8B configuration")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, best taken (default 3)")
    ap.add_argument("--instructions", action="store_true",
                    help="also count instructions under valgrind (slow; the same from run to run with PYTHONHASHSEED=0)")
    ap.add_argument("--policy", default="prefill_qos", help="a bundled policy (policies/NAME.fx; default prefill_qos)")
    ap.add_argument("--one", help=argparse.SUPPRESS)      # a child: run one configuration
    args = ap.parse_args()
    if args.instructions and not shutil.which("valgrind"):
        print("--instructions needs valgrind (apt-get install valgrind); counting wall time only")
        args.instructions = False
    if args.one:
        folder, backend, model, prompt, tp, attach, reference = json.loads(args.one)
        wall, report = run_once(Path(folder), backend, model, prompt, tp, attach, reference)
        print(json.dumps([wall, {"events": report["events"], "ttft_ms": report["ttft_ms"]}]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "out"
        source = ROOT / "policies" / f"{args.policy}.fx"
        if not source.is_file():
            raise SystemExit(f"--policy: no bundled policy {source.name} in {source.parent}")
        write_folder(build(source).files, folder)
        print(f"policy {source.name}")
        print(f"{'backend':<8}{'model':<12}{'prompt':>7}{'tp':>4}{'cold s':>8}{'policy wall s':>15}{'median':>8}"
              f"{'us/ev':>7}{'none wall s':>13}{'median':>8}{'us/ev':>7}{'overhead':>10}{'TTFT ms':>10}"
              f"{'base TTFT':>11}{'model ev':>10}{'loop ev':>9}{'none model ev':>15}{'loop ev':>9}"
              + (f"{'pol Ginsn':>10}{'none Ginsn':>11}{'insn ovh':>9}" if args.instructions else ""))
        for backend in args.backend.split(","):
            for model, prompt, tp in CONFIGS[:1] if args.quick else CONFIGS:
                cache = Path(tmp) / f"jit-cache-{backend}-{model}"
                cold = run_fresh(folder, backend, model, prompt, tp, True, cache)[0]
                runs = {True: [], False: []}
                for _ in range(max(1, args.repeat)):
                    for attach in (True, False):
                        runs[attach].append(run_fresh(folder, backend, model, prompt, tp, attach, cache))
                (w1, r1), (w0, r0) = (min(runs[a], key=lambda x: x[0]) for a in (True, False))
                e1, e0 = (model_events(folder, backend, model, prompt, tp, a, cache, r)
                          for a, r in ((True, r1), (False, r0)))
                m1, m0 = (statistics.median(w for w, _ in runs[a]) for a in (True, False))
                insn = instruction_columns(folder, backend, model, prompt, tp, cache, max(1, args.repeat)) \
                    if args.instructions else ""
                print(f"{backend:<8}{model:<12}{prompt:>7}{tp:>4}{cold:>8.2f}{w1:>15.2f}{m1:>8.2f}"
                      f"{w1 / e1 * 1e6:>7.2f}{w0:>13.2f}{m0:>8.2f}{w0 / e0 * 1e6:>7.2f}"
                      f"{w1 / w0 - 1:>9.0%}{r1['ttft_ms']:>10.1f}{r0['ttft_ms']:>11.1f}"
                      f"{e1:>10,}{r1['events']:>9,}{e0:>15,}{r0['events']:>9,}" + insn, flush=True)


if __name__ == "__main__":
    main()
