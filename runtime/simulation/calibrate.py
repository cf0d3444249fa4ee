"""Refit every coefficient of the model from the shared measurements, and validate it.

    fabric-calibrate [DATA_DIR] [--check]   (default: ../shared/data)

From ``DATA_DIR/vidur`` (operator and NCCL profiles): the operator tables the compute model
interpolates (runtime/simulation/data/operator_profiles.json), per GPU profile the GEMM efficiency
curve and each memory-bound operator's fixed cost and share of HBM bandwidth, the attention
curve through its published points, the all-reduce's alpha-beta per TP degree, and NVLink's
per-message cost.  From ``DATA_DIR/splitwise`` (measured prefills): the serving-stack
profile (`validation.fit_stack`).  It writes them into runtime/simulation/data (``--check``: writes
nothing and exits 1 where a stored figure differs from the refit) and prints the validation
table of the model against every measured configuration.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..machine.errors import InputError, OutputError
from ..machine.fsutil import atomic_write_text, read_bounded
from . import figures as figure_files
from .compute import PROFILES, gemm_time, profile_tables
from .figures import PATH, figures

SEND_RECV = "h100_dgx_send_recv.csv"
#: which GPU profile each Vidur file prefix was measured on
GPU_OF_PREFIX = {"h100": "h100_sxm", "a100": "a100_sxm"}
LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
MEMORY_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add", "emb")


MAX_DATA_FILE = 64 << 20    # bytes of one shared CSV file (the largest is under 1 MiB)


class DataError(InputError):
    """A shared data file that is not what the fit reads; the message names the file, the
    line and the column."""


class Row(dict):
    """One row of a shared CSV file, read as text; a column it lacks, or a value that is not
    the number asked for, is a `DataError` naming the file, line and column."""

    def __init__(self, values: dict, where: str):
        super().__init__(values)
        self.where = where

    def __missing__(self, key):
        raise DataError(f"{self.where}: no column '{key}'; is this the file the data's README describes?")

    def number(self, key: str) -> float:
        try:
            value = float(self[key])
        except (TypeError, ValueError):
            value = float("nan")
        if not math.isfinite(value):
            raise DataError(f"{self.where}: column '{key}': {self[key]!r} is not a number")
        return value

    def positive(self, key: str) -> float:
        value = self.number(key)
        if value <= 0:
            raise DataError(f"{self.where}: column '{key}': {self[key]!r} is not more than 0")
        return value

    def whole(self, key: str) -> int:
        """A count or a size: a whole number from 1."""
        value = self.number(key)
        if value != int(value) or value < 1:
            raise DataError(f"{self.where}: column '{key}': {self[key]!r} is not a whole number from 1")
        return int(value)


def read_rows(path: Path) -> list[Row]:
    """The rows of a shared CSV file (a regular file of at most `MAX_DATA_FILE`), each naming
    its line; a file with none is a `DataError`."""
    try:
        text = read_bounded(path, MAX_DATA_FILE).decode()
    except (OSError, UnicodeDecodeError, InputError) as e:
        raise DataError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = [Row(r, f"{path}, line {reader.line_num}") for r in reader]
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def profile_files(vidur: Path) -> list[Path]:
    """The operator profiles in ``vidur`` of a GPU the fit knows (`GPU_OF_PREFIX`)."""
    return [f for f in sorted(vidur.glob("*_mlp.csv")) if f.name.split("_")[0] in GPU_OF_PREFIX]


def _within(path: Path, keep, what: str) -> list[Row]:
    """The rows of ``path`` that ``keep`` keeps: ``what`` a fit needs, at least two of them."""
    rows = [r for r in read_rows(path) if keep(r)]
    _enough(len(rows), [path], f"rows of {what}")
    return rows


def _enough(n: int, files, what: str) -> None:
    """A fit's points: at least two (``what`` of ``files``)."""
    if n < 2:
        raise DataError(f"{', '.join(str(f) for f in files)}: {n} {what}; a fit needs two or more")


def _shape(row) -> tuple:
    return (row.whole("n_embd"), row.whole("n_head"), row.whole("n_kv_head"), row.whole("n_expanded_embd"),
            row["use_gated_mlp"] == "True")


