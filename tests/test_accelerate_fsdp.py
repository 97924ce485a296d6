"""Accelerate FSDP2 state through ``register_nvcomp_hooks``: sharded (NvcompWriter) and full (.nvc).

Real ``Accelerator.save_state`` / ``load_state`` on 2 spawned ranks (gloo, CPU), a model that
``accelerator.prepare`` wraps with FSDP2 ``fully_shard``. Accelerate picks FSDP only with an
accelerator device (``AcceleratorState``: MULTI_GPU and the like, never MULTI_CPU), so each rank
sets ``distributed_type`` to FSDP itself, before and again after ``prepare`` (which puts MULTI_CPU
back); everything else is Accelerate's own code. FSDP1 does not run on the CPU ("Inconsistent
compute device"); it and the CUDA runs are in ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import assert_tree_equal
from fresh_process import spawn_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SAVE_STEPS, NEXT_STEPS = 2, 3


# -- run in each rank ------------------------------------------------------------------------------
def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 2)
    )


KINDS = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


def _prepared(seed: int) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    acc = Accelerator(cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    _use(acc, KINDS[0])
    model = _model(seed)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    acc.state.distributed_type = DistributedType.FSDP
    return acc, model, opt


def _use(acc: Any, kind: str) -> None:
    # One plugin per state dict type, as a run configured with it would have (FSDP2 reads only
    # the type and its configs at save and load time).
    from accelerate.utils import FullyShardedDataParallelPlugin

    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)


def _train(acc: Any, model: Any, opt: Any, steps: int, first: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + acc.process_index)
        loss = model(torch.randn(16, 24, generator=g)).square().mean()
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        losses.append(float(loss))
    return losses


def _full_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, {"model": msd, "optim": osd})


class _Held:
    """A stream wrapper whose writes wait until ``release`` is set (60 s at most, then they fail)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, stream: Any) -> Any:
        release = self.release

        class Held:
            def write(self, data: Any) -> int:
                if not release.wait(60):
                    raise OSError("the writes were held for 60 s: the save did not return before them")
                written: int = stream.write(data)
                return written

            def __getattr__(self, name: str) -> Any:
                return getattr(stream, name)

        return Held()


def _tier_save(acc: Any, root: str, name: str, held: _Held | None = None) -> Any:
    """A sharded save_state with a copy to a local folder tier (made by rank 0, once committed);
    returns the hooks, whose remove() waits for the save and the copy. ``held``: async_save, its
    writes held until released."""
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    _use(acc, "SHARDED_STATE_DICT")
    hooks = register_nvcomp_hooks(
        acc, tiers=[nc.Tier(os.path.join(root, "tier"))], async_save=held is not None, stream_wrapper=held
    )
    acc.save_state(os.path.join(root, "local", name))
    return hooks


def _save_on_each_node_of_two_nodes(acc: Any, root: str) -> str | None:
    """save_on_each_node, as if each rank were a node of its own: refused on every rank, naming the setting."""
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    _use(acc, "SHARDED_STATE_DICT")
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    acc.project_configuration.save_on_each_node = True
    hooks = register_nvcomp_hooks(acc)
    try:
        acc.save_state(os.path.join(root, "each_node"))
        return None
    except nc.CheckpointError as exc:
        return str(exc)
    finally:
        hooks.remove()
        acc.project_configuration.save_on_each_node = False
        os.environ["LOCAL_WORLD_SIZE"] = before or ""


def _failed_on_one_rank(acc: Any, root: str) -> str:
    """An async sharded save whose rank-1 file cannot be written: nothing is committed, and every rank
    (the committing one through its save, the other through its own background write) raises it."""
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    def broken(stream: Any) -> Any:
        if acc.process_index != 1:
            return stream

        class Full:
            def write(self, data: Any) -> int:
                raise OSError("disk full on rank 1 (test)")

            def __getattr__(self, name: str) -> Any:
                return getattr(stream, name)

        return Full()

    _use(acc, "SHARDED_STATE_DICT")
    hooks = register_nvcomp_hooks(acc, async_save=True, stream_wrapper=broken)
    acc.save_state(os.path.join(root, "failed"))
    try:
        hooks.wait()
        return "not raised"
    except nc.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        hooks.remove()


