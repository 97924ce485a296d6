"""The HF Trainer callback's ``tiers=[...]``: ``output_dir/checkpoint-N`` is tier 0, copies go to the tiers.

Real ``Trainer`` runs of the tiny GPT-2 of ``test_hf_trainer`` (built from a config, no download);
the shared tiers are folders.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")

import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.tiers import open_tier, verify_unit  # noqa: E402
from nvcomp_checkpoint.transformers import NvcompTrainerCallback  # noqa: E402
from test_hf_trainer import script  # noqa: E402,F401 - a fixture: the training script, imported


def tiers(base: Path) -> list[nc.Tier]:
    return [
        nc.Tier(base / "shared", keep=2, name="shared", max_queued=8),
        nc.Tier(base / "archive", every_steps=8, name="archive", max_queued=8),
    ]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_copies_reach_the_tiers_and_a_fresh_node_resumes(
    script: tuple[Path, ModuleType], tmp_path: Path, async_save: bool
) -> None:  # noqa: F811
    _, mod = script
    snapshots = mod.Snapshots()
    out = tmp_path / "node1"
    first = mod.run(str(out), 12, 4, callbacks=[snapshots], nvcomp={"async_save": async_save, "tiers": tiers(tmp_path)})
    # on_train_end waited for the copies.
    shared, archive = open_tier(str(tmp_path / "shared")), open_tier(str(tmp_path / "archive"))
    assert shared.steps() == [8, 12]  # keep=2
    assert archive.steps() == [8, 12]  # the multiples of 8, and the run's newest step at its end
    copy = Path(shared.unit_path(12, True))
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in (out / "checkpoint-12").iterdir())
    assert "model.safetensors.nvc" in {p.name for p in copy.iterdir()}

    # The node is lost, and every copy of step 12 is damaged.
    shutil.rmtree(out)
    for weights in (copy / "model.safetensors.nvc", Path(archive.unit_path(12, True)) / "model.safetensors.nvc"):
        weights.write_bytes(weights.read_bytes()[:-100])
    path = NvcompTrainerCallback(tiers=tiers(tmp_path)).resume_path()
    assert path == shared.unit_path(8, True)

    dump = tmp_path / "restored.pt"
    resumed = mod.run(
        str(tmp_path / "node2"),
        12,
        4,
        resume=path,
        callbacks=[mod.DumpAtStart(str(dump))],
        nvcomp={"async_save": async_save, "tiers": tiers(tmp_path)},
    )
    restored = torch.load(dump, weights_only=False)
    assert restored["step"] == 8
    assert_tree_equal(restored["model"], snapshots.at[8]["model"])
    assert_tree_equal(restored["optimizer"], snapshots.at[8]["optimizer"])
    after = {s: v for s, v in mod.losses(first).items() if s > 8}
    assert {s: v for s, v in mod.losses(resumed).items() if s > 8} == after  # the same next losses
    # The resumed run's step 12 replaced the damaged copy.
    assert shared.steps() == [8, 12]
    assert verify_unit(shared, shared.manifest(12)) is None


def test_tiers_are_checked_when_the_callback_is_made(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"NvcompTrainerCallback\(tiers=...\) takes nvcomp_checkpoint.Tier"):
        NvcompTrainerCallback(tiers=[str(tmp_path)])
    with pytest.raises(ValueError, match="no tiers"):
        NvcompTrainerCallback().resume_path()
    assert NvcompTrainerCallback(tiers=[nc.Tier(tmp_path / "none")]).resume_path() is None
