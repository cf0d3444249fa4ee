"""Programs that only watch run in batches (`observers.mark_observers`, `Shim.flush`), and trains
step the chunks they watch (`decisions.Watched`): nothing in a run may tell the difference."""
import json

import pytest
from test_dispatch import POLICIES, _timeless

from fabric_ext.runtime.machine.errors import InputError
from fabric_ext.runtime.machine.jit import JitBackend
from fabric_ext.runtime.machine.program import VMFault
from fabric_ext.runtime.simulation import observers, shims
from policy_helpers import compiled
from test_runtime import compile_text, run_engine

SMALL = dict(model="llama3-8b", prompt=2048, tp=8)
# the fabric and workload of every policy below (SMALL's), and the movements most of them watch
HEADER = """
import "fabrics/dgx_cxl.fx"
workload prefill {
  model: "llama3-8b"; prompt: 2048; batch: 1; tp: 8
  weights: pool0; kv: pool0; kv_export: nic0; chunk: 2MiB
}"""
PRELUDE = HEADER + """
movement weights_in = weights : pool0 -> gpu* { critical }
movement kv_out = kv : gpu* -> pool0"""

# a watcher of everything a chunk's context says as it enters the switch, weights and KV alike
WATCHER = PRELUDE + """
map queued : array<u32, size>[4]
map when   : array<u32, time>[2]
map seen   : hash<u32, count>[4096]
map above  : lhist<size>[0, 64MiB, 2MiB]
map ring   : ringbuf[64KiB]
policy p {
  on weights_in.forward {
    queued[0] += ev.queue_bytes
    when[0] += now
    seen[ev.chunk * 16 + ev.out_port] += 1
    above = lhist(ev.queued_ahead_hi)
  }
  on kv_out.forward {
    queued[1] += ev.bytes
    when[1] += now
    if ev.queue_bytes > 4MiB { emit ring(now, ev.chunk, ev.queue_bytes) }
  }
}
"""


@pytest.mark.parametrize("name", POLICIES)
def test_observers_in_batches_change_nothing(name):
    """Every bundled policy gives the same report, map contents and program runs included,
    with its watching programs run in batches and each at its event."""
    batched, eng = run_engine(compiled(name), backend=JitBackend())
    each, _ = run_engine(compiled(name), backend=JitBackend(), lazy_observers=False)
    assert _timeless(batched) == _timeless(each)
    if name == "telemetry":
        assert set(eng.shims["sw0"].watching) == {"forward"}


def _batched_and_each(folder):
    """(report, engine) of a run with watchers in batches and trains stepping what they watch,
    and of the reference: every chunk an event and every run at it."""
    return [run_engine(folder, backend=JitBackend(), **SMALL, **opts)
            for opts in ({}, dict(lazy_observers=False, trains=False, per_chunk_events=True))]


def _same_runs(batched, each):
    """The same report but for the events the loop counts, and the same program runs."""
    assert {**_timeless(batched), "events": 0} == {**_timeless(each), "events": 0}
    assert [i["invocations"] for i in batched["islands"]] == [i["invocations"] for i in each["islands"]]


def _batched_as_at_events(folder, make=JitBackend):
    """(report, engine) of a small run with watchers in batches, held to be the report of the
    same run with every program run at its event (a fresh backend from ``make`` for each)."""
    batched, eng = run_engine(folder, backend=make(), **SMALL)
    each, _ = run_engine(folder, backend=make(), lazy_observers=False, **SMALL)
    assert _timeless(batched) == _timeless(each)
    return batched, eng


def test_a_watched_chunk_is_seen_as_it_is_at_its_event(tmp_path):
    """A watcher reads each chunk's time, index, port, what is queued at the switch and what
    of it is above its class: the sums, counts and records are the same when trains step the
    watched weights and the watchers run in batches as when every chunk is an event and every
    run is at it."""
    (batched, eng), (each, _) = _batched_and_each(compile_text(tmp_path, WATCHER))
    _same_runs(batched, each)
    maps = batched["maps"]
    assert maps["queued"]["0"] and maps["when"]["0"] and maps["ring"]["records"]
    assert eng.fabric.trains.steps > batched["events"] / 3      # the watched weights in trains
    # a finished transfer lets its watchers' stamps go (memory stays what a run without them takes)
    assert not any(s.watched for t in eng.fabric.transfers for s in t.standing.values())


# watchers of what a chunk's transfer and path say as it is issued: the KV's layer and GPU, and
# the all-reduce's ports (a GPU's transfers of it leave and arrive by different links)
ISSUE_WATCHER = PRELUDE + """
movement all_reduce = activations(collective) : gpu* <-> gpu*
map layers : hash<u32, size>[64]
map gpus   : hash<device, size>[16]
map ports  : hash<u32, count>[64]
policy p {
  on kv_out.issue at gpu* { layers[ev.layer] += ev.bytes  gpus[ev.src] += ev.bytes }
  on all_reduce.issue at gpu* { ports[ev.out_port * 8 + ev.in_port] += 1 }
}
"""


