"""Property test: mutated example policies either check clean or give exit 1 with at least one
FILE:LINE:COL: error: line, never a traceback."""
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES, POLICIES

TOKEN = re.compile(r"\d+(?:\.\d+)?[A-Za-z%/]*|[A-Za-z_][A-Za-z0-9_]*|<->|->|\.\.|[{}()\[\];:,.=<>+\-*/%!?&|]|\"[^\"]*\"")


def tokens(text):
    return [m for m in TOKEN.finditer(text)]


@st.composite
def mutants(draw):
    path = draw(st.sampled_from(EXAMPLES))
    text = path.read_text()
    toks = tokens(text)
    kind = draw(st.sampled_from(["delete", "duplicate", "swap", "truncate", "misspell"]))
    i = draw(st.integers(0, len(toks) - 2))
    t, u = toks[i], toks[i + 1]
    if kind == "delete":
        text = text[:t.start()] + text[t.end():]
    elif kind == "duplicate":
        text = text[:t.end()] + " " + t.group() + text[t.end():]
    elif kind == "swap":
        text = text[:t.start()] + u.group() + text[t.end():u.start()] + t.group() + text[u.end():]
    elif kind == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    else:
        word = t.group()
        j = draw(st.integers(0, max(0, len(word) - 1)))
        text = text[:t.start()] + word[:j] + draw(st.sampled_from("xqz_")) + word[j + 1:] + text[t.end():]
    return path.name, text


class _Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def quietly(main, argv) -> _Result:
    """A command's ``main`` in this process (its error handling is the same as the command's),
    its output kept."""
    import contextlib
    import io
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(argv)
    return _Result(rc, err.getvalue())


def check_many(files):
    """fabricc check in this process."""
    from fabric_ext import cli
    return quietly(cli.main, ["check", *map(str, files)])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(mutants(), min_size=8, max_size=8))
def test_mutants_check_clean_or_fail_cleanly(tmp_path_factory, batch):
    d = tmp_path_factory.mktemp("mut")
    (d / "fabrics").mkdir()
    (d / "fabrics" / "dgx_cxl.fx").write_text((POLICIES / "fabrics" / "dgx_cxl.fx").read_text())
    files = []
    for k, (name, text) in enumerate(batch):
        f = d / f"m{k}_{name}"
        f.write_text(text)
        files.append(f)
    for f in files:   # one process per file, so each exit status is its own
        r = check_many([f])
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (f.read_text(), r.stderr)
        if r.returncode == 0:
            continue
        assert r.returncode == 1, r.stderr
        assert re.search(rf"{re.escape(f.name)}:\d+:\d+: error: ", r.stderr), r.stderr


NUMBER = re.compile(r"\d+(?:\.\d+)?")
BOUNDARY_NUMBERS = ["0", "1", "2", "7", "8", "255", "4096", "65536", "4294967295", "18446744073709551615", "0.5"]
UNITS = ["", "B", "KiB", "MiB", "GB", "ns", "us", "ms", "s", "GB/s", "Gbps", "%", "TFLOPs"]


@st.composite
def revalued(draw):
    """An example policy with one to three numbers changed: to a boundary value, in its own
    unit or another.  Most still check clean, so they reach the compiler and the run."""
    path = draw(st.sampled_from(EXAMPLES))
    text = path.read_text()
    for _ in range(draw(st.integers(1, 3))):
        numbers = [m for m in TOKEN.finditer(text) if NUMBER.match(m.group())]
        m = draw(st.sampled_from(numbers))
        unit = m.group()[NUMBER.match(m.group()).end():]
        if draw(st.booleans()):
            unit = draw(st.sampled_from(UNITS))
        text = text[:m.start()] + draw(st.sampled_from(BOUNDARY_NUMBERS)) + unit + text[m.end():]
    return path.name, text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(revalued())
def test_revalued_policies_compile_and_run_or_fail_cleanly(tmp_path_factory, mutant):
    """What checks clean compiles, and what compiles runs: each step ends in 0 or in 1 with a
    message, never a traceback, and a run is bounded."""
    from fabric_ext import cli
    from fabric_ext.runtime.simulation import cli as run_cli
    name, text = mutant
    d = tmp_path_factory.mktemp("rev")
    (d / name).write_text(text)
    steps = [(cli.main, ["compile", str(d / name), "-o", str(d / "out")]),
             (run_cli.main, ["--policy", str(d / "out"), "--prompt", "256", "-q", "--max-events", "200000"])]
    for main, argv in steps:
        r = quietly(main, argv)
        assert r.returncode in (0, 1), (text, r.stderr)
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (text, r.stderr)
        if r.returncode:
            assert r.stderr.strip(), text
            break
