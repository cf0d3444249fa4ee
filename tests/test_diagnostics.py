"""Diagnostics that point at the cause (issue 13, item 10): one error for a missing import,
units written apart or as GBps, '=' in a condition, a brace never closed, a comment never ended."""
import pytest

from conftest import FABRIC, FABRIC_LINES
from fabric_ext.frontend import analyze

LINE = FABRIC_LINES + 1


def diagnose(tmp_path, text):
    path = tmp_path / "d.fx"
    path.write_text(text)
    a = analyze(path)
    return [(f"{d.span.line}:{d.span.col}", d.message, " ".join(d.hints)) for d in a.diags.errors]


def test_a_missing_import_is_one_error_at_the_import(tmp_path):
    errors = diagnose(tmp_path, 'import "nope.fx"\nmovement w = weights : pool0 -> gpu*\n'
                                "policy p { on w.forward { priority = 1 } }\n")
    assert len(errors) == 1 and errors[0][0] == "1:1" and "nope.fx': no such file" in errors[0][1]
    assert "nope.fx" not in errors[0][2]          # the hint does not repeat the failed import


@pytest.mark.parametrize("body,where,says,hint", [
    ("rate = 10 GB/s", f"{LINE}:42", "no space between a number and its unit: write '10GB/s'", ""),
    ("rate = 10GBps", f"{LINE}:42", "unknown unit 'GBps'", "did you mean 'GB/s'?"),
    ("rate = 10Gbit", f"{LINE}:42", "unknown unit 'Gbit'", "bps .. Tbps"),
    ("if ev.layer = 3 { priority = 1 }", f"{LINE}:47", "'=' assigns; a condition compares with '=='",
     "did you mean '=='?"),
])
def test_what_the_writer_meant(tmp_path, body, where, says, hint):
    errors = diagnose(tmp_path, FABRIC + "policy p { on kv.forward at sw0 { " + body + " } }\n")
    assert len(errors) == 1, errors
    assert errors[0][0] == where and says in errors[0][1] and hint in errors[0][2], errors


def test_a_brace_never_closed_is_pointed_at(tmp_path):
    errors = diagnose(tmp_path, FABRIC + "policy p {\n  on kv.forward at sw0 {\n    priority = 1\n\n}\n")
    assert errors == [(f"{LINE}:10", "this '{' is never closed",
                       f"add '}}' where its block ends (the file ends at line {LINE + 4})")]


def test_a_comment_never_ended(tmp_path):
    errors = diagnose(tmp_path, FABRIC + "/* notes\npolicy p { }\n")
    assert errors[0][:2] == (f"{LINE}:1", "unterminated comment")


def test_warnings_for_what_can_have_no_effect(tmp_path):
    """A handler only on GPUs outside the tensor-parallel group, and a map no handler uses,
    are warnings at their position (issue 13, item 4, in part); --Werror makes them errors."""
    import subprocess
    import sys

    from conftest import POLICIES
    text = (f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n'
            'workload w { model: "llama3-8b"; prompt: 1024; tp: 4; weights: pool0; kv: pool0 }\n'
            "movement kv = kv : gpu* -> pool0\n"
            "map unused : array<u32, count>[4]\n"
            "policy p { on kv.issue at gpu5 { priority = 7 }\n"
            "           on kv.issue at gpu* { priority = 6 } }\n")
    path = tmp_path / "w.fx"
    path.write_text(text)
    a = analyze(path)
    warnings = [(f"{d.span.line}:{d.span.col}", d.message) for d in a.diags.items if d.severity == "warning"]
    assert not a.diags.errors
    assert ("4:5", "map 'unused' is declared but no handler uses it") in warnings
    assert any(w[0] == "5:12" and "runs only on gpu5, outside the tensor-parallel group (tp 4" in w[1]
               for w in warnings), warnings
    assert len(warnings) == 2                 # the gpu* handler runs on gpu0..gpu3: no warning
    for cmd in (["check"], ["compile", "-o", str(tmp_path / "out")]):
        plain = subprocess.run([sys.executable, "-m", "fabric_ext.cli", *cmd[:1], str(path), *cmd[1:]],
                               capture_output=True, text=True, check=False)
        strict = subprocess.run([sys.executable, "-m", "fabric_ext.cli", *cmd[:1], "--Werror", str(path), *cmd[1:]],
                                capture_output=True, text=True, check=False)
        assert plain.returncode == 0 and "warning: map 'unused'" in plain.stderr, plain.stderr
        assert strict.returncode == 1 and "error: map 'unused'" in strict.stderr, strict.stderr
    assert (tmp_path / "out").is_dir()        # written by the plain compile only once


