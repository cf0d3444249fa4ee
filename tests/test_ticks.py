"""Lazy telemetry ticks: the contexts they build from the counter log, and runs that must
come out the same whether each tick runs at its time or just before anything can see it."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_ext.contract.context import ContextCodec
from fabric_ext.contract.hooks import HOOKS
from fabric_ext.runtime.simulation.servers import Chunk, Server, Transfer
from fabric_ext.runtime.simulation.sim import Sim
from fabric_ext.runtime.simulation.ticks import TickSource
from policy_helpers import compiled
from test_runtime import compile_text, run_engine

TICK = HOOKS["cxl_switch", "tick"]


class RecordingShim:
    """Stands in for a shim: keeps every context it is given."""

    def __init__(self, last_wins_periods=(), reads=("queue_bytes",), per_port=False):
        self.codecs = {"tick": ContextCodec(TICK)}
        # no handler list: every field is read; else handlers whose runs only the last one's counts
        self.handlers = {"tick": [{"period": p, "reads": list(reads), "last_wins": True, "per_port": per_port}
                                  for p in last_wins_periods]} if last_wins_periods else {}
        self.rows = []
        self.passed = 0

    def pass_over(self, hook, n):
        self.passed += n

    def has(self, hook):
        return True

    def maps_for(self, hook, movement):
        return frozenset({"m"})

    def deliver_batch(self, hook, rows, row_time):
        self.rows.extend(rows.copy().view(self.codecs["tick"].dtype()).reshape(-1))
        return len(rows)

    def run(self, hook, fields, now):
        self.deliver_batch(hook, np.frombuffer(self.codecs[hook].pack(fields), dtype=np.uint8)[None, :], None)
        return True


arrivals = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 2), st.integers(1, 40)), max_size=40)
catch_ups = st.lists(st.integers(0, 400), max_size=6)
period_sets = st.sampled_from([[7], [10], [25], [7, 10], [10, 25], [5, 7, 25]])


@settings(max_examples=200, deadline=None)
@given(arrivals, catch_ups, period_sets, st.sampled_from([1, 3, 4096]))
def test_tick_contexts_match_counters_sampled_one_tick_at_a_time(chunks, catch_up_at, periods, block):
    """Chunks arrive at three ports and queue; each tick must see every port as it stood just
    before its time, however the catch-ups and batches fall, in time order (at one time the
    shorter period first), each period's bytes counted since its own last tick."""
    shim = RecordingShim()
    sim, servers, src, due, samples = _three_ports(shim, periods, chunks, block=block)
    end = END
    for t in catch_up_at:
        sim.at(t, src.catch_up, t)
    sim.run(until=end)
    src.catch_up(end)
    assert got_rows(shim) == sampled(due, samples, servers)


END = 420


