"""The soundness fuzzer (tests/fuzz/soundness.py) in CI: a bounded, seeded run, and every case
it ever found replayed (tests/soundness_cases/*.json: rejected now, or clean under proof checking)."""
import os
import random
from pathlib import Path

import pytest
from fuzz.soundness import Case, accepts, check, fuzz

from fabric_ext.runtime.machine.program import Program

CASES = sorted((Path(__file__).parent / "soundness_cases").glob("*.json"))
SEED = int(os.environ.get("FABRIC_EXT_FUZZ_SEED", "20261201"))


def test_fuzzer_finds_no_unsound_proof():
    rep = fuzz(SEED, seconds=60, max_programs=6000)
    print(f"seed {SEED}: {rep.generated} programs, {rep.accepted} accepted, "
          f"{rep.kernel_rejected} of them rejected by the kernel")
    assert rep.accepted > rep.generated // 20, "the generator should get programs past the verifier"
    assert not rep.failures, "\n".join(c.why + "\n" + c.to_json() for c in rep.failures[:3])


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_found_cases_stay_fixed(path):
    case = Case.from_json(path.read_text())
    verdict = accepts(case)
    assert verdict is False or isinstance(verdict, Program), verdict      # never a verifier crash
    if verdict:
        assert check(case, verdict, random.Random(0), 24) is None

