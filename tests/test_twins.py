"""Islands whose programs are the same but for the island's name compile once (`codegen/twins.py`):
the others' objects are byte for byte what compiling each on its own gives, and where the
programs or the object's strings differ in anything else, each island compiles on its own."""
from conftest import POLICIES
from fabric_ext.codegen import driver
from fabric_ext.codegen.twins import renamed

REFERENCE = POLICIES / "prefill_qos.fx"


def _build(monkeypatch, text=None, twins=True):
    """The files of a compile of the reference (or ``text`` in its place) and how many islands
    LLVM compiled."""
    compiled = []
    compile_module = driver.compile_module
    monkeypatch.setattr(driver, "compile_module", lambda *a: compiled.append(1) or compile_module(*a))
    if not twins:
        monkeypatch.setattr(driver, "twin_of", lambda *a: None)
    res = driver.build(REFERENCE, text=text)
    assert res is not None
    monkeypatch.undo()
    return res.files, len(compiled)


def _variant(old, new):
    text = REFERENCE.read_text()
    assert old in text
    return text.replace(old, new)


def test_the_eight_gpus_compile_once_and_their_objects_are_their_own(monkeypatch):
    files, compiled = _build(monkeypatch)
    alone, each = _build(monkeypatch, twins=False)
    assert (compiled, each) == (3, 10)          # gpu0, sw0, nic0; and every island
    assert files == alone
    assert b"gpu5_issue" in files["gpu5.bpf.o"] and b"gpu0" not in files["gpu5.bpf.o"]


def test_programs_that_read_their_island_are_not_twins(monkeypatch):
    """`ev.island` is a constant of each program: the GPUs' programs differ, and each compiles."""
    text = _variant("kv_bytes[ev.src] += ev.bytes", "kv_bytes[ev.island] += ev.bytes")
    files, compiled = _build(monkeypatch, text)
    assert compiled == 10
    assert files == _build(monkeypatch, text, twins=False)[0]


def test_a_map_whose_name_ends_a_programs_is_not_renamed_with_it(monkeypatch):
    """The symbols' string table keeps `u0_issue` as the tail of `gpu0_issue`: renaming that
    would rename the map too, so each GPU compiles on its own."""
    text = _variant("kv_bytes", "u0_issue")
    files, compiled = _build(monkeypatch, text)
    assert compiled == 10
    assert files == _build(monkeypatch, text, twins=False)[0]


def test_a_rename_keeps_every_offset_or_is_refused(monkeypatch):
    obj = _build(monkeypatch)[0]["gpu0.bpf.o"]
    assert renamed(obj, {"gpu0_issue": "gpu1_issue"}).count(b"gpu1_issue") == obj.count(b"gpu0_issue") == 3
    assert renamed(obj, {"gpu0_issue": "gpu10_issue"}) is None       # a longer name moves every string after it
    assert renamed(obj, {"gpu0_iss": "gpu1_iss"}) is None            # not a whole string: found nowhere
    assert renamed(obj + b"gpu0_issue", {"gpu0_issue": "gpu1_issue"}) is None   # left outside the tables


def test_llvm_text_is_each_islands_own():
    """--emit llvm writes each island's optimised IR, so every island compiles."""
    res = driver.build(REFERENCE, emit=("llvm",))
    assert b"@gpu3_issue" in res.files["gpu3.ll"] and b"gpu0" not in res.files["gpu3.ll"]


def test_the_eight_gpus_programs_are_verified_once_when_loaded(monkeypatch):
    """Loading a bundle, a twin's program (the same instructions, hook and maps) takes the proof
    the verifier gave the first one's: 4 runs of the verifier for 11 programs, and each proof
    is what verifying the program on its own gives."""
    from fabric_ext.contract import bundle
    from fabric_ext.runtime.machine.verifier import verify
    from policy_helpers import compiled
    out = compiled("prefill_qos")
    man = bundle.load_manifest(out)
    runs = []
    monkeypatch.setattr(bundle, "verify", lambda prog: runs.append(prog.name) or verify(prog))
    maps, verified = bundle.create_maps(man), {}
    loaded = [p for island in ("gpu0", "gpu1", "gpu7", "sw0", "nic0")
              for p in bundle.island_programs(bundle.Folder(out), man, maps, island, verified)]
    assert runs == ["gpu0_issue", "sw0_forward", "sw0_tick", "nic0_tx"] and len(loaded) == 6
    for p in loaded:
        proof = (p.program.proof, p.program.mem_extent, p.program.call_maps)
        verify(p.program)
        assert proof == (p.program.proof, p.program.mem_extent, p.program.call_maps) and proof[0]
    # the same program on other maps is verified again (the key holds the maps themselves)
    bundle.island_programs(bundle.Folder(out), man, bundle.create_maps(man), "gpu2", verified)
    assert runs[-1] == "gpu2_issue" and len(runs) == 5
