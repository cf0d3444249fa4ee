"""The run as one self-contained HTML page (`fabric-run --html`, `api.Report.html`).

Tables (movements, links, islands, maps, the baseline beside), the root-cause chains where the
run has them, the plots inline (PNG as data URIs; they need matplotlib), and the policy's
source with the lines that set a decision highlighted, each with what its islands decided.
Nothing is fetched: the page opens offline.  Every text from the run or the policy is escaped.
"""
from __future__ import annotations

import base64
import re
import tempfile
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape

from fabric_ext.contract.schema import MAX_SOURCE

from ..machine.fsutil import UnreadableFile, read_bounded
from . import stats

NUMBER = re.compile(r"^-?[\d,.]+(%| \w+/?\w*)?$")     # right-aligned: 12.5, 1,024, 35%, 1.2 GB/s


def render(data: dict, manifest: dict, trace: str | None = None) -> tuple[str, list[str]]:
    """The page for a report (``data``, as `fabric-run --json` writes it) of the policy compiled
    into ``manifest``; ``trace``: the trace file to link to.  Returns the page and warnings."""
    warnings = []
    baseline = data.get("baseline")
    plots, missing = _plots(data)
    if missing:
        warnings.append(missing)
    env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"),
                      autoescape=select_autoescape(["html", "j2"]))
    w = data["workload"]
    ttft = f"{data['ttft_ms']:,.3f} ms" + (
        f" with the policy, {baseline['ttft_ms']:,.3f} ms without ({baseline['ttft_ms'] / data['ttft_ms']:.3f}x)"
        if baseline else "")
    page = env.get_template("report.html.j2").render(
        title=data["policy"], ttft=ttft, backend=data["backend"], events=f"{data['events']:,}", trace=trace,
        workload=f"{w['model']}: {w['prompt']} tokens x {w['batch']}, TP {w['tp']}; weights on {w['weights']}, "
                 f"KV to {w['kv']}" + (f", exported through {w['kv_export']}" if w["kv_export"] else ""),
        tables=_tables(data, baseline), plots=plots, plots_missing=missing,
        explain=_explain(data), sources=_sources(data, manifest))
    return page, warnings


def _cells(rows: list[list]) -> list[list[dict]]:
    return [[{"text": str(c), "num": isinstance(c, (int, float)) or bool(NUMBER.match(str(c)))} for c in row]
            for row in rows]


def _tables(data: dict, baseline: dict | None) -> list[dict]:
    out = []
    headers, rows = stats.movement_table(data, baseline)
    out.append({"id": "movements", "title": "Movements", "headers": headers, "rows": _cells(rows)})
    headers, rows, _ = stats.link_table(data, baseline, len(data["links"]))     # those that carried bytes
    idle = len(data["links"]) - len(rows)
    out.append({"id": "links", "title": "Links", "headers": headers, "rows": _cells(rows),
                "note": f"and {idle} link{'s' * (idle != 1)} that carried nothing" if idle else ""})
    headers, rows = stats.island_table(data)
    if rows:
        out.append({"id": "islands", "title": "Islands", "headers": headers, "rows": _cells(rows)})
    past = data.get("map_entries_past", {})
    for name, entries in data.get("map_entries", {}).items():
        if entries:
            out.append({"id": f"map-{name}", "title": f"Map {name}", "headers": ["key", "value"],
                        "rows": _cells([[e["key_text"], e["text"]] for e in entries]),
                        "note": f"the first {len(entries):,} of its {past[name]:,} entries, by key" if name in past else ""})
    for name, buckets in data.get("map_histograms", {}).items():
        if buckets:
            out.append({"id": f"hist-{name}", "title": f"Histogram {name}", "headers": ["bucket", "count"],
                        "rows": _cells([[b["text"], f"{b['count']:,}"] for b in buckets])})
    for name, records in data.get("map_records", {}).items():
        if records:
            fields = list(dict.fromkeys(f for r in records for f in r["fields"]))
            out.append({"id": f"ringbuf-{name}", "title": f"Ringbuf {name}", "headers": ["line", *fields],
                        "rows": _cells([[r["line"], *(r["fields"].get(f, {}).get("text", "") for f in fields)]
                                        for r in records])})
    return out


def _explain(data: dict) -> str | None:
    if "explain" not in data:
        return None
    from . import explain
    text = explain.render(data["explain"])
    if data.get("baseline", {}).get("explain"):
        text += "\n\n" + explain.render_against(data["explain"], data["baseline"]["explain"])
    return text


def _plots(data: dict) -> tuple[list[dict], str | None]:
    try:
        with tempfile.TemporaryDirectory(prefix="fabric-run-html-") as d:
            paths = stats.plots(data, d)
            return [{"title": Path(p).stem.replace("_", " "),
                     "data": base64.b64encode(Path(p).read_bytes()).decode()} for p in paths], None
    except ImportError:
        return [], "no plots: they need matplotlib (pip install 'fabric-ext[plot]')"


def _decided(data: dict, manifest: dict) -> dict[tuple[str, int], list[str]]:
    """(file, line) -> for each island whose handler sets a decision there, the movement it is
    for and what that hook decided over the run (counted per hook, not per line)."""
    islands = {i["name"]: i for i in data.get("islands", [])}
    names = {m["id"]: m["name"] for m in manifest.get("movements", [])}
    out: dict[tuple[str, int], list[str]] = {}
    for prog in manifest["programs"]:
        counts = islands.get(prog["island"], {}).get("decisions", {})
        for h in prog["handlers"]:
            for decision, lines in h.get("decides", {}).items():
                values = counts.get(f"{prog['hook']}.{decision}", {})
                said = ", ".join(f"{v} x{n:,}" for v, n in sorted(values.items(), key=lambda kv: -kv[1]))
                what = f"{prog['island']}.{prog['hook']} ({names.get(h.get('movement'), 'every movement')}): " \
                       f"{decision}; the hook decided {said}" if said else \
                       f"{prog['island']}.{prog['hook']}: {decision} never decided"
                for line in lines:
                    out.setdefault((h.get("file", ""), line), []).append(what)
    return out


def _sources(data: dict, manifest: dict) -> list[dict]:
    """Each source file of the policy, its lines with what was decided there (a file no longer
    there, or changed since it was compiled, is named but not shown)."""
    import hashlib
    decided = _decided(data, manifest)
    out = []
    for src in manifest.get("sources", []):
        entry = {"file": src["file"], "lines": None, "missing": ""}
        try:        # the manifest names it: a regular file of a policy's size at most, never a device
            text = read_bounded(Path(src["path"]), MAX_SOURCE)
        except (OSError, UnreadableFile):
            entry["missing"] = f"{src['path']} is not there any more (or is not a policy source)"
        else:
            if hashlib.sha256(text).hexdigest() != src["sha256"]:
                entry["missing"] = f"{src['path']} changed since the policy was compiled"
            else:
                entry["lines"] = [(n, line, "; ".join(decided.get((src["file"], n), [])))
                                  for n, line in enumerate(text.decode(errors="replace").splitlines(), 1)]
        out.append(entry)
    return out
