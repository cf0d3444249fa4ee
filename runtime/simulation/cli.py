"""`fabric-run`: run a compiled policy (or a .fx file) on the fabric carrying an LLM prefill.

    fabric-run                                   # the bundled reference policy
    fabric-run --policy out/ --baseline --json run.json --trace run.trace.json
    fabric-run --policy my.fx --model llama3-70b --prompt 32768 --tp 8
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from fabric_ext import __version__
from fabric_ext.exits import EXIT_INPUT, EXIT_OK, EXIT_USAGE, internal_error, stdout_closed

from ..machine.errors import InputError, OutputError, UsageError
from ..machine.fsutil import check_output
from ..machine.program import JIT_CHECKS
from .figures import figures
from .stats import LINKS_SHOWN


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def reference_policy() -> Path:
    """policies/prefill_qos.fx, from the source tree or the installed package."""
    import fabric_ext.policies as pkg
    return Path(pkg.__file__).parent / "prefill_qos.fx"


def build_parser():
    from .sim import DEFAULT_MAX_EVENTS, TRACE_MAX_EVENTS
    p = _Parser(prog="fabric-run", description="Run compiled fabric policies on an LLM prefill and report "
                                                 "its dataflow statistics.")
    p.add_argument("--version", action="version", version=f"fabric-run {__version__}")
    p.add_argument("--policy", metavar="DIR_OR_FX", action="append",
                   help="a folder from 'fabricc compile', or a .fx file to compile first "
                        "(default: the bundled policies/prefill_qos.fx); given more than once, each runs "
                        "on the same workload and one table compares them")
    p.add_argument("-I", dest="include", action="append", default=[], metavar="DIR",
                   help="also look for a .fx policy's imports in DIR (after its own folder; bundled fabrics last)")
    p.add_argument("-D", dest="define", action="append", default=[], metavar="NAME=VALUE",
                   help="set a param of a .fx policy (param NAME : DIM = VALUE), e.g. -D quota=1GB/s")
    p.add_argument("--backend", choices=("interp", "jit", "kernel"), default=None,
                   help="VM backend for the programs (default: jit where it works, else interp)")
    p.add_argument("--jit-checks", choices=JIT_CHECKS, default=None,
                   help="run-time bounds checks in JIT code: on accesses the verifier did not prove "
                        "(default), or on all of them, for policy folders you do not trust "
                        "(docs/security.md; FABRIC_EXT_JIT_CHECKS)")
    p.add_argument("--model", help="a built-in model (llama3-8b, llama3-70b, llama2-7b, llama2-70b, qwen2.5-7b, "
                                    "bloom-176b) or a Hugging Face config.json")
    p.add_argument("--prompt", type=int, help="prompt tokens")
    p.add_argument("--batch", type=int, help="prompts in the batch")
    p.add_argument("--tp", type=int, help="tensor-parallel degree")
    p.add_argument("--chunk", type=int, metavar="TOKENS", help="chunked prefill: tokens per pass")
    p.add_argument("--stack", metavar="NAME",
                   help="serving-stack profile: what the software adds to the hardware's time (vllm: fitted to "
                        "measured vLLM prefills; none: the hardware alone; default: the workload's, else "
                        f"{figures()['defaults']['stack']})")
    p.add_argument("--max-events", type=int, default=None, metavar="N",
                   help=f"stop a run that passes N simulated events and tick runs (default {DEFAULT_MAX_EVENTS:,}, "
                        f"with --trace {TRACE_MAX_EVENTS:,}; 0: no limit)")
    p.add_argument("--baseline", action="store_true", help="also run with no programs attached and compare")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace")
    p.add_argument("--explain", action="store_true",
                   help="say why the GPUs waited: a root-cause chain for the longest stalls, down to the policy "
                        "line that decided (docs/explain.md); with --baseline, what the policy changed")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib: pip install fabric-ext[plot])")
    p.add_argument("--html", metavar="FILE", help="write the report as one self-contained HTML page: tables, plots, "
                                                   "the policy's source with the lines that decided (opens offline)")
    p.add_argument("--links", type=_link_count, default=LINKS_SHOWN, metavar="all|N",
                   help=f"links the summary lists: the N busiest that carried bytes (default {LINKS_SHOWN}), or all")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on standard output")
    p.add_argument("--debug", action="store_true", help="print tracebacks of internal errors")
    return p


def _link_count(text: str) -> int | None:
    if text == "all":
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"'{text}': a number of links, or all")


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)      # unwinds what the run holds (backends, shared maps)


PROGRESS_AFTER_S = 1.0      # a run shorter than this shows no progress
PROJECT_AFTER = 0.05        # of the prefill's blocks begun: where its events per block are a guide


class _Progress:
    """What a run says as it goes, on standard error: a progress line for a run longer than
    PROGRESS_AFTER_S, where it is a terminal and the run is not -q; and, -q or not, one
    warning as soon as the run is on course to pass its limit of ``limit`` events (None: no
    limit), which it would otherwise say only when it stops there, minutes later."""

    def __init__(self, quiet: bool, limit: int | None):
        import time
        self.clock = time.monotonic
        self.start, self.limit = self.clock(), limit
        self.draw = not quiet and sys.stderr.isatty()
        self.line: str | None = None        # the progress line on screen, if any
        self.warned = False

    def __call__(self, p) -> None:
        if self.limit and not self.warned and p.fraction >= PROJECT_AFTER and p.events / p.fraction > self.limit:
            self.warned = True
            self.finish()
            sys.stderr.write(over_limit_warning(p, self.limit) + "\n")
        if not self.draw:
            return
        elapsed = self.clock() - self.start
        line = progress_line(p, elapsed)
        if elapsed >= PROGRESS_AFTER_S and line != self.line:
            self.line = line
            sys.stderr.write("\r" + line)
            sys.stderr.flush()

    def finish(self) -> None:
        """Erase the progress line, if one is drawn."""
        if self.line is not None:
            sys.stderr.write("\r\033[K")
            self.line = None


def over_limit_warning(p, limit: int) -> str:
    """What a run on course to pass its event limit says, at the fraction ``p`` it has run."""
    return (f"fabric-run: warning: {p.events:,} events at {p.fraction:.0%} of the prefill's blocks: on "
            f"course for about {p.events / p.fraction:,.0f}, past the limit of {limit:,} events, where the "
            "run will stop; stop it now and use larger transfer chunks or fewer prefill passes (--chunk), or "
            "rerun it with --max-events 0 (no limit)")


def progress_line(p, elapsed_s: float) -> str:
    """``[#####      ]  40%  1,234,567 events  812.3 ms simulated  ETA 3 s``."""
    pct = int(p.fraction * 100)
    eta = f"ETA {elapsed_s * (1 - p.fraction) / p.fraction:.0f} s" if p.fraction > 0 else "ETA -"
    return f"[{'#' * (pct // 4):<25}] {pct:3d}%  {p.events:,} events  {p.simulated_ms:,.1f} ms simulated  {eta}"


class _PolicyFailed(InputError):
    """A policy that did not compile; its diagnostics are printed already (`run` ends on it)."""


def _bundle(policy: Path, args):
    """The policy to run: a .fx file compiled (in memory, or from the compiled-policy cache:
    nothing is written for the run), or a compiled folder."""
    from fabric_ext import api
    if policy.suffix == ".fx" or policy.is_file():
        if not policy.is_file():
            raise UsageError(f"no such file: {policy}")
        from fabric_ext.bundle_cache import compile_cached
        from fabric_ext.cli import include_dirs
        from fabric_ext.params import parse_defines
        try:
            bundle, warnings = compile_cached(policy, include=[str(d.resolve()) for d in include_dirs(args.include)],
                                              params=parse_defines(args.define))
        except api.PolicyError as e:
            e.diagnostics.print(sys.stderr)
            raise _PolicyFailed() from None
        sys.stderr.write(warnings)
        return bundle
    if args.define:
        raise UsageError(f"-D: {policy} is compiled already, its params bound; recompile it with "
                         "fabricc compile -D NAME=VALUE, or run the .fx policy")
    return api.Bundle.read_folder(policy)


def _run_one(policy: Path, args, trace: bool = False):
    from fabric_ext import api

    from .sim import default_max_events
    bundle = _bundle(policy, args)
    progress = _Progress(args.quiet, default_max_events(trace) if args.max_events is None else args.max_events)
    try:
        report = api.run(bundle, model=args.model, prompt=args.prompt, batch=args.batch, tp=args.tp,
                         chunk=args.chunk, stack=args.stack, backend=args.backend or "auto",
                         jit_checks=args.jit_checks, baseline=args.baseline, trace=trace,
                         max_events=args.max_events, progress=progress, explain=args.explain)
    finally:
        progress.finish()
    data = report.to_dict()
    data["policy"] = str(policy)
    return report, data


def run(args) -> int:
    from . import stats
    policies = [Path(p) for p in args.policy] if args.policy else [reference_policy()]
    _check_outputs(args, policies)
    if len(policies) > 1:
        return _compare(policies, args)
    try:
        report, data = _run_one(policies[0], args, trace=bool(args.trace))
    except _PolicyFailed:
        return EXIT_INPUT
    if args.json:                # the files first: a reader that stops early (| head) loses none
        stats.write_json(args.json, data)
    if args.trace:
        stats.write_json(args.trace, report.trace(), indent=None)
    if args.html:
        _write_html(report, args)
    if args.plot:
        try:
            for p in stats.plots(data, args.plot):
                print(f"wrote {p}", file=sys.stderr)
        except ImportError:
            print("fabric-run: --plot needs matplotlib: pip install 'fabric-ext[plot]'", file=sys.stderr)
            return EXIT_INPUT
        except OSError as e:
            raise OutputError(f"cannot write the plots to {args.plot}: {e.strerror or e}; choose another folder") from None
    if not args.quiet:
        print(stats.render(data, data.get("baseline"), args.links))
        if args.explain:
            _print_explain(data)
    return EXIT_OK


def _check_outputs(args, policies: list[Path]) -> None:
    """Refuse, before the run, an output path that cannot be written (`fsutil.check_output`),
    or that is a policy the run reads (a source, or a file of a compiled folder): a slip of
    `--json p.fx` would replace the policy with its report."""
    inputs = [p.resolve() for p in policies]
    for flag, path in (("--json", args.json), ("--trace", args.trace), ("--html", args.html), ("--plot", args.plot)):
        if not path:
            continue
        check_output(Path(path), folder=flag == "--plot")
        out = Path(path).resolve()
        if any(out == p or p in out.parents for p in inputs):
            raise OutputError(f"{flag} {path}: that is the policy this run reads; choose another path")


def _print_explain(data: dict) -> None:
    from .explain import render, render_against
    print()
    print(render(data["explain"]))
    if data.get("baseline"):
        print()
        print(render_against(data["explain"], data["baseline"]["explain"]))


def _write_html(report, args) -> None:
    """The HTML page, linking to the trace by its path from the page's folder."""
    import os

    from ..machine.fsutil import atomic_write_text
    trace = os.path.relpath(Path(args.trace).resolve(), Path(args.html).resolve().parent) if args.trace else None
    page, warnings = report.html(trace)
    for w in warnings:
        print(f"fabric-run: --html: {w}", file=sys.stderr)
    atomic_write_text(Path(args.html), page)


def _compare(policies: list[Path], args) -> int:
    """Each policy on the same workload, one table side by side (and one JSON)."""
    from . import stats
    if args.trace or args.plot or args.html:
        raise UsageError("--trace, --plot and --html take one policy; run each policy on its own for them")
    runs = []
    for policy in policies:
        try:
            runs.append(_run_one(policy, args)[1])
        except _PolicyFailed:
            return EXIT_INPUT
    if args.json:
        stats.write_json(args.json, {"schema": stats.COMPARE_SCHEMA, "runs": runs})
    if not args.quiet:
        print(stats.render_comparison(runs))
        for data in runs if args.explain else []:
            print(f"\n== {data['policy']}")
            _print_explain(data)
    return EXIT_OK


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _exit_on_signal)
    from ..machine.kernel import KernelError, KernelVerifierError
    from .sim import EventLimit
    if args.max_events is not None and args.max_events < 0:
        print("fabric-run: --max-events must be 0 (no limit) or more", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run(args)
    except UsageError as e:
        print(f"fabric-run: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EventLimit as e:
        print(f"fabric-run: {e}, or raise --max-events (0: no limit)", file=sys.stderr)
        return EXIT_INPUT
    except KernelVerifierError as e:
        tail = "\n".join(e.log.strip().splitlines()[-4:])
        print(f"fabric-run: {e}\n{tail}\nhint: 'fabricc compile --kernel-verify' maps the log to .fx lines",
              file=sys.stderr)
        return EXIT_INPUT
    except KernelError as e:
        print(f"fabric-run: --backend kernel: {e.strerror or e}", file=sys.stderr)
        return EXIT_INPUT
    except (InputError, OutputError) as e:     # a folder, an object, a workload, a path: its message says what to do
        print(f"fabric-run: {e}", file=sys.stderr)
        return EXIT_INPUT
    except BrokenPipeError:
        return stdout_closed()
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns bugs into a message
        return internal_error("fabric-run", e, args.debug)


if __name__ == "__main__":
    sys.exit(main())
