"""``nvckpt ls``, ``nvckpt sync`` and ``nvckpt estimate --tier`` on tiers a CheckpointManager wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.cli.main import main


@pytest.fixture
def tiers(tmp_path):
    """A local tier with steps 1-4 (4 light) and a shared tier with steps 2 and 4 (the multiples of 2)."""
    ts = [nc.Tier(tmp_path / "local"), nc.Tier(tmp_path / "shared", every_steps=2)]
    with nc.CheckpointManager(ts) as mgr:
        for step in range(1, 5):
            model = torch.nn.Linear(64, 64)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()}, light=step == 4)
            mgr.wait()
    return tmp_path


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_ls_lists_steps_sizes_and_light(tiers, capsys):
    assert main(["ls", "--json", str(tiers / "local"), str(tiers / "shared")]) == 0
    doc = _json(capsys)["tiers"]
    local = doc[str(tiers / "local")]
    assert [(r["step"], r["light"], r["verifies"]) for r in local] == [
        (1, False, True),
        (2, False, True),
        (3, False, True),
        (4, True, True),
    ]
    assert local[0]["bytes"] == (tiers / "local" / "step-0000000001.nvc").stat().st_size
    assert [r["step"] for r in doc[str(tiers / "shared")]] == [2, 4]
    assert main(["ls", str(tiers / "local")]) == 0
    out = capsys.readouterr().out
    assert "4 step(s)" in out and "light" in out and "full" in out


def test_ls_finds_a_damaged_copy(tiers, capsys):
    f = tiers / "shared" / "step-0000000004.nvc"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x40  # in the tensor data, not the index
    f.write_bytes(bytes(data))
    # The quick check (size and index digest) cannot see it; decoding every chunk does.
    assert main(["ls", "--quick", "--json", str(tiers / "shared")]) == 0
    capsys.readouterr()
    assert main(["ls", "--json", str(tiers / "shared")]) == 1
    rows = _json(capsys)["tiers"][str(tiers / "shared")]
    assert rows[0]["verifies"] and not rows[1]["verifies"]
    assert "checksum" in rows[1]["problem"].lower()


def test_sync_copies_missing_steps_verified_and_keeps_n(tiers, capsys):
    dst = tiers / "offsite"
    assert main(["sync", "--json", str(tiers / "local"), str(dst), "--keep", "2"]) == 0
    doc = _json(capsys)
    # --keep 2 keeps the newest two steps, and never drops the newest full one (3; step 4 is light).
    assert doc["copied"] == [3, 4] and doc["kept"] == [3, 4] and doc["removed"] == []
    for step in (3, 4):
        name = f"step-{step:010d}.nvc"
        assert (dst / name).read_bytes() == (tiers / "local" / name).read_bytes()
    # Nothing left to copy the second time.
    assert main(["sync", "--json", str(tiers / "local"), str(dst)]) == 0
    assert _json(capsys)["copied"] == [1, 2]
    assert main(["sync", "--json", str(tiers / "shared"), str(dst), "--keep", "1"]) == 0
    doc = _json(capsys)
    assert doc["copied"] == [] and doc["kept"] == [3, 4] and doc["removed"] == [1, 2]
    r = nc.CheckpointManager([nc.Tier(dst)]).restore()
    assert r.step == 3
    assert_tree_equal(nc.load(tiers / "local" / "step-0000000003.nvc"), r.state)


def test_sync_refuses_a_source_that_changed(tiers, capsys):
    f = tiers / "local" / "step-0000000002.nvc"
    f.write_bytes(f.read_bytes() + b"extra")
    assert main(["sync", str(tiers / "local"), str(tiers / "offsite")]) == 1  # the others are copied, step 2 reported
    err = capsys.readouterr().err
    assert "step 2 not copied" in err and "step-0000000002.nvc" in err and "manifest says" in err
    # Step 2 left nothing behind.
    names = sorted(p.name for p in (tiers / "offsite").iterdir())
    assert [n for n in names if n.startswith("step-0000000002")] == [] and "step-0000000003.manifest.json" in names


def test_sync_bad_keep(tiers, capsys):
    assert main(["sync", str(tiers / "local"), str(tiers / "x"), "--keep", "0"]) == 2
    assert "--keep must be a positive integer" in capsys.readouterr().err


def test_estimate_storage_cost_per_tier(capsys):
    args = [
        "estimate",
        "--json",
        "--checkpoint-gb",
        "782",
        "--gpus",
        "8",
        "--gpu-hour-usd",
        "4.40",
        "--storage-gbps",
        "5",
        "--interval-min",
        "5",
        "--retain",
        "2",
        "--storage-usd-gb-month",
        "0.1",
        "--ratio",
        "1.27",
        "--tier",
        "local:0:2:0",
        "--tier",
        "shared:30:4:0.30",
        "--tier",
        "object:60:24:0.023",
    ]
    assert main(args) == 0
    result = _json(capsys)
    tiers = {t["name"]: t for t in result["tiers"]}
    assert tiers["local"]["copies_month"] == pytest.approx(8640)
    assert tiers["shared"]["copies_month"] == pytest.approx(1440)
    assert tiers["shared"]["stored_gb_without"] == pytest.approx(4 * 782)
    assert tiers["object"]["stored_gb_with"] == pytest.approx(24 * 782 / 1.27, rel=1e-3)
    assert tiers["object"]["usd_month_with"] == pytest.approx(24 * 782 / 1.27 * 0.023, rel=1e-3)
    # The grand total: the first table's (GPU idle + tier 0) plus every tier's storage.
    doc = json.loads(json.dumps(result))
    for k in ("without", "with"):
        expected = doc[k]["total_usd_month"] + sum(t[f"usd_month_{k}"] for t in tiers.values())
        assert doc["all_in_usd_month"][k] == pytest.approx(expected, abs=0.05)  # each rounded to cents
    assert main(args[:1] + args[2:]) == 0
    out = capsys.readouterr().out
    assert "storage per tier" in out and "total per month (GPU idle + tier 0)" in out and "total (tiers)" in out, out
    a = doc["all_in_usd_month"]
    assert (
        f"all in, per month (GPU idle + tier 0 + the tiers): ${a['without']:,.0f} without, ${a['with']:,.0f} with compression"
        in out
    ), out


def test_estimate_bad_tier_is_a_usage_error():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nvcomp_checkpoint.cli",
            "estimate",
            "--checkpoint-gb",
            "1",
            "--gpus",
            "1",
            "--gpu-hour-usd",
            "1",
            "--storage-gbps",
            "1",
            "--interval-min",
            "1",
            "--retain",
            "1",
            "--storage-usd-gb-month",
            "1",
            "--ratio",
            "1.2",
            "--tier",
            "object:60:0:0.02",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "KEEP at least 1" in proc.stderr


def test_ls_of_an_empty_tier(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["ls", str(tmp_path / "empty")]) == 0
    assert "no committed steps" in capsys.readouterr().out


def test_ls_of_a_missing_folder_is_an_error(tmp_path, capsys):
    # A mistyped path is not an empty tier.
    assert main(["ls", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "nothing: no such folder" in err and "Traceback" not in err, err


def test_ls_of_a_folder_that_is_not_a_tier_is_an_error(tmp_path, capsys):
    (tmp_path / "train.py").write_text("print()\n")
    (tmp_path / "model.nvc").write_bytes(b"x")
    assert main(["ls", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a tier" in err and "model.nvc, train.py" in err and "nvckpt inspect" in err, err


def test_ls_shows_deltas_and_their_base_and_sync_says_which_bases_it_keeps(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    with nc.CheckpointManager([nc.Tier(str(tmp_path / "src"))], incremental=True, full_every=10, async_save=False) as mgr:
        for step in (1, 2, 3, 4, 5):
            w = w + 1e-3 * torch.randn(64, 64, generator=g)
            mgr.save(step, {"w": w})
    capsys.readouterr()
    assert main(["ls", "--json", str(tmp_path / "src")]) == 0
    rows = json.loads(capsys.readouterr().out)["tiers"][str(tmp_path / "src")]
    assert [(r["step"], r["base"]) for r in rows] == [(1, None), (2, 1), (3, 2), (4, 3), (5, 4)]
    assert main(["ls", str(tmp_path / "src")]) == 0
    out = capsys.readouterr().out
    assert "base" in out and "delta" in out and "full" in out, out

    dst = tmp_path / "dst"
    assert main(["sync", "--json", str(tmp_path / "src"), str(dst), "--keep", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kept"] == [1, 2, 3, 4, 5] and d["removed"] == [] and d["kept_as_bases"] == [1, 2, 3], d
    assert main(["sync", str(tmp_path / "src"), str(dst), "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert "past --keep 2 it also keeps [1, 2, 3] as bases of kept deltas" in out, out
