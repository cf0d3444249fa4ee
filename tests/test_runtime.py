"""fabric-run: loading errors, decisions applied, faults, cross-island maps, the report formats."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import POLICIES
from fabric_ext.codegen.driver import build
from fabric_ext.contract.bundle import create_maps, load_manifest, write_folder
from fabric_ext.contract.runtime_json import BundleError
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.simulation.engine import Engine, RunOptions
from fabric_ext.runtime.simulation.figures import figures
from policy_helpers import compiled
from trace_format import check_trace

SMALL = dict(model="llama3-8b", prompt=512, tp=2)


def run_engine(folder, backend=None, attach=True, trace=False, **overrides):
    man = load_manifest(folder)
    opts = RunOptions(**{**SMALL, **overrides}, attach=attach, trace=trace)
    eng = Engine(folder, man, create_maps(man), backend or Interpreter(), opts)
    return eng.run(), eng


def compile_text(tmp_path, text, name="p"):
    src = tmp_path / f"{name}.fx"
    shutil.copytree(POLICIES / "fabrics", tmp_path / "fabrics", dirs_exist_ok=True)
    src.write_text(text)
    d = Diagnostics()
    res = build(src, diags=d)
    assert res is not None, [x.message for x in d.items]
    out = tmp_path / f"{name}_out"
    write_folder(res.files, out)
    return out


def fabric_run(*args):
    return subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", *map(str, args)],
                          capture_output=True, text=True)


# ---- loading errors -----------------------------------------------------------------------
def test_missing_folder(tmp_path):
    with pytest.raises(BundleError, match="no such folder"):
        load_manifest(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("mine")
    for path in (tmp_path / "notes.txt", Path("/dev/zero")):      # (not to be compiled into)
        with pytest.raises(BundleError, match="not a folder; give a policy folder from fabricc compile"):
            load_manifest(path)


def test_corrupt_manifest(tmp_path):
    out = tmp_path / "o"
    shutil.copytree(compiled("nic_pacing"), out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="corrupt manifest.json"):
        load_manifest(out)


def test_schema_mismatch(tmp_path):
    out = tmp_path / "o"
    shutil.copytree(compiled("nic_pacing"), out)
    man = json.loads((out / "manifest.json").read_text())
    man["schema"] = "fabric-manifest/99"
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BundleError, match="recompile"):
        load_manifest(out)


def test_changed_object_is_detected(tmp_path):
    out = tmp_path / "o"
    shutil.copytree(compiled("nic_pacing"), out)
    data = bytearray((out / "nic0.bpf.o").read_bytes())
    data[100] ^= 0xFF
    (out / "nic0.bpf.o").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="nic0.bpf.o: does not match manifest.json"):
        load_manifest(out)


def test_changed_source_is_detected(tmp_path):
    out = compile_text(tmp_path, (POLICIES / "nic_pacing.fx").read_text())
    (tmp_path / "p.fx").write_text((tmp_path / "p.fx").read_text() + "\n// edited\n")
    with pytest.raises(BundleError, match="changed since"):
        load_manifest(out)


def test_cli_reports_loading_errors_without_traceback(tmp_path):
    r = fabric_run("--policy", tmp_path / "nothing")
    assert r.returncode == 1 and "no such folder" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.fx"
    bad.write_text("policy p { on x.y { priority = } }")
    r = fabric_run("--policy", bad)
    assert r.returncode == 1 and "bad.fx:1:32: error" in r.stderr
    r = fabric_run("--policy", compiled("nic_pacing"), "--tp", "99")
    assert r.returncode == 1 and "tp 99 needs 99 GPUs" in r.stderr
    r = fabric_run("--model", "gpt-17")
    assert r.returncode == 1 and "unknown model 'gpt-17'" in r.stderr


def test_a_workload_that_does_not_fit_its_memory_is_refused_before_it_runs():
    """Every layer's KV of 2^36 prompts of 2^20 tokens is 8 PiB: the run used to grind through
    months of simulated time until its event limit; now it is refused at once, as a machine
    would refuse it, naming the memory, what does not fit and what to change."""
    r = fabric_run("--prompt", 1 << 20, "--batch", 1 << 16, "--max-events", 100_000)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "does not fit in pool0: its weights (13.0 GiB) and KV cache (8,388,608.0 GiB)" in r.stderr
    assert "more than its capacity of 1,024.0 GiB" in r.stderr
    r = fabric_run("--policy", compiled("nic_pacing"), "--model", "llama3-70b", "--tp", "1")
    assert r.returncode == 1 and "does not fit in gpu0: its weights (127.5 GiB)" in r.stderr
    assert "more than its hbm of 80.0 GiB" in r.stderr and "raise tp" in r.stderr


@pytest.mark.parametrize("capacity, fits", [("1023MiB", False), ("1GiB", True)])
def test_the_capacity_of_a_memory_decides_whether_its_kv_fits(tmp_path, capacity, fits):
    """8,192 tokens of Llama-3-8B's KV, every layer's, are 1 GiB (the weights stay in HBM):
    they fit a pool of exactly that, not one a MiB smaller."""
    out = compile_text(tmp_path, f"""