@pytest.mark.parametrize("text", ["", "// notes only\n"])
def test_a_file_that_declares_nothing_is_a_warning_but_a_fabric_alone_is_not(tmp_path, text):
    """An empty source compiles to a bundle with no programs and no fabric: the compiler says
    so. A file that only imports, or only declares a fabric (a library), says nothing."""
    from conftest import POLICIES
    path = tmp_path / "empty.fx"
    path.write_text(text)
    warnings = [(f"{d.span.line}:{d.span.col}", d.message) for d in analyze(path).diags.items]
    assert len(warnings) == 1 and warnings[0][0] == "1:1" and "this file declares nothing" in warnings[0][1]
    path.write_text(f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n')
    assert not analyze(path).diags.items
    assert not analyze(POLICIES / "fabrics" / "dgx_cxl.fx").diags.items


def test_werror_compile_writes_nothing_and_fabric_run_shows_the_warnings(tmp_path):
    import subprocess
    import sys

    from conftest import POLICIES
    path = tmp_path / "w.fx"
    path.write_text(f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n'
                    'workload w { model: "llama3-8b"; prompt: 256; tp: 2; weights: pool0; kv: pool0 }\n'
                    "movement kv = kv : gpu* -> pool0\nmap kv : array<u32, count>[4]\n"
                    "policy p { on kv.issue at gpu0 { priority = 7 } }\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "compile", "--Werror", str(path), "-o", str(out)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "error: map 'kv' is declared but no handler uses it" in r.stderr, r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(path), "-q"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "warning: map 'kv' is declared but no handler uses it" in r.stderr, r.stderr


def test_warnings_for_movements_and_handlers_no_transfer_reaches(tmp_path):
    """The compiler matches the transfers the declared prefill makes to movements, as the
    runtime does: a movement none matches, and a handler at an island none of its matched
    transfers cross, are warnings (the README's example matched nothing without a workload)."""
    from conftest import POLICIES
    text = (f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n'
            'workload w { model: "llama3-8b"; prompt: 1024; prefill_chunk: 512; tp: 2; weights: hbm; kv: pool0 }\n'
            "movement w_in = weights : pool0 -> gpu*\n"
            "movement kv = kv : gpu* -> pool0 via nic0\n"
            "movement back = kv : pool0 -> gpu*\n"
            "policy p { on w_in.forward { priority = 7 }\n"
            "           on kv.forward at sw0 { priority = 1 }\n"
            "           on kv.tx at nic0 { rate = 1GB/s }\n"
            "           on back.forward { priority = 6 } }\n")
    path = tmp_path / "m.fx"
    path.write_text(text)
    a = analyze(path)
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in a.diags.items if d.severity == "warning"}
    assert not a.diags.errors
    assert "matches no transfer of the prefill" in warnings.pop("3:1")        # weights stay in HBM
    assert warnings == {}, warnings       # kv crosses nic0 (via), back is the chunked prefill's read-back
    path.write_text(text.replace("prefill_chunk: 512; ", ""))          # one pass: nothing is read back
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in analyze(path).diags.items}
    assert "tp 2, 1 pass) no kv moves" in warnings.pop("5:1")


