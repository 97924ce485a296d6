"""The ``nvckpt`` command line: inspect, compress, decompress, verify, bench and estimate checkpoints.

``main`` turns every user mistake into one line on stderr and a non-zero exit code, never a
traceback; ``--debug`` shows the traceback of anything unexpected.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.version import __version__

from ._ui import EXIT_ERROR, EXIT_INTERNAL, stderr_console

__all__ = ["main", "build_parser", "COMMANDS"]

#: Each command and its help line. ``nvckpt``, ``nvckpt --help`` and ``nvckpt --version`` are answered
#: from this table alone: the command modules import torch (a second or more), so they are imported
#: only once a command is named. tests/test_cli.py holds it equal to the modules' own help lines.
COMMANDS = {
    "inspect": "show a checkpoint's tensors and per-component sizes, ratios and codecs",
    "compress": "convert a torch.save / Lightning / safetensors checkpoint (or an HF checkpoint directory) into ours",
    "decompress": "convert one of our files (or directories) back into plain torch.save or safetensors",
    "verify": "decode the object tree and every chunk as load does; non-zero exit on any problem",
    "bench": "measure every codec and filter on every component and recommend a policy for your storage speed",
    "estimate": "monthly GPU-idle and storage cost of checkpointing, without and with compression",
    "rebase": "write a delta checkpoint (and its chain of bases) as one self-contained full checkpoint",
    "ls": "list the steps on storage tiers: sizes, light/full, whether each verifies",
    "sync": "copy missing or damaged steps from one tier to another (verified), then keep the newest N",
    "run": "run a Python script or module whose torch.load reads our files (DeepSpeed's zero_to_fp32.py, ds_to_universal)",
}
_GLOBAL_OPTIONS = ("-q", "--quiet", "--debug")


def _top_parser() -> tuple[argparse.ArgumentParser, Any]:
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
    return parser, sub


def _light_parser() -> argparse.ArgumentParser:
    """The top-level parser with each command's name and help line only (no command module imported)."""
    parser, sub = _top_parser()
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text)
    return parser


def _names_a_command(argv: Sequence[str]) -> bool:
    # The first argument that is not a global option: a command (whose module must be imported) or not.
    first = next((a for a in argv if a not in _GLOBAL_OPTIONS), None)
    return first in COMMANDS


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (imports every command module)."""
    from . import bench, chain, convert, estimate, inspect, ls, run, sync, verify

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars and no notes; results and errors only")
    common.add_argument("--debug", action="store_true", help="show the traceback of unexpected errors")
    parser, sub = _top_parser()
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if not _names_a_command(argv):
        _light_parser().parse_args(argv)  # --help, --version or a usage error: each exits here
    args = build_parser().parse_args(argv)
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
