"""Every decision of every hook in the catalogue changes a run, where the catalogue says.

For each (hook, decision) pair of `fabric_ext.contract.hooks`, a policy is generated that sets the
decision at that hook, compiled and run on a small fabric and model beside the same policy
without the decision; the report must differ in what the decision's `shows` names.  A
decision added to the catalogue without a scenario here, or without an effect, fails.
"""
import json

import pytest

from fabric_ext.contract.hooks import HOOKS, SHOWS
from test_runtime import compile_text, run_engine

FABRIC = """
fabric small {
  gpu gpu0, gpu1
  cxl_switch sw0
  cxl_mem pool0 at sw0 { bw: 64GB/s }
  cxl_mem pool1 at sw0 { bw: 64GB/s }
  dpu nic0 { line_rate: 400Gbps }
  host cpu0
  link gpu0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu1 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link nic0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link cpu0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link cpu0 <-> nic0 { bw: 32GB/s; latency: 900ns; kind: pcie }
  link gpu0 <-> gpu1 { bw: 450GB/s; latency: 1us; kind: nvlink }
}
"""

#: a two-layer model: every scenario runs in well under a second
MODEL = {"num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 8192, "vocab_size": 32000}

# (a route that loops back is refused: tests/test_fabric_model.py)
# weights stream from pool0 while KV is written back to it: the two meet at the pool's memory
POOL = ("weights: pool0; kv: pool0",
        "movement w = weights : pool0 -> gpu* { chunk: 64KiB }\nmovement kv = kv : gpu* -> pool0")
EXPORT = ("weights: hbm; kv: hbm; kv_export: nic0", "movement e = kv : gpu* -> nic0 { chunk: 64KiB }")
# weights and the KV a chunked prefill reads back come in from the network, and meet after nic0
FROM_NIC = ("weights: nic0; kv: nic0; prefill_chunk: 1024; chunk: 64KiB", "movement w = weights : nic0 -> gpu* { chunk: 64KiB }")

#: hook -> (workload, movements, the handler with {d} for the decision, the movement to watch)
SCENARIOS = {
    ("gpu", "issue"): POOL + ("on w.issue at gpu* {{ {d} }}", "w"),
    ("gpu", "complete"): POOL + ("on w.complete at gpu* {{ {d} }}", "w"),
    ("gpu", "launch"): POOL + ("on gpu*.launch {{ {d} }}", "w"),
    ("cxl_switch", "forward"): EXPORT + ("on e.forward at sw0 {{ {d} }}", "e"),
    ("cxl_switch", "mem_access"): POOL + ("on kv.mem_access at sw0 {{ {d} }}", "kv"),
    ("dpu", "tx"): EXPORT + ("on e.tx at nic0 {{ {d} }}", "e"),
    ("dpu", "rx"): FROM_NIC + ("on w.rx at nic0 {{ {d} }}", "w"),
    ("host", "alloc"): POOL + ("on cpu0.alloc {{ {d} }}", "w"),
}

#: hook -> its scenario's fabric where not `FABRIC`: what arrives from the network is received at the
#: line rate, so a decision at rx (which comes after) shows where the NIC's link is the slower
FABRICS = {("dpu", "rx"): FABRIC.replace("link nic0 <-> sw0 { bw: 63GB/s", "link nic0 <-> sw0 { bw: 16GB/s")}

#: a value for each decision that must show, and where only one flow of two should take it
VALUES = {"priority": "if ev.src == gpu0 || ev.dst == gpu0 {{ priority = 7 }}", "rate": "rate = 1GB/s",
          "defer": "defer = 200us", "prefetch": "prefetch = 4", "coalesce": "coalesce = 1MiB",
          "stream": "stream = 3", "route": "route = cpu0", "tier": "tier = pool1",
          "queue": "rate = 10GB/s; queue = 1"}
#: what both runs of a decision set, so that the decision's effect can show
BESIDE = {"queue": "rate = 10GB/s"}     # two flows in one queue share its rate

PAIRS = [(kind, name, f.name) for (kind, name), h in HOOKS.items() for f in h.decisions]


def _policy(kind, name, decision):
    workload, movements, handler, _ = SCENARIOS[(kind, name)]
    body = handler.format(d=VALUES[decision[0]].format() if decision[1] else BESIDE.get(decision[0], ""))
    return (f"{FABRICS.get((kind, name), FABRIC)}\nworkload w {{ model: \"MODEL\"; prompt: 2048; tp: 2; {workload} }}\n"
            f"{movements}\npolicy p {{ {body} }}\n")


def _run(tmp_path, text, tag):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(MODEL))
    out = compile_text(tmp_path, text.replace("MODEL", str(model)), tag)
    return run_engine(out, model=str(model), prompt=2048, tp=2)[0]


def _movement(report, name):
    return next(m for m in report["movements"] if m["name"] == name)


def _shown(shows, base, run, movement):
    """What the decision's `shows` names, in the baseline run and in the run with it."""
    if shows == "links":          # (the bytes may leave the movement: a tier places the data elsewhere)
        return {x["name"]: x["bytes"] for x in base["links"]}, {x["name"]: x["bytes"] for x in run["links"]}
    a, b = _movement(base, movement), _movement(run, movement)
    if shows == "queueing":
        return (a["queue_p50_us"], a["queue_p99_us"]), (b["queue_p50_us"], b["queue_p99_us"])
    if shows in ("throughput", "latency"):         # GB/s of the movement's transfers, while they last
        return a["avg_gbps"], b["avg_gbps"]
    if shows == "schedule":       # weights issued earlier (they may then wait for their stream)
        return a["issued_avg_ms"], b["issued_avg_ms"]
    if shows == "chunks":
        return sum(x["chunks"] for x in base["links"]), sum(x["chunks"] for x in run["links"])
    if shows == "engines":
        return [c["chunks"] for c in base["copy_engines"]], [c["chunks"] for c in run["copy_engines"]]
    raise AssertionError(f"no check for shows={shows!r}")


def test_every_pair_has_a_scenario_and_every_decision_says_where_it_shows():
    for kind, name, decision in PAIRS:
        assert (kind, name) in SCENARIOS, f"{kind}.{name}: no scenario"
        assert decision in VALUES, f"{decision}: no value to set"
        assert HOOKS[kind, name].field(decision).shows in SHOWS, f"{kind}.{name}.{decision}: shows nothing"


@pytest.mark.parametrize("kind,name,decision", PAIRS, ids=[f"{k}.{n}.{d}" for k, n, d in PAIRS])
def test_decision_changes_the_run(tmp_path, kind, name, decision):
    shows = HOOKS[kind, name].field(decision).shows
    movement = SCENARIOS[(kind, name)][3]
    base = _run(tmp_path, _policy(kind, name, (decision, False)), "base")
    run = _run(tmp_path, _policy(kind, name, (decision, True)), "with")
    before, after = _shown(shows, base, run, movement)
    assert before != after, f"{kind}.{name}: {decision} changed nothing in {shows} ({before})"
    if shows in ("throughput", "latency"):      # a rate limit or a hold makes the movement slower
        assert after < before
    if shows == "chunks":                       # coalescing sends fewer, larger chunks
        assert after < before
    if shows == "schedule":                     # a deeper prefetch issues weights earlier
        assert after < before
