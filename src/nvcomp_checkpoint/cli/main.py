"""The ``nvckpt`` command line: inspect, compress, decompress, verify, bench and estimate checkpoints.

``main`` turns every user mistake into one line on stderr and a non-zero exit code, never a
traceback; ``--debug`` shows the traceback of anything unexpected.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from nvcomp_checkpoint import __version__
from nvcomp_checkpoint.errors import CheckpointError

from . import bench, chain, convert, estimate, inspect, ls, run, sync, verify
from ._ui import EXIT_ERROR, EXIT_INTERNAL, stderr_console

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars and no notes; results and errors only")
    common.add_argument("--debug", action="store_true", help="show the traceback of unexpected errors")
    parser = argparse.ArgumentParser(
        prog="nvckpt",
        description="Inspect, convert, verify and benchmark compressed training checkpoints (nvcomp-checkpoint).",
        epilog="Exit codes: 0 success, 1 verify found a problem, 2 error (bad input or option), 3 internal error.",
    )
    parser.add_argument("--version", action="version", version=f"nvckpt (nvcomp-checkpoint) {__version__}")
    # The common options are accepted before the command too (`nvckpt -q compress ...`), under other
    # names: a subparser's defaults would overwrite the same names (argparse sets them after).
    parser.add_argument("-q", "--quiet", dest="global_quiet", action="store_true", help="as the command's --quiet")
    parser.add_argument("--debug", dest="global_debug", action="store_true", help="as the command's --debug")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect.add_parser(sub, common)
    convert.add_parsers(sub, common)
    verify.add_parser(sub, common)
    bench.add_parser(sub, common)
    estimate.add_parser(sub, common)
    chain.add_parser(sub, common)
    ls.add_parser(sub, common)
    sync.add_parser(sub, common)
    run.add_parser(sub, common)
    return parser


def _one_line(exc: BaseException) -> str:
    # Messages from torch span lines (and carry ANSI escapes); an error is one line.
    text = " ".join(str(exc).replace("\x1b[1m", "").replace("\x1b[0m", "").split())
    return text or type(exc).__name__


def _fail(message: str) -> None:
    stderr_console().print(f"nvckpt: error: {message}", markup=False, highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nvckpt`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.quiet = bool(getattr(args, "quiet", False) or args.global_quiet)
    args.debug = bool(getattr(args, "debug", False) or args.global_debug)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except CheckpointError as exc:
        _fail(_one_line(exc))
    except FileNotFoundError as exc:
        _fail(f"{exc.filename or ''}: no such file or directory".lstrip(": "))
    except PermissionError as exc:
        _fail(f"{exc.filename or ''}: permission denied".lstrip(": "))
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or _one_line(exc)}")
    except Exception as exc:  # a bug: say so in one line, and how to see the traceback
        if args.debug:
            raise
        _fail(
            f"unexpected {type(exc).__name__}: {_one_line(exc)} (this is a bug; rerun with --debug for the traceback and report it)"
        )
        return EXIT_INTERNAL
    return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
