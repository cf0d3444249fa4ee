"""<island>.bpftime.json is what bpftime's importer reads (issue 13, item 11): every field it
reads, and handler fds unique across the islands that are imported into one shared memory."""
import json

import pytest

from fabric_ext.contract.bundle import load_manifest
from fabric_ext.contract.runtime_json import parse_runtime_json
from policy_helpers import compiled

# What bpftime's importer reads of each handler, unconditionally (nlohmann::json's operator[]
# on a missing key aborts it): runtime/src/bpftime_shm_json.cpp in eunomia-bpf/bpftime,
# json_to_bpf_map_attr() and import_shm_handler_from_json().
IMPORTER_MAP_ATTR = ("map_type", "key_size", "value_size", "max_entries", "flags", "ifindex",
                     "btf_vmlinux_value_type_id", "btf_id", "btf_key_type_id", "btf_value_type_id",
                     "map_extra", "kernel_bpf_map_id")
IMPORTER_PROG_ATTR = ("insns", "type", "cnt", "attach_fds")


def bpftime_files(name):
    folder = compiled(name)
    man = load_manifest(folder)
    islands = man["bpftime_shm"]["islands"]
    return folder, man, {i: json.loads((folder / f"{i}.bpftime.json").read_text()) for i in islands}


def test_every_field_the_importer_reads_is_there():
    _, _, files = bpftime_files("prefill_qos")
    assert files
    for table in files.values():
        for fd, h in table.items():
            assert int(fd) >= 0 and {"type", "name", "attr"} <= set(h)
            want = IMPORTER_MAP_ATTR if h["type"] == "bpf_map_handler" else IMPORTER_PROG_ATTR
            assert set(want) <= set(h["attr"]), (fd, h["type"])
            if h["type"] == "bpf_prog_handler":
                assert len(bytes.fromhex(h["attr"]["insns"])) == 8 * h["attr"]["cnt"]


def test_fds_are_unique_across_the_islands_of_one_shared_memory():
    """Imported one after another into one shared memory, no island's handler lands on
    another's fd: programs are all distinct, and a map used on several islands is one fd."""
    _, man, files = bpftime_files("prefill_qos")
    assert man["bpftime_shm"]["name"] and len(files) == 8          # gpu0..gpu7
    progs, maps = {}, {}
    for island, table in files.items():
        for fd, h in table.items():
            if h["type"] == "bpf_prog_handler":
                assert fd not in progs and fd not in maps, (island, fd)
                progs[fd] = island
            else:
                assert maps.setdefault(fd, h["name"]) == h["name"] and fd not in progs
    shared = [m["name"] for m in man["maps"] if m["shared"] and set(m["islands"]) & set(files)]
    for name in shared:       # one fd for the map wherever it is used
        assert len({fd for t in files.values() for fd, h in t.items() if h["name"] == name}) == 1


def test_our_loader_reads_them_back_as_compiled():
    """Relocations carry the global fd; reading a file maps them back to its own maps."""
    folder, _, files = bpftime_files("prefill_qos")
    for island in files:
        path = folder / f"{island}.bpftime.json"
        maps, progs = parse_runtime_json(path, path.read_bytes())
        assert progs and all(0 <= i.imm < len(maps) for p in progs.values() for i in p
                             if i.is_lddw and i.src == 1)


def test_a_runtime_artifact_whose_maps_are_too_large_together_is_refused(tmp_path):
    """Each map may be 64 MiB; an artifact's maps together at most 1 GiB, as a manifest's."""
    from fabric_ext.contract.runtime_json import BundleError, dputime_json, encode
    from fabric_ext.runtime.machine.elf import MapSpec
    from fabric_ext.runtime.machine.maps import RINGBUF
    rings = [MapSpec(f"r{i}", RINGBUF, 0, 0, 64 << 20) for i in range(17)]
    path = tmp_path / "sw0.dputime.json"
    assert len(parse_runtime_json(path, encode(dputime_json("sw0", "cxl_switch", [], rings[:16])))[0]) == 16
    with pytest.raises(BundleError, match="1,140,850,688 bytes together"):
        parse_runtime_json(path, encode(dputime_json("sw0", "cxl_switch", [], rings)))
