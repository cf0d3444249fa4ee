"""Pass 1: parse .fx source text into an AST (`parse`).

Syntax errors become diagnostics saying what was expected; bad unit suffixes
are reported at the literal and parsing goes on.
"""
from __future__ import annotations

import re
from functools import lru_cache

import lark
from lark import Token, Transformer, v_args

from fabric_ext.runtime.machine.gcutil import fewer_collections

from . import ast as A
from .diagnostics import Diagnostics, Span
from .units import BASE_UNIT, UNITS, UnitError, parse_quantity

U64_MAX = (1 << 64) - 1
#: the histogram functions: ``lat = hist(v)`` counts v in map lat (of the same kind)
HISTOGRAMS = ("hist", "lhist")
MAX_NUMBER_CHARS = 40        # digits, point and unit: far more than any 64-bit value needs
# how deep blocks and brackets may nest, and how many tokens one statement may have: the
# passes recurse over the tree, so these bound their depth (a policy needs a handful of each)
MAX_NESTING, MAX_STATEMENT_TOKENS = 64, 400
# tokens no expression holds: a run of others is one expression at most (a fabric's links with no
# properties, `link a <-> b` line after line, are no expression)
EXPRESSION_ENDS = {"{", "}", "=", "+=", "-=", "|=", "&=", "max=", "min=", ",", "if", "else", "on", "at", ";",
                   "->", "<->"}

# human names for the terminals lark reports as expected
_TOKEN_NAMES = {
    "NAME": "a name", "QUANTITY": "a number", "HEXNUM": "a number", "STRING": "a string",
    "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'",
    "SEMICOLON": "';'", "COLON": "':'", "COMMA": "','", "DOT": "'.'", "EQUAL": "'='",
    "ARROW": "'->' or '<->'", "DEVKIND": "a device kind (gpu, cxl_switch, cxl_mem, dpu, nic, host)",
    "LESSTHAN": "'<'", "MORETHAN": "'>'", "STAR": "'*'", "UPDATE_OP": "an assignment",
    "CMP_OP": "a comparison", "SUM_OP": "'+' or '-'", "MUL_OP": "an operator", "MINUS": "'-'",
    "BANG": "'!'", "__ANON_0": "'..'",
}


@lru_cache(maxsize=1)
def _lark() -> lark.Lark:
    from .grammar_tables import load
    return load()


def _expected_names(expected) -> list[str]:
    names = []
    for t in sorted(expected):
        name = _TOKEN_NAMES.get(t)
        if name is None and t == "$END":
            name = "end of file"
        if name is None:
            try:
                p = _lark().get_terminal(t).pattern
                name = f"'{p.value}'" if p.type == "str" else t.lower()
            except KeyError:
                name = t.lower()
        if name not in names:
            names.append(name)
    return names


