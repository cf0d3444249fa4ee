"""Pass 5: place handlers on islands (`place`), Merlin-style.

A handler on a movement's event without ``at`` is placed at every island on
the movement's path that has that hook (in a role where the hook fires); with
``at`` only at the named islands, each of which must be on the path and have
the hook.  A handler on an island event (``sw0.tick(10us)``, ``nic0.tx``) is
placed on each matching island and runs for every movement.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ast as A
from .checker import Symbols, check_handler, const_value
from .contract.hooks import HOOK_NAMES, HOOKS, Hook, hook, hooks_of
from .diagnostics import Diagnostics, did_you_mean
from .graph import MovementGraph
from .units import TIME


@dataclass
class Placement:
    """One handler placed on one island's hook."""
    island: str
    hook: Hook
    handler: A.Handler
    policy: str
    movement: str | None     # None: runs for every event at the hook
    period: int | None       # ns, for tick hooks
    order: int               # source order of the handler, for stable programs


def _fires(h: Hook, role: str) -> bool:
    return role in h.roles


def _movement_sites(mg: MovementGraph, movement: str, hook_name: str) -> list[str]:
    """Islands on the movement's path whose hook of that name fires there."""
    out = []
    for f in mg.flows.get(movement, []):
        for isl, role in f.islands:
            h = hook(mg.islands[isl].kind, hook_name)
            if h is not None and h.scope == "chunk" and _fires(h, role) and isl not in out:
                out.append(isl)
    return out


def _place_movement_handler(h, pol, order, sym, mg, diags) -> list[Placement]:
    name, hook_name = h.target.name, h.hook.name
    if h.arg is not None:
        diags.error(h.arg.span, f"'{hook_name}' on a movement takes no argument")
    kinds_with_hook = {hk.island_kind for hk in HOOKS.values() if hk.name == hook_name}
    if not kinds_with_hook:
        diags.error(h.hook.span, f"unknown hook '{hook_name}'", did_you_mean(hook_name, HOOK_NAMES)
                    or "hooks: " + ", ".join(HOOK_NAMES))
        return []
    if all(hook(k, hook_name).scope != "chunk" for k in kinds_with_hook):
        diags.error(h.hook.span, f"'{hook_name}' is not an event of a movement; it fires on islands",
                    f"write 'on ISLAND.{hook_name}{'(10us)' if hook_name == 'tick' else ''}'")
        return []
    if not mg.flows.get(name):      # its declaration is in error (no path, no pairs, too many): said there
        return []
    sites = _movement_sites(mg, name, hook_name)
    path_islands = mg.islands_of(name)
    if h.at:
        chosen = []
        for pat in h.at:
            hits = [i for i in mg.islands if pat.matches(i)]
            if not hits:
                diags.error(pat.span, f"unknown island '{pat}'", did_you_mean(pat.name, mg.islands))
                continue
            for isl in hits:
                if isl not in path_islands:
                    if not pat.wildcard:
                        diags.error(pat.span, f"'{isl}' is not on the path of movement '{name}'",
                                    "its path crosses " + ", ".join(path_islands) if path_islands else None)
                elif isl not in sites:
                    if not pat.wildcard:
                        diags.error(pat.span, f"island '{isl}' ({mg.islands[isl].kind}) has no '{hook_name}' "
                                    f"hook for movement '{name}'",
                                    _hooks_hint(mg.islands[isl].kind))
                else:
                    chosen.append(isl)
            if pat.wildcard and not any(i in sites for i in hits):
                diags.error(pat.span, f"no island matching '{pat}' on the path of '{name}' has hook '{hook_name}'")
        sites = chosen
    elif not sites and mg.flows.get(name):
        diags.error(h.hook.span, f"no island on the path of movement '{name}' has hook '{hook_name}'",
                    "its path crosses " + ", ".join(f"{i} ({mg.islands[i].kind})" for i in path_islands))
    return [Placement(isl, hook(mg.islands[isl].kind, hook_name), h, pol, name, None, order) for isl in sites]


def _hooks_hint(kind: str) -> str:
    return f"{kind} islands have: " + ", ".join(hooks_of(kind))


def _place_island_handler(h, pol, order, sym, mg, diags) -> list[Placement]:
    hook_name = h.hook.name
    if h.at:
        diags.error(h.at[0].span, "'at' applies to movement events; this event names its island already")
    hits = [i for i in mg.islands if h.target.matches(i)]
    if not hits:
        cands = list(mg.islands) + list(sym.movements)
        if h.target.name in sym.devices:
            diags.error(h.target.span, f"'{h.target.name}' is part of the island of "
                        f"'{mg.device_island.get(h.target.name)}', not an island itself",
                        f"write 'on {mg.device_island.get(h.target.name)}.{hook_name}'")
        else:
            diags.error(h.target.span, f"unknown movement or island '{h.target}'", did_you_mean(h.target.name, cands))
        return []
    period = None
    out = []
    for isl in hits:
        kind = mg.islands[isl].kind
        hk = hook(kind, hook_name)
        if hk is None:
            if not h.target.wildcard or len(hits) == 1:
                diags.error(h.hook.span, f"island '{isl}' ({kind}) has no hook '{hook_name}'",
                            did_you_mean(hook_name, hooks_of(kind)) or _hooks_hint(kind))
            continue
        if hk.scope == "tick":
            if h.arg is None:
                diags.error(h.hook.span, f"'{hook_name}' needs a period", f"write '{isl}.{hook_name}(10us)'")
                return []
            period = const_value(h.arg)
            if h.arg is not None and (not isinstance(h.arg, A.Num) or h.arg.dim != TIME or not period):
                diags.error(h.arg.span, "a tick period must be a positive time", "e.g. tick(10us)")
                return []
        elif h.arg is not None:
            diags.error(h.arg.span, f"'{hook_name}' takes no argument")
        out.append(Placement(isl, hk, h, pol, None, int(period) if period else None, order))
    if not out and len(hits) > 1:
        diags.error(h.hook.span, f"no island matching '{h.target}' has hook '{hook_name}'")
    return out


def place(policies: list[A.Policy], sym: Symbols, mg: MovementGraph, diags: Diagnostics) -> list[Placement]:
    """Place every handler of every policy; check each body against its hooks."""
    placements: list[Placement] = []
    order = 0
    for pol in policies:
        for h in pol.handlers:
            order += 1
            if not h.target.wildcard and h.target.name in sym.movements:
                ps = _place_movement_handler(h, pol.name.name, order, sym, mg, diags)
            else:
                ps = _place_island_handler(h, pol.name.name, order, sym, mg, diags)
            hooks = list({id(p.hook): p.hook for p in ps}.values())
            if hooks:  # when placement failed its error is already reported
                check_handler(h, hooks, sym, diags)
            placements.extend(ps)
    return placements
