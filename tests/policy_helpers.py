"""Compiling example policies once per test session and running their programs."""
import functools
import tempfile
from pathlib import Path

from conftest import POLICIES
from fabric_ext.codegen.driver import build
from fabric_ext.contract.bundle import load_bundle, write_folder
from fabric_ext.contract.context import ContextCodec
from fabric_ext.diagnostics import Diagnostics
from fabric_ext.runtime.machine.interp import Interpreter

_TMP = Path(tempfile.mkdtemp(prefix="fx-test-"))


@functools.cache
def compiled(name: str) -> Path:
    """The output folder of policies/NAME.fx, compiled once."""
    d = Diagnostics()
    res = build(POLICIES / f"{name}.fx", diags=d)
    assert res is not None, [x.message for x in d.items]
    out = _TMP / name
    write_folder(res.files, out)
    return out


class Runner:
    """Runs a bundle's programs on contexts given by field name."""

    def __init__(self, name: str, backend=None):
        self.bundle = load_bundle(compiled(name))
        self.ids = self.bundle.ids
        self.vm = backend or Interpreter()
        self.handles = {}

    def run(self, island: str, hook: str, **fields) -> dict:
        prog = self.bundle.islands[island][hook]
        codec = ContextCodec(prog.hook)
        for k in ("movement",):
            if isinstance(fields.get(k), str):
                fields[k] = self.ids["movements"][fields[k]]
        for k in ("src", "dst"):
            if isinstance(fields.get(k), str):
                fields[k] = self.ids["devices"][fields[k]]
        ctx = codec.pack(fields)
        if prog.name not in self.handles:
            self.handles[prog.name] = self.vm.load(prog)
        self.vm.run(self.handles[prog.name], ctx)
        return codec.decisions(ctx)

    def map(self, name):
        return self.bundle.maps[name]
