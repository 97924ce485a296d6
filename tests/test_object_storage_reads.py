"""Reading checkpoints from object storage (moto's S3 server in a process of its own): the decoding
workers read consecutive chunks in ranged requests, so memory beyond the result holds the reads in
flight, not a tensor's stored bytes; small tensors stored back to back share a request; a forged
index can make neither a request span the file nor a request per byte.

Requests are counted in the server's own log (one line per request it answered).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
import nvcomp_checkpoint.reader as reader_module
from conftest import assert_tree_equal, environ_set, start_moto_server, traced_load_extra, traced_peak
from nvcomp_checkpoint.errors import CheckpointError, FormatError
from nvcomp_checkpoint.reader import CheckpointReader

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "reads"
MIB = 1 << 20
_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3:
    """The server, a client, the reader's storage options and the server's log of requests."""

    def __init__(self, endpoint: str, log: Path) -> None:
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
        self.log = log

    def gets(self, key: str) -> int:
        """GET requests the server has answered for ``key`` so far."""
        return self.log.read_text(errors="replace").count(f"GET /{BUCKET}/{key} ")

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)
        return f"s3://{BUCKET}/{key}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    with environ_set(_AWS_ENV):  # dummies: nothing reaches real AWS credentials
        log = tmp_path_factory.mktemp("moto") / "moto_server.log"
        proc, port = start_moto_server(dict(os.environ), log)
        try:
            server = S3(f"http://127.0.0.1:{port}", log)
            server.client.create_bucket(Bucket=BUCKET)
            yield server
        finally:
            proc.kill()
            proc.wait()


def _saved(tmp_path: Path, tree: dict[str, Any], policy: nc.CodecPolicy | None = None) -> bytes:
    path = tmp_path / "saved.nvc"
    nc.save(tree, path, policy=policy)
    return path.read_bytes()


def _with_index(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``data`` with its index JSON edited by ``edit``, its digest and footer valid again."""
    offset, _, _, magic = struct.unpack("<QQQ8s", data[-32:])
    doc = json.loads(data[offset:-32])
    edit(doc)
    index = json.dumps(doc, separators=(",", ":")).encode()
    return data[:offset] + index + struct.pack("<QQQ8s", offset, len(index), xxhash.xxh3_64_intdigest(index), magic)


def _tensor(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if t["key"] == key)


_RAW = nc.CodecPolicy.uniform("none")


def test_a_large_tensor_is_read_in_ranged_requests_by_the_workers(s3: S3, tmp_path: Path, monkeypatch) -> None:
    # Before, the calling thread read the tensor's whole stored bytes (about 8 MiB here) in one
    # request and held them while its chunks were decoded. Reads of 1 MiB make the bound
    # measurable on a small tensor.
    monkeypatch.setattr(reader_module, "REMOTE_READ_BYTES", MIB, raising=False)
    chunk = 256 << 10
    tree = {"w": torch.randn(2 * MIB, generator=torch.Generator().manual_seed(3))}
    policy = nc.CodecPolicy.uniform(nc.CodecSpec("zstd", 1, "byteplane", chunk_bytes=chunk))
    url = s3.put("large.nvc", _saved(tmp_path, tree, policy))
    workers = 2
    with CheckpointReader(url, storage_options=s3.options, workers=workers) as reader:
        before = s3.gets("large.nvc")
        extra = traced_load_extra(reader, tree)
        requests = s3.gets("large.nvc") - before
    # Per worker: one read of 1 MiB and one chunk's planes; the HTTP client's buffers besides.
    assert extra < workers * (MIB + chunk) + 2 * MIB, f"{extra / MIB:.1f} MiB beyond the result"
    stored = reader.entry("w").stored_bytes
    assert stored // MIB <= requests <= stored // MIB + 3  # the object tree, then reads of 1 MiB


def test_small_tensors_stored_back_to_back_share_a_request(s3: S3, tmp_path: Path) -> None:
    tree = {f"b{i}": torch.full((64,), float(i)) for i in range(130)}
    url = s3.put("small.nvc", _saved(tmp_path, tree))
    with CheckpointReader(url, storage_options=s3.options) as reader:
        before = s3.gets("small.nvc")
        loaded = reader.load()
        requests = s3.gets("small.nvc") - before
        many = dict(reader.read_many([f"b{i}" for i in range(0, 130, 2)]))
    assert_tree_equal(loaded, tree)
    assert_tree_equal(many, {f"b{i}": tree[f"b{i}"] for i in range(0, 130, 2)})
    # A tensor finished hands its batch to a worker; load() finishes one once 64 are ahead of it.
    assert requests <= 1 + 130 // reader_module.READ_AHEAD_TENSORS, f"{requests} requests for 130 tensors of 256 bytes"


def test_tiny_frames_back_to_back_load_in_one_request(s3: S3, tmp_path: Path) -> None:
    # A valid index may cut a tensor into chunks of one element: 2048 frames of one byte each,
    # stored back to back. They are read together, not a request per frame.
    values = torch.arange(2048, dtype=torch.int32).to(torch.uint8)
    data = _saved(tmp_path, {"w": values}, _RAW)

    def one_byte_chunks(doc: dict[str, Any]) -> None:
        w = _tensor(doc, "w")
        at = w["frames"][0][0]
        raw = values.numpy().tobytes()
        w["chunk_bytes"] = 1
        w["frames"] = [[at + i, 1, f"{xxhash.xxh3_64_intdigest(raw[i : i + 1]):016x}"] for i in range(len(raw))]

    url = s3.put("tiny.nvc", _with_index(data, one_byte_chunks))
    with CheckpointReader(url, storage_options=s3.options) as reader:
        before = s3.gets("tiny.nvc")
        loaded = reader.read("w")
        requests = s3.gets("tiny.nvc") - before
    assert torch.equal(loaded, values)
    assert requests <= 1


