"""Compiled programs kept on disk between runs, so a policy is compiled to native code once.

An entry is the object code of one lifted program, named by a digest of
everything that code depends on: the program's bytes, its maps' shapes, the
context's writable bytes, the verifier's proof, the compiler's own source
(`lift`, `jit`, `maps`, `isa`), llvmlite's and LLVM's versions and the target
triple.  The code holds no address of the process that made it (see `lift`),
so an entry serves any later process.

The cache lives in ``$FABRIC_EXT_JIT_CACHE``, else ``$XDG_CACHE_HOME/fabric_ext/jit``,
else ``~/.cache/fabric_ext/jit``; ``FABRIC_EXT_JIT_CACHE=off`` turns it off.  Entries
are written whole (a temporary file renamed into place) and checked against
their own SHA-256 when read, so a truncated or damaged entry is recompiled,
never run.  Nothing in it is needed: deleting the folder only costs a compile.
The cache is trusted like ``__pycache__``: whoever can write the folder can
change what runs.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

MAGIC = b"FXJITOB1"
_SOURCES = ("lift.py", "jit.py", "maps.py", "isa.py")


def default_dir() -> Path | None:
    """Where the cache lives, or None when ``FABRIC_EXT_JIT_CACHE=off``."""
    where = os.environ.get("FABRIC_EXT_JIT_CACHE")
    if where is not None:
        return None if where.strip().lower() in ("", "off", "0", "no") else Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fabric_ext" / "jit"


def _compiler_salt() -> bytes:
    """What every entry depends on besides its program: a change to the compiler's source
    or to LLVM makes every older entry a miss."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    try:
        for name in _SOURCES:
            h.update(name.encode() + b"\0" + (here / name).read_bytes())
    except OSError:             # no source to tell versions apart: share nothing with other runs
        h.update(os.urandom(16))
    h.update(f"{llvmlite.__version__} {llvm.llvm_version_info} {llvm.get_default_triple()}".encode())
    return h.digest()


class CodeCache:
    """Object code by digest, in one folder (None: a cache that keeps nothing)."""

    def __init__(self, directory: Path | None):
        self.dir = directory
        self.salt = _compiler_salt()
        self.hits = self.misses = 0
        self.error = ""          # the last reason an entry could not be written

    def key(self, *parts: bytes) -> str:
        h = hashlib.sha256(self.salt)
        for p in parts:
            h.update(len(p).to_bytes(8, "little") + p)
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.o"

    def get(self, key: str) -> bytes | None:
        """The entry's object code, or None when it is absent or fails its check."""
        if self.dir is None:
            return None
        try:
            data = self._path(key).read_bytes()
        except OSError:
            data = b""
        head, digest, obj = data[:8], data[8:40], data[40:]
        if head == MAGIC and hashlib.sha256(obj).digest() == digest:
            self.hits += 1
            return obj
        self.misses += 1
        return None

    def put(self, key: str, obj: bytes) -> None:
        """Store an entry whole or not at all; a folder that cannot be written only costs
        later runs a compile (the reason is kept in ``error``)."""
        if self.dir is None:
            return
        tmp = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".o")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(obj).digest() + obj)
            os.replace(tmp, self._path(key))
            tmp = None
        except OSError as e:
            self.error = f"{self.dir}: {e.strerror or e}"
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