fabric f {{
  gpu gpu0, gpu1 {{ hbm: 80GiB }}
  cxl_switch sw0
  cxl_mem pool0 at sw0 {{ capacity: {capacity}; bw: 64GB/s }}
  link gpu0 <-> sw0 {{ bw: 63GB/s; kind: cxl }}
  link gpu1 <-> sw0 {{ bw: 63GB/s; kind: cxl }}
  link gpu0 <-> gpu1 {{ bw: 450GB/s; kind: nvlink }}
}}
workload w {{ model: "llama3-8b"; prompt: 8192; tp: 2; weights: hbm; kv: pool0 }}
movement kv = kv : gpu* -> pool0
policy p {{ on kv.forward at sw0 {{ priority = 1 }} }}""")
    if fits:
        report, _ = run_engine(out, prompt=8192)
        assert report["ttft_ms"] > 0
    else:
        from fabric_ext.runtime.simulation.workload import WorkloadError
        with pytest.raises(WorkloadError, match=r"does not fit in pool0: its KV cache \(1.0 GiB\)"):
            run_engine(out, prompt=8192)


# ---- the run and what the policy buys -------------------------------------------------------
def test_policy_beats_the_baseline_on_the_stress_case():
    with_policy, _ = run_engine(compiled("prefill_qos"))
    baseline, _ = run_engine(compiled("prefill_qos"), attach=False)
    assert with_policy["ttft_ms"] < baseline["ttft_ms"]
    stall = {m["name"]: m["stall_ms"] for m in with_policy["movements"]}
    base_stall = {m["name"]: m["stall_ms"] for m in baseline["movements"]}
    assert stall["ffn_weights"] < base_stall["ffn_weights"]


def test_the_summary_shows_the_baselines_figure_beside_each_movement_figure():
    from fabric_ext.runtime.simulation.stats import render
    with_policy, _ = run_engine(compiled("prefill_qos"))
    baseline, _ = run_engine(compiled("prefill_qos"), attach=False)
    lines = render(with_policy, baseline).splitlines()
    header = next(line for line in lines if line.startswith("movement"))
    assert header.split() == ["movement", "class", "MiB", "GB/s", "baseline", "queue", "p50", "us", "baseline",
                              "queue", "p99", "us", "baseline", "GPU", "stall", "ms", "baseline"]
    row = next(line for line in lines if line.startswith("kv_writeback")).split()
    kv = {m["name"]: m for m in with_policy["movements"]}["kv_writeback"]
    kv_base = {m["name"]: m for m in baseline["movements"]}["kv_writeback"]
    assert row[3:5] == [f"{kv['avg_gbps']:.2f}", f"{kv_base['avg_gbps']:.2f}"] and row[3] != row[4]


def test_decisions_are_counted_per_island():
    report, _ = run_engine(compiled("prefill_qos"))
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    assert sw0["decisions"]["forward.priority"]["7"] > 0 and sw0["invocations"] > 0
    assert sw0["ns_per_invocation"] > 0
    nic = next(i for i in report["islands"] if i["name"] == "nic0")
    assert nic["decisions"]["tx.rate"] == {"25GB/s": nic["per_hook"]["tx"]}


def test_rate_decision_paces_kv_export():
    report, _ = run_engine(compiled("prefill_qos"))
    wire = next(l for l in report["links"] if l["name"] == "nic0->wire")
    export = next(m for m in report["movements"] if m["name"] == "kv_export")
    assert export["avg_gbps"] <= 25.0 * 1.01
    assert wire["bytes"] == export["bytes"]


def test_data_from_the_network_is_received_at_the_nics_line_rate_before_rx(tmp_path):
    """Weights that come in through a NIC cross its wire first, at its line rate (full duplex:
    its own receive side), and only then is the chunk received: `rx` sees it after that."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16,
                                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 32000}))
    out = compile_text(tmp_path, f"""
fabric f {{
  gpu gpu0
  cxl_switch sw0
  dpu nic0 {{ line_rate: 8Gbps }}
  link gpu0 <-> sw0 {{ bw: 63GB/s; latency: 600ns; kind: cxl }}
  link nic0 <-> sw0 {{ bw: 63GB/s; latency: 600ns; kind: pcie }}
}}
workload w {{ model: "{model}"; prompt: 256; weights: nic0; kv: hbm; chunk: 1MiB }}
movement w_in = weights : nic0 -> gpu0
map first : hash<u32, time>[1]
policy p {{ on w_in.rx {{ first[0] min= now }} }}""")
    report, _ = run_engine(out, model=str(model), prompt=256, tp=1)
    weights = next(m for m in report["movements"] if m["name"] == "w_in")
    wire = next(link for link in report["links"] if link["name"] == "wire->nic0")
    assert wire["bytes"] == weights["bytes"] > 0
    assert report["ttft_ms"] * 1e6 >= weights["bytes"] / 1e9 * 1e9       # 8 Gbps: 1 GB/s
    assert int(report["maps"]["first"]["0"]) >= 2**20                     # the first MiB, received at 1 B/ns


def test_receiving_from_the_network_takes_the_nics_latency_and_has_its_trace_row(tmp_path):
    """A NIC's `latency` holds for what it receives as for what it sends: the first chunk from
    the network reaches `rx` a latency after its last byte came off the wire.  The trace shows
    the receive side as a row of its own (`<- wire`)."""
    from fabric_ext import api
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16,
                                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 32000}))
    firsts = []
    for latency in ("", " latency: 50us;"):
        text = (f'fabric f {{ gpu gpu0\n cxl_switch sw0\n dpu nic0 {{ line_rate: 8Gbps;{latency} }}\n'
                ' link gpu0 <-> sw0 { bw: 63GB/s; kind: cxl }\n link nic0 <-> sw0 { bw: 63GB/s; kind: pcie } }\n'
                f'workload w {{ model: "{model}"; prompt: 256; weights: nic0; kv: hbm; chunk: 1MiB }}\n'
                "movement w_in = weights : nic0 -> gpu0\nmap first : hash<u32, time>[1]\n"
                "policy p { on w_in.rx { first[0] min= now } }\n")
        report = api.run(api.compile(text), model=str(model), prompt=256, tp=1, trace=not latency)
        firsts.append(int(report.data["maps"]["first"]["0"]))
        if not latency:
            rows = {e["args"]["name"] for e in report.trace()["traceEvents"] if e["name"] == "thread_name"}
            assert {"<- wire", "-> sw0"} <= rows
    assert firsts[1] - firsts[0] == 50_000


def test_cross_island_map_written_on_the_switch_read_on_the_gpus(tmp_path):
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
movement kv = kv : gpu* -> pool0
map seen : array<u32, count>[1]
policy p {
  on w_in.forward at sw0 { seen[0] += 1 }
  on kv.issue at gpu* { if seen[0] > 0 { rate = 5GB/s } }
}""")
    man = load_manifest(out)
    assert next(m for m in man["maps"] if m["name"] == "seen")["shared"]
    report, eng = run_engine(out)
    assert report["maps"]["seen"]["0"] > 0
    gpu0 = next(i for i in report["islands"] if i["name"] == "gpu0")
    assert list(gpu0["decisions"]["issue.rate"]) == ["5GB/s"]
    kv = next(m for m in report["movements"] if m["name"] == "kv")
    # the rate the GPUs read from the switch's map holds: each GPU's flow is paced to 5 GB/s
    assert kv["bytes"] / (kv["span_ms"] / 1e3) <= 2 * 5e9 * 1.01


def test_host_tier_decision_keeps_weights_in_hbm(tmp_path):
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: hbm }
movement w_in = weights(ffn) : pool0 -> gpu*
policy p { on cpu0.alloc when ev.layer < 16 { tier = gpu0 } }""")
    report, _ = run_engine(out)
    streamed = next(m for m in report["movements"] if m["name"] == "w_in")
    ffn_per_layer = 3 * 4096 * 14336 * 2 // 2
    assert streamed["bytes"] == 16 * ffn_per_layer * 2  # layers 16..31 only, to both GPUs


