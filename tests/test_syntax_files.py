"""The editor syntax files under editors/ are what `fabric_ext.syntax_files` generates from the
grammar, the hook catalogue and the units, and they colour a bundled policy as expected (the
TextMate patterns applied here; the Vim file in Vim, where it is installed)."""
import re
import shutil
import subprocess

import pytest

from conftest import POLICIES, ROOT
from fabric_ext import syntax_files

SOURCE = POLICIES / "prefill_qos.fx"


def test_the_committed_files_are_the_generated_ones():
    for name, text in syntax_files.files().items():
        assert (ROOT / "editors" / name).read_text() == text, "run: python -m fabric_ext.syntax_files editors"


def test_every_keyword_of_the_grammar_and_every_decision_is_named():
    text = (ROOT / "fabric_ext" / "grammar.lark").read_text()
    words = set(re.findall(r'"([a-z_]+)"', text)) - {"max", "min"}
    assert words == set(syntax_files.keywords()) | set(syntax_files.device_kinds())
    assert {"priority", "rate", "defer", "prefetch", "tier", "route"} <= set(syntax_files.decisions())


def _scopes(line: str) -> dict[str, str]:
    """Each token of a line and the scope of the first TextMate pattern matching there."""
    patterns = [(p["name"], re.compile(p["match"])) for p in syntax_files.tmlanguage()["patterns"] if "match" in p]
    out, pos = {}, 0
    while pos < len(line):
        for scope, rx in patterns:
            m = rx.match(line, pos)
            if m and m.end() > pos:
                out[m.group(0)] = scope
                pos = m.end()
                break
        else:
            pos += 1
    return out


def test_the_textmate_grammar_colours_a_policy():
    lines = SOURCE.read_text().splitlines()
    assert _scopes(lines[0])[lines[0]].startswith("comment.line")
    assert _scopes("policy prefill_qos {")["policy"] == "keyword.control.fx"
    rate = _scopes(next(x for x in lines if "rate = 16GB/s" in x))
    assert rate["rate"] == "variable.language.decision.fx" and rate["16GB/s"] == "constant.numeric.quantity.fx"
    assert rate["80%"] == "constant.numeric.quantity.fx" and rate["ev.out_port"] == "variable.other.event.fx"
    assert _scopes("  gpu gpu0, gpu1 { hbm: 80GiB }")["gpu"] == "storage.type.device.fx"


@pytest.mark.skipif(shutil.which("vim") is None, reason="no vim here")
def test_vim_colours_a_policy(tmp_path):
    lines = SOURCE.read_text().splitlines()
    row = next(i for i, x in enumerate(lines, 1) if "rate = 16GB/s" in x)
    at = {"rate": lines[row - 1].index("rate") + 1, "16GB/s": lines[row - 1].index("16GB/s") + 1}
    out = tmp_path / "syn.txt"
    probe = f'echo synIDattr(synID(1,1,1),"name") synIDattr(synID({row},{at["rate"]},1),"name") ' \
            f'synIDattr(synID({row},{at["16GB/s"]},1),"name") &filetype'
    subprocess.run(["vim", "-Nu", "NONE", "-i", "NONE", "-es", "-c", f"set rtp^={ROOT / 'editors' / 'vim'}",
                    "-c", "filetype on", "-c", "syntax on", "-c", f"e {SOURCE}", "-c", f"redir! > {out}",
                    "-c", probe, "-c", "redir END", "-c", "qa!"], timeout=30, check=False)
    assert out.read_text().split() == ["fxComment", "fxDecision", "fxNumber", "fx"]
