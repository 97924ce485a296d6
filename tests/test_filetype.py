"""Tests of filetype: one sniffer for ``nc.load`` and ``nvckpt``, by content, never by name; checkpoint directories by the names in them; what is at a path."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.sources import sniff
from nvcomp_checkpoint.filetype import (
    ACCELERATE_DIR,
    DCP_DIR,
    HEAD_BYTES,
    HF_TRAINER_DIR,
    LIGHTNING_SHARDED_DIR,
    NVCOMP,
    OTHER,
    SAFETENSORS,
    TORCH,
    PathContents,
    directory_kind,
    kind_of,
    path_contents,
)


def _kind(path: Path) -> str:
    data = path.read_bytes()
    return kind_of(data[:HEAD_BYTES], len(data))


def test_every_layout_is_told_apart_by_its_first_bytes(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tree = {"w": torch.arange(6, dtype=torch.float32)}
    files = {
        "ours.bin": NVCOMP,
        "zip.bin": TORCH,
        "legacy2.bin": TORCH,
        "legacy4.bin": TORCH,
        "tensors.bin": SAFETENSORS,
        "text.bin": OTHER,
    }
    nc.save(tree, tmp_path / "ours.bin")
    torch.save(tree, tmp_path / "zip.bin")
    torch.save(tree, tmp_path / "legacy2.bin", _use_new_zipfile_serialization=False)
    torch.save(tree, tmp_path / "legacy4.bin", _use_new_zipfile_serialization=False, pickle_protocol=4)
    st.save_file(tree, str(tmp_path / "tensors.bin"))
    (tmp_path / "text.bin").write_text("hello, not a checkpoint")
    for name, kind in files.items():
        assert _kind(tmp_path / name) == kind, name
        assert sniff(str(tmp_path / name)) == kind, name  # the CLI agrees with the library
    for name in ("zip.bin", "legacy2.bin"):
        torch.testing.assert_close(nc.load(tmp_path / name), tree)
    # torch's weights-only unpickler has no FRAME opcode (protocol 4); a trusted load reads it.
    torch.testing.assert_close(nc.load(tmp_path / "legacy4.bin", weights_only=False), tree)


def test_loading_a_safetensors_file_says_what_it_is_and_what_to_call(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    st.save_file({"w": torch.ones(3)}, str(tmp_path / "model.ckpt"))
    with pytest.raises(nc.errors.FormatError, match=r"model\.ckpt: a safetensors file.*safetensors\.torch\.load_file"):
        nc.load(tmp_path / "model.ckpt")


def _dcp_save(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from nvcomp_checkpoint.dcp import NvcompWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": torch.nn.Linear(8, 8).state_dict()}, storage_writer=NvcompWriter(str(path)))


def test_checkpoint_directories_are_told_apart_by_their_names(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from transformers import TrainerState

    _dcp_save(tmp_path / "dcp")
    # Lightning's sharded strategies write DCP's files and meta.pt into one directory.
    _dcp_save(tmp_path / "lightning")
    nc.save({"global_step": 2}, tmp_path / "lightning" / "meta.pt")
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 4))
    accelerator.save_state(str(tmp_path / "accelerate"))
    (tmp_path / "trainer").mkdir()
    TrainerState(global_step=2).save_to_json(str(tmp_path / "trainer" / "trainer_state.json"))
    nc.save({"w": torch.ones(3)}, tmp_path / "trainer" / "optimizer.pt.nvc")
    (tmp_path / "other").mkdir()
    nc.save({"w": torch.ones(3)}, tmp_path / "other" / "step-1.nvc")
    expected = {
        "dcp": DCP_DIR,
        "lightning": LIGHTNING_SHARDED_DIR,
        "accelerate": ACCELERATE_DIR,
        "trainer": HF_TRAINER_DIR,
        "other": None,
    }
    for name, kind in expected.items():
        assert directory_kind(os.listdir(tmp_path / name)) == kind, (name, os.listdir(tmp_path / name))
    # nc.load of the two framework folders names the framework's call (DCP ones: the test below).
    for name, call in {"accelerate": "accelerator.load_state(", "trainer": "trainer.train(resume_from_checkpoint="}.items():
        with pytest.raises(nc.errors.FormatError, match=re.escape(call)):
            nc.load(tmp_path / name)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: _dcp_save(p), r"a torch\.distributed\.checkpoint \(DCP\) directory: load it with .*NvcompReader\('.*ckpt'\)"),
        (
            lambda p: (_dcp_save(p), nc.save({"step": 1}, p / "meta.pt")),
            r"a Lightning sharded checkpoint .*ckpt_path=.*NvcompModelParallelStrategy",
        ),
        (lambda p: p.mkdir(), r"ckpt: is an empty directory, not a checkpoint file"),
        (
            lambda p: (p.mkdir(), nc.save({"w": torch.ones(3)}, p / "step-1.nvc")),
            r"ckpt: is a directory, not a checkpoint file; it holds step-1\.nvc: pass one of them",
        ),
    ],
    ids=["dcp", "lightning-sharded", "empty", "folder-of-files"],
)
def test_load_and_open_of_a_directory_name_the_call_that_reads_it(tmp_path: Path, make: Any, message: str) -> None:
    make(tmp_path / "ckpt")
    for call in (nc.load, nc.open):
        with pytest.raises(nc.errors.FormatError, match=message) as info:
            call(tmp_path / "ckpt")
        assert not isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("root", ["local", "memory"])
def test_path_contents_says_what_is_at_a_path(tmp_path: Path, root: str) -> None:
    from nvcomp_checkpoint.storage import storage_for

    base = str(tmp_path) if root == "local" else f"memory://filetype-{tmp_path.name}"
    storage, _ = storage_for(base)
    storage.makedirs(f"{base}/empty")
    storage.makedirs(f"{base}/dcp")
    nc.save({"w": torch.ones(3)}, f"{base}/ours.nvc")
    nc.save({"w": torch.ones(3)}, f"{base}/dcp/.metadata")

    def contents(name: str) -> Any:
        return path_contents(*storage_for(f"{base}/{name}"), f"{base}/{name}")

    assert contents("absent") == PathContents(False)
    assert contents("ours.nvc") == PathContents(True, file_kind=NVCOMP)
    # An empty folder: a local one, or an fsspec one that only opening tells from a file.
    assert contents("empty") == PathContents(True, names={}) and contents("empty").directory_kind is None
    assert contents("dcp").is_dir and contents("dcp").directory_kind == DCP_DIR
    if root == "memory":  # nc.load of it: named an empty directory, as a local one is
        with pytest.raises(nc.errors.FormatError, match="is an empty directory, not a checkpoint file"):
            nc.load(f"{base}/empty")


def test_open_says_what_a_file_that_is_not_ours_is_and_what_reads_it(tmp_path: Path) -> None:
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.errors import FormatError

    torch.save({"w": torch.ones(4)}, tmp_path / "plain.pt")
    torch.save({"w": torch.ones(4)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "junk.bin").write_bytes(b"hello, not a checkpoint at all" * 8)
    for name in ("plain.pt", "legacy.pt"):
        with pytest.raises(FormatError, match=r"a torch\.save file, not an nvcomp-checkpoint file: nc\.load\(path\) reads it"):
            nc.open(tmp_path / name)
        assert torch.equal(nc.load(tmp_path / name)["w"], torch.ones(4))
    with pytest.raises(FormatError, match=r"not an nvcomp-checkpoint file \(it does not start with the NVCKPT magic\)"):
        nc.open(tmp_path / "junk.bin")
