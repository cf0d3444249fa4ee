"""Maps: the kernel's update flags and errors, bounds, LRU eviction, per-CPU values, shared memory."""
import errno
import multiprocessing as mp

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_ext.runtime.machine.maps import ARRAY, BPF_EXIST, BPF_NOEXIST, HASH, LRU_HASH, PERCPU_ARRAY, Map, MapError

K = lambda i: i.to_bytes(4, "little")  # noqa: E731
V = lambda i: i.to_bytes(8, "little")  # noqa: E731


def test_hash_flags_and_errors():
    m = Map("h", HASH, 4, 8, 2)
    assert m.update(K(1), V(10), BPF_EXIST) == -errno.ENOENT
    assert m.update(K(1), V(10), BPF_NOEXIST) == 0
    assert m.update(K(1), V(11), BPF_NOEXIST) == -errno.EEXIST
    assert m.update(K(1), V(12), BPF_EXIST) == 0 and m[1] == 12
    assert m.update(K(2), V(20)) == 0
    assert m.update(K(3), V(30)) == -errno.E2BIG
    assert m.delete(K(9)) == -errno.ENOENT
    assert m.delete(K(1)) == 0 and m.lookup(K(1)) is None
    assert m.update(K(3), V(30)) == 0 and m.dump() == {2: 20, 3: 30}


def test_array_bounds_and_flags():
    m = Map("a", ARRAY, 4, 8, 4)
    assert m.update(K(4), V(1)) == -errno.E2BIG
    assert m.update(K(0), V(1), BPF_NOEXIST) == -errno.EEXIST
    assert m.lookup_slot(K(3)) == 3 and m.lookup_slot(K(4)) is None
    assert m.delete(K(0)) == -errno.EINVAL


def test_lru_evicts_the_least_recently_used():
    m = Map("l", LRU_HASH, 4, 8, 2)
    m[1], m[2] = 1, 2
    m.lookup_slot(K(1), touch=True)     # a program's lookup: 2 is now the least recently used
    m[3] = 3
    assert sorted(m.dump()) == [1, 3]


def test_reading_an_lru_map_from_outside_leaves_its_order():
    """As the kernel's lookups from user space do not mark an entry used, reading a map for a
    report or a test does not change which entry an LRU map evicts next."""
    m = Map("l", LRU_HASH, 4, 8, 2)
    m[1], m[2] = 1, 2
    stamps = bytes(m.stamp)
    assert m.lookup(K(1)) == V(1) and m[1] == 1 and m.dump() == {1: 1, 2: 2}
    assert bytes(m.stamp) == stamps
    m[3] = 3                # 1, written first, is still the least recently used
    assert sorted(m.dump()) == [2, 3]


def test_percpu_values():
    m = Map("p", PERCPU_ARRAY, 4, 8, 2, ncpus=4)
    m.cpu = 2
    m[0] = 5
    assert m.percpu_values(K(0)) == [V(0), V(0), V(5), V(0)]
    assert m.dump() == {0: 5}



def test_deleting_a_per_cpu_hash_key_clears_its_copies_and_no_other_key_s():
    """Each CPU's copy of a slot lies a whole table after the one before; a delete cleared the
    slots after the key's on CPU 0 instead (another key's value)."""
    from fabric_ext.runtime.machine.maps import PERCPU_HASH
    m = Map("p", PERCPU_HASH, 4, 8, 4, ncpus=2)
    for cpu in (0, 1):
        m.cpu = cpu
        for k in range(4):
            assert m.update(K(k), V(100 * cpu + k)) == 0
    held = {k: m.percpu_values(K(k)) for k in range(4)}
    assert m.delete(K(0)) == 0
    assert {k: m.percpu_values(K(k)) for k in range(1, 4)} == {k: held[k] for k in range(1, 4)}
    assert m.update(K(0), V(7), BPF_NOEXIST) == 0          # a new entry: 0 on every CPU but this one
    assert m.percpu_values(K(0)) == [V(0), V(7)]


def test_bad_arguments():
    with pytest.raises(MapError):
        Map("x", ARRAY, 8, 8, 4)
    with pytest.raises(MapError):
        Map("x", HASH, 4, 8, 0)
    with pytest.raises(MapError):
        Map("x", HASH, 4, 8, 4).update(b"\0", V(1))


def _child(name, q):
    m = Map("s", HASH, 4, 8, 8, shm_name=name)
    m[7] = m[7] + 35
    q.put(m[1])
    m.close(unlink=False)


