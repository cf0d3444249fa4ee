"""Prefill dataflow statistics: collected from a finished run, shown as tables,
written as JSON (schema ``fabric-run/2``) or PNG plots (the trace: `trace.py`)."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .workload import Workload

SCHEMA = "fabric-run/2"   # 2: islands report events and runs (invocations) apart
COMPARE_SCHEMA = "fabric-run-compare/1"   # {"schema", "runs": [a fabric-run/2 report per policy]}
TIMELINE_BINS = 100
#: entries of one map the report keeps (the first by key): a policy's maps may hold 64 million
#: together, and the report's JSON and HTML would hold each several times over
REPORT_ENTRIES = 1 << 16


def percentiles(values: list, qs: tuple) -> list[float]:
    """The ``qs`` percentiles of ``values`` (0.0 each where there are none), interpolated
    between the closest ranks as `numpy.percentile` does by default, to the last bit: one
    sort for all of them, and none of that function's set-up (its first call imports
    numpy.ma)."""
    if not values:
        return [0.0] * len(qs)
    ranked = np.sort(np.asarray(values, dtype=float))
    out = []
    for q in qs:
        at = q / 100 * (len(ranked) - 1)
        lo = int(at)
        below, above, t = ranked[lo], ranked[min(lo + 1, len(ranked) - 1)], at - lo
        # numpy's lerp: from the nearer end, so that t = 0 and t = 1 give the ranks exactly
        out.append(float(above - (above - below) * (1 - t) if t >= 0.5 else below + (above - below) * t))
    return out


@dataclass(frozen=True)
class RunRecord:
    """Everything a finished run hands its report, named: the report (`collect`) and the trace
    (`trace`) read only this, never the engine that made it."""
    policy: str
    backend: str
    backend_load: dict
    workload: Workload
    stack: str
    gpu: str
    finished_ns: float                  # the prefill's end: time to first token
    kv_done_ns: float                   # the last KV byte written back or exported
    operator_ms: dict[str, float]       # kernels on the critical path, per operator
    beyond_profile_ms: float            # all-reduce time beyond the profiled sizes
    events: int                         # simulated events
    layer_stats: dict[int, dict]        # per layer: compute and stall ms
    stall_by_movement: dict[str, float]  # ns the GPUs waited for each movement
    transfers: list                     # every transfer (servers.Transfer)
    servers: list                       # every link server and wire, once each
    islands: list[dict]                 # each shim's summary
    faults: list[dict]
    maps: dict                          # final map contents (empty with no programs attached)
    copy_engines: list[dict]
    refused: dict[str, int]             # decisions the fabric refused, by reason
    map_full: dict[str, int] = field(default_factory=dict)  # hash map -> new keys refused, every entry in use
    map_entries_past: dict[str, int] = field(default_factory=dict)  # map -> its entries, where past REPORT_ENTRIES
    spans: list[tuple] = field(default_factory=list)   # (track, name, start ns, dur ns, args or None)
    map_types: dict[str, tuple] = field(default_factory=dict)   # name -> (kind, key type, value type), as declared
    record_layouts: dict[str, list] = field(default_factory=dict)   # ringbuf name -> its emits' fields (manifest)
    histograms: dict[str, dict] = field(default_factory=dict)   # hist/lhist map name -> its buckets (manifest)
    device_names: dict[int, str] = field(default_factory=dict)  # device id -> name, for device-typed keys and values
    explain: dict | None = None         # the stalls' root-cause chains (`explain.summary`), where recorded
    explain_asked: bool = False         # ... and whether the report shows them (else only the trace)


#: why the fabric may refuse each decision it counts under `refused`
REFUSED = {"route": "no link to that device, no path from there to the chunk's destination, or only one back "
                    "through a device it already crossed (a loop)",
           "tier": "a device that holds no memory, or one without room for the data, or no path to it that does "
                   "not loop, or data that is not kept where it lands (weights and KV a GPU reads, KV a NIC "
                   "exports: only KV written back may go to another memory)"}


def collect(r: RunRecord) -> dict:
    """The run's figures as a JSON-ready dict."""
    w, end = r.workload, r.finished_ns
    layers = [{"layer": layer, **{k: round(v, 4) for k, v in sorted(s.items())}}
              for layer, s in sorted(r.layer_stats.items())]
    by_mv = defaultdict(list)
    for t in r.transfers:
        by_mv[t.name].append(t)
    movements = []
    for name, ts in sorted(by_mv.items()):
        nbytes = sum(t.bytes for t in ts)
        span = max(t.end for t in ts) - min(t.start for t in ts)
        busy = sum(t.end - t.start for t in ts)
        p50, p99 = percentiles([x for t in ts for x in t.queue_waits], (50, 99))
        movements.append({"name": name, "class": ts[0].cls, "operator": ts[0].operator or None,
                          "transfers": len(ts), "bytes": nbytes,
                          "avg_gbps": round(nbytes / busy, 3) if busy else 0.0,
                          "span_ms": round(span / 1e6, 4),
                          "issued_avg_ms": round(sum(t.start for t in ts) / len(ts) / 1e6, 4),
                          "queue_p50_us": round(p50 / 1e3, 3),
                          "queue_p99_us": round(p99 / 1e3, 3),
                          "stall_ms": round(r.stall_by_movement.get(name, 0.0) / 1e6, 4)})
    horizon = max(end, r.kv_done_ns, 1.0)
    links = [_link(srv, horizon) for srv in r.servers]
    return {"schema": SCHEMA, "policy": r.policy, "backend": r.backend, "backend_load": r.backend_load,
            "workload": {"model": w.model.name, "prompt": w.prompt, "batch": w.batch, "tp": w.tp,
                         "chunk_tokens": w.chunk_tokens or w.prompt, "weights": w.weights, "kv": w.kv,
                         "kv_export": w.kv_export},
            "stack": r.stack, "gpu": r.gpu,
            "ttft_ms": round(end / 1e6, 4), "kv_done_ms": round(r.kv_done_ns / 1e6, 4),
            "compute_ms": round(sum(r.operator_ms.values()), 4),
            "allreduce_beyond_profile_ms": round(r.beyond_profile_ms, 4),
            "operators": {name: round(ms, 4) for name, ms in r.operator_ms.items()},
            "events": r.events, "layers": layers, "movements": movements,
            "links": sorted(links, key=lambda x: x["name"]), "islands": r.islands,
            "copy_engines": r.copy_engines, "maps": _jsonable(r.maps), "map_full": r.map_full,
            "map_entries_past": r.map_entries_past, "map_entries": decoded_maps(r),
            "map_records": decoded_records(r), "map_histograms": decoded_histograms(r),
            "faults": r.faults, "refused": r.refused, **({"explain": r.explain} if r.explain_asked else {})}


