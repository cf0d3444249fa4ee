"""Which declared movement a transfer belongs to: one rule for the compiler and the runtime.

A transfer is a data class, an operator (or none), a source and a destination.
It belongs to the movement that declares that class, operator and (source,
destination) flow; a movement that names its operator wins over one that
does not, and among equals the first declared wins.  The table is built from
the movements as the manifest lists them (name, class, operator, flows with
their routed paths), so the runtime follows the paths the compiler chose.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    """A transfer's movement (its manifest entry) and the flow routed for it."""
    movement: dict
    flow: dict

    @property
    def path(self) -> list[str]:
        return self.flow["path"]


class MovementTable:
    def __init__(self, movements: list[dict]):
        self._index: dict[tuple, Match] = {}
        for m in movements:
            for f in m["flows"]:
                self._index.setdefault((m["operator"], m["class"], f["src"], f["dst"]), Match(m, f))

    def match(self, cls: str, operator: str | None, src: str, dst: str) -> Match | None:
        return self._index.get((operator, cls, src, dst)) or self._index.get((None, cls, src, dst))