def test_a_tier_that_names_no_memory_is_refused_and_counted(tmp_path):
    """nic0 is a DPU, not a memory: neither the host's placement nor the switch's memory access
    moves data there, the run is the baseline's, and each refusal is counted."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights(ffn) : pool0 -> gpu*
movement kv = kv : gpu* -> pool0
policy p { on cpu0.alloc when ev.layer < 16 { tier = nic0 }
           on kv.mem_access at sw0 { tier = nic0 } }""")
    report, _ = run_engine(out)
    base, _ = run_engine(out, attach=False)
    assert report["ttft_ms"] == base["ttft_ms"]
    assert [(m["name"], m["bytes"]) for m in report["movements"]] == \
        [(m["name"], m["bytes"]) for m in base["movements"]]
    kv_chunks = sum(link["chunks"] for link in report["links"] if link["name"] in ("gpu0->sw0", "gpu1->sw0"))
    assert report["refused"]["tier"] == 16 * 2 + kv_chunks     # 16 layers x 2 operators placed, every KV chunk


def test_a_tier_moves_only_kv_written_back_and_only_while_the_memory_has_room(tmp_path):
    """At the switch's memory access a tier to pool1 moves the KV written back there, until
    pool1 is full (100 MiB: 50 of the 128 KV chunks); the weights read for the GPUs go on to
    them, and every chunk not moved is counted."""
    out = compile_text(tmp_path, """
fabric small {
  gpu gpu0, gpu1
  cxl_switch sw0
  cxl_mem pool0 at sw0 { bw: 64GB/s }
  cxl_mem pool1 at sw0 { bw: 64GB/s; capacity: 100MiB }
  link gpu0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu1 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu0 <-> gpu1 { bw: 450GB/s; latency: 1us; kind: nvlink }
}
workload w { model: "llama3-8b"; prompt: 2048; tp: 2; weights: pool0; kv: pool0; chunk: 2MiB }
movement w_in = weights : pool0 -> gpu*
movement kv = kv : gpu* -> pool0
policy p { on w_in.mem_access at sw0 { tier = pool1 }
           on kv.mem_access at sw0 { tier = pool1 } }""")
    report, _ = run_engine(out, prompt=2048, tp=2)
    base, _ = run_engine(out, prompt=2048, tp=2, attach=False)
    links = {link["name"]: link for link in report["links"]}
    kv = next(m for m in report["movements"] if m["name"] == "kv")
    weights = next(m for m in report["movements"] if m["name"] == "w_in")
    assert kv["bytes"] == 128 * 2**21 and links["pool1 memory"]["bytes"] == 100 * 2**20
    assert links["sw0->gpu0"]["bytes"] + links["sw0->gpu1"]["bytes"] == weights["bytes"] > 0
    assert report["refused"]["tier"] == weights["bytes"] // 2**21 + 128 - 50
    assert report["ttft_ms"] == pytest.approx(base["ttft_ms"], rel=0.05)


def test_kv_a_tier_moved_is_read_back_from_where_it_went(tmp_path):
    """A chunked prefill's later passes read each layer's KV back from where it was written:
    with a tier sending every other layer's KV to pool1, half of what is read comes from there."""
    out = compile_text(tmp_path, """
fabric small {
  gpu gpu0, gpu1
  cxl_switch sw0
  cxl_mem pool0 at sw0 { bw: 64GB/s }
  cxl_mem pool1 at sw0 { bw: 64GB/s }
  link gpu0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu1 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu0 <-> gpu1 { bw: 450GB/s; latency: 1us; kind: nvlink }
}
workload w { model: "llama3-8b"; prompt: 4096; prefill_chunk: 1024; tp: 2; weights: hbm; kv: pool0 }
movement kv = kv : gpu* -> pool0
movement back = kv : pool0 -> gpu*
movement back1 = kv : pool1 -> gpu*
policy p { on kv.mem_access at sw0 when ev.layer % 2 == 1 { tier = pool1 } }""")
    report, _ = run_engine(out, prompt=4096, tp=2)
    base, _ = run_engine(out, prompt=4096, tp=2, attach=False)
    moved = {m["name"]: m["bytes"] for m in report["movements"]}
    read = next(m["bytes"] for m in base["movements"] if m["name"] == "back")
    assert "back1" not in {m["name"] for m in base["movements"]}
    assert moved["back"] == moved["back1"] == read // 2 > 0
    assert report["refused"]["tier"] == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(0, 1 << 20))
def test_a_prompts_passes_tile_it_in_order(prompt, chunk_tokens):
    """`Workload.pass_of` (asked per block) gives the passes one by one: each starts where the
    one before ended, all but the last of the chunk's tokens, together the whole prompt."""
    from fabric_ext.runtime.simulation.workload import Workload, load_model
    w = Workload(load_model("llama3-8b"), prompt=prompt, chunk_tokens=chunk_tokens)
    passes = [w.pass_of(p) for p in range(w.pass_count())]
    assert sum(n for _, n in passes) == prompt
    assert all(start == p * (chunk_tokens or prompt) for p, (start, _) in enumerate(passes))
    assert all(n == (chunk_tokens or prompt) for _, n in passes[:-1]) and 0 < passes[-1][1] <= (chunk_tokens or prompt)


@pytest.mark.parametrize("placement", ["weights: pool0; kv: pool0; kv_export: nic0",
                                       "weights: hbm; kv: hbm", "weights: nic0; kv: pool0",
                                       "weights: gpu1; kv: gpu1"])
def test_the_transfers_a_run_makes_are_the_ones_the_compiler_warns_with(tmp_path, placement):
    """The compiler's movement warnings (`lint`) read `prefill_flows`; the engine must make
    exactly those kinds of transfer, or a movement warned about might move data after all."""
    from fabric_ext.runtime.simulation.workload import prefill_flows
    out = compile_text(tmp_path, f"""
import "fabrics/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 1024; prefill_chunk: 512; tp: 2; {placement} }}""")
    _, eng = run_engine(out, prompt=1024)
    made = {(t.cls, t.operator or None, t.src, t.dst) for t in eng.fabric.transfers}
    w = eng.workload
    assert w.pass_count() == 2
    assert made == set(prefill_flows(eng.gpus, w.weights, w.kv, w.kv_export, w.pass_count()))
    _, whole = run_engine(out, prompt=1024, chunk_tokens=1024)     # one pass: no KV read back
    made = {(t.cls, t.operator or None, t.src, t.dst) for t in whole.fabric.transfers}
    assert made == set(prefill_flows(eng.gpus, w.weights, w.kv, w.kv_export, 1)) < set(prefill_flows(
        eng.gpus, w.weights, w.kv, w.kv_export, 2)) or w.kv == "hbm"


