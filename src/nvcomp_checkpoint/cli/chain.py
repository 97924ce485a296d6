"""Chains of delta checkpoints on the command line: ``nvckpt rebase``, and the chain that
``inspect`` shows and ``verify`` checks."""

from __future__ import annotations

import argparse
import os
from typing import Any

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, FormatError
from nvcomp_checkpoint.format.layout import SAVE_METADATA_KEYS
from nvcomp_checkpoint.report import format_bytes

from . import _policy
from ._ui import EXIT_OK, Reporter, check_workers, print_json, stdout_console
from .sources import NVCOMP, sniff

__all__ = ["add_parser", "run_rebase", "describe_chain", "chain_text"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "rebase",
        parents=[common],
        help="write a delta checkpoint (and its chain of bases) as one self-contained full checkpoint",
        description=(
            "Read DELTA, following its chain of bases, and write OUT as a full checkpoint that needs no base: "
            "the bases of the chain may then be deleted."
        ),
    )
    p.add_argument("delta", help="a delta checkpoint (a full one is copied through a re-save)")
    p.add_argument("out", help="the full checkpoint to write")
    p.add_argument("--policy", help="codec policy for OUT (as for `compress`; default: the default policy)")
    p.add_argument("--workers", type=int, help="compression threads (default: every core)")
    p.add_argument(
        "--trust", action="store_true", help="load pickled Python objects (weights_only=False); only for files you trust"
    )
    p.add_argument("-f", "--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print the save report as JSON")
    p.set_defaults(func=run_rebase)


def describe_chain(path: str) -> list[dict[str, Any]]:
    """``[{path, depth, file_bytes, error}]`` from ``path`` back to its full checkpoint.

    Never raises for a broken chain: the link that cannot be followed carries the error. Each file
    is visited once and at most ``MAX_CHAIN_DEPTH`` deep (the reader refuses to open a deeper base).
    """
    links: list[dict[str, Any]] = []
    try:
        reader = nc.open(path)
    except CheckpointError as exc:
        return [{"path": path, "depth": None, "file_bytes": None, "error": " ".join(str(exc).split())}]
    first = reader
    try:
        while True:
            ref = reader.index.base
            links.append({"path": reader.path, "depth": ref.depth if ref else 0, "file_bytes": reader.file_bytes, "error": None})
            chain = reader.chain
            if chain is None:
                return links
            if any(os.path.abspath(link["path"]) == os.path.abspath(chain.path) for link in links):
                # The identity checks refuse such a base anyway; say what it is.
                error = f"{reader.path}: its chain of bases loops back to {chain.path} (a file met twice); its base records are corrupt or forged"
                links.append({"path": chain.path, "depth": None, "file_bytes": None, "error": error})
                return links
            try:
                # The base's reader, once its identity is checked; closed with the delta's reader.
                reader = chain.reader()
            except CheckpointError as exc:
                links.append({"path": chain.path, "depth": None, "file_bytes": None, "error": " ".join(str(exc).split())})
                return links
    finally:
        first.close()


def chain_text(links: list[dict[str, Any]]) -> str:
    """One line: ``delta (depth 2) <- base (depth 1) <- full``."""
    parts = []
    for link in links:
        if link["error"]:
            parts.append(f"{link['path']} (BROKEN: {link['error']})")
        else:
            kind = "full" if link["depth"] == 0 else f"delta, depth {link['depth']}"
            parts.append(f"{link['path']} ({kind}, {format_bytes(link['file_bytes'])})")
    return "chain: " + " <- ".join(parts)


def run_rebase(args: argparse.Namespace) -> int:
    check_workers(args.workers)
    policy = _policy.parse_policy(args.policy)
    _policy.check_policy_runs_here(policy)
    if sniff(args.delta) != NVCOMP:
        raise FormatError(f"{args.delta}: not an nvcomp-checkpoint file; rebase reads delta checkpoints")
    if os.path.exists(args.out) and not args.force:
        raise CheckpointError(f"{args.out}: already exists; pass --force to replace it")
    links = describe_chain(args.delta)
    broken = [link for link in links if link["error"]]
    if broken:
        raise CheckpointError(broken[0]["error"])
    if any(
        os.path.exists(link["path"]) and os.path.exists(args.out) and os.path.samefile(link["path"], args.out) for link in links
    ):
        raise CheckpointError(f"{args.out}: is a file of the chain itself; write to another path")
    reporter = Reporter(args.quiet)
    with nc.open(args.delta) as reader:
        meta = {k: v for k, v in reader.metadata.items() if k not in SAVE_METADATA_KEYS}
        raw = reader.raw_bytes
    reporter.start(f"reading {os.path.basename(args.delta)} and its {len(links) - 1} base(s)")
    try:
        tree = nc.load(args.delta, map_location="cpu", weights_only=not args.trust)
        task = reporter.start(f"writing {os.path.basename(args.out)}", raw)
        report = nc.save(tree, args.out, policy, metadata=meta, workers=args.workers, progress=task.advance)
    finally:
        reporter.stop()
    if args.json:
        out = report.to_dict()
        out.update(source=args.delta, chain=[link["path"] for link in links])
        print_json(out)
    elif not args.quiet:
        stdout_console().print(
            f"{args.delta} (chain of {len(links)} files) -> {args.out}: full checkpoint, {format_bytes(report.stored_bytes)} "
            f"({report.ratio:.3f}x), no base needed",
            markup=False,
            highlight=False,
        )
    return EXIT_OK
