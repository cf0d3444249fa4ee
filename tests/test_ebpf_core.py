"""The eBPF core: every instruction class and edge case in tests/ebpf/*.data, run in the
reference interpreter and, where bpf(2) is permitted, in the Linux kernel as the authority."""
import ctypes
import re
from contextlib import closing

import pytest

from ebpf_data import CASES
from fabric_ext.runtime.machine import isa, kernel
from fabric_ext.runtime.machine.asm import AsmError, assemble
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.program import Program, VMFault
from fabric_ext.runtime.machine.verifier import VerifierError, verify

KERNEL_OK, KERNEL_WHY = kernel.permitted()
needs_kernel = pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)


def program(case):
    return Program(case["name"], assemble(case["asm"]))


def backend(name, **kw):
    if name == "jit":
        from fabric_ext.runtime.machine.jit import JitBackend
        return JitBackend(**kw)
    return Interpreter(**kw)


@pytest.mark.parametrize("vm", ["interp", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_data_case(case, vm):
    prog = program(case)
    mem = bytearray(case["mem"]) if "mem" in case else None
    if "error" in case:
        with pytest.raises(VerifierError) as e:
            verify(prog)
        assert case["error"] in str(e.value)
        return
    verify(prog)
    b = backend(vm)
    if "fault" in case:
        with pytest.raises(VMFault) as e:
            b.run(b.load(prog), mem=mem)
        assert ("out-of-bounds" in str(e.value)) and "pc 0" in str(e.value)
        return
    assert b.run(b.load(prog), mem=mem if mem is not None else bytearray(8)) == case["result"]


KERNEL_CASES = [c for c in CASES if "result" in c and "helper" not in c["name"] and "kernel rejects" not in c]
BEYOND_KERNEL = [c for c in CASES if "kernel rejects" in c]


@needs_kernel
@pytest.mark.parametrize("case", BEYOND_KERNEL, ids=[c["name"] for c in BEYOND_KERNEL])
def test_what_we_accept_beyond_the_kernel_it_rejects(case):
    """The cases marked so are where this verifier accepts more than the kernel's (a loop
    bounded by its input): the kernel still rejects them, as the mark says."""
    kb = kernel.KernelBackend()
    try:
        with pytest.raises(kernel.KernelVerifierError):
            kb.load(program(case))
    finally:
        kb.close()


@needs_kernel
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c["name"] for c in KERNEL_CASES])
def test_kernel_agrees(case):
    """The same program as BPF_PROG_TYPE_SYSCALL through the kernel backend: the same full
    64-bit r0 and the same memory, passed as the context."""
    prog = program(case)
    mem = bytearray(case.get("mem", bytes(8)))
    ours = bytearray(mem)
    r0 = Interpreter().run(Program(prog.name, prog.insns, ctx_size=len(ours)), ctx=ours)
    kb = kernel.KernelBackend()
    try:
        assert kb.run(kb.load(prog), mem=mem) == r0
    finally:
        kb.close()
    assert bytes(mem) == bytes(ours)


@needs_kernel
def test_kernel_backend_returns_the_full_r0_through_jumps_and_calls():
    """BPF_PROG_TEST_RUN's retval has 32 bits: the backend stores r0 at every exit of the main
    function (not of subprograms), with jumps and calls re-aimed past what it inserts."""
    src = ("lddw %r6, 0x123456789abcdef0\nldxb %r1, [%r1+0]\njeq %r1, 0, zero\ncall local f\n"
           "add %r0, %r6\nexit\nzero:\nmov %r0, %r6\nexit\nf:\nlddw %r0, 0x100000000\nexit")
    prog = Program("full", assemble(src))
    verify(prog)
    kb = kernel.KernelBackend()
    try:
        h = kb.load(prog)
        for first, want in ((0, 0x123456789ABCDEF0), (1, 0x123456789ABCDEF0 + (1 << 32))):
            assert kb.run(h, mem=bytearray([first] + [0] * 7)) == want
            assert Interpreter().run(prog, mem=bytearray([first] + [0] * 7)) == want
    finally:
        kb.close()


