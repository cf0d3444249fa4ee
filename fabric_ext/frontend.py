"""The front end as one call: load, check, build the graph, place (`analyze`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checker import Symbols, check_declarations
from .diagnostics import Diagnostics
from .graph import MovementGraph, build_graph
from .loader import Program, load
from .placement import Placement, place


@dataclass
class Analysis:
    program: Program
    symbols: Symbols
    graph: MovementGraph
    placements: list[Placement]
    diags: Diagnostics

    @property
    def ok(self) -> bool:
        return not self.diags.has_errors()


def analyze(path: str | Path, diags: Diagnostics | None = None) -> Analysis:
    """Run every front-end pass over ``path``; errors are in ``.diags``, never raised.

    A missing root file raises ``OSError`` (a usage error, not a policy error).
    """
    diags = diags or Diagnostics()
    prog = load(path, diags)
    sym = check_declarations(prog, diags)
    mg = build_graph(sym, diags)
    placements = place(prog.policies, sym, mg, diags)
    return Analysis(prog, sym, mg, placements, diags)