def test_the_transfers_on_a_path_share_what_stands_for_their_watchers(tmp_path):
    """What stands for watched chunks is made once per path and hop (`HookPlan.watchers`), not
    per transfer: each chunk's context is stamped with its transfer's fields and its own, so
    the layers, GPUs and ports read are those of a run with every chunk an event."""
    (batched, eng), (each, _) = _batched_and_each(compile_text(tmp_path, ISSUE_WATCHER))
    _same_runs(batched, each)
    maps = batched["maps"]
    assert len(maps["layers"]) == 32 and len(maps["gpus"]) == 8 and len(maps["ports"]) > 8
    watchers = sum(len(p.watchers) for p in eng.site.remembered.plans.values())
    assert 0 < watchers < len(eng.fabric.transfers) / 4


@pytest.fixture
def flushed(monkeypatch):
    """The number of events each batch's flush runs, in order."""
    kept = []
    flush = observers.Batch.flush

    def counting(self):
        kept.append(len(self.times))
        flush(self)
    monkeypatch.setattr(observers.Batch, "flush", counting)
    return kept


def test_a_bounded_batch_changes_nothing(tmp_path, monkeypatch, flushed):
    """An observer's events run once PENDING_ROWS of them wait (memory stays bounded)."""
    monkeypatch.setattr(shims, "PENDING_ROWS", 7)
    (batched, _), (each, _) = _batched_and_each(compile_text(tmp_path, WATCHER))
    assert {**_timeless(batched), "events": 0} == {**_timeless(each), "events": 0}
    assert max(flushed) == 7


# watchers on every GPU's issue hook and at the switch, sharing one map: one batch, in order
GPU_WATCHERS = PRELUDE + """
map issued : hash<device, size>[4]     // full after four: which four is the order of events
map when   : array<u32, time>[1]
map queued : lhist<size>[0, 64MiB, 1MiB]
map n      : array<u32, u32>[1]
map trail  : array<u32, device>[8192]     // who saw what, in the order they saw it
policy p {
  on weights_in.issue at gpu* {
    issued[ev.dst] += ev.bytes
    n[0] += 1
    trail[n[0]] = ev.dst
  }
  on kv_out.issue at gpu* {
    when[0] += now
    queued = lhist(ev.queue_bytes)
    n[0] += 1
    trail[n[0]] = ev.src
  }
  on weights_in.forward {
    issued[ev.src] += ev.bytes
    n[0] += 1
    trail[n[0]] = ev.src
  }
}
"""


def test_watchers_that_share_a_map_run_in_the_order_of_their_events(tmp_path):
    """Nine programs watch (eight GPUs' issue hooks and the switch's forward) and share a map:
    their events wait in one batch and run in the order they happened, the weights' chunks
    still stream in trains, and the report is the one of every run at its event."""
    (batched, eng), (each, _) = _batched_and_each(compile_text(tmp_path, GPU_WATCHERS))
    _same_runs(batched, each)
    batches = {id(w.batch) for s in eng.shims.values() for w in s.watching.values()}
    assert len(batches) == 1 and sum(len(s.watching) for s in eng.shims.values()) == 9
    assert eng.fabric.trains.steps > batched["events"] / 3
    assert batched["maps"]["issued"] and batched["maps"]["when"]["0"]


# a watcher of the switch's queues: every chunk that starts on one of its links
DEQUEUE_WATCHER = HEADER + """
map waits : hist<time>
map sent  : array<u32, size>[16]
map n     : array<u32, u32>[1]
map trail : array<u32, u32>[16384]
policy p {
  on sw0.dequeue {
    waits = hist(ev.wait)
    sent[ev.out_port] += ev.bytes
    n[0] += 1
    trail[n[0]] = ev.out_port * 100000 + ev.chunk
  }
}
"""


# the same, one handler per movement named (a program watching every movement it names)
DEQUEUE_WATCHER_BY_MOVEMENT = PRELUDE + DEQUEUE_WATCHER[len(HEADER):].replace(
    "on sw0.dequeue {", "on weights_in.dequeue at sw0 { n[0] += 1 }\n  on kv_out.dequeue at sw0 {")


