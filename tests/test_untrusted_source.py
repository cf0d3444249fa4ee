""".fx sources are untrusted input: every malformed one is an error with file:line:col (exit 1),
never an internal error, a hang, an echo of a file that is not a policy, or a wrapped constant."""
import os
import subprocess
import sys

import pytest

from conftest import FABRIC, FABRIC_LINES

LINE = FABRIC_LINES + 1
HANDLER = "policy p {{ on kv.forward at sw0 {{ {} }} }}\n"


def fabricc(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fabric_ext.cli", *map(str, args)], capture_output=True,
                          cwd=cwd, timeout=120, check=False)


@pytest.mark.parametrize("name,body,where,says", [
    ("not_utf8", FABRIC.encode() + b"// caf\xe9\n", f"{LINE}:7", "byte 0xe9 is not UTF-8 text"),
    ("long_number", HANDLER.format("priority = " + "9" * 5000), f"{LINE}:46", "too long"),
    ("huge_chunk", FABRIC.replace("movement kv = kv : gpu* -> pool0",
                                  "movement kv = kv : gpu* -> pool0 { chunk: 9999999999999999999999999MiB }"),
     "11:43", "more than fits in 64 bits"),
    ("rate_overflows", HANDLER.format("rate = 99999999999TB/s"), f"{LINE}:42", "more than fits in 64 bits"),
    ("two_to_the_64", HANDLER.format("rate = 18446744073709551616B/s"), f"{LINE}:42", "more than fits in 64 bits"),
    ("hex_overflows", "map big : array<u32, u64>[0x1ffffffffffffffff]\n", f"{LINE}:27", "more than fits"),
    ("huge_ringbuf", "map rb : ringbuf[1TiB]\n", f"{LINE}:18", "ringbuf 'rb' is too large"),
    # each within the 64 MiB of one map; with the fabric's maps, past the 1 GiB of all of a policy's
    ("maps_too_large_together", "".join(f"map rb{i} : ringbuf[64MiB]\n" for i in range(16)), f"{LINE + 15}:20",
     "the maps up to 'rb15' take 1,073,74"),
    ("long_expression", HANDLER.format("priority = " + " + ".join(["1"] * 20000)), f"{LINE}:", "split the expression"),
    ("deep_ifs", HANDLER.format("if ev.bytes > 1 { " * 500 + "priority = 1 " + "} " * 500), f"{LINE}:",
     "nest more than 64 deep"),
    ("deep_parens", HANDLER.format("priority = " + "(" * 3000 + "1" + ")" * 3000), f"{LINE}:", "nest more than"),
    ("tiny_chunk", FABRIC.replace("movement kv = kv : gpu* -> pool0", "movement kv = kv : gpu* -> pool0 { chunk: 1B }"),
     "11:43", "'chunk' must be a whole size from 4 KiB"),
    ("no_prefetch", 'workload w { weights: pool0; prefetch: 0 }\n', f"{LINE}:40",
     "'prefetch' must be a whole count from 1"),      # the runtime issues a layer ahead at least
    ("import_device", 'import "/dev/zero"\n', f"{LINE}:1", "imports name .fx policy sources"),
    ("import_secret", 'import "/etc/passwd"\n', f"{LINE}:1", "imports name .fx policy sources"),
    ("nul_byte", FABRIC.encode() + b"map m\x00 : array<u32, u64>[4]\n", f"{LINE}:6", "unexpected character U+0000"),
])
def test_malformed_sources_are_errors_with_position(tmp_path, name, body, where, says):
    path = tmp_path / f"{name}.fx"
    data = body if isinstance(body, bytes) else (body if body.startswith(FABRIC[:20]) else FABRIC + body).encode()
    path.write_bytes(data)
    r = fabricc("check", path)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 1, err
    assert f"{name}.fx:{where}" in err and says in err, err
    assert "internal error" not in err and "Traceback" not in err and "root:" not in err


