"""Decoding into the tensor's own memory: the same bytes and the same refusals as decoding to a new
buffer, and a load whose memory beyond its result is a few chunks per worker, not a tensor's frames."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
import xxhash
import zstandard

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal, traced_load_extra, traced_peak
from nvcomp_checkpoint.codecs.cpu import NoneCpuCodec, ZstdCpuCodec
from nvcomp_checkpoint.errors import FormatError
from nvcomp_checkpoint.reader import CheckpointReader

MIB = 1 << 20


def _payload(size: int) -> bytes:
    w = torch.randn((size + 3) // 4, generator=torch.Generator().manual_seed(size)) * 0.02
    return w.view(torch.uint8).numpy().tobytes()[:size]


def _frames(size: int) -> dict[str, bytes]:
    data = _payload(size)
    half = size // 2
    return {
        "ours": ZstdCpuCodec(1).encode(memoryview(data)),
        "level 3": zstandard.ZstdCompressor(level=3).compress(data),
        "no declared size": zstandard.ZstdCompressor(write_content_size=False).compress(data),
        # nvCOMP's batched encoder may write a chunk as frames back to back.
        "two frames": zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:]),
    }


@pytest.mark.parametrize(
    ("kind", "size"),
    [(kind, size) for kind in ("ours", "level 3", "two frames") for size in (0, 100, 70_000, 3 * MIB + 5)]
    + [("no declared size", size) for size in (100, 70_000, 3 * MIB + 5)],
)
def test_decode_into_writes_what_decode_returns(size: int, kind: str) -> None:
    codec = ZstdCpuCodec(1)
    frame = memoryview(_frames(size)[kind])
    out = np.full(size, 0xAB, dtype=np.uint8)
    codec.decode_into(frame, memoryview(out))
    assert out.tobytes() == bytes(codec.decode(frame, size)) == _payload(size)


@pytest.mark.parametrize("delta", [-1, 1, 4096])
def test_decode_into_refuses_a_frame_of_another_size(delta: int) -> None:
    size = 3 * MIB
    frame = memoryview(_frames(size)["ours"])
    out = np.empty(size + delta, dtype=np.uint8)
    with pytest.raises(FormatError):
        ZstdCpuCodec(1).decode_into(frame, memoryview(out))


@pytest.mark.parametrize("cut", [1, 1000])
def test_decode_into_refuses_a_truncated_frame(cut: int) -> None:
    size = 3 * MIB
    frame = _frames(size)["ours"]
    with pytest.raises(FormatError):
        ZstdCpuCodec(1).decode_into(memoryview(frame[:-cut]), memoryview(np.empty(size, dtype=np.uint8)))


def test_raw_frames_decode_into_only_at_their_size() -> None:
    out = np.empty(4, dtype=np.uint8)
    NoneCpuCodec().decode_into(memoryview(b"abcd"), memoryview(out))
    assert out.tobytes() == b"abcd"
    with pytest.raises(FormatError):
        NoneCpuCodec().decode_into(memoryview(b"abc"), memoryview(out))


def _tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "fp32": torch.randn(3 * MIB + 7, generator=g) * 0.02,  # rotated planes, several chunks
        "bf16": (torch.randn(5 * MIB + 1, generator=g) * 0.02).to(torch.bfloat16),
        "fp64": torch.randn(MIB, generator=g, dtype=torch.float64),  # byte planes, strided join
        "int": torch.randint(0, 7, (MIB,), generator=g, dtype=torch.int64),
        "bytes": torch.randint(0, 3, (3 * MIB,), generator=g, dtype=torch.uint8),  # one plane: into the tensor
        "small": torch.arange(5, dtype=torch.float16),
    }


def test_local_reads_in_the_workers_and_fsspec_reads_decode_the_same(tmp_path: Path) -> None:
    tree = _tree()
    path = tmp_path / "a.nvc"
    nc.save(tree, path)
    url = f"memory://{tmp_path.name}/a.nvc"
    nc.save(tree, url)
    try:
        for workers in (1, 3):
            with CheckpointReader(path, workers=workers) as local:
                assert local._fd is not None  # read by the workers, chunk by chunk
                assert_tree_equal(local.load(), tree)
            with CheckpointReader(url, workers=workers) as remote:
                assert remote._fd is None  # read by the workers through the stream, a batch of chunks at a time
                assert_tree_equal(remote.load(), tree)
    finally:
        fsspec.filesystem("memory").rm(url, recursive=True)


def test_a_load_holds_a_few_chunks_per_worker_beyond_its_result(tmp_path: Path) -> None:
    # 64 MiB of noise that does not compress: before, the reader held a tensor's whole
    # stored bytes (about 60 MB here) while its chunks were decoded.
    tree = {"w": torch.randn(16 * MIB, generator=torch.Generator().manual_seed(2))}
    path = tmp_path / "big.nvc"
    nc.save(tree, path)
    chunk = 4 * MIB
    workers = 2
    with CheckpointReader(path, workers=workers) as reader:
        extra = traced_load_extra(reader, tree)
    # Per worker: one chunk's stored bytes read and one chunk's decoded planes.
    assert extra < workers * 2 * chunk + 4 * MIB, f"{extra / MIB:.1f} MiB beyond the result"


def _with_index(path: Path, edit) -> None:
    """``path`` with its index JSON edited by ``edit``, its digest and footer valid again."""
    data = path.read_bytes()
    offset, _, _, magic = struct.unpack("<QQQ8s", data[-32:])
    doc = json.loads(data[offset:-32])
    edit(doc)
    index = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(data[:offset] + index + struct.pack("<QQQ8s", offset, len(index), xxhash.xxh3_64_intdigest(index), magic))


def test_forged_planes_far_apart_are_read_without_the_bytes_between(tmp_path: Path) -> None:
    # The one chunk of "a" claims its own first byte plane and the second of "b", with 8 MiB of
    # "big" stored between them. Before, each worker read the whole span into its buffer: a
    # forged index could make every worker allocate the file's size.
    g = torch.Generator().manual_seed(6)
    tree = {
        "a": torch.randn(32 << 10, generator=g).half(),
        "big": torch.randint(0, 255, (8 * MIB,), dtype=torch.uint8, generator=g),
        "b": torch.randn(32 << 10, generator=g).half(),
    }
    path = tmp_path / "far.nvc"
    nc.save(tree, path, policy=nc.CodecPolicy.uniform("zstd:1:byteplane"))

    def a_takes_a_plane_of_b(doc) -> None:
        a, big, b = (next(t for t in doc["tensors"] if t["key"] == k) for k in ("a", "big", "b"))
        assert a["frames"][0][0] < big["frames"][0][0] < b["frames"][1][0]
        a["frames"] = [a["frames"][0], b["frames"][1]]
        b.update(shape=[0], frames=[])

    _with_index(path, a_takes_a_plane_of_b)
    with CheckpointReader(path, workers=1) as reader:
        loaded, peak = traced_peak(lambda: reader.read("a"))
    planes = torch.stack([tree["a"].view(torch.uint8)[0::2], tree["b"].view(torch.uint8)[1::2]], dim=1)
    assert torch.equal(loaded.view(torch.uint8), planes.reshape(-1))
    assert peak < 2 * MIB, f"{peak / MIB:.1f} MiB to read 64 KiB"
