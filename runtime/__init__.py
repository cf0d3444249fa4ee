"""fabric_ext.runtime: the eBPF machine (`machine`, imported by the compiler to verify) and the
fabric simulation (`simulation`, which runs the machine's programs), and `fabric-vm`."""
