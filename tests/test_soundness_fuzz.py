"""The soundness fuzzer (tests/fuzz/soundness.py) in CI: a bounded, seeded run, and every case
it ever found replayed (tests/soundness_cases/*.json: rejected now, or clean under proof checking,
and not faulting where `flow.may_fault` says they cannot);
and a seeded run of the random-policy judge (tests/fuzz/policy_verdicts.py)."""
import os
import random
from pathlib import Path

import pytest
from fuzz.soundness import Case, accepts, check, fuzz

from fabric_ext.runtime.machine import kernel
from fabric_ext.runtime.machine.program import Program

CASES = sorted((Path(__file__).parent / "soundness_cases").glob("*.json"))
SEED = int(os.environ.get("FABRIC_EXT_FUZZ_SEED", "20261201"))
KERNEL_OK, KERNEL_WHY = kernel.permitted()


def test_fuzzer_finds_no_unsound_proof():
    rep = fuzz(SEED, seconds=60, max_programs=6000)
    print(f"seed {SEED}: {rep.generated} programs, {rep.accepted} accepted, "
          f"{rep.kernel_rejected} of them rejected by the kernel, {rep.faultless} found unable to fault")
    assert rep.accepted > rep.generated // 20, "the generator should get programs past the verifier"
    assert rep.faultless > rep.accepted // 10, "some should be held to `may_fault`'s word"
    assert not rep.failures, "\n".join(c.why + "\n" + c.to_json() for c in rep.failures[:3])


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_found_cases_stay_fixed(path):
    case = Case.from_json(path.read_text())
    verdict = accepts(case)
    assert verdict is False or isinstance(verdict, Program), verdict      # never a verifier crash
    if verdict:
        assert check(case, verdict, random.Random(0), 24) is None



@pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)
def test_random_policies_get_the_kernels_verdicts(tmp_path):
    """tests/fuzz/policy_verdicts.py, seeded and bounded: every program of 12 random policies
    gets the same verdict here as from the running kernel's verifier (issue 16: what the
    kernel accepts within its 1M limit is accepted here too; the kernel is the judge)."""
    from fuzz.policy_verdicts import Policy, judge
    seed = SEED % 100_000
    found = []
    for s in range(seed, seed + 12):
        path = tmp_path / f"{s}.fx"
        path.write_text(Policy(random.Random(s), 4).text())
        found += [f"seed {s}: {line}" for line in judge(path, 1_000_000)]
    assert not found, "\n".join(found)
