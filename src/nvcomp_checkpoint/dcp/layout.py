"""The files of a compressed DCP checkpoint directory (specified in ``docs/dcp.md``).

One nvcomp-checkpoint file per rank and save (``__<rank>_<save id>.nvcdcp``), and ``.metadata``:
a pickle that stops a stock ``FileSystemReader`` with the reader to use, then our own record.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from ..format.picklescan import PicklePolicy, scan_pickle
from ..safepaths import inside_path

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
    "RECORD_HEAD",
    "MAX_METADATA_BYTES",
    "is_compressed_metadata",
    "refuse_stock_reader",
    "safe_unpickle",
    "check_file_name",
    "check_byte_item",
    "check_tensor_item",
]

#: DCP's commit point, as ``FileSystemWriter`` names it.
METADATA_NAME = ".metadata"
SHARD_SUFFIX = ".nvcdcp"
#: Starts our record after the refusal pickle: name, record version 1 (the pickle only: older
#: checkpoints, read through the scan), reserved zero byte. Version 2 adds the JSON record
#: (``metadata_file.RECORD_MAGIC_JSON``).
RECORD_MAGIC = b"NVCDCP\x01\x00"
#: magic, payload size (u64), xxh3-64 of the payload (u64); little-endian.
RECORD_HEAD = struct.Struct("<8sQQ")
#: A DCP metadata pickle larger than this is refused before it is read (a forged size field).
MAX_METADATA_BYTES = 1 << 30


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP write item lives: the rank file (a plain file name inside the checkpoint
    directory) and its tensor key in that file. A ``storage_data`` value of DCP's ``Metadata``;
    pickled by its class path ``nvcomp_checkpoint.dcp.layout.StoredItem``, which is part of the format.

    ``index_xxh3`` is the rank file's identity: its footer's digest of its index (as
    ``CheckpointReader.index_xxh3`` reads it). A reader refuses a file under that name with another
    index (a rank file of another checkpoint). ``None`` in checkpoints written before it was
    recorded (their pickles lack the field; the class default stands in).
    """

    file: str
    key: str
    index_xxh3: int | None = None


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
    "storage_reader=nvcomp_checkpoint.dcp.NvcompReader(path))"
)
#: Every ``.metadata`` we write starts with this pickle (protocol 2: the same bytes on every Python).
REFUSAL_PICKLE = pickle.dumps(_Refusal(_REFUSAL_TEXT), protocol=2)
#: How that pickle starts whatever its message says: PROTO 2, then GLOBAL of the refusal.
REFUSAL_HEAD = b"\x80\x02cnvcomp_checkpoint.dcp.layout\nrefuse_stock_reader\n"
assert REFUSAL_PICKLE.startswith(REFUSAL_HEAD)


def is_compressed_metadata(head: bytes) -> bool:
    """Whether the first bytes of a ``.metadata`` file are ours."""
    return head.startswith(REFUSAL_HEAD)


