"""fabric_ext: a compiler and runtime for eBPF data-movement policies on GPU-CXL-DPU fabrics.

The API (`fabric_ext.api`): ``compile(path_or_text) -> Bundle``, ``run(bundle, ...) -> Report``.
"""

__version__ = "0.1.0"
__all__ = ["Bundle", "PolicyError", "Report", "compile", "run"]


def __getattr__(name):
    # the API pulls in LLVM and the runtime: only when asked for, so `import fabric_ext.x` stays light
    if name in __all__:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'fabric_ext' has no attribute {name!r}")
