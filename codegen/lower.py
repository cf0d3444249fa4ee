"""Pass 6: lower placed handlers to the policy IR (`lower`).

Unit literals are already integers in base units; names resolve to context
fields, decisions, let variables, loop variables or device ids.  At -O1 and
above constants are folded and handlers that can never run (a guard that is
constantly false) or do nothing are dropped.
"""
from __future__ import annotations

import math
from collections import defaultdict

from fabric_ext import ast as A
from fabric_ext.checker import COMPARISONS, CONST_OPS, M64, const_value, exact_value
from fabric_ext.contract.ids import IdTables
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine.isa import STACK_SIZE as STACK_LIMIT

from . import ir


def _fractional(v) -> bool:
    """Whether a constant's exact value is no whole number (None: not a constant)."""
    return v is not None and v.denominator != 1


#: a comparison with its sides swapped: c < x is x > c
MIRRORED = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "==", "!=": "!="}


def fold(e):
    """Fold constant subexpressions of an IR expression."""
    if isinstance(e, ir.Bin):
        a, b = fold(e.left), fold(e.right)
        if isinstance(a, ir.Const) and isinstance(b, ir.Const):
            return ir.Const(CONST_OPS[e.op](a.value, b.value))
        return ir.Bin(e.op, a, b)
    if isinstance(e, ir.Not):
        a = fold(e.operand)
        return ir.Const(int(not a.value)) if isinstance(a, ir.Const) else ir.Not(a)
    if isinstance(e, ir.MinMax):
        args = tuple(fold(a) for a in e.args)
        if all(isinstance(a, ir.Const) for a in args):
            vals = [a.value for a in args]
            return ir.Const(min(vals) if e.op == "min" else max(vals))
        return ir.MinMax(e.op, args)
    if isinstance(e, ir.MapGet):
        return ir.MapGet(e.map, fold(e.key), fold(e.default))
    return e


