"""The JSON record of our ``.metadata`` (docs/dcp.md): our reader loads a checkpoint we wrote without
unpickling anything, and refuses a JSON record that does not belong to the pickle beside it.

Stock DCP keeps reading the ``.metadata`` pickle (and is refused by its first pickle); checkpoints
without the JSON record (record version 1) load through the pickle scan as before.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from nvcomp_checkpoint.dcp import NvcompReader, NvcompWriter, StoredItem, layout, metadata_file, read_stored_metadata
from nvcomp_checkpoint.errors import ChecksumError, FormatError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HEAD = struct.Struct("<8sQQ")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g)
    return {"model": {"w": w, "tied": w, "b": torch.randn(3, generator=g).bfloat16()}, "extra": {"step": 7, "note": "n"}}


def _target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(16, 8), "tied": torch.zeros(16, 8), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "extra": {"step": 0, "note": ""},
    }


def _load(path: Path) -> dict[str, Any]:
    target = _target()
    dcp.load(target, storage_reader=NvcompReader(path), no_dist=True)
    return target


def _parts(data: bytes) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """(refusal pickle, record head, pickle, JSON head, JSON) of a ``.metadata`` of record version 2."""
    start = len(layout.REFUSAL_PICKLE)
    magic, size, _ = HEAD.unpack_from(data, start)
    assert magic == metadata_file.RECORD_MAGIC_JSON
    body = start + HEAD.size
    json_at = body + size
    return data[:start], data[start:body], data[body:json_at], data[json_at : json_at + HEAD.size], data[json_at + HEAD.size :]


def _assemble(payload: bytes, record: dict[str, Any]) -> bytes:
    """A ``.metadata`` around ``payload`` and ``record``, every digest valid (a forger can compute them)."""
    text = json.dumps(record).encode()
    return (
        layout.REFUSAL_PICKLE
        + HEAD.pack(metadata_file.RECORD_MAGIC_JSON, len(payload), xxhash.xxh3_64_intdigest(payload))
        + payload
        + HEAD.pack(metadata_file.JSON_MAGIC, len(text), xxhash.xxh3_64_intdigest(text))
        + text
    )


@pytest.fixture
def ours(tmp_path: Path) -> Path:
    path = tmp_path / "ours"
    dcp.save(_state(), storage_writer=NvcompWriter(path), no_dist=True)
    return path


def test_the_format_names_are_pinned(ours: Path) -> None:
    assert metadata_file.RECORD_MAGIC_JSON == b"NVCDCP\x02\x00"
    assert metadata_file.JSON_MAGIC == b"NVCDJSON"
    assert metadata_file.JSON_FORMAT == "nvcomp-checkpoint DCP metadata v1"
    assert layout.RECORD_MAGIC == b"NVCDCP\x01\x00"
    _, _, payload, _, text = _parts((ours / ".metadata").read_bytes())
    record = json.loads(text)
    assert sorted(record) == ["format", "items", "pickle_xxh3", "planner_data", "storage", "storage_meta", "version"]
    assert record["pickle_xxh3"] == f"{xxhash.xxh3_64_intdigest(payload):016x}" and record["version"] == "1.0.0"
    w = next(i for i in record["items"] if i["fqn"] == "model.w")
    assert w == {
        "fqn": "model.w",
        "kind": "tensor",
        "dtype": "float32",
        "layout": "strided",
        "requires_grad": False,
        "memory_format": "contiguous_format",
        "pin_memory": False,
        "size": [16, 8],
        "chunks": [[[0, 0], [16, 8]]],
    }
    assert {"fqn": "extra.note", "kind": "bytes"} in record["items"]
    stored = next(s for s in record["storage"] if s["fqn"] == "model.w")
    assert sorted(stored) == ["file", "fqn", "index", "index_xxh3", "key", "offset"] and stored["file"].endswith(".nvcdcp")
    assert sorted(record["storage_meta"]) == ["checkpoint_id", "checkpoint_id_is_path", "load_id", "modules", "save_id"]
    # The pickle beside it is the same Metadata (what our older versions read).
    assert read_stored_metadata(ours) == layout.safe_unpickle(payload, "x")


def test_our_checkpoint_loads_without_unpickling(ours: Path) -> None:
    # Stock DCP reads the pickle, whose first pickle refuses it: it is not what loads ours.
    with pytest.raises(CheckpointException) as info:
        dcp.load(_target(), storage_reader=dcp.FileSystemReader(ours), no_dist=True)
    ((failure, _),) = info.value.failures.values()
    assert "NvcompReader" in str(failure), failure
    # The pickle replaced by bytes no unpickler reads, every digest made to match: ours still loads.
    data = (ours / ".metadata").read_bytes()
    _, _, payload, _, text = _parts(data)
    garbage = b"\xff" * len(payload)
    record = json.loads(text)
    record["pickle_xxh3"] = f"{xxhash.xxh3_64_intdigest(garbage):016x}"
    (ours / ".metadata").write_bytes(_assemble(garbage, record))
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(garbage)
    got = _load(ours)
    assert torch.equal(got["model"]["w"], _state()["model"]["w"]) and got["extra"] == _state()["extra"]
    assert got["model"]["b"].dtype == torch.bfloat16
    from nvcomp_checkpoint.cli.main import main

    assert main(["verify", str(ours)]) == 0


def test_a_json_record_of_another_pickle_is_refused(ours: Path, tmp_path: Path) -> None:
    data = (ours / ".metadata").read_bytes()
    _, _, payload, _, text = _parts(data)
    record = json.loads(text)
    record["pickle_xxh3"] = "0123456789abcdef"
    (ours / ".metadata").write_bytes(_assemble(payload, record))
    with pytest.raises(FormatError, match="names the pickle '0123456789abcdef'") as info:
        read_stored_metadata(ours)
    assert str(ours / ".metadata") in str(info.value)
    # A JSON record whose own digest fails, and one cut short.
    refusal, head, payload, json_head, text = _parts(data)
    (ours / ".metadata").write_bytes(refusal + head + payload + json_head + text.replace(b"model.w", b"model.x"))
    with pytest.raises(ChecksumError, match="JSON record is corrupt"):
        read_stored_metadata(ours)
    (ours / ".metadata").write_bytes(data[:-1])
    with pytest.raises(FormatError, match="JSON record is damaged"):
        read_stored_metadata(ours)


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda r: r["items"][0].update(dtype="os.system"), "is not a torch dtype"),
        (lambda r: r["items"][0].update(size=[-1]), "size is not a count"),
        (lambda r: r["items"][0].update(size=[1] * 65), "at most 64 counts"),
        (lambda r: r["items"][0].update(extra=1), "is not an object with the fields"),
        (lambda r: r["storage"][0].update(file=7), "file is not a string"),
        (lambda r: r.update(planner_data={"eval": "x"}), "planner_data holds a value it cannot"),
        (lambda r: r.update(format="nvcomp-checkpoint DCP metadata v9"), "upgrade"),
    ],
    ids=["dtype", "negative-size", "dims", "unknown-field", "file-type", "planner-data", "format"],
)
def test_a_malformed_json_record_is_refused_naming_the_file(ours: Path, change: Any, words: str) -> None:
    _, _, payload, _, text = _parts((ours / ".metadata").read_bytes())
    record = json.loads(text)
    change(record)
    (ours / ".metadata").write_bytes(_assemble(payload, record))
    with pytest.raises(FormatError, match=words) as info:
        read_stored_metadata(ours)
    assert str(ours / ".metadata") in str(info.value)


def test_deeply_nested_json_is_refused() -> None:
    text = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(FormatError, match="not JSON"):
        metadata_file.metadata_from_json(text, "x/.metadata", 0)


def test_every_kind_of_our_metadata_round_trips_through_json() -> None:
    props = [TensorProperties(dtype=d) for d in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.bool)]
    props.append(TensorProperties(dtype=torch.float16, memory_format=torch.channels_last, requires_grad=True))
    sdm: dict[str, Any] = {
        f"t{i}": TensorStorageMetadata(
            p,
            torch.Size([4, 6]),
            [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6])),
            ],
        )
        for i, p in enumerate(props)
    }
    sdm["obj"] = BytesStorageMetadata()
    storage = {MetadataIndex(f"t{i}", [0, 0], 0): StoredItem("__0_ab.nvcdcp", f"t{i}", 7) for i in range(len(props))}
    storage[MetadataIndex("obj")] = StoredItem("__0_ab.nvcdcp", "bytes:obj")
    planner = {"t0": ("model", "t0"), "obj": ("extra", 3, "obj")}
    for checkpoint_id in (Path("/ckpt/step_1"), "s3://bucket/step_1", None):
        md = Metadata(sdm, planner, storage, StorageMeta(checkpoint_id, "save", None, ["m"]), "1.0.0")
        data = metadata_file.encode_metadata(md)
        assert data[len(layout.REFUSAL_PICKLE) : len(layout.REFUSAL_PICKLE) + 8] == metadata_file.RECORD_MAGIC_JSON
        back = metadata_file.decode_metadata(data, "x/.metadata")
        assert back == md and type(back.storage_meta.checkpoint_id) is type(checkpoint_id)
        assert [type(v) for v in back.planner_data.values()] == [tuple, tuple]


def test_metadata_the_json_record_cannot_hold_is_written_as_a_pickle_only(tmp_path: Path) -> None:
    # A custom planner's planner_data (any object DCP's allow-list reads): record version 1, read
    # through the pickle scan as older checkpoints are.
    md = Metadata({"obj": BytesStorageMetadata()}, {"when": Path("/x")}, {MetadataIndex("obj"): StoredItem("f.nvcdcp", "k")})
    data = metadata_file.encode_metadata(md)
    assert data[len(layout.REFUSAL_PICKLE) : len(layout.REFUSAL_PICKLE) + 8] == layout.RECORD_MAGIC
    assert metadata_file.decode_metadata(data, "x/.metadata") == md