@pytest.mark.parametrize("policy", [DEQUEUE_WATCHER, DEQUEUE_WATCHER_BY_MOVEMENT], ids=["any", "by movement"])
def test_a_queue_watcher_sees_each_chunk_a_train_starts(tmp_path, policy):
    """Where only a watcher is asked as chunks leave the switch's queues, trains step the
    weights and each step shows its chunk, at its time, in order: the same report as every
    chunk an event and every run at it."""
    (batched, eng), (each, _) = _batched_and_each(compile_text(tmp_path, policy))
    _same_runs(batched, each)
    assert eng.fabric.trains.steps > batched["events"] / 3
    assert batched["maps"]["n"]["0"] > 1000


WATCH_AND_DECIDE = WATCHER.replace("policy p {", """policy p {
  on kv_out.issue at gpu* { priority = 3 }
  on sw0.tick(10us) { queued[2] = ev.bytes }""")


def test_a_program_that_decides_or_shares_a_map_is_run_at_its_event(tmp_path):
    """A tick that writes the watcher's map, or a handler that decides, keeps the program
    at its events (the order among programs, and the decisions, matter there)."""
    folder = compile_text(tmp_path, WATCH_AND_DECIDE)
    batched, eng = _batched_as_at_events(folder)
    assert not any(s.watching for s in eng.shims.values())


# each GPU's issue program decides the weights' prefetch and only watches the KV it writes back
DECIDE_AND_WATCH = PRELUDE + """
map kv_seen : hash<device, size>[8]
map n       : array<u32, u32>[1]
map trail   : array<u32, u32>[4096]     // the KV transfers' layers in the order the programs saw them
policy p {
  on weights_in.issue at gpu* { prefetch = 3 }
  on kv_out.issue at gpu* {
    kv_seen[ev.src] += ev.bytes
    n[0] += 1
    trail[n[0]] = ev.layer
  }
}
"""


def test_a_program_watches_in_batches_the_movements_it_decides_nothing_for(tmp_path, flushed):
    """The GPUs' issue programs decide for the weights at their events and keep the KV chunks
    they only watch for one batch (the eight share maps), since no run of them can fault: the
    report, the maps and the order in the trail included, is the one of every run at its event."""
    (batched, eng), (each, _) = _batched_and_each(compile_text(tmp_path, DECIDE_AND_WATCH))
    _same_runs(batched, each)
    kv = next(m["id"] for m in eng.man["movements"] if m["name"] == "kv_out")
    gpus = [s for name, s in eng.shims.items() if name.startswith("gpu")]
    assert all({h: w.movements for h, w in s.watching.items()} == {"issue": frozenset({kv})} and s.watches("issue", kv) and not s.watches("issue")
               for s in gpus) and len(gpus) == 8
    assert len({id(w.batch) for s in gpus for w in s.watching.values()}) == 1
    assert sum(flushed) == batched["maps"]["n"]["0"] > 100        # every KV run, in batches
    assert all(i["decisions"].get("issue.prefetch") for i in batched["islands"] if i["name"].startswith("gpu"))


def test_a_program_that_may_fault_decides_and_watches_at_its_events(tmp_path):
    """With a loop, a run could exhaust its budget and detach the program, deciding handlers
    and all, at an event a batch would reach only later: its watching runs stay at their events."""
    folder = compile_text(tmp_path, DECIDE_AND_WATCH.replace("n[0] += 1\n", "for i in 0..64 { n[0] += 1 }\n"))
    batched, eng = _batched_as_at_events(folder)
    assert not any(s.watching for s in eng.shims.values()) and batched["maps"]["n"]["0"] > 6400


class MapsElsewhere(JitBackend):
    """The JIT, standing for a backend whose maps live outside this process (the kernel's),
    where a run may fail for reasons outside the program."""
    host_maps = False


