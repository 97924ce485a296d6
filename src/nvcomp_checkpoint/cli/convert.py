"""``nvckpt compress`` and ``nvckpt decompress``: plain checkpoints into ours and back.

Single files convert to single files; a checkpoint directory (HF ``checkpoint-N/``, Accelerate
``save_state``) converts file by file into a directory of the same layout (see ``docs/cli.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.dirstore import DirectoryStore, sync_tree
from nvcomp_checkpoint.errors import CheckpointError, FormatError, UnsafeCheckpointError
from nvcomp_checkpoint.format.layout import SAVE_METADATA_KEYS
from nvcomp_checkpoint.report import component_rows, format_bytes, overhead_note
from nvcomp_checkpoint.storage import LOCAL, file_mode_of, is_url, storage_for, write_errors

from . import _dcp, _deepspeed, _policy
from ._ui import EXIT_OK, Reporter, check_workers, make_table, print_json, stdout_console
from .sources import (
    DIRECTORY,
    NVC_SUFFIX,
    NVCOMP,
    SAFETENSORS,
    TORCH,
    dir_files,
    iter_tensors,
    open_source,
    require_safetensors,
    sniff,
)

__all__ = ["add_parsers", "run_compress", "run_decompress"]


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "compress",
        parents=[common],
        help="convert a torch.save / Lightning / safetensors checkpoint (or an HF checkpoint directory) into ours",
        description=(
            "Convert SRC into an nvcomp-checkpoint file (or, for a directory, a directory where every "
            "tensor file FILE becomes FILE.nvc and every other file is copied). SRC may also be one of "
            "our files, to re-compress it with another policy."
        ),
    )
    p.add_argument("src", help="checkpoint file or directory to convert")
    p.add_argument(
        "dst",
        nargs="?",
        help="output file (or directory when SRC is a directory); a DeepSpeed folder without DST is converted in place",
    )
    p.add_argument(
        "--policy",
        help="codec policy: a JSON file or inline JSON of CodecPolicy.to_dict() form (a `bench --json` "
        "output works too), or a shorthand CODEC[:LEVEL][:FILTER] such as zstd, zstd:3, zstd:1:none",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where compression runs (overrides the policy's device)")
    p.add_argument("--workers", type=int, help="compression threads (default: every core)")
    p.add_argument(
        "--trust", action="store_true", help="load pickled Python objects (weights_only=False); only for files you trust"
    )
    p.add_argument("-f", "--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print the save report as JSON")
    p.add_argument(
        "--base",
        help="an earlier nvcomp-checkpoint file of the same run: write DST as a delta of it (loading DST then needs BASE "
        "at the same relative path; `nvckpt rebase` makes a full copy)",
    )
    p.set_defaults(func=run_compress)

    d = sub.add_parser(
        "decompress",
        parents=[common],
        help="convert one of our files (or directories) back into plain torch.save or safetensors",
        description=(
            "Write SRC back as a plain torch.save file (or a .safetensors file for weights that came from "
            "one), so any tool reads it. A directory made by `compress` becomes the original layout again."
        ),
    )
    d.add_argument("src", help="nvcomp-checkpoint file, or a directory made by `nvckpt compress`")
    d.add_argument("dst", nargs="?", help="output file or directory; a DeepSpeed folder without DST is converted in place")
    d.add_argument(
        "--to",
        choices=["auto", "torch", "safetensors"],
        default="auto",
        help="output format (auto: safetensors when the source was safetensors or DST ends in .safetensors, else torch.save)",
    )
    d.add_argument("--trust", action="store_true", help="allow pickled Python objects in the tree (weights_only=False)")
    d.add_argument("-f", "--force", action="store_true", help="replace DST if it exists")
    d.add_argument("--json", action="store_true", help="print what was written as JSON")
    d.set_defaults(func=run_decompress)


# -- helpers --------------------------------------------------------------------------------
def _check_dst(src: str, dst: str, force: bool) -> None:
    if not is_url(src) and not is_url(dst) and os.path.exists(dst) and os.path.exists(src) and os.path.samefile(src, dst):
        raise CheckpointError(f"{dst}: is the source itself; write to another path")
    if not is_url(dst) and os.path.isdir(dst) and not os.path.isdir(src):
        raise CheckpointError(f"{dst}: is a directory; give the output file's name")
    storage, spath = storage_for(dst)
    if storage.exists(spath) and not force:
        raise CheckpointError(f"{dst}: already exists; pass --force to replace it")


def _policy_from(args: argparse.Namespace) -> nc.CodecPolicy:
    policy = _policy.parse_policy(args.policy)
    if args.device:
        policy = policy.with_overrides(device=args.device)
    _policy.check_policy_runs_here(policy)
    return policy


def _tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(tree))


def _save_metadata(kind: str, src: str, source_meta: dict[str, Any]) -> dict[str, Any]:
    if kind == NVCOMP:
        return {k: v for k, v in source_meta.items() if k not in SAVE_METADATA_KEYS}
    meta: dict[str, Any] = {"source_format": kind, "source_file": os.path.basename(src.rstrip("/"))}
    if kind == SAFETENSORS and source_meta:
        meta["safetensors_metadata"] = dict(source_meta)
    return meta


def _compress_file(
    src: str, dst: str, policy: nc.CodecPolicy, args: argparse.Namespace, reporter: Reporter
) -> tuple[nc.SaveReport, str]:
    with open_source(src, trust=args.trust) as source:
        reporter.start(f"reading {os.path.basename(src)}")
        tree = source.load()
        meta = _save_metadata(source.kind, src, source.metadata)
        kind = source.kind
        task = reporter.start(f"compressing {os.path.basename(src)}", _tensor_bytes(tree))
        try:
            report = nc.save(
                tree,
                dst,
                policy,
                metadata=meta,
                workers=args.workers,
                progress=task.advance,
                base=getattr(args, "base", None),
                file_mode=file_mode_of(src),
            )
        finally:
            reporter.stop()
    return report, kind


@contextlib.contextmanager
def _open_output(dst: str, mode: int | None = None) -> Iterator[IO[bytes]]:
    """A stream whose bytes appear at ``dst`` (with permission bits ``mode``) only when the block succeeds;
    a failure names ``dst``, not the hidden temporary file the bytes go to first (as ``nc.save`` does)."""
    storage, spath = storage_for(dst)
    with write_errors(dst, "writing it"):
        with storage.open_write(spath, mode=mode) as f:
            yield f


def _write_torch(tree: Any, dst: str, mode: int | None = None) -> None:
    with _open_output(dst, mode) as f:
        torch.save(tree, f)


def _overlapping(tensors: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """Two tensors whose bytes overlap in memory (tied weights, views), or ``None``.

    safetensors refuses them; views of one storage that do not overlap are fine.
    """
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k) for k, t in tensors.items() if t.numel()
    )
    device, end, owner = None, 0, ""
    for dev, begin, stop, key in spans:
        if dev == device and begin < end:
            return owner, key
        if dev != device or stop > end:
            device, end, owner = dev, stop, key
    return None


def _write_safetensors(tree: Any, dst: str, metadata: dict[str, str] | None, where: str, mode: int | None = None) -> None:
    st = require_safetensors()
    if not isinstance(tree, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tree.items()):
        raise CheckpointError(
            f"{where}: safetensors holds a flat {{name: tensor}} dict and this checkpoint is a nested tree "
            "(optimizer state, step counters ...); decompress it with --to torch to a .pt file"
        )
    tensors = {k: v.detach().contiguous() for k, v in tree.items()}
    shared = _overlapping(tensors)
    if shared:
        raise CheckpointError(
            f"{where}: tensors {shared[0]!r} and {shared[1]!r} share memory (tied weights or views of one tensor), "
            "and a safetensors file cannot hold tensors that share memory; decompress it with --to torch to a .pt "
            "file, which keeps them shared"
        )
    with _open_output(dst, mode) as f:
        f.write(st.save(tensors, metadata=metadata or None))


def _decompress_file(src: str, dst: str, to: str, trust: bool, reporter: Reporter) -> tuple[str, int, int]:
    """Returns (format written, raw tensor bytes, bytes written)."""
    kind = sniff(src)
    if kind != NVCOMP:
        what = {TORCH: "a plain torch.save file", SAFETENSORS: "a safetensors file"}.get(kind, "not a checkpoint nvckpt reads")
        raise FormatError(f"{src}: not an nvcomp-checkpoint file ({what}); there is nothing to decompress")
    with nc.open(src) as reader:
        meta = reader.metadata
        raw = reader.raw_bytes
    if to == "auto":
        to = "safetensors" if meta.get("source_format") == SAFETENSORS or dst.endswith(".safetensors") else "torch"
    reporter.start(f"decompressing {os.path.basename(src)}")
    try:
        tree = nc.load(src, weights_only=not trust)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc} (nvckpt: pass --trust)") from exc
    reporter.start(f"writing {os.path.basename(dst)}")
    try:
        if to == "safetensors":
            _write_safetensors(tree, dst, meta.get("safetensors_metadata"), src, file_mode_of(src))
        else:
            _write_torch(tree, dst, file_mode_of(src))
    finally:
        reporter.stop()
    storage, spath = storage_for(dst)
    return to, raw, storage.size(spath)


# -- directories ----------------------------------------------------------------------------
#: Directories converted by nvckpt are committed as a whole, as Accelerate's are (no manifest).
_DIRS = DirectoryStore("nvcomp_checkpoint.json", "nvcomp-checkpoint/converted-directory")


def _tmp_dir_for(dst: str) -> Path:
    target = Path(os.path.abspath(dst))
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a directory; choose another output path")
    LOCAL.makedirs(os.fspath(target.parent))
    _DIRS.recover(target)  # a replacement that crashed between its two renames
    return _DIRS.fresh(_DIRS.staging_path(target))


def _commit_dir(tmp: Path, dst: str) -> None:
    # Every file durable first; then the directory appears complete or not at all, and a replaced
    # one is removed only after the new one is in place (put back if that fails).
    sync_tree(tmp)
    replaced = _DIRS.commit(tmp, Path(os.path.abspath(dst)))
    if replaced is not None:
        LOCAL.remove(os.fspath(replaced))


def _check_dst_dir(src: str, dst: str, force: bool) -> None:
    if is_url(dst):
        raise CheckpointError(f"{dst}: directories are converted to local paths only")
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise CheckpointError(f"{dst}: is the source itself; write to another directory")
    if os.path.exists(dst) and not force:
        raise CheckpointError(f"{dst}: already exists; pass --force to replace it")


_ConvertOne = Callable[[str, str, str, Path], dict[str, Any]]


def _convert_dir(src: str, dst: str, force: bool, what: str, convert_one: _ConvertOne) -> list[dict[str, Any]]:
    """Convert every file of ``src`` into a staging directory with ``convert_one(rel, kind,
    in_path, staging)``, then put the staging directory at ``dst`` in one rename."""
    _check_dst_dir(src, dst, force)
    files = dir_files(src)
    if not files:
        raise CheckpointError(f"{src}: the directory is empty; nothing to {what}")
    tmp = _tmp_dir_for(dst)
    rows: list[dict[str, Any]] = []
    try:
        for rel, kind in files:
            rows.append(convert_one(rel, kind, os.path.join(src, rel), tmp))
        _commit_dir(tmp, dst)
    except BaseException:
        LOCAL.remove(os.fspath(tmp))
        raise
    return rows


def _copy_file(rel: str, kind: str, in_path: str, tmp: Path, note: str = "") -> dict[str, Any]:
    """Files that are not converted (configs, tokenizer files, trainer_state.json, pickles we
    may not load) are kept byte for byte."""
    out_path = tmp / rel
    LOCAL.makedirs(os.fspath(out_path.parent))
    LOCAL.copy(in_path, os.fspath(out_path))
    size = os.path.getsize(in_path)
    return {
        "file": rel,
        "action": "copied",
        "output": rel,
        "format": kind,
        "input_bytes": size,
        "output_bytes": size,
        "note": note,
    }


def _compress_dir(
    src: str, dst: str, policy: nc.CodecPolicy, args: argparse.Namespace, reporter: Reporter
) -> list[dict[str, Any]]:
    def compress_one(rel: str, kind: str, in_path: str, tmp: Path) -> dict[str, Any]:
        tree = None
        note = ""
        if kind in (TORCH, SAFETENSORS):
            try:
                with open_source(in_path, trust=args.trust) as source:
                    tree = source.load()
                    meta = _save_metadata(kind, in_path, source.metadata)
            except UnsafeCheckpointError:
                note = "holds Python objects; --trust converts it"
            if tree is not None and not any(True for _ in iter_tensors(tree)):
                tree, note = None, "no tensors"
        if tree is None:
            return _copy_file(rel, kind, in_path, tmp, note)
        size = os.path.getsize(in_path)
        out_rel = rel + NVC_SUFFIX
        out_path = tmp / out_rel
        LOCAL.makedirs(os.fspath(out_path.parent))
        task = reporter.start(f"compressing {rel}", _tensor_bytes(tree))
        report = nc.save(
            tree,
            str(out_path),
            policy,
            metadata=meta,
            workers=args.workers,
            progress=task.advance,
            file_mode=file_mode_of(in_path),
        )
        reporter.stop()
        return {
            "file": rel,
            "format": kind,
            "input_bytes": size,
            "action": "compressed",
            "output": out_rel,
            "raw_bytes": report.raw_bytes,
            "output_bytes": report.stored_bytes,
            "ratio": round(size / report.stored_bytes, 4) if report.stored_bytes else 1.0,
            "components": {k: v.to_dict() for k, v in report.components.items()},
        }

    return _convert_dir(src, dst, args.force, "compress", compress_one)


def _decompress_one(rel: str, kind: str, in_path: str, tmp: Path, args: argparse.Namespace, reporter: Reporter) -> dict[str, Any]:
    """One file of a directory: ours decompressed (``FILE.nvc`` back to ``FILE``), any other copied."""
    if kind != NVCOMP:
        return _copy_file(rel, kind, in_path, tmp)
    out_rel = rel[: -len(NVC_SUFFIX)] if rel.endswith(NVC_SUFFIX) else rel
    out_path = tmp / out_rel
    LOCAL.makedirs(os.fspath(out_path.parent))
    to = "safetensors" if out_rel.endswith(".safetensors") else args.to
    fmt, raw, written = _decompress_file(in_path, str(out_path), to, args.trust, reporter)
    return {
        "file": rel,
        "action": "decompressed",
        "output": out_rel,
        "format": fmt,
        "input_bytes": os.path.getsize(in_path),
        "raw_bytes": raw,
        "output_bytes": written,
    }


def _decompress_dir(src: str, dst: str, args: argparse.Namespace, reporter: Reporter) -> list[dict[str, Any]]:
    def decompress_one(rel: str, kind: str, in_path: str, tmp: Path) -> dict[str, Any]:
        return _decompress_one(rel, kind, in_path, tmp, args, reporter)

    return _convert_dir(src, dst, args.force, "decompress", decompress_one)


# -- a whole run: checkpoint folders of every kind under one directory -------------------------
def _nested_units(src: str) -> list[tuple[str, str]]:
    """``(relative folder, kind)`` of the DeepSpeed tags and DCP checkpoints under ``src`` (not ``src`` itself):
    their files convert together (a tag's manifest, a DCP checkpoint's metadata), not one by one."""
    units: list[tuple[str, str]] = []
    for folder, subdirs, _ in os.walk(src):
        rel = Path(os.path.relpath(folder, src)).as_posix()
        if rel == ".":
            continue
        if _deepspeed.is_tag_dir(folder):
            units.append((rel, "deepspeed"))
        elif _dcp.is_dcp_dir(folder):
            units.append((rel, "dcp"))
        else:
            continue
        subdirs.clear()
    return units


def _decompress_run(src: str, dst: str, args: argparse.Namespace, reporter: Reporter) -> list[dict[str, Any]]:
    """Every checkpoint under ``src`` to plain files at ``dst`` in one go: a tier, a run's folder of
    checkpoints (files, HF/Accelerate folders, DeepSpeed tags, DCP checkpoints), staged and put at
    ``dst`` in one rename. Files of ours decompress; DeepSpeed tags and DCP checkpoints convert whole."""
    units = dict(_nested_units(src))
    if not units:
        return _decompress_dir(src, dst, args, reporter)

    def unit_of(rel: str) -> str | None:
        parent = Path(rel).parent.as_posix()
        return parent if parent in units else None

    def started(name: str) -> None:
        reporter.start(f"decompressing {name}")

    _check_dst_dir(src, dst, args.force)
    tmp = _tmp_dir_for(dst)
    rows: list[dict[str, Any]] = []
    try:
        for rel, kind in dir_files(src):
            unit = unit_of(rel)
            if unit is None:
                rows.append(_decompress_one(rel, kind, os.path.join(src, rel), tmp, args, reporter))
            elif units[unit] == "deepspeed":
                _copy_file(rel, kind, os.path.join(src, rel), tmp)  # converted in place below, with its tag
        for unit, kind in units.items():
            if kind == "deepspeed":
                unit_rows = _deepspeed.convert_in_place(os.fspath(tmp / unit), False, None, None, started)
                parent = Path(unit).parent.as_posix()  # the rows name "<tag>/<file>"
                above = "" if parent == "." else parent + "/"
                rows.extend(dict(r, file=above + r["file"], output=above + r["output"]) for r in unit_rows)
            elif _dcp.dcp_kind(os.path.join(src, unit)) == _dcp.DCP_OURS:
                started(unit)
                _dcp_decompress_into(os.path.join(src, unit), tmp / unit, args, reporter)
                rows.append(_unit_row(unit, os.path.join(src, unit), tmp / unit))
            else:
                for rel, kind in dir_files(os.path.join(src, unit)):
                    rows.append(_copy_file(f"{unit}/{rel}", kind, os.path.join(src, unit, rel), tmp))
        _commit_dir(tmp, dst)
    except BaseException:
        LOCAL.remove(os.fspath(tmp))
        raise
    finally:
        reporter.stop()
    return rows


#: What ``decompress_directory`` reads and rewrites: the commit record, the rank files and per-rank metadata.
_DCP_WRITTEN = re.compile(r"(__\d+)?\.metadata|__\d+_[0-9a-zA-Z]+\.nvcdcp")


def _dcp_decompress_into(src_unit: str, out: Path, args: argparse.Namespace, reporter: Reporter) -> None:
    """A compressed DCP checkpoint to plain at ``out``; its other files (Lightning's ``meta.pt``) come along."""
    from nvcomp_checkpoint.dcp import decompress_directory

    decompress_directory(src_unit, out)
    for rel, kind in dir_files(src_unit):
        if _DCP_WRITTEN.fullmatch(rel) is None and not (out / rel).exists():
            _decompress_one(rel, kind, os.path.join(src_unit, rel), out, args, reporter)


def _unit_row(unit: str, src_unit: str, out: Path) -> dict[str, Any]:
    size_in = sum(os.path.getsize(os.path.join(src_unit, rel)) for rel, _ in dir_files(src_unit))
    size_out = sum(os.path.getsize(out / rel) for rel, _ in dir_files(os.fspath(out)))
    return {
        "file": unit + "/",
        "action": "decompressed",
        "output": unit + "/",
        "format": "dcp",
        "input_bytes": size_in,
        "output_bytes": size_out,
    }


def _print_dir_rows(title: str, rows: list[dict[str, Any]]) -> None:
    total_in = sum(r["input_bytes"] for r in rows)
    total_out = sum(r["output_bytes"] for r in rows)
    table_rows = [
        [
            r["file"],
            r["action"],
            r["output"],
            format_bytes(r["input_bytes"]),
            format_bytes(r["output_bytes"]),
            f"{r['input_bytes'] / r['output_bytes']:.3f}x" if r["output_bytes"] else "-",
            r.get("note", ""),
        ]
        for r in rows
    ]
    table_rows.append(
        [
            "total",
            "",
            "",
            format_bytes(total_in),
            format_bytes(total_out),
            f"{total_in / total_out:.3f}x" if total_out else "-",
            "",
        ]
    )
    stdout_console().print(
        make_table(title, ["file", "action", "output", "in", "out", "ratio", "note"], table_rows, numeric_from=3)
    )


# -- DCP checkpoint directories -------------------------------------------------------------
def _convert_dcp(args: argparse.Namespace, what: str, policy: nc.CodecPolicy | None = None) -> int:
    """A DCP directory (``.metadata`` inside) converts rank file by rank file through
    :mod:`nvcomp_checkpoint.dcp`, staged and put at DST in one rename as other directories are."""
    from nvcomp_checkpoint.dcp import compress_directory, decompress_directory

    _check_dst_dir(args.src, args.dst, args.force)
    kind = _dcp.dcp_kind(args.src)
    if what == "compress" and kind == _dcp.DCP_OURS and args.policy is None and args.device is None:
        raise CheckpointError(f"{args.src}: already a compressed DCP checkpoint; pass --policy to re-compress it")
    if what == "decompress" and kind == _dcp.DCP_PLAIN:
        raise CheckpointError(f"{args.src}: a plain DCP checkpoint already; nothing to decompress")
    tmp = _tmp_dir_for(args.dst)
    reporter = Reporter(args.quiet)
    try:
        reporter.start(f"{what}ing {args.src}")
        try:
            if what == "decompress":
                decompress_directory(args.src, tmp)
            elif kind == _dcp.DCP_OURS:  # re-compress with another policy: through plain, rank file by rank file
                plain = _DIRS.fresh(_DIRS.staging_path(Path(os.fspath(tmp) + "-plain")))
                try:
                    decompress_directory(args.src, plain)
                    compress_directory(plain, tmp, policy, workers=args.workers)
                finally:
                    LOCAL.remove(os.fspath(plain))
            else:
                compress_directory(args.src, tmp, policy, workers=args.workers)
        finally:
            reporter.stop()
        _commit_dir(tmp, args.dst)
    except BaseException:
        LOCAL.remove(os.fspath(tmp))
        raise
    src_d, dst_d = _dcp.describe_dcp(args.src), _dcp.describe_dcp(args.dst)
    # The converters name the i-th source file (in name order) __<i>_...: pair the rows by that i.
    dst_d["files"].sort(key=lambda f: int(f["file"].split("_")[2]))
    total_in = sum(f["file_bytes"] for f in src_d["files"]) + src_d["metadata_bytes"]
    total_out = sum(f["file_bytes"] for f in dst_d["files"]) + dst_d["metadata_bytes"]
    if args.json:
        print_json(
            {
                "source": args.src,
                "destination": args.dst,
                "layout": "dcp",
                "format": dst_d["format"],
                "input_bytes": total_in,
                "output_bytes": total_out,
                "files": [
                    {"file": a["file"], "output": b["file"], "input_bytes": a["file_bytes"], "output_bytes": b["file_bytes"]}
                    for a, b in zip(src_d["files"], dst_d["files"])
                ],
            }
        )
    elif not args.quiet:
        rows = [
            [
                a["file"],
                what + "ed",
                b["file"],
                format_bytes(a["file_bytes"]),
                format_bytes(b["file_bytes"]),
                f"{a['file_bytes'] / b['file_bytes']:.3f}x" if b["file_bytes"] else "-",
                "",
            ]
            for a, b in zip(src_d["files"], dst_d["files"])
        ]
        rows.append(
            [
                "total",
                "",
                "",
                format_bytes(total_in),
                format_bytes(total_out),
                f"{total_in / total_out:.3f}x" if total_out else "-",
                "DCP checkpoint"
                + (", loads with nvcomp_checkpoint.dcp.NvcompReader" if dst_d["format"] == _dcp.DCP_OURS else ""),
            ]
        )
        stdout_console().print(
            make_table(
                f"{args.src} -> {args.dst}", ["file", "action", "output", "in", "out", "ratio", "note"], rows, numeric_from=3
            )
        )
    return EXIT_OK


# -- DeepSpeed checkpoint folders -------------------------------------------------------------
def _convert_deepspeed(args: argparse.Namespace, what: str, policy: nc.CodecPolicy | None = None) -> int:
    """A DeepSpeed folder (tags, ``latest``) converts tag by tag, file by file: in place without DST,
    else into a copy staged next to DST and put there in one rename."""
    reporter = Reporter(args.quiet)
    to_ours = what == "compress"

    def started(name: str) -> None:
        reporter.start(f"{what}ing {name}")

    try:
        if args.dst is None or (os.path.exists(args.dst) and os.path.samefile(args.src, args.dst)):
            rows = _deepspeed.convert_in_place(args.src, to_ours, policy, getattr(args, "workers", None), started)
        else:
            _check_dst_dir(args.src, args.dst, args.force)
            tmp = _tmp_dir_for(args.dst)
            try:
                for rel, kind in dir_files(args.src):
                    _copy_file(rel, kind, os.path.join(args.src, rel), tmp)
                rows = _deepspeed.convert_in_place(os.fspath(tmp), to_ours, policy, getattr(args, "workers", None), started)
                _commit_dir(tmp, args.dst)
            except BaseException:
                LOCAL.remove(os.fspath(tmp))
                raise
    finally:
        reporter.stop()
    if args.json:
        print_json({"source": args.src, "destination": args.dst or args.src, "layout": "deepspeed", "files": rows})
    elif not args.quiet:
        _print_dir_rows(f"{args.src} -> {args.dst or args.src} (DeepSpeed)", rows)
    return EXIT_OK


def _need_dst(args: argparse.Namespace) -> None:
    if args.dst is None:
        raise CheckpointError(f"{args.src}: give the output path (DST); only a DeepSpeed folder is converted in place")


# -- commands -------------------------------------------------------------------------------
def run_compress(args: argparse.Namespace) -> int:
    # Every option is checked before any input is read: a typo fails in a second, not after a 100 GB load.
    check_workers(args.workers)
    policy = _policy_from(args)
    reporter = Reporter(args.quiet)
    kind = sniff(args.src)
    if kind == DIRECTORY and args.base:
        raise CheckpointError(f"{args.src}: --base takes single files; compress a directory without it")
    if kind == DIRECTORY and _deepspeed.is_deepspeed_dir(args.src):
        return _convert_deepspeed(args, "compress", policy)
    _need_dst(args)
    if kind == DIRECTORY and _dcp.is_dcp_dir(args.src):
        return _convert_dcp(args, "compress", policy)
    if args.base and sniff(args.base) != NVCOMP:
        raise FormatError(f"{args.base}: --base must be an nvcomp-checkpoint file (compress it first)")
    if kind == DIRECTORY:
        rows = _compress_dir(args.src, args.dst, policy, args, reporter)
        if args.json:
            print_json(
                {
                    "source": args.src,
                    "destination": args.dst,
                    "layout": "directory",
                    "files": rows,
                    "input_bytes": sum(r["input_bytes"] for r in rows),
                    "output_bytes": sum(r["output_bytes"] for r in rows),
                }
            )
        elif not args.quiet:
            _print_dir_rows(f"{args.src} -> {args.dst}", rows)
        return EXIT_OK
    _check_dst(args.src, args.dst, args.force)
    report, src_kind = _compress_file(args.src, args.dst, policy, args, reporter)
    if args.json:
        out = report.to_dict()
        out.update(source=args.src, source_format=src_kind, policy=policy.to_dict())
        print_json(out)
    elif not args.quiet:
        console = stdout_console()
        console.print(str(report), markup=False, highlight=False)
        console.print(
            make_table(
                None,
                ["component", "tensors", "raw", "stored", "ratio", "codec", "filter"],
                component_rows(report.components, report.raw_bytes, report.stored_bytes),
            )
        )
        note = overhead_note(report.components, report.raw_bytes, report.stored_bytes)
        if note:
            console.print(note, markup=False, highlight=False)
    return EXIT_OK


def run_decompress(args: argparse.Namespace) -> int:
    reporter = Reporter(args.quiet)
    if sniff(args.src) == DIRECTORY and _deepspeed.is_deepspeed_dir(args.src):
        return _convert_deepspeed(args, "decompress")
    _need_dst(args)
    if sniff(args.src) == DIRECTORY and _dcp.is_dcp_dir(args.src):
        return _convert_dcp(args, "decompress")
    if sniff(args.src) == DIRECTORY:
        rows = _decompress_run(args.src, args.dst, args, reporter)
        if args.json:
            print_json({"source": args.src, "destination": args.dst, "layout": "directory", "files": rows})
        elif not args.quiet:
            _print_dir_rows(f"{args.src} -> {args.dst}", rows)
        return EXIT_OK
    _check_dst(args.src, args.dst, args.force)
    fmt, raw, written = _decompress_file(args.src, args.dst, args.to, args.trust, reporter)
    if args.json:
        print_json({"source": args.src, "destination": args.dst, "format": fmt, "raw_bytes": raw, "output_bytes": written})
    elif not args.quiet:
        stdout_console().print(
            f"{args.src} -> {args.dst} ({fmt}): {format_bytes(raw)} of tensors, {format_bytes(written)} written",
            markup=False,
            highlight=False,
        )
    return EXIT_OK
