"""Kernel map type numbers (include/uapi/linux/bpf.h) and the language's names for them.

Apart from `maps` (the stores, in numpy buffers) so that what only needs the numbers — the ELF
loader, the verifier, the compiler — does not import numpy.
"""
HASH, ARRAY, PERCPU_HASH, PERCPU_ARRAY, LRU_HASH, QUEUE, STACK, RINGBUF = 1, 2, 5, 6, 9, 22, 23, 27
KIND_TYPE = {"hash": HASH, "array": ARRAY, "percpu_hash": PERCPU_HASH, "percpu_array": PERCPU_ARRAY,
             "lru_hash": LRU_HASH, "queue": QUEUE, "stack": STACK, "ringbuf": RINGBUF}
TYPE_KIND = {v: k for k, v in KIND_TYPE.items()}
