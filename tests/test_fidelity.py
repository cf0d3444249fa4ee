"""The prefill against measured machines (issue 14): operators timed from their profiles and a
fitted model, all-reduces on the fitted alpha-beta, the serving-stack profile, the models,
and the calibration that refits all of it from ../shared/data."""
import json
import re
import shutil
import subprocess
import sys

import pytest

from conftest import POLICIES, ROOT
from fabric_ext.contract.bundle import create_maps, load_manifest
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.simulation import validation
from fabric_ext.runtime.simulation.compute import GpuProfile, Stack, Timer, profile_tables
from fabric_ext.runtime.simulation.engine import Engine, RunOptions
from fabric_ext.runtime.simulation.figures import figures
from fabric_ext.runtime.simulation.operators import attention_block, ffn_block
from fabric_ext.runtime.simulation.timing import Timing
from fabric_ext.runtime.simulation.workload import Workload, WorkloadError, load_model
from test_runtime import compile_text

DATA = ROOT.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "vidur").is_dir(), reason=f"no shared calibration data at {DATA}")


def run(folder, **opts):
    man = load_manifest(folder)
    eng = Engine(folder, man, create_maps(man), Interpreter(), RunOptions(attach=False, **opts))
    return eng.run(), eng


MACHINE = 'import "fabrics/{fabric}"\nworkload w {{ model: "{model}"; weights: hbm; kv: hbm }}\n'


# ---- operators -------------------------------------------------------------------------------
def test_a_profiled_operator_takes_its_measured_time():
    """Inside a profile (same layer shape and TP, token count in range) an operator's time is
    the measured median at a profiled token count, and between two between them."""
    model = load_model("llama2-70b")
    table = next(t for t in profile_tables() if t["gpu"] == "h100_sxm" and t["tp"] == 2
                 and tuple(t["shape"]) == model.shape)
    timer = Timer(GpuProfile.named("h100_sxm"), model, 2)
    i = table["tokens"].index(1024)
    up = next(op for op in ffn_block(model, 1, 1024, 2) if op.name == "mlp_up_proj")
    assert timer.time(up) == pytest.approx(table["ms"]["mlp_up_proj"][i] * 1e-3)
    lo, hi = table["tokens"][i], table["tokens"][i + 1]
    mid = next(op for op in ffn_block(model, 1, (lo + hi) // 2, 2) if op.name == "mlp_up_proj")
    a, b = sorted(table["ms"]["mlp_up_proj"][i:i + 2])
    assert a * 1e-3 <= timer.time(mid) <= b * 1e-3
    beyond = next(op for op in ffn_block(model, 1, 65536, 2) if op.name == "mlp_up_proj")
    assert timer.time(beyond) == timer.modelled(beyond)      # outside the table: the fitted model


def test_the_fitted_operator_model_is_close_to_the_profiles():
    """The mechanistic model (no tables) against one layer's profiled operators, summed: what
    the hardware-alone model rests on where no profile covers a shape."""
    for gpu, e in validation.operator_check().items():
        assert e["median"] < 0.08, (gpu, e)


def test_attention_runs_faster_on_longer_contexts_and_slower_on_a_thin_grid():
    timer = Timer(GpuProfile.named("h100_sxm"), load_model("llama3-70b"), 8)

    def rate(seqs, n, start=0):
        op = next(o for o in attention_block(load_model("llama3-70b"), seqs, start, n, 8) if o.name == "attn")
        return op.flops / timer.time(op)
    assert rate(8, 8192) > rate(64, 1024) > rate(512, 128)        # the same tokens, longer sequences
    assert rate(1, 512) < rate(32, 512)          # 8 heads x 4 tiles fill 32 of 132 SMs; 32 prompts fill them
    published = figures()["attention_published"]["h100_sxm"]["points"]
    assert rate(8, 8192) == pytest.approx(published[1][1], rel=0.1)


def test_bloom_and_llama_configs_from_hugging_face(tmp_path):
    bloom = tmp_path / "bloom.json"
    bloom.write_text(json.dumps({"model_type": "bloom", "n_layer": 70, "hidden_size": 14336, "n_head": 112,
                                 "vocab_size": 250880}))
    m = load_model(str(bloom))
    assert (m.layers, m.heads, m.kv_heads, m.head_dim, m.ffn, m.gated, m.rope) == \
        (70, 112, 112, 128, 4 * 14336, False, False)
    names = [op.name for op in attention_block(m, 1, 0, 64, 8) + ffn_block(m, 1, 64, 8)]
    assert "attn_rope" not in names                   # ALiBi: no rotary embedding
    up = next(op for op in ffn_block(m, 1, 64, 8) if op.name == "mlp_up_proj")
    assert up.gemm == (14336, 4 * 14336 // 8)          # one up projection, no gate
    assert load_model("bloom-176b").shape == m.shape
    assert m.name == "bloom (bloom)"
    snapshot = tmp_path / "Llama-3.2-1B"
    snapshot.mkdir()
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 16,
                                                      "hidden_size": 2048, "num_attention_heads": 32,
                                                      "num_key_value_heads": 8, "intermediate_size": 8192,
                                                      "vocab_size": 128256}))
    assert load_model(str(snapshot / "config.json")).name == "Llama-3.2-1B (llama)"     # not "config"
    bad = tmp_path / "bad.json"
    llama = {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "intermediate_size": 8192,
             "vocab_size": 128256}
    for config, says in [({"model_type": "bloom", "n_layer": 2}, "it has no 'hidden_size'"),
                         ({**llama, "num_hidden_layers": 10 ** 8}, "'num_hidden_layers' must be a whole number from 1"),
                         ({**llama, "num_attention_heads": 0}, "'num_attention_heads' must be a whole number"),
                         ({**llama, "hidden_size": 2047}, "the hidden size 2047 is no whole number of its 32 heads"),
                         ({**llama, "torch_dtype": "float8_e4m3fn"}, "'torch_dtype' 'float8_e4m3fn' is not one"),
                         ({**llama, "torch_dtype": ["bfloat16"]}, "'torch_dtype' ['bfloat16'] is not one"),
                         ([1, 2], "it is not a JSON object")]:
        bad.write_text(json.dumps(config))
        with pytest.raises(WorkloadError, match=re.escape(f"not a usable Hugging Face config: {says}")):
            load_model(str(bad))
    bad.write_text(json.dumps({**llama, "torch_dtype": "float32"}))
    assert load_model(str(bad)).dtype_bytes == 4


