"""fabric_ext: a compiler and runtime for eBPF data-movement policies on GPU-CXL-DPU fabrics."""

__version__ = "0.1.0"
