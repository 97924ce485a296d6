"""File modes: a converted file keeps its source's permission bits (as ``cp -p``, ``gzip`` and ``zstd`` do),
on every convert path; a new file follows the umask. Real files, checked with ``os.stat``."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.dirconvert import PlainFile, compress_in_place, decompress_in_place


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask() -> Iterator[Any]:
    """Sets the process umask for the test (022 unless the test sets another); the old one is put back."""
    old = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(old)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2048, generator=g), "b": torch.zeros(64)}


def _private(path: Path, mode: int = 0o600) -> Path:
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("umask_value", [0o077, 0o022, 0o027])
def test_a_new_save_follows_the_umask(tmp_path: Path, umask: Any, umask_value: int) -> None:
    umask(umask_value)
    nc.save(_state(), tmp_path / "a.nvc")
    nc.save_async(_state(), tmp_path / "b.nvc").result()
    for name in ("a.nvc", "b.nvc"):
        assert _mode(tmp_path / name) == 0o666 & ~umask_value


def test_save_file_mode_is_the_files_mode(tmp_path: Path, umask: Any) -> None:
    nc.save(_state(), tmp_path / "a.nvc", file_mode=0o640)
    assert _mode(tmp_path / "a.nvc") == 0o640
    with pytest.raises(ValueError, match="file_mode"):
        nc.save(_state(), tmp_path / "b.nvc", file_mode=0o10000)
    assert not (tmp_path / "b.nvc").exists()


@pytest.mark.parametrize("mode", [0o600, 0o640], ids=["0600", "0640"])
def test_cli_compress_and_decompress_of_a_file_keep_its_mode(tmp_path: Path, umask: Any, mode: int) -> None:
    state = _state()
    torch.save(state, tmp_path / "a.pt")
    _private(tmp_path / "a.pt", mode)
    assert main(["compress", str(tmp_path / "a.pt"), str(tmp_path / "a.nvc"), "--quiet"]) == 0
    assert _mode(tmp_path / "a.nvc") == mode
    assert main(["decompress", str(tmp_path / "a.nvc"), str(tmp_path / "back.pt"), "--quiet"]) == 0
    assert _mode(tmp_path / "back.pt") == mode
    assert main(["decompress", str(tmp_path / "a.nvc"), str(tmp_path / "back.safetensors"), "--quiet"]) == 0
    assert _mode(tmp_path / "back.safetensors") == mode
    assert_tree_equal(torch.load(tmp_path / "back.pt", weights_only=True), state)


def test_cli_keeps_a_wider_mode_under_a_narrow_umask(tmp_path: Path, umask: Any) -> None:
    # As gzip: the source's bits, not the umask's (a shared 0644 checkpoint stays readable by the group).
    torch.save(_state(), tmp_path / "a.pt")
    _private(tmp_path / "a.pt", 0o644)
    umask(0o077)
    assert main(["compress", str(tmp_path / "a.pt"), str(tmp_path / "a.nvc"), "--quiet"]) == 0
    assert _mode(tmp_path / "a.nvc") == 0o644


def test_cli_directory_conversions_keep_each_files_mode(tmp_path: Path, umask: Any) -> None:
    src = tmp_path / "src"
    src.mkdir()
    torch.save(_state(0), src / "model.pt")
    torch.save(_state(1), src / "optimizer.pt")
    (src / "config.json").write_text("{}")
    _private(src / "model.pt", 0o600)
    _private(src / "optimizer.pt", 0o640)
    _private(src / "config.json", 0o600)
    assert main(["compress", str(src), str(tmp_path / "c"), "--quiet"]) == 0
    assert {p.name: _mode(p) for p in (tmp_path / "c").iterdir() if not p.name.startswith("nvcomp_checkpoint")} == {
        "model.pt.nvc": 0o600,
        "optimizer.pt.nvc": 0o640,
        "config.json": 0o600,
    }
    assert main(["decompress", str(tmp_path / "c"), str(tmp_path / "d"), "--quiet"]) == 0
    assert {p.name: _mode(p) for p in (tmp_path / "d").iterdir() if not p.name.startswith("nvcomp_checkpoint")} == {
        "model.pt": 0o600,
        "optimizer.pt": 0o640,
        "config.json": 0o600,
    }


def _deepspeed_folder(root: Path) -> Path:
    """A plain DeepSpeed folder (tag t1 of 2 ranks, ``latest``) with private (0600) rank files."""
    tag = root / "t1"
    tag.mkdir(parents=True)
    torch.save({"module": _state(0), "ds_version": "0.19"}, tag / "mp_rank_00_model_states.pt")
    for rank in range(2):
        state = {"single_partition_of_fp32_groups": [torch.randn(128)], "partition_count": [2]}
        torch.save({"optimizer_state_dict": state, "ds_version": "0.19"}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("t1")
    for p in tag.iterdir():
        _private(p)
    return tag


def test_cli_in_place_deepspeed_conversion_keeps_private_rank_files_private(tmp_path: Path, umask: Any) -> None:
    tag = _deepspeed_folder(tmp_path / "ckpt")
    names = sorted(p.name for p in tag.iterdir())
    assert main(["compress", str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert all(nc.is_nvcomp_checkpoint(tag / n) for n in names)
    assert {n: _mode(tag / n) for n in names} == dict.fromkeys(names, 0o600)
    assert main(["decompress", str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert not any(nc.is_nvcomp_checkpoint(tag / n) for n in names)
    assert {n: _mode(tag / n) for n in names} == dict.fromkeys(names, 0o600)
    # Into another folder too.
    assert main(["compress", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quiet"]) == 0
    assert {n: _mode(tmp_path / "out" / "t1" / n) for n in names} == dict.fromkeys(names, 0o600)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_conversions_keep_each_files_mode(tmp_path: Path, umask: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")))
    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    for name in files:
        _private(tmp_path / "plain" / name)
    assert main(["compress", str(tmp_path / "plain"), str(tmp_path / "ours"), "--quiet"]) == 0
    modes = {p.name: _mode(p) for p in (tmp_path / "ours").iterdir() if not p.name.startswith("nvcomp_checkpoint")}
    assert modes and set(modes.values()) == {0o600}, modes
    assert main(["decompress", str(tmp_path / "ours"), str(tmp_path / "back"), "--quiet"]) == 0
    modes = {p.name: _mode(p) for p in (tmp_path / "back").iterdir() if not p.name.startswith("nvcomp_checkpoint")}
    assert modes and set(modes.values()) == {0o600}, modes


def test_in_place_directory_compression_keeps_each_files_mode(tmp_path: Path, umask: Any) -> None:
    # What the Trainer and Accelerate integrations run on the folders their frameworks write.
    state = _state()
    torch.save(state, tmp_path / "optimizer.pt")
    _private(tmp_path / "optimizer.pt")
    plain = PlainFile("optimizer.pt", "optimizer", lambda p: (torch.load(p, weights_only=True), {}))
    compress_in_place(tmp_path, [plain], meta_key="test", marker="test", resumes="the test resumes from them")
    assert _mode(tmp_path / "optimizer.pt.nvc") == 0o600

    def write(name: str, tree: Any, meta: dict[str, Any], stream: Any) -> None:
        torch.save(tree, stream)

    decompress_in_place(
        tmp_path,
        {"optimizer.pt": "optimizer"},
        write,
        meta_key="test",
        load_tree=lambda p, key: nc.load(p)[key],
    )
    assert _mode(tmp_path / "optimizer.pt") == 0o600
    assert_tree_equal(torch.load(tmp_path / "optimizer.pt", weights_only=True), state)
