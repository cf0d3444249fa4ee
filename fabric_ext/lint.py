"""Pass: warnings for parts of a policy that can have no effect (`warn`).

A policy the checker accepts may still do nothing where its writer expects it to: a
movement no transfer of the prefill matches (the workload, as declared, never moves that
data there), a handler at an island none of its movement's transfers cross, one on an
island's chunk hook that no transfer meets there, a handler
placed only on GPUs the workload does not use, a map no handler touches, or a decision
whose constant value can never take effect.  The compiler
says so, at the declaration's or the handler's position; `fabricc check --Werror` (and
`compile --Werror`) make these errors.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from . import ast as A
from .checker import const_value, exact_value
from .contract import topology
from .contract.flows import MovementTable
from .contract.hooks import TIER_KINDS
from .contract.topology import island_roles, route
from .diagnostics import Diagnostics
from .graph import prop_value
from .graph_export import to_json
from .units import SIZE, format_quantity


class _MapUses(A.Visitor):
    """The maps a policy reads, writes, deletes from or emits to."""

    def __init__(self):
        self.names: set[str] = set()

    def _use(self, node):
        self.names.add(node.map.name)
        self.generic_visit(node)

    visit_MapGet = visit_MapUpdate = visit_Delete = visit_Emit = visit_HistAdd = _use


class _Updates(A.Visitor):
    """Every map update of a policy (``m[k] OP= v``)."""

    def __init__(self):
        self.found: list[A.MapUpdate] = []

    def visit_MapUpdate(self, node):
        self.found.append(node)
        self.generic_visit(node)


class _CountedKeys(A.Visitor):
    """Every map access keyed by a context field numbered from 0 (`COUNTED`): (the
    access, its map, the field)."""

    def __init__(self):
        self.found: list[tuple[A.Node, str, str]] = []

    def _access(self, node):
        key = node.key
        if isinstance(key, A.FieldRef) and key.obj == "ev" and key.name.name in COUNTED:
            self.found.append((node, node.map.name, key.name.name))
        self.generic_visit(node)

    visit_MapGet = visit_MapUpdate = _access


#: context fields numbered from 0: a model's layers, an island's ports
COUNTED = ("layer", "port", "in_port", "out_port")


class _Variables(A.Visitor):
    """Each value a variable is given (``let x = v``, ``x = v``): (name, value)."""

    def __init__(self, decisions: set[str]):
        self.decisions, self.given = decisions, []

    def visit_Let(self, node):
        self.given.append((node.name.name, node.value))
        self.generic_visit(node)

    def visit_Assign(self, node):
        if not node.via_ev and node.target.name not in self.decisions:
            self.given.append((node.target.name, node.value))
        self.generic_visit(node)


class _Decisions(A.Visitor):
    """The decisions a handler sets to a constant (``coalesce = 256KiB``, ``route = sw1``)."""

    def __init__(self, names: set[str]):
        self.names, self.found = names, []

    def visit_Assign(self, node):
        if node.target.name in self.names:
            self.found.append(node)
        self.generic_visit(node)


def warn(analysis, diags: Diagnostics) -> None:
    """Add the warnings of ``analysis`` to ``diags``."""
    sym = analysis.symbols
    modules = analysis.program.modules
    if modules and not any(m.items for m in modules):
        diags.warning(modules[0].span, "this file declares nothing (no import, fabric, workload, movement, map "
                                       "or policy): its bundle has no programs and no fabric to run on",
                      'start from a bundled policy, e.g. import "fabrics/dgx_cxl.fx"')
    _export_to_where_kv_goes(sym, diags)
    _handlers_outside_the_tp_group(analysis, sym, diags)
    transfers = _prefill_transfers(analysis, sym)
    _movements_without_transfers(analysis, sym, transfers, diags)
    _island_handlers_no_transfer_meets(analysis, sym, transfers, diags)
    _decisions_without_effect(analysis, sym, transfers, diags)
    _updates_that_keep_zero(analysis, sym, diags)
    _maps_smaller_than_their_keys(analysis, sym, diags)
    _variables_cut_to_whole_numbers(analysis, diags)
    uses = _MapUses()
    for policy in analysis.program.policies:
        uses.visit(policy)
    for name, info in sym.maps.items():
        if name not in uses.names:
            diags.warning(info.decl.name.span, f"map '{name}' is declared but no handler uses it")


def _variables_cut_to_whole_numbers(analysis, diags) -> None:
    """A variable holds a whole number: ``let k = 1.5`` holds 1, and ``ev.bytes * k`` is then
    ``ev.bytes * 1``, where ``ev.bytes * 1.5`` takes the constant's exact value."""
    found = _Variables({f.name for pl in analysis.placements for f in pl.hook.decisions})
    for policy in analysis.program.policies:
        found.visit(policy)
    for name, value in found.given:
        exact = exact_value(value)
        if exact is not None and exact.denominator != 1:
            diags.warning(value.span, f"'{name}' holds {math.floor(exact)}: a variable holds whole numbers, so "
                          f"{float(exact):g} is cut to its whole part", "write the constant where it is used (it "
                          "then keeps its exact value), or scale it: let k = 3, then x * k / 2")


