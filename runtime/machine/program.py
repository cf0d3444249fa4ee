"""A loaded eBPF program and the small interface every VM backend implements."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import isa
from .errors import FabricError, line_window
from .isa import Insn


@dataclass(frozen=True)
class SourceLine:
    file: str
    line: int
    col: int
    text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}" + (f": {self.excerpt()}" if self.text.strip() else "")

    def excerpt(self, width: int = 100) -> str:
        """The line's text, cut to ``width`` characters around the column where it is longer
        (a line of an object's BTF may be any length)."""
        text = self.text.rstrip()
        if len(text.strip()) <= width:
            return text.strip()
        return line_window(text, self.col, width)[0].lstrip()    # the column counts from the line's start


@dataclass
class Program:
    """Relocated instructions plus what they refer to.

    ``lddw`` with src 1 has imm = index into ``maps``; with src 2, imm = map
    index and next_imm = offset into that (one-entry array) map's value.
    Local calls have been resolved to pc-relative offsets.
    """
    name: str
    insns: list[Insn]
    maps: list = field(default_factory=list)          # runtime.maps.Map, by index
    hook: object | None = None                        # fabric_ext.contract.hooks.Hook or None (bare)
    ctx_size: int = 0
    line_info: dict[int, SourceLine] = field(default_factory=dict)  # slot -> source
    section: str = ""
    proof: dict | None = None   # set by the verifier: pc -> memory kinds its access is proven in
    mem_extent: dict = field(default_factory=dict)   # ... pc -> bytes of given memory (mem) it reaches at most
    call_maps: dict = field(default_factory=dict)    # ... pc of a map helper call -> the one map it is on

    def __post_init__(self):
        self.slots = isa.to_slots(self.insns)
        if self.hook is not None and not self.ctx_size:
            self.ctx_size = self.hook.ctx_size

    @property
    def code(self) -> bytes:
        return isa.encode(self.insns)

    def where(self, pc: int) -> str:
        ins = self.slots[pc] if 0 <= pc < len(self.slots) else None
        text = isa.disasm_insn(ins, pc) if ins is not None else "?"
        src = self.source_line(pc)
        return f"{self.name} pc {pc}: {text}" + (f" ({src})" if src else "")

    def source_line(self, pc: int) -> SourceLine | None:
        best = None
        for slot in sorted(self.line_info):
            if slot > pc:
                break
            best = self.line_info[slot]
        return best


class VMFault(FabricError, RuntimeError):
    """A run-time fault: names the program, pc, instruction and source line."""

    def __init__(self, program: Program, pc: int, reason: str):
        self.program, self.pc, self.reason = program, pc, reason
        self.row = 0      # in a batch run: the context that faulted
        super().__init__(f"{program.where(pc)}: {reason}")


#: the JIT's run-time bounds checks: on accesses the verifier did not prove, or on all (docs/security.md)
JIT_CHECKS = ("unproven", "all")


class ProofViolation(VMFault):
    """A fault at an access the verifier proved safe: a defect of the verifier, found by the
    interpreter's proof checking (the JIT would have run that access unchecked)."""


class Backend:
    """A VM backend: load a verified program once, run it many times.

    ``run`` takes the context as a writable buffer (decisions come back in it)
    and optional memory for bare programs (r1 = memory, r2 = its length), and
    returns r0.  Faults raise `VMFault`.
    """
    name = "?"
    host_maps = False     # programs work on the `Map` objects' own buffers (so the shims may read them)

    def load(self, program: Program):
        return program

    def run(self, handle, ctx: bytearray | None = None, mem: bytearray | None = None) -> int:
        raise NotImplementedError

    def run_batch(self, handle, ctxs) -> int:
        """Run the program on every row of a 2-D uint8 array of contexts, in order and in place
        (decisions come back in the rows); returns the rows run.  A fault stops the batch: the
        `VMFault` carries the faulting row as ``row``.  Backends with a native batch entry
        override this loop."""
        for i, row in enumerate(ctxs):
            buf = bytearray(row.tobytes())
            try:
                self.run(handle, buf)
            except VMFault as e:
                e.row = i
                raise
            row[:] = memoryview(buf)
        return len(ctxs)

    def load_stats(self) -> dict:
        """How loading made the programs ready (backends that compile say what it cost)."""
        return {}

    def close(self) -> None:
        pass
