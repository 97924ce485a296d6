"""Tests of entrypoint: the session (options, saves, errors, tier copies, removals) every integration holds."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.entrypoint import (
    CheckpointSession,
    SessionOptions,
    as_policy,
    checked_on_every_rank,
    checkpoint_report,
    incremental_files,
    load_as_torch,
    policy_and_metadata,
    report_metrics,
    torch_weights_only,
)
from nvcomp_checkpoint.errors import CheckpointWriteError
from nvcomp_checkpoint.tiers import TierCopies


class Full:
    """Stream wrapper: the disk is full."""

    def __call__(self, stream: IO[bytes]) -> "Full":
        return self

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class Gated:
    """Stream wrapper: each write waits for ``gate``; with ``fail``, then fails as a full disk."""

    def __init__(self, gate: threading.Event, fail: bool = False) -> None:
        self.gate, self.fail = gate, fail

    def __call__(self, stream: IO[bytes]) -> "Gated":
        self.stream = stream
        return self

    def write(self, data: Any) -> int:
        assert self.gate.wait(60)
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.stream.write(data)


class Saver:
    """The smallest integration: saves a tree to a file and removes old ones, as the Lightning plugin does,
    holding a :class:`CheckpointSession` as every integration does."""

    def __init__(self, label: str, policy: Any = None, **options: Any) -> None:
        self.session = CheckpointSession(label, SessionOptions.of(label, policy, **options))

    def __getattr__(self, name: str) -> Any:  # wait, pending, close, resume_path, last_report ...
        return getattr(self.session, name)

    def save(self, tree: Any, path: Path, step: int) -> None:
        session = self.session
        started = time.perf_counter()
        after = session.after_durable(step, path)
        base = None if session.incremental is None else session.incremental.base_for(path)
        options = session.save_options(path, base=base)
        if not session.async_save:
            session.saved(session.save_now(tree, path, options), after)
            return
        session.checkpoint(path, started, after, lambda g: session.add_file(g, "file", tree, path, options))

    def remove(self, path: Path, deleted: list[str]) -> None:
        def delete(p: str) -> None:
            deleted.append(p)
            os.remove(p)

        self.session.remove(path, delete)


def _tree() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(0))}


def test_policy_takes_a_policy_a_dict_or_nothing() -> None:
    assert as_policy(None, "X") == nc.CodecPolicy()
    assert as_policy({"other": "none"}, "X") == nc.CodecPolicy(other="none")
    assert as_policy("zstd:3", "X") == nc.CodecPolicy.uniform(nc.CodecSpec(level=3))
    with pytest.raises(TypeError, match=r"X\(policy=...\): expected a CodecPolicy, a dict .* got int 3"):
        SessionOptions.of("X", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"X\(policy=...\): codec spec 'zstd:fast'"):
        SessionOptions.of("X", "zstd:fast")


def test_per_save_options_give_a_policy_and_metadata() -> None:
    base = nc.CodecPolicy()
    policy, meta = policy_and_metadata({"exp_avg": "none", "metadata": {"run": 1}}, base, "X")
    assert policy.exp_avg.codec == "none" and policy.weights == base.weights and meta == {"run": 1}
    assert policy_and_metadata(None, base, "X") == (base, None)
    with pytest.raises(ValueError, match=r"unknown storage_options key\(s\) \['nope'\]"):
        policy_and_metadata({"nope": 1}, base, "X")
    policy, _ = policy_and_metadata({"policy": "zstd:3"}, base, "X")
    assert policy == nc.CodecPolicy.uniform("zstd:3")
    with pytest.raises(TypeError, match=r"storage_options\['policy'\]: expected a CodecPolicy, .* got int 1"):
        policy_and_metadata({"policy": 1}, base, "X")


def test_weights_only_follows_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_weights_only(False) is False and torch_weights_only(True) is True
    assert torch_weights_only(None) is True  # torch >= 2.6
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert torch_weights_only(None) is False
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert torch_weights_only(False) is True


def test_load_as_torch_refuses_objects_weights_only_with_the_frameworks_hint(tmp_path: Path) -> None:
    nc.save({"w": torch.ones(3), "obj": Path("x")}, tmp_path / "c.nvc")
    with pytest.raises(nc.errors.UnsafeCheckpointError, match="pass weights_only=False there"):
        load_as_torch(tmp_path / "c.nvc", None, None, hint=" pass weights_only=False there")
    assert load_as_torch(tmp_path / "c.nvc", None, False, hint="")["obj"] == Path("x")


def test_the_incremental_option_is_checked_before_anything_is_set_up() -> None:
    assert incremental_files("X", False, None, "previous") is None
    assert incremental_files("X", True, 3, "full") is not None
    with pytest.raises(ValueError, match=r"X\(incremental=True, full_every=\.\.\.\)"):
        incremental_files("X", True, 0, "previous")


def test_a_background_failure_is_raised_once_naming_who_reports_it(tmp_path: Path) -> None:
    seen: list[nc.SaveReport] = []
    saver = Saver("Saver", async_save=True, on_saved=seen.append, stream_wrapper=Full())
    saver.save(_tree(), tmp_path / "a.nvc", step=1)
    with pytest.raises(CheckpointWriteError, match=r"a\.nvc.*reported by wait\(\)"):
        saver.wait()
    saver.wait()  # raised once
    assert not (tmp_path / "a.nvc").exists() and seen == [] and saver.pending() == 0


def test_close_raises_a_failure_or_logs_it_while_another_error_propagates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saver = Saver("Saver", async_save=True, stream_wrapper=Full())
    saver.save(_tree(), tmp_path / "a.nvc", step=1)
    with pytest.raises(CheckpointWriteError, match="reported by the end"):
        saver.close("the end")
    saver.save(_tree(), tmp_path / "b.nvc", step=2)  # a later save starts the thread again
    with caplog.at_level(logging.ERROR, "nvcomp_checkpoint"), pytest.raises(KeyError):
        try:
            raise KeyError("the first error")
        except KeyError:
            saver.close("the end")
            raise
    assert "b.nvc" in caplog.text


def test_saves_report_and_copy_to_tiers_once_durable(tmp_path: Path) -> None:
    seen: list[nc.SaveReport] = []
    saver = Saver("Saver", async_save=True, on_saved=seen.append, tiers=[nc.Tier(tmp_path / "copies")])
    (tmp_path / "ckpt").mkdir()
    saver.save(_tree(), tmp_path / "ckpt" / "step-3.nvc", step=3)
    saver.wait()
    assert [r.path for r in seen] == [str(tmp_path / "ckpt" / "step-3.nvc")] and saver.last_report is seen[0]
    found = saver.resume_path()
    assert found is not None and Path(found).is_relative_to(tmp_path / "copies")
    assert torch.equal(nc.load(found)["w"], _tree()["w"])
    metrics = report_metrics(seen[0], "p/")
    assert metrics["p/raw_bytes"] == seen[0].raw_bytes and "p/ratio/weights" in metrics


def test_resume_path_without_tiers_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Saver.resume_path\(\): no tiers; pass Saver\(tiers=\[nc.Tier\(...\)\]\)"):
        Saver("Saver").resume_path()


def test_a_save_report_that_cannot_be_built_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    written = nc.save({"w": torch.randn(32, 16)}, tmp_path / "meta.pt")
    missing = tmp_path / "not_a_dcp_dir"  # as a rank file unreadable right after the commit
    with caplog.at_level(logging.WARNING, logger="nvcomp_checkpoint"):
        report = checkpoint_report(tmp_path, 1.5, reports=[written], dcp_dirs=[missing])
        assert checkpoint_report(missing, 1.0, dcp_dirs=[missing]) is None
    assert report is not None and report.raw_bytes == written.raw_bytes and report.seconds == 1.5
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("committed, but its save report could not be built" in m for m in messages), messages
    assert messages[0].endswith("the report covers the other files only") and messages[1].endswith("no report for this save")
    merged = checkpoint_report(tmp_path, 2.0, reports=[written, written])
    assert merged is not None and merged.raw_bytes == 2 * written.raw_bytes


def test_checks_before_a_collective_load_without_a_process_group_are_the_checks_alone() -> None:
    assert checked_on_every_rank(lambda: 7, "where", leader_load=True) == 7

    def fails() -> None:
        raise FileNotFoundError("Checkpoint file not found: x.ckpt")

    with pytest.raises(FileNotFoundError, match="x.ckpt"):
        checked_on_every_rank(fails, "where", leader_load=True)


def test_a_removal_waits_for_the_saves_pending_and_is_skipped_if_one_fails(tmp_path: Path) -> None:
    # The checkpoint removed is the one the pending save replaces: it must outlive that save.
    for fail in (False, True):
        gate, deleted = threading.Event(), []
        saver = Saver("Saver", async_save=True, stream_wrapper=Gated(gate, fail))
        old = tmp_path / f"old-{fail}.nvc"
        nc.save(_tree(), old)
        saver.save(_tree(), tmp_path / f"new-{fail}.nvc", step=2)
        saver.remove(old, deleted)
        assert deleted == [] and old.exists()
        gate.set()
        if not fail:
            saver.wait()
            assert deleted == [str(old)] and not old.exists()
            continue
        with pytest.raises(
            CheckpointWriteError, match=rf"Not removed, so that the run keeps its newest complete checkpoint: {old}"
        ):
            saver.wait()
        assert deleted == [] and old.exists()


def test_a_removal_waits_for_the_deltas_that_need_it(tmp_path: Path) -> None:
    deleted: list[str] = []
    saver = Saver("Saver", incremental=True)
    full, delta = tmp_path / "step-1.nvc", tmp_path / "step-2.nvc"
    saver.save(_tree(), full, step=1)
    saver.save(_tree(), delta, step=2)  # a delta against step 1
    saver.remove(full, deleted)
    assert deleted == [] and full.exists()  # step 2 needs it
    saver.remove(delta, deleted)
    assert sorted(deleted) == [str(full), str(delta)] and not full.exists()


def test_a_removal_waits_for_the_copies_to_the_tiers(tmp_path: Path) -> None:
    gate, copying, deleted = threading.Event(), threading.Event(), []

    def hold(tier: str, step: int, nbytes: int) -> None:
        copying.set()
        assert gate.wait(60)

    (tmp_path / "ckpt").mkdir()
    saver = Saver("Saver")
    saver.session.tiers = TierCopies([nc.Tier(tmp_path / "copies")], "Saver", on_copy_progress=hold)
    first = tmp_path / "ckpt" / "step-1.nvc"
    saver.save(_tree(), first, step=1)  # durable: its copy starts, held
    assert copying.wait(60)
    saver.remove(first, deleted)
    assert deleted == [] and first.exists()
    gate.set()
    saver.wait()
    assert deleted == [str(first)] and not first.exists()
    found = saver.resume_path()
    assert found is not None and torch.equal(nc.load(found)["w"], _tree()["w"])


def test_a_session_view_reads_the_session_and_refuses_to_be_set() -> None:
    from nvcomp_checkpoint.entrypoint import SessionView

    class Entry:
        policy = SessionView[nc.CodecPolicy]("options.policy")
        last_report = SessionView["nc.SaveReport | None"]("last_report")

        def __init__(self) -> None:
            self.session = CheckpointSession("Entry", SessionOptions.of("Entry", "zstd:3"))

    entry = Entry()
    assert entry.policy == nc.CodecPolicy.uniform("zstd:3") and entry.last_report is None
    with pytest.raises(AttributeError, match=r"Entry\.policy is read-only: it is the session's options\.policy"):
        entry.policy = nc.CodecPolicy()
    assert "options.policy" in (Entry.policy.__doc__ or "")
