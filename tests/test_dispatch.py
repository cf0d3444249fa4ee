"""What the runtime knows before running a program (the manifest's handler list): events no
handler acts on are skipped, decisions of map-free handlers are remembered.  Both must be
invisible: the program really does nothing for the skipped events, and a run that remembers
nothing gives the same report."""
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_ext.contract.bundle import Folder, create_maps, load_bundle, load_manifest
from fabric_ext.contract.context import ContextCodec
from fabric_ext.contract.hooks import HOOKS
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.simulation import dispatch
from fabric_ext.runtime.simulation.hook_site import ShimHookSite
from policy_helpers import compiled
from test_runtime import compile_text, run_engine

POLICIES = ["prefill_qos", "kv_tiering", "nic_pacing", "telemetry"]


def _unhandled_cases():
    for name in POLICIES:
        man = load_manifest(compiled(name))
        for entry in man["programs"]:
            named = {h["movement"] for h in entry["handlers"]}
            if None not in named and "movement" in {f["name"] for f in man["hooks"][_hook_key(man, entry)]["fields"]}:
                yield name, entry["island"], entry["hook"], named


def _hook_key(man, entry):
    kind = next(i["kind"] for i in man["fabric"]["islands"] if i["name"] == entry["island"])
    return next(k for k in man["hooks"] if k == f"{kind}.{entry['hook']}")


CASES = list(_unhandled_cases())


@pytest.mark.parametrize("name,island,hook,named", CASES, ids=[f"{c[0]}-{c[1]}.{c[2]}" for c in CASES])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_program_does_nothing_for_a_movement_no_handler_names(name, island, hook, named, data):
    bundle = load_bundle(compiled(name))
    prog = bundle.islands[island][hook]
    codec = ContextCodec(prog.hook)
    movement = data.draw(st.integers(0, 40).filter(lambda m: m not in named))
    fields = {f: data.draw(st.integers(0, 2**32 - 1)) for f, (_, fl) in prog.hook.layout.items() if not fl.decision}
    fields["movement"] = movement
    ctx = codec.pack(fields)
    before = bytes(ctx), [m.dump() for m in prog.maps]
    Interpreter().run(prog, ctx)
    assert (bytes(ctx), [m.dump() for m in prog.maps]) == before


def _timeless(report):
    return {**report, "backend_load": None, "islands": [{k: v for k, v in i.items() if k not in ("ns_per_invocation", "invocations")}
                                  for i in report["islands"]]}


@pytest.mark.parametrize("name", ["prefill_qos", "nic_pacing", "kv_tiering"])
def test_remembering_decisions_changes_nothing_but_the_runs(name, monkeypatch):
    from fabric_ext.runtime.machine.jit import JitBackend
    remembered, _ = run_engine(compiled(name), backend=JitBackend())
    monkeypatch.setattr(dispatch, "MEMO_LIMIT", 0)
    ran, _ = run_engine(compiled(name), backend=JitBackend())
    assert _timeless(remembered) == _timeless(ran)
    runs = {i["name"]: i["invocations"] for i in ran["islands"]}
    fewer = {i["name"]: i["invocations"] for i in remembered["islands"]}
    assert sum(fewer.values()) < sum(runs.values())


@pytest.mark.parametrize("name", POLICIES)
def test_islands_with_no_enter_or_complete_program_are_not_asked_and_nothing_changes(name, monkeypatch):
    """The hook site asks the enter and complete hooks only at islands with a program on one
    (`ShimHookSite._watching`): the islands it watches are exactly those, and a run that asks
    every island gives the same report but for its events (it has an event at every arrival:
    `Fabric._lands_quietly`)."""
    report, eng = run_engine(compiled(name))
    man = load_manifest(compiled(name))
    kinds = {i["name"]: i["kind"] for i in man["fabric"]["islands"]}
    for moment in ("enter", "deliver"):
        hooks = {(k, h) for (k, h), hk in HOOKS.items() if hk.moment == moment}
        assert eng.site._watching(moment) == {p["island"] for p in man["programs"] if (kinds[p["island"]], p["hook"]) in hooks}
    assert eng.site._watching("enter")          # each bundled policy acts on entering some island
    monkeypatch.setattr(ShimHookSite, "_watching", lambda self, moment: self.shims)
    everywhere, _ = run_engine(compiled(name))
    assert {**_timeless(report), "events": 0} == {**_timeless(everywhere), "events": 0}
    assert report["events"] < everywhere["events"]


