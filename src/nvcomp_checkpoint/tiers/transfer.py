"""Copies of units between tiers: a checked byte-for-byte copy, a parallel upload from a local tier, one retry loop."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Callable

import xxhash

from ..errors import CheckpointWriteError, CopySourceError, CopySourceGoneError
from ..storage import upload_file, write_errors
from .units import COPY_CHUNK_BYTES, FileEntry, TierStore, UnitManifest, entry_path, quote

__all__ = ["copy_unit", "copy_with_retries"]

_LOG = logging.getLogger("nvcomp_checkpoint")

ProgressFn = Callable[[int], None]


def source_intact(src: TierStore, manifest: UnitManifest) -> bool:
    """Whether every file of an adopted unit is still there with its size."""
    try:
        return all(src.storage.size(src.source_path(manifest, e)) == e.size for e in manifest.files)
    except (FileNotFoundError, OSError):
        return False


def copy_unit(
    src: TierStore,
    dst: TierStore,
    manifest: UnitManifest,
    progress: ProgressFn | None = None,
    *,
    to: str | None = None,
) -> UnitManifest:
    """Copy one unit's files byte for byte, check them on ``dst``, then commit its manifest there.

    Streams :data:`COPY_CHUNK_BYTES` at a time (object stores upload in ``part_size`` parts).
    A failure removes what this copy wrote; ``dst``'s other units are untouched.

    ``to``: put the unit at this path of ``dst`` (a chain laid out for a restore, :func:`chain_layout`)
    instead of its step name, checked, and commit no manifest (the folder is not a tier).

    Returns:
        The manifest committed on ``dst`` (with the whole-file checksums read on the way).
    """
    entries: list[FileEntry] = []
    written: list[str] = []  # files this copy put in place (an atomic write that failed left none)
    if to is None:
        # A copy of this step already there (a resumed run saving the step again) is unlisted first:
        # its manifest would not describe the new bytes.
        dst.storage.remove(dst.manifest_path(manifest.step))
    else:
        dst.storage.remove(to)  # what an earlier restore left there
    try:
        for entry in manifest.files:
            s_path = src.source_path(manifest, entry)
            d_path = dst.file_path(manifest, entry) if to is None else entry_path(to, entry)
            if src.storage.is_local and upload_local(src, dst, manifest, entry, s_path, d_path, written, progress, entries):
                continue
            h = xxhash.xxh3_64()
            n = 0
            with src.storage.open_read(s_path) as fin, write_errors(d_path, f"copying step {manifest.step} to {dst.label}"):
                with dst.write_storage.open_write(d_path) as fout:
                    while chunk := fin.read(COPY_CHUNK_BYTES):
                        h.update(chunk)
                        fout.write(chunk)
                        n += len(chunk)
                        if progress is not None:
                            progress(len(chunk))
                    check_source(s_path, entry, n, h.intdigest())
            written.append(d_path)
            entries.append(replace(entry, xxh3=h.intdigest()))
        committed = replace(manifest, files=tuple(entries), created=time.time(), source=None)
        dst.check(committed, at=to)
        if to is None:
            dst.write_manifest(committed)
        return committed
    except BaseException:
        for path in written:
            try:
                dst.storage.remove(path)
            except Exception:  # noqa: BLE001 - the endpoint may be down; the next manager cleans up
                _LOG.debug("could not remove the partial copy %s", path, exc_info=True)
        if manifest.directory or to is not None:
            try:
                dst.storage.remove(dst.unit_path(manifest.step, True) if to is None else to)
            except Exception:  # noqa: BLE001
                pass
        raise


def check_source(s_path: str, entry: FileEntry, n: int, digest: int) -> None:
    if n != entry.size:
        raise CopySourceError(f"{s_path}: read {n} bytes, the manifest says {entry.size}; the source changed during the copy")
    if entry.xxh3 is not None and digest != entry.xxh3:
        raise CopySourceError(f"{s_path}: checksum mismatch against its manifest; the source copy is damaged")


def upload_local(
    src: TierStore,
    dst: TierStore,
    manifest: UnitManifest,
    entry: FileEntry,
    s_path: str,
    d_path: str,
    written: list[str],
    progress: ProgressFn | None,
    entries: list[FileEntry],
) -> bool:
    """A local file to an object store: parts uploaded in parallel (s3fs ``put_file``); False where not possible."""
    if not dst.storage.is_object_store:
        return False
    # The source is checked first (a committed unit does not change): read once, from the page cache.
    n, h = os.path.getsize(s_path), xxhash.xxh3_64()
    with src.storage.open_read(s_path) as fin:
        while chunk := fin.read(COPY_CHUNK_BYTES):
            h.update(chunk)
    check_source(s_path, entry, n, h.intdigest())
    with write_errors(d_path, f"copying step {manifest.step} to {dst.label}"):
        if not upload_file(dst.storage, s_path, d_path, dst.tier.part_size, dst.tier.upload_concurrency, progress):
            return False
    written.append(d_path)
    entries.append(replace(entry, xxh3=h.intdigest()))
    return True


def copy_with_retries(src: TierStore, dst: TierStore, manifest: UnitManifest, progress: ProgressFn | None = None) -> UnitManifest:
    """:func:`copy_unit`, tried ``1 + dst.tier.retries`` times, waiting ``backoff_s`` (doubled each time) between tries.

    A source that changed or does not match its manifest is not tried again: a retry reads the same bytes.

    Raises:
        CopySourceGoneError: An adopted unit was removed or replaced at its source before the copy was done.
        CheckpointWriteError: The last try failed, or the source changed (the tier's previous copies are untouched).
    """
    tier, delay = dst.tier, dst.tier.backoff_s
    for attempt in range(tier.retries + 1):
        try:
            return copy_unit(src, dst, manifest, progress)
        except Exception as exc:  # noqa: BLE001 - retried, or raised below with the attempts named
            if manifest.source is not None and not source_intact(src, manifest):
                raise CopySourceGoneError(
                    f"{manifest.source}: step {manifest.step} was removed or replaced (by the rotation of whoever wrote it) "
                    f"before its copy to {dst.label} was done; the copy is skipped. Keep more checkpoints there for the "
                    "copies to finish."
                ) from exc
            if attempt == tier.retries or isinstance(exc, CopySourceError):
                raise CheckpointWriteError(
                    f"{dst.label} ({dst.root}): copying step {manifest.step} failed after {attempt + 1} attempt(s): "
                    f"{quote(exc)}. The tier's previous copies are untouched; step {manifest.step} stays on "
                    f"{src.label} ({src.unit_path(manifest.step, manifest.directory)})."
                ) from exc
            _LOG.warning("%s: copying step %d failed (%s); retrying in %.1f s", dst.label, manifest.step, exc, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")
