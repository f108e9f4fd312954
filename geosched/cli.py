"""The ``geosched`` command line: one subcommand per verb.

Each verb lives in its own module under :mod:`geosched.commands` (or the
package that owns it) exposing ``add_arguments(parser)`` and ``run(args)``.
Errors are translated here, at the boundary: a :class:`GeoschedError` becomes
one line on stderr and its exit code (2 for bad input, 1 for run-time
failures); Ctrl-C exits 130 (``geosched <verb>: interrupted``; while the ``geosched`` script still loads, quietly:
:mod:`geosched.console`); an operating system's refusal (a full disk, a
file that cannot be written) is one line and exit 1; a closed pipe on stdout
ends a command quietly with 0, but a run it stopped (``args.run_stops``: launch,
job start) with 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from geosched.errors import GeoschedError

# verb -> (module, one-line help). Modules are imported to build their parser;
# they keep heavy imports (torch, ortools, zmq) inside run().
VERBS: dict[str, tuple[str, str]] = {
    "validate-config": ("geosched.commands.validate_config", "check a cluster/job config"),
    "keys": ("geosched.commands.keys", "write a job's key folder (signing and CURVE keys, token, logins)"),
    "simulate": ("geosched.commands.simulate", "simulate a pipeline schedule: iteration time, bubbles, timeline"),
    "plan": ("geosched.commands.plan", "plan GPUs per DC, stages, placement and data parallelism (CP-SAT)"),
    "profile": ("geosched.commands.profile", "measure the model on this machine; write a cost-model calibration"),
    "wanem": ("geosched.commands.wanem", "WAN emulator: a TCP relay adding delay, per-connection window and link cap"),
    "prefill": ("geosched.commands.prefill", "send a prompt to an agent's prefill endpoint; optionally decode on"),
    "export": ("geosched.commands.export", "merge a checkpoint's stage shards into one whole-model weights file"),
    "agent": ("geosched.commands.agent", "run one rank's agent daemon (MQTT control plane, trains on command)"),
    "job": ("geosched.commands.job", "start, show or stop a job over MQTT (the coordinator)"),
    "launch": ("geosched.commands.launch", "rehearse a whole job on this machine: broker, WAN emulator, agents"),
}

EPILOG = """examples:
  geosched validate-config configs/demo-3dc.yaml
  geosched simulate --schedule 1f1b --stages 4 --microbatches 8
  geosched simulate configs/demo-3dc.yaml --stages 3 --microbatches 4 --timeline t.png
"""


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line and exit code 2 (the CLI's and the benchmarks')."""

    def error(self, message: str) -> NoReturn:  # pragma: no cover - exercised via CLI tests
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with one subparser per verb (``verb``: that verb's alone, so a command
    imports its own module and not every other verb's: ``geosched plan`` starts 0.1 s sooner without the
    launcher's and the agents' modules)."""
    parser = OneLineParser(
        prog="geosched",
        description="Plan, simulate and run LLM training across datacenters over a WAN.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"geosched {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser)
    for name, (module_name, help_text) in VERBS.items():
        if verb is not None and name != verb:
            continue
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or help_text).strip()
        p = sub.add_parser(
            name,
            help=help_text,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def _version() -> str:
    """This checkout's version, as installed (``pyproject.toml``), or ``unknown`` when it is not."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("geosched")
    except PackageNotFoundError:
        return "unknown (not installed)"


def named_verb(argv: list[str]) -> str | None:
    """The verb ``argv`` runs when it names one after nothing but ``-v`` flags, else None (help, a typo:
    those need every verb's parser)."""
    for arg in argv:
        if arg in VERBS:
            return arg
        if not re.fullmatch(r"-v+|--verbose", arg):
            return None
    return None


def main(argv: list[str] | None = None, *, before_run: Callable[[], None] | None = None) -> int:
    """The command line (``argv`` None: this process's own arguments, and it ends with the command; a verb may
    then skip cleanup nobody would see, ``args.process_ends``). ``before_run``: called once the arguments are
    parsed, inside the handlers that report errors and Ctrl-C, just before the verb runs (the console script,
    :mod:`geosched.console`, hands SIGINT back to Python there)."""
    process_ends = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(named_verb(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the verb's parser, which the line then sends to: 'geosched plan --help'
        verb_parser = getattr(args, "_parser", parser)
        verb_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.process_ends = process_ends
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if before_run is not None:
            before_run()
        code = int(args._run(args) or 0)
        if sys.stdout is not None:
            sys.stdout.flush()  # output that cannot be written (a full disk) fails here, inside these handlers
        return code
    except GeoschedError as exc:
        sys.stderr.write(f"geosched {args.verb}: {exc.label + ': ' if exc.label else ''}{exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"geosched {args.verb}: interrupted\n")
        return 130
    except BrokenPipeError:  # the reader went away (``geosched plan ... | head``): not an error of ours
        _drop_stdout()
        if not getattr(args, "run_stops", False):
            return 0
        sys.stderr.write(
            f"geosched {args.verb}: error: its output's reader went away (broken pipe), so the run stopped\n"
        )
        return 1
    except OSError as exc:  # a full disk, a file that cannot be written: the system's refusal, in one line
        where = f" ({exc.filename})" if exc.filename else ""
        sys.stderr.write(f"geosched {args.verb}: error: {exc.strerror or str(exc) or type(exc).__name__}{where}\n")
        _drop_stdout()
        return 1


def _drop_stdout() -> None:
    """Flush stdout; if that fails, point it at /dev/null, so the interpreter's final flush fails no more."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):  # a closed pipe, a full disk (or no stdout at all)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