def test_a_gpu_of_the_group_that_keeps_the_data_moves_none_of_it_to_itself(tmp_path):
    """With the weights and KV kept on gpu1, gpu0 reads its shard from gpu1 and writes its KV
    there; gpu1's own are in its HBM already, and no transfer (or copy engine) stands for them."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 1024; prefill_chunk: 512; tp: 2; weights: gpu1; kv: gpu1 }""")
    report, eng = run_engine(out, prompt=1024)
    assert all(t.src != t.dst for t in eng.fabric.transfers)
    w = eng.workload
    moved = {(t.cls, t.src, t.dst) for t in eng.fabric.transfers if t.cls != "activations"}
    assert moved == {("weights", "gpu1", "gpu0"), ("kv", "gpu0", "gpu1"), ("kv", "gpu1", "gpu0")}
    weights = sum(t.bytes for t in eng.fabric.transfers if t.cls == "weights")
    assert weights == (w.weight_bytes("attention") + w.weight_bytes("ffn")) * w.model.layers * 2   # gpu0's, each pass


def test_an_all_reduce_moves_in_the_chunks_its_movement_asks_for(tmp_path):
    """Without a `chunk` of its own an all-reduce moves in at most 8 chunks (finer ones change
    no timing, only the events); with one, in chunks of that size, and the same time."""
    text = ('import "fabrics/dgx_cxl.fx"\nworkload w { model: "llama3-8b"; prompt: 2048; tp: 2; weights: hbm; '
            'kv: hbm; stack: "none" }\nmovement ar = activations(collective) : gpu* <-> gpu*')
    runs = [run_engine(compile_text(tmp_path, text + props, tag), prompt=2048)[0]
            for props, tag in (("", "default"), (" { chunk: 64KiB }", "fine"))]
    sent = [next(link for link in r["links"] if link["name"] == "gpu0->gpu1") for r in runs]
    assert sent[0]["bytes"] == sent[1]["bytes"] == sent[1]["chunks"] * 64 * 2**10
    assert sent[0]["chunks"] == 8 * 32 * 2 and runs[0]["ttft_ms"] == runs[1]["ttft_ms"]


def test_prefetch_decision_deepens_the_weight_stream(tmp_path):
    text = """
import "fabrics/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 4096; tp: 2; weights: pool0; kv: hbm }}
movement w_in = weights : pool0 -> gpu*
policy p {{ on w_in.issue at gpu* {{ prefetch = {n} }} }}"""
    shallow, _ = run_engine(compile_text(tmp_path, text.format(n=1), "a"), prompt=4096)
    deep, _ = run_engine(compile_text(tmp_path, text.format(n=3), "b"), prompt=4096)
    issued = {r: next(m for m in run["movements"] if m["name"] == "w_in")["issued_avg_ms"]
              for r, run in (("shallow", shallow), ("deep", deep))}
    # three layers ahead, the weights are issued earlier on average (the pool's channel is the
    # bottleneck either way, so the time to first token need not change)
    assert issued["deep"] < issued["shallow"]
    assert deep["ttft_ms"] <= shallow["ttft_ms"]


def test_faulting_program_is_detached_and_the_run_completes():
    report, _ = run_engine(compiled("prefill_qos"), backend=Interpreter(budget=6))
    assert report["ttft_ms"] > 0 and report["faults"]
    f = report["faults"][0]
    assert "instruction budget of 6 exhausted" in f["reason"] and f["program"] and "pc" in f["where"]
    assert len({(x["island"], x["hook"]) for x in report["faults"]}) == len(report["faults"])


def test_json_schema_and_trace(tmp_path):
    j, t = tmp_path / "run.json", tmp_path / "run.trace.json"
    r = fabric_run("--policy", compiled("prefill_qos"), "--prompt", "512", "--tp", "2", "--baseline",
                   "--json", j, "--trace", t, "-q")
    assert r.returncode == 0, r.stderr
    rep = json.loads(j.read_text())
    assert rep["schema"] == "fabric-run/2"
    assert {"policy", "backend", "workload", "ttft_ms", "layers", "movements", "links", "islands", "maps",
            "faults", "baseline"} <= set(rep)
    assert {"model", "prompt", "batch", "tp"} <= set(rep["workload"])
    m = rep["movements"][0]
    assert {"name", "class", "operator", "bytes", "avg_gbps", "queue_p50_us", "queue_p99_us", "stall_ms"} <= set(m)
    assert {"name", "bytes", "util_avg", "util_peak"} <= set(rep["links"][0])
    assert {"name", "kind", "runtime", "events", "invocations", "ns_per_invocation", "decisions"} <= set(rep["islands"][0])
    assert rep["baseline"]["islands"] == [] and rep["baseline"]["ttft_ms"] > 0
    tr = json.loads(t.read_text())
    check_trace(tr)
    processes = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "process_name"}
    rows = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert {"gpu0", "gpu1", "pool0", "baseline: gpu0"} <= processes
    assert {"kernels", "hooks", "memory channel", "-> sw0"} <= rows


def test_models_and_overrides(tmp_path):
    for model in ("qwen2.5-7b", "llama3-70b"):   # nic_pacing keeps weights in HBM: short runs
        report, _ = run_engine(compiled("nic_pacing"), model=model, prompt=256)
        assert report["workload"]["model"] == model and len(report["layers"]) > 0
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "intermediate_size": 4096, "vocab_size": 32000}))
    report, _ = run_engine(compiled("nic_pacing"), model=str(cfg), prompt=128)
    assert len(report["layers"]) == 2
    chunked, _ = run_engine(compiled("nic_pacing"), prompt=1024, chunk_tokens=256)
    assert chunked["workload"]["chunk_tokens"] == 256


def test_plots(tmp_path, monkeypatch):
    """PNGs; with a baseline, each link's baseline dotted in the link's colour and the
    baseline's per-layer total over the bars; every policy line told apart by colour or style."""
    pytest.importorskip("matplotlib")
    from fabric_ext.runtime.simulation import stats
    report, _ = run_engine(compiled("prefill_qos"))
    baseline, _ = run_engine(compiled("prefill_qos"), attach=False)
    files = stats.plots(report, tmp_path / "alone")
    assert all(open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for f in files)
    figures, save = [], stats._save
    monkeypatch.setattr(stats, "_save", lambda plt, fig, path: figures.append(fig) or save(plt, fig, path))
    stats.plots({**report, "baseline": baseline}, tmp_path / "both")
    links, layers = (fig.axes[0] for fig in figures)
    lines = {line.get_label(): line for line in links.get_lines()}
    policy = [l for name, l in lines.items() if not name.endswith("(baseline)")]
    assert len({(l.get_color(), l.get_linestyle()) for l in policy}) == len(policy) > 6
    for name, line in lines.items():
        if name.endswith(" (baseline)"):
            mine = lines[name.removesuffix(" (baseline)")]
            assert line.get_linestyle() == ":" and line.get_color() == mine.get_color()
            base_link = next(b for b in baseline["links"] if b["name"] == mine.get_label())
            assert list(line.get_ydata()) == [u * 100 for u in base_link["timeline"]]
    assert any(name.endswith("(baseline)") for name in lines)
    total = next(l for l in layers.get_lines() if l.get_label() == "baseline total")
    assert len(total.get_ydata()) == len(baseline["layers"])


