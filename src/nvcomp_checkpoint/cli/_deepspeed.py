"""DeepSpeed checkpoint folders in the CLI: ``inspect``, ``verify``, ``compress`` and ``decompress``.

A folder is a DeepSpeed checkpoint when it holds tags (sub-folders of files with DeepSpeed's names,
usually named by ``latest``), or is one tag. Files are read with the allow-list of
:mod:`nvcomp_checkpoint.deepspeed_layout`, so none of this needs ``--trust``.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.deepspeed_layout import (
    CONVERTING_NAME,
    MANIFEST_NAME,
    OPTIM_PARTITION,
    OTHER_FILE,
    classify_file,
    deepspeed_policy,
    deepspeed_safe_globals,
    is_deepspeed_dir,
    is_ours,
    is_tag_dir,
    read_latest,
    tag_dirs,
    tag_file_records,
    tag_problems,
    tag_to_load,
    write_manifest,
)
from nvcomp_checkpoint.errors import CheckpointError, FormatError
from nvcomp_checkpoint.filetype import NVCOMP, TORCH
from nvcomp_checkpoint.storage import LOCAL

__all__ = ["is_deepspeed_dir", "tags_of", "describe", "problems", "convert_in_place", "verify_ds_file"]


def tags_of(path: str) -> list[str]:
    """The tag folders of ``path``: itself when it is one tag, else its tags."""
    return [path] if is_tag_dir(path) else [os.path.join(path, t) for t in tag_dirs(path)]


def _deepspeed_files(tag: str) -> list[str]:
    return sorted(n for n in os.listdir(tag) if classify_file(n).kind != OTHER_FILE)


def describe(path: str) -> dict[str, Any]:
    """One row per file of every tag: tag, file, rank, kind, format, raw (tensor) bytes, stored bytes."""
    rows = []
    for tag in tags_of(path):
        for name in _deepspeed_files(tag):
            f = classify_file(name)
            full = os.path.join(tag, name)
            stored = os.path.getsize(full)
            raw = stored
            ours = is_ours(full)
            if ours:
                with nc.open(full) as reader:
                    raw = reader.raw_bytes
            rows.append(
                {
                    "tag": os.path.basename(os.path.normpath(tag)),
                    "file": name,
                    "rank": f.rank,
                    "kind": f.kind,
                    "expert": list(f.expert) if f.expert else None,
                    "format": NVCOMP if ours else TORCH,
                    "raw_bytes": raw,
                    "stored_bytes": stored,
                }
            )
    latest = None if is_tag_dir(path) else read_latest(path)
    return {"path": path, "layout": "deepspeed", "latest": latest, "files": rows}


def verify_ds_file(path: str, max_bytes: int | None) -> list[str]:
    """Every problem of one file, read as the attached engine reads it (our checksums, then the tree; a plain file decoded)."""
    with deepspeed_safe_globals():
        if is_ours(path):
            return [
                f"{p.tensor!r}: {p.error}" if p.tensor is not None else str(p.error)
                for p in nc.verify(path, max_bytes=max_bytes).problems
            ]
        try:
            nc.load(path, map_location="cpu", weights_only=True, max_bytes=max_bytes)
        except CheckpointError as exc:
            return [str(exc)]
    return []


def problems(path: str, max_bytes: int | None) -> tuple[list[dict[str, Any]], int]:
    """Every problem of a DeepSpeed folder (each tag's completeness, then each file), and the number of files checked."""
    found: list[dict[str, Any]] = []
    tags = tags_of(path)
    if not is_tag_dir(path):
        try:
            tag_to_load(path)
        except FormatError as exc:  # `latest` damaged, or naming a tag that is not there: a bad checkpoint
            found.append({"file": os.path.join(path, "latest"), "tensor": None, "error": str(exc)})
    checked = 0
    for tag in tags:
        found.extend({"file": tag, "tensor": None, "error": e} for e in tag_problems(tag, read_partition_count=True))
        for name in _deepspeed_files(tag):
            full = os.path.join(tag, name)
            checked += 1
            found.extend({"file": full, "tensor": None, "error": e} for e in verify_ds_file(full, max_bytes))
    return found, checked


def convert_in_place(
    path: str, to_ours: bool, policy: nc.CodecPolicy | None, workers: int | None, started: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Turn every tag of ``path`` into ours (``to_ours``) or plain ``torch.save`` files, file by file, in place.

    Each file is replaced atomically (a complete old or new file at every instant). While a tag is
    converted it holds :data:`CONVERTING_NAME`, so a load refuses the half-converted tag and names the
    command that finishes it; ours is committed by its manifest, written once every file is durable.
    ``latest`` is left as it is: it names the same tag, complete again when the conversion ends.

    A tag that is not complete (a save killed before its commit, a rank's file missing) is left as it
    is, with its problem in the row's note: converting it would make a tag that looks committed.

    Raises:
        FormatError: ``path`` holds no tag.
    """
    tags = tags_of(path)
    if not tags:
        raise FormatError(f"{path}: holds no DeepSpeed tag (no folder of mp_rank_*/zero_pp_rank_* files)")
    if policy is not None:
        policy = deepspeed_policy(policy)
    rows: list[dict[str, Any]] = []
    for tag in tags:
        # A conversion that did not finish (the marker is there) resumes; other problems skip the tag.
        # read_partition_count: a plain tag missing its last rank's file is incomplete too.
        bad = [] if os.path.exists(os.path.join(tag, CONVERTING_NAME)) else tag_problems(tag, read_partition_count=True)
        if bad:
            rows.extend(
                _row(tag, n, "skipped", os.path.getsize(os.path.join(tag, n)), os.path.getsize(os.path.join(tag, n)), bad[0])
                for n in _deepspeed_files(tag)
            )
            continue
        names = _deepspeed_files(tag)
        LOCAL.write_bytes(os.path.join(tag, CONVERTING_NAME), b'{"converting": true}')
        LOCAL.fsync(tag)
        if not to_ours and os.path.exists(os.path.join(tag, MANIFEST_NAME)):
            LOCAL.remove(os.path.join(tag, MANIFEST_NAME))
        for name in names:
            full = os.path.join(tag, name)
            before = os.path.getsize(full)
            if is_ours(full) == to_ours:
                rows.append(_row(tag, name, "kept", before, before))
                continue
            started(name)
            mode = stat.S_IMODE(os.stat(full).st_mode)  # kept, as gzip keeps it: a private rank file stays private
            with deepspeed_safe_globals():
                tree = nc.load(full, map_location="cpu", weights_only=True)
                if to_ours:
                    nc.save(tree, full, policy, workers=workers, file_mode=mode)
                else:
                    with LOCAL.open_write(full, mode=mode) as f:
                        torch.save(tree, f)
            rows.append(_row(tag, name, "compressed" if to_ours else "decompressed", before, os.path.getsize(full)))
        if to_ours:
            world = 1 + max((classify_file(n).rank or 0 for n in names if classify_file(n).kind == OPTIM_PARTITION), default=0)
            write_manifest(tag, os.path.basename(os.path.normpath(tag)), world, _records(tag, names))
        LOCAL.remove(os.path.join(tag, CONVERTING_NAME))
        LOCAL.fsync(tag)
    return rows


def _records(tag: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """The manifest records (size, digest) of a converted tag's files."""
    return tag_file_records({os.path.join(tag, n): n for n in names})


def _row(tag: str, name: str, action: str, before: int, after: int, note: str = "") -> dict[str, Any]:
    rel = os.path.join(os.path.basename(os.path.normpath(tag)), name)
    return {"file": rel, "action": action, "output": rel, "input_bytes": before, "output_bytes": after, "note": note}
