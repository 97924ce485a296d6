"""``nvcomp_checkpoint.deepspeed_layout``: a DeepSpeed tag's names, completeness and pickle allow-list, in the core.

No ranks here: files are made with DeepSpeed's own classes (or shaped as DeepSpeed writes them);
tests/test_deepspeed.py checks the folders real training runs leave.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal, run_python
from nvcomp_checkpoint.deepspeed_layout import (
    EXPERT,
    MODEL_STATES,
    OPTIM_PARTITION,
    OTHER_FILE,
    SAFE_GLOBAL_NAMES,
    classify_file,
    load_deepspeed_file,
    safe_global_objects,
    tag_problems,
    write_manifest,
)
from nvcomp_checkpoint.errors import UnsafeCheckpointError


def test_allow_list_names_are_deepspeeds_classes() -> None:
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from nvcomp_checkpoint.integrations.deepspeed import DEEPSPEED_SAFE_GLOBALS

    # The names are part of the format: each resolves to the class DeepSpeed pickles under it.
    assert SAFE_GLOBAL_NAMES == (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    )
    assert tuple(safe_global_objects()) == DEEPSPEED_SAFE_GLOBALS


@pytest.mark.parametrize(
    ("name", "kind", "rank", "expert"),
    [
        ("mp_rank_00_model_states.pt", MODEL_STATES, None, None),
        ("zero_pp_rank_3_mp_rank_00_model_states.pt", MODEL_STATES, 3, None),
        ("zero_pp_rank_1_mp_rank_00_optim_states.pt", OPTIM_PARTITION, 1, None),
        ("bf16_zero_pp_rank_12_mp_rank_01_optim_states.pt", OPTIM_PARTITION, 12, None),
        ("expp_rank_0_mp_rank_00_optim_states.pt", OPTIM_PARTITION, 0, None),
        ("layer_0_expert_1_mp_rank_00_model_states.pt", EXPERT, None, (0, 1)),
        ("layer_03-model_00-model_states.pt", MODEL_STATES, None, None),
        ("zero_to_fp32.py", OTHER_FILE, None, None),
        ("nvckpt_manifest.json", OTHER_FILE, None, None),
    ],
)
def test_file_names_are_classified(name: str, kind: str, rank: int | None, expert: tuple[int, int] | None) -> None:
    f = classify_file(name)
    assert (f.kind, f.rank, f.expert) == (kind, rank, expert)


def _scalers() -> dict:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    dynamic = DynamicLossScaler(init_scale=2.0**12, scale_window=7, min_scale=2.0, delayed_shift=2, consecutive_hysteresis=True)
    dynamic.cur_iter, dynamic.last_overflow_iter, dynamic.cur_hysteresis = 41, 30, 1
    return {
        "optimizer_state_dict": {
            "dynamic_loss_scale": True,
            "loss_scaler": dynamic,
            "overflow": False,
            "fp32_groups_flat": [torch.randn(64)],
            "static": LossScaler(128.0),
        },
        "ds_version": "0.19",
    }


def _state(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_state(v) for v in obj]
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
        return (type(obj).__qualname__, _state(vars(obj)))
    return obj


@pytest.mark.parametrize("fmt", ["plain", "ours"])
def test_fp16_loss_scalers_round_trip_through_the_allow_list(tmp_path: Path, fmt: str) -> None:
    # DeepSpeed refuses fp16 on the CPU accelerator ("Type fp16 is not supported on your device"), so
    # the fp16 optimizers' state is built here with DeepSpeed's own classes, as they write it.
    pytest.importorskip("deepspeed")
    tree = _scalers()
    tag = tmp_path / "t1"
    tag.mkdir()
    path = tag / "mp_rank_00_model_states.pt"
    if fmt == "plain":
        torch.save(tree, path)
    else:
        nc.save(tree, path)
        write_manifest(tag, "t1", 1, {path.name: path.stat().st_size})
    loaded = load_deepspeed_file(path)
    scaler = loaded["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler) is type(tree["optimizer_state_dict"]["loss_scaler"])
    # A resumed DynamicLossScaler continues from the saved iteration, scale and hysteresis.
    assert_tree_equal(_state(loaded), _state(tree))
    assert scaler.loss_scale == 2.0**12 and scaler.cur_iter == 41
    # Allowed only during the load: the process-wide list is not left widened.
    plain = tmp_path / "plain.pt"
    torch.save(tree, plain)
    with pytest.raises(pickle.UnpicklingError, match=r"deepspeed\.runtime\."):
        torch.load(plain, weights_only=True)


class _Exec:
    def __reduce__(self):  # noqa: ANN204
        return (os.system, ("echo smuggled",))


def test_a_global_outside_the_list_is_refused_without_importing_its_module(tmp_path: Path) -> None:
    # A file naming a module nobody imported, plain and ours: the refusal names it and the module is
    # never imported. One fresh process for both (it imports DeepSpeed for the allow-list).
    script = f"""
