"""Refit the compute model from Vidur's H100 profiles and store it in figures.json.

    python -m fabric_ext.runtime.calibrate [DATA_DIR]   (default: ../shared/data/vidur)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import csv

import numpy as np

from .compute import fit
from .figures import PATH, figures

SEND_RECV = "h100_dgx_send_recv.csv"


def fit_message_cost(path: Path) -> dict:
    """time = setup + bytes / bw, least squares over the NCCL send/recv profile's rows within
    one node (NVLink, devices_per_node 2): what one message costs beyond its bytes."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["devices_per_node"] == "2"]
    size = np.array([float(r["size"]) for r in rows])
    ns = np.array([float(r["time_stats.send_recv.median"]) for r in rows]) * 1e6
    setup, per_byte = np.linalg.lstsq(np.vstack([np.ones_like(size), size]).T, ns, rcond=None)[0]
    return {"setup": round(float(setup)), "fit_bw": round(1e9 / float(per_byte), -6), "fit_points": len(rows),
            "setup_source": "fitted by 'python -m fabric_ext.runtime.calibrate' to Vidur's NCCL send/recv profile "
                            "within a DGX-H100 node (microsoft/vidur data/profiling/network/h100_dgx/send_recv.csv, "
                            "devices_per_node 2): the intercept of time against size, one message's fixed cost"}


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
    if (data / SEND_RECV).is_file():
        doc["links"]["nvlink4"].update(fit_message_cost(data / SEND_RECV))
    PATH.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
