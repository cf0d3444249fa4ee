"""A check of a trace against the Trace Event Format that Perfetto and chrome://tracing read:
the fields each phase needs, names for every process and thread used, slices that nest on
each thread, and flows whose two ends pair."""
from collections import defaultdict

PHASES = {"X", "i", "M", "C", "s", "f"}
EPS = 1e-6      # us: what rounding to the ns may leave between slices that touch


def check_trace(trace: dict) -> None:
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["displayTimeUnit"] in ("ns", "ms")
    processes, threads, slices, flows = set(), set(), defaultdict(list), defaultdict(list)
    for e in events:
        assert e["ph"] in PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str), e
            (processes if e["name"] == "process_name" else threads).add(
                e["pid"] if e["name"] == "process_name" else (e["pid"], e["tid"]))
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            slices[e["pid"], e["tid"]].append(e)
        elif e["ph"] == "i":
            assert e["s"] in ("t", "p", "g"), e
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            flows[e["id"]].append(e)
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i", "s", "f")}
    assert {pid for pid, _ in used} | {e["pid"] for e in events if e["ph"] == "C"} <= processes
    assert used <= threads, used - threads
    for track, xs in slices.items():        # each slice ends before the next begins, or holds it
        open_ends: list[float] = []
        for x in sorted(xs, key=lambda x: (x["ts"], -x["dur"])):
            while open_ends and open_ends[-1] <= x["ts"] + EPS:
                open_ends.pop()
            assert not open_ends or x["ts"] + x["dur"] <= open_ends[-1] + EPS, (track, x)
            open_ends.append(x["ts"] + x["dur"])
    for fid, ends in flows.items():
        assert sorted(e["ph"] for e in ends) == ["f", "s"], (fid, ends)
        s, f = sorted(ends, key=lambda e: e["ph"] != "s")
        assert (s["name"], s["cat"]) == (f["name"], f["cat"]) and f["ts"] >= s["ts"] and f["bp"] == "e"
        assert any(x["ts"] - EPS <= s["ts"] <= x["ts"] + x["dur"] + EPS for x in slices[s["pid"], s["tid"]]), s
