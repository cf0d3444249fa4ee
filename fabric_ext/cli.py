"""`fabricc`: the command-line compiler.

Exit status: 0 clean, 1 errors in the input, 2 bad usage (unknown flag,
missing file).  User errors never print a Python traceback; an internal error
prints one line asking for a bug report (its traceback only with --debug).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fabric_ext.exits import EXIT_INPUT, EXIT_OK, EXIT_USAGE, internal_error, stdout_closed
from fabric_ext.runtime.machine.errors import OutputError, UsageError

from . import __version__
from .params import parse_defines


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        why = "a folder" if p.is_dir() else "not a regular file" if p.exists() else None
        raise UsageError(f"fabricc: {path} is {why}; give a .fx policy file" if why else f"fabricc: no such file: {path}")
    return p


def include_dirs(dirs) -> tuple[Path, ...]:
    """The -I folders, each of which must exist."""
    for d in dirs:
        if not Path(d).is_dir():
            raise UsageError(f"-I {d}: no such folder")
    return tuple(Path(d) for d in dirs)


def _analyze(path: Path, werror: bool = False, include=(), defines=None):
    from .frontend import analyze
    from .runtime.simulation.workload import check_declaration
    a = analyze(path, include=include, defines=defines)
    if not a.program.unread:                    # (a missing import says it all)
        check_declaration(a.symbols, a.diags)   # the workload against the models the runtime knows
    if werror:
        a.diags.warnings_as_errors()
    a.diags.print(sys.stderr)
    return a


def cmd_check(args) -> int:
    status = EXIT_OK
    for f in args.files:
        a = _analyze(_existing(f), args.Werror, include_dirs(args.include), parse_defines(args.define))
        n = len(a.diags.errors)
        if n:
            status = EXIT_INPUT
            print(f"{f}: {n} error{'s' * (n != 1)}", file=sys.stderr)
        elif not args.quiet:
            print(f"{f}: ok ({len(a.placements)} placements on {len({p.island for p in a.placements})} islands)")
    return status


def cmd_graph(args) -> int:
    from .graph_export import to_dot, to_json
    a = _analyze(_existing(args.file), include=include_dirs(args.include), defines=parse_defines(args.define))
    if not a.ok:
        return EXIT_INPUT
    text = json.dumps(to_json(a), indent=2) + "\n" if args.format == "json" else to_dot(a)
    if args.output:
        from fabric_ext.runtime.machine.fsutil import atomic_write_text
        if Path(args.output).resolve() in [Path(f).resolve() for f in a.program.files]:
            raise OutputError(f"-o {args.output}: that is a policy source this graph is read from; choose another path")
        atomic_write_text(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def cmd_compile(args) -> int:
    from . import api
    if not args.output.strip():
        raise UsageError("fabricc: -o needs a folder name")
    path, out = _existing(args.file), Path(args.output)
    try:
        bundle = api.compile(path, opt=args.O, mcpu=args.mcpu, emit=args.emit or [],
                             kernel_verify=args.kernel_verify, werror=args.Werror,
                             include=include_dirs(args.include), params=parse_defines(args.define))
    except api.PolicyError as e:
        e.diagnostics.print(sys.stderr)
        n = len(e.diagnostics.errors)
        print(f"{path}: {n} error{'s' * (n != 1)}; {out} left as it was", file=sys.stderr)
        return EXIT_INPUT
    bundle.diagnostics.print(sys.stderr)           # its warnings
    try:
        bundle.write(out)
    except OSError as e:
        why = str(e) if isinstance(e, OutputError) else f"cannot write {out}: {e.strerror or e}"
        print(f"fabricc: {why}", file=sys.stderr)
        return EXIT_INPUT
    for line in bundle.summary:
        print(line)
    print(f"wrote {len(bundle.files)} files to {out}")
    return EXIT_OK


def cmd_hooks(args) -> int:
    from .contract.hooks import HOOK_NAMES, HOOKS, listing, matching
    from .diagnostics import did_you_mean
    found = matching(args.pattern)
    if not found:
        names = [f"{k}.{n}" for k, n in HOOKS] + sorted({k for k, _ in HOOKS}) + HOOK_NAMES
        hint = did_you_mean(args.pattern, names)
        print(f"fabricc: no hook matches '{args.pattern}'" + (f"; {hint}" if hint else "")
              + " (fabricc hooks lists them all)", file=sys.stderr)
        return EXIT_INPUT
    print(listing(found, args.verbose))
    return EXIT_OK


def _include_option(p) -> None:
    p.add_argument("-I", dest="include", action="append", default=[], metavar="DIR",
                   help="also look for imports in DIR (after the importing file's folder; bundled fabrics last)")
    p.add_argument("-D", dest="define", action="append", default=[], metavar="NAME=VALUE",
                   help="set a param of the policy (param NAME : DIM = VALUE), e.g. -D quota=1GB/s")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fabricc", description="Compile .fx data-movement policies to per-island eBPF.")
    p.add_argument("--version", action="version", version=f"fabricc {__version__}")
    p.add_argument("--debug", action="store_true", help="print tracebacks of internal errors")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    c = sub.add_parser("check", help="parse and check policies, report every error")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("-q", "--quiet", action="store_true", help="print nothing when a file is clean")
    c.add_argument("--Werror", action="store_true", help="treat warnings as errors")
    c.set_defaults(func=cmd_check)
    _include_option(c)
    g = sub.add_parser("graph", help="print the semantic movement graph")
    g.add_argument("file", metavar="FILE")
    g.add_argument("--format", choices=("json", "dot"), default="json")
    g.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of standard output")
    g.set_defaults(func=cmd_graph)
    _include_option(g)
    h = sub.add_parser("hooks", help="list the hooks a policy can attach to (-v: their fields and decisions)")
    h.add_argument("pattern", nargs="?", metavar="KIND[.HOOK]", help="an island kind, a hook, or a pattern (*.tick)")
    h.add_argument("-v", "--verbose", action="store_true", help="context fields, decisions, defaults and effects")
    h.set_defaults(func=cmd_hooks)
    k = sub.add_parser("compile", help="compile a policy to eBPF objects and runtime artifacts")
    k.add_argument("file", metavar="FILE")
    k.add_argument("-o", "--output", metavar="DIR", required=True, help="output folder")
    k.add_argument("-O", type=int, choices=(0, 1, 2), default=2, help="optimisation level (default 2)")
    k.add_argument("--mcpu", choices=("v1", "v2", "v3", "v4"), default="v3", help="BPF cpu version (default v3)")
    k.add_argument("--emit", action="append", choices=("llvm", "asm"), help="also write LLVM IR or disassembly")
    k.add_argument("--kernel-verify", action="store_true", help="also load each program into the running kernel")
    k.add_argument("--Werror", action="store_true", help="treat warnings as errors (nothing is written)")
    k.set_defaults(func=cmd_compile)
    _include_option(k)
    f = sub.add_parser("fmt", help="lay policies out the one way (indentation, spaces), comments and lines kept")
    f.add_argument("files", nargs="+", metavar="FILE")
    how = f.add_mutually_exclusive_group()
    how.add_argument("-w", "--write", action="store_true", help="write the result back to each file")
    how.add_argument("--check", action="store_true", help="list the files fmt would change (exit 1 if any)")
    f.set_defaults(func=cmd_fmt)
    s = sub.add_parser("completion", help="print shell completion for fabricc, fabric-run and fabric-vm "
                       "(eval \"$(fabricc completion bash)\")")
    s.add_argument("shell", choices=("bash",), help="bash (zsh: after bashcompinit)")
    s.set_defaults(func=cmd_completion)
    return p


def cmd_fmt(args) -> int:
    """Lay each policy out (`fmt.format_source`): print it, write it back (-w), or list the
    files that are not laid out so (--check, exit 1 if any).  A file that does not parse is
    reported like `check` does and left as it is."""
    from .diagnostics import Diagnostics
    from .fmt import format_source
    from .loader import SourceError, read_source
    from .parser import parse
    from .runtime.machine.fsutil import atomic_write_text
    status = EXIT_OK
    for f in args.files:
        path = _existing(f)
        try:
            text = read_source(path)
        except (SourceError, OSError) as e:
            print(f"{f}: {e}", file=sys.stderr)
            status = EXIT_INPUT
            continue
        diags = Diagnostics()
        if parse(text, f, diags) is None:
            diags.print(sys.stderr)
            status = EXIT_INPUT
            continue
        laid_out = format_source(text)
        if args.check:
            if laid_out != text:
                print(f)
                status = EXIT_INPUT
        elif args.write:
            if laid_out != text:
                atomic_write_text(path, laid_out)
        else:
            sys.stdout.write(laid_out)
    return status


def cmd_completion(args) -> int:
    from .completion import bash, tool_parsers
    sys.stdout.write(bash(tool_parsers()))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.cmd is None:
            build_parser().print_help(sys.stderr)
            return EXIT_USAGE
        return args.func(args)
    except UsageError as e:
        print(e if str(e).startswith("fabricc") else f"fabricc: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OutputError as e:        # graph -o, fmt -w: where it cannot write, it says why
        print(f"fabricc: {e}", file=sys.stderr)
        return EXIT_INPUT
    except BrokenPipeError:
        return stdout_closed()
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns bugs into a message
        return internal_error("fabricc", e, debug)


if __name__ == "__main__":
    sys.exit(main())
