"""Hostile programs: each once made the JIT touch host memory or crashed the verifier.

Every one must be rejected by our verifier (with a message that says why) and, where bpf(2)
is permitted, by the kernel's; run without a proof, every backend must stop it with a fault."""
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fabric_ext.runtime.machine import isa as I
from fabric_ext.runtime.machine import kernel
from fabric_ext.runtime.machine.asm import assemble
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.maps import ARRAY, HASH, RINGBUF, Map
from fabric_ext.runtime.machine.program import Program, VMFault
from fabric_ext.runtime.machine.verifier import VerifierError, verify

KERNEL_OK, KERNEL_WHY = kernel.permitted()

LOOKUP_KEY_0 = "stw [%r10-4], 0\nmov %r2, %r10\nadd %r2, -4\nlddw %r1, map 0\ncall 1\n"
LOOKUP = LOOKUP_KEY_0 + "jeq %r0, 0, out\n"
RESERVE = """
lddw %r1, map 0
mov %r2, 8
mov %r3, 0
call 131
jeq %r0, 0, out
mov %r6, %r0
"""
OUT = "out:\nmov %r0, 0\nexit\n"

MAP_VALUE_PLUS_UNBOUNDED = "ldxdw %r7, [%r1+0]\n" + LOOKUP + "add %r0, %r7\nldxdw %r0, [%r0+0]\nexit\n" + OUT
DIV_BY_RANGE_WITH_ZERO = ("ldxb %r2, [%r1+0]\nand %r2, 1\nmov %r7, 4096\ndiv %r7, %r2\n" + LOOKUP
                          + "mov %r5, 4096\nsub %r5, %r7\nadd %r0, %r5\nldxdw %r0, [%r0+0]\nexit\n" + OUT)
RECORD_PLUS_UNBOUNDED = "ldxdw %r7, [%r1+0]\n" + RESERVE + ("add %r0, %r7\nstdw [%r0+0], 1\n"
                        "mov %r1, %r6\nmov %r2, 0\ncall 132\n") + OUT
WRITE_AFTER_SUBMIT = RESERVE + "mov %r1, %r6\nmov %r2, 0\ncall 132\nstdw [%r6+0], 1\n" + OUT
NEVER_SUBMITTED = RESERVE + "stdw [%r6+0], 1\n" + OUT
DOUBLE_SUBMIT = RESERVE + "mov %r1, %r6\nmov %r2, 0\ncall 132\nmov %r1, %r6\nmov %r2, 0\ncall 132\n" + OUT
RETURNS_STACK_POINTER = "call local f\nldxdw %r0, [%r0+0]\nexit\nf:\nstdw [%r10-8], 1\nmov %r0, %r10\nadd %r0, -8\nexit"
SPILLS_CALLEE_STACK = ("mov %r1, %r10\nadd %r1, -8\ncall local f\nldxdw %r1, [%r10-8]\nldxdw %r0, [%r1+0]\nexit\n"
                       "f:\nstdw [%r10-8], 1\nmov %r2, %r10\nadd %r2, -8\nstxdw [%r1+0], %r2\nmov %r0, 0\nexit")

# Pruning (runtime/machine/pruning.py): the fall-through path is explored first and reaches
# `join` in a safe state; the taken one (MEM[1] = 0xff) must not be pruned there by it.
def _join(small: str, big: str, after: str) -> str:
    return ("ldxb %r7, [%r1+0]\nldxb %r6, [%r1+1]\njgt %r6, 0x7f, big\n" + small + "ja join\nbig:\n" + big
            + "join:\n" + after)


# a range added to a pointer after the join: precise at the join
RANGE_AT_A_JOIN = _join("and %r7, 7\n", "add %r7, 256\n", LOOKUP + "add %r0, %r7\nldxb %r0, [%r0+0]\nexit\n" + OUT)
# the same range, spilled before the join and filled after it: the slot is precise at the join
SPILLED_RANGE_AT_A_JOIN = _join("and %r7, 7\nstxdw [%r10-16], %r7\n", "add %r7, 256\nstxdw [%r10-16], %r7\n",
                                LOOKUP + "ldxdw %r7, [%r10-16]\nadd %r0, %r7\nldxb %r0, [%r0+0]\nexit\n" + OUT)
