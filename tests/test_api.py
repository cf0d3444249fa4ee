"""The Python API (fabric_ext.api): compile in memory, run, the report's records, errors."""
import json

import pytest

import fabric_ext
from conftest import POLICIES
from fabric_ext.contract.bundle import load_manifest

TEXT = f'''import "{POLICIES}/fabrics/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: hbm }}
movement w_in = weights : pool0 -> gpu*
policy p {{ on w_in.forward {{ priority = 7 }} }}
'''


def test_compile_text_in_memory_run_and_write(tmp_path):
    bundle = fabric_ext.compile(TEXT)
    assert "manifest.json" in bundle.files and bundle.manifest["programs"]
    report = fabric_ext.run(bundle, baseline=True)
    assert report.ttft_ms > 0 and report.baseline.ttft_ms > 0
    w_in = report.movement("w_in")
    assert w_in.bytes == w_in["bytes"] > 0 and w_in.name == "w_in"
    assert report.to_dict()["policy_speedup"] == round(report.baseline.ttft_ms / report.ttft_ms, 4)
    assert json.loads(report.to_json())["ttft_ms"] == report.ttft_ms
    out = bundle.write(tmp_path / "out")
    assert load_manifest(out) == bundle.manifest          # what fabricc compile writes, checked
    again = fabric_ext.run(fabric_ext.Bundle.read_folder(out))
    assert again.ttft_ms == report.ttft_ms


def test_a_policy_that_does_not_compile_raises_with_every_diagnostic():
    with pytest.raises(fabric_ext.PolicyError) as e:
        fabric_ext.compile(TEXT.replace("priority = 7", "priorty = 7"))
    assert "priorty" in str(e.value) and e.value.diagnostics.errors
    with pytest.raises(fabric_ext.PolicyError, match="never runs|matches no transfer|no handler uses"):
        fabric_ext.compile(TEXT.replace("weights: pool0", "weights: hbm"), werror=True)
