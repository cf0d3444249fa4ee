"""Widening at loop heads: how the verifier proves a loop safe without running it out.

Where exploring a loop iteration by iteration would pass the complexity budget (a loop bound
by a large constant, or by its input), the verifier explores it again from states widened at
its head (`widen`): every range that grew since the head's last state jumps to its limit (a
pointer's offset to ±MAX_VAR_OFF; an unsigned scalar to the next constant the program's
branches compare with, else to 0 or 2^64-1, keeping the low zero bits both states agree on:
so ``i += 8`` under ``i < 4096`` widens to the multiples of 8 up to 4088), every stack byte not
initialised in both is not initialised, every spill not the same kind in both is forgotten
with its bytes.  A path reaching the head in a state the widened one already covers
(`covers`) ends there: what the widened state was proven to do, any state inside it does.
Ranges only grow, each time to one of finitely many stops or a limit, and the known low zero
bits only shrink, so a head is widened a bounded number of times.

Two states join only with the same frames (call depth, return addresses) and the same
ringbuf records held; where they differ, nothing is widened and exploration goes on as before.
"""
from __future__ import annotations

import bisect

from .state import Frame, State
from .values import M64, OFFSET_POINTERS, UNINIT, Scalar, Uninit, align_of, holds, scalar

LIMIT = 1 << 29        # the verifier's MAX_VAR_OFF: how far a pointer's offset may range


def thresholds(constants) -> list[int]:
    """Where a scalar's widened bound may stop short of its limit: each constant a program's
    branches compare with, and one either side of it (``i < C`` bounds i by C - 1), sorted."""
    out = {v for c in constants for v in (c - 1, c, c + 1) if 0 <= v <= M64}
    return sorted(out)


def widen(old: State, new: State, stops: list[int] = ()) -> State | None:
    """The widened state at a loop head reached in ``old`` and now in ``new`` (None where they
    cannot be joined).  A scalar's bound that grew moves to the next of ``stops`` past it
    (`thresholds`), else to its limit."""
    if len(old.frames) != len(new.frames) or old.refs != new.refs:
        return None
    frames = []
    for a, b in zip(old.frames, new.frames):
        if a.ret_pc != b.ret_pc:
            return None
        frames.append(_widen_frame(a, b, stops))
    return State(frames, max(old.next_id, new.next_id), dict(new.refs))


def _widen_frame(a: Frame, b: Frame, stops) -> Frame:
    regs = [_widen_value(x, y, stops) for x, y in zip(a.regs, b.regs)]
    init = bytearray(x & y for x, y in zip(a.init, b.init))
    spills = {}
    for at in set(a.spills) | set(b.spills):
        v = _widen_value(a.spills[at], b.spills[at], stops) if at in a.spills and at in b.spills else UNINIT
        if isinstance(v, Uninit):
            init[at:at + 8] = bytes(8)        # no value both agree on: the slot is unreadable
        else:
            spills[at] = v
    return Frame(regs, bytes(init), spills, b.ret_pc)


def _widen_value(a, b, stops=()):
    if a == b:
        return a
    if isinstance(a, Scalar) and isinstance(b, Scalar):
        lo = a.lo if b.lo >= a.lo else stops[i - 1] if (i := bisect.bisect_right(stops, b.lo)) else 0
        hi = a.hi if b.hi <= a.hi else stops[i] if (i := bisect.bisect_left(stops, b.hi)) < len(stops) else M64
        # both are multiples of 2**k, so the widened range holds only those too
        return scalar(lo, hi, min(align_of(a), align_of(b))) or Scalar(lo, hi)
    if isinstance(a, OFFSET_POINTERS) and type(a) is type(b) and a[:-3] == b[:-3]:
        lo = a.lo if b.lo >= a.lo else -LIMIT
        hi = a.hi if b.hi <= a.hi else LIMIT
        return a._replace(lo=lo, hi=hi)
    return UNINIT


def covers(w: State, s: State) -> bool:
    """Every concrete state ``s`` stands for is one ``w`` stands for, for all the verifier
    checks: same frames and records, each value of ``s`` inside ``w``'s."""
    if len(w.frames) != len(s.frames) or w.refs != s.refs:
        return False
    return all(_covers_frame(a, b) for a, b in zip(w.frames, s.frames))


def _covers_frame(w: Frame, s: Frame) -> bool:
    if w.ret_pc != s.ret_pc or not all(_covers_value(x, y) for x, y in zip(w.regs, s.regs)):
        return False
    if any(x and not y for x, y in zip(w.init, s.init)):
        return False
    for at, v in s.spills.items():
        if at in w.spills:
            if not _covers_value(w.spills[at], v):
                return False
        elif w.init[at] and not isinstance(v, Scalar):
            return False          # w reads these bytes as a number; s holds a pointer there
    return all(at in s.spills and _covers_value(v, s.spills[at]) for at, v in w.spills.items())


def _covers_value(w, s) -> bool:
    if w == s or isinstance(w, Uninit):
        return True        # what may be uninitialised in w, w's paths never read
    if isinstance(w, Scalar) and isinstance(s, Scalar):
        return holds(w, s)
    if isinstance(w, OFFSET_POINTERS) and type(w) is type(s) and w[:-3] == s[:-3]:
        return w.lo <= s.lo and s.hi <= w.hi
    return False