#: Every global a DCP ``Metadata`` pickle may name, as exact ``(module, qualname)`` pairs (no dotted
#: names: protocol 4 resolves ``module`` + ``"os.system"`` through the module's attributes): DCP's
#: metadata dataclasses and enum (also where torch 2.0-2.1 kept TensorProperties), the storage records
#: of both writers, ``torch.Size``, layouts, and paths (``StorageMeta.checkpoint_id``). Torch dtypes
#: are allowed by value (a ``torch`` attribute that is a ``torch.dtype``). Found by listing the globals
#: of real metadata (tensors, DTensor and ShardedTensor shards, byte items, tied weights, both
#: writers, with and without collectives); pinned by tests/test_dcp_forgery.py.
_ALLOWED_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("nvcomp_checkpoint.dcp.layout", "StoredItem"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch._utils", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
#: Containers nest no deeper in DCP metadata (Metadata > dict > TensorStorageMetadata > list > chunk > Size).
MAX_METADATA_NESTING = 32
#: The scan of a DCP metadata pickle before it is unpickled: no persistent ids, calls that copy
#: no more than its size (plus 64 Ki elements), DCP's nesting; ``_get_layout`` returns torch's
#: module-level layout objects, on which no state may be set.
METADATA_POLICY = PicklePolicy(
    suffix="; DCP never writes this",
    max_nesting=MAX_METADATA_NESTING,
    copy_slack=1 << 16,
    shared_results=frozenset({"torch.serialization._get_layout", "torch._utils._get_layout"}),
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise FormatError(
            f"{self.where}: the checkpoint metadata holds a {module[:100]}.{name[:100]}, which is not a DCP metadata type; "
            "nvcomp_checkpoint.dcp.NvcompReader does not build it. If you trust the checkpoint, load it with "
            "torch.distributed.checkpoint.FileSystemReader"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(f"{self.where}: the checkpoint metadata holds a persistent id, which DCP metadata never does")


def safe_unpickle(data: bytes, where: str) -> Any:
    """Unpickle DCP metadata with the allow-list: no code from the file runs, what it builds is
    bounded by its size, and no state is set on a class or enum member (the scan of
    :data:`METADATA_POLICY` runs first).

    Raises:
        FormatError: a global outside the allow-list, a pickle that would build more than its
            size allows, or bytes that are not a pickle.
    """
    scan_pickle(data, f"{where}: the checkpoint metadata is refused", METADATA_POLICY)
    try:
        return _MetadataUnpickler(data, where).load()
    except FormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises many types
        raise FormatError(f"{where}: the checkpoint metadata does not unpickle ({type(exc).__name__}: {str(exc)[:200]})") from exc


def check_file_name(name: Any, where: str, fqn: str) -> str:
    """``name``, a rank file's name as the metadata records it, if it is a plain file name inside the
    checkpoint directory (:func:`~nvcomp_checkpoint.safepaths.inside_path`, one component).

    Raises:
        UnsafePathError: Anything else (``../other/x``, ``/abs``, ``a/b``): a forged or damaged record.
    """
    return inside_path(name, where=where, what=f"item {fqn[:200]!r} names the file", single=True)


def check_byte_item(data: bytes, where: str, fqn: str) -> None:
    """Refuse a DCP byte item (``torch.save`` of a non-tensor value, which DCP's planner unpickles
    with ``torch.load(weights_only=False)``) that the weights-only rules of object trees refuse.

    Raises:
        UnsafeCheckpointError: It would build objects outside the weights-only allow-list (code).
        FormatError: It is not a torch.save archive, or its pickle is refused by the scan that
            bounds what it builds (sizes, nesting).
    """
    from ..errors import UnsafeCheckpointError
    from ..format.skeleton import decode_skeleton, weights_only_detail

    try:
        decode_skeleton(data, weights_only=True, where=f"{where}: DCP item {fqn[:200]!r}")
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{where}: DCP item {fqn[:200]!r} holds Python objects that a weights-only load refuses "
            f"({weights_only_detail(exc.__cause__ or exc)}); DCP would unpickle it with torch.load(weights_only=False). "
            "If you trust this checkpoint, load it with NvcompReader(path, weights_only=False)"
        ) from exc


def check_tensor_item(data: bytes, where: str, fqn: str) -> None:
    """Refuse a tensor item of a plain DCP rank file (``torch.save`` of one chunk) before torch
    loads it: its pickle must pass the scan of plain ``torch.save`` files, and it may build no more
    than its own bytes (DCP clones a view before saving it, so a chunk's storage is the chunk: a
    stride-0 view of 2**40 elements over one is forged).

    Raises:
        FormatError: Its pickle is refused, or it is not a torch.save archive.
        SizeLimitError: It builds more than its size.
    """
    from ..format.torchsave import check_torch_archive

    check_torch_archive(io.BytesIO(data), len(data), f"{where}: DCP item {fqn[:200]!r}", max_bytes=len(data))


def join(directory: str, name: str) -> str:
    """``directory/name`` for local paths and URLs alike."""
    if "://" in directory:
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)
