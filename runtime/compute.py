"""Operator compute time: a roofline with an efficiency curve calibrated from measured H100 profiles.

``time = max(flops / (peak * eff(flops)), bytes / hbm_bw)`` where
``eff(x) = e_max * x / (x + x_half)`` rises with the size of the GEMM.  The
two coefficients are fitted (`fit`) to Vidur's public H100 profiles of
Llama-2-7B and -70B linear layers (QKV, output, gate/up and down
projections, every token count and TP degree) by least squares on the
observed efficiency; ``python -m fabric_ext.runtime.calibrate`` refits them
and writes them with the fit's error to figures.json.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .figures import figures

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def efficiency(flops: float, e_max: float, x_half: float) -> float:
    return e_max * flops / (flops + x_half)


def op_time(flops: float, bytes_: float, peak: float, hbm_bw: float, coeffs: dict | None = None) -> float:
    """Seconds for one operator on one GPU."""
    c = coeffs or figures()["compute"]
    if flops <= 0:
        return bytes_ / hbm_bw
    return max(flops / (peak * efficiency(flops, c["e_max"], c["x_half"])), bytes_ / hbm_bw)


def linear_shape(op: str, row: dict) -> tuple[int, int]:
    """(in, out) features of one profiled linear operator, before sharding."""
    h, heads, kv, f = int(row["n_embd"]), int(row["n_head"]), int(row["n_kv_head"]), int(row["n_expanded_embd"])
    hd = h // heads
    return {"attn_pre_proj": (h, (heads + 2 * kv) * hd), "attn_post_proj": (heads * hd, h),
            "mlp_up_proj": (h, 2 * f), "mlp_down_proj": (f, h)}[op]


def profile_points(files: list[Path]):
    """(flops, bytes, measured seconds) for every profiled linear operator."""
    pts = []
    for path in files:
        for row in csv.DictReader(open(path)):
            n, tp = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
            for op in LINEAR_OPS:
                i, o = linear_shape(op, row)
                i, o = (i // tp, o) if op in ("attn_post_proj", "mlp_down_proj") else (i, o // tp)
                flops = 2.0 * n * i * o
                nbytes = 2.0 * (i * o + n * i + n * o)
                pts.append((flops, nbytes, float(row[f"time_stats.{op}.median"]) * 1e-3))
    return np.array(pts)


def fit(files: list[Path], peak: float, hbm_bw: float) -> dict:
    """Least-squares fit of (e_max, x_half) and the relative error of the fitted times."""
    pts = profile_points(files)
    flops, nbytes, t = pts[:, 0], pts[:, 1], pts[:, 2]
    compute_bound = flops / peak >= nbytes / hbm_bw
    x, e = flops[compute_bound], (flops / peak)[compute_bound] / t[compute_bound]
    best = None
    for x_half in np.geomspace(1e8, 1e13, 400):
        g = x / (x + x_half)
        e_max = float(np.dot(e, g) / np.dot(g, g))
        err = float(np.sum((e - e_max * g) ** 2))
        if best is None or err < best[0]:
            best = (err, e_max, float(x_half))
    _, e_max, x_half = best
    coeffs = {"e_max": e_max, "x_half": x_half}
    pred = np.array([op_time(f, b, peak, hbm_bw, coeffs) for f, b in zip(flops, nbytes)])
    rel = np.abs(pred - t) / t
    return {"model": "eff(x) = e_max * x / (x + x_half), x = FLOPs of the GEMM", "e_max": round(e_max, 4),
            "x_half": float(f"{x_half:.4g}"), "fit_points": int(len(t)),
            "median_rel_err": round(float(np.median(rel)), 4), "p90_rel_err": round(float(np.percentile(rel, 90)), 4)}
