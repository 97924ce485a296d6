"""Regressions for bugs found in the core review; each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import UnsupportedObjectError


def test_async_save_of_one_element_strided_view(tmp_path: Path) -> None:
    # ``x[::2]`` of two elements is "contiguous" with stride 2, which view(uint8) refuses;
    # the synchronous save handled it, the async snapshot raised RuntimeError.
    x = torch.arange(2.0)[::2]
    assert x.is_contiguous() and x.stride() == (2,)
    path = tmp_path / "a.nvc"
    nc.save_async({"x": x}, path).result()
    assert torch.equal(nc.load(path)["x"], x)


def test_unpicklable_object_is_a_checkpoint_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.nvc"
    with pytest.raises(UnsupportedObjectError, match="a.nvc"):
        nc.save({"w": torch.ones(3), "fn": lambda: 1}, path)
    assert not path.exists()


def test_out_of_range_zstd_level_is_refused_when_the_spec_is_made() -> None:
    # Before: accepted here, then a bare ValueError from zstandard in a worker mid-save.
    with pytest.raises(ValueError, match="level"):
        nc.CodecSpec(codec="zstd", level=99)
    with pytest.raises(ValueError, match="level"):
        nc.CodecSpec(codec="gdeflate", level=9)
    nc.CodecSpec(codec="zstd", level=22)
    nc.CodecSpec(codec="zstd", level=-5)


def test_empty_tensors_are_not_merged_into_one(tmp_path: Path) -> None:
    # Every zero-size storage has data_ptr 0: unrelated empty tensors looked tied.
    path = tmp_path / "a.nvc"
    nc.save({"a": torch.zeros(0), "b": torch.nn.Parameter(torch.zeros(0))}, path)
    out = nc.load(path)
    assert type(out["a"]) is torch.Tensor and not out["a"].requires_grad
    assert isinstance(out["b"], torch.nn.Parameter)


def test_parameter_and_its_detached_view_keep_their_own_kind(tmp_path: Path) -> None:
    # torch.save keeps a Parameter and ``p.detach()`` apart; they were merged into one
    # Parameter that requires grad, so in-place updates of the detached copy failed.
    w = torch.nn.Parameter(torch.randn(8))
    path = tmp_path / "a.nvc"
    nc.save({"a": w, "b": w.detach()}, path)
    out = nc.load(path)
    assert isinstance(out["a"], torch.nn.Parameter) and out["a"].requires_grad
    assert type(out["b"]) is torch.Tensor and not out["b"].requires_grad
    assert torch.equal(out["a"].detach(), out["b"])
    out["b"].add_(1)  # a plain tensor: in-place update allowed


def test_raw_frame_of_the_wrong_size_is_refused_at_open(tmp_path):
    """A `none` frame shorter than the shape needs is damage, found before any decoder runs."""
    import json

    import xxhash

    from nvcomp_checkpoint.errors import FormatError
    from nvcomp_checkpoint.format.layout import FOOTER, pack_footer

    path = tmp_path / "raw.nvc"
    nc.save({"w": torch.arange(4096, dtype=torch.float32)}, path, policy=nc.CodecPolicy.uniform("none"))
    data = bytearray(path.read_bytes())
    offset, size, _, _ = FOOTER.unpack(bytes(data[-FOOTER.size :]))
    index = json.loads(bytes(data[offset : offset + size]))
    index["tensors"][0]["frames"][0][1] -= 1
    blob = json.dumps(index, separators=(",", ":")).encode()
    forged = bytes(data[:offset]) + blob + pack_footer(offset, len(blob), xxhash.xxh3_64_intdigest(blob))
    path.write_bytes(forged)
    with pytest.raises(FormatError, match="raw frame"):
        nc.open(path)


def test_verify_reports_every_tensor_even_after_a_bad_one(tmp_path):
    path = tmp_path / "two.nvc"
    nc.save({"a": torch.randn(50_000), "b": torch.randn(50_000)}, path)
    with nc.open(path) as reader:
        first = reader.entry("a").frames[0]
    data = bytearray(path.read_bytes())
    data[first.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with nc.open(path) as reader:
        results = {entry.key: err for entry, err in reader.verify()}
    assert set(results) == {"a", "b"}
    assert results["a"] is not None and "'a'" in str(results["a"])
    assert results["b"] is None
