"""Params (issue 17): `param NAME : DIM = VALUE` in a policy, `-D NAME=VALUE` on the command
lines, dimension-checked, substituted before the passes and recorded in the manifest."""
import json
import subprocess
import sys

import pytest

import fabric_ext
from fabric_ext.contract.bundle import load_bundle
from fabric_ext.contract.context import ContextCodec
from fabric_ext.runtime.machine.errors import UsageError
from fabric_ext.runtime.machine.interp import Interpreter

POLICY = """import "dgx_cxl"
param quota : bandwidth = 2GB/s
param tokens : count = 1024
workload w {{ model: "llama3-8b"; prompt: tokens; tp: 2; weights: pool0; kv: pool0 }}
movement kv_wb = kv : gpu* -> pool0
policy p {{ on kv_wb.issue {{ {body} }} }}
"""


def rate_decided(tmp_path, params=None, body="rate = quota"):
    bundle = fabric_ext.compile(POLICY.format(body=body), params=params)
    folder = bundle.write(tmp_path / "out")
    loaded = load_bundle(folder)
    prog = loaded.islands["gpu0"]["issue"]
    codec = ContextCodec(prog.hook)
    ctx = codec.pack({"movement": loaded.ids["movements"]["kv_wb"]})
    Interpreter().run(prog, ctx)
    return codec.decisions(ctx)["rate"], loaded.manifest


def test_a_param_is_its_declared_value_unless_the_command_line_sets_it(tmp_path):
    rate, man = rate_decided(tmp_path)
    assert rate == 2 * 10**9 and man["params"] == {"quota": 2 * 10**9, "tokens": 1024}
    rate, man = rate_decided(tmp_path, {"quota": "512MB/s", "tokens": "4096"})
    assert rate == 512 * 10**6 and man["params"]["quota"] == 512 * 10**6
    assert man["workload"]["prompt"] == 4096                 # a param in a property


def test_params_fold_in_expressions(tmp_path):
    rate, _ = rate_decided(tmp_path, {"quota": "1GB/s"}, body="rate = quota * 3")
    assert rate == 3 * 10**9


@pytest.mark.parametrize("params,message", [
    ({"quota": "1GB"}, "'quota' is a bandwidth, not a size"),
    ({"quot": "1GB/s"}, "did you mean 'quota'?"),
    ({"quota": "1XB/s"}, "unknown unit"),
    ({"quota": "-1GB/s"}, "'-1GB/s' is no quantity: write a number of 0 or more and its unit, e.g. 1GB/s"),
])
def test_a_bad_define_is_a_usage_error_that_says_what_is_wrong(tmp_path, params, message):
    with pytest.raises(UsageError, match=message):
        fabric_ext.compile(POLICY.format(body="rate = quota"), params=params)


@pytest.mark.parametrize("decl,message,col", [
    ("param quota : bandwidth = 2GB", "param 'quota' is a bandwidth, and its value is a size", 27),
    ("param quota : speed = 2GB/s", "unknown dimension 'speed'", 15),
    ("param tokens : count = 3", "param 'tokens' is declared twice", 7),
])
def test_a_bad_declaration_is_an_error_at_its_place(decl, message, col):
    text = POLICY.format(body="rate = 1GB/s").replace("param quota : bandwidth = 2GB/s", decl)
    with pytest.raises(fabric_ext.PolicyError) as e:
        fabric_ext.compile(text)
    hit = next(d for d in e.value.diagnostics.errors if message in d.message)
    assert hit.span.col == col


def test_a_variable_may_not_take_a_params_name():
    with pytest.raises(fabric_ext.PolicyError) as e:
        fabric_ext.compile(POLICY.format(body="let quota = 5; rate = quota"))
    assert any("'quota' is a param of the policy" in d.message for d in e.value.diagnostics.errors)


def test_both_command_lines_take_defines_and_a_compiled_folder_refuses_them(tmp_path):
    src = tmp_path / "p.fx"
    src.write_text(POLICY.format(body="rate = quota"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "compile", "-D", "quota=1GB/s", str(src), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "manifest.json").read_text())["params"]["quota"] == 10**9
    bad = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "check", "-D", "quota", str(src)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "write -D NAME=VALUE" in bad.stderr
    gbps = {}
    for value in ("1GB/s", "4GB/s"):
        run = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(src), "-D",
                              f"quota={value}", "--prompt", "2048", "-q", "--json", str(tmp_path / "r.json")],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        gbps[value] = next(m["avg_gbps"] for m in json.loads((tmp_path / "r.json").read_text())["movements"]
                           if m["name"] == "kv_wb")
    assert gbps["1GB/s"] < 2.5 and gbps["4GB/s"] > 2 * gbps["1GB/s"]     # two GPUs' flows, each at its rate
    folder = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(out), "-D",
                             "quota=1GB/s", "-q"], capture_output=True, text=True)
    assert folder.returncode == 2 and "compiled already" in folder.stderr
