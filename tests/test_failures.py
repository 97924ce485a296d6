"""FailureLog: the one owner of background failures (the oldest raised once, the others logged)."""

from __future__ import annotations

import logging

import pytest

from nvcomp_checkpoint.errors import CheckpointWriteError
from nvcomp_checkpoint.failures import FailureLog


def test_the_oldest_is_raised_once_and_the_others_logged(caplog):
    log = FailureLog()
    first, second = OSError("disk full"), ValueError("bad")
    log.record(first)
    log.record(second, what="a copy to the tiers failed")
    caplog.set_level(logging.ERROR, logger="nvcomp_checkpoint")
    with pytest.raises(OSError) as err:
        log.raise_oldest()
    assert err.value is first
    assert "a copy to the tiers failed: bad" in caplog.text
    log.raise_oldest()  # each is reported once
    assert not log


def test_wrap_names_how_many_more_and_keeps_the_cause():
    log = FailureLog()
    log.record(OSError("a"))
    log.record(OSError("b"))
    with pytest.raises(CheckpointWriteError, match=r"1 more: OSError\('a'\)") as err:
        log.raise_oldest(wrap=lambda e, n: CheckpointWriteError(f"{n} more: {e!r}"))
    assert str(err.value.__cause__) == "a"


def test_by_key_and_forgotten_sources():
    log = FailureLog()
    handle = object()
    log.record(OSError("x"), key="/a", source=handle)
    log.record(OSError("y"), key="/b")
    assert log.has("/a") and not log.has("/c")
    log.forget(handle)  # reported through the handle's result()
    assert not log.has("/a")
    with pytest.raises(OSError, match="y"):
        log.raise_oldest("/b")
    assert log.oldest() is None


def test_log_all_reports_without_raising(caplog):
    log = FailureLog()
    log.record(OSError("x"), what="an async checkpoint save failed")
    caplog.set_level(logging.ERROR, logger="nvcomp_checkpoint")
    log.log_all()
    assert "an async checkpoint save failed: x" in caplog.text and not log