def _updates_that_keep_zero(analysis, sym, diags) -> None:
    """``min=`` and ``&=`` on an array: its entries are there from the start, holding 0, so
    these keep them 0 (a hash map's missing key takes the first value: codegen's
    `UPDATE_START`), unless the policy sets the map's entries with ``=`` too."""
    updates = _Updates()
    for policy in analysis.program.policies:
        updates.visit(policy)
    assigned = {u.map.name for u in updates.found if u.op == "="}
    for u in updates.found:
        info = sym.maps.get(u.map.name)
        if u.op in ("min=", "&=") and info is not None and info.kind in ("array", "percpu_array") \
                and u.map.name not in assigned:
            diags.warning(u.map.span, f"'{u.op}' on array '{u.map.name}' keeps its entries 0: an array's "
                          "entries start at 0", f"declare '{u.map.name}' a hash map (a key it does not hold takes "
                          "the first value), or set its entries with '=' first")


def _maps_smaller_than_their_keys(analysis, sym, diags) -> None:
    """An array or hash map indexed by ``ev.layer`` with fewer entries than the model has
    layers, or by a port with fewer than the island's device has ports: as in the kernel,
    updates past an array's end are dropped and reads there give 0, and a hash map with
    every entry in use refuses new keys (an lru_hash evicts instead)."""
    layers = _model_layers(sym)
    g, islands = analysis.graph.g, analysis.graph.islands
    warned = set()
    for pl in analysis.placements:
        keys = _CountedKeys()
        for stmt in pl.handler.body:
            keys.visit(stmt)
        for node, name, field in keys.found:
            info = sym.maps.get(name)
            if info is None or info.kind not in ("array", "percpu_array", "hash", "percpu_hash") \
                    or id(node) in warned:
                continue
            if field == "layer":
                count, what = layers, f"the workload's model has {layers} layers"
            else:       # (a DPU/NIC's network is a port after its links)
                count = max(len(topology.ports(g, d)) + (sym.devices[d].kind in ("dpu", "nic"))
                            for d in islands[pl.island].devices)
                what = f"{pl.island} has {count} ports"
            if count and info.max_entries < count:
                warned.add(id(node))
                lost = f"updates at ev.{field} {info.max_entries} and above are dropped, and reads there give 0" \
                    if info.kind.endswith("array") else \
                    f"once {info.max_entries} keys are in it, updates of another are refused (the run counts them)"
                diags.warning(node.key.span, f"'{name}' holds {info.max_entries} entries and {what}: {lost}",
                              f"declare '{name}' with [{count}] entries or more")


def _model_layers(sym) -> int | None:
    """The layers of the workload's model (None where it is no model the runtime loads)."""
    from fabric_ext.runtime.simulation.workload import WorkloadError, load_model
    prop = next((p for p in sym.workload.props if p.name.name == "model"), None) if sym.workload else None
    name = getattr(prop.value, "value", None) if prop is not None else "llama3-8b"
    try:
        return load_model(name).layers if isinstance(name, str) else None
    except WorkloadError:
        return None


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


