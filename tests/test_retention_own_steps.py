"""Retention never takes a step this manager wrote for a foreign one, nor removes it: a step is recorded as
the manager's own before its manifest makes it visible to the retention that other threads run."""

from __future__ import annotations

import logging
from typing import Any

import torch

import nvcomp_checkpoint as nc

FOREIGN = "this run did not see them"


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(32, 16)}, "optimizer": {"m": torch.randn(32, 16)}, "step": step}


def _retention_right_after_each_manifest(mgr: nc.CheckpointManager) -> None:
    """Run tier 0's retention at the instant a manifest is on disk, as the copy thread does when a copy
    ends (``Copier.done``), so the interleaving that a loaded machine produces now and then is forced."""
    store = mgr._stores[0]
    write = store.write_manifest

    def write_then_retention(manifest: Any) -> None:
        write(manifest)
        mgr._retention.apply(0)

    store.write_manifest = write_then_retention  # type: ignore[method-assign]


def test_a_step_just_written_is_never_taken_for_a_foreign_one(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "a", keep=2)], async_save=False)
    _retention_right_after_each_manifest(mgr)
    for step in (100, 200, 300):
        mgr.save(step, _state(step))
    mgr.close()
    assert FOREIGN not in caplog.text
    assert mgr.steps(0) == [200, 300]


def test_a_step_saved_again_after_a_resume_is_not_removed_as_abandoned(tmp_path, caplog):
    tiers = [nc.Tier(tmp_path / "a", keep=5)]
    with nc.CheckpointManager(tiers, async_save=False) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step))
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr = nc.CheckpointManager(tiers, async_save=False)
    assert mgr.restore(step=20).step == 20  # step 30 is abandoned: the next save replaces it
    _retention_right_after_each_manifest(mgr)
    mgr.save(25, _state(25))
    assert mgr.steps(0) == [10, 20, 25]
    mgr.save(30, _state(30))  # the run's own step 30, saved again
    mgr.close()
    assert mgr.steps(0) == [10, 20, 25, 30]
    assert caplog.text.count("removing step 30") == 1 and FOREIGN not in caplog.text
    r = nc.CheckpointManager(tiers).restore()
    assert r.step == 30 and torch.equal(r.state["model"]["w"], _state(30)["model"]["w"])


def test_the_readme_incremental_manager_never_warns_about_its_own_steps(tmp_path, caplog):
    """The README's example (async saves, a copy tier every 300 steps, deltas, a bf16 model and AdamW), run
    many times: the copy thread's retention of tier 0 races the next save's commit (about 1 run in 7 saw
    its own step as foreign before the step was recorded ahead of its manifest)."""
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    for run in range(12):
        root = tmp_path / f"run{run}"
        model = torch.nn.Linear(256, 256).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mgr = nc.CheckpointManager(
            [nc.Tier(root / "nvme", keep=2), nc.Tier(root / "fsx", every_steps=300, keep=2)], incremental=True, full_every=5
        )
        for step in range(100, 1100, 100):
            model(torch.randn(8, 256, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        mgr.close()
        assert mgr.steps(0) == [600, 700, 800, 900, 1000] and mgr.steps(1) == [600, 700, 800, 900, 1000]
        assert FOREIGN not in caplog.text and "removing step" not in caplog.text, f"run {run}"
