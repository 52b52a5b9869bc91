"""The `npqwen` command: the parser and main; each command lives in its own module here.

A command is one module, npqwen/cli/<name>.py, with `add_parser(commands)` (its subparser, its
options, `set_defaults(run=cmd_<name>)`) and its `cmd_<name>(args)`; adding one is that module
and its name in COMMANDS. What several commands share (loading, the sampling and engine-size
options, writing to stdout) is in common.py.

A mistake the user can fix (bad path, bad value, prompt too long) prints one line on stderr
and exits with status 1, without a traceback.
"""
import argparse
import difflib
import importlib
import io
import os
import sys

from ..errors import NpqwenError
from . import parallel
from .common import OutputError, write_out

COMMANDS = [   # npqwen/cli/<name>.py, in the order `npqwen --help` lists them
    "generate",
    "embed",
    "rerank",
    "serve",
    "chat",
    "inspect",
    "trace",
    "lens",
    "features",
    "compare",
    "perplexity",
    "merge-lora",
    "finetune",
    "quantize",
]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:   # tensor parallel (npqwen/cli/parallel.py): start under mpiexec, or be one of its ranks
        if parallel.wanted(args):
            if not parallel.mpi_world_size():
                parallel.relaunch(args, argv)
            if parallel.start(args, argv).rank > 0:
                return parallel.follow_command(args.comm)
    except NpqwenError as e:
        if parallel.first_rank():   # every rank finds the same mistake: one says it
            print(f"npqwen: error: {e}", file=sys.stderr)
        return 1
    try:
        return parallel.finish(args, run(args))
    except BaseException:   # a bug: the traceback shows; the other ranks may be mid-step, so the group ends
        if getattr(args, "comm", None) is not None and args.comm.failed is None:
            args.comm.failed = "rank 0 failed (see its traceback)"
        raise


def run(args) -> int:
    """The command, its exit status, and its errors as one line."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        # Text the terminal's encoding cannot show (PYTHONIOENCODING=latin-1 and a Chinese answer)
        # prints as "?" instead of ending the run in a UnicodeEncodeError.
        sys.stdout.reconfigure(errors="replace")
    try:
        code = args.run(args) or 0
        write_out("")   # flush now: a full disk shows as one line here, not as a traceback at exit
        return code
    except NpqwenError as e:
        print(f"npqwen: error: {e}", file=sys.stderr)
        if isinstance(e, OutputError):   # what is still buffered would fail again at exit: let it go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:   # e.g. `npqwen generate ... | head`
        sys.stderr.close()
        return 0


class Parser(argparse.ArgumentParser):
    """argparse, but an unknown option after a command shows that command's usage and the nearest
    option it has (`generate --temprature 0.5`: did you mean --temperature?)."""

    def parse_args(self, args=None, namespace=None):
        args, unknown = self.parse_known_args(args, namespace)
        if unknown:
            commands = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
            command = commands.choices[args.command]
            options = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
            near = [difflib.get_close_matches(u.split("=")[0], options, n=1) for u in unknown if u.startswith("-")]
            hint = "".join(f"; did you mean {n[0]}?" for n in near if n)
            command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return args


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="npqwen", description="Qwen3 inference in plain NumPy / CuPy.")
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"npqwen {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}").add_parser(commands)
    return parser
