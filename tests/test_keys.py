"""Keys of stored tensors: every path in the tree gets a key of its own, tied tensors are one entry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc


def test_paths_that_print_alike_get_keys_of_their_own(tmp_path: Path) -> None:
    t1, t2, t3, t4 = (torch.full((4,), float(i)) for i in range(1, 5))
    path = tmp_path / "k.nvc"
    nc.save({"a/b": t1, "a": {"b": t2}, 0: t3, "0": t4}, path)
    with nc.open(path) as reader:
        keys = reader.keys()
        assert len(keys) == len(set(keys)) == 4
        got = sorted(reader.read(k)[0].item() for k in keys)
    assert got == [1.0, 2.0, 3.0, 4.0]
    back = nc.load(path)
    assert back["a/b"][0] == 1 and back["a"]["b"][0] == 2 and back[0][0] == 3 and back["0"][0] == 4


def test_tied_weights_are_readable_by_every_path(tmp_path: Path) -> None:
    w = torch.randn(100, 16)
    path = tmp_path / "t.nvc"
    nc.save({"model": {"embed.weight": w, "lm_head.weight": w}}, path)
    with nc.open(path) as reader:
        assert set(reader.keys()) == {"model/embed.weight", "model/lm_head.weight"}
        assert torch.equal(reader.read("model/lm_head.weight"), w)
        assert reader.entry("model/lm_head.weight") is reader.entry("model/embed.weight")
        assert len(reader.index.tensors) == 1  # still stored once


def test_a_tied_path_that_prints_like_another_key_is_still_reachable(tmp_path: Path) -> None:
    t, y = torch.full((4,), 1.0), torch.full((4,), 2.0)
    path = tmp_path / "a.nvc"
    nc.save({"x": t, "a/b": y, "a": {"b": t}}, path)
    with nc.open(path) as reader:
        assert sorted(reader.keys()) == ["a/b", "a/b#2", "x"]
        assert torch.equal(reader.read("a/b"), y) and torch.equal(reader.read("a/b#2"), t)


def test_keys_stay_listed_when_the_object_tree_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "d.nvc"
    nc.save({"a": torch.randn(1000), "b": torch.randn(1000), "step": 5}, path)
    with nc.open(path) as reader:
        offset = reader.index.skeleton.offset
    data = bytearray(path.read_bytes())
    data[offset + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    with nc.open(path) as reader:
        assert reader.keys() == ["a", "b"]
        assert reader.read("a").numel() == 1000
        with pytest.raises(KeyError):
            reader.entry("nope")
    with pytest.raises(nc.CheckpointError, match="object tree is corrupt"):
        nc.load(path)


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


def test_async_save_of_one_element_strided_view(tmp_path: Path) -> None:
    # ``x[::2]`` of two elements is "contiguous" with stride 2, which view(uint8) refuses;
    # the synchronous save handled it, the async snapshot raised RuntimeError.
    x = torch.arange(2.0)[::2]
    assert x.is_contiguous() and x.stride() == (2,)
    path = tmp_path / "a.nvc"
    nc.save_async({"x": x}, path).result()
    assert torch.equal(nc.load(path)["x"], x)