# a number that decides a branch after the join: 5 does not take it, 50 does
DECIDED_AT_A_JOIN = _join("mov %r7, 5\n", "mov %r7, 50\n",
                          LOOKUP + "jgt %r7, 10, far\nmov %r0, 0\nexit\nfar:\nldxb %r0, [%r0+4096]\nexit\n" + OUT)
# a slot holding a stack pointer on one path and a number from the input on the other, read
# two blocks after the join
POINTER_OR_NUMBER_IN_A_SLOT = _join("stdw [%r10-24], 0\nmov %r7, %r10\nadd %r7, -24\nstxdw [%r10-16], %r7\n",
                                    "ldxdw %r7, [%r1+0]\nstxdw [%r10-16], %r7\n",
                                    LOOKUP + "ldxdw %r1, [%r10-16]\nldxdw %r0, [%r1+0]\nexit\n" + OUT)
# a range used after a subprogram call: the marks cannot be followed across the call
RANGE_ACROSS_A_CALL = _join("and %r7, 7\n", "add %r7, 256\n",
                            "call local f\n" + LOOKUP + "add %r0, %r7\nldxb %r0, [%r0+0]\nexit\n" + OUT
                            + "f:\nmov %r0, 0\nexit\n")

# two copies of one maybe-null pointer against two pointers of two lookups: one null check
# makes both copies safe, not both pointers (a hash map: the kernel knows an array's lookup
# of a constant key in range is never null)
ONE_POINTER_OR_TWO = _join(LOOKUP_KEY_0 + "mov %r8, %r0\nmov %r9, %r0\n",
                           LOOKUP_KEY_0 + "mov %r8, %r0\n" + LOOKUP_KEY_0 + "mov %r9, %r0\n",
                           "jeq %r8, 0, out\nldxb %r0, [%r9+0]\nexit\n" + OUT)
# the range matters past a join where a second path was pruned (at `use`): what the first path's
# checkpoint needed, the pruned path's checkpoints need too, or the third (0xff) is pruned at `mid`
RANGE_PAST_A_PRUNED_PATH = ("ldxb %r7, [%r1+0]\nldxb %r6, [%r1+1]\njgt %r6, 0x7f, second\nand %r7, 7\nja use\n"
                            "second:\njgt %r6, 0xf0, third\nand %r7, 7\nja mid\nthird:\nadd %r7, 256\n"
                            "mid:\nmov %r1, 0\nja use\nuse:\n" + LOOKUP + "add %r0, %r7\nldxb %r0, [%r0+0]\nexit\n" + OUT)

# mov r1, 0x7fffff00 with off = 8: the verifier once read it as a sign extension (r1 = 0)
MOV_WITH_OFF = [I.Insn(I.ALU64 | I.MOV | I.K, dst=1, off=8, imm=0x7FFFFF00)] + assemble(
    "mov %r2, %r10\nadd %r2, %r1\nstdw [%r2-8], 1\nmov %r0, 0\nexit")
MOV32_WITH_OFF = [I.Insn(I.ALU | I.MOV | I.K, dst=1, off=8, imm=0x7FFFFF00)] + MOV_WITH_OFF[1:]


def _value_map():
    return [Map("v", ARRAY, 4, 256, 1)]


def _hash_map():
    return [Map("h", HASH, 4, 256, 8)]


def _ringbuf():
    return [Map("rb", RINGBUF, 0, 0, 4096)]


