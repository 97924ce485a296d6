"""``NvcompReader``: a torch.distributed.checkpoint ``StorageReader`` for compressed and plain DCP directories.

Reads the directory's ``.metadata`` (ours, or a plain ``FileSystemWriter`` one), then each rank
file a load needs; every frame's checksum is checked before it is decoded.
"""

from __future__ import annotations

import io
import math
import os
import uuid
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..codecs import gpu_available
from ..credentials import StorageOptions
from ..errors import CheckpointError, FormatError, SizeLimitError
from ..filetype import NVCOMP, TORCH, path_contents
from ..reader import CheckpointReader
from ..storage import open_checkpoint_stream, storage_for
from .layout import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    SAVE_TAG,
    WORLD_SIZE_TAG,
    StoredItem,
    check_byte_item,
    check_file_name,
    is_compressed_metadata,
    join,
    rank_metadata_name,
    safe_unpickle,
)
from .metadata_file import decode_metadata

__all__ = [
    "NvcompReader",
    "read_stored_metadata",
    "require_stored_metadata",
    "merge_rank_metadata",
    "is_compressed_dcp_checkpoint",
    "rank_file_problems",
]


def _read_metadata_bytes(
    path: str, storage_options: dict[str, Any] | None, name: str = METADATA_NAME, max_bytes: int | None = None
) -> bytes | None:
    where = join(path, name)
    storage, spath = storage_for(where, storage_options)
    if not storage.exists(spath):
        return None
    size = storage.size(spath)
    if size > MAX_METADATA_BYTES:
        raise FormatError(f"{where}: {size} bytes of checkpoint metadata, over the limit of {MAX_METADATA_BYTES >> 30} GiB")
    if max_bytes is not None and size > max_bytes:
        raise SizeLimitError(
            f"{where}: {size} bytes of checkpoint metadata, over max_bytes={max_bytes}; raise max_bytes if you trust the checkpoint"
        )
    with open_checkpoint_stream(storage, spath, where) as f:
        data = bytes(f.read(size + 1))  # no more than was sized: a file growing meanwhile is not read on
    if len(data) != size:
        raise FormatError(
            f"{where}: changed size while it was read ({size} bytes, then {len(data)}); is a save running into this directory?"
        )
    return data


def read_stored_metadata(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, max_bytes: int | None = None
) -> Metadata | None:
    """The DCP ``Metadata`` committed in directory ``path`` (ours or plain), or None if there is none.

    Plain metadata is unpickled with the same allow-list as ours: no code from the file runs, and
    what the pickle builds is bounded by its size. Every rank file it names must be a plain file
    name inside ``path``. ``max_bytes`` bounds the size of each metadata file read.

    Raises:
        FormatError: The metadata is damaged or forged (a type outside the allow-list, a pickle
            that would build more than its size allows, a rank file outside the directory).
        SizeLimitError: A metadata file is larger than ``max_bytes``.
    """
    path = os.fspath(path)
    data = _read_metadata_bytes(path, storage_options, max_bytes=max_bytes)
    if data is None:
        return _read_rank_metadata(path, storage_options, max_bytes)
    return _decode(data, join(path, METADATA_NAME))


def require_stored_metadata(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, max_bytes: int | None = None
) -> Metadata:
    """:func:`read_stored_metadata`, for a path that must hold a committed DCP checkpoint.

    Raises:
        CheckpointError: It does not; the message says what is there instead (nothing, a file,
            an empty directory, a save that never completed) and what to do.
    """
    metadata = read_stored_metadata(path, storage_options, max_bytes=max_bytes)
    if metadata is None:
        raise CheckpointError(_no_checkpoint(os.fspath(path), storage_options))
    return metadata


def _decode(data: bytes, where: str) -> Metadata:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = decode_metadata(data, where) if is_compressed_metadata(data) else safe_unpickle(data, where)
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{where}: holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data or {}, dict):
        raise FormatError(f"{where}: its state_dict_metadata or storage_data is not a dict; the metadata is damaged or forged")
    for index, stored in (metadata.storage_data or {}).items():
        fqn = str(getattr(index, "fqn", index))
        # Both writers' records name a file of the directory; a reader joins the name to the path.
        if isinstance(stored, StoredItem):
            check_file_name(stored.file, where, fqn)
            if not isinstance(stored.key, str) or not isinstance(stored.index_xxh3, (int, type(None))):
                raise FormatError(f"{where}: item {fqn[:200]!r} has a malformed record; the metadata is damaged or forged")
        elif isinstance(stored, _StorageInfo):
            check_file_name(stored.relative_path, where, fqn)
    return metadata


