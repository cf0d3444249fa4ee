"""The hook catalogue: the one source of truth for every hook.

For each island kind it defines the hooks a program may attach to, the layout
of each hook's context struct (input fields read-only, decision fields
writable), each decision's default when no program runs, and what the runtime
does with it.  The checker, the code generator, the verifier, the runtime's
struct packing and the generated ``fabric.h`` all read this module; nothing
restates an offset by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..units import BANDWIDTH, COUNT, DEVICE, FLOPS, PERCENT, SIZE, TIME

CTYPE_SIZE = {"u32": 4, "u64": 8}

#: island kinds and the runtime shim that hosts them
ISLAND_RUNTIME = {"gpu": "bpftime", "host": "bpftime", "cxl_switch": "dputime", "dpu": "dputime"}

#: device kinds of the language -> island kind (None: part of another island)
DEVICE_ISLAND_KIND = {"gpu": "gpu", "host": "host", "cxl_switch": "cxl_switch",
                      "dpu": "dpu", "nic": "dpu", "cxl_mem": None}

#: device kinds that hold memory, which a `tier` decision may name (a GPU: its HBM)
TIER_KINDS = ("cxl_mem", "gpu", "host")


@dataclass(frozen=True)
class Field:
    """One member of a context struct."""
    name: str
    ctype: str                 # "u32" | "u64"
    dim: str | None            # dimension of the value (units.py)
    doc: str
    decision: bool = False     # writable by the program
    default: int = 0           # value before the program runs (decisions)
    effect: str = ""           # what the runtime does with a decision
    shows: str = ""            # where a run's report shows the effect (`SHOWS`)

    @property
    def size(self) -> int:
        return CTYPE_SIZE[self.ctype]


def _f(name, ctype, dim, doc):
    return Field(name, ctype, dim, doc)


def _d(name, ctype, dim, default, effect, shows):
    return Field(name, ctype, dim, effect, decision=True, default=default, effect=effect, shows=shows)


#: where the report of a run shows what a decision did (tests/test_decision_effects.py checks
#: each decision of every hook against it)
SHOWS = {
    "queueing": "the movement's queueing (p50/p99) against the other traffic it meets",
    "throughput": "the movement's GB/s",
    "latency": "how long the movement's transfers take",
    "schedule": "when the movement's transfers are issued (then the GPUs' stall and the time to first token)",
    "chunks": "how many chunks cross the links of the movement (each pays the link's fixed cost)",
    "engines": "which copy engines of the GPU carry the chunks",
    "links": "which links (or memories) carry the bytes",
}


# ---- fields shared between hooks ------------------------------------------------
#: readable as ev.NAME on every hook, but no part of any context: each island's program is
#: compiled for that island, so the compiler writes the value in (a wildcard `at gpu*` handler
#: tells its GPUs apart with it, and gpu.launch learns which GPU launched)
CONSTANTS = {"island": Field("island", "u32", DEVICE, "the device whose island runs the program "
                             "(compare with a device name: ev.island == gpu3)")}

NOW = _f("now", "u64", TIME, "simulated time of the event (ns)")
CHUNK_INPUTS = (
    NOW,
    _f("movement", "u32", COUNT, "movement id (manifest id table)"),
    _f("class", "u32", COUNT, "data class id: weights, kv, activations"),
    _f("operator", "u32", COUNT, "operator id: attention, ffn, embedding, lm_head, collective"),
    _f("src", "u32", DEVICE, "source device id"),
    _f("dst", "u32", DEVICE, "destination device id"),
    _f("layer", "u32", COUNT, "model layer the chunk belongs to"),
    _f("chunk", "u32", COUNT, "index of the chunk within its transfer"),
    _f("in_port", "u32", COUNT, "ingress port index at this island (0 where it came in by none)"),
    _f("out_port", "u32", COUNT, "egress port index at this island (0 where it leaves by none)"),
    _f("bytes", "u64", SIZE, "bytes in this chunk"),
    _f("queue_bytes", "u64", SIZE, "bytes queued ahead of the chunk at the egress (0 where it has none: at its "
       "end, and as it leaves the queue)"),
    _f("critical", "u32", COUNT, "1 if the movement is marked critical"),
    _f("hop", "u32", COUNT, "index of this island on the chunk's path (where the chunk enters it; at "
       "dequeue, of the device whose queue it leaves)"),
    _f("queued_ahead_hi", "u64", SIZE, "of queue_bytes, the bytes in higher priority classes than the chunk's "
       "now: they leave before it"),
    _f("queued_ahead_lo", "u64", SIZE, "of queue_bytes, the bytes in the chunk's priority class or lower"),
)
WAIT = _f("wait", "u64", TIME, "how long the chunk waited in the queue (ns)")
LATENCY = _f("latency", "u64", TIME, "time from issue to completion (ns)")
TICK_INPUTS = (
    NOW,
    _f("port", "u32", COUNT, "port (link) index the sample is for"),
    _f("peer", "u32", DEVICE, "device at the other end of the port (0: a DPU/NIC's network)"),
    _f("util_pct", "u32", PERCENT, "link utilisation over the last period (0-100)"),
    _f("bytes", "u64", SIZE, "bytes sent on the port during the last period"),
    _f("queue_bytes", "u64", SIZE, "bytes queued at the port now"),
    _f("period", "u64", TIME, "period of this tick (ns)"),
)

#: strict-priority classes on every queue: 0 (last) to MAX_PRIORITY (first)
MAX_PRIORITY = 7
PRIORITY = _d("priority", "u32", COUNT, 3, f"strict-priority class 0-{MAX_PRIORITY} on every egress queue it "
               f"meets from here on ({MAX_PRIORITY} first; flows of one class share a link round robin)", "queueing")
RATE = _d("rate", "u64", BANDWIDTH, 0, "token-bucket rate limit of the flow at this island: its chunks leave "
           "no faster than this (0: unlimited)", "throughput")
DEFER = _d("defer", "u64", TIME, 0, "hold the chunk this long before it moves on (at issue: before a copy "
            "engine takes it; the transfer's next chunk waits for it)", "latency")
PREFETCH = _d("prefetch", "u32", COUNT, 0, "issue weights this many layers ahead on this GPU from now on "
               "(0: workload default)", "schedule")
COALESCE = _d("coalesce", "u64", SIZE, 0, "hold the flow's chunks here until they reach this size, then send "
               "them as one chunk: one fixed per-chunk link cost instead of many (0: off)", "chunks")
STREAM = _d("stream", "u32", COUNT, 0, "copy-engine stream to issue on: a stream takes its transfers in "
             "order, streams share an engine round robin, stream s runs on engine (s-1) mod copy_engines "
             "(0: the data class's stream: weights 1, kv 2, activations 3)", "engines")
ROUTE = _d("route", "u32", DEVICE, 0, "next-hop device for the chunk, then the shortest path on (0: the "
            "movement's path)", "links")
TIER = _d("tier", "u32", DEVICE, 0, "memory device (" + ", ".join(TIER_KINDS) + ") to place or keep the "
           "data in instead, where it has room (0: workload default; a GPU: its HBM; another device is refused, "
           "as is data a GPU reads or a NIC exports: only weights placed and KV written back move)", "links")
QUEUE = _d("queue", "u32", COUNT, 0, "transmit queue the chunk leaves the NIC by: one queue sends in "
            "order, queues share the link round robin, and a `rate` set with it limits the queue, not the "
            "flow (0: the flow's own queue)", "throughput")


@dataclass(frozen=True)
class Hook:
    """A hook of one island kind: where it fires and what its context holds."""
    island_kind: str
    name: str
    doc: str
    fields: tuple[Field, ...]
    scope: str              # "chunk": per chunk of a movement; "tick": periodic; "island": per island event
    roles: tuple[str, ...] = ()   # where on a movement's path a chunk hook fires: src, dst, transit
    moment: str = ""        # when it fires (`MOMENTS`)

    @cached_property
    def layout(self) -> dict[str, tuple[int, Field]]:
        """field name -> (offset, field), naturally aligned, in declaration order."""
        out, off = {}, 0
        for f in self.fields:
            off = (off + f.size - 1) // f.size * f.size
            out[f.name] = (off, f)
            off += f.size
        return out

    @cached_property
    def ctx_size(self) -> int:
        end = max(o + f.size for o, f in self.layout.values())
        return (end + 7) // 8 * 8

    @property
    def struct_name(self) -> str:
        return f"fx_{self.island_kind}_{self.name}_ctx"

    @property
    def decisions(self) -> list[Field]:
        return [f for f in self.fields if f.decision]

    def field(self, name: str) -> Field | None:
        hit = self.layout.get(name)
        return hit[1] if hit else None

    def constant(self, name: str) -> Field | None:
        """A field every program of this hook can read that is no part of its context: known
        when the program is compiled for its island (`CONSTANTS`)."""
        return CONSTANTS.get(name)

    def readable(self, name: str) -> Field | None:
        """What ``ev.NAME`` reads: a context field or a constant of the island."""
        return self.field(name) or self.constant(name)

    def offset(self, name: str) -> int:
        return self.layout[name][0]

    def defaults(self) -> dict[str, int]:
        return {f.name: f.default for f in self.decisions}


#: when in a run each hook fires
MOMENTS = {
    "issue": "a copy engine of the GPU at the chunk's end is ready for it: the transfer's first chunk when the "
             "transfer starts, each later chunk when the one before it was taken by a copy engine",
    "enter": "the chunk enters the island on its path (a switch or a DPU/NIC it crosses or ends at)",
    "deliver": "the chunk's last byte arrived at the end of its path (at a DPU/NIC: left on its wire)",
    "dequeue": "the chunk leaves an egress queue of the island's device (a link's, a memory's, a NIC's "
               "wire) and starts on the link, after waiting `wait` ns",
    "launch": "an operator kernel is about to start on the GPU",
    "tick": "a period has passed, once per port of the island",
    "place": "the weights are placed before the run, once per layer and operator, at the fabric's first host",
}


def _hook(kind, name, doc, fields, scope, roles=(), moment=""):
    return Hook(kind, name, doc, tuple(fields), scope, tuple(roles), moment)


_ALL = [
    _hook("gpu", "issue", "a chunk of a movement is about to be issued by a copy engine",
          CHUNK_INPUTS + (PRIORITY, RATE, DEFER, PREFETCH, COALESCE, STREAM), "chunk", ("src", "dst"), "issue"),
    _hook("gpu", "complete", "a chunk of a movement has arrived or left",
          CHUNK_INPUTS + (LATENCY, PREFETCH), "chunk", ("src", "dst"), "deliver"),
    _hook("gpu", "dequeue", "a chunk leaves the GPU's egress queue for its link", CHUNK_INPUTS + (WAIT,),
          "chunk", ("src",), "dequeue"),
    _hook("gpu", "launch", "an operator kernel starts",
          (NOW, _f("layer", "u32", COUNT, "model layer"),
           _f("operator", "u32", COUNT, "operator id"),
           _f("flops", "u64", FLOPS, "floating-point operations of the kernel"),
           _f("bytes", "u64", SIZE, "bytes the kernel reads from HBM"),
           _f("stall", "u64", TIME, "time the kernel waited for its inputs (ns)"),
           PREFETCH), "island", (), "launch"),
    _hook("gpu", "tick", "periodic telemetry, once per port of the GPU", TICK_INPUTS, "tick", (), "tick"),
    _hook("cxl_switch", "forward", "a chunk is at a switch port, about to be forwarded",
          CHUNK_INPUTS + (PRIORITY, RATE, ROUTE, DEFER), "chunk", ("transit", "src", "dst"), "enter"),
    _hook("cxl_switch", "mem_access", "a chunk reads or writes switch-attached memory",
          CHUNK_INPUTS + (_f("write", "u32", COUNT, "1 for a write, 0 for a read"),
                          PRIORITY, RATE, DEFER, TIER), "chunk", ("src", "dst"), "enter"),
    _hook("cxl_switch", "dequeue", "a chunk leaves a switch port's queue (or its memory's) for the link",
          CHUNK_INPUTS + (WAIT,), "chunk", ("transit", "src", "dst"), "dequeue"),
    _hook("cxl_switch", "complete", "a chunk was written to the switch's memory", CHUNK_INPUTS + (LATENCY,),
          "chunk", ("dst",), "deliver"),
    _hook("cxl_switch", "tick", "per-port telemetry, once per port each period", TICK_INPUTS, "tick", (), "tick"),
    _hook("dpu", "tx", "a chunk is about to be transmitted onto the network",
          CHUNK_INPUTS + (RATE, COALESCE, QUEUE, PRIORITY), "chunk", ("dst", "transit"), "enter"),
    _hook("dpu", "rx", "a chunk was received from the network",
          CHUNK_INPUTS + (RATE, COALESCE, QUEUE, PRIORITY), "chunk", ("src",), "enter"),
    _hook("dpu", "dequeue", "a chunk leaves a queue of the DPU/NIC: for a link, or onto the network",
          CHUNK_INPUTS + (WAIT,), "chunk", ("src", "transit", "dst"), "dequeue"),
    _hook("dpu", "complete", "a chunk has left on the network", CHUNK_INPUTS + (LATENCY,), "chunk", ("dst",),
          "deliver"),
    _hook("dpu", "tick", "per-port telemetry of the DPU/NIC: its links, then its network port", TICK_INPUTS,
          "tick", (), "tick"),
    _hook("host", "alloc", "a tensor is about to be placed in memory",
          (NOW, _f("movement", "u32", COUNT, "movement id whose data the tensor holds"),
           _f("class", "u32", COUNT, "data class id"),
           _f("layer", "u32", COUNT, "model layer"),
           _f("bytes", "u64", SIZE, "size of the tensor"), TIER), "chunk", ("src", "dst", "transit"), "place"),
    _hook("host", "complete", "a chunk arrived in host memory", CHUNK_INPUTS + (LATENCY,), "chunk", ("dst",),
          "deliver"),
    _hook("host", "tick", "periodic host telemetry, once per port", TICK_INPUTS, "tick", (), "tick"),
]
HOOKS: dict[tuple[str, str], Hook] = {(h.island_kind, h.name): h for h in _ALL}

#: every hook name any island has, for "did you mean"
HOOK_NAMES = sorted({h.name for h in _ALL})

#: ids written to the manifest for data classes and operators
CLASSES = ("weights", "kv", "activations")
OPERATORS = ("attention", "ffn", "embedding", "lm_head", "collective")


def hooks_of(island_kind: str) -> dict[str, Hook]:
    return {name: h for (kind, name), h in HOOKS.items() if kind == island_kind}


def hook(island_kind: str, name: str) -> Hook | None:
    return HOOKS.get((island_kind, name))


def firing(island_kind: str, moment: str, role: str) -> tuple[str, ...]:
    """The hooks of an island kind that fire at ``moment`` for a chunk in ``role`` there."""
    return _FIRING.get((island_kind, moment, role), ())


_FIRING: dict[tuple[str, str, str], tuple[str, ...]] = {}
for _h in _ALL:
    for _role in _h.roles:
        _FIRING[(_h.island_kind, _h.moment, _role)] = _FIRING.get((_h.island_kind, _h.moment, _role), ()) + (_h.name,)


def ctx_struct_c(h: Hook) -> str:
    """The C declaration of a hook's context struct (used by fabric.h)."""
    lines = [f"/* {h.island_kind}.{h.name}: {h.doc}; fires when {MOMENTS[h.moment]} */",
             f"struct {h.struct_name} {{"]
    for name, (off, f) in h.layout.items():
        kind = "decision" if f.decision else "input"
        lines.append(f"\t__{f.ctype} {name};\t/* +{off} {kind}: {f.doc} */")
    lines.append("};")
    return "\n".join(lines)


