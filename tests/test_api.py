"""The Python API (fabric_ext.api): compile in memory, run, the report's records, errors."""
import json
import re

import pytest

import fabric_ext
from conftest import POLICIES
from fabric_ext.contract.bundle import load_manifest

TEXT = f'''import "{POLICIES}/fabrics/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: hbm }}
movement w_in = weights : pool0 -> gpu*
policy p {{ on w_in.forward {{ priority = 7 }} }}
'''


def test_compile_text_in_memory_run_and_write(tmp_path):
    bundle = fabric_ext.compile(TEXT)
    assert "manifest.json" in bundle.files and bundle.manifest["programs"]
    report = fabric_ext.run(bundle, baseline=True)
    assert report.ttft_ms > 0 and report.baseline.ttft_ms > 0
    w_in = report.movement("w_in")
    assert w_in.bytes == w_in["bytes"] > 0 and w_in.name == "w_in"
    with pytest.raises(KeyError, match="no movement 'w_on' in this report: it has .*w_in"):
        report.movement("w_on")
    with pytest.raises(KeyError, match="no link 'gpu0->gpu9'"):
        report.link("gpu0->gpu9")
    assert report.to_dict()["policy_speedup"] == round(report.baseline.ttft_ms / report.ttft_ms, 4)
    assert json.loads(report.to_json())["ttft_ms"] == report.ttft_ms
    out = bundle.write(tmp_path / "out")
    assert load_manifest(out) == bundle.manifest          # what fabricc compile writes, checked
    again = fabric_ext.run(fabric_ext.Bundle.read_folder(out))
    assert again.ttft_ms == report.ttft_ms


@pytest.mark.parametrize("options,says", [
    ({"jit_checks": "some"}, "JIT checks must be one of unproven, all, not 'some'"),   # not a fall back to interp
    ({"backend": "interp", "jit_checks": "all"}, "the interp backend checks every access anyway"),
    ({"max_events": -1}, "max_events must be 0 (no limit) or more, not -1"),
])
def test_run_options_that_would_be_ignored_or_mean_nothing_are_refused(options, says):
    from fabric_ext.runtime.machine.errors import UsageError
    with pytest.raises(UsageError, match=re.escape(says)):
        fabric_ext.run(fabric_ext.compile(TEXT), **options)


def test_a_traced_run_has_a_lower_event_limit_unless_it_names_one(monkeypatch):
    """A trace keeps about 2 KB per event: where a run records one and names no limit, it stops
    at `sim.TRACE_MAX_EVENTS` (lowered here), not at the untraced default."""
    from fabric_ext.runtime.simulation import sim
    monkeypatch.setattr(sim, "TRACE_MAX_EVENTS", 500)
    bundle = fabric_ext.compile(TEXT)
    with pytest.raises(sim.EventLimit, match="passed 500 events"):
        fabric_ext.run(bundle, trace=True)
    assert fabric_ext.run(bundle).to_dict()["events"] > 500
    assert fabric_ext.run(bundle, trace=True, max_events=0).trace()["traceEvents"]


def test_a_policy_that_does_not_compile_raises_with_every_diagnostic():
    with pytest.raises(fabric_ext.PolicyError) as e:
        fabric_ext.compile(TEXT.replace("priority = 7", "priorty = 7"))
    assert "priorty" in str(e.value) and e.value.diagnostics.errors
    with pytest.raises(fabric_ext.PolicyError, match="never runs|matches no transfer|no handler uses"):
        fabric_ext.compile(TEXT.replace("weights: pool0", "weights: hbm"), werror=True)