class _Build(Transformer):
    """Builds AST nodes from the parse tree; every node gets its span."""

    def __init__(self, file: str, diags: Diagnostics):
        super().__init__()
        self.file, self.diags = file, diags

    # -- helpers
    def _span(self, meta) -> Span:
        if isinstance(meta, Token):
            return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)
        if getattr(meta, "empty", False):
            return Span(self.file, 0, 0, 0, 0)
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _id(self, tok: Token) -> A.Ident:
        return A.Ident(str(tok), span=self._span(tok))

    def _num(self, tok: Token) -> A.Num:
        text = str(tok)
        if len(text) > MAX_NUMBER_CHARS:
            self.diags.error(self._span(tok), f"number of {len(text)} characters is too long",
                             "every value must fit in 64 bits (at most 20 digits)")
            return A.Num(0, None, text[:MAX_NUMBER_CHARS], span=self._span(tok))
        try:
            value, dim = parse_quantity(text)
        except UnitError as e:
            self.diags.error(self._span(tok), f"unknown unit '{e.unit}' in '{text}'",
                             f"did you mean '{e.suggestion}'?" if e.suggestion else
                             "units are B KiB MiB GiB TiB KB MB GB TB, B/s .. TB/s, bps .. Tbps, "
                             "ns us ms s, FLOPs .. TFLOPs and %")
            value, dim = 0, None
        return self._fits(A.Num(value, dim, text, span=self._span(tok)))

    def _fits(self, num: A.Num) -> A.Num:
        """A literal's value in its base unit must fit in u64: programs hold it in 64 bits."""
        if num.value > U64_MAX:
            unit = BASE_UNIT.get(num.dim, "")
            self.diags.error(num.span, f"'{num.text}' is {num.value:.4g} {unit}".rstrip() + ", more than fits "
                             "in 64 bits", f"the largest value is {U64_MAX} {unit}".rstrip())
            num.value = 0
        return num

    # -- values and expressions
    def quantity(self, items):
        return self._num(items[0])

    def hexnum(self, items):
        t = items[0]
        if len(str(t)) > MAX_NUMBER_CHARS:
            return self._num(t)
        return self._fits(A.Num(int(str(t), 16), None, str(t), span=self._span(t)))

    def string(self, items):
        t = items[0]
        return A.Str(str(t)[1:-1], span=self._span(t))

    def ident(self, items):
        return A.Name(str(items[0]), span=self._span(items[0]))

    name = ident

    @v_args(meta=True)
    def true(self, meta, items):
        return A.Bool(True, span=self._span(meta))

    @v_args(meta=True)
    def false(self, meta, items):
        return A.Bool(False, span=self._span(meta))

    @v_args(meta=True)
    def field(self, meta, items):
        obj, name = items
        return A.FieldRef(str(obj), self._id(name), span=self._span(meta))

    @v_args(meta=True)
    def map_get(self, meta, items):
        return A.MapGet(self._id(items[0]), items[1], items[2], span=self._span(meta))

    @v_args(meta=True)
    def call(self, meta, items):
        args = [a for a in items[1:] if a is not None]
        return A.Call(self._id(items[0]), args, span=self._span(meta))

    @v_args(meta=True)
    def arith(self, meta, items):
        left, op, right = items
        return A.BinOp(str(op), left, right, span=self._span(meta))

    cmp = arith

    @v_args(meta=True)
    def or_(self, meta, items):
        return A.BinOp("||", items[0], items[2], span=self._span(meta))

    @v_args(meta=True)
    def and_(self, meta, items):
        return A.BinOp("&&", items[0], items[2], span=self._span(meta))

    @v_args(meta=True)
    def not_(self, meta, items):
        return A.UnOp("!", items[0], span=self._span(meta))

    @v_args(meta=True)
    def neg(self, meta, items):
        return A.UnOp("-", items[0], span=self._span(meta))

    # -- statements
    @v_args(meta=True)
    def assign(self, meta, items):
        target, value = items
        if isinstance(target, A.FieldRef):
            return A.Assign(target.name, value, via_ev=True, span=self._span(meta))
        if isinstance(value, A.Call) and value.func.name in HISTOGRAMS:     # `lat = hist(v)`
            return A.HistAdd(A.Ident(target.id, span=target.span), value, span=self._span(meta))
        return A.Assign(A.Ident(target.id, span=target.span), value, span=self._span(meta))

    @v_args(meta=True)
    def let_stmt(self, meta, items):
        return A.Let(self._id(items[0]), items[1], span=self._span(meta))

    @v_args(meta=True)
    def if_stmt(self, meta, items):
        orelse = items[2] if len(items) > 2 and items[2] is not None else []
        return A.If(items[0], items[1], orelse, span=self._span(meta))

    def else_clause(self, items):
        return items[0] if isinstance(items[0], list) else [items[0]]

    def block(self, items):
        return list(items)

    @v_args(meta=True)
    def map_update(self, meta, items):
        m, key, op, value = items
        return A.MapUpdate(self._id(m), key, str(op), value, span=self._span(meta))

    @v_args(meta=True)
    def delete_stmt(self, meta, items):
        return A.Delete(self._id(items[0]), items[1], span=self._span(meta))

    @v_args(meta=True)
    def emit_stmt(self, meta, items):
        return A.Emit(self._id(items[0]), [a for a in items[1:] if a is not None],
                      span=self._span(meta))

    @v_args(meta=True)
    def for_stmt(self, meta, items):
        var, lo, hi, body = items
        return A.For(self._id(var), lo, hi, body, span=self._span(meta))

    # -- declarations
    @v_args(meta=True)
    def import_decl(self, meta, items):
        return A.Import(str(items[0])[1:-1], span=self._span(meta))

    @v_args(meta=True)
    def param_decl(self, meta, items):
        return A.Param(self._id(items[0]), self._id(items[1]), items[2], span=self._span(meta))

    @v_args(meta=True)
    def prop(self, meta, items):
        return A.Prop(self._id(items[0]), items[1], span=self._span(meta))

    def props(self, items):
        return [p for p in items if p is not None]

    @v_args(meta=True)
    def pattern(self, meta, items):
        return A.Pattern(str(items[0]), items[1] is not None, span=self._span(meta))

    def name_list(self, items):
        return [self._id(t) for t in items]

    def at_clause(self, items):
        return self._id(items[0])

    @v_args(meta=True)
    def device_decl(self, meta, items):
        kind, names, at, props = items
        return [A.Device(str(kind), n, at, props or [], span=n.span) for n in names]

    @v_args(meta=True)
    def link_decl(self, meta, items):
        a, arrow, b, props = items
        return A.Link(self._id(a), self._id(b), str(arrow) == "<->", props or [],
                      span=self._span(meta))

    @v_args(meta=True)
    def fabric(self, meta, items):
        devices, links = [], []
        for it in items[1:]:
            if isinstance(it, list):
                devices.extend(it)
            else:
                links.append(it)
        return A.Fabric(self._id(items[0]), devices, links, span=self._span(meta))

    @v_args(meta=True)
    def workload(self, meta, items):
        return A.Workload(self._id(items[0]), items[1], span=self._span(meta))

    def operator(self, items):
        return self._id(items[0])

    def via(self, items):
        return list(items)

    @v_args(meta=True)
    def movement(self, meta, items):
        name, cls, op, src, arrow, dst, via, props = items
        return A.Movement(self._id(name), self._id(cls), op, src, dst, str(arrow) == "<->",
                          via or [], props or [], span=self._span(meta))

    def type_args(self, items):
        return [self._id(t) if t is not None else None for t in items]

    def size(self, items):
        return [self.hexnum([t]) if str(t).startswith("0x") else self._num(t) for t in items]

    @v_args(meta=True)
    def map_decl(self, meta, items):
        name, kind, targs, sizes = items
        key, value = targs if targs else (None, None)
        sizes = sizes or []
        return A.MapDecl(self._id(name), self._id(kind), key, value, sizes[0] if sizes else None, sizes,
                         span=self._span(meta))

    def event_arg(self, items):
        return items[0]

    def at_list(self, items):
        return list(items)

    def when(self, items):
        return items[0]

    @v_args(meta=True)
    def event(self, meta, items):
        return items  # [pattern, hook token, arg]

    @v_args(meta=True)
    def handler(self, meta, items):
        (target, hook, arg), at, when, body = items
        return A.Handler(target, self._id(hook), arg, at or [], when, body, span=self._span(meta))

    @v_args(meta=True)
    def policy(self, meta, items):
        return A.Policy(self._id(items[0]), list(items[1:]), span=self._span(meta))

    def start(self, items):
        return list(items)