def test_island_handlers_no_transfer_meets_are_warned_and_indeed_never_run(tmp_path):
    """A handler on an island's chunk hook runs for every chunk that meets it there: where no
    transfer of the declared prefill does (nothing arrives from the network at nic0, nothing
    lands in host memory, no KV is exported), it is a warning; a run shows those handlers
    never ran and the others did.  A handler that routes makes paths change at run time, so
    then nothing is said."""
    import fabric_ext
    from conftest import POLICIES
    hooks = ["nic0.rx", "cpu0.complete", "nic0.tx", "sw0.forward", "sw0.mem_access", "gpu1.complete"]
    text = (f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n'
            'workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0 }\n'
            "map m : array<u32, count>[8]\npolicy p {\n"
            + "".join(f"  on {h} {{ m[{k}] += 1 }}\n" for k, h in enumerate(hooks)) + "}\n")
    path = tmp_path / "i.fx"
    path.write_text(text)
    a = analyze(path)
    assert not a.diags.errors
    warned = {d.span.line - 5 for d in a.diags.items if "no transfer of the prefill meets" in d.message}
    assert {hooks[k] for k in warned} == {"nic0.rx", "cpu0.complete", "nic0.tx"}
    counts = fabric_ext.run(fabric_ext.compile(text, werror=False)).to_dict()["maps"]["m"]
    ran = {k for k in range(len(hooks)) if int(counts.get(str(k), 0))}
    assert ran == set(range(len(hooks))) - warned
    path.write_text(text.replace("on sw0.forward { m[3] += 1 }", "on sw0.forward { m[3] += 1; route = cpu0 }"))
    assert not [d for d in analyze(path).diags.items if "no transfer of the prefill meets" in d.message]


def test_alloc_on_any_host_but_the_first_is_warned_and_indeed_never_runs(tmp_path):
    """The weights are placed once, from the fabric's first host (in declaration order, here h1):
    a handler on another host's alloc never runs."""
    import fabric_ext
    text = ("fabric f {\n  gpu g0\n  cxl_switch s0\n  cxl_mem m0 at s0 { capacity: 1TiB; bw: 64GB/s }\n"
            "  host h1\n  host h0\n  link g0 <-> s0 { bw: 63GB/s }\n  link h0 <-> s0 { bw: 63GB/s }\n"
            "  link h1 <-> s0 { bw: 63GB/s }\n}\n"
            'workload w { model: "llama3-8b"; prompt: 256; weights: m0 }\n'
            "map m : array<u32, count>[2]\n"
            "policy p { on h0.alloc { m[0] += 1 }\n           on h1.alloc { m[1] += 1 } }\n")
    path = tmp_path / "a.fx"
    path.write_text(text)
    warnings = {d.span.line: d.message for d in analyze(path).diags.items}
    assert warnings == {13: "h0.alloc never runs: the weights are placed at the fabric's first host, h1"}
    counts = fabric_ext.run(fabric_ext.compile(text)).to_dict()["maps"]["m"]
    assert int(counts.get("0", 0)) == 0 and int(counts["1"]) > 0


def test_an_export_to_where_kv_goes_already_is_warned_and_sent_once(tmp_path):
    import fabric_ext
    from conftest import POLICIES
    text = (f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n'
            'workload w { model: "llama3-8b"; prompt: 512; tp: 2; weights: hbm; kv: nic0; kv_export: nic0 }\n')
    path = tmp_path / "x.fx"
    path.write_text(text)
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in analyze(path).diags.items}
    assert warnings == {"2:89": "kv_export: nic0 is where kv sends the KV already: it goes there once"}
    report = fabric_ext.run(fabric_ext.compile(text)).to_dict()
    wire = next(link for link in report["links"] if link["name"] == "nic0->wire")
    assert wire["bytes"] == 2 * 512 * 8 * 128 * 2 * 32          # K and V of 512 tokens, 8 KV heads, 32 layers


