"""The files of a compressed DCP checkpoint directory (specified in ``docs/dcp.md``).

One nvcomp-checkpoint file per rank and save (``__<rank>_<save id>.nvcdcp``), and ``.metadata``:
a pickle that stops a stock ``FileSystemReader`` with the reader to use, then our own record.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import ChecksumError, FormatError

__all__ = [
    "METADATA_NAME",
    "SHARD_SUFFIX",
    "RECORD_MAGIC",
    "StoredItem",
    "holds_stored_items",
    "shard_name",
    "rank_metadata_name",
    "WORLD_SIZE_TAG",
    "SAVE_TAG",
    "encode_metadata",
    "decode_metadata",
    "is_compressed_metadata",
    "refuse_stock_reader",
    "safe_unpickle",
]

#: DCP's commit point, as ``FileSystemWriter`` names it.
METADATA_NAME = ".metadata"
SHARD_SUFFIX = ".nvcdcp"
#: Starts our record after the refusal pickle: name, record version 1, reserved zero byte.
RECORD_MAGIC = b"NVCDCP\x01\x00"
#: magic, payload size (u64), xxh3-64 of the payload (u64); little-endian.
_RECORD_HEAD = struct.Struct("<8sQQ")
#: A DCP metadata pickle larger than this is refused before it is read (a forged size field).
MAX_METADATA_BYTES = 1 << 30


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP write item lives: the rank file (relative to the checkpoint directory) and
    its tensor key in that file. A ``storage_data`` value of DCP's ``Metadata``; pickled by its
    class path ``nvcomp_checkpoint.dcp.layout.StoredItem``, which is part of the format."""

    file: str
    key: str


def holds_stored_items(metadata: Any) -> bool:
    """True when a DCP ``Metadata``'s records are :class:`StoredItem` (written by ``NvcompWriter``),
    False for a plain (``FileSystemWriter``) one."""
    return any(isinstance(v, StoredItem) for v in (metadata.storage_data or {}).values())


#: In ``storage_meta.modules`` of a per-rank metadata file (a save without collectives): the
#: number of ranks that saved, so a reader can tell a whole checkpoint from one missing ranks.
WORLD_SIZE_TAG = "nvcomp_checkpoint.dcp.world_size="
#: With it, the caller's ``NvcompWriter(save_tag=...)``: the same on every rank of one save, so a
#: directory mixing the parts of two saves (a retry into it) is refused.
SAVE_TAG = "nvcomp_checkpoint.dcp.save_tag="


def rank_metadata_name(rank: int) -> str:
    """One rank's metadata in a save without collectives (``dcp.save(..., use_collectives=False)``),
    as DCP's ``FileSystemWriter`` names it."""
    return f"__{rank}{METADATA_NAME}"


def shard_name(rank: int, save_id: str) -> str:
    """The rank file of one save: unique per save, so a save into a directory that holds a
    checkpoint never touches that checkpoint's files before the new metadata commits."""
    return f"__{rank}_{save_id}{SHARD_SUFFIX}"


def refuse_stock_reader(message: str) -> None:
    """Called by a stock ``pickle.load`` of our ``.metadata``: stops a plain DCP reader with the
    reader to use, instead of a confusing failure deep in a rank file."""
    from ..errors import FormatError as _FormatError

    raise _FormatError(message)


class _Refusal:
    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (refuse_stock_reader, (self.message,))


_REFUSAL_TEXT = (
    "this directory is a DCP checkpoint compressed by nvcomp-checkpoint; its rank files are not "
    "torch.save data. Load it with torch.distributed.checkpoint.load(state_dict, "
    "storage_reader=nvcomp_checkpoint.dcp.NvcompReader(path)) (pip install nvcomp-checkpoint)"
)
#: Every ``.metadata`` we write starts with this pickle (protocol 2: the same bytes on every Python).
REFUSAL_PICKLE = pickle.dumps(_Refusal(_REFUSAL_TEXT), protocol=2)
#: How that pickle starts whatever its message says: PROTO 2, then GLOBAL of the refusal.
REFUSAL_HEAD = b"\x80\x02cnvcomp_checkpoint.dcp.layout\nrefuse_stock_reader\n"
assert REFUSAL_PICKLE.startswith(REFUSAL_HEAD)


