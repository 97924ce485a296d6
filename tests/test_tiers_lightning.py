"""Lightning's ``NvcompCheckpointIO(tiers=[...])``: ModelCheckpoint's folder is tier 0, copies go to the tiers.

Real Trainer runs of the tiny module of ``test_lightning``; the shared tier is a second folder.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.lightning import NvcompCheckpointIO  # noqa: E402
from nvcomp_checkpoint.tiers import open_tier  # noqa: E402
from test_lightning import BATCHES_PER_EPOCH, DumpRestoredState, fit_tiny  # noqa: E402

EPOCHS = 2  # 8 steps, a checkpoint every 2 steps: 2, 4, 6, 8


def tiers(base: Path) -> list[nc.Tier]:
    return [
        nc.Tier(base / "shared", keep=2, name="shared", max_queued=8),
        nc.Tier(base / "archive", every_steps=4, name="archive", max_queued=8),
    ]


def every_2_steps(dirpath: Path, top_k: int = -1) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=2, save_top_k=top_k, filename="{epoch}-{step}")


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_copies_reach_the_tiers_with_their_retention(tmp_path: Path, async_save: bool) -> None:
    plugin = NvcompCheckpointIO(async_save=async_save, tiers=tiers(tmp_path))
    local = tmp_path / "local"
    fit_tiny(tmp_path / "run", EPOCHS, plugins=[plugin], callbacks=[every_2_steps(local)])
    # ModelCheckpoint keeps all four (its own top-k); teardown waited for the copies.
    assert sorted(p.name for p in local.glob("*.ckpt")) == [
        f"epoch={(s - 1) // BATCHES_PER_EPOCH}-step={s}.ckpt" for s in (2, 4, 6, 8)
    ]
    shared, archive = open_tier(str(tmp_path / "shared")), open_tier(str(tmp_path / "archive"))
    assert shared.steps() == [6, 8]  # keep=2
    assert archive.steps() == [4, 8]  # the multiples of 4
    # A copy is the compressed file as ModelCheckpoint wrote it, byte for byte.
    for store, step in ((shared, 8), (archive, 4)):
        copy = Path(store.unit_path(step, False))
        assert digest(copy) == digest(local / f"epoch={(step - 1) // BATCHES_PER_EPOCH}-step={step}.ckpt")
        assert nc.is_nvcomp_checkpoint(copy)


def test_top_k_rotation_keeps_tier0_small_while_the_tiers_keep_their_copies(tmp_path: Path) -> None:
    plugin = NvcompCheckpointIO(async_save=True, tiers=[nc.Tier(tmp_path / "shared", keep=3, name="shared", max_queued=8)])
    local = tmp_path / "local"
    fit_tiny(tmp_path / "run", EPOCHS, plugins=[plugin], callbacks=[every_2_steps(local, top_k=1)])
    assert [p.name for p in local.glob("*.ckpt")] == ["epoch=1-step=8.ckpt"]
    assert open_tier(str(tmp_path / "shared")).steps() == [4, 6, 8]


def test_a_fresh_node_resumes_from_the_newest_copy(tmp_path: Path) -> None:
    # The uninterrupted run: 2 + 2 epochs.
    _, _, straight = fit_tiny(tmp_path / "straight", 2 * EPOCHS, callbacks=[every_2_steps(tmp_path / "straight-ckpt")])
    plugin = NvcompCheckpointIO(tiers=tiers(tmp_path))
    local = tmp_path / "local"
    fit_tiny(tmp_path / "run", EPOCHS, plugins=[plugin], callbacks=[every_2_steps(local)])
    saved = nc.load(local / "epoch=1-step=8.ckpt", weights_only=False)
    # The node is lost: ModelCheckpoint's folder (and the run's, if any) are gone.
    shutil.rmtree(local)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    fresh = NvcompCheckpointIO(tiers=tiers(tmp_path))
    path = fresh.resume_path()
    assert path == str(tmp_path / "shared" / "step-0000000008.nvc")
    dump = tmp_path / "restored.pt"
    _, _, losses = fit_tiny(
        tmp_path / "run2",
        2 * EPOCHS,
        plugins=[fresh],
        ckpt_path=fresh.resume_path(),
        callbacks=[every_2_steps(tmp_path / "local2"), DumpRestoredState(str(dump))],
    )
    restored = torch.load(dump, weights_only=False)
    assert_tree_equal(restored["state_dict"], saved["state_dict"])
    assert_tree_equal(restored["optimizer"], saved["optimizer_states"][0])
    # The same next losses as the run that was never interrupted.
    assert losses == straight[EPOCHS * BATCHES_PER_EPOCH :]
    # The resumed run's checkpoints go on to the same tiers, with their retention.
    assert open_tier(str(tmp_path / "shared")).steps() == [14, 16]


def test_a_damaged_newest_copy_falls_back(tmp_path: Path) -> None:
    plugin = NvcompCheckpointIO(tiers=tiers(tmp_path))
    fit_tiny(tmp_path / "run", EPOCHS, plugins=[plugin], callbacks=[every_2_steps(tmp_path / "local")])
    newest = tmp_path / "shared" / "step-0000000008.nvc"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle: a damaged copy
    newest.write_bytes(bytes(data))
    # Step 8 from the next tier that holds it; then, with that one gone too, the older step 6.
    assert NvcompCheckpointIO(tiers=tiers(tmp_path)).resume_path() == str(tmp_path / "archive" / "step-0000000008.nvc")
    shutil.rmtree(tmp_path / "archive")
    assert NvcompCheckpointIO(tiers=tiers(tmp_path)).resume_path() == str(tmp_path / "shared" / "step-0000000006.nvc")


def test_tiers_must_be_tier_objects(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"NvcompCheckpointIO\(tiers=...\) takes nvcomp_checkpoint.Tier"):
        NvcompCheckpointIO(tiers=[str(tmp_path)])
    with pytest.raises(TypeError, match=r"wrap it in \[...\]"):
        NvcompCheckpointIO(tiers=nc.Tier(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tiers"):
        NvcompCheckpointIO().resume_path()
    assert NvcompCheckpointIO(tiers=[nc.Tier(tmp_path / "empty")]).resume_path() is None
