"""What a `manifest.json` may hold: types, ranges, and every reference resolved.

A policy folder is untrusted input (docs/security.md).  `validate` checks the manifest
before the runtime reads a single field of it: every value has the type and range the
runtime assumes, every name it refers to exists (islands, devices, hooks, maps,
movements), every file it reads is a plain name in the folder listed with its digest,
and no size can make the runtime allocate without bound.  A violation raises
`SchemaError` naming the key (``programs[2].ctx_size``) and what was expected.
"""
from __future__ import annotations

import math
import re

from fabric_ext.runtime.machine.elf import MapSpec, total_problem
from fabric_ext.runtime.machine.errors import ArtifactError
from fabric_ext.runtime.machine.maptypes import KIND_TYPE
from fabric_ext.units import BANDWIDTH, FLOPS, SIZE
from fabric_ext.units import COUNT as COUNT_DIM

from .hooks import DEVICE_ISLAND_KIND, HOOKS, ISLAND_RUNTIME
from .schema import (
    DEVICE_PROPS,
    HIST_BUCKETS,
    HISTOGRAM_KINDS,
    LINK_KINDS,
    MAP_KINDS,
    MAX_ENTRIES,
    PROP_RANGES,
    STRING,
    WORKLOAD_MEMORY_WORDS,
    placement_problem,
)

MAX_ITEMS = 100_000          # no list or object in a manifest is longer
MAX_NS = 10 ** 12            # any period or latency: 1000 s
FILE_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,200}")     # a plain name in the folder
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")


class SchemaError(ArtifactError):
    def __init__(self, key: str, msg: str):
        self.key, self.msg = key, msg
        super().__init__(f"key {key}: {msg}")


# -- value checks: each takes (value, key) and raises SchemaError ------------------------------
def _fail(key, expected, v):
    shown = repr(v)
    raise SchemaError(key, f"expected {expected}, got {shown[:60] + '...' if len(shown) > 60 else shown}")


def integer(lo: int, hi: int):
    def check(v, key):
        if type(v) is not int or not lo <= v <= hi:
            _fail(key, f"an integer in {lo}..{hi}", v)
    return check


def number(lo: float, hi: float, above: bool = False):
    def check(v, key):
        if type(v) not in (int, float) or math.isnan(v) or not (lo < v if above else lo <= v) or v > hi:
            _fail(key, f"a number {'>' if above else '>='} {lo} and <= {hi:g}", v)
    return check


def text(pattern: re.Pattern | None = None, choices=None, max_len: int = 4096):
    def check(v, key):
        if type(v) is not str or len(v) > max_len:
            _fail(key, "a string", v)
        if pattern is not None and not pattern.fullmatch(v):
            _fail(key, f"a name matching {pattern.pattern}", v)
        if choices is not None and v not in choices:
            _fail(key, f"one of {', '.join(choices)}", v)
    return check


def boolean(v, key):
    if type(v) is not bool:
        _fail(key, "true or false", v)


def anything(v, key):
    pass


def nullable(spec):
    def check(v, key):
        if v is not None:
            spec(v, key)
    return check


def list_of(spec, max_items: int = MAX_ITEMS):
    def check(v, key):
        if type(v) is not list or len(v) > max_items:
            _fail(key, f"a list of at most {max_items} items", v)
        for i, x in enumerate(v):
            spec(x, f"{key}[{i}]")
    return check


def _sub(key: str, part: str) -> str:
    return f"{key}.{part}" if key else part


def mapping(value_spec, key_pattern: re.Pattern = NAME):
    def check(v, key):
        if type(v) is not dict or len(v) > MAX_ITEMS:
            _fail(key, "an object", v)
        for k, x in v.items():
            if not key_pattern.fullmatch(k):
                raise SchemaError(_sub(key, k[:40]), f"not a valid name (expected {key_pattern.pattern})")
            value_spec(x, _sub(key, k))
    return check


def record(required: dict, optional: dict | None = None):
    """An object with these keys (others are ignored: a newer compiler may add some)."""
    optional = optional or {}

    def check(v, key):
        if type(v) is not dict:
            _fail(key or "the manifest", "an object", v)
        for k, spec in required.items():
            if k not in v:
                raise SchemaError(_sub(key, k), "missing")
            spec(v[k], _sub(key, k))
        for k, spec in optional.items():
            if k in v:
                spec(v[k], _sub(key, k))
    return check


ID = integer(0, 1 << 31)
PROP_NUMBER = number(0, 1e30)
POSITIVE = number(0, 1e30, above=True)     # a size, bandwidth, rate or count: 0 would be none (the checker's rule)
COUNT = integer(0, 1 << 31)
COUNT64 = integer(0, (1 << 64) - 1)
NAMES = list_of(text(NAME))
HANDLER = record({"movement": nullable(ID), "period": nullable(integer(1, MAX_NS)), "maps": NAMES,
                  "reads": NAMES, "last_wins": boolean},
                 {"map_reads": nullable(list_of(anything)), "per_port": boolean, "line": COUNT, "file": text(),
                  "decides": mapping(list_of(COUNT))})
