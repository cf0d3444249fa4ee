"""ELF loading of clang-built libbpf-style objects (committed fixtures, rebuilt when clang is present)."""
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fabric_ext.runtime.machine.elf import ObjectError, load_object
from fabric_ext.runtime.machine.interp import Interpreter
from fabric_ext.runtime.machine.verifier import VerifierError, verify

FIX = Path(__file__).parent / "fixtures"
CLANG = shutil.which("clang")


def run(obj, name, ctx_words):
    progs = {p.name: p for p in obj.instantiate()}
    p = progs[name]
    ctx = bytearray(struct.pack(f"<{len(ctx_words)}Q", *ctx_words))
    p.ctx_size = len(ctx)
    verify(p)
    r0 = Interpreter().run(p, ctx=ctx)
    return r0, struct.unpack(f"<{len(ctx_words)}Q", ctx), p


def test_btf_maps_and_several_programs_per_section():
    obj = load_object(FIX / "counter.bpf.o")
    assert [(p.name, p.section) for p in obj.programs] == [("count", "syscall"), ("total", "syscall")]
    assert [(m.name, m.kind, m.key_size, m.value_size, m.max_entries) for m in obj.maps] == \
        [("counts", "hash", 4, 8, 16), ("totals", "array", 4, 8, 4)]
    assert obj.license == "GPL"
    maps = {}
    progs = obj.instantiate(maps)
    for p in progs:
        p.ctx_size = 16
    vm = Interpreter()
    for key in (3, 3, 5):
        vm.run(progs[0], ctx=bytearray(struct.pack("<IIQ", key, 0, 0)))
    assert maps["counts"].dump() == {3: 2, 5: 1}
    vm.run(progs[1], ctx=bytearray(struct.pack("<IIQ", 6, 0, 40)))
    assert maps["totals"][2] == 40


def test_global_data_and_text_subprogram():
    r0, ctx, p = run(load_object(FIX / "globals.bpf.o"), "globals", [7, 0])
    assert ctx[1] == 7 * 3 + 6
    assert [m.name for m in p.maps] == [".data", ".rodata", ".bss"]
    assert p.maps[0][0] == 6 and p.maps[2][0] == 27


def test_ringbuf_and_clang_loop():
    r0, ctx, p = run(load_object(FIX / "ringbuf.bpf.o"), "emit", [7, 2, 3, 4])
    assert ctx[3] == 8
    assert p.maps[0].records == [struct.pack("<QQ", 7, 8)]


def test_line_info_names_the_c_source():
    obj = load_object(FIX / "counter.bpf.o")
    lines = obj.program("count").line_info
    assert any("ev->key" in sl.text for sl in lines.values())


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b[:100], "corrupt"),
    (lambda b: b"\x7fELF" + b"\0" * 60, "not an ELF"),
    (lambda b: b"not an elf at all", "not an ELF"),
])
def test_corrupt_objects_are_clear_errors(mutate, msg):
    data = (FIX / "counter.bpf.o").read_bytes()
    with pytest.raises(ObjectError) as e:
        load_object(mutate(data), "bad.o")
    assert msg in str(e.value) and "bad.o" in str(e.value)


def test_missing_file():
    with pytest.raises(ObjectError) as e:
        load_object("/nonexistent/x.o")
    assert "cannot read" in str(e.value)


@pytest.mark.skipif(CLANG is None, reason="clang is not installed (apt-get install clang libbpf-dev)")
@pytest.mark.parametrize("name", ["counter", "globals", "ringbuf"])
def test_fixtures_rebuild_with_clang(tmp_path, name):
    out = tmp_path / f"{name}.bpf.o"
    inc = f"/usr/include/{platform.machine()}-linux-gnu"
    subprocess.run([CLANG, "-target", "bpf", "-O2", "-g", f"-I{inc}", "-c", str(FIX / f"{name}.c"), "-o", str(out)],
                   check=True)
    fresh, committed = load_object(out), load_object(FIX / f"{name}.bpf.o")
    assert [p.name for p in fresh.programs] == [p.name for p in committed.programs]
    assert [(m.name, m.type) for m in fresh.maps] == [(m.name, m.type) for m in committed.maps]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["counter", "globals", "ringbuf"]),
       st.lists(st.tuples(st.integers(0, 7751), st.integers(0, 255)), min_size=1, max_size=8))
