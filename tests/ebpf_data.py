"""The .data test format under tests/ebpf/: sections '-- asm', '-- mem' (hex bytes),
'-- result' (r0), '-- error' (a verifier message fragment) or '-- fault' (a run-time one), and
'-- kernel rejects' (why the kernel's verifier rejects a program we accept)."""
from pathlib import Path

DATA = Path(__file__).parent / "ebpf"


def parse(path: Path) -> dict:
    sections, cur = {}, None
    for line in path.read_text().splitlines():
        if line.startswith("-- "):
            cur = line[3:].strip()
            sections[cur] = []
        elif cur is not None:
            sections[cur].append(line)
    out = {k: "\n".join(v).strip() for k, v in sections.items()}
    out["name"] = path.stem
    if "mem" in out:
        out["mem"] = bytes.fromhex("".join(out["mem"].split()))
    if "result" in out:
        out["result"] = int(out["result"], 0)
    return out


CASES = [parse(p) for p in sorted(DATA.glob("*.data"))]
