"""Async saves whose background write starts while the snapshot is still copying.

The snapshot copies host tensors in the tree's order on its copy threads; the writer compresses
each tensor once its copy is done, and ``save_async`` returns once every copy is. A copy is
held or failed here by replacing the snapshot's byte copy (``snapshot._copy_bytes``): there is no
other way to make a memcpy fail or wait; everything else is real (files, threads, the writer).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
import torch

import nvcomp_checkpoint as nc
import nvcomp_checkpoint.snapshot as snapshot_mod
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointWriteError

#: Fixed, so that the sync and the async file can be compared byte for byte.
SAME_TIME = {"created": 0.0}


@pytest.fixture(autouse=True)
def _no_leftover_saves():
    yield
    nc.wait_for_saves(timeout=60)


def big_tree(seed: int = 0) -> dict[str, Any]:
    """Over 32 MiB of host tensors, so the snapshot copies on its threads, in 8 MiB jobs."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(300, generator=gen)
    return {
        "model": {
            "embed": torch.randn(3_000_000, generator=gen).to(torch.bfloat16),
            "layers": [torch.randn(257, 129, generator=gen) for _ in range(40)],
            "strided": torch.randn(64, 48, generator=gen).t()[::2],
            "param": torch.nn.Parameter(torch.randn(20, 20, generator=gen)),
        },
        "optimizer": {
            "exp_avg": torch.randn(4_000_000, generator=gen),
            "exp_avg_sq": torch.randn(4_000_000, generator=gen).abs(),
            "step": torch.tensor(7.0),
        },
        "tied": [shared, shared],
        "empty": torch.empty(0, 3),
        "late": torch.randn(1_000_000, generator=gen),  # the last tensor copied
        "meta": {"step": 7, "seen": [1, 2]},
    }


def pointer(t: torch.Tensor) -> int:
    return t.data_ptr()


def src_pointer(src: np.ndarray) -> int:
    return int(src.__array_interface__["data"][0])


class FirstWrite:
    """Passes writes on; ``started`` is set at the first one (the magic, before any tensor)."""

    def __init__(self, inner: IO[bytes], started: threading.Event) -> None:
        self.inner, self.started = inner, started

    def write(self, data: Any) -> int:
        self.started.set()
        return self.inner.write(data)


@pytest.mark.parametrize("overlap", [True, False])
def test_async_file_is_byte_identical_to_the_sync_save(tmp_path: Path, overlap: bool) -> None:
    tree = big_tree()
    nc.save(tree, tmp_path / "sync.nvc", metadata=SAME_TIME)
    with nc.AsyncSaver(overlap=overlap) as saver:
        saver.save(tree, tmp_path / "async.nvc", metadata=SAME_TIME).result(timeout=120)
        # A second save reuses the first one's snapshot memory.
        saver.save(tree, tmp_path / "async2.nvc", metadata=SAME_TIME).result(timeout=120)
    sync = (tmp_path / "sync.nvc").read_bytes()
    assert (tmp_path / "async.nvc").read_bytes() == sync
    assert (tmp_path / "async2.nvc").read_bytes() == sync


def test_overlapped_delta_file_is_byte_identical_to_the_sync_delta(tmp_path: Path) -> None:
    base = big_tree()
    nc.save(base, tmp_path / "base.nvc")
    tree = big_tree()
    with torch.no_grad():
        tree["optimizer"]["exp_avg"][::1000].add_(1.0)  # a training step changes some values
        tree["model"]["layers"][3].mul_(2)
    nc.save(tree, tmp_path / "sync.nvc", metadata=SAME_TIME, base=tmp_path / "base.nvc")
    nc.save_async(tree, tmp_path / "async.nvc", metadata=SAME_TIME, base=tmp_path / "base.nvc").result(timeout=120)
    assert (tmp_path / "async.nvc").read_bytes() == (tmp_path / "sync.nvc").read_bytes()
    assert_tree_equal(tree, nc.load(tmp_path / "async.nvc"))


