"""Root-cause chains (`fabric-run --explain`) on scenarios whose cause is known by construction.

Each runs the small fabric and two-layer model of the decision tests with one cause built in
(a defer, a rate cap, KV writeback competing with the weights at the pool, a link too slow for
the weights, a link whose latency the prefetch depth does not cover) and checks what the
longest chains blame, the line they name, and that every chain's steps sum to its stall.
"""
import json

import pytest
from test_decision_effects import FABRIC, MODEL
from test_dispatch import _timeless

from fabric_ext.runtime.simulation.explain import render, render_against
from policy_helpers import compiled
from test_runtime import compile_text, fabric_run, run_engine
from trace_format import check_trace

WEIGHTS = "movement w = weights : pool0 -> gpu* { chunk: 64KiB }"
KV = "movement kv = kv : gpu* -> pool0"
SLOW_POOL = FABRIC.replace("pool0 at sw0 { bw: 64GB/s }", "pool0 at sw0 { bw: 8GB/s }")
FAR_GPUS = FABRIC.replace("latency: 600ns; kind: cxl", "latency: 2ms; kind: cxl")


def _policy(workload, movements, body="", fabric=FABRIC):
    return (f"{fabric}\nworkload w {{ model: \"MODEL\"; prompt: 2048; tp: 2; {workload} }}\n{movements}\n"
            f"policy p {{\n{body}\n}}\n")


def _explain(tmp_path, text, tag="p", **opts):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(MODEL))
    out = compile_text(tmp_path, text.replace("MODEL", str(model)), tag)
    report, _ = run_engine(out, model=str(model), prompt=2048, tp=2, explain=True, **opts)
    return report


def _line_of(text, snippet):
    return next(i for i, line in enumerate(text.splitlines(), 1) if snippet in line)


def _check_sums(report):
    """Every chain's steps sum to its stall (within 1 %), and the chains are every stall."""
    ex = report["explain"]
    for c in ex["chains"]:
        assert sum(s["ms"] for s in c["steps"]) == pytest.approx(c["stall_ms"], rel=0.01), c
    assert sum(c["stall_ms"] for c in ex["chains"]) == pytest.approx(
        sum(m["stall_ms"] for m in report["movements"]), rel=0.01)
    assert ex["chains"], "the scenario must stall"


def _top(report):
    """The longest chain and its largest step."""
    chain = report["explain"]["chains"][0]
    return chain, chain["steps"][0]


def _time(report, **match):
    """The time the chains' steps that match blame, in all."""
    return sum(s["ms"] for c in report["explain"]["chains"] for s in c["steps"]
               if all(s.get(k) == v for k, v in match.items()))


def test_a_defer_blocks_and_names_its_line(tmp_path):
    text = _policy("weights: pool0; kv: hbm", WEIGHTS, "  on w.issue at gpu* {\n    defer = 200us\n  }")
    report = _explain(tmp_path, text)
    _check_sums(report)
    chain, step = _top(report)
    assert chain["kind"] == "blocked" and chain["movement"] == "w"
    assert step["cause"] == "defer" and step["kind"] == "blocked"
    assert step["line"] == _line_of(text, "defer = 200us") and step["file"].endswith("p.fx")
    assert step["share"] > 0.9


def test_a_rate_cap_slows_and_names_its_line(tmp_path):
    text = _policy("weights: pool0; kv: hbm", WEIGHTS, "  on w.issue at gpu* { rate = 2GB/s }")
    report = _explain(tmp_path, text)
    _check_sums(report)
    chain, step = _top(report)
    assert chain["kind"] == "slowed"
    assert (step["cause"], step["line"]) == ("rate", _line_of(text, "rate = 2GB/s"))
    assert "held by rate at gpu" in step["text"]


def test_kv_writeback_at_the_weights_priority_is_named_with_its_bytes(tmp_path):
    same = _explain(tmp_path, _policy("weights: pool0; kv: pool0", f"{WEIGHTS}\n{KV}"), "same")
    _check_sums(same)
    behind_kv = [s for c in same["explain"]["chains"] for s in c["steps"]
                 if s["cause"] == "queued" and s["movement"] == "kv"]
    assert behind_kv and all(s["kind"] == "slowed" and s["bytes"] > 0 and s["where"] == "pool0 memory"
                             and s["priority"] == 3 for s in behind_kv)
    assert all(c["kind"] == "slowed" for c in same["explain"]["chains"] if c["movement"] == "w")
    # KV below the weights at the pool: what was queued behind it mostly goes
    low = _explain(tmp_path, _policy("weights: pool0; kv: pool0", f"{WEIGHTS}\n{KV}",
                                     "  on kv.forward at sw0 { priority = 0 }"), "low")
    assert _time(low, cause="queued", movement="kv") < 0.5 * _time(same, cause="queued", movement="kv")
    against = render_against(low["explain"], same["explain"])
    assert "queued at pool0 memory behind kv (priority 3)" in against and "removed" in against


