"""Differential tests of the three backends: hypothesis generates straight-line and branching
programs with stack, context, map and atomic traffic; the reference interpreter, the JIT and
the Linux kernel (BPF_PROG_TYPE_SYSCALL under BPF_PROG_TEST_RUN, where bpf(2) is permitted)
must leave the same r0, the same context and the same map contents.  The JIT runs each program
twice: unverified, with a run-time check on every access, and verified, with none where the
verifier proved the access."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric_ext.runtime.machine import isa as I
from fabric_ext.runtime.machine import kernel
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.program import Program
from fabric_ext.runtime.machine.verifier import verify

OK, WHY = kernel.permitted()
CTX = 64  # bytes of memory the program gets as its context; r0 is stored at offset 56

regs = st.integers(0, 5)
imm = st.integers(-(2**31), 2**31 - 1)
ALU = [I.ADD, I.SUB, I.MUL, I.DIV, I.OR, I.AND, I.LSH, I.RSH, I.MOD, I.XOR, I.MOV, I.ARSH]


@st.composite
def alu(draw):
    cls = draw(st.sampled_from([I.ALU, I.ALU64]))
    op = draw(st.sampled_from(ALU + [I.NEG]))
    dst = draw(regs)
    if op == I.NEG:
        return [I.Insn(cls | I.NEG, dst=dst)]
    if draw(st.booleans()):
        off = 1 if op in (I.DIV, I.MOD) and draw(st.booleans()) else 0
        if op == I.MOV and draw(st.booleans()):
            off = draw(st.sampled_from([8, 16] + ([32] if cls == I.ALU64 else [])))
        return [I.Insn(cls | op | I.X, dst=dst, src=draw(regs), off=off)]
    k = draw(imm)
    if op in (I.LSH, I.RSH, I.ARSH):
        k = draw(st.integers(0, 31 if cls == I.ALU else 63))
    if op in (I.DIV, I.MOD) and k == 0:
        k = 3
    off = 1 if op in (I.DIV, I.MOD) and draw(st.booleans()) else 0
    return [I.Insn(cls | op | I.K, dst=dst, imm=k, off=off)]


@st.composite
def mem(draw):
    size = draw(st.sampled_from([I.B, I.H, I.W, I.DW]))
    n = I.SIZE_BYTES[size]
    off = draw(st.integers(0, (56 - n) // n)) * n
    kind = draw(st.sampled_from(["ld", "ldsx", "st", "stx", "atomic", "stack"]))
    if kind == "ld":
        return [I.Insn(I.LDX | I.MEM | size, dst=draw(regs), src=9, off=off)]
    if kind == "ldsx" and size != I.DW:
        return [I.Insn(I.LDX | I.MEMSX | size, dst=draw(regs), src=9, off=off)]
    if kind == "st":
        return [I.Insn(I.ST | I.MEM | size, dst=9, off=off, imm=draw(imm))]
    if kind == "atomic" and n >= 4:  # atomics act on the stack (the kernel refuses them on ctx)
        op = draw(st.sampled_from([I.ADD, I.OR, I.AND, I.XOR, I.ADD | I.FETCH, I.XOR | I.FETCH, I.XCHG]))
        slot = -8 * draw(st.integers(1, 4))
        return [I.Insn(I.STX | I.MEM | I.DW, dst=10, src=draw(regs), off=slot),
                I.Insn(I.STX | I.ATOMIC | size, dst=10, src=draw(st.integers(1, 5)), off=slot, imm=op),
                I.Insn(I.LDX | I.MEM | I.DW, dst=draw(regs), src=10, off=slot)]
    if kind == "stack":
        slot = -8 * draw(st.integers(1, 4))
        return [I.Insn(I.STX | I.MEM | I.DW, dst=10, src=draw(regs), off=slot),
                I.Insn(I.LDX | I.MEM | I.DW, dst=draw(regs), src=10, off=slot)]
    return [I.Insn(I.STX | I.MEM | size, dst=9, src=draw(regs), off=off)]


def _segment(draw):
    body = []
    for _ in range(draw(st.integers(1, 10))):
        item = draw(st.one_of(alu(), mem(), st.just("jump")))
        body.extend([item] if item == "jump" else item)
    out = []
    for i, ins in enumerate(body):
        if ins == "jump":  # a forward conditional jump that stays inside this segment
            cls = draw(st.sampled_from([I.JMP, I.JMP32]))
            op = draw(st.sampled_from([I.JEQ, I.JGT, I.JGE, I.JSET, I.JNE, I.JSGT, I.JSGE, I.JLT, I.JLE,
                                       I.JSLT, I.JSLE]))
            left = sum(1 for x in body[i + 1:] if x != "jump") + sum(1 for x in body[i + 1:] if x == "jump")
            off = min(draw(st.integers(0, 3)), left)
            if draw(st.booleans()):
                out.append(I.Insn(cls | op | I.X, dst=draw(regs), src=draw(regs), off=off))
            else:
                out.append(I.Insn(cls | op | I.K, dst=draw(regs), imm=draw(imm), off=off))
        else:
            out.append(ins)
    return out


def _map_block(draw):
    """Look a key up in map 0 (array) or 1 (hash); add or store a register's value; re-initialise r1-r5."""
    which = draw(st.integers(0, 1))
    key = draw(st.integers(0, 5))
    out = [I.Insn(I.ALU64 | I.MOV | I.X, dst=6, src=draw(regs)),
           I.Insn(I.ST | I.MEM | I.W, dst=10, off=-40, imm=key),
           I.Insn(I.LD | I.IMM | I.DW, dst=1, src=I.PSEUDO_MAP_FD, imm=which),
           I.Insn(I.ALU64 | I.MOV | I.X, dst=2, src=10), I.Insn(I.ALU64 | I.ADD | I.K, dst=2, imm=-40)]
    if draw(st.booleans()):   # update with the register as the value
        out += [I.Insn(I.STX | I.MEM | I.DW, dst=10, src=6, off=-48),
                I.Insn(I.ALU64 | I.MOV | I.X, dst=3, src=10), I.Insn(I.ALU64 | I.ADD | I.K, dst=3, imm=-48),
                I.Insn(I.ALU64 | I.MOV | I.K, dst=4, imm=0), I.Insn(I.JMP | I.CALL, imm=2)]
    else:                     # lookup, null check, atomic add into the value
        out += [I.Insn(I.JMP | I.CALL, imm=1), I.Insn(I.JMP | I.JEQ | I.K, dst=0, imm=0, off=1),
                I.Insn(I.STX | I.ATOMIC | I.DW, dst=0, src=6, off=0, imm=I.ADD)]
    out.append(I.Insn(I.ALU64 | I.MOV | I.X, dst=0, src=6))
    out += [I.Insn(I.ALU64 | I.MOV | I.K, dst=r, imm=draw(imm)) for r in range(1, 6)]
    return out