def utilisation(span: np.ndarray, horizon: float, bins: int = TIMELINE_BINS) -> np.ndarray:
    """The share of each of ``bins`` equal bins of [0, horizon] a link spent sending (``span``:
    its intervals as `servers.Intervals.array`)."""
    if not len(span):
        return np.zeros(bins)
    width = horizon / bins
    return np.minimum(np.diff(_sent_before(span[:, 0], span[:, 1], np.arange(bins + 1) * width)) / width, 1.0)


def _sent_before(start, stop, edges):
    """How long a link has sent before each of ``edges``: its intervals never overlap (it sends
    one chunk at a time), so in time order those begun before an edge are whole but the last,
    which the edge may cut."""
    order = np.argsort(start, kind="stable")
    start, stop = start[order], stop[order]
    length = np.maximum(stop - start, 0.0)
    whole = np.concatenate([[0.0], np.cumsum(length)])
    begun = np.searchsorted(start, edges, side="right")
    last = np.maximum(begun - 1, 0)
    cut = np.where(begun > 0, np.clip(edges - start[last], 0.0, length[last]), 0.0)
    return whole[last] + cut


def _link(srv, horizon: float) -> dict:
    """A link's bytes, chunks and utilisation: on average, at its peak and over the run in
    TIMELINE_BINS bins."""
    span = srv.intervals.array()
    util = utilisation(span, horizon)
    return {"name": srv.name, "bytes": srv.bytes, "chunks": len(span), "bw_gbps": round(srv.bw / 1e9, 3),
            "util_avg": round(float(np.sum(span[:, 1] - span[:, 0]) / horizon), 4),
            "util_peak": round(float(util.max()) if len(util) else 0.0, 4),
            "timeline": [round(float(x), 3) for x in util]}