@example(fixture="counter", flips=[(6439, 128)])      # a section offset of 2^63: pyelftools overflowed reading it
@example(fixture="counter", flips=[(3072, 38), (7442, 212), (2242, 78)])   # line records of 0 bytes: 24 GB of them
@example(fixture="globals", flips=[(4669, 29)])       # a .bss of 2^44 bytes, allocated before it was checked
def test_corrupted_bytes_never_crash_the_loader(fixture, flips):
    """Random bytes of each fixture object changed: the loader and verifier give an error naming
    the object, or a program, and allocate no more than an object's maps may hold."""
    data = bytearray((FIX / f"{fixture}.bpf.o").read_bytes())
    for pos, val in flips:
        data[pos % len(data)] = val
    try:
        obj = load_object(bytes(data), "flipped.o")
    except ObjectError as e:
        assert "flipped.o" in str(e)
        return
    for p in obj.instantiate():
        p.ctx_size = 16
        try:
            verify(p)
        except VerifierError:
            pass


def test_btf_types_that_name_themselves_are_errors_not_loops():
    """A typedef of itself, or an array of itself, in a hostile object's BTF: `resolve` and
    `size_of` say so instead of looping (or recursing) without end."""
    from fabric_ext.runtime.machine.btf import ARRAY, BTF, TYPEDEF, BTFError, BType
    looped = BTF([BType(0, "void", 0, 0), BType(TYPEDEF, "a", 2, 0), BType(TYPEDEF, "b", 1, 0)], b"\0")
    with pytest.raises(BTFError, match="names itself"):
        looped.resolve(1)
    arrays = BTF([BType(0, "void", 0, 0), BType(ARRAY, "x", 0, 0, array=(1, 0, 4))], b"\0")
    with pytest.raises(BTFError, match="has no size"):
        arrays.size_of(1)


def test_a_typedef_chain_is_walked_once_not_once_per_map_that_names_it():
    """A hostile object's maps may each name the head of one long chain of typedefs (each
    walk 15 ms for 200,000 of them: minutes for thousands of maps): `resolve` remembers every
    type on the way, so the chain is walked once, and each of its types names its end."""
    from fabric_ext.runtime.machine.btf import BTF, INT, TYPEDEF, BType
    n = 200_000
    btf = BTF([BType(0, "void", 0, 0), BType(INT, "int", 4, 0)] + [BType(TYPEDEF, "t", i, 0) for i in range(1, n)],
              b"\0")
    assert btf.resolve(n).name == "int" and len(btf._resolved) == n - 1
    assert all(btf.resolve(tid).name == "int" for tid in range(1, n + 1))


def test_an_object_whose_maps_are_too_large_together_is_refused(tmp_path):
    """Each map may be 64 MiB; an object's maps together at most 1 GiB (`elf.total_problem`)."""
    from fabric_ext.runtime.machine.elf import MapSpec, total_problem
    from fabric_ext.runtime.machine.isa import MAX_MAP_BYTES, MAX_TOTAL_MAP_BYTES
    from fabric_ext.runtime.machine.maps import ARRAY
    assert MapSpec("a", ARRAY, 4, 12, 1000).bytes == 16_000
    assert total_problem(MAX_TOTAL_MAP_BYTES) is None
    assert "1,073,741,825 bytes together" in total_problem(MAX_TOTAL_MAP_BYTES + 1)
    if CLANG is None:
        pytest.skip("clang is not installed")
    rings = "".join(f"struct {{ int (*type)[27]; int (*max_entries)[{MAX_MAP_BYTES}]; }} r{i} "
                    f"__attribute__((section(\".maps\"), used));\n" for i in range(17))
    src = tmp_path / "rings.c"
    src.write_text(rings + '__attribute__((section("syscall"), used)) int p(void *ctx) { return 0; }\n'
                   'char LICENSE[] __attribute__((section("license"), used)) = "GPL";\n')
    obj = tmp_path / "rings.o"
    subprocess.run([CLANG, "-O2", "-g", "-target", "bpf", "-c", str(src), "-o", str(obj)], check=True)
    with pytest.raises(ObjectError, match="bytes together; the runtime allows 1024 MiB"):
        load_object(obj.read_bytes(), "rings.o")


