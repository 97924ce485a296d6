"""``CheckpointManager.adopt``: units written by someone else (a framework's checkpoint) copied to the tiers."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.tiers import TierCopies, verify_unit


def test_adopted_files_and_folders_are_copied_checked_and_retained(tmp_path: Path) -> None:
    fw = tmp_path / "framework"
    fw.mkdir()
    mgr = nc.CheckpointManager(
        [nc.Tier(fw, name="fw"), nc.Tier(tmp_path / "shared", keep=2, name="shared", max_queued=8)],
        tier0_external=True,
    )
    for step in (10, 20, 30):
        nc.save({"w": torch.full((100,), float(step))}, fw / f"epoch-{step}.ckpt")
        assert mgr.adopt(step, fw / f"epoch-{step}.ckpt") is not None
    assert mgr.adopt(30, fw / "epoch-30.ckpt") is None  # the same step again (Lightning: last.ckpt beside the top-k file)
    folder = fw / "checkpoint-40"
    folder.mkdir()
    nc.save({"w": torch.ones(5)}, folder / "model.nvc")
    (folder / "state.json").write_text("{}")
    mgr.adopt(40, folder)
    mgr.wait()
    assert mgr.steps(1) == [30, 40]
    assert mgr.steps(0) == []  # tier 0 is the framework's: no manifest is written there
    assert sorted(os.listdir(fw)) == ["checkpoint-40", "epoch-10.ckpt", "epoch-20.ckpt", "epoch-30.ckpt"]
    store = mgr._stores[1]
    assert verify_unit(store, store.manifest(40)) is None
    assert (Path(mgr.path(40, 1)) / "state.json").read_text() == "{}"
    r = mgr.restore(30)
    assert r is not None and r.tier_name == "shared" and torch.equal(r.state["w"], torch.full((100,), 30.0))
    located = mgr.locate()
    assert located is not None and located.step == 40 and located.state is None and located.path == mgr.path(40, 1)
    mgr.close()


def test_tier0_external_refuses_saves_and_missing_units(tmp_path: Path) -> None:
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "fw"), nc.Tier(tmp_path / "shared")], tier0_external=True)
    with pytest.raises(CheckpointError, match=r"belongs to the framework .* adopt\(step, path\)"):
        mgr.save(1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="adopt"):
        mgr.commit(1)
    with pytest.raises(CheckpointError, match="nothing to adopt as step 3"):
        mgr.adopt(3, tmp_path / "fw" / "gone.ckpt")
    mgr.close()


def test_a_source_the_framework_rotates_away_mid_copy_is_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    src = tmp_path / "fw" / "epoch-1.ckpt"
    src.parent.mkdir()
    nc.save({"w": torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))}, src)  # > one copy chunk
    assert src.stat().st_size > 9 << 20

    def rotate_away(tier: str, step: int, nbytes: int) -> None:
        if src.exists() and src.stat().st_size > 100:
            with open(src, "r+b") as f:  # the framework replaces the file while the copy reads it
                f.truncate(100)

    mgr = nc.CheckpointManager(
        [nc.Tier(src.parent, name="fw"), nc.Tier(tmp_path / "shared", name="shared")],
        tier0_external=True,
        on_copy_progress=rotate_away,
    )
    with caplog.at_level(logging.WARNING, logger="nvcomp_checkpoint"):
        mgr.adopt(1, src)
        mgr.close()  # no error: the copy is skipped, not failed
    assert mgr.steps(1) == []
    assert "removed or replaced" in caplog.text and "the copy is skipped" in caplog.text
    assert os.listdir(tmp_path / "shared") == []  # nothing half-copied left


def test_a_framework_removal_waits_for_the_copies_of_that_checkpoint(tmp_path: Path) -> None:
    # ModelCheckpoint's top-k (or Accelerate's total_limit) removes a checkpoint whose copy is
    # still queued or running: the deletion runs once the copy is done, so the tier gets it.
    fw = tmp_path / "fw"
    fw.mkdir()
    copying, release = threading.Event(), threading.Event()

    def hold(tier: str, step: int, nbytes: int) -> None:
        if step == 1:
            copying.set()
            assert release.wait(30)

    mgr = nc.CheckpointManager(
        [nc.Tier(fw, name="fw"), nc.Tier(tmp_path / "shared", name="shared", max_queued=8)],
        tier0_external=True,
        on_copy_progress=hold,
    )
    for step in (1, 2):
        nc.save({"w": torch.full((1000,), float(step))}, fw / f"step-{step}.ckpt")
        mgr.adopt(step, fw / f"step-{step}.ckpt")
    assert copying.wait(30)
    removed: list[str] = []

    def remover(name: str):
        return lambda: (os.remove(fw / name), removed.append(name))

    assert mgr.remove_after_copies(fw / "step-1.ckpt", remover("step-1.ckpt")) is True  # its copy is running
    assert mgr.remove_after_copies(fw / "step-2.ckpt", remover("step-2.ckpt")) is True  # its copy is queued
    assert (fw / "step-1.ckpt").exists() and removed == []
    release.set()
    mgr.wait()
    assert removed == ["step-1.ckpt", "step-2.ckpt"] and os.listdir(fw) == []
    assert mgr.steps(1) == [1, 2]
    # Nothing pending: a removal runs at once.
    nc.save({"w": torch.ones(3)}, fw / "step-3.ckpt")
    assert mgr.remove_after_copies(fw / "step-3.ckpt", remover("step-3.ckpt")) is False and removed[-1] == "step-3.ckpt"
    mgr.close()


def test_tier_copies_take_a_list_of_tiers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Owner\(tiers=\[\]\)"):
        TierCopies([], "Owner")
    with pytest.raises(TypeError, match="takes nvcomp_checkpoint.Tier objects, got str"):
        TierCopies(["fsx/run1"], "Owner")
    with pytest.raises(TypeError, match=r"wrap it in \[...\]"):
        TierCopies(nc.Tier(tmp_path), "Owner")  # type: ignore[arg-type]


def _deltas(fw: Path, steps: tuple[int, ...]) -> list[Path]:
    """Files as a framework's incremental saves write them: the first full, each next a delta of the one before."""
    paths = []
    for step in steps:
        path = fw / f"epoch-{step}.ckpt"
        nc.save({"w": torch.arange(1000, dtype=torch.float32) + step * 1e-3}, path, base=paths[-1] if paths else None)
        paths.append(path)
    return paths


