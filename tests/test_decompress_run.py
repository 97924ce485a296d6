"""``nvckpt decompress RUN OUT``: a whole run or tier into plain files in one command.

A run's folder holds checkpoints of every kind: a tier's step files (full and delta), a DeepSpeed
folder (tags committed by a manifest), a compressed DCP checkpoint, plain files. Each comes out as
its stock loader reads it: files by ``torch.load(weights_only=True)``, the DeepSpeed tag without its
(now wrong) manifest, the DCP checkpoint with DCP's own rank files.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.dcp import compress_directory
from nvcomp_checkpoint.deepspeed_layout import MANIFEST_NAME, write_manifest
from nvcomp_checkpoint.filetype import NVCOMP, TORCH, kind_of


def _kind(path: Path) -> str:
    with open(path, "rb") as f:
        return kind_of(f.read(16), path.stat().st_size)


def _run_folder(root: Path) -> dict[str, object]:
    """The run: a tier of 3 steps (deltas), a DeepSpeed tag, a compressed DCP checkpoint, a plain file; what each holds."""
    torch.manual_seed(0)
    expected: dict[str, object] = {}
    manager = nc.CheckpointManager([nc.Tier(root / "tier")], incremental=True, async_save=False)
    tree = {"w": torch.randn(64, 16), "step": 0}
    for step in (1, 2, 3):
        tree = {"w": tree["w"] + 0.01, "step": step}  # type: ignore[operator]
        manager.save(step, tree)
        expected[f"tier/step-{step:010d}"] = tree
    manager.close()
    tag = root / "ds" / "t1"
    tag.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        expected[f"ds/t1/{name}"] = {"module": {"w": torch.randn(8, 8)}, "name": name}
        nc.save(expected[f"ds/t1/{name}"], tag / name)
    write_manifest(tag, "t1", 1, {p.name: p.stat().st_size for p in tag.iterdir()})
    (root / "ds" / "latest").write_text("t1")
    state = {"w": torch.randn(32, 32), "b": torch.randn(32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it saves in one process
        dcp.save(state, checkpoint_id=str(root.parent / "dcp-plain"))
    compress_directory(root.parent / "dcp-plain", root / "dcp")
    expected["dcp"] = state
    torch.save({"note": 1}, root / "notes.pt")
    return expected


def test_a_whole_run_decompresses_to_what_stock_loaders_read(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "run"
    expected = _run_folder(run)
    assert {_kind(p) for p in (run / "tier").glob("*.nvc")} == {NVCOMP}
    capsys.readouterr()
    assert main(["decompress", str(run), str(tmp_path / "out"), "--json"]) == 0
    out = capsys.readouterr().out
    rows = {r["file"]: r for r in json.loads(out[out.index("{") :])["files"]}
    plain = tmp_path / "out"
    for rel, tree in expected.items():
        if rel == "dcp":
            continue
        assert _kind(plain / rel) == TORCH, rel
        assert_tree_equal(torch.load(plain / rel, weights_only=True), tree)
    # The DeepSpeed tag: every file plain, the manifest (of the compressed files' sizes) gone, `latest` kept.
    assert not (plain / "ds" / "t1" / MANIFEST_NAME).exists()
    assert (plain / "ds" / "latest").read_text() == "t1"
    assert rows["ds/t1/mp_rank_00_model_states.pt"]["action"] == "decompressed"
    # The DCP checkpoint: DCP's own rank files, loaded by DCP's stock reader.
    assert sorted(p.name for p in (plain / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]
    back = {"w": torch.zeros(32, 32), "b": torch.zeros(32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(plain / "dcp"))
    assert_tree_equal(back, expected["dcp"])
    assert rows["dcp/"]["action"] == "decompressed" and rows["notes.pt"]["action"] == "copied"
