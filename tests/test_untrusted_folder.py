"""A policy folder is untrusted input: tampered manifests and artifacts end in one clear error
naming the file and key (exit 1), never a traceback, a hang or an unbounded allocation."""
import json
import random
import shutil

import pytest

from fabric_ext.runtime.simulation import cli
from policy_helpers import compiled

BAD_VALUES = [None, -1, 0, 1.5, 2 ** 40, 2 ** 64, "x", "../../etc/passwd", [], {}, True, "\u00e9" * 5000]


def leaves(node, path=()):
    """Every (path, value) of a parsed JSON document, containers included."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):          # the first few items of each list stand for the rest
            yield from leaves(v, path + (i,))


def set_at(doc, path, value):
    node = doc
    for p in path[:-1]:
        node = node[p]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value


@pytest.fixture(scope="module")
def original():
    return json.loads((compiled("prefill_qos") / "manifest.json").read_text())


def run_folder(folder, capsys):
    code = cli.main(["--policy", str(folder), "--prompt", "256", "-q", "--max-events", "2000000"])
    err = capsys.readouterr().err
    assert code in (0, 1), err
    assert "internal error" not in err and "Traceback" not in err, err
    return code, err


def tampered(tmp_path, manifest):
    folder = tmp_path / "out"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(compiled("prefill_qos"), folder)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_tampered_manifests_give_one_clear_error(tmp_path, capsys, original):
    rng = random.Random(12)
    paths = [p for p, _ in leaves(original) if p]
    cases = [(p, v) for p in rng.sample(paths, 60) for v in rng.sample(BAD_VALUES, 3)]
    cases += [(p, KeyError) for p in rng.sample(paths, 30)]
    failed = 0
    for path, value in cases:
        man = json.loads(json.dumps(original))
        set_at(man, path, value)
        code, err = run_folder(tampered(tmp_path, man), capsys)
        if code:
            failed += 1
            assert "manifest.json" in err or ".json" in err or ".bpf.o" in err, (path, value, err)
    assert failed > len(cases) // 2      # most tampering is caught before anything runs


@pytest.mark.parametrize("path,value,says", [
    (("maps", 0, "max_entries"), 2 ** 40, "key maps[0].max_entries: expected an integer in"),
    (("files",), KeyError, "key files: missing"),
    (("programs", 0, "object"), "/etc/passwd", "key programs[0].object: expected a name"),
    (("programs", 0, "tick_periods_ns"), [0], "key programs[0].tick_periods_ns[0]: expected an integer in 1.."),
    (("programs", 0, "island"), "gpu99", "'gpu99' is not a island of this manifest"),
    (("programs", 0, "hook"), "nope", "gpu islands have no hook 'nope'"),
    (("fabric", "links", 0, "bw"), 0, "key fabric.links[0].bw: expected a number > 0"),
    (("fabric", "links", 0, "bw"), -5e9, "key fabric.links[0].bw"),
    (("fabric", "links", 0, "dst"), "nowhere", "key fabric.links[0].dst: 'nowhere' is not a device"),
    (("workload", "chunk"), 1, "key workload.chunk: expected an integer in 4096.."),
    (("workload", "chunk"), 2097152.5, "key workload.chunk"),
    (("workload", "prompt"), 10 ** 14, "key workload.prompt"),
    (("movements", 0, "chunk"), 1.5, "key movements[0].chunk"),
    (("fabric", "devices", 0, "props", "hbm_bw"), "fast", "key fabric.devices[0].props.hbm_bw: expected a number"),
    (("fabric", "devices", 0, "props", "hbm"), 0, "key fabric.devices[0].props.hbm: expected a number > 0"),
    (("workload", "weights"), "sw0", "key workload.weights: 'weights' cannot name sw0, a cxl_switch"),
    (("workload", "kv_export"), "pool0", "key workload.kv_export: 'kv_export' cannot name pool0, a cxl_mem"),
])
def test_each_boundary_names_the_key(tmp_path, capsys, original, path, value, says):
    man = json.loads(json.dumps(original))
    set_at(man, path, value)
    code, err = run_folder(tampered(tmp_path, man), capsys)
    assert code == 1 and says in err, err


def test_a_second_link_in_one_direction_is_refused(tmp_path, capsys, original):
    """The engine keeps one link a direction: a manifest with two would run on whichever came last."""
    man = json.loads(json.dumps(original))
    man["fabric"]["links"].append(dict(man["fabric"]["links"][0], bw=1.0))
    code, err = run_folder(tampered(tmp_path, man), capsys)
    assert code == 1 and f"key fabric.links[{len(man['fabric']['links']) - 1}]: a second link from" in err, err


def test_maps_each_small_enough_but_too_large_together_are_refused(tmp_path, capsys, original):
    """Each map is bounded (64 MiB); 17 of them were made, 1.1 GB, before this bound on all."""
    man = json.loads(json.dumps(original))
    base = {k: v for k, v in man["maps"][0].items() if k != "hist"}
    man["maps"] += [dict(base, name=f"ring{i}", kind="ringbuf", key_size=0, value_size=0, max_entries=64 << 20)
                    for i in range(17)]
    code, err = run_folder(tampered(tmp_path, man), capsys)
    assert code == 1 and "bytes together; the runtime allows 1024 MiB for all the maps" in err, err


def test_the_files_a_folder_may_hold(tmp_path, capsys, original):
    """Deep nesting, a huge manifest, an artifact that is a link out of the folder, or a
    runtime artifact with its digest updated but its content malformed."""
    folder = tampered(tmp_path, original)
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in run_folder(folder, capsys)[1]
    (folder / "manifest.json").write_bytes(b" " * (65 << 20))
    assert "more than the 64 MiB" in run_folder(folder, capsys)[1]
    folder = tampered(tmp_path, original)
    (folder / "gpu0.bpf.o").unlink()
    (folder / "gpu0.bpf.o").symlink_to("/etc/passwd")
    code, err = run_folder(folder, capsys)
    assert code == 1 and "not a regular file" in err and "root:" not in err
    import hashlib
    folder = tampered(tmp_path, original)
    bad = b'{"0": {"type": "bpf_map_handler"}}'
    (folder / "sw0.dputime.json").write_bytes(b'{"schema": "dputime/1", "maps": [{"name": 1}]}')
    (folder / "gpu0.bpftime.json").write_bytes(bad)
    man = json.loads(json.dumps(original))
    man["files"]["sw0.dputime.json"] = hashlib.sha256((folder / "sw0.dputime.json").read_bytes()).hexdigest()
    man["files"]["gpu0.bpftime.json"] = hashlib.sha256(bad).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(man))
    code, err = run_folder(folder, capsys)
    assert code == 1 and "malformed" in err, err


@pytest.mark.parametrize("args,says", [
    (["--max-events", "1000"], "the run passed 1,000 events"),
    (["--prompt", "0"], "prompt must be a whole number from 1 to 1048576, not 0"),
    (["--prompt", "99999999999999"], "prompt must be a whole number"),
    (["--tp", "0"], "tp must be a whole number from 1"),
    (["--tp", "3"], "tp 3 cannot split llama3-8b (32 query heads, 8 KV heads) evenly"),
    (["--batch", "0"], "batch must be a whole number from 1"),
    (["--chunk", "0"], "--chunk must be from 1 to the prompt's 8192 tokens, not 0"),
    (["--model", "llama3-7b"], "unknown model 'llama3-7b'"),
])
def test_runs_are_bounded(capsys, args, says):
    """No run is endless: the event limit stops one (documented, overridable), and workload
    values outside their ranges are refused before anything runs."""
    code = cli.main(["--policy", str(compiled("prefill_qos")), "-q", *args])
    err = capsys.readouterr().err
    assert code == 1 and says in err, err


def test_a_run_of_a_policy_source_writes_nothing_and_stops_on_a_signal(tmp_path):
    """fabric-run --policy X.fx compiles in memory: nothing lands in the temporary folder, and
    a SIGTERM ends the run with 128 + 15."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import POLICIES
    env = os.environ | {"TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "fabric_ext.runtime.simulation.cli", "--policy", str(POLICIES / "prefill_qos.fx"),
           "--model", "llama3-70b", "--prompt", "32768", "--chunk", "512", "-q"]   # a minute or more
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    r = subprocess.run(cmd[:5] + ["--prompt", "256", "-q"], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(("fx-jit", "pymp-"))], list(tmp_path.iterdir())