#: the language's tokens as a scan in C (running Lark's lexer a second time would cost as much
#: as the parse itself): comments, strings, the update operators, names, numbers with their
#: units, two-character operators and any other single character; what lies between matches
#: is white space.  `_too_complex` counts them; `fmt` lays them out.
TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|"[^"\n]*"|(?:max|min)=(?!=)|[A-Za-z_]\w*|\d[\w.]*(?:/s|%)?'
                    r"|==|!=|<=|>=|&&|\|\||<<|>>|\.\.|<->|->|\?\?|[-+|&]=|\S", re.S)


def _too_complex(text: str, file: str, diags: Diagnostics) -> bool:
    """Report nesting or statements beyond what the passes can recurse over."""
    depth, run = 0, 0
    for m in TOKENS.finditer(text):
        tok = m.group()
        if tok[0] == '"' or tok[:2] in ("//", "/*"):
            continue
        if tok in ("{", "(", "["):
            depth += 1
            if depth > MAX_NESTING:
                diags.error(_span_at(text, file, m.start()), f"blocks and brackets nest more than {MAX_NESTING} "
                            "deep here", "split the handler, or name parts of it with map entries")
                return True
        elif tok in ("}", ")", "]"):
            depth -= 1
        run = 0 if tok in EXPRESSION_ENDS else run + 1
        if run > MAX_STATEMENT_TOKENS:
            diags.error(_span_at(text, file, m.start()), f"an expression of more than {MAX_STATEMENT_TOKENS} tokens",
                        "split the expression into several statements")
            return True
    return False