def test_issue_decisions_stand_for_the_transfer_and_still_act(monkeypatch):
    """prefill_qos's GPU issue handlers for weights decide from the movement alone: each GPU's
    shim is asked once per movement, every later chunk of that transfer and of the movement's
    later transfers there takes the standing decisions, and those still act: every chunk
    counts as delivered to the hook, and prefetch 2 holds (weights two layers ahead).  KV
    write-back's handler only watches, reading the chunk's bytes: each chunk's context is kept
    for its batch."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.shims import Shim
    asked = Counter()
    decide, keep = Shim.decide, Shim.keep
    monkeypatch.setattr(Shim, "decide", lambda self, hook, fields, now=0.0:
                        asked.update([(hook, fields["movement"])]) or decide(self, hook, fields, now))

    def kept(self, hook, ctx, now):
        asked[hook, int(np.frombuffer(bytes(ctx), dtype=self.codecs[hook].dtype())["movement"][0])] += 1
        keep(self, hook, ctx, now)
    monkeypatch.setattr(Shim, "keep", kept)
    report, eng = run_engine(compiled("prefill_qos"), backend=JitBackend())
    ids = load_manifest(compiled("prefill_qos"))["ids"]["movements"]
    by_name = Counter()
    for t in eng.fabric.transfers:
        by_name[t.name, "transfers"] += 1
        by_name[t.name, "chunks"] += t.chunks_total
    for weights in ("attn_weights", "ffn_weights"):
        gpus = {t.dst for t in eng.fabric.transfers if t.name == weights}
        assert asked["issue", ids[weights]] == len(gpus) < by_name[weights, "transfers"]
    assert asked["issue", ids["kv_writeback"]] == by_name["kv_writeback", "chunks"]
    issued = sum(i["per_hook"].get("issue", 0) for i in report["islands"] if i["name"].startswith("gpu"))
    assert issued == sum(by_name[m, "chunks"] for m in ("attn_weights", "ffn_weights", "kv_writeback"))
    assert all(eng.site.prefetch[g] == 2 for g in eng.gpus)


def test_a_standing_prefetch_decision_speaks_for_every_chunk(tmp_path, monkeypatch):
    """An issue decision that stands for a transfer applies its prefetch again for each later
    chunk, as the program would: the GPU's depth (and the decision named as its source) follows
    the latest chunk issued, attention's or FFN's.  A run that asks the program for every chunk
    gives the same report and the same last word."""
    from fabric_ext.runtime.simulation.decisions import DecisionCache
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement attn = weights(attention) : pool0 -> gpu*
movement ffn = weights(ffn) : pool0 -> gpu*
policy p { on attn.issue at gpu* { prefetch = 1 } on ffn.issue at gpu* { prefetch = 3 } }""")
    standing, eng = run_engine(out)
    last = (dict(eng.site.prefetch), dict(eng.site.prefetch_by))
    assert eng.site.remembered.standing
    monkeypatch.setattr(DecisionCache, "stand", lambda self, *args, **kw: None)
    asked, eng = run_engine(out)
    assert not eng.site.remembered.standing
    assert {**_timeless(standing), "islands": 0} == {**_timeless(asked), "islands": 0}
    assert (dict(eng.site.prefetch), dict(eng.site.prefetch_by)) == last


def test_a_prefetch_word_comes_after_the_words_trains_took_before_it():
    """Trains tell the hook site what they took when it asks (`Trains.tell`, `HookSite.untold`):
    a prefetch decision the site applies comes after the words of the chunks trains issued
    before it, and reading the depth sees those."""
    _, eng = run_engine(compiled("prefill_qos"))
    site, gpu = eng.site, eng.gpus[0]
    untold = [(3, "issue", 7)]          # a word a train took and has not told

    def tell():
        while untold:
            site.set_prefetch(gpu, *untold.pop())
    site.untold = tell
    site.set_prefetch(gpu, 1, "issue", 5)
    assert site.prefetch_of(gpu) == (1, ("issue", 5))
    untold.append((4, "complete", 8))
    assert site.prefetch_of(gpu) == (4, ("complete", 8))


def test_the_report_counts_what_trains_took_and_had_not_told(monkeypatch):
    """What trains took of what stands and had not told the hook site yet (`Trains.tell`) is
    counted in the report all the same: settling asks them first."""
    from fabric_ext.runtime.simulation.trains import Trains
    flows, fits = [], Trains._fits
    monkeypatch.setattr(Trains, "_fits", lambda self, t: flows.append(fits(self, t)) or flows[-1])
    _, eng = run_engine(compiled("prefill_qos"))
    flow = next(f for f in flows if f is not None and f.ends)
    island = flow.ends[0][0]

    def issued(report):
        return next(i for i in report["islands"] if i["name"] == island)["per_hook"]["issue"]
    before = issued(eng.report())
    flow.issued = 5                     # five more chunks a train issued, not told yet
    eng.fabric.trains._told[flow] = None
    assert issued(eng.report()) == before + 5


