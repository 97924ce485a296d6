"""The tail of a local save: its pages start for the device while it is still written, so the fsync
that ends it waits for the last of them only, and the file it replaces is unlinked in another thread."""

from __future__ import annotations

import os
import threading
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


def test_a_replaced_file_is_unlinked_off_the_saving_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Freeing the blocks of the file a save replaces took 30-65 ms per 155 MB here, at the end of the save.
    monkeypatch.setattr(storage, "RETIRE_BYTES", 1 << 10)
    path = tmp_path / "a.nvc"
    old, new = {"w": torch.randn(64 << 10)}, {"w": torch.randn(64 << 10) + 1}
    nc.save(old, path)
    unlinked: list[tuple[str, str]] = []
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        unlinked.append((self.name, threading.current_thread().name))
        real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)

    def settle() -> None:
        for thread in threading.enumerate():
            if thread.name == "nvckpt-unlink":
                thread.join()

    nc.save(new, path)
    settle()
    assert len(unlinked) == 1 and storage.is_temp_name(unlinked[0][0]) and unlinked[0][1] == "nvckpt-unlink"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.nvc"]
    assert_tree_equal(nc.load(path), new)
    # A file with another name keeps its blocks there: it is replaced as before, nothing to unlink.
    os.link(path, tmp_path / "kept.nvc")
    nc.save(old, path)
    settle()
    assert len(unlinked) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["a.nvc", "kept.nvc"]
    assert_tree_equal(nc.load(path), old)
    assert_tree_equal(nc.load(tmp_path / "kept.nvc"), new)
