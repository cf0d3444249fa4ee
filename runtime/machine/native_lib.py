"""The JIT's runtime library: functions every program's native code may use, compiled once
per process (and kept in the code cache) instead of into each program's module.

- ``fx_batch(env, base, n, stride, entry)`` runs a program over n contexts in one call;
- ``fx_hash_update(bufs, key, value, flags, key_size, value_size, cap, max_entries, lru)``
  is `maps.Map.update` on a hash or LRU map's own buffers, for what is common: a key the map
  holds, or a new one where there is room.  What needs Python (a map full, an LRU map to
  evict from, flags the kernel refuses) it leaves untouched and answers ``ASK_PYTHON``; the
  caller then makes the helper call back into `maps.Map.update`, which decides as always;
- ``fx_hash_delete(bufs, key, key_size, value_size, cap)`` is `maps.Map.delete` on a hash or
  LRU map's buffers.

The map functions are generic over their map's shape, which their callers pass: one function serves every
program, so a program pays a call per use, not the code of a probe per call site.
"""
from __future__ import annotations

import errno

import llvmlite.binding as llvm

from . import irtext as L
from .isa import MASK64
from .lift import ASK_PYTHON, ENV_INDEX, I8, I64, MAP_ADDRS, PTR, error_return
from .maps import EMPTY, HASH_MULTIPLIER, TOMB, USED

BATCH, HASH_UPDATE, HASH_DELETE = "fx_batch", "fx_hash_update", "fx_hash_delete"
ENTRY_TYPE = L.FunctionType(I64, [PTR])
_EEXIST, _ENOENT = error_return(errno.EEXIST), error_return(errno.ENOENT)
NONE = MASK64        # no slot


def module() -> L.Module:
    m = L.Module(name="fx_runtime")
    m.triple = llvm.get_default_triple()
    _batch(m)
    _hash_update(m)
    _hash_delete(m)
    return m


class _Loops:
    """Loops written with variables in allocas, all in the function's first block (where the
    tier's SROA makes them registers); ``b`` builds from the block after it."""

    def __init__(self, fn: L.Function):
        self.fn = fn
        self.top = L.IRBuilder(fn.append_basic_block("vars"))
        self.start = fn.append_basic_block("start")
        self.b = L.IRBuilder(self.start)

    def var(self, init) -> L.Value:
        """A variable, set to ``init`` here (each time the code passes here)."""
        v = self.top.alloca(I64)
        self.b.store(init, v)
        return v

    def done(self) -> None:
        self.top.branch(self.start)

    def get(self, var) -> L.Value:
        return self.b.load(var, typ=I64)

    def block(self, name: str) -> L.Block:
        return self.fn.append_basic_block(name)

    def raw_at(self, base, offset, width):
        """The ``width`` (8 or 1) bytes at ``base + offset``, an i64 or an i8."""
        return self.b.load(self.b.inttoptr(self.b.add(base, offset), PTR), typ=L.IntType(8 * width), align=1)

    def bytes_at(self, base, offset, width):
        """The ``width`` (8 or 1) bytes at ``base + offset`` as an i64."""
        v = self.raw_at(base, offset, width)
        return v if width == 8 else self.b.zext(v, I64)

    def copy(self, dst, src, size, name: str) -> None:
        """``size`` bytes from ``src`` to ``dst`` (whole slots or disjoint: no overlap)."""
        self.each_piece(size, name, lambda off, width: self.b.store(
            self.raw_at(src, off, width), self.b.inttoptr(self.b.add(dst, off), PTR)))

    def each_piece(self, size, name: str, body) -> None:
        """``body(offset, width)`` over ``size`` bytes: 8-byte pieces, then single bytes."""
        b = self.b
        off = self.var(I64(0))
        head, word, byte, out = (self.block(f"{name}_{x}") for x in ("head", "word", "byte", "out"))
        b.branch(head)
        b.position_at_end(head)
        left = b.sub(size, self.get(off))
        more = self.block(f"{name}_more")
        b.cbranch(b.icmp_unsigned("==", left, I64(0)), out, more)
        b.position_at_end(more)
        b.cbranch(b.icmp_unsigned(">=", left, I64(8)), word, byte)
        for blk, width in ((word, 8), (byte, 1)):
            b.position_at_end(blk)
            at = self.get(off)
            body(at, width)
            b.store(b.add(at, I64(width)), off)
            b.branch(head)
        b.position_at_end(out)


