"""Choosing a VM backend by name.  It sits above the backends (program.py, which they all
import, names none of them)."""
from __future__ import annotations

from .errors import UsageError
from .program import JIT_CHECKS, Backend


def get_backend(name: str, jit_checks: str | None = None, **kw) -> Backend:
    """The backend called ``name``: ``interp``, ``jit``, ``kernel`` or ``auto`` (jit where it works).
    ``jit_checks`` is the JIT's ``checks``; with another backend it has no effect (the
    interpreter checks every access, the kernel's verifier decides), so it is a `UsageError`."""
    if jit_checks is not None and jit_checks not in JIT_CHECKS:     # (before "auto" could fall back on it)
        raise UsageError(f"JIT checks must be one of {', '.join(JIT_CHECKS)}, not '{jit_checks}'")
    if jit_checks is not None and name not in ("jit", "auto"):
        raise UsageError(f"--jit-checks {jit_checks} is for the JIT (--backend jit); the {name} backend "
                         + ("checks every access anyway" if name == "interp" else "runs what the kernel's verifier accepts"))
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
