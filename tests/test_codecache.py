"""The JIT's on-disk code cache: entries read back whole or not at all, compiled code that
holds no address of the process that made it, and a later fabric-run that compiles nothing."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from fabric_ext.runtime.machine import codecache, jit
from fabric_ext.runtime.machine import isa as I
from fabric_ext.runtime.machine.codecache import CodeCache, default_dir
from fabric_ext.runtime.machine.maps import ARRAY, HASH, LRU_HASH, Map
from fabric_ext.runtime.machine.program import Program
from fabric_ext.runtime.machine.verifier import verify
from policy_helpers import compiled


def test_an_entry_reads_back_whole_and_a_damaged_one_reads_as_absent(tmp_path):
    cache = CodeCache(tmp_path)
    key = cache.key(b"program")
    assert cache.get(key) is None and cache.misses == 1
    cache.put(key, b"\x7fELF object code")
    assert cache.get(key) == b"\x7fELF object code" and cache.hits == 1
    entry = tmp_path / f"{key}.o"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([entry.name, "key"])   # no temporary file
    data = entry.read_bytes()
    for damaged in (data[:-1], data[:-1] + b"?", b"", b"FXJITOB2" + data[8:12]):
        entry.write_bytes(damaged)
        assert cache.get(key) is None


def test_past_its_size_the_cache_lets_the_least_recently_used_entries_go(tmp_path):
    """Every program and policy ever run would stay: past ``max_bytes`` the entries least
    recently written or read go, down to three quarters of it; the key stays."""
    cache = CodeCache(tmp_path, max_bytes=10 * 1040)        # ten entries of 1,000 bytes and their headers
    keys = [cache.key(bytes([i])) for i in range(14)]
    for i, key in enumerate(keys[:10]):
        cache.put(key, bytes(1000))
        os.utime(tmp_path / f"{key}.o", ns=(i * 10**9, i * 10**9))     # written in turn, a second apart
    assert cache.get(keys[0]) is not None                  # read now: the most recently used
    cache.put(keys[10], bytes(1000))                        # eleven: past the size
    left = {key for key in keys if (tmp_path / f"{key}.o").exists()}
    assert left == {keys[0], *keys[5:11]} and (tmp_path / "key").exists()     # 7,280 bytes: under 7,800
    assert all(cache.get(key) is None for key in keys[1:5])


def test_entries_it_did_not_write_are_misses(tmp_path):
    """A planted entry runs native code as the user: only entries tagged with the user's own
    key (HMAC of name and code) are used; a valid entry of another program under this name,
    one tagged with the old plain digest, or with another key, are all misses."""
    import hashlib
    import hmac
    cache = CodeCache(tmp_path)
    mine, other = cache.key(b"mine"), cache.key(b"other")
    cache.put(other, b"other code")
    (tmp_path / f"{mine}.o").write_bytes((tmp_path / f"{other}.o").read_bytes())
    assert cache.get(mine) is None and cache.get(other) == b"other code"
    planted = b"\x7fELF evil"
    for tag in (hashlib.sha256(planted).digest(),
                hmac.new(os.urandom(32), mine.encode() + b"\0" + planted, hashlib.sha256).digest()):
        (tmp_path / f"{mine}.o").write_bytes(b"FXJITOB2" + tag + planted)
        assert cache.get(mine) is None
    assert (tmp_path / "key").stat().st_mode & 0o777 == 0o600


def test_runs_that_start_together_on_an_empty_folder_share_one_key(tmp_path, monkeypatch):
    """A sweep started in parallel opens the cache in several processes at once: a run that
    looks while another is making the key finds a whole key or none, never a part of one."""
    opened = []
    real_urandom = os.urandom

    def urandom_with_a_run_in_between(n):
        if not opened:                      # another run opens the folder meanwhile
            opened.append(None)
            opened[0] = CodeCache(tmp_path)
        return real_urandom(n)

    monkeypatch.setattr(codecache.os, "urandom", urandom_with_a_run_in_between)
    first = CodeCache(tmp_path)
    other = opened[0]
    assert first.refused == other.refused == ""
    assert first._key == other._key == (tmp_path / "key").read_bytes()
    other.put(other.key(b"program"), b"code")
    assert first.get(first.key(b"program")) == b"code"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["key", f"{first.key(b'program')}.o"])


@pytest.mark.parametrize("spoil", ["group-writable", "others' folder", "readable key", "short key"])
def test_an_untrustworthy_folder_is_not_used_and_said_once(tmp_path, capsys, spoil):
    folder = tmp_path / "jit"
    CodeCache(folder)                              # made 0700 with a 0600 key
    assert folder.stat().st_mode & 0o777 == 0o700
    if spoil == "group-writable":
        folder.chmod(0o775)
    elif spoil == "others' folder":
        if os.getuid() != 0:
            pytest.skip("changing a folder's owner needs root")
        os.chown(folder, 65534, 65534)
    elif spoil == "readable key":
        (folder / "key").chmod(0o644)
    else:
        (folder / "key").write_bytes(b"short")
    caches = [CodeCache(folder), CodeCache(folder)]
    assert all(c.dir is None and c.refused for c in caches)
    caches[0].put("k", b"code")
    assert caches[0].get("k") is None and not list(folder.glob("*.o"))
    assert capsys.readouterr().err.count("the JIT code cache is not used") == 1


def test_keys_tell_their_parts_apart():
    cache = CodeCache(None)
    assert cache.key(b"ab", b"c") != cache.key(b"a", b"bc") != cache.key(b"abc")
    assert cache.key(b"x") == CodeCache(None).key(b"x")


def test_a_folder_that_cannot_be_written_only_costs_a_compile(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = CodeCache(blocker / "jit")
    cache.put("k", b"code")
    assert cache.refused.startswith(str(blocker / "jit")) and cache.get("k") is None
    cache = CodeCache(tmp_path / "c")
    (tmp_path / "c").chmod(0o500)                   # unwritable after it was opened
    cache.put("k", b"code")
    if os.getuid() != 0:                            # root writes anyway
        assert cache.error.startswith(str(tmp_path / "c")) and cache.get("k") is None
    off = CodeCache(None)
    off.put("k", b"code")
    assert off.get("k") is None and not off.error


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.setenv("FABRIC_EXT_JIT_CACHE", "off")
    assert default_dir() is None
    monkeypatch.setenv("FABRIC_EXT_JIT_CACHE", str(tmp_path / "c"))
    assert default_dir() == tmp_path / "c"
    monkeypatch.delenv("FABRIC_EXT_JIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "fabric_ext" / "jit"


def test_a_run_with_no_home_folder_keeps_no_cache_and_says_so(tmp_path):
    """A container's bare uid has no $HOME and no passwd entry: the run goes on without the
    caches, each said once, instead of failing as an internal error."""
    script = ("import os, pwd, sys\n"
              "def no_entry(uid): raise KeyError(uid)\n"
              "pwd.getpwuid = no_entry\n"
              "from fabric_ext.runtime.simulation.cli import main\n"
              f"sys.exit(main(['--policy', {str(ROOT / 'policies' / 'prefill_qos.fx')!r}, '--quiet']))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME", "FABRIC_EXT_JIT_CACHE",
                                                           "FABRIC_EXT_BUNDLE_CACHE")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if "there is no home folder" in line]
    assert len(said) == 2 and "the JIT code cache is not used" in said[0] + said[1], run.stderr
    assert "the compiled-policy cache is not used" in said[0] + said[1]


def _maps():
    return [Map("arr", ARRAY, 4, 8, 4), Map("hsh", HASH, 4, 8, 8), Map("lru", LRU_HASH, 4, 8, 4)]


def _program(maps, value: int) -> Program:
    """Store ``value`` under key 1 in every map (array and hashes natively, the hashes through
    the runtime library), then return the LRU entry's value as a native probe reads it."""
    def lddw_map(i):
        return I.Insn(I.LD | I.IMM | I.DW, dst=1, src=I.PSEUDO_MAP_FD, imm=i)
    args = [I.Insn(I.ALU64 | I.MOV | I.X, dst=2, src=10), I.Insn(I.ALU64 | I.ADD | I.K, dst=2, imm=-4)]
    insns = [I.Insn(I.ST | I.MEM | I.W, dst=10, off=-4, imm=1), I.Insn(I.ST | I.MEM | I.DW, dst=10, off=-16, imm=value)]
    for i in range(3):
        insns += [lddw_map(i), *args, I.Insn(I.ALU64 | I.MOV | I.X, dst=3, src=10),
                  I.Insn(I.ALU64 | I.ADD | I.K, dst=3, imm=-16), I.Insn(I.ALU64 | I.MOV | I.K, dst=4, imm=0),
                  I.Insn(I.JMP | I.CALL, imm=2)]
    insns += [lddw_map(2), *args, I.Insn(I.JMP | I.CALL, imm=1), I.Insn(I.JMP | I.JEQ | I.K, dst=0, imm=0, off=2),
              I.Insn(I.LDX | I.MEM | I.DW, dst=0, src=0, off=0), I.Insn(I.JMP | I.EXIT),
              I.Insn(I.ALU64 | I.MOV | I.K, dst=0, imm=-1), I.Insn(I.JMP | I.EXIT)]
    prog = Program("cached", insns, maps)
    verify(prog)
    return prog


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """As if a new process started: no native code in memory, the code cache in tmp_path."""
    def start():
        monkeypatch.setattr(jit, "_native", {})
        monkeypatch.setattr(jit, "_tiers", {})
        monkeypatch.setattr(jit, "_lib", None)
        monkeypatch.setattr(jit, "_cache", CodeCache(tmp_path))
    start()
    return start


