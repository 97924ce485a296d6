"""``nvcomp_checkpoint.deepspeed.attach``: DeepSpeed checkpoints written compressed, committed whole, loaded without pickle trust.

One 2-rank CPU run (torchrun, gloo) per ZeRO stage (tests/deepspeed_train.py): it saves a plain and a
compressed tag ``t3``, records the next losses, and is killed with SIGKILL while saving ``t5``. Fresh
processes then resume from both folders with the uninterrupted run's losses, and save again, sync and
async. The tests below check what those runs left and what they printed; the forged-file tests need
no ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import fresh_process
from conftest import assert_tree_equal, run_python

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.deepspeed import MANIFEST_NAME, check_tag_complete, load_deepspeed_file  # noqa: E402
from nvcomp_checkpoint.errors import CheckpointNotFoundError, FormatError, UnsafeCheckpointError  # noqa: E402
from nvcomp_checkpoint.filetype import NVCOMP, TORCH, kind_of  # noqa: E402

SCRIPT = Path(__file__).with_name("deepspeed_train.py")
#: The ZeRO stage whose resume run copies to an S3 tier (one stage: the suite's time); the other stage's
#: copies to a local folder tier (deepspeed_train.py).
TIER_STAGE = 3
ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
}


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """The two ranks, as torchrun runs them (see tests/fresh_process.py)."""
    return fresh_process.run_ranks(
        (str(SCRIPT), *args), 2, cwd=os.getcwd(), env=dict(os.environ, PYTHONWARNINGS="ignore", **ENV), timeout=300
    )


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """The killed first run and the fresh-process resume of one ZeRO stage; returns (stage, root)."""
    stage = request.param
    root = tmp_path_factory.mktemp(f"ds_zero{stage}")
    first = _torchrun("first", str(stage), str(root))
    # The t5 save is killed by design: the run must end with that SIGKILL, not finish or fail otherwise.
    assert fresh_process.ended_by_signal(first) == signal.SIGKILL, first.stdout[-2000:] + first.stderr[-4000:]
    assert "should have been killed" not in first.stderr
    # The resume reads `latest` and must land on t3; save_checkpoint there leaves the folder as it was.
    snapshot = {p: p.stat().st_size for p in (root / "ours").rglob("*") if p.is_file()}
    from test_tiers_s3 import BUCKET, MotoServer, served

    resume = (
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        "resume",
        str(stage),
        str(root),
    )
    if stage == TIER_STAGE:
        # The async engine's tags are copied to an S3 tier (moto's server), and a fresh engine resumes from it.
        with served(MotoServer(root / "moto_server.log")) as server:
            run_python(*resume, cwd=root, NVCKPT_DS_S3=server.endpoint, **ENV)
            (root / "s3_keys.json").write_text(json.dumps(server.keys(f"ds-zero{stage}/")))
        assert BUCKET == "tiers"  # the bucket deepspeed_train.py names
    else:
        run_python(*resume, cwd=root, **ENV)
    assert {p: p.stat().st_size for p in (root / "ours").rglob("*") if p.is_file()} == snapshot
    return stage, root


def _comparable(tree: object) -> object:
    """The tree with DeepSpeed's objects (LossScaler has no __eq__) as their class name and attributes."""
    if isinstance(tree, dict):
        return {k: _comparable(v) for k, v in tree.items() if k != "ds_config"}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_comparable(v) for v in tree)
    if hasattr(tree, "__dict__") and not isinstance(tree, torch.Tensor):
        return (type(tree).__name__, _comparable(vars(tree)))
    return tree


def _kind(path: Path) -> str:
    with open(path, "rb") as f:
        return kind_of(f.read(16), path.stat().st_size)


def test_resume_after_kill_continues_with_identical_losses_from_ours_and_plain(run: tuple[int, Path]) -> None:
    _, root = run
    ref = json.loads((root / "ref.json").read_text())
    resumed = json.loads((root / "resumed.json").read_text())
    assert resumed["ours"] == ref
    assert resumed["plain"] == ref