def test_training_right_after_an_overlapped_save_does_not_reach_the_file(tmp_path: Path) -> None:
    tree = big_tree()
    expected = _clone(tree)
    with nc.AsyncSaver() as saver:
        for step in range(2):  # the second save reuses the snapshot memory of the first
            path = tmp_path / f"step{step}.nvc"
            handle = saver.save(tree, path)
            # The writer is compressing while training changes every tensor in place.
            with torch.no_grad():
                for t in _tensors(tree):
                    if t.numel():
                        t.add_(1)
            tree["meta"]["seen"].append(step)
            handle.result(timeout=120)
            assert_tree_equal(expected, nc.load(path))
            expected = _clone(tree)


def test_the_write_starts_before_the_last_copy_is_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = big_tree()
    expected = _clone(tree)
    late, release = pointer(tree["late"]), threading.Event()
    copy_bytes = snapshot_mod._copy_bytes

    def held(dst: np.ndarray, src: np.ndarray) -> None:
        if src_pointer(src) == late:
            assert release.wait(60), "the test never released the last copy"
        copy_bytes(dst, src)

    monkeypatch.setattr(snapshot_mod, "_copy_bytes", held)
    started = threading.Event()
    out: dict[str, Any] = {}
    with nc.AsyncSaver() as saver:
        caller = threading.Thread(
            target=lambda: out.setdefault(
                "handle", saver.save(tree, tmp_path / "ckpt.nvc", stream_wrapper=lambda s: FirstWrite(s, started))
            )
        )
        caller.start()
        try:
            assert started.wait(30), "the background write did not start while a copy was held"
            caller.join(0.2)
            assert caller.is_alive(), "save() returned before every tensor was copied"
        finally:
            release.set()
        caller.join(60)
        with torch.no_grad():
            tree["late"].zero_()  # after save() returned: not in the file
        out["handle"].result(timeout=120)
    assert_tree_equal(expected, nc.load(tmp_path / "ckpt.nvc"))


def test_a_failed_copy_of_a_later_tensor_is_one_error_from_save_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ckpt.nvc"
    previous = {"v": torch.arange(10)}
    nc.save(previous, path)
    tree = big_tree()
    late = pointer(tree["late"])
    copy_bytes = snapshot_mod._copy_bytes

    def failing(dst: np.ndarray, src: np.ndarray) -> None:
        if src_pointer(src) == late:
            raise OSError(5, "Input/output error")
        copy_bytes(dst, src)

    monkeypatch.setattr(snapshot_mod, "_copy_bytes", failing)
    with nc.AsyncSaver() as saver:
        with pytest.raises(
            CheckpointWriteError, match=r"ckpt.nvc: the async snapshot could not copy tensor 'late'.*Input/output"
        ):
            saver.save(tree, path)
        # Raised once: not by the next save, wait(), nor by load of the path.
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.nvc"]  # no temporary file left
        assert_tree_equal(previous, nc.load(path))
        saver.wait()
        monkeypatch.setattr(snapshot_mod, "_copy_bytes", copy_bytes)
        saver.save(tree, path).result(timeout=120)
    nc.wait_for_saves()
    assert_tree_equal(tree, nc.load(path))
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def _tensors(tree: Any) -> list[torch.Tensor]:
    from nvcomp_checkpoint.format.skeleton import flatten

    return [t for _, t in flatten(tree)[1]]


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        out = tree.detach().clone()
        return torch.nn.Parameter(out, requires_grad=tree.requires_grad) if isinstance(tree, torch.nn.Parameter) else out
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def test_the_background_write_does_not_plan_the_tree_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nvcomp_checkpoint.writer as writer_mod

    planned: list[int] = []
    plan = writer_mod.plan_tensors

    def counted(tensors: Any, *args: Any) -> Any:
        planned.append(len(tensors))
        return plan(tensors, *args)

    monkeypatch.setattr(writer_mod, "plan_tensors", counted)  # what CheckpointWriter.write calls
    tree = {"a": torch.randn(1000), "b": [torch.arange(5), {"c": torch.ones(3, 3)}], "step": 3}
    nc.save_async(tree, tmp_path / "async.nvc").result(timeout=60)
    assert planned == []  # planned once, on the caller's thread, by the snapshot
    nc.save(tree, tmp_path / "sync.nvc")
    assert planned == [3]
    assert_tree_equal(tree, nc.load(tmp_path / "async.nvc"))
