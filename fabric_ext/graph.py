"""Pass 4: the semantic movement graph (`build_graph`).

The physical graph is a `contract.digraph.DiGraph` of devices and directed links (with
bandwidth and latency).  Each movement is expanded over its patterns into
concrete flows (source, destination), each routed along a path (shortest by
latency unless ``via`` is given) and mapped to the ordered list of islands it
crosses, with each island's role on the path (src, transit, dst).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fabric_ext.contract.digraph import DiGraph

from . import ast as A
from .checker import Symbols
from .contract.hooks import DEVICE_ISLAND_KIND, ISLAND_RUNTIME
from .contract.topology import island_roles, route
from .diagnostics import Diagnostics


def prop_value(props: list[A.Prop], name: str, default=None):
    """The value of a property (number, string or name), or ``default``."""
    for p in props:
        if p.name.name == name and p.value is not None:
            v = p.value
            return v.value if isinstance(v, (A.Num, A.Str)) else getattr(v, "id", default)
    return default


def has_flag(props: list[A.Prop], name: str) -> bool:
    return any(p.name.name == name for p in props)


@dataclass
class Island:
    name: str
    kind: str          # gpu | cxl_switch | dpu | host
    devices: list[str]  # the devices it governs (a switch governs its cxl_mem)

    @property
    def runtime(self) -> str:
        return ISLAND_RUNTIME[self.kind]


@dataclass
class Flow:
    """One concrete (source, destination) pair of a movement, routed."""
    movement: str
    src: str
    dst: str
    path: list[str]                        # devices, src first
    islands: list[tuple[str, str]]         # (island, role) in path order


@dataclass
class MovementGraph:
    g: DiGraph
    islands: dict[str, Island]
    device_island: dict[str, str]
    flows: dict[str, list[Flow]] = field(default_factory=dict)  # movement -> flows

    def islands_of(self, movement: str) -> list[str]:
        """Islands a movement crosses, in first-crossed order over all its flows."""
        seen: list[str] = []
        for f in self.flows.get(movement, []):
            for isl, _ in f.islands:
                if isl not in seen:
                    seen.append(isl)
        return seen


def _islands(sym: Symbols) -> tuple[dict[str, Island], dict[str, str]]:
    islands, dev_island = {}, {}
    for name, d in sym.devices.items():
        kind = DEVICE_ISLAND_KIND[d.kind]
        if kind is not None:
            islands[name] = Island(name, kind, [name])
            dev_island[name] = name
    for name, d in sym.devices.items():
        if d.kind == "cxl_mem" and d.at is not None and d.at.name in islands:
            islands[d.at.name].devices.append(name)
            dev_island[name] = d.at.name
    return islands, dev_island


def _latency(props: list[A.Prop], kind: str | None) -> float:
    """A link's latency: as declared, else its kind's figure (the runtime takes the same), so
    that routes by latency are the ones the runtime would take."""
    from fabric_ext.runtime.simulation.figures import link_figure
    declared = prop_value(props, "latency")
    return declared if declared is not None else link_figure(kind)["latency"]


def _physical(sym: Symbols) -> DiGraph:
    g = DiGraph()
    for name, d in sym.devices.items():
        g.add_node(name, kind=d.kind)
    fab = sym.fabric
    for link in fab.links if fab else []:
        a, b = link.a.name, link.b.name
        if a not in sym.devices or b not in sym.devices or a == b:
            continue
        kind = prop_value(link.props, "kind")
        attrs = {"bw": prop_value(link.props, "bw"), "latency": _latency(link.props, kind), "kind": kind,
                 "span": link.span}
        g.add_edge(a, b, **attrs, hop=_hop(sym, a))
        if link.bidir:
            g.add_edge(b, a, **attrs, hop=_hop(sym, b))
    for name, d in sym.devices.items():
        if d.kind == "cxl_mem" and d.at is not None and d.at.name in sym.devices \
                and not g.has_edge(name, d.at.name):
            attrs = {"bw": prop_value(d.props, "bw"), "latency": _latency(d.props, "internal"),
                     "kind": "internal", "span": d.span}
            g.add_edge(name, d.at.name, **attrs, hop=0)
            g.add_edge(d.at.name, name, **attrs, hop=_hop(sym, d.at.name))
    return g


def _hop(sym: Symbols, device: str) -> float:
    """What leaving ``device`` adds to a link's latency: the time inside it (a switch's hop,
    a NIC's latency; the runtime adds the same), so that routes by latency count it
    (`topology.route`)."""
    from fabric_ext.runtime.simulation.figures import time_inside
    d = sym.devices[device]
    return time_inside(d.kind, {p.name.name: prop_value(d.props, p.name.name) for p in d.props})


#: flows (source, destination pairs) the movements of a policy have together, at most: every
#: ordered pair of 128 devices.  Each is routed and its path kept (a 48 KB fabric of 1,000 GPUs in
#: a ring with `gpu* <-> gpu*` took more than 300 s and 9.5 GB).
MAX_FLOWS = 128 * 127


def build_graph(sym: Symbols, diags: Diagnostics) -> MovementGraph:
    """Build the movement graph; a movement with no path is an error at its declaration."""
    g = _physical(sym)
    islands, dev_island = _islands(sym)
    mg = MovementGraph(g, islands, dev_island)
    devices = list(sym.devices)
    left = MAX_FLOWS
    for name, m in sym.movements.items():
        srcs = [d for d in devices if m.src.matches(d)]
        dsts = [d for d in devices if m.dst.matches(d)]
        n = (len(srcs) * len(dsts) - len(set(srcs) & set(dsts))) * (2 if m.bidir else 1)
        if left - n < 0:        # (said at the first movement past the bound only)
            if left >= 0:
                diags.error(m.span, f"movement '{name}' has {n:,} source and destination pairs: with the movements "
                            f"before it, more than the {MAX_FLOWS:,} flows the compiler routes (the movements "
                            "after it are not routed)", "narrow its patterns to the devices it moves between")
            left = -1
            mg.flows[name] = []
            continue
        left -= n
        pairs = [(s, d) for s in srcs for d in dsts if s != d]
        if m.bidir:
            pairs += [(d, s) for s, d in pairs]
        via = [d for p in m.via for d in devices if p.matches(d)]
        flows = []
        for s, d in pairs:
            path = route(g, s, d, via)
            if path is None:
                hint = f"add a link on the way from '{s}' to '{d}'" if not via else \
                    f"check that every device in 'via' is linked on the way from '{s}' to '{d}'"
                diags.error(m.span, f"movement '{name}' cannot reach '{d}' from '{s}': no path", hint)
                continue
            flows.append(Flow(name, s, d, path, island_roles(path, dev_island)))
        if not pairs:
            diags.error(m.span, f"movement '{name}' has no source/destination pair",
                        "source and destination patterns match the same single device")
        mg.flows[name] = flows
    return mg