def test_files_keep_deepspeed_names_and_are_compressed(run: tuple[int, Path]) -> None:
    stage, root = run
    plain = sorted(p.name for p in (root / "plain" / "t3").iterdir())
    ours = sorted(p.name for p in (root / "ours" / "t3").iterdir())
    assert ours == sorted(plain + [MANIFEST_NAME])
    assert len(plain) == (3 if stage == 2 else 4)
    for name in plain:
        assert _kind(root / "plain" / "t3" / name) == TORCH
        assert _kind(root / "ours" / "t3" / name) == NVCOMP
    assert sum((root / "ours" / "t3" / n).stat().st_size for n in plain) < sum(
        (root / "plain" / "t3" / n).stat().st_size for n in plain
    )
    manifest = json.loads((root / "ours" / "t3" / MANIFEST_NAME).read_text())
    assert manifest["tag"] == "t3" and manifest["world_size"] == 2
    # Each file with its size and index digest, recorded by the rank that wrote it.
    from nvcomp_checkpoint.filedigest import index_digest

    assert manifest["files"] == {
        n: {"bytes": (root / "ours" / "t3" / n).stat().st_size, "index_xxh3": index_digest(root / "ours" / "t3" / n)}
        for n in plain
    }
    assert manifest["format"] == "nvcomp-checkpoint deepspeed tag v2" and len(manifest["save_id"]) == 32
    if stage == 2:  # save_16bit_model's export is read by other tools: it stays a torch.save file
        assert _kind(root / "export" / "pytorch_model.bin") == TORCH


def test_killed_save_leaves_latest_on_the_last_complete_tag(run: tuple[int, Path]) -> None:
    stage, root = run
    assert (root / "ours" / "latest").read_text() == "t3"
    t5 = root / "ours" / "t5"
    assert not (t5 / MANIFEST_NAME).exists()
    # What the killed save left of t5 is refused, naming the tag, on every rank's first load.
    leftovers = sorted(p for p in t5.iterdir() if not p.name.startswith("."))
    assert leftovers, "the kill should come after some t5 file was written"
    for path in leftovers:
        with pytest.raises(FormatError, match="never committed"):
            load_deepspeed_file(path)


def test_async_save_commits_once_durable_with_the_same_files_as_sync(run: tuple[int, Path]) -> None:
    _, root = run
    assert (root / "sync" / "latest").read_text() == "t7"
    assert (root / "async" / "latest").read_text() == "t6"
    names = sorted(p.name for p in (root / "sync" / "t5").iterdir())
    assert names == sorted(p.name for p in (root / "async" / "t5").iterdir())
    for name in names:
        if name == MANIFEST_NAME:
            continue
        assert _kind(root / "async" / "t5" / name) == NVCOMP
        assert_tree_equal(
            _comparable(load_deepspeed_file(root / "sync" / "t5" / name)),
            _comparable(load_deepspeed_file(root / "async" / "t5" / name)),
        )


def test_incremental_tags_are_deltas_of_the_previous_tag(run: tuple[int, Path]) -> None:
    from nvcomp_checkpoint.delta import base_path_of
    from nvcomp_checkpoint.reader import CheckpointReader

    _, root = run
    sync = root / "sync"
    names = sorted(p.name for p in (sync / "t6").iterdir() if p.name != MANIFEST_NAME)
    assert names == sorted(p.name for p in (sync / "t5").iterdir() if p.name != MANIFEST_NAME)
    for name in names:
        assert base_path_of(str(sync / "t5" / name), CheckpointReader) is None  # the process's first save: full
        assert base_path_of(str(sync / "t6" / name), CheckpointReader) == str(sync / "t5" / name)
        assert base_path_of(str(sync / "t7" / name), CheckpointReader) is None  # full_every=2
        # The async engine (async_save, tiers and incremental at once) chains its tags the same way.
        assert base_path_of(str(root / "async" / "t6" / name), CheckpointReader) == str(root / "async" / "t5" / name)
    assert sum((sync / "t6" / n).stat().st_size for n in names) < sum((sync / "t5" / n).stat().st_size for n in names)


