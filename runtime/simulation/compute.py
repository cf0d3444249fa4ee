"""How long each operator (`operators.Operator`) takes on one GPU.

Where Vidur measured the operator at this shape (same model layer shape, same tensor-parallel
degree, token count inside the profiled range) the time is interpolated from those medians
(`runtime/simulation/data/operator_profiles.json`, extracted from ../shared/data/vidur by
``fabric-calibrate``).  Elsewhere a mechanistic model, with
coefficients fitted by the same command to the same profiles, one set per GPU profile:

- GEMM: ``max(flops / (peak * eff(flops)), t0 + bytes / (hbm_bw * bw_frac))``,
  ``eff(x) = e_max * x / (x + x_half)``;
- memory-bound operators (norms, RoPE, activation, residual add, embedding):
  ``t0 + bytes / (hbm_bw * bw_frac)``, ``t0`` and ``bw_frac`` per operator;
- attention core (a FlashAttention-class kernel): ``flops / (rate(context) * occupancy)``,
  ``rate(s) = r_max * s / (s + s_half)`` through the published causal, head-dim-128 figures,
  and ``occupancy`` the share of the last wave of thread blocks (one per 128 queries of a
  head) that the GPU's SMs fill.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from .figures import data_text, figures
from .operators import ATTENTION, GEMM, Operator

PROFILES = Path(__file__).with_name("data") / "operator_profiles.json"
ATTENTION_TILE = 128         # query rows per thread block of the attention kernel


@lru_cache(maxsize=1)
def profile_tables() -> list[dict]:
    text = data_text(PROFILES)
    return json.loads(text)["tables"] if text else []


def efficiency(flops: float, e_max: float, x_half: float) -> float:
    return e_max * flops / (flops + x_half)


def gemm_time(flops: float, nbytes: float, peak: float, hbm_bw: float, c: dict) -> float:
    """Seconds of one GEMM: the efficiency curve, or its bytes where they take longer."""
    return max(flops / (peak * efficiency(flops, c["e_max"], c["x_half"])),
               c["t0"] * 1e-9 + nbytes / (hbm_bw * c["bw_frac"]))


@dataclass(frozen=True)
class GpuProfile:
    """A GPU's figures and the compute model's coefficients for it."""
    name: str
    peak: float          # dense BF16 FLOP/s
    hbm_bw: float        # B/s
    sms: int
    coeffs: dict
    timed_as: str        # the profile whose fitted coefficients it takes (its own, or its "compute"), and
                         # a stack's figures where the stack has none of its own (`Stack.figures_of`)

    @classmethod
    def named(cls, name: str, peak: float | None = None, hbm_bw: float | None = None) -> GpuProfile:
        gpu = figures()["gpu"][name]
        timed_as = gpu.get("compute", name)
        return cls(name, float(peak or gpu["bf16"]), float(hbm_bw or gpu["hbm_bw"]), int(gpu["sms"]),
                   figures()["compute"][timed_as], timed_as)


def _table(gpu: GpuProfile, model, tp: int) -> dict | None:
    shape = model.shape
    for t in profile_tables():
        if t["gpu"] == gpu.name and t["tp"] == tp and tuple(t["shape"]) == shape:
            return t
    return None


class Timer:
    """Operator times (seconds) for one model on one GPU profile at one TP degree."""

    def __init__(self, gpu: GpuProfile, model, tp: int):
        self.gpu, self.tp = gpu, tp
        self.table = _table(gpu, model, tp)

    def time(self, op: Operator) -> float:
        measured = self._measured(op)
        return measured if measured is not None else self.modelled(op)

    def _measured(self, op: Operator) -> float | None:
        t = self.table
        if t is None or op.name not in t["ms"] or not t["tokens"][0] <= op.tokens <= t["tokens"][-1]:
            return None
        return float(np.interp(op.tokens, t["tokens"], t["ms"][op.name])) * 1e-3

    def modelled(self, op: Operator) -> float:
        g, c = self.gpu, self.gpu.coeffs
        if op.kind == GEMM:
            return gemm_time(op.flops, op.bytes, g.peak, g.hbm_bw, c["gemm"])
        if op.kind == ATTENTION:
            a = c["attention"]
            rate = a["r_max"] * op.context / (op.context + a["s_half"]) * g.peak / a["peak"]
            blocks = op.seqs * op.heads * math.ceil(op.tokens / max(op.seqs, 1) / ATTENTION_TILE)
            occupancy = blocks / (math.ceil(blocks / g.sms) * g.sms) if blocks else 1.0
            return max(op.flops / (rate * occupancy), op.bytes / g.hbm_bw) + a["t0"] * 1e-9
        m = c["memory"].get(op.name) or c["memory"]["add"]
        return m["t0"] * 1e-9 + op.bytes / (g.hbm_bw * m["bw_frac"])


@dataclass(frozen=True)
class Stack:
    """What the serving software adds to the hardware's time (figures.json "stacks")."""
    name: str
    floor_ms: dict = field(default_factory=dict)     # GPU profile -> the least time a pass takes (its host CPU)
    kernel_factor: dict = field(default_factory=dict)    # GPU profile -> kernel time / profiled time
    large_busbw_factor: dict = field(default_factory=dict)   # TP degree -> bus bandwidth share, beyond the profile
    per_prompt_ms: float = 0.0     # CPU time per prompt of the batch in a pass
    tail_ms: float = 0.0           # from the last kernel to the first token out
    # GPU profile -> the stack's ALiBi attention kernel time / the FlashAttention curve's
    alibi_attention_factor: dict = field(default_factory=dict)

    @classmethod
    def named(cls, name: str) -> Stack:
        stacks = figures()["stacks"]
        if name not in stacks:
            raise KeyError(name)
        s = stacks[name]
        return cls(name, dict(s.get("floor_ms", {})), dict(s.get("kernel_factor", {})),
                   dict(s.get("large_busbw_factor", {})), float(s.get("per_prompt_ms", 0.0)),
                   float(s.get("tail_ms", 0.0)), dict(s.get("alibi_attention_factor", {})))

    def figures_of(self, gpu: GpuProfile) -> str:
        """The GPU profile whose figures this stack gives ``gpu``: its own where the stack was
        fitted to a machine of it (a power-capped H100: the cap is measured only with the
        stack), else those of the profile it is timed as (an H200: the H100's host and software)."""
        return gpu.name if gpu.name in self.floor_ms else gpu.timed_as

    def floor(self, gpu: str) -> float:
        return float(self.floor_ms.get(gpu, 0.0))

    def kernel(self, gpu: str, op: Operator) -> float:
        """Op's time in this stack relative to the compute model's: the GPU's kernel factor,
        and for attention with ALiBi biases the stack's own kernel's factor beside it (a stack
        may time ALiBi with another kernel than the FlashAttention curve describes)."""
        factor = float(self.kernel_factor.get(gpu, 1.0))
        if op.kind == ATTENTION and op.alibi:
            factor *= float(self.alibi_attention_factor.get(gpu, 1.0))
        return factor

    def busbw(self, tp: int) -> float:
        """The share of the profiled bus bandwidth an all-reduce at or beyond the largest
        profiled size reaches in this stack."""
        return float(self.large_busbw_factor.get(str(tp), 1.0))