@pytest.mark.parametrize("vm", ["interp", "jit"])
def test_ringbuf_drops_are_counted_and_reported(tmp_path, vm):
    """Nothing consumes a ringbuf during a run: once it is full, records are dropped, and the
    report says how many (they were lost in silence)."""
    from fabric_ext.runtime.machine.backends import get_backend
    from fabric_ext.runtime.simulation import stats
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
map ring : ringbuf[4KiB]
policy p { on w_in.forward at sw0 { emit ring(now, ev.bytes) } }""")
    report, _ = run_engine(out, backend=get_backend(vm))
    ring = report["maps"]["ring"]
    kept = len(ring["records"])
    assert kept * (16 + 8) <= 4096 < (kept + 1) * (16 + 8)        # full: 16-byte records, 8-byte headers
    assert ring["dropped"] > 0
    assert f"ringbuf ring: {ring['dropped']} records dropped, {kept} kept" in stats.render(report)


@pytest.mark.parametrize("vm", ["interp", "jit"])
def test_updates_a_full_hash_map_refuses_are_counted_and_reported(tmp_path, vm):
    """A hash map with every entry in use refuses new keys, as the kernel's does: the report
    counts the refusals (they were lost in silence), where an lru_hash evicts instead."""
    from fabric_ext.runtime.machine.backends import get_backend
    from fabric_ext.runtime.simulation import stats
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights(ffn) : pool0 -> gpu*
map h : hash<u32, count>[4]
map l : lru_hash<u32, count>[4]
policy p { on w_in.forward at sw0 { h[ev.layer] += 1; l[ev.layer] += 1 } }""")
    report, _ = run_engine(out, backend=get_backend(vm))
    per_layer = report["maps"]["h"]["0"]
    assert sorted(report["maps"]["h"]) == ["0", "1", "2", "3"] and sorted(report["maps"]["l"]) == ["28", "29", "30", "31"]
    assert report["map_full"] == {"h": per_layer * 28}          # layers 4-31 of Llama-3-8B: each chunk's update
    assert f"map h: {per_layer * 28:,} updates of a new key refused" in stats.render(report)


def test_a_report_keeps_the_first_entries_of_a_map_by_key_and_says_how_many_it_has(tmp_path):
    """A policy's maps may hold 64 million entries together: a report of each, several times
    over (raw, decoded, HTML), took tens of gigabytes. It keeps a map's first `REPORT_ENTRIES`
    by key and says how many there are."""
    from fabric_ext.runtime.simulation import stats
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
map a : array<u32, count>[262144]
policy p { on w_in.forward at sw0 { for i in 0..1024 { a[(ev.layer * 8 + ev.chunk) * 1024 + i] = 1 } } }""")
    from fabric_ext.runtime.machine.backends import get_backend
    report, eng = run_engine(out, backend=get_backend("jit"))
    total = eng.maps["a"].entry_count()
    assert total > stats.REPORT_ENTRIES and report["map_entries_past"] == {"a": total}
    kept = [int(k) for k in report["maps"]["a"]]
    assert len(kept) == len(report["map_entries"]["a"]) == stats.REPORT_ENTRIES and kept == sorted(kept)
    assert kept[-1] < sorted(eng.maps["a"].dump())[stats.REPORT_ENTRIES]      # the first, by key
    assert f"... and {total - 16:,} more entries (--json has the first 65,536 by key)" in stats.render(report)
    from fabric_ext.runtime.simulation import html_report
    page, _ = html_report.render(report, eng.man)
    assert f"the first 65,536 of its {total:,} entries, by key" in page


def test_ringbuf_records_are_decoded_into_their_emits_fields(tmp_path):
    """Each record comes back as the fields of the emit that wrote it (named after what it
    records, with units and device names), told apart by length, in the JSON and the summary."""
    from fabric_ext.runtime.simulation import stats
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
map ring : ringbuf[1MiB]
policy p {
  on w_in.forward at sw0 {
    emit ring(now, ev.bytes, ev.dst)
    if ev.chunk == 0 { emit ring(ev.layer, ev.chunk * 2) }
  }
}""")
    report, eng = run_engine(out)
    rows = report["map_records"]["ring"]
    assert len(rows) == len(report["maps"]["ring"]["records"]) > 2
    wide = [r for r in rows if r["line"] == "8"]
    narrow = [r for r in rows if r["line"] == "9"]
    assert wide and narrow and len(wide) + len(narrow) == len(rows)
    first = wide[0]["fields"]
    assert list(first) == ["now", "bytes", "dst"] and list(narrow[0]["fields"]) == ["layer", "value2"]
    assert first["bytes"]["text"] == "2 MiB" and first["dst"]["text"] in ("gpu0", "gpu1")
    assert first["now"]["text"].endswith("s") and narrow[0]["fields"]["value2"]["value"] == 0
    assert sorted({r["fields"]["layer"]["value"] for r in narrow}) == list(range(eng.workload.model.layers))
    text = stats.render(report)
    assert "ringbuf ring:" in text and "now" in text and "emit line" in text and "2 MiB" in text


def test_ringbuf_records_of_emits_alike_in_length_name_both_lines():
    """Two emits of one length share a ringbuf: their records take the first one's names and
    name both lines; a record of a length no emit writes is kept as hex."""
    from types import SimpleNamespace

    from fabric_ext.runtime.simulation.stats import _records_table, decoded_records
    layouts = [{"line": 8, "fields": [{"name": "bytes", "dim": "size"}]},
               {"line": 12, "fields": [{"name": "layer", "dim": None}]}]
    record = SimpleNamespace(record_layouts={"ring": layouts}, device_names={},
                             maps={"ring": {"records": [(4096).to_bytes(8, "little").hex(), "01" * 12]}})
    alike, odd = decoded_records(record)["ring"]
    assert alike == {"line": "8/12", "fields": {"bytes": {"value": 4096, "text": "4 KiB"}}}
    assert odd == {"line": None, "fields": {}, "hex": "01" * 12}
    assert f"? ({'01' * 12})" in _records_table([alike, odd])


KV_RELOAD = """
import "fabrics/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 8192; tp: 2; weights: hbm; kv: pool0 }}
movement kv_out = kv : gpu* -> pool0
movement kv_reload = kv : pool0 -> gpu*
policy p {{ {body} }}"""


