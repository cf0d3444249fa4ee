"""A program's control flow, and what it says about its runs: its local calls, whether any
instruction can run twice (`acyclic`), and whether any run can fault (`may_fault`).  No LLVM
here: the simulation asks these without loading the JIT."""
from __future__ import annotations

from . import helpers as H
from . import isa as I
from .program import Program

# helpers that return an answer (0, a pointer, -errno) for any arguments the verifier accepts:
# a run of them fails only where memory given at run time is shorter than it claims
CANNOT_FAIL = frozenset({H.MAP_LOOKUP_ELEM, H.MAP_UPDATE_ELEM, H.MAP_DELETE_ELEM, H.GET_SMP_PROCESSOR_ID,
                         H.KTIME_GET_NS, H.GET_PRANDOM_U32, H.RINGBUF_OUTPUT, H.RINGBUF_RESERVE,
                         H.RINGBUF_SUBMIT, H.RINGBUF_DISCARD})


def local_calls(slots) -> list[tuple[int, I.Insn]]:
    """Each call of a subprogram (a local call): its pc and instruction."""
    return [(pc, ins) for pc, ins in enumerate(slots)
            if ins is not None and ins.opcode == I.JMP | I.CALL and ins.src == I.PSEUDO_CALL]


def acyclic(prog: Program) -> bool:
    """No local call and no cycle in the control-flow graph, reachable or not: then no
    instruction runs twice.  (LLVM lays out straight-line code with backward jumps too: a
    shared tail placed before the branch that reaches it.)"""
    slots = prog.slots
    n = len(slots)

    def successors(pc: int) -> tuple[int, ...]:
        ins = slots[pc]
        if ins.cls not in (I.JMP, I.JMP32) or ins.op == I.CALL:
            return (pc + ins.slots,)
        if ins.op == I.EXIT:
            return ()
        target = pc + 1 + ins.jump_offset
        return (target,) if ins.op == I.JA else (pc + 1, target)

    if local_calls(slots):
        return False
    state = [0] * n                 # 0 unvisited, 1 on the path, 2 done
    for root in range(n):
        if slots[root] is None or state[root]:
            continue
        stack = [(root, iter(successors(root)))]
        state[root] = 1
        while stack:
            pc, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[pc] = 2
                stack.pop()
            elif 0 <= nxt < n and slots[nxt] is not None:
                if state[nxt] == 1:
                    return False
                if state[nxt] == 0:
                    state[nxt] = 1
                    stack.append((nxt, iter(successors(nxt))))
    return True


def helpers_called(prog: Program) -> set[int]:
    """The helper ids the program's code calls."""
    return {ins.imm for ins in prog.insns if ins.opcode == I.JMP | I.CALL and ins.src == 0}


def may_fault(prog: Program, budget: int = I.RUN_BUDGET) -> str | None:
    """Why a run of the verified ``prog`` on a whole context might fault, or None when none
    can, on any backend that keeps its maps in this process (the interpreter, the JIT): no
    instruction runs twice and there are no more than ``budget`` of them, so the budget holds;
    every access was proven within memory of a size known before the run (the stack, the
    context, a map value, a ringbuf record), so no bounds check can fail; and every helper it
    calls answers whatever arguments the verifier let through (`CANNOT_FAIL`)."""
    if prog.proof is None:
        return "it was not verified"
    if not acyclic(prog):
        return "it has a loop or a local call: its instruction budget may run out"
    if len(prog.slots) > budget:
        return f"it is longer than the instruction budget of {budget}"
    if any("mem" in kinds for kinds in prog.proof.values()):
        return "it reads memory whose length is known only at run time"
    failing = helpers_called(prog) - CANNOT_FAIL
    if failing:
        return f"it calls helper {', '.join(H.HELPERS[h].name for h in sorted(failing))}, which may fail"
    return None