import pathlib, sys, torch
import nvcomp_checkpoint as nc
from nvcomp_checkpoint.deepspeed_layout import load_deepspeed_file, write_manifest
from nvcomp_checkpoint.errors import UnsafeCheckpointError
class Far:
    pass
Far.__module__, Far.__qualname__ = "antigravity", "geohash"
sys.modules["antigravity"] = type(sys)("antigravity"); sys.modules["antigravity"].geohash = Far
paths = []
for fmt in ("plain", "ours"):
    tag = pathlib.Path({str(tmp_path)!r}) / fmt / "t1"; tag.mkdir(parents=True)
    path = tag / "mp_rank_00_model_states.pt"
    tree = {{"module": {{"w": torch.ones(4)}}, "x": Far()}}
    if fmt == "plain":
        torch.save(tree, path)
    else:
        nc.save(tree, path)
        write_manifest(tag, "t1", 1, {{path.name: path.stat().st_size}})
    paths.append(path)
del sys.modules["antigravity"]
for path in paths:
    try:
        load_deepspeed_file(path)
    except UnsafeCheckpointError as exc:
        assert "antigravity.geohash" in str(exc), exc
    else:
        raise AssertionError(f"{{path}} loaded")
assert "antigravity" not in sys.modules
"""
    run_python("-c", script, cwd=tmp_path, DS_ACCELERATOR="cpu")


def test_without_deepspeed_files_are_read_with_stand_ins_and_not_written_back(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    tree = _scalers()
    tag = tmp_path / "t1"
    tag.mkdir()
    torch.save(tree, tag / "mp_rank_00_model_states.pt")
    nc.save(tree, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    write_manifest(tag, "t1", 1, {p.name: p.stat().st_size for p in tag.iterdir()})
    script = f"""
import sys
sys.modules["deepspeed"] = None  # as if not installed: any import of it fails
import nvcomp_checkpoint as nc
from nvcomp_checkpoint.deepspeed_layout import load_deepspeed_file
from nvcomp_checkpoint.errors import UnsupportedObjectError
for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
    t = load_deepspeed_file({str(tag)!r} + "/" + name)
    s = t["optimizer_state_dict"]["loss_scaler"]
    assert type(s).__name__ == "DynamicLossScaler" and s.state["cur_iter"] == 41, vars(s)
    try:
        nc.save(t, {str(tmp_path)!r} + "/out.nvc")
    except UnsupportedObjectError as exc:
        assert "pip install deepspeed" in str(exc), exc
    else:
        raise AssertionError("a stand-in was written")