def test_remembered_decisions_follow_the_fields_the_handler_reads(tmp_path):
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0; chunk: 3MiB }
movement w_in = weights : pool0 -> gpu*
policy p { on w_in.forward at sw0 { if ev.bytes >= 3MiB { priority = 7 } else { priority = 5 } } }""")
    report, eng = run_engine(out)
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    prio = sw0["decisions"]["forward.priority"]
    assert set(prio) == {"5", "7"}        # the last chunk of each transfer is shorter
    assert sum(prio.values()) == sw0["per_hook"]["forward"]
    assert sw0["invocations"] < sw0["per_hook"]["forward"]


def test_decisions_standing_for_a_transfer_are_dropped_when_their_program_is_detached():
    """The hook site applies a transfer's standing decisions without asking the shims; once the island's program
    is detached (after a fault) they no longer hold, and its later chunks ask again."""
    from fabric_ext.runtime.machine.jit import JitBackend
    report, eng = run_engine(compiled("prefill_qos"), backend=JitBackend())
    standing = [s for (t, island, _), s in eng.site.remembered.standing.items() if island == "sw0" and s.decisions]
    assert standing and all(s.decisions.get("priority") for s in standing)
    eng.shims["sw0"].detach("forward")
    assert not any(island == "sw0" for _, island, _ in eng.site.remembered.standing)


def test_a_train_stops_at_the_event_limit_where_the_loop_does():
    """A step a train takes counts as an event (`Sim.take`): a run passes its limit at the same
    event, at the same time, with trains and without."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.sim import EventLimit
    said = []
    for trains in (True, False):
        with pytest.raises(EventLimit) as e:
            run_engine(compiled("prefill_qos"), backend=JitBackend(), trains=trains, max_events=2_000)
        said.append(str(e.value))
    assert said[0] == said[1] and "passed 2,000 events" in said[0]


def _detached_mid_run(trains):
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.engine import Engine, RunOptions
    from test_runtime import SMALL
    folder = compiled("prefill_qos")
    man = load_manifest(folder)
    eng = Engine(folder, man, create_maps(man), JitBackend(), RunOptions(**SMALL, trains=trains))
    eng.sim.at(1.5e6, eng.shims["sw0"].detach, "forward")
    eng.sim.at(2.5e6, eng.shims["gpu0"].detach, "issue")
    return eng.run(), eng


def test_a_program_detached_mid_run_leaves_trains_what_the_loop_does():
    """What stands for the weights' chunks, which trains take, is dropped when the program
    that decided it is detached (`HookSite.stands_for`): the run is the same with trains and
    without, where the switch's and a GPU's programs are detached while weights stream."""
    stepped, eng = _detached_mid_run(True)
    looped, _ = _detached_mid_run(False)
    assert _timeless(stepped) == _timeless(looped)
    assert eng.fabric.trains.steps and stepped["ttft_ms"] > 2.5


def test_decisions_shared_by_transfers_change_nothing_but_the_asking(monkeypatch):
    """A static plan's standing decisions serve the later transfers whose fields the handlers
    read are the same (`HookPlan.shared`): the run is the one where every transfer's first
    chunk asks the programs, also where programs are detached mid-run (what they decided is
    shared no more)."""
    shared, eng = _detached_mid_run(True)
    assert any(plan.shared for plan in eng.site.remembered.plans.values())
    monkeypatch.setattr(ShimHookSite, "_shared", staticmethod(lambda plan, t, chunk: None))
    asked, _ = _detached_mid_run(True)
    assert _timeless(shared) == _timeless(asked)


def test_decisions_shared_by_transfers_follow_the_fields_the_handler_reads(tmp_path):
    """Decisions from a transfer's own field (its layer) are shared only by transfers of the
    same layer: each layer's chunks get their own priority."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
policy p { on w_in.forward at sw0 { priority = ev.layer % 4 } }""")
    report, eng = run_engine(out)
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    assert set(sw0["decisions"]["forward.priority"]) == {"0", "1", "2"}    # (3, the default, is no decision)
    transfers = [t for t in eng.fabric.transfers if t.name == "w_in"]
    assert sw0["invocations"] == len({t.layer for t in transfers}) < len(transfers)