def _three_ports(shim, periods, chunks, **kw):
    """Three ports (1, 0.5 and 4 bytes per ns) the chunks queue at (every third a collective's,
    at its pace), a tick source over them, every tick due by END, and the counters sampled just
    before each."""
    sim = Sim()
    servers = [Server(sim, f"p{i}", bw) for i, bw in enumerate([1e9, 0.5e9, 4e9])]
    src = TickSource(shim, "sw0", periods, servers, [11, 12, 13], **kw)
    due = sorted({(k * p, p) for p in periods for k in range(1, END // p + 1)})
    samples = _sample_before_ticks(sim, servers, due)
    flow = Transfer("m", 1, "kv", "", "a", "b", 0)
    collective = Transfer("ar", 2, "activations", "collective", "a", "b", 0)   # every third chunk: at
    collective.pace, collective.fixed_cost = 0.3e9, False                      # its pace, below the links'
    for i, (t, port, size) in enumerate(chunks):
        sim.at(t, servers[port].enqueue, Chunk(collective if i % 3 == 2 else flow, i, size, ["a", "b"]),
               lambda c: None)
    return sim, servers, src, due, samples


def _sample_before_ticks(sim, servers, due):
    """tick time -> [(bytes, queued) per port] as they stand just before it: sampled at the
    tick's time, ahead of every other event then (scheduled first, so the simulator runs it
    first), as a tick runs.  (A sample a little earlier misses events whose times carry
    rounding, such as 30 bytes at 1 GB/s ending at 29.999999999999996 ns.)"""
    samples = {0: [(0, 0)] * len(servers)}
    for t, _ in due:
        sim.at(t, lambda t=t: samples.__setitem__(t, [(s.bytes, s.queued_bytes) for s in servers]))
    return samples


def sampled(due, samples, servers):
    """The tick contexts the servers' records imply: each port's busy share of the window
    [T - period, T) and the bytes sent in it (each transmission's bytes spread evenly over
    its time on the link), summed in transmission order; the queue as sampled just before T."""
    want = []
    for t, period in due:
        lo = float(t) - float(period)
        for port, srv in enumerate(servers):
            busy = sent = 0.0
            for start, stop, size in srv.intervals:
                if start < t and stop > lo:
                    overlap = min(stop, float(t)) - max(start, lo)
                    busy += overlap
                    sent += size * overlap / (stop - start)
            util = int(min(busy * 100 / period + 0.5, 100))
            want.append((t, port, 11 + port, util, int(sent), samples[t][port][1], period))
    return want


def got_rows(shim):
    return [tuple(int(r[n]) for n in ("now", "port", "peer", "util_pct", "bytes", "queue_bytes", "period"))
            for r in shim.rows]


@settings(max_examples=150, deadline=None)
@given(arrivals, catch_ups, period_sets, st.booleans())
def test_only_the_last_of_overwriting_ticks_runs_and_sees_its_own_counters(chunks, catch_up_at, periods,
                                                                           queue_read):
    """Handlers whose runs overwrite each other (`last_wins`): of the ticks each catch-up
    finds due, each period's last runs, with the counters it would have had anyway (the
    queue reads 0 where no handler reads it)."""
    shim = RecordingShim(last_wins_periods=periods, reads=("queue_bytes",) if queue_read else ("util_pct",))
    sim, servers, src, every, samples = _three_ports(shim, periods, chunks)
    end = END
    points = sorted(set(catch_up_at) | {end})
    for t in points[:-1]:
        sim.at(t, src.catch_up, t)
    sim.run(until=end)
    src.catch_up(end)
    runs, last = [], {p: 0 for p in periods}
    for t in points:
        runs += sorted((t // p * p, p) for p in periods if t // p > last[p])
        last.update({p: t // p for p in periods})
    want = sampled(runs, samples, servers)
    assert got_rows(shim) == (want if queue_read else [w[:5] + (0,) + w[6:] for w in want])
    assert shim.passed == 3 * (len(every) - len(runs))


@settings(max_examples=150, deadline=None)
@given(arrivals, catch_ups, st.lists(st.tuples(st.integers(0, 400), st.integers(0, 3)), max_size=12),
       st.sampled_from([7, 10, 25]))
def test_a_port_run_ahead_sees_its_own_counters_and_the_catch_up_leaves_it_out(chunks, catch_up_at, ahead_at,
                                                                                 period):
    """`per_port` handlers: a port's tick run ahead of the others' to bring its entry of map m
    up to date (`TickSource.preview`, port 3 writes none) has the context it would have had at
    its time; the catch-up that reaches that tick leaves the port out, and every (tick, port)
    due is run or passed over once."""
    shim = RecordingShim(last_wins_periods=[period], reads=("util_pct",), per_port=True)
    sim, servers, src, every, samples = _three_ports(shim, [period], chunks)
    events = sorted([(t, i, port) for i, (t, port) in enumerate(ahead_at)] + [(t, -1, None) for t in catch_up_at])
    for t, _, port in events:
        sim.at(t, *((src.catch_up, t) if port is None else (src.preview, src.ports_of([("m", port)]), t)))
    sim.run(until=END)
    src.catch_up(END)
    row = {(w[0], w[1]): w[:5] + (0,) + w[6:] for w in sampled(every, samples, servers)}
    want, next_k, ahead = [], 1, {}
    for t, _, port in events + [(END, 0, None)]:
        k = t // period
        if k < next_k:
            continue            # nothing due
        if port is None:
            want += [row[k * period, q] for q in range(3) if ahead.get(q) != k]
            next_k, ahead = k + 1, {}
        elif port < 3 and ahead.get(port) != k:
            ahead[port] = k
            want.append(row[k * period, port])
    assert got_rows(shim) == want
    assert len(shim.rows) + shim.passed == 3 * len(every)


def _same_run(folder, **kw):
    from fabric_ext.runtime.machine.jit import JitBackend
    lazy, eng_lazy = run_engine(folder, backend=JitBackend(), **kw)
    eager, eng_eager = run_engine(folder, backend=JitBackend(), eager_ticks=True, **kw)
    for key in ("ttft_ms", "maps", "movements", "faults"):
        assert lazy[key] == eager[key], key
    # the same events; lazily, ticks whose effect the next one overwrites are not run
    events = [[{k: v for k, v in i.items() if k not in ("ns_per_invocation", "invocations")} for i in r["islands"]]
              for r in (lazy, eager)]
    assert events[0] == events[1]
    assert all(a["invocations"] <= b["invocations"] for a, b in zip(lazy["islands"], eager["islands"]))
    return lazy, eng_lazy


def test_lazy_ticks_equal_ticks_at_their_time_when_the_map_is_read():
    """prefill_qos: the switch's forward program reads what the tick writes."""
    report, eng = _same_run(compiled("prefill_qos"))
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    periods = report["ttft_ms"] * 1e6 // 10_000
    assert sw0["per_hook"]["tick"] == periods * len(eng.fabric.ports("sw0"))
    # the tick overwrites port_util: of the ticks between two reads only the last one runs
    assert eng.shims["sw0"].invocations["tick"] < sw0["per_hook"]["tick"] / 4
    assert sw0["decisions"]["forward.rate"]       # the tick-written utilisation paced some KV


def test_a_port_whose_entry_a_standing_decision_reads_runs_its_tick_ahead_alone(monkeypatch):
    """prefill_qos: what stands for a KV transfer at the switch holds while the tick-written
    utilisation of its port does; checking it runs that port's pending tick alone
    (`TickSource.preview`: the handler is `per_port`), and the catch-up that reaches the tick
    leaves the port out.  The run is the one with each tick run at its time (`_same_run`).
    A check before the port's next tick asks nothing of the tick source (`Refresher`): each
    check that asks runs the port ahead."""
    ahead, previews = [], []
    run_ahead, preview = TickSource._run_ahead, TickSource.preview
    monkeypatch.setattr(TickSource, "_run_ahead", lambda self, *a: ahead.append(a[1:]) or run_ahead(self, *a))
    monkeypatch.setattr(TickSource, "preview", lambda self, *a: previews.append(a[1]) or preview(self, *a))
    report, _ = _same_run(compiled("prefill_qos"), prompt=4096)
    kv_at_sw0 = next(i for i in report["islands"] if i["name"] == "sw0")["per_hook"]["forward"]
    assert 0 < len(previews) == len(ahead) < kv_at_sw0 / 4


def test_a_tick_that_writes_another_ports_entry_is_caught_up_whole(tmp_path):
    """Each port's tick writes another port's entry (`last_wins`, not `per_port`): the pool's
    entry, which the KV pacing reads, holds the utilisation of the link to gpu7, which streams
    weights.  A check of that entry cannot run one port ahead and catches every port up; the
    run is the one with each tick at its time."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload prefill { model: "llama3-8b"; prompt: 8192; batch: 1; tp: 8; weights: pool0; kv: pool0; chunk: 256KiB }
movement kv_writeback = kv : gpu* -> pool0
map port_util : array<u32, percent>[16]
policy p {
  on sw0.tick(10us) { port_util[ev.port + 2] = ev.util_pct }
  on kv_writeback.forward at sw0 { priority = 1  if port_util[ev.out_port] > 50% { rate = 8GB/s } }
}""")
    report, eng = _same_run(out, prompt=8192, tp=8)
    (src,) = eng.ticks
    assert src.periods[0].last_wins and not src.per_port
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    assert 0 < sw0["decisions"]["forward.rate"]["8GB/s"] < sw0["per_hook"]["forward"]    # it flips


def test_lazy_ticks_equal_ticks_at_their_time_when_the_tick_reads_a_map(tmp_path):
    """The tick reads (and resets) what the forward program counts, and another island reads
    what the tick derives: ticks must run before the writes they would have preceded."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 2048; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
movement kv = kv : gpu* -> pool0
map seen : array<u32, count>[16]
map busy : array<u32, count>[16]
map util : array<u32, percent>[16]
map ticks : array<u32, count>[2]
policy p {
  on w_in.forward at sw0 { seen[ev.out_port] += 1 }
  on sw0.tick(5us) { busy[ev.port] = seen[ev.port]; seen[ev.port] = 0; ticks[0] += 1 }
  on sw0.tick(7us) { util[ev.port] = ev.util_pct; ticks[1] += 1 }
  on kv.issue at gpu* { if busy[0] + busy[1] + busy[2] > 0 && util[1] < 50% { rate = 20GB/s } }
}""")
    report, _ = _same_run(out, prompt=2048)
    assert report["maps"]["ticks"]["0"] > 0 and report["maps"]["ticks"]["1"] > 0


def test_an_overwriting_tick_nothing_reads_runs_once_per_port_at_the_end(tmp_path):
    """A `last_wins` tick that keeps no log (it reads no queue) is not caught up on a clock
    (`TickSource.grows`): nothing reads what it writes during the run, so each port's program
    runs once, at the end, and the map holds what ticks run at their time leave."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload prefill { model: "llama3-8b"; prompt: 8192; batch: 1; tp: 8; weights: pool0; kv: pool0 }
map port_util : array<u32, percent>[16]
policy p { on sw0.tick(10us) { port_util[ev.port] = ev.util_pct } }""")
    report, eng = _same_run(out, prompt=8192, tp=8)
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    assert eng.shims["sw0"].invocations["tick"] == len(eng.fabric.ports("sw0")) < sw0["per_hook"]["tick"]


def test_telemetry_ticks_nobody_reads_run_once_at_the_end():
    report, _ = _same_run(compiled("telemetry"))
    assert sum(report["maps"]["util_hist"].values()) > 0


def test_a_faulting_tick_is_detached_at_its_time(tmp_path):
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
map m : array<u32, percent>[4]
policy p { on sw0.tick(10us) { for i in 0..200 { m[i % 4] += ev.util_pct } } }""")
    from fabric_ext.runtime.machine.interp import Interpreter
    report, _ = run_engine(out, backend=Interpreter(budget=1500))
    (fault,) = report["faults"]
    assert fault["hook"] == "tick" and "budget" in fault["reason"]
    assert fault["time_ns"] == 10_000          # the first tick: the whole loop needs more
    assert report["ttft_ms"] > 0
    assert np.isfinite(report["ttft_ms"])


def test_lazy_ticks_of_two_islands_that_share_a_map_run_in_time_order(tmp_path):
    """A GPU's tick counts, the switch's tick copies the count: each switch tick must see
    the GPU ticks up to its own time, however late either is caught up."""
    out = compile_text(tmp_path, """
import "fabrics/dgx_cxl.fx"
workload w { model: "llama3-8b"; prompt: 2048; tp: 2; weights: pool0; kv: pool0 }
movement w_in = weights : pool0 -> gpu*
map count : array<u32, count>[1]
map seen : array<u32, count>[16]
map saw : array<u32, count>[1]
policy p {
  on gpu0.tick(7us) { if ev.port == 0 { count[0] += 1 } }
  on sw0.tick(10us) { seen[ev.port] = count[0] }
  on w_in.forward at sw0 { saw[0] += seen[0] }
}""")
    report, _ = _same_run(out, prompt=2048)
    assert report["maps"]["saw"]["0"] > 0


def _slow_gpus(tmp_path, handlers: str):
    """A policy whose GPUs compute at 1 GFLOP/s: a 512-token prefill takes hours of simulated
    time, almost all of it kernels, with a 10 us tick on the switch."""
    from conftest import POLICIES
    (tmp_path / "fabrics").mkdir()
    (tmp_path / "fabrics" / "slow.fx").write_text(
        (POLICIES / "fabrics" / "dgx_cxl.fx").read_text().replace("bf16: 989TFLOPs", "bf16: 1GFLOPs"))
    return compile_text(tmp_path, """
import "fabrics/slow.fx"
workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }
movement kv = kv : gpu* -> pool0
map util : array<u32, percent>[16]
map ticks : array<u32, count>[16]
policy p {
  on kv.forward at sw0 { if util[0] > 80% { rate = 16GB/s } }
  HANDLERS
}""".replace("HANDLERS", handlers))


def test_a_long_quiet_stretch_costs_no_tick_events(tmp_path):
    """Ticks whose each run overwrites the last are caught up in one run however long the
    stretch, and the records are flushed only after events: hours of simulated kernels once
    took an event every 4,096 ticks (one tick run each), 500,000 of them here."""
    report, eng = run_engine(_slow_gpus(tmp_path, "on sw0.tick(10us) { util[ev.port] = ev.util_pct }"),
                             max_events=20_000)
    assert report["ttft_ms"] * 1e6 / (4096 * 10_000) > 100_000       # what the old clock took
    sw0 = next(i for i in report["islands"] if i["name"] == "sw0")
    assert sw0["per_hook"]["tick"] == report["ttft_ms"] * 1e6 // 10_000 * len(eng.fabric.ports("sw0"))
    assert eng.shims["sw0"].invocations["tick"] < 20_000      # ports x runs: once per catch-up


def test_ticks_that_must_each_run_count_against_the_event_limit(tmp_path):
    """A counting tick over hours of simulated time is billions of runs, outside the event
    loop: they count against --max-events, so the run stops (it ran for hours)."""
    import pytest

    from fabric_ext.runtime.simulation.sim import EventLimit
    folder = _slow_gpus(tmp_path, "on sw0.tick(10us) { ticks[ev.port] += 1 }")
    with pytest.raises(EventLimit, match=r"limit of 100,000 events and ticks .* tick programs run at 10[0-9,]+ tick"):
        run_engine(folder, max_events=100_000)


def test_utilisation_is_the_busy_share_of_the_window():
    """A chunk in service for half of a period reads 50 %, and a port busy through a
    period reads 100 % in every tick of it (it read 0 % or 100 %, as transmissions started)."""
    shim = RecordingShim()
    sim = Sim()
    port = Server(sim, "p", 1e9)             # 1 byte per ns
    src = TickSource(shim, "sw0", [10], [port], [11])
    flow = Transfer("m", 1, "kv", "", "a", "b", 0)
    sim.at(0, port.enqueue, Chunk(flow, 0, 35, ["a", "b"]), lambda c: None)   # busy 0-35 ns
    sim.run()
    src.catch_up(40)
    rows = [(r[0], r[3], r[4]) for r in got_rows(shim)]
    assert rows == [(10, 100, 10), (20, 100, 10), (30, 100, 10), (40, 50, 5)]


def test_a_collective_is_counted_over_its_time_on_the_link():
    """A collective's chunk crosses a link at its pace (NCCL's bus bandwidth), slower than
    the link: a tick sees the port busy for that long, its bytes spread over it."""
    shim = RecordingShim()
    sim = Sim()
    port = Server(sim, "p", 1e9)             # 1 byte per ns
    src = TickSource(shim, "sw0", [10], [port], [11])
    flow = Transfer("ar", 1, "activations", "collective", "a", "b", 0)
    flow.pace, flow.fixed_cost = 0.5e9, False
    sim.at(0, port.enqueue, Chunk(flow, 0, 20, ["a", "b"]), lambda c: None)   # busy 0-40 ns
    sim.run()
    src.catch_up(50)
    rows = [(r[0], r[3], r[4]) for r in got_rows(shim)]
    assert rows == [(10, 100, 5), (20, 100, 5), (30, 100, 5), (40, 100, 5), (50, 0, 0)]