@dataclass(frozen=True)
class LayerShape:
    """A layer as Vidur's profiles name it (hidden, heads, KV heads, FFN, gated): what
    `operators` and `compute.Timer` read of a model, for a profile row or table."""
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated: bool
    dtype_bytes: int = 2
    rope: bool = True
    window: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def shape(self) -> tuple:
        return (self.hidden, self.heads, self.kv_heads, self.ffn, self.gated)


def profiled_operators(row):
    """The operators of one profile row (its token count, TP degree, layer shape), by name."""
    from .operators import attention_block, embedding, ffn_block
    m, n, tp = LayerShape(*_shape(row)), row.whole("num_tokens"), row.whole("num_tensor_parallel_workers")
    ops = attention_block(m, 1, 0, n, tp) + ffn_block(m, 1, n, tp) + [embedding(m, 1, n)]
    return {op.name: op for op in ops}


def tables(files: list[Path]) -> list[dict]:
    """The medians of every profiled operator per (GPU, layer shape, TP degree), by token count."""
    out = []
    for path in files:
        groups = defaultdict(dict)
        for row in read_rows(path):
            groups[(_shape(row), row.whole("num_tensor_parallel_workers"))][row.whole("num_tokens")] = row
        for (shape, tp), by_tokens in sorted(groups.items()):
            tokens = sorted(by_tokens)
            ops = LINEAR_OPS + MEMORY_OPS
            out.append({"gpu": GPU_OF_PREFIX[path.name.split("_")[0]], "file": path.name, "shape": list(shape),
                        "tp": tp, "tokens": tokens,
                        "ms": {op: [by_tokens[t].number(f"time_stats.{op}.median") for t in tokens] for op in ops}})
    return out


def _points(files, names):
    """(operator, measured seconds) for every row of ``files`` and operator in ``names``."""
    for path in files:
        for row in read_rows(path):
            ops = profiled_operators(row)
            for name in names:
                yield ops[name], row.number(f"time_stats.{name}.median") * 1e-3


def _fixed_plus_bytes(nbytes, t):
    """(t0 s, s per byte) of t = t0 + bytes * per_byte, least squares on the relative error."""
    t0, per_byte = np.linalg.lstsq(np.vstack([1 / t, nbytes / t]).T, np.ones_like(t), rcond=None)[0]
    return max(float(t0), 0.0), max(float(per_byte), 1e-18)


def fit_gemm(files, peak: float, hbm_bw: float) -> dict:
    """The GEMM model: where a linear operator moves more bytes than the peak rate computes in
    that time, ``t0 + bytes / (hbm_bw * bw_frac)``; elsewhere the efficiency curve, by least
    squares on the observed efficiency."""
    pts = list(_points(files, LINEAR_OPS))
    flops = np.array([op.flops for op, _ in pts])
    nbytes = np.array([op.bytes for op, _ in pts])
    t = np.array([s for _, s in pts])
    bound = flops / peak >= nbytes / hbm_bw
    _enough(int(bound.sum()), files, "compute-bound GEMMs")
    _enough(int((~bound).sum()), files, "memory-bound GEMMs")
    t0, per_byte = _fixed_plus_bytes(nbytes[~bound], t[~bound])
    x, e = flops[bound], (flops / peak)[bound] / t[bound]
    best = None
    for x_half in np.geomspace(1e8, 1e13, 400):
        g = x / (x + x_half)
        e_max = float(np.dot(e, g) / np.dot(g, g))
        err = float(np.sum((e - e_max * g) ** 2))
        if best is None or err < best[0]:
            best = (err, e_max, float(x_half))
    c = {"e_max": round(best[1], 4), "x_half": float(f"{best[2]:.4g}"), "t0": round(t0 * 1e9),
         "bw_frac": round(1 / (per_byte * hbm_bw), 4)}
    rel = np.abs(np.array([gemm_time(f, b, peak, hbm_bw, c) for f, b in zip(flops, nbytes)]) - t) / t
    return {**c, "model": "max(FLOPs / (peak * e_max * x / (x + x_half)), t0 + bytes / (hbm_bw * bw_frac)), "
                          "x = FLOPs of the GEMM", "fit_points": len(t),
            "median_rel_err": round(float(np.median(rel)), 4), "p90_rel_err": round(float(np.percentile(rel, 90)), 4)}


