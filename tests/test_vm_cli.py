"""fabric-vm and the bpf_conformance plugin protocol of fabric-vm-plugin, on every backend."""
import subprocess
import sys

import pytest

from fabric_ext.contract.bundle import load_manifest
from fabric_ext.runtime.machine import kernel

BACKENDS = ["interp", "jit"] + (["kernel"] if kernel.permitted()[0] else [])


def plugin(args, stdin):
    return subprocess.run([sys.executable, "-c", "import sys; from fabric_ext.runtime.vm_cli import plugin_main; "
                           "sys.exit(plugin_main())", *args], input=stdin, capture_output=True, text=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plugin_spaced_hex_and_r0_in_hex(backend):
    # mov r0, 3; ldxb r1, [r1+1]; add r0, r1; exit  -- with the memory given in argv[1]
    prog = "b7 00 00 00 03 00 00 00 71 11 01 00 00 00 00 00 0f 10 00 00 00 00 00 00 95 00 00 00 00 00 00 00"
    for args in (["00 10", "--backend", backend], ["--backend", backend, "00 10"]):   # options anywhere
        r = plugin(args, prog)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "13"


def test_plugin_run_together_hex_and_empty_memory():
    r = plugin([""], "b7000000ffffffff9500000000000000\n")
    assert r.returncode == 0 and r.stdout.strip() == "ffffffffffffffff"
    r = plugin(["--backend", "jit", ""], "b7000000ffffffff9500000000000000")
    assert r.returncode == 0 and r.stdout.strip() == "ffffffffffffffff"


def test_plugin_help_program_option_and_elf_mode(tmp_path):
    r = plugin(["-h"], "")
    assert r.returncode == 0 and "--elf" in r.stdout
    r = plugin(["--program", "b7000000050000009500000000000000"], "")
    assert r.returncode == 0 and r.stdout.strip() == "5"
    from conftest import ROOT
    elf = (ROOT / "tests" / "fixtures" / "counter.bpf.o").read_bytes().hex()
    r = plugin(["--elf", "00" * 64], elf)        # counter.c's first program returns 0
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr
    r = plugin(["--elf", ""], "7f454c46" + "00" * 60)
    assert r.returncode == 1 and "fabric-vm-plugin:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("backend", ["interp", "jit"])
def test_plugin_callx_calls_the_helper_in_a_register(backend):
    """callx (JMP|CALL|X, the helper id in dst): bpf_conformance's callx.data."""
    from fabric_ext.runtime.machine import isa
    from fabric_ext.runtime.machine.asm import assemble
    code = isa.encode(assemble("mov %r1, -1\nmov %r2, 5\ncall %r2\nmov %r0, 2\nexit")).hex()
    r = plugin(["--backend", backend], code)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
    bad = isa.encode(assemble("ldxb %r2, [%r1+0]\ncall %r2\nexit")).hex()
    r = plugin(["00", "--backend", backend], bad)
    assert r.returncode == 1 and "callx: r2 must hold a known helper id" in r.stderr


@pytest.mark.parametrize("args,stdin,code,msg", [
    (["", "--nope"], "9500000000000000", 2, "unrecognized arguments"),
    (["", "--backend", "gpu"], "9500000000000000", 2, "invalid choice"),
    ([""], "07000000010000009500000000000000", 1, "r0 is read before it is written"),
    ([""], "zz", 2, "not hex bytes"),
    (["0102"], "7910000000000000 9500000000000000", 1, "out-of-bounds"),
])
def test_plugin_errors(args, stdin, code, msg):
    r = plugin(args, stdin)
    assert r.returncode == code and msg in (r.stdout + r.stderr), r.stderr


def vm(*args):
    return subprocess.run([sys.executable, "-m", "fabric_ext.runtime.vm_cli", *map(str, args)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fabric_vm_run_asm(tmp_path, backend):
    f = tmp_path / "p.asm"
    f.write_text("mov %r0, 7\nexit\n")
    r = vm("run", f, "--backend", backend)
    assert r.returncode == 0 and "r0 = 0x7 (7)" in r.stdout


def test_fabric_vm_run_object_prints_maps_and_ctx(tmp_path):
    from fabric_ext.contract.context import ContextCodec
    from fabric_ext.contract.hooks import HOOKS
    from policy_helpers import compiled
    ctx = ContextCodec(HOOKS["dpu", "tx"]).pack(movement=1, bytes=4096, queue_bytes=1 << 30)
    r = vm("run", compiled("nic_pacing") / "nic0.bpf.o", "--program", "nic0_tx", "--ctx", bytes(ctx).hex())
    assert r.returncode == 0, r.stderr
    assert "map tx_bytes (percpu_array): {0: 4096}" in r.stdout and "ctx = " in r.stdout
    r = vm("run", compiled("nic_pacing") / "nic0.bpf.o", "--program", "nic0_tx", "--hook", "dpu.tx",
           "--ctx", bytes(ctx).hex(), "--backend", "jit")
    assert r.returncode == 0, r.stderr
    assert "decision rate = 20000000000" in r.stdout and "decision coalesce = 262144" in r.stdout


def test_fabric_vm_disasm_and_errors(tmp_path):
    from policy_helpers import compiled
    r = vm("disasm", compiled("nic_pacing") / "nic0.bpf.o")
    assert r.returncode == 0 and "nic0_tx (section syscall):" in r.stdout and "exit" in r.stdout
    bad = tmp_path / "bad.asm"
    bad.write_text("mov %r0, 1\nbogus\n")
    r = vm("run", bad)
    assert r.returncode == 1 and f"{bad}:2: unknown instruction 'bogus'" in r.stderr and "Traceback" not in r.stderr
    bad.write_text("mov r0, 1\nexit\n")
    r = vm("run", bad)
    assert r.returncode == 1 and f"{bad}:1: expected a register %r0..%r10, got 'r0' (write '%r0')" in r.stderr
    r = vm("run", tmp_path / "missing.o")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_fabric_vm_reads_only_bounded_regular_files(tmp_path):
    for cmd in (["run", "/dev/zero"], ["disasm", "/dev/zero"]):
        r = vm(*cmd)
        assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
    for cmd in ("run", "disasm"):
        r = vm(cmd, "/dev/zero")
        assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr


def test_fabric_vm_run_packs_the_context_by_field_names(tmp_path):
    """--ctx FIELD=VALUE,... with --hook: units converted (4KiB is 4096 bytes; 1GiB of queue
    picks the lower rate, 1KiB the higher), names looked up in the policy's manifest beside
    the object, the same decisions as for the id."""
    from policy_helpers import compiled
    obj = compiled("nic_pacing") / "nic0.bpf.o"
    ids = load_manifest(compiled("nic_pacing"))["ids"]
    base = ["run", obj, "--program", "nic0_tx", "--hook", "dpu.tx", "--backend", "jit", "--ctx"]
    full = vm(*base, "movement=kv_export, bytes=4KiB, queue_bytes=1GiB, chunk=6, src=gpu1")
    assert full.returncode == 0, full.stderr
    assert "decision rate = 20000000000" in full.stdout and "decision queue = 2" in full.stdout
    assert "map tx_bytes (percpu_array): {0: 4096}" in full.stdout
    light = vm(*base, f"movement={ids['movements']['kv_export']},bytes=4096,queue_bytes=1KiB")
    assert "decision rate = 36000000000" in light.stdout, light.stderr
    (tmp_path / "nic0.bpf.o").write_bytes(obj.read_bytes())      # no manifest beside it
    alone = vm("run", tmp_path / "nic0.bpf.o", "--hook", "dpu.tx", "--ctx", "movement=kv_export")
    assert alone.returncode == 2 and "names need the policy's manifest.json beside the object" in alone.stderr
    (tmp_path / "manifest.json").write_text("{")
    corrupt = vm("run", tmp_path / "nic0.bpf.o", "--hook", "dpu.tx", "--ctx", "src=gpu0")
    assert corrupt.returncode == 2 and "corrupt manifest.json" in corrupt.stderr


def test_fabric_vm_run_refuses_a_hook_the_program_is_not_compiled_for():
    """The manifest beside an object names each program's hook: another hook's context would
    be read at the wrong offsets, so it is refused (usage, exit 2)."""
    from policy_helpers import compiled
    obj = compiled("prefill_qos") / "sw0.bpf.o"
    wrong = vm("run", obj, "--program", "sw0_forward", "--hook", "gpu.issue", "--ctx", "bytes=4KiB")
    assert wrong.returncode == 2 and "sw0_forward is compiled for cxl_switch.forward" in wrong.stderr, wrong.stderr
    tick = vm("run", obj, "--program", "sw0_tick", "--hook", "cxl_switch.tick")
    assert tick.returncode == 0, tick.stderr


@pytest.mark.parametrize("ctx, hook, says", [
    ("bytes=4KiB", None, "needs --hook"),
    ("bytez=4KiB", "dpu.tx", "has no field 'bytez'"),
    ("bytes=4GB/s", "dpu.tx", "'bytes' is a size, not a bandwidth"),
    ("bytes=4Kib", "dpu.tx", "unknown unit 'Kib'"),
    ("bytes", "dpu.tx", "not hex bytes: 'bytes' (or FIELD=VALUE,... with --hook)"),
    ("bytes=", "dpu.tx", "'bytes=' is not FIELD=VALUE"),
    ("bytes=1.5", "dpu.tx", "not a whole number"),
    ("chunk=99999999999", "dpu.tx", "fits in its u32"),
    ("bytes=big", "dpu.tx", "'bytes' takes a number"),
    ("movement=kv_exp", "dpu.tx", "no such name (the policy has: kv_export)"),
    ("src=gpu99", "dpu.tx", "src=gpu99: no such name"),
    ("bytes=4KiB,bytes=1", "dpu.tx", "'bytes' is given twice"),
])
def test_fabric_vm_run_ctx_by_names_errors(ctx, hook, says):
    from policy_helpers import compiled
    r = vm("run", compiled("nic_pacing") / "nic0.bpf.o", *(["--hook", hook] if hook else []), "--ctx", ctx)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_context_file_is_read_bounded(tmp_path):
    """`--ctx @FILE` reads a regular file of at most 64 KiB: a device that never ends, a file
    too large or one that cannot be opened is an input error naming it, not a read without
    end."""
    obj = tmp_path / "one.s"
    obj.write_text("mov %r0, 1\nexit\n")
    big, small = tmp_path / "big.bin", tmp_path / "ctx.bin"
    big.write_bytes(bytes(70_000))
    small.write_bytes(bytes(range(8)))
    for path, says in [("/dev/zero", "it is not a regular file"), (big, "it is 70000 bytes, more than the 65536 bytes allowed"),
                       (tmp_path / "gone.bin", "No such file")]:
        r = vm("run", obj, "--ctx", f"@{path}")
        assert r.returncode == 1 and f"--ctx @{path}: {says}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = vm("run", obj, "--ctx", f"@{small}")
    assert r.returncode == 0 and "ctx = 0001020304050607" in r.stdout, r.stderr


def test_a_disassembled_program_runs_as_its_object_does(tmp_path):
    from policy_helpers import compiled
    obj = compiled("prefill_qos") / "nic0.bpf.o"
    listing = tmp_path / "tx.asm"
    listing.write_text(vm("disasm", obj).stdout)
    movement = load_manifest(compiled("prefill_qos"))["ids"]["movements"]["kv_export"]
    ran = [vm("run", f, "--hook", "dpu.tx", "--ctx", f"bytes=4KiB,movement={movement}") for f in (obj, listing)]
    assert all(r.returncode == 0 for r in ran), [r.stderr for r in ran]
    assert ran[0].stdout == ran[1].stdout and "decision rate = 25000000000" in ran[0].stdout


def test_fabric_vm_shows_a_large_maps_first_entries_and_how_many_more(tmp_path):
    """A program may fill an array of a million entries: the run prints the first 1,024 of
    each map and the count of the rest (it printed them all)."""
    import fabric_ext
    from conftest import POLICIES
    bundle = fabric_ext.compile(f'import "{POLICIES}/fabrics/dgx_cxl.fx"\nmovement kv = kv : gpu* -> pool0\n'
                                "map a : array<u32, count>[4096]\n"
                                "policy p { on kv.forward at sw0 { for i in 0..1024 { a[i] = 1\n a[i + 1024] = 2 } } }\n",
                                werror=False)
    bundle.write(tmp_path / "out")
    r = vm("run", tmp_path / "out" / "sw0.bpf.o", "--hook", "cxl_switch.forward", "--ctx", "movement=kv")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("map a (array): "))
    assert line.endswith("1023: 1} and 1,024 more entries") and line.count(": 1") == 1024
