"""Local saves start writing their pages to the device while they are still being written, so the
fsync that ends a save waits for the tail of the file, not the whole of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint import storage

pytestmark = pytest.mark.skipif(storage._SYNC_FILE_RANGE is None, reason="sync_file_range is Linux only")


def test_a_local_save_starts_writeback_every_writeback_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int, int]] = []
    real = storage._SYNC_FILE_RANGE
    assert real is not None

    def record(fd: int, offset: int, nbytes: int, flags: int) -> None:
        calls.append((fd, offset, nbytes, flags))
        real(fd, offset, nbytes, flags)

    monkeypatch.setattr(storage, "_SYNC_FILE_RANGE", record)
    monkeypatch.setattr(storage, "WRITEBACK_BYTES", 64 << 10)
    with storage.open_for_writing(tmp_path / "pieces") as f:
        for _ in range(10):
            f.write(bytes(40 << 10))  # a call once 64 KiB are unsynced: after pieces 2, 4, 6, 8 and 10
    assert len(calls) == 5
    assert all(c[1:] == (0, 0, storage.SYNC_FILE_RANGE_WRITE) for c in calls)
    assert (tmp_path / "pieces").read_bytes() == bytes(400 << 10)
    calls.clear()
    tree = {"w": torch.randn(256 << 10)}  # 1 MiB that does not compress much
    path = tmp_path / "a.nvc"
    nc.save(tree, path)
    assert len(calls) >= 2  # a save goes through it
    assert_tree_equal(nc.load(path), tree)


def test_writeback_failures_do_not_fail_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: int) -> None:
        raise OSError(95, "Operation not supported")  # as on file systems without it

    monkeypatch.setattr(storage, "_SYNC_FILE_RANGE", refuse)
    monkeypatch.setattr(storage, "WRITEBACK_BYTES", 64 << 10)
    tree = {"w": torch.randn(256 << 10)}
    nc.save(tree, tmp_path / "a.nvc")
    assert_tree_equal(nc.load(tmp_path / "a.nvc"), tree)