def _save_without_report(acc: Any, root: str) -> list[str]:
    """A sharded save whose report cannot be built (a rank file unreadable right after DCP's commit):
    it still commits on every rank, and the committing process warns; returns this rank's warnings."""
    import logging

    import nvcomp_checkpoint.dcp
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    def unreadable(path: str, **kwargs: Any) -> Any:
        raise OSError(f"{path}: unreadable (test)")

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nvcomp_checkpoint").addHandler(handler)
    kept, nvcomp_checkpoint.dcp.dcp_report = nvcomp_checkpoint.dcp.dcp_report, unreadable
    _use(acc, "SHARDED_STATE_DICT")
    hooks = register_nvcomp_hooks(acc)
    try:
        acc.save_state(os.path.join(root, "unreported"))
    finally:
        hooks.remove()
        nvcomp_checkpoint.dcp.dcp_report = kept
        logging.getLogger("nvcomp_checkpoint").removeHandler(handler)
    return [w for w in warned if "report could not be built" in w]


def _save_run(rank: int, root: str) -> None:
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    acc, model, opt = _prepared(seed=0)
    _train(acc, model, opt, SAVE_STEPS - 1, first=0)
    _tier_save(acc, root, "first").remove()  # an older copy, which the resume must pass over
    _train(acc, model, opt, 1, first=SAVE_STEPS - 1)
    reports = {}
    for kind in KINDS:
        _use(acc, kind)
        out = os.path.join(root, kind)
        hooks = register_nvcomp_hooks(acc)
        acc.save_state(os.path.join(out, "ours"))
        # The process that commits reports the save: every rank's files; the others have none.
        reports[kind] = (hooks.last_report, hooks.last_reports)
        # A folder that also holds your own files is updated in place, twice: the first save's
        # rank files must not stay behind.
        if rank == 0:
            os.makedirs(os.path.join(out, "shared"))
            Path(out, "shared", "notes.txt").write_text("mine")
        acc.wait_for_everyone()
        acc.save_state(os.path.join(out, "shared"))
        acc.save_state(os.path.join(out, "shared"))
        hooks.remove()
        acc.save_state(os.path.join(out, "plain"))  # Accelerate's own FSDP files, for the hooks to load
    refused = _save_on_each_node_of_two_nodes(acc, root)
    unreported = _save_without_report(acc, root)
    failed = _failed_on_one_rank(acc, root)
    # Saved in the background (async_save): every rank's shards are copied, then training goes on (its
    # collectives beside the save's own) while the rank files are written; the resume from the tier
    # gets the state of the save, bit for bit.
    held = _Held()
    hooks = _tier_save(acc, root, "second", held)
    state = _full_state(model, opt)
    losses = _train(acc, model, opt, NEXT_STEPS, first=SAVE_STEPS)
    held.release.set()  # no rank file was written before: save_state returned with every write held
    hooks.remove()  # waits for the commit (on every rank) and the copy
    in_background = None if hooks.last_report is None else hooks.last_report.to_dict()
    torch.save(
        {
            "state": state,
            "losses": losses,
            "reports": reports,
            "iteration": acc.save_iteration,
            "refused": refused,
            "unreported": unreported,
            "in_background": in_background,
            "failed": failed,
        },
        os.path.join(root, f"saved_{rank}.pt"),
    )
    # The HF Trainer in the same processes (last: it sets up Accelerate's shared state its own way).
    _trainer_fit(root, "reference", max_steps=TRAINER_STEPS[1])  # uninterrupted, nothing saved
    _trainer_fit(root, "saved", max_steps=TRAINER_STEPS[0], save=True)