MISTRAL = {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}


def test_a_sliding_window_bounds_what_each_query_attends_to(tmp_path):
    """Mistral's `sliding_window`: a prompt within it is timed as full attention; beyond it
    each query attends to the window's keys only, and nothing but attention changes."""
    folder = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama3-8b"))
    full, windowed = tmp_path / "full.json", tmp_path / "windowed.json"
    full.write_text(json.dumps({**MISTRAL, "sliding_window": None}))
    windowed.write_text(json.dumps({**MISTRAL, "sliding_window": 2048}))
    assert (load_model(str(full)).window, load_model(str(windowed)).window) == (0, 2048)

    def operators(config, prompt):
        return run(folder, model=str(config), prompt=prompt, stack="none")[0]["operators"]
    assert operators(windowed, 2048) == operators(full, 2048)
    long_full, long_windowed = operators(full, 16384), operators(windowed, 16384)
    # 16k queries over 2k keys each, against 8k on average: attention (most of this pass) ~ 3.6x less
    assert 2.5 < long_full["attn"] / long_windowed["attn"] < 4.5
    assert {k: v for k, v in long_full.items() if k != "attn"} == \
        {k: v for k, v in long_windowed.items() if k != "attn"}


def test_a_windowed_attention_sees_the_window_as_its_context(tmp_path):
    """Beyond the window each query attends to the window's keys: the kernel's FLOPs are the
    window's, its rate that of a context as long as the window, and a later pass reads the
    window's KV, not all of the earlier tokens'."""
    config = tmp_path / "mistral.json"
    config.write_text(json.dumps({**MISTRAL, "sliding_window": 2048}))
    m = load_model(str(config))
    attn = next(op for op in attention_block(m, 1, 8192, 1024, 1) if op.name == "attn")
    heads, kv, d = 32, 8, 128
    assert attn.context == 2048 and attn.flops == 4.0 * 1024 * 2048 * heads * d
    assert attn.bytes == 2 * (1024 * 2 * (heads + kv) * d + 2048 * 2 * kv * d)


def test_a_chunked_prefill_reads_back_only_the_windows_kv(tmp_path):
    """Each later pass reads the earlier passes' KV from the pool: all of it, or the latest
    `sliding_window` tokens' of it."""
    folder = compile_text(tmp_path, 'import "fabrics/dgx_cxl.fx"\nworkload w { model: "llama3-8b"; weights: hbm; '
                          'kv: pool0 }\nmovement back = kv : pool0 -> gpu*\n')
    full, windowed = tmp_path / "full.json", tmp_path / "windowed.json"
    full.write_text(json.dumps(MISTRAL))
    windowed.write_text(json.dumps({**MISTRAL, "sliding_window": 1024}))

    def read_back(config):
        report = run(folder, model=str(config), prompt=4096, chunk_tokens=1024, stack="none")[0]
        return next(m["bytes"] for m in report["movements"] if m["name"] == "back")
    # passes after 1k, 2k and 3k tokens: 6k tokens' KV read in all, or 1k each with the window
    assert read_back(full) == 2 * read_back(windowed) > 0


