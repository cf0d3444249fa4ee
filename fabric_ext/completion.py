"""Bash completion for the command-line tools, generated from their argparse parsers (so it
never lists an option a tool does not have): subcommands, each one's options, the choices of
an option that has them, and file names everywhere else.  zsh takes it after
``autoload -U bashcompinit && bashcompinit``."""
from __future__ import annotations

import argparse


def _options(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    """A parser's option strings, and the choices of those that take one of a few values."""
    opts, choices = [], {}
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            opts += action.option_strings
            if action.choices:
                for o in action.option_strings:
                    choices[o] = [str(c) for c in action.choices]
    return opts, choices


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def bash(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """One completion function per tool (``prog`` -> its parser), and the ``complete`` lines."""
    out = ["# bash completion for fabric_ext's tools: eval \"$(fabricc completion bash)\""]
    for prog, parser in parsers.items():
        fn = "_fx_" + prog.replace("-", "_")
        subs = _subcommands(parser)
        top_opts, top_choices = _options(parser)
        by_cmd = {name: _options(sp) for name, sp in subs.items()}
        choices = {"": top_choices, **{name: ch for name, (_, ch) in by_cmd.items()}}   # "": before a subcommand
        choice_cases = [f'    "{cmd}:{opt}") words="{" ".join(vals)}";;'
                        for cmd, ch in choices.items() for opt, vals in ch.items()]
        opt_cases = [f'    {cmd}) words="{" ".join(opts)}";;' for cmd, (opts, _) in by_cmd.items()]
        out += [
            f"{fn}() {{",
            '  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd="" words="" w',
            '  for w in "${COMP_WORDS[@]:1:COMP_CWORD-1}"; do',
            f'    case "$w" in {"|".join(subs) or "__none__"}) cmd=$w; break;; esac',
            "  done",
            '  case "$cmd:$prev" in',
            *choice_cases,
            "  esac",
            '  if [[ -z $words && $cur == -* ]]; then',
            '    case "$cmd" in',
            *opt_cases,
            f'    *) words="{" ".join(top_opts)}";;',
            "    esac",
            "  fi",
            f'  [[ -z $words && -z $cmd && $cur != -* ]] && words="{" ".join(subs)}"',
            '  if [[ -n $words ]]; then COMPREPLY=($(compgen -W "$words" -- "$cur")); '
            'else COMPREPLY=($(compgen -f -- "$cur")); fi',
            "}",
            f"complete -o filenames -F {fn} {prog}",
        ]
    return "\n".join(out) + "\n"


def tool_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers of fabricc, fabric-run and fabric-vm."""
    from fabric_ext.cli import build_parser as fabricc
    from fabric_ext.runtime.simulation.cli import build_parser as fabric_run
    from fabric_ext.runtime.vm_cli import build_parser as fabric_vm
    return {"fabricc": fabricc(), "fabric-run": fabric_run(), "fabric-vm": fabric_vm()}
