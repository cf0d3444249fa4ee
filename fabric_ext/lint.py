"""Pass: warnings for parts of a policy that can have no effect (`warn`).

A policy the checker accepts may still do nothing where its writer expects it to: a
movement no transfer of the prefill matches (the workload, as declared, never moves that
data there), a handler at an island none of its movement's transfers cross, a handler
placed only on GPUs the workload does not use, or a map no handler touches.  The compiler
says so, at the declaration's or the handler's position; `fabricc check --Werror` (and
`compile --Werror`) make these errors.
"""
from __future__ import annotations

from . import ast as A
from .diagnostics import Diagnostics
from .flows import MovementTable
from .graph_export import to_json


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
    _movements_without_transfers(analysis, sym, diags)
    uses = _MapUses()
    for policy in analysis.program.policies:
        uses.visit(policy)
    for name, info in sym.maps.items():
        if name not in uses.names:
            diags.warning(info.decl.name.span, f"map '{name}' is declared but no handler uses it")


def _workload(sym) -> dict:
    """The workload's properties as declared (numbers and names), the runtime's defaults
    for what it leaves out."""
    out = {"tp": 1, "weights": "hbm", "kv": "hbm", "kv_export": None}
    for p in sym.workload.props if sym.workload is not None else ():
        v = p.value
        if isinstance(v, A.Num) and isinstance(v.value, int):
            out[p.name.name] = v.value
        elif isinstance(v, A.Name):
            out[p.name.name] = v.id
    return out


def _movements_without_transfers(analysis, sym, diags) -> None:
    """Match the transfers the declared prefill makes to movements, as the runtime will
    (`flows.MovementTable`): a movement none matches never moves anything, and a handler on
    a movement at an island none of its matched transfers cross never runs."""
    from fabric_ext.runtime.workload import prefill_flows
    w = _workload(sym)
    gpus = [name for name, d in sym.devices.items() if d.kind == "gpu"][:w["tp"]]
    table = MovementTable(to_json(analysis)["movements"])
    crossed: dict[str, set[str]] = {}
    for cls, operator, src, dst in prefill_flows(gpus, w["weights"], w["kv"], w["kv_export"]):
        hit = table.match(cls, operator, src, dst)
        if hit is not None:
            crossed.setdefault(hit.movement["name"], set()).update(i["island"] for i in hit.flow["islands"])
    for name, decl in sym.movements.items():
        if name not in crossed:
            diags.warning(decl.span, f"movement '{name}' matches no transfer of the prefill: with this workload "
                          f"(weights: {w['weights']}, kv: {w['kv']}, kv_export: {w['kv_export'] or 'none'}, "
                          f"tp {w['tp']}) no {decl.cls.name} moves from its source to its destination",
                          "declare a workload that places the data there, or match the transfers it makes")
    warned = set()
    for pl in analysis.placements:
        islands = crossed.get(pl.movement or "")
        if sym.devices[pl.island].kind == "gpu":
            continue            # GPUs outside the tensor-parallel group: `_handlers_outside_the_tp_group`
        if islands is not None and pl.island not in islands and id(pl.handler) not in warned:
            if not any(p.handler is pl.handler and p.island in islands for p in analysis.placements):
                warned.add(id(pl.handler))
                diags.warning(pl.handler.span, f"no transfer of movement '{pl.movement}' crosses {pl.island}: "
                              f"this handler never runs (its transfers cross {', '.join(sorted(islands))})")


def _handlers_outside_the_tp_group(analysis, sym, diags) -> None:
    """The prefill runs on the first ``tp`` GPUs of the fabric (in declaration order): a
    handler whose every GPU placement lies beyond them never runs there."""
    tp = _workload(sym)["tp"]
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