def decoded_maps(r: RunRecord) -> dict[str, list[dict]]:
    """Each hash or array map's entries at the run's end with their declared types: a device
    key or value by its name, a value with its unit (``{"key", "value", "text"}``)."""
    out, names = {}, r.device_names
    for name, entries in r.maps.items():
        kind, key_type, value_type = r.map_types.get(name, ("?", None, None))
        if kind != "ringbuf" and name not in r.histograms and isinstance(entries, dict):
            out[name] = [{"key": k, "value": v, "key_text": _shown(k, key_type, names),
                          "text": _shown(v, value_type, names)}
                         for k, v in sorted(entries.items())]
    return out


def decoded_histograms(r: RunRecord) -> dict[str, list[dict]]:
    """Each histogram's buckets that counted anything, in order: ``{"lo", "hi", "count",
    "text"}`` (hi None for an lhist's last, open bucket; text as ``[1us, 2us)``)."""
    out = {}
    for name, h in r.histograms.items():
        counts = r.maps.get(name) or {}
        rows = []
        for k in sorted(k for k, n in counts.items() if n):
            lo, hi = _bucket(h, k)
            shown = [_shown(x, h["dim"], {}) for x in (lo, hi) if x is not None]
            rows.append({"lo": lo, "hi": hi, "count": counts[k],
                         "text": f"[{shown[0]}, {shown[1]})" if hi is not None else f"[{shown[0]}, ...)"})
        out[name] = rows
    return out


def _bucket(h: dict, k: int) -> tuple[int, int | None]:
    """The values bucket k of a histogram counts: [lo, hi), hi None for no bound."""
    if h["kind"] == "hist":
        return (0, 2) if k == 0 else (1 << k, 1 << (k + 1))
    lo, hi, step = h["lo"], h["hi"], h["step"]
    if k == 0:
        return 0, lo
    return (lo + (k - 1) * step, lo + k * step) if lo + (k - 1) * step < hi else (hi, None)


def _hist_table(rows: list[dict], width: int = 40) -> list[str]:
    """bpftrace's picture of a histogram: each bucket, its count and a bar."""
    most = max(r["count"] for r in rows)
    label = max(len(r["text"]) for r in rows)
    return [f"{r['text']:<{label}} {r['count']:>10,} |{'@' * round(width * r['count'] / most):<{width}}|"
            for r in rows]


def _shown(v: int, dim: str | None, device_names: dict) -> str:
    """A value as its declared type says: a dimension with its unit, a device by its name, a
    number in full (u32/u64, a count)."""
    from fabric_ext.units import BASE_UNIT, DEVICE, format_quantity
    if dim == DEVICE:
        return device_names.get(v, str(v))
    return format_quantity(v, dim) if dim in BASE_UNIT else str(v)


def decoded_records(r: RunRecord) -> dict[str, list[dict]]:
    """Each ringbuf's records as the fields of the ``emit`` that wrote them (its line, each
    field by name with its value and, where it has a dimension, its unit).  A record is known
    by its length: where emits of the same length share the map, the first one's names are
    used and the line says which emits it may be."""
    out = {}
    for name, layouts in r.record_layouts.items():
        dump = r.maps.get(name)
        if not isinstance(dump, dict) or not dump.get("records"):
            continue
        by_size: dict[int, list[dict]] = {}
        for layout in layouts:
            by_size.setdefault(8 * len(layout["fields"]), []).append(layout)
        rows = []
        for rec in dump["records"]:
            raw = bytes.fromhex(rec)
            found = by_size.get(len(raw))
            if not found:
                rows.append({"line": None, "fields": {}, "hex": rec})
                continue
            values = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
            fields = {}
            for f, v in zip(found[0]["fields"], values):
                fields[f["name"]] = {"value": v, "text": _shown(v, f.get("dim"), r.device_names)}
            rows.append({"line": "/".join(str(x["line"]) for x in found), "fields": fields})
        out[name] = rows
    return out


def _jsonable(maps):
    return {k: ({str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) and "records" not in v else v)
            for k, v in maps.items()}


def _records_table(rows: list[dict]) -> str:
    """Records as a table: one column per field name (of every emit shown), then the line."""
    names = list(dict.fromkeys(n for row in rows for n in row["fields"]))
    return _table([[row["fields"][n]["text"] if n in row["fields"] else "" for n in names]
                   + [row["line"] or f"? ({row['hex']})"] for row in rows], names + ["emit line"])


