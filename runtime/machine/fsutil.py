"""Writing files so that a failure never leaves them half-written, nor removes what we did not write."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from .errors import InputError, OutputError


def printable(text: str) -> str:
    """``text`` as any file can hold it in UTF-8 (LLVM's debug info, a listing, a report): the
    bytes of a file name in it that are not UTF-8, which Python keeps as lone surrogates,
    shown as U+FFFD."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode(errors="surrogateescape").decode(errors="replace")


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of ``text`` in UTF-8 (`printable`)."""
    atomic_write_bytes(path, printable(text).encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write the file whole or not at all (a temporary file renamed over it), with the mode it
    had, or for a new file the one the umask gives (a temporary file's own is 0600).  Through
    a symbolic link, the file it names is replaced and the link kept; a device or a pipe
    (``/dev/stdout``) is written as a stream, never replaced.  Raises `OutputError`, naming
    the path and why, where it cannot write."""
    path = Path(path)
    kind = check_output(path)
    try:
        if kind == "stream":
            with open(path, "wb") as f:
                f.write(data)
            return
        _replace_file(Path(os.path.realpath(path)), data)
    except BrokenPipeError:     # a reader of the stream gone: the tools' own way out (`stdout_closed`)
        raise
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}; choose another path") from None


def check_output(path: Path, folder: bool = False) -> str:
    """Whether ``path`` may be written as an output file (``folder``: as an output folder)
    before any work is done for it: "new", "file" (one there, to be replaced) or "stream" (a
    device or a pipe); raises `OutputError` where a file above it stands where a folder must,
    or it is a folder where a file is asked for (or the other way round)."""
    above = next((p for p in Path(path).parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise OutputError(f"cannot write {path}: {above} is a file, not a folder; choose an output path elsewhere")
    try:
        mode = os.stat(path).st_mode        # (through a link)
    except FileNotFoundError:
        return "new"
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}; choose another path") from None
    if folder != stat.S_ISDIR(mode):
        raise OutputError(f"cannot write {path}: it is {'not ' * folder}a folder; "
                          f"name {'a folder' if folder else 'a file'} for this output")
    return "file" if folder or stat.S_ISREG(mode) else "stream"


def _replace_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


MAX_OUTPUT_MANIFEST = 64 << 20     # bytes of the manifest of an output folder to be replaced


class UnreadableFile(InputError):
    """A file an input may not be read from: not a regular file, or too large."""


def read_bounded(path: Path, limit: int, follow_links: bool = True) -> bytes:
    """The bytes of an untrusted input file: a regular file (a link to one where
    ``follow_links``; never a device or fifo, which could block or never end) of at most
    ``limit`` bytes, read with that bound even if it grows meanwhile.  Raises `UnreadableFile`,
    or OSError where it cannot be opened."""
    st = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableFile("it is not a regular file" + ("" if follow_links else " (a link or a device)"))
    if st.st_size > limit:
        raise UnreadableFile(f"it is {st.st_size} bytes, more than the {_size(limit)} allowed")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFile(f"it is more than the {_size(limit)} allowed")
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def check_replaceable(target: Path, manifest: str = "manifest.json") -> None:
    """``target`` may be replaced only if it does not exist, is empty, or is an earlier output of
    ours: a folder whose ``manifest`` lists (under ``files``) every other entry in it.  Anything
    else would lose what the user put there."""
    if target.is_symlink():
        raise OutputError(f"{target} exists and is not a folder; choose a folder for the output")
    if check_output(target, folder=True) == "new":
        return
    entries = {p.name for p in target.iterdir()}
    if not entries:
        return
    try:     # (bounded, and a regular file: a pipe named so would never end)
        man = json.loads(read_bounded(target / manifest, MAX_OUTPUT_MANIFEST, follow_links=False))
        ours = set(man["files"]) | {manifest}
    except (OSError, ValueError, KeyError, TypeError):
        raise OutputError(f"{target} is not empty and is not an earlier fabricc output (no readable "
                          f"{manifest}); fabricc will not replace it: choose a new or empty folder") from None
    foreign = sorted(entries - ours)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(f"{target} holds what fabricc did not write ({shown}); fabricc removes nothing it "
                          "did not write: move those away or choose another folder")


def replace_dir(staging: Path, target: Path) -> None:
    """Move a fully written ``staging`` folder into place at ``target`` (see `check_replaceable`),
    with the mode the old folder had (a new one: the umask's)."""
    check_replaceable(target)
    if target.is_dir():
        mode = target.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o777 & ~umask
    os.chmod(staging, mode)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old.{os.getpid()}")
        os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