def test_a_link_too_slow_for_the_weights_is_bandwidth_bound(tmp_path):
    report = _explain(tmp_path, _policy("weights: pool0; kv: hbm; prefetch: 8", WEIGHTS, fabric=SLOW_POOL))
    _check_sums(report)
    chain, step = _top(report)
    assert chain["kind"] == "slowed"
    assert (step["cause"], step["where"], step["movement"]) == ("bandwidth", "pool0 memory", "w")
    assert step["share"] > 0.95
    assert _time(report, cause="queued") == 0 and _time(report, kind="blocked") < 0.1 * _time(report)


def test_host_memory_too_slow_for_the_weights_is_bandwidth_bound(tmp_path):
    """Each chunk is read from the host's memory before its first link, and holds its copy
    engine meanwhile: the wait for the engine is the memory's, not the engine's."""
    slow_host = FABRIC.replace("host cpu0", "host cpu0 { dram_bw: 4GB/s }")
    weights = "movement w = weights : cpu0 -> gpu* { chunk: 64KiB }"
    report = _explain(tmp_path, _policy("weights: cpu0; kv: hbm; prefetch: 8", weights, fabric=slow_host))
    _check_sums(report)
    chain, step = _top(report)
    assert (step["cause"], step["where"], step["movement"]) == ("bandwidth", "cpu0 memory", "w")
    assert _time(report, cause="bandwidth", where="cpu0 memory") > 0.9 * _time(report)
    assert _time(report, cause="engine") == 0


def test_a_shallow_prefetch_blocks_and_a_deeper_one_removes_it(tmp_path):
    shallow = _explain(tmp_path, _policy("weights: pool0; kv: hbm", WEIGHTS, fabric=FAR_GPUS), "shallow")
    _check_sums(shallow)
    chain, step = _top(shallow)
    assert chain["kind"] == "blocked"
    assert step["cause"] == "prefetch" and step["decision"] == "prefetch depth 1 (the workload's)"
    assert step["text"] == f"issued late to {chain['gpu']}: prefetch depth 1 (the workload's)"
    assert "line" not in step
    deep = _explain(tmp_path, _policy("weights: pool0; kv: hbm; prefetch: 4", WEIGHTS, fabric=FAR_GPUS), "deep")
    assert _time(deep, cause="prefetch") < 0.1 * _time(shallow, cause="prefetch")


def test_a_prefetch_decision_is_named_by_its_line(tmp_path):
    text = _policy("weights: pool0; kv: hbm", WEIGHTS, "  on gpu*.launch { prefetch = 1 }", fabric=FAR_GPUS)
    step = _top(_explain(tmp_path, text))[1]
    assert step["cause"] == "prefetch" and step["line"] == _line_of(text, "prefetch = 1")
    assert step["decision"].startswith("prefetch = 1 at gpu") and step["decision"].endswith(".launch")


@pytest.mark.parametrize("name", ["prefill_qos", "nic_pacing", "kv_tiering", "telemetry"])
def test_evidence_is_off_unless_asked_and_never_changes_the_run(name):
    plain, eng = run_engine(compiled(name))
    assert "explain" not in plain and eng.prefill.stalls is None
    assert all(t.last_chunk is None for t in eng.fabric.transfers)
    assert all(s.occupants is None for s in eng.fabric.servers.values())
    explained, _ = run_engine(compiled(name), explain=True)
    assert _timeless({k: v for k, v in explained.items() if k != "explain"}) == _timeless(plain)
    _check_sums(explained)
    assert _time(explained, cause="untracked") == 0      # the evidence places every instant


