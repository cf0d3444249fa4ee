"""The verifier's abstract machine state: per path, its frames (registers, which stack bytes
are initialised, what is spilled where) and the ringbuf records it holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Frame:
    regs: list
    init: bytes              # per stack byte: initialised?  Immutable, so copies and keys share it
    spills: dict             # 8-aligned offset (from frame bottom) -> register value
    ret_pc: int = -1

    def copy(self):
        return Frame(list(self.regs), self.init, dict(self.spills), self.ret_pc)

    def key(self):
        return (tuple(self.regs), self.init, tuple(sorted(self.spills.items())), self.ret_pc)


class State:
    """One path's abstract machine: its frames, and the ringbuf records it holds (reference
    id -> pc of the reserve), each of which must be submitted or discarded before exit."""
    __slots__ = ("frames", "next_id", "refs")

    def __init__(self, frames, next_id=1, refs=None):
        self.frames, self.next_id = frames, next_id
        self.refs: dict[int, int] = refs if refs is not None else {}

    @property
    def top(self) -> Frame:
        return self.frames[-1]

    def copy(self):
        return State([f.copy() for f in self.frames], self.next_id, dict(self.refs))

    def key(self):
        return tuple(f.key() for f in self.frames), tuple(sorted(self.refs.items()))

    def replace_values(self, fix):
        """Apply ``fix`` to every register and spilled value of every frame."""
        for f in self.frames:
            f.regs = [fix(v) for v in f.regs]
            f.spills = {k: fix(v) for k, v in f.spills.items()}
