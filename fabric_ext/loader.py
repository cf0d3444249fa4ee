"""Pass 2: resolve ``import`` declarations and gather one program (`load`).

Imports are resolved relative to the importing file; each file is read once,
and a cycle is reported with the chain of files that forms it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import ast as A
from .diagnostics import Diagnostics, Span
from .parser import parse


@dataclass
class Program:
    """Every declaration of a root file and what it imports, in source order."""
    root: str
    modules: list[A.Module] = field(default_factory=list)
    fabrics: list[A.Fabric] = field(default_factory=list)
    workloads: list[A.Workload] = field(default_factory=list)
    movements: list[A.Movement] = field(default_factory=list)
    maps: list[A.MapDecl] = field(default_factory=list)
    policies: list[A.Policy] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # file -> text

    @property
    def files(self) -> list[str]:
        return [m.path for m in self.modules]


def display_path(path: Path) -> str:
    """A path as the user should read it: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def load(root: str | Path, diags: Diagnostics) -> Program:
    """Parse ``root`` and everything it imports; errors go to ``diags``."""
    root = Path(root)
    prog = Program(root=display_path(root))
    done: set[Path] = set()

    def visit(path: Path, chain: list[Path], at: Span | None) -> None:
        real = path.resolve()
        if real in chain:
            cycle = " -> ".join(display_path(p) for p in chain[chain.index(real):] + [real])
            diags.error(at, f"import cycle: {cycle}", "move the shared declarations into one file both import")
            return
        if real in done:
            return
        try:
            text = path.read_text()
        except OSError as e:
            if at is None:
                raise
            diags.error(at, f"cannot import '{display_path(path)}': {e.strerror.lower()}",
                        "import paths are relative to the importing file")
            return
        name = display_path(path)
        module = parse(text, name, diags)
        prog.sources[name] = text
        if module is None:
            done.add(real)
            return
        for item in module.items:
            if isinstance(item, A.Import):
                visit(path.parent / item.path, chain + [real], item.span)
        done.add(real)
        prog.modules.append(module)
        for item in module.items:
            bucket = {A.Fabric: prog.fabrics, A.Workload: prog.workloads,
                      A.Movement: prog.movements, A.MapDecl: prog.maps,
                      A.Policy: prog.policies}.get(type(item))
            if bucket is not None:
                bucket.append(item)

    visit(root, [], None)
    return prog
