"""The public entry points: ``save``, ``load`` and ``open``."""

from __future__ import annotations

import errno
import os
import time
from typing import Any, Callable

import torch

from .errors import CheckpointError, CheckpointWriteError, FormatError
from .format.layout import MAGIC
from .policy import CodecPolicy
from .reader import CheckpointReader, MapLocation
from .report import SaveReport
from .storage import storage_for
from .writer import CheckpointWriter

__all__ = ["save", "load", "open", "is_nvcomp_checkpoint"]


def save(
    obj: Any,
    path: str | os.PathLike[str],
    policy: CodecPolicy | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SaveReport:
    """Save a checkpoint tree (state dicts, optimizer state, Lightning checkpoints ...).

    The file appears at ``path`` only once it is complete and durable: a failed or killed save
    leaves whatever was there before untouched.

    Args:
        obj: Any tree of dicts, lists and tuples holding tensors and plain values.
        path: Local path, or an fsspec URL such as ``s3://bucket/ckpt.nvc``.
        policy: Codec settings per component; defaults to :class:`CodecPolicy()`.
        metadata: JSON-safe values stored in the index (read back with ``open(path).metadata``).
        storage_options: Passed to fsspec for URLs (credentials, endpoint ...).
        workers: Compression threads (default: every core).
        progress: Called with the raw bytes of each chunk as it is written.

    Returns:
        A :class:`SaveReport` with raw and stored bytes, time and a per-component table.
    """
    policy = policy or CodecPolicy()
    where = os.fspath(path)
    storage, spath = storage_for(path, storage_options)
    start = time.perf_counter()
    try:
        with storage.open_write(spath) as stream:
            writer = CheckpointWriter(stream, policy, where, workers=workers, progress=progress)
            _, stats, raw = writer.write(obj, metadata)
            stored = writer._pos
    except CheckpointError:
        raise
    except OSError as exc:
        hint = " (the disk is full)" if exc.errno == errno.ENOSPC else ""
        raise CheckpointWriteError(
            f"{where}: writing the checkpoint failed{hint}: {exc}. Any previous file at this path is untouched."
        ) from exc
    seconds = time.perf_counter() - start
    return SaveReport(where, raw, stored, seconds, stats, seconds)


def is_nvcomp_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True if ``path`` is a file that starts with this format's magic."""
    storage, spath = storage_for(path, storage_options)
    try:
        with storage.open_read(spath) as f:
            return f.read(6) == MAGIC[:6]
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    weights_only: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Load a checkpoint saved by :func:`save`, or a plain ``torch.save`` file.

    Args:
        path: Local path or fsspec URL.
        map_location: As for ``torch.load``: ``None`` (the saved device; the CPU where that is
            a GPU and there is none), a device, a ``{saved: target}`` dict, or a callable.
            On a CUDA device, tensors are decompressed on that device.
        weights_only: Refuse to construct arbitrary Python objects (the rules of
            ``torch.load(weights_only=True)``). Pass ``False`` only for files you trust.
        storage_options: Passed to fsspec for URLs.

    Returns:
        The saved tree with bit-identical tensors.
    """
    where = os.fspath(path)
    storage, spath = storage_for(path, storage_options)
    try:
        with storage.open_read(spath) as f:
            head = f.read(len(MAGIC))
    except FileNotFoundError as exc:
        raise FormatError(f"{where}: no such checkpoint file") from exc
    except IsADirectoryError as exc:
        raise FormatError(f"{where}: is a directory, not a checkpoint file") from exc
    if head[:6] == MAGIC[:6]:
        with CheckpointReader(path, storage_options=storage_options) as reader:
            return reader.load(map_location, weights_only=weights_only)
    return _load_plain(where, storage, spath, map_location, weights_only)


def _load_plain(where: str, storage: Any, spath: str, map_location: MapLocation, weights_only: bool) -> Any:
    """A file written by ``torch.save`` (a run that switched to this library resumes from it)."""
    import pickle

    try:
        with storage.open_read(spath) as f:
            return torch.load(f, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            from .errors import UnsafeCheckpointError

            raise UnsafeCheckpointError(
                f"{where}: this plain torch.save file holds Python objects that a weights-only load refuses. "
                "If you trust the file, load it with weights_only=False."
            ) from exc
        raise FormatError(f"{where}: neither an nvcomp-checkpoint file nor a readable torch.save file ({exc})") from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise FormatError(f"{where}: neither an nvcomp-checkpoint file nor a readable torch.save file ({exc})") from exc


def open(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> CheckpointReader:  # noqa: A001
    """Open a checkpoint for lazy reading of single tensors or components.

    Example:
        >>> with nvcomp_checkpoint.open("ckpt.nvc") as reader:
        ...     reader.keys(); reader.read("model/weight"); reader.summary()
    """
    return CheckpointReader(path, storage_options=storage_options)