@st.composite
def programs(draw):
    out = [I.Insn(I.ALU64 | I.MOV | I.X, dst=9, src=1)]
    out += [I.Insn(I.ST | I.MEM | I.DW, dst=10, off=-8 * k, imm=draw(imm)) for k in range(1, 5)]
    out += [I.Insn(I.ALU64 | I.MOV | I.K, dst=r, imm=draw(imm)) for r in range(6)]
    for _ in range(draw(st.integers(1, 4))):
        out += _segment(draw)
        if draw(st.booleans()):
            out += _map_block(draw)
    out += [I.Insn(I.STX | I.MEM | I.DW, dst=9, src=0, off=56), I.Insn(I.JMP | I.EXIT)]
    return out


def _maps():
    from fabric_ext.runtime.machine.maps import ARRAY, HASH, Map
    return [Map("arr", ARRAY, 4, 8, 4), Map("hsh", HASH, 4, 8, 8)]


def _run(backend, insns, data, verified=False):
    maps = _maps()
    prog = Program("diff", insns, maps, ctx_size=CTX)
    if verified:
        verify(prog)    # the JIT then leaves out the checks the verifier proved
    ctx = bytearray(data)
    r0 = backend.run(backend.load(prog), ctx)
    if hasattr(backend, "sync"):
        backend.sync()
    return r0, bytes(ctx), [m.dump() for m in maps]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.binary(min_size=CTX, max_size=CTX))
