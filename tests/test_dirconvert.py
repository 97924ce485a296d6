"""Tests of dirconvert: files of a directory compressed in place and back, never without a complete copy."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from nvcomp_checkpoint.dirconvert import SUFFIX, PlainFile, compress_in_place, compressed_copy, decompress_in_place
from nvcomp_checkpoint.dirstore import MARKER_NAME
from nvcomp_checkpoint.errors import CheckpointWriteError


def _read(path: Path) -> tuple[Any, dict[str, Any]]:
    return torch.load(path, weights_only=True), {"file": path.name}


def _write(name: str, tree: Any, meta: dict[str, Any], stream: IO[bytes]) -> None:
    assert meta == {"file": name}
    torch.save(tree, stream)


def _directory(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    trees = {n: {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(i))} for i, n in enumerate(("a.pt", "b.pt"))}
    directory = tmp_path / "checkpoint-1"
    directory.mkdir()
    for name, tree in trees.items():
        torch.save(tree, directory / name)
    (directory / "other.json").write_text("{}")
    os.utime(directory, (1_000_000, 1_000_000))
    return directory, trees


def test_files_compress_in_place_and_come_back(tmp_path: Path) -> None:
    directory, trees = _directory(tmp_path)
    files = [PlainFile(name, "tree", _read) for name in trees]
    assert compressed_copy(directory, ["a.pt"]) is None  # the plain file is there
    report = compress_in_place(directory, files, meta_key="test", marker="what these files are", resumes="the test resumes")
    assert compressed_copy(directory, ["x.pt", "b.pt"]) == directory / ("b.pt" + SUFFIX)
    assert sorted(os.listdir(directory)) == [MARKER_NAME, "a.pt" + SUFFIX, "b.pt" + SUFFIX, "other.json"]
    assert report.raw_bytes > 0 and directory.stat().st_mtime == 1_000_000
    load = lambda path, key: __import__("nvcomp_checkpoint").load(path)[key]  # noqa: E731
    assert decompress_in_place(directory, {n: "tree" for n in trees}, _write, meta_key="test", load_tree=load) == ["a.pt", "b.pt"]
    assert sorted(os.listdir(directory)) == ["a.pt", "b.pt", "other.json"] and directory.stat().st_mtime == 1_000_000
    for name, tree in trees.items():
        assert torch.equal(torch.load(directory / name, weights_only=True)["w"], tree["w"])


def test_a_failure_leaves_the_plain_files_as_they_were(tmp_path: Path) -> None:
    directory, trees = _directory(tmp_path)
    before = {n: (directory / n).read_bytes() for n in trees}

    def full(stream: IO[bytes]) -> Any:
        class Full:
            def write(self, data: Any) -> int:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return Full()

    calls = []

    def read_then_fail(path: Path) -> tuple[Any, dict[str, Any]]:
        calls.append(path.name)
        return _read(path)

    with pytest.raises(
        CheckpointWriteError,
        match=r"a\.pt\.nvc: writing the checkpoint failed .*The plain files of .*checkpoint-1 are untouched and the test resumes",
    ):
        compress_in_place(
            directory,
            [PlainFile(n, "tree", read_then_fail) for n in trees],
            meta_key="test",
            marker="m",
            resumes="the test resumes",
            stream_wrapper=full,
        )
    assert calls == ["a.pt"] and sorted(os.listdir(directory)) == ["a.pt", "b.pt", "other.json"]
    assert {n: (directory / n).read_bytes() for n in trees} == before and directory.stat().st_mtime == 1_000_000


def test_a_converted_file_of_another_save_is_refused_and_files_without_an_identity_load(tmp_path: Path) -> None:
    import shutil

    from nvcomp_checkpoint.dirconvert import check_identity
    from nvcomp_checkpoint.errors import MixedSaveError

    kwargs: dict[str, Any] = {"meta_key": "test", "marker": "m", "resumes": "r"}
    for name in ("first", "second", "old"):
        (tmp_path / name).mkdir()
    first, trees = _directory(tmp_path / "first")
    compress_in_place(first, [PlainFile(n, "tree", _read) for n in trees], identity={"step": 1}, **kwargs)
    for name in trees:
        check_identity(first / (name + SUFFIX), {"step": 1})
    with pytest.raises(MixedSaveError, match=r"a\.pt\.nvc: written for step 1, but .* step 2"):
        check_identity(first / ("a.pt" + SUFFIX), {"step": 2})
    # The same step, another conversion: its save id differs from the folder's other file.
    second, _ = _directory(tmp_path / "second")
    compress_in_place(second, [PlainFile(n, "tree", _read) for n in trees], identity={"step": 1}, **kwargs)
    shutil.copyfile(second / ("b.pt" + SUFFIX), first / ("b.pt" + SUFFIX))
    with pytest.raises(MixedSaveError, match=r"a\.pt\.nvc: not converted with b\.pt\.nvc"):
        check_identity(first / ("a.pt" + SUFFIX), {"step": 1})
    # Converted before identities were recorded: nothing to check, the folder loads as before.
    old, _ = _directory(tmp_path / "old")
    compress_in_place(old, [PlainFile(n, "tree", _read) for n in trees], **kwargs)
    check_identity(old / ("a.pt" + SUFFIX), {"step": 5})