def _batch(m: L.Module) -> None:
    """Run ``entry`` on n contexts, ``stride`` bytes apart from ``base``, and stop at the first
    fault; what the runs return is summed into the env's ``r0_sum`` (kept, so that no run's work
    is dead code to LLVM).  Returns the rows run."""
    fn = L.Function(m, L.FunctionType(I64, [PTR, I64, I64, I64, ENTRY_TYPE.as_pointer()]), name=BATCH)
    env, base, n, stride, entry = fn.args
    lp = _Loops(fn)
    b = lp.b

    def field(name):
        return b.gep(env, [I64(ENV_INDEX[name] * 8)], source_etype=I8)
    i = lp.var(I64(0))
    head, body, step, out = (lp.block(x) for x in ("head", "body", "step", "out"))
    b.branch(head)
    b.position_at_end(head)
    b.cbranch(b.icmp_unsigned("<", lp.get(i), n), body, out)
    b.position_at_end(body)
    row = lp.get(i)
    b.store(b.add(base, b.mul(row, stride)), field("ctx"))
    b.store(I64(0), field("executed"))                  # a budget per run
    r0 = b.call(entry, [env])
    b.store(b.add(b.load(field("r0_sum"), typ=I64), r0), field("r0_sum"))
    b.cbranch(b.icmp_unsigned("!=", b.load(field("fault"), typ=I64), I64(0)), out, step)   # a fault: this row
    b.position_at_end(step)
    b.store(b.add(row, I64(1)), i)
    b.branch(head)
    b.position_at_end(out)
    b.ret(lp.get(i))
    lp.done()


def _probe(m: L.Module, lp: _Loops, key, ks, cap, state, keys) -> tuple:
    """`maps.Map._probe` of ``key``: `maps.hash_slot`'s hash, then the linear probe.  Returns the
    blocks it goes on to where the map holds the key and where it does not, and the variables
    holding the key's slot (where held) and the first free one (where not: a tombstone passed,
    or the empty end; NONE where there is none)."""
    b = lp.b
    h = lp.var(I64(0))                     # 8-byte words, the last zero-padded
    word = lp.var(I64(0))

    def fold(off, width):
        if width == 8:
            b.store(b.mul(b.xor(lp.get(h), lp.bytes_at(key, off, 8)), I64(HASH_MULTIPLIER)), h)
            return
        shift = b.mul(b.and_(off, I64(7)), I64(8))       # a byte of the last, partial word
        w = b.or_(lp.get(word), b.shl(lp.bytes_at(key, off, 1), shift))
        b.store(w, word)
        with b.if_then(b.icmp_unsigned("==", b.add(off, I64(1)), ks)):
            b.store(b.mul(b.xor(lp.get(h), w), I64(HASH_MULTIPLIER)), h)
    lp.each_piece(ks, "hash", fold)
    # the top log2(cap) bits; cap 1 has none (a shift by 64 is poison: cap - 1 masks it to 0)
    bits = b.sub(I64(63), b.call(m.declare("llvm.ctlz.i64", L.FunctionType(I64, [I64, L.IntType(1)])),
                                 [cap, L.IntType(1)(0)]))
    start = b.lshr(lp.get(h), b.sub(I64(64), b.select(b.icmp_unsigned("==", bits, I64(0)), I64(1), bits)))

    i = lp.var(I64(0))
    free = lp.var(I64(NONE))
    slot = lp.var(I64(0))
    head, body, used, next_ = (lp.block(f"probe_{x}") for x in ("head", "body", "used", "next"))
    found, missing = lp.block("found"), lp.block("missing")
    b.branch(head)
    b.position_at_end(head)
    b.cbranch(b.icmp_unsigned("<", lp.get(i), cap), body, missing)
    b.position_at_end(body)
    s = b.and_(b.add(start, lp.get(i)), b.sub(cap, I64(1)))
    b.store(s, slot)
    st = b.load(b.inttoptr(b.add(state, s), PTR), typ=I8)
    no_free = b.icmp_unsigned("==", lp.get(free), I64(NONE))
    with b.if_then(b.and_(no_free, b.icmp_unsigned("!=", st, I8(USED)))):   # EMPTY or TOMB
        b.store(s, free)
    with b.if_then(b.icmp_unsigned("==", st, I8(EMPTY))):
        b.branch(missing)
    b.cbranch(b.icmp_unsigned("==", st, I8(TOMB)), next_, used)
    b.position_at_end(used)
    differ = lp.var(I64(0))
    held = b.add(keys, b.mul(s, ks))
    lp.each_piece(ks, "cmp", lambda off, width: b.store(
        b.or_(lp.get(differ), b.xor(lp.bytes_at(held, off, width), lp.bytes_at(key, off, width))), differ))
    b.cbranch(b.icmp_unsigned("==", lp.get(differ), I64(0)), found, next_)
    b.position_at_end(next_)
    b.store(b.add(lp.get(i), I64(1)), i)
    b.branch(head)
    return found, missing, slot, free


