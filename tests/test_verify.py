"""``nc.verify`` and ``nvckpt verify``: a file passes exactly when ``load`` accepts it.

The object tree is decoded with the weights-only rules and its tensor references are checked;
every chunk of every tensor is checksummed and decoded; each problem names the tensor.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.main import build_parser, main
from nvcomp_checkpoint.errors import ChecksumError, FormatError, UnsafeCheckpointError


def _tree() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"a": torch.randn(3000, generator=g), "b": torch.arange(5000.0)}, "step": 7}


def _damage(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_good_file_passes_with_its_counts_and_progress(tmp_path):
    path = tmp_path / "good.nvc"
    nc.save(_tree(), path)
    seen: list[int] = []
    result = nc.verify(path, progress=seen.append)
    assert result.ok and result.problems == ()
    assert result.tensors == 2 and result.raw_bytes == 8 * 4000 == sum(seen)
    assert result.path == str(path)


def test_a_damaged_tensor_is_named_and_the_others_pass(tmp_path):
    path = tmp_path / "tensor.nvc"
    nc.save(_tree(), path)
    with nc.open(path) as reader:
        frame = reader.entry("model/b").frames[0]
    _damage(path, frame.offset + frame.size // 2)
    result = nc.verify(path)
    assert [(p.tensor, type(p.error)) for p in result.problems] == [("model/b", ChecksumError)]


def test_a_damaged_object_tree_and_a_truncated_file_are_problems_of_the_file(tmp_path):
    path = tmp_path / "tree.nvc"
    nc.save(_tree(), path)
    with nc.open(path) as reader:
        offset = reader.index.skeleton.offset
    _damage(path, offset + 1)
    result = nc.verify(path)
    assert [(p.tensor, type(p.error)) for p in result.problems] == [(None, ChecksumError)]
    cut = tmp_path / "cut.nvc"
    nc.save(_tree(), cut)
    cut.write_bytes(cut.read_bytes()[:-10])
    result = nc.verify(cut)
    assert not result.ok and result.tensors == 0 and isinstance(result.problems[0].error, FormatError)


class Opaque:
    """A class a weights-only load refuses to build."""

    def __init__(self) -> None:
        self.x = 1


def test_a_tree_that_weights_only_load_refuses_fails_verify(tmp_path, capsys):
    # Was: exit 0, although load() refuses the file without weights_only=False.
    path = tmp_path / "objects.nvc"
    nc.save({"w": torch.ones(3), "obj": Opaque(), "od": collections.OrderedDict(a=1)}, path)
    result = nc.verify(path)
    assert [(p.tensor, type(p.error)) for p in result.problems] == [(None, UnsafeCheckpointError)]
    assert main(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["failures"][0]["tensor"] is None and "weights-only" in report["failures"][0]["error"]
    assert nc.load(path, weights_only=False)["obj"].x == 1


def test_verify_help_says_it_decodes_the_tree_with_the_weights_only_rules():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["verify"].description.split())
    assert "weights-only rules" in text and "passes exactly when load accepts it" in text