HOSTILE = {
    # name: (instructions, maps, a fragment of our verifier's message)
    "map_value_plus_unbounded": (assemble(MAP_VALUE_PLUS_UNBOUNDED), _value_map, "unbounded range"),
    "record_plus_unbounded": (assemble(RECORD_PLUS_UNBOUNDED), _ringbuf, "unbounded range"),
    "mov_with_off": (MOV_WITH_OFF, list, "reserved fields"),
    "mov32_with_off": (MOV32_WITH_OFF, list, "reserved fields"),
    "div_by_range_with_zero": (assemble(DIV_BY_RANGE_WITH_ZERO), _value_map, "outside its 256-byte value"),
    "write_after_submit": (assemble(WRITE_AFTER_SUBMIT), _ringbuf, "after it was submitted or discarded"),
    "never_submitted": (assemble(NEVER_SUBMITTED), _ringbuf, "reference leak"),
    "double_submit": (assemble(DOUBLE_SUBMIT), _ringbuf, "already submitted or discarded"),
    "returns_stack_pointer": (assemble(RETURNS_STACK_POINTER), list, "cannot return a stack pointer"),
    "spills_callee_stack": (assemble(SPILLS_CALLEE_STACK), list, "callee's stack into a caller's frame"),
    "range_at_a_join": (assemble(RANGE_AT_A_JOIN), _value_map, "outside its 256-byte value"),
    "spilled_range_at_a_join": (assemble(SPILLED_RANGE_AT_A_JOIN), _value_map, "outside its 256-byte value"),
    "decided_at_a_join": (assemble(DECIDED_AT_A_JOIN), _value_map, "outside its 256-byte value"),
    "pointer_or_number_in_a_slot": (assemble(POINTER_OR_NUMBER_IN_A_SLOT), _value_map, "read from a number"),
    "range_across_a_call": (assemble(RANGE_ACROSS_A_CALL), _value_map, "outside its 256-byte value"),
    "range_past_a_pruned_path": (assemble(RANGE_PAST_A_PRUNED_PATH), _value_map, "outside its 256-byte value"),
    "one_pointer_or_two": (assemble(ONE_POINTER_OR_TWO), _hash_map, "may be null"),
}
# the ones whose run reaches memory it must not: without a proof every backend faults
RUNNABLE = ["map_value_plus_unbounded", "record_plus_unbounded", "mov_with_off", "mov32_with_off",
            "div_by_range_with_zero", "write_after_submit", "range_at_a_join", "spilled_range_at_a_join",
            "decided_at_a_join", "pointer_or_number_in_a_slot", "range_across_a_call", "range_past_a_pruned_path"]
# the memory each bare program is given: an even first byte (a divisor of 0), a huge u64
MEM = b"\xfe" + b"\xff" * 6 + b"\x7f"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_verifier_rejects(name):
    insns, maps, why = HOSTILE[name]
    prog = Program(name, insns, maps())
    with pytest.raises(VerifierError) as e:
        verify(prog)
    assert why in str(e.value)


@pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_kernel_rejects_too(name):
    insns, maps, _ = HOSTILE[name]
    kb = kernel.KernelBackend()
    try:
        with pytest.raises(kernel.KernelError):
            kb.load(Program(name, insns, maps()))
    finally:
        kb.close()


@pytest.mark.parametrize("name", RUNNABLE)
def test_unverified_runs_fault_on_every_backend(name):
    """What the verifier now rejects could only have run on its false proof: with no proof
    at all, each backend checks every access.  The interpreter's regions lie far apart, so it
    faults; the JIT's are real buffers, so a stray access may land in another of the run's own
    regions (VM memory) rather than fault — either way the process lives on."""
    from fabric_ext.runtime.machine.jit import JitBackend
    insns, maps, _ = HOSTILE[name]
    with pytest.raises(VMFault):
        Interpreter().run(Program(name, insns, maps()), mem=bytearray(MEM))
    vm = JitBackend()
    try:
        vm.run(vm.load(Program(name, insns, maps())), mem=bytearray(MEM))
    except VMFault as e:
        assert "out-of-bounds" in str(e) or "not a reserved ringbuf record" in str(e)


def test_jit_bounds_check_cannot_wrap():
    """addr + size overflowed for an address near 2^64, passing for any region."""
    from fabric_ext.runtime.machine.jit import JitBackend
    vm = JitBackend()
    for addr in (0xFFFFFFFFFFFFFFFC, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFF8):
        prog = Program("wrap", assemble(f"lddw %r1, {addr:#x}\nldxw %r0, [%r1+0]\nstw [%r1+0], 1\nexit"))
        with pytest.raises(VMFault, match="out-of-bounds"):
            vm.run(vm.load(prog), mem=bytearray(8))


