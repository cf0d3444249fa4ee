"""The eBPF core: every instruction class and edge case in tests/ebpf/*.data, run in the
reference interpreter and, where bpf(2) is permitted, in the Linux kernel as the authority."""
import pytest

from ebpf_data import CASES
from fabric_ext.runtime import isa, kernel
from fabric_ext.runtime.asm import AsmError, assemble
from fabric_ext.runtime.interp import Interpreter
from fabric_ext.runtime.program import Program, VMFault
from fabric_ext.runtime.verifier import VerifierError, verify

KERNEL_OK, KERNEL_WHY = kernel.permitted()
needs_kernel = pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)


def program(case):
    return Program(case["name"], assemble(case["asm"]))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_data_case(case):
    prog = program(case)
    mem = bytearray(case["mem"]) if "mem" in case else None
    if "error" in case:
        with pytest.raises(VerifierError) as e:
            verify(prog)
        assert case["error"] in str(e.value)
        return
    verify(prog)
    if "fault" in case:
        with pytest.raises(VMFault) as e:
            Interpreter().run(prog, mem=mem)
        assert case["fault"] in str(e.value) and "pc 0" in str(e.value)
        return
    assert Interpreter().run(prog, mem=mem if mem is not None else bytearray(8)) == case["result"]


KERNEL_CASES = [c for c in CASES if "result" in c and "helper" not in c["name"]]


@needs_kernel
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c["name"] for c in KERNEL_CASES])
def test_kernel_agrees(case):
    """The same program as BPF_PROG_TYPE_SYSCALL: same r0 (the kernel reports 32 bits)
    and the same memory, passed as the context."""
    prog = program(case)
    mem = bytearray(case.get("mem", bytes(8)))
    ours = bytearray(mem)
    r0 = Interpreter().run(Program(prog.name, prog.insns, ctx_size=len(ours)), ctx=ours)
    fd = kernel.load_program(prog.insns, prog.name)
    try:
        kr0, _ = kernel.test_run(fd, mem)
    finally:
        import os
        os.close(fd)
    assert kr0 == r0 & 0xFFFFFFFF
    assert bytes(mem) == bytes(ours)


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


def test_instruction_budget():
    prog = Program("spin", assemble("mov %r0, 0\nloop:\nadd %r0, 1\njlt %r0, 100000, loop\nexit"))
    with pytest.raises(VMFault) as e:
        Interpreter(budget=1000).run(prog)
    assert "instruction budget of 1000 exhausted" in str(e.value)


def test_fault_then_continue():
    """A faulting run raises; the same interpreter runs the next program normally."""
    vm = Interpreter()
    bad = Program("bad", assemble("ldxdw %r0, [%r1+64]\nexit"))
    with pytest.raises(VMFault):
        vm.run(bad, mem=bytearray(8))
    assert vm.run(Program("ok", assemble("mov %r0, 3\nexit"))) == 3


def test_context_write_rules_from_the_hook_catalogue():
    from fabric_ext.hooks import HOOKS
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
