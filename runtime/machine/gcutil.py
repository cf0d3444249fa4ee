"""The garbage collector's young-generation threshold while a large job runs.

A prefill run allocates millions of short-lived objects, and the compiler's parser a tree
node or more per token, and neither makes much cyclic garbage: collecting every 700
allocations (CPython's default) is work that finds almost nothing, and as the live objects
grow, the older generations' collections it triggers grow with them (half the parse of a
12,000-handler policy).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

#: allocations between young-generation collections while a job runs
GC_YOUNG = 20_000


@contextmanager
def fewer_collections():
    """GC_YOUNG for the young generation while the block runs, the caller's thresholds after
    (a caller's own higher threshold is kept, and 0, which turns collection off)."""
    old = gc.get_threshold()
    gc.set_threshold(old[0] if old[0] == 0 or old[0] > GC_YOUNG else GC_YOUNG, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
