"""The hooks a telemetry policy diagnoses with (issue 18): what is queued ahead of a chunk by
priority (ev.queued_ahead_hi / _lo), a chunk leaving a queue (`dequeue`, with its wait), and
`complete` at every kind of destination.  Each runs a policy that records what it sees in a
map and checks the map against the run."""
import json

from test_decision_effects import FABRIC, MODEL

from test_runtime import compile_text, run_engine

MAPS = """
map hi : array<u32, size>[1]
map lo : array<u32, size>[1]
map waited : array<u32, time>[1]
map seen : array<u32, count>[1]
map sent : array<u32, size>[1]
map got : hash<device, size>[4]
"""


def _run(tmp_path, workload, movements, body, tag="p"):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(MODEL))
    text = (f"{FABRIC}\nworkload w {{ model: \"{model}\"; prompt: 2048; tp: 2; {workload} }}\n{movements}\n{MAPS}\n"
            f"policy p {{\n{body}\n}}\n")
    report, eng = run_engine(compile_text(tmp_path, text, tag), model=str(model), prompt=2048, tp=2)
    return report, {name: m.dump() for name, m in eng.maps.items()}, eng


POOL = ("weights: pool0; kv: pool0",
        "movement w = weights : pool0 -> gpu* { chunk: 64KiB }\nmovement kv = kv : gpu* -> pool0")
WATCH_KV = "  on kv.forward at sw0 { hi[0] max= ev.queued_ahead_hi; lo[0] max= ev.queued_ahead_lo }"


def test_queued_ahead_splits_the_queue_by_the_chunks_priority(tmp_path):
    # weights above KV at the pool: what KV meets there is ahead of it
    _, above, _ = _run(tmp_path, *POOL, WATCH_KV + "\n  on w.forward at sw0 { priority = 7 }", "above")
    assert above["hi"].get(0, 0) > 0
    # weights in KV's class: all of it is in its class or below
    _, same, _ = _run(tmp_path, *POOL, WATCH_KV, "same")
    assert same["hi"].get(0, 0) == 0 and same["lo"].get(0, 0) > 0


def test_dequeue_fires_once_per_chunk_leaving_the_queue_with_its_wait(tmp_path):
    report, maps, eng = _run(tmp_path, *POOL, "  on kv.dequeue at sw0 { waited[0] += ev.wait; seen[0] += 1 }")
    kv = [t for t in eng.fabric.transfers if t.name == "kv"]
    assert maps["seen"][0] == sum(t.chunks_total for t in kv)     # each leaves the switch for the pool once
    assert 0 < maps["waited"][0] <= sum(sum(t.queue_waits) for t in kv)
    # the same policy on no queue of the GPUs: no program there, nothing asked
    assert all(srv.on_dequeue is None for (u, _), srv in eng.fabric.servers.items() if u.startswith("gpu"))


def test_complete_fires_where_kv_is_written_and_where_it_leaves(tmp_path):
    report, maps, _ = _run(tmp_path, "weights: hbm; kv: pool0; kv_export: nic0",
                           "movement kv = kv : gpu* -> pool0\nmovement e = kv : gpu* -> nic0",
                           "  on kv.complete at sw0 { got[ev.src] += ev.bytes }\n"
                           "  on e.complete at nic0 { sent[0] += ev.bytes }")
    by_name = {m["name"]: m["bytes"] for m in report["movements"]}
    assert sum(maps["got"].values()) == by_name["kv"] and len(maps["got"]) == 2      # per GPU
    assert maps["sent"][0] == by_name["e"]


def test_complete_fires_in_host_memory(tmp_path):
    report, maps, _ = _run(tmp_path, "weights: hbm; kv: cpu0", "movement kv = kv : gpu* -> cpu0",
                           "  on kv.complete at cpu0 { sent[0] += ev.bytes }")
    assert maps["sent"][0] == next(m["bytes"] for m in report["movements"] if m["name"] == "kv") > 0


def test_dequeue_fires_at_a_gpus_link_and_a_nics_wire(tmp_path):
    report, maps, eng = _run(tmp_path, "weights: hbm; kv: hbm; kv_export: nic0", "movement e = kv : gpu* -> nic0",
                             "  on e.dequeue at gpu* { seen[0] += 1 }\n  on e.dequeue at nic0 { sent[0] += ev.bytes }")
    export = [t for t in eng.fabric.transfers if t.name == "e"]
    assert maps["seen"][0] == sum(t.chunks_total for t in export)      # each leaves its GPU once
    assert maps["sent"][0] == sum(t.bytes for t in export)             # ... and the NIC, onto the wire