def test_a_pointer_into_run_time_memory_is_checked_against_that_memory_only():
    """The verifier knows the pointer below derives from the program's memory (r1 plus an
    offset it cannot bound), so the JIT checks it against that memory (and the context, which a
    bare program's memory may come as): an offset that lands it in a map's values faults.
    With --jit-checks all the proof is not used and every region of the program is allowed."""
    import ctypes
    import mmap

    from fabric_ext.runtime.machine.jit import JitBackend
    # both mapped pages apart from the heap, so that they lie within the verifier's 512 MiB
    table = Map("t", ARRAY, 4, 8, 1, shared=True)
    table.update(bytes(4), (0x5EC2E7).to_bytes(8, "little"))
    mem = mmap.mmap(-1, 1 << 20)          # mapped next to the table's pages
    distance = table.values.ctypes.data - ctypes.addressof((ctypes.c_char * len(mem)).from_buffer(mem))
    if abs(distance) >= 1 << 29:
        pytest.skip("the map's values lie too far from the memory for a bounded offset")
    mem[:8] = abs(distance).to_bytes(8, "little")
    move = "add" if distance > 0 else "sub"
    prog = Program("reach", assemble(f"ldxdw %r2, [%r1+0]\nand %r2, 0x1fffffff\n{move} %r1, %r2\n"
                                     "ldxdw %r0, [%r1+0]\nexit"), [table])
    verify(prog)
    assert prog.proof[3] == {"mem"}
    with pytest.raises(VMFault, match="out-of-bounds"):
        _run(JitBackend(), prog, mem)
    assert _run(JitBackend(checks="all"), prog, mem) == 0x5EC2E7
    table.close()


def _run(vm, prog, mem):
    return vm.run(vm.load(prog), mem=mem)


@pytest.mark.parametrize("bad", [
    I.Insn(I.ALU64 | I.NEG, dst=0, imm=1),
    I.Insn(I.ALU64 | I.ADD | I.X, dst=0, src=1, imm=5),
    I.Insn(I.ALU64 | I.ADD | I.K, dst=0, src=1, imm=5),
    I.Insn(I.ALU64 | I.ADD | I.K, dst=0, off=1, imm=5),
    I.Insn(I.ALU | I.MOV | I.X, dst=0, src=1, off=32),
    I.Insn(I.LDX | I.MEM | I.W, dst=0, src=10, off=-8, imm=1),
    I.Insn(I.ST | I.MEM | I.W, dst=10, src=1, off=-8, imm=1),
    I.Insn(I.JMP | I.JEQ | I.K, dst=0, src=1, off=0, imm=0),
    I.Insn(I.JMP | I.JA, dst=1, off=0),
    I.Insn(I.JMP | I.CALL, dst=1, imm=5),
])
def test_reserved_fields_are_rejected(bad):
    prog = Program("r", [I.Insn(I.ALU64 | I.MOV | I.K, dst=0, imm=0), I.Insn(I.ALU64 | I.MOV | I.K, dst=1),
                         I.Insn(I.STX | I.MEM | I.DW, dst=10, src=0, off=-8), bad, I.Insn(I.JMP | I.EXIT)])
    with pytest.raises(VerifierError, match="reserved fields"):
        verify(prog)


def test_records_released_on_every_path_are_accepted():
    src = RESERVE + "stdw [%r6+0], 7\nldxdw %r2, [%r1+0]\njeq %r2, 0, drop\nmov %r1, %r6\nmov %r2, 0\ncall 132\nja out\n" \
          "drop:\nmov %r1, %r6\nmov %r2, 0\ncall 133\n" + OUT
    src = "mov %r9, %r1\n" + src.replace("ldxdw %r2, [%r1+0]", "ldxdw %r2, [%r9+0]")
    prog = Program("rb", assemble(src), _ringbuf())
    verify(prog)
    for mem, records in ((b"\x01" + bytes(7), 1), (bytes(8), 0)):
        rb = _ringbuf()
        Interpreter().run(Program("rb", prog.insns, rb), mem=bytearray(mem))
        assert len(rb[0].records) == records


