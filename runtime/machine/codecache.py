"""Compiled programs kept on disk between runs, so a policy is compiled to native code once.

An entry is the object code of one lifted program, named by a digest of
everything that code depends on: the program's bytes, its maps' shapes, the
context's writable bytes, the verifier's proof, the compiler's own source
(`lift`, `jit`, `maps`, `isa`), llvmlite's and LLVM's versions, the target
triple and the host CPU with its features (`host_target`).  The code holds no
address of the process that made it (see `lift`), so an entry serves any later
process on the same kind of CPU.

The cache lives in ``$FABRIC_EXT_JIT_CACHE``, else ``$XDG_CACHE_HOME/fabric_ext/jit``,
else ``~/.cache/fabric_ext/jit``; ``FABRIC_EXT_JIT_CACHE=off`` turns it off.  Entries
are written whole (a temporary file renamed into place).

Native code from disk runs with the user's rights, so the cache trusts only
what it wrote itself: each entry carries an HMAC-SHA256, under a per-user key
kept 0600 in the folder (``key``), of its own name and its code.  An entry that
is planted, damaged, truncated, or another program's (renamed) fails the check
and is a miss: recompiled and replaced, never run.  A folder that is group- or
world-writable, or owned by someone else, is not used at all (said once, on
standard error), and neither is a key file others can read or that is not ours.
Nothing in the cache is needed: deleting the folder only costs a compile.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
import stat
import sys
import tempfile
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

MAGIC = b"FXJITOB2"          # 2: authenticated entries
MAX_BYTES = 256 << 20        # a cache folder's entries together, at most: past it the least recently used go
KEY_FILE, KEY_SIZE = "key", 32
_warned: set[tuple[str, str]] = set()    # (cache, reason) already said in this process
_SOURCES = ("lift.py", "native_lib.py", "irtext.py", "jit.py", "maps.py", "isa.py")


def default_dir(env: str = "FABRIC_EXT_JIT_CACHE", name: str = "jit",
                what: str = "the JIT code cache") -> Path | None:
    """Where a cache lives (``$env``, else ``$XDG_CACHE_HOME/fabric_ext/NAME``, else
    ``~/.cache/fabric_ext/NAME``), or None when ``$env`` is off or there is no home to keep
    it in (said once)."""
    where = os.environ.get(env)
    if where is not None:
        return None if where.strip().lower() in ("", "off", "0", "no") else Path(where)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except (RuntimeError, KeyError):    # no $HOME and no passwd entry: a container's bare uid
            _say_once(what, f"there is no home folder (no $HOME, and uid {os.getuid()} has no passwd "
                            f"entry)", env)
            return None
    return Path(base) / "fabric_ext" / name


def _say_once(what: str, why: str, env: str) -> None:
    """Tell, once per process and reason, that a cache is not used and why."""
    if (what, why) not in _warned:
        _warned.add((what, why))
        print(f"fabric_ext: {what} is not used: {why}; what it keeps is made again every run "
              f"(set {env} to a folder of your own, or 'off')", file=sys.stderr)


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
    cpu, features = host_target()
    h.update(f"{llvmlite.__version__} {llvm.llvm_version_info} {llvm.get_default_triple()} {cpu} {features}".encode())
    return h.digest()


@functools.cache
def host_target() -> tuple[str, str]:
    """The CPU this process runs on and its features, as LLVM names them (no features where
    LLVM cannot tell them: it then goes by the CPU's name alone): the JIT compiles for them,
    and they are part of every entry's name, so code made on one CPU is never read on
    another that may lack an instruction it uses (a cache folder on a shared home).  Asked
    once per process: the cache's salt and each JIT tier read it."""
    llvm.initialize_native_target()
    try:
        features = llvm.get_host_cpu_features().flatten()
    except RuntimeError:
        features = ""
    return llvm.get_host_cpu_name(), features


def _unsafe(st: os.stat_result, what: str, private: bool) -> str | None:
    """Why a file or folder with status ``st`` cannot be trusted (None if it can)."""
    if st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not by you"
    if st.st_mode & (0o077 if private else 0o022):
        return f"{what} has mode {stat.S_IMODE(st.st_mode):o} (others can {'read' if private else 'write'} it)"
    return None


class CodeCache:
    """Object code by digest, in one folder (None: a cache that keeps nothing).  Any other
    blob the project computes once and trusts only as its own write can be kept the same
    way: ``salt`` is what every entry depends on (default: the JIT's sources and LLVM),
    ``what`` and ``env`` name the cache in the one message that says it is not used."""

    def __init__(self, directory: Path | None, salt: bytes | None = None, what: str = "the JIT code cache",
                 env: str = "FABRIC_EXT_JIT_CACHE", suffix: str = ".o", max_bytes: int = MAX_BYTES):
        self.dir, self.what, self.env, self.suffix = directory, what, env, suffix
        self.max_bytes = max_bytes
        self.salt = _compiler_salt() if salt is None else salt
        self.hits = self.misses = 0
        self.error = ""          # the last reason an entry could not be written
        self.refused = ""        # why the folder is not used at all
        self._key: bytes | None = None
        if directory is not None:
            self._open()

    def _open(self):
        """Make or check the folder and its key; on any doubt, use no cache and say so once."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = _unsafe(os.stat(self.dir), str(self.dir), private=False)
            if why is None:
                self._key, why = self._read_key()
        except OSError as e:
            why = f"{self.dir}: {e.strerror or e}"
        if why is not None:
            self.refused, self.dir = why, None
            _say_once(self.what, why, self.env)

    def _make_key(self, path: Path) -> None:
        """Make the folder's key unless there is one.  It appears whole or not at all (written
        aside, then linked into place, which fails if another run got there first): runs
        started together on an empty folder would otherwise read each other's empty file."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".key-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_SIZE))
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)

    def _read_key(self) -> tuple[bytes | None, str | None]:
        path = self.dir / KEY_FILE
        if not os.path.lexists(path):
            self._make_key(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            why = _unsafe(st, str(path), private=True)
            if why is None and not stat.S_ISREG(st.st_mode):
                why = f"{path} is not a regular file"
            key = f.read(KEY_SIZE + 1)
        if why is None and len(key) != KEY_SIZE:
            why = f"{path} is not a key of {KEY_SIZE} bytes"
        return (None, why) if why else (key, None)

    def _tag(self, key: str, obj: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + obj, hashlib.sha256).digest()

    def key(self, *parts: bytes) -> str:
        h = hashlib.sha256(self.salt)
        for p in parts:
            h.update(len(p).to_bytes(8, "little") + p)
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{self.suffix}"

    def get(self, key: str) -> bytes | None:
        """The entry's object code, or None when it is absent or fails its check."""
        if self.dir is None:
            return None
        try:
            data = self._path(key).read_bytes()
        except OSError:
            data = b""
        head, tag, obj = data[:8], data[8:40], data[40:]
        if head == MAGIC and hmac.compare_digest(tag, self._tag(key, obj)):
            self.hits += 1
            try:
                os.utime(self._path(key))      # used now: the last to go (`_prune`)
            except OSError:
                pass
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
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=self.suffix)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + self._tag(key, obj) + obj)
            os.replace(tmp, self._path(key))
            tmp = None
            self._prune()
        except OSError as e:
            self.error = f"{self.dir}: {e.strerror or e}"
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _prune(self) -> None:
        """Past ``max_bytes`` of entries, remove the least recently used (written or read)
        until they take three quarters of it: a cache of every policy and program ever run
        would only grow.  Another run may be reading one: it misses and compiles again."""
        entries = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(self.suffix) and not e.name.startswith("."):
                    st = e.stat(follow_symlinks=False)
                    entries.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return
        for _, size, path in sorted(entries):
            if total <= self.max_bytes * 3 // 4:
                break
            try:
                os.unlink(path)
                total -= size
            except FileNotFoundError:       # (another run pruned it)
                total -= size