def _passes(w: dict) -> int:
    """The passes of the declared prefill: one, or the prompt in `prefill_chunk`s."""
    from fabric_ext.runtime.simulation.workload import DEFAULT_PROMPT
    prompt, step = w.get("prompt", DEFAULT_PROMPT), w.get("prefill_chunk", 0)
    return -(-prompt // step) if 0 < step < prompt else 1


class _Transfer(NamedTuple):
    """A kind of transfer the declared prefill makes (`_prefill_transfers`)."""
    hit: object         # its movement's match (`flows.MovementTable`), or None
    path: list | None   # the movement's path, or routed as the runtime routes a transfer no movement declares
    kept: bool          # KV written back: its bytes stay where it ends (what a `tier` may move)


def _prefill_transfers(analysis, sym) -> list[_Transfer]:
    """Each kind of transfer the declared prefill makes, matched to its movement as the runtime
    will."""
    from fabric_ext.runtime.simulation.workload import kept_where_it_lands, prefill_flows
    w = _workload(sym)
    gpus = [name for name, d in sym.devices.items() if d.kind == "gpu"][:w["tp"]]
    table = MovementTable(to_json(analysis)["movements"])
    out = []
    for cls, operator, src, dst in prefill_flows(gpus, w["weights"], w["kv"], w["kv_export"], _passes(w)):
        hit = table.match(cls, operator, src, dst)
        out.append(_Transfer(hit, hit.path if hit is not None else route(analysis.graph.g, src, dst),
                             kept_where_it_lands(cls, operator, dst, w["kv"])))
    return out


def _movements_without_transfers(analysis, sym, transfers, diags) -> None:
    """A movement no transfer of the prefill matches never moves anything (but where a
    handler sets a tier, KV to and from the memory it names), and a handler on a movement at
    an island none of its matched transfers cross never runs."""
    w = _workload(sym)
    crossed: dict[str, set[str]] = {}
    for t in transfers:
        if t.hit is not None:
            crossed.setdefault(t.hit.movement["name"], set()).update(i["island"] for i in t.hit.flow["islands"])
    tiered = any(_sets(pl.handler, {"tier"}) for pl in analysis.placements)
    for name, decl in sym.movements.items():
        if name not in crossed and not (tiered and decl.cls.name == "kv"):   # a tier may put KV anywhere
            passes = _passes(w)
            diags.warning(decl.span, f"movement '{name}' matches no transfer of the prefill: with this workload "
                          f"(weights: {w['weights']}, kv: {w['kv']}, kv_export: {w['kv_export'] or 'none'}, "
                          f"tp {w['tp']}, {passes} pass{'es' if passes > 1 else ''}) no {decl.cls.name} moves from "
                          "its source to its destination",
                          "declare a workload that places the data there (KV is read back only by a chunked "
                          "prefill's later passes: prefill_chunk), or match the transfers it makes")
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


def _island_handlers_no_transfer_meets(analysis, sym, transfers, diags) -> None:
    """A handler on an island's chunk hook (``nic0.rx``, ``cpu0.complete``) runs for every
    chunk that meets the hook there, whatever its movement: where none of the declared
    prefill's transfers does (each on its movement's path, or routed as the runtime routes
    it), it never runs; nor does ``host.alloc`` but at the fabric's first host.  Not said
    where a handler routes or tiers: paths then change as the run goes."""
    if any(_sets(pl.handler, {"route", "tier"}) for pl in analysis.placements):
        return
    mg, w = analysis.graph, _workload(sym)
    gpus = [name for name, d in sym.devices.items() if d.kind == "gpu"]
    met = {role for t in transfers for role in island_roles(t.path or [], mg.device_island)}
    placer = next((name for name, island in mg.islands.items() if island.kind == "host"), None)
    by_handler: dict[int, tuple[A.Handler, list]] = {}
    for pl in analysis.placements:
        if pl.movement is None and pl.hook.scope == "chunk" and pl.island not in gpus[w["tp"]:]:
            by_handler.setdefault(id(pl.handler), (pl.handler, []))[1].append(pl)
    for handler, placements in by_handler.values():
        if any(pl.island == placer if pl.hook.moment == "place" else
               any((pl.island, role) in met for role in pl.hook.roles) for pl in placements):
            continue
        where = ", ".join(sorted({f"{pl.island}.{pl.hook.name}" for pl in placements}))
        if all(pl.hook.moment == "place" for pl in placements):
            diags.warning(handler.span, f"{where} never runs: the weights are placed at the fabric's first host, "
                          f"{placer}", f"write 'on {placer}.{placements[0].hook.name}'")
        else:
            diags.warning(handler.span, f"no transfer of the prefill meets {where}: this handler never runs "
                          f"(with this workload: weights: {w['weights']}, kv: {w['kv']}, "
                          f"kv_export: {w['kv_export'] or 'none'}, tp {w['tp']})",
                          "declare a workload whose data passes there, or hook an island it crosses")


def _sets(handler: A.Handler, decisions: set[str]) -> bool:
    finder = _Decisions(decisions)
    for stmt in handler.body:
        finder.visit(stmt)
    return bool(finder.found)


def _export_to_where_kv_goes(sym, diags) -> None:
    """`kv_export` naming the device `kv` sends the KV to already sends it once, not twice."""
    w = _workload(sym)
    if w["kv_export"] is not None and w["kv_export"] == w["kv"]:
        prop = next(p for p in sym.workload.props if p.name.name == "kv_export")
        diags.warning(prop.value.span, f"kv_export: {w['kv']} is where kv sends the KV already: it goes there once",
                      "leave kv_export out, or keep the KV elsewhere (kv: hbm, or a memory) and export it")


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


def _decisions_without_effect(analysis, sym, transfers, diags) -> None:
    """A decision set to a constant that no event at any of the handler's islands can act on:
    `coalesce` no larger than the chunks it would merge, `prefetch` with no weights to fetch,
    `route` to a device not linked to the island, `tier` naming a device that holds no memory;
    and a `tier` on movements that carry no KV written back (nothing else moves on one)."""
    kept = {t.hit.movement["name"] for t in transfers if t.kept and t.hit is not None}
    by_handler: dict[int, tuple[A.Handler, list]] = {}
    for pl in analysis.placements:
        by_handler.setdefault(id(pl.handler), (pl.handler, []))[1].append(pl)
    for handler, placements in by_handler.values():
        names = {f.name for pl in placements for f in pl.hook.decisions}
        finder = _Decisions(names)
        for stmt in handler.body:
            finder.visit(stmt)
        for assign in finder.found:
            why = _tier_on_data_not_kept(assign, placements, kept) or _without_effect(analysis, sym, assign, placements)
            if why is not None:
                diags.warning(assign.value.span, why[0], why[1])


def _tier_on_data_not_kept(assign, placements, kept: set[str]) -> tuple[str, str] | None:
    """Why a `tier` on movements whose data is not kept where it lands (weights and KV a GPU
    reads, KV a NIC exports) never takes effect; None where one of them may carry KV written
    back, or a handler on an island hook may meet it."""
    if assign.target.name != "tier" or any(pl.movement is None or pl.movement in kept for pl in placements):
        return None
    names = ", ".join(sorted({pl.movement for pl in placements}))
    return (f"tier: {names} carries no KV written back to memory, the only data a tier moves on its way "
            "(weights and KV a GPU reads, and KV a NIC exports, go on to where they are used); the runtime "
            "refuses it",
            "set tier on the movement of the KV written back, or place weights with host.alloc")


def _chunk_size(sym, movement: str | None) -> int:
    """The largest chunk a handler on ``movement`` (None: every movement) can be given: the
    movement's `chunk`, or the workload's, which transfers no movement sets keep."""
    from fabric_ext.runtime.simulation.figures import figures
    size = _workload(sym).get("chunk", figures()["defaults"]["transfer_chunk"])
    decls = [sym.movements[movement]] if movement else list(sym.movements.values())
    sizes = [prop_value(d.props, "chunk", size) for d in decls]
    return min(sizes + ([size] if movement is None else []))


def _without_effect(analysis, sym, assign, placements) -> tuple[str, str] | None:
    """Why the constant decision ``assign`` never takes effect at any of ``placements`` (a
    message and a hint), or None when it may."""
    name, value = assign.target.name, assign.value
    if name in ("route", "tier"):
        device = value.id if isinstance(value, A.Name) and value.id in sym.devices else None
        if device is None:
            return None
        if name == "tier" and sym.devices[device].kind not in TIER_KINDS:
            return (f"tier = {device}: {device} is a {sym.devices[device].kind}, which holds no memory; the runtime "
                    "refuses it", f"a tier names a memory device ({', '.join(TIER_KINDS)})")
        if name == "route":
            g, islands = analysis.graph.g, analysis.graph.islands
            linked = [pl.island for pl in placements
                      if any(g.has_edge(d, device) for d in islands[pl.island].devices)]
            if not linked:
                where = ", ".join(sorted({pl.island for pl in placements}))
                return (f"route = {device}: {device} is not linked to {where}, so no chunk can go there next; "
                        "the runtime refuses it", "route names a neighbour of the island (its next hop)")
        return None
    v = const_value(value)
    if not v:
        return None
    if name == "coalesce":
        sizes = {pl.movement: _chunk_size(sym, pl.movement) for pl in placements}
        if all(v <= size for size in sizes.values()):
            chunk = format_quantity(min(sizes.values()), SIZE)
            return (f"coalesce = {format_quantity(v, SIZE)} never merges anything: the chunks it meets are "
                    f"{chunk} or more already (a chunk is held only while smaller than the coalesce size)",
                    "coalesce to more than the chunk size, or give the movement a smaller `chunk`")
    if name == "prefetch" and _workload(sym)["weights"] == "hbm":
        return ("prefetch never takes effect: the workload keeps the weights in HBM (weights: hbm), so no "
                "weights are fetched", "place the weights elsewhere (weights: pool0), or drop the decision")
    return None
