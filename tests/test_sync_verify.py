"""``nvckpt sync`` verifies before it trusts: DST's copies are checked and copied again from SRC where
damaged, ``--keep`` counts verified copies only, SRC and DST that are one place are refused, and a FIFO
named by a manifest is refused without being read."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.main import main


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 32)}, "optimizer": {"m": torch.randn(64, 32)}, "step": step}


@pytest.fixture
def tiers(tmp_path: Path) -> Path:
    """``src`` with steps 1-4, and ``dst`` with a verified copy of each (an earlier sync)."""
    with nc.CheckpointManager([nc.Tier(tmp_path / "src"), nc.Tier(tmp_path / "dst")], async_save=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, _state(step))
            mgr.wait()  # every step copied (a copy that finds the queue full is skipped)
    return tmp_path


def _unit(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}.nvc"


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40  # in the tensor data: the size and the index digest still match
    path.write_bytes(bytes(data))


def _sync(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main(["sync", "--json", *args])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_copy_damaged_on_dst_is_copied_again_from_src(tiers, capsys):
    _damage(_unit(tiers / "dst", 3))
    rc, doc = _sync(capsys, str(tiers / "src"), str(tiers / "dst"))
    assert rc == 0, doc
    assert doc["recopied"] == [3] and doc["copied"] == [3] and doc["verified"] == 3
    assert [d["step"] for d in doc["damaged"]] == [3] and doc["damaged"][0]["repaired"]
    assert _unit(tiers / "dst", 3).read_bytes() == _unit(tiers / "src", 3).read_bytes()
    # The text report says what was found.
    _damage(_unit(tiers / "dst", 2))
    # --quick checks sizes and index digests only, as `nvckpt ls --quick`: a flipped data byte passes it.
    rc, doc = _sync(capsys, "--quick", str(tiers / "src"), str(tiers / "dst"))
    assert rc == 0 and doc["verified"] == 4 and doc["copied"] == []
    assert main(["sync", str(tiers / "src"), str(tiers / "dst")]) == 0
    out = capsys.readouterr().out
    assert "verified 3 copies" in out and "copied again [2]" in out, out


def test_keep_counts_verified_copies_and_never_drops_a_good_step_for_a_damaged_one(tiers, capsys):
    # SRC lacks step 4 (its copy there is gone): DST's damaged 4 cannot be repaired.
    (tiers / "src" / "step-0000000004.manifest.json").unlink()
    _damage(_unit(tiers / "dst", 4))
    rc, doc = _sync(capsys, str(tiers / "src"), str(tiers / "dst"), "--keep", "1")
    assert rc == 1, doc  # something could not be repaired
    assert doc["removed"] == [1, 2] and doc["kept"] == [3, 4]
    assert doc["damaged"] == [{"step": 4, "problem": doc["damaged"][0]["problem"], "repaired": False}]
    assert "checksum" in doc["damaged"][0]["problem"].lower() or "decode" in doc["damaged"][0]["problem"].lower()
    r = nc.CheckpointManager([nc.Tier(tiers / "dst")]).restore()
    assert r.step == 3  # the good step the old sync deleted
    # With SRC holding a good step 4, the same sync repairs it and keeps it alone.
    with nc.CheckpointManager([nc.Tier(tiers / "src")], async_save=False) as mgr:
        mgr.save(4, _state(4))
    rc, doc = _sync(capsys, str(tiers / "src"), str(tiers / "dst"), "--keep", "1")
    assert rc == 0 and doc["recopied"] == [4] and doc["kept"] == [4] and doc["removed"] == [3]


@pytest.mark.parametrize("form", ["same", "dotdot", "symlink", "trailing-slash"])
def test_src_and_dst_in_one_place_are_refused_and_src_is_untouched(tiers, capsys, form):
    src = tiers / "src"
    dst = {
        "same": str(src),
        "dotdot": str(src / ".." / "src"),
        "symlink": str(tiers / "link"),
        "trailing-slash": str(src) + "/",
    }[form]
    if form == "symlink":
        (tiers / "link").symlink_to(src, target_is_directory=True)
    before = _files(src)
    assert main(["sync", str(src), dst, "--keep", "1"]) == 2
    assert "one place" in capsys.readouterr().err
    assert _files(src) == before


def test_urls_naming_one_prefix_are_refused_before_any_request(capsys):
    for a, b in [("s3://b/run", "s3://b/run/"), ("s3://b/run", "s3a://b/x/../run"), ("s3://b//run", "s3://b/run")]:
        assert main(["sync", a, b, "--endpoint-url", "http://127.0.0.1:9", "--keep", "1"]) == 2
        assert "one place" in capsys.readouterr().err


def _run_with_a_bound(args: list[str], fifo: Path, seconds: float = 20) -> int:
    """``main(args)`` on a thread; a read that blocks on ``fifo`` is released (a writer opens and closes it)."""
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(main(args)), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked reader gets EOF
        os.close(fd)
        t.join(10)
        pytest.fail(f"nvckpt {' '.join(args)} blocked on the FIFO {fifo}")
    return result[0]


def test_a_fifo_named_by_a_manifest_is_refused_unread(tiers, capsys):
    # On SRC: step 2's file replaced by a FIFO; DST lacks step 2.
    (tiers / "dst" / "step-0000000002.manifest.json").unlink()
    _unit(tiers / "dst", 2).unlink()
    fifo = _unit(tiers / "src", 2)
    fifo.unlink()
    os.mkfifo(fifo)
    rc = _run_with_a_bound(["sync", str(tiers / "src"), str(tiers / "dst")], fifo)
    assert rc == 1
    captured = capsys.readouterr()
    assert "not a regular file" in captured.err and "step-0000000002.nvc" in captured.err
    assert "step-0000000002.manifest.json" not in _files(tiers / "dst")
    # On DST: a FIFO in place of a copy is a damaged copy, copied again from SRC.
    fifo = _unit(tiers / "dst", 3)
    fifo.unlink()
    os.mkfifo(fifo)
    rc = _run_with_a_bound(["sync", "--json", str(tiers / "src"), str(tiers / "dst")], fifo)
    doc = json.loads(capsys.readouterr().out)
    assert 3 in doc["recopied"] and _unit(tiers / "dst", 3).is_file()
    assert rc == 1  # step 2 still cannot be copied
