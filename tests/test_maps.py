"""Maps: the kernel's update flags and errors, bounds, LRU eviction, per-CPU values, shared memory."""
import errno
import multiprocessing as mp

import pytest

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
    m.lookup(K(1))          # 2 is now the least recently used
    m[3] = 3
    assert sorted(m.dump()) == [1, 3]


def test_percpu_values():
    m = Map("p", PERCPU_ARRAY, 4, 8, 2, ncpus=4)
    m.cpu = 2
    m[0] = 5
    assert m.percpu_values(K(0)) == [V(0), V(0), V(5), V(0)]
    assert m.dump() == {0: 5}


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
