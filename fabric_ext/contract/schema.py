"""What each declaration may say: device, link, workload and movement properties,
map kinds and value types.  The checker validates against these tables and the
runtime's fabric model reads the same names."""
from __future__ import annotations

# the checker refuses larger maps (isa.py holds the machine's limits without importing numpy)
from fabric_ext.runtime.machine.isa import MAX_MAP_BYTES, MAX_TOTAL_MAP_BYTES, map_bytes  # noqa: F401
from fabric_ext.units import BANDWIDTH, COUNT, DEVICE, FLOPS, PERCENT, SIZE, TIME

STRING, NAME, FLAG = "string", "name", "flag"

DEVICE_PROPS: dict[str, dict[str, str]] = {
    "gpu": {"hbm": SIZE, "hbm_bw": BANDWIDTH, "bf16": FLOPS, "copy_engines": COUNT,
            "model": STRING},
    "cxl_switch": {"ports": COUNT, "hop": TIME, "bw": BANDWIDTH},
    "cxl_mem": {"capacity": SIZE, "bw": BANDWIDTH, "latency": TIME},
    "dpu": {"line_rate": BANDWIDTH, "latency": TIME, "mem": SIZE},
    "nic": {"line_rate": BANDWIDTH, "latency": TIME, "mem": SIZE},
    "host": {"dram": SIZE, "dram_bw": BANDWIDTH},
}
LINK_PROPS = {"bw": BANDWIDTH, "latency": TIME, "kind": NAME}
LINK_KINDS = ("pcie", "cxl", "nvlink", "ethernet", "internal")

WORKLOAD_PROPS = {"model": STRING, "prompt": COUNT, "batch": COUNT, "tp": COUNT,
                  "weights": DEVICE, "kv": DEVICE, "kv_export": DEVICE, "chunk": SIZE,
                  "prefill_chunk": COUNT, "prefetch": COUNT, "stack": STRING}
#: workload placements may also name a GPU's own memory
WORKLOAD_MEMORY_WORDS = ("hbm", "none")
#: the kinds of device each workload placement may name: where weights and KV are kept or
#: come in from (a memory, a GPU's HBM, or a DPU or NIC they arrive through), and the DPU or
#: NIC that exports KV to a decode node.  A switch keeps nothing.
WORKLOAD_DEVICE_KINDS = {"weights": ("gpu", "cxl_mem", "host", "dpu", "nic"),
                         "kv": ("gpu", "cxl_mem", "host", "dpu", "nic"),
                         "kv_export": ("dpu", "nic")}


def placement_problem(prop: str, device: str, kind: str) -> str | None:
    """Why the workload's ``prop`` cannot name ``device`` of ``kind`` (None: it can)."""
    kinds = WORKLOAD_DEVICE_KINDS.get(prop)
    if kinds is None or kind in kinds:
        return None
    return f"'{prop}' cannot name {device}, a {kind}: it names a {', '.join(kinds[:-1])} or {kinds[-1]}"

MOVEMENT_PROPS = {"critical": FLAG, "chunk": SIZE}
#: properties the language no longer has, each with what to write instead: they were
#: accepted and changed nothing in a run
REMOVED_PROPS = {
    "pattern": "'pattern' had no effect and is gone: a movement's chunks move as its handlers decide "
               "(size: 'chunk: SIZE'; pace: 'rate = ...'; merge: 'coalesce = ...')",
    "background": "'background' had no effect and is gone: give the movement a low 'priority' in its handlers",
}
#: the values a workload or movement property may take (base units), so that no run is endless:
#: a chunk is at least a page (a 1-byte chunk is ~10^10 events), a prompt at most 2^20 tokens
PROP_RANGES = {"prompt": (1, 1 << 20), "batch": (1, 1 << 16), "tp": (1, 1 << 16),
               "chunk": (4096, 1 << 40), "prefill_chunk": (0, 1 << 20), "prefetch": (1, 1 << 16)}

MAP_KINDS = ("array", "hash", "percpu_array", "percpu_hash", "lru_hash", "ringbuf")
#: histograms a policy declares (`map lat : hist<time>`): an array of counts underneath
HISTOGRAM_KINDS = ("hist", "lhist")
HIST_BUCKETS = 64              # a hist's: bucket k counts values in [2^k, 2^(k+1)), bucket 0 also 0
MAX_LHIST_BUCKETS = 1024
#: integer types and the byte size they are stored in
INT_TYPES = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}     # (no signed ones: values are unsigned)
#: dimension names usable as map key or value types, stored as u64 (device as u32)
DIM_TYPES = {"size": (SIZE, 8), "bandwidth": (BANDWIDTH, 8), "time": (TIME, 8),
             "percent": (PERCENT, 8), "count": (COUNT, 8), "flops": (FLOPS, 8),
             "device": (DEVICE, 4)}
MAX_SOURCE = 1 << 20       # bytes in one .fx file (here, not in the loader: the compiled-policy cache
                           # reads a source for its key without importing the parser)
MAX_ENTRIES = 1 << 20
MAX_DEVICES = 4096              # devices of a fabric
MAX_LOOP_TRIPS = 1024          # bounded loops are unrolled up to this many trips
BUILTINS = ("min", "max")


def type_info(name: str) -> tuple[str | None, int] | None:
    """(dimension, byte size) of a map key/value type name, or None if unknown."""
    if name in INT_TYPES:
        return None, INT_TYPES[name]
    return DIM_TYPES.get(name)
