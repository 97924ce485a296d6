"""What a committed DCP checkpoint directory holds: its rank files, their sizes and per-component totals.

:func:`dcp_report` is the :class:`~nvcomp_checkpoint.SaveReport` of a sharded save, read from the
rank files' indexes only; ``nvckpt inspect`` and ``verify`` list a directory with :func:`read_dcp_files`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import CheckpointError, FormatError
from ..policy import Component
from ..reader import CheckpointReader
from ..report import ComponentStats, SaveReport
from ..storage import is_storage_error, list_names, storage_for
from .layout import METADATA_NAME, StoredItem, holds_stored_items, join, rank_metadata_name
from .reader import require_stored_metadata

__all__ = ["RankFile", "DcpFiles", "read_dcp_files", "dcp_report", "metadata_files", "rank_file_records", "component_totals"]

_RANK_METADATA = re.compile(r"__\d+\.metadata")


@dataclass(frozen=True)
class RankFile:
    """One rank file named by the checkpoint's metadata.

    Attributes:
        name: The file's name inside the checkpoint directory.
        items: DCP items the metadata places in it.
        file_bytes: Its size; ``None`` when the file is missing (or, with ``error``, its size does not read).
        tensors: The entries of its index (ours; each with ``key``, ``component``, ``nbytes``,
            ``stored_bytes``, ``codec``, ``filter``); empty for a plain, missing or unreadable file.
        error: Why it could not be read (a damaged or foreign file, a storage failure), else ``None``.
        foreign: It reads, but is not the file the metadata names (another index digest: a rank
            file of another checkpoint under this name); ``error`` says so.
    """

    name: str
    items: int
    file_bytes: int | None
    tensors: tuple[Any, ...] = ()
    error: str | None = None
    foreign: bool = False

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes the file spends on its tensors' frames (its index and footer excluded)."""
        return sum(t.stored_bytes for t in self.tensors)


@dataclass(frozen=True)
class DcpFiles:
    """The files of a committed DCP checkpoint directory (ours or plain).

    Attributes:
        path: The directory.
        compressed: Written by :class:`~nvcomp_checkpoint.dcp.NvcompWriter` (else plain DCP).
        metadata: The DCP ``Metadata`` (merged over the ranks for a save without collectives).
        records: Per rank file name, its ``(MetadataIndex, storage record)`` pairs.
        rank_files: One :class:`RankFile` per rank file, in name order.
        metadata_files: ``(".metadata",)``, or one ``__<rank>.metadata`` per rank.
        metadata_bytes: Their total size.
    """

    path: str
    compressed: bool
    metadata: Any
    records: Mapping[str, list[tuple[Any, Any]]]
    rank_files: tuple[RankFile, ...]
    metadata_files: tuple[str, ...]
    metadata_bytes: int
    components: Mapping[str, ComponentStats] = field(default_factory=dict)

    @property
    def raw_bytes(self) -> int:
        return sum(f.raw_bytes for f in self.rank_files)

    @property
    def file_bytes(self) -> int:
        """Bytes on disk: every rank file present and the metadata."""
        return sum(f.file_bytes or 0 for f in self.rank_files) + self.metadata_bytes


def rank_file_records(metadata: Any) -> dict[str, list[tuple[Any, Any]]]:
    """The items of a DCP ``Metadata`` grouped by the rank file holding them (ours: ``StoredItem.file``,
    plain: ``_StorageInfo.relative_path``), in file name order."""
    files: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = info.file if isinstance(info, StoredItem) else info.relative_path
        files.setdefault(name, []).append((index, info))
    return dict(sorted(files.items()))