def _world_size(metadata: Metadata) -> int | None:
    for tag in getattr(metadata.storage_meta, "modules", None) or ():
        if isinstance(tag, str) and tag.startswith(WORLD_SIZE_TAG):
            return int(tag[len(WORLD_SIZE_TAG) :])
    return None


def _save_tag(metadata: Metadata) -> str | None:
    for tag in getattr(metadata.storage_meta, "modules", None) or ():
        if isinstance(tag, str) and tag.startswith(SAVE_TAG):
            return tag[len(SAVE_TAG) :]
    return None


def _read_rank_metadata(path: str, storage_options: dict[str, Any] | None, max_bytes: int | None = None) -> Metadata | None:
    """A save without collectives (``__<rank>.metadata`` per rank) as one ``Metadata``, or None.

    Committed means: every rank's metadata is in place (ours record how many ranks saved; for a
    plain one, ranks are counted up to the first missing file), and together they cover every
    element of every tensor. Then DCP loads it as any checkpoint: on any number of ranks,
    resharding, or in one process.
    """
    data = _read_metadata_bytes(path, storage_options, rank_metadata_name(0), max_bytes)
    if data is None:
        return None
    parts = [_decode(data, join(path, rank_metadata_name(0)))]
    world = _world_size(parts[0])
    rank = 1
    while world is None or rank < world:
        name = rank_metadata_name(rank)
        data = _read_metadata_bytes(path, storage_options, name, max_bytes)
        if data is None:
            if world is None:
                break  # a plain checkpoint: the coverage check below catches a missing rank's shards
            raise CheckpointError(
                f"{join(path, name)}: missing: this checkpoint was saved without collectives by {world} ranks and rank "
                f"{rank} never committed its part (its save failed or is still running). Load an earlier checkpoint, "
                "and save again into a new directory: a retry into this one would mix the parts of two saves."
            )
        part = _decode(data, join(path, name))
        if _world_size(part) != world:
            raise CheckpointError(
                f"{join(path, name)}: saved by {_world_size(part)} ranks, {rank_metadata_name(0)} by {world}: "
                "the directory mixes two saves; load an earlier checkpoint"
            )
        if _save_tag(part) != _save_tag(parts[0] if parts else part):
            raise CheckpointError(
                f"{join(path, name)}: save_tag {_save_tag(part)!r}, {rank_metadata_name(0)} has "
                f"{_save_tag(parts[0] if parts else part)!r}: the directory mixes the parts of two saves; load an earlier checkpoint"
            )
        parts.append(part)
        rank += 1
    return merge_rank_metadata(parts, path)


def merge_rank_metadata(parts: list[Metadata], path: str) -> Metadata:
    """The per-rank metadata of a save without collectives merged into the metadata DCP loads from.

    Items every rank saved (unsharded tensors, non-tensor values) are taken from the lowest rank.

    Raises:
        CheckpointError: the ranks disagree on a tensor's shape or dtype, or some of a tensor's
            elements are in no rank's part.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    merged: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    planner_data: dict[str, Any] = {}
    for rank, part in enumerate(parts):
        for fqn, md in part.state_dict_metadata.items():
            have = merged.get(fqn)
            if have is None:
                merged[fqn] = (
                    TensorStorageMetadata(md.properties, md.size, list(md.chunks))
                    if isinstance(md, TensorStorageMetadata)
                    else md
                )
                continue
            if isinstance(have, BytesStorageMetadata) and isinstance(md, BytesStorageMetadata):
                continue
            if not (isinstance(have, TensorStorageMetadata) and isinstance(md, TensorStorageMetadata)) or (
                have.size != md.size or have.properties.dtype != md.properties.dtype
            ):
                raise CheckpointError(
                    f"{join(path, rank_metadata_name(rank))}: {fqn!r} differs from the other ranks' (type, shape or "
                    "dtype): the directory mixes saves; load an earlier checkpoint"
                )
            seen = {tuple(c.offsets) for c in have.chunks}
            have.chunks.extend(c for c in md.chunks if tuple(c.offsets) not in seen)
        for index, stored in (part.storage_data or {}).items():
            storage_data.setdefault(index, stored)
        for key, value in (part.planner_data or {}).items():
            planner_data.setdefault(key, value)
    for fqn, md in merged.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
            held = sum(math.prod(c.sizes) for c in md.chunks)
            if held < math.prod(md.size):
                raise CheckpointError(
                    f"{path}: tensor {fqn!r} is saved only in part ({held} of {math.prod(md.size)} elements) by the "
                    f"{len(parts)} rank metadata files present (saved without collectives): a rank's part is missing; "
                    "load an earlier checkpoint"
                )
    first = parts[0]
    return Metadata(
        state_dict_metadata=merged,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=first.storage_meta,
        version=first.version,
    )


def is_compressed_dcp_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True if ``path`` is a committed DCP directory written by :class:`NvcompWriter` (for a save
    without collectives: rank 0's part is; loading checks every rank's)."""
    try:
        data = _read_metadata_bytes(os.fspath(path), storage_options)
        if data is None:  # a save without collectives: rank 0's metadata
            data = _read_metadata_bytes(os.fspath(path), storage_options, rank_metadata_name(0))
    except (OSError, CheckpointError):
        return False
    return data is not None and is_compressed_metadata(data)


