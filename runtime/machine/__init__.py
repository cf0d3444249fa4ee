"""The eBPF machine: instruction set, assembler, ELF/BTF loader, maps, helpers, verifier and the
VM backends (interpreter, LLVM JIT, the kernel).  It imports nothing from the simulation or the
front end (tests/test_layout.py holds it to that), so it could be published alone."""
