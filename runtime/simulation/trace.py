"""A run as a Chrome/Perfetto trace (`fabric-run --trace`, `api.Report.trace`).

One process per device, named after it, with one row (thread) each for its kernels, the
hook events of its island, its stalls and each link it sends on; the tensor-parallel group's
all-reduces are a process of their own.  A link's slices are its chunks, with the movement,
layer, chunk index, priority and bytes as args; a hook event has the movement, the
decisions its program made and the lines of the handlers that ran.  Counter tracks give
each link's utilisation and the bytes queued at it.  Each stall is a slice with its
root-cause chain as args (docs/explain.md) and flow events to the links and islands the chain
blames.  With a baseline, its run is a second set of processes, named "baseline: ...".

The trace is drawn from a `stats.RunRecord` of a run made with ``trace=True``.
"""
from __future__ import annotations

from .stats import RunRecord, utilisation

BASELINE_PID = 1000         # the baseline's processes are numbered from here
UTIL_BINS = 200             # counter points per link over the run
DEPTH_BINS = 2000
#: the causes a stall's flow points at: to the link's row, or to the island's hook events
FLOW_TO_LINK = ("queued", "bandwidth")
FLOW_TO_HOOKS = ("defer", "rate", "prefetch")
GROUP = "tensor-parallel group"


class _Tracks:
    """Processes (one per device) and their rows, numbered as first used; their names go out
    as metadata events."""

    def __init__(self, events: list, pid_base: int, label: str):
        self.events, self.pid_base, self.label = events, pid_base, label
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}

    def pid(self, device: str) -> int:
        if device not in self.pids:
            self.pids[device] = pid = self.pid_base + len(self.pids) + 1
            self.events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                                "args": {"name": f"{self.label}{device}"}})
        return self.pids[device]

    def row(self, device: str, row: str) -> tuple[int, int]:
        pid = self.pid(device)
        if (device, row) not in self.tids:
            self.tids[device, row] = tid = len(self.tids) + 1
            self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": row}})
        return pid, self.tids[device, row]


def trace(record: RunRecord, baseline: RunRecord | None = None) -> dict:
    """The trace-event JSON of a run (and of its baseline run, if given)."""
    events: list[dict] = []
    _run(events, _Tracks(events, 0, ""), record)
    if baseline is not None:
        _run(events, _Tracks(events, BASELINE_PID, "baseline: "), baseline)
    other = {"ttft_ms": round(record.finished_ns / 1e6, 4)}
    if baseline is not None:
        other["baseline_ttft_ms"] = round(baseline.finished_ns / 1e6, 4)
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}


def _link_row(srv) -> tuple[str, str]:
    device, to = srv.ends
    return device, {"memory": "memory channel", "wire in": "<- wire"}.get(to, f"-> {to}")


def _run(events: list, tracks: _Tracks, r: RunRecord) -> None:
    for track, name, start, dur, args in r.spans:
        if dur:
            pid, tid = tracks.row(track, "kernels")
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": start / 1e3, "dur": dur / 1e3,
                           "cat": "compute", "args": args or {}})
        else:
            pid, tid = tracks.row(track, "hooks")
            events.append({"ph": "i", "pid": pid, "tid": tid, "name": name, "ts": start / 1e3, "s": "t",
                           "cat": "hook", "args": args or {}})
    horizon = max(r.finished_ns, r.kv_done_ns, 1.0)
    for srv in r.servers:
        if not srv.intervals:
            continue
        device, row = _link_row(srv)
        pid, tid = tracks.row(device, row)
        occupants = srv.occupants or [None] * len(srv.intervals)
        for (start, stop, nbytes), who in zip(srv.intervals, occupants):
            args = {"bytes": nbytes}
            if who is not None:
                t, priority, index, _ = who
                args.update(movement=t.name, layer=t.layer, chunk=index, priority=priority)
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": args.get("movement", f"{nbytes >> 10} KiB"),
                           "ts": start / 1e3, "dur": (stop - start) / 1e3, "cat": "transfer", "args": args})
        events.extend(_counters(pid, f"{row} utilisation %", _utilisation(srv.intervals, horizon), "util"))
        if srv.occupants:
            events.extend(_counters(pid, f"{row} queued bytes", _depth(srv, horizon), "bytes"))
    if r.explain is not None:
        links = {srv.name: _link_row(srv) for srv in r.servers}
        events.extend(_stalls(r.explain, tracks, links))


