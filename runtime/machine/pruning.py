"""Pruning: where a path may stop because a state explored before covers it.

The verifier saves a checkpoint of the state at every block leader a path reaches.  A later
path reaching the same leader stops there when a checkpoint whose paths are all explored
(`Checkpoint.done`) covers its state, for everything those paths looked at.  As in the
kernel's verifier (`is_state_visited`, `states_equal`), two things decide what that is:

- **precision** (`mark_precise`, the kernel's `mark_chain_precision`): a number's range
  matters only where it decided something: a branch taken one way only, an offset added to
  a pointer, a helper's size argument.  There the verifier walks the path back, block by
  block, through the instructions the number came from (a move, an operand, a spill and its
  fill) and marks the registers and spill slots it came from precise in every checkpoint on
  the way.  A checkpoint covers a number that is not precise in it with any number.
- **stack reads** (`mark_read`, the kernel's `REG_LIVE_READ`): a stack slot a checkpoint's
  paths never read before writing it whole can hold anything.

A pruned path has the same future as the checkpoint's, so the checkpoint's marks are marked
on the pruned path's own checkpoints in turn.  Where that cannot be worked out (a state
pruned by one whose paths are still being explored, as around a loop, or a path crossing a
bpf-to-bpf call), the checkpoints on the path become `exact`: matched only by an identical
state, as before this module.  A wrong mark here would make the verifier prove an unsafe
program, so every rule keeps the kernel's direction: when in doubt, more precise.
"""
from __future__ import annotations

from types import MappingProxyType

from . import isa as I
from .values import MapValueOrNull, Record, RecordOrNull, Scalar, Uninit, holds

CALLER_SAVED = frozenset(range(6))       # r0-r5: what a helper call leaves unknown
SLOTS = I.STACK_SIZE // 8                # 8-byte slots a frame's stack has
# a checkpoint's marks are bit sets (ints): register r of frame f is bit 11 f + r, stack
# slot (f, offset) bit SLOTS f + offset / 8; a 1M-step exploration saves hundreds of
# thousands of checkpoints, most of which never mark anything
_NO_SPILLS = MappingProxyType({})


