"""``nvckpt sync``: copy the steps one tier has and another lacks, verified, then apply ``--keep``.

The compressed units are copied as they are (never recompressed) and committed on the destination
only once checked, exactly as a :class:`nvcomp_checkpoint.CheckpointManager` does. DST's listing is
not taken at its word: each of its copies is verified first, a damaged one is copied again from SRC,
and ``--keep`` counts verified copies only.
"""

from __future__ import annotations

import argparse
import os
import posixpath
from typing import Any

from nvcomp_checkpoint.delta import retained
from nvcomp_checkpoint.errors import CheckpointError, FormatError
from nvcomp_checkpoint.report import format_bytes
from nvcomp_checkpoint.storage import is_url
from nvcomp_checkpoint.tiers import TierStore, UnitManifest, copy_unit, open_tier, retained_steps, verify_unit

from ._ui import EXIT_FAILED, EXIT_OK, Reporter, print_json, stderr_console, stdout_console
from .ls import add_storage_arguments, storage_options_from

__all__ = ["add_parser", "run_sync", "same_place"]

#: URL protocols that name one store (fsspec's aliases).
_PROTOCOL_ALIASES = {"s3a": "s3", "gs": "gcs", "abfs": "az", "abfss": "az", "adl": "az"}


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "sync",
        parents=[common],
        help="copy missing or damaged steps from one tier to another (verified), then keep the newest N",
        description=(
            "Verify DST's copies (every byte and frame; --quick: sizes and index digests), then copy every committed "
            "step of SRC that DST lacks or holds damaged, byte for byte, checked on DST before it is listed there. "
            "With --keep N, DST then keeps its newest N verified steps (never its newest full one); a damaged copy "
            "never counts. SRC is never changed; SRC and DST in one place are refused. Exit code 1 when a step "
            "could not be copied or a damaged copy could not be repaired."
        ),
    )
    p.add_argument("src", metavar="SRC", help="source tier folder or URL")
    p.add_argument("dst", metavar="DST", help="destination tier folder or URL")
    p.add_argument("--keep", type=int, help="steps DST keeps after the copy (default: all)")
    p.add_argument("--quick", action="store_true", help="verify DST's copies by size and index digest only; decode nothing")
    p.add_argument("--json", action="store_true", help="print what was verified, copied and removed as JSON")
    add_storage_arguments(p)
    p.set_defaults(func=run_sync)


def _place(location: str) -> tuple[str, str]:
    """``(protocol, path)`` naming where a tier root is: a local path with ``..`` and links resolved, or a
    URL's protocol (aliases folded) with its bucket and prefix normalized."""
    if not is_url(location):
        local = location[len("file://") :] if location.startswith("file://") else location
        return "file", os.path.realpath(os.path.abspath(local))
    protocol, rest = location.split("://", 1)
    protocol = _PROTOCOL_ALIASES.get(protocol.lower(), protocol.lower())
    return protocol, posixpath.normpath("/" + rest).lstrip("/")


def same_place(a: str, b: str) -> bool:
    """Whether two tier roots are one place (same path after ``..`` and links; same protocol, bucket and prefix)."""
    return _place(a) == _place(b)


def _verify_all(
    dst: TierStore, have: dict[int, UnitManifest], problems: dict[int, str], quick: bool, reporter: Reporter
) -> tuple[dict[int, UnitManifest], dict[int, str]]:
    """DST's copies that verify, and why each other one does not (its manifest's problem included)."""
    good, damaged = {}, dict(problems)
    for step, m in sorted(have.items()):
        reporter.start(f"verifying step {step} on DST", None)
        why = verify_unit(dst, m, full=not quick)
        if why is None:
            good[step] = m
        else:
            damaged[step] = why
    return good, damaged


