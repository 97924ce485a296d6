"""``nvckpt run SCRIPT [ARGS]`` / ``nvckpt run -m MODULE [ARGS]``: a tool that reads checkpoints with ``torch.load``, reading ours.

Runs the script or module in this process, as ``python`` would, with ``torch.load`` reading our files
(:func:`nvcomp_checkpoint.enable_torch_load`): DeepSpeed's ``zero_to_fp32.py`` and ``ds_to_universal``
on a compressed folder, an evaluation script, a converter. Files of a DeepSpeed tag are read with
DeepSpeed's allow-list and their tag's manifest checked, as the attached engine reads them.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from typing import Any

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.deepspeed_layout import OTHER_FILE, classify_file, load_deepspeed_file
from nvcomp_checkpoint.errors import CheckpointError, UnsafeCheckpointError
from nvcomp_checkpoint.torchload import disable_torch_load, enable_torch_load

__all__ = ["add_parser", "run_run", "load_any"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run",
        parents=[common],
        help="run a Python script or module whose torch.load reads our files (DeepSpeed's zero_to_fp32.py, ds_to_universal)",
        description=(
            "Run SCRIPT (or, with -m, the module) in this process as `python SCRIPT ARGS` would, with torch.load "
            "reading nvcomp-checkpoint files (weights-only rules; files of a DeepSpeed tag with DeepSpeed's "
            "allow-list). Other files go to torch.load unchanged. Example: "
            "nvckpt run ckpt/zero_to_fp32.py ckpt out; nvckpt run -m deepspeed.checkpoint.ds_to_universal "
            "--input_folder ckpt/step10 --output_folder universal"
        ),
    )
    p.add_argument("-m", dest="as_module", action="store_true", help="ARGV[0] is a module to run, as python -m")
    p.add_argument(
        "--trust",
        action="store_true",
        help="honour the script's torch.load(weights_only=False) for our files too (unpickles arbitrary objects)",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]", help="the script (or module) and its arguments")
    p.set_defaults(func=run_run)


def load_any(path: str, map_location: Any) -> Any:
    """One of our files by path: a DeepSpeed tag's file as the attached engine reads it, any other with ``nc.load``."""
    try:
        if classify_file(os.path.basename(path)).kind != OTHER_FILE:
            return load_deepspeed_file(path, map_location)
        return nc.load(path, map_location)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{exc} (nvckpt run keeps weights-only rules for nvcomp-checkpoint files whatever weights_only the "
            "script passes; for a file you trust, pass --trust)"
        ) from exc


def run_run(args: argparse.Namespace) -> int:
    if not args.argv:
        raise CheckpointError("nvckpt run: give the script (or -m MODULE) to run, then its arguments")
    target, rest = args.argv[0], list(args.argv[1:])
    if not args.as_module and not os.path.isfile(target):
        raise CheckpointError(f"{target}: no such script; give a Python file, or -m MODULE")
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    sys.argv = [target, *rest]
    # As python does: the script's folder (or, for -m, the working directory) first on the path.
    sys.path.insert(0, os.getcwd() if args.as_module else os.path.dirname(os.path.abspath(target)))
    enable_torch_load(trust=args.trust, loader=load_any)
    try:
        if args.as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return int(code or 0)
        print(code, file=sys.stderr)
        return 1
    except Exception:  # the script's own failure: its traceback and exit status 1, as python gives
        traceback.print_exc()
        return 1
    finally:
        disable_torch_load()
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0
