"""The front end as one call: load, bind params, check, build the graph, place (`analyze`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fabric_ext.runtime.machine.gcutil import fewer_collections

from .checker import Symbols, check_declarations
from .diagnostics import Diagnostics
from .graph import MovementGraph, build_graph
from .lint import warn
from .loader import Program, load
from .params import bind
from .placement import Placement, place


@dataclass
class Analysis:
    program: Program
    symbols: Symbols
    graph: MovementGraph
    placements: list[Placement]
    diags: Diagnostics
    params: dict = field(default_factory=dict)     # each param's bound value (params.py)

    @property
    def ok(self) -> bool:
        return not self.diags.has_errors()


def analyze(path: str | Path, diags: Diagnostics | None = None, text: str | None = None, include=(),
            defines: dict[str, str] | None = None) -> Analysis:
    """Run every front-end pass over ``path`` (with ``text``: over that source, named ``path``);
    errors are in ``.diags``, never raised.

    A missing root file raises ``OSError`` (a usage error, not a policy error).
    """
    with fewer_collections():       # the parser makes a tree node or more per token
        return _analyze(path, diags or Diagnostics(), text, include, defines)


def _analyze(path, diags: Diagnostics, text, include, defines) -> Analysis:
    prog = load(path, diags, text, include)
    params = bind(prog, defines or {}, diags)       # -D values over the declared ones
    # an import that could not be read leaves its declarations missing: what the later passes
    # would say about them is a consequence of that one error, so they report into a scratch list
    later = diags if not prog.unread else Diagnostics()
    sym = check_declarations(prog, later)
    mg = build_graph(sym, later)
    placements = place(prog.policies, sym, mg, later)
    a = Analysis(prog, sym, mg, placements, diags, params)
    if not later.has_errors():
        warn(a, later)              # parts that can have no effect (lint.py)
    return a
