"""Real Linux eBPF through bpf(2) with ctypes (libbpf not required).

Maps with ``BPF_MAP_CREATE``, programs with ``BPF_PROG_LOAD`` as
``BPF_PROG_TYPE_SYSCALL`` after our own relocation (map fds into ``lddw``),
runs with ``BPF_PROG_TEST_RUN`` passing the context in ``ctx_in`` (the kernel
copies it back, decisions included); a bare program's memory goes the same way.
``BPF_PROG_TEST_RUN`` reports only the low 32 bits of r0, so `KernelBackend`
loads each program with every exit of its main function rewritten to store the
full r0 in a one-entry array map first (as bpf_conformance's libbpf plugin
does), and reads it from there.  Everything it creates is closed by ``close()``.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import struct

from . import isa as I
from .errors import FabricError
from .maptypes import PERCPU_ARRAY, PERCPU_HASH, RINGBUF
from .program import Backend, Program, VMFault

SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}.get(platform.machine(), 321)
MAP_CREATE, MAP_LOOKUP, MAP_UPDATE, MAP_DELETE, MAP_NEXT_KEY, PROG_LOAD, PROG_TEST_RUN = 0, 1, 2, 3, 4, 5, 10
COMMAND_NAMES = {MAP_CREATE: "BPF_MAP_CREATE", MAP_LOOKUP: "BPF_MAP_LOOKUP_ELEM", MAP_UPDATE: "BPF_MAP_UPDATE_ELEM",
                 MAP_DELETE: "BPF_MAP_DELETE_ELEM", MAP_NEXT_KEY: "BPF_MAP_GET_NEXT_KEY", PROG_LOAD: "BPF_PROG_LOAD",
                 PROG_TEST_RUN: "BPF_PROG_TEST_RUN"}
PROG_TYPE_SYSCALL, PROG_TYPE_XDP = 31, 6
F_SLEEPABLE = 1 << 4
LOG_STATS = 4                  # BPF_LOG_STATS: the verifier's statistics only
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class KernelError(FabricError, OSError):
    pass


class KernelVerifierError(KernelError):
    """The kernel verifier rejected a program; ``log`` is its log."""

    def __init__(self, name: str, err: int, log: str):
        self.name, self.log = name, log
        tail = "; ".join(line.strip() for line in log.strip().splitlines()[-3:])
        super().__init__(err, f"kernel verifier rejected '{name}': {os.strerror(err)}"
                         + (f" (its log ends: {tail})" if tail else ""))

    def failing_insn(self) -> int | None:
        """The instruction the log ends on (the one it rejected), if it names one."""
        hits = re.findall(r"^(\d+): \(", self.log, re.M)
        return int(hits[-1]) if hits else None


def bpf(cmd: int, attr: ctypes.Array) -> int:
    r = _libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise KernelError(e, f"bpf({COMMAND_NAMES.get(cmd, cmd)}): {os.strerror(e)}")
    return r


def permitted() -> tuple[bool, str]:
    """Whether this process may use bpf(2), with a one-line reason when it may not."""
    try:
        fd = create_map(2, 4, 8, 1, "probe")
    except KernelError as e:
        return False, f"bpf(2) is not permitted here ({os.strerror(e.errno)}); run as root or grant CAP_BPF"
    except Exception as e:  # noqa: BLE001 - no syscall at all (non-Linux)
        return False, f"bpf(2) is unavailable here ({e})"
    os.close(fd)
    return True, ""


def create_map(map_type: int, key_size: int, value_size: int, max_entries: int, name: str, flags: int = 0) -> int:
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<IIIII", attr, 0, map_type, key_size, value_size, max_entries, flags)
    attr[28:28 + 15] = name.encode()[:15].ljust(15, b"\0")
    return bpf(MAP_CREATE, attr)


def _found(cmd: int, attr) -> bool:
    """Run a map command; False where the kernel answers ENOENT (no such key, or no next key)."""
    try:
        bpf(cmd, attr)
    except KernelError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def _elem(fd, key: bytes, value_buf, flags=0):
    attr = ctypes.create_string_buffer(128)
    kb = ctypes.create_string_buffer(key, len(key))
    struct.pack_into("<IIQQQ", attr, 0, fd, 0, ctypes.addressof(kb), ctypes.addressof(value_buf), flags)
    return attr, kb


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    out = ctypes.create_string_buffer(value_size)
    attr, _kb = _elem(fd, key, out)
    return out.raw if _found(MAP_LOOKUP, attr) else None


def map_update(fd: int, key: bytes, value: bytes, flags: int = 0) -> int:
    vb = ctypes.create_string_buffer(value, len(value))
    attr, _kb = _elem(fd, key, vb, flags)
    try:
        bpf(MAP_UPDATE, attr)
    except KernelError as e:
        return -e.errno
    return 0


def map_keys(fd: int, key_size: int) -> list[bytes]:
    keys, prev = [], None
    while True:
        nxt = ctypes.create_string_buffer(key_size)
        attr = ctypes.create_string_buffer(128)
        kb = ctypes.create_string_buffer(prev or b"\0" * key_size, key_size)
        struct.pack_into("<IIQQ", attr, 0, fd, 0, ctypes.addressof(kb) if prev is not None else 0,
                         ctypes.addressof(nxt))
        if not _found(MAP_NEXT_KEY, attr):
            return keys
        prev = nxt.raw
        keys.append(prev)


def load_program(insns: list[I.Insn], name: str, prog_type: int = PROG_TYPE_SYSCALL,
                 license: str = "GPL") -> int:
    """Load into the kernel; on rejection, load again with a verifier log and raise it."""
    try:
        return _prog_load(insns, name, prog_type, license, 0)[0]
    except KernelError as e:
        first = e
    try:
        _prog_load(insns, name, prog_type, license, 1)
    except KernelVerifierError as e:
        raise e from None
    raise KernelVerifierError(name, first.errno, "") from None


def verifier_stats(insns: list[I.Insn], name: str, prog_type: int = PROG_TYPE_SYSCALL) -> str:
    """The kernel verifier's statistics for a program it accepts (BPF_LOG_STATS: "processed
    N insns ...", "verification time N usec"); the program is unloaded again."""
    fd, log = _prog_load(insns, name, prog_type, "GPL", LOG_STATS)
    os.close(fd)
    return log