class _Lowerer:
    def __init__(self, prog: ir.ProgramIR, ids: IdTables, opt: int, diags: Diagnostics, maps: dict):
        self.p, self.ids, self.opt, self.diags = prog, ids, opt, diags
        self.map_infos = maps           # checker.MapInfo by name: a histogram's buckets
        self.scopes: list[dict[str, ir.Var]] = []
        self.counter = 0
        self.maps: set[str] = set()
        self.reads: set[str] = set()    # context fields the current handler reads

    def expr(self, e):
        out = self._expr(e)
        return fold(out) if self.opt >= 1 else out

    def _expr(self, e):
        if isinstance(e, A.Num):
            return ir.Const(int(e.value) & M64)
        if isinstance(e, A.Bool):
            return ir.Const(int(e.value))
        if isinstance(e, A.Name):
            if e.id == "now":
                return self._read("now")
            for scope in reversed(self.scopes):
                if e.id in scope:
                    return scope[e.id]
            if self.p.hook.field(e.id) is not None:
                return self._read(e.id)
            return ir.Const(self.ids.devices[e.id])
        if isinstance(e, A.FieldRef):
            if self.p.hook.constant(e.name.name):    # ev.island: the island this program is for
                return ir.Const(self.ids.devices[self.p.island])
            return self._read(e.name.name)
        if isinstance(e, A.MapGet):
            self.maps.add(e.map.name)
            default = self._expr(e.default) if e.default is not None else ir.Const(0)
            return ir.MapGet(e.map.name, self._expr(e.key), default)
        if isinstance(e, A.Call):
            return ir.MinMax(e.func.name, tuple(self._expr(a) for a in e.args))
        if isinstance(e, A.BinOp):
            return self._binop(e)
        if isinstance(e, A.UnOp):
            return ir.Not(self._expr(e.operand)) if e.op == "!" else ir.Bin("-", ir.Const(0), self._expr(e.operand))
        raise TypeError(f"cannot lower {type(e).__name__}")

    def _binop(self, e: A.BinOp):
        """A constant is folded exactly and rounded down once (the checker refused overflow);
        a dimensioned product or quotient at run time scales before it divides, so that
        ev.bytes / 2GB/s is (bytes * 10^9) / (2 * 10^9) ns and no quotient is lost to rounding."""
        v = exact_value(e)      # at every -O: the value of a constant is its meaning, not an optimisation
        if v is not None:
            return ir.Const(int(v) & M64)
        if e.op in COMPARISONS:
            return self._compare(e)
        if e.op in ("*", "/", "%", "-") and any(_fractional(exact_value(side)) for side in (e.left, e.right)):
            return self._by_fraction(e)
        left, right = self._expr(e.left), self._expr(e.right)
        if e.scale == 1:
            return ir.Bin(e.op, left, right)
        if e.scale > 1:         # a quotient: scale the dividend first
            return ir.Bin("/", ir.Bin("*", left, ir.Const(int(e.scale))), right)
        return ir.Bin("/", ir.Bin("*", left, right), ir.Const(int(1 / e.scale)))   # a product

    def _by_fraction(self, e: A.BinOp):
        """A run-time value times, over, modulo or less a constant that is no whole number: by
        its exact value (with the dimensions' scale), the product taken before the quotient,
        so that ev.bytes * 1.5 is (bytes * 3) / 2, not bytes * 1; x - 0.5 rounds down to x - 1."""
        c_left, c_right = exact_value(e.left), exact_value(e.right)
        if e.op == "%":         # x % (p/q) is (x*q % p) / q, and c % x is (p % x*q) / q, rounded down
            c = c_right if c_right is not None else c_left
            p, q = ir.Const(c.numerator & M64), ir.Const(c.denominator & M64)
            xq = ir.Bin("*", self._expr(e.left if c_right is not None else e.right), q)
            return ir.Bin("/", ir.Bin("%", xq, p) if c_right is not None else ir.Bin("%", p, xq), q)
        if e.op == "-":
            if c_right is not None:
                return ir.Bin("-", self._expr(e.left), ir.Const(math.ceil(c_right) & M64))
            return ir.Bin("-", ir.Const(math.floor(c_left) & M64), self._expr(e.right))
        if e.op == "*" or c_right is not None:      # x * c, c * x, x / c: x times a fraction
            x = self._expr(e.right if c_left is not None else e.left)
            r = (c_left if c_left is not None else c_right) * e.scale if e.op == "*" else e.scale / c_right
            scaled = ir.Bin("*", x, ir.Const(r.numerator & M64))
            return scaled if r.denominator == 1 else ir.Bin("/", scaled, ir.Const(r.denominator & M64))
        r = c_left * e.scale                          # c / x
        return ir.Bin("/", ir.Const(r.numerator & M64), ir.Bin("*", self._expr(e.right), ir.Const(r.denominator & M64)))

    def _compare(self, e: A.BinOp):
        """A comparison of a run-time value with a constant compares with the constant's exact
        value, not its whole part: x >= 80.5% is x > 80, x == 80.5% never holds."""
        op, left, right = e.op, e.left, e.right
        c = exact_value(right)
        if c is None:
            c, left, op = exact_value(left), right, MIRRORED[op]
        if c is None or c.denominator == 1:
            return ir.Bin(e.op, self._expr(e.left), self._expr(e.right))
        if op in ("==", "!="):
            return ir.Const(int(op == "!="))
        whole = ir.Const(math.floor(c) & M64)     # x < c is x <= floor(c); x >= c is x > floor(c)
        return ir.Bin({"<": "<=", "<=": "<=", ">": ">", ">=": ">"}[op], self._expr(left), whole)

    def _read(self, name):
        self.reads.add(name)
        return self._field(name)

    def _field(self, name):
        off, f = self.p.hook.layout[name]
        return ir.CtxField(name, off, f.ctype)

    def _new_var(self, name):
        self.counter += 1
        v = ir.Var(f"{name}.{self.counter}")
        self.p.vars.append(v)
        return v

    def stmts(self, body):
        self.scopes.append({})
        out = []
        for s in body:
            out.extend(self.stmt(s))
        self.scopes.pop()
        return out

    def stmt(self, s):
        if isinstance(s, A.Let):
            v = self._new_var(s.name.name)
            val = self.expr(s.value)
            self.scopes[-1][s.name.name] = v
            return [ir.SetVar(v, val, s.span)]
        if isinstance(s, A.Assign):
            if not s.via_ev:
                for scope in reversed(self.scopes):
                    if s.target.name in scope:
                        return [ir.SetVar(scope[s.target.name], self.expr(s.value), s.span)]
            return [ir.SetField(self._field(s.target.name), self.expr(s.value), s.span)]
        if isinstance(s, A.If):
            cond = self.expr(s.cond)
            then, orelse = self.stmts(s.then), self.stmts(s.orelse)
            if self.opt >= 1 and isinstance(cond, ir.Const):
                return then if cond.value else orelse
            return [ir.If(cond, then, orelse, s.span)]
        if isinstance(s, A.MapUpdate):
            self.maps.add(s.map.name)
            return [ir.MapUpdate(s.map.name, self.expr(s.key), s.op, self.expr(s.value), s.span)]
        if isinstance(s, A.HistAdd):
            self.maps.add(s.map.name)
            return self._hist_add(s)
        if isinstance(s, A.Delete):
            self.maps.add(s.map.name)
            return [ir.MapDelete(s.map.name, self.expr(s.key), s.span)]
        if isinstance(s, A.Emit):
            self.maps.add(s.map.name)
            return [ir.Emit(s.map.name, [self.expr(a) for a in s.args], s.span)]
        if isinstance(s, A.For):
            v = self._new_var(s.var.name)
            self.scopes.append({s.var.name: v})
            body = self.stmts(s.body)
            self.scopes.pop()
            return [ir.Loop(v, int(const_value(s.lo)), int(const_value(s.hi)), body, s.span)]
        raise TypeError(f"cannot lower {type(s).__name__}")


    def _hist_add(self, s):
        """Count the value in its bucket: for a hist, the index of its highest set bit (a binary
        search over shifts: eBPF has no count-leading-zeros), 0 for 0 and 1; for an lhist, 0
        below its lowest value, the last bucket from its highest on, else 1 + (v - lo) / step."""
        h = self.map_infos[s.map.name].hist
        v, k = self._new_var("hist_value"), self._new_var("hist_bucket")
        out = [ir.SetVar(v, self.expr(s.call.args[0]), s.span)]
        if h["kind"] == "hist":
            out.append(ir.SetVar(k, ir.Const(0), s.span))
            for shift in (32, 16, 8, 4, 2, 1):
                out.append(ir.If(ir.Bin(">=", v, ir.Const(1 << shift)),
                                 [ir.SetVar(k, ir.Bin("+", k, ir.Const(shift)), s.span),
                                  ir.SetVar(v, ir.Bin(">>", v, ir.Const(shift)), s.span)], [], s.span))
        else:
            lo, hi, step = h["lo"], h["hi"], h["step"]
            inside = ir.Bin("+", ir.Bin("/", ir.Bin("-", v, ir.Const(lo)), ir.Const(step)), ir.Const(1))
            out.append(ir.If(ir.Bin("<", v, ir.Const(lo)), [ir.SetVar(k, ir.Const(0), s.span)],
                             [ir.If(ir.Bin(">=", v, ir.Const(hi)), [ir.SetVar(k, ir.Const((hi - lo) // step + 1), s.span)],
                                    [ir.SetVar(k, inside, s.span)], s.span)], s.span))
        out.append(ir.MapUpdate(s.map.name, k, "+=", ir.Const(1), s.span))
        return out


def _stack_bytes(p: ir.ProgramIR, emit_args: int) -> int:
    # let/loop variables, a key and a value temporary per map access, the emit record
    return 8 * len(p.vars) + 16 + 8 * emit_args


def _max_emit(body) -> int:
    best = 0
    for s in body:
        if isinstance(s, ir.Emit):
            best = max(best, len(s.args))
        for sub in ("then", "orelse", "body"):
            best = max(best, _max_emit(getattr(s, sub, []) or []))
    return best


# map kinds whose final contents after a store do not depend on what was stored before
_OVERWRITABLE = ("array", "hash")
_PORT_FIELDS = frozenset({"port", "peer"})     # the same set of values on every tick


def _uses(e, kind) -> bool:
    """Whether expression ``e`` contains a node of type ``kind``."""
    return isinstance(e, kind) or any(_uses(o, kind) for o in ir.operands(e))


def _port_key(e) -> bool:
    """A key that takes the same values on every tick: built from constants and the port."""
    if isinstance(e, ir.CtxField):
        return e.name in _PORT_FIELDS
    if isinstance(e, (ir.Var, ir.MapGet)):
        return False
    return all(_port_key(o) for o in ir.operands(e))


def _last_wins(h: ir.HandlerIR, prog: ir.ProgramIR, maps: dict) -> bool:
    """Whether of several runs of tick handler ``h`` in a row only the last one's effect
    remains, so the runtime may run just the last (`runtime/simulation/ticks.py`): it reads no map
    and, on every path, stores plainly to the same entries (keys from constants and the
    port, over every port each tick) of array or hash maps that no other handler of its
    program reads."""
    if h.period is None or h.guard is not None or not h.body:
        return False
    written = set()
    for s in h.body:
        if isinstance(s, ir.SetVar) and not _uses(s.value, ir.MapGet):
            continue
        if not (isinstance(s, ir.MapUpdate) and s.op == "=" and maps[s.map].kind in _OVERWRITABLE
                and _port_key(s.key) and not _uses(s.value, ir.MapGet)):
            return False
        written.add(s.map)
    return not any(written & set(o.maps) for o in prog.handlers if o is not h)


def _per_port(h: ir.HandlerIR, maps: dict) -> bool:
    """Whether a `last_wins` tick handler's run for one port's context writes only that port's
    entries, of array maps (every store's key is the port itself): then one port's tick may
    run ahead of the others' and leave what theirs write alone (`ticks.TickSource.preview`).
    A hash map is left out: which keys a full one takes depends on the order of the stores."""
    return h.last_wins and all(not isinstance(s, ir.MapUpdate) or maps[s.map].kind == "array" and
                               isinstance(s.key, ir.CtxField) and s.key.name == "port" for s in h.body)


def _map_reads(h: ir.HandlerIR, hook, maps: dict) -> list | None:
    """The map entries a handler's decisions depend on besides its context fields, when it
    only reads maps and only at keys the runtime can work out before it runs: array maps at
    constant keys or keys that are an input field of the context (a decision field holds
    what the program stored there, unknown before it runs).  Then (`runtime/simulation/dispatch.py`) its
    decisions are a function of the fields it reads and those entries' values.  A list of
    [map, {"const": k}] or [map, {"field": name}]; None where the handler writes or emits
    anything but context decisions, or reads a map otherwise."""
    reads = []

    def expr(e) -> bool:
        if isinstance(e, ir.MapGet):
            known = isinstance(e.key, ir.Const) or (isinstance(e.key, ir.CtxField)
                                                     and not hook.field(e.key.name).decision)
            if maps[e.map].kind != "array" or not known:
                return False
            key = {"const": e.key.value} if isinstance(e.key, ir.Const) else {"field": e.key.name}
            if [e.map, key] not in reads:
                reads.append([e.map, key])
        return all(expr(o) for o in ir.operands(e))

    def stmts(body) -> bool:
        for s in body:
            if isinstance(s, (ir.SetField, ir.SetVar)):
                ok = expr(s.value)
            elif isinstance(s, ir.If):
                ok = expr(s.cond) and stmts(s.then) and stmts(s.orelse)
            else:                      # a map write, an emit, a loop
                ok = False
            if not ok:
                return False
        return True

    return reads if (h.guard is None or expr(h.guard)) and stmts(h.body) else None


def lower(analysis, ids: IdTables, opt: int, diags: Diagnostics) -> list[ir.ProgramIR]:
    """One ProgramIR per (island, hook) that has handlers, in island then hook order."""
    groups = defaultdict(list)
    for pl in analysis.placements:
        groups[(pl.island, pl.hook.name)].append(pl)
    programs = []
    for (island, _), pls in sorted(groups.items(), key=lambda kv: (ids.islands[kv[0][0]], kv[0][1])):
        pls.sort(key=lambda p: p.order)
        prog = ir.ProgramIR(island, analysis.graph.islands[island].kind, pls[0].hook, [], [])
        low = _Lowerer(prog, ids, opt, diags, analysis.symbols.maps)
        used_maps: set[str] = set()
        for pl in pls:
            h = pl.handler
            low.maps, low.reads = set(), set()
            guard = low.expr(h.when) if h.when is not None else None
            body = low.stmts(h.body)
            if opt >= 1:
                if isinstance(guard, ir.Const):
                    if not guard.value:
                        continue           # dead: the guard never holds
                    guard = None
                if not body:
                    continue               # dead: nothing to do
            mid = ids.movements[pl.movement] if pl.movement else None
            prog.handlers.append(ir.HandlerIR(pl.policy, mid, pl.period, guard, body, h.span, sorted(low.maps),
                                              sorted(low.reads)))
            used_maps |= low.maps
        prog.maps = sorted(used_maps)
        for h in prog.handlers:
            h.last_wins = _last_wins(h, prog, analysis.symbols.maps)
            h.per_port = _per_port(h, analysis.symbols.maps)
            h.map_reads = _map_reads(h, prog.hook, analysis.symbols.maps)
        used = _stack_bytes(prog, max((_max_emit(h.body) for h in prog.handlers), default=0))
        if used > STACK_LIMIT:
            diags.error(pls[0].handler.span, f"the program for {island}.{prog.hook.name} needs {used} bytes "
                        f"of stack, more than the {STACK_LIMIT} eBPF allows",
                        "use fewer let variables or emit fewer values per record")
            continue
        if prog.handlers or any(p.period for p in pls):
            programs.append(prog)
    return programs
