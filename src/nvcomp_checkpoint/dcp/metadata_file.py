"""Our ``.metadata`` file (``docs/dcp.md``): the refusal pickle, DCP's ``Metadata`` pickled (for
older readers of ours), and the same ``Metadata`` as JSON, which our reader loads without unpickling.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import pickletools
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import ChecksumError, FormatError
from .layout import (
    MAX_METADATA_BYTES,
    MAX_METADATA_NESTING,
    RECORD_HEAD,
    RECORD_MAGIC,
    REFUSAL_PICKLE,
    StoredItem,
    safe_unpickle,
)

__all__ = [
    "RECORD_MAGIC_JSON",
    "JSON_MAGIC",
    "JSON_FORMAT",
    "MAX_DIMS",
    "encode_metadata",
    "decode_metadata",
    "metadata_to_json",
    "metadata_from_json",
]

#: Record version 2: the pickle record is followed by the JSON record.
RECORD_MAGIC_JSON = b"NVCDCP\x02\x00"
#: Starts the JSON record: magic, JSON size (u64), xxh3-64 of the JSON (u64); little-endian.
JSON_MAGIC = b"NVCDJSON"

#: The ``format`` of the JSON record, part of the format.
JSON_FORMAT = "nvcomp-checkpoint DCP metadata v1"
#: Most dimensions a tensor of the record may have (torch's own limit is 64 on most backends).
MAX_DIMS = 64
_MAX_INT = (1 << 63) - 1


class _NotRepresentable(Exception):
    """A value the JSON record cannot hold (the ``.metadata`` is then written with its pickle only)."""


def _name(value: Any, kind: type) -> str:
    if not isinstance(value, kind):
        raise _NotRepresentable(f"{value!r} is not a {kind.__name__}")
    return str(value).removeprefix("torch.")


def _plain(value: Any, depth: int = 0) -> Any:
    """``planner_data`` (DCP's default planner: ``{fqn: (key, index, ...)}``) as tagged JSON."""
    if depth > MAX_METADATA_NESTING:
        raise _NotRepresentable("nested too deep")
    if value is None or type(value) in (bool, str) or (type(value) is int and -_MAX_INT <= value <= _MAX_INT):
        return value
    if type(value) is tuple:
        return {"tuple": [_plain(v, depth + 1) for v in value]}
    if type(value) is list:
        return {"list": [_plain(v, depth + 1) for v in value]}
    if type(value) is dict:
        return {"dict": [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in value.items()]}
    raise _NotRepresentable(f"a {type(value).__name__}")


def metadata_to_json(metadata: Any, pickle_xxh3: int) -> bytes | None:
    """The JSON record of a DCP ``Metadata`` whose pickle has the digest ``pickle_xxh3``, or None
    when the metadata holds what the record cannot (a custom planner's ``planner_data``, storage
    records other than :class:`StoredItem`)."""
    try:
        items: list[dict[str, Any]] = []
        for fqn, md in metadata.state_dict_metadata.items():
            if type(md) is BytesStorageMetadata:
                items.append({"fqn": _text(fqn), "kind": "bytes"})
                continue
            if type(md) is not TensorStorageMetadata:
                raise _NotRepresentable(f"a {type(md).__name__}")
            p = md.properties
            items.append(
                {
                    "fqn": _text(fqn),
                    "kind": "tensor",
                    "dtype": _name(p.dtype, torch.dtype),
                    "layout": _name(p.layout, torch.layout),
                    "requires_grad": bool(p.requires_grad),
                    "memory_format": _name(p.memory_format, torch.memory_format),
                    "pin_memory": bool(p.pin_memory),
                    "size": list(md.size),
                    "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
                }
            )
        storage: list[dict[str, Any]] = []
        for index, stored in (metadata.storage_data or {}).items():
            if type(stored) is not StoredItem or type(index) is not MetadataIndex:
                raise _NotRepresentable(f"a {type(stored).__name__} record")
            storage.append(
                {
                    "fqn": _text(index.fqn),
                    "offset": None if index.offset is None else list(index.offset),
                    "index": index.index,
                    "file": _text(stored.file),
                    "key": _text(stored.key),
                    # A u64 as 16 hex digits: JSON readers other than Python's lose integers above 2**53.
                    "index_xxh3": None if stored.index_xxh3 is None else f"{_digest(stored.index_xxh3):016x}",
                }
            )
        meta = metadata.storage_meta
        record = {
            "format": JSON_FORMAT,
            "pickle_xxh3": f"{pickle_xxh3:016x}",
            "version": metadata.version,
            "storage_meta": None
            if meta is None
            else {
                "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
                "checkpoint_id_is_path": isinstance(meta.checkpoint_id, pathlib.PurePath),
                "save_id": meta.save_id,
                "load_id": meta.load_id,
                "modules": [_text(m) for m in meta.modules],
            },
            "planner_data": _plain(metadata.planner_data),
            "items": items,
            "storage": storage,
        }
    except _NotRepresentable:
        return None
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _digest(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise _NotRepresentable(f"{value!r} is not a u64")
    return value


def _text(value: Any) -> str:
    if type(value) is not str:
        raise _NotRepresentable(f"{value!r} is not a str")
    return value


class _Reader:
    """Checks each field of a JSON record as it is turned into DCP's classes."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, what: str) -> FormatError:
        return FormatError(
            f"{self.where}: the metadata's JSON record is malformed ({what}); restore the checkpoint from another copy"
        )

    def text(self, value: Any, what: str, optional: bool = False) -> Any:
        if (value is None and optional) or type(value) is str:
            return value
        raise self.bad(f"{what} is not a string")

    def count(self, value: Any, what: str, optional: bool = False) -> Any:
        if (value is None and optional) or (type(value) is int and 0 <= value <= _MAX_INT):
            return value
        raise self.bad(f"{what} is not a count")

    def digest(self, value: Any, what: str) -> int | None:
        if value is None:
            return None
        if type(value) is str and len(value) == 16 and all(c in "0123456789abcdef" for c in value):
            return int(value, 16)
        raise self.bad(f"{what} is not 16 hex digits")

    def counts(self, value: Any, what: str) -> torch.Size:
        if not isinstance(value, list) or len(value) > MAX_DIMS:
            raise self.bad(f"{what} is not a list of at most {MAX_DIMS} counts")
        return torch.Size([self.count(v, what) for v in value])

    def named(self, value: Any, kind: type, what: str) -> Any:
        found = getattr(torch, value, None) if type(value) is str and value.isidentifier() else None
        if not isinstance(found, kind):
            raise self.bad(f"{what} {str(value)[:40]!r} is not a torch {kind.__name__}")
        return found

    def obj(self, value: Any, what: str, keys: frozenset[str]) -> dict[str, Any]:
        if type(value) is not dict or set(value) != keys:
            raise self.bad(f"{what} is not an object with the fields {sorted(keys)}")
        return value

    def plain(self, value: Any, depth: int = 0) -> Any:
        if depth > MAX_METADATA_NESTING:
            raise self.bad("planner_data nests too deep")
        if value is None or type(value) in (bool, str, int):
            return value
        if type(value) is dict and len(value) == 1:
            ((tag, items),) = value.items()
            if type(items) is list:
                if tag == "tuple":
                    return tuple(self.plain(v, depth + 1) for v in items)
                if tag == "list":
                    return [self.plain(v, depth + 1) for v in items]
                if tag == "dict" and all(type(p) is list and len(p) == 2 for p in items):
                    return {self.hashable(self.plain(k, depth + 1)): self.plain(v, depth + 1) for k, v in items}
        raise self.bad("planner_data holds a value it cannot")

    def hashable(self, key: Any) -> Any:
        try:
            hash(key)
        except TypeError:
            raise self.bad("planner_data has a key that is not hashable") from None
        return key


_TOP = frozenset({"format", "pickle_xxh3", "version", "storage_meta", "planner_data", "items", "storage"})
_META = frozenset({"checkpoint_id", "checkpoint_id_is_path", "save_id", "load_id", "modules"})
_TENSOR = frozenset({"fqn", "kind", "dtype", "layout", "requires_grad", "memory_format", "pin_memory", "size", "chunks"})
_BYTES = frozenset({"fqn", "kind"})
_STORED = frozenset({"fqn", "offset", "index", "file", "key", "index_xxh3"})


def metadata_from_json(data: bytes, where: str, pickle_xxh3: int) -> Metadata:
    """The DCP ``Metadata`` of a JSON record, which must name ``pickle_xxh3`` (the digest of the
    pickle it stands beside). Nothing is unpickled; every field is checked for type and range.

    Raises:
        FormatError: The record is malformed, of another format, or names another pickle.
    """
    r = _Reader(where)
    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise r.bad(f"not JSON: {type(exc).__name__}") from None
    top = r.obj(record, "the record", _TOP)
    if top["format"] != JSON_FORMAT:
        raise FormatError(
            f"{where}: its JSON record is {str(top['format'])[:60]!r}, not {JSON_FORMAT!r}; a newer nvcomp-checkpoint wrote it: upgrade"
        )
    if top["pickle_xxh3"] != f"{pickle_xxh3:016x}":
        raise FormatError(
            f"{where}: its JSON record names the pickle {str(top['pickle_xxh3'])[:20]!r}, but the pickle beside it is "
            f"{pickle_xxh3:016x}; the metadata is forged or damaged: restore the checkpoint from another copy"
        )
    if type(top["items"]) is not list or type(top["storage"]) is not list:
        raise r.bad("items or storage is not a list")
    state: dict[str, Any] = {}
    for item in top["items"]:
        kind = item.get("kind") if type(item) is dict else None
        if kind == "bytes":
            state[r.text(r.obj(item, "a byte item", _BYTES)["fqn"], "fqn")] = BytesStorageMetadata()
            continue
        t = r.obj(item, "a tensor item", _TENSOR)
        if kind != "tensor" or type(t["requires_grad"]) is not bool or type(t["pin_memory"]) is not bool:
            raise r.bad("an item is neither a tensor nor bytes")
        if type(t["chunks"]) is not list or not all(type(c) is list and len(c) == 2 for c in t["chunks"]):
            raise r.bad("chunks is not a list of [offsets, sizes]")
        state[r.text(t["fqn"], "fqn")] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=r.named(t["dtype"], torch.dtype, "dtype"),
                layout=r.named(t["layout"], torch.layout, "layout"),
                requires_grad=t["requires_grad"],
                memory_format=r.named(t["memory_format"], torch.memory_format, "memory_format"),
                pin_memory=t["pin_memory"],
            ),
            size=r.counts(t["size"], "size"),
            chunks=[ChunkStorageMetadata(offsets=r.counts(o, "offsets"), sizes=r.counts(s, "sizes")) for o, s in t["chunks"]],
        )
    storage: dict[MetadataIndex, StoredItem] = {}
    for entry in top["storage"]:
        e = r.obj(entry, "a storage record", _STORED)
        offset = None if e["offset"] is None else r.counts(e["offset"], "offset")
        index = MetadataIndex(r.text(e["fqn"], "fqn"), offset, r.count(e["index"], "index", optional=True))
        storage[index] = StoredItem(r.text(e["file"], "file"), r.text(e["key"], "key"), r.digest(e["index_xxh3"], "index_xxh3"))
    meta = None
    if top["storage_meta"] is not None:
        m = r.obj(top["storage_meta"], "storage_meta", _META)
        if type(m["modules"]) is not list or type(m["checkpoint_id_is_path"]) is not bool:
            raise r.bad("storage_meta is malformed")
        checkpoint_id = r.text(m["checkpoint_id"], "checkpoint_id", optional=True)
        meta = StorageMeta(
            checkpoint_id=pathlib.Path(checkpoint_id)
            if m["checkpoint_id_is_path"] and checkpoint_id is not None
            else checkpoint_id,
            save_id=r.text(m["save_id"], "save_id", optional=True),
            load_id=r.text(m["load_id"], "load_id", optional=True),
            modules=[r.text(v, "modules") for v in m["modules"]],
        )
    return Metadata(
        state_dict_metadata=state,
        planner_data=r.plain(top["planner_data"]),
        storage_data=storage,
        storage_meta=meta,
        version=r.text(top["version"], "version", optional=True),
    )


def encode_metadata(metadata: Any) -> bytes:
    """``.metadata``: the refusal pickle, the record head and the pickled DCP ``Metadata``, then
    (record version 2) the JSON record naming the pickle's digest. Metadata the JSON record cannot
    hold (a custom planner's ``planner_data``) is written as version 1, the pickle only."""
    payload = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    digest = xxhash.xxh3_64_intdigest(payload)
    text = metadata_to_json(metadata, digest)
    if text is None:
        return REFUSAL_PICKLE + RECORD_HEAD.pack(RECORD_MAGIC, len(payload), digest) + payload
    return (
        REFUSAL_PICKLE
        + RECORD_HEAD.pack(RECORD_MAGIC_JSON, len(payload), digest)
        + payload
        + RECORD_HEAD.pack(JSON_MAGIC, len(text), xxhash.xxh3_64_intdigest(text))
        + text
    )


def _record_start(data: bytes, where: str) -> int:
    """The offset just past the refusal pickle's STOP, found without running the pickle."""
    try:
        for op, _, pos in pickletools.genops(io.BytesIO(data[:4096])):
            if op.name == "STOP" and pos is not None:  # a BytesIO always tells its position
                return pos + 1
    except Exception as exc:  # noqa: BLE001 - damaged bytes raise ValueError and others
        raise FormatError(f"{where}: the metadata's leading record is damaged ({exc})") from exc
    raise FormatError(f"{where}: the metadata's leading record is damaged (no end)")


def decode_metadata(data: bytes, where: str) -> Any:
    """The DCP ``Metadata`` of our ``.metadata`` bytes, every digest checked.

    Version 2 is read from its JSON record (nothing is unpickled); version 1 (older checkpoints)
    is unpickled with the allow-list after the scan.

    Raises:
        FormatError: truncated, a newer record version, a JSON record that names another pickle,
            or (version 1) a type outside the allow-list.
        ChecksumError: the pickle or the JSON does not match its digest.
    """
    start = _record_start(data, where)
    head = data[start : start + RECORD_HEAD.size]
    if len(head) != RECORD_HEAD.size:
        raise FormatError(f"{where}: truncated ({len(data)} bytes); restore the checkpoint from another copy")
    magic, size, digest = RECORD_HEAD.unpack(head)
    if magic[:6] != RECORD_MAGIC[:6]:
        raise FormatError(f"{where}: not an nvcomp-checkpoint DCP metadata record")
    if magic not in (RECORD_MAGIC, RECORD_MAGIC_JSON):
        raise FormatError(
            f"{where}: DCP record version {magic[6]}; this nvcomp-checkpoint reads {RECORD_MAGIC[6]} and "
            f"{RECORD_MAGIC_JSON[6]}. Upgrade it."
        )
    body = start + RECORD_HEAD.size
    payload = data[body : body + size] if size <= MAX_METADATA_BYTES else b""
    rest = data[body + len(payload) :]
    if len(payload) != size or (magic == RECORD_MAGIC and rest):
        raise FormatError(f"{where}: the record claims {size} bytes of metadata, the file holds {len(data) - body} (truncated?)")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise ChecksumError(f"{where}: the checkpoint metadata is corrupt (checksum mismatch); restore it from another copy")
    if magic == RECORD_MAGIC:
        return safe_unpickle(payload, where)
    json_head = rest[: RECORD_HEAD.size]
    if len(json_head) != RECORD_HEAD.size:
        raise FormatError(
            f"{where}: truncated before its JSON record ({len(data)} bytes); restore the checkpoint from another copy"
        )
    json_magic, json_size, json_digest = RECORD_HEAD.unpack(json_head)
    text = rest[RECORD_HEAD.size :]
    if json_magic != JSON_MAGIC or len(text) != json_size:
        raise FormatError(
            f"{where}: its JSON record is damaged (magic {json_magic!r}, claims {json_size} bytes, holds {len(text)}); "
            "restore the checkpoint from another copy"
        )
    if xxhash.xxh3_64_intdigest(text) != json_digest:
        raise ChecksumError(
            f"{where}: the checkpoint metadata's JSON record is corrupt (checksum mismatch); restore it from another copy"
        )
    return metadata_from_json(text, where, digest)
