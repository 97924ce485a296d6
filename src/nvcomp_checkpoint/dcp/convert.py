"""Conversion of a DCP checkpoint directory between DCP's plain files and ours, rank file by rank file.

No process group and no model are needed: each rank file becomes one file of the other kind,
holding the same items, and the same DCP metadata is written last with the new storage records.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..errors import CheckpointError, FormatError
from ..policy import CodecPolicy
from ..reader import CheckpointReader
from ..storage import file_mode_of, open_checkpoint_stream, storage_for, write_errors
from ..writer import CheckpointWriter
from .layout import METADATA_NAME, StoredItem, check_tensor_item, join, shard_name
from .metadata_file import encode_metadata
from .reader import read_stored_metadata
from .writer import FqnPolicy, bytes_key, unique_key

__all__ = ["compress_directory", "decompress_directory"]


def _metadata(src: str, storage_options: dict[str, Any] | None) -> Metadata:
    metadata = read_stored_metadata(src, storage_options)
    if metadata is None:
        raise CheckpointError(f"{src}: no .metadata: not a DCP checkpoint, or a save that never completed")
    return metadata


def _check_target(dst: str, storage_options: dict[str, Any] | None) -> None:
    storage, spath = storage_for(join(dst, METADATA_NAME), storage_options)
    if storage.exists(spath):
        raise CheckpointError(f"{dst}: already holds a DCP checkpoint; convert into a new directory")


def _by_file(metadata: Metadata) -> dict[str, list[tuple[Any, Any]]]:
    files: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = info.file if isinstance(info, StoredItem) else getattr(info, "relative_path", None)
        if not isinstance(name, str):
            raise FormatError(f"unknown storage record {type(info).__name__} for {index.fqn!r}")
        files.setdefault(name, []).append((index, info))
    return files


def compress_directory(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    policy: CodecPolicy | None = None,
    *,
    workers: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write the plain DCP checkpoint ``src`` (``FileSystemWriter``, with or without its
    extensions) as a compressed one at ``dst``; the result loads with ``NvcompReader``."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    src, dst = os.fspath(src), os.fspath(dst)
    metadata = _metadata(src, storage_options)
    if any(isinstance(v, StoredItem) for v in (metadata.storage_data or {}).values()):
        raise CheckpointError(f"{src}: already a compressed DCP checkpoint")
    _check_target(dst, storage_options)
    fqn_policy = FqnPolicy.of(policy)
    registry = ExtensionRegistry()
    save_id = uuid.uuid4().hex[:12]
    records: dict[Any, StoredItem] = {}
    for rank, (name, items) in enumerate(sorted(_by_file(metadata).items())):
        out_name = shard_name(rank, save_id)
        tree: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        keys: dict[Any, str] = {}
        where = join(src, name)
        storage, spath = storage_for(where, storage_options)
        with open_checkpoint_stream(storage, spath, where) as stream:
            for index, info in sorted(items, key=lambda kv: kv[1].offset):
                stream.seek(info.offset)
                raw = stream.read(info.length)
                if len(raw) != info.length:
                    raise FormatError(f"{where}: truncated: {index.fqn!r} needs {info.length} bytes at {info.offset}")
                data: io.IOBase | io.BytesIO = io.BytesIO(raw)
                for ext in registry.from_descriptor_list(getattr(info, "transform_descriptors", None) or ()):
                    data = ext.transform_from(data)  # type: ignore[attr-defined]
                raw = data.read()
                if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
                    key = unique_key(bytes_key(index.fqn), (index.index,), used)
                    tree[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                else:
                    key = unique_key(index.fqn, tuple(index.offset or ()), used)
                    check_tensor_item(raw, where, index.fqn)
                    tree[key] = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                keys[index] = key
        target = join(dst, out_name)
        out, opath = storage_for(target, storage_options)
        with write_errors(target), out.open_write(opath, mode=file_mode_of(where)) as f:
            written, _, _ = CheckpointWriter(f, fqn_policy, target, workers=workers).write(
                tree, {"dcp_rank": rank, "dcp_file": out_name}
            )
        identity = xxhash.xxh3_64_intdigest(written.to_json_bytes())  # the file's footer digest: its identity
        records.update((index, StoredItem(out_name, key, identity)) for index, key in keys.items())
    metadata.storage_data = records
    _write_metadata(dst, encode_metadata(metadata), storage_options, file_mode_of(join(src, METADATA_NAME)))


def decompress_directory(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> None:
    """Write the compressed DCP checkpoint ``src`` as a plain one at ``dst`` (``FileSystemWriter``'s
    layout: one ``__<rank>_0.distcp`` per rank file); the result loads with DCP's stock reader."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    src, dst = os.fspath(src), os.fspath(dst)
    metadata = _metadata(src, storage_options)
    if not all(isinstance(v, StoredItem) for v in (metadata.storage_data or {}).values()):
        raise CheckpointError(f"{src}: a plain DCP checkpoint already; nothing to decompress")
    _check_target(dst, storage_options)
    records: dict[Any, Any] = {}
    for rank, (name, items) in enumerate(sorted(_by_file(metadata).items())):
        out_name = f"__{rank}_0.distcp"
        target = join(dst, out_name)
        out, opath = storage_for(target, storage_options)
        with CheckpointReader(join(src, name), storage_options=storage_options) as reader:
            keys = {item.key: index for index, item in items}
            with write_errors(target), out.open_write(opath, mode=file_mode_of(join(src, name))) as f:
                pos = 0
                for key, tensor in reader.read_many(list(keys), map_location="cpu"):
                    index = keys[key]
                    if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
                        data = tensor.numpy().tobytes()
                    else:
                        buf = io.BytesIO()
                        torch.save(tensor, buf)  # as FileSystemWriter stores a tensor item
                        data = buf.getvalue()
                    f.write(data)
                    records[index] = _StorageInfo(out_name, pos, len(data))
                    pos += len(data)
    metadata.storage_data = records
    _write_metadata(dst, pickle.dumps(metadata), storage_options, file_mode_of(join(src, METADATA_NAME)))


def _write_metadata(dst: str, data: bytes, storage_options: dict[str, Any] | None, mode: int | None = None) -> None:
    target = join(dst, METADATA_NAME)
    storage, spath = storage_for(target, storage_options)
    with write_errors(target, "committing the checkpoint metadata"), storage.open_write(spath, mode=mode) as f:
        f.write(data)
