"""The compiled-policy cache of `fabric-run --policy X.fx` (issue 16): a policy compiles once,
a change to it or to anything it imports compiles it again, warnings are shown on every run,
and an entry that is not the cache's own write is never used."""
import subprocess
import sys

import pytest

from conftest import POLICIES
from fabric_ext import bundle_cache
from fabric_ext.runtime.machine.codecache import default_dir

LINT = ('import "{fabric}"\nworkload w {{ model: "llama3-8b"; prompt: 256; tp: 1; weights: hbm; kv: pool0 }}\n'
        "movement kv_out = kv : gpu0 -> pool0\npolicy p {{ on kv_out.issue {{ prefetch = 2 }} }}\n")


@pytest.fixture
def compiles(monkeypatch):
    """The compiles api.compile really ran."""
    ran = []
    real = bundle_cache.compile

    def counted(path, **options):
        ran.append(path)
        return real(path, **options)
    monkeypatch.setattr(bundle_cache, "compile", counted)
    return ran


def policy(tmp_path, fabric_text=None):
    fabric = tmp_path / "fabric.fx"
    fabric.write_text(fabric_text or (POLICIES / "fabrics" / "dgx_cxl.fx").read_text())
    path = tmp_path / "p.fx"
    path.write_text(LINT.format(fabric=fabric))
    return path, fabric


def test_a_policy_compiles_once_and_its_warnings_come_back_with_it(tmp_path, compiles, monkeypatch):
    monkeypatch.setenv(bundle_cache.ENV, str(tmp_path / "cache"))
    path, _ = policy(tmp_path)
    first, warned = bundle_cache.compile_cached(path)
    second, warned_again = bundle_cache.compile_cached(path)
    assert len(compiles) == 1
    assert second.files == first.files and second.summary == first.summary
    assert "warning" in warned and warned_again == warned       # prefetch with weights in HBM


def test_a_change_to_an_import_compiles_again(tmp_path, compiles, monkeypatch):
    monkeypatch.setenv(bundle_cache.ENV, str(tmp_path / "cache"))
    path, fabric = policy(tmp_path)
    bundle_cache.compile_cached(path)
    fabric.write_text(fabric.read_text().replace("64GB/s", "32GB/s", 1))
    bundle, _ = bundle_cache.compile_cached(path)
    assert len(compiles) == 2
    assert b"32" in bundle.files["manifest.json"]


def test_an_entry_that_fails_its_check_is_compiled_again_and_replaced(tmp_path, compiles, monkeypatch):
    monkeypatch.setenv(bundle_cache.ENV, str(tmp_path / "cache"))
    path, _ = policy(tmp_path)
    good, _ = bundle_cache.compile_cached(path)
    [entry] = (tmp_path / "cache").glob("*.bundle")
    data = bytearray(entry.read_bytes())
    data[-10] ^= 1                                     # one bit of one artifact
    entry.write_bytes(bytes(data))
    again, _ = bundle_cache.compile_cached(path)
    assert len(compiles) == 2 and again.files == good.files
    bundle_cache.compile_cached(path)
    assert len(compiles) == 2                          # the recompiled entry replaced it


def test_a_source_too_large_to_compile_is_not_read_whole_for_its_key(tmp_path, monkeypatch):
    """The cache's key reads the source as the compiler does (at most 1 MiB): a larger one is
    refused by compiling it, with no entry and no read of all of it."""
    from fabric_ext import api
    from fabric_ext.runtime.machine import fsutil
    monkeypatch.setenv(bundle_cache.ENV, str(tmp_path / "cache"))
    big = tmp_path / "big.fx"
    big.write_bytes(b" " * (8 << 20))
    reads = []
    real = fsutil.read_bounded
    monkeypatch.setattr(bundle_cache, "read_bounded", lambda p, limit, **kw: reads.append(limit) or real(p, limit, **kw))
    with pytest.raises(api.PolicyError, match="more than the 1 MiB allowed"):
        bundle_cache.compile_cached(big)
    assert reads == [1 << 20] and not list((tmp_path / "cache").glob("*.bundle"))


def test_a_policy_from_the_cache_loads_no_parser(tmp_path):
    """Start-up: a warm `fabric-run X.fx` reads its bundle from the cache without importing the
    compiler's front end (lark), so keying the cache reads the source with what the runtime has."""
    path, _ = policy(tmp_path)
    probe = ("import sys; from pathlib import Path; from fabric_ext import bundle_cache; "
             f"bundle_cache.compile_cached(Path({str(path)!r})); print('lark' in sys.modules)")
    env = {**__import__("os").environ, bundle_cache.ENV: str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env) for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], [r.stderr for r in runs]


def test_off_keeps_nothing(tmp_path, compiles, monkeypatch):
    monkeypatch.setenv(bundle_cache.ENV, "off")
    assert default_dir(bundle_cache.ENV, "bundles") is None
    path, _ = policy(tmp_path)
    bundle_cache.compile_cached(path)
    bundle_cache.compile_cached(path)
    assert len(compiles) == 2


def test_fabric_run_shows_the_warnings_of_a_cached_policy(tmp_path):
    path, _ = policy(tmp_path)
    env = {"FABRIC_EXT_BUNDLE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(path), "-q"],
                           capture_output=True, text=True, env=env) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0]
    assert "warning" in runs[0].stderr and runs[1].stderr == runs[0].stderr
    assert list((tmp_path / "cache").glob("*.bundle"))
