"""Tests of filetype: one sniffer for ``nc.load`` and ``nvckpt``, by content, never by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.sources import sniff
from nvcomp_checkpoint.filetype import HEAD_BYTES, NVCOMP, OTHER, SAFETENSORS, TORCH, kind_of


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