def fit_memory(files, hbm_bw: float) -> dict:
    """Per memory-bound operator, t = t0 + bytes / (hbm_bw * bw_frac), least squares on the
    relative error (every row counts alike, small and large)."""
    out = {}
    for name in MEMORY_OPS:
        pts = [(op.bytes, s) for op, s in _points(files, (name,)) if s > 0]
        _enough(len(pts), files, f"timed {name} operators")
        b, t = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        t0, per_byte = _fixed_plus_bytes(b, t)
        rel = np.abs(t0 + b * per_byte - t) / t
        out[name] = {"t0": round(t0 * 1e9), "bw_frac": round(1 / (per_byte * hbm_bw), 4), "fit_points": len(t),
                     "median_rel_err": round(float(np.median(rel)), 4)}
    return out


def attention_curve(published: dict) -> dict:
    """rate(s) = r_max * s / (s + s_half) through the two published (context, FLOP/s) points."""
    (s1, r1), (s2, r2) = published["points"]
    s_half = (r2 - r1) / (r1 / s1 - r2 / s2)
    return {"r_max": float(f"{r1 * (s1 + s_half) / s1:.4g}"), "s_half": round(s_half), "peak": published["peak"],
            "t0": published["t0"], "source": published["source"]}


def fit_allreduce(path: Path) -> dict:
    """Per TP degree within one node: time = alpha + 2 (t-1)/t * size / busbw, least squares on
    the relative error over every profiled size."""
    out = {}
    rows = _within(path, lambda r: r["num_workers"] == r["devices_per_node"], "all-reduces within one node")
    for t in sorted({r.whole("num_workers") for r in rows}):
        rr = [r for r in rows if r.whole("num_workers") == t]
        size = np.array([r.number("size") for r in rr])
        sec = np.array([r.number("time_stats.all_reduce.median") for r in rr]) * 1e-3
        x = 2 * (t - 1) / t * size
        alpha, per_byte = np.linalg.lstsq(np.vstack([1 / sec, x / sec]).T, np.ones_like(sec), rcond=None)[0]
        if not per_byte > 0:
            raise DataError(f"{path}: the all-reduce times at TP {t} do not grow with the size; no bandwidth fits them")
        rel = np.abs(alpha + x * per_byte - sec) / sec
        out[str(t)] = {"alpha": round(float(alpha) * 1e9), "busbw": float(f"{1 / per_byte:.4g}"),
                       "fit_points": len(sec), "max_size": int(size.max()),
                       "median_rel_err": round(float(np.median(rel)), 4)}
    return out


def fit_message_cost(path: Path) -> dict:
    """time = setup + bytes / bw, least squares over the NCCL send/recv profile's rows within
    one node (NVLink, devices_per_node 2): what one message costs beyond its bytes."""
    rows = _within(path, lambda r: r["devices_per_node"] == "2", "messages within one node (devices_per_node 2)")
    size = np.array([r.number("size") for r in rows])
    ns = np.array([r.number("time_stats.send_recv.median") for r in rows]) * 1e6
    setup, per_byte = np.linalg.lstsq(np.vstack([np.ones_like(size), size]).T, ns, rcond=None)[0]
    if not per_byte > 0:
        raise DataError(f"{path}: the message times do not grow with the size; no bandwidth fits them")
    return {"setup": round(float(setup)), "fit_bw": round(1e9 / float(per_byte), -6), "fit_points": len(rows),
            "setup_source": "fitted by 'fabric-calibrate' to Vidur's NCCL send/recv profile "
                            "within a DGX-H100 node (microsoft/vidur data/profiling/network/h100_dgx/send_recv.csv, "
                            "devices_per_node 2): the intercept of time against size, one message's fixed cost"}


