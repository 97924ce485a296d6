"""Temporary files of killed saves: listed by inspect/verify of their directory, removed by the next save.

Saves run in real subprocesses that hold in the middle of writing (until the test lets them
go) and are killed with SIGKILL, so nothing of theirs can clean up. A temporary file whose
writer is alive, runs on another host or predates the host tag is never removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.storage import is_temp_name, stale_temp_files, temp_name, temp_prefix

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}

# Writes one frame, then holds (alive, its temporary file open) while the hold file exists.
_HELD_SAVE = textwrap.dedent(
    """
    import os, sys, time, torch
    import nvcomp_checkpoint as nc

    target, hold = sys.argv[1], sys.argv[2]

    def progress(nbytes):
        print("frame", flush=True)
        while os.path.exists(hold):
            time.sleep(0.01)

    nc.save({"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))}, target, workers=1, progress=progress)
    print("done", flush=True)
    """
)


def _start_held_save(target: Path, hold: Path) -> subprocess.Popen[str]:
    hold.touch()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD_SAVE, str(target), str(hold)], stdout=subprocess.PIPE, text=True, env=ENV
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "frame", f"the save did not start (rc {proc.poll()})"
    return proc


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if is_temp_name(p.name))


def _kill(proc: subprocess.Popen[str], *, reap: bool = True) -> None:
    proc.send_signal(signal.SIGKILL)
    if reap:
        assert proc.wait(timeout=30) == -signal.SIGKILL


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_killed_saves_are_listed_then_removed_by_the_next_save(tmp_path, capsys):
    target = tmp_path / "ckpt.nvc"
    tree = {"w": torch.arange(10.0), "step": 1}
    nc.save(tree, target)
    # Three saves in flight at once (ranks, or retries that overlap), all killed.
    savers = [_start_held_save(target, tmp_path / f"hold{i}") for i in range(3)]
    for proc in savers:
        _kill(proc)
    killed = _temps(tmp_path)
    assert len(killed) == 3 and all(name.startswith(temp_prefix("ckpt.nvc")) for name in killed), killed
    assert_tree_equal(nc.load(target), tree)  # the killed saves never touched the checkpoint

    assert sorted(os.path.basename(p) for p in stale_temp_files(tmp_path)) == killed
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["stale_temp_files"]
    assert sorted(f["file"] for f in listed) == killed and all(f["file_bytes"] >= 0 for f in listed)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("left by a killed save") == 3, out
    assert main(["verify", str(tmp_path)]) == 0  # the checkpoint itself is fine: a note, not a failure
    out = capsys.readouterr().out
    assert out.count("temporary file of a killed save") == 3 and "OK" in out, out

    nc.save({"w": torch.arange(10.0), "step": 2}, target)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("hold")) == ["ckpt.nvc"]
    assert nc.load(target)["step"] == 2
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stale_temp_files"] == []


def test_saves_killed_one_after_another_leave_at_most_the_last(tmp_path):
    target = tmp_path / "ckpt.nvc"
    for i in range(3):
        _kill(_start_held_save(target, tmp_path / f"hold{i}"))
        assert len(_temps(tmp_path)) == 1  # each save removed the one killed before it
    nc.save({"w": torch.ones(3)}, target)
    assert _temps(tmp_path) == []


def test_a_save_into_a_subdirectory_cleans_that_directory(tmp_path):
    sub = tmp_path / "run" / "step-10"
    sub.mkdir(parents=True)
    _kill(_start_held_save(sub / "model.nvc", tmp_path / "hold"))
    assert len(_temps(sub)) == 1
    nc.save({"w": torch.ones(3)}, sub / "optimizer.nvc")  # another file of the same directory
    assert _temps(sub) == []


def test_a_live_writers_temporary_file_is_kept(tmp_path):
    hold = tmp_path / "hold"
    proc = _start_held_save(tmp_path / "other.nvc", hold)
    try:
        live = _temps(tmp_path)
        assert len(live) == 1
        assert stale_temp_files(tmp_path) == []
        nc.save({"w": torch.ones(3)}, tmp_path / "ckpt.nvc")
        assert _temps(tmp_path) == live
    finally:
        hold.unlink()
    assert proc.stdout is not None
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0 and "done" in rest
    assert nc.load(tmp_path / "other.nvc")["w"].numel() == 1 << 18  # its save completed after ours
    assert _temps(tmp_path) == []


def test_a_killed_writer_not_yet_reaped_counts_as_gone(tmp_path):
    proc = _start_held_save(tmp_path / "ckpt.nvc", tmp_path / "hold")
    _kill(proc, reap=False)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child did not become a zombie"
            time.sleep(0.01)
        assert len(stale_temp_files(tmp_path)) == 1
        nc.save({"w": torch.ones(3)}, tmp_path / "ckpt.nvc")
        assert _temps(tmp_path) == []
    finally:
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    "name",
    [
        ".ckpt.nvc.tmp-{pid}-0badc0de@another-host~4026531836",  # same PID space unknown: another host
        ".nvckpt-tmp-0badc0de-{pid}-0badc0de@another-host~4026531836",  # the same, named as now
        ".nvckpt-tmp-0badc0de-{pid}-0badc0de",  # no host: written through fsspec
        ".ckpt.nvc.tmp-{pid}-0badc0de",  # written before temporary names carried their host
        "ckpt.nvc.tmp-{pid}-0badc0de",  # not hidden: not one of ours
    ],
)
def test_temporary_files_not_known_to_be_dead_are_kept(tmp_path, name):
    path = tmp_path / name.format(pid=_dead_pid())
    path.write_bytes(b"partial")
    assert stale_temp_files(tmp_path) == []
    nc.save({"w": torch.ones(3)}, tmp_path / "ckpt.nvc")
    assert path.read_bytes() == b"partial"


def test_a_target_name_near_the_file_system_limit_still_saves(tmp_path):
    target = tmp_path / ("n" * 220 + ".nvc")  # with the host tag, its temporary name would pass 255 bytes
    nc.save({"w": torch.ones(3)}, target)
    assert torch.equal(nc.load(target)["w"], torch.ones(3))
    assert _temps(tmp_path) == []


def test_a_temporary_name_never_holds_the_target_name(tmp_path):
    # Frameworks find checkpoints by name (Lightning's HPC resume: every digit of a name holding
    # "hpc_ckpt_"); a killed save's file must not look like one. The next save still cleans it.
    target = tmp_path / "hpc_ckpt_2.ckpt"
    _kill(_start_held_save(target, tmp_path / "hold"))
    (killed,) = _temps(tmp_path)
    assert "hpc_ckpt" not in killed and "ckpt_" not in killed and killed.startswith(temp_prefix(target.name))
    assert stale_temp_files(tmp_path) == [str(tmp_path / killed)]
    # A file of a killed save of an earlier release (its name held the target's) is cleaned too.
    host = temp_name("x").rsplit("@", 1)[1]
    legacy = tmp_path / f".hpc_ckpt_3.ckpt.tmp-{_dead_pid()}-0badc0de@{host}"
    legacy.write_bytes(b"partial")
    nc.save({"w": torch.ones(3)}, target)
    assert _temps(tmp_path) == [] and not legacy.exists()