def _run(value: int):
    maps = _maps()
    backend = jit.JitBackend()
    r0 = backend.run(backend.load(_program(maps, value)))
    return r0, [m[1] for m in maps], backend.load_stats()


def test_code_read_from_the_cache_runs_as_the_code_compiled(fresh_process, tmp_path):
    r0, values, stats = _run(77)
    assert (r0, values) == (77, [77, 77, 77])
    assert (stats["compiled"], stats["from_cache"]) == (1, 0)
    fresh_process()
    r0, values, stats = _run(77)
    assert (r0, values) == (77, [77, 77, 77])
    assert (stats["compiled"], stats["from_cache"]) == (0, 1)
    # a damaged entry is compiled again and rewritten, not run
    library = jit.code_cache().key(b"runtime library")
    entry, = [p for p in tmp_path.glob("*.o") if p.stem != library]      # the program's
    entry.write_bytes(entry.read_bytes()[:100])
    fresh_process()
    r0, values, stats = _run(77)
    assert (r0, values, stats["compiled"]) == (77, [77, 77, 77], 1)
    fresh_process()
    assert _run(77)[2]["from_cache"] == 1



def test_the_runtime_library_is_compiled_once_and_read_from_the_cache_after(fresh_process, monkeypatch):
    """A process's first hash map or batch compiles `native_lib`'s functions and caches them; a
    later process reads them (its own compile of them would fail here) and runs the same."""
    from fabric_ext.runtime.machine import native_lib
    first = _run(3)
    assert jit._library() is jit._library()
    fresh_process()
    monkeypatch.setattr(native_lib, "module", lambda: pytest.fail("the library was compiled again"))
    assert _run(3)[:2] == first[:2]
    assert jit._lib is not None

