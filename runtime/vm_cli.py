"""`fabric-vm` (run and disassemble eBPF) and `fabric-vm-plugin` (the bpf_conformance plugin).

    fabric-vm run OBJECT_OR_ASM [--program NAME] [--hook KIND.HOOK] [--ctx HEX|@file|FIELD=VALUE,...]
                  [--mem HEX] [--backend interp]
    fabric-vm disasm OBJECT
    fabric-vm-plugin [MEMORY_HEX] [--backend NAME] [--elf] [--program HEX] < program_hex
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fabric_ext.exits import EXIT_INPUT, EXIT_OK, EXIT_USAGE, stdout_closed
from fabric_ext.runtime.machine.fsutil import UnreadableFile, read_bounded

from .machine import isa
from .machine.asm import AsmError, assemble
from .machine.backends import get_backend
from .machine.elf import MAX_OBJECT, load_object
from .machine.errors import FabricError, InputError, UsageError
from .machine.program import JIT_CHECKS, Program
from .machine.verifier import verify

BACKENDS = ("interp", "jit", "kernel")
MAX_CTX = 1 << 16       # bytes of a context read from a file: far more than any hook's



class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _hex(text: str, what: str, hint: str = "") -> bytes:
    clean = "".join(text.split())
    try:
        return bytes.fromhex(clean)
    except ValueError:
        raise SystemExit(_fail(f"{what} is not hex bytes: {text[:40]!r}{hint}", 2)) from None


def _fail(msg: str, code: int = 1) -> int:
    print(msg, file=sys.stderr)
    return code


def _read(path: str, limit: int, what: str) -> bytes:
    """An input file's bytes: a regular file of at most ``limit`` (``what`` names it in errors)."""
    try:
        return read_bounded(Path(path), limit)
    except UnreadableFile as e:
        raise SystemExit(_fail(f"fabric-vm: {what}: {e}")) from None
    except OSError as e:
        raise SystemExit(_fail(f"fabric-vm: {what}: {e.strerror or e}")) from None


MAP_ENTRIES_SHOWN = 1024      # of each map after a run (an array may hold a million)


def _load(path: str, program: str | None) -> Program:
    p = Path(path)
    if not p.exists():
        raise SystemExit(_fail(f"fabric-vm: no such file: {path}", 2))
    data = _read(path, MAX_OBJECT, path)
    if data[:4] == b"\x7fELF":
        obj = load_object(data, path)
        if not obj.programs:
            raise SystemExit(_fail(f"fabric-vm: {path} has no programs", 1))
        spec = obj.program(program) if program else obj.programs[0]
        return next(pr for pr in obj.instantiate() if pr.name == spec.name)
    try:
        return Program(p.stem, assemble(data.decode(errors="replace")))
    except AsmError as e:
        raise InputError(f"{path}:{e.line}: {e.msg}") from None


def cmd_run(args) -> int:
    prog = _load(args.file, args.program)
    if args.hook:
        from fabric_ext.contract.hooks import HOOKS
        kind, _, name = args.hook.partition(".")
        if (kind, name) not in HOOKS:
            raise SystemExit(_fail(f"fabric-vm: unknown hook '{args.hook}' (e.g. cxl_switch.forward)", 2))
        compiled_for = _compiled_for(args.file, prog.name)
        if compiled_for not in (None, args.hook):
            raise SystemExit(_fail(f"fabric-vm: {prog.name} is compiled for {compiled_for} (the manifest.json "
                                   f"beside {args.file} says so), not {args.hook}; its context is another", 2))
        prog.hook = HOOKS[kind, name]
        prog.ctx_size = prog.hook.ctx_size
    ctx = None
    if args.ctx and "=" in args.ctx:
        if prog.hook is None:
            raise SystemExit(_fail("fabric-vm: --ctx by field names needs --hook KIND.HOOK (its fields)", 2))
        from fabric_ext.contract.context import ContextCodec, fields_from_text
        try:
            ctx = ContextCodec(prog.hook).pack(fields_from_text(prog.hook, args.ctx, _id_tables(args.file)))
        except ValueError as e:
            raise SystemExit(_fail(f"fabric-vm: --ctx: {e}", 2)) from None
    elif args.ctx:
        raw = _read(args.ctx[1:], MAX_CTX, f"--ctx {args.ctx}") if args.ctx.startswith("@") else _hex(args.ctx, "--ctx", " (or FIELD=VALUE,... with --hook)")
        ctx = bytearray(raw)
        if prog.hook is not None and len(ctx) != prog.hook.ctx_size:
            raise SystemExit(_fail(f"fabric-vm: --ctx has {len(ctx)} bytes; {args.hook} needs {prog.hook.ctx_size}", 2))
        prog.ctx_size = len(ctx)
    elif prog.hook is not None:
        from fabric_ext.contract.context import ContextCodec
        ctx = ContextCodec(prog.hook).pack()
    mem = bytearray(_hex(args.mem, "--mem")) if args.mem is not None else None
    verify(prog)
    backend = get_backend(args.backend, jit_checks=args.jit_checks)
    try:
        r0 = backend.run(backend.load(prog), ctx, mem)
    finally:
        if hasattr(backend, "sync"):
            backend.sync()
        backend.close()
    print(f"r0 = {r0:#x} ({r0})")
    if prog.hook is not None:
        from fabric_ext.contract.context import ContextCodec
        for name, value in ContextCodec(prog.hook).decisions(ctx).items():
            print(f"decision {name} = {value}")
    elif ctx is not None:
        print(f"ctx = {bytes(ctx).hex()}")
    if mem is not None:
        print(f"mem = {bytes(mem).hex()}")
    for m in prog.maps:
        shown = m.dump(MAP_ENTRIES_SHOWN)
        more = m.entry_count() - len(shown) if len(shown) == MAP_ENTRIES_SHOWN else 0   # (a full dump may be all)
        print(f"map {m.name} ({m.kind}): {shown}" + (f" and {more:,} more entries" if more > 0 else ""))
    return 0