@needs_kernel
def test_kernel_rejections_carry_the_kernel_log():
    kb = kernel.KernelBackend()
    try:
        with pytest.raises(kernel.KernelVerifierError) as e:
            kb.load(Program("bad", assemble("mov %r0, 0\nldxdw %r0, [%r0+0]\nexit")))
        assert "its log ends:" in str(e.value) and "invalid mem access" in str(e.value)
    finally:
        kb.close()


def test_encode_decode_roundtrip():
    for case in CASES:
        insns = assemble(case["asm"])
        assert isa.decode(isa.encode(insns)) == insns


def test_disassembly_reads_like_objdump():
    text = isa.disasm(assemble("mov %r0, 1\nldxw %r2, [%r1+4]\njeq %r0, 5, +1\nlock add [%r10-8], %r1\nexit"))
    lines = [l.split("\t")[-1] for l in text.splitlines()]
    assert lines == ["r0 = 1", "r2 = *(u32 *)(r1 + 0x4)", "if r0 == 0x5 goto +1",
                     "lock *(u64 *)(r10 - 0x8) += r1", "exit"]


@pytest.mark.parametrize("src,line,msg", [
    ("mov %r0, 1\nfrob %r0\nexit", 2, "unknown instruction 'frob'"),
    ("mov %r11, 1", 1, "expected a register"),
    ("jeq %r0, 1, nowhere\nexit", 1, "unknown label 'nowhere'"),
    ("ldxw %r0, %r1\nexit", 1, "memory operand"),
])
def test_assembler_errors_name_the_line(src, line, msg):
    with pytest.raises(AsmError) as e:
        assemble(src)
    assert e.value.line == line and msg in str(e.value)


@pytest.mark.parametrize("vm", ["interp", "jit"])
def test_instruction_budget(vm):
    prog = Program("spin", assemble("mov %r0, 0\nloop:\nadd %r0, 1\njlt %r0, 100000, loop\nexit"))
    b = backend(vm, budget=1000)
    with pytest.raises(VMFault) as e:
        b.run(b.load(prog))
    assert "instruction budget of 1000 exhausted" in str(e.value)


@pytest.mark.parametrize("vm", ["interp", "jit"])
def test_budget_holds_for_straight_line_code(vm):
    """The JIT counts nothing in a program without loops, unless it is longer than the budget."""
    prog = Program("line", assemble("mov %r0, 1\nadd %r0, 1\nadd %r0, 1\nexit"))
    big = backend(vm, budget=4)
    assert big.run(big.load(prog)) == 3
    small = backend(vm, budget=3)
    with pytest.raises(VMFault) as e:
        small.run(small.load(prog))
    assert "instruction budget of 3 exhausted" in str(e.value)


def test_jit_bounds_checks_what_the_verifier_cannot_prove():
    """A bare program indexes its memory with a value read from it: the JIT checks at run time."""
    from fabric_ext.runtime.machine.jit import JitBackend
    prog = Program("idx", assemble("ldxb %r2, [%r1+0]\nadd %r1, %r2\nldxb %r0, [%r1+0]\nexit"))
    verify(prog)
    b = JitBackend()
    h = b.load(prog)
    assert b.run(h, mem=bytearray([2, 0, 9, 0])) == 9
    with pytest.raises(VMFault) as e:
        b.run(h, mem=bytearray([200, 0, 9, 0]))
    assert "out-of-bounds" in str(e.value) and "pc 2" in str(e.value)


def test_jit_drops_only_the_checks_the_verifier_proved():
    """The verifier records where each access was proven; the JIT's code for a proven context
    access has no check, so a context shorter than the hook's runs the checked code instead."""
    from fabric_ext.contract.hooks import HOOKS
    from fabric_ext.runtime.machine.jit import JitBackend
    hook = HOOKS["cxl_switch", "forward"]
    off = hook.offset("bytes")
    prog = Program("p", assemble(f"ldxdw %r0, [%r1+{off}]\nexit"), hook=hook)
    verify(prog)
    assert prog.proof == {0: frozenset({"ctx"})}
    b = JitBackend()
    h = b.load(prog)
    ctx = bytearray(hook.ctx_size)
    ctx[off] = 42
    assert b.run(h, ctx) == 42
    with pytest.raises(VMFault) as e:
        b.run(h, bytearray(off + 4))
    assert "out-of-bounds" in str(e.value)
    bare = Program("m", assemble("ldxb %r0, [%r1+0]\nexit"))
    verify(bare)
    assert bare.proof == {0: frozenset({"mem"})}     # memory given at run time: always checked


