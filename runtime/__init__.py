"""fabric_ext.runtime: the eBPF machine (ISA, loader, maps, helpers, verifier,
VM backends), the device shims, the fabric model and the prefill workload."""