def test_with_fewer_kv_heads_than_gpus_each_keeps_one():
    """TP shards the KV heads; past as many GPUs as KV heads each GPU keeps one (with its K
    and V projections), as the attention block computes it."""
    m = load_model("llama3-8b")                             # 32 query heads, 8 KV heads of 128
    w8, w16 = Workload(m, 1024, tp=8), Workload(m, 1024, tp=16)
    assert w16.kv_bytes(1024) == w8.kv_bytes(1024) == 2 * 1024 * 128 * 2
    qkv = next(op for op in attention_block(m, 1, 0, 1, 16) if op.name == "attn_pre_proj")
    assert qkv.gemm == (4096, (2 + 2 * 1) * 128)
    whole = (2 * 32 + 2 * 8) * 4096 * 128 * 2                 # Q, K, V and O of one layer
    assert w8.weight_bytes("attention") * 8 == whole
    assert w16.weight_bytes("attention") == (2 * 2 + 2 * 1) * 4096 * 128 * 2
    assert w8.weight_bytes("ffn") * 8 == 3 * 4096 * 14336 * 2


def test_configs_whose_layers_the_model_does_not_time_are_refused(tmp_path):
    """Experts, another architecture, or a window on some layers only would be timed as a dense
    Llama layer in silence: each is an error naming the key, and what to do where there is a way."""
    config = tmp_path / "config.json"
    qwen = {**MISTRAL, "model_type": "qwen2", "sliding_window": 4096}
    for c, says in [({**MISTRAL, "model_type": "mixtral", "num_local_experts": 8}, "'num_local_experts' is 8: "
                     "a mixture of experts"),
                    ({**MISTRAL, "model_type": "qwen2_moe", "num_experts": 60}, "'num_experts' is 60"),
                    ({**MISTRAL, "model_type": "gpt_neox"}, "'model_type' 'gpt_neox' is not one the model "
                     "times"),
                    ({**qwen, "use_sliding_window": True}, "'use_sliding_window' windows only the layers"),
                    ({**MISTRAL, "sliding_window": 0}, "'sliding_window' must be a whole number")]:
        config.write_text(json.dumps(c))
        with pytest.raises(WorkloadError, match=re.escape(says)):
            load_model(str(config))
    config.write_text(json.dumps(qwen))                 # Qwen's window is off unless switched on
    assert load_model(str(config)).window == 0
    config.write_text(json.dumps({k: v for k, v in MISTRAL.items() if k != "model_type"}))
    assert load_model(str(config)).gated                # no model_type: a Llama-style layer
    config.write_text(json.dumps({**MISTRAL, "model_type": "mixtral", "num_local_experts": 8}))
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--model", str(config), "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "a mixture of experts" in r.stderr and "Traceback" not in r.stderr


def test_batch_multiplies_the_work_and_the_report_names_every_operator(tmp_path):
    folder = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"))
    one, _ = run(folder, prompt=512, batch=1, tp=8, stack="none")
    four, _ = run(folder, prompt=512, batch=4, tp=8, stack="none")
    assert set(one["operators"]) == {"emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn",
                                     "attn_post_proj", "add", "post_attention_layernorm", "mlp_up_proj",
                                     "mlp_act", "mlp_down_proj", "lm_head"}
    assert 2.5 < four["compute_ms"] / one["compute_ms"] < 4.5
    assert four["ttft_ms"] > one["ttft_ms"]


# ---- machines and collectives -----------------------------------------------------------------
def test_the_gpu_model_property_picks_the_profile(tmp_path):
    a100, _ = run(compile_text(tmp_path, MACHINE.format(fabric="dgx_a100.fx", model="llama2-70b"), "a"),
                  prompt=1024, tp=8, stack="none")
    h100, _ = run(compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"), "h"),
                  prompt=1024, tp=8, stack="none")
    assert (a100["gpu"], h100["gpu"]) == ("a100_sxm", "h100_sxm")
    assert a100["compute_ms"] > 1.8 * h100["compute_ms"]       # 312 vs 989 TFLOP/s, 2.0 vs 3.35 TB/s


