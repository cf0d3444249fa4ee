"""Routing, port numbering and island roles: the facts the compiler and the runtime share.

The compiler routes each movement's flows with these functions and writes the
paths into the manifest; the runtime follows those paths, and routes with the
same functions only what the compiler could not know (a transfer no movement
declares, a ``route`` or ``tier`` decision).  Port ``i`` of a device leads to
``ports(g, device)[i]`` on both sides.
"""
from __future__ import annotations

from .digraph import DiGraph, shortest_path


def _weight(u, v, attrs) -> float:
    # shortest by latency, a switch's hop included (the compiler's graph keeps it apart from
    # the link's latency, the runtime's adds it in); each hop also costs 1 ns so that
    # equal-latency routes prefer fewer hops
    return (attrs.get("latency") or 0) + (attrs.get("hop") or 0) + 1


def route(g: DiGraph, src: str, dst: str, via: tuple[str, ...] | list[str] = ()) -> list[str] | None:
    """The lowest-latency path from src to dst through every device of ``via`` in order
    (fewest hops among equals), or None when there is none."""
    stops = [src, *via, dst]
    path = [src]
    for a, b in zip(stops, stops[1:]):
        leg = shortest_path(g, a, b, _weight)
        if leg is None:
            return None
        path += leg[1:]
    return path


def ports(g: DiGraph, device: str) -> list[str]:
    """The devices a device's ports lead to, in port-index order."""
    return sorted(g.successors(device))


def port_index(g: DiGraph, device: str, peer: str) -> int:
    """The index of the device's port that leads to ``peer`` (0 when none does)."""
    p = ports(g, device)
    return p.index(peer) if peer in p else 0


def island_role(island: str, src: str, dst: str, device_island: dict[str, str]) -> str:
    """The role of ``island`` for a chunk going from device src to dst: "src" or "dst" where
    the island holds that end (a switch holds its memory), else "transit"."""
    return "src" if device_island.get(src) == island else "dst" if device_island.get(dst) == island else "transit"


def island_roles(path: list[str], device_island: dict[str, str]) -> list[tuple[str, str]]:
    """The islands a path crosses, in order, each with its role: src, transit or dst.  A
    switch and its memory are one island; an endpoint role wins over transit."""
    out: list[tuple[str, str]] = []
    for i, dev in enumerate(path):
        isl = device_island.get(dev)
        if isl is None:
            continue
        role = "src" if i == 0 else "dst" if i == len(path) - 1 else "transit"
        if out and out[-1][0] == isl:
            if role != "transit":
                out[-1] = (isl, role)
            continue
        out.append((isl, role))
    return out