def _span_at(text: str, file: str, pos: int) -> Span:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return Span(file, line, col, line, col + 1)


def parse(text: str, file: str, diags: Diagnostics) -> A.Module | None:
    """Parse one file; on a syntax error, report it and return None."""
    diags.sources[file] = text
    if _too_complex(text, file, diags):
        return None
    with fewer_collections():       # a tree node or more per token, little cyclic garbage
        try:
            tree = _lark().parse(text)
        except lark.exceptions.UnexpectedInput as e:
            _syntax_error(e, text, file, diags)
            return None
        items = _Build(file, diags).transform(tree)
    return A.Module(file, items, span=Span(file, 1, 1, 1, 1))


_SPACED_UNIT = re.compile(r"(\d+(?:\.\d+)?)[ \t]+(" + "|".join(
    re.escape(u) for u in sorted(UNITS, key=len, reverse=True)) + r")(?![A-Za-z/])")


def _syntax_error(e: lark.exceptions.UnexpectedInput, text: str, file: str, diags: Diagnostics) -> None:
    """One syntax error, said the way its likely cause would be: a unit apart from its number,
    '=' where a condition compares, a brace never closed, a comment never ended."""
    lines = text.splitlines() or [""]
    end = Span(file, len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2)
    tok = getattr(e, "token", None)
    at_end = isinstance(e, lark.exceptions.UnexpectedEOF) or (tok is not None and tok.type == "$END")
    line, col = (end.line, end.col) if at_end else (e.line, e.column)
    span = end if at_end else Span(file, line, col, line, (tok.end_column if tok is not None and tok.end_column
                                                           else col + 1))
    expected = _expected_names(getattr(e, "expected", None) or getattr(e, "allowed", None) or ())
    hint = "expected " + ", ".join(expected[:8]) + (", ..." if len(expected) > 8 else "") if expected else None
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    spaced = next((m for m in _SPACED_UNIT.finditer(source) if m.start(2) <= col - 1 <= m.end(2)), None)
    if spaced:
        diags.error(Span(file, line, spaced.start() + 1, line, spaced.end() + 1),
                    f"no space between a number and its unit: write '{spaced[1]}{spaced[2]}'")
    elif at_end and (opener := _unclosed_brace(text)) is not None:
        diags.error(Span(file, opener.line, opener.column, opener.line, opener.column + 1),
                    "this '{' is never closed", f"add '}}' where its block ends (the file ends at line {end.line})")
    elif not at_end and text.startswith("/*", _offset(text, line, col)):
        diags.error(span, "unterminated comment", "close it with */")
    elif tok is not None and str(tok) == "=" and re.search(r"\bif\b[^{}]*$", source[:col - 1]):
        diags.error(span, "'=' assigns; a condition compares with '=='", "did you mean '=='?")
    elif isinstance(e, lark.exceptions.UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else "end of file"
        shown = f"'{ch}'" if ch.isprintable() else f"U+{ord(ch):04X}, not printable"   # (a NUL, a control)
        diags.error(span, f"unexpected character {shown}", hint)
    else:
        diags.error(span, f"unexpected {'end of file' if at_end else repr(str(tok))}", hint)


def _unclosed_brace(text: str):
    """The innermost '{' that no '}' closes, as a token (None when they balance)."""
    stack = []
    try:
        for tok in _lark().lex(text):
            if tok == "{":
                stack.append(tok)
            elif tok == "}" and stack:
                stack.pop()
    except lark.exceptions.LarkError:
        pass
    return stack[-1] if stack else None


def _offset(text: str, line: int, col: int) -> int:
    """The character offset of a 1-based line and column."""
    start = 0
    for _ in range(line - 1):
        start = text.find("\n", start) + 1
    return start + col - 1
