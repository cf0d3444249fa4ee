"""Diagnostics: source spans, collected errors and warnings, and their rendering.

Passes never raise on a user error: they append a `Diagnostic` to a
`Diagnostics` collection and go on, so one run reports every error of a file.
Rendering follows the usual compiler shape::

    policy.fx:12:9: error: unknown movement 'kv_wrtieback'
       12 |   on kv_wrtieback.forward { priority = 1 }
          |      ~~~~~~~~~~~~
    hint: did you mean 'kv_writeback'?
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fabric_ext.runtime.machine.errors import line_window

SHOWN_COLUMNS = 120      # of a source line under a diagnostic: a longer one is cut around the span


@dataclass(frozen=True)
class Span:
    """A region of a source file; lines and columns start at 1, end is exclusive."""
    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


NO_SPAN = Span("<builtin>", 0, 0, 0, 0)


@dataclass
class Diagnostic:
    severity: str  # "error" | "warning"
    message: str
    span: Span
    hints: list[str] = field(default_factory=list)


class Diagnostics:
    """An ordered collection of diagnostics with the sources needed to render them."""

    def __init__(self) -> None:
        self.items: list[Diagnostic] = []
        self.sources: dict[str, str] = {}

    def error(self, span: Span, message: str, *hints: str | None) -> None:
        self.items.append(Diagnostic("error", message, span, [h for h in hints if h]))

    def warning(self, span: Span, message: str, *hints: str | None) -> None:
        self.items.append(Diagnostic("warning", message, span, [h for h in hints if h]))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "error"]

    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.items)

    def warnings_as_errors(self) -> None:
        """--Werror: every warning so far becomes an error."""
        for d in self.items:
            d.severity = "error"

    def render(self, d: Diagnostic) -> str:
        out = [f"{d.span}: {d.severity}: {d.message}"]
        text = self.sources.get(d.span.file)
        if text is None and d.span.line > 0 and Path(d.span.file).is_file():
            text = Path(d.span.file).read_text(errors="replace")
        lines = text.splitlines() if text else []
        if 0 < d.span.line <= len(lines):
            src = lines[d.span.line - 1].expandtabs(1)
            end = d.span.end_col if d.span.end_line == d.span.line else len(src) + 1
            shown, shift = line_window(src, d.span.col, SHOWN_COLUMNS)
            col, end = d.span.col - shift, min(end - shift, len(shown) + 1)
            gutter = f"{d.span.line:>5} | "
            out.append(gutter + shown)
            width = max(1, end - col)
            mark = "^" if width == 1 else "~" * width
            out.append(" " * (len(gutter) - 2) + "| " + " " * (col - 1) + mark)
        out.extend(f"hint: {h}" for h in d.hints)
        return "\n".join(out)

    def rendered(self) -> str:
        """Every diagnostic as `print` shows it, in source order."""
        return "".join(self.render(d) + "\n"
                       for d in sorted(self.items, key=lambda d: (d.span.file, d.span.line, d.span.col)))

    def print(self, stream=None) -> None:
        (stream or sys.stderr).write(self.rendered())


def closest(name: str, candidates) -> str | None:
    """The candidate nearest to a misspelt name, or None."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(name: str, candidates) -> str | None:
    best = closest(name, candidates)
    return f"did you mean '{best}'?" if best else None