def _resume_run(rank: int, root: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    out: dict[str, Any] = {}
    acc, model, opt = _prepared(seed=1)  # other weights than the saved ones
    for kind in KINDS:
        _use(acc, kind)
        for name in ("ours", "plain"):
            hooks = register_nvcomp_hooks(acc)
            acc.load_state(os.path.join(root, kind, name))
            hooks.remove()
            state = _full_state(model, opt)
            out[f"{kind}/{name}"] = {"state": state, "losses": _train(acc, model, opt, NEXT_STEPS, first=SAVE_STEPS)}
    # A fresh node: the local folders are gone; every rank resumes from the newest copy on the tier.
    import nvcomp_checkpoint as nc

    _use(acc, "SHARDED_STATE_DICT")
    hooks = register_nvcomp_hooks(acc, tiers=[nc.Tier(os.path.join(root, "tier"))])
    path = hooks.resume_path()
    acc.load_state(path)
    hooks.remove()
    out["tier"] = {"path": path, "iteration": acc.save_iteration, "state": _full_state(model, opt)}
    out["tier"]["losses"] = _train(acc, model, opt, NEXT_STEPS, first=SAVE_STEPS)
    # A stock Accelerator cannot read our shards, and says which reader can.
    try:
        acc.load_state(os.path.join(root, "SHARDED_STATE_DICT", "ours"))
        out["stock"] = "loaded"
    except CheckpointException as exc:  # DCP's (a BaseException) holds each rank's error
        out["stock"] = repr(exc)
    torch.save(out, os.path.join(root, f"resumed_{rank}.pt"))
    _trainer_fit(root, "resumed", max_steps=TRAINER_STEPS[1], resume=True)


# -- the HF Trainer with FSDP2 (NvcompTrainer, the callback with a tier) ----------------------------
TRAINER_STEPS = (4, 6)  # saved at steps 2 and 4, copied to the tier; then resumed from the copy of 4


def _trainer_fit(root: str, name: str, max_steps: int, save: bool = False, resume: bool = False) -> dict[str, Any]:
    """NvcompTrainer on a GPT-2 without tied weights, FSDP2 set by hand as for the Accelerator above
    (the Trainer enables FSDP only with an accelerator device); writes ``trainer_<name>_<rank>.json``."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.transformers import NvcompTrainer, NvcompTrainerCallback

    class CpuFsdpTrainer(NvcompTrainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
            )
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True

    class FsdpAgain(TrainerCallback):  # accelerator.prepare puts MULTI_CPU back
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            trainer.accelerator.state.distributed_type = DistributedType.FSDP

    torch.manual_seed(0 if not resume else 1)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    )  # tied lm_head/wte: two names, one tensor
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(3))
    args = TrainingArguments(
        output_dir=os.path.join(root, "trainer"),
        max_steps=max_steps,
        save_steps=2,
        save_strategy="steps" if save or resume else "no",
        per_device_train_batch_size=4,
        logging_steps=1,
        lr_scheduler_type="constant",
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        use_cpu=True,
    )
    callback = NvcompTrainerCallback(tiers=[nc.Tier(os.path.join(root, "trainer_tier"))])
    trainer = CpuFsdpTrainer(
        model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens], callbacks=[callback, FsdpAgain()]
    )
    resume_from = callback.resume_path() if resume else None  # every rank: the newest copy on the tier
    trainer.train(resume_from_checkpoint=resume_from)
    report = callback.last_report
    out = {
        "losses": [[h["step"], h["loss"]] for h in trainer.state.log_history if "loss" in h],
        "resumed_from": resume_from,
        "report": None if report is None else report.to_dict(),
        "wrapped": type(trainer.model_wrapped).__name__,
    }
    Path(root, f"trainer_{name}_{trainer.args.process_index}.json").write_text(json.dumps(out))
    return out


def _rank_main(rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    fn(rank, *args)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn(fn: Any, *args: Any) -> None:
    spawn_ranks(_rank_main, 2, fn, args)


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp2_save_state_resumes_bit_identical(tmp_path: Path) -> None:
    _spawn(_save_run, str(tmp_path))
    reports = [torch.load(tmp_path / f"saved_{rank}.pt", weights_only=False)["reports"] for rank in range(2)]
    for rank in range(2):
        refused = torch.load(tmp_path / f"saved_{rank}.pt", weights_only=False)["refused"]
        assert refused is not None and "save_on_each_node=True with FSDP SHARDED_STATE_DICT on 2 nodes" in refused, refused
        assert "Set ProjectConfiguration(save_on_each_node=...) to False" in refused, refused
    assert not (tmp_path / "each_node").exists()
    # The async save's report (the committing process's): blocked for the copy only, durable later.
    in_background = [torch.load(tmp_path / f"saved_{rank}.pt", weights_only=False)["in_background"] for rank in range(2)]
    assert in_background[1] is None and in_background[0]["seconds_blocked"] < in_background[0]["seconds"], in_background
    # A write that failed on rank 1 only, in the background: raised on both ranks, nothing committed.
    for rank in range(2):
        failed = torch.load(tmp_path / f"saved_{rank}.pt", weights_only=False)["failed"]
        assert failed.startswith("CheckpointWriteError") and "rank 1: " in failed, (rank, failed)
        assert "disk full on rank 1 (test)" in failed and "reported by wait()" in failed, (rank, failed)
    assert not (tmp_path / "failed").exists()
    # A report that cannot be built fails no committed save: rank 0 warned for each DCP directory.
    unreported = [torch.load(tmp_path / f"saved_{rank}.pt", weights_only=False)["unreported"] for rank in range(2)]
    assert unreported[1] == [] and len(unreported[0]) == 2, unreported
    for name, warning in zip(("pytorch_model_fsdp_0", "optimizer_0"), unreported[0]):
        # Named in the save's staging folder, where DCP committed it before save_state's own commit.
        assert f"{os.sep}{name}: committed, but its save report could not be built (OSError: " in warning, warning
        assert warning.endswith("unreadable (test)); no report for this save"), warning
        assert (tmp_path / "unreported" / name / ".metadata").is_file()
    assert (tmp_path / "unreported" / "nvcomp_checkpoint.json").is_file()
    for kind in KINDS:
        _check_reports(tmp_path / kind / "ours", kind, *reports[0][kind])
        assert reports[1][kind] == (None, {}), reports[1][kind]  # rank 1 commits nothing
        ours = tmp_path / kind / "ours"
        manifest = json.loads((ours / "nvcomp_checkpoint.json").read_text())
        assert manifest["fsdp"] == {"version": 2, "state_dict_type": kind}
        assert manifest["models"] == [] and manifest["optimizers"] == []
        names = sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*") if p.is_file())
        if kind == "SHARDED_STATE_DICT":
            # Every rank's shards compressed, Accelerate's directory names kept, no plain DCP file.
            for d in ("pytorch_model_fsdp_0", "optimizer_0"):
                assert len([n for n in names if n.startswith(f"{d}/__") and n.endswith(".nvcdcp")]) == 2, names
                assert f"{d}/.metadata" in names
            assert not [n for n in names if n.endswith(".distcp")]
            assert (tmp_path / kind / "plain" / "pytorch_model_fsdp_0" / "__0_0.distcp").is_file()
        else:
            assert "pytorch_model_fsdp.nvc" in names and "optimizer.nvc" in names
            assert not [n for n in names if n.endswith(".bin")]
            assert (tmp_path / kind / "plain" / "pytorch_model_fsdp.bin").is_file()
        assert sorted(manifest["files"]) == sorted(n for n in names if n != "nvcomp_checkpoint.json")
        shared = tmp_path / kind / "shared"
        kept = sorted(p.relative_to(shared).as_posix() for p in shared.rglob("*") if p.is_file())
        listed = json.loads((shared / "nvcomp_checkpoint.json").read_text())["files"]
        assert kept == sorted([*listed, "nvcomp_checkpoint.json", "notes.txt"]), kept

    # The tier holds both sharded saves, copied whole by rank 0; the local folders go, as on a fresh node.
    tier_steps = sorted(p.name for p in (tmp_path / "tier").iterdir() if p.is_dir())
    assert len(tier_steps) == 2, tier_steps
    for step in tier_steps:
        copied = sorted(
            p.relative_to(tmp_path / "tier" / step).as_posix() for p in (tmp_path / "tier" / step).rglob("*") if p.is_file()
        )
        for d in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert len([n for n in copied if n.startswith(f"{d}/__") and n.endswith(".nvcdcp")]) == 2, copied
            assert f"{d}/.metadata" in copied, copied
    shutil.rmtree(tmp_path / "local")
    _check_trainer_save(tmp_path)
    shutil.rmtree(tmp_path / "trainer")  # the Trainer's local checkpoints too

    _spawn(_resume_run, str(tmp_path))
    _check_trainer_resume(tmp_path)
    for rank in range(2):
        saved = torch.load(tmp_path / f"saved_{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed_{rank}.pt", weights_only=False)
        for kind in KINDS:
            # Loading ours restores exactly what loading Accelerate's own files restores ...
            assert_tree_equal(resumed[f"{kind}/ours"], resumed[f"{kind}/plain"], f"{kind}/rank{rank}")
            for name in ("ours", "plain"):
                # ... which is the state as saved, bit for bit, and the uninterrupted run's next losses.
                # (A full FSDP2 load broadcasts rank 0's state, which turns Adam's betas tuple into a list.)
                got = resumed[f"{kind}/{name}"]
                assert_tree_equal(_tuples_as_lists(saved["state"]), _tuples_as_lists(got["state"]), f"{kind}/{name}/rank{rank}")
                assert got["losses"] == saved["losses"], (kind, name, rank)
        assert "NvcompReader" in resumed["stock"], resumed["stock"]
        # From the tier copy: the newest save (not the older copy), bit for bit, and the same next losses.
        tier = resumed["tier"]
        assert Path(tier["path"]).parent == tmp_path / "tier" and Path(tier["path"]).name == tier_steps[-1], tier["path"]
        assert_tree_equal(saved["state"], tier["state"], f"tier/rank{rank}")
        assert tier["losses"] == saved["losses"], rank
        assert tier["iteration"] == saved["iteration"], (tier["iteration"], saved["iteration"])


def _trainer_run(root: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((root / f"trainer_{name}_{rank}.json").read_text())


def _check_trainer_save(root: Path) -> None:
    """The Trainer's FSDP2 state: compressed, reported on rank 0 (every rank's files), copied whole to the tier."""
    from nvcomp_checkpoint.dcp import read_dcp_files

    reference = _trainer_run(root, "reference", 0)
    saved = [_trainer_run(root, "saved", rank) for rank in range(2)]
    assert saved[0]["wrapped"].startswith("FSDP"), saved[0]["wrapped"]  # really FSDP2
    assert saved[0]["losses"] == reference["losses"][: TRAINER_STEPS[0]]
    assert saved[1]["report"] is None  # rank 1 does not save the checkpoint
    last = root / "trainer" / f"checkpoint-{TRAINER_STEPS[0]}"
    dcp_dirs = [last / "pytorch_model_fsdp_0", last / "optimizer_0"]
    files = [read_dcp_files(str(d)) for d in dcp_dirs]
    report = saved[0]["report"]
    assert report["stored_bytes"] == sum(p.stat().st_size for d in dcp_dirs for p in d.iterdir())
    assert report["raw_bytes"] == sum(f.raw_bytes for f in files)
    assert {"weights", "exp_avg", "exp_avg_sq"} <= set(report["components"])
    tier = root / "trainer_tier"
    assert sorted(p.name for p in tier.iterdir() if p.is_dir()) == ["step-0000000002", "step-0000000004"]
    copied = sorted(
        p.relative_to(tier / "step-0000000004").as_posix() for p in (tier / "step-0000000004").rglob("*") if p.is_file()
    )
    # Every rank's files: its shards and its RNG state (written after the FSDP state: the copy waits for every rank).
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "pytorch_model_fsdp_0/.metadata"} <= set(copied), copied
    assert len([n for n in copied if n.endswith(".nvcdcp")]) == 4, copied


def _check_trainer_resume(root: Path) -> None:
    reference = _trainer_run(root, "reference", 0)["losses"]
    for rank in range(2):
        resumed = _trainer_run(root, "resumed", rank)
        assert resumed["resumed_from"] == str(root / "trainer_tier" / "step-0000000004"), resumed["resumed_from"]
    # The steps after the copy's: the uninterrupted run's losses (rank 0 logs them).
    resumed = _trainer_run(root, "resumed", 0)["losses"]
    tail = [s for s in resumed if s[0] > TRAINER_STEPS[0]]
    assert len(tail) == TRAINER_STEPS[1] - TRAINER_STEPS[0] and tail == reference[TRAINER_STEPS[0] :], (tail, reference)


def _check_reports(ours: Path, kind: str, report: Any, per_file: dict[str, Any]) -> None:
    """The committing process's report: per file or DCP directory, what the files hold, summed over the ranks."""
    from test_dcp_report import assert_report_matches_files

    if kind == "SHARDED_STATE_DICT":
        assert sorted(per_file) == ["optimizer_0", "pytorch_model_fsdp_0"], per_file
        for name, r in per_file.items():
            assert_report_matches_files(r, ours / name)
        assert set(per_file["pytorch_model_fsdp_0"].components) == {"weights"}
        assert {"exp_avg", "exp_avg_sq"} <= set(per_file["optimizer_0"].components)
    else:
        assert sorted(per_file) == ["optimizer.nvc", "pytorch_model_fsdp.nvc"], per_file
        for name, r in per_file.items():
            assert r.stored_bytes == (ours / name).stat().st_size
    assert report.stored_bytes == sum(r.stored_bytes for r in per_file.values())
    assert report.raw_bytes == sum(r.raw_bytes for r in per_file.values())
    # The full model and its Adam moments: every parameter once, whichever ranks held its shards.
    params = 24 * 48 + 48 + 48 * 40 + 40 + 40 * 2 + 2
    model, optimizer = sorted(per_file, key=lambda n: not n.startswith("pytorch_model"))
    assert per_file[model].raw_bytes == per_file[model].components["weights"].raw_bytes == params * 4
    assert per_file[optimizer].components["exp_avg"].raw_bytes == params * 4