def _buffers(b: L.IRBuilder, bufs) -> list:
    """The map's buffers' addresses, in `MAP_ADDRS` order, from the address table at ``bufs``."""
    return [b.load(b.inttoptr(b.add(bufs, I64(k * 8)), PTR), typ=I64) for k in range(len(MAP_ADDRS))]


def _hash_update(m: L.Module) -> None:
    """`maps.Map.update` on the buffers ``bufs`` points to (the map's `MAP_ADDRS` in the address
    table)."""
    fn = L.Function(m, L.FunctionType(I64, [I64] * 9), name=HASH_UPDATE)
    bufs, key, value, flags, ks, vs, cap, max_entries, lru = fn.args
    lp = _Loops(fn)
    b = lp.b
    values, state, keys, meta, stamp = _buffers(b, bufs)
    ask = lp.block("ask_python")
    with b.if_then(b.icmp_unsigned(">", flags, I64(2)), likely=False):   # -EINVAL, Python's to say
        b.branch(ask)
    found, missing, slot, free = _probe(m, lp, key, ks, cap, state, keys)

    def touch_and_write(at):
        with b.if_then(b.icmp_unsigned("!=", lru, I64(0))):
            clock_p = b.inttoptr(b.add(meta, I64(8)), PTR)
            clock = b.add(b.load(clock_p, typ=I64), I64(1))
            b.store(clock, clock_p)
            b.store(clock, b.inttoptr(b.add(stamp, b.mul(at, I64(8))), PTR))
        lp.copy(b.add(values, b.mul(at, vs)), value, vs, "value")
        b.ret(I64(0))

    b.position_at_end(found)
    with b.if_then(b.icmp_unsigned("==", flags, I64(1))):      # BPF_NOEXIST
        b.ret(I64(_EEXIST))
    touch_and_write(lp.get(slot))

    b.position_at_end(missing)
    with b.if_then(b.icmp_unsigned("==", flags, I64(2))):      # BPF_EXIST
        b.ret(I64(_ENOENT))
    count = b.load(b.inttoptr(meta, PTR), typ=I64)
    with b.if_then(b.icmp_unsigned(">=", count, max_entries), likely=False):   # full: refuse or evict
        b.branch(ask)
    at = lp.get(free)
    with b.if_then(b.icmp_unsigned("==", at, I64(NONE)), likely=False):     # no slot (cannot be: cap > max)
        b.branch(ask)
    b.store(I8(USED), b.inttoptr(b.add(state, at), PTR))
    lp.copy(b.add(keys, b.mul(at, ks)), key, ks, "key")
    b.store(b.add(count, I64(1)), b.inttoptr(meta, PTR))
    touch_and_write(at)

    b.position_at_end(ask)
    b.ret(I64(ASK_PYTHON))
    lp.done()


def _hash_delete(m: L.Module) -> None:
    """`maps.Map.delete` on a hash or LRU map's buffers: the key's slot a tombstone, its value
    zeroed, the count one less; -ENOENT where the map does not hold the key."""
    fn = L.Function(m, L.FunctionType(I64, [I64] * 5), name=HASH_DELETE)
    bufs, key, ks, vs, cap = fn.args
    lp = _Loops(fn)
    b = lp.b
    values, state, keys, meta, _ = _buffers(b, bufs)
    found, missing, slot, _ = _probe(m, lp, key, ks, cap, state, keys)
    b.position_at_end(found)
    at = lp.get(slot)
    b.store(I8(TOMB), b.inttoptr(b.add(state, at), PTR))
    count_p = b.inttoptr(meta, PTR)
    b.store(b.sub(b.load(count_p, typ=I64), I64(1)), count_p)
    dst = b.add(values, b.mul(at, vs))
    lp.each_piece(vs, "zero", lambda off, width: b.store(L.IntType(8 * width)(0), b.inttoptr(b.add(dst, off), PTR)))
    b.ret(I64(0))
    b.position_at_end(missing)
    b.ret(I64(_ENOENT))
    lp.done()