def test_chunked_prefill_reads_the_earlier_passes_kv_back_from_where_it_lives(tmp_path):
    """With KV outside HBM, attention of each later pass waits for the KV of the passes before
    it, read back as a `kv` transfer with its own movement; a reload policy then changes TTFT."""
    from fabric_ext.runtime.simulation.workload import load_model
    plain = compile_text(tmp_path, KV_RELOAD.format(body=""), "plain")
    report, eng = run_engine(plain, prompt=8192, tp=2, chunk_tokens=2048)
    reload = next(m for m in report["movements"] if m["name"] == "kv_reload")
    m = load_model("llama3-8b")
    per_token = 2 * m.kv_heads * m.head_dim * m.dtype_bytes // 2        # one layer, one GPU (TP 2)
    assert reload["bytes"] == 2 * m.layers * sum(per_token * first for first in (2048, 4096, 6144))
    whole, _ = run_engine(plain, prompt=8192, tp=2)                       # one pass: nothing to read back
    assert "kv_reload" not in {x["name"] for x in whole["movements"]}
    slow = compile_text(tmp_path, KV_RELOAD.format(body="on kv_reload.forward at sw0 { rate = 2GB/s }"), "slow")
    paced, _ = run_engine(slow, prompt=8192, tp=2, chunk_tokens=2048)
    assert paced["ttft_ms"] > report["ttft_ms"]
    assert next(m for m in paced["movements"] if m["name"] == "kv_reload")["stall_ms"] > reload["stall_ms"]


def test_the_runtime_follows_the_compiled_path_via_a_switch(tmp_path):
    """`via sw0` routes the all-reduce through the switch: the manifest's path is what the
    chunks take, so the switch's handler runs (the runtime routed gpu0 -> gpu1 directly)."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 1024; tp: 2; weights: hbm; kv: hbm }
movement ar = activations(collective) : gpu* <-> gpu* via sw0
policy p { on ar.forward at sw0 { priority = 7 } }""")
    report, _ = run_engine(out, prompt=1024, tp=2)
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    assert sw0["events"] > 0 and "forward.priority" in sw0["decisions"]
    links = {x["name"]: x["bytes"] for x in report["links"]}
    assert links["gpu0->sw0"] > 0 and links.get("gpu0->gpu1", 0) == 0


def test_a_gpus_copy_engines_are_what_its_fabric_says(tmp_path):
    """`copy_engines: 1` leaves one engine per GPU: a transfer on stream 3 runs on it."""
    text = """
fabric f {{
  gpu gpu0 {{ copy_engines: {n} }}
  cxl_switch sw0
  cxl_mem pool0 at sw0 {{ bw: 64GB/s }}
  link gpu0 <-> sw0 {{ bw: 63GB/s; kind: cxl }}
}}
workload w {{ model: "llama3-8b"; prompt: 256; tp: 1; weights: pool0; kv: hbm }}
movement w_in = weights : pool0 -> gpu0
policy p {{ on w_in.issue at gpu0 {{ stream = 3 }} }}"""
    for n in (1, 4):
        report, _ = run_engine(compile_text(tmp_path, text.format(n=n), f"ce{n}"), prompt=256, tp=1)
        used = [c["chunks"] for c in report["copy_engines"]]
        assert len(used) == n and used[(3 - 1) % n] == sum(used) > 0


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.one_of(st.floats(-1e12, 1e12), st.integers(0, 4).map(float)), max_size=40),
       q=st.one_of(st.sampled_from([0, 50, 99, 100]), st.floats(0, 100)))
def test_report_percentiles_are_numpys_to_the_last_bit(values, q):
    """The report's queue percentiles skip numpy.percentile's set-up; they must not differ from it."""
    import numpy as np

    from fabric_ext.runtime.simulation.stats import percentiles
    want = float(np.percentile(values, q)) if values else 0.0
    assert percentiles(values, (q,)) == [want]


def test_a_host_tier_into_a_full_hbm_is_refused_and_counted(tmp_path):
    """Llama-3-70B at TP 1: the host program keeps every layer's weights in gpu0's HBM, which
    holds about half of them beside the KV cache.  Layers are placed in order while they fit;
    the rest stay in the pool, streamed, and each refused placement is counted."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-70b"; prompt: 512; tp: 1; weights: pool0; kv: hbm }
movement w_in = weights : pool0 -> gpu*
policy p { on cpu0.alloc { tier = gpu0 } }""")
    report, _ = run_engine(out, model="llama3-70b", tp=1)
    h, kv_heads, d, ffn, layers = 8192, 8, 128, 28672, 80
    sizes = {"attention": (2 * h * 64 * d + 2 * h * kv_heads * d) * 2, "ffn": 3 * h * ffn * 2}
    room, streamed, refused = 80 * 2**30 - layers * 512 * 2 * kv_heads * d * 2, 0, 0
    for _ in range(layers):
        for op in ("attention", "ffn"):
            if sizes[op] <= room:
                room -= sizes[op]
            else:
                streamed, refused = streamed + sizes[op], refused + 1
    assert 0 < refused < 2 * layers
    assert report["refused"]["tier"] == refused
    assert next(m for m in report["movements"] if m["name"] == "w_in")["bytes"] == streamed


