"""AST of the .fx language: dataclasses that carry their source span.

`Visitor` recurses by default through every child node, so a pass overrides
only the ``visit_<Class>`` methods of the nodes it cares about.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .diagnostics import NO_SPAN, Span

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}     # a node class's fields, looked up once
_METHODS: dict[tuple[type, type], object] = {}      # (visitor class, node class) -> its visit_ function


@dataclass(eq=False)
class Node:
    span: Span = field(default=NO_SPAN, kw_only=True, repr=False)

    def children(self):
        names = _FIELD_NAMES.get(type(self))
        if names is None:
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in fields(self) if f.name != "span")
        for name in names:
            v = getattr(self, name)
            if isinstance(v, Node):
                yield v
            elif isinstance(v, (list, tuple)):
                yield from (x for x in v if isinstance(x, Node))


class Visitor:
    """Calls ``visit_<ClassName>`` if defined, else visits the children."""

    def visit(self, node: Node):
        key = (type(self), type(node))
        meth = _METHODS.get(key, _METHODS)
        if meth is _METHODS:
            meth = _METHODS[key] = getattr(type(self), "visit_" + type(node).__name__, None)
        if meth is not None:
            return meth(self, node)
        return self.generic_visit(node)

    def generic_visit(self, node: Node):
        for child in node.children():
            self.visit(child)


# ---- names and values ---------------------------------------------------------
@dataclass(eq=False)
class Ident(Node):
    """A name as written, with its span (used for declarations and references)."""
    name: str


@dataclass(eq=False)
class Pattern(Node):
    """A device name or a prefix pattern such as ``gpu*``."""
    name: str
    wildcard: bool = False

    def matches(self, candidate: str) -> bool:
        return candidate.startswith(self.name) if self.wildcard else candidate == self.name

    def __str__(self) -> str:
        return self.name + ("*" if self.wildcard else "")


@dataclass(eq=False)
class Prop(Node):
    """``name: value`` inside braces; value None for a flag such as ``critical``."""
    name: Ident
    value: Node | None


# ---- expressions ------------------------------------------------------------------
@dataclass(eq=False)
class Num(Node):
    """A literal converted to its base unit; ``dim`` None for a bare number."""
    value: int | float
    dim: str | None
    text: str


@dataclass(eq=False)
class Str(Node):
    value: str


@dataclass(eq=False)
class Bool(Node):
    value: bool


@dataclass(eq=False)
class Name(Node):
    """A bare name in an expression: a let variable, a decision, a device, ``now``."""
    id: str


@dataclass(eq=False)
class FieldRef(Node):
    """``ev.bytes``: a field of the hook's context."""
    obj: str
    name: Ident


@dataclass(eq=False)
class MapGet(Node):
    """``m[key]`` or ``m[key] ?? default`` (a missing key reads as the default, 0 if none)."""
    map: Ident
    key: Node
    default: Node | None


@dataclass(eq=False)
class Call(Node):
    """A built-in function: ``min``, ``max``."""
    func: Ident
    args: list[Node]


@dataclass(eq=False)
class BinOp(Node):
    op: str
    left: Node
    right: Node
    #: set by the checker: the factor that brings ``left op right`` to the result's base unit
    #: (units.DIM_ARITH; 1 for everything but products and quotients of dimensions)
    scale: object = field(default=1, kw_only=True, repr=False)


@dataclass(eq=False)
class UnOp(Node):
    op: str  # "-" or "!"
    operand: Node


# ---- statements ---------------------------------------------------------------------
@dataclass(eq=False)
class Assign(Node):
    """``priority = 7`` (a decision) or ``x = 3`` (a let variable) or ``ev.rate = ...``."""
    target: Ident
    value: Node
    via_ev: bool = False


@dataclass(eq=False)
class Let(Node):
    name: Ident
    value: Node


@dataclass(eq=False)
class If(Node):
    cond: Node
    then: list[Node]
    orelse: list[Node]


@dataclass(eq=False)
class MapUpdate(Node):
    """``m[k] = v``, ``m[k] += v`` and friends."""
    map: Ident
    key: Node
    op: str
    value: Node


@dataclass(eq=False)
class Delete(Node):
    map: Ident
    key: Node


@dataclass(eq=False)
class HistAdd(Node):
    """``lat = hist(v)`` (``lhist(v)``): count v in its bucket of the histogram map ``lat``."""
    map: Ident
    call: Call          # hist(v) or lhist(v): the checker holds it to one argument and the map's kind


@dataclass(eq=False)
class Emit(Node):
    """``emit ring(a, b, ...)``: write a record of u64s to a ringbuf map."""
    map: Ident
    args: list[Node]


@dataclass(eq=False)
class For(Node):
    """``for i in lo..hi { ... }`` with constant bounds."""
    var: Ident
    lo: Node
    hi: Node
    body: list[Node]


# ---- declarations ----------------------------------------------------------------------
@dataclass(eq=False)
class Import(Node):
    path: str


@dataclass(eq=False)
class Param(Node):
    """``param quota : bandwidth = 2GB/s``: a value the command line may override (``-D``)."""
    name: Ident
    dim: Ident
    value: Node


@dataclass(eq=False)
class Device(Node):
    kind: str
    name: Ident
    at: Ident | None
    props: list[Prop]


@dataclass(eq=False)
class Link(Node):
    a: Ident
    b: Ident
    bidir: bool
    props: list[Prop]


@dataclass(eq=False)
class Fabric(Node):
    name: Ident
    devices: list[Device]
    links: list[Link]


@dataclass(eq=False)
class Workload(Node):
    name: Ident
    props: list[Prop]


@dataclass(eq=False)
class Movement(Node):
    name: Ident
    cls: Ident
    operator: Ident | None
    src: Pattern
    dst: Pattern
    bidir: bool
    via: list[Pattern]
    props: list[Prop]


@dataclass(eq=False)
class MapDecl(Node):
    """``map NAME : KIND<KEY, VALUE>[N]``; a histogram ``map NAME : hist<DIM>`` or
    ``lhist<DIM>[MIN, MAX, STEP]`` has its dimension as ``key_type`` and its bounds as ``params``."""
    name: Ident
    kind: Ident
    key_type: Ident | None
    value_type: Ident | None
    max_entries: Num | None
    params: list[Num] = field(default_factory=list)      # every number in the brackets


@dataclass(eq=False)
class Handler(Node):
    """``on TARGET.HOOK[(arg)] [at ISLANDS] [when COND] { body }``."""
    target: Pattern
    hook: Ident
    arg: Node | None
    at: list[Pattern]
    when: Node | None
    body: list[Node]


@dataclass(eq=False)
class Policy(Node):
    name: Ident
    handlers: list[Handler]


@dataclass(eq=False)
class Module(Node):
    """One source file."""
    path: str
    items: list[Node]


def walk(node: Node):
    """Every node below and including ``node``, depth first."""
    yield node
    for child in node.children():
        yield from walk(child)