def test_jit_batch_runs_many_contexts_in_one_call():
    import numpy as np

    from fabric_ext.contract.hooks import HOOKS
    from fabric_ext.runtime.machine.jit import JitBackend
    hook = HOOKS["cxl_switch", "forward"]
    src = (f"ldxdw %r2, [%r1+{hook.offset('bytes')}]\nrsh %r2, 20\nstxw [%r1+{hook.offset('priority')}], %r2\n"
           "mov %r0, 0\nexit")
    prog = Program("b", assemble(src), hook=hook)
    verify(prog)
    ctxs = np.zeros((1000, hook.ctx_size), dtype=np.uint8)
    ctxs[:, hook.offset("bytes") + 2] = np.arange(1000) % 8 * 16   # bytes = (i % 8) << 20
    b = JitBackend()
    assert b.run_batch(b.load(prog), ctxs) == 1000
    prio = ctxs[:, hook.offset("priority")]
    assert list(prio[:9]) == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert b.run_batch(b.load(prog), ctxs[:0]) == 0
    ctxs.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        b.run_batch(b.load(prog), ctxs)


def test_a_batch_keeps_what_its_runs_return():
    """The batch entry sums r0 over the rows (`batch_r0`), so a program whose only result is r0
    is not dead code to LLVM; the sum equals the single runs'."""
    import numpy as np

    from fabric_ext.runtime.machine.jit import JitBackend
    prog = Program("r0", assemble("ldxdw %r0, [%r1+0]\nmul %r0, 3\nexit"))
    verify(prog)
    ctxs = np.arange(1000, dtype=np.uint64).reshape(1000, 1).view(np.uint8).copy()
    b = JitBackend()
    h = b.load(prog)
    assert b.run_batch(h, ctxs) == 1000
    assert b.batch_r0 == sum(b.run(h, bytearray(row.tobytes())) for row in ctxs) == 3 * 999 * 1000 // 2


def test_one_batch_driver_runs_every_program_s_batches():
    """The batch loop is compiled once per process and calls the entry it is given: batches of
    two programs, interleaved, each run their own program; a program's module holds only its
    own code."""
    import numpy as np

    from fabric_ext.runtime.machine import jit
    from fabric_ext.runtime.machine.lift import Lifter
    triple = Program("x3", assemble("ldxdw %r0, [%r1+0]\nmul %r0, 3\nexit"))
    plus = Program("p7", assemble("ldxdw %r0, [%r1+0]\nadd %r0, 7\nexit"))
    ctxs = np.arange(100, dtype=np.uint64).reshape(100, 1).view(np.uint8).copy()
    b = jit.JitBackend()
    sums = []
    for prog in (triple, plus, triple):
        verify(prog)
        b.run_batch(b.load(prog), ctxs)
        sums.append(b.batch_r0)
    assert sums == [3 * 4950, 4950 + 700, 3 * 4950]
    library = jit._library()
    b.run_batch(b.load(plus), ctxs)
    assert jit._library() is library
    assert "batch" not in str(Lifter(plus, "fxp", plus.proof, counted=False).build())


def test_fault_then_continue():
    """A faulting run raises; the same interpreter runs the next program normally."""
    vm = Interpreter()
    bad = Program("bad", assemble("ldxdw %r0, [%r1+64]\nexit"))
    with pytest.raises(VMFault):
        vm.run(bad, mem=bytearray(8))
    assert vm.run(Program("ok", assemble("mov %r0, 3\nexit"))) == 3


