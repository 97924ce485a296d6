"""DeepSpeed ZeRO-2 through Accelerate, the HF Trainer and Lightning: compressed files, and resumes in fresh processes.

Per framework, one 2-rank CPU run (tests/deepspeed_frameworks_train.py) saves the same state plain and
through our integration and records the next losses (Accelerate's is then killed with SIGKILL in the
middle of a third save; Lightning's saves with async_save, tiers and incremental and is killed after its
third checkpoint); fresh processes resume from both folders (Lightning's: from the tier) with our integration. Lightning's
DeepSpeedStrategy refuses the CPU: its run lifts that one check (see the script), and
``benchmarks/gpu_deepspeed_check.py`` (a step of ``benchmarks/gpu_check.sh``) runs the unmodified
strategy on a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

import fresh_process
from conftest import assert_tree_equal, run_python

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from nvcomp_checkpoint.deepspeed import MANIFEST_NAME  # noqa: E402
from nvcomp_checkpoint.delta import base_path_of  # noqa: E402
from nvcomp_checkpoint.filetype import NVCOMP, TORCH, kind_of  # noqa: E402
from nvcomp_checkpoint.reader import CheckpointReader  # noqa: E402

SCRIPT = Path(__file__).with_name("deepspeed_frameworks_train.py")
ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1] / "src"), str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
}
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT))


def _kind(path: Path) -> str:
    with open(path, "rb") as f:
        return kind_of(f.read(16), path.stat().st_size)


def _deepspeed_files(tag_dir: Path) -> list[str]:
    return sorted(p.name for p in tag_dir.iterdir() if p.name != MANIFEST_NAME)


def _check_tags(ours: Path, plain: Path) -> None:
    """Our tag folder holds DeepSpeed's files under its names, compressed, and the commit record."""
    names = _deepspeed_files(plain)
    assert names == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert _deepspeed_files(ours) == names
    assert (ours / MANIFEST_NAME).is_file()
    for name in names:
        assert _kind(ours / name) == NVCOMP, name
        assert _kind(plain / name) == TORCH, name
    assert (ours.parent / "latest").read_text() == ours.name


def _resumes(root: Path, framework: str) -> None:
    run_python(*TORCHRUN, framework, "resume", str(root), cwd=root, **ENV)
    ref = json.loads((root / "ref.json").read_text())
    resumed = json.loads((root / "resumed.json").read_text())
    assert len(ref) == 2
    assert resumed == {"ours": ref, "plain": ref}


