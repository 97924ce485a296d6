"""Storage tiers on local folders: schedules, retention, verified copies, restore with fallback, light saves.

The S3 tier (a real moto server) is covered in test_tiers_s3.py.
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError, CopySourceError, CopyTimeoutError
from nvcomp_checkpoint.storage import is_temp_name, temp_prefix
from nvcomp_checkpoint.tiers import TierStore, UnitManifest, light_tree, open_tier, retained_steps
from nvcomp_checkpoint.tiers.retention import newer_steps, steps_to_remove
from nvcomp_checkpoint.tiers.transfer import copy_with_retries


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def _tiers(tmp_path: Path, **kw: Any) -> list[nc.Tier]:
    return [
        nc.Tier(tmp_path / "local", keep=2, name="local"),
        nc.Tier(tmp_path / "shared", every_steps=2, keep=2, name="shared", **kw),
        nc.Tier(tmp_path / "object", every_steps=3, keep=1, keep_every_steps=6, name="object", **kw),
    ]


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_retention_on_every_tier(tmp_path):
    states = {}
    with nc.CheckpointManager(_tiers(tmp_path)) as mgr:
        for step in range(1, 14):
            states[step] = _state(step)
            mgr.save(step, states[step])
            mgr.wait()  # copies land before the next save: the schedule is deterministic
        # local: every save, newest 2. shared: the multiples of 2, newest 2.
        # object: the multiples of 3, the newest one plus the multiples of 6.
        assert mgr.steps(0) == [12, 13]
        assert mgr.steps(1) == [10, 12]
        assert mgr.steps(2) == [6, 12]
        assert mgr.path(12, tier=2) == str(tmp_path / "object" / "step-0000000012.nvc")
        assert mgr.path(9, tier=2) is None
    # close() copied the newest step, 13, to the tiers whose schedules skipped it; their retention followed.
    assert mgr.steps(1) == [12, 13] and mgr.steps(2) == [6, 12, 13]
    # Only committed units and their manifests are left: no temporary files, no orphans.
    assert _files(tmp_path / "shared") == [
        "step-0000000012.manifest.json",
        "step-0000000012.nvc",
        "step-0000000013.manifest.json",
        "step-0000000013.nvc",
    ]
    # The copies are the compressed file as it is, byte for byte.
    assert (tmp_path / "object" / "step-0000000013.nvc").read_bytes() == (tmp_path / "local" / "step-0000000013.nvc").read_bytes()
    r = nc.CheckpointManager(_tiers(tmp_path)).restore()
    assert (r.step, r.tier_name, r.light) == (13, "local", False)
    assert_tree_equal(states[13], r.state)


def test_keep_every_steps_and_retained_steps():
    assert retained_steps(range(1, 21), 2, None) == {19, 20}
    assert retained_steps(range(1, 21), 2, 5) == {5, 10, 15, 19, 20}
    assert retained_steps([3, 9], 1, None, protect=[3, 7]) == {3, 9}
    assert retained_steps([1, 2, 3], None, None) == {1, 2, 3}


def test_keep_every_steps_on_a_tier(tmp_path):
    tiers = [nc.Tier(tmp_path / "a", keep=1), nc.Tier(tmp_path / "b", keep=2, keep_every_steps=4)]
    with nc.CheckpointManager(tiers) as mgr:
        for step in range(1, 11):
            mgr.save(step, {"w": torch.full((8,), float(step))})
            mgr.wait()
        assert mgr.steps(0) == [10]
        assert mgr.steps(1) == [4, 8, 9, 10]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_newest_copy_falls_back_to_another_tier_then_older_step(tmp_path, caplog):
    tiers = [nc.Tier(tmp_path / "local", keep=3), nc.Tier(tmp_path / "shared", keep=3)]
    states = {s: _state(s) for s in (1, 2)}
    with nc.CheckpointManager(tiers) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
        mgr.wait()
    local2, shared2 = tmp_path / "local" / "step-0000000002.nvc", tmp_path / "shared" / "step-0000000002.nvc"
    # A data byte in the middle of the file (not the index): only decoding finds it.
    _flip_byte(local2, local2.stat().st_size // 3)
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    r = nc.CheckpointManager(tiers).restore()
    assert (r.step, r.tier) == (2, 1)
    assert_tree_equal(states[2], r.state)
    assert [(s, t) for s, t, _ in r.skipped] == [(2, "tier0")]
    assert "checksum" in r.skipped[0][2].lower()
    assert "skipped step 2 on tier0" in caplog.text

    # Both copies of step 2 damaged (one truncated): the older step, bit-identical.
    shared2.write_bytes(shared2.read_bytes()[:-100])
    r = nc.CheckpointManager(tiers).restore()
    assert r.step == 1 and r.tier == 0
    assert_tree_equal(states[1], r.state)
    assert [(s, t) for s, t, _ in r.skipped] == [(2, "tier0"), (2, "tier1")]
    assert "manifest says" in r.skipped[1][2]

    # Asking for step 2 only: a clear error that names both copies.
    with pytest.raises(CheckpointError, match="step 2 on tier0.*step 2 on tier1"):
        nc.CheckpointManager(tiers).restore(step=2)


def test_fresh_start_restores_nothing(tmp_path):
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "a")])
    assert mgr.restore() is None and mgr.steps() == []
    with pytest.raises(CheckpointError, match="step 5 is on no tier"):
        mgr.restore(step=5)


def test_light_saves(tmp_path, caplog):
    tiers = [nc.Tier(tmp_path / "local", keep=2), nc.Tier(tmp_path / "shared", keep=1)]
    states = {}
    with nc.CheckpointManager(tiers, full_every=3) as mgr:
        for step in range(1, 6):  # full: 1, 4; light: 2, 3, 5
            states[step] = _state(step)
            mgr.save(step, states[step])
            mgr.wait()
        # keep=2 and keep=1, yet the newest full save (4) stays on every tier.
        assert mgr.steps(0) == [4, 5]
        assert mgr.steps(1) == [4, 5]
        assert [mgr.manifest(s).light for s in (4, 5)] == [False, True]
    with nc.open(tmp_path / "local" / "step-0000000005.nvc") as reader:
        assert set(reader.summary()) == {"weights"}
        assert reader.metadata["nvckpt_light"] is True and "optimizer" in reader.metadata["nvckpt_dropped"]
    mgr = nc.CheckpointManager(tiers)
    with caplog.at_level("WARNING", logger="nvcomp_checkpoint"):
        r = mgr.restore()
    assert (r.step, r.light) == (4, False)
    assert_tree_equal(states[4], r.state)
    assert any("light" in reason for _, _, reason in r.skipped)
    # The log says what was skipped and why, not only how many.
    assert "newer steps not restored: step 5 on tier0: light (weights only); pass allow_light=True to use it" in caplog.text
    r = mgr.restore(allow_light=True)
    assert (r.step, r.light) == (5, True)
    assert_tree_equal({"model": states[5]["model"], "step": 5}, r.state)


def test_light_tree_drops_whole_subtrees():
    state = _state(1)
    state["rng"] = {"cpu": torch.get_rng_state()}
    state["epoch"] = 3
    tree, dropped = light_tree(state)
    assert set(tree) == {"model", "step", "epoch"}
    assert sorted(dropped) == ["optimizer", "rng"]
    assert_tree_equal(state["model"], tree["model"])


def test_slow_tier_copy_is_skipped_not_waited_for(tmp_path, caplog):
    release, copying = threading.Event(), threading.Event()

    def slow(tier: str, step: int, nbytes: int) -> None:
        if tier == "slow":
            copying.set()
            release.wait(30)

    tiers = [nc.Tier(tmp_path / "local", keep=5), nc.Tier(tmp_path / "slow", name="slow", max_queued=1)]
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr = nc.CheckpointManager(tiers, on_copy_progress=slow)
    blocked = []
    for step in range(1, 5):
        t = time.perf_counter()
        mgr.save(step, {"w": torch.full((1000,), float(step))}).result()
        blocked.append(time.perf_counter() - t)
        if step == 1:  # the copy thread has taken step 1 off the queue (on a loaded machine it can lag)
            assert copying.wait(30)
    # Step 1 is copying (held), step 2 waits in the queue, steps 3 and 4 are skipped.
    deadline = time.monotonic() + 30  # step 4's copy is scheduled just after its save is durable
    while "step 4 is skipped" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "slow is behind: the copy of step 3 is skipped" in caplog.text
    assert "the copy of step 4 is skipped" in caplog.text
    assert max(blocked) < 10
    assert mgr.steps(0) == [1, 2, 3, 4]
    release.set()
    mgr.close()
    assert mgr.steps(1) == [1, 2, 4]  # and the newest, skipped, at close


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 2 MiB tmpfs (needs root and mount rights; skipped otherwise)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_tier0_full_raises_and_keeps_previous_checkpoint(tiny_tmpfs, tmp_path):
    tiers = [nc.Tier(tiny_tmpfs / "run", keep=3), nc.Tier(tmp_path / "shared", keep=3)]
    g = torch.Generator().manual_seed(0)
    small = {"w": torch.randint(0, 256, (300 << 10,), dtype=torch.uint8, generator=g)}
    big = {"w": torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)}  # does not fit in 2 MiB
    mgr = nc.CheckpointManager(tiers)
    mgr.save(1, small)
    mgr.wait()
    mgr.save(2, big)
    with pytest.raises(CheckpointWriteError, match="disk is full"):
        mgr.wait()
    assert mgr.steps(0) == [1] and mgr.steps(1) == [1]
    assert _files(tiny_tmpfs / "run") == ["step-0000000001.manifest.json", "step-0000000001.nvc"]
    r = mgr.restore()
    assert r.step == 1
    assert_tree_equal(small, r.state)
    # The error is raised once; saving goes on when space is back.
    mgr.save(3, small)
    mgr.close()
    assert mgr.steps(0) == [1, 3]


_FSIZE_CHILD = """
import resource, signal, sys, torch
import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointWriteError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
mgr = nc.CheckpointManager([nc.Tier(sys.argv[1], keep=3)])
mgr.save(1, {"w": torch.arange(1000.0)})
mgr.wait()
mgr.save(2, {"w": torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)})
try:
    mgr.wait()
