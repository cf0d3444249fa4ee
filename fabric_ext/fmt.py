"""`fabricc fmt`: lay a policy out the one way, keeping every token and comment.

What it changes, and only this:
- indentation: two spaces per open brace, four more on a line that continues an open
  parenthesis or bracket (inside a block comment, lines are left as written);
- spaces: at least one on each side of an assignment, update or comparison operator and of
  an arrow, one after a comma and none before it or before a semicolon (alignment with
  more spaces is kept);
- lines: no trailing spaces, no blank lines at the end, one newline at the end; a file whose
  every line ends in CRLF keeps CRLF (a byte-order mark at its start, which the loader
  ignores, is not written back).

Lines are never joined, split or dropped, so every line keeps its number: a diagnostic, or
an object's line info, points where it did.  The text it returns holds the same tokens
(`parser.TOKENS`), comments included, in the same order (`format_source` checks that before
returning); formatting is idempotent.
"""
from __future__ import annotations

import re

from fabric_ext.parser import TOKENS
from fabric_ext.runtime.machine.errors import FabricError

_WHITE = re.compile(r"\r?\n|[^\S\n]+")
#: operators that get a space on each side
SPACED = frozenset({"=", "+=", "-=", "|=", "&=", "max=", "min=", "==", "!=", "<=", ">=", "&&", "||", "->", "<->"})
OPEN, CLOSE = {"{": "}", "(": ")", "[": "]"}, {"}", ")", "]"}
INDENT = "  "


class FormatError(FabricError):
    """The formatter would have changed the tokens: a bug, reported instead of written."""


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) of each token (`parser.TOKENS`) and each run of white space between them:
    kind is comment, string, code, space or newline."""
    out, pos = [], 0
    for m in TOKENS.finditer(text):
        out += _white(text, pos, m.start())
        tok = m.group()
        out.append(("comment" if tok[:2] in ("//", "/*") else "string" if tok[0] == '"' else "code", tok))
        pos = m.end()
    return out + _white(text, pos, len(text))


def _white(text: str, start: int, end: int) -> list[tuple[str, str]]:
    return [("newline" if w.group()[-1] == "\n" else "space", w.group()) for w in _WHITE.finditer(text, start, end)]


def _lines(tokens):
    """The tokens split into source lines (a block comment stays inside the line it starts on)."""
    line: list[tuple[str, str]] = []
    for kind, tok in tokens:
        if kind == "newline":
            yield line
            line = []
        else:
            line.append((kind, tok))
    yield line


def _spaced(line: list[tuple[str, str]]) -> str:
    """A line's tokens joined with the spacing rules (its leading spaces dropped)."""
    words = list(line)
    while words and words[0][0] == "space":
        words.pop(0)
    while words and words[-1][0] == "space":
        words.pop()
    out: list[str] = []
    for i, (kind, tok) in enumerate(words):
        if kind == "space":
            out.append("" if words[i + 1][1] in (",", ";") else tok)
            continue
        prev = words[i - 1][1] if i and words[i - 1][0] != "space" else None     # adjacent, no space between
        if prev is not None and (tok in SPACED or prev in SPACED or prev == ",") and not (
                prev == "," and tok in (")", "]")):
            out.append(" ")
        out.append(tok)
    return "".join(out)


def format_source(text: str) -> str:
    """The policy text laid out (see the module's docstring), with the line ends it had (CRLF
    where every line has one)."""
    if "\r\n" in text and text.count("\r\n") == text.count("\n"):
        return format_source(text.replace("\r\n", "\n")).replace("\n", "\r\n")
    tokens = _tokens(text)
    out_lines: list[str] = []
    stack: list[str] = []
    for line in _lines(tokens):
        code = [t for k, t in line if k == "code"]
        closing = 0
        for t in code:                 # closers at the start of the line take its indentation back
            if t in CLOSE:
                closing += 1
            else:
                break
        depth = stack[:len(stack) - closing]
        indent = INDENT * sum(1 for s in depth if s == "{") + INDENT * 2 * any(s != "{" for s in depth)
        body = _spaced(line)
        out_lines.append((indent + body) if body else "")
        for t in code:
            if t in OPEN:
                stack.append(t)
            elif t in CLOSE and stack:
                stack.pop()
    while out_lines and not out_lines[-1]:
        out_lines.pop()
    text_out = "\n".join(out_lines) + "\n" if out_lines else ""
    if [t for t in _tokens(text_out) if t[0] in ("code", "string", "comment")] != \
            [t for t in tokens if t[0] in ("code", "string", "comment")]:
        raise FormatError("formatting would change the policy's tokens")
    return text_out
