"""Histogram maps (`hist<DIM>`, `lhist<DIM>[MIN, MAX, STEP]`, counted with `NAME = hist(v)`):
the buckets the compiled program counts in, against Python's, for any value (a property test
through the interpreter and the JIT); a run's histogram against the chunks it saw; the report's
picture; and the checker's errors."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decision_effects import FABRIC, MODEL

from fabric_ext.contract.bundle import load_bundle
from fabric_ext.contract.context import ContextCodec
from fabric_ext.frontend import analyze
from fabric_ext.runtime.machine import kernel
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.jit import JitBackend
from fabric_ext.runtime.simulation.stats import render
from test_runtime import compile_text, run_engine

POLICY = FABRIC + """
workload w { model: "MODEL"; prompt: 2048; tp: 2; weights: pool0; kv: pool0 }
movement w = weights : pool0 -> gpu* { chunk: 96KiB }
movement kv = kv : gpu* -> pool0 { chunk: 96KiB }
map lat : hist<time>
map sizes : lhist<size>[32KiB, 96KiB, 16KiB]
policy p {
  on w.complete at gpu* { lat = hist(ev.latency) }
  on kv.forward at sw0 { sizes = lhist(ev.bytes) }
}
"""


def log2_bucket(v: int) -> int:
    return max(v.bit_length() - 1, 0)


def linear_bucket(v: int, lo=32 << 10, hi=96 << 10, step=16 << 10) -> int:
    return 0 if v < lo else (hi - lo) // step + 1 if v >= hi else 1 + (v - lo) // step


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hist")
    model = tmp / "model.json"
    model.write_text(json.dumps(MODEL))
    return compile_text(tmp, POLICY.replace("MODEL", str(model)), "hist"), model


def _counting(folder, island, hook, map_name, vm):
    """A function that runs the program of island.hook on a context and returns the map's counts."""
    bundle = load_bundle(folder)
    prog = bundle.islands[island][hook]
    codec, handle = ContextCodec(prog.hook), vm.load(prog)
    movement = bundle.ids["movements"]["w" if hook == "complete" else "kv"]

    def count(**fields):
        vm.run(handle, codec.pack({"movement": movement, **fields}))
        return dict(bundle.maps[map_name].dump())
    return count


@settings(max_examples=120, deadline=None)
@given(v=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2, 3, 4, 2**32 - 1, 2**32, 2**63])))
def test_a_hist_counts_each_value_in_the_bucket_of_its_highest_bit(folder, v):
    for vm in (Interpreter(), JitBackend()):
        count = _counting(folder[0], "gpu0", "complete", "lat", vm)
        before = count(latency=0).copy()
        after = count(latency=v)
        changed = {k for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)}
        assert changed == {log2_bucket(v)}


@settings(max_examples=80, deadline=None)
@given(v=st.one_of(st.integers(0, 300 << 10), st.sampled_from([0, 32 << 10, (32 << 10) - 1, 96 << 10, 2**64 - 1])))
def test_an_lhist_counts_below_inside_and_above_its_bounds(folder, v):
    count = _counting(folder[0], "sw0", "forward", "sizes", Interpreter())
    before = count(bytes=0).copy()
    after = count(bytes=v)
    assert {k for k in after if after[k] != before.get(k, 0)} == {linear_bucket(v)}


def test_a_run_counts_the_chunks_it_saw_and_draws_them(folder):
    path, model = folder
    report, eng = run_engine(path, model=str(model), prompt=2048, tp=2)
    kv = [t for t in eng.fabric.transfers if t.name == "kv"]
    sizes = [min(t.chunk_bytes, t.bytes - i * t.chunk_bytes) for t in kv for i in range(t.chunks_total)]
    expected = {}
    for s in sizes:
        expected[linear_bucket(s)] = expected.get(linear_bucket(s), 0) + 1
    buckets = report["map_histograms"]["sizes"]
    assert {linear_bucket(b["lo"]): b["count"] for b in buckets} == expected
    assert sum(b["count"] for b in report["map_histograms"]["lat"]) == sum(
        t.chunks_total for t in eng.fabric.transfers if t.name == "w")      # each weights chunk completes once
    text = render(report)
    assert "hist sizes:" in text and all(f"{b['text']} " in text for b in buckets)
    assert "sizes" not in report["map_entries"]          # shown as a histogram, not as array entries


@pytest.mark.parametrize("decl,stmt,message", [
    ("map lat : hist<time>", "lat[3] += 1", "'lat' is a hist; it counts values itself"),
    ("map lat : hist<time>", "lat = lhist(ev.latency)", "count with hist(), not lhist()"),
    ("map lat : hist<time>", "lat = hist(ev.bytes)", "'lat' counts a time, not a size"),
    ("map lat : hist<time, u64>", "lat = hist(ev.latency)", "a hist has one type"),
    ("map lat : hist<time>[8]", "lat = hist(ev.latency)", "it takes no size"),
    ("map lat : lhist<time>[0, 10us, 3us]", "lat = lhist(ev.latency)", "a whole number of steps"),
    ("map lat : lhist<time>[0, 10us]", "lat = lhist(ev.latency)", "needs its lowest value, its highest"),
    ("map lat : lhist<time>[0, 1KiB, 4]", "lat = lhist(ev.latency)", "'1KiB' is no bound for an lhist that counts a time"),
    ("map lat : hash<u32, time>[4]", "lat = hist(ev.latency)", "'lat' is a hash map, not a histogram"),
])
def test_the_checker_says_what_is_wrong(tmp_path, decl, stmt, message):
    path = tmp_path / "p.fx"
    path.write_text(FABRIC + "\nmovement w = weights : pool0 -> gpu*\n" + decl
                    + "\npolicy p { on w.complete at gpu* { " + stmt + " } }\n")
    errors = [x.message for x in analyze(path).diags.items if x.severity == "error"]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.skipif(not kernel.permitted()[0], reason=kernel.permitted()[1] or "bpf(2) not permitted")
def test_the_kernel_verifier_accepts_the_bucketing(folder):
    from fabric_ext import api
    source = next(folder[0].parent.glob("hist.fx"))
    bundle = api.compile(source, kernel_verify=True)
    assert bundle.manifest["maps"][0]["hist"]["kind"] in ("hist", "lhist")


@pytest.mark.parametrize("change,says", [
    (lambda m: m["hist"].pop("lo"), "an lhist needs lo, hi and step"),
    (lambda m: m.update(max_entries=7), "do not make its 7 buckets"),
    (lambda m: m["hist"].update(step=0), "do not make its"),
    (lambda m: m.update(value_size=4), "a histogram is an array of u64 counts"),
])
def test_a_tampered_histogram_layout_is_refused_by_key(folder, tmp_path, capsys, change, says):
    import shutil

    from fabric_ext.runtime.simulation import cli
    out = tmp_path / "out"
    shutil.copytree(folder[0], out)
    man = json.loads((out / "manifest.json").read_text())
    change(next(m for m in man["maps"] if m["name"] == "sizes"))
    (out / "manifest.json").write_text(json.dumps(man))
    code = cli.main(["--policy", str(out), "--model", str(folder[1]), "--prompt", "256", "-q"])
    err = capsys.readouterr().err
    assert code == 1 and "maps[" in err and says in err and "Traceback" not in err, err
