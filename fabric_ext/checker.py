"""Pass 3: check declarations (`check_declarations`) and handler bodies (`check_handler`).

Reports undefined and duplicate names (with "did you mean"), wrong kinds,
dimension errors, map type mismatches, writes to read-only context fields and
unbounded loops.  Event resolution and placement (which need the movement
graph) live in placement.py; this pass checks what each statement means for
the hooks its handler was placed on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from . import ast as A
from .contract import schema as S
from .contract.hooks import CLASSES, DEVICE_ISLAND_KIND, MAX_PRIORITY, OPERATORS, Hook
from .diagnostics import Diagnostics, closest, did_you_mean
from .loader import Program
from .units import (
    BANDWIDTH,
    BASE_UNIT,
    BOOL,
    COUNT,
    DEVICE,
    DIM_ARITH,
    DIM_NAMES,
    FLOPS,
    PERCENT,
    SIZE,
    TIME,
    exact_of,
    format_quantity,
)

_SCALAR = (None, COUNT)


def compatible(a: str | None, b: str | None) -> bool:
    return a == b or a is None or b is None or (a in _SCALAR and b in _SCALAR)


def dim_name(d: str | None) -> str:
    return DIM_NAMES.get(d, d or "a plain number")


@dataclass
class MapInfo:
    decl: A.MapDecl
    kind: str
    key_dim: str | None = None
    key_size: int = 4
    value_dim: str | None = None
    value_size: int = 8
    max_entries: int = 1
    records: list = field(default_factory=list)    # a ringbuf's: each emit's line and fields (`s_Emit`)
    hist: dict | None = None    # a histogram's: {"kind": hist|lhist, "dim", and an lhist's "lo", "hi", "step"}


@dataclass
class Symbols:
    """Declarations by name, after the declaration checks."""
    devices: dict[str, A.Device] = field(default_factory=dict)
    movements: dict[str, A.Movement] = field(default_factory=dict)
    maps: dict[str, MapInfo] = field(default_factory=dict)
    workload: A.Workload | None = None
    fabric: A.Fabric | None = None

    def island_kind(self, device: str) -> str | None:
        d = self.devices.get(device)
        return DEVICE_ISLAND_KIND.get(d.kind) if d else None


M64 = (1 << 64) - 1
#: the language's operators on constants: unsigned 64-bit, subtraction stops at 0, x / 0 = 0, x % 0 = x.
#: The checker folds with it, and so does the code generator (codegen/lower.py).
CONST_OPS = {
    "+": lambda a, b: (a + b) & M64, "-": lambda a, b: max(a - b, 0), "*": lambda a, b: (a * b) & M64,
    "/": lambda a, b: a // b if b else 0, "%": lambda a, b: a % b if b else a,
    "&": lambda a, b: a & b, "|": lambda a, b: a | b, "^": lambda a, b: a ^ b,
    "<<": lambda a, b: (a << (b & 63)) & M64, ">>": lambda a, b: a >> (b & 63),
    "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b), "<": lambda a, b: int(a < b),
    ">": lambda a, b: int(a > b), "<=": lambda a, b: int(a <= b), ">=": lambda a, b: int(a >= b),
    "&&": lambda a, b: int(bool(a) and bool(b)), "||": lambda a, b: int(bool(a) or bool(b)),
}


COMPARISONS = frozenset({"==", "!=", "<", ">", "<=", ">="})


def exact_value(e: A.Node) -> Fraction | None:
    """The exact value of a constant expression in its base unit (a fraction: 1MiB / 3ms is
    349525333333 1/3 B/s), or None if it depends on run-time data.  Sums, differences (stopping
    at 0), products, quotients and comparisons are exact, dimensioned ones scaled
    (`BinOp.scale`); bitwise operators and shifts take whole numbers; x / 0 is 0 and x % 0 is x."""
    if isinstance(e, A.Num):
        return exact_of(e.value)
    if isinstance(e, A.Call) and e.func.name in ("min", "max") and e.args:
        vals = [exact_value(a) for a in e.args]
        return None if None in vals else (min if e.func.name == "min" else max)(vals)
    if not isinstance(e, A.BinOp):
        return None
    a, b = exact_value(e.left), exact_value(e.right)
    if a is None or b is None:
        return None
    op = e.op
    if op == "+":
        return a + b
    if op == "-":
        return max(a - b, Fraction(0))
    if op == "*":
        return a * b * e.scale
    if op == "/":
        return a / b * e.scale if b else Fraction(0)
    if op == "%":
        return a % b if b else a
    if op in COMPARISONS:           # of the exact values: 80% < 80.5% holds
        return Fraction(CONST_OPS[op](a, b))
    return Fraction(CONST_OPS[op](math.floor(a), math.floor(b)))


def const_value(e: A.Node) -> int | None:
    """The value of a constant expression as the program holds it (rounded down to a whole
    number), or None if it depends on run-time data."""
    v = exact_value(e)
    return None if v is None else math.floor(v)


# ---- declarations ---------------------------------------------------------------------
def _check_props(props, table, what, diags, devices=None, positive=False):
    """Each property of ``props`` known to ``table`` and of its kind; ``positive``: a size,
    bandwidth, compute rate or count is more than 0, and a count whole (a device's or a
    link's: 0 would mean no memory, no bandwidth, no engine, where leaving it out means the
    default)."""
    seen = {}
    for p in props:
        name = p.name.name
        if name in seen:
            diags.error(p.name.span, f"duplicate property '{name}' in {what}")
            continue
        seen[name] = p
        kind = table.get(name)
        if kind is None and table is S.MOVEMENT_PROPS and name in S.REMOVED_PROPS:
            diags.error(p.name.span, f"{what} has no property '{name}'", S.REMOVED_PROPS[name])
            continue
        if kind is None:
            diags.error(p.name.span, f"{what} has no property '{name}'",
                        did_you_mean(name, table) or "known: " + ", ".join(table))
            continue
        v = p.value
        if kind == S.FLAG:
            if v is not None:
                diags.error(p.span, f"'{name}' is a flag and takes no value", f"write just '{name}'")
        elif v is None:
            diags.error(p.span, f"property '{name}' needs a value")
        elif kind == S.STRING:
            if not isinstance(v, A.Str):
                diags.error(v.span, f"'{name}' must be a string in double quotes")
        elif kind in (S.NAME, DEVICE):
            if not isinstance(v, A.Name):
                diags.error(v.span, f"'{name}' must be a name")
            elif kind == DEVICE and devices is not None and v.id not in devices \
                    and v.id not in S.WORKLOAD_MEMORY_WORDS:
                diags.error(v.span, f"unknown device '{v.id}'", did_you_mean(v.id, devices))
            elif kind == DEVICE and devices is not None and v.id in devices:
                why = S.placement_problem(name, v.id, devices[v.id].kind)
                if why:
                    diags.error(v.span, why)
        elif not isinstance(v, A.Num):
            diags.error(v.span, f"'{name}' must be {dim_name(kind)}")
        elif not compatible(v.dim, kind):
            diags.error(v.span, f"'{name}' must be {dim_name(kind)}, not {dim_name(v.dim)}",
                        _unit_hint(kind))
        elif name in S.PROP_RANGES:
            lo, hi = S.PROP_RANGES[name]
            if v.value != int(v.value) or not lo <= v.value <= hi:
                diags.error(v.span, f"'{name}' must be a whole {dim_name(kind)[2:]} from "
                            f"{format_quantity(lo, kind)} to {format_quantity(hi, kind)}")
        elif positive and kind in (SIZE, BANDWIDTH, FLOPS, COUNT) and \
                (v.value <= 0 or (kind == COUNT and v.value != int(v.value))):
            diags.error(v.span, f"'{name}' of {what} must be {'a whole number' if kind == COUNT else 'more than 0'}"
                        f"{' from 1' if kind == COUNT else ''}, not {format_quantity(v.value, kind)}",
                        "leave it out for the default (runtime/simulation/data/figures.json)")
    return seen


def _unit_hint(dim):
    return {SIZE: "write it with a size unit, e.g. 256KiB", BANDWIDTH: "write it with a bandwidth unit, e.g. 16GB/s",
            TIME: "write it with a time unit, e.g. 5us", PERCENT: "write it as a percentage, e.g. 80%"}.get(dim)


def _check_fabric(prog: Program, sym: Symbols, diags: Diagnostics) -> None:
    if len(prog.fabrics) > 1:
        for f in prog.fabrics[1:]:
            diags.error(f.name.span, f"a second fabric '{f.name.name}'; a program has one fabric",
                        f"the first is '{prog.fabrics[0].name.name}' at {prog.fabrics[0].name.span}")
    if not prog.fabrics:
        return
    fab = sym.fabric = prog.fabrics[0]
    if len(fab.devices) > S.MAX_DEVICES:
        d = fab.devices[S.MAX_DEVICES]
        diags.error(d.name.span, f"the fabric declares {len(fab.devices):,} devices; a fabric has at most "
                    f"{S.MAX_DEVICES:,} (each is routed, and each of its own islands compiles an object)",
                    "model a part of the fabric, or one of many identical parts")
        del fab.devices[S.MAX_DEVICES:]     # (the rest checked as they are, without more errors)
    for d in fab.devices:
        if d.name.name in sym.devices:
            diags.error(d.name.span, f"duplicate device '{d.name.name}'",
                        f"first declared at {sym.devices[d.name.name].name.span}")
            continue
        sym.devices[d.name.name] = d
    for d in fab.devices:
        _check_props(d.props, S.DEVICE_PROPS[d.kind], f"a {d.kind}", diags, positive=True)
        if d.kind == "cxl_mem":
            if d.at is None:
                diags.error(d.name.span, f"cxl_mem '{d.name.name}' must say which switch it is attached to",
                            f"write 'cxl_mem {d.name.name} at SWITCH'")
            elif d.at.name not in sym.devices:
                diags.error(d.at.span, f"unknown device '{d.at.name}'", did_you_mean(d.at.name, sym.devices))
            elif sym.devices[d.at.name].kind != "cxl_switch":
                diags.error(d.at.span, f"'{d.at.name}' is a {sym.devices[d.at.name].kind}, not a cxl_switch",
                            "switch-local memory attaches to a cxl_switch")
        elif d.at is not None:
            diags.error(d.at.span, f"only cxl_mem devices take 'at'; '{d.name.name}' is a {d.kind}")
    declared = {}          # (from, to) -> the link that declared that direction first
    for link in fab.links:
        for end in (link.a, link.b):
            if end.name not in sym.devices:
                diags.error(end.span, f"link to unknown device '{end.name}'", did_you_mean(end.name, sym.devices))
        if link.a.name == link.b.name:
            diags.error(link.span, f"link from '{link.a.name}' to itself")
        ways = [(link.a.name, link.b.name)] + ([(link.b.name, link.a.name)] if link.bidir else [])
        first = next((declared[w] for w in ways if w in declared), None)
        if first is not None:       # one link per direction: a second would silently replace the first
            diags.error(link.span, f"a second link from '{link.a.name}' to '{link.b.name}'",
                        f"the first is at {first.span}; give one link the bandwidth of both")
        for w in ways:
            declared.setdefault(w, link)
        props = _check_props(link.props, S.LINK_PROPS, "a link", diags, positive=True)
        kind = props.get("kind")
        if kind is not None and isinstance(kind.value, A.Name) and kind.value.id not in S.LINK_KINDS:
            diags.error(kind.value.span, f"unknown link kind '{kind.value.id}'",
                        did_you_mean(kind.value.id, S.LINK_KINDS) or "kinds: " + ", ".join(S.LINK_KINDS))
    _check_switch_ports(fab, declared, diags)


def _check_switch_ports(fab, declared: dict, diags: Diagnostics) -> None:
    """A switch with ``ports: N`` links at most N devices (its memories included)."""
    for d in fab.devices:
        ports = next((p for p in d.props if p.name.name == "ports"), None) if d.kind == "cxl_switch" else None
        n = const_value(ports.value) if ports is not None else None
        if n is None or n < 1:      # (no ports at all: `_check_props`)
            continue
        peers = {b for a, b in declared if a == d.name.name} | {a for a, b in declared if b == d.name.name} | \
            {m.name.name for m in fab.devices if m.kind == "cxl_mem" and m.at is not None and m.at.name == d.name.name}
        if len(peers) > n:
            diags.error(ports.value.span, f"switch '{d.name.name}' has {int(n)} ports but links {len(peers)} "
                        f"device{'s' * (len(peers) != 1)} ({', '.join(sorted(peers))})", f"give it 'ports: {len(peers)}' or more, or fewer links")


def _check_workload(prog: Program, sym: Symbols, diags: Diagnostics) -> None:
    for w in prog.workloads[1:]:
        diags.error(w.name.span, f"a second workload '{w.name.name}'; a program has one workload")
    if prog.workloads:
        sym.workload = prog.workloads[0]
        _check_props(sym.workload.props, S.WORKLOAD_PROPS, "a workload", diags, sym.devices)


def _check_pattern(p: A.Pattern, sym: Symbols, diags: Diagnostics) -> bool:
    if any(p.matches(n) for n in sym.devices):
        return True
    if p.wildcard:
        diags.error(p.span, f"pattern '{p}' matches no device",
                    "devices: " + ", ".join(sym.devices) if sym.devices else "declare a fabric first")
    else:
        diags.error(p.span, f"unknown device '{p.name}'", did_you_mean(p.name, sym.devices))
    return False


def _check_movements(prog: Program, sym: Symbols, diags: Diagnostics) -> None:
    for m in prog.movements:
        name = m.name.name
        if name in sym.movements:
            diags.error(m.name.span, f"duplicate movement '{name}'",
                        f"first declared at {sym.movements[name].name.span}")
            continue
        if name in sym.devices:
            diags.error(m.name.span, f"movement '{name}' has the name of a device")
            continue
        ok = True
        if m.cls.name not in CLASSES:
            diags.error(m.cls.span, f"unknown data class '{m.cls.name}'",
                        did_you_mean(m.cls.name, CLASSES) or "classes: " + ", ".join(CLASSES))
        if m.operator is not None and m.operator.name not in OPERATORS:
            diags.error(m.operator.span, f"unknown operator '{m.operator.name}'",
                        did_you_mean(m.operator.name, OPERATORS) or "operators: " + ", ".join(OPERATORS))
        for p in (m.src, m.dst, *m.via):
            ok &= _check_pattern(p, sym, diags)
        _check_props(m.props, S.MOVEMENT_PROPS, "a movement", diags)
        if ok:
            sym.movements[name] = m


def _check_maps(prog: Program, sym: Symbols, diags: Diagnostics) -> None:
    for m in prog.maps:
        name = m.name.name
        if name in sym.maps:
            diags.error(m.name.span, f"duplicate map '{name}'", f"first declared at {sym.maps[name].decl.name.span}")
            continue
        kind = m.kind.name
        if kind in S.HISTOGRAM_KINDS:
            sym.maps[name] = _check_histogram(m, diags)
            continue
        if kind not in S.MAP_KINDS:
            kinds = S.MAP_KINDS + S.HISTOGRAM_KINDS
            diags.error(m.kind.span, f"unknown map kind '{kind}'", did_you_mean(kind, kinds) or "kinds: " + ", ".join(kinds))
            continue
        if len(m.params) > 1:
            diags.error(m.params[1].span, f"a {kind} map takes one size in its brackets, its entries",
                        f"write 'map {name} : {kind}<...>[64]'")
        info = MapInfo(m, kind)
        if kind == "ringbuf":
            if m.key_type is not None:
                diags.error(m.key_type.span, "a ringbuf has no key or value type",
                            f"write 'map {name} : ringbuf[64KiB]'")
            size = m.max_entries.value if m.max_entries else 0
            if not size or size < 4096 or size & (size - 1) or int(size) % 4096:
                diags.error((m.max_entries or m.kind).span,
                            "a ringbuf needs a size that is a power of two and at least 4KiB",
                            f"write 'map {name} : ringbuf[64KiB]'")
            elif size > S.MAX_MAP_BYTES:
                diags.error(m.max_entries.span, f"ringbuf '{name}' is too large: {int(size):,} bytes",
                            f"at most {S.MAX_MAP_BYTES // 2**20} MiB per map")
                size = 0
            info.key_size, info.value_size, info.max_entries = 0, 0, int(size or 4096)
            sym.maps[name] = info
            continue
        if m.key_type is None or m.value_type is None:
            diags.error((m.key_type or m.kind).span, f"map '{name}' needs key and value types",
                        f"write 'map {name} : {kind}<u32, u64>[N]'")
            # still a map (u32 to u64, of its size or the largest): its uses are checked without
            # more errors about it
            n = m.max_entries.value if m.max_entries else None
            info.max_entries = n if isinstance(n, int) and 0 < n <= S.MAX_ENTRIES else S.MAX_ENTRIES
            sym.maps[name] = info
            continue
        for t, role in ((m.key_type, "key"), (m.value_type, "value")):
            ti = S.type_info(t.name)
            if ti is None and t.name in ("i8", "i16", "i32", "i64"):
                diags.error(t.span, f"a map holds no signed values: the language's values are unsigned "
                                    f"(subtraction stops at 0), so '{t.name}' would hold what 'u{t.name[1:]}' does",
                            f"write 'u{t.name[1:]}'")
                ti = (None, S.INT_TYPES.get(f"u{t.name[1:]}", 8))
            elif ti is None:
                diags.error(t.span, f"unknown {role} type '{t.name}'",
                            did_you_mean(t.name, list(S.INT_TYPES) + list(S.DIM_TYPES)))
                ti = (None, 8)
            if role == "key":
                info.key_dim, info.key_size = ti
            else:
                info.value_dim, info.value_size = ti
        if kind in ("array", "percpu_array") and info.key_size != 4:
            diags.error(m.key_type.span, f"an {kind} map is indexed by a u32 key, not '{m.key_type.name}'",
                        f"write '{kind}<u32, {m.value_type.name}>'")
        if m.max_entries is None:
            diags.error(m.name.span, f"map '{name}' needs a size", f"write 'map {name} : {kind}<...>[64]'")
        else:
            n = m.max_entries.value
            if m.max_entries.dim is not None or not isinstance(n, int) or n < 1:
                diags.error(m.max_entries.span, "map size must be a positive whole number of entries")
            elif n > S.MAX_ENTRIES or n * (info.key_size + info.value_size) > S.MAX_MAP_BYTES:
                diags.error(m.max_entries.span,
                            f"map '{name}' is too large: {n} entries of {info.key_size + info.value_size} bytes",
                            f"at most {S.MAX_ENTRIES} entries and {S.MAX_MAP_BYTES // 2**20} MiB per map")
            else:
                info.max_entries = n
        sym.maps[name] = info
    total = 0
    for info in sym.maps.values():
        total += S.map_bytes(info.kind == "ringbuf", info.key_size, info.value_size, info.max_entries)
        if total > S.MAX_TOTAL_MAP_BYTES:
            decl = info.decl
            diags.error((decl.max_entries or decl.name).span,
                        f"the maps up to '{decl.name.name}' take {total:,} bytes together",
                        f"at most {S.MAX_TOTAL_MAP_BYTES >> 20} MiB for all the maps of a policy: make some smaller")
            break


def _check_histogram(m: A.MapDecl, diags: Diagnostics) -> MapInfo:
    """``hist<DIM>`` (log2 buckets) or ``lhist<DIM>[MIN, MAX, STEP]`` (linear): an array of
    u64 counts, one per bucket (an lhist's first for below MIN, its last for MAX and above).
    A declaration in error still gives its map, so that its uses are checked without more
    errors about it."""
    name, kind = m.name.name, m.kind.name
    example = f"map {name} : hist<time>" if kind == "hist" else f"map {name} : lhist<size>[0, 64KiB, 4KiB]"
    ti = S.type_info(m.key_type.name) if m.key_type is not None else None
    info = MapInfo(m, "array", key_dim=COUNT, value_dim=COUNT, hist={"kind": kind, "dim": ti[0] if ti else None})
    if m.key_type is None or m.value_type is not None or ti is None:
        diags.error((m.value_type or m.key_type or m.kind).span,
                    f"a {kind} has one type: the dimension of what it counts", f"write '{example}'")
        return info
    if kind == "hist":
        if m.params:
            diags.error(m.params[0].span, "a hist has 64 buckets, one per power of two; it takes no size",
                        f"write '{example}'")
        info.max_entries = S.HIST_BUCKETS
        return info
    if len(m.params) != 3:
        diags.error((m.params[0] if m.params else m.kind).span, "an lhist needs its lowest value, its highest "
                    "and the width of a bucket", f"write '{example}'")
        return info
    for p in m.params:
        if not compatible(p.dim, ti[0]) or not isinstance(p.value, int) or p.value < 0:
            diags.error(p.span, f"'{p.text}' is no bound for an lhist that counts {dim_name(ti[0])}",
                        f"its bounds are whole values of that dimension: write '{example}'")
            return info
    lo, hi, step = (p.value for p in m.params)
    if hi <= lo or step < 1 or (hi - lo) % step:
        diags.error(m.params[0].span, f"lhist bounds [{', '.join(p.text for p in m.params)}]: the highest must be "
                    "above the lowest by a whole number of steps", f"write '{example}'")
        return info
    if (hi - lo) // step > S.MAX_LHIST_BUCKETS:
        diags.error(m.params[2].span, f"an lhist of {(hi - lo) // step} buckets is too large",
                    f"at most {S.MAX_LHIST_BUCKETS}: use a wider step")
        return info
    info.hist |= {"lo": lo, "hi": hi, "step": step}
    info.max_entries = (hi - lo) // step + 2
    return info


def check_declarations(prog: Program, diags: Diagnostics) -> Symbols:
    """Check fabric, workload, movements and maps; return the symbol tables."""
    sym = Symbols()
    _check_fabric(prog, sym, diags)
    _check_workload(prog, sym, diags)
    _check_movements(prog, sym, diags)
    _check_maps(prog, sym, diags)
    if prog.policies and not prog.fabrics:
        diags.error(prog.policies[0].name.span, "policy without a fabric",
                    'declare a fabric or import one, e.g. import "fabrics/dgx_cxl.fx"')
    names: dict[str, A.Policy] = {}
    for p in prog.policies:
        if p.name.name in names:
            diags.error(p.name.span, f"duplicate policy '{p.name.name}'",
                        f"first declared at {names[p.name.name].name.span}")
        names[p.name.name] = p
    return sym


# ---- handler bodies ------------------------------------------------------------------
class BodyChecker:
    """Checks the statements of one handler against the hooks it is placed on."""

    def __init__(self, sym: Symbols, hooks: list[Hook], diags: Diagnostics):
        self.sym, self.hooks, self.diags = sym, hooks, diags
        self.scopes: list[dict[str, str | None]] = [{}]

    # -- names
    def _lookup(self, name: str):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise KeyError(name)

    def _decision(self, name: str):
        """The decision field if every hook of the handler has it."""
        fields = [h.field(name) for h in self.hooks]
        if fields and all(f is not None and f.decision for f in fields):
            return fields[0]
        return None

    def _hook_names(self):
        return ", ".join(sorted({f"{h.island_kind}.{h.name}" for h in self.hooks}))

    def _visible_names(self):
        names = set(self.sym.devices) | {"now"}
        for s in self.scopes:
            names |= set(s)
        for h in self.hooks:
            names |= {f.name for f in h.decisions}
        return names

    # -- expressions
    def expr(self, e: A.Node) -> str | None:
        meth = getattr(self, "e_" + type(e).__name__)
        return meth(e)

    def e_Num(self, e):
        return e.dim

    def e_Bool(self, e):
        return BOOL

    def e_Str(self, e):
        self.diags.error(e.span, "strings are not values in handlers")
        return None

    def e_Name(self, e):
        if e.id == "now":
            return TIME
        try:
            return self._lookup(e.id)
        except KeyError:
            pass
        f = self._decision(e.id)
        if f is not None:
            return f.dim
        if e.id in self.sym.devices:
            return DEVICE
        if e.id in self.sym.movements:
            self.diags.error(e.span, f"'{e.id}' is a movement, not a value",
                             "compare ev.movement only inside handlers of other events")
            return None
        self.diags.error(e.span, f"unknown name '{e.id}'", did_you_mean(e.id, self._visible_names()))
        return None

    def e_FieldRef(self, e):
        if e.obj != "ev":
            self.diags.error(e.span, f"unknown object '{e.obj}'", "context fields are read as ev.FIELD")
            return None
        missing = [h for h in self.hooks if h.readable(e.name.name) is None]
        if missing:
            h = missing[0]
            self.diags.error(e.name.span, f"the context of {h.island_kind}.{h.name} has no field '{e.name.name}'",
                             did_you_mean(e.name.name, h.layout) or "fields: " + ", ".join(h.layout))
            return None
        return self.hooks[0].readable(e.name.name).dim if self.hooks else None

    def _map(self, ident: A.Ident, want_ringbuf=False) -> MapInfo | None:
        info = self.sym.maps.get(ident.name)
        if info is None:
            self.diags.error(ident.span, f"unknown map '{ident.name}'", did_you_mean(ident.name, self.sym.maps))
            return None
        if want_ringbuf != (info.kind == "ringbuf"):
            if want_ringbuf:
                self.diags.error(ident.span, f"emit needs a ringbuf map; '{ident.name}' is a {info.kind}")
            else:
                self.diags.error(ident.span, f"'{ident.name}' is a ringbuf; it cannot be indexed",
                                 f"write records with 'emit {ident.name}(...)'")
            return None
        return info

    def _key(self, info: MapInfo, key: A.Node):
        kd = self.expr(key)
        if not compatible(kd, info.key_dim) or kd == BOOL:
            self.diags.error(key.span, f"map '{info.decl.name.name}' has {dim_name(info.key_dim)} key, "
                             f"not {dim_name(kd)}", f"declared at {info.decl.span}")
        k = const_value(key)
        if k is not None and info.kind in ("array", "percpu_array") and k >= info.max_entries:
            self.diags.error(key.span, f"index {k} is out of bounds for '{info.decl.name.name}' "
                             f"with {info.max_entries} entries")

    def _value_fits(self, info: MapInfo, value: A.Node, vd):
        if not compatible(vd, info.value_dim) or vd == BOOL:
            self.diags.error(value.span, f"map '{info.decl.name.name}' holds {dim_name(info.value_dim)}, "
                             f"not {dim_name(vd)}", f"declared at {info.decl.span}")
        v = const_value(value)
        if v is not None and v >= 1 << (8 * info.value_size):
            self.diags.error(value.span, f"{v} does not fit in the {info.value_size}-byte values "
                             f"of '{info.decl.name.name}'")

    def e_MapGet(self, e):
        info = self._map(e.map)
        if info is None:
            self.expr(e.key)
            return None
        self._key(info, e.key)
        if e.default is not None:
            self._value_fits(info, e.default, self.expr(e.default))
        return info.value_dim

    def e_Call(self, e):
        dims = [self.expr(a) for a in e.args]
        if e.func.name not in S.BUILTINS:
            self.diags.error(e.func.span, f"unknown function '{e.func.name}'",
                             did_you_mean(e.func.name, S.BUILTINS) or "functions: min, max")
            return None
        if len(e.args) < 2:
            self.diags.error(e.span, f"{e.func.name}() takes at least two arguments")
            return None
        out = None
        for a, d in zip(e.args, dims):
            if not compatible(out, d):
                self.diags.error(a.span, f"{e.func.name}() of {dim_name(out)} and {dim_name(d)}")
            out = out or d
        return out

    def e_UnOp(self, e):
        d = self.expr(e.operand)
        if e.op == "!":
            return BOOL
        self.diags.error(e.span, "negative values are not supported: values are unsigned 64-bit",
                         "subtraction stops at 0: write 'a - b' and compare")
        return d

    def e_BinOp(self, e):
        d = self._binop_dim(e)
        if e.op in ("/", "%") and exact_value(e.right) == 0:
            self.diags.error(e.right.span, f"'{e.op}' by zero", "x / 0 is 0 and x % 0 is x in eBPF; "
                             "write the value you mean")
        elif d not in (BOOL,):
            v = exact_value(e)
            if v is not None and v > M64:
                self.diags.error(e.span, f"this constant is {float(v):.4g} {BASE_UNIT.get(d, '')}".rstrip()
                                 + ", more than fits in 64 bits")
        return d

    def _binop_dim(self, e):
        a, b = self.expr(e.left), self.expr(e.right)
        op = e.op
        if op in ("&&", "||"):
            return BOOL
        if BOOL in (a, b) and op not in ("==", "!="):
            self.diags.error(e.span, f"'{op}' on a boolean", "combine conditions with && and ||")
            return None
        if op in ("==", "!=", "<", ">", "<=", ">="):
            if not compatible(a, b):
                self.diags.error(e.span, f"cannot compare {dim_name(a)} with {dim_name(b)}", _unit_hint(a))
            return BOOL
        if DEVICE in (a, b):
            self.diags.error(e.span, f"arithmetic on a device with '{op}'")
            return None
        if op in ("+", "-", "%"):
            if not compatible(a, b):
                self.diags.error(e.span, f"cannot {'add' if op == '+' else 'combine'} {dim_name(a)} "
                                 f"and {dim_name(b)}", _unit_hint(a))
            return a if a not in _SCALAR else b
        if op in ("*", "/") and (op, a, b) in DIM_ARITH:
            d, e.scale = DIM_ARITH[op, a, b]
            return d
        if op == "*":
            if a in _SCALAR or b in _SCALAR:
                return a if a not in _SCALAR else b
            self.diags.error(e.span, f"cannot multiply {dim_name(a)} by {dim_name(b)}")
            return None
        if op == "/":
            if b in _SCALAR:
                return a
            if a == b:
                return None
            self.diags.error(e.span, f"cannot divide {dim_name(a)} by {dim_name(b)}")
            return None
        return a  # bitwise and shifts keep the left operand's dimension

    # -- statements
    def stmts(self, body: list[A.Node]) -> None:
        self.scopes.append({})
        for s in body:
            getattr(self, "s_" + type(s).__name__)(s)
        self.scopes.pop()

    def s_Let(self, s):
        d = self.expr(s.value)
        if s.name.name in self.scopes[-1]:
            self.diags.error(s.name.span, f"'{s.name.name}' is already defined in this block")
        elif self._decision(s.name.name) is not None or s.name.name in ("now", "ev"):
            self.diags.error(s.name.span, f"'{s.name.name}' is a built-in name", "choose another name")
        self.scopes[-1][s.name.name] = d

    def s_Assign(self, s):
        name = s.target.name
        d = self.expr(s.value)
        if not s.via_ev:
            try:
                ld = self._lookup(name)
            except KeyError:
                pass
            else:
                if not compatible(ld, d):
                    self.diags.error(s.value.span, f"'{name}' holds {dim_name(ld)}, not {dim_name(d)}")
                return
        f = self._decision(name)
        if f is None:
            self._bad_target(s, name)
            return
        if not compatible(f.dim, d) or d == BOOL:
            self.diags.error(s.value.span, f"'{name}' must be {dim_name(f.dim)}, not {dim_name(d)}",
                             _unit_hint(f.dim))
        if f.dim == DEVICE and not (isinstance(s.value, A.Name) and s.value.id in self.sym.devices) \
                and d != DEVICE:
            self.diags.error(s.value.span, f"'{name}' must name a device", "e.g. route = sw1")
        exact = exact_value(s.value)
        if f.dim in (BANDWIDTH, TIME) and exact is not None and 0 < exact < 1:
            self.diags.error(s.value.span, f"'{name}' = {float(exact):.3g} {BASE_UNIT[f.dim]} rounds down to 0, "
                             f"which sets no {name}", f"values are whole {BASE_UNIT[f.dim]}")
        v = const_value(s.value)
        if name == "priority" and v is not None and v > MAX_PRIORITY:
            self.diags.error(s.value.span, f"priority {v} is out of range",
                             f"priorities are 0 (last) to {MAX_PRIORITY} (first)")

    def _bad_target(self, s, name):
        for h in self.hooks:
            fld = h.field(name)
            if fld is not None and not fld.decision:
                self.diags.error(s.target.span, f"context field '{name}' of {h.island_kind}.{h.name} is read-only",
                                 "decisions it accepts: " + ", ".join(x.name for x in h.decisions) if h.decisions
                                 else f"{h.island_kind}.{h.name} makes no decisions; it only observes")
                return
        all_decisions = {f.name for h in self.hooks for f in h.decisions}
        hint = did_you_mean(name, all_decisions | {n for sc in self.scopes for n in sc})
        if hint is None:
            hint = ("decisions it accepts: " + ", ".join(sorted(all_decisions))) if all_decisions \
                else f"{self._hook_names()} makes no decisions; it only observes"
        self.diags.error(s.target.span, f"{self._hook_names()} has no decision '{name}'", hint,
                         None if s.via_ev else f"to keep a value, write 'let {name} = ...'")

    def s_If(self, s):
        self.expr(s.cond)
        self.stmts(s.then)
        self.stmts(s.orelse)

    def s_MapUpdate(self, s):
        info = self._map(s.map)
        d = self.expr(s.value)
        if info is None:
            self.expr(s.key)
            return
        if info.hist is not None:
            self.diags.error(s.span, f"'{s.map.name}' is a {info.hist['kind']}; it counts values itself",
                             f"write '{s.map.name} = {info.hist['kind']}(value)'")
        self._key(info, s.key)
        self._value_fits(info, s.value, d)

    def s_HistAdd(self, s):
        info = self._map(s.map)
        call, name = s.call, s.map.name
        dims = [self.expr(a) for a in call.args]
        if info is None:
            return
        if info.hist is None:
            self.diags.error(s.map.span, f"'{name}' is a {info.kind} map, not a histogram",
                             f"declare it 'map {name} : {call.func.name}<DIM>...' to count values in buckets")
            return
        if call.func.name != info.hist["kind"]:
            self.diags.error(call.func.span, f"'{name}' is a {info.hist['kind']}; count with "
                             f"{info.hist['kind']}(), not {call.func.name}()", f"declared at {info.decl.span}")
        if len(call.args) != 1:
            self.diags.error(call.span, f"{call.func.name}() takes one value: the bounds are the map's")
            return
        if not compatible(dims[0], info.hist["dim"]) or dims[0] == BOOL:
            self.diags.error(call.args[0].span, f"'{name}' counts {dim_name(info.hist['dim'])}, "
                             f"not {dim_name(dims[0])}", f"declared at {info.decl.span}")

    def s_Delete(self, s):
        info = self._map(s.map)
        if info is None:
            return
        if info.kind in ("array", "percpu_array"):
            self.diags.error(s.span, f"entries of the {info.kind} '{s.map.name}' cannot be deleted",
                             f"write '{s.map.name}[k] = 0' to reset one")
        self._key(info, s.key)

    def s_Emit(self, s):
        info = self._map(s.map, want_ringbuf=True)
        dims = [self.expr(a) for a in s.args]
        for a, dim in zip(s.args, dims):
            if dim == BOOL:
                self.diags.error(a.span, "emit records numbers, not conditions")
        if not s.args:
            self.diags.error(s.span, "emit needs at least one value")
        if info is not None and info.kind == "ringbuf":     # how the run's report decodes its records
            info.records.append({"line": s.span.line, "fields": [
                {"name": _field_name(a, i), "dim": dim} for i, (a, dim) in enumerate(zip(s.args, dims))]})

    def s_For(self, s):
        lo, hi = const_value(s.lo), const_value(s.hi)
        for bound, v in ((s.lo, lo), (s.hi, hi)):
            self.expr(bound)
            if v is None:
                self.diags.error(bound.span, "loop bounds must be constants",
                                 "every program must provably terminate; write for i in 0..N with a number N")
        if lo is not None and hi is not None and hi - lo > S.MAX_LOOP_TRIPS:
            self.diags.error(s.span, f"loop of {hi - lo} iterations is too long",
                             f"at most {S.MAX_LOOP_TRIPS} iterations")
        self.scopes.append({s.var.name: COUNT})
        self.stmts(s.body)
        self.scopes.pop()


def check_handler(h: A.Handler, hooks: list[Hook], sym: Symbols, diags: Diagnostics) -> None:
    """Check the guard and body of a handler placed on ``hooks``."""
    bc = BodyChecker(sym, hooks, diags)
    if h.when is not None:
        bc.expr(h.when)
    bc.stmts(h.body)


def _field_name(e: A.Node, i: int) -> str:
    """A record field's name: the context field or name it records, else its position."""
    if isinstance(e, A.FieldRef):
        return e.name.name
    if isinstance(e, A.Name):
        return e.id
    return f"value{i + 1}"


__all__ = ["Symbols", "MapInfo", "check_declarations", "check_handler", "const_value", "compatible", "closest"]
