"""``nvcomp_checkpoint.dcp.dcp_report``: the SaveReport of a committed DCP checkpoint, from its rank files' indexes.

Checkpoints saved here by DCP in one process (its no-process-group path); the 2-rank runs of the
Accelerate and Lightning integrations check the same report over two rank files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.dcp import NvcompWriter, dcp_report, read_dcp_files
from nvcomp_checkpoint.errors import CheckpointError, FormatError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 64, generator=g) * 0.02).to(torch.bfloat16)
    return {
        "model": {"layer": {"weight": w, "bias": torch.randn(96, generator=g)}},
        "optim": {
            "state": {
                "layer.weight": {
                    "exp_avg": torch.randn(96, 64, generator=g) * 1e-3,
                    "exp_avg_sq": torch.rand(96, 64, generator=g) * 1e-6,
                }
            }
        },
        "extra": {"epoch": 3, "note": "a pickled item"},
    }


def _on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def assert_report_matches_files(report: nc.SaveReport, path: str | os.PathLike[str]) -> None:
    """The report's totals are what the directory's files hold: every byte on disk, and the
    raw and stored bytes of every entry of every rank file's index."""
    files = read_dcp_files(os.fspath(path))
    assert report.stored_bytes == _on_disk(Path(path)) == files.file_bytes
    entries = [t for f in files.rank_files for t in f.tensors]
    assert report.raw_bytes == sum(t.nbytes for t in entries) > 0
    assert sum(c.raw_bytes for c in report.components.values()) == report.raw_bytes
    assert sum(c.stored_bytes for c in report.components.values()) == sum(t.stored_bytes for t in entries)
    assert sum(c.tensors for c in report.components.values()) == len(entries)


def test_report_totals_are_what_the_files_hold(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, storage_writer=NvcompWriter(tmp_path / "ckpt"))
    report = dcp_report(str(tmp_path / "ckpt"), seconds=1.5)
    assert_report_matches_files(report, tmp_path / "ckpt")
    assert report.path == str(tmp_path / "ckpt") and report.seconds == report.seconds_blocked == 1.5
    # Every tensor's bytes are there, per component; the pickled items are "other".
    comps = report.components
    assert comps["weights"].raw_bytes == 96 * 64 * 2 + 96 * 4 and comps["weights"].tensors == 2
    assert comps["exp_avg"].raw_bytes == comps["exp_avg_sq"].raw_bytes == 96 * 64 * 4
    assert comps["other"].tensors == 2  # extra.epoch and extra.note, pickled by the planner
    assert list(comps)[:3] == ["weights", "exp_avg", "exp_avg_sq"]
    assert report.ratio > 1.0 and comps["weights"].codecs and "total (file)" in report.table()


def test_cli_inspect_shows_the_report_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    dcp.save(_state(), storage_writer=NvcompWriter(tmp_path / "ckpt"))
    report = dcp_report(str(tmp_path / "ckpt"))
    assert main(["inspect", "--json", str(tmp_path / "ckpt")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["file_bytes"] == report.stored_bytes and shown["raw_bytes"] == report.raw_bytes
    assert shown["components"] == {k: v.to_dict() for k, v in report.components.items()}


def test_report_refuses_what_it_cannot_describe(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="an empty directory: no checkpoint was saved here"):
        dcp_report(str(tmp_path))
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "plain"))
    with pytest.raises(FormatError, match="plain DCP checkpoint.*nvckpt inspect"):
        dcp_report(str(tmp_path / "plain"))
    dcp.save(_state(), storage_writer=NvcompWriter(tmp_path / "ours"))
    rank_file = next((tmp_path / "ours").glob("*.nvcdcp"))
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[:-4] + b"\0\0\0\0")  # the footer's magic
    with pytest.raises(FormatError, match=rf"{rank_file.name}: its index does not read"):
        dcp_report(str(tmp_path / "ours"))
    rank_file.unlink()
    with pytest.raises(FormatError, match=rf"{rank_file.name} named by the metadata are missing"):
        dcp_report(str(tmp_path / "ours"))


def test_writer_takes_filesystem_writers_options_that_mean_something_and_names_the_rest(tmp_path) -> None:
    from nvcomp_checkpoint.dcp import NvcompWriter

    w = NvcompWriter(tmp_path, thread_count=3, single_file_per_rank=True, sync_files=True, overwrite=True)
    assert w.workers == 3
    refused = {
        "per_thread_copy_ahead": (TypeError, "compresses chunk by chunk"),
        "_extensions": (TypeError, "policy= instead"),
        "serialization_format": (TypeError, "writes its own"),
        "nonsense": (TypeError, "not an option of NvcompWriter or FileSystemWriter"),
        "single_file_per_rank": (ValueError, "each rank writes one compressed file"),
        "sync_files": (ValueError, "every file is fsynced"),
        "overwrite": (ValueError, "replaces the checkpoint at its path as a whole"),
    }
    for name, (error, words) in refused.items():
        value = False if name in ("single_file_per_rank", "sync_files", "overwrite") else 1
        with pytest.raises(error, match=rf"NvcompWriter\({name}=") as info:
            NvcompWriter(tmp_path, **{name: value})
        assert words in str(info.value), (name, str(info.value))
    with pytest.raises(ValueError, match=r"give one of them"):
        NvcompWriter(tmp_path, workers=2, thread_count=3)