SCHEMA = record({
    "files": mapping(text(SHA256), FILE_NAME),
    "fabric": record({
        "devices": list_of(record({"name": text(NAME), "kind": text(choices=tuple(DEVICE_ISLAND_KIND)),
                                   "island": nullable(text(NAME))},
                                  {"id": ID, "props": mapping(anything)})),
        "links": list_of(record({"src": text(NAME), "dst": text(NAME),
                                 "bw": nullable(number(0, 1e18, above=True)),
                                 "latency": nullable(number(0, MAX_NS))},
                                {"kind": nullable(text(choices=LINK_KINDS))})),
        "islands": list_of(record({"name": text(NAME), "kind": text(choices=tuple(ISLAND_RUNTIME)),
                                   "runtime": text(choices=tuple(sorted(set(ISLAND_RUNTIME.values()))))},
                                  {"devices": NAMES})),
    }),
    "movements": list_of(record({
        "name": text(NAME), "class": text(NAME), "operator": nullable(text(NAME)), "id": integer(1, 1 << 31),
        "flows": list_of(record({"src": text(NAME), "dst": text(NAME), "path": NAMES})),
    }, {"chunk": nullable(integer(*PROP_RANGES["chunk"])), "critical": boolean,
        "islands": NAMES})),
    "programs": list_of(record({
        "island": text(NAME), "hook": text(NAME), "object": text(FILE_NAME), "symbol": text(NAME),
        "ctx_size": integer(1, 1 << 16),
    }, {"section": text(), "insns": COUNT, "tick_periods_ns": list_of(integer(1, MAX_NS), 64),
        "handlers": nullable(list_of(HANDLER))})),
    "maps": list_of(record({"name": text(NAME), "kind": text(choices=MAP_KINDS), "key_size": integer(0, 512),
                            "value_size": integer(0, 1 << 26), "max_entries": integer(1, max(MAX_ENTRIES, 1 << 26))},
                           {"islands": NAMES, "shared": boolean, "key_type": nullable(text()),
                            "value_type": nullable(text()), "records": list_of(record(
                                {"line": COUNT, "fields": list_of(record({"name": text(max_len=256)},
                                                                         {"dim": nullable(text(max_len=64))}), 64)})),
                            "hist": record({"kind": text(choices=HISTOGRAM_KINDS), "dim": nullable(text(max_len=64))},
                                           {"lo": COUNT64, "hi": COUNT64, "step": COUNT64})})),
    "ids": record({what: mapping(ID) for what in ("movements", "devices", "islands")},
                  {what: mapping(ID) for what in ("classes", "operators")}),
}, {
    "workload": record({}, {
        "model": text(max_len=1024), "stack": text(max_len=256), "weights": text(), "kv": text(),
        "kv_export": nullable(text()),
        "prefill_chunk": integer(0, PROP_RANGES["prompt"][1]),
        **{p: integer(*PROP_RANGES[p]) for p in ("prompt", "batch", "tp", "chunk", "prefetch")}}),
    "sources": list_of(record({"file": text(), "path": text(), "sha256": text(SHA256)})),
    "line_map": mapping(list_of(record({"insn": COUNT, "file": text(), "line": COUNT, "col": COUNT}))),
    "hooks": mapping(anything),
    "params": mapping(number(0, float(1 << 64))),
    "bpftime_shm": record({"name": text(NAME), "islands": NAMES}),
})


# -- references ---------------------------------------------------------------------------------
def _unique(items, key: str) -> dict:
    out = {}
    for i, x in enumerate(items):
        if x["name"] in out:
            raise SchemaError(f"{key}[{i}].name", f"'{x['name']}' is declared twice")
        out[x["name"]] = x
    return out


def _known(name, names, key, what):
    if name not in names:
        raise SchemaError(key, f"'{name}' is not a {what} of this manifest")