def test_the_report_is_built_from_the_runs_record_alone():
    """`stats.collect` reads a `RunRecord`, not an engine: from a record of one 1 MB transfer
    over a 1 ms window and one link busy for the first half of a 2 ms run, the report gives the
    movement's bandwidth, the link's utilisation and its timeline."""
    from types import SimpleNamespace as NS

    from fabric_ext.runtime.simulation import stats
    from fabric_ext.runtime.simulation.servers import Intervals
    from fabric_ext.runtime.simulation.workload import Workload, load_model
    transfer = NS(name="kv", cls="kv", operator="", bytes=10**6, start=0.0, end=1e6, queue_waits=[5e3, 15e3])
    link = NS(name="sw0->cxl0", bytes=10**6, bw=64e9, intervals=Intervals([(0.0, 1e6, 10**6)]))
    record = stats.RunRecord(
        policy="p", backend="interp", backend_load={}, workload=Workload(load_model("llama3-8b"), prompt=512),
        stack="none", gpu="h100_sxm", finished_ns=2e6, kv_done_ns=2e6, operator_ms={"attn": 1.5},
        beyond_profile_ms=0.0, events=7, layer_stats={}, stall_by_movement={"kv": 2.5e5}, transfers=[transfer],
        servers=[link], islands=[], faults=[], maps={}, copy_engines=[], refused={})
    report = stats.collect(record)
    mv, ln = report["movements"][0], report["links"][0]
    assert report["ttft_ms"] == 2.0 and report["compute_ms"] == 1.5 and report["events"] == 7
    assert mv["avg_gbps"] == 1.0 and mv["stall_ms"] == 0.25 and mv["queue_p50_us"] == 10.0
    assert ln["util_avg"] == 0.5 and ln["util_peak"] == 1.0
    assert ln["timeline"][:50] == [1.0] * 50 and ln["timeline"][50:] == [0.0] * 50


def test_a_run_reports_its_progress_and_the_command_line_shows_it():
    """`progress` gets the fraction of blocks begun, the events and the simulated time so far,
    each growing; fabric-run renders them with an ETA (on a terminal, after a second)."""
    from fabric_ext.runtime.simulation.cli import progress_line
    from fabric_ext.runtime.simulation.engine import Progress
    seen = []
    report = fabric_ext.run(fabric_ext.compile(POLICIES / "prefill_qos.fx"), prompt=512, progress=seen.append)
    assert len(seen) > 10 and all(isinstance(p, Progress) for p in seen)
    assert [p.fraction for p in seen] == sorted(p.fraction for p in seen) and seen[-1].fraction > 0.95
    assert seen[-1].events <= report.data["events"] and seen[-1].simulated_ms <= report.ttft_ms
    assert all(a.events <= b.events and a.simulated_ms <= b.simulated_ms for a, b in zip(seen, seen[1:]))
    line = progress_line(Progress(0.25, 1_234_567, 812.34), elapsed_s=2.0)
    assert line.startswith("[######") and " 25%" in line and "1,234,567 events" in line
    assert "812.3 ms simulated" in line and line.endswith("ETA 6 s")


def test_the_summary_lists_the_links_asked_for_with_the_baselines_beside():
    from fabric_ext.runtime.simulation import stats
    report = fabric_ext.run(fabric_ext.compile(POLICIES / "prefill_qos.fx"), prompt=256, baseline=True)
    data = report.to_dict()

    def listed(text):
        table = text.split("\nlink ")[1].split("\n\n")[0].splitlines()[2:]
        return [row.split("  ")[0].strip() for row in table if not row.startswith("...")]
    used = [x["name"] for x in sorted(data["links"], key=lambda x: (-x["util_avg"], x["name"])) if x["bytes"]]
    two = stats.render(data, data["baseline"], links=2)
    assert listed(two) == used[:2] and f"and {len(used) - 2} more links" in two and "baseline util avg" in two
    everything = stats.render(data, links=None)
    assert sorted(listed(everything)) == sorted(x["name"] for x in data["links"]) and "more link" not in everything


def test_maps_at_the_end_of_a_run_are_shown_with_their_declared_types():
    """A device-keyed map by device name, a size-valued one with its unit, in the summary and
    the JSON (map_entries), from the same contents as the raw maps."""
    from fabric_ext.runtime.simulation import stats
    report = fabric_ext.run(fabric_ext.compile(POLICIES / "prefill_qos.fx"), prompt=512)
    data = report.to_dict()
    entries = data["map_entries"]["kv_bytes"]
    assert {e["key_text"] for e in entries} == {f"gpu{i}" for i in range(8)}
    raw = data["maps"]["kv_bytes"]
    assert all(raw[str(e["key"])] == e["value"] and e["text"].endswith("B") for e in entries)
    text = stats.render(data)
    assert "map kv_bytes:" in text and f"gpu3  {entries[3]['text']}" in text


