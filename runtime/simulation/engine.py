"""The prefill run: a compiled policy's programs attached to a fabric carrying an LLM prefill.

`Engine` builds the fabric model from the manifest (figures from the data file
fill what the policy's fabric leaves out), attaches every island's programs
through its shim, gives the fabric its hook site (`hook_site.ShimHookSite`: events
to contexts to shims, decisions back), runs the telemetry ticks, and runs the
prefill's schedule (`prefill.Prefill`), which moves data through the hook site.
Every decision a program makes is applied by the fabric model; the run's
figures come back as a `stats.RunRecord` (`record`) and a dict (`report`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fabric_ext.contract.bundle import Folder
from fabric_ext.contract.digraph import DiGraph
from fabric_ext.contract.schema import PROP_RANGES
from fabric_ext.runtime.machine.gcutil import fewer_collections

from .fabric_model import Fabric, Room
from .figures import default, figures, link_figure, time_inside
from .hook_site import ShimHookSite
from .observers import mark_observers
from .prefill import Prefill, Progress  # noqa: F401  (Progress: what RunOptions.progress is called with)
from .shims import SHIMS
from .sim import DEFAULT_MAX_EVENTS, Sim
from .stats import REPORT_ENTRIES, RunRecord
from .ticks import BLOCK, Refresher, TickSource, catch_up_together
from .timing import Timing, profile_of
from .workload import DEFAULT_PROMPT, Workload, WorkloadError, load_model, tp_problem

#: the property that sizes each kind of device's memory (a GPU without one: its profile's figure)
CAPACITY_PROP = {"gpu": "hbm", "cxl_mem": "capacity", "host": "dram", "dpu": "mem", "nic": "mem"}


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


@dataclass
class RunOptions:
    model: str | None = None
    prompt: int | None = None
    batch: int | None = None
    tp: int | None = None
    chunk_tokens: int | None = None
    attach: bool = True              # False: the baseline, every island on its defaults
    progress: object = None          # callable(Progress) or None
    trace: bool = False              # record spans for a Perfetto trace (and the evidence for its stall flows)
    eager_ticks: bool = False        # run each tick at its time instead of lazily (tests compare the two)
    per_chunk_events: bool = False   # an event at every end of transmission and every arrival (`fabric_model`)
    trains: bool = True              # servers' round robin over copy engines stepped ahead in one event (`trains`)
    lazy_observers: bool = True      # programs that only watch run in batches (`observers.mark_observers`)
    max_events: int | None = DEFAULT_MAX_EVENTS   # a run that passes this many events stops (None: no limit)
    stack: str | None = None         # serving-stack profile (figures.json "stacks"), else the workload's
    context_tracer: object = None    # callable(island, hook, ctx bytes) for every event a program acts on
    explain: bool = False            # record the evidence for root-cause chains of the stalls (`explain`)


class Engine:
    def __init__(self, artifacts, manifest: dict, maps: dict, backend, opts: RunOptions):
        """``artifacts``: the compiled policy, a folder (a path) or an in-memory `api.Bundle`."""
        if isinstance(artifacts, (str, Path)):
            artifacts = Folder(Path(artifacts))
        self.man, self.maps, self.backend, self.opts = manifest, maps, backend, opts
        self.folder = artifacts.name
        self.ids = manifest["ids"]
        self.devices = {d["name"]: d for d in manifest["fabric"]["devices"]}
        self.islands = {i["name"]: i for i in manifest["fabric"]["islands"]}
        self.device_island = {d["name"]: d["island"] for d in manifest["fabric"]["devices"] if d["island"]}
        self.workload = self._workload()
        self.room = self._room(self.workload)     # bytes free in each sized memory; tiers take from it
        self.sim = Sim(opts.max_events)
        self.shims = {}
        if opts.attach:
            verified = {}       # what the verifier found, for a twin island's program
            for name, isl in self.islands.items():
                shim = SHIMS[isl["runtime"]](name, isl["kind"], backend)
                shim.tracer = opts.context_tracer
                if any(p["island"] == name for p in manifest["programs"]):
                    shim.load(artifacts, manifest, maps, verified)
                self.shims[name] = shim
            if opts.lazy_observers:
                mark_observers(self.shims)
        self.gpus = self._gpus()
        self.site = ShimHookSite(manifest, self.shims, self.sim, self.workload.transfer_chunk,
                                 {g: self.workload.prefetch for g in self.gpus}, opts.trace)
        self.fabric = self._fabric()
        self.site.bind(self.fabric)
        dequeue = {p["island"] for p in manifest["programs"] if p["hook"] == "dequeue"} if opts.attach else set()
        self.fabric.watch_dequeue(dequeue, {isl for isl in dequeue if self.shims[isl].watches("dequeue")})
        stack = opts.stack or manifest.get("workload", {}).get("stack") or figures()["defaults"]["stack"]
        self.timing = Timing(self.workload, self.gpus, {g: self.devices[g].get("props", {}) for g in self.gpus},
                             stack)
        self.prefill = None               # the schedule, while `run` runs it
        self.ticks: list[TickSource] = []
        self._tick_deps: dict[tuple, list[TickSource]] = {}
        self._refreshers: dict[tuple, Refresher | None] = {}    # (`_ticks_before_reading`)

    # -- setup ---------------------------------------------------------------------------
    def _workload(self) -> Workload:
        w, o = self.man.get("workload", {}), self.opts

        def pick(option, key, fallback):
            value = option if option is not None else w.get(key, fallback)
            lo, hi = PROP_RANGES[key]
            if type(value) is not int or not lo <= value <= hi:
                raise WorkloadError(f"{key} must be a whole number from {lo} to {hi}, not {value!r}")
            return value
        model = load_model(o.model or w.get("model", "llama3-8b"))
        prompt = pick(o.prompt, "prompt", DEFAULT_PROMPT)
        if o.chunk_tokens is not None and not 1 <= o.chunk_tokens <= prompt:
            raise WorkloadError(f"--chunk must be from 1 to the prompt's {prompt} tokens, not {o.chunk_tokens} "
                                "(leave it out for a prefill in one pass)")
        chunk_tokens = o.chunk_tokens if o.chunk_tokens is not None else w.get("prefill_chunk", 0) or 0
        if type(chunk_tokens) is not int or chunk_tokens < 0:
            raise WorkloadError(f"the prefill chunk must be a whole number of tokens, not {chunk_tokens!r}")
        chunk_tokens = min(chunk_tokens, prompt)      # a declared chunk past a shorter prompt: one pass
        wl = Workload(model, prompt, pick(o.batch, "batch", 1), pick(o.tp, "tp", 1), chunk_tokens,
                      w.get("weights", "hbm"), w.get("kv", "hbm"), w.get("kv_export"),
                      pick(None, "chunk", figures()["defaults"]["transfer_chunk"]),
                      int(w.get("prefetch") or figures()["defaults"]["prefetch"]))
        why = tp_problem(model, wl.tp, [d for d, v in self.devices.items() if v["kind"] == "gpu"])
        if why:
            raise WorkloadError(why)
        for where in (wl.weights, wl.kv):
            if where not in ("hbm", "none") and where not in self.devices:
                raise WorkloadError(f"workload places data on unknown device '{where}'")
        return wl

    def _room(self, wl: Workload) -> Room:
        """Bytes left in each memory that has a size (`CAPACITY_PROP`) once the workload's
        weights and KV cache are in it: "hbm" (each GPU of the TP group: the least of theirs),
        else a device.  Refuses a workload that does not fit."""
        smallest = min(self._gpus(), key=lambda g: self._gpu_figure(g, "hbm"))
        room = {"hbm": self._gpu_figure(smallest, "hbm")}
        for dev, d in self.devices.items():
            prop = CAPACITY_PROP.get(d["kind"])
            size = self._gpu_figure(dev, prop) if prop == "hbm" else self._prop(dev, prop) if prop else None
            if size:
                room[dev] = float(size)
        for where, kept in wl.kept_bytes().items():
            if where not in room:
                continue
            need = sum(kept.values())
            if need > room[where]:
                dev = smallest if where == "hbm" else where
                prop = CAPACITY_PROP[self.devices[dev]["kind"]]
                what = " and ".join(f"{name} ({_gib(n)})" for name, n in kept.items())
                raise WorkloadError(
                    f"the workload does not fit in {dev}: its {what} need {_gib(need)}, more than "
                    f"its {prop} of {_gib(room[where])}; lower the prompt or batch"
                    f"{', raise tp' if where == 'hbm' else ''}, keep them elsewhere, or give {dev} more {prop}")
            room[where] -= need
        group = set(self._gpus())
        return Room({dev: n for dev, n in room.items() if dev not in group}, group)

    def _gpus(self):
        return [d for d, v in self.devices.items() if v["kind"] == "gpu"][: self.workload.tp]

    def _fabric(self) -> Fabric:
        g = DiGraph()
        for link in self.man["fabric"]["links"]:
            u, v = link["src"], link["dst"]
            figure = link_figure(link.get("kind"))
            bw = link["bw"] or self._switch_bw(u, v) or figure["bw"]
            lat = link["latency"] if link["latency"] is not None else figure["latency"]
            lat += self._inside(u)
            g.add_edge(u, v, bw=float(bw), latency=float(lat), kind=link.get("kind"), setup=self._setup(link))
        mem = {n: float(self._prop(n, "bw") or default("cxl_mem")["bw"])
               for n, d in self.devices.items() if d["kind"] == "cxl_mem"}
        dpu = default("dpu")
        wires = {n: (float(self._prop(n, "line_rate") or dpu["line_rate"]), float(dpu["chunk_overhead"]),
                     self._inside(n)) for n, d in self.devices.items() if d["kind"] in ("dpu", "nic")}
        kinds = {n: i["kind"] for n, i in self.islands.items()}
        engines = {n: int(self._gpu_figure(n, "copy_engines")) for n, d in self.devices.items() if d["kind"] == "gpu"}
        host_memory = {n: float(self._prop(n, "dram_bw")) for n, d in self.devices.items()
                       if d["kind"] == "host" and self._prop(n, "dram_bw")}
        return Fabric(self.sim, g, self.device_island, kinds, wires, mem, self.site, engines,
                      self.opts.per_chunk_events, self._evidence, self.opts.trains, host_memory, self.room)

    @property
    def _evidence(self) -> bool:
        """Whether the run records the evidence of its stalls' chains (`explain`): for the
        report, or for the trace's stall flows."""
        return self.opts.explain or self.opts.trace

    @staticmethod
    def _setup(link) -> float:
        """The link's fixed cost per chunk, from the figure of its kind (the default link's for
        one without); none inside a switch, between it and its memory."""
        kind = link.get("kind")
        if kind == "internal":
            return 0.0
        return float(link_figure(kind)["setup"])

    def _inside(self, device) -> float:
        """The time a chunk spends crossing ``device``, added to each link (or wire) it leaves
        by (`figures.time_inside`)."""
        d = self.devices[device]
        return float(time_inside(d["kind"], d.get("props", {})))

    def _switch_bw(self, u, v):
        """What a link between ``u`` and ``v`` that gives no bandwidth takes from a switch at
        either end (its `bw`: each of its ports'), or None."""
        return next((self._prop(d, "bw") for d in (u, v)
                     if self.devices[d]["kind"] == "cxl_switch" and self._prop(d, "bw")), None)

    def _prop(self, device, name):
        return self.devices[device].get("props", {}).get(name)

    def _gpu_figure(self, device, name):
        props = self.devices[device].get("props", {})
        return float(props.get(name) or figures()["gpu"][profile_of(device, props)][name])

    # -- telemetry ticks ----------------------------------------------------------------------
    def _start_ticks(self):
        for island, shim in self.shims.items():
            periods = sorted({p for e in self.man["programs"] if e["island"] == island and e["hook"] == "tick"
                              for p in e.get("tick_periods_ns") or []})
            if not periods or not shim.has("tick"):
                continue
            peers = self.fabric.ports(island)
            servers = [self.fabric.server(island, p) for p in peers]
            peer_ids = [self.ids["devices"].get(p, 0) for p in peers]
            if island in self.fabric.wires:       # a DPU/NIC's network port, after its links: no device
                servers.append(self.fabric.wires[island])
                peer_ids.append(0)
            src = TickSource(shim, island, periods, servers, peer_ids, self.site.spans if self.opts.trace else None,
                             charge=self.sim.charge_ticks)
            self.ticks.append(src)
        self._tick_groups = self._group_ticks()
        for src, group in self._tick_groups.items():
            src.elide = len(group) == 1      # another island's tick may read what a passed-over one wrote
        # the sources caught up on a clock, though nothing reads what they write: at every tick
        # time with ``eager_ticks``; else those whose catch-up grows with the stretch it covers
        self._clocked = [t for t in self.ticks if self.opts.eager_ticks or t.grows]
        if self._clocked:
            self._flush_every = BLOCK * min(t.shortest for t in self._clocked)
            self.sim.at(0, self._tick_clock)
        if self.ticks:
            self.site.before_event, self.site.before_reading = self._ticks_before, self._ticks_before_reading

    def _group_ticks(self) -> dict[TickSource, list[TickSource]]:
        """Each tick source's group: the sources whose programs share a map with it, directly
        or through others.  A group's ticks must run interleaved in time order, since one's
        tick may read what another's wrote; sources alone in their group run in batches."""
        group = {t: (t,) for t in self.ticks}
        for i, a in enumerate(self.ticks):
            for b in self.ticks[i + 1:]:
                if group[a] != group[b] and a.maps & b.maps:
                    merged = tuple(t for t in self.ticks if t in group[a] or t in group[b])
                    for t in merged:
                        group[t] = merged
        return group

    def _catch_up(self, sources, t: float) -> None:
        """Run the ticks due by t of ``sources`` and of every source grouped with them."""
        for group in dict.fromkeys(self._tick_groups[src] for src in sources):
            catch_up_together(group, t)

    def _tick_clock(self):
        """Catch the clocked tick sources up now: at every tick time with ``eager_ticks``, else
        every BLOCK periods though nothing reads what they write yet (running a tick early is
        always allowed), so a catch-up's work stays bounded (`TickSource.grows`)."""
        if self.prefill.finished is None:
            self._catch_up(self._clocked, self.sim.now)
            nxt = self.sim.next_time()
            due = [t.next_due for t in self._clocked if t.active]
            if due and nxt is not None:     # (with no other event the run is over)
                # BLOCK periods on, or at the next event if that is later: the records grow only
                # in events, so a quiet stretch (a long kernel) needs no flush, however long
                self.sim.at(min(due) if self.opts.eager_ticks else max(self.sim.now + self._flush_every, nxt),
                            self._tick_clock)

    def _ticks_before(self, island, hook, movement):
        """Run the pending ticks whose program shares a map with what this event's handlers touch."""
        now = self.sim.now
        deps = self._tick_deps_of(island, hook, movement)
        if any(t.next_due <= now for t in deps):    # (where none is due, nothing the event could see is pending)
            self._catch_up(deps, now)

    def _ticks_before_reading(self, watch: tuple, entries: tuple) -> Refresher | None:
        """What brings the map entries ``entries`` ((map, index) each) that the handlers of
        ``watch`` ((island, hook, movement) each) read up to date, before a time it is given
        (`ticks.Refresher`): one for every decision that reads them.  None where no tick shares
        a map with them."""
        key = (watch, entries)
        if key not in self._refreshers:
            deps = list(dict.fromkeys(t for island, hook, movement in watch
                                      for t in self._tick_deps_of(island, hook, movement)))
            self._refreshers[key] = Refresher(deps, entries, self._catch_up) if deps else None
        return self._refreshers[key]

    def _tick_deps_of(self, island, hook, movement) -> list[TickSource]:
        """The tick sources whose program shares a map with what the hook's handlers touch for
        events of ``movement`` (kept)."""
        key = (island, hook, movement)
        deps = self._tick_deps.get(key)
        if deps is None:
            touched = self.shims[island].maps_for(hook, movement) or frozenset()
            deps = self._tick_deps[key] = [
                t for t in self.ticks
                if not (t.island == island and hook == "tick") and touched & t.maps]
        return deps

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        """Simulate the prefill and return its report."""
        self.simulate()
        return self.report()

    def simulate(self) -> None:
        """Run the prefill to its end (and the ticks due by then), and leave the maps as its
        programs left them: read back from a backend that keeps them elsewhere (the kernel)."""
        self.prefill = Prefill(self, self._prefill_finished, self._evidence)
        self.prefill.place()
        self._start_ticks()
        self.prefill.start()
        with fewer_collections():
            self.sim.run()
        if self.prefill.finished is None:
            raise RuntimeError(f"the prefill did not finish: {self._stuck()}")
        self._catch_up(self.ticks, self.prefill.finished)
        self._run_observers()
        sync = getattr(self.backend, "sync", None)
        if sync is not None:
            sync()

    def _stuck(self) -> str:
        """What a prefill that did not finish left undone (for the internal error's report)."""
        stuck = [t for t in self.fabric.transfers if t.chunks_done < t.chunks_total]
        parts = [f"{len(stuck)} transfer(s) never completed"]
        if stuck:
            t = stuck[0]
            parts[0] += (f" (first: {t.name or t.cls} {t.src} -> {t.dst}, "
                         f"{t.chunks_done} of {t.chunks_total} chunks arrived)")
        for (where, (name, src, dst)), held in self.fabric.coalescing.items():
            place = where if isinstance(where, str) else "issue"       # ("issue", transfer) at a GPU
            parts.append(f"{len(held.chunks)} chunk(s) of {name or 'an undeclared movement'} {src} -> {dst} "
                         f"held for coalescing at {place}")
        return "; ".join(parts)

    def _run_observers(self) -> None:
        """Run what the programs that only watch were given and have not run yet (`observers.Batch`)."""
        for shim in self.shims.values():
            shim.flush()

    def _prefill_finished(self, t: float) -> None:
        for tick in self.ticks:
            tick.end = t                  # no ticks after the prefill's end

    # -- figures ------------------------------------------------------------------------------------
    def report(self) -> dict:
        """The run's report (`stats.collect`), as it stands: after a backend whose maps live
        elsewhere synced them, asking again gives their final contents."""
        from .stats import collect
        return collect(self.record())

    def record(self) -> RunRecord:
        """What the run hands its report and trace (`stats.RunRecord`)."""
        self.site.settle()                 # the chunks standing decisions served
        self._run_observers()               # (a run stopped early, or simulated by hand)
        servers = list(dict.fromkeys([*self.fabric.servers.values(), *self.fabric.wires.values(),
                                      *self.fabric.sources.values()]))
        attached = self.opts.attach
        maps = {name: m.dump(REPORT_ENTRIES) for name, m in sorted(self.maps.items())} if attached else {}
        return RunRecord(
            policy=str(self.folder), backend=self.backend.name, backend_load=self.backend.load_stats() if attached else {},
            workload=self.workload, stack=self.timing.stack.name, gpu=self.timing.timers[self.gpus[0]].gpu.name,
            finished_ns=self.prefill.finished, kv_done_ns=self.prefill.kv_done,
            operator_ms=dict(self.timing.operator_ms), beyond_profile_ms=self.timing.beyond_profile_ms,
            events=self.sim.events, layer_stats=self.prefill.layer_stats,
            stall_by_movement=self.prefill.stall_by_movement, transfers=self.fabric.transfers, servers=servers,
            islands=[s.summary() for s in self.shims.values()], faults=[f for s in self.shims.values() for f in s.faults],
            maps=maps,
            map_full={name: m.full for name, m in sorted(self.maps.items()) if m.full},
            map_entries_past={name: n for name, m in sorted(self.maps.items())     # (a full dump may hold them all)
                              if len(maps.get(name, ())) == REPORT_ENTRIES and (n := m.entry_count()) > REPORT_ENTRIES},
            map_types={m["name"]: (m["kind"], m.get("key_type"), m.get("value_type")) for m in self.man["maps"]},
            record_layouts={m["name"]: m["records"] for m in self.man["maps"] if m.get("records")},
            histograms={m["name"]: m["hist"] for m in self.man["maps"] if m.get("hist")},
            device_names={i: name for name, i in self.ids["devices"].items()},
            copy_engines=[{"name": ce.name, "chunks": ce.chunks, "bytes": ce.bytes}
                          for engines in self.fabric.engines.values() for ce in engines],
            refused=dict(self.fabric.refused), spans=self.site.spans, explain=self._explain(),
            explain_asked=self.opts.explain)

    def _explain(self) -> dict | None:
        """The stalls' root-cause chains, where the run recorded the evidence for them."""
        if not self._evidence:
            return None
        from .explain import chains, summary
        return summary(chains(self.fabric, self.man["programs"], self.prefill.stalls))