def _prog_load(insns, name, prog_type, license, log_level) -> tuple[int, str]:
    code = I.encode(insns)
    buf = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(license.encode())
    log = ctypes.create_string_buffer(16 << 20 if log_level else 1)
    attr = ctypes.create_string_buffer(160)
    flags = F_SLEEPABLE if prog_type == PROG_TYPE_SYSCALL else 0
    struct.pack_into("<IIQQIIQII", attr, 0, prog_type, len(code) // 8, ctypes.addressof(buf),
                     ctypes.addressof(lic), log_level, len(log) if log_level else 0,
                     ctypes.addressof(log) if log_level else 0, 0, flags)
    attr[48:48 + 15] = re.sub(r"[^A-Za-z0-9_.]", "_", name).encode()[:15].ljust(15, b"\0")
    try:
        return bpf(PROG_LOAD, attr), log.value.decode(errors="replace")
    except KernelError as e:
        if not log_level:
            raise
        raise KernelVerifierError(name, e.errno, log.value.decode(errors="replace")) from None


def test_run(fd: int, ctx: bytearray | None = None, data: bytes | None = None, repeat: int = 0):
    """(r0, kernel-reported ns per run) for one BPF_PROG_TEST_RUN; ``ctx`` is updated in place."""
    attr = ctypes.create_string_buffer(80)
    cbuf = ctypes.create_string_buffer(bytes(ctx), len(ctx)) if ctx else None
    dbuf = ctypes.create_string_buffer(data, len(data)) if data else None
    struct.pack_into("<IIII", attr, 0, fd, 0, len(data) if data else 0, 0)
    struct.pack_into("<Q", attr, 16, ctypes.addressof(dbuf) if dbuf else 0)
    struct.pack_into("<I", attr, 32, repeat)
    struct.pack_into("<I", attr, 40, len(ctx) if ctx else 0)
    struct.pack_into("<Q", attr, 48, ctypes.addressof(cbuf) if cbuf else 0)
    bpf(PROG_TEST_RUN, attr)
    if ctx is not None and cbuf is not None:
        ctx[:] = cbuf.raw
    retval, duration = struct.unpack_from("<I", attr, 4)[0], struct.unpack_from("<I", attr, 36)[0]
    return retval, duration


def possible_cpus() -> int:
    """How many values a per-CPU map lookup returns (the kernel's possible CPUs)."""
    try:
        text = open("/sys/devices/system/cpu/possible").read().strip()
    except OSError:
        return os.cpu_count() or 1
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


