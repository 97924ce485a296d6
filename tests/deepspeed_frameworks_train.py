"""2-rank DeepSpeed ZeRO-2 runs on the CPU (gloo) through Accelerate, the HF Trainer and Lightning, for
tests/test_deepspeed_frameworks.py.

``python -m torch.distributed.run --nproc_per_node 2 tests/deepspeed_frameworks_train.py FRAMEWORK MODE ROOT``
with FRAMEWORK ``accelerate``, ``hf`` or ``lightning`` and MODE:

* ``first``: train 3 steps and save the same state twice, plain (the framework's stock DeepSpeed save,
  ``ROOT/plain``) and compressed (our integration, ``ROOT/ours``); train 2 more steps (their losses:
  ``ROOT/ref.json``). Accelerate then starts a third save, during which rank 1 is killed with SIGKILL;
  Lightning saves with ``async_save``, ``tiers`` and ``incremental`` and is killed after step 3 (see
  :func:`lightning_run`).
* ``resume``: fresh processes resume with our integration from ``ROOT/ours`` and from ``ROOT/plain`` and
  train the same 2 steps (losses: ``ROOT/resumed.json``, with ``{"ours": [...], "plain": [...]}``).

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA in ``setup_environment``; here that one
check is lifted (``_OnCPU``) so that everything else runs as on a GPU: the strategy, DeepSpeed's engine,
Lightning's save and restore. With ``NVCKPT_DS_GPU=1`` (``benchmarks/gpu_deepspeed_check.py``, one
process) the unmodified strategies run on CUDA device 0 instead.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError  # noqa: E402

DIM, BATCH, STEPS = 16, 2, 3
ZERO = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}


def batch(rank: int, step: int) -> torch.Tensor:
    """The batch of a rank at a step: a resumed run sees what the uninterrupted one saw."""
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1000 * rank + step))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.b(torch.relu(self.a(x)))
        return {"loss": (out - x.flip(-1)).pow(2).mean(), "logits": out}


GPU = os.environ.get("NVCKPT_DS_GPU") == "1"
#: Accelerate's first two saves with the hooks (automatic naming), relative to ROOT.
OURS, OURS2 = "project/checkpoints/checkpoint_1", "project/checkpoints/checkpoint_2"


def write_json(root: str, name: str, obj: object) -> None:
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, name), "w") as f:
            json.dump(obj, f)
    torch.distributed.barrier()


# -- Accelerate ------------------------------------------------------------------------------------
def accelerate_run(mode: str, root: str) -> None:
    """``first``: after the plain save, the hooks save ``OURS`` (step 3) and ``OURS2`` (step 5, a delta
    against ``OURS``; ``total_limit=1`` keeps both) in the background, copied to the tier ``ROOT/tier``;
    ``ref2.json``: steps 6-7; then a commit fails (a full disk), and a save is killed.
    ``resume``: besides ``OURS`` and ``plain``, resumes from the tier's newest copy (laid out with its
    chain in ``ROOT/restore``: tier 0 is gone on a fresh node), records steps 6-7 (``from_tier``), and
    saves ``ours3`` synchronously (copied to the tier as the hooks are removed)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
    from nvcomp_checkpoint.errors import UnsupportedOptionError

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)
    plugin.deepspeed_config.update(ZERO, train_micro_batch_size_per_gpu=BATCH, train_batch_size=2 * BATCH)
    # Without a backend named, Accelerate on a machine without GPUs counts one process (and each rank
    # would save as the main one); DeepSpeed's ranks still run over gloo.
    acc = Accelerator(
        deepspeed_plugin=plugin,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        project_dir=os.path.join(root, "project"),
    )
    assert acc.num_processes == 2, acc.num_processes
    ours, ours2 = (os.path.join(root, OURS), os.path.join(root, OURS2))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The tier keeps its newest copy only, and with it the folder that copy is a delta against.
    options = {"async_save": True, "tiers": [nc.Tier(os.path.join(root, "tier"), keep=1)], "incremental": True}
    if mode == "resume":
        try:  # refused by the one check (entrypoint.support) before anything is wrapped
            register_nvcomp_hooks(acc, leader_load=True)
            raise AssertionError("leader_load with DeepSpeed should be refused")
        except UnsupportedOptionError as exc:
            assert "leader_load" in str(exc) and "Accelerate + DeepSpeed" in str(exc), exc  # noqa: PT017
            assert "prepare" not in vars(acc), exc  # noqa: PT017
        # Before prepare: attached to the engine prepare creates. Synchronous here (the first run's are async).
        hooks = register_nvcomp_hooks(acc, **{**options, "async_save": False})
    model, optimizer = acc.prepare(model, optimizer)

    def train(steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            loss = model(batch(acc.process_index, model.global_steps))["loss"]
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    if mode == "first":
        train(STEPS)
        acc.save_state(os.path.join(root, "plain"))  # stock: no hooks yet
        config = acc.project_configuration
        config.automatic_checkpoint_naming, config.total_limit = True, 1  # checkpoints/checkpoint_<n>, rotated
        hooks = register_nvcomp_hooks(acc, **options)  # after prepare: attached at once
        assert str(acc.save_state()) == ours  # returns once each rank's partition is copied
        # Not visible before DeepSpeed's commit of the tag (at the next optimizer step) and the folder's.
        assert not os.path.exists(ours) and hooks.pending() == acc.is_main_process
        write_json(root, "ref.json", train(2))  # the tag is committed at a step, the folder behind it
        assert str(acc.save_state()) == ours2  # a delta against ours: waits for it first
        assert os.path.isdir(ours)
        write_json(root, "ref2.json", train(2))
        hooks.wait()  # every process: commits ours2's tag, then the folder and its copy to the tier
        report = hooks.last_report
        write_json(root, "report.json", os.path.basename(report.path) if acc.is_main_process and report is not None else None)
        # The main process's disk fills up as it commits the next folder, in the background: hooks.wait()
        # raises on every process, the folder is not committed, and the next save reuses its number.
        from nvcomp_checkpoint.storage import LOCAL

        fsync = LOCAL.fsync
        if acc.is_main_process:

            def full(path: str) -> None:
                if path.endswith("random_states_0.pkl"):  # one of Accelerate's files, fsynced by the commit
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                fsync(path)

            LOCAL.fsync = full  # type: ignore[method-assign]
        iteration = acc.save_iteration
        acc.save_state()
        try:
            hooks.wait()
            raise AssertionError("the commit of 'full' should have failed")
        except CheckpointError as exc:
            with open(os.path.join(root, f"failed_{acc.process_index}.txt"), "w") as f:
                f.write(str(exc))
        LOCAL.fsync = fsync  # type: ignore[method-assign]
        assert acc.save_iteration == iteration, (acc.save_iteration, iteration)
        if acc.process_index == 1:

            def kill(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                os.kill(os.getpid(), signal.SIGKILL)

            model.checkpoint_engine.save = kill  # as rank 1 writes its partition of the next save
        acc.save_state()  # the same number again
        hooks.wait()
        raise AssertionError("the save of 'killed' should have been killed")
    resumed = {}
    for key, name in (("ours", OURS), ("plain", "plain")):
        acc.load_state(os.path.join(root, name))
        assert model.global_steps == STEPS, model.global_steps
        resumed[key] = train(2)
    # A fresh node: the newest copy on the tier, laid out with the folder it is a delta against.
    path = hooks.resume_path(os.path.join(root, "restore"))
    assert path is not None and path.startswith(os.path.join(root, "restore")), path
    acc.load_state(path)
    assert model.global_steps == STEPS + 2, model.global_steps
    resumed["from_tier"] = train(2)
    write_json(root, "resumed.json", resumed)
    acc.save_state(os.path.join(root, "ours3"))  # synchronous: committed when it returns, on every process
    assert os.path.isfile(os.path.join(root, "ours3", "nvcomp_checkpoint.json"))
    hooks.remove()
    assert "prepare" not in vars(acc)  # Accelerator.prepare is the class's again


# -- the HF Trainer --------------------------------------------------------------------------------
class Batches(torch.utils.data.Dataset):
    """Sample i of the run; the Trainer's sampler and its skipping on resume decide which rank sees it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(DIM, generator=torch.Generator().manual_seed(i))}


def hf_run(mode: str, root: str) -> None:
    """``first``: stock, then ours (NvcompTrainer) with ``async_save``, ``tiers`` (``ROOT/tier``) and
    ``incremental``, saving at steps 1 and 3 with ``save_total_limit=1``; rank 1 is killed with SIGKILL in
    the last save, before the engine commits its tag. ``resume``: ours from the tier's newest
    copy (the test removed ``ROOT/ours``: a fresh node), whose last save fails on rank 1 and raises on
    both ranks; NvcompTrainer from the stock folder."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nvcomp_checkpoint.transformers import NvcompTrainer, NvcompTrainerCallback

    tier = [nc.Tier(os.path.join(root, "tier"), name="shared")]
    sync_tier = [nc.Tier(os.path.join(root, "tier-sync"), name="shared")]
    rank = torch.distributed.get_rank()

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    class KilledInTheLastSave(TrainerCallback):
        """Before our callback's on_save of the last step: the tag of that step is written (in the
        background), not committed. Rank 0 records what the test checks; rank 1 dies."""

        def __init__(self, losses: Losses, ours: NvcompTrainerCallback) -> None:
            self.losses, self.ours = losses, ours

        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step != STEPS + 2:
                return
            if rank == 0:
                assert self.ours.tiers is not None
                self.ours.tiers.wait()  # the copy of checkpoint-3, committed at a step since
                with open(os.path.join(root, "ref.json"), "w") as f:
                    json.dump(self.losses.losses[STEPS:], f)
                report = self.ours.last_report
                with open(os.path.join(root, "reports.json"), "w") as f:
                    json.dump([os.path.basename(report.path) if report else None], f)
            torch.distributed.barrier()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    class FailsOnRank1(TrainerCallback):
        """Rank 1's partition file of the last save cannot be written (a folder holds its name): the
        background write fails on rank 1 alone, and the commit must raise on both ranks."""

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step == STEPS + 2 and rank == 1:
                tag = os.path.join(args.output_dir, f"checkpoint-{STEPS + 2}", f"global_step{STEPS + 2}")
                os.makedirs(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))

    class AlsoSavesAtStep1(TrainerCallback):
        """A save at step 1 too: checkpoint-3 is then a delta of checkpoint-1 (``incremental``)."""

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step == 1:
                control.should_save = True

    def trainer(kind: str, out: str, max_steps: int, limit: int | None = None, **nvcomp: object) -> tuple[Trainer, Losses]:
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=os.path.join(root, out),
            per_device_train_batch_size=BATCH,
            max_steps=max_steps,
            save_steps=STEPS,
            save_total_limit=limit,
            logging_steps=1,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            deepspeed={**ZERO, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
            report_to=[],
            disable_tqdm=True,
        )
        losses = Losses()
        callbacks: list[TrainerCallback] = [losses]
        if kind != "stock":
            ours = NvcompTrainerCallback(**nvcomp)  # type: ignore[arg-type]
            callbacks += {
                "killed": [AlsoSavesAtStep1(), KilledInTheLastSave(losses, ours), ours],
                "fails": [FailsOnRank1(), ours],
            }.get(kind, [ours])
        cls = NvcompTrainer if kind in ("nvcomp-trainer", "killed") else Trainer
        return cls(model=Net(), args=args, train_dataset=Batches(), callbacks=callbacks), losses

    if mode == "first":
        plain, _ = trainer("stock", "plain", STEPS)
        plain.train()
        # NvcompTrainer rotates (save_total_limit=1) keeping checkpoint-1, the base of checkpoint-3's deltas.
        ours, _ = trainer("killed", "ours", STEPS + 2, 1, async_save=True, tiers=tier, incremental=True)
        ours.train()
        raise AssertionError("rank 1 should have been killed in the last save")
    try:  # refused when the Trainer is built, before any step
        trainer("refused", "refused", STEPS, leader_load=True)
        raise AssertionError("leader_load with DeepSpeed should be refused")
    except CheckpointError as exc:
        assert "leader_load" in str(exc), exc  # noqa: PT017
    try:  # a stock Trainer rotating deletes folders deltas need
        trainer("refused", "refused", STEPS, 1, incremental=True)
        raise AssertionError("incremental with a stock Trainer's save_total_limit should be refused")
    except CheckpointError as exc:
        assert "incremental" in str(exc) and "NvcompTrainer" in str(exc), exc  # noqa: PT017
    resumed = {}
    # A fresh node: the newest copy on the tier that checks (step 3; the killed step 5 never reached it).
    path = NvcompTrainerCallback(tiers=tier).resume_path()
    assert path is not None, "no copy of checkpoint-3 on the tier"
    for name, kind, start, nvcomp in (
        ("ours", "fails", path, {"async_save": True, "tiers": tier}),
        # Without async_save the engine commits inside the Trainer's save: the folder is copied at on_save.
        ("plain", "nvcomp-trainer", os.path.join(root, "plain", f"checkpoint-{STEPS}"), {"tiers": sync_tier}),
    ):
        t, losses = trainer(kind, f"resumed-{name}", STEPS + 2, **nvcomp)
        try:
            t.train(resume_from_checkpoint=start)
            assert kind != "fails", "the failed commit of the last save should have raised"
        except CheckpointWriteError as exc:
            # On both ranks, though only rank 1's file failed; the losses before that save are logged.
            assert kind == "fails" and f"global_step{STEPS + 2}" in str(exc), exc  # noqa: PT017
        resumed[name] = losses.losses
    write_json(root, "resumed.json", resumed)


# -- Lightning -------------------------------------------------------------------------------------
def lightning_run(mode: str, root: str) -> None:
    """``first``: the stock strategy trains 5 steps and saves ``plain`` at step 3 (the reference losses: its
    steps 3 and 4). Ours trains with ``NvcompCheckpointIO(async_save=True, tiers=..., incremental=True)``:
    ``ModelCheckpoint`` (top 1) saves ``ckpts/step=1``, ``step=2`` (a delta; removing ``step=1`` waits for
    it), then ``ours`` at step 3 (a delta of ``step=2``); every folder goes to the tier ``tier``; once
    ``plugin.wait()`` committed the last one on both ranks, both ranks are killed (SIGKILL).
    ``resume``: fresh processes resume from the tier's newest copy (laid out with its chain; its save at
    step 5, ``failed``, fails on rank 1 and so on both) and from ``plain`` (saving ``resumed-plain`` at step
    4, synchronously, without a plugin), and train steps 3 and 4."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    from nvcomp_checkpoint.lightning import NvcompCheckpointIO, NvcompDeepSpeedStrategy

    class _OnCPU:
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # everything DeepSpeedStrategy does but its CUDA check

    class Stock(_OnCPU, DeepSpeedStrategy):
        pass

    class Ours(_OnCPU, NvcompDeepSpeedStrategy):
        pass

    if GPU:  # Lightning's own strategies, unmodified, on one CUDA device
        Stock, Ours = DeepSpeedStrategy, NvcompDeepSpeedStrategy  # type: ignore[misc]
    world = 1 if GPU else 2
    tier = nc.Tier(os.path.join(root, "tier"))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.losses: list[float] = []

        def training_step(self, x: torch.Tensor, i: int) -> torch.Tensor:
            loss = self.net(batch(self.global_rank, self.trainer.global_step).to(self.device))["loss"]
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.zeros(64, DIM), batch_size=BATCH)

    class SaveAt(pl.Callback):
        def __init__(self, path: str, step: int = STEPS) -> None:
            self.path, self.step = path, step

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)

    class Before(ModelCheckpoint):
        """ModelCheckpoint's saves and top-k removals before step 3 (where SaveAt saves)."""

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object, **kwargs: object) -> None:
            if trainer.global_step < STEPS:
                super().on_train_batch_end(trainer, *args, **kwargs)

    class Killed(pl.Callback):
        def __init__(self, plugin: NvcompCheckpointIO) -> None:
            self.plugin = plugin

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == STEPS and not GPU:
                self.plugin.wait()  # every rank: the tag in flight committed, then the copies to the tier done
                # Rank 0 alone copies to the tier: no rank is killed (which ends the others) before its wait is over.
                torch.distributed.barrier()
                ckpts = os.path.join(root, "ckpts")
                write_json(root, "killed.json", {"ckpts": sorted(os.listdir(ckpts)), "reports": self.plugin.last_report.path})
                os.kill(os.getpid(), signal.SIGKILL)

    def fit(
        cls: type,
        max_steps: int,
        ckpt_path: str | None = None,
        callbacks: tuple[pl.Callback, ...] = (),
        failing: str | None = None,
        **kw: object,
    ) -> Module:
        torch.manual_seed(0)
        devices = (
            {"process_group_backend": "nccl"}
            if GPU
            else {
                "process_group_backend": "gloo",
                "parallel_devices": [torch.device("cpu", i) for i in range(2)],
            }
        )
        strategy = cls(config={**ZERO, "train_micro_batch_size_per_gpu": BATCH}, **devices)
        trainer = pl.Trainer(
            accelerator="gpu" if GPU else "cpu",
            devices=world,
            strategy=strategy,
            max_steps=max_steps,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            default_root_dir=root,
            callbacks=list(callbacks),
            **kw,
        )
        module = Module()
        try:
            trainer.fit(module, ckpt_path=ckpt_path)
        except CheckpointWriteError as exc:
            if failing is None:
                raise
            with open(os.path.join(failing, f"rank{trainer.global_rank}.txt"), "w") as f:
                f.write(str(exc))
        else:
            assert failing is None or GPU, "the last save should have failed on every rank"
        return module

    if mode == "first":
        module = fit(Stock, STEPS + 2, callbacks=(SaveAt(os.path.join(root, "plain")),), enable_checkpointing=False)
        write_json(root, "ref.json", module.losses[STEPS:])
        plugin = NvcompCheckpointIO(async_save=True, tiers=[tier], incremental=True)
        top1 = Before(dirpath=os.path.join(root, "ckpts"), filename="{step}", every_n_train_steps=1, save_top_k=1)
        fit(Ours, STEPS + 2, callbacks=(SaveAt(os.path.join(root, "ours")), Killed(plugin), top1), plugins=[plugin])
        if not GPU:
            raise AssertionError("the run should have been killed after its step-3 checkpoint")
        return
    # A fresh node: the tier's newest copy, laid out with its chain; each rank of the node in its own folder.
    rank = int(os.environ.get("RANK", "0"))
    newest = NvcompCheckpointIO(tiers=[tier]).resume_path(os.path.join(root, f"restore-{rank}"))
    assert newest is not None
    if rank == 0:  # before fit: no process group yet
        with open(os.path.join(root, "newest.json"), "w") as f:
            json.dump(os.path.relpath(newest, root), f)
    # The resume from the tier saves at its last step (async) where rank 1 cannot write its partition file
    # (a folder is in the way): the commit at the end of fit fails on both ranks, each saying so.
    failed, blocked = os.path.join(root, "failed"), "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt/in-the-way"
    os.makedirs(os.path.join(failed, blocked), exist_ok=True)
    module = fit(
        Ours,
        STEPS + 2,
        newest,
        callbacks=(SaveAt(failed, STEPS + 2),),
        failing=failed,
        plugins=[NvcompCheckpointIO(async_save=True)],
        enable_checkpointing=False,
    )
    resumed = {"ours": module.losses}
    # The resume from the plain folder saves once more, synchronously and without a plugin (the strategy's own session).
    again = (SaveAt(os.path.join(root, "resumed-plain"), STEPS + 1),)
    resumed["plain"] = fit(Ours, STEPS + 2, os.path.join(root, "plain"), callbacks=again, enable_checkpointing=False).losses
    write_json(root, "resumed.json", resumed)


def main() -> None:
    framework, mode, root = sys.argv[1:4]
    # The CPU accelerator JIT-builds a shared-memory allreduce (minutes of C++ on a cold cache).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.set_num_threads(1)
    if framework != "lightning":  # Lightning's strategy initialises the process group itself
        deepspeed.init_distributed(dist_backend="gloo")
    {"accelerate": accelerate_run, "hf": hf_run, "lightning": lightning_run}[framework](mode, root)


if __name__ == "__main__":
    main()