def test_a_map_smaller_than_the_layers_or_ports_that_index_it_is_warned(tmp_path):
    """Llama-3-8B has 32 layers and sw0 11 ports: arrays of 16 and 8 entries indexed by them
    lose what is past their end, and a hash of 16 entries refuses layers once full (run: the
    layers past 16 are not counted); maps as large as those, and an lru_hash, which evicts,
    are not warned about."""
    import fabric_ext
    from conftest import POLICIES
    text = (f'import "{POLICIES}/fabrics/dgx_cxl.fx"\n'
            'workload w { model: "llama3-8b"; prompt: 256; tp: 2; weights: pool0; kv: hbm }\n'
            "movement wt = weights : pool0 -> gpu*\n"
            "map layers : array<u32, count>[16]\nmap util : array<u32, percent>[8]\n"
            "map whole : array<u32, count>[32]\nmap ports : array<u32, percent>[11]\n"
            "policy p { on wt.issue at gpu* { layers[ev.layer] += 1\n whole[ev.layer] += 1 }\n"
            "           on sw0.tick(10us) { util[ev.port] = ev.util_pct\n ports[ev.port] = ev.util_pct }\n"
            "           on wt.forward at sw0 { h[ev.layer] += 1\n lru[ev.layer] += 1 } }\n"
            "map h : hash<u32, count>[16]\nmap lru : lru_hash<u32, count>[16]\n")
    path = tmp_path / "a.fx"
    path.write_text(text)
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in analyze(path).diags.items}
    assert warnings.pop("8:41").startswith("'layers' holds 16 entries and the workload's model has 32 layers")
    assert warnings.pop("10:37").startswith("'util' holds 8 entries and sw0 has 11 ports")
    assert warnings.pop("12:37") == ("'h' holds 16 entries and the workload's model has 32 layers: once 16 "
                                     "keys are in it, updates of another are refused (the run counts them)")
    assert warnings == {}, warnings
    report = fabric_ext.run(fabric_ext.compile(text, werror=False)).to_dict()
    counts = report["maps"]
    assert len(counts["layers"]) == 16 and len(counts["whole"]) == 32 and len(counts["h"]) == 16
    assert report["map_full"]["h"] > 0 and "lru" not in report["map_full"]


def test_warnings_for_decisions_that_can_never_take_effect(tmp_path):
    """A constant decision no event can act on: coalescing to no more than the chunk size, a
    prefetch with the weights in HBM, a route to a device not linked to the island, a tier
    naming no memory, a tier on KV read back (only KV written back moves).  The same decisions with values that can act are not warned about."""
    path = tmp_path / "d.fx"
    path.write_text(
        "fabric f {\n  gpu g0, g1\n  cxl_switch s0, s1\n  cxl_mem m0 at s0 { capacity: 1TiB; bw: 64GB/s }\n"
        "  dpu n0\n  link g0 <-> s0 { bw: 63GB/s }\n  link g1 <-> s0 { bw: 63GB/s }\n"
        "  link s0 <-> s1 { bw: 63GB/s }\n  link s1 <-> n0 { bw: 63GB/s }\n}\n"
        'workload w { model: "llama3-8b"; prompt: 1024; tp: 2; weights: hbm; kv: m0; kv_export: n0 }\n'
        "movement kv = kv : g* -> m0 { chunk: 64KiB }\nmovement ex = kv : g* -> n0\n"
        "policy p {\n"
        "  on kv.issue at g* { coalesce = 64KiB; prefetch = 2 }\n"       # 15
        "  on kv.issue at g0 { coalesce = 1MiB }\n"
        "  on kv.forward at s0 { route = n0 }\n"                         # 17
        "  on ex.forward at s0 { route = s1 }\n"
        "  on kv.mem_access at s0 { tier = n0 }\n"                       # 19
        "  on kv.mem_access at s0 { tier = g1 }\n"
        "  on ex.tx at n0 { coalesce = 1MiB }\n"                        # 21
        "  on back.mem_access at s0 { tier = g1 }\n}\nmovement back = kv : m0 -> g*\n")
    a = analyze(path)
    assert not a.diags.errors
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in a.diags.items}
    assert "never merges anything: the chunks it meets are 64 KiB" in warnings.pop("15:34")
    assert "prefetch never takes effect" in warnings.pop("15:52")
    assert "n0 is not linked to s0" in warnings.pop("17:33")
    assert "n0 is a dpu, which holds no memory" in warnings.pop("19:35")
    assert "the chunks it meets are 2 MiB" in warnings.pop("21:31")      # ex keeps the workload's chunk
    assert "tier: back carries no KV written back to memory" in warnings.pop("22:37")   # KV read back
    assert warnings == {}, warnings


