"""Incremental saves in the CheckpointManager: chains per tier, retention keeping bases, base-first
copies, restore and fetch following chains, on local folders and a real S3 endpoint (moto)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointWriteError
from nvcomp_checkpoint.tiers import verify_unit
from test_tiers_s3 import BUCKET, moto  # noqa: F401 - the moto_server fixture


class _Run:
    """A tiny model trained step by step: consecutive states are close, as a delta expects."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def state(self, step: int) -> dict[str, Any]:
        self.model(torch.randn(8, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step})


def _bases(mgr: nc.CheckpointManager, tier: int = 0) -> dict[int, int | None]:
    return {s: mgr.manifest(s, tier).base for s in mgr.steps(tier)}


def _file_base(path: str) -> str | None:
    with nc.open(path) as r:
        return None if r.index.base is None else r.index.base.path


def test_chains_with_full_every_and_retention_keeping_bases(tmp_path):
    run, states = _Run(), {}
    tiers = [
        nc.Tier(tmp_path / "local", keep=2, name="local"),
        nc.Tier(tmp_path / "shared", every_steps=2, keep=1, name="shared"),
    ]
    with nc.CheckpointManager(tiers, incremental=True, full_every=3) as mgr:
        for step in range(1, 8):
            states[step] = run.state(step)
            mgr.save(step, states[step])
            mgr.wait()
            if step == 3:
                # 1 full, 2 against 1, 3 against 2: the newest two (2, 3) need 1.
                assert _bases(mgr) == {1: None, 2: 1, 3: 2}
                # shared copies 2 (a multiple of 2), which brought its base 1 first; keep=1 keeps 2's chain.
                assert _bases(mgr, 1) == {1: None, 2: 1}
            if step == 6:
                # 4 full: 1-3 go as a chain; 5 against 4, 6 against 5.
                assert _bases(mgr) == {4: None, 5: 4, 6: 5}
        assert _bases(mgr) == {5: 4, 6: 5, 7: None} | {4: None}
        assert _bases(mgr, 1) == {4: None, 5: 4, 6: 5}  # 6 brought its chain
        # The files are deltas whose base is recorded relative to the tier folder.
        assert _file_base(mgr.path(6)) == "step-0000000005.nvc"
        assert nc.open(mgr.path(6)).metadata["nvckpt_base_step"] == 5
    assert _bases(mgr, 1) == {7: None}  # close() copied the newest step, 7 (full), and keep=1 followed
    for step in (4, 5, 6, 7):
        r = nc.CheckpointManager(tiers).restore(step)
        assert r.tier_name == "local"
        assert_tree_equal(states[step], r.state)


def test_delta_base_full_and_first_save_of_a_manager_is_full(tmp_path):
    run = _Run()
    tiers = [nc.Tier(tmp_path / "local")]
    with nc.CheckpointManager(tiers, incremental=True, full_every=4, delta_base="full", async_save=False) as mgr:
        for step in range(10, 70, 10):
            mgr.save(step, run.state(step))
    assert _bases(mgr) == {10: None, 20: 10, 30: 10, 40: 10, 50: None, 60: 50}
    with nc.CheckpointManager(tiers, incremental=True, full_every=4) as mgr2:
        mgr2.save(70, run.state(70))
        mgr2.save(80, run.state(80))
    assert mgr2.manifest(70).base is None and mgr2.manifest(80).base == 70


def test_incremental_takes_a_chain_policy(tmp_path):
    run = _Run()
    policy = nc.ChainPolicy(full_every=3, base="full")
    with nc.CheckpointManager([nc.Tier(tmp_path / "local")], incremental=policy, async_save=False) as mgr:
        assert mgr.chain_policy is policy and mgr.incremental
        for step in range(1, 6):
            mgr.save(step, run.state(step))
    assert _bases(mgr) == {1: None, 2: 1, 3: 1, 4: None, 5: 4}
    with pytest.raises(ValueError, match="in the ChainPolicy only"):
        nc.CheckpointManager([nc.Tier(tmp_path / "other")], incremental=policy, full_every=5)


def test_a_delta_is_not_committed_where_its_base_copy_failed(tmp_path, caplog):
    run = _Run()
    tiers = [nc.Tier(tmp_path / "local"), nc.Tier(tmp_path / "shared", name="shared", retries=0, backoff_s=0)]
    mgr = nc.CheckpointManager(tiers, incremental=True, full_every=10)
    mgr.wait()  # the tiers' leftovers are cleaned (in the background): the blocker below is not taken for one
    # Something in the way of step 1's copy on the shared tier: a folder where its file goes.
    blocker = tmp_path / "shared" / "step-0000000001.nvc"
    blocker.mkdir(parents=True)
    (blocker / "x").write_bytes(b"x")
    caplog.set_level(logging.ERROR, logger="nvcomp_checkpoint")
    mgr.save(1, run.state(1))
    with pytest.raises(CheckpointWriteError, match="copying step 1 failed"):
        mgr.wait()
    mgr.save(2, run.state(2))
    with pytest.raises(CheckpointWriteError, match="step 2 is not copied: it is a delta against step 1, whose copy there failed"):
        mgr.wait()
    assert "step 2 is not copied" in caplog.text
    assert mgr.steps(1) == [] and mgr.steps(0) == [1, 2]
    # Once the way is clear, the next delta's copy brings its whole chain, bases first.
    (blocker / "x").unlink()
    blocker.rmdir()
    mgr.save(3, run.state(3))
    mgr.close()
    m = {s: mgr.manifest(s, 1) for s in mgr.steps(1)}
    assert sorted(m) == [1, 2, 3] and m[1].created <= m[2].created <= m[3].created


