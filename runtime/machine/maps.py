"""BPF maps with the kernel's semantics, stored in numpy buffers.

Every map keeps its values in one flat byte buffer so that a lookup returns a
slot index (the VM turns it into a pointer into that buffer) and in-place
updates and atomics act on the stored value.  Hash and LRU maps are open
addressing tables in buffers too, so a map can live in shared memory
(``shared=True``) and several processes see one map, as bpftime's maps do.
"""
from __future__ import annotations

import errno
from multiprocessing import shared_memory

import numpy as np

from .errors import InputError
from .maptypes import (  # noqa: F401  (the map type numbers, also read from here)
    ARRAY,
    HASH,
    KIND_TYPE,
    LRU_HASH,
    PERCPU_ARRAY,
    PERCPU_HASH,
    QUEUE,
    RINGBUF,
    STACK,
    TYPE_KIND,
)

BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2

EMPTY, USED, TOMB = 0, 1, 2

#: 2^64 divided by the golden ratio: multiplying by it and keeping the top bits (Fibonacci
#: hashing) spreads keys that differ in any bit, consecutive ids included, over the table
HASH_MULTIPLIER = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def hash_slot(key: bytes, cap: int) -> int:
    """Where a key's probe starts in a hash table of ``cap`` slots (a power of two).  The key
    is read as 8-byte little-endian words, the last one zero-padded; each is folded in as
    h = (h ^ word) * HASH_MULTIPLIER mod 2^64, and the slot is the top log2(cap) bits of h.
    Compiled code hashes the same way (`lift.Lifter._hash_lookup`): a multiply per word,
    where a byte-wise hash such as CRC-32 needs a table load per byte."""
    h = 0
    for i in range(0, len(key), 8):
        h = ((h ^ int.from_bytes(key[i:i + 8], "little")) * HASH_MULTIPLIER) & _MASK64
    return h >> (65 - cap.bit_length())     # cap 1: h >> 64, slot 0


class MapError(InputError):
    pass