def _objects():
    """Each fixture's object, and each island's object of the bundled reference policy."""
    from fabric_ext.codegen.driver import build
    objects = {f"{n}.bpf.o": (FIX / f"{n}.bpf.o").read_bytes() for n in ("counter", "globals", "ringbuf")}
    compiled = build(Path(__file__).resolve().parent.parent / "policies" / "prefill_qos.fx")
    return objects | {n: b for n, b in compiled.files.items() if n.endswith(".bpf.o")}


def test_the_elf_reader_reads_what_pyelftools_reads():
    """Differential: `elfread` against pyelftools, an ELF reader of its own, on clang's
    objects and ours: the same sections, symbols and relocations."""
    import io

    from elftools.elf.elffile import ELFFile
    from elftools.elf.enums import ENUM_ST_INFO_BIND, ENUM_ST_INFO_TYPE, ENUM_ST_SHNDX
    from elftools.elf.relocation import RelocationSection

    from fabric_ext.runtime.machine.elfread import ElfFile
    for name, data in _objects().items():
        ours, theirs = ElfFile(data), ELFFile(io.BytesIO(data))
        assert [(s.name, s.offset, s.size, s.link, s.info, s.flags) for s in ours.sections] == \
            [(s.name, s["sh_offset"], s["sh_size"], s["sh_link"], s["sh_info"], s["sh_flags"])
             for s in theirs.iter_sections()], name
        assert [ours.content(s) for s in ours.sections if s.type != 8] == \
            [s.data() for s in theirs.iter_sections() if s["sh_type"] != "SHT_NOBITS"], name
        symtab = theirs.get_section_by_name(".symtab")
        info = [s.entry["st_info"] for s in symtab.iter_symbols()]
        assert [(s.name, s.value, s.size, s.type, s.bind, s.shndx) for s in ours.symbols] == \
            [(s.name, s["st_value"], s["st_size"], ENUM_ST_INFO_TYPE[i["type"]], ENUM_ST_INFO_BIND[i["bind"]],
              ENUM_ST_SHNDX.get(s["st_shndx"], s["st_shndx"])) for s, i in zip(symtab.iter_symbols(), info)], name
        relocated = [s for s in theirs.iter_sections() if isinstance(s, RelocationSection)]
        assert relocated, name
        for rel in relocated:
            target = ours.sections[rel["sh_info"]]
            assert [(r.offset, r.type, r.symbol) for r in ours.relocations_of(target)] == \
                [(r["r_offset"], r["r_info_type"], r["r_info_sym"]) for r in rel.iter_relocations()], name


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b[:40] + struct.pack("<Q", 1 << 62) + b[48:], "section header table"),
    (lambda b: b[:4] + b"\x02\x02" + b[6:], "big-endian"),
    (lambda b: b[:62] + struct.pack("<H", 0xffff), "extended section numbering"),
])
def test_hostile_elf_headers_are_named(mutate, msg):
    """The ELF header's own fields: the section header table's place, byte order, the names'
    table's index (each a message of its own, not a traceback)."""
    data = (FIX / "counter.bpf.o").read_bytes()
    with pytest.raises(ObjectError, match=msg):
        load_object(mutate(data), "bad.o")


def _elf(sections: list[tuple]) -> bytes:
    """A relocatable BPF ELF of ``sections`` (name, type, flags, data, link, info), after the
    null section; the section names' table is added last."""
    names, table = [], b"\0"
    for name, *_ in [*sections, (".shstrtab",)]:
        names.append(len(table))
        table += name.encode() + b"\0"
    sections = [("", 0, 0, b"", 0, 0), *sections, (".shstrtab", 3, 0, table, 0, 0)]
    names.insert(0, 0)
    body, offsets = b"", []
    for _, _, _, data, _, _ in sections:
        offsets.append(64 + len(body))
        body += data + b"\0" * (-len(data) % 8)
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01", 1, 247, 1, 0, 0, 64 + len(body), 0, 64, 0, 0,
                         64, len(sections), len(sections) - 1)
    return header + body + b"".join(struct.pack("<IIQQQQIIQQ", names[i], t, f, 0, offsets[i], len(d), link, info, 8, 0)
                                    for i, (_, t, f, d, link, info) in enumerate(sections))


