import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# the JIT's code cache (runtime/machine/codecache.py): one per session, so tests neither reuse nor
# leave entries in the user's ~/.cache (set before any test imports the JIT)
os.environ["FABRIC_EXT_JIT_CACHE"] = tempfile.mkdtemp(prefix="fx-jit-cache-")
atexit.register(shutil.rmtree, os.environ["FABRIC_EXT_JIT_CACHE"], ignore_errors=True)
# every interpreter run in the suite checks the verifier's proofs (runtime/machine/interp.py): an
# access proven safe that faults, or lands in memory of another kind, fails as a verifier bug
os.environ["FABRIC_EXT_CHECK_PROOFS"] = "1"

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"
EXAMPLES = sorted(p for p in POLICIES.glob("*.fx"))

FABRIC = """\
fabric f {
  gpu gpu0, gpu1 { hbm: 80GiB }
  cxl_switch sw0 { ports: 8 }
  cxl_mem pool0 at sw0 { bw: 64GB/s }
  dpu nic0 { line_rate: 400Gbps }
  link gpu0 <-> sw0 { bw: 63GB/s }
  link gpu1 <-> sw0 { bw: 63GB/s }
  link nic0 <-> sw0 { bw: 63GB/s }
}
movement w = weights(ffn) : pool0 -> gpu* { critical }
movement kv = kv : gpu* -> pool0
movement ex = kv : gpu* -> nic0
map util : array<u32, percent>[16]
map cnt : hash<u32, u64>[64]
map ring : ringbuf[4KiB]
"""
FABRIC_LINES = FABRIC.count("\n")


@pytest.fixture
def analyze_src(tmp_path):
    """Analyze a policy written after the standard test fabric; returns the Analysis."""
    from fabric_ext.frontend import analyze

    def run(body: str, with_fabric: bool = True, name: str = "t.fx"):
        path = tmp_path / name
        path.write_text((FABRIC if with_fabric else "") + body)
        return analyze(path)
    return run