def _prefill(w: dict) -> str:
    """``prefill of llama3-8b: 8192 tokens x 1 in passes of 2048, TP 4``."""
    chunk = w.get("chunk_tokens") or w["prompt"]
    return (f"prefill of {w['model']}: {w['prompt']} tokens x {w['batch']}"
            + (f" in passes of {chunk}" if chunk < w["prompt"] else "") + f", TP {w['tp']}")


def render_comparison(runs: list[dict]) -> str:
    """Policies side by side on one workload: time to first token (and its baseline's), then
    each movement's GB/s and GPU stall under each policy."""
    names = _run_names(runs)
    out = [_prefill(runs[0]["workload"])]
    if any(r["workload"] != runs[0]["workload"] for r in runs):
        out = [f"{n}: {_prefill(r['workload'])}" for n, r in zip(names, runs)]
        out.append("note: the policies' workloads differ (their own declarations); give --model, --prompt, "
                   "--batch, --tp to run them all on one")
    out.append("")
    with_base = any("baseline" in r for r in runs)
    rows = [[n, f"{r['ttft_ms']:.3f}", f"{r['kv_done_ms']:.3f}"]
            + (([f"{r['baseline']['ttft_ms']:.3f}", f"{r['policy_speedup']:.3f}x"] if "baseline" in r else ["-", "-"])
               if with_base else [])
            for n, r in zip(names, runs)]
    out.append(_table(rows, ["policy", "TTFT ms", "KV done ms"] + (["baseline TTFT ms", "speedup"] if with_base else [])))
    movements = sorted({m["name"] for r in runs for m in r["movements"]})
    by = [{m["name"]: m for m in r["movements"]} for r in runs]
    table = []
    for mv in movements:
        cells = []
        for b in by:
            m = b.get(mv)
            cells += [f"{m['avg_gbps']:.2f}", f"{m['stall_ms']:.3f}"] if m else ["-", "-"]
        table.append([mv] + cells)
    out += ["", _table(table, ["movement"] + [f"{n} {what}" for n in names for what in ("GB/s", "stall ms")])]
    return "\n".join(out)


def _run_names(runs: list[dict]) -> list[str]:
    """Each run's column name: its policy's file name, its path where two share that, and its
    place in the command line where two are the same policy."""
    paths = [str(r["policy"] or f"run {i}") for i, r in enumerate(runs, 1)]
    stems = [Path(p).stem for p in paths]
    return [stem if stems.count(stem) == 1 else path if paths.count(path) == 1 else f"{stem} #{i}"
            for i, (stem, path) in enumerate(zip(stems, paths), 1)]


def _decision_shares(island: dict, width: int = 90) -> str:
    """``forward.priority=7 62%/1 38%``: each decision's values by their share of the hook's events."""
    parts = []
    for key, counts in island["decisions"].items():
        events = island["per_hook"].get(key.split(".")[0]) or sum(counts.values())
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        parts.append(f"{key}=" + "/".join(f"{v} {c / events:.0%}" for v, c in ranked))
    text = ", ".join(parts)
    return text if len(text) <= width else text[:width - 3] + "..."


#: the movements table's figures: (header, report key, format); with a baseline, each has its
#: baseline's beside it
MOVEMENT_FIGURES = (("GB/s", "avg_gbps", "{:.2f}"), ("queue p50 us", "queue_p50_us", "{:.2f}"),
                    ("queue p99 us", "queue_p99_us", "{:.2f}"), ("GPU stall ms", "stall_ms", "{:.3f}"))


def movement_table(report: dict, baseline: dict | None) -> tuple[list[str], list[list]]:
    """Headers and rows of the movements table; with a baseline, its figure beside each figure
    ("-" for a movement the baseline did not make)."""
    base_mv = {m["name"]: m for m in (baseline or {}).get("movements", [])}
    headers = ["movement", "class", "MiB"]
    for header, _, _ in MOVEMENT_FIGURES:
        headers += [header, "baseline"] if baseline else [header]
    rows = []
    for m in report["movements"]:
        b = base_mv.get(m["name"])
        row = [m["name"], m["class"], f"{m['bytes'] / 2**20:.1f}"]
        for _, key, fmt in MOVEMENT_FIGURES:
            row += [fmt.format(m[key])] + ([fmt.format(b[key]) if b else "-"] if baseline else [])
        rows.append(row)
    return headers, rows