def test_backends_agree(insns, data):
    from fabric_ext.runtime.machine.jit import JitBackend
    verify(Program("diff", insns, _maps(), ctx_size=CTX))
    want = _run(Interpreter(), insns, data)
    assert _run(JitBackend(), insns, data) == want, I.disasm(insns)
    assert _run(JitBackend(), insns, data, verified=True) == want, I.disasm(insns)
    if OK:
        kb = kernel.KernelBackend()
        try:
            r0, ctx, maps = _run(kb, insns, data)
        finally:
            kb.close()
        assert (r0, ctx, maps) == want, I.disasm(insns)


# A bare program's memory is sized at run time: where the verifier proved how far each access
# reaches, the JIT runs a version without checks when the memory is at least that long, and the
# checked version otherwise.  Both must agree with the interpreter on every size around the bound.
GIVEN_MEMORY = """
    mov %r0, 0
    mov %r3, 0
loop:
    mov %r4, %r1
    add %r4, %r3
    ldxdw %r5, [%r4+0]
    add %r0, %r5
    stxdw [%r4+0], %r0
    add %r3, 8
    jlt %r3, 256, loop
    ldxw %r5, [%r1+300]
    add %r0, %r5
    exit
"""


@settings(max_examples=60, deadline=None)
@given(size=st.one_of(st.integers(0, 320), st.sampled_from([255, 256, 303, 304, 305])),
       seed=st.integers(0, 2**32 - 1))
def test_given_memory_sized_around_its_proven_reach(size, seed):
    import random

    from fabric_ext.runtime.machine.asm import assemble
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.machine.program import VMFault
    prog = Program("given", assemble(GIVEN_MEMORY))
    verify(prog)
    assert prog.mem_extent and max(prog.mem_extent.values()) == 304
    data = bytearray(random.Random(seed).randbytes(size))
    outcome = []
    for vm in (Interpreter(), JitBackend()):
        mem = bytearray(data)
        try:
            outcome.append((vm.run(vm.load(prog), mem=mem), bytes(mem)))
        except VMFault as e:
            outcome.append(("fault", e.pc))
    assert outcome[0] == outcome[1]
    assert (outcome[0][0] == "fault") == (size < 304)


def test_the_checked_code_for_short_memory_is_compiled_only_when_a_short_run_comes():
    """The JIT compiles a program whose proven accesses reach into its given memory once,
    for runs with all of it; a run (or a batch's rows) with less takes code that checks those
    accesses, made when the first such run comes, and agrees with the interpreter."""
    import numpy as np

    from fabric_ext.runtime.machine.asm import assemble
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.machine.program import VMFault
    prog = Program("given", assemble(GIVEN_MEMORY))
    verify(prog)
    jb = JitBackend()
    c = jb.load(prog)
    whole = bytearray(range(256)) * 2
    want = Interpreter().run(Interpreter().load(prog), mem=bytearray(whole))
    assert jb.run(c, mem=bytearray(whole)) == want
    made = jb.load_stats()["compiled"] + jb.load_stats()["from_cache"] + jb.load_stats()["in_process"]
    assert made == 1
    rows = np.zeros((3, 200), dtype=np.uint8)
    with pytest.raises(VMFault) as short:
        jb.run_batch(c, rows)
    assert "out-of-bounds" in str(short.value) and short.value.row == 0
    st = jb.load_stats()
    assert st["compiled"] + st["from_cache"] + st["in_process"] == 2


def test_the_code_compiled_with_the_proof_faults_rather_than_read_past_short_memory():
    """Defence in depth: were a short run ever sent to the code compiled for all the given
    memory, its guard faults before any unchecked access."""
    from fabric_ext.runtime.machine.asm import assemble
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.machine.program import VMFault
    prog = Program("given", assemble(GIVEN_MEMORY))
    verify(prog)
    jb = JitBackend()
    c = jb.load(prog)
    c.min_given = 0          # as if the backend did not tell a short run
    with pytest.raises(VMFault, match="16 bytes of given memory, less than the 304"):
        jb.run(c, mem=bytearray(16))