except CheckpointWriteError as exc:
    print("CheckpointWriteError", mgr.steps(0), exc)
"""


def test_tier0_file_size_limit_in_child(tmp_path):
    """Where no tmpfs can be mounted: RLIMIT_FSIZE makes the kernel fail the tier-0 write."""
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path / "run")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("CheckpointWriteError [1] "), proc.stdout + proc.stderr[-2000:]
    assert _files(tmp_path / "run") == ["step-0000000001.manifest.json", "step-0000000001.nvc"]
    r = nc.CheckpointManager([nc.Tier(tmp_path / "run")]).restore()
    assert r.step == 1 and torch.equal(r.state["w"], torch.arange(1000.0))


def test_directory_unit_copied_verified_and_retained(tmp_path, caplog):
    """A sharded save (a folder of files, as DCP writes) is one unit."""
    tiers = [nc.Tier(tmp_path / "local", keep=1), nc.Tier(tmp_path / "shared", keep=2)]
    mgr = nc.CheckpointManager(tiers)
    for step in (1, 2):
        unit = Path(mgr.unit_path(step, directory=True))
        (unit / "shards").mkdir(parents=True)
        nc.save({"w": torch.full((100,), float(step))}, unit / "shards" / "rank0.nvc")
        (unit / ".metadata").write_bytes(b"plan %d" % step * 100)
        m = mgr.commit(step)
        assert m.directory and [f.path for f in m.files] == [".metadata", "shards/rank0.nvc"]
        mgr.wait()
    assert mgr.steps(0) == [2] and mgr.steps(1) == [1, 2]
    assert not (tmp_path / "local" / "step-0000000001").exists()
    assert (tmp_path / "shared" / "step-0000000002" / ".metadata").read_bytes() == b"plan 2" * 100

    def loader(path: str, options: Any) -> Any:
        return nc.load(Path(path) / "shards" / "rank0.nvc")

    r = mgr.restore(loader=loader)
    assert (r.step, r.tier) == (2, 0) and torch.equal(r.state["w"], torch.full((100,), 2.0))
    # A damaged plain file in the tier-0 unit: found by its checksum, the shared copy is used.
    _flip_byte(tmp_path / "local" / "step-0000000002" / ".metadata", 3)
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    r = mgr.restore(loader=loader)
    assert (r.step, r.tier) == (2, 1)
    assert "checksum mismatch" in r.skipped[0][2]
    mgr.close()


_KILLED_COPY = """
import sys, time, torch
import nvcomp_checkpoint as nc
def hold(tier, step, nbytes):
    if step == 2:
        print("COPYING", flush=True)
        time.sleep(600)
