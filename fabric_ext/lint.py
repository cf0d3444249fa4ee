"""Pass: warnings for parts of a policy that can have no effect (`warn`).

A policy the checker accepts may still do nothing where its writer expects it to: a
handler placed only on GPUs the workload does not use, or a map no handler touches.  The
compiler says so, at the handler's or the map's position; `fabricc check --Werror` (and
`compile --Werror`) make these errors.
"""
from __future__ import annotations

from . import ast as A
from .diagnostics import Diagnostics


class _MapUses(A.Visitor):
    """The maps a policy reads, writes, deletes from or emits to."""

    def __init__(self):
        self.names: set[str] = set()

    def _use(self, node):
        self.names.add(node.map.name)
        self.generic_visit(node)

    visit_MapGet = visit_MapUpdate = visit_Delete = visit_Emit = _use


def warn(analysis, diags: Diagnostics) -> None:
    """Add the warnings of ``analysis`` to ``diags``."""
    sym = analysis.symbols
    _handlers_outside_the_tp_group(analysis, sym, diags)
    uses = _MapUses()
    for policy in analysis.program.policies:
        uses.visit(policy)
    for name, info in sym.maps.items():
        if name not in uses.names:
            diags.warning(info.decl.name.span, f"map '{name}' is declared but no handler uses it")


def _handlers_outside_the_tp_group(analysis, sym, diags) -> None:
    """The prefill runs on the first ``tp`` GPUs of the fabric (in declaration order): a
    handler whose every GPU placement lies beyond them never runs there."""
    tp = 1
    if sym.workload is not None:
        for p in sym.workload.props:
            if p.name.name == "tp" and isinstance(p.value, A.Num) and isinstance(p.value.value, int):
                tp = p.value.value
    gpus = [name for name, d in sym.devices.items() if d.kind == "gpu"]
    group = set(gpus[:tp])
    by_handler: dict[int, tuple[A.Handler, set[str]]] = {}
    for pl in analysis.placements:
        if pl.island in gpus:
            by_handler.setdefault(id(pl.handler), (pl.handler, set()))[1].add(pl.island)
    for handler, islands in by_handler.values():
        if not islands & group:
            shown = ", ".join(sorted(islands))
            diags.warning(handler.span, f"this handler runs only on {shown}, outside the tensor-parallel group "
                          f"(tp {tp}: {', '.join(gpus[:tp])}): it never runs",
                          "place it on a GPU of the group, or raise the workload's tp")