def test_removed_movement_properties_say_what_to_write_instead(tmp_path):
    path = tmp_path / "r.fx"
    path.write_text("fabric f { gpu a, b link a <-> b }\nmovement m = kv : a -> b { pattern: bulk; background }\n")
    errors = {d.message: " ".join(d.hints) for d in analyze(path).diags.errors}
    assert "gone" in errors["a movement has no property 'pattern'"]
    assert "priority" in errors["a movement has no property 'background'"]


def test_a_long_line_is_shown_around_the_error(tmp_path):
    """A generated policy's handler on one line of 10,000 columns: the diagnostic shows 120
    columns around the error, the caret under it, not the whole line."""
    path = tmp_path / "long.fx"
    path.write_text(FABRIC + "policy p { on kv.forward at sw0 { " + "priority = 1 " * 800 + "rate = 10GBps } }\n")
    a = analyze(path)
    (d,) = a.diags.errors
    source, caret = a.diags.render(d).splitlines()[1:3]
    assert d.span.col > 10_000 and len(source) < 140
    assert source[caret.index("~"):].startswith("10GBps")


def test_a_line_of_an_objects_line_info_is_cut_around_its_column():
    from fabric_ext.runtime.machine.program import SourceLine
    text = "  on kv.forward { " + "m[1] = 1 " * 500 + "boom }"
    shown = str(SourceLine("p.fx", 3, text.index("boom") + 1, text))
    assert shown.startswith("p.fx:3:") and "boom" in shown and len(shown) < 130
    assert str(SourceLine("p.fx", 3, 3, "  on kv.forward { }  ")) == "p.fx:3:3: on kv.forward { }"


def test_a_switch_linking_more_devices_than_its_ports_is_an_error(tmp_path):
    path = tmp_path / "s.fx"
    path.write_text("fabric f {\n  gpu g0, g1, g2\n  cxl_switch s0 { ports: 3 }\n  cxl_mem m0 at s0\n"
                    "  link g0 <-> s0\n  link g1 <-> s0\n  link s0 -> g2\n}\n")
    errors = {f"{d.span.line}:{d.span.col}": d.message for d in analyze(path).diags.errors}
    assert errors == {"3:26": "switch 's0' has 3 ports but links 4 devices (g0, g1, g2, m0)"}
    path.write_text(path.read_text().replace("ports: 3", "ports: 0"))
    assert [d.message for d in analyze(path).diags.errors] == ["'ports' of a cxl_switch must be a whole number "
                                                               "from 1, not 0"]
    path.write_text(path.read_text().replace("ports: 0", "ports: 4"))
    assert not analyze(path).diags.errors


