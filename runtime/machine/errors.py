"""The project's errors, one hierarchy from the machine up: every error a user can meet is a
`FabricError` whose message names the file, line or instruction and what to do.

- `InputError` (exit 1): something given to a tool is wrong: a policy, an object, a program,
  a compiled folder (`ArtifactError`), a workload;
- `OutputError` (exit 1): a path a tool was asked to write that it must not or cannot;
- `UsageError` (exit 2): the command line itself;
- `VMFault`-style run-time faults and `KernelError`s are `FabricError`s of their own kinds.

Each class keeps the built-in base it had (``ValueError``, ``OSError``, ``RuntimeError``) so
that code catching those still does.  The command lines turn them into exit codes
(`fabric_ext.exits`); anything else is a bug, reported as one.
"""
from __future__ import annotations


class FabricError(Exception):
    """An error a user can act on."""


class InputError(FabricError, ValueError):
    """An input that is wrong: its message says where and what to do."""


class ArtifactError(InputError):
    """A compiled artifact (an object, a manifest, a policy folder) that is malformed,
    missing or changed."""


class OutputError(FabricError, OSError):
    """An output we must not (or cannot) write; the message says why and what to do."""


class UsageError(FabricError):
    """A command line that asks for something that cannot be done."""


def line_window(text: str, col: int, width: int) -> tuple[str, int]:
    """What to show of a source line around column ``col`` (from 1): all of it where it
    fits in ``width``, else ``width`` characters from a little before the column, cut with
    '...'; and how far left a column moves in what is shown."""
    if len(text) <= width:
        return text, 0
    start = max(0, min(col - 1 - width // 3, len(text) - width))
    head, tail = ("..." if start else ""), ("..." if start + width < len(text) else "")
    return head + text[start:start + width] + tail, start - len(head)
