"""``nvckpt inspect``: what a checkpoint holds, as a tree and a per-component table.

Reads only the index of our files and the header of safetensors files; ``torch.save`` files are
memory-mapped, so inspecting a large checkpoint reads little of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from datetime import datetime, timezone
from typing import Any

from rich.text import Text
from rich.tree import Tree

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, UnsafeCheckpointError
from nvcomp_checkpoint.report import COMPONENT_COLUMNS, codec_notes, component_rows, format_bytes, overhead_note
from nvcomp_checkpoint.storage import stale_temp_files

from . import _dcp, _deepspeed
from ._ui import EXIT_OK, make_table, print_json, stdout_console
from .chain import chain_text, describe_chain
from .sources import DIRECTORY, NVCOMP, OTHER, TensorInfo, dir_files, open_source, sniff

__all__ = ["add_parser", "run_inspect", "component_stats", "build_tree"]

#: With more tensors than this, the tree is cut at :data:`_AUTO_DEPTH` levels unless --depth says otherwise.
_AUTO_FULL_TREE = 100
_AUTO_DEPTH = 3


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show a checkpoint's tensors and per-component sizes, ratios and codecs",
        description=(
            "Show the tensor tree and a per-component table (tensors, raw size, stored size, ratio, codec, "
            "filter) of an nvcomp-checkpoint file, a torch.save / Lightning .ckpt file, a .safetensors file "
            "(sizes only) or a checkpoint directory."
        ),
    )
    p.add_argument("path", help="checkpoint file or directory")
    p.add_argument("--json", action="store_true", help="print everything as JSON (every tensor included)")
    p.add_argument(
        "--depth",
        type=int,
        help=f"tree levels to expand (0: all; default: all up to {_AUTO_FULL_TREE} tensors, else {_AUTO_DEPTH})",
    )
    p.add_argument("--no-tree", action="store_true", help="print only the tables")
    p.add_argument(
        "--trust",
        action="store_true",
        help="load pickled Python objects in torch.save files (weights_only=False); only for files you trust",
    )
    p.set_defaults(func=run_inspect)


def component_stats(tensors: list[TensorInfo]) -> dict[str, nc.ComponentStats]:
    """Per-component totals, in the canonical component order."""
    stats: dict[str, nc.ComponentStats] = {}
    for t in tensors:
        stats[t.component] = stats.get(t.component, nc.ComponentStats()).add(t.raw_bytes, t.stored_bytes, t.codec, t.filter)
    order = [c.value for c in nc.Component]
    return {k: stats[k] for k in sorted(stats, key=lambda k: order.index(k) if k in order else len(order))}


def _leaf_label(name: str, t: TensorInfo, compressed: bool) -> str:
    shape = "x".join(map(str, t.shape)) if t.shape else "scalar"
    label = f"{name}  {t.dtype}[{shape}]  {format_bytes(t.raw_bytes)}"
    if compressed:
        ratio = t.raw_bytes / t.stored_bytes if t.stored_bytes else 1.0
        label += f" -> {format_bytes(t.stored_bytes)} ({ratio:.2f}x {t.codec}/{t.filter})"
    return label + f"  [{t.component}]"


def build_tree(title: str, tensors: list[TensorInfo], depth: int | None, compressed: bool) -> Tree:
    """A rich tree of tensor keys; subtrees deeper than ``depth`` are summarized on one line."""
    if depth is None:
        depth = 0 if len(tensors) <= _AUTO_FULL_TREE else _AUTO_DEPTH
    nested: dict[str, Any] = {}
    for t in tensors:
        node = nested
        parts = t.key.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part + "/", {})
        node[parts[-1]] = t

    def totals(node: dict[str, Any]) -> tuple[int, int, int]:
        n = raw = stored = 0
        for v in node.values():
            if isinstance(v, TensorInfo):
                n, raw, stored = n + 1, raw + v.raw_bytes, stored + v.stored_bytes
            else:
                a, b, c = totals(v)
                n, raw, stored = n + a, raw + b, stored + c
        return n, raw, stored

    def add(branch: Tree, node: dict[str, Any], level: int) -> None:
        for name, v in node.items():
            if isinstance(v, TensorInfo):
                branch.add(Text(_leaf_label(name, v, compressed), overflow="fold"))
                continue
            n, raw, stored = totals(v)
            summary = f"{name}  ({n} tensor{'s' if n != 1 else ''}, {format_bytes(raw)}"
            summary += f" -> {format_bytes(stored)})" if compressed else ")"
            child = branch.add(Text(summary, overflow="fold"))
            if depth == 0 or level + 1 < depth:
                add(child, v, level + 1)

    tree = Tree(Text(title, overflow="fold"))
    add(tree, nested, 0)
    return tree


#: Longest text shown for one value read from a file (a key, a codec level, a metadata value).
_SHOWN_CHARS = 200


def _shown(value: Any) -> str:
    """``value`` as one line of at most :data:`_SHOWN_CHARS` printable characters, whatever it is.

    Everything inspect prints from a file passes here: a forged index may hold control
    characters (terminal escapes), megabytes of text or values no formatter expects.
    """
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # noqa: BLE001 - a value no repr handles is still shown as what it is
        text = f"<{type(value).__name__}>"
    if len(text) > _SHOWN_CHARS:
        text = text[: _SHOWN_CHARS - 3] + "..."
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _shown_info(t: TensorInfo) -> TensorInfo:
    # Part by part, so that the tree keeps its shape.
    key = "/".join(_shown(part) for part in t.key.split("/"))
    return dataclasses.replace(t, key=key, component=_shown(t.component), codec=_shown(t.codec), filter=_shown(t.filter))


def _describe_file(path: str, trust: bool) -> dict[str, Any]:
    """Everything inspect reports about one file, JSON-safe (``_infos``/``_stats``: as printed)."""
    with open_source(path, trust=trust) as source:
        tensors = source.tensors()
        shown = [_shown_info(t) for t in tensors]
        stats = component_stats(tensors)
        raw = sum(t.raw_bytes for t in tensors)
        gpu_only = sorted({t.codec.split(":")[0] for t in tensors} & set(nc.GPU_ONLY_CODECS))
        return {
            "path": path,
            "format": source.kind,
            "file_bytes": source.file_bytes,
            "raw_bytes": raw,
            "ratio": round(raw / source.file_bytes, 4) if source.file_bytes else 1.0,
            "components": {k: v.to_dict() for k, v in stats.items()},
            "tensors": [t.to_dict() for t in tensors],
            "metadata": source.metadata,
            # A delta checkpoint's chain of bases (cli/chain.py); [] for other files.
            "chain": describe_chain(path) if source.kind == NVCOMP and _is_delta(path) else [],
            # Whether the file loads on a machine without a GPU (no nvCOMP-only codec in it).
            "portable": not gpu_only,
            "gpu_only_codecs": gpu_only,
            "_infos": shown,
            "_stats": component_stats(shown),
        }


def _is_delta(path: str) -> bool:
    with nc.open(path) as reader:
        return reader.index.base is not None


def _meta_value(key: str, value: Any) -> str:
    if key == "created" and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        except (OverflowError, ValueError, OSError):
            pass  # not a time a calendar holds (1e300): shown as the number it is
    return _shown(value)


def _public(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _inspect_dir(args: argparse.Namespace) -> dict[str, Any]:
    files: list[dict[str, Any]] = []
    all_infos: list[TensorInfo] = []
    for rel, kind in dir_files(args.path):
        full = os.path.join(args.path, rel)
        size = os.path.getsize(full)
        if kind in (OTHER, DIRECTORY):
            files.append({"file": rel, "format": kind, "file_bytes": size, "raw_bytes": 0, "tensors": 0})
            continue
        try:
            d = _describe_file(full, args.trust)
        except UnsafeCheckpointError:
            files.append(
                {
                    "file": rel,
                    "format": kind,
                    "file_bytes": size,
                    "raw_bytes": None,
                    "tensors": None,
                    "note": "holds Python objects; --trust lists it",
                }
            )
            continue
        all_infos.extend(d["_infos"])
        files.append(
            {
                "file": rel,
                "format": kind,
                "file_bytes": size,
                "raw_bytes": d["raw_bytes"],
                "tensors": len(d["_infos"]),
                "components": d["components"],
                "tensor_list": d["tensors"],
                "metadata": d["metadata"],
            }
        )
    stats = component_stats(all_infos)
    total_file = sum(f["file_bytes"] for f in files)
    raw = sum(t.raw_bytes for t in all_infos)
    stale = []
    for directory, _, _ in os.walk(args.path):
        for p in stale_temp_files(directory):
            try:
                stale.append({"file": os.path.relpath(p, args.path), "file_bytes": os.path.getsize(p)})
            except OSError:
                continue  # removed meanwhile by a save
    return {
        "path": args.path,
        "format": DIRECTORY,
        "file_bytes": total_file,
        "raw_bytes": raw,
        "components": {k: v.to_dict() for k, v in stats.items()},
        "files": files,
        "stale_temp_files": stale,
        "_stats": stats,
    }


def _print_codec_notes(console: Any, stats: dict[str, nc.ComponentStats]) -> None:
    # The codec column names codecs as SaveReport.table() does (``zstd:3``) and says what ``none`` is.
    for note in codec_notes(stats):
        console.print(note, markup=False, highlight=False)


def _run_inspect_dcp(args: argparse.Namespace) -> int:
    # A DCP directory: one row per rank file, components summed over every rank's items.
    d = _dcp.describe_dcp(args.path)
    infos = [_shown_info(t) for t in d.pop("_infos")]
    stats = component_stats(infos)
    raw = sum(t.raw_bytes for t in infos)
    stored = sum(t.stored_bytes for t in infos)
    on_disk = sum(f["file_bytes"] for f in d["files"]) + d["metadata_bytes"]
    if args.json:
        print_json(
            dict(
                d,
                raw_bytes=raw,
                stored_bytes=stored,
                file_bytes=on_disk,
                ratio=round(raw / on_disk, 4) if on_disk else 1.0,
                components={k: v.to_dict() for k, v in stats.items()},
            )
        )
        return EXIT_OK
    console = stdout_console()
    what = "compressed by nvcomp-checkpoint" if d["format"] == _dcp.DCP_OURS else "plain, as FileSystemWriter writes it"
    rows = [
        [
            f["file"],
            f["rank_file"],
            f["items"],
            format_bytes(f["raw_bytes"]),
            format_bytes(f["file_bytes"]),
            f"{f['raw_bytes'] / f['file_bytes']:.3f}x" if f["file_bytes"] else "-",
            f.get("note", ""),
        ]
        for f in d["files"]
    ]
    if d["metadata_files"] == [".metadata"]:
        rows.append([".metadata", "", "", "", format_bytes(d["metadata_bytes"]), "", "written last: the commit"])
    else:  # a save without collectives: each rank committed its own part
        names = d["metadata_files"]
        rows.append(
            [f"{names[0]} .. {names[-1]}", "", "", "", format_bytes(d["metadata_bytes"]), "", "one per rank: each rank's commit"]
        )
    rows.append(
        [
            "total (files)",
            "",
            len(infos),
            format_bytes(raw),
            format_bytes(on_disk),
            f"{raw / on_disk:.3f}x" if on_disk else "-",
            "",
        ]
    )
    console.print(
        make_table(
            f"{args.path} (DCP checkpoint, {what})",
            ["file", "rank file", "items", "raw", "on disk", "ratio", "note"],
            rows,
            numeric_from=1,
        )
    )
    # The frames of the tensors only; the table above counts whole files (indexes, .metadata).
    console.print(
        make_table("items by component, every rank", COMPONENT_COLUMNS, component_rows(stats, raw, stored, "total (tensors)"))
    )
    _print_codec_notes(console, stats)
    return EXIT_OK


def _run_inspect_deepspeed(args: argparse.Namespace) -> int:
    """A DeepSpeed folder: one row per file of every tag (rank, kind, raw and stored size, ratio)."""
    d = _deepspeed.describe(args.path)
    if args.json:
        print_json(d)
        return EXIT_OK
    rows = []
    for f in d["files"]:
        kind = f["kind"] + (f" {f['expert'][0]}/{f['expert'][1]}" if f["expert"] else "")
        rows.append(
            [
                f["tag"],
                f["file"],
                "-" if f["rank"] is None else f["rank"],
                kind,
                f["format"],
                format_bytes(f["raw_bytes"]),
                format_bytes(f["stored_bytes"]),
                f"{f['raw_bytes'] / f['stored_bytes']:.3f}x" if f["stored_bytes"] else "-",
            ]
        )
    raw = sum(f["raw_bytes"] for f in d["files"])
    stored = sum(f["stored_bytes"] for f in d["files"])
    rows.append(["total", "", "", "", "", format_bytes(raw), format_bytes(stored), f"{raw / stored:.3f}x" if stored else "-"])
    latest = f", latest: {d['latest']}" if d["latest"] else ""
    stdout_console().print(
        make_table(
            f"{args.path} (DeepSpeed{latest})",
            ["tag", "file", "rank", "kind", "format", "raw", "stored", "ratio"],
            rows,
            numeric_from=5,
        )
    )
    return EXIT_OK


def _refuse_a_folder_without_checkpoints(path: str, files: list[dict[str, Any]]) -> None:
    """A folder of scripts (or a mistyped one) is not a checkpoint: an error, not an empty table."""
    if any(f["format"] not in (OTHER, DIRECTORY) for f in files):
        return
    names = sorted(f["file"] for f in files)
    held = f"its {len(names)} files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else "it is empty"
    raise CheckpointError(
        f"{path}: not a checkpoint folder: {held} hold no torch.save, safetensors or nvcomp-checkpoint file"
        if names
        else f"{path}: not a checkpoint folder: {held}"
    )


def run_inspect(args: argparse.Namespace) -> int:
    kind = sniff(args.path)
    console = stdout_console()
    if kind == DIRECTORY and _deepspeed.is_deepspeed_dir(args.path):
        return _run_inspect_deepspeed(args)
    if kind == DIRECTORY and _dcp.is_dcp_dir(args.path):
        return _run_inspect_dcp(args)
    if kind == DIRECTORY:
        _dcp.refuse_uncommitted_save(args.path)  # rank files but no .metadata: not a checkpoint
        d = _inspect_dir(args)
        _refuse_a_folder_without_checkpoints(args.path, d["files"])
        if args.json:
            print_json(_public(d))
            return EXIT_OK
        rows = []
        for f in d["files"]:
            raw = "-" if not f.get("raw_bytes") else format_bytes(f["raw_bytes"])
            rows.append(
                [
                    f["file"],
                    f["format"],
                    "-" if f["tensors"] is None else f["tensors"],
                    raw,
                    format_bytes(f["file_bytes"]),
                    f.get("note", ""),
                ]
            )
        for f in d["stale_temp_files"]:
            rows.append(
                [
                    f["file"],
                    "temporary",
                    "-",
                    "-",
                    format_bytes(f["file_bytes"]),
                    "left by a killed save; the next save into this directory removes it",
                ]
            )
        console.print(
            make_table(f"{args.path} (directory)", ["file", "format", "tensors", "raw", "on disk", "note"], rows, numeric_from=2)
        )
        stored = sum(s.stored_bytes for s in d["_stats"].values())
        console.print(
            make_table(
                "tensor files by component",
                COMPONENT_COLUMNS,
                component_rows(d["_stats"], d["raw_bytes"], stored, "total (tensors)"),
            )
        )
        _print_codec_notes(console, d["_stats"])
        return EXIT_OK

    d = _describe_file(args.path, args.trust)
    if args.json:
        print_json(_public(d))
        return EXIT_OK
    compressed = d["format"] == NVCOMP
    ratio = f", {d['raw_bytes'] / d['file_bytes']:.3f}x" if compressed and d["file_bytes"] else ""
    title = (
        f"{args.path}  ({d['format']}, {format_bytes(d['file_bytes'])} file, {format_bytes(d['raw_bytes'])} of tensors{ratio})"
    )
    # The title on a line of its own, soft-wrapped: a path is never cut (as a tree's root label is at
    # the console's width when piped) nor folded mid-name; the tree's labels wrap at the width.
    console.print(title, markup=False, highlight=False, soft_wrap=True)
    if not args.no_tree:
        tree = build_tree(title, d["_infos"], args.depth, compressed)
        tree.hide_root = True
        console.print(tree, soft_wrap=False)
    console.print(make_table(None, COMPONENT_COLUMNS, component_rows(d["_stats"], d["raw_bytes"], d["file_bytes"])))
    _print_codec_notes(console, d["_stats"])
    note = overhead_note(d["_stats"], d["raw_bytes"], d["file_bytes"]) if compressed else None
    if note:
        console.print(note, markup=False, highlight=False)
    if compressed:
        if d["portable"]:
            console.print("loads anywhere: every codec has a CPU decoder", markup=False, highlight=False)
        else:
            console.print(
                f"needs a CUDA GPU with nvCOMP to load: codec {', '.join(d['gpu_only_codecs'])} has no CPU decoder "
                "(convert with: nvckpt compress SRC DST --policy zstd on a GPU machine)",
                markup=False,
                highlight=False,
            )
    if d["chain"]:
        console.print(chain_text(d["chain"]), markup=False, highlight=False)
    meta = d["metadata"]
    if meta:
        shown = ", ".join(f"{_shown(k)}={_meta_value(k, v)}" for k, v in meta.items() if not isinstance(v, (dict, list)))
        console.print(f"metadata: {shown}", markup=False, highlight=False)
    return EXIT_OK