def _tuples_as_lists(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _tuples_as_lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_tuples_as_lists(v) for v in tree]
    return tree


def test_sharded_state_has_one_committer(monkeypatch: pytest.MonkeyPatch) -> None:
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.integrations.accelerate_fsdp import check_one_committer

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    check_one_committer(True, 8, "ckpt", "X")  # one node: its main process is the only committer
    check_one_committer(False, 16, "ckpt", "X")
    with pytest.raises(nc.CheckpointError, match=r"ckpt: save_on_each_node=True .* on 2 nodes.*Set X to False"):
        check_one_committer(True, 16, "ckpt", "X")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    check_one_committer(True, 16, "ckpt", "X")  # no launcher said how many processes a node runs: one node


def test_fsdp_names_are_state_files() -> None:
    from nvcomp_checkpoint.integrations.accelerate import _is_state_file
    from nvcomp_checkpoint.integrations.accelerate_fsdp import is_fsdp_state_name

    for name in ("pytorch_model_fsdp_0", "optimizer_1", "pytorch_model_fsdp.nvc", "pytorch_model_fsdp_1.bin", "optimizer.nvc"):
        assert is_fsdp_state_name(name) and _is_state_file(name), name
    for name in ("notes.txt", "pytorch_model_fsdp", "optimizer_x"):
        assert not is_fsdp_state_name(name), name