def test_a_verifier_defect_rejects_instead_of_raising(monkeypatch):
    from fabric_ext.runtime.machine import verifier
    def broken(*args):
        raise IndexError("list index out of range")
    monkeypatch.setattr(verifier.Verifier, "load", broken)
    with pytest.raises(VerifierError, match="verifier bug"):
        verify(Program("p", assemble("ldxdw %r0, [%r10-8]\nexit")))


@pytest.fixture
def unsound_map_bounds(monkeypatch):
    """A verifier with a defect: its bounds check on map values knocked out."""
    from fabric_ext.runtime.machine import verifier
    real = verifier.Verifier._check_access

    def no_map_bounds(self, pc, ptr, off, size, write):
        if ptr.kind != "map_value":
            real(self, pc, ptr, off, size, write)
    monkeypatch.setattr(verifier.Verifier, "_check_access", no_map_bounds)


def test_proof_checking_finds_a_verifier_defect(unsound_map_bounds):
    """With the map-value bounds check knocked out of the verifier, the hostile program is
    'proven'; the proof-checking interpreter reports the defect instead of a plain fault."""
    from fabric_ext.runtime.machine.program import ProofViolation
    prog = Program("p", assemble(DIV_BY_RANGE_WITH_ZERO), _value_map())
    verify(prog)
    with pytest.raises(ProofViolation, match="verifier bug: the access was proven to stay in map_value"):
        Interpreter(check_proofs=True).run(prog, mem=bytearray(MEM))
    with pytest.raises(VMFault) as e:
        Interpreter(check_proofs=False).run(prog, mem=bytearray(MEM))
    assert not isinstance(e.value, ProofViolation)


def test_division_ranges_keep_zero():
    """x / y with y possibly 0 may be 0 (RFC 9669): a read at such a derived offset inside the
    value is accepted (the one past it is not, above), and runs clean under proof checking."""
    prog = Program("ok", assemble("ldxb %r2, [%r1+0]\nand %r2, 1\nmov %r7, 248\ndiv %r7, %r2\n" + LOOKUP
                                  + "add %r0, %r7\nldxdw %r0, [%r0+0]\nexit\n" + OUT), _value_map())
    verify(prog)
    assert Interpreter(check_proofs=True).run(prog, mem=bytearray(MEM)) == 0


def test_jit_checks_all_stops_what_a_wrong_proof_lets_through(unsound_map_bounds, monkeypatch):
    """Defence in depth: with checks=all the JIT keeps run-time checks on proven accesses, so
    even a verifier defect (simulated here) ends in a fault, not in host memory."""
    from fabric_ext.runtime.machine.jit import JitBackend
    prog = Program("p", assemble(DIV_BY_RANGE_WITH_ZERO), _value_map())
    verify(prog)
    assert prog.proof
    vm = JitBackend(checks="all")
    with pytest.raises(VMFault, match="out-of-bounds"):
        vm.run(vm.load(prog), mem=bytearray(MEM))
    assert vm.load_stats()["checks"] == "all"
    monkeypatch.setenv("FABRIC_EXT_JIT_CHECKS", "all")
    assert JitBackend().checks == "all"
    monkeypatch.setenv("FABRIC_EXT_JIT_CHECKS", "some")
    with pytest.raises(ValueError, match="unproven, all"):
        JitBackend()


def test_proof_checking_finds_an_access_in_memory_of_another_kind():
    """A proven access that lands in memory, but not the kind it was proven in, is a defect too
    (the JIT would run it unchecked wherever it pointed)."""
    from fabric_ext.runtime.machine.program import ProofViolation
    prog = Program("p", assemble("stdw [%r10-8], 1\nldxdw %r0, [%r10-8]\nexit"))
    verify(prog)
    assert Interpreter(check_proofs=True).run(prog) == 1
    prog.proof = {1: frozenset({"map_value"})}          # a wrong proof for the load
    with pytest.raises(ProofViolation, match="proven to stay in map_value, but it reached stack frame 0"):
        Interpreter(check_proofs=True).run(prog)
    assert Interpreter(check_proofs=False).run(prog) == 1


