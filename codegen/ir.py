"""The policy IR: one `ProgramIR` per (island, hook), handlers in source order.

Values are unsigned 64-bit integers; comparisons and boolean operators yield
0 or 1.  Everything is resolved: context fields carry their offset and C
type, maps their declaration, names their meaning.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fabric_ext.diagnostics import Span


@dataclass(frozen=True)
class Const:
    value: int


@dataclass(frozen=True)
class CtxField:
    name: str
    offset: int
    ctype: str


@dataclass(frozen=True)
class Var:
    name: str       # unique within the program


@dataclass(frozen=True)
class MapGet:
    map: str
    key: object
    default: object


@dataclass(frozen=True)
class Bin:
    op: str         # + - * / % & | ^ << >> == != < > <= >= && ||
    left: object
    right: object


@dataclass(frozen=True)
class Not:
    operand: object


@dataclass(frozen=True)
class MinMax:
    op: str         # "min" | "max"
    args: tuple


def operands(e) -> tuple:
    """An expression's subexpressions (none for a constant, a field or a variable)."""
    if isinstance(e, Bin):
        return (e.left, e.right)
    if isinstance(e, Not):
        return (e.operand,)
    if isinstance(e, MinMax):
        return e.args
    if isinstance(e, MapGet):
        return (e.key, e.default)
    return ()


# statements carry the span of their source for line info
@dataclass
class SetField:
    field: CtxField
    value: object
    span: Span


@dataclass
class SetVar:
    var: Var
    value: object
    span: Span


@dataclass
class If:
    cond: object
    then: list
    orelse: list
    span: Span


@dataclass
class MapUpdate:
    map: str
    key: object
    op: str         # = += -= |= &= max= min=
    value: object
    span: Span


#: what an update starts from on a key the map does not hold: its operator's identity, so
#: that the first ``min=`` or ``&=`` stores the value (0 would keep the entry 0 for good)
UPDATE_START = {"+=": 0, "-=": 0, "|=": 0, "max=": 0, "&=": (1 << 64) - 1, "min=": (1 << 64) - 1}


@dataclass
class MapDelete:
    map: str
    key: object
    span: Span


@dataclass
class Emit:
    map: str
    args: list
    span: Span


@dataclass
class Loop:
    var: Var
    lo: int
    hi: int
    body: list
    span: Span


def statements(body: list):
    """Every statement of a body, nested ones (an if's branches, a loop's body) after their parent."""
    for s in body:
        yield s
        for sub in ("then", "orelse", "body"):
            yield from statements(getattr(s, sub, None) or [])


@dataclass
class HandlerIR:
    policy: str
    movement_id: int | None     # None: runs for every event at the hook
    period: int | None          # tick handlers: the period they run at
    guard: object | None
    body: list
    span: Span
    maps: list[str] = field(default_factory=list)   # maps the guard and body use, sorted
    reads: list[str] = field(default_factory=list)  # context fields the guard and body read, sorted
    last_wins: bool = False     # tick handlers: runs in a row leave only the last one's effect
    per_port: bool = False      # ... and a port's run writes only that port's entries
    map_reads: list | None = None   # (map, key) entries its decisions read, when it only reads maps so

    def decides(self) -> dict[str, list[int]]:
        """The decisions it may make, each with the lines that set it."""
        out: dict[str, list[int]] = {}
        for s in statements(self.body):
            if isinstance(s, SetField) and s.span.line not in out.setdefault(s.field.name, []):
                out[s.field.name].append(s.span.line)
        return out


@dataclass
class ProgramIR:
    island: str
    island_kind: str
    hook: object                # fabric_ext.contract.hooks.Hook
    handlers: list[HandlerIR]
    maps: list[str]             # maps the program uses, sorted
    vars: list[Var] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.island}_{self.hook.name}"