def test_code_made_for_one_cpu_is_not_read_on_another(fresh_process, monkeypatch):
    """The JIT compiles for the host CPU and its features (`codecache.host_target`): a cache
    folder shared by two machines (a home on NFS) must not hand one's code to the other."""
    assert _run(5)[2]["compiled"] == 1
    host = codecache.host_target()
    for other in ((host[0], host[1] + ",-sse4.2"), ("x86-64" if host[0] != "x86-64" else "znver4", host[1])):
        monkeypatch.setattr(codecache, "host_target", lambda other=other: other)
        fresh_process()
        assert _run(5)[2]["compiled"] == 1
    monkeypatch.setattr(codecache, "host_target", lambda: host)
    fresh_process()
    assert _run(5)[2]["from_cache"] == 1


def test_a_cpu_whose_features_llvm_cannot_tell_is_named_alone(monkeypatch):
    """Where LLVM cannot read the host's features, the JIT targets the CPU by its name (LLVM's
    default features for it) instead of failing to start."""
    import llvmlite.binding as llvm

    def unknown():
        raise RuntimeError("failed to get host cpu features")
    monkeypatch.setattr(llvm, "get_host_cpu_features", unknown)
    codecache.host_target.cache_clear()
    try:
        assert codecache.host_target() == (llvm.get_host_cpu_name(), "")
    finally:
        codecache.host_target.cache_clear()