def test_async_tiered_incremental_engine_resumes_on_a_fresh_node_from_the_tiers_delta_tag(run: tuple[int, Path]) -> None:
    """attach(async_save=True, tiers=[...], incremental=True): the tier holds the delta tag t6 and its base t5
    (a local tier keeping one step keeps the base too); with the save folder gone, fresh ranks resume from
    the tier (resume_path) with the uninterrupted run's next losses."""
    stage, root = run
    resumed = json.loads((root / "resumed.json").read_text())
    tag_files = sorted(p.name for p in (root / "async" / "t6").iterdir())
    if stage == TIER_STAGE:
        keys = json.loads((root / "s3_keys.json").read_text())
        copied: dict[str, set[str]] = {}
        for key in keys:
            if key.count("/") >= 2:  # a file of a step's folder (not the step's manifest beside it)
                copied.setdefault(key.split("/")[1], set()).add(key.rsplit("/", 1)[1])
    else:
        copied = {p.name: {f.name for f in p.iterdir()} for p in (root / "tier").iterdir() if p.is_dir()}
        assert sorted(copied) == ["step-0000000005", "step-0000000006"]  # keep=1, and t6's base
    assert {"step-0000000005", "step-0000000006"} <= set(copied), sorted(copied)
    assert set(tag_files) <= copied["step-0000000006"]  # every file of the tag, its manifest included
    assert resumed["tier"]["step"] == 6
    assert resumed["tier"]["losses"] == resumed["after_async_t6"]
    assert Path(resumed["tier"]["path"]).is_relative_to(root / "restore")


def test_on_saved_is_called_on_every_rank_once_each_tag_is_committed(run: tuple[int, Path]) -> None:
    _, root = run
    for rank in (0, 1):
        record = json.loads((root / f"on_saved-{rank}.json").read_text())
        for kind, tags in (("sync", ["t5", "t6", "t7"]), ("async", ["t5", "t6"])):
            # report.path is the tag folder; the tag's manifest and `latest` were there when it was called.
            expected = [{"path": str(root / kind / t), "manifest": True, "latest": t} for t in tags]
            assert record["saved"][kind] == expected, (rank, kind)
        assert record["last_report"] == {"ours": str(root / "sync" / "t7"), "plain": str(root / "async" / "t6")}


def test_a_file_failing_on_one_rank_fails_the_save_on_every_rank_naming_rank_and_file(run: tuple[int, Path]) -> None:
    _, root = run
    for rank in (0, 1):
        failed = json.loads((root / f"failed-{rank}.json").read_text())
        assert failed is not None and failed["type"] == "CheckpointWriteError", (rank, failed)
        assert "rank 1 failed to write its files" in failed["message"], failed
        assert "No space left on device" in failed["message"] and f"{os.sep}t8{os.sep}" in failed["message"], failed
    assert (root / "sync" / "latest").read_text() == "t7"
    assert not (root / "sync" / "t8" / MANIFEST_NAME).exists()


def test_flat_master_weights_and_moments_are_classified(run: tuple[int, Path]) -> None:
    stage, root = run
    optim = root / "ours" / "t3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with nc.open(optim) as reader:
        components = {t.key: t.component for t in reader.index.tensors}
    flat = "optimizer_state_dict/single_partition_of_fp32_groups/0" if stage == 2 else "optimizer_state_dict/fp32_flat_groups/0"
    state = (
        "optimizer_state_dict/base_optimizer_state/state/0" if stage == 2 else "optimizer_state_dict/optimizer_state_dict/state/0"
    )
    assert components[flat] == "weights"
    assert components[f"{state}/exp_avg"] == "exp_avg"
    assert components[f"{state}/exp_avg_sq"] == "exp_avg_sq"


def test_deepspeed_classes_are_allowed_only_during_the_load(run: tuple[int, Path]) -> None:
    _, root = run
    plain = root / "plain" / "t3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = load_deepspeed_file(plain)
    assert type(state["optimizer_state_dict"]["loss_scaler"]).__name__ == "LossScaler"
    assert_tree_equal(_comparable(state), _comparable(load_deepspeed_file(root / "ours" / "t3" / plain.name)))
    # The process-wide allow-list is not left widened.
    with pytest.raises(pickle.UnpicklingError, match=r"deepspeed\.runtime\."):
        torch.load(plain, weights_only=True)