def _counters(pid: int, name: str, points: list[tuple[float, float]], key: str) -> list[dict]:
    return [{"ph": "C", "pid": pid, "tid": 0, "name": name, "ts": t / 1e3, "args": {key: v}} for t, v in points]


def _utilisation(intervals, horizon: float) -> list[tuple[float, float]]:
    """A link's busy share (percent) in UTIL_BINS equal bins of the run (`stats.utilisation`)."""
    width = horizon / UTIL_BINS
    return [(k * width, round(float(u) * 100, 2)) for k, u in enumerate(utilisation(intervals.array(), horizon, UTIL_BINS))]


def _depth(srv, horizon: float) -> list[tuple[float, int]]:
    """The most bytes queued at a link in each of DEPTH_BINS bins, where it changed: each chunk
    counts from its enqueueing to the start of its transmission (`Server.occupants`)."""
    changes = []
    for (start, _, nbytes), (_, _, _, enqueued) in zip(srv.intervals, srv.occupants):
        if start > enqueued:            # (a chunk sent as it came never queued)
            changes += [(enqueued, nbytes), (start, -nbytes)]
    changes.sort(key=lambda c: (c[0], c[1] > 0))      # at one time, what leaves before what comes
    width = horizon / DEPTH_BINS
    peak: dict[int, int] = {}
    queued = 0
    for t, delta in changes:
        queued += delta
        k = min(int(t // width), DEPTH_BINS - 1)
        peak[k] = max(peak.get(k, 0), queued)
    out, last = [], None
    for k in sorted(peak):
        if peak[k] != last:
            out.append((k * width, peak[k]))
            last = peak[k]
    return out


def _stalls(explain: dict, tracks: _Tracks, links: dict[str, tuple[str, str]]) -> list[dict]:
    """Each stall a slice with its chain's steps as args, on its GPU's "stalls" row (the
    group's all-reduce row); for the chains covering the share, a flow from the slice to each
    link or island its steps blame, landing at the middle of the wait."""
    events = []
    for n, c in enumerate(explain["chains"]):
        pid, tid = tracks.row(GROUP, "all-reduce") if c["gpu"] == "all" else tracks.row(c["gpu"], "stalls")
        start, dur = c["start_ms"] * 1e3, c["stall_ms"] * 1e3
        events.append({"ph": "X", "pid": pid, "tid": tid, "name": f"stall: {c['movement']} ({c['kind']})",
                       "ts": start, "dur": dur, "cat": "stall",
                       "args": {s["text"]: f"{s['ms']:.3f} ms" for s in c["steps"]}})
        if n >= explain["chains_covering"]:
            continue
        for k, step in enumerate(s for s in c["steps"] if s["cause"] in FLOW_TO_LINK + FLOW_TO_HOOKS):
            if step["cause"] in FLOW_TO_LINK:
                target = tracks.row(*links[step["where"]]) if step["where"] in links else None
            else:
                target = tracks.row(step["where"], "hooks")
            if target is None:
                continue
            flow = {"name": step["cause"], "cat": "stall", "id": tracks.pid_base * 1000 + n * 100 + k}
            events.append({**flow, "ph": "s", "pid": pid, "tid": tid, "ts": start})
            events.append({**flow, "ph": "f", "bp": "e", "pid": target[0], "tid": target[1], "ts": start + dur / 2})
    return events
