"""Packing hook contexts from the hook catalogue: the runtime's side of fabric.h."""
from __future__ import annotations

import struct

_FMT = {"u32": "<I", "u64": "<Q"}


class ContextCodec:
    """Fills a hook's context struct and reads its decisions back, by field name."""

    def __init__(self, hook):
        self.hook = hook
        self.size = hook.ctx_size
        self._fields = [(name, off, _FMT[f.ctype], f) for name, (off, f) in hook.layout.items()]
        self._offs = {name: (off, fmt) for name, off, fmt, _ in self._fields}
        self._decisions = [(n, off, fmt) for n, off, fmt, f in self._fields if f.decision]
        self._template = bytearray(self.size)
        for n, off, fmt, f in self._fields:
            if f.decision:
                struct.pack_into(fmt, self._template, off, f.default)

    def pack(self, values: dict[str, int] | None = None, **kw) -> bytearray:
        """A context with the given inputs and every decision at its default."""
        buf = bytearray(self._template)
        for name, v in (values or {}).items() | kw.items():
            off, fmt = self._offs[name]
            struct.pack_into(fmt, buf, off, int(v) & (0xFFFFFFFF if fmt == "<I" else 0xFFFFFFFFFFFFFFFF))
        return buf

    def get(self, buf, name: str) -> int:
        off, fmt = self._offs[name]
        return struct.unpack_from(fmt, buf, off)[0]

    def decisions(self, buf) -> dict[str, int]:
        return {n: struct.unpack_from(fmt, buf, off)[0] for n, off, fmt in self._decisions}

    def changed(self, buf) -> dict[str, int]:
        """Decisions whose value differs from the default (what the program decided)."""
        return {n: v for n, v in self.decisions(buf).items() if v != self.hook.field(n).default}
