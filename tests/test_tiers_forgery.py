"""A tier whose units were put under another step's name (a broken sync, an attacker): restore, locate and
``nvckpt ls`` refuse the copy instead of calling step 200's state step 300."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.errors import CheckpointError


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(32, 16)}, "optimizer": {"m": torch.randn(32, 16)}, "step": step}


def _unit(folder: Path, step: int) -> tuple[Path, Path]:
    return folder / f"step-{step:010d}.nvc", folder / f"step-{step:010d}.manifest.json"


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    with nc.CheckpointManager([nc.Tier(tmp_path / "t")]) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, _state(step))
    return tmp_path / "t"


def _restore_skips_300(tier: Path, why: str) -> None:
    r = nc.CheckpointManager([nc.Tier(tier)]).restore()
    assert r.step == 200
    assert_tree_equal(_state(200), r.state)
    assert [(s, t) for s, t, _ in r.skipped] == [(300, "tier0")]
    assert why in r.skipped[0][2]
    assert nc.CheckpointManager([nc.Tier(tier)]).locate().step == 200
    with pytest.raises(CheckpointError, match="step 300"):
        nc.CheckpointManager([nc.Tier(tier)]).restore(step=300)


def _ls_refuses_300(tier: Path, capsys: pytest.CaptureFixture[str], why: str) -> None:
    for quick in ([], ["--quick"]):
        assert main(["ls", "--json", *quick, str(tier)]) == 1
        rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["tiers"][str(tier)]}
        assert rows[300]["verifies"] is False and why in rows[300]["problem"]
        assert rows[200]["verifies"] is True and rows[100]["verifies"] is True


def test_a_unit_and_manifest_copied_under_another_step_name(tier, capsys):
    for src, dst in zip(_unit(tier, 200), _unit(tier, 300)):
        shutil.copyfile(src, dst)
    why = "records step 200"
    _restore_skips_300(tier, why)
    _ls_refuses_300(tier, capsys, why)


def test_a_manifest_rewritten_to_the_name_its_file_does_not_have(tier, capsys):
    """The manifest's step and unit name rewritten to 300 (it is not signed): the file's own metadata says 200."""
    nvc, manifest = _unit(tier, 300)
    shutil.copyfile(_unit(tier, 200)[0], nvc)
    doc = json.loads(_unit(tier, 200)[1].read_bytes())
    doc["step"] = 300
    doc["unit"] = nvc.name
    manifest.write_text(json.dumps(doc))
    why = "the file records step 200"
    _restore_skips_300(tier, why)
    _ls_refuses_300(tier, capsys, why)


def test_a_manifest_naming_another_unit(tier, capsys):
    nvc, manifest = _unit(tier, 300)
    doc = json.loads(manifest.read_bytes())
    assert doc["step"] == 300 and doc["unit"] == nvc.name
    doc["unit"] = "step-0000000200.nvc"
    manifest.write_text(json.dumps(doc))
    why = "names unit step-0000000200.nvc"
    _restore_skips_300(tier, why)
    _ls_refuses_300(tier, capsys, why)


def test_files_without_the_recorded_step_restore_on_the_manifest_check(tmp_path):
    """A unit whose file records no step (an adopted framework file, an older save) restores as before."""
    folder = tmp_path / "t"
    mgr = nc.CheckpointManager([nc.Tier(folder)])
    src = tmp_path / "framework.nvc"
    nc.save(_state(7), src)
    mgr_ext = nc.CheckpointManager([nc.Tier(tmp_path), nc.Tier(folder)], tier0_external=True)
    mgr_ext.adopt(7, src)
    mgr_ext.close()
    r = mgr.restore()
    assert r.step == 7
    assert_tree_equal(_state(7), r.state)