def run_sync(args: argparse.Namespace) -> int:
    if args.keep is not None and args.keep < 1:
        raise CheckpointError(f"--keep must be a positive integer, got {args.keep}")
    if same_place(args.src, args.dst):
        raise CheckpointError(
            f"SRC {args.src} and DST {args.dst} are one place (the same folder once '..' and links are resolved, or "
            "the same bucket and prefix): there is nothing to copy, and --keep would remove SRC's steps; give another DST"
        )
    src = open_tier(args.src, storage_options_from(args, args.src), name="SRC")
    dst = open_tier(args.dst, storage_options_from(args, args.dst), name="DST")
    wanted = src.manifests()
    have, problems = dst.listing()
    copied, failed, nbytes = [], {}, 0
    with Reporter(args.quiet) as reporter:
        good, damaged = _verify_all(dst, have, problems, args.quick, reporter)
        if args.keep is not None:
            # Steps that --keep would delete at once are not worth copying.
            keep_from = retained_steps(set(good) | set(wanted), args.keep, None)
            # ... and the bases the kept deltas need (copied first: steps go in ascending order).
            keep_from = set(
                retained(sorted(keep_from), lambda s: wanted[s].base if s in wanted else good[s].base if s in good else None)
            )
            wanted = {s: m for s, m in wanted.items() if s in keep_from}
        for step, m in sorted(wanted.items()):
            if step in good:
                continue
            task = reporter.start(f"step {step}" + (" (damaged on DST)" if step in damaged else ""), m.stored_bytes)
            try:
                committed = copy_unit(src, dst, m, task.advance)
                why = verify_unit(dst, committed, full=not args.quick)
                if why is not None:
                    dst.remove_unit(step, committed.directory)
                    raise FormatError(f"step {step}: its copy on DST does not verify ({why}); removed there")
            except FormatError as exc:  # this step's bytes (SRC's copy, a FIFO, a broken chain): the others go on
                failed[step] = str(exc)
                continue
            copied.append(step)
            good[step] = committed
            nbytes += m.stored_bytes
    recopied = [s for s in copied if s in damaged]
    removed: list[int] = []
    as_bases: list[int] = []  # kept past --keep: bases of kept deltas
    as_full: list[int] = []  # kept past --keep: the newest full step
    if args.keep is not None and good:
        full = [s for s, m in good.items() if not m.light]
        protect = {max(good)} | ({max(full)} if full else set())
        by_count = retained_steps(good, args.keep, None)
        kept = retained_steps(good, args.keep, None, protect)
        as_full = sorted(kept - by_count)
        kept = set(retained(sorted(kept), lambda s: good[s].base if s in good else None))  # a chain goes as a whole
        as_bases = sorted(kept - by_count - set(as_full))
        # A damaged copy older than every kept step goes as retention would take it; a newer one stays (reported).
        doomed = set(good) - kept | {s for s in damaged if s not in copied and s < min(kept)}
        for step in sorted(doomed):
            dst.remove_unit(step, good[step].directory if step in good else None)
            removed.append(step)
    unrepaired = {s: why for s, why in damaged.items() if s not in copied and s not in removed}
    report = [{"step": s, "problem": why, "repaired": s in copied} for s, why in sorted(damaged.items())]
    for step, why in sorted(failed.items()):
        stderr_console().print(f"nvckpt sync: step {step} not copied: {why}", markup=False, highlight=False)
    for step, why in sorted(unrepaired.items()):
        stderr_console().print(
            f"nvckpt sync: step {step} on DST is damaged and SRC holds no good copy of it: {why}; kept as found",
            markup=False,
            highlight=False,
        )
    code = EXIT_FAILED if failed or unrepaired else EXIT_OK
    verified = len([s for s in have if s not in damaged])
    if args.json:
        print_json(
            {
                "nvckpt": "sync",
                "verified": verified,
                "damaged": report,
                "copied": copied,
                "recopied": recopied,
                "failed": [{"step": s, "problem": why} for s, why in sorted(failed.items())],
                "bytes": nbytes,
                "removed": removed,
                "kept": dst.steps(),
                "kept_as_bases": as_bases,
                "kept_as_newest_full": as_full,
            }
        )
        return code
    console = stdout_console()
    extra = []
    if as_bases:
        extra.append(f"{as_bases} as bases of kept deltas (a chain goes as a whole)")
    if as_full:
        extra.append(f"{as_full} as the newest full step")
    beyond = f"; past --keep {args.keep} it also keeps {' and '.join(extra)}" if extra else ""
    found = f"verified {verified} copies" + (f", {len(damaged)} damaged" if damaged else "")
    again = f", copied again {recopied}" if recopied else ""
    trouble = []
    if failed:
        trouble.append(f"not copied {sorted(failed)}")
    if unrepaired:
        trouble.append(f"damaged and not repaired {sorted(unrepaired)}")
    console.print(
        f"{args.dst}: {found}; copied {len(copied)} step(s) ({format_bytes(nbytes)}) {copied or ''}{again}; "
        f"removed {removed or 'none'}{beyond}; now holds {dst.steps()}" + (f"; {', '.join(trouble)}" if trouble else ""),
        markup=False,
        highlight=False,
    )
    return code
