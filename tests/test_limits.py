"""What a save refuses up front (format limits, trees it cannot store) and which errors reach the
caller (bad paths, a callback's own exception): each names the file and leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import UnsupportedObjectError


def test_object_tree_over_the_format_limit_is_refused_at_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the writer wrote any object tree and the reader refused one over 1 GiB, so the
    # save "succeeded" with a file that never loaded. The limit is lowered to keep the test small.
    import nvcomp_checkpoint.writer as writer_mod

    monkeypatch.setattr(writer_mod, "MAX_INDEX_BYTES", 1 << 20)
    path = tmp_path / "big.nvc"
    with pytest.raises(UnsupportedObjectError, match=r"big\.nvc.*torch tensors"):
        nc.save({"w": torch.ones(4), "blob": bytes(2 << 20)}, path)
    assert not path.exists()


def test_an_index_over_the_format_limit_is_refused_at_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The object tree was bounded, the index (metadata, one entry per tensor) was not.
    import nvcomp_checkpoint.writer as writer_mod

    monkeypatch.setattr(writer_mod, "MAX_INDEX_BYTES", 1 << 20)
    path = tmp_path / "i.nvc"
    with pytest.raises(UnsupportedObjectError, match=r"i\.nvc: metadata"):
        nc.save({"w": torch.ones(4)}, path, metadata={"notes": "x" * (1 << 20)})
    with pytest.raises(UnsupportedObjectError, match=r"i\.nvc: the checkpoint's index \(20000 tensors"):
        nc.save({"t": [torch.full((4,), float(i)) for i in range(20000)]}, path)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_a_tree_that_contains_itself_is_refused(tmp_path: Path) -> None:
    d: dict = {"x": torch.ones(4)}
    d["self"] = d
    path = tmp_path / "c.nvc"
    with pytest.raises(UnsupportedObjectError, match=r"c\.nvc.*contains itself at 'self'"):
        nc.save(d, path)
    assert not path.exists()
    shared = [torch.ones(2)]
    nc.save({"a": shared, "b": shared}, path)  # the same list twice is no cycle
    assert torch.equal(nc.load(path)["b"][0], torch.ones(2))


def test_uninitialized_lazy_parameters_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "l.nvc"
    with pytest.raises(UnsupportedObjectError, match=r"l\.nvc.*'weight'.*forward pass"):
        nc.save(torch.nn.LazyLinear(4).state_dict(), path)
    assert not path.exists()


def test_unpicklable_object_is_a_checkpoint_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.nvc"
    with pytest.raises(UnsupportedObjectError, match="a.nvc"):
        nc.save({"w": torch.ones(3), "fn": lambda: 1}, path)
    assert not path.exists()


def test_open_errors_are_checkpoint_errors(tmp_path: Path) -> None:
    afile = tmp_path / "f.py"
    afile.write_text("x = 1\n")
    with pytest.raises(nc.CheckpointError, match="not a directory"):
        nc.load(afile / "x.nvc")
    with pytest.raises(nc.CheckpointError, match="bogus://x.*fsspec"):
        nc.load("bogus://x")
    with pytest.raises(nc.CheckpointError, match="bogus://x.*fsspec"):
        nc.save({"x": torch.ones(2)}, "bogus://x")
    assert nc.is_nvcomp_checkpoint(afile / "x.nvc") is False


def test_a_callbacks_own_exception_passes_through_save(tmp_path: Path) -> None:
    class Cancelled(Exception):
        pass

    def cancel(_n: int) -> None:
        raise Cancelled("stop")

    path = tmp_path / "c.nvc"
    with pytest.raises(Cancelled):
        nc.save({"w": torch.randn(1000)}, path, progress=cancel)

    def oom(_n: int) -> None:
        raise torch.OutOfMemoryError("fake OOM")

    with pytest.raises(torch.OutOfMemoryError):
        nc.save({"w": torch.randn(1000)}, path, progress=oom)
    assert not path.exists()