@pytest.mark.slow
def test_zero0_zero1_bf16_and_moe_resume_with_identical_losses(tmp_path: Path) -> None:
    run_python(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        "matrix",
        "0",
        str(tmp_path),
        cwd=tmp_path,
        **ENV,
    )
    results = json.loads((tmp_path / "matrix.json").read_text())
    assert sorted(results) == ["zero0", "zero0-bf16", "zero0-moe", "zero1-bf16", "zero2-bf16"]
    for name, r in results.items():
        assert r["resumed"] == r["ref"], name
        for f in r["files"]:
            assert f == MANIFEST_NAME or _kind(tmp_path / name / "a" / f) == NVCOMP, (name, f)
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in results["zero2-bf16"]["files"]
    # MoE: one file per expert (each rank writes its own) and one optimizer file per expert-parallel rank.
    assert {
        "layer_0_expert_0_mp_rank_00_model_states.pt",
        "layer_0_expert_1_mp_rank_00_model_states.pt",
        "expp_rank_0_mp_rank_00_optim_states.pt",
        "expp_rank_1_mp_rank_00_optim_states.pt",
    } <= set(results["zero0-moe"]["files"])
    with nc.open(tmp_path / "zero2-bf16" / "a" / "mp_rank_00_model_states.pt") as reader:
        weights = [t for t in reader.index.tensors if t.key.startswith("module/")]
    assert weights and all(t.component == "weights" and t.dtype == torch.bfloat16 for t in weights)


class Smuggled:
    """A class no DeepSpeed checkpoint holds; unpickling it would call ``print``."""

    def __reduce__(self):  # noqa: ANN204
        return (print, ("unpickled",))


def _ds_like(extra: object) -> dict:
    return {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.ones(8)}}, "loss_scaler": extra}, "ds_version": "0.19"}