class KernelRing:
    """A kernel ringbuf's mmap'd pages, mapped once: its consumer position (written back as
    records are consumed) and its data, mapped twice over as the kernel lays it out."""

    def __init__(self, fd: int, size: int):
        import mmap
        self.page, self.size = mmap.PAGESIZE, size
        self.cons = mmap.mmap(fd, self.page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod = mmap.mmap(fd, self.page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=self.page)

    def drain(self) -> list[bytes]:
        """Consume every committed record."""
        cons, prod, page, size = self.cons, self.prod, self.page, self.size
        c, p = struct.unpack_from("<Q", cons, 0)[0], struct.unpack_from("<Q", prod, 0)[0]
        out = []
        while c < p:
            at = page + (c & (size - 1))
            hdr = struct.unpack_from("<I", prod, at)[0]
            if hdr & (1 << 31):     # still being written
                break
            n = hdr & ~(3 << 30)
            if not hdr & (1 << 30):  # not discarded
                out.append(bytes(prod[at + 8:at + 8 + n]))
            c += (n + 8 + 7) // 8 * 8
        struct.pack_into("<Q", cons, 0, c)
        return out

    def move_to(self, m) -> None:
        """Consume every committed record into the `Map` ``m``, which keeps those that fit it
        and counts the rest as dropped."""
        for record in self.drain():
            m.ringbuf_output(record)

    def close(self) -> None:
        self.cons.close()
        self.prod.close()


def store_r0_at_exit(insns: list[I.Insn], map_fd: int) -> list[I.Insn]:
    """``insns`` with each exit of the main function (not of subprograms) preceded by a store
    of the full r0 into entry 0 of the array map ``map_fd``; jumps and calls re-aimed."""
    slots, _ = I.slot_index(insns)
    subprograms = [s + 1 + ins.imm for s, ins in zip(slots, insns)
                   if ins.opcode == I.JMP | I.CALL and ins.src == I.PSEUDO_CALL]
    main_end = min(subprograms, default=slots[-1] + 1 if slots else 0)
    store = [I.Insn(I.ALU64 | I.MOV | I.X, dst=6, src=0),
             I.Insn(I.ST | I.MEM | I.W, dst=10, off=-4, imm=0),
             I.Insn(I.ALU64 | I.MOV | I.X, dst=2, src=10),
             I.Insn(I.ALU64 | I.ADD | I.K, dst=2, imm=-4),
             I.Insn(I.LD | I.IMM | I.DW, dst=1, src=I.PSEUDO_MAP_FD, imm=map_fd),
             I.Insn(I.JMP | I.CALL, imm=1),
             I.Insn(I.JMP | I.JEQ | I.K, dst=0, imm=0, off=1),
             I.Insn(I.STX | I.MEM | I.DW, dst=0, src=6),
             I.Insn(I.ALU64 | I.MOV | I.X, dst=0, src=6)]
    out, new_slot, at = [], {}, 0      # new_slot: old slot -> where it (or what replaces it) starts
    for slot, ins in zip(slots, insns):
        new_slot[slot] = at
        inserted = store if ins.opcode == I.JMP | I.EXIT and slot < main_end else []
        out += [(slot, x, True) for x in inserted] + [(slot, ins, False)]
        at += sum(x.slots for x in inserted) + ins.slots

    def aim(slot, rel, at):          # an offset to the old target's new place (a bad one stays bad)
        target = new_slot.get(slot + 1 + rel)
        return rel if target is None else target - at - 1
    fixed, at = [], 0
    for slot, ins, inserted in out:
        if not inserted and ins.cls in (I.JMP, I.JMP32) and ins.op != I.EXIT:
            if ins.op == I.CALL:
                if ins.src == I.PSEUDO_CALL:
                    ins = I.Insn(ins.opcode, ins.dst, ins.src, ins.off, aim(slot, ins.imm, at))
            elif ins.opcode == I.JMP32 | I.JA:
                ins = I.Insn(ins.opcode, ins.dst, ins.src, ins.off, aim(slot, ins.imm, at))
            else:
                ins = I.Insn(ins.opcode, ins.dst, ins.src, aim(slot, ins.off, at), ins.imm)
        fixed.append(ins)
        at += ins.slots
    return fixed


class KernelBackend(Backend):
    """Runs programs in the Linux kernel.  Each of our `Map`s gets one kernel map,
    shared by every program that uses it; ``sync()`` copies kernel contents back.

    A ringbuf is the exception: the kernel counts none of the records its full ring refuses,
    so after each run the records a program wrote are consumed and handed to our `Map`, which
    keeps them while they fit its capacity (nothing consumes a ring during a run) and counts
    the rest as dropped, as the other backends do.  Only a single run that writes more than
    the whole ring holds would lose records uncounted in the kernel's ring itself.

    Our per-CPU maps model one CPU, and a program runs on the CPU that asks for the run: the
    process is held to one CPU while the backend is open (given back at ``close``), so that
    a per-CPU value set with ``=``, ``max=`` or ``min=`` is not summed with what another CPU
    kept of it."""
    name = "kernel"

    def __init__(self, **_ignored):
        ok, why = permitted()
        if not ok:
            raise KernelError(errno.EPERM, why)
        self.map_fds: dict[int, tuple[object, int]] = {}
        self.prog_fds: list[int] = []
        self.rings: dict[int, KernelRing] = {}     # id(Map) -> its kernel ring's pages
        self.affinity = os.sched_getaffinity(0)
        self.cpu = min(self.affinity)              # every run's, and each per-CPU map's slot
        os.sched_setaffinity(0, {self.cpu})

    def _fd(self, m) -> int:
        hit = self.map_fds.get(id(m))
        if hit is None:
            try:
                fd = create_map(m.type, m.key_size, m.value_size, m.max_entries, m.name, m.flags)
            except KernelError as e:
                raise KernelError(e.errno, f"the kernel cannot create map '{m.name}' ({m.max_entries:,} entries "
                                  f"of {m.key_size + m.value_size} bytes): {e.strerror}") from None
            percpu = m.type in (PERCPU_HASH, PERCPU_ARRAY)
            stride = (m.value_size + 7) // 8 * 8
            for k, v in m.items():
                if m.hashed or any(v):
                    if percpu:  # the kernel wants one value per possible CPU: ours goes to the runs' CPU
                        v = bytes(stride * self.cpu) + v.ljust(stride, b"\0") + bytes(stride * (possible_cpus() - self.cpu - 1))
                    map_update(fd, k, v)
            hit = self.map_fds[id(m)] = (m, fd)
        return hit[1]

    def relocate(self, prog: Program) -> list[I.Insn]:
        out = []
        for ins in prog.insns:
            if ins.is_lddw and ins.src in (I.PSEUDO_MAP_FD, I.PSEUDO_MAP_VALUE):
                ins = I.Insn(ins.opcode, ins.dst, ins.src, ins.off, self._fd(prog.maps[ins.imm]), ins.next_imm)
            out.append(ins)
        return out

    def load(self, prog: Program):
        r0_fd = create_map(2, 4, 8, 1, "fx_r0")
        self.prog_fds.append(r0_fd)
        fd = load_program(store_r0_at_exit(self.relocate(prog), r0_fd), prog.name)
        self.prog_fds.append(fd)
        rings = [(m, self._ring(m)) for m in {id(m): m for m in prog.maps}.values() if m.type == RINGBUF]
        return (prog, fd, r0_fd, rings)

    def _ring(self, m) -> KernelRing:
        ring = self.rings.get(id(m))
        if ring is None:
            ring = self.rings[id(m)] = KernelRing(self._fd(m), m.max_entries)
        return ring

    def run(self, handle, ctx=None, mem=None) -> int:
        """r0 in full; a bare program's memory is its context (r1), as syscall programs take it."""
        prog, fd, r0_fd, rings = handle
        buf = ctx if ctx is not None else mem
        try:
            low, _ = test_run(fd, buf if buf else None)
        except KernelError as e:
            raise VMFault(prog, 0, f"BPF_PROG_TEST_RUN failed: {e}") from None
        for m, ring in rings:       # what it wrote, kept where our ring has room (see the class)
            ring.move_to(m)
        full = map_lookup(r0_fd, bytes(4), 8)
        r0 = int.from_bytes(full, "little") if full is not None else low
        if r0 & 0xFFFFFFFF != low:
            raise VMFault(prog, 0, f"the kernel returned {low:#x}, but r0 was stored as {r0:#x}")
        return r0

    def sync(self) -> None:
        """Copy every kernel map's contents into its Map (ringbuf records are consumed)."""
        for m, fd in self.map_fds.values():
            if m.type == RINGBUF:       # (drained as each run ends: see the class)
                self._ring(m).move_to(m)
                continue
            percpu = m.type in (PERCPU_HASH, PERCPU_ARRAY)
            stride = (m.value_size + 7) // 8 * 8
            for k in map_keys(fd, m.key_size):
                v = map_lookup(fd, k, stride * possible_cpus() if percpu else m.value_size)
                if v is None:
                    continue
                if percpu:  # our per-CPU maps model one CPU: it holds the sum over the kernel's CPUs
                    total = sum(int.from_bytes(v[i:i + m.value_size], "little") for i in range(0, len(v), stride))
                    v = (total & ((1 << (8 * m.value_size)) - 1)).to_bytes(m.value_size, "little")
                m.update(k, v[:m.value_size])

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings = {}
        if self.affinity:
            os.sched_setaffinity(0, self.affinity)
            self.affinity = None
        for fd in self.prog_fds + [fd for _, fd in self.map_fds.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.prog_fds, self.map_fds = [], {}
