"""The static verifier: what must hold before any backend runs a program.

Two passes.  The structural pass checks opcodes, registers, jump targets (in
range, never into the middle of ``lddw``), helper ids and map references.  The
path pass then explores every path with an abstract state per register and
stack slot (uninitialised, scalar with an unsigned range, or a typed pointer
with an offset range), as the kernel's verifier does: stack and context
accesses in bounds, context writes only to decision fields of the hook, map
values only after a null check and within the value size, helper arguments of
the right kind, no reads of uninitialised registers or stack.  A path ends
where a checkpoint saved at the same block leader covers its state for what
the checkpoint's paths needed (`pruning.py`).  Loops are explored iteration by
iteration; where that runs out the complexity budget (a large or
input-dependent trip count), the path pass runs again with states widened at
loop heads (`widening.py`), whose cost does not grow with the trip count; such
a loop ends at the run-time instruction budget if not sooner.  A state that
repeats on its own path is an infinite loop.
"""
from __future__ import annotations

from . import helpers as Hl
from . import isa as I
from . import pruning
from .errors import InputError
from .insn_rules import ATOMIC_IMMS, VALID_OPCODES, reserved_fields
from .liveness import live_in
from .program import Program
from .semantics import alu, ctx_write_mask
from .state import Frame, State
from .values import (
    OFFSET_POINTERS,
    UNINIT,
    Ctx,
    MapPtr,
    MapValue,
    MapValueOrNull,
    Mem,
    Record,
    RecordOrNull,
    Released,
    Scalar,
    StackPtr,
    align_of,
    const,
    is_ptr,
    scalar,
)
from .widening import covers, thresholds, widen

M64, M32 = I.MASK64, I.MASK32
FULL = (0, M64)
STACK = I.STACK_SIZE
# how far a pointer's offset may range, as the kernel's BPF_MAX_VAR_OFF: offsets stay far
# from 2^63, so sums of them never wrap and every bounds test below is on exact integers
MAX_VAR_OFF = 1 << 29
#: the most bytes of a bare program's memory an access may be proven to reach (`Program.mem_extent`)
MAX_MEM_EXTENT = 1 << 32
class VerifierError(InputError):
    """A rejected program; the message names the pc, instruction and source line."""

    def __init__(self, program: Program, pc: int, msg: str):
        self.program, self.pc, self.msg = program, pc, msg
        super().__init__(f"{program.where(pc)}: {msg}")


# ---- abstract values (values.py) ---------------------------------------------------
def signed_range(v: Scalar):
    """A scalar's unsigned range [lo, hi] as a signed one, or None where it spans 2^63 (then its
    values read as signed are not one interval: it is unbounded below)."""
    lo, hi = v.lo, v.hi
    if hi < 1 << 63:
        return lo, hi
    if lo >= 1 << 63:
        return lo - (1 << 64), hi - (1 << 64)
    return None


# what each non-memory pointer kind is called in messages
POINTER_WORDS = {"map_ptr": "a map reference", "map_value_or_null": "a pointer that may be null; check it against 0 first",
                 "record_or_null": "a pointer that may be null; check it against 0 first",
                 "released": "a ringbuf record that was already submitted or discarded"}


class _TooComplex(VerifierError):
    """The exploration ran out of its instruction budget."""


#: distinct states a loop head is explored in before the second pass widens them
WIDEN_AFTER = 8
#: instructions the first exploration (and the widened one) may take of the budget
FIRST_PASS = 100_000