def _expected(metadata: Metadata, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype the metadata gives the stored item at ``index``; None for a byte item.

    Raises:
        FormatError: the metadata holds no such item or chunk (it is inconsistent).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = metadata.state_dict_metadata.get(index.fqn)
    if isinstance(md, BytesStorageMetadata):
        return None
    if isinstance(md, TensorStorageMetadata):
        offsets = tuple(index.offset or ())
        hint = index.index
        chunks = md.chunks
        if isinstance(hint, int) and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offsets:
            return tuple(chunks[hint].sizes), md.properties.dtype
        for chunk in chunks:
            if tuple(chunk.offsets) == offsets:
                return tuple(chunk.sizes), md.properties.dtype
    raise FormatError(f"item {index.fqn[:200]!r} at offsets {list(index.offset or ())} has a record but no chunk in the metadata")


def rank_file_problems(
    reader: CheckpointReader, records: list[tuple[Any, StoredItem]], metadata: Metadata
) -> list[tuple[str | None, FormatError]]:
    """What is wrong with rank file ``reader`` for the records the metadata places in it, found from
    its index alone (nothing is decoded): ``(fqn or None, error)`` pairs, empty when it is right.

    The file must be the one the metadata recorded (its index digest, where recorded: a rank file
    of another checkpoint under this name is not), and hold every record's key with the shape and
    dtype of the metadata's chunk (a byte item: bytes). The shape bounds what a load decodes
    from the file to what the metadata states.
    """
    digests = {stored.index_xxh3 for _, stored in records if stored.index_xxh3 is not None}
    if digests and digests != {reader.index_xxh3}:
        recorded = ", ".join(f"{d:016x}" for d in sorted(digests))
        return [
            (
                None,
                FormatError(
                    f"{reader.path}: not the rank file this checkpoint's metadata names (its index digest is "
                    f"{reader.index_xxh3:016x}, the metadata recorded {recorded}): a file of another checkpoint, or another save, "
                    "under this name; restore the checkpoint from another copy"
                ),
            )
        ]
    problems: list[tuple[str | None, FormatError]] = []
    for index, stored in records:
        try:
            entry = reader.entry(stored.key)
        except KeyError:
            problems.append((index.fqn, FormatError(f"{reader.path}: item {index.fqn!r}: key {stored.key!r} is not in the file")))
            continue
        try:
            want = _expected(metadata, index)
        except FormatError as exc:
            problems.append((index.fqn, FormatError(f"{reader.path}: {exc}")))
            continue
        shape, dtype = want if want is not None else ((entry.shape[0],) if len(entry.shape) == 1 else (-1,), torch.uint8)
        if tuple(entry.shape) != shape or entry.dtype != dtype:
            problems.append(
                (
                    index.fqn,
                    FormatError(
                        f"{reader.path}: item {index.fqn!r}: the file holds {str(entry.dtype).removeprefix('torch.')}{list(entry.shape)}, "
                        f"the metadata says {'bytes' if want is None else str(dtype).removeprefix('torch.') + str(list(shape))}; "
                        "the file or the metadata is damaged or forged: restore the checkpoint from another copy"
                    ),
                )
            )
    return problems


class _CheckedPlanner:
    """A load planner whose ``load_bytes`` first checks the item with the weights-only rules: DCP's
    own planner unpickles byte items with ``torch.load(weights_only=False)``."""

    def __init__(self, planner: LoadPlanner, path: str, files: dict[Any, str]) -> None:
        self._planner = planner
        self._path = path
        self._files = files

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        name = self._files.get(read_item.storage_index, "")
        check_byte_item(value.getvalue(), join(self._path, name) if name else self._path, read_item.storage_index.fqn)
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class NvcompReader(StorageReader):
    """Reads a DCP checkpoint directory written by :class:`NvcompWriter`, or a plain one.

    ``dcp.load(state_dict, storage_reader=NvcompReader(path))`` loads on any number of ranks
    (or with no process group), whatever the number that saved: DCP reshards, this reader
    decodes each stored shard it needs once per load step and copies the requested slices.

    What the directory holds is checked before it is used: ``.metadata`` is unpickled with an
    allow-list of DCP's metadata types, bounded by its size; every rank file it names must be a
    file of the directory, the very file that save wrote (its index digest), with the shapes the
    metadata states; and every byte item (a non-tensor value, which DCP unpickles with
    ``torch.load(weights_only=False)``) must pass the weights-only rules of ``nc.load``.

    Args:
        path: The checkpoint directory (local path or fsspec URL); or ``dcp.load(..., checkpoint_id=path)``.
        storage_options: Passed to fsspec for URLs.
        workers: Decompression threads per rank.
        max_bytes: For checkpoints from untrusted sources: refuse, before allocating, to decode
            more than this many bytes on a rank in one load (the stored shards and byte items it
            reads), or to read a metadata file larger than this. ``None``: no limit beyond the format's.
        weights_only: ``False`` hands byte items to DCP unchecked: only for checkpoints you trust
            (they may hold any pickled object, and so run code).

    Raises (inside DCP's ``CheckpointException``, per rank):
        CheckpointError: no ``.metadata`` (not a checkpoint, or a save that never committed).
        ChecksumError: a stored byte does not match its checksum; names the tensor's FQN and file.
        FormatError: forged or damaged metadata or rank files (named).
        UnsafeCheckpointError: a byte item the weights-only rules refuse.
        SizeLimitError: over ``max_bytes``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        workers: int | None = None,
        max_bytes: int | None = None,
        weights_only: bool = True,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path) if path is not None else ""
        self.storage_options: dict[str, Any] | None = StorageOptions.of(storage_options)  # credentials out of every repr
        self.workers = workers
        self.max_bytes = max_bytes
        self.weights_only = weights_only
        self.storage_data: dict[Any, Any] = {}
        self.metadata: Metadata | None = None
        self.load_id = uuid.uuid4().hex
        self._plain: Any = None  # a FileSystemReader for plain checkpoints

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self.metadata = None
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._plain = None

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs: DCP then does not fall back to reading only its own rank's metadata of a
        # save without collectives (a load on other ranks would miss shards); read_stored_metadata
        # merges every rank's, and a failure reports only the real reason a load cannot start.
        if not self.path:
            raise CheckpointError("NvcompReader has no directory: pass NvcompReader(path) or dcp.load(..., checkpoint_id=path)")
        metadata = require_stored_metadata(self.path, self.storage_options, max_bytes=self.max_bytes)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        self.storage_data = metadata.storage_data or {}
        values = list(self.storage_data.values())
        if values and not all(isinstance(v, StoredItem) for v in values):
            # A plain DCP checkpoint (FileSystemWriter / FsspecWriter): torch's own readers read its files.
            from torch.distributed.checkpoint import FileSystemReader
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            if "://" in self.path:
                self._plain = FsspecReader(self.path, **(self.storage_options or {}))
            else:
                self._plain = FileSystemReader(self.path)
            self._plain.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._plain is not None:
            return self._read_plain(plan, planner)
        assert self.metadata is not None
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            stored = self.storage_data[req.storage_index]
            per_file.setdefault(stored.file, []).append(req)
        decoded = 0
        for name, reqs in per_file.items():
            with CheckpointReader(join(self.path, name), storage_options=self.storage_options, workers=self.workers) as reader:
                records = [(req.storage_index, self.storage_data[req.storage_index]) for req in reqs]
                problems = rank_file_problems(reader, records, self.metadata)
                if problems:
                    raise problems[0][1]
                keys = {stored.key for _, stored in records}
                decoded += sum(reader.entry(k).nbytes for k in keys)
                if self.max_bytes is not None and decoded > self.max_bytes:
                    raise SizeLimitError(
                        f"{reader.path}: this load decodes {decoded} bytes on this rank (up to this file), over "
                        f"max_bytes={self.max_bytes}; raise max_bytes if you trust the checkpoint"
                    )
                self._read_file(reader, reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_plain(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """A plain checkpoint's items through torch's reader, bounded by ``max_bytes`` and with byte
        items checked by the weights-only rules before DCP's planner unpickles them."""
        infos = [self.storage_data[req.storage_index] for req in plan.items]
        total = sum(int(getattr(info, "length", 0) or 0) for info in infos)
        if self.max_bytes is not None and total > self.max_bytes:
            raise SizeLimitError(
                f"{self.path}: this load reads {total} bytes of rank files on this rank, over max_bytes={self.max_bytes}; "
                "raise max_bytes if you trust the checkpoint"
            )
        if self.weights_only and any(req.type == LoadItemType.BYTE_IO for req in plan.items):
            files = {req.storage_index: getattr(info, "relative_path", "") for req, info in zip(plan.items, infos)}
            planner = _CheckedPlanner(planner, self.path, files)  # type: ignore[assignment]
        return self._plain.read_data(plan, planner)

    def _read_file(self, reader: CheckpointReader, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        # Every request for one stored shard is served by one decode; shards are decoded ahead
        # on one worker pool, in file order, and each is freed once its slices are copied.
        by_key: dict[str, list[tuple[ReadItem, torch.Tensor | None]]] = {}
        for req in reqs:
            target = None if req.type == LoadItemType.BYTE_IO else planner.resolve_tensor(req).detach()
            by_key.setdefault(self.storage_data[req.storage_index].key, []).append((req, target))
        keys = sorted(by_key, key=lambda k: min((f.offset for f in reader.entry(k).frames), default=0))
        on_gpu = gpu_available() and all(t is None or t.device.type == "cuda" for k in keys for _, t in by_key[k])
        devices = {t.device for k in keys for _, t in by_key[k] if t is not None}
        # Decoded where the targets live: on their GPU with nvCOMP when they all share one.
        location = next(iter(devices)) if on_gpu and len(devices) == 1 else torch.device("cpu")
        for key, stored in reader.read_many(keys, map_location=location):
            for req, target in by_key.pop(key):
                if target is None:
                    data = stored.cpu().numpy().tobytes()
                    if self.weights_only:
                        check_byte_item(data, reader.path, req.storage_index.fqn)
                    planner.load_bytes(req, io.BytesIO(data))
                    continue
                piece = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
                if target.size() != piece.size():
                    raise FormatError(
                        f"{reader.path}: tensor {key!r}: the stored slice has shape {list(piece.shape)}, the state dict "
                        f"expects {list(target.shape)}; the checkpoint does not match this model"
                    )
                target.copy_(piece)
                planner.commit_tensor(req, target)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def _no_checkpoint(path: str, storage_options: dict[str, Any] | None) -> str:
    """Why ``path``, which has no DCP metadata, does not load: what is there, and what to do."""
    found = path_contents(*storage_for(path, storage_options), path)
    if not found.exists:
        return f"{path}: does not exist; check the path (NvcompReader takes the directory that dcp.save wrote)"
    if found.file_kind == NVCOMP:
        return f"{path}: a single-file checkpoint of nvcomp-checkpoint, not a DCP directory: use nvcomp_checkpoint.load(path)"
    if found.file_kind == TORCH:
        return f"{path}: a torch.save file, not a DCP directory: use nvcomp_checkpoint.load(path) or torch.load(path)"
    if not found.is_dir:
        return f"{path}: a file, not a DCP checkpoint directory (NvcompReader takes the directory that dcp.save wrote)"
    if not found.names:
        return f"{path}: an empty directory: no checkpoint was saved here (or a save was killed before it wrote a file)"
    return (
        f"{path}: a directory without .metadata (nor __0.metadata): not a DCP checkpoint, or a save that never "
        "completed (the metadata is written last, once every rank's file is durable). Load an earlier checkpoint."
    )
