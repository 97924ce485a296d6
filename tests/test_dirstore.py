"""Tests of dirstore: a directory committed as a whole, its manifest, recovery and rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvcomp_checkpoint.dirstore import MARKER_NAME, DirectoryStore, rotate
from nvcomp_checkpoint.errors import ChecksumError, FormatError
from nvcomp_checkpoint.storage import LocalStorage

STORE = DirectoryStore("manifest.json", "test/dir", 1)


def _staged(tmp_path: Path, target: Path, files: dict[str, bytes]) -> Path:
    staging = STORE.fresh(STORE.staging_path(target))
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    return staging


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_commit_replaces_the_directory_as_a_whole(tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not exchange:
        monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
    target = tmp_path / "ckpt"
    staging = _staged(tmp_path, target, {"a.bin": b"old"})
    assert STORE.commit(staging, target) is None
    staging = _staged(tmp_path, target, {"b.bin": b"new", "sub/c.bin": b"c"})
    STORE.write_manifest(staging, {"step": 2})
    replaced = STORE.commit(staging, target)
    assert replaced is not None and (replaced / "a.bin").read_bytes() == b"old"
    assert sorted(os.listdir(target)) == ["b.bin", "manifest.json", "sub"]
    manifest = STORE.read_manifest(target)
    assert manifest is not None and manifest["step"] == 2 and set(manifest["files"]) == {"b.bin", "sub/c.bin"}
    STORE.check_files(target, manifest)


def test_a_crash_between_the_two_renames_is_recovered(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "a.bin").write_bytes(b"previous")
    os.rename(target, STORE.old_path(target))  # the state a crash after the first rename leaves
    STORE.recover(target)
    assert (target / "a.bin").read_bytes() == b"previous" and not STORE.old_path(target).exists()
    STORE.old_path(target).mkdir()  # a leftover next to a complete target is only removed
    STORE.recover(target)
    assert not STORE.old_path(target).exists() and (target / "a.bin").exists()


def test_the_manifest_names_a_truncated_or_altered_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    staging = _staged(tmp_path, target, {"a.bin": b"0123456789", "b.bin": b"abcdefghij"})
    STORE.write_manifest(staging, {})
    STORE.commit(staging, target)
    manifest = STORE.read_manifest(target)
    assert manifest is not None
    (target / "a.bin").write_bytes(b"01234")
    with pytest.raises(FormatError, match=r"a\.bin: 5 bytes, but the save wrote 10"):
        STORE.check_files(target, manifest)
    (target / "a.bin").write_bytes(b"0123456789")
    (target / "b.bin").write_bytes(b"abcdefghiX")
    with pytest.raises(ChecksumError, match=r"b\.bin"):
        STORE.check_files(target, manifest)
    (target / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(FormatError, match="not an nvcomp-checkpoint manifest"):
        STORE.read_manifest(target)
    assert STORE.read_manifest(target, quiet=True) is None


def test_rotation_deletes_the_oldest_and_never_the_one_to_keep(tmp_path: Path) -> None:
    dirs = []
    for i in range(4):
        d = tmp_path / "checkpoints" / f"checkpoint_{i}"
        d.mkdir(parents=True)
        dirs.append(d)
    rotate(dirs, 2, keep=dirs[0], trash=tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_3"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_an_in_place_install_moves_the_manifest_last_and_leaves_other_files(tmp_path: Path) -> None:
    target = tmp_path / "work"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "old.nvc").write_bytes(b"previous save")
    staging = STORE.fresh(STORE.staging_path(target, inside=True))
    (staging / "new.nvc").write_bytes(b"new")
    STORE.write_manifest(staging, {})
    inode = os.stat(target / "notes.txt").st_ino
    STORE.install_in_place(staging, target, first=lambda n: n.endswith(".nvc"), obsolete=["old.nvc"])
    assert sorted(os.listdir(target)) == ["manifest.json", "new.nvc", "notes.txt"]
    assert os.stat(target / "notes.txt").st_ino == inode


def test_publish_replaces_a_saved_directory_and_installs_into_a_shared_one(tmp_path: Path) -> None:
    saved = lambda name: name.endswith(".nvc")  # noqa: E731
    target = tmp_path / "ckpt"
    assert (
        STORE.publish(_staged(tmp_path, target, {"m.nvc": b"1"}), target, {"names": ["m.nvc"]}, marker="m", saved=saved) is None
    )
    assert (
        STORE.publish(_staged(tmp_path, target, {"n.nvc": b"2"}), target, {"names": ["n.nvc"]}, marker="m", saved=saved) is None
    )
    assert sorted(os.listdir(target)) == [MARKER_NAME, "manifest.json", "n.nvc"]  # replaced as a whole
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the replaced directory is gone
    (target / "notes.txt").write_text("mine")  # now shared: updated file by file
    staging = _staged(tmp_path, target, {"o.nvc": b"3"})
    previous = STORE.publish(staging, target, {"names": ["o.nvc"]}, marker="m", saved=saved, obsolete=lambda p: p["names"])
    assert previous is not None and previous["names"] == ["n.nvc"]
    assert sorted(os.listdir(target)) == [MARKER_NAME, "manifest.json", "notes.txt", "o.nvc"]
    assert STORE.checked_manifest(target, lists=("names",))["names"] == ["o.nvc"]  # type: ignore[index]


def test_checked_manifest_refuses_an_incomplete_or_inconsistent_directory(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    assert STORE.checked_manifest(target) is None  # not ours: the framework loads it
    (target / "m.nvc").write_bytes(b"1")
    with pytest.raises(FormatError, match=r"holds \.nvc files but no manifest\.json"):
        STORE.checked_manifest(target)
    STORE.publish(_staged(tmp_path, target, {"m.nvc": b"1"}), target, {"names": ["m.nvc", "x.nvc"]}, marker="m", saved=bool)
    with pytest.raises(FormatError, match=r"x\.nvc is not in the file list"):
        STORE.checked_manifest(target, lists=("names",))
    (target / "m.nvc").unlink()
    with pytest.raises(FormatError, match=r"m\.nvc: missing"):
        STORE.checked_manifest(target)


def test_nvckpt_directory_conversion_recovers_an_interrupted_replacement(tmp_path: Path) -> None:
    import torch

    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.cli.main import main

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    torch.save({"w": torch.ones(8)}, src / "optimizer.pt")
    assert main(["compress", str(src), str(dst), "--quiet"]) == 0
    # A later `--force` conversion crashed between its two renames: only the old directory is left.
    os.rename(dst, STORE.old_path(dst))
    assert main(["decompress", str(dst), str(tmp_path / "back"), "--quiet"]) != 0  # nothing at dst yet
    torch.save({"w": torch.zeros(8)}, src / "optimizer.pt")
    assert main(["compress", str(src), str(dst), "--quiet", "--force"]) == 0  # recovers, then replaces
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]
    assert torch.equal(nc.load(dst / "optimizer.pt.nvc")["w"], torch.zeros(8))