class Verifier:
    def __init__(self, prog: Program, max_insns: int = I.VERIFY_BUDGET, bare_mem: bool | None = None):
        self.p = prog
        self.max_insns = max_insns
        self.hook = prog.hook
        # a program with a context (from its hook, or a size given for a bare one) gets r1 = ctx;
        # without one it is a bare program: r1 = the memory given to it, r2 = its length
        self.ctx_size = prog.ctx_size
        self.wmask = ctx_write_mask(prog.hook, self.ctx_size) if self.ctx_size else b""
        self.bare = not self.ctx_size if bare_mem is None else bare_mem
        self.kinds: dict[int, set] = {}   # pc -> the kinds of memory its accesses were proven in
        self.mem_extent: dict[int, int | None] = {}   # pc -> bytes of given memory it reaches (None: unbounded)
        self.call_maps: dict[int, set] = {}   # pc of a map helper call -> the maps its r1 may reference
        self.pc = 0                       # the instruction being checked (for a defect's message)

    def fail(self, pc, msg):
        raise VerifierError(self.p, pc, msg)

    # -- structural pass ---------------------------------------------------------
    def structural(self):
        slots, n = self.p.slots, len(self.p.slots)
        if n == 0:
            self.fail(0, "empty program")
        self.loop_heads = set()
        constants = set()            # what branches compare with: where widening stops
        used_maps = set()
        for pc, ins in enumerate(slots):
            if ins is None:
                continue
            if ins.opcode not in VALID_OPCODES:
                self.fail(pc, f"unknown opcode {ins.opcode:#04x}")
            if ins.dst > 10 or ins.src > 10 and not ins.is_lddw and ins.opcode != I.JMP | I.CALL:
                self.fail(pc, f"invalid register r{max(ins.dst, ins.src)}")
            c, op = ins.cls, ins.op
            writes_dst = c in (I.ALU, I.ALU64, I.LDX) or ins.is_lddw
            if writes_dst and ins.dst == 10:
                self.fail(pc, "frame pointer r10 is read only")
            if c in (I.ALU, I.ALU64) and op == I.END and ins.imm not in (16, 32, 64):
                self.fail(pc, f"invalid byte swap width {ins.imm}")
            why = reserved_fields(ins)
            if why:
                self.fail(pc, f"instruction uses reserved fields ({why}); the kernel refuses it too")
            if c == I.STX and ins.mode == I.ATOMIC and ins.imm not in ATOMIC_IMMS:
                self.fail(pc, f"unknown atomic operation {ins.imm:#x}")
            if ins.is_lddw:
                if ins.src in (I.PSEUDO_MAP_FD, I.PSEUDO_MAP_VALUE) and ins.imm >= len(self.p.maps):
                    self.fail(pc, f"reference to map {ins.imm}, but the program has {len(self.p.maps)} maps")
                if ins.src in (I.PSEUDO_MAP_FD, I.PSEUDO_MAP_VALUE):
                    used_maps.add(ins.imm)
                    if len(used_maps) > I.MAX_USED_MAPS:
                        self.fail(pc, f"the program uses more than {I.MAX_USED_MAPS} maps, the most the "
                                  "kernel allows one program: use fewer maps in this hook's handlers")
                if ins.src not in (0, I.PSEUDO_MAP_FD, I.PSEUDO_MAP_VALUE):
                    self.fail(pc, f"unsupported lddw source {ins.src}")
            if c in (I.JMP, I.JMP32) and op not in (I.EXIT,):
                if op == I.CALL:
                    if ins.opcode & I.X:
                        continue
                    if ins.src == I.PSEUDO_CALL:
                        self._target(pc, pc + 1 + ins.imm)
                    elif ins.src != 0:
                        self.fail(pc, f"unsupported call kind (src {ins.src})")
                    elif ins.imm not in Hl.HELPERS:
                        self.fail(pc, f"unknown helper {ins.imm}: the runtime provides "
                                  + ", ".join(f"{h.id} ({h.name})" for h in Hl.HELPERS.values()))
                    continue
                t = pc + 1 + ins.jump_offset
                self._target(pc, t)
                if t <= pc:
                    self.loop_heads.add(t)
                if op != I.JA and not ins.opcode & I.X:
                    constants.add(ins.imm & (M32 if c == I.JMP32 else M64))
        self.stops = thresholds(constants)

    def _target(self, pc, t):
        if not 0 <= t < len(self.p.slots):
            self.fail(pc, f"jump out of range to pc {t}")
        if self.p.slots[t] is None:
            self.fail(pc, f"jump into the middle of lddw at pc {t - 1}")

    # -- path pass -----------------------------------------------------------------
    def initial(self) -> State:
        regs = [UNINIT] * 11
        regs[10] = StackPtr(0, STACK, STACK)
        if self.ctx_size:
            regs[1] = Ctx(0, 0)
        elif self.bare:
            regs[1], regs[2] = Mem(0, 0), Scalar()
        return State([Frame(regs, bytes(STACK), {})])

    def run(self):
        """Explore every path, for up to FIRST_PASS instructions; where loops run past that,
        explore again with widening at their heads (`widening.py`), which proves them safe
        whatever their trip count (such a loop ends at the run-time instruction budget if not
        sooner); where widening loses what a loop needs (an index's relation to its bound),
        explore iteration by iteration again, up to the whole budget, as the kernel does."""
        self.structural()
        self.live = live_in(self.p.slots)
        first = min(self.max_insns, FIRST_PASS)
        try:
            return self._explore(False, first)
        except _TooComplex as e:
            too_complex = e
        try:
            return self._explore(True, first)
        except VerifierError as e:
            widened = e
        if first < self.max_insns:
            try:
                return self._explore(False, self.max_insns)
            except _TooComplex as e:
                too_complex = e
        raise VerifierError(self.p, too_complex.pc, f"{too_complex.msg}; explored again with widening at "
                            f"loop heads, pc {widened.pc} fails: {widened.msg}") from None

    def _explore(self, widening: bool, budget: int) -> int:
        self.kinds = {}
        self.mem_extent = {}
        self.call_maps = {}
        self.inits: dict[bytes, bytes] = {}
        slots = self.p.slots
        # Depth-first: the work list is LIFO, so a popped item's path is a prefix of the
        # current one; `on_path` holds the loop-head states of the current path only.  An
        # item is (pc, state, depth, the checkpoint of its block, the last pc run in it).
        work = [(0, self.initial(), 0, None, -1)]
        path: list[tuple] = []
        on_path: set = set()
        seen: dict[int, dict] = {}          # leader -> state key -> its checkpoint
        self.covering: dict[int, list] = {}  # leader -> its done checkpoints that may cover others
        widened: dict[int, State] = {}      # loop head -> the widened state explored from it
        processed = 0
        leaders = self._leaders()
        dead = {pc: [r for r in range(10) if not self.live[pc] >> r & 1] for pc in leaders if pc < len(slots)}
        while work:
            pc, st, depth, self.cp, last = work.pop()
            while len(path) > depth:
                on_path.discard(path.pop())
            while True:
                processed += 1
                if processed > budget:
                    heads = sorted(self.loop_heads)
                    self.pc = pc
                    raise _TooComplex(self.p, pc, f"program too complex: explored {budget} "
                                      f"instructions without leaving the loop at pc {heads[0] if heads else pc}")
                if pc >= len(slots):
                    self.fail(len(slots) - 1, "execution falls off the end of the program")
                if widening and pc in self.loop_heads:
                    w = widened.get(pc)
                    if w is not None and covers(w, st):
                        pruning.make_exact(self.cp)     # the widened state's paths include this one's
                        self._end_path()
                        break
                    if w is not None or len(seen.get(pc, ())) >= WIDEN_AFTER:
                        joined = widen(w, st, self.stops) if w is not None else st.copy()
                        if joined is not None:
                            widened[pc] = joined
                            st = joined.copy()
                if pc in leaders:
                    regs = st.top.regs
                    for r in dead[pc]:      # what no path reads again: paths that differ only there meet
                        regs[r] = UNINIT
                    k = st.key()
                    if pc in self.loop_heads and pc not in widened:
                        if (pc, k) in on_path:
                            self.fail(pc, "infinite loop: the same state repeats on one path")
                        path.append((pc, k))
                        on_path.add((pc, k))
                    bucket = seen.setdefault(pc, {})
                    if self._pruned(pc, bucket, k, last):
                        self._end_path()
                        break
                    self.cp = bucket[k] = pruning.Checkpoint(pc, k, len(st.frames) - 1, self.cp, last)
                self.pc = pc
                nxt = self.step(pc, slots[pc], st, work, len(path))
                if nxt is None:
                    self._end_path()
                    break
                last, pc = pc, nxt
        self.p.proof = {pc: frozenset(k) for pc, k in self.kinds.items()}
        self.p.mem_extent = {pc: n for pc, n in self.mem_extent.items() if n is not None}
        self.p.call_maps = {pc: next(iter(ms)) for pc, ms in self.call_maps.items() if len(ms) == 1}
        return processed

    def _end_path(self):
        for cp in pruning.end_path(self.cp):
            if not cp.exact:
                self.covering.setdefault(cp.pc, []).append(cp)

    def _pruned(self, pc: int, bucket: dict, k: tuple, last: int) -> bool:
        """Does a checkpoint at leader ``pc`` cover the state ``k``?  If so, what its paths
        needed, this path's checkpoints need too (`pruning`)."""
        old = bucket.get(k)
        if old is None:
            old = pruning.find_cover(self.covering.get(pc, []), k)
            if old is None:
                return False
        if not old.done or old.exact:
            pruning.make_exact(self.cp)     # what its paths need is not known yet
            return True
        pruning.inherit(old, self.cp, self.p.slots, last)
        return True

    def _precise(self, *regs):
        """The ranges of ``regs`` decide something at this instruction (`pruning.mark_precise`)."""
        pruning.mark_precise(self.p.slots, self.cp, self.pc - 1, set(regs), set())

    def _fork(self, work, pc, st, depth):
        """Explore ``st`` from ``pc`` later: one more open path from this block's checkpoint."""
        self.cp.branches += 1
        work.append((pc, st, depth, self.cp, self.pc))

    def _leaders(self):
        out = {0}
        for pc, ins in enumerate(self.p.slots):
            if ins is None or ins.cls not in (I.JMP, I.JMP32):
                continue
            if ins.op == I.CALL and ins.src == I.PSEUDO_CALL:
                out |= {pc + 1 + ins.imm, pc + 1}
            elif ins.op not in (I.CALL, I.EXIT):
                out |= {pc + 1 + ins.jump_offset, pc + 1}
        return out

    # -- one instruction; returns the next pc or None when the path ends ---------------
    def step(self, pc, ins, st: State, work, depth):
        f = st.top
        regs = f.regs
        c = ins.cls
        if c in (I.ALU, I.ALU64):
            self.alu(pc, ins, regs)
            return pc + 1
        if ins.is_lddw:
            if ins.src == I.PSEUDO_MAP_FD:
                regs[ins.dst] = MapPtr(ins.imm)
            elif ins.src == I.PSEUDO_MAP_VALUE:
                m = self.p.maps[ins.imm]
                if m.kind != "array" or ins.next_imm >= m.value_size:
                    self.fail(pc, f"map value reference into '{m.name}' at offset {ins.next_imm} is invalid")
                regs[ins.dst] = MapValue(ins.imm, ins.next_imm, ins.next_imm)
            else:
                regs[ins.dst] = const(ins.imm)
            return pc + 2
        if c == I.LDX:
            size = I.SIZE_BYTES[ins.size]
            regs[ins.dst] = self.load(pc, st, self.read(pc, regs, ins.src), ins.off, size, ins.mode == I.MEMSX)
            return pc + 1
        if c == I.ST:
            self.store(pc, st, self.read(pc, regs, ins.dst), ins.off, I.SIZE_BYTES[ins.size], const(ins.imm))
            return pc + 1
        if c == I.STX:
            size = I.SIZE_BYTES[ins.size]
            base, val = self.read(pc, regs, ins.dst), self.read(pc, regs, ins.src)
            if ins.mode == I.ATOMIC:
                self.atomic(pc, st, ins, base, val, size)
            else:
                self.store(pc, st, base, ins.off, size, val)
            return pc + 1
        op = ins.op
        if op == I.EXIT:
            r0 = regs[0]
            if r0 == UNINIT:
                self.fail(pc, "r0 is not set before exit")
            if len(st.frames) == 1:
                if is_ptr(r0):
                    self.fail(pc, "the program returns a pointer; return a number")
                if st.refs:
                    ref_pc = min(st.refs.values())
                    self.fail(pc, f"reference leak: the ringbuf record reserved at pc {ref_pc} is neither "
                              "submitted nor discarded on this path")
                return None
            if isinstance(r0, StackPtr) and r0.frame == len(st.frames) - 1:
                self.fail(pc, "cannot return a stack pointer to the caller: the callee's frame ends here")
            ret = st.frames.pop()
            caller = st.top
            caller.regs[0] = r0
            for r in range(1, 6):
                caller.regs[r] = UNINIT
            return ret.ret_pc
        if op == I.CALL:
            if ins.src == I.PSEUDO_CALL:
                if len(st.frames) >= I.MAX_FRAMES:
                    self.fail(pc, f"call depth exceeds {I.MAX_FRAMES} frames")
                regs_new = [UNINIT] * 11
                for r in range(1, 6):
                    regs_new[r] = regs[r]
                regs_new[10] = StackPtr(len(st.frames), STACK, STACK)
                st.frames.append(Frame(regs_new, bytes(STACK), {}, pc + 1))
                return pc + 1 + ins.imm
            hid = ins.imm
            if ins.opcode & I.X:
                v = self.read(pc, regs, ins.dst)
                self._precise(ins.dst)
                if not isinstance(v, Scalar) or not v.constant or v.lo not in Hl.HELPERS:
                    self.fail(pc, f"callx: r{ins.dst} must hold a known helper id, not "
                              f"{v.kind if not isinstance(v, Scalar) else f'{v.lo}..{v.hi}'}")
                hid = v.lo
            self.helper(pc, hid, st)
            return pc + 1
        if op == I.JA:
            return pc + 1 + ins.jump_offset
        return self.branch(pc, ins, st, work, depth)

    def read(self, pc, regs, r):
        v = regs[r]
        if v == UNINIT:
            self.fail(pc, f"r{r} is read before it is written")
        return v

    # -- ALU -------------------------------------------------------------------------------
    def alu(self, pc, ins, regs):
        is64 = ins.cls == I.ALU64
        op = ins.op
        d = regs[ins.dst]
        if ins.opcode & I.X:
            s = self.read(pc, regs, ins.src)
        else:
            s = const(ins.imm if is64 or op == I.MOV else ins.imm & M32)
            if is64:
                s = const(ins.imm)
        if op == I.MOV:
            if is64 and not ins.off:
                regs[ins.dst] = s
                return
            if is_ptr(s):
                self.fail(pc, "32-bit or sign-extending move of a pointer")
            regs[ins.dst] = self.scalar_op(ins, s, s, is64)
            return
        if d == UNINIT:
            self.fail(pc, f"r{ins.dst} is read before it is written")
        if op in (I.NEG, I.END):
            if is_ptr(d):
                self.fail(pc, "arithmetic on a pointer")
            regs[ins.dst] = self.scalar_op(ins, d, d, is64)
            return
        if is_ptr(d) or is_ptr(s):
            regs[ins.dst] = self.ptr_arith(pc, ins, d, s, is64)
            return
        regs[ins.dst] = self.scalar_op(ins, d, s, is64)

    def ptr_arith(self, pc, ins, d, s, is64):
        op = ins.op
        if not is64:
            self.fail(pc, "32-bit arithmetic on a pointer")
        for v in (d, s):
            if is_ptr(v) and not isinstance(v, OFFSET_POINTERS):
                self.fail(pc, f"arithmetic on {POINTER_WORDS[v.kind]}")
        # the register holding the number the pointer moves by (none: an immediate)
        by = ins.src if is_ptr(d) and ins.opcode & I.X else ins.dst if not is_ptr(d) else None
        if op == I.ADD:
            ptr, sc = (d, s) if is_ptr(d) else (s, d)
            if is_ptr(sc):
                self.fail(pc, "adding two pointers")
            if by is not None:
                self._precise(by)
            return self._shift_ptr(pc, ptr, signed_range(sc))
        if op == I.SUB:
            if is_ptr(d) and not is_ptr(s):
                if by is not None:
                    self._precise(by)
                delta = signed_range(s)
                return self._shift_ptr(pc, d, delta and (-delta[1], -delta[0]))
            if is_ptr(d) and is_ptr(s) and d.kind == s.kind:
                return Scalar()
        self.fail(pc, f"pointer arithmetic with '{I.ALU_NAMES.get(op, op)}' is not allowed")

    def _shift_ptr(self, pc, ptr, delta):
        """``ptr`` moved by a signed offset range; the offsets stay within ±MAX_VAR_OFF."""
        if delta is None:
            self.fail(pc, f"math between a {ptr.kind} pointer and a register with an unbounded range is not "
                      "allowed; bound the value with a comparison first")
        lo, hi = ptr.lo + delta[0], ptr.hi + delta[1]
        if max(-lo, hi) >= MAX_VAR_OFF:
            self.fail(pc, f"pointer offset range {lo}..{hi} makes the {ptr.kind} pointer go out of bounds "
                      f"(offsets must stay within ±{MAX_VAR_OFF})")
        return ptr._replace(lo=lo, hi=hi)

    def scalar_op(self, ins, d, s, is64):
        """The result range of a scalar operation (exact when both are constants)."""
        mask = M64 if is64 else M32
        op = ins.op
        if d.constant and s.constant:
            regs = [0] * 11
            regs[1], regs[2] = d.lo, s.lo
            fake = I.Insn((ins.opcode | I.X), dst=1, src=2, off=ins.off, imm=ins.imm)
            if op == I.END:
                fake = I.Insn(ins.opcode, dst=1, imm=ins.imm)
            return const(alu(fake, ins.cls, regs))
        lo, hi = d.lo, d.hi
        if not is64:
            if hi > M32:
                lo, hi = 0, M32
            slo, shi = (s.lo, s.hi) if s.hi <= M32 else (0, M32)
        else:
            slo, shi = s.lo, s.hi
        r = None
        if op == I.ADD and hi + shi <= mask:
            r = (lo + slo, hi + shi)
        elif op == I.SUB and lo >= shi:
            r = (lo - shi, hi - slo)
        elif op == I.MUL and hi * shi <= mask:
            r = (lo * slo, hi * shi)
        elif op == I.DIV and ins.off == 0:
            # x / 0 = 0 in eBPF: a divisor range holding 0 puts 0 in the result
            r = (0, hi) if slo == 0 else (lo // shi, hi // slo)
        elif op == I.MOD and ins.off == 0:
            # x % 0 = x: a divisor range holding 0 keeps the dividend's range
            r = (0, hi) if slo == 0 else (0, min(hi, shi - 1))
        elif op == I.AND:
            r = (0, min(hi, shi))
        elif op == I.RSH and slo == shi:
            sh = slo & (63 if is64 else 31)
            r = (lo >> sh, hi >> sh)
        elif op == I.LSH and slo == shi and (hi << (slo & (63 if is64 else 31))) <= mask:
            sh = slo & (63 if is64 else 31)
            r = (lo << sh, hi << sh)
        elif op in (I.OR, I.XOR) and hi <= mask and shi <= mask:
            top = (1 << max(hi.bit_length(), shi.bit_length())) - 1
            r = (0, top)
        elif op == I.END:
            r = (0, (1 << ins.imm) - 1)
        elif op == I.MOV:
            r = (0, mask)
        if r is None:
            r = (0, mask)
        return scalar(*r, _result_align(op, d, s, 64 if is64 else 32)) or Scalar(*r)

    # -- memory --------------------------------------------------------------------------------
    def _stack_frame(self, st, ptr: StackPtr):
        return st.frames[ptr.frame]

    def check_access(self, pc, st, ptr, off, size, write):
        self._check_access(pc, ptr, off, size, write)
        self.kinds.setdefault(pc, set()).add(ptr.kind)

    def _read_stack(self, frame, at, size):
        for slot in range(at - at % 8, at + size, 8):
            pruning.mark_read(self.cp, (frame, slot))

    def _check_access(self, pc, ptr, off, size, write):
        if isinstance(ptr, Scalar):
            self.fail(pc, f"{'write to' if write else 'read from'} a number, not a pointer")
        if isinstance(ptr, OFFSET_POINTERS):
            lo, hi = ptr.lo + off, ptr.hi + off
        if isinstance(ptr, Ctx):
            if ptr.lo or ptr.hi:
                self.fail(pc, f"context access through a pointer moved {ptr.lo}..{ptr.hi} bytes off the context: "
                          "the kernel reads a context only at an instruction's offset from the context pointer "
                          "itself")
            if lo < 0 or hi + size > self.ctx_size:
                self.fail(pc, f"context access at offset {lo} of {size} bytes is outside the "
                          f"{self.ctx_size}-byte context of {self._hook_name()}")
            if lo != hi:
                self.fail(pc, "context access with a variable offset")
            if write and self.wmask.find(0, lo, lo + size) != -1:
                fld = self._field_at(lo)
                self.fail(pc, f"write to read-only context field '{fld}' of {self._hook_name()}")
            return
        if isinstance(ptr, StackPtr):
            if lo < 0 or hi + size > STACK:
                self.fail(pc, f"stack access at r10{lo - STACK:+d} of {size} bytes is outside the {STACK}-byte stack")
            if lo != hi:
                self.fail(pc, "stack access with a variable offset")
            return
        if isinstance(ptr, MapValue):
            m = self.p.maps[ptr.map]
            if lo < 0 or hi + size > m.value_size:
                self.fail(pc, f"access to map '{m.name}' value at offset {lo}..{hi} of {size} bytes is outside "
                          f"its {m.value_size}-byte value")
            return
        if isinstance(ptr, Record):
            if lo < 0 or hi + size > ptr.size:
                self.fail(pc, f"access to a {ptr.size}-byte ringbuf record at offset {lo} is out of bounds")
            return
        if isinstance(ptr, Mem):    # memory given to a bare program: its size known only at run time
            known = lo >= 0 and hi + size <= MAX_MEM_EXTENT
            if pc not in self.mem_extent or self.mem_extent[pc] is not None:
                self.mem_extent[pc] = max(self.mem_extent.get(pc) or 0, hi + size) if known else None
            return
        if isinstance(ptr, (MapValueOrNull, RecordOrNull)):
            self.fail(pc, "access through a pointer that may be null; compare it with 0 first")
        if isinstance(ptr, Released):
            self.fail(pc, f"access to a ringbuf record after it was submitted or discarded at pc {ptr.pc}")
        if isinstance(ptr, MapPtr):
            self.fail(pc, "a map reference cannot be dereferenced; use bpf_map_lookup_elem")
        self.fail(pc, f"invalid memory access through {ptr.kind}")

    def _hook_name(self):
        return f"{self.hook.island_kind}.{self.hook.name}" if self.hook else "the program"

    def _field_at(self, off):
        for name, (o, f) in self.hook.layout.items():
            if o <= off < o + f.size:
                return name
        return f"+{off}"

    def load(self, pc, st, ptr, off, size, signed):
        self.check_access(pc, st, ptr, off, size, False)
        if isinstance(ptr, StackPtr):
            fr = self._stack_frame(st, ptr)
            at = ptr.lo + off
            self._read_stack(ptr.frame, at, size)
            if not all(fr.init[at:at + size]):
                self.fail(pc, f"read of uninitialised stack at r10{at - STACK:+d}")
            if size == 8 and at in fr.spills:
                self.cp.spill(pc, (ptr.frame, at), store=False)
                return fr.spills[at]
        if signed:
            return Scalar()
        return Scalar(0, (1 << (8 * size)) - 1)

    def store(self, pc, st, ptr, off, size, val):
        self.check_access(pc, st, ptr, off, size, True)
        if isinstance(ptr, StackPtr):
            fr = self._stack_frame(st, ptr)
            at = ptr.lo + off
            for a in list(fr.spills):
                if a < at + size and at < a + 8:
                    del fr.spills[a]
            if not all(fr.init[at:at + size]):
                init = fr.init[:at] + b"\x01" * size + fr.init[at + size:]
                fr.init = self.inits.setdefault(init, init)     # one copy of each: states share it
            if isinstance(val, StackPtr) and val.frame > ptr.frame:
                self.fail(pc, "cannot spill a pointer to a callee's stack into a caller's frame: "
                          "it would outlive the callee")
            if size == 8 and at % 8 == 0:
                fr.spills[at] = val
                self.cp.spill(pc, (ptr.frame, at), store=True)
            elif is_ptr(val):
                self.fail(pc, "partial spill of a pointer to the stack")
        elif is_ptr(val):
            self.fail(pc, f"storing a pointer into {ptr.kind} would leak it")

    def atomic(self, pc, st, ins, base, val, size):
        if isinstance(base, Ctx):
            self.fail(pc, "atomic operation on the context")
        if is_ptr(val):
            self.fail(pc, "atomic operation with a pointer operand")
        self.load(pc, st, base, ins.off, size, False)
        self.store(pc, st, base, ins.off, size, Scalar())
        regs = st.top.regs
        if ins.imm == I.CMPXCHG:
            self.read(pc, regs, 0)
            regs[0] = Scalar()
        elif ins.imm & I.FETCH:
            regs[ins.src] = Scalar(0, M32 if size == 4 else M64)

    # -- helpers -----------------------------------------------------------------------------------
    def _mem_arg(self, pc, st, r, ptr, size):
        if isinstance(ptr, StackPtr):
            fr = self._stack_frame(st, ptr)
            self.check_access(pc, st, ptr, 0, size, False)
            at = ptr.lo
            self._read_stack(ptr.frame, at, size)
            if not all(fr.init[at:at + size]):
                self.fail(pc, f"r{r} points to {size} bytes of stack that are not all initialised")
        elif isinstance(ptr, OFFSET_POINTERS):
            if size:
                self.check_access(pc, st, ptr, 0, size, False)
        else:
            self.fail(pc, f"r{r} must point to memory, not {ptr.kind}")

    def helper(self, pc, hid, st):
        spec = Hl.HELPERS[hid]
        regs = st.top.regs
        mp = None
        reserve_size = 0
        if spec.ret == Hl.RET_RECORD_OR_NULL:
            size = regs[2]
            self._precise(2)
            if not isinstance(size, Scalar) or not size.constant:
                self.fail(pc, f"{spec.name} needs a constant size in r2")
            reserve_size = size.lo
        for i, kind in enumerate(spec.args, start=1):
            v = regs[i]
            if v == UNINIT:
                self.fail(pc, f"{spec.name}: argument r{i} is not set")
            if kind == Hl.MAP:
                if not isinstance(v, MapPtr):
                    self.fail(pc, f"{spec.name}: r{i} must be a map reference")
                mp = self.p.maps[v.map]
                self.call_maps.setdefault(pc, set()).add(v.map)
                if (mp.kind == "ringbuf") != spec.name.startswith("ringbuf"):
                    self.fail(pc, f"{spec.name} cannot be used on the {mp.kind} map '{mp.name}'")
            elif kind in (Hl.KEY, Hl.VALUE):
                self._mem_arg(pc, st, i, v, mp.key_size if kind == Hl.KEY else mp.value_size)
            elif kind == Hl.MEM:
                size = regs[i + 1]
                if not isinstance(size, Scalar):
                    self.fail(pc, f"{spec.name}: r{i + 1} must be a size")
                self._precise(i + 1)
                if size.hi > 1 << 16:
                    self.fail(pc, f"{spec.name}: size in r{i + 1} is unbounded")
                self._mem_arg(pc, st, i, v, size.hi)
            elif kind in (Hl.SCALAR, Hl.SIZE):
                if is_ptr(v):
                    self.fail(pc, f"{spec.name}: r{i} must be a number, not a pointer")
            elif kind == Hl.RECORD:
                if isinstance(v, Released):
                    self.fail(pc, f"{spec.name}: the record in r{i} was already submitted or discarded at pc {v.pc}")
                if not isinstance(v, Record) or (v.lo, v.hi) != (0, 0):
                    self.fail(pc, f"{spec.name}: r{i} must be a record from bpf_ringbuf_reserve, at its start")
                self._release(st, v.id, pc)
        for r in range(1, 6):
            regs[r] = UNINIT
        if spec.ret == Hl.RET_MAP_VALUE_OR_NULL:
            regs[0] = MapValueOrNull(self.p.maps.index(mp), st.next_id)
            st.next_id += 1
        elif spec.ret == Hl.RET_RECORD_OR_NULL:
            regs[0] = RecordOrNull(reserve_size, st.next_id)
            st.refs[st.next_id] = pc
            st.next_id += 1
        else:
            regs[0] = Scalar()

    # -- branches ---------------------------------------------------------------------------------
    def branch(self, pc, ins, st, work, depth):
        regs = st.top.regs
        a = self.read(pc, regs, ins.dst)
        b = self.read(pc, regs, ins.src) if ins.opcode & I.X else const(ins.imm)
        taken_pc, fall_pc = pc + 1 + ins.off, pc + 1
        op = ins.op
        if isinstance(a, (MapValueOrNull, RecordOrNull)) and b == const(0) and op in (I.JEQ, I.JNE):
            null_st, ok_st = st.copy(), st
            self._resolve_null(null_st, a, True)
            self._resolve_null(ok_st, a, False)
            if op == I.JEQ:
                self._fork(work, taken_pc, null_st, depth)
                return fall_pc
            self._fork(work, fall_pc, null_st, depth)
            return taken_pc
        if is_ptr(a) or is_ptr(b):
            self._fork(work, taken_pc, st.copy(), depth)
            return fall_pc
        outcome = self._decide(ins, a, b)
        if outcome is not None:     # decided by the ranges: they must hold wherever this path is pruned
            self._precise(ins.dst, *((ins.src,) if ins.opcode & I.X else ()))
        if outcome is True:
            self._refine(ins, st, a, b, True)
            return taken_pc
        if outcome is False:
            self._refine(ins, st, a, b, False)
            return fall_pc
        other = st.copy()
        self._refine(ins, other, a, b, True)
        self._fork(work, taken_pc, other, depth)
        self._refine(ins, st, a, b, False)
        return fall_pc

    @staticmethod
    def _resolve_null(st, ptr, is_null):
        """After a comparison with 0: every copy of a maybe-null pointer is 0, or a pointer
        to the start of its map value or record."""
        nid = ptr.id

        def fix(v):
            if type(v) is type(ptr) and v.id == nid:
                if is_null:
                    return const(0)
                return MapValue(v.map, 0, 0) if isinstance(v, MapValueOrNull) else Record(v.size, nid, 0, 0)
            return v
        st.replace_values(fix)
        if is_null and isinstance(ptr, RecordOrNull):
            st.refs.pop(nid, None)     # a failed reserve holds nothing

    @staticmethod
    def _release(st, ref, pc):
        """Submit or discard: the record is gone, and so is every copy of its pointer."""
        st.refs.pop(ref, None)
        st.replace_values(lambda v: Released(pc) if isinstance(v, Record) and v.id == ref else v)

    @staticmethod
    def _ranges(ins, a, b):
        if ins.cls == I.JMP32:
            if a.hi > M32 or b.hi > M32:
                return None
        return (a.lo, a.hi), (b.lo, b.hi)

    def _decide(self, ins, a, b):
        rr = self._ranges(ins, a, b)
        if rr is None:
            return None
        (alo, ahi), (blo, bhi) = rr
        op = ins.op
        signed_ok = ahi < 1 << (31 if ins.cls == I.JMP32 else 63) and bhi < 1 << (31 if ins.cls == I.JMP32 else 63)
        if op in (I.JSGT, I.JSGE, I.JSLT, I.JSLE):
            if not signed_ok:
                return None
            op = {I.JSGT: I.JGT, I.JSGE: I.JGE, I.JSLT: I.JLT, I.JSLE: I.JLE}[op]
        if op == I.JEQ:
            if alo == ahi == blo == bhi:
                return True
            return False if ahi < blo or bhi < alo else None
        if op == I.JNE:
            if alo == ahi == blo == bhi:
                return False
            return True if ahi < blo or bhi < alo else None
        if op == I.JGT:
            return True if alo > bhi else False if ahi <= blo else None
        if op == I.JGE:
            return True if alo >= bhi else False if ahi < blo else None
        if op == I.JLT:
            return True if ahi < blo else False if alo >= bhi else None
        if op == I.JLE:
            return True if ahi <= blo else False if alo > bhi else None
        if op == I.JSET:
            if alo == ahi and blo == bhi:
                return bool(alo & blo)
            return False if ahi == 0 or bhi == 0 else None
        return None

    def _refine(self, ins, st, a, b, taken):
        """Narrow the compared register's range on one side of a branch (against a constant)."""
        if not b.constant:
            return
        rr = self._ranges(ins, a, b)
        if rr is None:
            return
        (lo, hi), (c, _) = rr
        op = ins.op
        if op in (I.JSGT, I.JSGE, I.JSLT, I.JSLE):
            lim = 1 << (31 if ins.cls == I.JMP32 else 63)
            if hi >= lim or c >= lim:
                return
            op = {I.JSGT: I.JGT, I.JSGE: I.JGE, I.JSLT: I.JLT, I.JSLE: I.JLE}[op]
        if not taken:
            op = {I.JEQ: I.JNE, I.JNE: I.JEQ, I.JGT: I.JLE, I.JLE: I.JGT, I.JGE: I.JLT, I.JLT: I.JGE}.get(op)
        if op == I.JEQ:
            lo, hi = c, c
        elif op == I.JGT:
            lo = max(lo, c + 1)
        elif op == I.JGE:
            lo = max(lo, c)
        elif op == I.JLT:
            hi = min(hi, c - 1) if c else hi
        elif op == I.JLE:
            hi = min(hi, c)
        elif op == I.JNE:
            if lo == c:
                lo += 1
            elif hi == c:
                hi -= 1
        else:
            return
        narrowed = scalar(lo, hi, align_of(a)) if lo <= hi else None
        if narrowed is not None:
            st.top.regs[ins.dst] = narrowed


def _result_align(op: int, d: Scalar, s: Scalar, bits: int) -> int:
    """How many low bits of a ``bits``-wide operation's result are known zero, from its
    operands': exact modulo 2**bits, so wrapping, truncation to 32 bits and overflow keep it."""
    a, b = min(align_of(d), bits), min(align_of(s), bits)
    if op in (I.ADD, I.SUB, I.OR, I.XOR):
        k = min(a, b)
    elif op == I.MUL:
        k = a + b
    elif op == I.AND:
        k = max(a, b)
    elif op == I.LSH and s.constant:
        k = a + (s.lo & (bits - 1))
    elif op == I.RSH and s.constant:
        k = max(a - (s.lo & (bits - 1)), 0)
    else:
        k = 0
    return min(k, bits)


def verify(prog: Program, max_insns: int = I.VERIFY_BUDGET) -> int:
    """Verify ``prog``; returns the number of instructions explored or raises VerifierError.

    On success ``prog.proof`` maps each memory instruction's pc to the kinds of memory
    (stack, ctx, map_value, record, mem) it was proven to stay within on every path, and
    ``prog.mem_extent`` each ``mem`` access's reach (bytes from the start of the given memory,
    where bounded); the JIT drops the run-time check where no kind is ``mem``, and where it is
    only ``mem`` when the memory given at run time is at least that long.
    Nothing else escapes: a defect of the verifier itself rejects the program."""
    v = Verifier(prog, max_insns)
    try:
        return v.run()
    except VerifierError:
        raise
    except Exception as e:  # noqa: BLE001 - a verifier defect must reject, never crash the caller
        prog.proof, prog.mem_extent, prog.call_maps = None, {}, {}
        raise VerifierError(prog, v.pc, f"verifier bug ({type(e).__name__}: {e}); the program is "
                            "rejected; please report it") from None
