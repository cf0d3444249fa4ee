"""The fabric as a directed graph: devices and the links between them, with their attributes.

What the compiler and the runtime need of a graph is small — add nodes and links, look a link
up, walk a device's successors, the lowest-cost path — so it is this module rather than
networkx, whose import alone (0.15 s) cost more than checking a policy.  The API is networkx's
for the part used (``add_node``, ``add_edge``, ``has_edge``, ``successors``, ``edges(data=True)``,
``edges[u, v]``), and `shortest_path` is what networkx's ``shortest_path`` runs for one pair,
its bidirectional Dijkstra, ties broken as it breaks them (tests/test_frontend.py compares the
two on random graphs).
"""
from __future__ import annotations

from heapq import heappop, heappush
from itertools import count


class DiGraph:
    def __init__(self):
        self.succ: dict[str, dict[str, dict]] = {}     # u -> v -> the link's attributes
        self.pred: dict[str, dict[str, dict]] = {}     # v -> u -> the same attributes
        self.node_attrs: dict[str, dict] = {}

    def add_node(self, n: str, **attrs) -> None:
        self.succ.setdefault(n, {})
        self.pred.setdefault(n, {})
        self.node_attrs.setdefault(n, {}).update(attrs)

    def add_edge(self, u: str, v: str, **attrs) -> None:
        """A link from u to v (adding either device if new); a link added again takes the new
        attributes over the old."""
        self.add_node(u)
        self.add_node(v)
        self.pred[v][u] = self.succ[u].setdefault(v, {})
        self.pred[v][u].update(attrs)

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
    when there is none.  Dijkstra from both ends in turn, as networkx's bidirectional search
    runs it: a node's path is the first found at its distance (the queues break ties by push
    order, neighbours in insertion order), and the search ends when a node is settled from
    both sides, with the best meeting point seen so far."""
    if source not in g.succ or target not in g.succ:
        return None
    if source == target:
        return [source]
    neighbours = (g.succ, g.pred)
    settled: tuple[dict, dict] = ({}, {})
    preds: tuple[dict, dict] = ({source: None}, {target: None})
    seen = ({source: 0}, {target: 0})
    order = count()
    fringe = ([(0, next(order), source)], [(0, next(order), target)])
    best, meet, side = None, None, 1
    while fringe[0] and fringe[1]:
        side = 1 - side
        d, _, v = heappop(fringe[side])
        if v in settled[side]:
            continue
        settled[side][v] = d
        if v in settled[1 - side]:
            return _walk(preds[0], meet)[::-1] + _walk(preds[1], preds[1][meet])
        for w, attrs in neighbours[side][v].items():
            vw = d + (weight(v, w, attrs) if side == 0 else weight(w, v, attrs))
            if w not in settled[side] and (w not in seen[side] or vw < seen[side][w]):
                seen[side][w] = vw
                heappush(fringe[side], (vw, next(order), w))
                preds[side][w] = v
                if w in seen[1 - side] and (best is None or vw + seen[1 - side][w] < best):
                    best, meet = vw + seen[1 - side][w], w
    return None


def _walk(pred: dict, node) -> list:
    """From ``node`` along ``pred`` to the search's end (None)."""
    out = []
    while node is not None:
        out.append(node)
        node = pred[node]
    return out