def test_context_write_rules_from_the_hook_catalogue():
    from fabric_ext.contract.hooks import HOOKS
    hook = HOOKS["cxl_switch", "forward"]
    write_input = f"mov %r2, 1\nstxw [%r1+{hook.offset('bytes')}], %r2\nmov %r0, 0\nexit"
    with pytest.raises(VerifierError) as e:
        verify(Program("w", assemble(write_input), hook=hook))
    assert "read-only context field 'bytes'" in str(e.value)
    ok = f"mov %r2, 7\nstxw [%r1+{hook.offset('priority')}], %r2\nmov %r0, 0\nexit"
    verify(Program("ok", assemble(ok), hook=hook))
    oob = f"ldxdw %r0, [%r1+{hook.ctx_size}]\nexit"
    with pytest.raises(VerifierError) as e:
        verify(Program("oob", assemble(oob), hook=hook))
    assert "outside the" in str(e.value)


def test_the_context_is_read_only_at_the_pointer_itself():
    """The kernel reads a context only at an instruction's offset from the pointer it was
    given (`dereference of modified ctx ptr`); so does this verifier, or it would accept what
    the kernel refuses (LLVM moved the pointer once a handler used 60 maps)."""
    from fabric_ext.contract.hooks import HOOKS
    hook = HOOKS["cxl_switch", "forward"]
    at = hook.offset("bytes")
    moved = Program("moved", assemble(f"mov %r2, %r1\nadd %r2, {at}\nldxdw %r0, [%r2+0]\nexit"), hook=hook)
    with pytest.raises(VerifierError, match=f"moved {at}..{at} bytes off the context"):
        verify(moved)
    verify(Program("direct", assemble(f"ldxdw %r0, [%r1+{at}]\nexit"), hook=hook))
    if KERNEL_OK:
        with closing(kernel.KernelBackend()) as kb, pytest.raises(kernel.KernelVerifierError, match="modified ctx ptr"):
            kb.load(moved)


def test_a_program_may_use_as_many_maps_as_the_kernel_allows():
    from fabric_ext.runtime.machine.elf import MapSpec
    from fabric_ext.runtime.machine.maps import ARRAY
    maps = [MapSpec(f"m{i}", ARRAY, 4, 8, 1).create() for i in range(isa.MAX_USED_MAPS + 1)]
    src = "".join(f"lddw %r1, map {i}\n" for i in range(isa.MAX_USED_MAPS)) + "mov %r0, 0\nexit"
    verify(Program("most", assemble(src), maps))
    over = src.replace("mov %r0", f"lddw %r1, map {isa.MAX_USED_MAPS}\nmov %r0")
    with pytest.raises(VerifierError, match="uses more than 64 maps"):
        verify(Program("over", assemble(over), maps))


@pytest.mark.parametrize("src,expected", [
    ("mov %r0, 0\njeq %r1, 0, +1\nmov %r0, 1\nexit", True),
    # a shared tail placed before the branch that reaches it: a backward jump, no cycle
    ("ja +2\nmov %r0, 7\nexit\njeq %r1, 0, -3\nmov %r0, 1\nexit", True),
    ("mov %r0, 0\nadd %r0, 1\njlt %r0, 10, -2\nexit", False),
    # a cycle no path reaches still counts: the budget must bound whatever runs
    ("mov %r0, 0\nexit\nja -1", False),
])
def test_the_jit_tells_a_loop_from_a_backward_jump(src, expected):
    """Straight-line code takes the JIT's fast tier with no instruction budget (each instruction
    runs at most once); only a real cycle in the control-flow graph counts as a loop."""
    from fabric_ext.runtime.machine.flow import acyclic
    assert acyclic(Program("p", assemble(src))) is expected


@pytest.mark.parametrize("src, ctx_size, why", [
    ("ldxdw %r0, [%r1+8]\nstxdw [%r10-8], %r0\nexit", 16, None),
    ("mov %r0, 0\nadd %r0, 1\njlt %r0, 10, -2\nexit", 16, "loop"),
    ("ldxdw %r0, [%r1+0]\nexit", 0, "known only at run time"),          # memory given to a bare program
    ("stdw [%r10-8], 0\nmov %r1, %r10\nadd %r1, -8\nmov %r2, 8\ncall 6\nmov %r0, 0\nexit", 16,
     "trace_printk"),
])
def test_may_fault_says_why_a_run_could_fault(src, ctx_size, why):
    """`flow.may_fault`: None only for a verified program that no run on a whole context can
    fault (tests/fuzz/soundness.py holds it to that on random programs); else the reason."""
    from fabric_ext.runtime.machine.flow import may_fault
    prog = Program("p", assemble(src), ctx_size=ctx_size)
    assert may_fault(prog) == "it was not verified"
    verify(prog)
    reason = may_fault(prog)
    assert reason is None if why is None else why in reason, reason
    assert may_fault(prog, budget=2) is not None


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_assembler_reads_what_disasm_prints(case):
    """Every conformance-style program, printed by `isa.disasm` (listing, bytes and all) and
    assembled again, is the same instructions."""
    insns = assemble(case["asm"])
    again = assemble(isa.disasm(insns))
    assert [i.encode() for i in again] == [i.encode() for i in insns]


