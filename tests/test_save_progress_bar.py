"""``save(..., progress=True)``: an opt-in progress bar on stderr for long saves, only on a terminal."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.progressbar import tensor_bytes


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_save_with_progress_true_shows_a_bar_on_a_terminal_and_saves_the_same(tmp_path, monkeypatch) -> None:
    state = {"w": torch.randn(1 << 16), "opt": [torch.randn(1 << 15), 3]}
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    nc.save(state, tmp_path / "bar.nvc", progress=True)
    monkeypatch.undo()
    assert "saving bar.nvc" in terminal.getvalue()
    assert_tree_equal(nc.load(tmp_path / "bar.nvc"), state)


def test_no_bar_where_stderr_is_not_a_terminal_and_false_is_no_progress(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    nc.save({"w": torch.randn(1000)}, tmp_path / "a.nvc", progress=True)
    nc.save({"w": torch.randn(1000)}, tmp_path / "b.nvc", progress=False)
    assert capsys.readouterr().err == ""


def test_the_bars_total_counts_each_tensor_once() -> None:
    shared = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes({"a": shared, "b": [shared, (torch.zeros(3, dtype=torch.int8), "x")], "c": 1}) == 83