# ---- the catalogue in docs/language.md ------------------------------------------------
DOCS_BEGIN = "<!-- hooks: generated from fabric_ext/contract/hooks.py by `python -m fabric_ext.contract.hooks docs/language.md` -->"
DOCS_END = "<!-- hooks: end -->"


def _dim_word(f: Field) -> str:
    return f.dim or f.ctype


def markdown() -> str:
    """The hooks (what fires when, with which decisions) and every decision's effect, as the
    Markdown tables of docs/language.md."""
    roles = {"src": "source", "dst": "destination", "transit": "on the way"}
    rows = ["| island | hook | event | where on a movement's path | decisions |", "| --- | --- | --- | --- | --- |"]
    for h in _ALL:
        name = f"`{h.name}(PERIOD)`" if h.scope == "tick" else f"`{h.name}`"
        where = ", ".join(roles[r] for r in h.roles) if h.moment in ("issue", "enter", "deliver", "dequeue") else "—"
        decisions = " ".join(f"`{f.name}`" for f in h.decisions) or "—"
        rows.append(f"| {h.island_kind} | {name} | {h.doc} | {where} | {decisions} |")
    rows += ["", "When each hook fires:", ""]
    for moment, text in MOMENTS.items():
        named = ", ".join(f"`{h.island_kind}.{h.name}`" for h in _ALL if h.moment == moment)
        rows.append(f"- {named}: when {text}.")
    rows += ["", "| decision | value | default | what the fabric does with it | the report shows it in |",
             "| --- | --- | --- | --- | --- |"]
    seen = {}
    for h in _ALL:
        for f in h.decisions:
            seen.setdefault(f.name, f)
    for f in seen.values():
        rows.append(f"| `{f.name}` | {_dim_word(f)} | {f.default} | {f.effect} | {SHOWS[f.shows]} |")
    return "\n".join(rows)


