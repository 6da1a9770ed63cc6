"""The argument parser and the entry point: input errors are one line and exit code 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from ..coordinator.client import DEFAULT_NAMESPACE
from .inspect_state import MAX_TABLE_ROWS, cmd_inspect
from .merge import cmd_merge
from .plan import cmd_plan
from .status import cmd_status
from .text import (
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_OK,
    PROG,
    CliError,
    Parser,
    one_line,
)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argument parser of the CLI."""
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    # Also after the command; SUPPRESS: a subcommand never resets it when given before.
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an unexpected error")
    parser = Parser(prog=prog, description="Inspect lance_ray checkpoints and plans, watch "
                     "a running coordinator, merge per-rank states.")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", parents=[common], help="describe a checkpoint state file",
                       description="Describe a checkpoint (a rank's, a merged or a "
                       "lancedb.streaming reference-format state).")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="state JSON file")
    p.add_argument("--png", metavar="OUT.png", help="write a bar chart of per-split progress")
    p.add_argument("--all", action="store_true",
                   help="one table row per split (default: grouped, at most "
                   f"{MAX_TABLE_ROWS} rows)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", parents=[common], help="describe the split plan of a table",
                       description="Build the split plan a StreamingDataset with these "
                       "arguments would read, and describe it.")
    p.add_argument("table", metavar="TABLE", help="Lance dataset URI, e.g. db/demo.lance")
    p.add_argument("--num-splits", type=int, required=True, metavar="N")
    p.add_argument("--shuffle-seed", type=int, default=0, metavar="S")
    p.add_argument("--epoch", type=int, default=0, metavar="E")
    p.add_argument("--no-shuffle", action="store_true", help="sequential splits")
    p.add_argument("--clump-size", type=int, default=None, metavar="C",
                   help="shuffle_clump_size; also prints clump statistics")
    p.add_argument("--filter", default=None, metavar="SQL", help="SQL row filter")
    p.add_argument("--table-version", type=int, default=None, metavar="V",
                   help="table version (default: the current one)")
    p.add_argument("--plan", choices=("lancedb", "index"), default="lancedb",
                   help="plan mode (index: computed, for tables past lancedb's builder limit)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("status", parents=[common], help="progress of a running coordinator",
                       description="Connect to a running Ray cluster and print the progress "
                       "of a coordinator actor.")
    p.add_argument("name", metavar="NAME", help="coordinator name")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                   help=f"Ray namespace (default {DEFAULT_NAMESPACE})")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster address (default: auto)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("merge", parents=[common], help="merge per-rank state files into one",
                       description="Merge the states of every rank of one run, saved at one "
                       "global step, into one state that resumes on any valid world size.")
    p.add_argument("states", nargs="+", metavar="STATE", help="per-rank state JSON files")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the merged state here (default: print it)")
    p.set_defaults(func=cmd_merge)
    return parser


def _configure_logging() -> None:
    """Library warnings (e.g. a legacy or reference-format state) go to stderr, briefly."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format=f"{PROG}: %(levelname)s: %(message)s")


def _fail(prog: str, message: object) -> int:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return EXIT_INPUT


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except CliError as e:
        print(one_line(e), file=sys.stderr)
        return EXIT_INPUT
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else EXIT_OK
    _configure_logging()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as e:
        return _fail(prog, e)
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return EXIT_OK
    except OSError as e:
        where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
        return _fail(prog, f"{e.strerror or e}{':' + where if where else ''}")
    except (ValueError, TypeError) as e:
        return _fail(prog, e)
    except Exception as e:
        if args.traceback:
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {one_line(e)} (rerun with "
              "--traceback for details)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