def test_the_text_names_the_longest_waits_and_the_causes(tmp_path):
    text = _policy("weights: pool0; kv: hbm", WEIGHTS, "  on w.issue at gpu* { defer = 200us }")
    shown = render(_explain(tmp_path, text)["explain"])
    assert shown.startswith("Why the GPUs waited:")
    assert "(and 1 more GPUs:" in shown          # the two GPUs' waits of one block are one entry
    assert f"held by defer at gpu0.issue ({tmp_path / 'p.fx'}:{_line_of(text, 'defer')})" in shown
    assert "Causes over those stalls:" in shown
    assert render({"chains": []}) == "Why the GPUs waited: they never did (no stall to explain)"


def test_fabric_run_explain(tmp_path):
    out = tmp_path / "run.json"
    r = fabric_run("--explain", "--baseline", "--json", out)
    assert r.returncode == 0, r.stderr
    assert "Why the GPUs waited:" in r.stdout and "Against the baseline" in r.stdout
    data = json.loads(out.read_text())
    assert data["explain"]["chains"] and data["baseline"]["explain"]["chains"]
    assert data["explain"]["stall_ms"] < data["baseline"]["explain"]["stall_ms"]
    # the all-reduces (TP 8) are chains of the group: their fixed cost, then the ring at the bus bandwidth
    ring = [c for c in data["explain"]["chains"] if c["gpu"] == "all"]
    assert ring and all({s["cause"] for s in c["steps"]} <= {"collective", "bandwidth", "latency"} for c in ring)
    assert any("at the collective's bus bandwidth" in s["text"] for c in ring for s in c["steps"])


def test_the_trace_links_each_stall_to_what_its_chain_blames(tmp_path):
    trace = tmp_path / "run.trace.json"
    r = fabric_run("--policy", compiled("prefill_qos"), "--prompt", "512", "--tp", "2", "--trace", trace, "-q")
    assert r.returncode == 0, r.stderr
    data = json.loads(trace.read_text())
    check_trace(data)          # the flows' ends pair and leave a stall slice
    events = data["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    stalls = [e for e in events if e.get("cat") == "stall" and e["ph"] == "X"]
    ends = [e for e in events if e["ph"] == "f"]
    assert stalls and ends
    assert all(rows[e["pid"], e["tid"]] in ("stalls", "all-reduce") for e in stalls)
    assert all(rows[e["pid"], e["tid"]] in ("hooks", "memory channel") or rows[e["pid"], e["tid"]].startswith("-> ")
               for e in ends)
    assert all(any(k.startswith(("bandwidth-bound", "queued", "issued late", "held by", "in flight", "the all-reduce"))
                   for k in e["args"]) for e in stalls)


@pytest.mark.parametrize("name,opts", [("prefill_qos", {"chunk_tokens": 128}), ("kv_tiering", {"chunk_tokens": 256}),
                                       ("nic_pacing", {"tp": 4, "prompt": 1024}), ("telemetry", {"tp": 1})])
def test_every_chain_sums_to_its_stall_across_workloads(name, opts):
    """Chunked prefills (the KV of earlier passes read back), other TP degrees: the evidence
    places every instant of every stall."""
    report, _ = run_engine(compiled(name), explain=True, **opts)
    if report["explain"]["chains"]:
        _check_sums(report)
    assert _time(report, cause="untracked") == 0


def test_a_decision_with_no_line_in_the_manifest_is_named_without_one():
    """A manifest is untrusted: a handler that says it decides rate on no line names no line."""
    from fabric_ext.runtime.simulation.explain import Explainer
    programs = [{"island": "sw0", "hook": "forward", "handlers": [{"movement": 1, "decides": {"rate": []}},
                                                                  {"movement": None, "decides": {"rate": [9]}}]}]
    ex = Explainer(None, programs)
    assert ex._handler("sw0", lambda h: h == "forward", 1, "rate") == ("forward", 9, "")
    assert ex._handler("sw0", lambda h: h == "forward", 1, "defer") == (None, None, "")


def test_a_rate_at_a_switch_names_the_forward_handlers_line(tmp_path):
    """A hold decided on entering an island (not at issue) is named by that island's handler."""
    text = _policy("weights: pool0; kv: hbm", WEIGHTS, "  on w.forward at sw0 { rate = 2GB/s }")
    report = _explain(tmp_path, text)
    _check_sums(report)
    step = _top(report)[1]
    assert (step["cause"], step["where"], step["line"]) == ("rate", "sw0", _line_of(text, "rate = 2GB/s"))
    assert step["decision"] == "rate at sw0.forward"