def test_an_unknown_gpu_profile_or_stack_is_an_error_at_its_line(tmp_path):
    shutil.copytree(POLICIES / "fabrics", tmp_path / "fabrics")
    src = tmp_path / "u.fx"
    src.write_text('fabric f { gpu g0, g1 { model: "h100_sx" }\n link g0 <-> g1 { bw: 450GB/s } }\n'
                   'workload w { model: "llama3-8b"; stack: "vlm"; tp: 2 }\n')
    r = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "check", str(src)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "u.fx:1:" in r.stderr and "unknown GPU profile 'h100_sx'" in r.stderr and "'h100_sxm'" in r.stderr
    assert "u.fx:3:" in r.stderr and "unknown serving stack 'vlm'" in r.stderr and "'vllm'" in r.stderr
    folder = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"), "s")
    with pytest.raises(WorkloadError, match="unknown serving stack 'fast'"):
        run(folder, stack="fast", tp=8)


def test_an_allreduce_takes_the_fitted_alpha_beta(tmp_path):
    """One all-reduce per block: alpha + 2 (t-1)/t * size / busbw of the H100 fit at TP 4,
    carried over the NVLink ring by the fabric (its chunks pay no per-message cost twice)."""
    folder = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"))
    report, _ = run(folder, prompt=256, tp=4, stack="none")
    fit = figures()["compute"]["h100_sxm"]["all_reduce"]["4"]
    size = 256 * 8192 * 2
    expected = (fit["alpha"] + 2 * 3 / 4 * size / fit["busbw"] * 1e9) / 1e6
    per_call = [layer["allreduce_ms"] / 2 for layer in report["layers"]]
    assert per_call == pytest.approx([expected] * 80, rel=0.03)


def test_a_tp_degree_without_a_fit_takes_the_nearest_ones_fit_and_stack_share():
    """TP 16 all-reduces as TP 8 was fitted, at or beyond the largest profiled size at the
    stack's share for TP 8 too (not the whole bus bandwidth)."""
    gpus = [f"gpu{i}" for i in range(16)]
    timing = Timing(Workload(load_model("llama3-8b"), 8192, tp=16), gpus, {}, "vllm")
    fit = figures()["compute"]["h100_sxm"]["all_reduce"]["8"]
    small, large = timing.all_reduce("gpu0", 1 << 20), timing.all_reduce("gpu0", fit["max_size"])
    assert small.busbw == fit["busbw"] and small.alpha_ns == fit["alpha"]
    assert Stack.named("vllm").busbw(8) < 1
    assert large.busbw == pytest.approx(fit["busbw"] * Stack.named("vllm").busbw(8))


# ---- the serving stack -------------------------------------------------------------------------
def test_the_stack_adds_its_floor_tail_and_factors(tmp_path, monkeypatch):
    """The vllm stack's floor holds a short prefill; a stack's kernel factor stretches every
    kernel and its tail comes after the last (a made-up stack, so that both differ from 1 and 0
    whatever the fit gives)."""
    monkeypatch.setitem(figures()["stacks"], "slow", {"kernel_factor": {"h100_sxm": 1.25}, "tail_ms": 3.0})
    folder = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"))
    none, _ = run(folder, prompt=16, tp=8, stack="none")
    vllm, _ = run(folder, prompt=16, tp=8, stack="vllm")
    assert none["ttft_ms"] < Stack.named("vllm").floor("h100_sxm") == pytest.approx(vllm["ttft_ms"])   # the floor
    long_none, _ = run(folder, prompt=2048, tp=8, stack="none")
    long_slow, _ = run(folder, prompt=2048, tp=8, stack="slow")
    assert long_slow["compute_ms"] == pytest.approx(long_none["compute_ms"] * 1.25, rel=1e-6)
    assert long_slow["ttft_ms"] - long_none["ttft_ms"] == pytest.approx(0.25 * long_none["compute_ms"] + 3.0, rel=0.01)


