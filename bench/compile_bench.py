"""Wall time of `fabricc compile` per example policy (whole process, start-up included)
and the instructions per island it produced.

    python bench/compile_bench.py [--runs N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"{'policy':<16}{'best s':>8}{'median s':>10}  instructions per island")
    for fx in sorted((ROOT / "policies").glob("*.fx")):
        times = []
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.runs):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "fabric_ext.cli", "compile", str(fx), "-o", f"{tmp}/out"],
                               check=True, capture_output=True)
                times.append(time.perf_counter() - t0)
            man = json.loads(Path(f"{tmp}/out/manifest.json").read_text())
        per = {}
        for p in man["programs"]:
            per[p["island"]] = per.get(p["island"], 0) + p["insns"]
        times.sort()
        print(f"{fx.stem:<16}{times[0]:>8.3f}{times[len(times) // 2]:>10.3f}  "
              + ", ".join(f"{k} {v}" for k, v in per.items()))


if __name__ == "__main__":
    main()
