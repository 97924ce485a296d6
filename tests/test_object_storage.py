"""Checkpoints on object storage through a real S3 endpoint (moto's server) and fsspec memory.

The object appears only when its upload completes: a failed save (single PUT or multipart)
leaves the previous object as it was and no multipart upload behind.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import FormatError, UnsupportedObjectError
from nvcomp_checkpoint.format.layout import GUARD

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "checkpoints"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on a free local port, with one bucket; yields client and options."""
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)  # dummies, so nothing ever reaches real AWS credentials
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "x", "secret": "y"}
        yield {"client": client, "options": options, "endpoint": endpoint}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _trained_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2 + seed}


def _object(s3: dict[str, Any], key: str) -> bytes:
    return s3["client"].get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _pending_uploads(s3: dict[str, Any]) -> list[Any]:
    return s3["client"].list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])


def test_s3_save_load_roundtrip(s3):
    url = f"s3://{BUCKET}/run/ckpt.nvc"
    state = _trained_state()
    report = nc.save(state, url, storage_options=s3["options"])
    head = s3["client"].head_object(Bucket=BUCKET, Key="run/ckpt.nvc")
    assert head["ContentLength"] == report.stored_bytes and report.ratio > 1.0
    assert nc.is_nvcomp_checkpoint(url, storage_options=s3["options"])
    assert_tree_equal(state, nc.load(url, storage_options=s3["options"]))
    # The object is a complete checkpoint: the same bytes load from a local copy too.
    assert _object(s3, "run/ckpt.nvc")[len(GUARD) : len(GUARD) + 6] == b"NVCKPT"


def test_s3_open_reads_one_tensor_by_range(s3):
    url = f"s3://{BUCKET}/run/big.nvc"
    g = torch.Generator().manual_seed(1)
    tree = {f"layer{i}": torch.randn(1 << 20, generator=g) for i in range(6)}  # 24 MiB, about 20 stored
    tree["small"] = torch.arange(1000, dtype=torch.float32)
    nc.save(tree, url, storage_options=s3["options"])
    # Small blocks so that what is fetched shows what the reader asked for.
    options = dict(s3["options"], default_block_size=1 << 20, default_cache_type="bytes")
    with nc.open(url, storage_options=options) as reader:
        size = reader.file_bytes
        assert size > 16 << 20
        assert torch.equal(reader.read("small"), tree["small"])
        assert torch.equal(reader.read("layer3"), tree["layer3"])
        fetched = reader._stream.cache.total_requested_bytes
    print(f"range reads fetched {fetched} of {size} bytes")
    # The index, one small tensor and one 4 MiB tensor: far less than the whole object.
    assert fetched < size / 3, (fetched, size)


def test_s3_failed_save_keeps_previous_object(s3):
    url = f"s3://{BUCKET}/run/keep.nvc"
    first = _trained_state(0)
    nc.save(first, url, storage_options=s3["options"])
    before = _object(s3, "run/keep.nvc")

    # An unsupported tensor found while planning.
    with pytest.raises(UnsupportedObjectError):
        nc.save({"w": torch.ones(8), "bad": torch.empty(3, device="meta")}, url, storage_options=s3["options"])
    assert _object(s3, "run/keep.nvc") == before

    # A callback that raises in the middle of a small (single PUT) save.
    def fail_soon(nbytes: int) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        nc.save(_trained_state(1), url, storage_options=s3["options"], progress=fail_soon)
    assert _object(s3, "run/keep.nvc") == before
    assert_tree_equal(first, nc.load(url, storage_options=s3["options"]))


def test_s3_failed_multipart_save_is_aborted(s3):
    url = f"s3://{BUCKET}/run/multipart.nvc"
    options = dict(s3["options"], default_block_size=5 << 20)  # S3's smallest part size
    first = {"w": torch.arange(5000, dtype=torch.float32)}
    nc.save(first, url, storage_options=options)
    before = _object(s3, "run/multipart.nvc")

    g = torch.Generator().manual_seed(2)
    big = {"w": torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=g)}  # stored raw
    written = []
    in_flight = []

    def fail_late(nbytes: int) -> None:
        written.append(nbytes)
        if sum(written) >= 12 << 20:  # two 5 MiB parts are uploaded by now
            in_flight.extend(_pending_uploads(s3))
            raise RuntimeError("interrupted upload")

    with pytest.raises(RuntimeError, match="interrupted upload"):
        nc.save(big, url, storage_options=options, progress=fail_late)
    assert len(in_flight) == 1  # the failure really hit a multipart upload in progress
    assert _object(s3, "run/multipart.nvc") == before
    assert _pending_uploads(s3) == []  # the multipart upload was aborted, no parts billed

    # And a successful multipart save replaces the object.
    report = nc.save(big, url, storage_options=options)
    assert s3["client"].head_object(Bucket=BUCKET, Key="run/multipart.nvc")["ContentLength"] == report.stored_bytes
    assert_tree_equal(big, nc.load(url, storage_options=options))


def test_s3_missing_object(s3):
    with pytest.raises(FormatError, match="no such checkpoint") as info:
        nc.load(f"s3://{BUCKET}/run/missing.nvc", storage_options=s3["options"])
    assert isinstance(info.value, FileNotFoundError)  # as a local missing file
    assert not nc.is_nvcomp_checkpoint(f"s3://{BUCKET}/run/missing.nvc", storage_options=s3["options"])


def test_memory_filesystem_roundtrip():
    import fsspec

    fs = fsspec.filesystem("memory")
    url = "memory://nvckpt-tests/run/ckpt.nvc"
    state = _trained_state()
    report = nc.save(state, url)
    assert fs.size("/nvckpt-tests/run/ckpt.nvc") == report.stored_bytes
    assert_tree_equal(state, nc.load(url))
    with nc.open(url) as reader:
        assert torch.equal(reader.read("model/0.weight"), state["model"]["0.weight"])
        assert reader.summary()["exp_avg"].tensors == 4

    # A failed save leaves the previous file and no temporary file behind.
    before = fs.cat_file("/nvckpt-tests/run/ckpt.nvc")
    with pytest.raises(UnsupportedObjectError):
        nc.save({"bad": torch.empty(2, device="meta")}, url)
    assert fs.cat_file("/nvckpt-tests/run/ckpt.nvc") == before
    assert fs.ls("/nvckpt-tests/run", detail=False) == ["/nvckpt-tests/run/ckpt.nvc"]
    fs.rm("/nvckpt-tests", recursive=True)


def test_s3_storage_implements_every_operation(s3, tmp_path):
    from nvcomp_checkpoint.storage import storage_for
    from test_storage_interface import exercise_every_operation

    storage, root = storage_for(f"s3://{BUCKET}/interface", s3["options"])
    assert storage.is_object_store and not storage.is_local
    exercise_every_operation(storage, root)
    assert storage.bucket_exists("s3://no-such-bucket/run") is False
    # What only an object store does: a parallel multipart upload, and aborting one a killed process left.
    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(11 << 20))
    seen: list[int] = []
    assert storage.upload_file(os.fspath(local), f"{root}/big.bin", 5 << 20, 2, seen.append)
    assert _object(s3, "interface/big.bin") == local.read_bytes() and sum(seen) == local.stat().st_size
    killed = s3["client"].create_multipart_upload(Bucket=BUCKET, Key="interface/killed.bin")["UploadId"]
    assert storage.abort_unfinished_uploads(root) == [f"{BUCKET}/interface/killed.bin"]
    assert killed not in [u["UploadId"] for u in _pending_uploads(s3)]