def metadata_files(path: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The metadata files of a DCP directory: ``.metadata``, or one ``__<rank>.metadata`` per rank
    (a save without collectives), in rank order; ``[]`` when there is none."""
    storage, spath = storage_for(join(path, METADATA_NAME), storage_options)
    if storage.exists(spath):
        return [METADATA_NAME]
    storage, spath = storage_for(path, storage_options)
    names = [n for n, folder in list_names(storage, spath).items() if not folder and _RANK_METADATA.fullmatch(n)]
    return sorted(names, key=lambda n: int(n[2:-9])) if rank_metadata_name(0) in names else []


def component_totals(tensors: Any) -> dict[str, ComponentStats]:
    """Per-component totals of index entries, in the canonical component order (as ``reader.summary()``)."""
    stats: dict[str, ComponentStats] = {}
    for t in tensors:
        stats[t.component] = stats.get(t.component, ComponentStats()).add(t.nbytes, t.stored_bytes, t.codec.label, t.filter)
    order = [c.value for c in Component]
    return {k: stats[k] for k in sorted(stats, key=lambda k: order.index(k) if k in order else len(order))}


def read_dcp_files(path: str, storage_options: dict[str, Any] | None = None) -> DcpFiles:
    """The files of the committed DCP checkpoint at ``path``; for ours, every rank file's index is
    read (its footer and index only, never a tensor's frames).

    A rank file the metadata names but that is missing has ``file_bytes=None``; one that does not
    read (damaged, not ours, or the storage failed on it) has the reason in ``error``, and the
    other files are read all the same.

    Raises:
        CheckpointError: No committed checkpoint at ``path`` (the message says what is there).
    """
    metadata = require_stored_metadata(path, storage_options)
    records = rank_file_records(metadata)
    compressed = holds_stored_items(metadata)
    rank_files = tuple(_rank_file(path, name, items, compressed, storage_options) for name, items in records.items())
    names = metadata_files(path, storage_options)
    meta_bytes = 0
    for n in names:
        storage, spath = storage_for(join(path, n), storage_options)
        meta_bytes += storage.size(spath)
    return DcpFiles(
        path,
        compressed,
        metadata,
        records,
        rank_files,
        tuple(names),
        meta_bytes,
        component_totals(t for f in rank_files for t in f.tensors),
    )


def _rank_file(
    path: str, name: str, records: list[tuple[Any, Any]], compressed: bool, storage_options: dict[str, Any] | None
) -> RankFile:
    """One rank file's size and (ours) index; a failure to read it is its ``error``."""
    where = join(path, name)
    storage, spath = storage_for(where, storage_options)
    items = len(records)
    try:
        if not storage.exists(spath):
            return RankFile(name, items, None)
        if not compressed:
            return RankFile(name, items, storage.size(spath))
        with CheckpointReader(where, storage_options=storage_options) as reader:
            digests = {d for _, info in records if (d := getattr(info, "index_xxh3", None)) is not None}
            if digests and digests != {reader.index_xxh3}:
                return RankFile(
                    name,
                    items,
                    reader.file_bytes,
                    error=(
                        f"{where}: not the rank file this checkpoint's metadata names (index digest {reader.index_xxh3:016x}, "
                        f"recorded {', '.join(f'{d:016x}' for d in sorted(digests))}): a file of another checkpoint under this name"
                    ),
                    foreign=True,
                )
            return RankFile(name, items, reader.file_bytes, tuple(reader.index.tensors))
    except CheckpointError as exc:  # FormatError, ChecksumError, permission denied: named by the message
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - the storage's own failure on this file; a bug passes through
        if not is_storage_error(exc):
            raise
        error = f"{where}: cannot be read: {type(exc).__name__}: {exc}"
    try:
        size: int | None = storage.size(spath)
    except Exception:  # noqa: BLE001 - the error above says why the file does not read
        size = None
    return RankFile(name, items, size, error=error)


def dcp_report(
    path: str, *, seconds: float = 0.0, seconds_blocked: float | None = None, storage_options: dict[str, Any] | None = None
) -> SaveReport:
    """The :class:`~nvcomp_checkpoint.SaveReport` of a committed DCP checkpoint written by
    :class:`~nvcomp_checkpoint.dcp.NvcompWriter`, summed over every rank file.

    Reads the metadata and each rank file's index (not the tensors): cheap enough to call after
    every save, on the one process that reports it.

    Args:
        path: The checkpoint directory (local path or fsspec URL).
        seconds, seconds_blocked: The save's times, as the caller measured them.
        storage_options: Passed to fsspec for URLs.

    Returns:
        ``raw_bytes``: every stored item's bytes (tensor shards and the planner's byte items);
        ``stored_bytes``: the directory's bytes on disk (rank files and metadata); per component,
        tensors, raw and stored (frame) bytes, codecs and filters.

    Raises:
        CheckpointError: Not a committed DCP checkpoint.
        FormatError: A plain DCP checkpoint (no per-tensor index to report from), a rank file
            missing, or one whose index does not read.
    """
    files = read_dcp_files(path, storage_options)
    if not files.compressed:
        raise FormatError(
            f"{path}: a plain DCP checkpoint (FileSystemWriter's), not one written by nvcomp_checkpoint.dcp.NvcompWriter; "
            "its per-rank sizes and ratios are listed by `nvckpt inspect`"
        )
    missing = [f.name for f in files.rank_files if f.file_bytes is None and f.error is None]
    if missing:
        raise FormatError(
            f"{path}: rank file(s) {', '.join(missing)} named by the metadata are missing; restore the checkpoint from another copy"
        )
    damaged = next((f for f in files.rank_files if f.error is not None), None)
    if damaged is not None:
        raise FormatError(
            f"{join(path, damaged.name)}: its index does not read ({damaged.error}); restore the checkpoint from another copy"
        )
    return SaveReport(
        path,
        files.raw_bytes,
        files.file_bytes,
        seconds,
        dict(files.components),
        seconds if seconds_blocked is None else seconds_blocked,
    )