class _Buffers:
    """Named numpy arrays carved out of one allocation (shared memory or private)."""

    def __init__(self, layout: dict[str, tuple[type, int]], shared: bool, shm_name: str | None):
        sizes = {k: np.dtype(t).itemsize * n for k, (t, n) in layout.items()}
        total = max(8, sum((s + 7) // 8 * 8 for s in sizes.values()))
        self.shm = None
        if shared or shm_name:
            self.shm = shared_memory.SharedMemory(name=shm_name, create=shm_name is None, size=total)
            raw = np.ndarray((total,), dtype=np.uint8, buffer=self.shm.buf)
            if shm_name is None:
                raw[:] = 0
        else:
            raw = np.zeros(total, dtype=np.uint8)
        self.arrays, off = {}, 0
        for k, (t, _n) in layout.items():
            self.arrays[k] = raw[off:off + sizes[k]].view(t)
            off += (sizes[k] + 7) // 8 * 8

    def close(self, unlink: bool):
        if self.shm is not None:
            self.arrays.clear()
            self.shm.close()
            if unlink:
                self.shm.unlink()


class Map:
    """A BPF map.  Keys and values are ``bytes`` in the Python API."""

    def __init__(self, name: str, map_type: int, key_size: int, value_size: int, max_entries: int,
                 flags: int = 0, ncpus: int = 1, shared: bool = False, shm_name: str | None = None):
        if map_type not in TYPE_KIND:
            raise MapError(f"map '{name}': unsupported map type {map_type}")
        if max_entries < 1:
            raise MapError(f"map '{name}': max_entries must be at least 1")
        if map_type != RINGBUF and value_size < 1:
            raise MapError(f"map '{name}': value_size must be at least 1")
        if map_type in (ARRAY, PERCPU_ARRAY) and key_size != 4:
            raise MapError(f"map '{name}': array maps need a 4-byte key, not {key_size}")
        self.name, self.type, self.key_size, self.value_size = name, map_type, key_size, value_size
        self.max_entries, self.flags = max_entries, flags
        self.ncpus = ncpus if map_type in (PERCPU_ARRAY, PERCPU_HASH) else 1
        self.cpu = 0
        self.records: list[bytes] = []  # ringbuf output, oldest first
        self.ring_used = 0              # ... and the bytes it holds, 8-byte headers included
        self.dropped = 0                # ringbuf records refused for want of room
        self.full = 0                   # hash updates of a new key refused: every entry in use
        hashed = map_type in (HASH, PERCPU_HASH, LRU_HASH)
        self.cap = 1 << (2 * max_entries - 1).bit_length() if hashed else max_entries
        if map_type == RINGBUF:
            self.cap = 1
        layout = {"meta": (np.uint64, 2), "values": (np.uint8, self.cap * max(value_size, 1) * self.ncpus)}
        if hashed:
            layout |= {"keys": (np.uint8, self.cap * key_size), "state": (np.uint8, self.cap),
                       "stamp": (np.uint64, self.cap)}
        self._buf = _Buffers(layout, shared, shm_name)
        a = self._buf.arrays
        self.meta, self.values = a["meta"], a["values"]
        self.keys, self.state, self.stamp = a.get("keys"), a.get("state"), a.get("stamp")
        self.hashed = hashed

    @property
    def kind(self) -> str:
        return TYPE_KIND[self.type]

    @property
    def shm_name(self) -> str | None:
        return self._buf.shm.name if self._buf.shm else None

    @property
    def count(self) -> int:
        return self.max_entries if not self.hashed else int(self.meta[0])

    def close(self, unlink: bool = True) -> None:
        self._buf.close(unlink)

    # -- slots --------------------------------------------------------------------
    def value_offset(self, slot: int, cpu: int | None = None) -> int:
        """Byte offset of a slot's value (for the current CPU) in ``values``."""
        c = self.cpu if cpu is None else cpu
        return (c * self.cap + slot) * self.value_size

    def _probe(self, key: bytes):
        """(slot holding key or None, first free slot or None)."""
        ks, cap = self.key_size, self.cap
        h = hash_slot(key, cap)
        free = None
        for i in range(cap):
            s = (h + i) & (cap - 1)
            st = self.state[s]
            if st == EMPTY:
                return None, free if free is not None else s
            if st == TOMB:
                if free is None:
                    free = s
            elif self.keys[s * ks:(s + 1) * ks].tobytes() == key:
                return s, None
        return None, free

    def _check_key(self, key: bytes) -> bytes:
        key = bytes(key)
        if len(key) != self.key_size:
            raise MapError(f"map '{self.name}': key must be {self.key_size} bytes, got {len(key)}")
        return key

    def lookup_slot(self, key: bytes, touch: bool = False) -> int | None:
        """The slot of ``key``, or None: what bpf_map_lookup_elem returns a pointer to.
        ``touch``: a program's lookup, which marks an LRU map's entry recently used; a read from
        outside (a report, a test), like the kernel's lookups from user space, does not."""
        key = self._check_key(key)
        if self.type == RINGBUF:
            return None
        if not self.hashed:
            idx = int.from_bytes(key, "little")
            return idx if idx < self.max_entries else None
        slot, _ = self._probe(key)
        if touch and slot is not None and self.type == LRU_HASH:
            self._touch(slot)
        return slot

    def _touch(self, slot):
        self.meta[1] += 1
        self.stamp[slot] = self.meta[1]

    # -- the kernel's operations, returning 0 or -errno ------------------------------
    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> int:
        key, value = self._check_key(key), bytes(value)
        if len(value) != self.value_size:
            raise MapError(f"map '{self.name}': value must be {self.value_size} bytes, got {len(value)}")
        if flags not in (BPF_ANY, BPF_NOEXIST, BPF_EXIST):
            return -errno.EINVAL
        if not self.hashed:
            idx = int.from_bytes(key, "little")
            if idx >= self.max_entries:
                return -errno.E2BIG
            if flags == BPF_NOEXIST:
                return -errno.EEXIST
            self._write(idx, value)
            return 0
        slot, free = self._probe(key)
        if slot is not None:
            if flags == BPF_NOEXIST:
                return -errno.EEXIST
        else:
            if flags == BPF_EXIST:
                return -errno.ENOENT
            if self.count >= self.max_entries:
                if self.type != LRU_HASH:
                    self.full += 1
                    return -errno.E2BIG
                self._evict()
                _, free = self._probe(key)
            slot = free
            self.state[slot] = USED
            self.keys[slot * self.key_size:(slot + 1) * self.key_size] = np.frombuffer(key, np.uint8)
            self.meta[0] += 1
        if self.type == LRU_HASH:
            self._touch(slot)
        self._write(slot, value)
        return 0

    def _write(self, slot: int, value: bytes):
        o = self.value_offset(slot)  # per-CPU maps: the current CPU's copy
        self.values[o:o + self.value_size] = np.frombuffer(value, np.uint8)

    def _evict(self):
        used = np.nonzero(self.state == USED)[0]
        victim = int(used[np.argmin(self.stamp[used])])
        self.state[victim] = TOMB
        self.meta[0] -= 1

    def delete(self, key: bytes) -> int:
        key = self._check_key(key)
        if not self.hashed:
            return -errno.EINVAL
        slot, _ = self._probe(key)
        if slot is None:
            return -errno.ENOENT
        self.state[slot] = TOMB
        self.meta[0] -= 1
        for cpu in range(self.ncpus):       # each CPU's copy (they lie a table apart, not side by side)
            o = self.value_offset(slot, cpu)
            self.values[o:o + self.value_size] = 0
        return 0

    # -- Python API -------------------------------------------------------------------
    def lookup(self, key: bytes, cpu: int | None = None) -> bytes | None:
        slot = self.lookup_slot(key)
        if slot is None:
            return None
        return self._value_bytes(slot, cpu)

    def _value_bytes(self, slot: int, cpu: int | None = None) -> bytes:
        """The value in ``slot`` (a per-CPU map's: ``cpu``'s copy, the current CPU's by default)."""
        o = self.value_offset(slot, cpu)
        return self.values[o:o + self.value_size].tobytes()

    def __getitem__(self, key: int | bytes) -> int:
        """Value as a little-endian integer (missing keys read as 0), for tests and reports."""
        kb = key.to_bytes(self.key_size, "little") if isinstance(key, int) else key
        v = self.lookup(kb)
        return int.from_bytes(v, "little") if v is not None else 0

    def __setitem__(self, key: int | bytes, value: int | bytes) -> None:
        kb = key.to_bytes(self.key_size, "little") if isinstance(key, int) else key
        vb = value.to_bytes(self.value_size, "little") if isinstance(value, int) else value
        rc = self.update(kb, vb)
        if rc:
            raise MapError(f"map '{self.name}': update failed ({errno.errorcode[-rc]})")

    def keys_list(self) -> list[bytes]:
        if self.type == RINGBUF:
            return []
        if not self.hashed:
            return [i.to_bytes(4, "little") for i in range(self.max_entries)]
        return [k for _, k in self._held()]

    def _held(self) -> list[tuple[int, bytes]]:
        """A hash map's (slot, key) of every entry, in the table's order."""
        ks = self.key_size
        return [(s, self.keys[s * ks:(s + 1) * ks].tobytes()) for s in np.nonzero(self.state == USED)[0].tolist()]

    def items(self, cpu: int | None = None):
        for k in self.keys_list():
            yield k, self.lookup(k, cpu)

    def percpu_values(self, key: bytes) -> list[bytes] | None:
        slot = self.lookup_slot(key)
        if slot is None:
            return None
        return [self._value_bytes(slot, c) for c in range(self.ncpus)]

    def _entries(self) -> list[tuple[int, int]]:
        """(key, slot) of each entry `dump` shows, in key order: a hash map's every key, an
        array's indices that hold anything (found by numpy: an array may have a million)."""
        if self.hashed:
            return sorted((int.from_bytes(k, "little"), s) for s, k in self._held())
        held = self.values.reshape(self.ncpus, self.cap, self.value_size)[:, :self.max_entries].any(axis=(0, 2))
        return [(k, k) for k in np.nonzero(held)[0].tolist()]

    def entry_count(self) -> int:
        """How many entries `dump` would show without a limit."""
        return self.count if self.hashed else len(self._entries())

    def dump(self, limit: int | None = None) -> dict:
        """Non-zero entries as {key: value} integers (keys ≤ 8 bytes) in key order (not the
        table's, which the hash decides), the first ``limit`` of them; or records for a ringbuf."""
        if self.type == RINGBUF:
            return {"records": [r.hex() for r in self.records], "dropped": self.dropped}
        return {key: sum(int.from_bytes(self._value_bytes(slot, c), "little") for c in range(self.ncpus))
                for key, slot in self._entries()[:limit]}

    # -- ringbuf ------------------------------------------------------------------------
    def ringbuf_room(self, size: int) -> bool:
        """Whether a record of ``size`` bytes (plus its 8-byte header) fits; a refusal counts as
        a drop, as the kernel's ringbuf drops what does not fit."""
        if self.ring_used + size + 8 > self.max_entries:
            self.dropped += 1
            return False
        return True

    def ringbuf_output(self, data: bytes) -> int:
        if self.type != RINGBUF:
            return -errno.EINVAL
        if not self.ringbuf_room(len(data)):
            return -errno.EAGAIN
        self.records.append(bytes(data))
        self.ring_used += len(data) + 8      # kept, not summed per record: nothing consumes a ring during a run
        return 0