def test_a_gpu_timed_as_another_takes_that_ones_stack_figures_too(tmp_path):
    """An H200 is timed with the H100's fitted coefficients, and on the H100's host and
    software stack: its floor and factors are the H100's, not none at all."""
    h100 = 'model: "h100_sxm"; hbm: 80GiB; hbm_bw: 3.35TB/s'
    fabric = (POLICIES / "fabrics" / "dgx_h100.fx").read_text()
    assert h100 in fabric
    (tmp_path / "dgx_h200.fx").write_text(fabric.replace(h100, 'model: "h200_sxm"; hbm: 141GB; hbm_bw: 4.8TB/s'))
    folder = compile_text(tmp_path, MACHINE.replace("fabrics/", "").format(fabric="dgx_h200.fx", model="llama2-70b"))
    vllm, _ = run(folder, prompt=16, tp=8, stack="vllm")
    assert vllm["gpu"] == "h200_sxm"
    assert vllm["ttft_ms"] == pytest.approx(Stack.named("vllm").floor("h100_sxm"))
    for name, stack in figures()["stacks"].items():       # every profile has its figures, its own or another's
        for table in ("floor_ms", "kernel_factor", "alibi_attention_factor"):
            if table in stack:
                assert {GpuProfile.named(g).timed_as for g in figures()["gpu"]} <= set(stack[table]), (name, table)


def test_a_power_capped_h100_takes_its_own_stack_figures_and_without_them_is_an_h100(tmp_path):
    """The capped H100 (the measured h100-80gb-pcap machine) computes as an H100 with the
    hardware alone (the cap is measured only end to end), and in the vllm stack takes the
    figures fitted to its own machine: its kernel factor and floor, not the H100's."""
    fabric = (POLICIES / "fabrics" / "dgx_h100.fx").read_text()
    (tmp_path / "capped.fx").write_text(fabric.replace('model: "h100_sxm"', 'model: "h100_sxm_pcap"'))
    machine = MACHINE.replace("fabrics/", "")
    capped = compile_text(tmp_path, machine.format(fabric="capped.fx", model="llama3-8b"), "c")
    h100 = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama3-8b"), "h")
    (c_none, _), (h_none, _) = (run(f, prompt=2048, tp=8, stack="none") for f in (capped, h100))
    assert c_none["gpu"] == "h100_sxm_pcap" and c_none["ttft_ms"] == h_none["ttft_ms"]
    (c_vllm, _), (h_vllm, _) = (run(f, prompt=2048, tp=8, stack="vllm") for f in (capped, h100))
    vllm = Stack.named("vllm")
    factor = vllm.kernel_factor["h100_sxm_pcap"]
    assert factor > 1.1 and vllm.kernel_factor["h100_sxm"] < factor
    assert c_vllm["compute_ms"] == pytest.approx(h_vllm["compute_ms"] / vllm.kernel_factor["h100_sxm"] * factor, rel=1e-4)
    short, _ = run(capped, prompt=16, tp=8, stack="vllm")
    assert short["ttft_ms"] == pytest.approx(vllm.floor("h100_sxm_pcap")) != vllm.floor("h100_sxm")


def test_a_measured_machine_runs_on_its_fabric_with_its_gpus_profile():
    """The validation runs each measured machine on its bundled fabric with its GPUs taking
    the machine's profile (the capped H100: dgx_h100.fx's GPUs as `h100_sxm_pcap`); a fabric
    whose GPUs name no profile is refused, not run as the default H100."""
    runner = validation._Runner()
    capped = runner.bundle(validation.MACHINES["h100-80gb-pcap"], "bloom-176b")
    assert {d["props"].get("model") for d in capped.manifest["fabric"]["devices"] if d["kind"] == "gpu"} \
        == {"h100_sxm_pcap"}
    with pytest.raises(ValueError, match="dgx_cxl.fx: no GPU names its profile"):
        runner.bundle(validation.Machine("dgx_cxl.fx", "h100_sxm_pcap"), "bloom-176b")


def test_the_stack_is_chosen_by_the_workload_or_the_command_line(tmp_path):
    folder = compile_text(tmp_path, 'import "fabrics/dgx_h100.fx"\n'
                        'workload w { model: "llama2-70b"; tp: 8; prompt: 64; stack: "none" }\n')
    report, _ = run(folder)
    assert report["stack"] == "none"
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(folder), "--stack", "vllm",
                        "-q", "--json", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "r.json").read_text())["stack"] == "vllm"


# ---- calibration and validation ------------------------------------------------------------------
@pytest.fixture(scope="module")
def validated():
    return validation.validate(DATA / "splitwise" / "prefill_measured.csv")


@needs_data
def test_every_stored_coefficient_is_what_a_refit_of_the_shared_data_gives():
    """`calibrate --check` refits the operator tables, the compute and collective models and
    the stack from ../shared/data and fails where a stored figure differs."""
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.calibrate", str(DATA), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "median |error|" in r.stdout and "left out:" in r.stdout


