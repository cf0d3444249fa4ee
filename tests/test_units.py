"""What the compiler computes (issue 13, items 1 and 8): dimensioned arithmetic exact in base
units — constants fold as exact fractions rounded down once, at run time a quotient of
dimensions scales before it divides — and ev.island, a constant of each island's program.
Every test compiles a policy, runs its program and reads the decisions it made."""
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FABRIC, FABRIC_LINES
from fabric_ext.codegen.driver import build
from fabric_ext.contract.bundle import load_bundle, write_folder
from fabric_ext.contract.context import ContextCodec
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine.interp import Interpreter

M64 = (1 << 64) - 1
LINE = FABRIC_LINES + 1


def compile_policy(tmp_path, body, opt=2):
    path = tmp_path / "u.fx"
    path.write_text(FABRIC + body)
    d = Diagnostics()
    res = build(path, opt, diags=d)
    return res, d


def issue_decisions(tmp_path, body, opt=2, **fields):
    """The decisions gpu0's issue program makes for a chunk of movement kv."""
    res, d = compile_policy(tmp_path, "policy p { on kv.issue at gpu0 { " + body + " } }\n", opt)
    assert res is not None, [x.message for x in d.items]
    out = tmp_path / "out"
    write_folder(res.files, out)
    bundle = load_bundle(out)
    prog = bundle.islands["gpu0"]["issue"]
    codec = ContextCodec(prog.hook)
    ctx = codec.pack({"movement": bundle.ids["movements"]["kv"], **fields})
    Interpreter().run(prog, ctx)
    return codec.decisions(ctx)


def errors(tmp_path, body):
    res, d = compile_policy(tmp_path, "policy p { on kv.issue at gpu0 { " + body + " } }\n")
    assert res is None
    return [f"{x.span.line}:{x.span.col}: {x.message}" for x in d.errors]


@pytest.mark.parametrize("body,decision,want", [
    ("rate = 1MiB / 1ms", "rate", 1048576000),                 # was 1 (B/s)
    ("defer = 1MiB / 2GB/s", "defer", 524288),                 # was 0
    ("coalesce = 16GB/s * 1us", "coalesce", 16000),           # was 10^9 too large
    ("coalesce = 1us * 16GB/s", "coalesce", 16000),
    ("rate = 1MiB / 3ms", "rate", 349525333),                  # rounded down once, at the end
    ("defer = (1MiB / 3) / (1GB/s)", "defer", 349525),
    ("rate = 10GB/s - 20GB/s + 1B/s", "rate", 1),              # subtraction stops at 0
])
def test_constant_dimensioned_arithmetic_is_exact(tmp_path, body, decision, want):
    assert issue_decisions(tmp_path, body)[decision] == want


@pytest.mark.parametrize("opt", [0, 1, 2])
def test_constants_are_exact_at_every_optimisation_level(tmp_path, opt):
    """The value of a constant is its meaning: -O0 folds it exactly too (10^15 * 10^9 would wrap
    in 64-bit run-time arithmetic), and min/max of constants fold as exactly."""
    d = issue_decisions(tmp_path, "coalesce = 1000TB / 1s * 1ns\n rate = min(1MiB / 3ms, 10GB/s)", opt)
    assert (d["coalesce"], d["rate"]) == (10 ** 6, 349525333)


@pytest.mark.parametrize("nbytes", [1, 3, 4096, 2 << 20, 10 ** 9 + 7])
def test_run_time_quotients_scale_before_dividing(tmp_path, nbytes):
    """ev.bytes / 2GB/s is a time in ns: bytes * 10^9 / (2 * 10^9), rounded down."""
    d = issue_decisions(tmp_path, "defer = ev.bytes / 2GB/s\n rate = ev.bytes / 1ms", bytes=nbytes)
    assert d["defer"] == nbytes * 10 ** 9 // (2 * 10 ** 9)
    assert d["rate"] == nbytes * 10 ** 9 // 10 ** 6


@pytest.mark.parametrize("body,says", [
    ("rate = 10GB/s / 0", f"{LINE}:50: '/' by zero"),
    ("rate = 10GB/s % 0", f"{LINE}:50: '%' by zero"),
    ("rate = 18446744073TB/s * 10", "more than fits in 64 bits"),
    ("defer = 1B / 2GB/s", f"{LINE}:42: 'defer' = 0.5 ns rounds down to 0"),
    ("rate = 1B / 2s", "'rate' = 0.5 B/s rounds down to 0"),
])
def test_constants_that_cannot_be_held_are_errors_with_position(tmp_path, body, says):
    assert any(says in e for e in errors(tmp_path, body)), errors(tmp_path, body)