@pytest.mark.parametrize("hook", ["issue", "complete"])
def test_hooks_at_a_chunks_ends_see_the_hop_and_port_it_enters_or_leaves_by(tmp_path, hook):
    """`issue` and `complete` fire at both ends of a chunk's path (a GPU's copy engine takes it
    at either end).  At its destination ``ev.hop`` is this island's index on the path and
    ``ev.in_port`` the port the chunk enters the island by (a switch's, for its memory); at its
    source ``ev.hop`` is 0 and ``ev.out_port`` the port it leaves by; 0 where there is no port.
    Ports are numbered in the order of their peers' names: gpu0's lead to gpu1 ... gpu7 (0-6)
    and sw0 (7); sw0's to cpu0 (0), gpu0 (1), gpu1 (2), ..."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
map from_pool0 : hash<u32, count>[8]
map from_gpu0 : hash<u32, count>[8]
map from_gpu1 : hash<u32, count>[8]
map kv_at_sw0 : hash<device, u32>[8]
policy p {
  on gpu0.HOOK {
    let seen = ev.hop * 10000 + ev.in_port * 100 + ev.out_port
    if ev.src == pool0 { from_pool0[seen] += 1 }
    if ev.src == gpu0 { from_gpu0[seen] += 1 }
    if ev.src == gpu1 { from_gpu1[seen] += 1 }
  }
  on sw0.complete { kv_at_sw0[ev.src] = ev.hop * 10000 + ev.in_port * 100 + ev.out_port }
}""".replace("HOOK", hook))
    report, _ = run_engine(out)
    seen = {name: sorted((int(k) // 10000, int(k) // 100 % 100, int(k) % 100) for k in report["maps"][name])
            for name in ("from_pool0", "from_gpu0", "from_gpu1")}
    assert seen == {"from_pool0": [(2, 7, 0)],              # weights, into gpu0 from sw0 (pool0, sw0, gpu0)
                    "from_gpu0": [(0, 0, 0), (0, 0, 7)],    # the all-reduce's chunks out to gpu1, KV to sw0
                    "from_gpu1": [(1, 0, 0)]}               # the all-reduce's chunks, in from gpu1
    kv = {e["key_text"]: e["value"] for e in report["map_entries"]["kv_at_sw0"]}
    assert kv == {"gpu0": 10100, "gpu1": 10200}             # KV, into sw0 (hop 1) by gpu0's and gpu1's ports


def test_a_nics_network_is_a_port_its_ticks_and_chunks_see(tmp_path):
    """A DPU/NIC's network port comes after its links (nic0 has one, to sw0): its ticks sample
    it (peer 0: no device) with the bytes the wire carried, and KV leaving on it has it as
    ``ev.out_port`` at tx; the wire is the slower hop, so queue builds there."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 8192; tp: 8; weights: hbm; kv: hbm; kv_export: nic0 }
map peer : hash<u32, device>[4]
map util : array<u32, percent>[4]
map queued : array<u32, size>[4]
map out : hash<u32, count>[4]
policy p {
  on nic0.tick(10us) { peer[ev.port] = ev.peer; util[ev.port] max= ev.util_pct; queued[ev.port] max= ev.queue_bytes }
  on nic0.tx { out[ev.out_port] += 1 }
}""")
    report, eng = run_engine(out, model="llama3-8b", prompt=8192, tp=8)
    m = report["maps"]
    assert m["peer"] == {"0": eng.ids["devices"]["sw0"], "1": 0}
    assert int(m["util"]["1"]) == 100 and int(m["util"].get("0", 0)) == 0     # the wire is busy; nothing goes back to sw0
    assert int(m["queued"]["1"]) > 0
    assert list(m["out"]) == ["1"]
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: nic0 }
map ports : hash<u32, count>[4]
policy p { on nic0.rx { ports[ev.in_port * 10 + ev.out_port] += 1 } }""", name="rx")
    report, _ = run_engine(out, model="llama3-8b", prompt=512, tp=2)
    assert list(report["maps"]["ports"]) == ["10"]       # weights in from the network, out to sw0


def test_a_link_that_gives_only_its_kind_takes_that_kinds_figures(tmp_path):
    """`link a <-> b { kind: nvlink }` is an NVLink: its bandwidth and latency are NVLink's
    figures (they were PCIe's), and routes by latency count that latency, in the compiler's
    paths and the runtime's alike."""
    nvlink = figures()["links"]["nvlink4"]
    fabric = "fabric f {\n  gpu g0, g1\n  link g0 <-> g1 { kind: nvlink%s }\n}\n"
    workload = 'workload w { model: "llama3-8b"; prompt: 1024; tp: 2 }\n'
    given = "; ".join(f"{k}: {v}" for k, v in (("bw", f"{nvlink['bw'] / 1e9:g}GB/s"), ("latency", f"{nvlink['latency']}ns")))
    bare, full = (run_engine(compile_text(tmp_path, fabric % props + workload, name=n), model="llama3-8b",
                             prompt=1024, tp=2)[0] for n, props in (("bare", ""), ("full", "; " + given)))
    assert bare["links"] == full["links"] and bare["ttft_ms"] == full["ttft_ms"]
    assert bare["links"][0]["bw_gbps"] == nvlink["bw"] / 1e9
    # a switch path of 2 x 300 ns (and its hop) is shorter than the NVLink's 2 us: both route by it
    routed = compile_text(tmp_path, "fabric f {\n  gpu g0, g1\n  cxl_switch s0\n  link g0 <-> g1 { kind: nvlink }\n"
                          "  link g0 <-> s0 { latency: 300ns }\n  link g1 <-> s0 { latency: 300ns }\n}\n" + workload
                          + "movement ar = activations : g0 -> g1\n", name="routed")
    man = json.loads((routed / "manifest.json").read_text())
    assert [f["path"] for m in man["movements"] for f in m["flows"]] == [["g0", "s0", "g1"]]
    _, eng = run_engine(routed, model="llama3-8b", prompt=1024, tp=2)
    assert eng.fabric.route("g1", "g0") == ["g1", "s0", "g0"]


def test_a_switch_bandwidth_is_that_of_each_of_its_links_that_gives_none(tmp_path):
    text = ("fabric f {\n  gpu g0\n  cxl_switch s0 { bw: 8GB/s }\n  cxl_mem m0 at s0 { bw: 64GB/s }\n"
            "  link g0 <-> s0 { latency: 600ns }\n}\n"
            'workload w { model: "llama3-8b"; prompt: 512; tp: 1; weights: m0 }\n')
    report, _ = run_engine(compile_text(tmp_path, text), model="llama3-8b", prompt=512, tp=1)
    assert {link["name"]: link["bw_gbps"] for link in report["links"]}["s0->g0"] == 8.0


def test_the_compiler_routes_as_the_runtime_does_a_switchs_hop_included(tmp_path):
    """The direct link (1,050 ns) is shorter than the switch's way (500 + 500 ns) once the
    switch's 100 ns hop counts, as the runtime counts it: a movement's path (the compiler's)
    and a transfer no movement declares (routed by the runtime) take the same way."""
    text = ("fabric f {\n  gpu g0, g1\n  cxl_switch s0 { hop: 100ns }\n  link g0 <-> g1 { latency: 1050ns }\n"
            "  link g0 <-> s0 { latency: 500ns }\n  link g1 <-> s0 { latency: 500ns }\n}\n"
            'workload w { model: "llama3-8b"; prompt: 512; tp: 2 }\nmovement ar = activations : g0 -> g1\n')
    out = compile_text(tmp_path, text)
    man = json.loads((out / "manifest.json").read_text())
    _, eng = run_engine(out, model="llama3-8b", prompt=512, tp=2)
    assert man["movements"][0]["flows"][0]["path"] == ["g0", "g1"] == eng.fabric.route("g0", "g1")
    assert eng.fabric.route("g1", "g0") == ["g1", "g0"]


@pytest.mark.parametrize("kind", ["dpu", "nic"])
def test_a_nics_latency_is_the_time_a_chunk_spends_crossing_it(tmp_path, kind):
    """KV written to the host crosses n0 and KV exported leaves on n0's wire: each chunk's
    latency from issue to completion grows by n0's `latency` exactly (the first chunk of the
    first layer, which waits for nothing)."""
    def first_chunks(latency):
        text = (f"fabric f {{\n  gpu g0\n  cxl_switch s0\n  {kind} n0 {{ line_rate: 400Gbps{latency} }}\n"
                "  host h0 { dram: 1TiB }\n  link g0 <-> s0 { bw: 63GB/s; latency: 600ns }\n"
                "  link s0 <-> n0 { bw: 63GB/s; latency: 600ns }\n  link n0 <-> h0 { bw: 63GB/s; latency: 600ns }\n}\n"
                'workload w { model: "llama3-8b"; prompt: 512; kv: h0; kv_export: n0 }\n'
                "map first : hash<device, time>[4]\npolicy p {\n"
                "  on h0.complete { if ev.layer == 0 && ev.chunk == 0 { first[ev.island] = ev.latency } }\n"
                "  on n0.complete { if ev.layer == 0 && ev.chunk == 0 { first[ev.island] = ev.latency } }\n}\n")
        out = compile_text(tmp_path, text, name=f"l{len(latency)}")
        report, _ = run_engine(out, model="llama3-8b", prompt=512, tp=1)
        return {e["key_text"]: e["value"] for e in report["map_entries"]["first"]}
    without, with_5us = first_chunks(""), first_chunks("; latency: 5us")
    assert set(without) == {"h0", "n0"}
    assert {d: with_5us[d] - without[d] for d in without} == {"h0": 5000, "n0": 5000}


def test_min_and_and_updates_take_the_first_value_of_a_key_the_map_does_not_hold(tmp_path):
    """An update starts from its operator's identity on a key the map does not hold: the first
    ``min=`` or ``&=`` stores the value (starting from 0, the entry stayed 0 for good), as
    ``max=`` and ``+=`` already did; every map kind that can lack a key does so."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
map lo : hash<u32, count>[64]
map lo_lru : lru_hash<u32, count>[64]
map both : percpu_hash<u32, count>[64]
map hi : hash<u32, count>[64]
policy p {
  on sw0.forward {
    lo[ev.layer] min= ev.chunk + 1
    lo_lru[ev.layer] min= ev.chunk + 5
    hi[ev.layer] max= ev.chunk + 1
    both[ev.layer] &= ev.layer + 16
  }
}""")
    report, eng = run_engine(out)
    m = report["maps"]
    layers = eng.workload.model.layers
    assert {int(v) for v in m["lo"].values()} == {1} and len(m["lo"]) == layers
    assert {int(v) for v in m["lo_lru"].values()} == {5}
    assert min(int(v) for v in m["hi"].values()) > 1
    assert {int(k) + 16: int(v) for k, v in m["both"].items()} == {k + 16: k + 16 for k in range(layers)}