def test_the_event_limit_and_jit_checks_reach_the_run(tmp_path):
    """--max-events 0 lifts the limit (the run completes); --jit-checks all reaches the JIT
    backend and the report says so."""
    import json
    out = tmp_path / "r.json"
    code = cli.main(["--policy", str(compiled("prefill_qos")), "-q", "--prompt", "256", "--max-events", "0",
                     "--backend", "jit", "--jit-checks", "all", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["backend_load"]["checks"] == "all" and report["events"] > 1000
    from fabric_ext.runtime.simulation import stats
    assert "every access checked at run time" in stats.render(report)


@pytest.mark.parametrize("backend,says", [("interp", "checks every access anyway"),
                                           ("kernel", "runs what the kernel's verifier accepts")])
def test_jit_checks_with_a_backend_it_does_not_reach_is_a_usage_error(capsys, backend, says):
    """--jit-checks has an effect on the JIT only: with another backend it would be ignored,
    so it is refused (exit 2) before anything runs."""
    code = cli.main(["--policy", str(compiled("prefill_qos")), "-q", "--backend", backend, "--jit-checks", "all"])
    assert code == 2 and f"--jit-checks all is for the JIT (--backend jit); the {backend} backend {says}" \
        in capsys.readouterr().err


def test_a_model_config_is_read_bounded(tmp_path, capsys):
    big = tmp_path / "config.json"
    big.write_bytes(b" " * (2 << 20))
    code = cli.main(["--policy", str(compiled("prefill_qos")), "-q", "--model", str(big)])
    err = capsys.readouterr().err
    assert code == 1 and "not a usable Hugging Face config" in err and "allowed" in err, err


@pytest.mark.parametrize("path,value,says", [
    (("movements", 0, "flows", 0, "path", 1), "gpu3", "movements[0].flows[0].path[1]: no link from 'pool0' to 'gpu3'"),
    (("movements", 0, "flows", 0, "path"), ["gpu0"], "movements[0].flows[0].path: a path from 'pool0'"),
    (("movements", 0, "flows", 0, "path"), KeyError, "key movements[0].flows[0].path: missing"),
])
def test_a_flow_path_the_runtime_would_follow_must_run_over_links(tmp_path, capsys, original, path, value, says):
    """The runtime moves chunks along the manifest's paths: one that skips a link is refused."""
    man = json.loads(json.dumps(original))
    set_at(man, path, value)
    code, err = run_folder(tampered(tmp_path, man), capsys)
    assert code == 1 and says in err, err
