"""Ids for movements, devices, islands, classes and operators, assigned once
(in declaration order, starting at 1 so that 0 can mean "unset") and written
to the manifest so that the runtime fills contexts with the same numbers."""
from __future__ import annotations

from dataclasses import dataclass

from .hooks import CLASSES, OPERATORS


@dataclass
class IdTables:
    movements: dict[str, int]
    devices: dict[str, int]
    islands: dict[str, int]
    classes: dict[str, int]
    operators: dict[str, int]

    def to_json(self) -> dict:
        return {k: dict(v) for k, v in vars(self).items()}


def assign_ids(analysis) -> IdTables:
    sym, mg = analysis.symbols, analysis.graph
    return IdTables(
        movements={m: i for i, m in enumerate(sym.movements, 1)},
        devices={d: i for i, d in enumerate(sym.devices, 1)},
        islands={n: i for i, n in enumerate(mg.islands, 1)},
        classes={c: i for i, c in enumerate(CLASSES, 1)},
        operators={o: i for i, o in enumerate(OPERATORS, 1)},
    )
