"""The model against measured prefills (../shared/data/splitwise), and the serving-stack fit.

Each measured configuration (model, GPU, TP degree, prompt tokens, batch) is run through the
engine on the bundled fabric of its machine (policies/fabrics/dgx_a100.fx, dgx_h100.fx; its
GPUs take the machine's profile: `MACHINES`), weights in HBM, no policy: first with no stack (the hardware alone), then with the fitted one.
The stack's coefficients come from a least-squares fit of the relative error of
``max(floor, kernel_factor * compute + collectives + tail)`` over every configuration.
"""
from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .workload import load_model


class Machine(NamedTuple):
    """A measured machine: the bundled fabric of its kind, and the GPU profile its GPUs take."""
    fabric: str
    gpu: str


#: measured hardware -> its machine (a power-capped DGX H100 is a DGX H100 whose GPUs take the
#: capped profile)
MACHINES = {"a100-80gb": Machine("dgx_a100.fx", "a100_sxm"), "h100-80gb": Machine("dgx_h100.fx", "h100_sxm"),
            "h100-80gb-pcap": Machine("dgx_h100.fx", "h100_sxm_pcap")}
#: measured model -> built-in model
MODELS = {"llama2-70b": "llama2-70b", "bloom-176b": "bloom-176b"}
#: configurations of the measured file the fit runs the engine on, at most (each twice, and
#: the stack's fit over all of them): the shared file has 78
MAX_CONFIGURATIONS = 1024


@dataclass(frozen=True)
class Point:
    """One measured configuration: the median of its repeated runs."""
    model: str
    hardware: str
    tp: int
    prompt: int
    batch: int
    measured_ms: float
    runs: int
    fastest_ms: float        # the repeated runs' range: where an error is within the
    slowest_ms: float        # machine's own scatter

    @property
    def group(self) -> str:
        return f"{self.model} {self.hardware}"


@dataclass(frozen=True)
class Modelled:
    point: Point
    hardware_ms: float       # the engine with no stack
    compute_ms: float        # of which kernels on the critical path
    modelled_ms: float       # with the stack

    @property
    def error(self) -> float:
        return self.modelled_ms / self.point.measured_ms - 1

    @property
    def beyond_runs(self) -> float:
        """The relative distance from the modelled time to the nearest repeated run (0 inside
        the runs' range): how much of the error the machine's own scatter does not explain."""
        p = self.point
        nearest = min(max(self.modelled_ms, p.fastest_ms), p.slowest_ms)
        return self.modelled_ms / nearest - 1