def test_decisions_shared_by_transfers_are_kept_for_a_bounded_number_of_keys(tmp_path, monkeypatch):
    """What a plan shares is kept for at most MEMO_LIMIT keys (a key per value of the fields
    read, and per path at a hop): past it, later keys ask as before, and the run is the same."""
    from fabric_ext.runtime.simulation import decisions
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
policy p { on w_in.forward at sw0 { priority = ev.layer % 4 } }""")
    unbounded, eng = run_engine(out)
    layers = len({t.layer for t in eng.fabric.transfers if t.name == "w_in"})
    assert max(len(plan.shared) for plan in eng.site.remembered.plans.values()) == layers > 2
    monkeypatch.setattr(decisions, "MEMO_LIMIT", 2)
    bounded, eng = run_engine(out)
    assert max(len(plan.shared) for plan in eng.site.remembered.plans.values()) == 2
    assert _timeless(bounded) == _timeless(unbounded)


def test_decisions_remembered_per_map_entry_follow_the_entry(tmp_path):
    """A handler that reads an array entry at a context field's key: its decisions are
    remembered per field value and entry value, so a changed entry runs the program again;
    without the maps in this process (the kernel's) nothing is remembered."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.dispatch import acting
    from fabric_ext.runtime.simulation.shims import DputimeShim
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
movement kv = kv : gpu* -> pool0
map util : array<u32, percent>[4]
policy p { on kv.forward at sw0 { if util[ev.out_port] > 80% { rate = 16GB/s } } }""")
    man = load_manifest(out)
    maps = create_maps(man)
    shim = DputimeShim("sw0", "cxl_switch", JitBackend())
    shim.load(Folder(out), man, maps)
    kv = man["ids"]["movements"]["kv"]
    decide = lambda port: (shim.decide("forward", {"movement": kv, "out_port": port}).decisions,
                           shim.invocations["forward"])
    assert decide(1) == ({}, 1) and decide(1) == ({}, 1)          # remembered
    maps["util"][1] = 90
    assert decide(1) == ({"rate": 16 * 10**9}, 2) and decide(1)[1] == 2
    assert decide(2) == ({}, 3) and decide(9) == ({}, 4)          # another entry; out of range
    maps["util"][1] = 0
    assert decide(1) == ({}, 4)                                    # this value was seen before
    maps["util"][1] = 10
    assert decide(1) == ({}, 5)
    handlers = shim.handlers["forward"]
    assert acting("forward", shim.programs["forward"], handlers, kv, host_maps=False).key_fields is None


def test_the_context_tracer_sees_what_the_programs_are_given():
    """`RunOptions.context_tracer` (what bench/vm_bench.py records streams with): every event
    that reaches a shim's program, recalled decisions included, as its packed context."""
    from fabric_ext.runtime.simulation.engine import Engine, RunOptions
    folder = compiled("prefill_qos")
    man = load_manifest(folder)
    seen = {}

    def tracer(island, hook, ctx):
        seen.setdefault((island, hook), []).append(ctx)
    eng = Engine(folder, man, create_maps(man), Interpreter(), RunOptions(prompt=512, tp=2, context_tracer=tracer))
    report = eng.run()
    per_hook = {i["name"]: i["per_hook"] for i in report["islands"]}
    invocations = {i["name"]: i["invocations"] for i in report["islands"]}
    forward = seen[("sw0", "forward")]
    assert invocations["sw0"] <= sum(len(v) for (isl, _), v in seen.items() if isl == "sw0") \
        <= sum(per_hook["sw0"].values())
    size = eng.shims["sw0"].codecs["forward"].size
    assert all(len(c) == size for c in forward) and len(set(forward)) > 1
    # decisions one transfer's chunks share with the next's (`HookPlan.shared`) are not taken
    # where a tracer records: each transfer's first chunk at the switch reaches its program
    assert len(forward) >= sum("sw0" in t.path for t in eng.fabric.transfers)
    # each context names its movement's class, operator, ends and criticality: the hook site
    # keeps a transfer's fields as a tuple (`Transfer.ctx`) and names them by position
    ids, movements = man["ids"], {m["id"]: m for m in man["movements"]}
    for ctx in forward:
        f = np.frombuffer(ctx, dtype=eng.shims["sw0"].codecs["forward"].dtype())[0]
        m = movements[int(f["movement"])]
        assert (int(f["class"]), int(f["operator"]), int(f["critical"])) == \
            (ids["classes"][m["class"]], ids["operators"].get(m["operator"] or "", 0), int(m["critical"]))
        assert (int(f["src"]), int(f["dst"])) in \
            {(ids["devices"][fl["src"]], ids["devices"][fl["dst"]]) for fl in m["flows"]}


@pytest.mark.parametrize("name", POLICIES)
def test_ends_of_transmission_without_events_change_nothing_but_the_events(name):
    """Every bundled policy gives the same report, hook deliveries and map contents included,
    with an event at every chunk's end of transmission and without (`servers.Server`)."""
    from fabric_ext.runtime.machine.jit import JitBackend
    fewer, _ = run_engine(compiled(name), backend=JitBackend())
    every, _ = run_engine(compiled(name), backend=JitBackend(), per_chunk_events=True)
    assert {**_timeless(fewer), "events": 0} == {**_timeless(every), "events": 0}
    assert fewer["events"] < every["events"]


@pytest.mark.parametrize("name", POLICIES)
def test_trains_change_nothing_but_the_time_a_run_takes(name):
    """Every bundled policy gives the same report, events and map contents included, with the
    pool's round robin stepped in trains (`trains`) and without: where the weights stream
    from the pool, most of their steps are taken in trains."""
    from fabric_ext.runtime.machine.jit import JitBackend
    stepped, eng = run_engine(compiled(name), backend=JitBackend())
    looped, _ = run_engine(compiled(name), backend=JitBackend(), trains=False)
    assert _timeless(stepped) == _timeless(looped)
    if name == "prefill_qos":
        assert eng.fabric.trains.steps > stepped["events"] / 3


KV_ONLY = """
import "fabrics/dgx_cxl.fx"
workload prefill {
  model: "llama3-8b"; prompt: 2048; batch: 1; tp: 8
  weights: pool0; kv: pool0; kv_export: nic0; chunk: 2MiB
}
movement kv_writeback = kv : gpu* -> pool0
policy p { on kv_writeback.forward at sw0 { priority = 1 } }
"""


def test_where_no_handler_acts_on_a_movement_nothing_stands_and_trains_step_it(tmp_path):
    """The switch's program acts on KV only: for the weights nothing is decided there, which
    holds for every chunk of theirs, so their chunks stream from the pool in trains as they
    do with no program at all; the report is the same as the loop's."""
    from fabric_ext.runtime.machine.jit import JitBackend
    folder = compile_text(tmp_path, KV_ONLY)
    small = dict(model="llama3-8b", prompt=2048, tp=8)
    stepped, eng = run_engine(folder, backend=JitBackend(), **small)
    looped, _ = run_engine(folder, backend=JitBackend(), trains=False, **small)
    assert _timeless(stepped) == _timeless(looped)
    assert eng.fabric.trains.steps > stepped["events"] / 3
    bare, bare_eng = run_engine(folder, backend=JitBackend(), attach=False, **small)
    assert eng.fabric.trains.steps > bare_eng.fabric.trains.steps / 2


ONE_OF_TWO = """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: hbm }
movement attn_weights = weights(attention) : pool0 -> gpu*
movement ffn_weights = weights(ffn) : pool0 -> gpu*
map landed : array<u32, count>[2]
policy p { on ffn_weights.complete at gpu0 { landed[0] += 1 } }
"""


def test_a_complete_handler_of_one_movement_sees_every_chunk_where_another_shares_its_ends(tmp_path):
    """The attention and FFN weights both go from the pool to each GPU.  A chunk whose
    arrival asks nothing lands without an event; that it asks nothing depends on its movement
    (only the FFN's chunks are shown to gpu0's program), not only on its ends, so every FFN
    chunk is still shown, as it is with an event at every arrival (found by
    tests/fuzz/shortcuts.py, seed 3: the attention weights' first quiet landing had made the
    FFN's quiet too)."""
    from fabric_ext.runtime.machine.jit import JitBackend
    folder = compile_text(tmp_path, ONE_OF_TWO)
    quiet, eng = run_engine(folder, backend=JitBackend())
    every, _ = run_engine(folder, backend=JitBackend(), per_chunk_events=True)
    ffn_chunks = sum(t.chunks_total for t in eng.fabric.transfers
                     if t.movement_id == eng.ids["movements"]["ffn_weights"] and t.path[-1] == "gpu0")
    assert int(quiet["maps"]["landed"]["0"]) == int(every["maps"]["landed"]["0"]) == ffn_chunks > 32


def test_random_policies_run_the_same_with_the_shortcuts_and_without(tmp_path):
    """tests/fuzz/shortcuts.py, seeded and bounded: random policies (decisions at every chunk
    hook, map updates, conditions on what varies per chunk and on what a tick writes) give the
    same report, maps included, with trains, standing and remembered decisions, batched
    watchers and lazy ticks as with none of them; and, where bpf(2) is permitted, with the
    programs in the kernel as in the JIT (but for a full LRU map's evictions)."""
    import random

    from fuzz.shortcuts import Policy, check

    from fabric_ext.runtime.machine import kernel
    seed = int(os.environ.get("FABRIC_EXT_FUZZ_SEED", "20261201")) % 100_000
    found = []
    for s in range(seed, seed + 4):
        rng = random.Random(s)
        path = tmp_path / f"p{s}.fx"
        path.write_text(Policy(rng, 3).text())
        workload = dict(model="llama3-8b", prompt=rng.choice([256, 512]), tp=rng.choice([2, 4, 8]))
        found += [f"seed {s} {workload}: {line}" for line in check(path, workload, kernel.permitted()[0]) or []]
    assert not found, "\n".join(found[:10])


WHOLE_TRANSFERS = """
import "fabrics/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 256; tp: {tp}; weights: pool0; kv: pool0 }}
movement wt = weights{which} : pool0 -> gpu*
policy p {{ on wt.issue at gpu* {{ coalesce = 1TiB }} }}
"""


@pytest.mark.parametrize("which", ["", "(ffn)", "(attention)"])
@pytest.mark.parametrize("tp", [2, 8])
def test_a_chunk_coalesced_from_a_whole_transfer_lands_as_its_parts_in_a_train(tmp_path, which, tp):
    """Coalescing at issue larger than a transfer holds all its chunks at once: none is left to
    issue, so what stands at issue no longer keeps the transfer out of trains, and a train once
    landed the merged chunk as one of its 84 (the prefill never finished). A train takes no
    coalesced chunk, and lands none (where one operator's weights coalesce, a merged chunk
    ends its transmission as a train of the other's begins): the run completes, as the loop's."""
    from fabric_ext.runtime.machine.jit import JitBackend
    folder = compile_text(tmp_path, WHOLE_TRANSFERS.format(which=which, tp=tp))
    stepped, eng = run_engine(folder, backend=JitBackend(), prompt=256, tp=tp)
    looped, _ = run_engine(folder, backend=JitBackend(), trains=False, prompt=256, tp=tp)
    assert _timeless(stepped) == _timeless(looped)
    assert all(t.chunks_done == t.chunks_total for t in eng.fabric.transfers)


def test_a_decision_read_from_a_map_entry_stands_at_its_hop_while_the_entry_holds(monkeypatch):
    """prefill_qos's KV write-back handler at the switch reads port_util[ev.out_port], which
    the switch's tick writes: its decision holds for a transfer's chunks at that hop while the
    entry is unchanged, and for the later transfers on the same path (`HookPlan.shared`), so
    the switch's program is asked once per path and change of the entry, not per transfer or
    chunk; a changed entry is asked about again, and its decision acts."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.servers import Chunk
    from fabric_ext.runtime.simulation.shims import Shim
    asked = Counter()
    decide = Shim.decide
    monkeypatch.setattr(Shim, "decide", lambda self, hook, fields, now=0.0:
                        asked.update([(self.island, hook, fields["movement"])]) or decide(self, hook, fields, now))
    report, eng = run_engine(compiled("prefill_qos"), backend=JitBackend(), prompt=8192, tp=8)
    kv = load_manifest(compiled("prefill_qos"))["ids"]["movements"]["kv_writeback"]
    transfers = [t for t in eng.fabric.transfers if t.movement_id == kv]
    chunks = sum(t.chunks_total for t in transfers)
    assert len({tuple(t.path) for t in transfers}) <= asked["sw0", "forward", kv] < len(transfers) < chunks
    t = next(t for t in transfers if ("sw0", "enter") in t.standing)
    out_port = eng.fabric.port_index("sw0", t.path[2])
    port_util = eng.shims["sw0"].maps["port_util"]
    eng.site.before_event = None                # the run is over: no ticks to catch up
    chunk = Chunk(t, 0, 2 << 20, t.path)
    chunk.hop = 1
    asked.clear()
    port_util[out_port] = 95                    # hot: paced
    assert eng.site.on_enter(chunk, "sw0") == {"priority": 1, "rate": 16_000_000_000}
    assert eng.site.on_enter(chunk, "sw0") == {"priority": 1, "rate": 16_000_000_000}
    port_util[out_port] = 10
    assert eng.site.on_enter(chunk, "sw0") == {"priority": 1}
    assert asked["sw0", "forward", kv] == 2     # once per value of the entry


HOT_PORT = """
import "fabrics/dgx_cxl.fx"
workload prefill {
  model: "llama3-8b"; prompt: 8192; batch: 1; tp: 8
  weights: hbm; kv: pool0; chunk: 256KiB
}
movement kv_writeback = kv : gpu* -> pool0
map port_util : array<u32, percent>[16]
policy p {
  on sw0.tick(10us) { port_util[ev.port] = ev.util_pct }
  on kv_writeback.forward at sw0 { priority = 1  if port_util[ev.out_port] > 50% { rate = 8GB/s } }
}
"""


def test_a_decision_standing_at_a_hop_sees_the_ticks_before_it(tmp_path, monkeypatch):
    """Where the entry a standing decision read is written by ticks, the ticks due run before
    it is checked: a run whose decisions flip with the port's load is the same as one that
    asks the program for every chunk.  The standing decisions serve the later transfers on
    their path too (`HookPlan.shared`), while the entry holds."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.decisions import AtHop
    folder = compile_text(tmp_path, HOT_PORT)
    small = dict(model="llama3-8b", prompt=8192, tp=8)
    found, shared = Counter(), ShimHookSite._shared

    def counted(plan, t, chunk):
        standing = shared(plan, t, chunk)
        found[type(standing)] += 1
        return standing
    monkeypatch.setattr(ShimHookSite, "_shared", staticmethod(counted))
    standing, _ = run_engine(folder, backend=JitBackend(), **small)
    assert found[AtHop]
    monkeypatch.setattr(dispatch, "MEMO_LIMIT", 0)
    asked, _ = run_engine(folder, backend=JitBackend(), **small)
    assert _timeless(standing) == _timeless(asked)
    sw0 = next(i for i in asked["islands"] if i["name"] == "sw0")
    assert 0 < sw0["decisions"]["forward.rate"]["8GB/s"] < sw0["per_hook"]["forward"]    # it flips


def test_an_island_is_asked_only_about_the_movements_its_handlers_name(monkeypatch):
    """The GPUs' issue program acts on KV write-back and the weights: their chunks are asked
    about as they are issued; the all-reduce's and the KV export's, which no issue handler
    names, are not (`HookSite.asks` given the transfer)."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.hook_site import ShimHookSite
    asked = Counter()
    on_issue = ShimHookSite.on_issue
    monkeypatch.setattr(ShimHookSite, "on_issue", lambda self, chunk, island, role:
                        asked.update([chunk.transfer.name]) or on_issue(self, chunk, island, role))
    report, eng = run_engine(compiled("prefill_qos"), backend=JitBackend())
    chunks = Counter()
    for t in eng.fabric.transfers:
        chunks[t.name] += t.chunks_total
    assert chunks["allreduce"] and chunks["kv_export"]
    assert asked["allreduce"] == asked["kv_export"] == 0
    assert asked["kv_writeback"] == chunks["kv_writeback"]


COMPLETE_ONE = """
import "fabrics/dgx_cxl.fx"
workload prefill {
  model: "llama3-8b"; prompt: 2048; batch: 1; tp: 8
  weights: pool0; kv: hbm; chunk: 2MiB
}
movement attn_weights = weights(attention) : pool0 -> gpu*
movement ffn_weights  = weights(ffn)       : pool0 -> gpu*
policy p { on attn_weights.complete at gpu* { prefetch = 3 } }
"""


def test_chunks_of_a_movement_no_complete_handler_names_land_without_an_event(tmp_path, monkeypatch):
    """A GPU's complete program acts on the attention weights alone: the FFN weights' chunks
    land without an event of their own, and the run is the same as one that has an event at
    each of their arrivals, but for its events."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.hook_site import ShimHookSite
    folder = compile_text(tmp_path, COMPLETE_ONE)
    small = dict(model="llama3-8b", prompt=2048, tp=8)
    fewer, _ = run_engine(folder, backend=JitBackend(), **small)
    asks = ShimHookSite.asks
    monkeypatch.setattr(ShimHookSite, "asks", lambda self, island, moment, transfer=None: asks(self, island, moment))
    every, _ = run_engine(folder, backend=JitBackend(), **small)
    assert {**_timeless(fewer), "events": 0} == {**_timeless(every), "events": 0}
    assert fewer["events"] < every["events"]
    gpu0 = next(i for i in fewer["islands"] if i["name"] == "gpu0")
    assert gpu0["per_hook"]["complete"] > 0


def test_a_decision_that_holds_at_a_hop_is_not_taken_at_another(monkeypatch):
    """A KV write-back transfer's decision at the switch holds at the hop it was made at: a
    chunk of the transfer meeting the switch at another hop of its path asks the program."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.decisions import AtHop
    from fabric_ext.runtime.simulation.servers import Chunk
    from fabric_ext.runtime.simulation.shims import Shim
    report, eng = run_engine(compiled("prefill_qos"), backend=JitBackend(), prompt=8192, tp=8)
    t = next(t for t in eng.fabric.transfers if isinstance(t.standing.get(("sw0", "enter")), AtHop))
    eng.site.before_event = None                # the run is over: no ticks to catch up
    asked = Counter()
    decide = Shim.decide
    monkeypatch.setattr(Shim, "decide", lambda self, hook, fields, now=0.0:
                        asked.update([fields["hop"]]) or decide(self, hook, fields, now))
    assert t.standing["sw0", "enter"].hop == 1
    for hop in (1, 2):
        chunk = Chunk(t, 0, 2 << 20, t.path)
        chunk.hop = hop
        eng.site.on_enter(chunk, "sw0")
    assert asked == {2: 1}


def test_a_finished_transfer_keeps_no_train_flow():
    """What trains work out for a transfer (`Transfer.train`) goes with it when it completes:
    a run holds it only for transfers still moving."""
    from fabric_ext.runtime.machine.jit import JitBackend
    report, eng = run_engine(compiled("prefill_qos"), backend=JitBackend(), prompt=8192, tp=8)
    assert eng.fabric.trains.steps
    assert all(t.train is None for t in eng.fabric.transfers if t.chunks_done == t.chunks_total)


@pytest.mark.parametrize("name", ["nic_pacing", "prefill_qos"])
def test_decision_counts_are_what_each_run_decided_however_many_outcomes_are_shared(name, monkeypatch):
    """The shims count a run by its outcome and hand runs that decided alike one answer, up to
    SHARED_LIMIT outcomes; here one, so most runs take the path that shares nothing.  The
    report's counts must still be those of every run's own decisions, read field by field."""
    from fabric_ext.contract import context
    from fabric_ext.runtime.simulation import shims
    monkeypatch.setattr(context, "SHARED_LIMIT", 1)
    monkeypatch.setattr(shims, "SHARED_LIMIT", 1)
    monkeypatch.setattr(dispatch, "MEMO_LIMIT", 0)      # every event runs its program
    decided = Counter()

    class Recording(Interpreter):
        def run(self, prog, ctx=None, mem=None):
            r0 = super().run(prog, ctx, mem)
            codec = ContextCodec(prog.hook)
            for field, value in codec.decisions(ctx).items():
                if value != prog.hook.field(field).default:
                    decided[prog.name, field, value] += 1
            return r0
    report, eng = run_engine(compiled(name), backend=Recording())
    counted = Counter()
    for shim in eng.shims.values():
        for hook, runs in shim.outcomes.items():
            for outcome, n in runs.items():
                for field, value in shim.codecs[hook].changed_of(outcome).items():
                    counted[shim.programs[hook].name, field, value] += n
    assert counted == decided and sum(decided.values()) > 1000
    in_report = sorted(n for i in report["islands"] for by_value in i["decisions"].values() for n in by_value.values())
    assert in_report == sorted(decided.values())      # (labelled with units: compared as counts)


def test_what_transfers_left_standing_stands_for_the_next_from_its_start(monkeypatch):
    """prefill_qos: once a transfer has made its decisions at a point of its path (its issue at
    a GPU, its entry to the switch or the DPU) and they are shared (`HookPlan.shared`,
    `HookPlan.watchers`), a later transfer with the same key starts with them standing
    (`ShimHookSite.starting`), in one change of what stands for it, where each point's first
    chunk would have made one: the same report as when each first chunk takes them there."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.decisions import DecisionCache
    changes = Counter()
    stand, stand_all = DecisionCache.stand, DecisionCache.stand_all
    monkeypatch.setattr(DecisionCache, "stand", lambda self, t, *a, **kw: changes.update([t]) or stand(self, t, *a, **kw))
    monkeypatch.setattr(DecisionCache, "stand_all", lambda self, t, found: changes.update([t]) or stand_all(self, t, found))
    started, eng = run_engine(compiled("prefill_qos"), backend=JitBackend(), prompt=8192, tp=8)
    at_start = sum(changes.values())
    changes.clear()
    monkeypatch.setattr(ShimHookSite, "starting", lambda self, t: None)
    each, _ = run_engine(compiled("prefill_qos"), backend=JitBackend(), prompt=8192, tp=8)
    assert _timeless(started) == _timeless(each)
    transfers = len(eng.fabric.transfers)
    assert at_start < transfers < sum(changes.values())


def test_the_context_tracer_sees_every_tick_run_ahead_of_its_batch(monkeypatch):
    """A port's tick run ahead of the others' (`TickSource.preview`, through `Shim.run`) is an
    event a program acts on, as a catch-up's rows are: the tracer records every run."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.simulation.engine import Engine, RunOptions
    from fabric_ext.runtime.simulation.ticks import TickSource
    ahead = []
    run_ahead = TickSource._run_ahead
    monkeypatch.setattr(TickSource, "_run_ahead", lambda self, *a: ahead.append(a) or run_ahead(self, *a))
    folder = compiled("prefill_qos")
    man = load_manifest(folder)
    ticks = []

    def tracer(island, hook, ctx):
        if (island, hook) == ("sw0", "tick"):
            ticks.append(ctx)
    eng = Engine(folder, man, create_maps(man), JitBackend(), RunOptions(prompt=8192, tp=8, context_tracer=tracer))
    eng.run()
    assert ahead and len(ticks) == eng.shims["sw0"].invocations["tick"]
