"""Every timeout of the library: ``None`` and ``inf`` mean no limit, a huge number works, and what is not a
number >= 0 is refused naming the parameter, before anything waits."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.deadline import MAX_WAIT_S, Deadline, timeout_seconds
from nvcomp_checkpoint.entrypoint import CheckpointSession, SessionOptions
from nvcomp_checkpoint.tiers import TierCopies

NO_LIMIT = [None, math.inf, 1e300, 10**30]
REFUSED: list[tuple[Any, type[Exception]]] = [
    (True, TypeError),
    (False, TypeError),
    ("5", TypeError),
    ([1], TypeError),
    (math.nan, ValueError),
    (-1, ValueError),
    (-math.inf, ValueError),
]


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(16, 8)}, "step": step}


def test_the_helper_takes_none_and_inf_for_no_limit_and_clamps_what_threading_accepts():
    assert timeout_seconds(None) is None and timeout_seconds(math.inf) is None
    assert timeout_seconds(0) == 0.0 and timeout_seconds(2.5) == 2.5
    assert Deadline(math.inf).left() is None and not Deadline(math.inf).expired
    assert Deadline(1e300).left() == MAX_WAIT_S  # what threading, queue and Thread.join accept
    assert Deadline(0).expired and Deadline(0).left() == 0.0
    for value, error in REFUSED:
        with pytest.raises(error, match=r"wait\(timeout=\.\.\.\) must be a number of seconds >= 0"):
            Deadline(value, "wait(timeout=...)")


def _manager_calls(tmp_path) -> tuple[nc.CheckpointManager, dict[str, Callable[[Any], Any]]]:
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "a", keep=2), nc.Tier(tmp_path / "b")])
    mgr.save(1, _state(1))
    return mgr, {
        "restore": lambda t: mgr.restore(timeout=t),
        "locate": lambda t: mgr.locate(timeout=t),
        "resume_path": lambda t: mgr.resume_path(tmp_path / "fetched", timeout=t),
        # A save in flight, so that the waits really wait.
        "wait": lambda t: (mgr.save(2, _state(2)), mgr.wait(timeout=t)),
        "close": lambda t: (mgr.save(3, _state(3)), mgr.close(timeout=t)),
    }


@pytest.mark.parametrize("timeout", NO_LIMIT, ids=repr)
def test_manager_waits_take_no_limit(tmp_path, timeout):
    _, calls = _manager_calls(tmp_path)
    assert calls["restore"](timeout).step == 1
    assert calls["locate"](timeout).step == 1
    assert calls["resume_path"](timeout).step == 1
    calls["wait"](timeout)
    calls["close"](timeout)


@pytest.mark.parametrize(("value", "error"), REFUSED, ids=lambda v: repr(v)[:12])
def test_manager_waits_refuse_what_is_not_a_number(tmp_path, value, error):
    mgr, calls = _manager_calls(tmp_path)
    for name, call in calls.items():
        with pytest.raises(error, match=rf"CheckpointManager\.{name}\(timeout=\.\.\.\) must be a number"):
            call(value)
    mgr.close()


def test_tier_copies_waits(tmp_path):
    copies = TierCopies([nc.Tier(tmp_path / "copies")], "X(tiers=...)")
    copies.manager(tmp_path / "ckpt" / "a.nvc")
    for t in NO_LIMIT:
        assert copies.resume_path(tmp_path / "fetched", timeout=t) is None
        assert copies.locate(timeout=t) is None
        copies.wait(timeout=t)
    for value, error in REFUSED:
        for name, call in {
            "resume_path": lambda v: copies.resume_path(tmp_path / "fetched", timeout=v),
            "locate": lambda v: copies.locate(timeout=v),
            "wait": lambda v: copies.wait(timeout=v),
        }.items():
            with pytest.raises(error, match=rf"X\.{name}\(timeout=\.\.\.\) must be a number"):
                call(value)


def test_async_saves_and_entry_points(tmp_path):
    with nc.AsyncSaver() as saver:
        handle = saver.save(_state(1), tmp_path / "a.nvc")
        for t in NO_LIMIT:
            assert handle.wait(t)
            assert handle.result(t).path == str(tmp_path / "a.nvc")
            assert handle.exception(t) is None
            saver.wait(timeout=t)
            nc.wait_for_saves(timeout=t)
        for value, error in REFUSED:
            for name, call in {
                "AsyncSaveHandle.wait": lambda v: handle.wait(v),
                "AsyncSaveHandle.result": lambda v: handle.result(v),
                "AsyncSaveHandle.exception": lambda v: handle.exception(v),
                "AsyncSaver.wait": lambda v: saver.wait(timeout=v),
                "AsyncSaver.close": lambda v: saver.close(timeout=v),
                "wait_for_saves": lambda v: nc.wait_for_saves(timeout=v),
            }.items():
                with pytest.raises(error, match=rf"{name}\(timeout=\.\.\.\) must be a number"):
                    call(value)
    nc.AsyncSaver().close(timeout=math.inf)
    entry = CheckpointSession("X", SessionOptions.of("X", tiers=[nc.Tier(tmp_path / "copies")]))
    for t in NO_LIMIT:
        entry.wait(timeout=t)
    for value, error in REFUSED:
        with pytest.raises(error, match=r"X\.wait\(timeout=\.\.\.\) must be a number"):
            entry.wait(timeout=value)