def test_lddw_second_half_must_be_empty():
    from fabric_ext.runtime.machine.isa import DecodeError, decode
    good = bytes.fromhex("18010000050000000000000000000000")
    assert decode(good)[0].imm == 5
    for bad in ("18010000050000000001000000000000", "18010000050000000000010000000000"):
        with pytest.raises(DecodeError, match="bad second half"):
            decode(bytes.fromhex(bad))


def test_jit_counts_a_second_outstanding_record_as_dropped():
    """The JIT's compiled checks know one reserved record: a second reserve while one is held
    returns null, and the ring counts it as a drop rather than losing it in silence."""
    from fabric_ext.runtime.machine.jit import JitBackend
    src = (RESERVE + "lddw %r1, map 0\nmov %r2, 8\nmov %r3, 0\ncall 131\nmov %r7, %r0\n"
           "jeq %r7, 0, one\nmov %r1, %r7\nmov %r2, 0\ncall 133\none:\n"
           "mov %r1, %r6\nmov %r2, 0\ncall 132\n" + OUT)
    rb = _ringbuf()
    prog = Program("two", assemble(src), rb)
    verify(prog)
    vm = JitBackend()
    vm.run(vm.load(prog), mem=bytearray(8))
    assert len(rb[0].records) == 1 and rb[0].dropped == 1


# ---- widening at loop heads -------------------------------------------------------------------
PRIME = """
    mov %r0, 0
    mov %r1, 2
outer:
    mov %r2, 2
inner:
    mov %r3, %r2
    mul %r3, %r2
    jgt %r3, %r1, prime
    mov %r4, %r1
    mod %r4, %r2
    jeq %r4, 0, next
    add %r2, 1
    ja inner
prime:
    add %r0, 1
next:
    add %r1, 1
    jlt %r1, {n}, outer
    exit
"""


def test_a_loop_past_the_exploration_budget_is_proven_by_widening_at_a_cost_that_does_not_grow():
    """The prime loop with argument 10007 (which the kernel accepts within its 1M limit) ran out
    the 100,000-instruction exploration; widened at its heads it is proven in a few hundred
    steps, the same for 10007 and 1,000,000, and it still computes what it computed."""
    steps = {}
    for n in (10007, 1_000_000):
        prog = Program("prime", assemble(PRIME.format(n=n)))
        steps[n] = verify(prog)
    assert steps[10007] == steps[1_000_000] < 1000
    assert Interpreter().run(Program("p", assemble(PRIME.format(n=400))), mem=bytearray(8)) == 78


@pytest.mark.parametrize("backend", ["interp", "jit"])
def test_a_loop_bounded_by_its_input_ends_at_the_run_time_budget(backend):
    """Accepted by widening, not bounded by the verifier: the instruction budget ends it."""
    from fabric_ext.runtime.machine.jit import JitBackend
    prog = Program("spin", assemble("ldxdw %r2, [%r1+0]\nmov %r0, 0\nloop:\nadd %r0, 1\njlt %r0, %r2, loop\nexit"))
    verify(prog)
    vm = Interpreter(budget=10_000) if backend == "interp" else JitBackend(budget=10_000)
    h = vm.load(prog)
    assert vm.run(h, mem=bytearray((100).to_bytes(8, "little"))) == 100
    with pytest.raises(VMFault, match="budget"):
        vm.run(h, mem=bytearray((10**9).to_bytes(8, "little")))


@pytest.mark.parametrize("backend", ["interp", "jit"])
@pytest.mark.parametrize("tail", [0, 60])
def test_the_budget_holds_for_the_instructions_after_the_last_loop_head(backend, tail):
    """The JIT compares the count with the budget where a backward jump lands and at exit, not
    in every block: a run whose loop stays within the budget but whose straight tail after
    it passes the budget still faults, as on the interpreter; one within it returns."""
    from fabric_ext.runtime.machine.jit import JitBackend
    src = "ldxdw %r2, [%r1+0]\nmov %r0, 0\nloop:\nadd %r0, 1\njlt %r0, %r2, loop\n" + "add %r0, 1\n" * tail + "exit"
    prog = Program("tail", assemble(src))
    verify(prog)
    vm = Interpreter(budget=250) if backend == "interp" else JitBackend(budget=250)
    h = vm.load(prog)
    mem = bytearray((100).to_bytes(8, "little"))      # 2 + 2 x 100 + tail + 1 instructions
    if tail:
        with pytest.raises(VMFault, match="budget"):
            vm.run(h, mem=mem)
    else:
        assert vm.run(h, mem=mem) == 100