def measured(path: Path) -> tuple[list[Point], list[str]]:
    """The configurations of the measured file that the model covers, and why the others are
    left out: a machine or model with no profile, or a median below that of the same prompt
    at half the batch (twice the work in less time is no complete prefill)."""
    from .calibrate import read_rows
    runs = defaultdict(list)
    for r in read_rows(path):
        runs[(r["model"], r["hardware"], r.whole("tensor_parallel"), r.whole("prompt_size"),
              r.whole("batch_size"))].append(r.positive("prompt_time"))
    if len(runs) > MAX_CONFIGURATIONS:
        from .calibrate import DataError
        raise DataError(f"{path}: {len(runs):,} configurations (model, hardware, TP, prompt, batch); the fit runs "
                        f"the engine on each, and takes at most {MAX_CONFIGURATIONS:,}")
    points, skipped = [], []
    for (model, hw, tp, prompt, batch), times in sorted(runs.items()):
        median = statistics.median(times)
        if hw not in MACHINES or model not in MODELS:
            why = f"{model} on {hw}: " + ("no profile of that machine" if hw not in MACHINES else "no such model")
            if why not in skipped:
                skipped.append(why)
            continue
        half = runs.get((model, hw, tp, prompt, batch // 2)) if batch > 1 else None
        if half and median < statistics.median(half):
            skipped.append(f"{model} on {hw}, TP {tp}, {prompt} x {batch}: {median:.1f} ms, less than the "
                           f"{statistics.median(half):.1f} ms of half the batch")
            continue
        points.append(Point(model, hw, tp, prompt, batch, median, len(times), min(times), max(times)))
    return points, skipped


class _Runner:
    """Compiles (in memory) an empty policy on each bundled fabric once and runs the engine on it."""

    def __init__(self):
        self.bundles = {}

    def bundle(self, machine: Machine, model: str):
        import fabric_ext.policies as pkg
        from fabric_ext import api
        key = (machine, model)
        if key not in self.bundles:
            fabric = (Path(pkg.__file__).parent / "fabrics" / machine.fabric).read_text()
            fabric, swapped = re.subn(r'\bmodel: "[^"]*"', f'model: "{machine.gpu}"', fabric)
            if not swapped:
                raise ValueError(f"{machine.fabric}: no GPU names its profile ('model:') to take {machine.gpu}")
            self.bundles[key] = api.compile(f'{fabric}\nworkload w {{ model: "{model}"; weights: hbm; kv: hbm }}\n')
        return self.bundles[key]

    def run(self, p: Point, stack: str) -> dict:
        from fabric_ext.contract.bundle import create_maps

        from ..machine.errors import InputError
        from ..machine.interp import Interpreter
        from .engine import Engine, RunOptions
        b = self.bundle(MACHINES[p.hardware], MODELS[p.model])
        opts = RunOptions(prompt=p.prompt, batch=p.batch, tp=p.tp, stack=stack, attach=False)   # (bounded)
        try:
            return Engine(b, b.manifest, create_maps(b.manifest), Interpreter(), opts).run()
        except InputError as e:     # a workload past the bounds, a run past its events: which row
            raise InputError(f"{p.model} on {p.hardware}, TP {p.tp}, {p.prompt} x {p.batch}: {e}") from None


def _hardware(points: list[Point]) -> list[dict]:
    """The engine's report of every point with the hardware alone."""
    runner = _Runner()
    return [runner.run(p, "none") for p in points]


def fit_stack(path: Path) -> dict:
    """The vllm stack, minimising the squared relative error of
    ``max(floor[gpu], hardware + (k[gpu] - 1) compute + k[gpu] (a[gpu] - 1) alibi
    + (1/f[tp] - 1) beyond + s * batch + tail)`` over every covered configuration: a floor per
    machine (its host CPU), a kernel factor per GPU profile, a factor per GPU profile for the
    stack's ALiBi attention kernel against the FlashAttention curve (``alibi``: that attention's
    time in the hardware-alone run), a bus-bandwidth share per TP degree for all-reduces beyond
    the profiled sizes, a cost per prompt in the batch, and a fixed tail (a search over the floors
    on a grid, `_floors`; linear least squares for the rest)."""
    points, _ = measured(path)
    reports = _hardware(points)
    t = np.array([p.measured_ms for p in points])
    hw = np.array([r["ttft_ms"] for r in reports])
    gpu = np.array([r["gpu"] for r in reports])
    gpus = sorted(set(gpu))
    tps = sorted({p.tp for p in points})
    alibi = np.array([0.0 if load_model(MODELS[p.model]).rope else r["operators"]["attn"]
                      for p, r in zip(points, reports)])
    alibi_gpus = [g for g in gpus if alibi[gpu == g].any()]
    cols = [np.where(gpu == g, [r["compute_ms"] for r in reports], 0.0) for g in gpus]
    cols += [np.where(gpu == g, alibi, 0.0) for g in alibi_gpus]
    cols += [np.array([r["allreduce_beyond_profile_ms"] if p.tp == tp else 0.0 for p, r in zip(points, reports)])
             for tp in tps]
    cols += [np.array([float(p.batch) for p in points]), np.ones_like(t)]
    a = np.vstack(cols).T
    n, m = len(gpus), len(alibi_gpus)
    held = [*range(n + m), a.shape[1] - 1]

    def fit(floors):
        floor = np.select([gpu == g for g in gpus], floors)
        active = np.ones_like(t, dtype=bool)
        for _ in range(4):            # the floor hides the points below it from the rest of the fit
            x = _at_least_zero(a[active] / t[active, None], 1 - hw[active] / t[active], held)
            active = hw + a @ x > floor
        pred = np.maximum(floor, hw + a @ x)
        return float(np.sum((pred / t - 1) ** 2)), x, pred

    floors = _floors(fit, n)
    _, x, pred = fit(floors)
    rel = np.abs(pred / t - 1)
    kernel = {g: 1 + float(v) for g, v in zip(gpus, x[:n])}
    beyond = x[n + m:n + m + len(tps)]
    return {"floor_ms": {g: round(float(f), 2) for g, f in zip(gpus, floors)},
            "kernel_factor": {g: round(k, 4) for g, k in kernel.items()},
            "alibi_attention_factor": {g: round(1 + float(v) / kernel[g], 3) for g, v in zip(alibi_gpus, x[n:n + m])},
            "large_busbw_factor": {str(tp): round(1 / (1 + float(v)), 4) if v > -1 else 1.0
                                   for tp, v in zip(tps, beyond)},
            "per_prompt_ms": round(float(x[-2]), 3), "tail_ms": round(float(x[-1]), 2),
            "fit_points": len(t), "median_rel_err": round(float(np.median(rel)), 4),
            "max_rel_err": round(float(rel.max()), 4)}


#: the floors a stack fit tries, ms (every 2 ms from 0 to 100)
FLOOR_GRID = tuple(float(f) for f in np.linspace(0, 100, 51))


def _floors(fit, n: int) -> list[float]:
    """The floors of n machines that give ``fit`` (floors -> (squared error, ...)) its least
    error on `FLOOR_GRID`, one machine's at a time with the others held, until none moves (a
    machine's floor bears on its own points; the others see it only through the factors they
    share)."""
    floors = [0.0] * n
    for _ in range(10):
        before = list(floors)
        for i in range(n):
            floors[i] = min(FLOOR_GRID, key=lambda f: (fit(floors[:i] + [f] + floors[i + 1:])[0], f))
        if floors == before:
            break
    return floors


def _at_least_zero(a, rhs, held):
    """Least squares of ``a x = rhs`` where the unknowns ``held`` cannot be negative: a kernel
    factor less 1 (a stack's kernels are the profiled ones, or the curve's, never faster) and
    the tail (no time is taken back after the last kernel).  One that would come out below 0 is
    held at 0 and the rest refitted."""
    keep = np.ones(a.shape[1], dtype=bool)
    while True:
        x = np.zeros(a.shape[1])
        x[keep] = np.linalg.lstsq(a[:, keep], rhs, rcond=None)[0]
        low = [i for i in held if keep[i] and x[i] < 0]
        if not low:
            return x
        keep[low] = False


def validate(path: Path) -> tuple[list[Modelled], list[str]]:
    """Every covered configuration, modelled with the hardware alone and with the vllm stack."""
    points, skipped = measured(path)
    runner = _Runner()
    out = []
    for p in points:
        hw = runner.run(p, "none")
        out.append(Modelled(p, hw["ttft_ms"], hw["compute_ms"], runner.run(p, "vllm")["ttft_ms"]))
    return out, skipped


def render(result: tuple[list[Modelled], list[str]]) -> str:
    rows, skipped = result
    lines = [f"{'model':<11} {'GPU':<14} {'TP':>2} {'prompt':>6} {'batch':>5} {'measured':>9} {'hardware':>9} "
             f"{'modelled':>9} {'error':>7} {'runs (min-max)':>17} {'beyond runs':>11}"]
    for m in rows:
        p = m.point
        lines.append(f"{p.model:<11} {p.hardware:<14} {p.tp:>2} {p.prompt:>6} {p.batch:>5} {p.measured_ms:>9.1f} "
                     f"{m.hardware_ms:>9.1f} {m.modelled_ms:>9.1f} {m.error:>+7.1%} "
                     f"{p.fastest_ms:>8.1f}-{p.slowest_ms:<8.1f} {m.beyond_runs:>+11.1%}")
    lines.append("")
    lines.append(f"{'group':<30} {'points':>6} {'median |error|':>14} {'max |error|':>11} {'max beyond runs':>15} "
                 f"{'hardware median':>15}")
    for group, ms in summary(rows).items():
        lines.append(f"{group:<30} {ms['points']:>6} {ms['median']:>14.1%} {ms['max']:>11.1%} "
                     f"{ms['max_beyond_runs']:>15.1%} {ms['hardware']:>+15.1%}")
    for why in skipped:
        lines.append(f"left out: {why}")
    return "\n".join(lines)


def summary(rows: list[Modelled]) -> dict[str, dict]:
    """Per (model, GPU) group: points, median and max |error| with the stack, the largest
    distance to the nearest repeated run, median error of the hardware alone."""
    groups = defaultdict(list)
    for m in rows:
        groups[m.point.group].append(m)
        groups[f"{m.point.group} TP{m.point.tp}"].append(m)
    return {g: {"points": len(ms), "median": float(np.median([abs(m.error) for m in ms])),
                "max": max(abs(m.error) for m in ms),
                "max_beyond_runs": max(abs(m.beyond_runs) for m in ms),
                "hardware": float(np.median([m.hardware_ms / m.point.measured_ms - 1 for m in ms]))}
            for g, ms in sorted(groups.items())}


def operator_check() -> dict[str, dict]:
    """The mechanistic operator model (`compute.Timer.modelled`, no tables) against the
    profiles it was fitted to: per GPU profile, the relative error of one layer's profiled
    operators summed, over every profiled shape, TP degree and token count."""
    from .calibrate import LINEAR_OPS, MEMORY_OPS, LayerShape
    from .compute import GpuProfile, Timer, profile_tables
    from .operators import attention_block, ffn_block
    errors = defaultdict(list)
    for t in profile_tables():
        shape = LayerShape(*t["shape"])
        timer = Timer(GpuProfile.named(t["gpu"]), shape, t["tp"])
        for i, n in enumerate(t["tokens"]):
            ops = [op for op in attention_block(shape, 1, 0, n, t["tp"]) + ffn_block(shape, 1, n, t["tp"])
                   if op.name in LINEAR_OPS + MEMORY_OPS]
            profiled = sum(t["ms"][op.name][i] for op in ops) * 1e-3
            errors[t["gpu"]].append(sum(timer.modelled(op) for op in ops) / profiled - 1)
    return {g: {"points": len(e), "median": float(np.median(np.abs(e))), "max": float(np.max(np.abs(e)))}
            for g, e in sorted(errors.items())}