mgr = nc.CheckpointManager([nc.Tier(sys.argv[1]), nc.Tier(sys.argv[2])], on_copy_progress=hold)
mgr.save(1, {"w": torch.arange(1000.0)})
mgr.wait()
g = torch.Generator().manual_seed(0)
mgr.save(2, {"w": torch.randint(0, 256, (20 << 20,), dtype=torch.uint8, generator=g)})
time.sleep(600)
"""


def test_copy_killed_mid_way_is_never_listed_and_cleaned(tmp_path):
    import os
    import signal
    import sys

    local, shared = tmp_path / "local", tmp_path / "shared"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_COPY, str(local), str(shared)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout.readline().strip() == b"COPYING", proc.stderr.read().decode()[-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    partial = [p.name for p in shared.iterdir() if is_temp_name(p.name)]
    assert len(partial) == 1 and partial[0].startswith(temp_prefix("step-0000000002.nvc"))
    tiers = [nc.Tier(local), nc.Tier(shared)]
    assert nc.CheckpointManager(tiers, clean=False).steps(1) == [1]  # never listed
    mgr = nc.CheckpointManager(tiers)
    mgr.wait()  # the leftovers go in the background, before the first write to the tier
    assert _files(shared) == ["step-0000000001.manifest.json", "step-0000000001.nvc"]
    r = nc.CheckpointManager(tiers[1:]).restore()
    assert r.step == 1 and torch.equal(r.state["w"], torch.arange(1000.0))
    assert mgr.steps(0) == [1, 2]


def test_leftovers_are_cleaned_by_the_next_manager(tmp_path):
    tiers = [nc.Tier(tmp_path / "local"), nc.Tier(tmp_path / "shared")]
    with nc.CheckpointManager(tiers) as mgr:
        mgr.save(1, {"w": torch.ones(10)})
    shared = tmp_path / "shared"
    # What a killed copy leaves: a temporary file, and a unit whose manifest was never written.
    (shared / ".step-0000000002.nvc.tmp-123-abcd").write_bytes(b"partial")
    (shared / "step-0000000003.nvc").write_bytes((shared / "step-0000000001.nvc").read_bytes())
    assert nc.CheckpointManager(tiers, clean=False).steps(1) == [1]  # never listed
    nc.CheckpointManager(tiers).wait()  # the leftovers go in the background, before the first write to the tier
    assert _files(shared) == ["step-0000000001.manifest.json", "step-0000000001.nvc"]


def test_sync_saves_and_bad_arguments(tmp_path):
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "a", keep=1), nc.Tier(tmp_path / "b")], async_save=False)
    report = mgr.save(7, {"w": torch.ones(4)})
    assert report.stored_bytes == (tmp_path / "a" / "step-0000000007.nvc").stat().st_size
    mgr.close()
    assert mgr.steps(1) == [7]
    with pytest.raises(ValueError, match="takes every save"):
        nc.CheckpointManager([nc.Tier(tmp_path / "a", every_steps=2)])
    with pytest.raises(ValueError, match="keep must be a positive integer"):
        nc.Tier(tmp_path / "a", keep=0)
    with pytest.raises(ValueError, match="part_size"):
        nc.Tier("s3://b/x", part_size=1 << 20)
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        mgr.save(-1, {})


def test_resumed_run_replaces_the_abandoned_newer_steps(tmp_path, caplog):
    tiers = [nc.Tier(tmp_path / "local", keep=3), nc.Tier(tmp_path / "shared", every_steps=10, keep=3)]
    with nc.CheckpointManager(tiers) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step))
            mgr.wait()
        assert mgr.steps(0) == [10, 20, 30] and mgr.steps(1) == [10, 20, 30]
    # Step 30 is damaged everywhere: the run resumes from 20 and trains on.
    for t in ("local", "shared"):
        _flip_byte(tmp_path / t / "step-0000000030.nvc", 200)
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr = nc.CheckpointManager(tiers)
    r = mgr.restore()
    assert r.step == 20
    new = _state(25)
    mgr.save(25, new)  # due on "shared" although only 5 steps passed: the newer copies are abandoned
    mgr.close()
    assert "removing step 30, newer than step 25 just saved" in caplog.text
    assert mgr.steps(0) == [10, 20, 25] and mgr.steps(1) == [10, 20, 25]
    r = nc.CheckpointManager(tiers).restore()
    assert r.step == 25 and r.skipped == ()
    assert_tree_equal(new, r.state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_directory_unit_restores_through_a_loader(tmp_path):
    """A real torch.distributed.checkpoint save (one process) is one unit, restored with dcp.load."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    tiers = [nc.Tier(tmp_path / "local", keep=1), nc.Tier(tmp_path / "shared", keep=2)]
    state = _state(3)["model"]
    mgr = nc.CheckpointManager(tiers)
    dcp.save({"model": state}, checkpoint_id=mgr.unit_path(3, directory=True), no_dist=True)
    m = mgr.commit(3)
    assert m.directory and ".metadata" in [f.path for f in m.files]
    mgr.close()
    assert mgr.steps(1) == [3]

    def loader(path: str, options: Any) -> Any:
        target = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
        dcp.load(target, checkpoint_id=path, no_dist=True)
        return target

    # Tier 0 lost: the shared copy restores, bit-identical.
    import shutil

    shutil.rmtree(tmp_path / "local")
    r = nc.CheckpointManager(tiers).restore(loader=loader)
    assert (r.step, r.tier) == (3, 1)
    assert_tree_equal({"model": state}, r.state)


