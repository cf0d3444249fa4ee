"""What every command line of the project exits with, and what it does when its reader goes.

0 ok, 1 an input error (a policy, a folder, an object, a workload), 2 a usage error, 3 an
internal error (a bug, reported as one).  A command whose standard output is closed early
(``fabric-run | head``) has written its files already; it stops quietly with 0.
"""
from __future__ import annotations

import os
import sys

EXIT_OK, EXIT_INPUT, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def stdout_closed() -> int:
    """Standard output's reader went away: point the descriptor at /dev/null, so that the
    interpreter's flush at exit cannot fail a second time, and exit as done."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_OK


def internal_error(prog: str, e: BaseException, debug: bool) -> int:
    """A bug, not an input error: one line saying so (the traceback with ``--debug``)."""
    if debug:
        import traceback
        traceback.print_exc()
    print(f"{prog}: internal error: {type(e).__name__}: {e} -- please report this bug "
          "(rerun with --debug for the traceback)", file=sys.stderr)
    return EXIT_INTERNAL
