"""Choosing a VM backend by name.  It sits above the backends (program.py, which they all
import, names none of them)."""
from __future__ import annotations

from .program import Backend


def get_backend(name: str, jit_checks: str | None = None, **kw) -> Backend:
    """The backend called ``name``: ``interp``, ``jit``, ``kernel`` or ``auto`` (jit where it works).
    ``jit_checks`` is the JIT's ``checks`` (the other backends check every access anyway)."""
    if name in ("jit", "auto"):
        try:
            from .jit import JitBackend  # LLVM is loaded only for the JIT
            return JitBackend(checks=jit_checks, **kw)
        except Exception:  # noqa: BLE001 - no native target: fall back to the interpreter
            if name == "jit":
                raise
    if name in ("interp", "auto"):
        from .interp import Interpreter
        return Interpreter(**kw)
    if name == "kernel":
        from .kernel import KernelBackend
        return KernelBackend(**kw)
    raise ValueError(f"unknown backend '{name}' (available: interp, jit, kernel)")