@st.composite
def map_ops(draw):
    """A program of hash-map operations on keys 0-5 (more than the map holds) of a drawn key and
    value size (partial 8-byte words of both included), updates with every flag (an invalid one
    too), whose return codes and values found it sums into r0: (instructions, key size, value size)."""
    ks, vs = draw(st.sampled_from([4, 6, 12, 16])), draw(st.sampled_from([8, 11, 16]))
    key_at, value_at = -64, -32

    def fill(at, size, first, seed):
        """``size`` bytes at r10 + at: a word ``first``, then bytes from ``seed``."""
        return [I.Insn(I.ST | I.MEM | I.W, dst=10, off=at, imm=first)] + \
            [I.Insn(I.ST | I.MEM | I.B, dst=10, off=at + j, imm=(seed * 7 + j) & 0x7F) for j in range(4, size)]
    out = [I.Insn(I.ALU64 | I.MOV | I.K, dst=7, imm=0)]
    for _ in range(draw(st.integers(1, 14))):
        op = draw(st.sampled_from(["update", "update", "lookup", "delete"]))
        k = draw(st.integers(0, 5))
        out += fill(key_at, ks, k, k) + [
            I.Insn(I.LD | I.IMM | I.DW, dst=1, src=I.PSEUDO_MAP_FD, imm=0),
            I.Insn(I.ALU64 | I.MOV | I.X, dst=2, src=10), I.Insn(I.ALU64 | I.ADD | I.K, dst=2, imm=key_at)]
        if op == "update":
            out += fill(value_at, vs, draw(imm), draw(st.integers(0, 99))) + [
                I.Insn(I.ALU64 | I.MOV | I.X, dst=3, src=10), I.Insn(I.ALU64 | I.ADD | I.K, dst=3, imm=value_at),
                I.Insn(I.ALU64 | I.MOV | I.K, dst=4, imm=draw(st.integers(0, 3))), I.Insn(I.JMP | I.CALL, imm=2)]
        elif op == "lookup":      # the value found (its first 8 bytes), or 0
            out += [I.Insn(I.JMP | I.CALL, imm=1), I.Insn(I.JMP | I.JEQ | I.K, dst=0, imm=0, off=1),
                    I.Insn(I.LDX | I.MEM | I.DW, dst=0, src=0, off=0)]
        else:
            out += [I.Insn(I.JMP | I.CALL, imm=3)]
        out += [I.Insn(I.ALU64 | I.MUL | I.K, dst=7, imm=31), I.Insn(I.ALU64 | I.ADD | I.X, dst=7, src=0)]
    return out + [I.Insn(I.ALU64 | I.MOV | I.X, dst=0, src=7), I.Insn(I.JMP | I.EXIT)], ks, vs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(map_ops(), st.sampled_from(["hash", "lru_hash"]), st.integers(1, 8))
def test_hash_map_updates_agree(ops, kind, entries):
    """The JIT's own hash update (`native_lib`: a key the map holds, a new key where there is
    room) and what it leaves to maps.py (a full map, an LRU map's evictions, flags the kernel
    refuses): return codes, values, the maps' contents (which entries an LRU map keeps, their
    stamps) and the refusals counted are the interpreter's, over two runs."""
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.machine.maps import HASH, LRU_HASH, Map
    insns, ks, vs = ops

    def run(backend, verified):
        maps = [Map("m", HASH if kind == "hash" else LRU_HASH, ks, vs, entries)]
        prog = Program("ops", insns, maps, ctx_size=CTX)
        if verified:
            verify(prog)
        handle = backend.load(prog)
        m = maps[0]
        return ([backend.run(handle, bytearray(CTX)) for _ in range(2)], m.dump(), bytes(m.stamp), bytes(m.state),
                m.count, m.full)
    want = run(Interpreter(), False)
    assert run(JitBackend(), False) == want, I.disasm(insns)
    assert run(JitBackend(), True) == want, I.disasm(insns)


def test_the_jit_refuses_a_program_larger_than_it_compiles_and_the_interpreter_runs_it():
    """LLVM's time and memory grow faster than a program (200,000 branchy instructions: 19 s
    and 0.9 GB): past `MAX_JIT_SLOTS` the JIT says so and names the backend that runs it."""
    from fabric_ext.runtime.machine.asm import assemble
    from fabric_ext.runtime.machine.errors import InputError
    from fabric_ext.runtime.machine.jit import MAX_JIT_SLOTS, JitBackend
    prog = Program("long", assemble("mov %r0, 1\n" * MAX_JIT_SLOTS + "exit\n"))
    with pytest.raises(InputError, match=f"long: 65,537 instructions, more than the {MAX_JIT_SLOTS:,} the JIT "
                                         "compiles .* run it with --backend interp"):
        JitBackend().load(prog)
    interp = Interpreter(budget=2 * MAX_JIT_SLOTS)
    assert interp.run(interp.load(prog)) == 1


