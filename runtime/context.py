"""Packing hook contexts from the hook catalogue: the runtime's side of fabric.h."""
from __future__ import annotations

import ctypes
import struct

import numpy as np

_FMT = {"u32": "<I", "u64": "<Q"}
_MASK = {"<I": 0xFFFFFFFF, "<Q": 0xFFFFFFFFFFFFFFFF}


class ContextCodec:
    """Fills a hook's context struct and reads its decisions back, by field name.

    Fields the hook does not have are ignored, so one dict of event fields can
    serve every hook that fires for an event."""

    def __init__(self, hook):
        self.hook = hook
        self.size = hook.ctx_size
        self._offs = {name: (off, struct.Struct(_FMT[f.ctype])) for name, (off, f) in hook.layout.items()}
        self._decisions = [(n, off, struct.Struct(_FMT[f.ctype]), f.default)
                           for n, (off, f) in hook.layout.items() if f.decision]
        self._template = bytearray(self.size)
        for n, off, st, default in self._decisions:
            st.pack_into(self._template, off, default)
        self.buffer = ctypes.create_string_buffer(self.size)   # reused by `fill`
        self._template_bytes = bytes(self._template)
        self._plans: dict[tuple, tuple] = {}
        # every decision read back with one unpack, compared with the defaults at once
        if self._decisions:
            start = self._decisions[0][1]
            fmt, pos = "<", start
            for n, off, st, _ in self._decisions:
                fmt += "x" * (off - pos) + st.format[-1]
                pos = off + st.size
            self._dec_struct, self._dec_start = struct.Struct(fmt), start
            self._dec_names = [n for n, *_ in self._decisions]
            self._dec_defaults = tuple(d for *_, d in self._decisions)

    def pack(self, values: dict[str, int] | None = None, **kw) -> bytearray:
        """A new context with the given inputs and every decision at its default."""
        buf = bytearray(self._template)
        self._write(buf, values or {})
        self._write(buf, kw)
        return buf

    def fill(self, values: dict[str, int]):
        """The codec's own reusable buffer, filled: no allocation per event."""
        buf = self.buffer
        ctypes.memmove(buf, self._template_bytes, self.size)
        self._write(buf, values)
        return buf

    def _layout_for(self, names: tuple):
        """One struct covering the given fields in offset order (cached per set of names).

        Padding between them packs as zeros, which is safe: every hook lays its inputs out
        before its decisions, and only inputs are filled this way."""
        hit = self._plans.get(names)
        if hit is None:
            fields = sorted((self._offs[n][0], n, self._offs[n][1]) for n in names if n in self._offs)
            fmt, pos, order, masks = "<", fields[0][0] if fields else 0, [], []
            start = pos
            for off, n, st in fields:
                fmt += "x" * (off - pos) + st.format[-1]
                pos = off + st.size
                order.append(n)
                masks.append(0xFFFFFFFF if st.size == 4 else 0xFFFFFFFFFFFFFFFF)
            hit = self._plans[names] = (struct.Struct(fmt), start, order, masks)
        return hit

    def _write(self, buf, values):
        if not values:
            return
        st, start, order, masks = self._layout_for(tuple(values))
        st.pack_into(buf, start, *[int(values[n]) & m for n, m in zip(order, masks)])

    def pack_many(self, rows: list[dict[str, int]]) -> np.ndarray:
        """A 2-D uint8 array of contexts, one row per event (for batch runs); rows share keys."""
        out = np.tile(np.frombuffer(bytes(self._template), dtype=np.uint8), (len(rows), 1))
        if rows:
            for name in rows[0]:
                hit = self._offs.get(name)
                if hit is None:
                    continue
                off, st = hit
                col = np.array([r[name] for r in rows], dtype="<u4" if st.size == 4 else "<u8")
                out[:, off:off + st.size] = col.view(np.uint8).reshape(len(rows), st.size)
        return out

    def get(self, buf, name: str) -> int:
        off, st = self._offs[name]
        return st.unpack_from(buf, off)[0]

    def decisions(self, buf) -> dict[str, int]:
        return {n: st.unpack_from(buf, off)[0] for n, off, st, _ in self._decisions}

    def changed(self, buf) -> dict[str, int]:
        """Decisions whose value differs from the default (what the program decided)."""
        if not self._decisions:
            return {}
        values = self._dec_struct.unpack_from(buf, self._dec_start)
        if values == self._dec_defaults:
            return {}
        return {n: v for n, v, d in zip(self._dec_names, values, self._dec_defaults) if v != d}
