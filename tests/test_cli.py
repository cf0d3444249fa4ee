"""fabricc's exit codes, diagnostics format and outputs."""
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, FABRIC, POLICIES


def fabricc(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fabric_ext.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def test_check_examples_exit_0():
    r = fabricc("check", *EXAMPLES)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok") == len(EXAMPLES)


@pytest.mark.parametrize("path,says", [("/dev/zero", "/dev/zero is not a regular file"), ("/tmp", "/tmp is a folder"),
                                       ("missing.fx", "no such file: missing.fx")])
def test_a_source_that_is_no_file_is_named_for_what_it_is(path, says):
    r = fabricc("check", path)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_errors_exit_1_with_position_caret_and_hint(tmp_path):
    f = tmp_path / "bad.fx"
    f.write_text(FABRIC + "policy p { on kv.forward { prio = 1 } }\n")
    r = fabricc("check", f)
    assert r.returncode == 1
    line = FABRIC.count("\n") + 1
    assert f"bad.fx:{line}:28: error: cxl_switch.forward has no decision 'prio'" in r.stderr
    assert "~~~~" in r.stderr and "hint: did you mean 'priority'?" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["check", "missing.fx"], ["--nope"], ["check"], [], ["graph", "x", "--format", "png"]])
def test_usage_errors_exit_2(args):
    r = fabricc(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_version_and_help():
    r = fabricc("--version")
    assert r.returncode == 0 and r.stdout.startswith("fabricc ")
    for cmd in ("check", "graph", "compile"):
        r = fabricc(cmd, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout


def test_graph_json_and_dot(tmp_path):
    policy = [p for p in EXAMPLES if p.name == "prefill_qos.fx"][0]
    r = fabricc("graph", policy, "--format", "json")
    assert r.returncode == 0, r.stderr
    g = json.loads(r.stdout)
    assert {"devices", "links", "movements", "placements"} <= set(g)
    kv = next(m for m in g["movements"] if m["name"] == "kv_writeback")
    assert kv["flows"][0]["path"] == ["gpu0", "sw0", "pool0"]
    assert kv["islands"][:2] == ["gpu0", "sw0"]
    out = tmp_path / "g.dot"
    r = fabricc("graph", policy, "--format", "dot", "-o", out)
    assert r.returncode == 0 and out.read_text().startswith("digraph fabric {")


def test_internal_error_is_one_line(monkeypatch, capsys):
    from fabric_ext import cli
    monkeypatch.setattr(cli, "cmd_check", lambda args: 1 / 0)
    parser = cli.build_parser
    def broken():
        p = parser()
        p._subparsers._group_actions[0].choices["check"].set_defaults(func=lambda a: 1 / 0)
        return p
    monkeypatch.setattr(cli, "build_parser", broken)
    assert cli.main(["check", "x.fx"]) == 3
    err = capsys.readouterr().err
    assert "internal error" in err and "Traceback" not in err


REFERENCE = [p for p in EXAMPLES if p.name == "prefill_qos.fx"][0]


def test_compile_replaces_only_empty_folders_and_its_own_output(tmp_path):
    """`-o .` once deleted the working folder's contents: fabricc now replaces only an empty
    folder or an earlier output whose manifest lists every entry, and keeps the folder's mode."""
    (tmp_path / "mine.txt").write_text("keep")
    for out in (".", ""):
        r = fabricc("compile", REFERENCE, "-o", out, cwd=tmp_path)
        assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
        assert (tmp_path / "mine.txt").read_text() == "keep"
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    out.chmod(0o750)
    assert fabricc("compile", REFERENCE, "-o", out).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o750
    assert fabricc("compile", REFERENCE, "-o", out).returncode == 0      # its own output: replaced
    (out / "notes.txt").write_text("mine")
    r = fabricc("compile", REFERENCE, "-o", out)
    assert r.returncode == 1 and "notes.txt" in r.stderr and "removes nothing it did not write" in r.stderr
    assert (out / "notes.txt").read_text() == "mine" and (out / "manifest.json").is_file()
    r = fabricc("compile", REFERENCE, "-o", tmp_path / "mine.txt")
    assert r.returncode == 1 and "not a folder" in r.stderr


def test_an_output_folder_whose_manifest_is_a_pipe_is_refused_not_waited_on(tmp_path):
    import os
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "manifest.json")
    r = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "compile", str(REFERENCE), "-o", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not an earlier fabricc output" in r.stderr, r.stderr


@pytest.mark.parametrize("out", ["/proc/fabricc-out", "/dev/null/x"])
def test_unwritable_output_is_an_input_error(out):
    r = fabricc("compile", REFERENCE, "-o", out)
    assert r.returncode == 1 and "cannot write" in r.stderr and "Traceback" not in r.stderr
    if out.startswith("/dev/null/"):
        assert "/dev/null is a file, not a folder" in r.stderr


def test_a_closed_stdout_loses_no_file_and_is_no_internal_error(tmp_path):
    """`fabric-run ... | head` where the reader is gone before the summary is printed: the JSON
    and trace files are complete, nothing says "internal error", and the exit is 0 (issue 15)."""
    import json
    import subprocess
    import sys
    out, trace = tmp_path / "r.json", tmp_path / "t.json"
    cmd = [sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--prompt", "512", "--json", str(out),
           "--trace", str(trace)]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.close()                  # the reader went away before a line was written
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == 0, err
    assert "internal error" not in err and "Traceback" not in err, err
    assert json.loads(out.read_text())["ttft_ms"] > 0 and json.loads(trace.read_text())["traceEvents"]


def reference_copy(tmp_path):
    """The reference policy as tmp_path/p.fx, its imports still found."""
    policy = tmp_path / "p.fx"
    policy.write_text(REFERENCE.read_text().replace('import "fabrics/', f'import "{REFERENCE.parent}/fabrics/'))
    return policy


@pytest.mark.parametrize("flag,path,says", [
    ("--json", "{file}/r.json", "{file} is a file, not a folder"),
    ("--trace", "{file}/t.json", "{file} is a file, not a folder"),
    ("--html", "{dir}", "it is a folder; name a file"),
    ("--plot", "{file}", "it is not a folder; name a folder"),
])
def test_an_output_fabric_run_cannot_write_is_refused_before_the_run(tmp_path, flag, path, says):
    """A path under a file, or a folder where a file is asked for: exit 1 with the path and
    why, before anything runs (the policy named does not even exist), nothing written."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    path, says = (x.format(file=file, dir=tmp_path) for x in (path, says))
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", tmp_path / "gone",
                        flag, path], capture_output=True, text=True)
    assert r.returncode == 1 and f"cannot write {path}: {says}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_output_that_is_the_policy_the_run_reads_is_refused(tmp_path):
    """`--json p.fx` (a slip for `--json p.json`) would replace the policy with its report."""
    policy = reference_copy(tmp_path)
    folder = tmp_path / "out"
    assert fabricc("compile", policy, "-o", folder).returncode == 0
    for given, flag, path in [(policy, "--json", policy), (folder, "--trace", folder / "manifest.json"),
                              (folder, "--plot", folder)]:
        before = {p: p.read_bytes() for p in [policy, *folder.iterdir()]}
        r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", given, flag, path],
                           capture_output=True, text=True)
        assert r.returncode == 1 and f"{flag} {path}: that is the policy this run reads" in r.stderr, r.stderr
        assert {p: p.read_bytes() for p in before} == before


def test_plots_the_system_refuses_to_write_are_an_input_error():
    pytest.importorskip("matplotlib")
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--prompt", "256", "-q",
                        "--plot", "/proc/fabric-plots"], capture_output=True, text=True)
    assert r.returncode == 1 and "cannot write the plots to /proc/fabric-plots: " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_fabricc_graph_says_why_it_cannot_write(tmp_path):
    r = fabricc("graph", REFERENCE, "-o", "/dev/null/g.json")
    assert r.returncode == 1 and "/dev/null is a file, not a folder" in r.stderr and "Traceback" not in r.stderr
    r = fabricc("graph", REFERENCE, "-o", "/proc/fabricc-graph.json")      # refused by the system as it writes
    assert r.returncode == 1 and "cannot write /proc/fabricc-graph.json: " in r.stderr and "Traceback" not in r.stderr
    policy = reference_copy(tmp_path)
    before = policy.read_text()
    r = fabricc("graph", policy, "-o", policy)
    assert r.returncode == 1 and "that is a policy source this graph is read from" in r.stderr
    assert policy.read_text() == before


def test_an_output_through_a_link_replaces_the_file_it_names_and_a_stream_is_written_as_one(tmp_path):
    """An output path that is a link keeps it (the file it names replaced whole); a pipe or a
    device (`--json /dev/stdout`) is written as a stream, never replaced by a file."""
    import os
    import stat
    import threading

    from fabric_ext.runtime.machine.fsutil import atomic_write_text
    (tmp_path / "report.json").write_text("old")
    (tmp_path / "link.json").symlink_to("report.json")
    atomic_write_text(tmp_path / "link.json", "new\n")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "report.json").read_text() == "new\n"
    pipe, got = tmp_path / "pipe", []
    os.mkfifo(pipe)
    reader = threading.Thread(target=lambda: got.append(pipe.read_text()), daemon=True)
    reader.start()
    atomic_write_text(pipe, "streamed\n")
    reader.join(10)
    assert got == ["streamed\n"] and stat.S_ISFIFO(pipe.lstat().st_mode)
    before = os.lstat("/dev/stdout")
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--prompt", "256", "-q",
                        "--json", "/dev/stdout"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ttft_ms"] > 0 and os.lstat("/dev/stdout").st_mode == before.st_mode


# ---- fabricc hooks ----------------------------------------------------------------------------
def test_fabricc_hooks_lists_every_hook_of_the_catalogue():
    from fabric_ext.contract.hooks import HOOKS
    r = fabricc("hooks")
    assert r.returncode == 0
    listed = [line.split()[0].removesuffix("(PERIOD)") for line in r.stdout.splitlines()]
    assert listed == [f"{k}.{n}" for k, n in HOOKS]
    assert fabricc("hooks", "*.tick").stdout.count("(PERIOD)") == sum(n == "tick" for _, n in HOOKS)


def test_fabricc_hooks_verbose_shows_each_field_and_decision_as_the_catalogue_has_it():
    from fabric_ext.contract.hooks import HOOKS
    h = HOOKS["cxl_switch", "forward"]
    out = fabricc("hooks", "cxl_switch.forward", "-v").stdout
    assert f"{h.ctx_size} bytes" in out
    for f in h.fields:
        line = next(x for x in out.splitlines() if x.split()[:1] == [f.name])
        assert f.ctype in line
        assert (f"default {f.default}" in line and f.effect in line) if f.decision else f.doc in line


def test_fabricc_hooks_names_the_closest_hook_for_a_typo():
    r = fabricc("hooks", "cxl_switch.forwad")
    assert r.returncode == 1 and "did you mean 'cxl_switch.forward'" in r.stderr and not r.stdout


def test_include_folders_on_both_command_lines(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "fab.fx").write_text((POLICIES / "fabrics" / "dgx_h100.fx").read_text())
    policy = tmp_path / "p.fx"
    policy.write_text('import "fab"\nworkload w { model: "llama3-8b"; prompt: 128; tp: 2 }\n')
    assert fabricc("check", policy).returncode == 1
    assert fabricc("check", "-I", lib, policy).returncode == 0
    assert fabricc("check", "-I", tmp_path / "nope", policy).returncode == 2
    run = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "-I", str(lib), "--policy",
                          str(policy), "-q", "--json", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "r.json").read_text())["gpu"] == "h100_sxm"
    bad = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "-I", str(tmp_path / "nope"),
                          "--policy", str(policy), "-q"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no such folder" in bad.stderr


def test_two_policies_run_on_one_workload_side_by_side(tmp_path):
    """fabric-run --policy a --policy b: each run on the same workload, one table, one JSON."""
    out = tmp_path / "cmp.json"
    r = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy",
                        str(POLICIES / "prefill_qos.fx"), "--policy", str(POLICIES / "nic_pacing.fx"),
                        "--model", "llama3-8b", "--prompt", "512", "--tp", "2", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "fabric-run-compare/1"
    assert [Path(x["policy"]).stem for x in doc["runs"]] == ["prefill_qos", "nic_pacing"]
    assert doc["runs"][0]["workload"]["prompt"] == doc["runs"][1]["workload"]["prompt"] == 512
    row = next(line for line in r.stdout.splitlines() if line.startswith("nic_pacing "))
    assert f"{doc['runs'][1]['ttft_ms']:.3f}" in row
    assert "prefill_qos GB/s" in r.stdout and "nic_pacing stall ms" in r.stdout
    traced = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy",
                             str(POLICIES / "prefill_qos.fx"), "--policy", str(POLICIES / "nic_pacing.fx"),
                             "--trace", str(tmp_path / "t.json")], capture_output=True, text=True)
    assert traced.returncode == 2 and "take one policy" in traced.stderr


def _complete(script_path, *words):
    """What bash completes for the command line ``words`` (the last one being typed)."""
    line = " ".join(f"'{w}'" for w in words)
    out = subprocess.run(["bash", "-c", f'source {script_path}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; '
                          f'_fx_{words[0].replace("-", "_")}; printf "%s\\n" "${{COMPREPLY[@]}}"'],
                         capture_output=True, text=True, cwd=script_path.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to complete in")
def test_bash_completion_follows_the_parsers(tmp_path):
    """`fabricc completion bash`: subcommands, each one's options, an option's choices, files
    elsewhere, for all three tools; what it lists is what the parsers take."""
    r = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "completion", "bash"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "fx.bash"
    script.write_text(r.stdout)
    (tmp_path / "policy.fx").write_text("")
    assert _complete(script, "fabricc", "c") == ["check", "compile", "completion"]
    assert _complete(script, "fabricc", "compile", "--m") == ["--mcpu"]
    assert _complete(script, "fabricc", "compile", "--mcpu", "") == ["v1", "v2", "v3", "v4"]
    assert _complete(script, "fabricc", "check", "pol") == ["policy.fx"]
    assert _complete(script, "fabric-run", "--backend", "") == ["interp", "jit", "kernel"]
    assert "--baseline" in _complete(script, "fabric-run", "--b")
    assert _complete(script, "fabric-vm", "") == ["run", "disasm"]
    assert _complete(script, "fabric-vm", "run", "--h") == ["--help", "--hook"]
    bad = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "completion", "fish"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_fabric_run_help_names_the_serving_stack_a_run_takes_by_default():
    import re

    import fabric_ext
    help_text = subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--help"],
                               capture_output=True, text=True).stdout
    default = re.search(r"default: the\s+workload's, else (\w+)\)", help_text).group(1)
    bundle = fabric_ext.compile(f'import "{POLICIES}/fabrics/dgx_h100.fx"\n'
                                'workload w { model: "llama3-8b"; prompt: 512; tp: 2 }\n', werror=False)
    assert fabric_ext.run(bundle).ttft_ms == fabric_ext.run(bundle, stack=default).ttft_ms \
        != fabric_ext.run(bundle, stack="none").ttft_ms


def test_a_policy_in_a_folder_of_any_name_compiles_and_runs(tmp_path):
    """A folder name with a byte that is not UTF-8 and a C comment's end (`*/`): the name goes
    into LLVM's debug info, the C listing's comments, the compiled-policy cache and the
    reports, shown with U+FFFD where it is not UTF-8 (it was an internal error in each), and
    the listing still builds."""
    folder = tmp_path / os.fsdecode(b"x\xff*")
    folder.mkdir()
    shutil.copytree(POLICIES / "fabrics", folder / "fabrics")
    shutil.copy(POLICIES / "kv_tiering.fx", folder / "p.fx")
    r = subprocess.run([sys.executable, "-m", "fabric_ext.cli", "compile", folder / "p.fx", "-o", folder / "out"],
                       capture_output=True)    # (it names the folder as the file system has it: not UTF-8)
    assert r.returncode == 0, r.stderr
    listing = (folder / "out" / "sw0.bpf.c").read_text()
    assert "x\ufffd*\\/p.fx" in listing.splitlines()[1] and "*/p.fx" not in listing
    if shutil.which("clang"):
        built = subprocess.run(["clang", "-target", "bpf", "-O2", f"-I/usr/include/{platform.machine()}-linux-gnu",
                                "-c", "sw0.bpf.c", "-o", str(tmp_path / "sw0.o")],
                               cwd=folder / "out", capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
    env = {"FABRIC_EXT_BUNDLE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", folder / "p.fx",
                            "--prompt", "2048", "--html", folder / "r.html", "--json", folder / "r.json"],
                           capture_output=True, env=env) for _ in range(2)]   # the second from the cache
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr.decode(errors="replace")
    assert list((tmp_path / "cache").glob("*.bundle")) and runs[1].stderr == runs[0].stderr
    assert "x\ufffd*/p.fx" in (folder / "r.html").read_text()
    assert json.loads((folder / "r.json").read_text())["policy"]