def link_table(report: dict, baseline: dict | None, shown: int | None) -> tuple[list[str], list[list], int]:
    """Headers and rows of the links table, busiest first, with the baseline's utilisation beside
    where there is one; ``shown`` of those that carried bytes (None: every link), and how many
    that carried bytes are left out."""
    ranked = sorted(report["links"], key=lambda x: (-x["util_avg"], x["name"]))
    used = [x for x in ranked if x["bytes"]]
    rows = ranked if shown is None else used[:shown]
    base = {x["name"]: x for x in (baseline or {}).get("links", [])}
    return (["link", "MiB", "util avg", "util peak"] + (["baseline util avg"] if baseline else []),
            [[x["name"], f"{x['bytes'] / 2**20:.1f}", f"{x['util_avg'] * 100:.1f}%", f"{x['util_peak'] * 100:.1f}%"]
             + ([f"{base[x['name']]['util_avg'] * 100:.1f}%" if x["name"] in base else "-"] if baseline else [])
             for x in rows], len(used) - len(rows))


def island_table(report: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of the islands table: each island whose programs saw events."""
    return (["island", "kind", "runtime", "events", "runs", "ns/run", "decisions"],
            [[i["name"], i["kind"], i["runtime"], i["events"], i["invocations"], i["ns_per_invocation"],
              _decision_shares(i)] for i in report["islands"] if i["events"]])


def _links(report, baseline, shown):
    headers, rows, left = link_table(report, baseline, shown)
    return [_table(rows, headers)] + (
        [f"... and {left} more link{'s' * (left != 1)} that carried bytes (--links all, or --links N)"]
        if shown is not None and left > 0 else [])


def _table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _load_line(load: dict | None) -> str:
    if not load or "compiled" not in load:
        return ""
    how = [f"{load['compiled']} compiled in {load['compile_ms']:.1f} ms"] if load["compiled"] else []
    how += [f"{load['from_cache']} from the code cache"] if load["from_cache"] else []
    how += [f"{load['in_process']} already loaded"] if load.get("in_process") else []
    how += ["every access checked at run time"] if load.get("checks") == "all" else []
    return f" ({', '.join(how) or 'no programs'}; ready in {load['load_ms']:.1f} ms)"


LINKS_SHOWN = 8       # links the summary lists unless asked for more (`render`'s ``links``)
MAP_ROWS = 16         # entries of a map the summary shows


def render(report: dict, baseline: dict | None = None, links: int | None = LINKS_SHOWN) -> str:
    """The terminal summary: time to first token, movements, busiest links, islands, faults.
    ``links``: how many of the links that carried bytes to list, busiest first (None: every
    link, idle ones too)."""
    w = report["workload"]
    out = [f"{_prefill(w)}; weights on {w['weights']}, KV to {w['kv']}"
           + (f", exported through {w['kv_export']}" if w['kv_export'] else ""),
           f"backend {report['backend']}{_load_line(report.get('backend_load'))}, {report['events']} events", ""]
    if baseline:
        gain = baseline["ttft_ms"] / report["ttft_ms"] if report["ttft_ms"] else 0
        out.append(f"time to first token: {report['ttft_ms']:.3f} ms with the policy, "
                   f"{baseline['ttft_ms']:.3f} ms baseline ({gain:.3f}x)")
    else:
        kv_moves = any(m["class"] == "kv" and m["bytes"] for m in report["movements"])
        out.append(f"time to first token: {report['ttft_ms']:.3f} ms"
                   + (f" (KV all written by {report['kv_done_ms']:.3f} ms)" if kv_moves else ""))
    out.append("")
    headers, rows = movement_table(report, baseline)
    out.append(_table(rows, headers))
    out.append("")
    out += _links(report, baseline, links)
    if report["islands"]:
        headers, rows = island_table(report)
        out += ["", _table(rows, headers)]
    for name, entries in report.get("map_entries", {}).items():
        if entries:
            out += ["", f"map {name}:", _table([[e["key_text"], e["text"]] for e in entries[:MAP_ROWS]], ["key", "value"])]
            if len(entries) > MAP_ROWS:
                total = report.get("map_entries_past", {}).get(name)
                out.append(f"... and {len(entries) - MAP_ROWS} more entries (--json has them all)" if total is None else
                           f"... and {total - MAP_ROWS:,} more entries (--json has the first {len(entries):,} by key)")
    for name, rows in report.get("map_histograms", {}).items():
        if rows:
            out += ["", f"hist {name}:", *_hist_table(rows)]
    for name, rows in report.get("map_records", {}).items():
        out += ["", f"ringbuf {name}:", _records_table(rows[:MAP_ROWS])]
        if len(rows) > MAP_ROWS:
            out.append(f"... and {len(rows) - MAP_ROWS} more records (--json has them all)")
    drops = [(name, m) for name, m in report["maps"].items() if isinstance(m, dict) and m.get("dropped")]
    if drops:
        out.append("")
    for name, m in drops:
        out.append(f"ringbuf {name}: {m['dropped']} records dropped, {len(m['records'])} kept: it was full "
                   "(nothing consumes it during a run); make it larger or emit less")
    full = report.get("map_full", {})
    if full:
        out.append("")
    for name, n in full.items():
        out.append(f"map {name}: {n:,} updates of a new key refused: all its entries were in use (as the kernel "
                   "refuses them); make it larger, or an lru_hash, which evicts the least recently used")
    refused = {k: v for k, v in report.get("refused", {}).items() if v}
    if refused:
        out.append("")
    for what, n in refused.items():
        out.append(f"{what}: {n} decisions not applied: {REFUSED.get(what, 'the fabric refused them')}")
    if report["faults"]:
        out.append("")
        for f in report["faults"]:
            out.append(f"fault: {f['where']}: {f['reason']} -- detached from {f['island']}.{f['hook']}, "
                       "defaults apply from then on")
    return "\n".join(out)


def plots(report: dict, folder) -> list[str]:
    """PNG plots: link utilisation over time and per-layer compute vs stall (needs matplotlib).
    A report with a baseline (``--baseline``) has it overlaid: each link's baseline dotted in
    its colour, the baseline's per-layer total as a line over the policy's bars."""
    import matplotlib
    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = report.get("baseline")
    out = []
    fig, ax = plt.subplots(figsize=(10, 4))
    colours = plt.get_cmap("tab10").colors
    styles = ("-", "-.")         # 12 links: colour and style tell each apart
    base_links = {l["name"]: l for l in base["links"]} if base else {}
    for i, l in enumerate(sorted(report["links"], key=lambda x: -x["util_avg"])[:12]):
        look = {"color": colours[i % len(colours)], "linestyle": styles[i // len(colours)]}
        ax.plot(*_timeline(report, l), label=l["name"], **look)
        if l["name"] in base_links:
            ax.plot(*_timeline(base, base_links[l["name"]]), label=f"{l['name']} (baseline)",
                    **look | {"linestyle": ":", "alpha": 0.8})
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("utilisation (%)")
    if ax.get_legend_handles_labels()[0]:       # (a run that moved nothing has no lines)
        ax.legend(fontsize=7, ncol=2)
    ax.set_title("link utilisation" + (" (dotted: baseline, no programs)" if base else ""))
    out.append(_save(plt, fig, folder / "link_utilisation.png"))
    fig, ax = plt.subplots(figsize=(10, 4))
    L = [x["layer"] for x in report["layers"]]
    parts = [("attention_ms", "attention"), ("ffn_ms", "FFN"), ("attention_stall_ms", "stall before attention"),
             ("ffn_stall_ms", "stall before FFN"), ("allreduce_ms", "all-reduce")]
    bottom = np.zeros(len(L))
    for key, label in parts:
        vals = np.array([x.get(key, 0.0) for x in report["layers"]])
        ax.bar(L, vals, bottom=bottom, label=label)
        bottom += vals
    if base:
        total = [sum(x.get(key, 0.0) for key, _ in parts) for x in base["layers"]]
        ax.step([x["layer"] for x in base["layers"]], total, where="mid", color="black", label="baseline total")
    ax.set_xlabel("layer")
    ax.set_ylabel("ms")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title("per-layer compute and stall")
    out.append(_save(plt, fig, folder / "layers.png"))
    return out


def _timeline(report: dict, link: dict):
    """A link's utilisation samples (%) against time (ms) over the run."""
    xs = np.linspace(0, max(report["ttft_ms"], report["kv_done_ms"]), len(link["timeline"]))
    return xs, np.array(link["timeline"]) * 100


def _save(plt, fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def write_json(path, data, indent: int | None = 1) -> None:
    """Write ``data`` as JSON, whole or not at all (``indent=None``: compact, for a trace)."""
    from fabric_ext.runtime.machine.fsutil import atomic_write_text
    atomic_write_text(Path(path), json.dumps(data, indent=indent, separators=None if indent else (",", ":")) + "\n")
