"""The movement graph as JSON (for tools and the manifest) and as Graphviz DOT."""
from __future__ import annotations

from .graph import has_flag


def to_json(a) -> dict:
    """devices, links, movements (with path and islands per flow) and placements."""
    sym, mg = a.symbols, a.graph
    devices = [{"name": n, "kind": d.kind, "island": mg.device_island.get(n),
                **({"at": d.at.name} if d.at else {})} for n, d in sym.devices.items()]
    links = [{"src": u, "dst": v, "bw": e.get("bw"), "latency": e.get("latency"), "kind": e.get("kind")}
             for u, v, e in sorted(mg.g.edges(data=True), key=lambda t: (t[0], t[1]))]
    movements = []
    for name, m in sym.movements.items():
        movements.append({
            "name": name, "class": m.cls.name, "operator": m.operator.name if m.operator else None,
            "critical": has_flag(m.props, "critical"),
            "flows": [{"src": f.src, "dst": f.dst, "path": f.path,
                       "islands": [{"island": i, "role": r} for i, r in f.islands]}
                      for f in mg.flows.get(name, [])],
            "islands": mg.islands_of(name),
        })
    placements = [{"island": p.island, "hook": p.hook.name, "policy": p.policy, "movement": p.movement,
                   "period_ns": p.period, "line": p.handler.span.line, "file": p.handler.span.file}
                  for p in a.placements]
    islands = [{"name": i.name, "kind": i.kind, "runtime": i.runtime, "devices": i.devices}
               for i in mg.islands.values()]
    return {"devices": devices, "links": links, "islands": islands, "movements": movements,
            "placements": placements}


def to_dot(a) -> str:
    mg = a.graph
    colors = {"gpu": "palegreen", "cxl_switch": "lightblue", "cxl_mem": "lightyellow",
              "dpu": "plum", "nic": "plum", "host": "lightgrey"}
    out = ["digraph fabric {", "  rankdir=LR;", "  node [shape=box, style=filled];"]
    for n, d in a.symbols.devices.items():
        out.append(f'  "{n}" [label="{n}\\n{d.kind}", fillcolor={colors.get(d.kind, "white")}];')
    for u, v, e in sorted(mg.g.edges(data=True), key=lambda t: (t[0], t[1])):
        back = mg.g.edges[v, u] if mg.g.has_edge(v, u) else None
        if back is not None and u > v and back.get("bw") == e.get("bw"):
            continue  # drawn once, both ways, from the other end
        label = f"{e['bw'] / 1e9:g} GB/s" if e.get("bw") else ""
        both = ', dir=both' if back is not None and back.get("bw") == e.get("bw") else ""
        out.append(f'  "{u}" -> "{v}" [label="{label}", color=grey{both}];')
    for name, flows in mg.flows.items():
        for f in flows[:1]:  # one representative flow per movement keeps the picture readable
            for u, v in zip(f.path, f.path[1:]):
                out.append(f'  "{u}" -> "{v}" [label="{name}", color=red, fontcolor=red, style=bold];')
    out.append("}")
    return "\n".join(out) + "\n"
