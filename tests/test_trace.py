"""The Perfetto trace (`fabric-run --trace`): valid Trace Event Format, one process per
device, chunks with their movement and priority, hook events with the decisions made and the
handlers' lines, counter tracks per link, stalls with their chains, and the baseline beside."""
import pytest

from conftest import POLICIES
from fabric_ext import api
from policy_helpers import compiled
from trace_format import check_trace


@pytest.fixture(scope="module")
def traced():
    report = api.run(compiled("prefill_qos"), prompt=512, tp=2, baseline=True, trace=True, backend="interp")
    return report, report.trace()


def _events(trace, ph, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == ph and (cat is None or e.get("cat") == cat)]


def test_it_is_valid_trace_event_format(traced):
    check_trace(traced[1])


def test_one_process_per_device_and_the_baseline_beside(traced):
    report, trace = traced
    names = {e["pid"]: e["args"]["name"] for e in _events(trace, "M") if e["name"] == "process_name"}
    assert {"gpu0", "gpu1", "sw0", "pool0", "nic0", "tensor-parallel group"} <= set(names.values())
    assert {"baseline: gpu0", "baseline: pool0"} <= set(names.values())
    assert all(pid > 1000 for pid, name in names.items() if name.startswith("baseline: "))
    assert trace["otherData"] == {"ttft_ms": report.ttft_ms, "baseline_ttft_ms": report.baseline.ttft_ms}


def test_a_links_slices_are_its_chunks_with_movement_and_priority(traced):
    report, trace = traced
    chunks = [e for e in _events(trace, "X", "transfer") if e["pid"] < 1000]
    by_movement = {}
    for e in chunks:
        by_movement.setdefault(e["args"]["movement"], set()).add(e["args"]["priority"])
    # the policy ranks the weights first at the switch and KV writeback last
    assert 7 in by_movement["ffn_weights"] and 1 in by_movement["kv_writeback"]
    assert sum(e["args"]["bytes"] for e in chunks) == sum(x["bytes"] for x in report.data["links"])
    assert all({"layer", "chunk"} <= set(e["args"]) for e in chunks)


def test_hook_events_carry_the_decisions_and_the_handlers_lines(traced):
    forwards = [e for e in _events(traced[1], "i", "hook") if e["name"] == "forward" and e["pid"] < 1000]
    ranked = [e for e in forwards if e["args"]["decisions"].get("priority") == 7]
    assert ranked and all(e["args"]["movement"] in ("attn_weights", "ffn_weights") for e in ranked)
    source = (POLICIES / "prefill_qos.fx").read_text().splitlines()
    lines = {line for e in ranked for line in e["args"]["lines"]}
    assert lines and all("priority = 7" in source[line - 1] for line in lines)


def test_counters_for_each_links_utilisation_and_queue(traced):
    counters = {e["name"] for e in _events(traced[1], "C") if e["pid"] < 1000}
    assert "memory channel utilisation %" in counters and "memory channel queued bytes" in counters
    util = [e["args"]["util"] for e in _events(traced[1], "C") if e["name"] == "memory channel utilisation %"
            and e["pid"] < 1000]
    assert max(util) == 100 and min(util) >= 0


def test_stalls_carry_their_chain(traced):
    stalls = [e for e in _events(traced[1], "X", "stall") if e["pid"] < 1000]
    assert stalls and all(e["args"] for e in stalls)
    assert all(e["name"].startswith("stall: ") for e in stalls)


def test_the_queue_counters_count_only_chunks_that_waited(traced):
    report, trace = traced
    peaks = {}
    for e in _events(trace, "C"):
        if e["pid"] < 1000 and e["name"].endswith("queued bytes"):
            peaks[e["name"]] = max(peaks.get(e["name"], 0), e["args"]["bytes"])
    waited = {srv.name for srv in report._record.servers if any(start > occ[3] for (start, _, _), occ in
                                                                 zip(srv.intervals, srv.occupants or []))}
    assert peaks["memory channel queued bytes"] >= 2 << 20          # weights queue at the pool's memory
    assert "pool0 memory" in waited and len(peaks) <= len(waited)   # a link nothing waited at has no counter
