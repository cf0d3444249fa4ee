"""The LALR parser of grammar.lark, built once and shipped (`grammar.tables.json`) instead of
rebuilt in every process.

Building the tables costs more than parsing a policy, and Lark's own cache (``cache=True``)
would load them as a pickle from the shared temporary folder, which anyone can plant.  The
shipped file is part of the package, like its code; it carries the sha256 of the grammar and
the Lark version it was built from, and where either differs the parser is built from the
grammar instead (same parser, only slower).  ``python -m fabric_ext.grammar_tables`` rewrites
it; a test holds it equal to a fresh build.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import lark
from lark.grammar import Rule
from lark.lexer import TerminalDef

GRAMMAR = Path(__file__).with_name("grammar.lark")
TABLES = Path(__file__).with_name("grammar.tables.json")
OPTIONS = {"parser": "lalr", "propagate_positions": True, "maybe_placeholders": True}


def build() -> lark.Lark:
    return lark.Lark(GRAMMAR.read_text(), **OPTIONS)


def load() -> lark.Lark:
    """The parser from the shipped tables where they are those of this grammar and Lark, else built."""
    stamp = _stamp()
    try:
        doc = json.loads(TABLES.read_text(), object_hook=_decode)
    except (OSError, ValueError):
        return build()
    if doc.get("stamp") != stamp:
        return build()
    return lark.Lark.__new__(lark.Lark)._load({"data": doc["data"], "memo": doc["memo"]})


def dumps(parser: lark.Lark) -> str:
    data, memo = parser.memo_serialize([TerminalDef, Rule])
    return json.dumps(_encode({"stamp": _stamp(), "data": data, "memo": memo}), sort_keys=True,
                      separators=(",", ":")) + "\n"


def _stamp() -> dict:
    return {"grammar_sha256": hashlib.sha256(GRAMMAR.read_bytes()).hexdigest(), "lark": lark.__version__}


# JSON keeps neither tuples nor dicts keyed by numbers (the parse table's states): tag them
def _encode(x):
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _encode(v) for k, v in x.items()}
        return {"#items": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"#tuple": [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    return x


def _decode(d: dict):
    if "#items" in d:
        return {_hashable(k): v for k, v in d["#items"]}
    if "#tuple" in d:
        return tuple(d["#tuple"])
    return d


def _hashable(k):
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


if __name__ == "__main__":
    TABLES.write_text(dumps(build()))
    print(f"wrote {TABLES}", file=sys.stderr)