RING_POLICY = """
import "{fabrics}/dgx_cxl.fx"
workload w {{ model: "llama3-8b"; prompt: 512; tp: 2; weights: pool0; kv: pool0; chunk: 64KiB }}
movement kv_writeback = kv : gpu* -> pool0
map seen : hash<u32, count>[64]
map last : percpu_array<u32, count>[2]
map ring : ringbuf[4KiB]
policy p {{ on kv_writeback.forward at sw0 {{ seen[ev.layer] += 1
                                               last[0] = ev.layer
                                               last[1] max= ev.chunk
                                               emit ring(ev.layer, ev.chunk) }} }}
"""


@pytest.mark.skipif(not OK, reason=WHY)
def test_a_whole_run_in_the_kernel_reports_what_the_jit_does_dropped_records_included():
    """A policy run with its programs in the kernel gives the JIT's report: the same map
    contents (a per-CPU value set with `=` included: every run is on one CPU, see below), and
    the same records kept in a ring that fills and the same count of those it dropped (the
    kernel's ring counts none: its records are taken after each run into a ring of the same
    size, which counts them; before, such a run reported 0 dropped)."""
    from pathlib import Path

    from fabric_ext import api
    fabrics = Path(__file__).resolve().parents[1] / "policies" / "fabrics"
    bundle = api.compile(RING_POLICY.format(fabrics=fabrics))
    jit, kern = (api.run(bundle, backend=b).to_dict() for b in ("jit", "kernel"))
    assert kern["maps"] == jit["maps"] and kern["map_records"] == jit["map_records"]
    assert jit["maps"]["ring"]["dropped"] > 0 and len(jit["map_records"]["ring"]) == 4096 // 24


@pytest.mark.skipif(not OK, reason=WHY)
def test_the_kernel_backend_holds_the_process_to_one_cpu_while_it_is_open():
    """A program runs on the CPU that asks for the run, and a per-CPU map keeps a value per
    CPU: set with `=` on two CPUs, the kernel's values summed would be neither (found by
    tests/fuzz/shortcuts.py --kernel, seed 120102, a value twice the JIT's).  Our per-CPU maps
    model one CPU, so the backend holds the process to one while it is open."""
    import os
    before = os.sched_getaffinity(0)
    kb = kernel.KernelBackend()
    try:
        assert os.sched_getaffinity(0) == {kb.cpu}
    finally:
        kb.close()
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not OK, reason=WHY)
def test_a_per_cpu_maps_values_are_where_the_kernel_runs_the_programs():
    """Our per-CPU map holds one CPU's values: the kernel backend puts them in the slot of the
    CPU it holds the process to, which here is not CPU 0, so a program run there reads them."""
    import os

    from fabric_ext.runtime.machine.asm import assemble
    from fabric_ext.runtime.machine.maps import PERCPU_ARRAY, Map
    before = os.sched_getaffinity(0)
    others = sorted(before - {0})
    if not others:
        pytest.skip("this process may run on CPU 0 only: no other CPU's slot to tell apart")
    m = Map("v", PERCPU_ARRAY, 4, 8, 1)
    m[0] = 41
    prog = Program("read", assemble("stw [%r10-4], 0\nmov %r2, %r10\nadd %r2, -4\nlddw %r1, map 0\ncall 1\n"
                                    "jeq %r0, 0, out\nldxdw %r0, [%r0+0]\nexit\nout:\nmov %r0, 0\nexit"),
                   [m], ctx_size=8)
    os.sched_setaffinity(0, {others[0]})     # the backend holds the process to the least CPU it may use
    try:
        kb = kernel.KernelBackend()
        try:
            assert kb.cpu == others[0] and kb.run(kb.load(prog), bytearray(8)) == 41
        finally:
            kb.close()
    finally:
        os.sched_setaffinity(0, before)