@needs_data
def test_the_model_is_within_its_error_bounds_of_the_measured_prefills(validated):
    """Per (model, GPU) group: median |error| within 8 %; every point within 25 % (issue 14's
    15 % is met on BLOOM H100, capped or not, only: docs/model.md names the other points and
    why); the hardware alone is too fast."""
    rows, skipped = validated
    assert len(rows) == 77 and len(skipped) == 1
    for group, s in validation.summary(rows).items():
        if "TP" not in group:
            assert s["median"] <= 0.08, (group, s)
            assert s["max"] <= 0.25, (group, s)
            assert s["hardware"] < -0.1, (group, s)
    for group in ("bloom-176b h100-80gb", "bloom-176b h100-80gb-pcap"):
        assert validation.summary(rows)[group]["max"] <= 0.15


def test_an_error_beyond_the_runs_is_the_distance_to_the_nearest_repeated_run():
    """Inside the repeated runs' range nothing is beyond them; outside, the distance is to the
    nearer end of the range, not to the median."""
    p = validation.Point("llama2-70b", "a100-80gb", 4, 512, 4, measured_ms=571.4, runs=5,
                         fastest_ms=450.0, slowest_ms=587.0)
    inside, below, above = (validation.Modelled(p, 0.0, 0.0, ms) for ms in (500.0, 405.0, 645.7))
    assert inside.beyond_runs == 0 and inside.error == pytest.approx(500 / 571.4 - 1)
    assert below.beyond_runs == pytest.approx(-0.1)
    assert above.beyond_runs == pytest.approx(0.1)


def test_calibrate_gives_its_usage_and_refuses_unknown_options():
    help_ = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.calibrate", "--help"],
                           capture_output=True, text=True)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: fabric-calibrate")
    bad = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.calibrate", "--chek"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unexpected arguments: --chek" in bad.stderr


def _calibrate(data):
    from fabric_ext.runtime.simulation.compute import PROFILES
    from fabric_ext.runtime.simulation.figures import PATH
    before = PATH.read_bytes(), PROFILES.read_bytes()
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.calibrate", str(data)],
                       capture_output=True, text=True, timeout=600)
    assert (PATH.read_bytes(), PROFILES.read_bytes()) == before, "a failed calibration changed the stored figures"
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("text,says", [
    ("a,b\n1,2\n", "h100_x_mlp.csv, line 2: no column 'n_embd'"),
    ("n_embd,n_head\n", "h100_x_mlp.csv: no rows"),
    ("n_embd,n_head,n_kv_head,n_expanded_embd,use_gated_mlp,num_tokens\n4096,32,8,big,True,1\n",
     "h100_x_mlp.csv, line 2: column 'n_expanded_embd': 'big' is not a number"),
    ("n_embd,n_head,n_kv_head,n_expanded_embd,use_gated_mlp,num_tokens\n4096,0,8,14336,True,1\n",
     "h100_x_mlp.csv, line 2: column 'n_head': '0' is not a whole number from 1"),
])
def test_calibrate_names_the_file_line_and_column_it_cannot_read(tmp_path, text, says):
    (tmp_path / "vidur").mkdir()
    (tmp_path / "vidur" / "h100_x_mlp.csv").write_text(text)
    r = _calibrate(tmp_path)
    assert r.returncode == 1 and says in r.stderr, r.stderr


def test_fits_refuse_data_too_thin_or_backwards_to_fit(tmp_path):
    """Each fit needs two points or more, a bandwidth that comes out positive, and measured
    prefills that took time; else the file is named and why."""
    from fabric_ext.runtime.simulation import calibrate
    nccl = tmp_path / "ar.csv"
    head = "num_workers,devices_per_node,size,time_stats.all_reduce.median\n"
    nccl.write_text(head + "2,2,1024,0.05\n2,8,2048,0.06\n")
    with pytest.raises(calibrate.DataError, match="1 rows of all-reduces within one node; a fit needs two or more"):
        calibrate.fit_allreduce(nccl)
    nccl.write_text(head + "2,2,1024,0.09\n2,2,1048576,0.05\n2,2,4194304,0.01\n")      # faster as it grows
    with pytest.raises(calibrate.DataError, match="at TP 2 do not grow with the size"):
        calibrate.fit_allreduce(nccl)
    sends = tmp_path / "sr.csv"
    sends.write_text("devices_per_node,size,time_stats.send_recv.median\n2,1024,0.09\n2,1048576,0.01\n")
    with pytest.raises(calibrate.DataError, match="do not grow with the size"):
        calibrate.fit_message_cost(sends)
    measured = tmp_path / "m.csv"
    measured.write_text("model,hardware,tensor_parallel,prompt_size,batch_size,prompt_time\n"
                        "llama2-70b,a100-80gb,2,512,1,0\n")
    with pytest.raises(calibrate.DataError, match="m.csv, line 2: column 'prompt_time': '0' is not more than 0"):
        validation.measured(measured)