def encode_metadata(metadata: Any) -> bytes:
    """``.metadata``: the refusal pickle, then magic, size, xxh3 and the pickled DCP ``Metadata``."""
    payload = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return REFUSAL_PICKLE + _RECORD_HEAD.pack(RECORD_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def is_compressed_metadata(head: bytes) -> bool:
    """Whether the first bytes of a ``.metadata`` file are ours."""
    return head.startswith(REFUSAL_HEAD)


def _record_start(data: bytes, where: str) -> int:
    """The offset just past the refusal pickle's STOP, found without running the pickle."""
    try:
        for op, _, pos in pickletools.genops(io.BytesIO(data[:4096])):
            if op.name == "STOP":
                return int(pos) + 1
    except Exception as exc:  # noqa: BLE001 - damaged bytes raise ValueError and others
        raise FormatError(f"{where}: the metadata's leading record is damaged ({exc})") from exc
    raise FormatError(f"{where}: the metadata's leading record is damaged (no end)")


def decode_metadata(data: bytes, where: str) -> Any:
    """The DCP ``Metadata`` of our ``.metadata`` bytes, checked and unpickled with the allow-list.

    Raises:
        FormatError: truncated, a newer record version, or a type outside the allow-list.
        ChecksumError: the payload does not match its digest.
    """
    start = _record_start(data, where)
    head = data[start : start + _RECORD_HEAD.size]
    if len(head) != _RECORD_HEAD.size:
        raise FormatError(f"{where}: truncated ({len(data)} bytes); restore the checkpoint from another copy")
    magic, size, digest = _RECORD_HEAD.unpack(head)
    if magic[:6] != RECORD_MAGIC[:6]:
        raise FormatError(f"{where}: not an nvcomp-checkpoint DCP metadata record")
    if magic[6] != RECORD_MAGIC[6]:
        raise FormatError(f"{where}: DCP record version {magic[6]}; this nvcomp-checkpoint reads {RECORD_MAGIC[6]}. Upgrade it.")
    payload = data[start + _RECORD_HEAD.size :]
    if size > MAX_METADATA_BYTES or len(payload) != size:
        raise FormatError(f"{where}: the record claims {size} bytes of metadata, the file holds {len(payload)} (truncated?)")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise ChecksumError(f"{where}: the checkpoint metadata is corrupt (checksum mismatch); restore it from another copy")
    return safe_unpickle(payload, where)


#: What a DCP ``Metadata`` pickle may build: DCP's metadata classes, torch sizes, dtypes and
#: layouts, paths (``StorageMeta.checkpoint_id``) and the storage records of both writers.
_ALLOWED_MODULE_PREFIXES = (
    "torch.distributed.checkpoint.metadata",
    # Where older torch releases kept TensorProperties and shard metadata (checkpoints they wrote).
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._shard.metadata",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("nvcomp_checkpoint.dcp.layout", "StoredItem"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or module.startswith(_ALLOWED_MODULE_PREFIXES):
            return super().find_class(module, name)
        raise FormatError(
            f"{self.where}: the checkpoint metadata holds a {module}.{name}, which is not a DCP metadata type; "
            "nvcomp_checkpoint.dcp.NvcompReader does not build it. If you trust the checkpoint, load it with "
            "torch.distributed.checkpoint.FileSystemReader"
        )


def safe_unpickle(data: bytes, where: str) -> Any:
    """Unpickle DCP metadata with the allow-list (no code from the file runs)."""
    try:
        return _MetadataUnpickler(data, where).load()
    except FormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises many types
        raise FormatError(f"{where}: the checkpoint metadata does not unpickle ({type(exc).__name__}: {exc})") from exc


def join(directory: str, name: str) -> str:
    """``directory/name`` for local paths and URLs alike."""
    if "://" in directory:
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)