def test_a_slow_tier_gets_every_delta_after_its_base(tmp_path):
    run, states = _Run(), {}

    def slow(tier: str, step: int, nbytes: int) -> None:
        if tier == "slow":
            time.sleep(0.05)

    tiers = [nc.Tier(tmp_path / "local", keep=3), nc.Tier(tmp_path / "slow", name="slow", keep=2, max_queued=1)]
    with nc.CheckpointManager(tiers, incremental=True, full_every=4, on_copy_progress=slow) as mgr:
        for step in range(1, 10):
            states[step] = run.state(step)
            mgr.save(step, states[step])
    slow_steps = mgr.steps(1)
    manifests = {s: mgr.manifest(s, 1) for s in slow_steps}
    assert slow_steps[-1] == 9  # close() copies the newest step
    # Which saves the slow tier took depends on timing (a due copy that finds the queue full is
    # skipped); what it lists never depends on it: every delta after its base, and it restores.
    assert slow_steps
    for s, m in manifests.items():
        if m.base is not None:
            assert m.base in manifests and manifests[m.base].created <= m.created
    r = nc.CheckpointManager([nc.Tier(tmp_path / "slow")]).restore()
    assert r.step == slow_steps[-1]
    assert_tree_equal(states[r.step], r.state)


def test_restore_falls_back_over_a_broken_chain(tmp_path, caplog):
    run, states = _Run(), {}
    tiers = [nc.Tier(tmp_path / "local", name="local"), nc.Tier(tmp_path / "shared", name="shared")]
    with nc.CheckpointManager(tiers, incremental=True, full_every=5) as mgr:
        for step in (1, 2, 3):
            states[step] = run.state(step)
            mgr.save(step, states[step])
    local = tmp_path / "local"
    # A damaged base (flipped bytes across step 2's data) on local: step 3 comes from shared.
    data = bytearray((local / "step-0000000002.nvc").read_bytes())
    for k in range(1, 6):
        data[len(data) * k // 8] ^= 0xFF
    (local / "step-0000000002.nvc").write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr = nc.CheckpointManager(tiers, clean=False)
    r = mgr.restore()
    assert (r.step, r.tier_name) == (3, "shared")
    assert_tree_equal(states[3], r.state)
    assert any(s == 3 and t == "local" for s, t, _ in r.skipped)
    # locate checks every byte of the chain too.
    found = mgr.locate()
    assert (found.step, found.tier_name) == (3, "shared")
    # Step 1 gone from shared as well: no copy of 3 or 2 has a whole chain; 1 restores from local.
    (tmp_path / "shared" / "step-0000000001.nvc").unlink()
    r = nc.CheckpointManager(tiers, clean=False).restore()
    assert (r.step, r.tier_name) == (1, "local")
    assert_tree_equal(states[1], r.state)
    reasons = {(s, t): why for s, t, why in r.skipped}
    assert "base step 1 is not on shared" in reasons[(3, "shared")] or "missing" in reasons[(3, "shared")]
    assert {(3, "local"), (2, "local"), (2, "shared")} <= set(reasons)


def test_chains_on_s3_restore_and_fetch(tmp_path, moto):
    run, states = _Run(), {}
    url = f"s3://{BUCKET}/inc"
    tiers = [
        nc.Tier(tmp_path / "local", keep=1),
        nc.Tier(url, every_steps=2, keep=1, name="object", storage_options=moto.options()),
    ]
    with nc.CheckpointManager(tiers, incremental=True, full_every=3) as mgr:
        for step in range(1, 6):
            states[step] = run.state(step)
            mgr.save(step, states[step])
            mgr.wait()
        # object copies 2 and 4 (multiples of 2); 2 brought 1; keep=1 kept 4 (full).
        assert _bases(mgr, 1) == {4: None}
        assert _bases(mgr) == {4: None, 5: 4}
    # close() copied the newest step, 5 (against 4); keep=1 keeps its chain.
    assert _bases(mgr, 1) == {4: None, 5: 4}
    assert moto.keys("inc/") == [f"inc/step-000000000{s}.{x}" for s in (4, 5) for x in ("manifest.json", "nvc")]
    # A fresh node: only the object store.
    fresh = nc.CheckpointManager([nc.Tier(tmp_path / "fresh"), nc.Tier(url, name="object", storage_options=moto.options())])
    r = fresh.restore()
    assert (r.step, r.tier_name) == (5, "object")
    assert_tree_equal(states[5], r.state)
    local = fresh.fetch(5, 1, tmp_path / "download")
    assert sorted(p.name for p in Path(local).parent.iterdir() if p.suffix == ".nvc") == [
        "step-0000000004.nvc",
        "step-0000000005.nvc",
    ]
    assert Path(local).parent.parent == tmp_path / "download"
    assert_tree_equal(states[5], nc.load(local))


def test_nvckpt_sync_brings_and_keeps_the_chain(tmp_path, capsys):
    from nvcomp_checkpoint.cli.main import main

    run, states = _Run(), {}
    with nc.CheckpointManager([nc.Tier(tmp_path / "local")], incremental=True, full_every=3, async_save=False) as mgr:
        for step in range(1, 6):
            states[step] = run.state(step)
            mgr.save(step, states[step])
    dst = tmp_path / "copy"
    assert main(["sync", "--json", str(tmp_path / "local"), str(dst), "--keep", "1"]) == 0
    # --keep 1 keeps 5, a delta of 4: both are copied (4 first) and kept.
    out = json.loads(capsys.readouterr().out)
    assert out["copied"] == [4, 5] and out["kept"] == [4, 5]
    r = nc.CheckpointManager([nc.Tier(dst)]).restore()
    assert r.step == 5
    assert_tree_equal(states[5], r.state)


def _framework_chain(tmp_path: Path, damage_base: bool = False) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Three files a framework named itself (a full, b a delta of a, c a delta of b), adopted as
    steps 1-3 and copied to the tier ``shared``: the chain lies there under step names, not in place."""
    fw = tmp_path / "fw"
    fw.mkdir()
    big = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    states = {s: {"big": big, "small": torch.full((64,), float(s))} for s in (1, 2, 3)}
    paths = {s: fw / f"{n}.ckpt" for s, n in zip((1, 2, 3), "abc")}
    for s, base in ((1, None), (2, paths[1]), (3, paths[2])):
        nc.save(states[s], paths[s], base=base)
    if damage_base:  # a frame of the base damaged on tier 0 already: the copy carries it faithfully
        data = bytearray(paths[1].read_bytes())
        data[len(data) // 2] ^= 0xFF
        paths[1].write_bytes(bytes(data))
    shared = tmp_path / "shared"
    with nc.CheckpointManager([nc.Tier(fw), nc.Tier(shared, name="shared", max_queued=8)], tier0_external=True) as mgr:
        for s, base in ((1, None), (2, paths[1]), (3, paths[2])):
            mgr.adopt(s, paths[s], base=base)
    return shared, states


def _resume_at_once(shared: str, local_dir: str, barrier: Any, out: Any, lock: bool) -> None:
    if not lock:  # a file system that does not honour flock: only the rename keeps the folder whole
        nc.tiers.restore.local_lock = contextlib.nullcontext
    mgr = nc.CheckpointManager([nc.Tier(shared + "-fw"), nc.Tier(shared, name="shared")], tier0_external=True, clean=False)
    barrier.wait(30)
    try:
        found = mgr.resume_path(local_dir)
        out.put((found.step, found.path, float(nc.load(found.path)["small"][0]), [s for s, _, _ in found.skipped]))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put(repr(exc))


def test_processes_resuming_at_once_into_one_folder_get_the_same_whole_chain(tmp_path):
    shared, _ = _framework_chain(tmp_path)
    ctx = multiprocessing.get_context("fork")
    # A fresh folder, then one that already holds the chain; then a fresh one without the lock.
    for local, lock in ((tmp_path / "restore", True), (tmp_path / "restore", True), (tmp_path / "nolock", False)):
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_resume_at_once, args=(str(shared), str(local), barrier, out, lock)) for _ in range(2)]
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert results[0] == results[1], results
        step, path, small, skipped = results[0]
        assert (step, small, skipped) == (3, 3.0, []), results
        chain = Path(path).parent
        assert chain.parent == local and sorted(p.name for p in chain.iterdir()) == ["a.ckpt", "b.ckpt", "step-0000000003.nvc"]
        # One folder per chain, nothing half-written left beside it.
        assert [p.name for p in local.iterdir() if not p.name.endswith(".lock")] == [chain.name]
    # A laid-out chain damaged since is never rewritten (another process may read it): an error naming it.
    base = chain / "a.ckpt"
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 0xFF
    base.write_bytes(bytes(data))
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "fw"), nc.Tier(shared, name="shared")], tier0_external=True, clean=False)
    with pytest.raises(nc.errors.FormatError, match=f"{chain}: step 3, laid out there by an earlier fetch, does not check"):
        mgr.fetch(3, 1, tmp_path / "nolock")


def test_verify_decodes_a_laid_out_delta(tmp_path):
    shared, _ = _framework_chain(tmp_path, damage_base=True)
    store = nc.tiers.open_tier(str(shared))
    # Every byte matches the manifests (the damage was copied faithfully): only decoding finds it.
    assert verify_unit(store, store.manifest(3), full=False) is None
    problem = verify_unit(store, store.manifest(3), full=True)
    assert problem is not None and "laid out with its chain, it does not decode" in problem and "'big'" in problem
    assert verify_unit(store, store.manifest(1), full=True) is not None