def test_the_summary_gives_each_decisions_share_of_events_and_kv_timing_only_when_kv_moves():
    from fabric_ext.runtime.simulation import stats
    data = fabric_ext.run(fabric_ext.compile(POLICIES / "prefill_qos.fx"), prompt=512).to_dict()
    sw0 = next(i for i in data["islands"] if i["name"] == "sw0")
    prio = sw0["decisions"]["forward.priority"]
    top = max(prio, key=prio.get)
    text = stats.render(data)
    assert f"forward.priority={top} {prio[top] / sw0['per_hook']['forward']:.0%}" in text
    assert "KV all written by" in text
    plain = fabric_ext.run(fabric_ext.compile(POLICIES / "fabrics" / "dgx_h100.fx"), prompt=128).to_dict()
    assert "KV all written by" not in stats.render(plain)


def test_progress_is_shown_only_on_a_terminal_and_not_with_quiet(monkeypatch):
    import io

    from fabric_ext.runtime.simulation import cli
    from fabric_ext.runtime.simulation.engine import Progress
    err = io.StringIO()                                     # not a terminal
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    for quiet in (True, False):
        show = cli._Progress(quiet=quiet, limit=None)
        show(Progress(0.5, 1000, 1.0))
        show.finish()
    assert err.getvalue() == ""
    monkeypatch.setattr(err, "isatty", lambda: True, raising=False)
    show = cli._Progress(quiet=False, limit=None)
    show(Progress(0.5, 1000, 1.0))
    show.finish()
    assert err.getvalue().startswith("\r[############") and err.getvalue().endswith("\r\033[K")


def test_a_run_on_course_to_pass_its_event_limit_says_so_early(capsys):
    """Where the events so far project past --max-events, fabric-run warns once, at 5 % of the
    prefill's blocks, long before the run stops at the limit; -q or not, terminal or not."""
    from fabric_ext.runtime.simulation import cli
    argv = ["--policy", str(POLICIES / "prefill_qos.fx"), "--prompt", "2048", "--chunk", "256", "-q"]
    total = fabric_ext.run(fabric_ext.compile(POLICIES / "prefill_qos.fx"), prompt=2048, chunk=256).data["events"]
    limit = total // 2
    assert cli.main(argv + ["--max-events", str(limit)]) == 1
    err = capsys.readouterr().err.splitlines()
    warning = re.fullmatch(r"fabric-run: warning: ([\d,]+) events at (\d+)% of the prefill's blocks: on course "
                           r"for about ([\d,]+), past the limit of ([\d,]+) events, .*", err[0])
    assert warning and "passed" in err[1], err
    at, pct, projected, said = (int(g.replace(",", "")) for g in warning.groups())
    assert at < limit // 5 and pct < 20 and said == limit and total / 2 < projected < total * 2
    assert cli.main(argv + ["--max-events", str(total * 2)]) == 0     # on course to fit: nothing said
    assert "warning" not in capsys.readouterr().err


def test_a_comparison_says_when_the_policies_workloads_differ():
    from fabric_ext.runtime.simulation import stats
    run = fabric_ext.run(fabric_ext.compile(POLICIES / "kv_tiering.fx"), prompt=128).to_dict()
    other = dict(run, policy="other.fx", workload=dict(run["workload"], prompt=256))
    text = stats.render_comparison([run, other])
    assert "workloads differ" in text
    assert "kv_tiering: prefill of llama3-8b: 128 tokens" in text and "other: prefill of llama3-8b: 256 tokens" in text
    same = stats.render_comparison([run, dict(run, policy="same.fx")])
    assert "workloads differ" not in same and same.startswith("prefill of llama3-8b: 128 tokens x 1, TP 4")
    chunked = fabric_ext.run(fabric_ext.compile(POLICIES / "kv_tiering.fx"), prompt=4096).to_dict()
    assert stats.render(chunked).startswith("prefill of llama3-8b: 4096 tokens x 1 in passes of 2048, TP 4")


def test_a_comparisons_columns_tell_apart_policies_that_share_a_name():
    """Two files of one name are named by their paths; one policy given twice by its place."""
    from fabric_ext.runtime.simulation import stats
    run = fabric_ext.run(fabric_ext.compile(POLICIES / "kv_tiering.fx"), prompt=128).to_dict()

    def rows(runs):         # the first column of the TTFT table
        return [re.split(r"\s{2,}", line)[0] for line in stats.render_comparison(runs).splitlines()[4:4 + len(runs)]]
    assert rows([dict(run, policy="a/p.fx"), dict(run, policy="b/p.fx"), dict(run, policy="q.fx")]) == \
        ["a/p.fx", "b/p.fx", "q"]
    assert rows([dict(run, policy="p.fx"), dict(run, policy="p.fx")]) == ["p #1", "p #2"]
