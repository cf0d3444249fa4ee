"""The fabric as a directed graph: devices and the links between them, with their attributes.

What the compiler and the runtime need of a graph is small — add nodes and links, look a link
up, walk a device's successors, the lowest-cost path — so it is this module rather than
networkx, whose import alone (0.15 s) cost more than checking a policy.  The API is networkx's
for the part used (``add_node``, ``add_edge``, ``has_edge``, ``successors``, ``edges(data=True)``,
``edges[u, v]``), and `shortest_path` is networkx's Dijkstra, ties broken as it breaks them
(tests/test_frontend.py compares the two on random graphs).
"""
from __future__ import annotations

from heapq import heappop, heappush
from itertools import count


class DiGraph:
    def __init__(self):
        self.succ: dict[str, dict[str, dict]] = {}     # u -> v -> the link's attributes
        self.node_attrs: dict[str, dict] = {}

    def add_node(self, n: str, **attrs) -> None:
        self.succ.setdefault(n, {})
        self.node_attrs.setdefault(n, {}).update(attrs)

    def add_edge(self, u: str, v: str, **attrs) -> None:
        """A link from u to v (adding either device if new); a link added again takes the new
        attributes over the old."""
        self.add_node(u)
        self.add_node(v)
        self.succ[u].setdefault(v, {}).update(attrs)

    def has_edge(self, u: str, v: str) -> bool:
        return v in self.succ.get(u, ())

    def successors(self, n: str):
        return iter(self.succ[n])

    def __contains__(self, n) -> bool:
        return n in self.succ

    def __iter__(self):
        return iter(self.succ)

    @property
    def edges(self) -> _Edges:
        return _Edges(self.succ)


class _Edges:
    """``g.edges(data=True)`` iterates (u, v, attributes) in insertion order; ``g.edges[u, v]``
    is one link's attributes."""

    def __init__(self, succ):
        self.succ = succ

    def __call__(self, data: bool = False):
        for u, out in self.succ.items():
            for v, attrs in out.items():
                yield (u, v, attrs) if data else (u, v)

    def __getitem__(self, uv: tuple[str, str]) -> dict:
        u, v = uv
        return self.succ[u][v]

    def __iter__(self):
        return self()


def shortest_path(g: DiGraph, source: str, target: str, weight) -> list[str] | None:
    """The path of least total ``weight(u, v, attributes)`` from source to target, or None
    when there is none.  Dijkstra as networkx runs it: a node's path is the first one found
    at its distance (the queue breaks ties by push order, successors in insertion order)."""
    if source not in g.succ or target not in g.succ:
        return None
    if source == target:
        return [source]
    dist: dict[str, float] = {}
    seen = {source: 0}
    paths = {source: [source]}
    order = count()
    fringe = [(0, next(order), source)]
    while fringe:
        d, _, v = heappop(fringe)
        if v in dist:
            continue
        dist[v] = d
        if v == target:
            return paths[v]
        for u, attrs in g.succ[v].items():
            vu = d + weight(v, u, attrs)
            if u not in dist and (u not in seen or vu < seen[u]):
                seen[u] = vu
                heappush(fringe, (vu, next(order), u))
                paths[u] = paths[v] + [u]
    return None
