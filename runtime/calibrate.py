"""Refit the compute model from Vidur's H100 profiles and store it in figures.json.

    python -m fabric_ext.runtime.calibrate [DATA_DIR]   (default: ../shared/data/vidur)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .compute import fit
from .figures import PATH, figures


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    data = Path(argv[0] if argv else "../shared/data/vidur")
    files = sorted(data.glob("h100_*_mlp.csv"))
    if not files:
        print(f"calibrate: no h100_*_mlp.csv profiles in {data}", file=sys.stderr)
        return 2
    gpu = figures()["gpu"]["h100_sxm"]
    result = fit(files, gpu["bf16"], gpu["hbm_bw"])
    result["source"] = ("fitted by 'python -m fabric_ext.runtime.calibrate' to Vidur's public H100 profiles "
                        "(microsoft/vidur data/profiling/compute/h100, Llama-2-7B and Llama-2-70B mlp.csv, "
                        "linear operators at every token count and TP degree)")
    doc = json.loads(PATH.read_text())
    doc["compute"] = result
    PATH.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
