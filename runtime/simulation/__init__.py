"""The fabric simulation: the bundle a compiler wrote, the device shims that run its programs on
the machine, the fabric model, the prefill workload and its compute model, the engine that drives
them, the report and `fabric-run`."""