@pytest.mark.slow
def test_accelerate_save_state_writes_deepspeed_compressed_and_resumes_after_a_kill(tmp_path: Path) -> None:
    # register_nvcomp_hooks(acc, async_save=True, tiers=[...], incremental=True) on ZeRO-2: each folder is
    # committed after DeepSpeed's tag, the second one a delta, both copied to the tier; a fresh node resumes
    # from the tier. leader_load is refused by the one check (in the resume run).
    first = fresh_process.run_ranks(
        (str(SCRIPT), "accelerate", "first", str(tmp_path)),
        2,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore", **ENV),
        timeout=300,
    )
    # The third save is killed by design: the run must end with that SIGKILL, not finish or fail otherwise.
    assert fresh_process.ended_by_signal(first) == signal.SIGKILL, first.stdout[-2000:] + first.stderr[-4000:]
    assert "should have been killed" not in first.stderr
    checkpoints = tmp_path / "project" / "checkpoints"
    ours, ours2 = checkpoints / "checkpoint_1", checkpoints / "checkpoint_2"
    _check_tags(ours / "pytorch_model", tmp_path / "plain" / "pytorch_model")
    _check_tags(ours2 / "pytorch_model", tmp_path / "plain" / "pytorch_model")
    for folder in (ours, ours2):
        manifest = json.loads((folder / "nvcomp_checkpoint.json").read_text())
        assert manifest["deepspeed"] == {"tags": ["pytorch_model"]}
        assert manifest["models"] == [] and manifest["optimizers"] == []
        assert "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt" in manifest["files"]
    # Every file of checkpoint_2's tag is a delta against the same file of checkpoint_1 (each rank's
    # partition too), which total_limit=1 therefore keeps.
    for name in _deepspeed_files(ours2 / "pytorch_model"):
        assert base_path_of(str(ours2 / "pytorch_model" / name), CheckpointReader) == str(ours / "pytorch_model" / name), name
    # The main process's report: the folder, its files together.
    assert json.loads((tmp_path / "report.json").read_text()) == "checkpoint_2"
    # A commit that failed on the main process (a full disk) raised on both, and committed nothing;
    # the killed save (the same number again) committed nothing either.
    failed = [(tmp_path / f"failed_{rank}.txt").read_text() for rank in (0, 1)]
    assert str(checkpoints / "checkpoint_3") in failed[0] and "No space left" in failed[0], failed[0]
    assert "process 0" in failed[1] and "No space left" in failed[1], failed[1]
    # (The killed one may leave its hidden staging folder, which the next save of that number clears.)
    assert sorted(p for p in os.listdir(checkpoints) if not p.startswith(".")) == ["checkpoint_1", "checkpoint_2"]
    # A fresh node: tier 0 is gone; the tier kept its newest copy (a delta) and the copy it needs.
    ours2.rename(tmp_path / "checkpoint_2.gone")
    run_python(*TORCHRUN, "accelerate", "resume", str(tmp_path), cwd=tmp_path, **ENV)
    ref = json.loads((tmp_path / "ref.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert len(ref) == 2
    assert resumed == {"ours": ref, "plain": ref, "from_tier": json.loads((tmp_path / "ref2.json").read_text())}
    # The resumed run's synchronous save (full: the first of its process), numbered after the folder it
    # resumed from, reached the tier, which keeps it alone.
    assert json.loads((tmp_path / "ours3" / "nvcomp_checkpoint.json").read_text())["iteration"] == 3
    assert sorted(p.name for p in (tmp_path / "tier").iterdir() if p.is_dir()) == ["step-0000000003"]


@pytest.mark.slow
def test_hf_trainer_with_deepspeed_saves_async_to_tiers_and_a_fresh_node_resumes_after_a_kill(tmp_path: Path) -> None:
    first = fresh_process.run_ranks(
        (str(SCRIPT), "hf", "first", str(tmp_path)),
        2,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore", **ENV),
        timeout=300,
    )
    # Rank 1 is killed in the last save by design: the run must end with that SIGKILL, not finish or fail otherwise.
    assert fresh_process.ended_by_signal(first) == signal.SIGKILL, first.stdout[-2000:] + first.stderr[-4000:]
    assert "should have been killed" not in first.stderr
    ours, plain = tmp_path / "ours" / "checkpoint-3", tmp_path / "plain" / "checkpoint-3"
    _check_tags(ours / "global_step3", plain / "global_step3")
    # The callback converts nothing of the Trainer's own: the weights stay the export from_pretrained reads.
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in plain.iterdir())
    safetensors_torch = pytest.importorskip("safetensors.torch")
    weights = safetensors_torch.load_file(ours / "model.safetensors")
    assert_tree_equal(weights, safetensors_torch.load_file(plain / "model.safetensors"))  # the same 3 steps
    # checkpoint-3 was recorded once its tag was committed (at a later step: async_save), and copied whole.
    assert json.loads((tmp_path / "reports.json").read_text()) == ["checkpoint-3"]
    from nvcomp_checkpoint.incremental import unit_base_of
    from nvcomp_checkpoint.tiers import open_tier, verify_unit

    # incremental: checkpoint-3 is a delta of checkpoint-1, which NvcompTrainer's rotation kept (save_total_limit=1).
    assert unit_base_of(str(ours)) == str(tmp_path / "ours" / "checkpoint-1")
    shared = open_tier(str(tmp_path / "tier"))
    assert shared.steps() == [1, 3]  # the killed step 5 never reached the tier
    copy = Path(shared.unit_path(3, True))
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == sorted(p.relative_to(ours) for p in ours.rglob("*"))
    # The killed save's tag was written but never committed: no manifest, no `latest`.
    killed = tmp_path / "ours" / "checkpoint-5"
    assert (killed / "global_step5").is_dir() and not (killed / "global_step5" / MANIFEST_NAME).exists()
    assert not (killed / "latest").exists()
    # A fresh node: tier 0 is gone; ours resumes from the tier's copy of step 3 (laid out with its base).
    shutil.rmtree(tmp_path / "ours")
    _resumes(tmp_path, "hf")
    # The resumed run's last save failed on rank 1 (raised on both ranks): never recorded, never copied.
    assert shared.steps() == [1, 3] and verify_unit(shared, shared.manifest(3)) is None
    assert not (tmp_path / "resumed-ours" / "checkpoint-5" / "latest").exists()
    # NvcompTrainer resumed from the plain folder and writes ours from then on, copied whole to its tier.
    written = tmp_path / "resumed-plain" / "checkpoint-5"
    _check_tags(written / "global_step5", plain / "global_step3")
    synced = open_tier(str(tmp_path / "tier-sync"))
    assert synced.steps() == [5]
    copy = Path(synced.unit_path(5, True))
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == sorted(p.relative_to(written) for p in written.rglob("*"))


@pytest.mark.slow
def test_lightning_deepspeed_async_tiers_deltas_resume_on_a_fresh_node_after_a_kill(tmp_path: Path) -> None:
    from nvcomp_checkpoint.incremental import DEFERRED_NAME, unit_base_of

    first = fresh_process.run_ranks(
        (str(SCRIPT), "lightning", "first", str(tmp_path)),
        2,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore", **ENV),
        timeout=300,
    )
    # Both ranks are killed by design once the step-3 checkpoint is committed and on the tier.
    assert fresh_process.ended_by_signal(first) == signal.SIGKILL, first.stdout[-2000:] + first.stderr[-4000:]
    assert "should have been killed" not in first.stderr
    ours, ckpts = tmp_path / "ours", tmp_path / "ckpts"
    _check_tags(ours / "checkpoint", tmp_path / "plain" / "checkpoint")
    # Each rank file is a delta against the same file of the previous checkpoint: ours -> step=2 -> step=1 (full).
    assert unit_base_of(str(ours)) == str(ckpts / "step=2.ckpt")
    assert unit_base_of(str(ckpts / "step=2.ckpt")) == str(ckpts / "step=1.ckpt")
    assert unit_base_of(str(ckpts / "step=1.ckpt")) is None
    # ModelCheckpoint's top-1 removal of step=1 (after step=2's commit, in the background) waits for the delta.
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed == {"ckpts": [DEFERRED_NAME, "step=1.ckpt", "step=2.ckpt"], "reports": str(ours)}
    assert json.loads((ckpts / DEFERRED_NAME).read_text()) == ["step=1.ckpt"]
    assert sorted(p.name for p in (tmp_path / "tier").iterdir() if p.is_dir()) == [
        "step-0000000001",
        "step-0000000002",
        "step-0000000003",
    ]
    shutil.rmtree(ours)  # a fresh node: tier 0 is gone, the tier holds the chain
    shutil.rmtree(ckpts)
    _resumes(tmp_path, "lightning")
    # The newest copy (step 3), laid out with its chain where its rank files look for their bases.
    newest = tmp_path / json.loads((tmp_path / "newest.json").read_text())
    assert newest.name == "step-0000000003" and newest.parent.parent.name == "restore-0", newest
    for base in ("step=1.ckpt", "step=2.ckpt"):
        _check_tags(newest.parent / "ckpts" / base / "checkpoint", tmp_path / "plain" / "checkpoint")
    # A synchronous save without a plugin (the strategy's own session), after the resume from the plain folder.
    _check_tags(tmp_path / "resumed-plain" / "checkpoint", tmp_path / "plain" / "checkpoint")
    # Rank 1 could not write its file of the step-5 save: both ranks raised, neither committed the tag.
    failed = tmp_path / "failed"
    errors = {p.name: p.read_text() for p in failed.glob("rank*.txt")}
    assert sorted(errors) == ["rank0.txt", "rank1.txt"], errors
    for error in errors.values():  # each rank names rank 1 and its file
        assert "rank 1 failed" in error and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in error, errors
        assert "not committed" in error, errors
    assert not (failed / "latest").exists() and not (failed / "checkpoint" / MANIFEST_NAME).exists()


# -- what needs no ranks ---------------------------------------------------------------------------
def test_lightning_stock_deepspeed_strategy_with_the_plugin_is_refused_and_ours_takes_its_policy() -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from nvcomp_checkpoint import CodecPolicy, Tier
    from nvcomp_checkpoint.errors import CheckpointError
    from nvcomp_checkpoint.integrations.lightning_deepspeed import check_deepspeed_checkpoint_io
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO, NvcompDeepSpeedStrategy

    stock = DeepSpeedStrategy(stage=2)
    check_deepspeed_checkpoint_io(stock)  # no plugin: nothing to refuse
    stock.checkpoint_io = NvcompCheckpointIO()
    with pytest.raises(CheckpointError, match="NvcompDeepSpeedStrategy"):
        check_deepspeed_checkpoint_io(stock)
    policy = CodecPolicy(min_compress_bytes=4096)
    ours = NvcompDeepSpeedStrategy(stage=2)
    ours.checkpoint_io = NvcompCheckpointIO(policy)
    check_deepspeed_checkpoint_io(ours)
    assert ours.policy == policy
    assert NvcompDeepSpeedStrategy(stage=2, policy={"min_compress_bytes": 1024}).policy == CodecPolicy(min_compress_bytes=1024)
    ours.checkpoint_io = NvcompCheckpointIO(leader_load=True)
    with pytest.raises(CheckpointError, match=r"leader_load=\.\.\..*own optimizer partition"):
        check_deepspeed_checkpoint_io(ours)
    # What the strategy's session honours (the run above): nothing refused.
    ours.checkpoint_io = NvcompCheckpointIO(async_save=True, tiers=[Tier("/nonexistent-tier")], incremental=True)
    check_deepspeed_checkpoint_io(ours)


def test_lightning_deepspeed_strategy_on_the_cpu_is_refused_by_lightning_before_any_step(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from nvcomp_checkpoint.lightning import NvcompDeepSpeedStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, x: torch.Tensor, i: int) -> torch.Tensor:
            raise AssertionError("no step may run")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=NvcompDeepSpeedStrategy(stage=2), logger=False, default_root_dir=tmp_path
    )
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.zeros(4, 2)))
