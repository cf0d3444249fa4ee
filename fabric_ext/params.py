"""Pass 2b: bind each ``param`` to its value (`bind`), the declared one or the command line's.

``param quota : bandwidth = 2GB/s`` declares a value the policy uses by name, in expressions
and in properties; ``-D quota=1GB/s`` (on `fabricc` and `fabric-run`) overrides it, checked
against the declared dimension.  Each use becomes the literal of its bound value, so the
later passes see plain numbers (and fold them); the manifest records every bound value.
"""
from __future__ import annotations

from dataclasses import fields

from fabric_ext.runtime.machine.errors import UsageError

from . import ast as A
from .diagnostics import Diagnostics, did_you_mean
from .units import BASE_UNIT, DIM_NAMES, quantity_as

#: the dimension a param declares -> its values' dimension: one with a unit, or count (a plain number)
DIMS = {**{dim: dim for dim in BASE_UNIT}, "count": None}
U64_MAX = (1 << 64) - 1


def parse_defines(items) -> dict[str, str]:
    """``-D NAME=VALUE`` options as {name: value text}."""
    out = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise UsageError(f"-D {item}: write -D NAME=VALUE (a param of the policy and its value, e.g. quota=1GB/s)")
        out[name.strip()] = value.strip()
    return out


def bind(program, defines: dict[str, str], diags: Diagnostics) -> dict[str, int | float]:
    """Every param's value (``defines`` over the declared ones), substituted for its uses in
    ``program``; a bad declaration is an error in ``diags``, a bad ``-D`` a `UsageError`."""
    declared: dict[str, tuple[A.Param, str | None]] = {}
    for p in program.params:
        dim = _declared_dim(p, diags)
        if p.name.name in declared:
            diags.error(p.name.span, f"param '{p.name.name}' is declared twice")
        elif dim is not False:
            declared[p.name.name] = (p, dim)
    values = {name: (p.value.value, p.value.text) for name, (p, _) in declared.items()}
    for name, text in defines.items():
        if name not in declared:
            hint = did_you_mean(name, declared)
            raise UsageError(f"-D {name}={text}: the policy declares no param '{name}'"
                             + (f"; {hint}" if hint else f" (its params: {', '.join(declared) or 'none'})"))
        values[name] = (_defined(name, text, declared[name][1]), text)
    if values:
        bound = {name: (value, declared[name][1], text) for name, (value, text) in values.items()}
        for module in program.modules:
            _substitute(module, bound, diags)
    return {name: value for name, (value, _) in values.items()}


def _declared_dim(p: A.Param, diags):
    """The declared dimension (None: a count), or False where the declaration is wrong."""
    if p.dim.name not in DIMS:
        diags.error(p.dim.span, f"unknown dimension '{p.dim.name}' for param '{p.name.name}'",
                    f"a param is one of {', '.join(DIMS)}")
        return False
    dim = DIMS[p.dim.name]
    v = p.value
    if not isinstance(v, A.Num) or (v.dim != dim and not (v.dim is None and v.value == 0)):
        got = DIM_NAMES[v.dim] if isinstance(v, A.Num) else "not a number"
        diags.error(v.span, f"param '{p.name.name}' is {DIM_NAMES[dim]}, and its value is {got}",
                    f"give it a value in units of {p.dim.name}" if dim else "give it a plain number")
        return False
    return dim


def _defined(name: str, text: str, dim):
    try:
        value = quantity_as(text, dim, name, bare=False)
    except ValueError as e:
        raise UsageError(f"-D {name}={text}: {e}") from None
    if not 0 <= value <= U64_MAX:
        raise UsageError(f"-D {name}={text}: more than fits in 64 bits")
    return value


def _substitute(node, values, diags) -> None:
    """Each ``Name`` of a param becomes the literal of its value, in place; a variable named
    like a param is an error (its uses would be ambiguous)."""
    for f in fields(node):
        v = getattr(node, f.name)
        if isinstance(v, list):
            setattr(node, f.name, [_replaced(x, values) for x in v])
        elif isinstance(v, A.Node):
            setattr(node, f.name, _replaced(v, values))
    for child in node.children():
        _substitute(child, values, diags)
    var = node.name if isinstance(node, A.Let) else node.var if isinstance(node, A.For) else None
    if var is not None and var.name in values:
        diags.error(var.span, f"'{var.name}' is a param of the policy; name the variable differently")


def _replaced(node, values):
    if isinstance(node, A.Name) and node.id in values:
        value, dim, text = values[node.id]
        return A.Num(value, dim, text, span=node.span)
    return node