def matching(pattern: str | None) -> list[Hook]:
    """The hooks ``KIND``, ``KIND.HOOK`` or a shell pattern (``*.tick``) names, in catalogue order."""
    from fnmatch import fnmatchcase
    if not pattern:
        return list(_ALL)
    if "." not in pattern and not any(c in pattern for c in "*?["):
        pattern += ".*"
    return [h for h in _ALL if fnmatchcase(f"{h.island_kind}.{h.name}", pattern)]


def listing(hooks: list[Hook], verbose: bool = False) -> str:
    """What `fabricc hooks` prints: a line per hook, or with ``verbose`` when it fires, its
    context fields (name, type, dimension, what it holds) and its decisions (default, effect)."""
    if not verbose:
        width = max(len(_label(h)) for h in hooks) + 2
        return "\n".join(f"{_label(h):<{width}}{h.doc}" for h in hooks)
    return "\n\n".join(_verbose(h) for h in hooks)


def _label(h: Hook) -> str:
    return f"{h.island_kind}.{h.name}{'(PERIOD)' if h.scope == 'tick' else ''}"


def _verbose(h: Hook) -> str:
    roles = {"src": "at its source", "dst": "at its destination", "transit": "on its way"}
    out = [f"{_label(h)}: {h.doc}", f"  fires when {MOMENTS[h.moment]}" if h.moment else ""]
    if h.roles:
        out.append("  on a movement's path: " + ", ".join(roles[r] for r in h.roles))
    out.append(f"  context struct {h.struct_name} ({h.ctx_size} bytes), read as ev.NAME:")
    rows = [(f.name, f.ctype, _dim_word(f) if f.dim else "-", f.doc) for f in h.fields if not f.decision]
    rows += [(f.name, f.ctype, _dim_word(f) if f.dim else "-", f.doc) for f in CONSTANTS.values()]
    out += _rows(rows)
    if h.decisions:
        out.append("  decisions, written as NAME = value:")
        out += _rows([(f.name, f.ctype, f"default {f.default}", f.effect) for f in h.decisions])
    return "\n".join(line for line in out if line)


def _rows(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"    {a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]


def update_docs(path) -> bool:
    """Rewrite the generated part of ``path``; whether it changed."""
    from pathlib import Path
    path = Path(path)
    text = path.read_text()
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    new = f"{head}{DOCS_BEGIN}\n{markdown()}\n{DOCS_END}{tail}"
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys
    for arg in sys.argv[1:]:
        print(f"{arg}: {'updated' if update_docs(arg) else 'up to date'}")
    if len(sys.argv) == 1:
        print(markdown())