def test_the_assembler_reads_fabric_vm_disasm_of_every_bundled_object(tmp_path):
    import re

    from fabric_ext.runtime.machine.elf import load_object
    from fabric_ext.runtime.vm_cli import main
    from policy_helpers import compiled
    for policy in ("prefill_qos", "telemetry", "kv_tiering", "nic_pacing"):
        for obj in compiled(policy).glob("*.bpf.o"):
            import contextlib
            import io
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["disasm", str(obj)]) == 0
            programs = {p.name: p.insns for p in load_object(obj).programs}
            for name, body in re.findall(r"^(\w+) \(section [^)]*\):\n(.*?)(?=^\w+ \(section|\Z)", out.getvalue(),
                                         re.MULTILINE | re.DOTALL):
                assert [i.encode() for i in assemble(body)] == [i.encode() for i in programs[name]], (obj, name)
            assert programs


def _the_kernel_accepts(prog):
    """Where bpf(2) is permitted, the kernel's verifier accepts ``prog`` (else it raises)."""
    if KERNEL_OK:
        with closing(kernel.KernelBackend()) as kb:
            kb.load(prog)


@pytest.mark.parametrize("seed,size,name", [(5, 4, "gpu0_issue"), (1, 4, "nic0_tx"), (11, 3, "sw0_forward")])
def test_generated_policies_the_kernel_accepts_verify_here_too(seed, size, name):
    """Programs of generated policies (tests/fuzz/policy_verdicts.py) the kernel accepts, on
    which this verifier ran out of its 1M-instruction budget: branches in and after
    300-iteration loops leave different values behind that nothing reads again (seed 5,
    forgotten as dead registers) or whose range decides nothing (seeds 1 and 11, pruned by
    precision and stack reads: runtime/machine/pruning.py)."""
    import random
    import tempfile
    from pathlib import Path

    from fuzz.policy_verdicts import Policy, compile_unjudged

    from fabric_ext.runtime.machine.elf import load_object
    from fabric_ext.runtime.machine.liveness import live_in
    assert live_in(assemble("mov %r7, 1\nmov %r7, 2\nmov %r0, %r7\nexit")) == [0, 0, 1 << 7, 1]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.fx"
        path.write_text(Policy(random.Random(seed), size).text())
        res = compile_unjudged(path)            # compiled whatever this verifier says
    file = name.split("_")[0] + ".bpf.o"
    (prog,) = [p for p in load_object(res.files[file], file).instantiate() if p.name == name]
    assert verify(prog) < 100_000
    _the_kernel_accepts(prog)


def test_a_branch_decided_by_a_number_loaded_just_before_by_lddw_verifies():
    """Tracing the branch's operands back started at the lddw's second slot, which is no
    instruction: a verifier bug, found by policy_verdicts (seeds 1117, 1191 at size 5)."""
    prog = Program("lddw", assemble("lddw %r1, 0x100000000\njgt %r1, 3, big\nmov %r0, 0\nexit\nbig:\nmov %r0, 1\nexit"))
    verify(prog)
    assert Interpreter().run(prog, mem=bytearray(8)) == 1


def _diamonds(n: int, side: str) -> str:
    """``n`` branches on bits of the input, one after another, each running ``side`` (formatted
    with the branch's number) on one of its two paths: 2**n paths."""
    out = ["ldxdw %r6, [%r1+0]", "mov %r7, 0"]
    for i in range(n):
        out += [f"jset %r6, {1 << i}, j{i}", side.format(i=i, bit=1 << i, slot=-8 * (i + 2)), f"j{i}:"]
    return "\n".join(out)


