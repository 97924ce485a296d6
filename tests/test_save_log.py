"""Every save is visible: one INFO line per checkpoint on logger ``nvcomp_checkpoint``, whichever entry point made it.

The line names the path, raw -> stored bytes, the ratio, the seconds until durable and the seconds
the caller was blocked; the full report rides on the record (``nvckpt_report``).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nvcomp_checkpoint as nc

_LINE = re.compile(
    r"^(?P<what>[\w ()_:]+) (?P<path>\S+): [\d.]+ \w?i?B -> [\d.]+ \w?i?B \((?P<ratio>[\d.]+)x\) in [\d.]+ s, blocked [\d.]+ s, "
)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _saved_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "nvcomp_checkpoint" and r.levelno == logging.INFO and _LINE.match(r.getMessage())
    ]


def _save_sync(path: Path) -> str:
    nc.save(_state(), path)
    return os.fspath(path)


def _save_async(path: Path) -> str:
    nc.save_async(_state(), path).result(timeout=60)
    return os.fspath(path)


def _manager(async_save: bool) -> Callable[[Path], str]:
    def save(path: Path) -> str:
        manager = nc.CheckpointManager([nc.Tier(os.fspath(path))], async_save=async_save)
        try:
            manager.save(7, _state())
            manager.wait()
        finally:
            manager.close()
        return os.fspath(path / "step-0000000007.nvc")

    return save


def _lightning(async_save: bool) -> Callable[[Path], str]:
    def save(path: Path) -> str:
        from nvcomp_checkpoint.lightning import NvcompCheckpointIO

        plugin = NvcompCheckpointIO(async_save=async_save)
        try:
            plugin.save_checkpoint({"state_dict": _state()["model"], "global_step": 3}, path)
        finally:
            plugin.teardown()
        return os.fspath(path)

    return save


def _accelerate(path: Path) -> str:
    # A checkpoint of several files (model.nvc, optimizer.nvc ...): one line, for the folder, not one per file.
    from accelerate import Accelerator

    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    register_nvcomp_hooks(acc)
    acc.save_state(os.fspath(path))
    return os.fspath(path)


@pytest.mark.parametrize(
    "save",
    [_save_sync, _save_async, _manager(False), _manager(True), _lightning(False), _lightning(True), _accelerate],
    ids=["save", "save_async", "manager", "manager-async", "lightning", "lightning-async", "accelerate"],
)
def test_one_info_line_per_save(tmp_path: Path, caplog: pytest.LogCaptureFixture, save: Callable[[Path], str]) -> None:
    with caplog.at_level(logging.INFO, logger="nvcomp_checkpoint"):
        where = save(tmp_path / "ckpt.nvc" if save in (_save_sync, _save_async) else tmp_path / "out")
    lines = _saved_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    m = _LINE.match(lines[0].getMessage())
    assert m is not None and m["path"] == where
    report = lines[0].nvckpt_report  # type: ignore[attr-defined]
    on_disk = os.path.getsize(where) if os.path.isfile(where) else sum(p.stat().st_size for p in Path(where).glob("*.nvc"))
    assert report["path"] == where and report["stored_bytes"] == on_disk
    assert float(m["ratio"]) == pytest.approx(report["raw_bytes"] / report["stored_bytes"], abs=5e-4) and float(m["ratio"]) > 1.0
    assert report["seconds_blocked"] <= report["seconds"]


def test_nothing_below_info_shows_without_logging_set_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The line is INFO: a user sees it once logging is set to INFO (README), never as a warning.
    with caplog.at_level(logging.WARNING, logger="nvcomp_checkpoint"):
        nc.save(_state(), tmp_path / "quiet.nvc")
    assert [r for r in caplog.records if r.name == "nvcomp_checkpoint"] == []
