"""Accelerate's ``register_nvcomp_hooks(accelerator, tiers=[...])``: the save_state folder is tier 0.

The training program of ``test_accelerate`` (a tiny model with dropout, AdamW, StepLR, a registered
object; every RNG shapes the loss), run in this process; the shared tiers are folders.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.accelerate import MANIFEST_NAME, register_nvcomp_hooks  # noqa: E402
from nvcomp_checkpoint.tiers import open_tier  # noqa: E402
from test_accelerate import _module, script  # noqa: E402,F401 - script is a fixture

SAVES, M_STEPS = 5, 3


def tiers(base: Path) -> list[nc.Tier]:
    return [
        nc.Tier(base / "shared", keep=2, name="shared", max_queued=8),
        nc.Tier(base / "archive", every_steps=2, name="archive", max_queued=8),
    ]


def build(module, project_dir: Path, base: Path, **kwargs):
    acc, model, opt, sched, tracker, _ = module.build(project_dir=str(project_dir), total_limit=2, hooks=False)
    hooks = register_nvcomp_hooks(acc, tiers=tiers(base), **kwargs)
    return acc, model, opt, sched, tracker, hooks


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_copies_reach_the_tiers_and_a_fresh_node_resumes(script, tmp_path: Path, async_save: bool) -> None:  # noqa: F811
    m = _module(script)
    torch.set_num_threads(1)
    node1 = tmp_path / "node1"
    objs = build(m, node1, tmp_path, async_save=async_save)
    acc, hooks = objs[0], objs[5]
    for _ in range(SAVES):
        m.train(objs, 1)
        acc.save_state()  # checkpoints/checkpoint_<iteration>, total_limit=2
    hooks.wait()  # the last commit, then every copy
    at_save = m.snapshot(objs)
    straight = m.train(objs, M_STEPS)
    hooks.remove()

    assert sorted(p.name for p in (node1 / "checkpoints").iterdir()) == ["checkpoint_3", "checkpoint_4"]
    shared, archive = open_tier(str(tmp_path / "shared")), open_tier(str(tmp_path / "archive"))
    assert shared.steps() == [3, 4]  # keep=2
    assert archive.steps() == [0, 2, 4]  # every 2 iterations
    copy = Path(shared.unit_path(4, True))
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in (node1 / "checkpoints" / "checkpoint_4").iterdir())
    assert (copy / MANIFEST_NAME).is_file()

    # The node is lost with its checkpoints; a new one resumes from the newest copy.
    shutil.rmtree(node1)
    objs2 = build(m, tmp_path / "node2", tmp_path, async_save=async_save)
    acc2, hooks2 = objs2[0], objs2[5]
    path = hooks2.resume_path()
    assert path == str(copy)
    acc2.load_state(path)
    assert_tree_equal(m.snapshot(objs2), at_save)  # model, optimizer, scheduler, RNGs, registered object
    assert m.train(objs2, M_STEPS) == straight  # the same next losses
    assert acc2.save_iteration == SAVES  # numbering goes on after the copy loaded
    acc2.save_state()
    hooks2.wait()
    assert shared.steps() == [4, 5]
    hooks2.remove()


def test_a_damaged_newest_copy_falls_back_to_another_tier_then_an_older_step(script, tmp_path: Path) -> None:  # noqa: F811
    m = _module(script)
    objs = build(m, tmp_path / "node1", tmp_path)
    for _ in range(3):
        m.train(objs, 1)
        objs[0].save_state()
    objs[5].remove()
    damaged = tmp_path / "shared" / "step-0000000002" / "optimizer.nvc"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    objs2 = build(m, tmp_path / "node2", tmp_path)
    # The same step on the next tier first, then older steps.
    assert objs2[5].resume_path() == str(tmp_path / "archive" / "step-0000000002")
    shutil.rmtree(tmp_path / "archive")
    assert objs2[5].resume_path() == str(tmp_path / "shared" / "step-0000000001")
    objs2[5].remove()


def test_tiers_are_checked_before_the_accelerator_is_wrapped(script, tmp_path: Path) -> None:  # noqa: F811
    m = _module(script)
    acc = m.build(project_dir=str(tmp_path), hooks=False)[0]
    with pytest.raises(TypeError, match=r"register_nvcomp_hooks\(tiers=...\) takes nvcomp_checkpoint.Tier"):
        register_nvcomp_hooks(acc, tiers=[str(tmp_path / "shared")])
    hooks = register_nvcomp_hooks(acc)  # not left half wrapped
    with pytest.raises(ValueError, match="no tiers"):
        hooks.resume_path()
    hooks.remove()