def test_a_checkpoint_that_keeps_failing_to_cover_is_dropped():
    """As the kernel drops it (miss_cnt > hit_cnt * 3 + 3): where paths differ in what matters,
    each would otherwise be compared with all the ones before it."""
    from fabric_ext.runtime.machine import pruning
    from fabric_ext.runtime.machine.state import Frame, State
    from fabric_ext.runtime.machine.values import UNINIT, const

    def key(r1):
        regs = [UNINIT] * 11
        regs[1] = const(r1)
        return State([Frame(regs, bytes(isa.STACK_SIZE), {})]).key()
    never, once = (pruning.Checkpoint(7, key(1), 0, None, -1) for _ in range(2))
    for cp in (never, once):
        cp.branches, cp.precise_regs = 0, 1 << 1        # done; r1's value mattered
    candidates = [never, once]
    assert pruning.find_cover(candidates, key(1)) is once and once.hits == 1
    for _ in range(4):
        assert pruning.find_cover(candidates, key(2)) is None
    assert candidates == [once]           # never: four misses and no hit, dropped
    for _ in range(2):
        pruning.find_cover(candidates, key(2))
    assert candidates == [once]           # once: six misses after its hit, kept (3 * 1 + 3)
    pruning.find_cover(candidates, key(2))
    assert candidates == []


@needs_kernel
def test_the_kernel_reports_how_many_steps_its_verifier_took():
    """bench/verifier_bench.py sets our steps beside the kernel's (BPF_LOG_STATS)."""
    log = kernel.verifier_stats(assemble("mov %r0, 0\nl:\nadd %r0, 1\njlt %r0, 10, l\nexit"), "count")
    assert int(re.search(r"processed (\d+) insns", log).group(1)) > 10


def test_numbers_whose_range_decides_nothing_do_not_keep_paths_apart():
    """Each of 2**20 paths leaves a different number in r7, which only goes into a map value:
    its range decides nothing, so paths meet at every join whatever it holds."""
    from fabric_ext.runtime.machine.maps import ARRAY, Map
    src = (_diamonds(20, "or %r7, {bit}") + "\nstw [%r10-4], 0\nmov %r2, %r10\nadd %r2, -4\nlddw %r1, map 0\n"
           "call 1\njeq %r0, 0, out\nstxdw [%r0+0], %r7\nout:\nmov %r0, 0\nexit")
    prog = Program("or", assemble(src), [Map("v", ARRAY, 4, 8, 1)], ctx_size=8)
    assert verify(prog) < 1_000
    _the_kernel_accepts(prog)


def test_stack_slots_no_path_reads_do_not_keep_paths_apart():
    """Each of 2**20 paths initialises a different set of stack slots, which nothing reads."""
    prog = Program("slots", assemble(_diamonds(20, "stdw [%r10{slot}], 1") + "\nmov %r0, 0\nexit"), ctx_size=8)
    assert verify(prog) < 1_000
    _the_kernel_accepts(prog)


def test_an_interrupt_in_a_jit_helper_call_stops_the_run(monkeypatch):
    """Ctrl-C (or fabric-run's exit on SIGTERM) while native code was in a Python helper was
    printed by ctypes and swallowed: the run went on. It stops the run and is raised after."""
    from fabric_ext.runtime.machine import jit

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(jit.Hl, "call", interrupted)
    b = jit.JitBackend()
    prog = Program("p", assemble("call 7\nmov %r0, 1\nexit"))
    verify(prog)
    with pytest.raises(KeyboardInterrupt):
        b.run(b.load(prog), mem=bytearray(8))
    monkeypatch.undo()
    assert b.run(b.load(prog), mem=bytearray(8)) == 1       # the backend runs on


@needs_kernel
def test_a_failed_bpf_call_names_its_command():
    attr = ctypes.create_string_buffer(128)      # map type 0, no sizes: refused
    with pytest.raises(kernel.KernelError, match=r"bpf\(BPF_MAP_CREATE\)"):
        kernel.bpf(kernel.MAP_CREATE, attr)