@pytest.mark.parametrize("src", [
    # the stack slot written moves down one every 1,024 iterations: out of the frame after
    # 65,536, long after the exploration's budget; widened, the offset is unbounded
    "mov %r2, 0\nloop:\nmov %r4, %r2\nrsh %r4, 10\nlsh %r4, 3\nmov %r3, %r10\nsub %r3, %r4\n"
    "stdw [%r3-8], 1\nadd %r2, 1\njlt %r2, 100000, loop\nmov %r0, 0\nexit",
    # a pointer into an 8-byte map value moves one byte per outer iteration, after an inner
    # loop that spends the budget; widened, its offset runs past the value
    "mov %r6, 0\nstxw [%r10-4], %r6\nlddw %r1, 0\nmov %r2, %r10\nadd %r2, -4\ncall 1\njeq %r0, 0, out\n"
    "mov %r7, 0\nouter:\nmov %r2, 0\ninner:\nadd %r2, 1\njlt %r2, 30000, inner\nldxb %r3, [%r0+0]\n"
    "add %r0, 1\nadd %r7, 1\njlt %r7, 100, outer\nout:\nmov %r0, 0\nexit",
])
def test_widening_never_accepts_an_access_the_loop_could_make_out_of_bounds(src):
    """Both loops leave their memory only after the first exploration's 100,000 instructions,
    so with no more budget than that only the widened pass sees it; it must reject them."""
    insns = assemble(src)
    insns = [I.Insn(i.opcode, i.dst, I.PSEUDO_MAP_FD, i.off, 0) if i.is_lddw else i for i in insns]
    prog = Program("walk", insns, [Map("m", ARRAY, 4, 8, 1)])
    with pytest.raises(VerifierError, match="widening"):
        verify(prog, max_insns=100_000)


SUM_MAP_VALUE = """mov %r6, 0
mov %r7, 0
stxw [%r10-4], %r6
lddw %r1, 0
mov %r2, %r10
add %r2, -4
call 1
jeq %r0, 0, out
mov %r3, 0
loop:
mov %r4, %r0
add %r4, %r3
ldxdw %r1, [%r4+0]
add %r7, %r1
add %r3, 8
jlt %r3, 262144, loop
out:
mov %r0, %r7
exit"""


def _sum_loop(size: int, bound_in_register: bool = False) -> tuple[Program, Map]:
    src = SUM_MAP_VALUE.replace("262144", str(size))
    if bound_in_register:      # the same loop bounded by a register holding the size
        src = src.replace("mov %r3, 0\n", f"mov %r3, 0\nmov %r5, {size}\n").replace(f"jlt %r3, {size},", "jlt %r3, %r5,")
    insns = [I.Insn(i.opcode, i.dst, I.PSEUDO_MAP_FD, i.off, 0) if i.is_lddw else i for i in assemble(src)]
    table = Map("m", ARRAY, 4, size, 1)
    table.update(bytes(4), bytes(range(256)) * (size // 256))
    return Program("sum", insns, [table]), table


def test_widening_proves_a_loop_over_a_map_value_whatever_its_trip_count():
    """Summing a 256 KiB (or 512 KiB) map value 8 bytes a step: the widened index stops at the
    branch's bound and keeps its known low zero bits, so it is a multiple of 8 up to size - 8
    and the read stays in the value.  The widened pass takes the same steps for either size
    (after the first pass's 100,000), and the access runs unchecked."""
    from fabric_ext.runtime.machine.jit import JitBackend
    steps = []
    for size in (262144, 524288):
        prog, table = _sum_loop(size)
        steps.append(verify(prog))
        assert prog.proof[12] == {"map_value"}
        expected = sum(table.values[:size].view("<u8").tolist()) & I.MASK64
        assert Interpreter().run(prog, mem=bytearray(8)) == expected
        jit = JitBackend()
        assert jit.run(jit.load(prog), mem=bytearray(8)) == expected
    assert steps[0] == steps[1] < 1000
    if kernel.permitted()[0]:
        kb = kernel.KernelBackend()
        try:
            kb.load(_sum_loop(262144)[0])                   # the kernel accepts it too
        finally:
            kb.close()


def test_a_loop_widening_cannot_prove_is_explored_up_to_the_kernels_budget():
    """Bounded by a register, not a constant, the widened index has no bound to stop at (the
    access would be unbounded), so the loop is explored iteration by iteration past the first
    pass, within the kernel's 1M instructions, as the kernel does."""
    prog, table = _sum_loop(262144, bound_in_register=True)
    assert 100_000 < verify(prog) < 1_000_000
    assert prog.proof[13] == {"map_value"}
    assert Interpreter().run(prog, mem=bytearray(8)) == sum(table.values[:262144].view("<u8").tolist()) & I.MASK64


@settings(max_examples=400, deadline=None)
@given(op=st.sampled_from(["add", "sub", "mul", "lsh", "rsh", "and", "or", "xor", "arsh", "div", "mod"]),
       is64=st.booleans(), ranges=st.lists(st.tuples(st.integers(0, I.MASK64), st.integers(0, 1 << 20),
                                                     st.integers(0, 12)), min_size=2, max_size=2),
       picks=st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20)))
