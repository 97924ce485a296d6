"""``nvckpt sync``: copy the steps one tier has and another lacks, verified, then apply ``--keep``.

The compressed units are copied as they are (never recompressed) and committed on the
destination only once checked, exactly as a :class:`nvcomp_checkpoint.CheckpointManager` does.
"""

from __future__ import annotations

import argparse
from typing import Any

from nvcomp_checkpoint.delta import retained
from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.report import format_bytes
from nvcomp_checkpoint.tiers import copy_unit, open_tier, retained_steps

from ._ui import EXIT_OK, Reporter, print_json, stdout_console
from .ls import add_storage_arguments, storage_options_from

__all__ = ["add_parser", "run_sync"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "sync",
        parents=[common],
        help="copy missing steps from one tier to another (verified), then keep the newest N",
        description=(
            "Copy every committed step of SRC that DST lacks, byte for byte, checked on DST before it is listed "
            "there. With --keep N, DST then keeps its newest N steps (never its newest full one); SRC is never changed."
        ),
    )
    p.add_argument("src", metavar="SRC", help="source tier folder or URL")
    p.add_argument("dst", metavar="DST", help="destination tier folder or URL")
    p.add_argument("--keep", type=int, help="steps DST keeps after the copy (default: all)")
    p.add_argument("--json", action="store_true", help="print what was copied and removed as JSON")
    add_storage_arguments(p)
    p.set_defaults(func=run_sync)


def run_sync(args: argparse.Namespace) -> int:
    if args.keep is not None and args.keep < 1:
        raise CheckpointError(f"--keep must be a positive integer, got {args.keep}")
    src = open_tier(args.src, storage_options_from(args, args.src), name="SRC")
    dst = open_tier(args.dst, storage_options_from(args, args.dst), name="DST")
    have = dst.manifests()
    wanted = src.manifests()
    if args.keep is not None:
        # Steps that --keep would delete at once are not worth copying.
        keep_from = retained_steps(set(have) | set(wanted), args.keep, None)
        # ... and the bases the kept deltas need (copied first: steps go in ascending order).
        keep_from = set(
            retained(sorted(keep_from), lambda s: wanted[s].base if s in wanted else have[s].base if s in have else None)
        )
        wanted = {s: m for s, m in wanted.items() if s in keep_from}
    copied, nbytes = [], 0
    with Reporter(args.quiet) as reporter:
        for step, m in sorted(wanted.items()):
            if step in have:
                continue
            task = reporter.start(f"step {step}", m.stored_bytes)
            copy_unit(src, dst, m, task.advance)
            copied.append(step)
            nbytes += m.stored_bytes
    removed: list[int] = []
    as_bases: list[int] = []  # kept past --keep: bases of kept deltas
    as_full: list[int] = []  # kept past --keep: the newest full step
    if args.keep is not None:
        now = dst.manifests()
        full = [s for s, m in now.items() if not m.light]
        protect = {max(now)} | ({max(full)} if full else set()) if now else set()
        by_count = retained_steps(now, args.keep, None)
        kept = retained_steps(now, args.keep, None, protect)
        as_full = sorted(kept - by_count)
        kept = set(retained(sorted(kept), lambda s: now[s].base if s in now else None))  # a chain goes as a whole
        as_bases = sorted(kept - by_count - set(as_full))
        for step in sorted(set(now) - kept):
            dst.remove_unit(step, now[step].directory)
            removed.append(step)
    if args.json:
        print_json(
            {
                "nvckpt": "sync",
                "copied": copied,
                "bytes": nbytes,
                "removed": removed,
                "kept": dst.steps(),
                "kept_as_bases": as_bases,
                "kept_as_newest_full": as_full,
            }
        )
        return EXIT_OK
    console = stdout_console()
    extra = []
    if as_bases:
        extra.append(f"{as_bases} as bases of kept deltas (a chain goes as a whole)")
    if as_full:
        extra.append(f"{as_full} as the newest full step")
    beyond = f"; past --keep {args.keep} it also keeps {' and '.join(extra)}" if extra else ""
    console.print(
        f"{args.dst}: copied {len(copied)} step(s) ({format_bytes(nbytes)}) {copied or ''}; "
        f"removed {removed or 'none'}{beyond}; now holds {dst.steps()}",
        markup=False,
        highlight=False,
    )
    return EXIT_OK
