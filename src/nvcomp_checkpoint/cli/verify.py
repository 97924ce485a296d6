"""``nvckpt verify``: the object tree decoded and checked, every chunk decoded, the failing tensors named.

Exit code 0 when ``load`` would accept the file, 1 when anything is corrupt, forged or cannot be
decoded here, 2 when the path is not one of our files (see ``docs/cli.md``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, CodecUnavailableError, FormatError, SizeLimitError
from nvcomp_checkpoint.report import format_bytes
from nvcomp_checkpoint.storage import stale_temp_files

from . import _dcp, _deepspeed
from ._ui import EXIT_FAILED, EXIT_OK, Reporter, default_max_bytes, print_json, stdout_console
from .chain import describe_chain
from .sources import DIRECTORY, NVCOMP, SAFETENSORS, TORCH, dir_files, sniff

__all__ = ["add_parser", "run_verify", "verify_file", "default_max_bytes", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str) -> int:
    """``"512M"``, ``"8G"``, ``"1.5T"`` or a number of bytes (units of 1024) as bytes; ``"0"``: no limit."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number of bytes, or with K, M, G, T)") from None
    if number < 0 or number != number or number == float("inf"):
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(number * _UNITS[unit])


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[common],
        help="decode the object tree and every chunk as load does; non-zero exit on any problem",
        description=(
            "Check a file as nc.load reads it: the index; the object tree (checksum, then decoded with the "
            "weights-only rules of torch.load(weights_only=True), and every tensor reference checked against the "
            "index); every chunk of every tensor (checksum, then a full decode). A file passes exactly when load "
            "accepts it. Exit code 0: all good; 1: something is corrupt, forged, refused by the weights-only rules "
            "or not decodable here (the tensor is named); 2: not a checkpoint of ours. A directory made by "
            "`nvckpt compress` has each of its .nvc files verified, and temporary files left by killed saves in it "
            "are listed (the next save there removes them)."
        ),
    )
    p.add_argument("path", help="nvcomp-checkpoint file, or a directory of them")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="refuse, before decoding, a file whose object tree and tensors decode to more than SIZE (e.g. 64G; "
        "a delta tensor counts once per file of its chain); default: this machine's memory; 0: no limit",
    )
    p.set_defaults(func=run_verify)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def verify_file(path: str, reporter: Reporter, max_bytes: int | None = None, of: str = "") -> dict[str, Any]:
    """Verify one file; returns ``{file, tensors, raw_bytes, unreadable, failures: [{tensor, error}]}``.

    ``unreadable``: its index could not be read (truncated, not ours), so no tensor was checked.
    ``max_bytes``: as for :func:`nvcomp_checkpoint.verify` (None: no limit). ``of``: where the file
    stands among those verified (``"3/12"``), shown on its progress bar.
    """
    try:
        with nc.open(path) as reader:  # the index only: the size of the bar
            total: int | None = reader.raw_bytes
    except CheckpointError:
        total = None  # nc.verify reports why
    task = reporter.start(f"verifying {os.path.basename(path)}" + (f" ({of})" if of else ""), total)
    try:
        # A file that starts with our magic (checked by the caller) and fails is damage, not a mistake.
        checked = nc.verify(path, progress=task.advance, max_bytes=max_bytes)
    finally:
        reporter.stop()
    failures = []
    for problem in checked.problems:
        message = _one_line(problem.error)
        if isinstance(problem.error, CodecUnavailableError):
            message = f"cannot be decoded on this machine: {message}"
        elif isinstance(problem.error, SizeLimitError) and problem.error.needed is not None:
            message = (
                f"{path}: not verified: it decodes to {problem.error.needed} bytes ({format_bytes(problem.error.needed)}), over "
                f"--max-bytes {problem.error.limit}; if you trust the file, pass --max-bytes {problem.error.needed} (or 0: no limit)"
            )
        failures.append({"tensor": problem.tensor, "error": message})
    return {
        "file": path,
        "tensors": checked.tensors,
        "raw_bytes": checked.raw_bytes,
        "unreadable": total is None,
        "failures": failures,
    }


def _run_verify_deepspeed(args: argparse.Namespace) -> int:
    """A DeepSpeed folder: every tag complete (its manifest, or every rank's files), every file read as the attached engine reads it."""
    limit = default_max_bytes() if args.max_bytes is None else (args.max_bytes or None)
    failures, checked = _deepspeed.problems(args.path, limit)
    ok = not failures
    if args.json:
        print_json({"path": args.path, "layout": "deepspeed", "ok": ok, "files": checked, "failures": failures})
    else:
        console = stdout_console()
        for f in failures:
            where = "" if f["file"] in f["error"] else f"{f['file']}: "
            console.print(f"FAILED {where}{f['error']}", markup=False, highlight=False)
        if ok and not args.quiet:
            tags = len(_deepspeed.tags_of(args.path))
            console.print(
                f"OK {args.path}: DeepSpeed checkpoint, {_count(tags, 'tag')}, {_count(checked, 'file')} verified",
                markup=False,
                highlight=False,
            )
        elif not ok:
            console.print(
                f"FAILED {args.path}: {_count(len(failures), 'problem')} in {_count(checked, 'file')}",
                markup=False,
                highlight=False,
            )
    return EXIT_OK if ok else EXIT_FAILED


