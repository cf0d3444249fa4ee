"""`fabricc fmt`: idempotent, comment- and line-preserving, the same programs after as before."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import POLICIES
from fabric_ext.contract.bundle import load_bundle
from fabric_ext.fmt import format_source
from test_runtime import compile_text

SOURCES = sorted(POLICIES.glob("*.fx")) + sorted((POLICIES / "fabrics").glob("*.fx"))

MESSY = '''import "fabrics/dgx_cxl.fx"
movement w=weights : pool0->gpu*
map m : hash<device,size>[8]   // bytes per GPU
policy p {
on w.issue at gpu* {
      if ev.bytes>1MiB&&ev.layer==3 { priority=7 ; m[ev.src]+=ev.bytes }
   else { defer = 5us }
  /* a block
       comment kept */
  let x = min(ev.bytes,
1MiB)
}
}


'''
LAID_OUT = '''import "fabrics/dgx_cxl.fx"
movement w = weights : pool0 -> gpu*
map m : hash<device, size>[8]   // bytes per GPU
policy p {
  on w.issue at gpu* {
    if ev.bytes>1MiB && ev.layer == 3 { priority = 7; m[ev.src] += ev.bytes }
    else { defer = 5us }
    /* a block
       comment kept */
    let x = min(ev.bytes,
        1MiB)
  }
}
'''


def fabricc(*args):
    return subprocess.run([sys.executable, "-m", "fabric_ext.cli", *map(str, args)], capture_output=True, text=True)


def test_a_messy_policy_is_laid_out():
    assert format_source(MESSY) == LAID_OUT
    assert format_source(LAID_OUT) == LAID_OUT


def test_a_policy_with_crlf_line_ends_keeps_them_on_every_line():
    """An editor that writes CRLF gets CRLF back on every line, not CRLF where a comment
    ends the line and LF elsewhere."""
    crlf = MESSY.replace("\n", "\r\n")
    assert format_source(crlf) == LAID_OUT.replace("\n", "\r\n")
    assert format_source(format_source(crlf)) == format_source(crlf)


def test_a_source_that_begins_with_a_byte_order_mark_reads_as_without_it(tmp_path):
    from fabric_ext.frontend import analyze
    path = tmp_path / "bom.fx"
    path.write_bytes(b"\xef\xbb\xbf" + (POLICIES / "prefill_qos.fx").read_bytes().replace(
        b'import "fabrics/', f'import "{POLICIES}/fabrics/'.encode()))
    a = analyze(path)
    assert a.ok and not a.diags.errors and len(a.placements) == 30


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_every_bundled_source_is_laid_out_already_and_stays_so(source):
    text = source.read_text()
    assert format_source(text) == text
    assert format_source(format_source(text)) == format_source(text)


def _programs(folder):
    b = load_bundle(folder)
    return {(isl, hook): p.code for isl, progs in b.islands.items() for hook, p in progs.items()}, \
        {name: (m.type, m.key_size, m.value_size, m.max_entries) for name, m in b.maps.items()}


@pytest.mark.parametrize("name", ["prefill_qos", "telemetry", "kv_tiering", "nic_pacing"])
def test_a_messed_up_policy_laid_out_compiles_to_the_same_programs(tmp_path, name):
    """Strip each line's indentation and squeeze the spaces around its operators; laid out
    again, it compiles to the programs and maps of the original, line for line."""
    text = (POLICIES / f"{name}.fx").read_text()
    messed = "\n".join(re.sub(r"\s*(=|->|,)\s*", r"\1", line.strip()) if "//" not in line and '"' not in line
                       else line.strip() for line in text.splitlines())
    laid = format_source(messed)
    assert laid.count("\n") == text.count("\n")                  # every line where it was
    assert format_source(laid) == laid
    assert _programs(compile_text(tmp_path, laid, "laid")) == _programs(compile_text(tmp_path, text, "orig"))


@settings(max_examples=60, deadline=None)
@given(source=st.sampled_from(SOURCES), seed=st.integers(0, 2**32 - 1))
def test_whitespace_anywhere_changes_nothing_but_the_layout(source, seed):
    """Random indentation, and random spaces around operators and commas outside comments and
    strings: the tokens, comments and lines survive, and a second run changes nothing."""
    import random

    from fabric_ext.fmt import _tokens
    rng = random.Random(seed)
    text = source.read_text()

    def noise(line):
        if "//" in line or '"' in line or "/*" in line:
            return " " * rng.randrange(6) + line.strip()
        spaced = re.sub(r"\s*(,|<->|(?<!<)->|(?<![<>=!+\-|&a-z])=(?!=))\s*",
                        lambda m: " " * rng.randrange(3) + m[1] + " " * rng.randrange(3), line.strip())
        return " " * rng.randrange(6) + spaced
    noisy = "\n".join(noise(line) for line in text.splitlines()) + "\n"
    laid = format_source(noisy)
    assert format_source(laid) == laid
    assert laid.count("\n") == text.count("\n")
    kept = ("code", "string", "comment")
    assert [t for t in _tokens(laid) if t[0] in kept] == [t for t in _tokens(text) if t[0] in kept]


def test_fmt_check_and_write(tmp_path):
    shutil.copytree(POLICIES / "fabrics", tmp_path / "fabrics")
    messy, clean = tmp_path / "messy.fx", tmp_path / "clean.fx"
    messy.write_text(MESSY)
    clean.write_text(LAID_OUT)
    os.chmod(messy, 0o640)
    r = fabricc("fmt", "--check", messy, clean)
    assert r.returncode == 1 and r.stdout.split() == [str(messy)]
    r = fabricc("fmt", messy)
    assert r.returncode == 0 and r.stdout == LAID_OUT and messy.read_text() == MESSY
    r = fabricc("fmt", "-w", messy)
    assert r.returncode == 0 and messy.read_text() == LAID_OUT
    assert oct(messy.stat().st_mode & 0o777) == oct(0o640)          # written back with the mode it had
    assert fabricc("fmt", "--check", messy, clean).returncode == 0


def test_fmt_leaves_a_file_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.fx"
    bad.write_text("policy p {\n  on x.issue { priority = }\n}\n")
    r = fabricc("fmt", "-w", bad)
    assert r.returncode == 1 and "bad.fx:2:" in r.stderr and "Traceback" not in r.stderr
    assert bad.read_text() == "policy p {\n  on x.issue { priority = }\n}\n"
    assert fabricc("fmt", tmp_path / "nope.fx").returncode == 2


def test_a_new_output_file_gets_the_umasks_mode(tmp_path):
    from fabric_ext.runtime.machine.fsutil import atomic_write_text
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "new.json", "{}\n")
    finally:
        os.umask(old)
    assert oct((tmp_path / "new.json").stat().st_mode & 0o777) == oct(0o640)