def test_loads_share_native_code_and_keep_their_own_maps(fresh_process):
    """Two loads of one program on different maps: compiled once, each run writes its own maps."""
    backend = jit.JitBackend()
    first, second = _maps(), _maps()
    assert backend.run(backend.load(_program(first, 5))) == 5
    assert backend.run(backend.load(_program(second, 5))) == 5
    assert len(jit._native) == 1 and backend.load_stats()["compiled"] == 1
    first[0][1] = 9
    assert [m[1] for m in second] == [5, 5, 5] and first[0][1] == 9


def test_a_later_fabric_run_compiles_nothing_and_reports_the_same(tmp_path):
    out = compiled("prefill_qos")
    env = {"FABRIC_EXT_JIT_CACHE": str(tmp_path / "cache")}
    reports = []
    for i in range(2):
        r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(out), "--model",
                            "llama3-8b", "--prompt", "1024", "--backend", "jit", "--json", str(tmp_path / f"{i}.json"),
                            "-q"], capture_output=True, text=True, env=os.environ | env)
        assert r.returncode == 0, r.stderr
        reports.append(json.loads((tmp_path / f"{i}.json").read_text()))
    cold, warm = (r.pop("backend_load") for r in reports)
    assert cold["compiled"] > 0 and cold["from_cache"] == 0
    assert warm["compiled"] == 0 and warm["from_cache"] == cold["compiled"]
    for r in reports:
        for island in r["islands"]:
            island.pop("ns_per_invocation")
    assert reports[0] == reports[1]


def test_the_jit_emits_only_the_map_the_verifier_proved_a_call_is_on():
    """telemetry's sw0.forward looks up two hash maps: each call site gets that one map's probe,
    not a dispatch over every map of the program; unverified (no proof), every map's."""
    import re

    from fabric_ext.contract.bundle import create_maps, load_bundle
    from fabric_ext.runtime.machine.lift import Lifter
    from fabric_ext.runtime.machine.verifier import verify
    from policy_helpers import compiled
    bundle = load_bundle(compiled("telemetry"))
    maps = create_maps(bundle.manifest)
    prog = bundle.islands["sw0"]["forward"]
    prog.maps = [maps[m.name] for m in prog.maps]
    verify(prog)
    assert prog.call_maps
    cases = lambda ir: {(int(pc), int(i)) for pc, i in re.findall(r'^"?map(\d+)_(\d+)"?:', ir, re.MULTILINE)}  # noqa: E731
    proven = cases(str(Lifter(prog, "p", prog.proof, False).build()))
    every = cases(str(Lifter(prog, "q", None, False).build()))
    assert proven and proven <= set(prog.call_maps.items()) and proven < every     # (hash updates: the callback)
    assert len({pc for pc, _ in proven}) == len(proven)          # one map's code per call site