def _data_with_slower_allreduces(tmp_path):
    """A copy of the shared data whose H100 NCCL profile takes twice as long: a refit of it
    differs from the stored figures."""
    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    nccl = data / "vidur" / "h100_dgx_all_reduce.csv"
    nccl.chmod(0o644)
    header, *rows = nccl.read_text().splitlines()
    median = header.split(",").index("time_stats.all_reduce.median")
    nccl.write_text("\n".join([header] + [",".join(f"{float(v) * 2}" if i == median else v
                                                    for i, v in enumerate(r.split(","))) for r in rows]) + "\n")
    return data


@needs_data
def test_a_bad_measured_row_leaves_the_stored_figures_as_they_were(tmp_path):
    """The stack is fitted after the hardware figures are refitted for its runs: a measured row
    that is no number then stops the calibration with the row named, and every stored figure
    is as it was (the NCCL profile changed here too, so that the refit the stack's runs read
    differs from what is stored)."""
    data = _data_with_slower_allreduces(tmp_path)
    measured = data / "splitwise" / "prefill_measured.csv"
    measured.chmod(0o644)
    lines = measured.read_text().splitlines(keepends=True)
    row = lines[3].split(",")
    row[lines[0].split(",").index("prompt_time")] = "fast"
    lines[3] = ",".join(row)
    measured.write_text("".join(lines))
    r = _calibrate(data)
    assert r.returncode == 1 and "prefill_measured.csv, line 4: column 'prompt_time': 'fast' is not a number" \
        in r.stderr, r.stderr


def test_the_stacks_per_prompt_cost_and_large_allreduce_share_take_effect(tmp_path, monkeypatch):
    """A stack's CPU cost per prompt adds that much per prompt of the batch, and its share of
    the bus bandwidth for all-reduces beyond the profiled sizes stretches exactly their
    bandwidth time (what `allreduce_beyond_profile_ms` reports)."""
    monkeypatch.setitem(figures()["stacks"], "per_prompt", {"per_prompt_ms": 100.0})
    monkeypatch.setitem(figures()["stacks"], "half_busbw", {"large_busbw_factor": {"8": 0.5}})
    folder = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"))
    ttft = {(stack, batch): run(folder, prompt=512, batch=batch, tp=8, stack=stack)[0]["ttft_ms"]
            for stack in ("none", "per_prompt") for batch in (1, 4)}
    assert ttft["per_prompt", 1] - ttft["none", 1] == pytest.approx(100.0, abs=1e-6)
    assert ttft["per_prompt", 4] - ttft["none", 4] == pytest.approx(400.0, abs=1e-6)
    none, _ = run(folder, prompt=4096, tp=8, stack="none")          # 64 MiB all-reduces: the profile's largest
    half, _ = run(folder, prompt=4096, tp=8, stack="half_busbw")
    beyond = none["allreduce_beyond_profile_ms"]
    assert beyond > 0 and half["allreduce_beyond_profile_ms"] == beyond
    assert half["ttft_ms"] - none["ttft_ms"] == pytest.approx(beyond, rel=0.05)


def test_the_stacks_alibi_attention_factor_stretches_only_alibi_attention(tmp_path, monkeypatch):
    """A stack's ALiBi attention factor multiplies the attention core of an ALiBi model (BLOOM)
    and nothing else: the prefill takes (factor - 1) x that attention's time longer, every other
    operator keeps its time, and a RoPE model (Llama) runs as without it."""
    monkeypatch.setitem(figures()["stacks"], "slow_alibi", {"alibi_attention_factor": {"h100_sxm": 3.0}})
    bloom = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="bloom-176b"), name="bloom")
    none, _ = run(bloom, prompt=2048, tp=8, stack="none")
    slow, _ = run(bloom, prompt=2048, tp=8, stack="slow_alibi")
    attn = none["operators"]["attn"]
    assert attn > 0 and slow["operators"]["attn"] == pytest.approx(3 * attn, abs=1e-3)
    assert {k: v for k, v in slow["operators"].items() if k != "attn"} == \
        {k: v for k, v in none["operators"].items() if k != "attn"}
    assert slow["ttft_ms"] - none["ttft_ms"] == pytest.approx(2 * attn, rel=0.01)
    llama = compile_text(tmp_path, MACHINE.format(fabric="dgx_h100.fx", model="llama2-70b"), name="llama")
    assert run(llama, prompt=2048, tp=8, stack="slow_alibi")[0]["ttft_ms"] == \
        run(llama, prompt=2048, tp=8, stack="none")[0]["ttft_ms"]