def test_a_device_or_link_figure_of_0_is_an_error_not_the_default(tmp_path):
    """A size, bandwidth, compute rate or count of 0 (or a fraction of an engine) meant the
    figure left out: each is an error; latencies and hops of 0 are times like any other."""
    path = tmp_path / "z.fx"
    path.write_text("fabric f {\n gpu g0 { copy_engines: 2.5; hbm: 0GB; bf16: 0TFLOPs }\n"
                    " cxl_switch s0 { hop: 0ns }\n cxl_mem m0 at s0 { bw: 0GB/s; capacity: 0GB; latency: 0ns }\n"
                    " dpu n0 { line_rate: 0Gbps }\n host h0 { dram_bw: 0GB/s }\n"
                    " link g0 <-> s0 { bw: 0GB/s; latency: 0ns }\n link n0 <-> s0\n link h0 <-> s0\n}\n")
    errors = [d.message for d in analyze(path).diags.errors]
    assert errors == ["'copy_engines' of a gpu must be a whole number from 1, not 2.5",
                      "'hbm' of a gpu must be more than 0, not 0 B", "'bf16' of a gpu must be more than 0, not 0 FLOPs",
                      "'bw' of a cxl_mem must be more than 0, not 0 B/s", "'capacity' of a cxl_mem must be more than 0, "
                      "not 0 B", "'line_rate' of a dpu must be more than 0, not 0 B/s",
                      "'dram_bw' of a host must be more than 0, not 0 B/s", "'bw' of a link must be more than 0, not 0 B/s"]


def test_min_and_and_on_an_array_that_nothing_sets_are_warned(tmp_path):
    """An array holds every key from the start, at 0: ``min=`` and ``&=`` keep it 0 unless the
    policy also sets its entries with ``=``; on a hash map they take the first value."""
    path = tmp_path / "a.fx"
    path.write_text("fabric f {\n  gpu g0\n  cxl_switch s0\n  link g0 <-> s0\n}\n"
                    "map a : array<u32, size>[4]\nmap b : array<u32, size>[4]\nmap h : hash<u32, size>[4]\n"
                    "policy p { on s0.forward { a[0] min= ev.bytes; b[0] &= ev.bytes; b[1] = 7B; h[0] min= 1B } }\n")
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in analyze(path).diags.items
                if "keeps its entries 0" in d.message}
    assert warnings == {"9:28": "'min=' on array 'a' keeps its entries 0: an array's entries start at 0"}


def test_a_variable_given_a_constant_that_is_no_whole_number_is_warned(tmp_path):
    """A variable holds a whole number: ``let k = 1.5`` holds 1 (``ev.bytes * k`` is then
    ``ev.bytes * 1``), which the compiler says; a decision or a whole constant is not warned."""
    path = tmp_path / "v.fx"
    path.write_text("fabric f {\n  gpu g0\n  cxl_switch s0\n  link g0 <-> s0\n}\n"
                    "policy p { on s0.forward {\n  let k = 1.5\n  let j = 2\n  j = 0.25\n  k = 3\n  priority = 2 } }\n")
    warnings = {f"{d.span.line}:{d.span.col}": d.message for d in analyze(path).diags.items if "holds" in d.message}
    assert warnings == {"7:11": "'k' holds 1: a variable holds whole numbers, so 1.5 is cut to its whole part",
                        "9:7": "'j' holds 0: a variable holds whole numbers, so 0.25 is cut to its whole part"}


def test_variables_not_decisions_are_warned_and_a_tier_keeps_paths_open(tmp_path):
    """A decision given a fractional constant is not a variable (decisions round down once,
    docs/language.md); and a handler that tiers, like one that routes, moves paths at run
    time, so no island handler is said to be never met."""
    path = tmp_path / "d.fx"
    path.write_text("fabric f {\n  gpu g0\n  cxl_switch s0\n  cxl_mem m0 at s0\n  host h0\n  link g0 <-> s0\n"
                    "  link h0 <-> s0\n}\n"
                    'workload w { model: "llama3-8b"; prompt: 256; kv: m0 }\nmap n : hash<u32, count>[2]\n'
                    "policy p { on s0.mem_access { priority = 2.5; tier = m0 }\n"
                    "           on h0.complete { n[0] += 1 } }\n")
    a = analyze(path)
    messages = [d.message for d in a.diags.items]
    assert not a.diags.errors and not [m for m in messages if "holds" in m or "prefill meets" in m], messages
    path.write_text(path.read_text().replace("; tier = m0", ""))
    assert any("no transfer of the prefill meets h0.complete" in d.message for d in analyze(path).diags.items)