# -- property: random dimensioned constant expressions against an independent exact oracle ----
SIZES = [("1B", 1), ("4KiB", 4096), ("1MiB", 2 ** 20), ("3GB", 3 * 10 ** 9), ("7B", 7)]
TIMES = [("1ns", 1), ("3us", 3000), ("1ms", 10 ** 6), ("2s", 2 * 10 ** 9)]
RATES = [("1B/s", 1), ("16GB/s", 16 * 10 ** 9), ("3KiB/s", 3072), ("100Gbps", 100 * 10 ** 9 // 8)]
COUNTS = [("1", 1), ("3", 3), ("7", 7), ("1000", 1000)]
LEAVES = {"size": SIZES, "time": TIMES, "bandwidth": RATES, "count": COUNTS}


def _div(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _mul(a, b):
    return None if a is None or b is None else a * b


@st.composite
def expression(draw, dim, depth=0):
    """(source text, exact value in base units, or None where it divides by zero) of an
    expression of dimension ``dim``."""
    if depth >= 3 or draw(st.booleans()):
        text, value = draw(st.sampled_from(LEAVES[dim]))
        return text, Fraction(value)
    form = draw(st.sampled_from(["sum", "diff", "scaled", "shrunk"] + {
        "size": ["rate*time"], "time": ["size/rate"], "bandwidth": ["size/time"], "count": []}[dim]))
    sub = lambda d: draw(expression(d, depth + 1))
    if form in ("sum", "diff"):
        (ta, a), (tb, b) = sub(dim), sub(dim)
        if a is None or b is None:
            return f"({ta} + {tb})", None
        return f"({ta} {'+' if form == 'sum' else '-'} {tb})", a + b if form == "sum" else max(a - b, Fraction(0))
    if form == "scaled":
        (ta, a), (tb, b) = sub(dim), sub("count")
        return f"({ta} * {tb})", _mul(a, b)
    if form == "shrunk":
        (ta, a), (tb, b) = sub(dim), sub("count")
        return f"({ta} / {tb})", _div(a, b)
    if form == "rate*time":
        (ta, a), (tb, b) = sub("bandwidth"), sub("time")
        return f"({ta} * {tb})", _div(_mul(a, b), Fraction(10 ** 9))     # (B/s) * ns = 10^-9 B
    if form == "size/rate":
        (ta, a), (tb, b) = sub("size"), sub("bandwidth")
        return f"({ta} / {tb})", _mul(_div(a, b), Fraction(10 ** 9))     # B / (B/s) = s = 10^9 ns
    (ta, a), (tb, b) = sub("size"), sub("time")
    return f"({ta} / {tb})", _mul(_div(a, b), Fraction(10 ** 9))         # B/ns = 10^9 B/s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.sampled_from([("rate", "bandwidth"), ("defer", "time"), ("coalesce", "size")]), st.data())
def test_compiled_constants_match_exact_fractions(tmp_path, target, data):
    decision, dim = target
    text, exact = data.draw(expression(dim))
    res, d = compile_policy(tmp_path, "policy p { on kv.issue at gpu0 { " + f"{decision} = {text}" + " } }\n")
    if exact is None:
        assert res is None and any("by zero" in x.message for x in d.errors), text
        return
    if exact > M64 or (dim in ("bandwidth", "time") and 0 < exact < 1):
        assert res is None, text                         # an error, never a wrapped or silent value
        return
    if res is None:   # an intermediate step overflowed 64 bits: also an error, at its position
        assert any("more than fits in 64 bits" in x.message for x in d.errors), (text, d.errors)
        return
    assert issue_decisions(tmp_path, f"{decision} = {text}")[decision] == int(exact), text


def test_ev_island_tells_the_gpus_of_a_wildcard_handler_apart(tmp_path):
    """ev.island (issue 13, item 8): every hook can read which island's program runs, gpu.launch
    included; it is compiled into each island's program, not carried in the context."""
    res, d = compile_policy(tmp_path, "map launched : array<u32, count>[16]\n"
                            "policy p { on kv.issue at gpu* { if ev.island == gpu1 { priority = 7 } }\n"
                            "           on gpu*.launch { launched[ev.island] += 1 } }\n")
    assert res is not None, [x.message for x in d.items]
    out = tmp_path / "out"
    write_folder(res.files, out)
    bundle = load_bundle(out)
    ids = bundle.ids["devices"]
    # on gpu0 the condition is a constant false: the compiler drops the handler (and the program)
    assert "issue" not in bundle.islands["gpu0"]
    prog = bundle.islands["gpu1"]["issue"]
    codec = ContextCodec(prog.hook)
    ctx = codec.pack({"movement": bundle.ids["movements"]["kv"]})
    Interpreter().run(prog, ctx)
    assert codec.decisions(ctx)["priority"] == 7
    for gpu in ("gpu0", "gpu1"):
        launch = bundle.islands[gpu]["launch"]
        Interpreter().run(launch, ContextCodec(launch.hook).pack({}))
    assert bundle.maps["launched"].dump() == {ids["gpu0"]: 1, ids["gpu1"]: 1}
    assert "island" not in bundle.islands["gpu0"]["launch"].hook.layout     # no context field


# -- property: a run-time value compared with a constant, against the exact comparison -------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), whole=st.integers(0, 6),
       half=st.booleans(), constant_first=st.booleans(), nbytes=st.integers(0, 8))
def test_a_comparison_with_a_constant_compares_its_exact_value(tmp_path, op, whole, half, constant_first, nbytes):
    """``ev.bytes >= 2.5B`` compares with 2.5, not with its whole part: at 2 bytes it is false
    (it was true), and ``== 2.5B`` never holds; either side may be the constant."""
    constant = f"{whole}{'.5' if half else ''}B"
    cond = f"{constant} {op} ev.bytes" if constant_first else f"ev.bytes {op} {constant}"
    exact = Fraction(whole) + Fraction(1, 2) * half
    left, right = (exact, nbytes) if constant_first else (nbytes, exact)
    want = {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right,
            "==": left == right, "!=": left != right}[op]
    got = issue_decisions(tmp_path, f"if {cond} {{ priority = 7 }} else {{ priority = 1 }}", bytes=nbytes)
    assert got["priority"] == (7 if want else 1), cond


@pytest.mark.parametrize("cond,holds", [("80% < 80.5%", True), ("80.5% == 80%", False), ("1MiB / 3ms > 349525333B/s", True)])
def test_constant_comparisons_are_exact(tmp_path, cond, holds):
    got = issue_decisions(tmp_path, f"if {cond} {{ priority = 7 }} else {{ priority = 1 }}")
    assert got["priority"] == (7 if holds else 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(form=st.sampled_from(["x * c", "c * x", "x / c", "x - cB", "cB - x", "x % cB", "cB % x"]),
       c=st.fractions(min_value=Fraction(1, 8), max_value=Fraction(40), max_denominator=8),
       nbytes=st.integers(0, 1 << 30))
def test_a_run_time_value_by_a_constant_that_is_no_whole_number(tmp_path, form, c, nbytes):
    """``ev.bytes * 1.5`` is bytes * 3 / 2 (it was bytes * 1, and ``* 0.5`` gave 0): a run-time
    product, quotient, remainder or difference with a constant takes the constant's exact
    value and rounds down once, at the end, as a constant expression does."""
    text = f"{float(c):.3f}"
    if Fraction(text) != c:      # (decimals the lexer reads exactly)
        return
    body = "coalesce = " + form.replace("x", "ev.bytes").replace("c", text)
    exact = {"x * c": nbytes * c, "c * x": nbytes * c, "x / c": nbytes / c,
             "x - cB": max(nbytes - c, 0), "cB - x": max(c - nbytes, 0),
             "x % cB": nbytes % c, "cB % x": c % nbytes if nbytes else c}[form]
    assert issue_decisions(tmp_path, body, bytes=nbytes)["coalesce"] == int(exact), body


@pytest.mark.parametrize("body,decision,want", [
    ("rate = 8.2GB/s", "rate", 8_200_000_000),            # was 8,199,999,999 (a float's 8.2 * 10^9)
    ("coalesce = 1.005KB", "coalesce", 1005),             # was 1004
    ("coalesce = ev.bytes * 0.3", "coalesce", 3),         # 10 bytes * 3/10, not * 0.29999...
])
def test_decimal_literals_are_their_exact_decimal_values(tmp_path, body, decision, want):
    assert issue_decisions(tmp_path, body, bytes=10)[decision] == want
