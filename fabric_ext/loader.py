"""Pass 2: resolve ``import`` declarations and gather one program (`load`).

An import names a ``.fx`` file relative to the importing file, or a bare name
(``import "dgx_cxl"``) meaning ``NAME.fx``; either is looked for next to the
importing file, then in each include folder (``-I``) in order, then among the
bundled policies and fabrics (`BUNDLED`).  Each file is read once, and a cycle
is reported with the chain of files that forms it.  A source is
untrusted input: only a regular file of at most `MAX_SOURCE` bytes of UTF-8 is
read (an import must name a ``.fx`` file), so no path can make the compiler
hang on a device, echo a file that is not a policy, or read without bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fabric_ext.contract.schema import MAX_SOURCE
from fabric_ext.runtime.machine.errors import InputError
from fabric_ext.runtime.machine.fsutil import UnreadableFile, read_bounded

from . import ast as A
from .diagnostics import Diagnostics, Span
from .parser import parse


def bundled() -> list[Path]:
    """The folders of the policies and fabrics that ship with the package."""
    import fabric_ext.policies as pkg
    here = Path(pkg.__file__).parent
    return [here / "fabrics", here]


def is_bare_name(name: str) -> bool:
    """``import "dgx_cxl"``: a name (no folder, no suffix), meaning ``NAME.fx``."""
    return "/" not in name and not Path(name).suffix


def resolve(name: str, importer: Path, include: tuple[Path, ...] = ()) -> Path | None:
    """The file an import of ``name`` in ``importer`` reads: ``name`` (``NAME.fx`` for a bare
    name) next to the importer, in an include folder, or bundled; None where none is."""
    rel = Path(f"{name}.fx" if is_bare_name(name) else name)
    for folder in (importer.parent, *include, *bundled()):
        candidate = folder / rel
        if candidate.is_file():
            return candidate
    return None


def _bundled_names() -> list[str]:
    return sorted({p.stem for folder in bundled() for p in folder.glob("*.fx")})


class SourceError(InputError):
    """A file that cannot be a policy source; ``line``/``col`` where it is text that is not UTF-8."""

    def __init__(self, msg: str, line: int = 0, col: int = 0):
        self.line, self.col = line, col
        super().__init__(msg)


def read_source(path: Path) -> str:
    """The text of a policy source, or `SourceError` (OSError where it cannot be opened)."""
    try:
        data = read_bounded(path, MAX_SOURCE)
    except UnreadableFile as e:
        raise SourceError(str(e)) from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")     # (the byte-order mark some editors write)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SourceError(f"byte {data[e.start]:#04x} is not UTF-8 text", line, col) from None


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
    params: list[A.Param] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # file -> text
    unread: int = 0        # imports that could not be read: what they declare is missing

    @property
    def files(self) -> list[str]:
        return [m.path for m in self.modules]


def display_path(path: Path) -> str:
    """A path as the user should read it: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def load(root: str | Path, diags: Diagnostics, text: str | None = None, include=()) -> Program:
    """Parse ``root`` and everything it imports; errors go to ``diags``.  With ``text``, that is
    the root's source (no file is read for it; its imports are relative to ``root``'s folder).
    ``include``: folders searched for imports after the importing file's own."""
    root = Path(root)
    include = tuple(Path(d) for d in include)
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
        name = display_path(path)
        if at is not None and path.suffix != ".fx":
            diags.error(at, f"cannot import '{display_path(path)}': imports name .fx policy sources",
                        "name a .fx file, or a bundled fabric by its name (import \"dgx_cxl\")")
            prog.unread += 1
            return
        try:
            source = text if at is None and text is not None else read_source(path)
        except SourceError as e:
            where = Span(name, e.line, e.col, e.line, e.col + 1) if e.line else at or Span(name, 1, 1, 1, 2)
            diags.error(where, f"cannot read '{name}': {e}", "policy sources are UTF-8 text files of at most 1 MiB")
            prog.unread += 1
            return
        except OSError as e:
            if at is None:
                raise
            diags.error(at, f"cannot import '{display_path(path)}': {(e.strerror or str(e)).lower()}",
                        "import paths are relative to the importing file")
            prog.unread += 1
            return
        if len(source.encode()) > MAX_SOURCE:
            diags.error(at or Span(name, 1, 1, 1, 2), f"cannot read '{name}': larger than {MAX_SOURCE} bytes",
                        "policy sources are UTF-8 text files of at most 1 MiB")
            prog.unread += 1
            return
        module = parse(source, name, diags)
        prog.sources[name] = source
        if module is None:
            done.add(real)
            return
        for item in module.items:
            if isinstance(item, A.Import):
                found = resolve(item.path, path, include)
                if found is None and is_bare_name(item.path):
                    _not_found(item, path, include)
                    continue
                visit(found or path.parent / item.path, chain + [real], item.span)
        done.add(real)
        prog.modules.append(module)
        for item in module.items:
            bucket = {A.Fabric: prog.fabrics, A.Workload: prog.workloads,
                      A.Movement: prog.movements, A.MapDecl: prog.maps,
                      A.Policy: prog.policies, A.Param: prog.params}.get(type(item))
            if bucket is not None:
                bucket.append(item)

    def _not_found(item, importer, include):
        from .diagnostics import did_you_mean
        where = ", ".join(display_path(p) for p in (importer.parent, *include))
        hint = did_you_mean(item.path, _bundled_names())
        diags.error(item.span, f"cannot import '{item.path}': no {item.path}.fx in {where} or among the "
                    f"bundled fabrics and policies ({', '.join(_bundled_names())})",
                    hint or "add the folder that holds it with -I DIR")
        prog.unread += 1

    visit(root, [], None)
    return prog