def test_an_object_whose_programs_each_call_a_large_subprogram_is_refused_not_loaded_for_ever():
    """40 programs (symbols) over one 16-byte section, each calling a .text of 30,000
    instructions, which each program takes a copy of, as libbpf does: 1.2 million
    instructions from a 240 KB file (65,536 programs of a 64 MiB .text would be 2^39). The
    loader stops at 2^20 together, naming the limit."""
    call, exit_ = struct.pack("<BBhi", 0x85, 0x10, 0, -1), struct.pack("<BBhi", 0x95, 0, 0, 0)
    text = struct.pack("<BBhi", 0xb7, 0, 0, 1) * 29_999 + exit_
    symbols = struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0) + struct.pack("<IBBHQQ", 0, 3, 0, 2, 0, 0)    # .text's
    symbols += struct.pack("<IBBHQQ", 1, 0x12, 0, 1, 0, 16) * 40        # global functions 'p' in section 1
    data = _elf([("prog", 1, 6, call + exit_, 0, 0), (".text", 1, 6, text, 0, 0),
                 (".rel.prog", 9, 0, struct.pack("<QQ", 0, 1 << 32 | 10), 4, 1),
                 (".symtab", 2, 0, symbols, 5, 0), (".strtab", 3, 0, b"\0p\0", 0, 0)])
    with pytest.raises(ObjectError, match="more than 1,048,576 instructions .at program 'p'."):
        load_object(data, "calls.o")
    one = _elf([("prog", 1, 6, call + exit_, 0, 0), (".text", 1, 6, text, 0, 0),     # one such program loads
                (".rel.prog", 9, 0, struct.pack("<QQ", 0, 1 << 32 | 10), 4, 1),
                (".symtab", 2, 0, symbols[:72], 5, 0), (".strtab", 3, 0, b"\0p\0", 0, 0)])
    assert [len(p.insns) for p in load_object(one, "one.o").programs] == [2 + 30_000]


def test_a_name_that_runs_to_the_end_of_its_table_is_an_error_read_within_a_bound():
    """Every symbol of a hostile object may name one string that runs without a NUL to the
    end of a large table: each read of it stops at 4,096 bytes (65,536 symbols over 64 MiB
    were 4 TB of scanning) and the name is an error."""
    symbols = struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0) + struct.pack("<IBBHQQ", 1, 0x12, 0, 1, 0, 8) * 2000
    data = _elf([("prog", 1, 6, struct.pack("<BBhi", 0x95, 0, 0, 0), 0, 0),
                 (".symtab", 2, 0, symbols, 3, 0), (".strtab", 3, 0, b"\0" + b"x" * (1 << 20), 0, 0)])
    with pytest.raises(ObjectError, match="symbol 1's name is not NUL-terminated in its string table, or longer "
                                          "than 4,096 bytes"):
        load_object(data, "names.o")


def test_an_elf_symbol_table_past_its_bound_and_a_btf_string_without_end_are_bounded():
    """A symbol table of more than 65,536 entries is an error (each is parsed into an object);
    a BTF string that runs without a NUL to the end of its table is read up to 4,096 bytes."""
    from fabric_ext.runtime.machine.btf import BTF, MAX_STRING
    symbols = struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0) * (65_536 + 1)
    data = _elf([(".symtab", 2, 0, symbols, 2, 0), (".strtab", 3, 0, b"\0", 0, 0)])
    with pytest.raises(ObjectError, match="the symbol table is 1572888 bytes: .*or more than 65,536"):
        load_object(data, "symbols.o")
    btf = BTF([], b"\0" + b"x" * (1 << 20))
    assert btf.string(1) == "x" * MAX_STRING and btf.string(0) == ""