assert not any(m == "deepspeed" or m.startswith("deepspeed.") for m in sys.modules if sys.modules[m] is not None)
"""
    run_python("-c", script, cwd=tmp_path)


def test_plain_tag_missing_a_rank_is_named(tmp_path: Path) -> None:
    tag = tmp_path / "t1"
    tag.mkdir()
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    for rank in (0, 2):
        torch.save({}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    problems = tag_problems(tag)
    assert len(problems) == 1 and "ranks [1]" in problems[0]
    torch.save({}, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert tag_problems(tag) == []
    (tag / "mp_rank_00_model_states.pt").unlink()
    assert "no model states" in tag_problems(tag)[0]


def test_a_reduce_to_a_function_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"x": _Exec()}, path)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        load_deepspeed_file(path)


def _plain_deepspeed_folder(root: Path) -> Path:
    """A plain DeepSpeed folder shaped as ZeRO-2 writes it (2 ranks), made without training."""
    tag = root / "t1"
    tag.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save({"module": {"w": torch.randn(256)}, "ds_version": "0.19"}, tag / "mp_rank_00_model_states.pt")
    for rank in range(2):
        state = {"single_partition_of_fp32_groups": [torch.randn(128)], "partition_count": [2]}
        torch.save({"optimizer_state_dict": state, "ds_version": "0.19"}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("t1")
    return tag


def test_in_place_compress_killed_midway_is_refused_until_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvcomp_checkpoint.cli.main import main
    from nvcomp_checkpoint.deepspeed_layout import CONVERTING_NAME, MANIFEST_NAME
    from nvcomp_checkpoint.errors import FormatError

    tag = _plain_deepspeed_folder(tmp_path / "ckpt")
    before = {p.name: torch.load(p, weights_only=True) for p in tag.iterdir()}
    real_save = nc.save
    saved: list[str] = []

    def dies_on_the_second_file(obj, path, *args, **kwargs):  # noqa: ANN001, ANN202
        if saved:
            raise KeyboardInterrupt  # as a kill would: the first file converted, the rest not
        saved.append(str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(nc, "save", dies_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        from nvcomp_checkpoint.cli._deepspeed import convert_in_place

        convert_in_place(str(tmp_path / "ckpt"), True, nc.CodecPolicy(), None, lambda name: None)
    assert (tag / CONVERTING_NAME).exists() and not (tag / MANIFEST_NAME).exists()
    # The half-converted tag is refused on every file, naming the command that finishes it.
    for p in tag.glob("*.pt"):
        with pytest.raises(FormatError, match="run the same command again"):
            load_deepspeed_file(p)
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    monkeypatch.setattr(nc, "save", real_save)
    assert main(["compress", str(tmp_path / "ckpt")]) == 0  # resumes
    assert not (tag / CONVERTING_NAME).exists() and (tag / MANIFEST_NAME).exists()
    assert (tmp_path / "ckpt" / "latest").read_text() == "t1"
    for name, tree in before.items():
        assert nc.is_nvcomp_checkpoint(tag / name)
        assert_tree_equal(load_deepspeed_file(tag / name), tree)
    assert main(["verify", str(tmp_path / "ckpt")]) == 0


def test_verify_names_a_missing_last_rank_of_a_plain_tag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nvcomp_checkpoint.cli.main import main

    tag = _plain_deepspeed_folder(tmp_path / "ckpt")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    assert "ranks [1]" in capsys.readouterr().out
    (tmp_path / "ckpt" / "latest").write_text("t9")
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    assert "names tag 't9'" in capsys.readouterr().out


def test_in_place_compress_leaves_a_tag_missing_its_last_rank_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Converting it would write a manifest of what is present, which would then verify as committed.
    from nvcomp_checkpoint.cli.main import main
    from nvcomp_checkpoint.deepspeed_layout import MANIFEST_NAME

    tag = _plain_deepspeed_folder(tmp_path / "ckpt")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert main(["compress", str(tmp_path / "ckpt"), "--json"]) == 0  # as for a tag a kill left: skipped, named
    rows = json.loads(capsys.readouterr().out)["files"]
    assert {r["action"] for r in rows} == {"skipped"} and all("ranks [1]" in r["note"] for r in rows), rows
    assert not (tag / MANIFEST_NAME).exists()
    assert not any(nc.is_nvcomp_checkpoint(p) for p in tag.iterdir())
    assert main(["verify", str(tmp_path / "ckpt")]) == 1


@pytest.mark.parametrize("count", [1 << 22, 1 << 40])
def test_a_forged_partition_count_is_bounded_and_names_the_file(tmp_path: Path, count: int) -> None:
    # partition_count says how many ranks wrote ZeRO files; [2**40] would build a set that size.
    tag = _plain_deepspeed_folder(tmp_path / "ckpt")
    rank0 = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(rank0, weights_only=True)
    state["optimizer_state_dict"]["partition_count"] = [count]
    torch.save(state, rank0)
    (problem,) = tag_problems(tag, read_partition_count=True)
    assert str(rank0) in problem and f"partition_count {count}" in problem and len(problem) < 600, problem


def _compressed_run(root: Path, value: float) -> Path:
    """A DeepSpeed folder (2 ranks, tag t1) compressed and committed by ``nvckpt compress``; constant
    tensors, so two runs' files compress to the same sizes."""
    from nvcomp_checkpoint.cli.main import main

    tag = root / "t1"
    tag.mkdir(parents=True)
    torch.save({"module": {"w": torch.full((256,), value)}, "ds_version": "0.19"}, tag / "mp_rank_00_model_states.pt")
    for rank in range(2):
        state = {"single_partition_of_fp32_groups": [torch.full((128,), value + rank)], "partition_count": [2]}
        torch.save({"optimizer_state_dict": state, "ds_version": "0.19"}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("t1")
    assert main(["compress", str(root)]) == 0
    return tag


def test_a_same_size_rank_file_of_another_run_is_refused_by_load_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvcomp_checkpoint.cli.main import main
    from nvcomp_checkpoint.errors import MixedSaveError

    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    # Two runs whose rank-1 files have the same size: the index holds decimal text (a save's time, frame
    # digests), so sizes spread over a few bytes; runs are made until two share one (pigeonhole: a handful).
    by_size: dict[int, Path] = {}
    for attempt in range(40):
        run = _compressed_run(tmp_path / f"r{attempt}", 1.0 + attempt)
        size = (run / name).stat().st_size
        if size in by_size:
            mine, theirs = by_size[size], run
            break
        by_size[size] = run
    else:
        pytest.fail(f"40 runs, no two rank-1 files of one size: {sorted(by_size)}")
    assert (mine / name).stat().st_size == (theirs / name).stat().st_size  # only a digest tells them apart
    (mine / name).write_bytes((theirs / name).read_bytes())
    with pytest.raises(MixedSaveError, match=name):
        load_deepspeed_file(mine / name)
    capsys.readouterr()
    assert main(["verify", str(mine.parent)]) == 1
    assert name in capsys.readouterr().out
    assert main(["verify", str(theirs.parent)]) == 0


def test_tag_manifest_records_digests_and_identity_and_v1_manifests_still_load(tmp_path: Path) -> None:
    from nvcomp_checkpoint.deepspeed_layout import MANIFEST_NAME
    from nvcomp_checkpoint.errors import FormatError

    tag = _compressed_run(tmp_path / "a", 1.0)
    manifest = json.loads((tag / MANIFEST_NAME).read_text())
    assert manifest["tag"] == "t1" and manifest["world_size"] == 2 and len(manifest["save_id"]) == 32
    assert all(isinstance(r["index_xxh3"], int) and r["bytes"] > 0 for r in manifest["files"].values()), manifest
    # A manifest written before digests were recorded (v1, sizes only) still loads, checking sizes.
    old = {"format": "nvcomp-checkpoint deepspeed tag v1", "tag": "t1", "world_size": 2}
    old["files"] = {n: r["bytes"] for n, r in manifest["files"].items()}
    (tag / MANIFEST_NAME).write_text(json.dumps(old))
    assert load_deepspeed_file(tag / "mp_rank_00_model_states.pt")["module"]["w"][0] == 1.0
    old["files"]["mp_rank_00_model_states.pt"] += 1
    (tag / MANIFEST_NAME).write_text(json.dumps(old))
    with pytest.raises(FormatError, match="committed"):
        load_deepspeed_file(tag / "mp_rank_00_model_states.pt")


def test_nvckpt_ls_verifies_a_deepspeed_tag_copied_to_a_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A tier copy of a DeepSpeed tag holds DeepSpeed's classes (the loss scaler of every ZeRO optimizer
    # file): `nvckpt ls` checks it with DeepSpeed's allow-list, as `nvckpt verify` of the folder does.
    pytest.importorskip("deepspeed")
    from nvcomp_checkpoint.cli.main import main

    tag = tmp_path / "run" / "t1"
    tag.mkdir(parents=True)
    path = tag / "mp_rank_00_model_states.pt"
    nc.save(_scalers(), path)
    write_manifest(tag, "t1", 1, {path.name: path.stat().st_size})
    mgr = nc.CheckpointManager(
        [nc.Tier(tmp_path / "run", name="fw"), nc.Tier(tmp_path / "shared", name="shared")], tier0_external=True
    )
    mgr.wait()
    mgr.adopt(1, tag)
    mgr.close()
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "shared"), "--json"]) == 0, capsys.readouterr()


def test_a_deepspeed_delta_tag_names_its_base_tag_though_its_files_end_in_pt(tmp_path: Path) -> None:
    # The tiers and the rotation find a chain through unit_base_of: DeepSpeed's rank files keep their
    # `.pt` names, so a lookup of `.nvc` files only took every delta tag for a full one, and its base
    # never reached the tier (a fresh node then could not open the delta).
    from nvcomp_checkpoint.incremental import keep_with_bases, unit_base_of

    first, second = tmp_path / "t1", tmp_path / "t2"
    first.mkdir()
    second.mkdir()
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {"optimizer_state_dict": {"single_partition_of_fp32_groups": [torch.randn(4096)]}}
    nc.save(state, first / name)
    state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][:10] += 1
    nc.save(state, second / name, base=first / name)
    (second / "notes.txt").write_text("not a checkpoint")
    assert unit_base_of(str(first)) is None
    assert unit_base_of(str(second)) == str(first)
    assert keep_with_bases([str(second)]) == {str(first), str(second)}