def test_a_hosts_memory_bandwidth_is_shared_by_what_is_read_from_and_written_to_it(tmp_path):
    """`dram_bw`: a chunk from host memory is read through a server of that bandwidth before
    its first link, one to host memory written through it as it arrives; reads and writes
    share it.  Below the links' bandwidth it sets the pace; the run is the same with trains
    off (every step in the loop)."""
    def run(dram, **options):
        text = (f"fabric f {{\n  gpu g0\n  cxl_switch s0\n  host h0 {{ dram: 1TiB{dram} }}\n"
                "  link g0 <-> s0 { bw: 63GB/s; latency: 600ns }\n  link h0 <-> s0 { bw: 63GB/s; latency: 600ns }\n}\n"
                'workload w { model: "llama3-8b"; prompt: 512; weights: h0; kv: h0 }\n')
        out = compile_text(tmp_path, text, name=f"h{len(dram)}")
        report, _ = run_engine(out, model="llama3-8b", prompt=512, tp=1, **options)
        return report, {link["name"]: link for link in report["links"]}
    (plain, plain_links), (slow, slow_links) = run(""), run("; dram_bw: 8GB/s")
    assert "h0 memory" not in plain_links
    memory = slow_links["h0 memory"]
    assert memory["bytes"] == slow_links["h0->s0"]["bytes"] + slow_links["s0->h0"]["bytes"] > 0
    assert memory["bw_gbps"] == 8.0 and memory["util_avg"] > 0.8
    assert slow["ttft_ms"] > 2 * plain["ttft_ms"]
    looped, _ = run("; dram_bw: 8GB/s", trains=False)
    assert looped["ttft_ms"] == slow["ttft_ms"] and looped["links"] == slow["links"]


def test_a_switch_hop_of_0_is_0_and_a_nics_complete_names_its_network_port(tmp_path):
    """`hop: 0ns` is no hop (it meant the default hop); KV exported through n0 completes there
    as it leaves on the network, by n0's network port (1: after its one link)."""
    def first_latency(hop):
        text = (f"fabric f {{\n  gpu g0\n  cxl_switch s0 {{ hop: {hop} }}\n  dpu n0\n"
                "  link g0 <-> s0 { bw: 63GB/s; latency: 600ns }\n  link s0 <-> n0 { bw: 63GB/s; latency: 600ns }\n}\n"
                'workload w { model: "llama3-8b"; prompt: 512; kv_export: n0 }\n'
                "map first : hash<u32, time>[2]\nmap out : hash<u32, count>[4]\n"
                "policy p { on n0.complete { out[ev.out_port] += 1\n"
                "  if ev.layer == 0 && ev.chunk == 0 { first[0] = ev.latency } } }\n")
        report, _ = run_engine(compile_text(tmp_path, text, name=f"hop{hop}"), model="llama3-8b", prompt=512, tp=1)
        return int(report["maps"]["first"]["0"]), list(report["maps"]["out"])
    (no_hop, ports), (hop_1us, _) = first_latency("0ns"), first_latency("1us")
    assert hop_1us - no_hop == 1000 and ports == ["1"]


def test_a_prefill_that_does_not_finish_says_what_it_left_undone(tmp_path, monkeypatch):
    """A run whose transfers never complete is a bug of the simulator (an internal error), and
    its message says what was left: which transfers, how far they got, and what is still held
    for coalescing (here: a transfer's last chunk made to leave what its flow held, the bug
    tests/fuzz/shortcuts.py found at seed 120119)."""
    from fabric_ext.runtime.simulation.fabric_model import Fabric
    folder = compile_text(tmp_path, 'import "fabrics/dgx_cxl.fx"\n'
                          'workload w { model: "llama3-8b"; weights: pool0; kv: hbm; chunk: 1MiB }\n'
                          "movement ffn_weights = weights(ffn) : pool0 -> gpu*\n"
                          "policy p { on ffn_weights.issue at gpu* { if ev.chunk % 2 == 0 { coalesce = 5MiB } } }\n")
    run_engine(folder)            # chunks 0-167: the last is odd; 84 even ones fill 16 buffers of 5, 4 left
    monkeypatch.setattr(Fabric, "_takes_held", lambda self, chunk, where: False)
    with pytest.raises(RuntimeError, match=r"the prefill did not finish: 2 transfer\(s\) never completed "
                                           r"\(first: ffn_weights pool0 -> gpu0, \d+ of 168 chunks arrived\); "
                                           r"\d chunk\(s\) of ffn_weights pool0 -> gpu0 held for coalescing at issue"):
        run_engine(folder)
