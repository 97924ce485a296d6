"""``nvckpt ls``: the steps each tier holds, their sizes, light or full, and whether each verifies.

A tier is a folder or URL that a :class:`nvcomp_checkpoint.CheckpointManager` writes to
(``step-NNNNNNNNNN.nvc`` units with their manifests; see ``docs/tiers.md``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from nvcomp_checkpoint.errors import CheckpointError, TierNotFoundError
from nvcomp_checkpoint.report import format_bytes
from nvcomp_checkpoint.tiers import TierStore, open_tier, verify_unit

from ._ui import EXIT_FAILED, EXIT_OK, make_table, print_json, stdout_console

__all__ = ["add_parser", "run_ls", "add_storage_arguments", "storage_options_from"]


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs (credentials come from the usual AWS variables)")


def storage_options_from(args: argparse.Namespace, url: str) -> dict[str, Any] | None:
    """fsspec options for ``url`` from the command line."""
    if getattr(args, "endpoint_url", None) and url.startswith(("s3://", "s3a://")):
        return {"client_kwargs": {"endpoint_url": args.endpoint_url}}
    return None


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list the steps on storage tiers: sizes, light/full, whether each verifies",
        description=(
            "List the committed steps of one or more tiers (folders or URLs a CheckpointManager writes to). "
            "Each copy is checked against its manifest and, unless --quick, every chunk is decoded. "
            "Exit code 1 when a copy does not verify."
        ),
    )
    p.add_argument("urls", nargs="+", metavar="URL", help="tier folder or URL (s3://bucket/run1 ...)")
    p.add_argument("--quick", action="store_true", help="check sizes and index digests only; decode nothing")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    add_storage_arguments(p)
    p.set_defaults(func=run_ls)


def list_tier(url: str, options: dict[str, Any] | None, quick: bool) -> list[dict[str, Any]]:
    """One row per committed step of the tier at ``url``, oldest first."""
    store = open_tier(url, options)
    manifests, problems = store.listing()
    if not manifests and not problems:
        _refuse_what_is_not_a_tier(url, store)
    rows = []
    for step in sorted({*manifests, *problems}):
        m = manifests.get(step)
        if m is None:  # a manifest that does not check (damaged, or another step's): the step is not listed
            rows.append(
                {
                    "step": step,
                    "path": store.manifest_path(step),
                    "kind": "unknown",
                    "files": 0,
                    "bytes": 0,
                    "light": False,
                    "base": None,
                    "created": 0.0,
                    "verifies": False,
                    "problem": problems[step],
                }
            )
            continue
        problem = verify_unit(store, m, full=not quick)
        rows.append(
            {
                "step": step,
                "path": store.unit_path(step, m.directory),
                "kind": "directory" if m.directory else "file",
                "files": len(m.files),
                "bytes": m.stored_bytes,
                "light": m.light,
                "base": m.base,
                "created": m.created,
                "verifies": problem is None,
                "problem": problem,
            }
        )
    return rows


def _refuse_what_is_not_a_tier(url: str, store: TierStore) -> None:
    """A tier without steps is an empty one; a mistyped folder or a folder of other files is an error.

    Raises:
        TierNotFoundError: ``url`` is a local folder that does not exist.
        CheckpointError: ``url`` holds files, none of them a step (not a tier).
    """
    names = store.names()
    if not names and "://" not in store.root and os.path.isfile(store.root):
        raise CheckpointError(f"{url}: a file, not a tier folder; for a checkpoint file: nvckpt inspect {url}")
    if not names and "://" not in store.root and not os.path.isdir(store.root):
        raise TierNotFoundError(f"{url}: no such folder (a tier is the folder or URL a CheckpointManager writes to)")
    if names and not any(n.startswith("step-") for n in names):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise CheckpointError(
            f"{url}: not a tier: no step-NNNNNNNNNN units among its {len(names)} entries ({shown}). "
            "`nvckpt ls` lists the folders a CheckpointManager writes to; for a checkpoint file or folder: nvckpt inspect PATH"
        )


def run_ls(args: argparse.Namespace) -> int:
    result = {url: list_tier(url, storage_options_from(args, url), args.quick) for url in args.urls}
    bad = any(not r["verifies"] for rows in result.values() for r in rows)
    if args.json:
        print_json({"nvckpt": "ls", "tiers": result})
        return EXIT_FAILED if bad else EXIT_OK
    console = stdout_console()
    for url, rows in result.items():
        table_rows = [
            [
                str(r["step"]),
                format_bytes(r["bytes"]),
                "light" if r["light"] else "full" if r["base"] is None else "delta",
                "-" if r["base"] is None else str(r["base"]),
                r["kind"] if r["kind"] in ("file", "unknown") else f"directory ({r['files']} files)",
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"])) if r["created"] else "-",
                ("ok" if args.quick is False else "ok (quick)") if r["verifies"] else f"NO: {r['problem']}",
            ]
            for r in rows
        ]
        title = f"{url}: {len(rows)} step(s), {format_bytes(sum(r['bytes'] for r in rows))}"
        if not rows:
            console.print(f"{url}: no committed steps", markup=False, highlight=False)
            continue
        console.print(
            make_table(title, ["step", "size", "save", "base", "unit", "created", "verifies"], table_rows, numeric_from=1)
        )
    return EXIT_FAILED if bad else EXIT_OK
