"""The fast paths of save and load: block-wise byte-plane split/join and the load read-ahead.

They must give exactly the bytes of the plain definitions (a strided transpose, one tensor at
a time), whatever the width, alignment, length or number of tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import ChecksumError
from nvcomp_checkpoint.filters import ByteplaneFilter
from nvcomp_checkpoint.reader import READ_AHEAD_TENSORS


def _reference_planes(data: np.ndarray, width: int) -> list[np.ndarray]:
    return [data] if width == 1 else list(data.reshape(-1, width).T.copy())


@pytest.mark.parametrize("width", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("elements", [0, 1, 7, 65_535, 65_536, 300_001])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_split_and_join_match_the_transpose(width, elements, offset):
    rng = np.random.default_rng(width * 1000 + elements + offset)
    backing = rng.integers(0, 256, width * elements + offset, dtype=np.uint8)
    data = backing[offset:]  # unaligned starts happen for tensors that are views into storage
    filt = ByteplaneFilter(width)
    planes = filt.split(data)
    ref = _reference_planes(data, width)
    assert len(planes) == len(ref)
    for got, want in zip(planes, ref):
        assert got.flags.c_contiguous and got.dtype == np.uint8
        assert np.array_equal(got, want)
    out = np.zeros(width * elements + offset, dtype=np.uint8)[offset:]
    filt.join(out, [bytes(p) for p in planes])  # decoders hand back bytes objects
    assert np.array_equal(out, data)


@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), payload=st.binary(max_size=4096))
def test_join_inverts_split(width, payload):
    data = np.frombuffer(payload[: len(payload) // width * width], dtype=np.uint8)
    filt = ByteplaneFilter(width)
    out = np.empty_like(data)
    filt.join(out, filt.split(data))
    assert np.array_equal(out, data)


def test_join_rejects_a_missing_plane():
    with pytest.raises(ValueError, match="needs 4 planes"):
        ByteplaneFilter(4).join(np.empty(8, dtype=np.uint8), [b"ab", b"cd"])


def _many_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tree: dict[str, torch.Tensor] = {}
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.complex64]
    # More tensors than the read-ahead window, so loading cycles through it several times.
    for i in range(3 * READ_AHEAD_TENSORS + 5):
        dtype = dtypes[i % len(dtypes)]
        shape = (i % 7 + 1, 97)
        t = (
            torch.randn(shape, dtype=dtype)
            if dtype.is_floating_point or dtype.is_complex
            else torch.randint(0, 100, shape, dtype=dtype)
        )
        tree[f"t{i}"] = t
    tree["big"] = torch.randn(3 << 20) * 0.01  # 12 MiB: several chunks, decoded in parallel
    tree["view"] = torch.randn(1001)[1:]  # storage offset of one element
    return tree


def test_many_tensors_round_trip_bit_identical(tmp_path):
    tree = _many_tensors()
    nc.save(tree, tmp_path / "many.nvc", workers=2)
    assert_tree_equal(tree, nc.load(tmp_path / "many.nvc"))
    with nc.open(tmp_path / "many.nvc") as reader:
        assert len(reader.entry("big").frames) > 4
        assert all(err is None for _, err in reader.verify())


def test_frame_digests_computed_by_workers_match_the_file(tmp_path):
    tree = {"w": torch.randn(1 << 20), "g": torch.randn(4096).to(torch.bfloat16)}
    nc.save(tree, tmp_path / "d.nvc", workers=3)
    data = (tmp_path / "d.nvc").read_bytes()
    with nc.open(tmp_path / "d.nvc") as reader:
        for key in reader.keys():
            for f in reader.entry(key).frames:
                assert xxhash.xxh3_64_intdigest(data[f.offset : f.offset + f.size]) == f.xxh


def test_corrupt_tensor_behind_the_read_ahead_is_reported(tmp_path):
    tree = _many_tensors()
    path = tmp_path / "bad.nvc"
    nc.save(tree, path)
    with nc.open(path) as reader:
        frame = reader.entry("big").frames[-1]
    raw = bytearray(path.read_bytes())
    raw[frame.offset + frame.size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="'big'"):
        nc.load(path)
