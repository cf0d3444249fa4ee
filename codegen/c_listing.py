"""The libbpf-style C listing of each island's object, rendered with jinja2.

The listing is equivalent to the object (same maps, same context structs from
the generated ``fabric.h``, same decisions), so a person can read or hand-tune
what the compiler made and rebuild it with ``clang -target bpf -O2 -g``.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

from fabric_ext.contract.hooks import HOOKS, ctx_struct_c

from . import ir

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                          keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                          undefined=jinja2.StrictUndefined)
_ENV.filters["c_comment"] = lambda text: text.replace("*/", "*\\/")    # (a path may hold "*/")
C_TYPES = {1: "__u8", 2: "__u16", 4: "__u32", 8: "__u64"}
MAP_TYPES = {"hash": "BPF_MAP_TYPE_HASH", "array": "BPF_MAP_TYPE_ARRAY", "percpu_hash": "BPF_MAP_TYPE_PERCPU_HASH",
             "percpu_array": "BPF_MAP_TYPE_PERCPU_ARRAY", "lru_hash": "BPF_MAP_TYPE_LRU_HASH",
             "ringbuf": "BPF_MAP_TYPE_RINGBUF"}


def c_expr(e) -> str:
    if isinstance(e, ir.Const):
        return f"{e.value}ULL"
    if isinstance(e, ir.CtxField):
        return f"(__u64)ev->{e.name}"
    if isinstance(e, ir.Var):
        return e.name.replace(".", "_")
    if isinstance(e, ir.Not):
        return f"(__u64)!({c_expr(e.operand)})"
    if isinstance(e, ir.MinMax):
        out = c_expr(e.args[0])
        for a in e.args[1:]:
            out = f"fx_{e.op}({out}, {c_expr(a)})"
        return out
    if isinstance(e, ir.MapGet):
        return f"fx_get_{e.map}({c_expr(e.key)}, {c_expr(e.default)})"
    if isinstance(e, ir.Bin):
        a, b = c_expr(e.left), c_expr(e.right)
        named = {"-": "fx_sub", "/": "fx_div", "%": "fx_mod", "<<": "fx_shl", ">>": "fx_shr"}
        if e.op in named:
            return f"{named[e.op]}({a}, {b})"
        if e.op in ("==", "!=", "<", ">", "<=", ">=", "&&", "||"):
            return f"(__u64)({a} {e.op} {b})"
        return f"({a} {e.op} {b})"
    raise TypeError(type(e).__name__)


_COMBINE = {"+=": "old + v", "-=": "fx_sub(old, v)", "|=": "old | v", "&=": "old & v",
            "max=": "fx_max(old, v)", "min=": "fx_min(old, v)"}


def c_stmts(body, indent: int) -> list[str]:
    pad = "\t" * indent
    out = []
    for s in body:
        if isinstance(s, ir.SetField):
            out.append(f"{pad}ev->{s.field.name} = {c_expr(s.value)};")
        elif isinstance(s, ir.SetVar):
            out.append(f"{pad}{c_expr(s.var)} = {c_expr(s.value)};")
        elif isinstance(s, ir.If):
            out.append(f"{pad}if ({c_expr(s.cond)}) {{")
            out += c_stmts(s.then, indent + 1)
            if s.orelse:
                out.append(f"{pad}}} else {{")
                out += c_stmts(s.orelse, indent + 1)
            out.append(f"{pad}}}")
        elif isinstance(s, ir.MapUpdate):
            if s.op == "=":
                out.append(f"{pad}fx_set_{s.map}({c_expr(s.key)}, {c_expr(s.value)});")
            else:
                start = f"{ir.UPDATE_START[s.op]:#x}ULL"     # on a key the map does not hold
                out.append(f"{pad}{{ __u64 v = {c_expr(s.value)}, k = {c_expr(s.key)}, "
                           f"old = fx_get_{s.map}(k, {start}); fx_set_{s.map}(k, {_COMBINE[s.op]}); }}")
        elif isinstance(s, ir.MapDelete):
            out.append(f"{pad}fx_del_{s.map}({c_expr(s.key)});")
        elif isinstance(s, ir.Emit):
            vals = ", ".join(c_expr(a) for a in s.args)
            out.append(f"{pad}{{ __u64 rec[{len(s.args)}] = {{ {vals} }};"
                       f" bpf_ringbuf_output(&{s.map}, rec, sizeof(rec), 0); }}")
        elif isinstance(s, ir.Loop):
            v = c_expr(s.var)
            out.append(f"{pad}for ({v} = {s.lo}; {v} < {s.hi}; {v}++) {{")
            out += c_stmts(s.body, indent + 1)
            out.append(f"{pad}}}")
    return out


def render_fabric_h(ids) -> str:
    structs = [ctx_struct_c(h) for h in HOOKS.values()]
    return _ENV.get_template("fabric.h.j2").render(structs=structs, ids=ids)


def render_listing(island: str, programs: list[ir.ProgramIR], maps: dict, source: str) -> str:
    used = sorted({m for p in programs for m in p.maps})
    mdecls = []
    for name in used:
        info = maps[name]
        mdecls.append({"name": name, "type": MAP_TYPES[info.kind], "kind": info.kind,
                       "key": C_TYPES.get(info.key_size), "value": C_TYPES.get(info.value_size),
                       "max_entries": info.max_entries})
    progs = []
    for p in programs:
        handlers = []
        for h in p.handlers:
            conds = []
            if h.movement_id is not None:
                conds.append(f"ev->movement == {h.movement_id}")
            if h.period is not None:
                conds.append(f"ev->period == {h.period}")
            if h.guard is not None:
                conds.append(c_expr(h.guard))
            handlers.append({"line": h.span.line, "cond": " && ".join(conds) or "1",
                             "body": c_stmts(h.body, 2)})
        progs.append({"name": p.name, "struct": p.hook.struct_name, "handlers": handlers,
                      "vars": [v.name.replace(".", "_") for v in p.vars]})
    return _ENV.get_template("island.bpf.c.j2").render(island=island, source=source, maps=mdecls,
                                                        programs=progs)