def refit(data: Path) -> tuple[dict, dict]:
    """The figures document and the operator tables as the shared files give them."""
    vidur = data / "vidur"
    doc = json.loads(PATH.read_text())
    files = profile_files(vidur)
    for prefix, gpu_name in GPU_OF_PREFIX.items():
        mine = [f for f in files if f.name.startswith(prefix + "_")]
        if not mine:
            continue
        gpu = doc["gpu"][gpu_name]
        c = doc["compute"].setdefault(gpu_name, {})
        c["gemm"] = fit_gemm(mine, gpu["bf16"], gpu["hbm_bw"])
        c["memory"] = fit_memory(mine, gpu["hbm_bw"])
        c["attention"] = attention_curve(doc["attention_published"][gpu_name])
        c["source"] = (f"fitted by 'fabric-calibrate' to Vidur's {prefix.upper()} operator "
                       f"profiles ({', '.join(f.name for f in mine)}: microsoft/vidur data/profiling/compute); "
                       "attention through attention_published")
        ar = vidur / f"{prefix}_dgx_all_reduce.csv"
        if ar.is_file():
            c["all_reduce"] = fit_allreduce(ar)
    if (vidur / SEND_RECV).is_file():
        doc["links"]["nvlink4"].update(fit_message_cost(vidur / SEND_RECV))
    profiles = {"source": "medians of microsoft/vidur data/profiling/compute/*/mlp.csv (ms), extracted by "
                          "'fabric-calibrate'", "tables": tables(files)}
    doc["stacks"].setdefault("vllm", {})
    return doc, profiles


def _read_as(texts: dict[Path, str]) -> None:
    """Have this process read ``texts`` as the package's data files (the files stay as they
    are: a calibration stopped half way, or a --check, changes none of them)."""
    figure_files.override.clear()
    figure_files.override.update(texts)
    figures.cache_clear()
    profile_tables.cache_clear()


def _write(texts: dict[Path, str]) -> None:
    for path, text in texts.items():
        atomic_write_text(path, text)


USAGE = """usage: fabric-calibrate [DATA] [--check]

Refits every coefficient of runtime/simulation/data/figures.json and the operator tables from
DATA (default ../shared/data: vidur/ and splitwise/) and prints the validation table.
  --check   refit without writing; exit 1 where a stored figure differs from the refit"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(f"calibrate: unexpected arguments: {' '.join(args)}\n{USAGE}", file=sys.stderr)
        return 2
    data = Path(args[0] if args else "../shared/data")
    if not profile_files(data / "vidur"):
        print(f"calibrate: no Vidur operator profiles ({'|'.join(GPU_OF_PREFIX)}_*_mlp.csv) in {data / 'vidur'}",
              file=sys.stderr)
        return 2
    from . import validation
    splitwise = data / "splitwise" / "prefill_measured.csv"
    stored = {PATH: PATH.read_text(), PROFILES: PROFILES.read_text() if PROFILES.is_file() else ""}
    try:
        doc, profiles = refit(data)
        new = {PATH: _dump(doc), PROFILES: json.dumps(profiles) + "\n"}
        if splitwise.is_file():
            # the stack is fitted over the engine's runs, which read the hardware figures just fitted
            _read_as({**new, PATH: _dump({**doc, "stacks": json.loads(stored[PATH])["stacks"]})})
            doc["stacks"]["vllm"] = {"source": doc["stacks"]["vllm"].get("source", ""),
                                     **validation.fit_stack(splitwise)}
            new[PATH] = _dump(doc)
        changed = [p for p, text in new.items() if stored[p] != text]
        _read_as(stored if check else new)
        for p in changed if check else ():
            print(f"calibrate: {p} differs from a refit of {data}", file=sys.stderr)
        if splitwise.is_file():
            print(validation.render(validation.validate(splitwise)))
    except InputError as e:     # a data file, or a measured row the model cannot run: the figures stay
        print(f"calibrate: {e}", file=sys.stderr)
        return 1
    finally:
        _read_as({})
    if not check:
        try:
            _write(new)
        except OutputError as e:       # (each file whole or not at all: `atomic_write_text`)
            print(f"calibrate: {e}", file=sys.stderr)
            return 1
    return 1 if check and changed else 0


def _dump(doc: dict) -> str:
    return json.dumps(doc, indent=2) + "\n"


if __name__ == "__main__":
    sys.exit(main())
