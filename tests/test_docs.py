"""Every example in docs/language.md and the README compiles (issue 13: the docs show what the
language accepts): the declaration blocks of language.md as one program, its statement block
inside a handler, and the README's policy against the bundled fabric."""
import re
import shutil

from conftest import POLICIES, ROOT
from fabric_ext.frontend import analyze

DECLARATION = re.compile(r"^(fabric|workload|movement|map|import|param)\b")


def blocks(path):
    """The fenced code blocks of a Markdown file that are .fx (no shell, no output, no template)."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL):
        if lang in ("sh", "json", "python") or "NAME" in body or "…" in body or re.match(r"^\S+\.fx:\d+", body):
            continue
        out.append(body)
    return out


def check_clean(tmp_path, text, name="docs.fx"):
    path = tmp_path / name
    path.write_text(text)
    a = analyze(path)
    assert not a.diags.items, "\n".join(f"{d.span}: {d.severity}: {d.message}" for d in a.diags.items) + "\n" + text


def test_language_reference_examples_compile(tmp_path):
    found = blocks(ROOT / "docs" / "language.md")
    declarations = [b for b in found if DECLARATION.match(b)]
    statements = [b for b in found if not DECLARATION.match(b)]
    assert len(declarations) >= 4 and statements
    body = "\n".join("    " + line for b in statements for line in b.splitlines())
    check_clean(tmp_path, "\n".join(declarations) + "\npolicy docs {\n  on kv_export.issue at gpu0 {\n"
                + body + "\n  }\n  on sw0.tick(10us) { port_util[ev.port] = ev.util_pct }\n"
                "  on kv_bytes_writer.forward { kv_bytes[ev.src] += ev.bytes }\n}\n"
                "movement kv_bytes_writer = kv : gpu* -> pool0\n")


def test_readme_policy_compiles(tmp_path):
    found = [b for b in blocks(ROOT / "README.md") if b.startswith("import")]
    assert len(found) == 1
    shutil.copytree(POLICIES / "fabrics", tmp_path / "fabrics")
    check_clean(tmp_path, found[0], "readme.fx")


def test_the_hook_tables_of_the_language_reference_are_the_catalogue():
    """docs/language.md shows the hooks, when they fire and what each decision does as
    `hooks.markdown()` renders them from the catalogue: a decision whose effect changes in
    hooks.py and not in the docs fails here."""
    from fabric_ext.contract import hooks
    text = (ROOT / "docs" / "language.md").read_text()
    generated = text.split(hooks.DOCS_BEGIN, 1)[1].split(hooks.DOCS_END, 1)[0].strip()
    assert generated == hooks.markdown(), "run: python -m fabric_ext.contract.hooks docs/language.md"
    for h in hooks.HOOKS.values():
        for f in h.decisions:
            assert f"| `{f.name}` |" in generated and f.effect in generated


def test_the_readme_api_example_runs(monkeypatch, capsys):
    """The README's Python example, as written, from the repository's folder."""
    found = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert len(found) == 1
    monkeypatch.chdir(ROOT)
    exec(compile(found[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"^\d+\.\d ms, baseline \d+\.\d ms$", out, re.MULTILINE), out
    assert "KV export at" in out


def test_the_diagnosing_example_of_docs_explain_compiles_in_the_reference_policy(tmp_path):
    block = re.findall(r"^```\n(on .*?)^```", (ROOT / "docs" / "explain.md").read_text(), re.MULTILINE | re.DOTALL)
    assert len(block) == 1
    shutil.copytree(POLICIES / "fabrics", tmp_path / "fabrics")
    policy = (POLICIES / "prefill_qos.fx").read_text().replace(
        "policy prefill_qos {", "map kv_wait : hash<device, time>[8]\nmap kv_written : hash<device, size>[8]\n"
        "policy prefill_qos {\n" + block[0])
    assert block[0] in policy
    check_clean(tmp_path, policy, "explain.fx")
