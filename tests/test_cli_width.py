"""The CLI's tables at a narrow terminal: every figure printed whole, columns wrap or drop."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nvcomp_checkpoint.cli.main import main


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("width") / "a_rather_long_checkpoint_file_name_for_the_table.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def _run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: int, *args: object) -> tuple[str, str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def _widest_line(text: str) -> int:
    """The widest line of the tables in ``text`` (a summary line with a long path may wrap in the terminal)."""
    return max([len(line) for line in text.splitlines() if line[:1] in "┏┃┡│└"] or [0])


@pytest.mark.parametrize("columns", [80, 60])
def test_compress_inspect_and_bench_figures_are_whole(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plain: Path, columns: int
) -> None:
    dst = tmp_path / "out.nvc"
    out, _ = _run(capsys, monkeypatch, columns, "compress", plain, dst)
    assert "…" not in out and _widest_line(out) <= columns, out
    ratio = json.loads(_run(capsys, monkeypatch, columns, "inspect", dst, "--json")[0])["ratio"]
    out, _ = _run(capsys, monkeypatch, columns, "compress", plain, dst, "--force")
    assert re.search(rf"\b{ratio:.3f}", out) or re.search(rf"\b{ratio:.2f}", out), out

    out, _ = _run(capsys, monkeypatch, columns, "inspect", dst)
    assert "…" not in out and _widest_line(out) <= columns, out

    plot = tmp_path / "bench.png"
    out, err = _run(
        capsys, monkeypatch, columns, "bench", plain, "--sample-mb", "0.25", "--repeat", "1", "--codecs", "zstd:1", "--plot", plot
    )
    assert "…" not in out and _widest_line(out) <= columns, out
    assert "ratio" in out and re.search(r"\d\.\d{3}x", out), out
    assert f"plot written to {plot}" in err and plot.stat().st_size > 0


def test_a_very_narrow_terminal_drops_columns_and_says_which(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plain: Path
) -> None:
    out, _ = _run(capsys, monkeypatch, 40, "bench", plain, "--sample-mb", "0.25", "--repeat", "1", "--codecs", "zstd:1")
    assert "…" not in out and "not shown at this width:" in out, out
    assert re.search(r"\d\.\d{3}x", out), out


def test_global_options_before_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plain: Path
) -> None:
    out, err = _run(capsys, monkeypatch, 80, "-q", "compress", plain, tmp_path / "q.nvc")
    assert err == ""
    assert (tmp_path / "q.nvc").exists()


def test_inspect_at_80_columns_prints_the_title_whole_and_breaks_names_between_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plain: Path
) -> None:
    folder = tmp_path / "a_rather_long_directory_name_for_checkpoints" / "run-2026-12-05"
    folder.mkdir(parents=True)
    dst = folder / "a_rather_long_checkpoint_file_name_for_the_table.nvc"
    _run(capsys, monkeypatch, 80, "compress", plain, dst)
    out, _ = _run(capsys, monkeypatch, 80, "inspect", dst)
    # The title (path and ratio) is one line, whole, however long: piped output is not cut.
    assert re.search(rf"^{re.escape(str(dst))}  \(nvcomp-checkpoint, .*\d\.\d{{3}}x\)$", out, re.M), out
    # Every tensor's label ends with its component, however it wrapped.
    assert len(re.findall(r"\[(weights|exp_avg|exp_avg_sq|other)\]", out)) == len(re.findall(r"float32\[", out)), out

    out, _ = _run(capsys, monkeypatch, 80, "inspect", folder)
    assert _widest_line(out) <= 80, out
    cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    start = cells.index("a_rather_long_")
    name = cells[start : start + 4]
    assert "".join(name) == dst.name, out
    assert all(part[-1] in "_-./" for part in name[:-1]), name  # broken after a separator, never mid-word