def test_imports_read_only_bounded_regular_files(tmp_path):
    (tmp_path / "zero.fx").symlink_to("/dev/zero")
    (tmp_path / "big.fx").write_bytes(b"// " + b"x" * (1 << 20) + b"\n")
    for target, says in (("zero.fx", "not a regular file"), ("big.fx", "at most 1 MiB")):
        root = tmp_path / f"uses_{target}"
        root.write_text(f'import "{target}"\n' + FABRIC)
        r = fabricc("check", root)
        assert r.returncode == 1 and says.encode() in r.stderr, r.stderr


def test_the_parser_builds_no_tables_from_the_shared_temporary_folder(tmp_path):
    """Lark's cache=True loads a pickle from the temporary folder anyone can write to."""
    env = os.environ | {"TMPDIR": str(tmp_path)}
    src = tmp_path / "p.fx"
    src.write_text(FABRIC)
    subprocess.run([sys.executable, "-m", "fabric_ext.cli", "check", str(src)], env=env, check=True,
                   capture_output=True)
    assert not [p for p in tmp_path.iterdir() if "lark" in p.name]


FRAGMENTS = ["{", "}", "(", ")", "[", "]", "=", "==", "ev.", "ev.bytes", "9" * 30, "99999999999TB/s", "0x" + "f" * 20,
             "1.5.5", "%", "/*", "*/", "//", '"', "import", "policy", "on", "at", "if", "else", "let", "..", "<->",
             "\x00", "\u00e9", "\U0001f600", "movement", "map", ":", ";", ",", "gpu*", "tick(0us)", "-", "!"]


def mutants(text: str, rng, n: int):
    """Deterministic random damage: cut, repeat, or splice fragments into a source."""
    for _ in range(n):
        t = text
        for _ in range(rng.randint(1, 4)):
            i, j = sorted(rng.randrange(len(t) + 1) for _ in range(2))
            kind = rng.random()
            if kind < 0.3:
                t = t[:i] + t[j:]
            elif kind < 0.5:
                t = t[:j] + t[i:j] * rng.randint(2, 20) + t[j:]
            else:
                t = t[:i] + rng.choice(FRAGMENTS) + t[i:]
        yield t


def test_damaged_policies_never_give_an_internal_error(tmp_path, capsys):
    """Random damage to every bundled policy (seeded): each checks and compiles clean or is an
    error at a position; no internal error, no traceback.  In process, through fabricc's entry."""
    import random
    import shutil

    from conftest import EXAMPLES
    from fabric_ext import cli
    shutil.copytree(EXAMPLES[0].parent / "fabrics", tmp_path / "fabrics")
    rng = random.Random(2026)
    tried = errors = 0
    for example in EXAMPLES:
        for text in mutants(example.read_text(), rng, 40):
            path = tmp_path / "m.fx"
            path.write_bytes(text.encode("utf-8", "surrogatepass"))
            code = cli.main(["check", str(path)])
            if code == 0:       # what checks clean must also compile, or fail with a position
                code = cli.main(["compile", str(path), "-o", str(tmp_path / "out")])
            err = capsys.readouterr().err
            assert code in (0, 1), err
            assert "internal error" not in err and "Traceback" not in err, (text, err)
            tried += 1
            errors += code == 1
    assert errors > tried // 2


@pytest.mark.parametrize("workload,where,says", [
    ('model: "llama3-8bb"; tp: 2', "2:21", "did you mean 'llama3-8b'?"),
    ('model: "llama3-8b"; tp: 3', "2:38", "tp 3 cannot split llama3-8b"),
    ('model: "llama3-8b"; tp: 16', "2:38", "tp 16 needs 16 GPUs; the fabric has 8"),
    ('model: "/dev/zero"; tp: 2', "2:21", "unknown model"),
])
def test_workload_errors_at_their_position(tmp_path, workload, where, says):
    """The workload is checked against the models the runtime knows, by fabricc check and
    compile, before anything runs (it was found only at run time, without a position)."""
    from conftest import POLICIES
    path = tmp_path / "w.fx"
    path.write_text(f'import "{POLICIES}/fabrics/dgx_cxl.fx"\nworkload w {{ {workload} }}\n')
    for cmd in (["check", path], ["compile", path, "-o", tmp_path / "out"]):
        r = fabricc(*cmd)
        err = r.stderr.decode()
        assert r.returncode == 1 and f"w.fx:{where}" in err and says in err, err
