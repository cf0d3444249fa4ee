"""Grammar, checker rules, imports, units, graph routing and placement."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FABRIC_LINES, POLICIES
from fabric_ext import ast as A
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.parser import parse
from fabric_ext.units import UnitError, parse_quantity

L = FABRIC_LINES  # line numbers below count from the end of the test fabric


def errors(a):
    return [(d.span.line - L, d.span.col, d.message) for d in a.diags.errors]


def one_error(a):
    errs = errors(a)
    assert len(errs) >= 1, "expected an error"
    return errs[0]


# ---- units ----------------------------------------------------------------------
@pytest.mark.parametrize("text,value,dim", [
    ("64GB/s", 64e9, "bandwidth"), ("400Gbps", 50e9, "bandwidth"), ("10us", 10_000, "time"),
    ("256KiB", 262144, "size"), ("80%", 80, "percent"), ("989TFLOPs", 989e12, "flops"),
    ("1TiB", 2**40, "size"), ("3.35TB/s", 3.35e12, "bandwidth"), ("7", 7, None), ("2ms", 2e6, "time"),
    ("1.5ns", 1.5, "time"), ("8bps", 1, "bandwidth"),
])
def test_units(text, value, dim):
    v, d = parse_quantity(text)
    assert d == dim and v == pytest.approx(value)


def test_unknown_unit_suggests():
    with pytest.raises(UnitError) as e:
        parse_quantity("5Gbs")
    assert e.value.suggestion == "Gbps"


# ---- grammar ----------------------------------------------------------------------
def test_grammar_covers_the_language():
    src = """
    import "x.fx"
    fabric f { gpu a, b { hbm: 80GiB } cxl_switch s cxl_mem m at s { bw: 1GB/s } link a <-> s { bw: 1GB/s } link b -> s }
    workload w { model: "llama3-8b"; prompt: 8192 }
    movement mv = weights(ffn) : m -> a via s { critical; chunk: 2MiB }
    movement bi = activations(collective) : a <-> b
    map h : lru_hash<u32, u64>[8]
    policy p {
      on mv.forward at s, a when ev.bytes > 1KiB && !(ev.layer == 3) {
        let x = min(ev.bytes, 4MiB) / 2
        if x > 1MiB { priority = 7 } else if x > 1KiB { priority = 5 } else { defer = 5us }
        h[ev.layer] += 1; h[0] max= x
        for i in 0..4 { h[i] = h[i] ?? 3 }
        emit r(now, x)
        delete h[1]
        ev.rate = 1GB/s
      }
    }
    """
    d = Diagnostics()
    m = parse(src, "g.fx", d)
    assert not d.items
    kinds = [type(i).__name__ for i in m.items]
    assert kinds == ["Import", "Fabric", "Workload", "Movement", "Movement", "MapDecl", "Policy"]
    fab = m.items[1]
    assert [x.name.name for x in fab.devices] == ["a", "b", "s", "m"]
    assert fab.links[1].bidir is False and fab.devices[3].at.name == "s"
    h = m.items[-1].handlers[0]
    assert [p.name for p in h.at] == ["s", "a"] and isinstance(h.when, A.BinOp)
    stmts = [type(s).__name__ for s in h.body]
    assert stmts == ["Let", "If", "MapUpdate", "MapUpdate", "For", "Emit", "Delete", "Assign"]
    assert h.body[1].orelse[0].orelse[0].target.name == "defer"
    assert h.body[-1].via_ev


def test_every_node_has_a_span():
    d = Diagnostics()
    m = parse('policy p { on a.b { if ev.x > 3 { priority = 1 } } }', "s.fx", d)
    for n in A.walk(m):
        if not isinstance(n, A.Module):
            assert n.span.line == 1 and n.span.col >= 1, n


def test_syntax_error_says_what_was_expected():
    d = Diagnostics()
    assert parse("policy p { on a.b { priority = } }", "e.fx", d) is None
    (err,) = d.errors
    assert (err.span.line, err.span.col) == (1, 32)
    assert "unexpected '}'" in err.message and "a number" in err.hints[0]


def test_newlines_or_semicolons_separate():
    d = Diagnostics()
    m = parse("policy p { on a.b { priority = 1\n rate = 2GB/s; defer = 1us } }", "n.fx", d)
    assert len(m.items[0].handlers[0].body) == 3


# ---- checker rules: one good and one bad input each --------------------------------
GOOD = {
    "decision": "policy p { on w.forward { priority = 7 } }",
    "field": "policy p { on kv.forward { if ev.bytes > 1MiB { priority = 1 } } }",
    "map": "policy p { on sw0.tick(10us) { util[ev.port] = ev.util_pct } }",
    "emit": "policy p { on kv.forward { emit ring(now, ev.bytes) } }",
    "loop": "policy p { on kv.forward { for i in 0..4 { cnt[i] += 1 } } }",
    "at": "policy p { on kv.issue at gpu0 { rate = 10GB/s } }",
    "let": "policy p { on kv.forward { let x = ev.bytes * 2\n if x > 1MiB { defer = 1us } } }",
    "tier": "policy p { on kv.mem_access at sw0 { tier = pool0 } }",
}


@pytest.mark.parametrize("name", GOOD)
def test_good_inputs_check_clean(analyze_src, name):
    a = analyze_src(GOOD[name])
    assert errors(a) == []


BAD = [
    # (source, line, col, message fragment, hint fragment)
    ("policy p { on exx.forward { priority = 1 } }", 1, 15, "unknown movement or island 'exx'", "did you mean 'ex'"),
    ("policy p { on w.forwrd { priority = 1 } }", 1, 17, "unknown hook 'forwrd'", "did you mean 'forward'"),
    ("policy p { on w.issue at sw0 { priority = 1 } }", 1, 26, "island 'sw0' (cxl_switch) has no 'issue' hook", None),
    ("policy p { on kv.tx { rate = 1GB/s } }", 1, 18, "no island on the path of movement 'kv' has hook 'tx'", None),
    ("policy p { on w.forward { prio = 1 } }", 1, 27, "has no decision 'prio'", "did you mean 'priority'"),
    ("policy p { on w.forward { priority = ev.bytez } }", 1, 41, "has no field 'bytez'", "did you mean 'bytes'"),
    ("policy p { on w.forward { rate = 10us } }", 1, 34, "'rate' must be a bandwidth, not a time", None),
    ("policy p { on w.forward { ev.bytes = 5 } }", 1, 30, "context field 'bytes' of cxl_switch.forward is read-only", None),
    ("policy p { on w.forward at nic0 { priority = 1 } }", 1, 28, "'nic0' is not on the path of movement 'w'", None),
    ("policy p { on ex.tx at sw0 { rate = 1GB/s } }", 1, 24, "island 'sw0' (cxl_switch) has no 'tx' hook", None),
    ("policy p { on w.forward { prefetch = 2 } }", 1, 27, "cxl_switch.forward has no decision 'prefetch'", None),
    ("policy p { on w.forward { util[ev.port] = ev.bytes } }", 1, 43, "map 'util' holds a percentage, not a size", None),
    ("policy p { on w.forward { nope[1] = 1 } }", 1, 27, "unknown map 'nope'", None),
    ("policy p { on w.forward { ring[1] = 1 } }", 1, 27, "'ring' is a ringbuf; it cannot be indexed", None),
    ("policy p { on w.forward { emit cnt(1) } }", 1, 32, "emit needs a ringbuf map", None),
    ("policy p { on w.forward { for i in 0..ev.layer { cnt[i] += 1 } } }", 1, 39, "loop bounds must be constants", None),
    ("policy p { on w.forward { for i in 0..5000 { cnt[i] += 1 } } }", 1, 27, "too long", None),
    ("policy p { on w.forward { priority = 9 } }", 1, 38, "priority 9 is out of range", None),
    ("policy p { on w.forward { priority = x } }", 1, 38, "unknown name 'x'", None),
    ("policy p { on w.forward { if ev.bytes > 10us { priority = 1 } } }", 1, 30, "cannot compare a size with a time", None),
    ("policy p { on sw0.tick { util[ev.port] = 1 } }", 1, 19, "'tick' needs a period", None),
    ("policy p { on sw0.tick(10GB) { util[0] = 1 } }", 1, 24, "a tick period must be a positive time", None),
    ("policy p { on w.forward { util[20] = 1 } }", 1, 32, "index 20 is out of bounds", None),
    ("policy p { on w.forward { route = 3 } }", 1, 35, "'route' must name a device", None),
    ("policy p { on w.tick(10us) { priority = 1 } }", 1, 17, "'tick' is not an event of a movement", None),
    ("policy p { on gpu0.forward { priority = 1 } }", 1, 20, "island 'gpu0' (gpu) has no hook 'forward'", None),
    ("policy p { on w.forward { let a = 1\n let a = 2 } }", 2, 6, "'a' is already defined", None),
    ("policy p { on w.forward { priority = min(1) } }", 1, 38, "min() takes at least two arguments", None),
]


@pytest.mark.parametrize("src,line,col,msg,hint", BAD, ids=[b[3][:40] for b in BAD])
def test_bad_inputs_report_at_their_position(analyze_src, src, line, col, msg, hint):
    a = analyze_src(src)
    errs = [d for d in a.diags.errors if msg in d.message]
    assert errs, f"no error containing {msg!r}; got {errors(a)}"
    d = errs[0]
    assert (d.span.line - L, d.span.col) == (line, col), errors(a)
    if hint:
        assert any(hint in h for h in d.hints), d.hints


DECL_BAD = [
    ("fabric f { gpu g0 gpu g0 }", "duplicate device 'g0'"),
    ("fabric f { gpu g0 { hbmm: 1GiB } }", "has no property 'hbmm'"),
    ("fabric f { gpu g0 { hbm: 1GB/s } }", "'hbm' must be a size, not a bandwidth"),
    ("fabric f { gpu g0 link g0 <-> g9 }", "link to unknown device 'g9'"),
    ("fabric f { cxl_mem m }", "must say which switch"),
    ("fabric f { gpu g cxl_mem m at g }", "is a gpu, not a cxl_switch"),
    ("fabric f { gpu a, b }\nmovement m = kv : a -> b", "cannot reach 'b' from 'a': no path"),
    ("fabric f { gpu a, b link a <-> b }\nmovement m = weight : a -> b", "unknown data class 'weight'"),
    ("fabric f { gpu a, b link a <-> b }\nmovement m = kv : a -> c*", "pattern 'c*' matches no device"),
    ("fabric f { gpu a }\nmap m : array<u64, u64>[4]", "indexed by a u32 key"),
    ("fabric f { gpu a }\nmap m : array<u64>[4]", "map 'm' needs key and value types"),    # (was a crash)
    ("fabric f { gpu a }\nmap m : hash<u32, i32>[4]", "'i32' would hold what 'u32' does"),  # (it did, silently)
    ("fabric f { gpu a }\nmap m : hash<u32, u64>[100000000]", "too large"),
    ("fabric f { gpu a }\nmap m : hashh<u32, u64>[4]", "unknown map kind 'hashh'"),
    ("fabric f { gpu a }\nmap m : ringbuf[1000]", "power of two"),
    ("fabric f { gpu a }\nmap m : hash<u32, u64>[4]\nmap m : hash<u32, u64>[4]", "duplicate map 'm'"),
    ("fabric f { gpu a }\nworkload w { prompt: 1KiB }", "'prompt' must be a count"),
    ("fabric f { gpu a }\nworkload w { weights: pol0 }", "unknown device 'pol0'"),
    ("fabric f { gpu a, b  link a <-> b { bw: 1GB/s }  link b -> a { bw: 2GB/s } }", "a second link from 'b' to 'a'"),
    ("fabric f { gpu a  cxl_switch s }\nworkload w { kv: s }", "'kv' cannot name s, a cxl_switch: it names a gpu,"),
    ("fabric f { gpu a  cxl_mem m }\nworkload w { kv_export: m }", "'kv_export' cannot name m, a cxl_mem: it names a dpu or nic"),
]


@pytest.mark.parametrize("src,msg", DECL_BAD, ids=[m for _, m in DECL_BAD])
def test_declaration_errors(analyze_src, src, msg):
    a = analyze_src(src, with_fabric=False)
    assert any(msg in d.message for d in a.diags.errors), [d.message for d in a.diags.errors]
    assert all(d.span.line >= 1 and d.span.col >= 1 for d in a.diags.errors)


def test_all_errors_of_a_file_in_one_run(analyze_src):
    a = analyze_src("policy p {\n on w.forward { prio = 1 }\n on kv.forward { rate = 1us }\n on zz.forward { } }")
    assert len(a.diags.errors) == 3


# ---- imports ---------------------------------------------------------------------
def test_import_shares_a_fabric(tmp_path):
    from fabric_ext.frontend import analyze
    (tmp_path / "fab.fx").write_text("fabric f { gpu a, b  link a <-> b }")
    (tmp_path / "p.fx").write_text('import "fab.fx"\nmovement m = kv : a -> b\npolicy p { on m.issue { priority = 1 } }')
    a = analyze(tmp_path / "p.fx")
    assert a.ok and [p.island for p in a.placements] == ["a", "b"]


def test_import_cycle_is_reported(tmp_path):
    from fabric_ext.frontend import analyze
    (tmp_path / "a.fx").write_text('import "b.fx"\n')
    (tmp_path / "b.fx").write_text('import "a.fx"\n')
    a = analyze(tmp_path / "a.fx")
    (err,) = a.diags.errors
    assert "import cycle" in err.message and err.span.line == 1 and err.span.file.endswith("b.fx")


def test_missing_import(tmp_path):
    from fabric_ext.frontend import analyze
    (tmp_path / "a.fx").write_text('\nimport "nope.fx"\n')
    (err,) = analyze(tmp_path / "a.fx").diags.errors
    assert "cannot import" in err.message and err.span.line == 2


# ---- graph and placement -----------------------------------------------------------
def test_routes_by_latency_and_via(analyze_src):
    src = """fabric f { gpu a, b  cxl_switch s1, s2
      link a <-> s1 { latency: 100ns } link s1 <-> b { latency: 100ns }
      link a <-> s2 { latency: 1us } link s2 <-> b { latency: 1us } }
    movement fast = kv : a -> b
    movement slow = kv : a -> b via s2
    policy p { on fast.forward { priority = 1 } on slow.forward { priority = 2 } }"""
    a = analyze_src(src, with_fabric=False)
    assert a.ok
    assert a.graph.flows["fast"][0].path == ["a", "s1", "b"]
    assert a.graph.flows["slow"][0].path == ["a", "s2", "b"]
    assert [(p.island, p.movement) for p in a.placements] == [("s1", "fast"), ("s2", "slow")]


def test_patterns_expand_and_handlers_place_on_every_island(analyze_src):
    a = analyze_src("policy p { on kv.issue { priority = 1 } on ex.forward { priority = 2 } }")
    assert a.ok
    assert [(f.src, f.dst) for f in a.graph.flows["kv"]] == [("gpu0", "pool0"), ("gpu1", "pool0")]
    assert a.graph.flows["kv"][0].islands == [("gpu0", "src"), ("sw0", "dst")]
    assert a.graph.flows["ex"][0].islands == [("gpu0", "src"), ("sw0", "transit"), ("nic0", "dst")]
    assert sorted((p.island, p.hook.name) for p in a.placements) == \
        [("gpu0", "issue"), ("gpu1", "issue"), ("sw0", "forward")]


def test_bidirectional_movement(analyze_src):
    a = analyze_src("movement ar = activations(collective) : gpu0 <-> gpu1\n")
    assert [(f.src, f.dst) for f in a.graph.flows["ar"]] == [("gpu0", "gpu1"), ("gpu1", "gpu0")]


def test_examples_check_clean():
    from conftest import EXAMPLES
    from fabric_ext.frontend import analyze
    assert len(EXAMPLES) >= 4
    for p in EXAMPLES:
        a = analyze(p)
        assert a.ok, a.diags.items
        assert a.placements


# ---- the shipped parser tables -----------------------------------------------------------
def test_the_shipped_parser_tables_are_those_of_the_grammar_and_are_used(monkeypatch):
    """grammar.tables.json carries the grammar's digest and Lark's version (rewrite it with
    `python -m fabric_ext.grammar_tables` after changing the grammar); loading it builds
    nothing, and a stamp that does not match falls back to building."""
    from fabric_ext import grammar_tables as gt
    built = []
    monkeypatch.setattr(gt, "build", lambda: built.append(1))
    assert gt.load() is not None and not built
    monkeypatch.setattr(gt, "_stamp", lambda: {"grammar_sha256": "0" * 64, "lark": "0"})
    gt.load()
    assert built == [1]


@pytest.mark.parametrize("text", [
    *[p.read_text() for p in sorted(POLICIES.rglob("*.fx"))],
    "fabric f { gpu g0 }", "policy p { on x.issue { priority = } }", "workload w { model: ; }",
    "movement m = kv : a -> b via", "map m : array<u32, u64>[4]\npolicy p { on m { } }", "}{",
])
def test_the_shipped_tables_parse_as_a_parser_built_from_the_grammar(text):
    """Trees, and the tokens a syntax error expects, equal those of a parser built afresh."""
    import lark

    from fabric_ext import grammar_tables as gt
    shipped, fresh = gt.load(), gt.build()

    def outcome(parser):
        try:
            return parser.parse(text)
        except lark.exceptions.UnexpectedInput as e:
            return type(e).__name__, e.line, e.column, sorted(getattr(e, "expected", None) or
                                                              getattr(e, "allowed", None) or ())
    assert outcome(shipped) == outcome(fresh)


# ---- the graph's shortest paths, against networkx -------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7), st.sampled_from([0, 1, 2, 5, None])),
                max_size=30), st.integers(0, 7), st.integers(0, 7))
def test_shortest_paths_are_those_networkx_finds(links, src, dst):
    """`contract.digraph.shortest_path` breaks ties as networkx's Dijkstra does, so routes and
    port numbers are what they were when the project routed with networkx (latency 0 and
    equal-cost routes included)."""
    import networkx as nx

    from fabric_ext.contract.digraph import DiGraph, shortest_path
    from fabric_ext.contract.topology import _weight
    ours, theirs = DiGraph(), nx.DiGraph()
    for g in (ours, theirs):
        for n in range(8):
            g.add_node(f"d{n}")
        for u, v, lat in links:
            g.add_edge(f"d{u}", f"d{v}", latency=lat)
    try:
        expected = nx.shortest_path(theirs, f"d{src}", f"d{dst}", weight=_weight)
    except nx.NetworkXNoPath:
        expected = None
    assert shortest_path(ours, f"d{src}", f"d{dst}", _weight) == expected
    assert list(ours.edges(data=True)) == list(theirs.edges(data=True))


# ---- where imports are found -----------------------------------------------------------------
def test_a_bundled_fabric_imports_by_name_from_any_folder(tmp_path):
    from fabric_ext.frontend import analyze
    (tmp_path / "p.fx").write_text('import "dgx_cxl"\nworkload w { model: "llama3-8b"; prompt: 256; tp: 2 }\n')
    a = analyze(tmp_path / "p.fx")
    assert a.ok and "pool0" in a.symbols.devices


def test_imports_are_looked_for_next_to_the_importer_then_in_include_folders_then_bundled(tmp_path):
    from fabric_ext.frontend import analyze
    lib, mine = tmp_path / "lib", tmp_path / "mine"
    lib.mkdir()
    mine.mkdir()
    (lib / "fab.fx").write_text('fabric f { gpu lib_gpu { } }\n')
    (mine / "dgx_cxl.fx").write_text('fabric f { gpu my_gpu { } }\n')       # shadows the bundled one
    (mine / "p.fx").write_text('import "fab"\n')
    (mine / "q.fx").write_text('import "dgx_cxl"\n')
    missing = analyze(mine / "p.fx")
    assert "cannot import 'fab'" in missing.diags.errors[0].message
    assert "lib_gpu" in analyze(mine / "p.fx", include=[lib]).symbols.devices
    assert "my_gpu" in analyze(mine / "q.fx").symbols.devices


def test_an_import_found_nowhere_names_where_it_looked_and_the_closest_bundled_name(tmp_path):
    from fabric_ext.frontend import analyze
    (tmp_path / "p.fx").write_text('import "dgx_h10"\n')
    [e] = analyze(tmp_path / "p.fx").diags.errors
    assert "no dgx_h10.fx in" in e.message and "dgx_h100" in e.message
    assert e.hints == ["did you mean 'dgx_h100'?"] and (e.span.line, e.span.col) == (1, 1)


def test_a_map_declared_without_its_types_is_one_error_not_one_per_use(analyze_src):
    a = analyze_src("map m2 : array<u64>[4]\npolicy p { on w.forward { m2[1] = 2\n m2[2] += 1 } }")
    assert [d.message for d in a.diags.errors] == ["map 'm2' needs key and value types"]


def test_a_fabric_past_its_bounds_is_one_error_each_not_minutes_and_gigabytes(analyze_src):
    """A 48 KB fabric of 1,000 GPUs in a ring with `gpu* <-> gpu*` routed 1,998,000 flows (more
    than 300 s and 9.5 GB); a 44 KB one of 5,000 GPUs compiles 5,000 islands. Each bound is one
    error where it is passed, and what follows is checked without more. (The ring's links have
    no properties: 1,000 of them were "an expression of more than 400 tokens".)"""
    from fabric_ext.contract.schema import MAX_DEVICES
    from fabric_ext.graph import MAX_FLOWS
    ring = 1_000
    a = analyze_src("fabric f {\n  gpu " + ", ".join(f"g{i}" for i in range(ring)) + " { hbm: 80GiB }\n"
                    + "".join(f"  link g{i} <-> g{(i + 1) % ring}\n" for i in range(ring)) + "}\n"
                    "movement a = activations(collective) : g* <-> g*\n"
                    "policy p { on a.issue at g* { priority = 1 } }\n", with_fabric=False)
    assert [d.message for d in a.diags.errors] == [
        f"movement 'a' has 1,998,000 source and destination pairs: with the movements before it, more than the "
        f"{MAX_FLOWS:,} flows the compiler routes (the movements after it are not routed)"]
    a = analyze_src("fabric f {\n  gpu " + ", ".join(f"g{i}" for i in range(MAX_DEVICES + 1)) + " }\n"
                    "map m : hash<u32, u64>[4]\npolicy p { on g*.tick(10us) { m[1] = 1 } }\n", with_fabric=False)
    (e,) = a.diags.errors
    assert e.message.startswith(f"the fabric declares {MAX_DEVICES + 1:,} devices; a fabric has at most "
                                f"{MAX_DEVICES:,}") and e.span.line == 2


@pytest.mark.parametrize("entry", ["parse", "analyze", "build"])
def test_each_compiler_entry_collects_garbage_less_often_and_restores_the_caller_s_thresholds(monkeypatch, entry):
    """The parser makes a tree node or more per token and little cyclic garbage: the young
    generation is collected every GC_YOUNG allocations while the parser (fabricc fmt), the
    front end (fabricc check) and the compiler (fabricc compile) run, each past the part the
    one before covers (half the parse of a 12,000-handler policy went to collections), and
    the caller's thresholds are back after it."""
    import gc

    import fabric_ext.codegen.driver as D
    import fabric_ext.frontend as F
    import fabric_ext.parser as P
    from fabric_ext.runtime.machine.gcutil import GC_YOUNG
    seen = []

    def recording(module, name):
        real = getattr(module, name)

        def record(*args, **kwargs):
            seen.append(gc.get_threshold()[0])
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, record)
    path = POLICIES / "prefill_qos.fx"
    run, module, name = {"parse": (lambda: P.parse(path.read_text(), str(path), Diagnostics()), P._Build, "transform"),
                         "analyze": (lambda: F.analyze(path).ok, F, "warn"),
                         "build": (lambda: D.build(path), D, "lower")}[entry]
    recording(module, name)
    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        assert run()
        assert seen == [GC_YOUNG] and gc.get_threshold()[0] == 700
    finally:
        gc.set_threshold(*before)


@pytest.mark.parametrize("caller, during", [(700, 20_000), (50_000, 50_000), (0, 0)])
def test_fewer_collections_keeps_a_higher_threshold_and_collection_turned_off(caller, during):
    import gc

    from fabric_ext.runtime.machine.gcutil import fewer_collections
    before = gc.get_threshold()
    gc.set_threshold(caller, *before[1:])
    try:
        with fewer_collections():
            assert gc.get_threshold()[0] == during
        assert gc.get_threshold()[0] == caller
    finally:
        gc.set_threshold(*before)