def _references(man: dict) -> None:
    fabric = man["fabric"]
    devices = _unique(fabric["devices"], "fabric.devices")
    islands = _unique(fabric["islands"], "fabric.islands")
    maps = _unique(man["maps"], "maps")
    movements = {m["id"] for m in man["movements"]}
    files = man["files"]
    for i, d in enumerate(fabric["devices"]):
        if d["island"] is not None:
            _known(d["island"], islands, f"fabric.devices[{i}].island", "island")
        kinds = DEVICE_PROPS.get(d["kind"], {})
        for name, value in d.get("props", {}).items():       # the engine reads them as numbers
            if name in kinds:
                check = text() if kinds[name] == STRING else POSITIVE if kinds[name] in (SIZE, BANDWIDTH, FLOPS, COUNT_DIM) \
                    else PROP_NUMBER
                check(value, f"fabric.devices[{i}].props.{name}")
    linked = set()
    for i, link in enumerate(fabric["links"]):
        for end in ("src", "dst"):
            _known(link[end], devices, f"fabric.links[{i}].{end}", "device")
        if (link["src"], link["dst"]) in linked:    # (the engine keeps one link a direction)
            raise SchemaError(f"fabric.links[{i}]", f"a second link from '{link['src']}' to '{link['dst']}'")
        linked.add((link["src"], link["dst"]))
    for i, isl in enumerate(fabric["islands"]):
        if ISLAND_RUNTIME[isl["kind"]] != isl["runtime"]:
            raise SchemaError(f"fabric.islands[{i}].runtime", f"a {isl['kind']} island runs on "
                              f"{ISLAND_RUNTIME[isl['kind']]}, not {isl['runtime']}")
        for j, d in enumerate(isl.get("devices", [])):
            _known(d, devices, f"fabric.islands[{i}].devices[{j}]", "device")
    for i, m in enumerate(man["movements"]):
        for j, f in enumerate(m["flows"]):
            for end in ("src", "dst"):
                _known(f[end], devices, f"movements[{i}].flows[{j}].{end}", "device")
            key = f"movements[{i}].flows[{j}].path"
            for k, d in enumerate(f["path"]):
                _known(d, devices, f"{key}[{k}]", "device")
            if f["path"][:1] != [f["src"]] or f["path"][-1:] != [f["dst"]]:
                raise SchemaError(key, f"a path from '{f['src']}' to '{f['dst']}' must start and end there")
            for k, hop in enumerate(zip(f["path"], f["path"][1:])):
                if hop not in linked:
                    raise SchemaError(f"{key}[{k + 1}]", f"no link from '{hop[0]}' to '{hop[1]}' in fabric.links")
    for i, p in enumerate(man["programs"]):
        key = f"programs[{i}]"
        _known(p["island"], islands, f"{key}.island", "island")
        isl = islands[p["island"]]
        hook = HOOKS.get((isl["kind"], p["hook"]))
        if hook is None:
            raise SchemaError(f"{key}.hook", f"{isl['kind']} islands have no hook '{p['hook']}'")
        if p["ctx_size"] != hook.ctx_size:
            raise SchemaError(f"{key}.ctx_size", f"{isl['kind']}.{p['hook']} has a {hook.ctx_size}-byte "
                              f"context, not {p['ctx_size']} (compiled by another version?)")
        runtime_json = f"{p['island']}.{isl['runtime']}.json"
        for what, name in (("object", p["object"]), ("runtime artifact", runtime_json)):
            if name not in files:
                raise SchemaError(f"{key}.object" if what == "object" else "files",
                                  f"the {what} {name} is not listed in files (with its sha256)")
        for j, h in enumerate(p.get("handlers") or []):
            if h["movement"] is not None:
                _known(h["movement"], movements, f"{key}.handlers[{j}].movement", "movement id")
            for k, name in enumerate(h["maps"]):
                _known(name, maps, f"{key}.handlers[{j}].maps[{k}]", "map")
    total = 0
    for i, m in enumerate(man["maps"]):
        spec = MapSpec(m["name"], KIND_TYPE[m["kind"]], m["key_size"], m["value_size"], m["max_entries"])
        total += spec.bytes
        why = spec.problem() or total_problem(total)
        if why:
            raise SchemaError(f"maps[{i}]", why)
        for j, name in enumerate(m.get("islands", [])):
            _known(name, islands, f"maps[{i}].islands[{j}]", "island")
        if "hist" in m:
            why = _histogram_problem(m)
            if why:
                raise SchemaError(f"maps[{i}].hist", why)
    for what, names in (("devices", devices), ("islands", islands)):
        for name in man["ids"][what]:
            _known(name, names, f"ids.{what}.{name}", what[:-1])
    w = man.get("workload", {})
    for where in ("weights", "kv", "kv_export"):
        v = w.get(where)
        if v is not None and v not in WORKLOAD_MEMORY_WORDS:
            _known(v, devices, f"workload.{where}", "device")
            why = placement_problem(where, v, devices[v]["kind"])
            if why:
                raise SchemaError(f"workload.{where}", why)


def _histogram_problem(m: dict) -> str | None:
    """Why a map's histogram layout cannot be the one its compiler wrote (None if it can): an
    array of u64 counts, 64 buckets for a hist, one per step and two more for an lhist."""
    h = m["hist"]
    if m["kind"] != "array" or m["key_size"] != 4 or m["value_size"] != 8:
        return "a histogram is an array of u64 counts with u32 keys"
    if h["kind"] == "hist":
        return None if m["max_entries"] == HIST_BUCKETS else f"a hist has {HIST_BUCKETS} buckets"
    if not all(k in h for k in ("lo", "hi", "step")):
        return "an lhist needs lo, hi and step"
    lo, hi, step = h["lo"], h["hi"], h["step"]
    if hi <= lo or step < 1 or (hi - lo) % step or m["max_entries"] != (hi - lo) // step + 2:
        return f"lhist bounds {lo}..{hi} by {step} do not make its {m['max_entries']} buckets"
    return None


def validate(man) -> None:
    """Raise `SchemaError` unless ``man`` (parsed JSON) is a manifest the runtime can run."""
    SCHEMA(man, "")
    _references(man)
