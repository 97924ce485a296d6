"""Tests of savegroup: several files saved as one unit, one completion, one error owner, actions after durability."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointWriteError
from nvcomp_checkpoint.savegroup import SaveSequence
from nvcomp_checkpoint.saveoptions import SaveOptions


class Slow:
    """Stream wrapper: holds each file's first write for ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, stream: IO[bytes]) -> Any:
        outer = self

        class Wrapped:
            first = True

            def write(self, data: Any) -> int:
                if self.first:
                    self.first = False
                    time.sleep(outer.delay)
                return stream.write(data)

        return Wrapped()


class Held:
    """Stream wrapper: holds each file's first write until ``gate`` is set (a store as slow as the test needs)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def __call__(self, stream: IO[bytes]) -> Any:
        gate = self.gate

        class Wrapped:
            first = True

            def write(self, data: Any) -> int:
                if self.first:
                    self.first = False
                    assert gate.wait(60), "the test never released the write"
                return stream.write(data)

        return Wrapped()


class Full:
    """Stream wrapper: the disk is full."""

    def __call__(self, stream: IO[bytes]) -> "Full":
        return self

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _tree(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))}


def test_a_group_completes_once_when_every_file_is_durable(tmp_path: Path) -> None:
    seen: list[nc.SaveReport] = []
    commits: list[tuple[dict[str, Any], bool]] = []
    seq = SaveSequence("test", on_saved=seen.append)
    group = seq.begin(tmp_path / "unit", commit=lambda reports: commits.append((reports, (tmp_path / "b.nvc").exists())))
    seq.save(group, "a", _tree(1), tmp_path / "a.nvc", SaveOptions.of(tmp_path / "a.nvc", "save", stream_wrapper=Slow(0.2)))
    seq.save(group, "b", _tree(2), tmp_path / "b.nvc", SaveOptions.of(tmp_path / "b.nvc", "save"))
    seq.seal(group)
    report = seq.result(group)
    assert len(commits) == 1 and sorted(commits[0][0]) == ["a", "b"] and commits[0][1]
    assert seen == [report] and report.path == str(tmp_path / "unit")
    assert report.raw_bytes == sum(r.raw_bytes for r in commits[0][0].values())
    assert report.seconds >= 0.2 and seq.last_report is report
    torch.testing.assert_close(nc.load(tmp_path / "a.nvc"), _tree(1))
    seq.close()


def test_a_failed_file_fails_the_group_and_its_error_is_raised_once(tmp_path: Path) -> None:
    seen: list[nc.SaveReport] = []
    cleaned: list[BaseException] = []
    commits: list[Any] = []
    seq = SaveSequence("test", on_saved=seen.append)
    group = seq.begin(tmp_path / "unit", commit=commits.append, failed=cleaned.append)
    seq.save(group, "a", _tree(1), tmp_path / "a.nvc", SaveOptions.of(tmp_path / "a.nvc", "save"))
    seq.save(group, "b", _tree(2), tmp_path / "b.nvc", SaveOptions.of(tmp_path / "b.nvc", "save", stream_wrapper=Full()))
    seq.seal(group)
    seq.wait()
    assert commits == [] and seen == [] and len(cleaned) == 1
    nc.wait_for_saves()  # the sequence owns the error: nobody else raises it
    with pytest.raises(CheckpointWriteError, match=r"disk is full.*reported by the test"):
        seq.raise_errors("the test")
    seq.raise_errors("the test")  # once
    seq.close()


def test_actions_wait_for_durability_and_are_skipped_after_a_failure(tmp_path: Path) -> None:
    seq = SaveSequence("test", max_pending=2)
    old = tmp_path / "old.nvc"
    nc.save(_tree(0), old)
    ran: list[bool] = []
    gate = threading.Event()
    group = seq.begin(tmp_path / "new.nvc")
    seq.save(
        group, "new", _tree(1), tmp_path / "new.nvc", SaveOptions.of(tmp_path / "new.nvc", "save", stream_wrapper=Held(gate))
    )
    seq.seal(group)
    assert seq.after_pending(lambda: ran.append((tmp_path / "new.nvc").exists()), str(old))
    assert ran == []  # queued behind the pending save
    gate.set()
    seq.wait()
    assert ran == [True]
    # A removal queued behind a save that fails is skipped, and said so with the failure.
    group = seq.begin(tmp_path / "bad.nvc")
    seq.save(group, "bad", _tree(2), tmp_path / "bad.nvc", SaveOptions.of(tmp_path / "bad.nvc", "save", stream_wrapper=Full()))
    seq.seal(group)
    seq.after_pending(lambda: ran.append(False), str(old))
    seq.wait()
    assert ran == [True]
    with pytest.raises(CheckpointWriteError, match=r"Not removed, so that the run keeps .*old\.nvc"):
        seq.raise_errors("the test")
    assert not seq.after_pending(lambda: None, "x")  # nothing pending: the caller acts itself
    seq.close()


def test_an_on_saved_callback_cannot_wait_for_itself(tmp_path: Path) -> None:
    caught: list[BaseException] = []
    seq: SaveSequence

    def on_saved(report: nc.SaveReport) -> None:
        try:
            seq.wait()
        except RuntimeError as exc:
            caught.append(exc)

    seq = SaveSequence("test", on_saved=on_saved)
    group = seq.begin(tmp_path / "a.nvc")
    seq.save(group, "a", _tree(1), tmp_path / "a.nvc", SaveOptions.of(tmp_path / "a.nvc", "save"))
    seq.seal(group)
    seq.wait()
    assert len(caught) == 1 and "on_saved" in str(caught[0]) and "wait for itself" in str(caught[0])
    seq.close()


def test_the_callers_own_group_raises_to_the_caller_only(tmp_path: Path) -> None:
    seq = SaveSequence("test")
    group = seq.begin(tmp_path / "unit", commit=lambda reports: (_ for _ in ()).throw(OSError(errno.EIO, "commit failed")))
    group.add_report("a", nc.save(_tree(1), tmp_path / "a.nvc"))
    seq.seal(group)  # completes here, in the caller's thread
    with pytest.raises(OSError, match="commit failed"):
        seq.result(group)
    seq.raise_errors("the test")  # taken by result(): not raised again


def test_max_pending_bounds_the_groups_in_flight(tmp_path: Path) -> None:
    seq = SaveSequence("test", max_pending=1)
    gate = threading.Event()
    first = seq.begin(tmp_path / "a.nvc")
    seq.save(first, "a", _tree(1), tmp_path / "a.nvc", SaveOptions.of(tmp_path / "a.nvc", "save", stream_wrapper=Held(gate)))
    seq.seal(first)
    began: list[bool] = []
    second = threading.Thread(target=lambda: began.append((seq.begin(tmp_path / "b.nvc"), first.done())[1]))
    second.start()  # waits for the first group
    second.join(0.3)
    assert second.is_alive() and began == []
    gate.set()
    second.join(60)
    assert began == [True]  # it began once the first group was done
    assert seq.pending() == 1


def test_a_background_job_is_a_part_of_its_group(tmp_path: Path) -> None:
    threads: list[str] = []
    seq = SaveSequence("test", on_saved=lambda r: threads.append(threading.current_thread().name))
    group = seq.begin(tmp_path / "dir")
    seq.run(group, "job", lambda: nc.save(_tree(3), tmp_path / "job.nvc"))
    seq.seal(group)
    report = seq.result(group)
    assert report.raw_bytes == 64 * 64 * 4 and threads and threads[0] != threading.main_thread().name
    seq.close()


def test_an_abandoned_group_commits_nothing_and_runs_nothing_queued_behind_it(tmp_path: Path) -> None:
    seq = SaveSequence("test")
    commits: list[Any] = []
    ran: list[int] = []
    gate = threading.Event()
    group = seq.begin(tmp_path / "unit", commit=commits.append)
    seq.save(group, "a", _tree(1), tmp_path / "a.nvc", SaveOptions.of(tmp_path / "a.nvc", "save", stream_wrapper=Held(gate)))
    assert seq.after_pending(lambda: ran.append(1), "old.nvc")
    gate.set()
    seq.abandon(group)  # the caller failed: waits for the file handed over, then gives up
    assert (tmp_path / "a.nvc").exists() and commits == [] and ran == []
    assert group.done() and seq.pending() == 0
    seq.close()
