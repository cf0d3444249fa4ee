"""Compiled policies kept between runs, so `fabric-run --policy X.fx` compiles a policy once.

An entry is a compiled bundle (every artifact, the compiler's summary and its warnings as
shown), named by a digest of the policy's path, its text and the compile options, salted with
every source file of the installed package (a new compiler, catalogue or figure makes every
older entry a miss).  Imports are checked on reading: the manifest lists each source with its
sha256, and an entry whose sources changed since is a miss (a file added earlier in the
import search path, which would now shadow one the entry was compiled from, is not noticed:
`FABRIC_EXT_BUNDLE_CACHE=off`, or delete the folder).  The store is the JIT's
(`machine.codecache.CodeCache`): entries written whole, each authenticated with an HMAC under
a per-user key, a folder others can write not used.  It lives in ``$FABRIC_EXT_BUNDLE_CACHE``,
else ``~/.cache/fabric_ext/bundles``; ``off`` keeps nothing.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from functools import lru_cache
from pathlib import Path

from fabric_ext.contract.bundle import source_states
from fabric_ext.contract.schema import MAX_SOURCE
from fabric_ext.runtime.machine.codecache import CodeCache, default_dir
from fabric_ext.runtime.machine.fsutil import read_bounded

from .api import Bundle, compile

ENV = "FABRIC_EXT_BUNDLE_CACHE"
PACKAGES = ("fabric_ext", "fabric_ext.codegen", "fabric_ext.runtime")
SUFFIXES = {".py", ".lark", ".json", ".j2", ".fx"}
MAGIC = b"FXBUNDL1"


@lru_cache(maxsize=1)
def _salt() -> bytes:
    """A digest of every file the compiler's output can depend on."""
    h = hashlib.sha256(MAGIC)
    for pkg in PACKAGES:
        for root in importlib.util.find_spec(pkg).submodule_search_locations:
            for p in sorted(Path(root).rglob("*")):
                if p.suffix in SUFFIXES and "__pycache__" not in p.parts:
                    h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.digest()


def compile_cached(path: Path, cache: CodeCache | None = None, **options) -> tuple[Bundle, str]:
    """The bundle of the policy at ``path`` (raises `api.PolicyError` as `api.compile` does) and
    its warnings as the compiler renders them: from the cache where an entry is current."""
    path = Path(path).resolve()
    try:
        source = read_bounded(path, MAX_SOURCE)
    except (OSError, ValueError):       # not a source the compiler reads (compiling says why): no entry
        source = None
    cache = cache if cache is not None else open_cache()
    key = cache.key(os.fsencode(path), source, json.dumps(options, sort_keys=True).encode()) \
        if source is not None else None
    hit = _unpack(cache.get(key), str(path)) if key else None
    if hit is not None and all(state == "same" for _, state in source_states(hit[0].manifest)):
        return hit
    bundle = compile(path, **options)
    warnings = bundle.diagnostics.rendered() if bundle.diagnostics else ""
    if key:
        cache.put(key, _pack(bundle, warnings))
    return bundle, warnings


def open_cache() -> CodeCache:
    what = "the compiled-policy cache"
    return CodeCache(default_dir(ENV, "bundles", what), _salt(), what=what, env=ENV, suffix=".bundle")


def _pack(bundle: Bundle, warnings: str) -> bytes:
    # (warnings name the policy's path: bytes of it that are not UTF-8 kept as they are)
    parts = [("#warnings", warnings.encode(errors="surrogateescape")), ("#summary", "\n".join(bundle.summary).encode()),
             *sorted(bundle.files.items())]
    return b"".join(struct.pack("<II", len(n.encode()), len(d)) + n.encode() + d for n, d in parts)


def _unpack(blob: bytes | None, name: str) -> tuple[Bundle, str] | None:
    """An entry back (it passed its HMAC, so it is ours; read defensively all the same)."""
    if not blob:
        return None
    files, at = {}, 0
    try:
        while at < len(blob):
            n, d = struct.unpack_from("<II", blob, at)
            at += 8
            files[blob[at:at + n].decode()] = blob[at + n:at + n + d]
            at += n + d
        warnings, summary = files.pop("#warnings").decode(errors="surrogateescape"), files.pop("#summary").decode()
        manifest = json.loads(files["manifest.json"])
    except (struct.error, KeyError, UnicodeDecodeError, ValueError):
        return None
    return Bundle(manifest, files, name, None, tuple(summary.splitlines())), warnings