def test_a_scalar_operation_holds_every_value_it_can_give(op, is64, ranges, picks):
    """The verifier's result of an ALU operation on two scalar ranges (each a multiple of 2**k,
    from `values.scalar`) holds the concrete result of every operand pair drawn from them,
    range and known low zero bits alike (the JIT drops checks on what they prove)."""
    from fabric_ext.runtime.machine.semantics import alu
    from fabric_ext.runtime.machine.values import align_of, scalar
    from fabric_ext.runtime.machine.verifier import Verifier
    operands = []
    for (lo, span, k), pick in zip(ranges, picks):
        v = scalar(lo, min(lo + span * (1 << k), I.MASK64), k)
        assume(v is not None)
        step = 1 << align_of(v) if not v.constant else 1
        x = min(v.lo + pick * step, v.hi) // step * step if step > 1 else min(v.lo + pick, v.hi)
        assume(v.lo <= x <= v.hi)
        operands.append((v, x))
    (d, x), (s, y) = operands
    cls = I.ALU64 if is64 else I.ALU
    ins = I.Insn(cls | I.X | getattr(I, op.upper()), dst=1, src=2)
    abstract = Verifier(Program("p", [I.Insn(I.ALU64 | I.MOV, 0), I.Insn(I.JMP | I.EXIT)])).scalar_op(ins, d, s, is64)
    regs = [0] * 11
    regs[1], regs[2] = x, y
    concrete = alu(ins, cls, regs)
    assert abstract.lo <= concrete <= abstract.hi, (abstract, concrete)
    assert concrete % (1 << align_of(abstract)) == 0


@settings(max_examples=300, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, I.MASK64), st.integers(0, 1 << 16), st.integers(0, 10)),
                       min_size=2, max_size=2),
       constants=st.lists(st.integers(0, I.MASK64), max_size=4))
def test_a_widened_scalar_holds_both_states_values_and_covers_them(ranges, constants):
    """Widening a loop head's scalar (`widening._widen_value`, stopping at the branches'
    constants) gives a range that holds every value of the old and the new state, each a
    multiple of its known 2**k, and that `covers` both."""
    from fabric_ext.runtime.machine.values import align_of, scalar
    from fabric_ext.runtime.machine.widening import _covers_value, _widen_value, thresholds
    a, b = (scalar(lo, min(lo + span * (1 << k), I.MASK64), k) for lo, span, k in ranges)
    assume(a is not None and b is not None)
    w = _widen_value(a, b, thresholds(constants))
    for v in (a, b):
        assert _covers_value(w, v)
        for x in (v.lo, v.hi):
            assert w.lo <= x <= w.hi and x % (1 << align_of(w)) == 0
