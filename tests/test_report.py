"""Per-component tables: ``SaveReport.table()``, ``reader.summary()`` and ``nvckpt inspect`` agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.main import main


def _trained_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _codec_column(table: str) -> dict[str, str]:
    """component -> codec cell of a plain-text or rich table."""
    out = {}
    for line in table.splitlines():
        cells = [c for c in line.replace("│", " ").split("  ") if c.strip()]
        if cells and cells[0].strip() in ("weights", "exp_avg", "exp_avg_sq", "other"):
            out[cells[0].strip()] = cells[5].strip()
    return out


def test_report_summary_and_inspect_name_codecs_alike(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.nvc"
    policy = nc.CodecPolicy(weights=nc.CodecSpec(codec="zstd", level=3))
    report = nc.save(_trained_state(), path, policy=policy)
    with nc.open(path) as reader:
        summary = reader.summary()
    assert report.components["weights"].codecs == ("none", "zstd:3")  # biases are under 2 KiB
    assert summary["weights"].codecs == ("none", "zstd:3") and summary["exp_avg"].codecs == ("none", "zstd:1")
    assert main(["inspect", str(path), "--no-tree"]) == 0
    inspected = capsys.readouterr().out
    expected = {"weights": "none,zstd:3", "exp_avg": "none,zstd:1", "exp_avg_sq": "none,zstd:1", "other": "none"}
    assert _codec_column(report.table()) == _codec_column(str(summary)) == _codec_column(inspected) == expected
    for text in (report.table(), str(summary), inspected):
        assert "none = stored raw: tensors under 2 KiB" in text


def test_summary_prints_as_the_save_reports_table(tmp_path: Path) -> None:
    path = tmp_path / "c.nvc"
    report = nc.save(_trained_state(), path)
    with nc.open(path) as reader:
        summary = reader.summary()
    assert isinstance(summary, dict) and dict(summary) == dict(report.components)
    assert str(summary) == repr(summary) == report.table()
    assert list(summary) == ["weights", "exp_avg", "exp_avg_sq", "other"]  # canonical order, as the writer's


def test_no_note_when_nothing_is_stored_raw(tmp_path: Path) -> None:
    report = nc.save({"w": torch.randn(4096)}, tmp_path / "w.nvc")
    assert report.components["weights"].codecs == ("zstd:1",)
    assert "stored raw" not in report.table()


def test_a_delta_save_report_names_its_base(tmp_path: Path) -> None:
    state = _trained_state()
    full = nc.save(state, tmp_path / "step-1000.nvc")
    delta = nc.save(state, tmp_path / "step-1040.nvc", base=tmp_path / "step-1000.nvc")
    assert full.base is None and "(delta of" not in str(full)
    assert str(delta).startswith(f"{tmp_path / 'step-1040.nvc'} (delta of {tmp_path / 'step-1000.nvc'}): "), str(delta)
    assert delta.to_dict()["base"] == str(tmp_path / "step-1000.nvc") and full.to_dict()["base"] is None


def test_the_table_notes_when_the_index_outweighs_the_data(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tiny = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))  # ~2K parameters
    report = nc.save({"model": tiny.state_dict()}, tmp_path / "tiny.nvc")
    assert report.stored_bytes > report.raw_bytes
    assert "the index and headers" in report.table() and "larger than its raw tensors" in report.table()
    big = nc.save({"w": torch.randn(256, 256).bfloat16()}, tmp_path / "big.nvc")
    assert big.stored_bytes < big.raw_bytes and "the index and headers" not in big.table()