def run_verify(args: argparse.Namespace) -> int:
    kind = sniff(args.path)
    if kind == DIRECTORY and _deepspeed.is_deepspeed_dir(args.path):
        return _run_verify_deepspeed(args)
    reporter = Reporter(args.quiet)
    stale: list[str] = []
    extra: list[dict[str, Any]] = []
    dcp_kind = None
    uncommitted: list[dict[str, Any]] = []
    if kind == DIRECTORY and _dcp.is_dcp_dir(args.path):
        try:
            dcp_kind = _dcp.dcp_kind(args.path)
        except CheckpointError as exc:  # a save without collectives that a rank never committed
            uncommitted = [{"file": args.path, "tensor": None, "error": str(exc)}]
    elif kind == DIRECTORY and _dcp.uncommitted_save(args.path):  # rank files, no .metadata: a killed save
        uncommitted = [{"file": args.path, "tensor": None, "error": _dcp.uncommitted_save(args.path)}]
    if dcp_kind == _dcp.DCP_PLAIN:
        # No checksums in plain rank files: every item is read and decoded as DCP's reader would.
        paths = []
        extra = _dcp.verify_plain_dcp(args.path, max_bytes=getattr(args, "max_bytes", None))
    elif kind == DIRECTORY:
        stale = [p for d, _, _ in os.walk(args.path) for p in stale_temp_files(d)]
        paths = [os.path.join(args.path, rel) for rel, k in dir_files(args.path) if k == NVCOMP]
        if dcp_kind == _dcp.DCP_OURS:
            extra = _dcp.verify_ours_dcp(args.path, verified=paths, max_bytes=getattr(args, "max_bytes", None))
        extra = uncommitted + extra
        if not paths and not extra:
            raise FormatError(f"{args.path}: holds no nvcomp-checkpoint files to verify (convert it with `nvckpt compress`)")
    elif kind == NVCOMP:
        # A delta is checked with every base of its chain (each one's identity, then its bytes).
        links = describe_chain(args.path)
        paths = [link["path"] for link in links if not link["error"]]
        chain_failures = [{"file": link["path"], "tensor": None, "error": link["error"]} for link in links if link["error"]]
    else:
        what = {TORCH: "a plain torch.save file", SAFETENSORS: "a safetensors file"}.get(kind, "not a checkpoint nvckpt reads")
        raise FormatError(
            f"{args.path}: not an nvcomp-checkpoint file ({what}); verify checks the checksums of files written by "
            "nvcomp-checkpoint (convert it with `nvckpt compress`)"
        )
    limit = default_max_bytes() if args.max_bytes is None else (args.max_bytes or None)
    results = [verify_file(p, reporter, limit, f"{i}/{len(paths)}" if len(paths) > 1 else "") for i, p in enumerate(paths, 1)]
    failures = (
        [dict(f, file=r["file"]) for r in results for f in r["failures"]] + extra + (chain_failures if kind == NVCOMP else [])
    )
    tensors = sum(r["tensors"] for r in results)
    raw = sum(r["raw_bytes"] for r in results)
    if dcp_kind == _dcp.DCP_PLAIN:
        described = _dcp.describe_dcp(args.path)
        tensors = sum(f["items"] for f in described["files"])
        raw = sum(f["raw_bytes"] for f in described["files"])
        results = described["files"]
    ok = not failures
    if args.json:
        print_json(
            {
                "path": args.path,
                "ok": ok,
                "files": len(results),
                "tensors": tensors,
                "raw_bytes": raw,
                "failures": failures,
                "stale_temp_files": [{"file": p, "bytes": _size(p)} for p in stale],
            }
        )
    else:
        console = stdout_console()
        for p in stale:
            console.print(
                f"NOTE {p}: temporary file of a killed save ({format_bytes(_size(p))}); the next save into "
                "this directory removes it",
                markup=False,
                highlight=False,
            )
        for f in failures:
            # The reader's messages name the file and the tensor; add them only where they do not.
            named = f["file"] in f["error"] and (f["tensor"] is None or repr(f["tensor"]) in f["error"])
            where = "" if named else f"{f['file']}: " + (f"tensor {f['tensor']!r}: " if f["tensor"] is not None else "")
            console.print(f"FAILED {where}{f['error']}", markup=False, highlight=False)
        files = f"{_count(len(results), 'file')}, " if kind == DIRECTORY else ""
        if dcp_kind == _dcp.DCP_PLAIN:
            files = f"plain DCP (no checksums: structure and decoding checked), {files}"
        if ok:
            if not args.quiet:
                console.print(
                    f"OK {args.path}: {files}{_count(tensors, 'tensor')} ({format_bytes(raw)}) verified",
                    markup=False,
                    highlight=False,
                )
        else:
            bad = len({(f["file"], f["tensor"]) for f in failures})
            unreadable = [r["file"] for r in results if r.get("unreadable")]
            if kind == NVCOMP and links[0]["error"]:  # the file itself could not be opened to follow its chain
                unreadable.append(args.path)
            if unreadable == [args.path]:
                summary = "the file is unreadable (its index cannot be read), so no tensor was checked"
            else:
                summary = f"{_count(bad, 'problem')} in {files}{_count(tensors, 'tensor')}"
                if unreadable:
                    summary += f"; unreadable: {', '.join(unreadable)}"
            console.print(f"FAILED {args.path}: {summary}", markup=False, highlight=False)
    return EXIT_OK if ok else EXIT_FAILED


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # removed meanwhile by a save
        return 0
