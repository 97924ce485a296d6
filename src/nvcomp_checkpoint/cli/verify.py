"""``nvckpt verify``: every checksum checked and every chunk decoded, the failing tensors named.

Exit code 0 when everything decodes, 1 when anything is corrupt or cannot be decoded here, 2 when
the path is not one of our files (see ``docs/cli.md``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, CodecUnavailableError, FormatError
from nvcomp_checkpoint.report import format_bytes

from ._ui import EXIT_FAILED, EXIT_OK, Reporter, print_json, stdout_console
from .chain import describe_chain
from .sources import DIRECTORY, NVCOMP, TORCH, SAFETENSORS, dir_files, sniff

__all__ = ["add_parser", "run_verify", "verify_file"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[common],
        help="check every checksum and decode every chunk; non-zero exit on any problem",
        description=(
            "Check the index, the object tree and every chunk of every tensor (checksum, then a full decode). "
            "Exit code 0: all good; 1: something is corrupt (the tensor is named); 2: not a checkpoint of ours. "
            "A directory made by `nvckpt compress` has each of its .nvc files verified."
        ),
    )
    p.add_argument("path", help="nvcomp-checkpoint file, or a directory of them")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_verify)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def verify_file(path: str, reporter: Reporter) -> dict[str, Any]:
    """Verify one file; returns ``{file, tensors, raw_bytes, failures: [{tensor, error}]}``."""
    result: dict[str, Any] = {"file": path, "tensors": 0, "raw_bytes": 0, "failures": []}
    try:
        reader = nc.open(path)
    except FormatError as exc:
        # The file starts with our magic (checked by the caller), so this is damage, not a mistake.
        result["failures"].append({"tensor": None, "error": _one_line(exc)})
        return result
    with reader:
        entries = reader.index.tensors
        result["tensors"] = len(entries)
        result["raw_bytes"] = reader.raw_bytes
        task = reporter.start(f"verifying {os.path.basename(path)}", reader.raw_bytes)
        try:
            for entry, error in reader.verify():
                task.advance(entry.nbytes)
                if error is not None:
                    message = _one_line(error)
                    if isinstance(error, CodecUnavailableError):
                        message = f"cannot be decoded on this machine: {message}"
                    result["failures"].append({"tensor": entry.key, "error": message})
        except CheckpointError as exc:  # the object tree's frame is checked before any tensor
            result["failures"].append({"tensor": None, "error": _one_line(exc)})
        finally:
            reporter.stop()
    return result


def run_verify(args: argparse.Namespace) -> int:
    kind = sniff(args.path)
    reporter = Reporter(args.quiet)
    if kind == DIRECTORY:
        paths = [os.path.join(args.path, rel) for rel, k in dir_files(args.path) if k == NVCOMP]
        if not paths:
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
    results = [verify_file(p, reporter) for p in paths]
    failures = [dict(f, file=r["file"]) for r in results for f in r["failures"]] + (chain_failures if kind == NVCOMP else [])
    tensors = sum(r["tensors"] for r in results)
    raw = sum(r["raw_bytes"] for r in results)
    ok = not failures
    if args.json:
        print_json({"path": args.path, "ok": ok, "files": len(results), "tensors": tensors, "raw_bytes": raw, "failures": failures})
    else:
        console = stdout_console()
        for f in failures:
            # The reader's messages name the file and the tensor; add them only where they do not.
            named = f["file"] in f["error"] and (f["tensor"] is None or repr(f["tensor"]) in f["error"])
            where = "" if named else f"{f['file']}: " + (f"tensor {f['tensor']!r}: " if f["tensor"] is not None else "")
            console.print(f"FAILED {where}{f['error']}", markup=False, highlight=False)
        files = f"{len(results)} files, " if kind == DIRECTORY else ""
        if ok:
            if not args.quiet:
                console.print(f"OK {args.path}: {files}{tensors} tensor{'s' if tensors != 1 else ''} ({format_bytes(raw)}) verified", markup=False, highlight=False)
        else:
            bad = len({(f["file"], f["tensor"]) for f in failures})
            console.print(f"FAILED {args.path}: {bad} problem(s) in {files}{tensors} tensors", markup=False, highlight=False)
    return EXIT_OK if ok else EXIT_FAILED