def test_the_floor_search_finds_the_grids_best_floors_where_machines_share_factors():
    """`validation._floors`, one machine's floor at a time, finds the floors an exhaustive search
    of the grid finds, on an error in which the machines' floors are coupled (through the
    factors they share), as in the stack fit."""
    import itertools

    def fit(floors):
        a, b, c = (f - best for f, best in zip(floors, (68.0, 48.0, 62.0)))
        return (a * a + b * b + c * c + 0.6 * a * b - 0.5 * b * c,)

    grid = validation.FLOOR_GRID
    assert validation._floors(fit, 3) == list(min(itertools.product(grid, repeat=3), key=lambda f: fit(f)[0]))
    assert validation._floors(lambda f: (sum((x - 30.0) ** 2 for x in f),), 2) == [30.0, 30.0]


def test_the_stack_fit_holds_kernel_factors_and_the_tail_at_their_floors():
    """`validation._at_least_zero`: where least squares would make a held unknown negative (a
    kernel faster than its profile, a tail that takes time back), it is held at 0 and the
    others refitted; unheld unknowns may be negative."""
    import numpy as np
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    rhs = np.array([-1.0, 0.0, 1.0])             # unconstrained: x = (-1, 1)
    assert np.allclose(validation._at_least_zero(a, rhs, []), [-1.0, 1.0])
    held = validation._at_least_zero(a, rhs, [0])
    assert held[0] == 0.0 and np.allclose(held[1], np.linalg.lstsq(a[:, 1:], rhs, rcond=None)[0][0])


@needs_data
def test_a_calibration_stopped_half_way_leaves_the_stored_figures_as_they_were(tmp_path, monkeypatch):
    """The stack's fit runs the engine on the hardware figures just refitted: they are read in
    the process, not written over the package's until the calibration is done, so one stopped
    during that fit (Ctrl-C here; a SIGTERM alike) leaves every stored figure as it was (the
    NCCL profile is changed, so that the refit differs from what is stored)."""
    from fabric_ext.runtime.simulation import calibrate
    from fabric_ext.runtime.simulation.compute import PROFILES
    from fabric_ext.runtime.simulation.figures import PATH, figures
    data = _data_with_slower_allreduces(tmp_path)
    before, stored = (PATH.read_bytes(), PROFILES.read_bytes()), figures()

    def stop(path):
        assert figures() != stored       # the engine's runs would read the refit ...
        raise KeyboardInterrupt
    monkeypatch.setattr(validation, "fit_stack", stop)
    with pytest.raises(KeyboardInterrupt):
        calibrate.main([str(data)])
    assert (PATH.read_bytes(), PROFILES.read_bytes()) == before      # ... and the files are as they were
    assert figures() == stored


def test_a_measured_file_of_more_configurations_than_the_fit_runs_is_refused(tmp_path):
    """The fit runs the engine on every configuration, twice: a file of 1,025 is an error
    naming it, before any run (3,000 ran for more than 4 minutes)."""
    rows = "".join(f"llama2-70b,a100-80gb,8,{128 + i},1,128,100.0,50\n" for i in range(1025))
    path = tmp_path / "prefill_measured.csv"
    path.write_text("model,hardware,tensor_parallel,prompt_size,batch_size,token_size,prompt_time,token_time\n" + rows)
    from fabric_ext.runtime.simulation.calibrate import DataError
    with pytest.raises(DataError, match="1,025 configurations .model, hardware, TP, prompt, batch.; the fit runs the engine "
                             "on each, and takes at most 1,024"):
        validation.measured(path)


@needs_data
def test_a_calibration_that_cannot_write_its_figures_says_so(monkeypatch, capsys):
    """The figures are written only at the end, each whole (`atomic_write_text`): where that
    fails (no space, no permission) the calibration says so and exits 1, no traceback."""
    from fabric_ext.runtime.machine.errors import OutputError
    from fabric_ext.runtime.simulation import calibrate

    def refuse(path, text):
        raise OutputError(f"cannot write {path}: No space left on device")
    monkeypatch.setattr(calibrate, "atomic_write_text", refuse)
    assert calibrate.main([str(DATA)]) == 1
    assert "figures.json: No space left on device" in capsys.readouterr().err