def _id_tables(obj_path: str):
    """The id tables of the policy folder an object is in (None: not in a policy folder); the
    manifest is read, and checked, only if a name is asked for."""
    folder = Path(obj_path).parent
    if not (folder / "manifest.json").is_file():
        return None

    ids: dict = {}

    def table(what: str) -> dict[str, int]:
        if not ids:
            from fabric_ext.contract.bundle import load_manifest
            from fabric_ext.contract.runtime_json import BundleError
            try:
                ids.update(load_manifest(folder)["ids"])
            except BundleError as e:
                raise ValueError(str(e)) from None
        return ids[what]
    return table


def _compiled_for(obj_path: str, symbol: str) -> str | None:
    """The hook (KIND.HOOK) the manifest of the policy folder an object is in names for its
    program ``symbol``; None where the object is in no policy folder or the manifest names none
    (one that cannot be read is said to be so where names are looked up in it: `_id_tables`)."""
    folder = Path(obj_path).parent
    if not (folder / "manifest.json").is_file():
        return None
    from fabric_ext.contract.bundle import load_manifest
    from fabric_ext.contract.runtime_json import BundleError
    try:
        man = load_manifest(folder)
    except BundleError:
        return None
    kinds = {i["name"]: i["kind"] for i in man["fabric"]["islands"]}
    return next((f"{kinds[p['island']]}.{p['hook']}" for p in man["programs"]
                 if p["symbol"] == symbol and p["object"] == Path(obj_path).name), None)


def cmd_disasm(args) -> int:
    p = Path(args.file)
    if not p.exists():
        return _fail(f"fabric-vm: no such file: {args.file}", 2)
    obj = load_object(p)
    for spec in obj.programs:
        print(f"{spec.name} (section {spec.section}):")
        print(isa.disasm(spec.insns))
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="fabric-vm", description="Run and disassemble eBPF programs.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    r = sub.add_parser("run", help="verify and run a program (ELF object or assembly)")
    r.add_argument("file", metavar="OBJECT_OR_ASM")
    r.add_argument("--program", help="program (function) name in an object")
    r.add_argument("--ctx", help="context bytes as hex, @FILE, or with --hook by field names: "
                   "bytes=2MiB,out_port=3 (a unit is checked against the field's dimension)")
    r.add_argument("--mem", help="memory bytes as hex (r1 = memory, r2 = length)")
    r.add_argument("--hook", metavar="KIND.HOOK", help="the hook the program is for (e.g. dpu.tx): its "
                   "context rules apply and its decisions are printed by name; an object in a policy "
                   "folder must name the hook its manifest gives the program")
    r.add_argument("--backend", choices=BACKENDS, default="interp")
    r.add_argument("--jit-checks", choices=JIT_CHECKS, default=None,
                   help="run-time bounds checks in JIT code (docs/security.md)")
    r.set_defaults(func=cmd_run)
    d = sub.add_parser("disasm", help="disassemble every program of an object")
    d.add_argument("file", metavar="OBJECT")
    d.set_defaults(func=cmd_disasm)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except BrokenPipeError:
        return stdout_closed()
    except UsageError as e:
        return _fail(f"fabric-vm: {e}", EXIT_USAGE)
    except (FabricError, KeyError, ValueError, OSError) as e:    # an input: the message says what
        return _fail(f"fabric-vm: {e}")


def _plugin_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="fabric-vm-plugin", description="The bpf_conformance plugin: the program as hex on "
                 "standard input (or --program), memory as hex in MEMORY; prints r0 in hex.")
    ap.add_argument("memory", nargs="?", default="", metavar="MEMORY", help="the memory's bytes as hex")
    ap.add_argument("--program", metavar="HEX", help="the program as hex instead of standard input")
    ap.add_argument("--elf", action="store_true", help="the program is an ELF object (as hex): its first program runs")
    ap.add_argument("--backend", choices=BACKENDS, default="interp")
    ap.add_argument("--jit-checks", choices=JIT_CHECKS, default=None,
                    help="run-time bounds checks in JIT code (docs/security.md)")
    ap.add_argument("--debug", action="store_true", help="say why a program was not run")
    return ap


def plugin_main(argv=None) -> int:
    """The bpf_conformance plugin protocol: memory hex in argv, program hex on stdin, r0 hex out.
    Options may come in any order, before or after the memory."""
    argv = sys.argv[1:] if argv is None else argv
    args = _plugin_parser().parse_args(argv)
    try:
        text = args.program if args.program is not None else sys.stdin.read(1 << 24)
        code = _hex(text, "the program")
        mem = bytearray(_hex(args.memory, "MEMORY"))
        if args.elf:
            prog = load_object(code, "<stdin>").instantiate()[0]
        else:
            prog = Program("plugin", isa.decode(code))
        verify(prog)
        backend = get_backend(args.backend, jit_checks=args.jit_checks)
        try:
            r0 = backend.run(backend.load(prog), None, mem)
        finally:
            backend.close()
    except (FabricError, ValueError, IndexError, OSError) as e:
        print(f"fabric-vm-plugin: {e}" if args.debug or not isinstance(e, IndexError)
              else "fabric-vm-plugin: the object has no program", file=sys.stderr)
        return EXIT_INPUT
    print(f"{r0:x}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