def _slot_bit(loc: tuple) -> int:
    return 1 << (loc[0] * SLOTS + loc[1] // 8)


def slots_of(bits: int):
    """The (frame, offset) stack slots of a bit set."""
    while bits:
        b = (bits & -bits).bit_length() - 1
        yield b // SLOTS, b % SLOTS * 8
        bits &= bits - 1


class Checkpoint:
    """A state saved at a block leader, and what the paths from it were found to need."""
    __slots__ = ("pc", "key", "frame", "parent", "from_pc", "branches", "precise_regs",
                 "precise_slots", "read", "writes", "spill_at", "exact", "hits", "misses")

    def __init__(self, pc: int, key: tuple, frame: int, parent: Checkpoint | None, from_pc: int):
        self.pc, self.key, self.frame = pc, key, frame
        self.parent = parent                # the checkpoint of the block the path came from
        self.from_pc = from_pc              # the last instruction run in that block
        self.branches = 1                   # paths from here not yet explored to their end
        self.precise_regs = 0               # registers whose range mattered to its paths
        self.precise_slots = 0              # stack slots whose spilled number's range mattered
        self.read = 0                       # stack slots read before being written whole
        self.writes = 0                     # stack slots this block writes whole
        self.spill_at = _NO_SPILLS          # pc in this block -> (frame, slot) it spilled or filled
        self.exact = False                  # its marks are not known: only an identical state matches
        self.hits = self.misses = 0         # states it covered, and did not

    @property
    def done(self) -> bool:
        return self.branches == 0

    def spill(self, pc: int, loc: tuple, store: bool):
        """Instruction ``pc`` of this block stored (``store``) or loaded the 8-byte spill at ``loc``."""
        if self.spill_at is _NO_SPILLS:
            self.spill_at = {}
        self.spill_at[pc] = loc
        if store:
            self.writes |= _slot_bit(loc)


def find_cover(candidates: list[Checkpoint], key: tuple) -> Checkpoint | None:
    """The done checkpoint of ``candidates`` (one leader's) that covers the state ``key``, the
    latest first.  One that keeps failing to cover is dropped, as the kernel drops it
    (``miss_cnt > hit_cnt * 3 + 3``): where every path differs in what matters, comparing each
    with all the others before it would cost the square of their number."""
    for i in range(len(candidates) - 1, -1, -1):
        cp = candidates[i]
        if covers(cp, key):
            cp.hits += 1
            return cp
        cp.misses += 1
        if cp.misses > 3 * cp.hits + 3:
            del candidates[i]
    return None


def end_path(cp: Checkpoint | None) -> list[Checkpoint]:
    """A path ended (exit, or pruned): the checkpoints whose last open path it was, now done."""
    done = []
    while cp is not None:
        cp.branches -= 1
        if cp.branches:
            break
        done.append(cp)
        cp = cp.parent
    return done


def make_exact(cp: Checkpoint | None):
    """``cp`` and every checkpoint before it on its path may match only identical states."""
    while cp is not None and not cp.exact:
        cp.exact = True
        cp = cp.parent


def mark_read(cp: Checkpoint, loc: tuple):
    """Stack slot ``loc`` is read now, in ``cp``'s block: every checkpoint back to the block
    that wrote it whole held the value read."""
    bit = _slot_bit(loc)
    if cp.writes & bit:
        return
    while not cp.read & bit:
        cp.read |= bit
        cp = cp.parent
        if cp is None or cp.writes & bit:
            return


def inherit(old: Checkpoint, cp: Checkpoint, slots: list, last: int):
    """A path pruned by done checkpoint ``old`` (after instruction ``last`` of ``cp``'s block)
    has its future: what ``old``'s paths read and needed precise, ``cp`` and those before it
    hold for it."""
    for loc in slots_of(old.read):
        mark_read(cp, loc)
    if old.precise_regs or old.precise_slots:
        regs = {b - 11 * old.frame for b in range(11 * old.frame, 11 * old.frame + 11) if old.precise_regs >> b & 1}
        mark_precise(slots, cp, last, regs, set(slots_of(old.precise_slots)))


def mark_precise(slots: list, cp: Checkpoint, last: int, regs: set, stack: set):
    """The range of registers ``regs`` (of ``cp``'s frame) and spill slots ``stack`` as they
    are after instruction ``last`` of ``cp``'s block decided something: mark precise what they
    came from, in ``cp`` and the checkpoints before it."""
    regs, stack = set(regs), set(stack)
    while True:
        if last >= cp.pc and _crosses_frames(slots[last]):
            make_exact(cp)                  # registers of another frame: mark everything
            return
        for pc in range(last, cp.pc - 1, -1):
            ins = slots[pc]
            if ins is not None:
                _back(ins, pc, cp, regs, stack)
        frames = cp.key[0]
        f = cp.frame
        values = frames[f][0]
        regs = {r for r in regs if type(values[r]) is Scalar}
        marks = sum(1 << (11 * f + r) for r in regs)
        slot_marks = 0
        if stack:
            stack = {loc for loc in stack if loc[0] < len(frames) and type(dict(frames[loc[0]][2]).get(loc[1])) is Scalar}
            slot_marks = sum(_slot_bit(loc) for loc in stack)
        if not marks & ~cp.precise_regs and not slot_marks & ~cp.precise_slots:
            return                          # marked before, and so were the checkpoints before it
        cp.precise_regs |= marks
        cp.precise_slots |= slot_marks
        if cp.parent is None:
            return
        last, cp = cp.from_pc, cp.parent


def _crosses_frames(ins) -> bool:
    return ins is not None and ins.cls == I.JMP and (ins.op == I.EXIT or ins.op == I.CALL and ins.src == I.PSEUDO_CALL)


def _back(ins, pc: int, cp: Checkpoint, regs: set, stack: set):
    """One instruction backwards: where the values in ``regs``/``stack`` after it came from."""
    c, d = ins.cls, ins.dst
    x = bool(ins.opcode & I.X)
    if c in (I.ALU, I.ALU64):
        if d in regs:
            if ins.op == I.MOV:
                regs.discard(d)
            if x and ins.op not in (I.NEG, I.END):
                regs.add(ins.src)
    elif ins.is_lddw:
        regs.discard(d)
    elif c == I.LDX:
        if d in regs:
            regs.discard(d)
            loc = cp.spill_at.get(pc)
            if loc is not None:
                stack.add(loc)              # a fill: the number was spilled before
    elif c in (I.ST, I.STX):
        loc = cp.spill_at.get(pc)
        if c == I.STX and ins.mode == I.ATOMIC:
            stack.discard(loc)              # the slot now holds an unknown number
            if ins.imm == I.CMPXCHG:
                regs.discard(0)             # the old value, fetched: a number of its own
            elif ins.imm & I.FETCH:
                regs.discard(ins.src)
        elif loc in stack:
            stack.discard(loc)
            if c == I.STX:
                regs.add(ins.src)
    elif c in (I.JMP, I.JMP32) and ins.op == I.CALL or c == I.LD:
        regs -= CALLER_SAVED                # a helper's result is a number of its own


# -- does a checkpoint cover a state? --------------------------------------------------------
_IDS = (MapValueOrNull, RecordOrNull, Record)


def covers(cp: Checkpoint, key: tuple) -> bool:
    """Does done checkpoint ``cp`` cover the state whose `State.key` is ``key``: the same
    pointers, a number wherever it holds a number (inside its range where that is precise),
    initialised stack wherever its paths read the stack, the same ringbuf records held."""
    old_frames, old_refs = cp.key
    frames, refs = key
    if len(old_frames) != len(frames) or len(old_refs) != len(refs):
        return False
    ids: dict = {}
    precise = cp.precise_regs
    for f, (old, new) in enumerate(zip(old_frames, frames)):
        if old[3] != new[3]:
            return False                    # another return address
        old_regs, regs = old[0], new[0]
        bits = precise >> (11 * f) & 0x7FF
        if bits and not _precise_numbers_cover(old_regs, regs, bits):
            return False                    # the usual miss, found first
        for r, a in enumerate(old_regs):
            b = regs[r]
            if (a is not b and a != b or type(a) in _IDS) and not _value_covers(a, b, bits >> r & 1, ids):
                return False
    spills: dict = {}
    for f, at in slots_of(cp.read):
        old_init, old_spills = old_frames[f][1], old_frames[f][2]
        init = frames[f][1]
        if any(old_init[i] and not init[i] for i in range(at, at + 8)):
            return False                    # its paths read bytes this state never wrote
        if f not in spills:
            spills[f] = dict(old_spills), dict(frames[f][2])
        a, b = spills[f][0].get(at), spills[f][1].get(at)
        slot_precise = cp.precise_slots >> (f * SLOTS + at // 8) & 1
        if a is not None:
            if b is None:
                if type(a) is not Scalar or slot_precise:
                    return False            # bytes written one at a time read as any number
            elif not _value_covers(a, b, slot_precise, ids):
                return False
        elif b is not None and type(b) is not Scalar:
            return False                    # its paths read a number there; this holds a pointer
    if not old_refs:
        return True
    new_refs = dict(refs)
    return all(new_refs.get(ids.get(i)) == pc for i, pc in old_refs)


def _precise_numbers_cover(old_regs: tuple, regs: tuple, bits: int) -> bool:
    """Whether each register of ``bits`` that holds a number in both holds the new one's range."""
    while bits:
        r = (bits & -bits).bit_length() - 1
        bits &= bits - 1
        a, b = old_regs[r], regs[r]
        if type(a) is Scalar and type(b) is Scalar and a != b and not holds(a, b):
            return False
    return True


def _value_covers(a, b, precise: bool, ids: dict) -> bool:
    if type(a) is not type(b):
        return type(a) is Uninit            # what may be uninitialised there, its paths never read
    if type(a) is Scalar:
        return not precise or holds(a, b)
    if type(a) in _IDS:
        if a._replace(id=0) != b._replace(id=0):
            return False
        if ids.setdefault(a.id, b.id) != b.id:
            return False
        return list(ids.values()).count(b.id) == 1   # one old reference to one new
    return a == b