def test_trainer_callback_with_fsdp_needs_the_mixin(tmp_path: Path) -> None:
    # The HF Trainer runs FSDP only on an accelerator device (as Accelerate): its save/resume runs
    # in benchmarks/gpu_check.sh; here, what the callback refuses when the Trainer is created.
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.transformers import NvcompTrainerCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True)
    with pytest.raises(nc.CheckpointError, match="NvcompTrainer .or put NvcompTrainerMixin"):
        NvcompTrainerCallback().on_init_end(args, TrainerState(), TrainerControl())
    from nvcomp_checkpoint.integrations.transformers_fsdp import check_fsdp_callback

    with pytest.raises(nc.CheckpointError, match=r"compress_weights=True\) with FSDP"):
        check_fsdp_callback(None, True, True, str(tmp_path))


@pytest.mark.parametrize("module", ["accelerate.accelerator", "transformers.trainer"])
def test_fsdp_functions_are_swapped_for_the_call_only(module: str) -> None:
    # Accelerate's save_state/load_state and the Trainer call the four functions by the names
    # they imported: those are swapped while the block runs, and put back after, also on error.
    import importlib

    from accelerate.utils import fsdp_utils

    from nvcomp_checkpoint.dcp import fsdp_functions

    namespace = importlib.import_module(module)
    names = fsdp_functions.FSDP_FUNCTION_NAMES
    assert all(getattr(namespace, n) is getattr(fsdp_utils, n) for n in names)
    # The core's functions, bound to the fsdp_utils module the framework calls (found through it, also
    # while ours are in place: the Trainer's module imports no Accelerate integration of ours).
    assert fsdp_functions.fsdp_helpers_of(namespace) is fsdp_utils
    with pytest.raises(KeyError):
        with fsdp_functions.nvcomp_fsdp_functions(namespace, fsdp_functions.fsdp_helpers_of(namespace), workers=1):
            assert namespace.save_fsdp_model.func is fsdp_functions.save_fsdp_model
            assert namespace.load_fsdp_optimizer.func is fsdp_functions.load_fsdp_optimizer
            assert namespace.load_fsdp_optimizer.keywords["helpers"] is fsdp_utils
            assert fsdp_functions.fsdp_helpers_of(namespace) is fsdp_utils
            raise KeyError("inside")
    assert all(getattr(namespace, n) is getattr(fsdp_utils, n) for n in names)
    # Accelerate's names of the state the core writes.
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

    assert (fsdp_functions.FSDP_MODEL_NAME, fsdp_functions.OPTIMIZER_NAME) == (FSDP_MODEL_NAME, OPTIMIZER_NAME)


def test_fsdp_setups_without_a_compressed_form_are_refused_at_registration() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.integrations.accelerate_fsdp import check_fsdp_hooks

    local = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(nc.CheckpointError, match="LOCAL_STATE_DICT writes one torch.save file per rank.*SHARDED_STATE_DICT"):
        check_fsdp_hooks(local, async_save=False)
    sharded = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    check_fsdp_hooks(sharded, async_save=True)  # written in the background (test_fsdp2_save_state_resumes_bit_identical)
    check_fsdp_hooks(sharded, async_save=False)