def test_shared_memory_map_is_seen_by_another_process():
    m = Map("s", HASH, 4, 8, 8, shared=True)
    m[1], m[7] = 41, 7
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_child, args=(m.shm_name, q))
    p.start()
    p.join(60)
    assert q.get(timeout=5) == 41
    assert m[7] == 42
    m.close()


@st.composite
def _tables(draw):
    """A hash map's key size and capacity, keys put in (some deleted again: tombstones) and a
    key to look up: one of them or not."""
    key_size = draw(st.integers(1, 24))
    max_entries = draw(st.integers(1, 12))
    # often a prefix all keys share: only a later word tells them apart
    shared = draw(st.binary(min_size=key_size - 1, max_size=key_size - 1)) if draw(st.booleans()) else b""
    tail = st.binary(min_size=key_size - len(shared), max_size=key_size - len(shared)).map(shared.__add__)
    keys = draw(st.lists(tail, max_size=max_entries, unique=True))
    gone = draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
    probe = draw(st.sampled_from(keys) if keys and draw(st.booleans()) else tail)
    return key_size, max_entries, keys, gone, probe


@settings(max_examples=150, deadline=None)
@given(_tables(), st.sampled_from([HASH, LRU_HASH]))
def test_compiled_probe_finds_what_maps_py_placed(table, kind):
    """The JIT inlines a hash map's probe (`lift.Lifter._hash_lookup`): over keys of every size
    (whole 8-byte words and every tail), full tables and tombstones, it must find exactly the
    slots maps.py put them in (`maps.hash_slot`), as the interpreter (which asks maps.py) does."""
    from fabric_ext.runtime.machine import isa as I
    from fabric_ext.runtime.machine.interp import Interpreter
    from fabric_ext.runtime.machine.jit import JitBackend
    from fabric_ext.runtime.machine.program import Program
    from fabric_ext.runtime.machine.verifier import verify
    key_size, max_entries, keys, gone, probe = table
    m = Map("h", kind, key_size, 8, max_entries)
    for i, key in enumerate(keys):
        assert m.update(key, V(i + 1)) == 0
    for key in gone:
        assert m.delete(key) == 0
    assert list(m.dump()) == sorted(int.from_bytes(k, "little") for k in keys if k not in gone)
    insns = [I.Insn(I.ST | I.MEM | I.B, dst=10, off=j - key_size, imm=byte) for j, byte in enumerate(probe)]
    insns += [I.Insn(I.LD | I.IMM | I.DW, dst=1, src=I.PSEUDO_MAP_FD, imm=0),
              I.Insn(I.ALU64 | I.MOV | I.X, dst=2, src=10), I.Insn(I.ALU64 | I.ADD | I.K, dst=2, imm=-key_size),
              I.Insn(I.JMP | I.CALL, imm=1), I.Insn(I.JMP | I.JEQ | I.K, dst=0, imm=0, off=2),
              I.Insn(I.LDX | I.MEM | I.DW, dst=0, src=0, off=0), I.Insn(I.JMP | I.EXIT),
              I.Insn(I.ALU64 | I.MOV | I.K, dst=0, imm=0), I.Insn(I.JMP | I.EXIT)]
    prog = Program("probe", insns, [m])
    verify(prog)
    want = keys.index(probe) + 1 if probe in keys and probe not in gone else 0
    assert Interpreter().run(prog) == want
    jit = JitBackend()
    assert jit.run(jit.load(prog)) == want


def test_a_ringbuf_holds_records_up_to_its_size_and_drops_the_rest():
    """Its room is kept as records come (the sum over every record, per output, made a
    large ring quadratic: a 1 GiB ring ran past 120 s); a record needs its bytes and an
    8-byte header."""
    from fabric_ext.runtime.machine.maps import RINGBUF
    ring = Map("rb", RINGBUF, 0, 0, 4096)
    assert all(ring.ringbuf_output(bytes(56)) == 0 for _ in range(64))      # 64 x (56 + 8) = 4096
    assert ring.ring_used == 4096 and ring.dropped == 0
    assert ring.ringbuf_output(b"") == -errno.EAGAIN and ring.dropped == 1
    assert len(ring.dump()["records"]) == 64


def test_a_ringbuf_larger_than_a_map_may_be_is_refused():
    from fabric_ext.runtime.machine.elf import MapSpec
    from fabric_ext.runtime.machine.isa import MAX_MAP_BYTES
    from fabric_ext.runtime.machine.maps import RINGBUF
    assert MapSpec("rb", RINGBUF, 0, 0, MAX_MAP_BYTES).problem() is None
    assert "too large" in MapSpec("rb", RINGBUF, 0, 0, 2 * MAX_MAP_BYTES).problem()