def _unlisted_kv_maps(folder):
    """The manifest's handler list, with the KV handlers' maps left out (their code still names them)."""
    man = json.loads((folder / "manifest.json").read_text())
    for p in man["programs"]:
        for h in p["handlers"]:
            if h.get("decides") == {}:
                h["maps"] = []
    (folder / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("case", ["maps elsewhere", "maps unlisted"])
def test_a_program_is_taken_apart_only_where_its_watching_runs_cannot_tell(tmp_path, case):
    """A deciding program watches some movements in a batch only on a backend that keeps its
    maps here (where `may_fault`'s word holds), and only with each map its code names listed
    by a handler (one no handler lists goes with every movement, so watching and deciding share
    it): otherwise every run stays at its event, and the report is the same."""
    folder = compile_text(tmp_path, DECIDE_AND_WATCH)
    if case == "maps unlisted":
        _unlisted_kv_maps(folder)
    backend = MapsElsewhere if case == "maps elsewhere" else JitBackend
    batched, eng = _batched_as_at_events(folder, backend)
    assert not any(s.watching for s in eng.shims.values()) and batched["maps"]["n"]["0"] > 100


class FaultAt(JitBackend):
    """The JIT, but the nth run of any program faults, in a batch or alone."""

    def __init__(self, n):
        super().__init__()
        self.left = n

    def run(self, handle, ctx=None, mem=None):
        self.left -= 1
        if self.left == 0:
            raise VMFault(handle.prog, 0, "the test's fault")
        return super().run(handle, ctx, mem)

    def run_batch(self, handle, ctxs):
        if 0 < self.left <= len(ctxs):
            row = self.left - 1
            super().run_batch(handle, ctxs[:row])
            self.left = 0
            e = VMFault(handle.prog, 0, "the test's fault")
            e.row = row
            raise e
        self.left -= len(ctxs)
        return super().run_batch(handle, ctxs)


def test_a_watcher_that_faults_in_a_batch_stops_where_it_would_have(tmp_path):
    """The 300th run faults: run in a batch, the fault is reported at that event's time, the
    events after it are not run, and the maps hold what the 299 runs before it left."""
    folder = compile_text(tmp_path, WATCHER)
    batched, eng = _batched_as_at_events(folder, lambda: FaultAt(300))
    assert batched["faults"] and batched["faults"][0]["time_ns"] > 0
    assert sum(batched["maps"]["seen"].values()) <= 299


@pytest.mark.parametrize("nth", [1, 300, 301])
def test_one_of_kin_watchers_that_faults_in_a_shared_call_stops_alone(tmp_path, nth):
    """The eight GPUs' watchers are the same code on the same maps, so their events run in one
    call; the one whose run faults is reported at its event and detached, and the others' events
    after it still run: the same report as every run at its event."""
    folder = compile_text(tmp_path, GPU_WATCHERS)
    batched, eng = _batched_as_at_events(folder, lambda: FaultAt(nth))
    assert len(batched["faults"]) == 1 and batched["maps"]["n"]["0"] > nth
    fault = batched["faults"][0]
    assert fault["program"] == f"{fault['island']}_{fault['hook']}"      # its own, not its kin's


def test_a_manifest_that_hides_a_decision_is_found_out(tmp_path):
    """A handler list that says a deciding handler decides nothing makes its program an
    observer; its decision shows in the batch, and the run stops with a message, not a
    silently different run."""
    folder = compile_text(tmp_path, WATCHER.replace("queued[1] += ev.bytes", "queued[1] += ev.bytes\n    priority = 2"))
    man = json.loads((folder / "manifest.json").read_text())
    for p in man["programs"]:
        for h in p["handlers"]:
            h["decides"] = {}
    (folder / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(InputError, match="decides nothing.*compile it again"):
        run_engine(folder, backend=JitBackend(), **SMALL)


def test_each_at_its_event_keeps_nothing_back():
    """`RunOptions(lazy_observers=False)`, the reference every test here compares with, runs
    each watcher at its event: no batch is kept, and the switch's program runs once per event."""
    _, eng = run_engine(compiled("telemetry"), backend=JitBackend(), lazy_observers=False)
    assert not any(s.watching for s in eng.shims.values())
    batched, beng = run_engine(compiled("telemetry"), backend=JitBackend())
    assert beng.shims["sw0"].watching and not any(w.batch.times for s in beng.shims.values() for w in s.watching.values())


def test_a_program_with_a_helper_that_tells_time_or_order_is_no_observer():
    """A watcher that calls a helper whose result depends on when or after what it runs (the
    clock, prandom, printk) runs at its events: its calls are read from its code."""
    from fabric_ext.runtime.machine.isa import CALL, JMP, Insn
    for helper, batched in ((None, True), (5, False), (7, False), (6, False), (1, True)):
        _, eng = run_engine(compiled("telemetry"), backend=JitBackend(), lazy_observers=False)
        prog = eng.shims["sw0"].programs["forward"]
        if helper is not None:
            prog.insns.append(Insn(JMP | CALL, imm=helper))      # (never reached: the rule reads code)
        observers.mark_observers(eng.shims)
        assert ("forward" in eng.shims["sw0"].watching) is batched, helper


def test_a_watcher_detached_mid_run_runs_what_it_was_given_first():
    """Detaching a watcher runs the events it kept before it goes, as they ran at each event."""
    from fabric_ext.contract.bundle import create_maps, load_manifest
    from fabric_ext.runtime.simulation.engine import Engine, RunOptions
    reports = []
    for lazy in (True, False):
        folder = compiled("telemetry")
        man = load_manifest(folder)
        eng = Engine(folder, man, create_maps(man), JitBackend(), RunOptions(**SMALL, lazy_observers=lazy))
        eng.sim.at(100e6, eng.shims["sw0"].detach, "forward")
        reports.append(eng.run())
    assert _timeless(reports[0]) == _timeless(reports[1])
    assert 0 < reports[0]["maps"]["bytes_by_movement"]["1"] < 11274289152     # half the weights' bytes