def test_every_steps_copies_multiples_and_close_copies_the_newest(tmp_path):
    tiers = [nc.Tier(tmp_path / "local"), nc.Tier(tmp_path / "even", every_steps=2), nc.Tier(tmp_path / "fourth", every_steps=4)]
    mgr = nc.CheckpointManager(tiers)
    for step in range(1, 8):
        mgr.save(step, {"w": torch.full((8,), float(step))})
        mgr.wait()
    # Multiples of N (as keep_every_steps, Lightning's every_n_train_steps, Orbax's save_interval_steps).
    assert mgr.steps(1) == [2, 4, 6] and mgr.steps(2) == [4]
    mgr.close()
    # The run's newest step reaches every tier at close, though its schedule skipped it.
    assert mgr.steps(1) == [2, 4, 6, 7] and mgr.steps(2) == [4, 7]
    r = nc.CheckpointManager([nc.Tier(tmp_path / "fourth")]).restore()
    assert r.step == 7 and torch.equal(r.state["w"], torch.full((8,), 7.0))


def test_close_copies_the_newest_step_to_a_minutes_tier(tmp_path):
    tiers = [nc.Tier(tmp_path / "local", keep=1), nc.Tier(tmp_path / "hourly", every_minutes=60)]
    with nc.CheckpointManager(tiers) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((8,), float(step))})
            mgr.wait()
        assert mgr.steps(1) == [1]
    assert mgr.steps(1) == [1, 3]