@pytest.mark.parametrize("fmt", ["plain", "ours"])
@pytest.mark.parametrize("extra", [Smuggled(), Path("/etc")], ids=["reduce-to-print", "pathlib"])
def test_unknown_class_is_refused_naming_it(tmp_path: Path, fmt: str, extra: object, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.parent.mkdir()
    if fmt == "plain":
        torch.save(_ds_like(extra), path)
    else:
        nc.save(_ds_like(extra), path)
        (path.parent / MANIFEST_NAME).write_text(
            json.dumps({"format": "nvcomp-checkpoint deepspeed tag v1", "tag": "t1", "files": {path.name: path.stat().st_size}})
        )
    name = "print" if isinstance(extra, Smuggled) else "PosixPath"
    with pytest.raises(UnsafeCheckpointError, match=name):
        load_deepspeed_file(path)
    assert "unpickled" not in capsys.readouterr().out


def _committed(tmp_path: Path) -> Path:
    tag = tmp_path / "t1"
    tag.mkdir()
    for rank in range(2):
        nc.save(_ds_like(None), tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    files = {p.name: p.stat().st_size for p in tag.iterdir()}
    (tag / MANIFEST_NAME).write_text(json.dumps({"format": "nvcomp-checkpoint deepspeed tag v1", "tag": "t1", "files": files}))
    return tag


def test_tag_missing_a_rank_file_names_it(tmp_path: Path) -> None:
    tag = _committed(tmp_path)
    assert check_tag_complete(str(tag))
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        load_deepspeed_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize(
    "forge",
    [
        lambda m: m["files"].update({"zero_pp_rank_1_mp_rank_00_optim_states.pt": 7}),  # size changed
        lambda m: m["files"].update({"../latest": 2}),  # a path out of the tag
        lambda m: m["files"].update({"/etc/passwd": 2}),
        lambda m: m.update({"files": ["x"]}),
        lambda m: m.update({"format": "something else"}),
    ],
    ids=["size", "dotdot", "absolute", "files-not-a-dict", "format"],
)
def test_forged_manifest_is_refused(tmp_path: Path, forge) -> None:  # noqa: ANN001
    tag = _committed(tmp_path)
    manifest = json.loads((tag / MANIFEST_NAME).read_text())
    forge(manifest)
    (tag / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(FormatError):
        load_deepspeed_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_manifest_that_is_not_json_is_refused(tmp_path: Path) -> None:
    tag = _committed(tmp_path)
    (tag / MANIFEST_NAME).write_bytes(b"\x00{not json")
    with pytest.raises(FormatError, match="unreadable tag manifest"):
        load_deepspeed_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from nvcomp_checkpoint.cli.main import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_cli_on_deepspeed_folders_and_zero_to_fp32_of_decompressed(
    run: tuple[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nvckpt` verify / compress (in place) / inspect / decompress on the run's folders, without --trust;
    DeepSpeed's own zero_to_fp32 reads the decompressed folder's fp32 weights bit for bit."""
    import shutil

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    stage, root = run
    expected = get_fp32_state_dict_from_zero_checkpoint(str(root / "plain"))
    work = tmp_path / "plain"
    shutil.copytree(root / "plain", work)
    assert _cli("verify", str(work), capsys=capsys)[0] == 0
    assert _cli("compress", str(work), "--json", capsys=capsys)[0] == 0
    tag = work / "t3"
    names = sorted(p.name for p in tag.iterdir())
    assert MANIFEST_NAME in names and (work / "latest").read_text() == "t3"
    for name in names:
        if name != MANIFEST_NAME:
            assert _kind(tag / name) == NVCOMP, name
    assert check_tag_complete(str(tag))
    code, out = _cli("verify", str(work), capsys=capsys)
    assert code == 0 and "2 tags" not in out and "OK" in out, out
    code, out = _cli("inspect", str(work), "--json", capsys=capsys)
    rows = json.loads(out)["files"]
    optim = sorted((r["rank"], r["kind"]) for r in rows if r["kind"] == "optim partition")
    assert optim == [(0, "optim partition"), (1, "optim partition")]
    assert all(r["format"] == NVCOMP for r in rows), rows
    # ZeRO-3's model-states files hold no weights (a few hundred bytes): the partitions carry the ratio.
    assert all(r["raw_bytes"] > r["stored_bytes"] for r in rows if r["kind"] == "optim partition"), rows
    # The attach-written folder (t3 complete, t5 killed mid-save) decompressed into a new folder: t5 is skipped.
    code, out = _cli("decompress", str(root / "ours"), str(tmp_path / "d"), "--json", capsys=capsys)
    assert code == 0
    actions = {r["file"].split("/")[0]: r["action"] for r in json.loads(out)["files"]}
    assert actions == {"t3": "decompressed", "t5": "skipped"}
    assert (tmp_path / "d" / "latest").read_text() == "t3"
    assert all(_kind(p) == TORCH for p in (tmp_path / "d" / "t3").iterdir())
    assert_tree_equal(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "d")), expected)
    # DeepSpeed's ds_to_universal reads it too: each parameter's fp32.pt is the plain checkpoint's weight.
    run_python(
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tmp_path / "d" / "t3"),
        "--output_folder",
        str(tmp_path / "universal"),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        cwd=tmp_path,
        **ENV,
    )
    universal = {}
    for name, weight in expected.items():
        saved = torch.load(tmp_path / "universal" / "zero" / name / "fp32.pt", weights_only=True)
        # ZeRO-2's fp32.pt is {"param": tensor, "cat_dim": ...}; ZeRO-3's the flat tensor.
        universal[name] = (saved["param"] if isinstance(saved, dict) else saved).reshape(weight.shape)
    assert_tree_equal(universal, dict(expected))
    # Compressed in place, then decompressed in place: the plain folder's fp32 weights again.
    assert _cli("decompress", str(work), capsys=capsys)[0] == 0
    assert not (tag / MANIFEST_NAME).exists()
    assert_tree_equal(get_fp32_state_dict_from_zero_checkpoint(str(work)), expected)
    # A rank's file missing: verify fails naming it, and compress leaves the tag alone.
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    code, out = _cli("verify", str(work), capsys=capsys)
    assert code == 1 and "ranks [1]" in out, out


def test_leader_load_is_refused_naming_why() -> None:
    from nvcomp_checkpoint.deepspeed import attach

    engine = object()  # refused before the engine is touched
    with pytest.raises(ValueError, match=r"attach\(leader_load=\.\.\.\) with DeepSpeed.*own optimizer partition"):
        attach(engine, leader_load=True)


def test_tiers_and_full_every_are_checked_before_the_engine_is_touched(tmp_path: Path) -> None:
    from nvcomp_checkpoint.deepspeed import attach

    class Engine:
        checkpoint_engine = None

        def save_checkpoint(self, *args: object, **kwargs: object) -> bool:
            return True

    engine = Engine()
    with pytest.raises(TypeError, match=r"attach\(tiers=...\) takes a list"):
        attach(engine, tiers=nc.Tier(tmp_path / "t"))
    with pytest.raises(ValueError, match=r"attach\(incremental=True, full_every=...\)"):
        attach(engine, incremental=True, full_every=0)
    assert engine.checkpoint_engine is None
    with pytest.raises(ValueError, match="no tiers"):
        attach(engine).resume_path()