def test_forged_frames_one_byte_apart_are_refused_before_a_request(s3: S3, tmp_path: Path) -> None:
    # 4096 frames of one byte with a byte between each: a request per frame where reads are
    # requests. Before, they were read as one span and decoded.
    values = torch.arange(8192, dtype=torch.int32).to(torch.uint8)
    data = _saved(tmp_path, {"w": values}, _RAW)
    raw = values.numpy().tobytes()

    def every_other_byte(doc: dict[str, Any]) -> None:
        w = _tensor(doc, "w")
        at = w["frames"][0][0]
        w["shape"] = [len(raw) // 2]
        w["chunk_bytes"] = 1
        w["frames"] = [[at + i, 1, f"{xxhash.xxh3_64_intdigest(raw[i : i + 1]):016x}"] for i in range(0, len(raw), 2)]

    url = s3.put("scattered.nvc", _with_index(data, every_other_byte))
    with CheckpointReader(url, storage_options=s3.options) as reader:
        before = s3.gets("scattered.nvc")
        with pytest.raises(FormatError, match=r"scattered.nvc: tensor 'w': its 4096 frames .* lie in 4096 separate places"):
            reader.read("w")
        with pytest.raises(FormatError, match="separate places"):
            reader.load()
        assert [entry.key for entry, error in reader.verify() if isinstance(error, FormatError)] == ["w"]
        assert s3.gets("scattered.nvc") - before <= 2  # the object tree (load, verify), no frame


def test_forged_frames_far_apart_read_no_bytes_between(s3: S3, tmp_path: Path) -> None:
    # Tensor "a" claims its own frame and that of "b", with 8 MiB of "big" stored between them.
    # Before, reading "a" read the whole span between its first and last frame in one request.
    tree = {
        "a": torch.arange(64 << 10, dtype=torch.int32).to(torch.uint8),
        "big": torch.randint(0, 255, (8 * MIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)),
        "b": torch.full((64 << 10,), 7, dtype=torch.uint8),
    }
    data = _saved(tmp_path, tree, _RAW)

    def a_takes_b(doc: dict[str, Any]) -> None:
        a, b, big = _tensor(doc, "a"), _tensor(doc, "b"), _tensor(doc, "big")
        assert a["frames"][0][0] < big["frames"][0][0] < b["frames"][0][0]
        a.update(shape=[2 * (64 << 10)], chunk_bytes=64 << 10, frames=a["frames"] + b["frames"])
        b.update(shape=[0], frames=[])

    url = s3.put("far.nvc", _with_index(data, a_takes_b))
    with CheckpointReader(url, storage_options=s3.options) as reader:
        loaded, peak = traced_peak(lambda: reader.read("a"))
    assert torch.equal(loaded, torch.cat([tree["a"], tree["b"]]))
    assert peak < 2 * MIB, f"{peak / MIB:.1f} MiB to read 128 KiB"


def test_a_truncated_object_is_refused_naming_it(s3: S3, tmp_path: Path) -> None:
    data = _saved(tmp_path, {"w": torch.randn(300_000)})
    url = s3.put("cut.nvc", data[: len(data) // 2])
    with pytest.raises(FormatError, match="cut.nvc: .*truncated"):
        nc.load(url, storage_options=s3.options)


def test_an_object_replaced_after_open_is_refused_naming_it(s3: S3, tmp_path: Path) -> None:
    # The reader's ranged requests name the object as it was opened (its ETag): a shorter one
    # put at the key meanwhile is refused, never read as part of the first.
    data = _saved(tmp_path, {"w": torch.randn(1 << 20)})
    url = s3.put("replaced.nvc", data)
    with CheckpointReader(url, storage_options=s3.options) as reader:
        s3.put("replaced.nvc", data[: len(data) // 2])
        with pytest.raises(CheckpointError, match="replaced.nvc: the file was replaced or changed since it was opened"):
            reader.load()


def test_a_delta_and_its_base_load_from_s3(s3: S3) -> None:
    # The delta's chunks are undone against its base's, each base tensor read through ranged requests too.
    g = torch.Generator().manual_seed(5)
    first = {"w": torch.randn(600_000, generator=g), "b": torch.randn(100, generator=g)}
    second = {"w": first["w"] + torch.randn(600_000, generator=g) * 1e-4, "b": first["b"].clone()}
    base, delta = f"s3://{BUCKET}/chain/a.nvc", f"s3://{BUCKET}/chain/b.nvc"
    nc.save(first, base, storage_options=s3.options)
    nc.save(second, delta, base=base, storage_options=s3.options)
    with CheckpointReader(delta, storage_options=s3.options) as reader:
        assert reader.chain is not None and reader.entry("w").delta is not None
        assert_tree_equal(reader.load(), second)