def test_an_adopted_delta_is_not_committed_where_its_base_copy_failed(tmp_path: Path, caplog) -> None:
    fw = tmp_path / "framework"
    fw.mkdir()
    mgr = nc.CheckpointManager(
        [nc.Tier(fw, name="fw"), nc.Tier(tmp_path / "shared", name="shared", retries=0, backoff_s=0, max_queued=8)],
        tier0_external=True,
    )
    mgr.wait()  # the tiers' leftovers are cleaned in the background: the blocker below would be one
    blocker = tmp_path / "shared" / "step-0000000010.nvc"  # a folder where step 10's copy goes
    blocker.mkdir(parents=True)
    (blocker / "x").write_bytes(b"x")
    caplog.set_level(logging.ERROR, logger="nvcomp_checkpoint")
    a, b = _deltas(fw, (10, 20))
    mgr.adopt(10, a)
    with pytest.raises(CheckpointError, match="copying step 10 failed"):
        mgr.wait()
    assert mgr.adopt(20, b, base=a).base == 10
    with pytest.raises(CheckpointError, match="step 20 is not copied: it is a delta against step 10, whose copy there failed"):
        mgr.wait()
    assert "step 20 is not copied" in caplog.text and mgr.steps(1) == []
    # A delta against a file the manager never adopted: not copied, said at the next wait.
    (c,) = _deltas(fw, (30,))
    (d,) = [fw / "epoch-40.ckpt"]
    nc.save({"w": torch.zeros(1000)}, d, base=c)
    assert mgr.adopt(40, d, base=c) is None
    with pytest.raises(CheckpointError, match="which was not handed to the tiers"):
        mgr.wait()
    mgr.close()


def test_the_framework_removing_a_base_waits_for_the_copies_that_need_it(tmp_path: Path) -> None:
    fw = tmp_path / "framework"
    fw.mkdir()
    gate = threading.Event()

    def slow(tier: str, step: int, nbytes: int) -> None:
        if step == 20:
            gate.wait(10)

    copies = TierCopies([nc.Tier(tmp_path / "shared", name="shared", max_queued=8)], "test", on_copy_progress=slow)
    a, b = _deltas(fw, (10, 20))
    copies.adopt(10, a)
    copies.wait()  # step 10 is copied
    copies.adopt(20, b, base=a)
    # Step 20's copy (held) needs step 10 on tier 0 should the tier lack it: removing 10 waits for it.
    assert copies.remove_after_copies(a, lambda: os.remove(a)) is True
    assert a.exists()
    gate.set()
    copies.wait()
    assert not a.exists()
    mgr = copies.manager()
    assert {s: mgr.manifest(s, 1).base for s in mgr.steps(1)} == {10: None, 20: 10}