def test_close_and_wait_give_up_by_their_deadline_and_name_what_is_not_copied(tmp_path):
    release = threading.Event()

    def hold(tier: str, step: int, nbytes: int) -> None:
        if tier == "slow":
            release.wait(60)

    tiers = [nc.Tier(tmp_path / "local", keep=5), nc.Tier(tmp_path / "slow", name="slow", max_queued=1)]
    mgr = nc.CheckpointManager(tiers, on_copy_progress=hold)
    try:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((1000,), float(step))}).result()
        started = time.monotonic()
        with pytest.raises(CopyTimeoutError) as err:
            mgr.wait(timeout=0.5)
        assert time.monotonic() - started < 5
        assert [(p.step, p.tier) for p in err.value.pending] == [(1, "slow"), (2, "slow")]
        started = time.monotonic()
        with pytest.raises(CopyTimeoutError, match="step 1 to slow") as err:
            mgr.close(timeout=1)
        assert time.monotonic() - started < 5
    finally:
        release.set()
    for p in err.value.pending:
        assert Path(p.path).is_file() and p.path == mgr.unit_path(p.step)
    assert [(p.step, p.tier) for p in err.value.pending] == [(1, "slow"), (2, "slow")]
    assert isinstance(err.value, TimeoutError)
    # The copy running at the deadline may finish; the one queued behind it is dropped, never half there.
    deadline = time.monotonic() + 30
    while mgr.steps(1) != [1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mgr.steps(1) == [1]
    assert sorted(p.name for p in (tmp_path / "slow").iterdir()) == ["step-0000000001.manifest.json", "step-0000000001.nvc"]


def test_restore_says_which_newer_steps_the_next_save_removes(tmp_path, caplog):
    tiers = [nc.Tier(tmp_path / "local", keep=9), nc.Tier(tmp_path / "shared", keep=9)]
    with nc.CheckpointManager(tiers, full_every=3) as mgr:
        for step in range(1, 7):  # full: 1, 4; light: 2, 3, 5, 6
            mgr.save(step, _state(step))
            mgr.wait()
    mgr = nc.CheckpointManager(tiers)
    caplog.set_level(logging.INFO, logger="nvcomp_checkpoint")
    r = mgr.restore()
    assert r.step == 4
    assert r.abandoned == ((5, "tier0"), (5, "tier1"), (6, "tier0"), (6, "tier1"))
    assert "restore: step 4 (full) from tier0; newer steps not restored: step 6 on tier0: light" in caplog.text
    assert "each save of this run removes the abandoned steps above it: 5, 6 on tier0; 5, 6 on tier1" in caplog.text
    mgr.save(5, _state(5))  # replaces step 5, removes step 6
    mgr.close()
    assert mgr.steps(0) == [1, 2, 3, 4, 5] and mgr.steps(1) == [1, 2, 3, 4, 5]
    assert not mgr.manifest(5).light


def test_restore_takes_no_private_flags():
    # locate() and resume_path() are operations of their own, not restore() behind private keywords.
    for method in (nc.CheckpointManager.restore, nc.CheckpointManager.locate, nc.CheckpointManager.resume_path):
        assert not [p for p in inspect.signature(method).parameters if p.startswith("_")], method.__name__


def test_a_copy_whose_source_changed_is_not_retried(tmp_path):
    src = open_tier(str(tmp_path / "a"), name="a")
    dst = TierStore(nc.Tier(tmp_path / "b", retries=5, backoff_s=60), "b")
    path = tmp_path / "a" / "step-0000000001.nvc"
    nc.save({"w": torch.arange(1000.0)}, path)
    manifest = src.describe(1, False, False)
    with open(path, "ab") as f:
        f.write(b"later bytes")  # the unit changed after its manifest was taken
    started = time.monotonic()
    with pytest.raises(CheckpointWriteError, match=r"failed after 1 attempt\(s\)") as err:
        copy_with_retries(src, dst, manifest)
    assert isinstance(err.value.__cause__, CopySourceError) and time.monotonic() - started < 30
    assert dst.steps() == []


def test_steps_to_remove_is_a_pure_policy():
    def unit(step: int, *, light: bool = False, base: int | None = None) -> UnitManifest:
        return UnitManifest(step, False, light, (), 0.0, base=base)

    # 1 full, 2..4 deltas chained on it, 5 full, 6 light: keep=1 keeps 6 (newest), 5 (newest full).
    tier = {1: unit(1), 2: unit(2, base=1), 3: unit(3, base=2), 4: unit(4, base=3), 5: unit(5), 6: unit(6, light=True)}
    assert steps_to_remove(tier, 1, None) == [1, 2, 3, 4]
    # Protecting 4 (a copy still reads it) keeps its whole chain.
    assert steps_to_remove(tier, 1, None, protect={4}) == []
    # keep=2 and every 3rd: 5, 6 and 3, which needs 2 and 1; only 4 goes.
    assert steps_to_remove(tier, 2, 3) == [4] and steps_to_remove(tier, None, None) == []
    assert newer_steps([1, 5, 7, 9], 5, replaceable={7}) == ([7], [9])
