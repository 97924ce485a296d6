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
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import assert_tree_equal, spawn_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SAVE_STEPS, NEXT_STEPS = 2, 3


# -- run in each rank ------------------------------------------------------------------------------
def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 2))


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


def _save_run(rank: int, root: str) -> None:
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    acc, model, opt = _prepared(seed=0)
    _train(acc, model, opt, SAVE_STEPS, first=0)
    for kind in KINDS:
        _use(acc, kind)
        out = os.path.join(root, kind)
        hooks = register_nvcomp_hooks(acc)
        acc.save_state(os.path.join(out, "ours"))
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
    state = _full_state(model, opt)
    losses = _train(acc, model, opt, NEXT_STEPS, first=SAVE_STEPS)
    torch.save({"state": state, "losses": losses}, os.path.join(root, f"saved_{rank}.pt"))


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
    _use(acc, "SHARDED_STATE_DICT")
    # A stock Accelerator cannot read our shards, and says which reader can.
    try:
        acc.load_state(os.path.join(root, "SHARDED_STATE_DICT", "ours"))
        out["stock"] = "loaded"
    except CheckpointException as exc:  # DCP's (a BaseException) holds each rank's error
        out["stock"] = repr(exc)
    torch.save(out, os.path.join(root, f"resumed_{rank}.pt"))


def _rank_main(rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
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
    for kind in KINDS:
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

    _spawn(_resume_run, str(tmp_path))
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


def _tuples_as_lists(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _tuples_as_lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_tuples_as_lists(v) for v in tree]
    return tree


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

    from nvcomp_checkpoint.integrations import accelerate_fsdp

    namespace = importlib.import_module(module)
    names = accelerate_fsdp.FSDP_FUNCTION_NAMES
    assert all(getattr(namespace, n) is getattr(fsdp_utils, n) for n in names)
    with pytest.raises(KeyError):
        with accelerate_fsdp.nvcomp_fsdp_functions(namespace, workers=1):
            assert namespace.save_fsdp_model.func is accelerate_fsdp.save_fsdp_model
            assert namespace.load_fsdp_optimizer is accelerate_fsdp.load_fsdp_optimizer
            raise KeyError("inside")
    assert all(getattr(namespace, n) is getattr(fsdp_utils, n) for n in names)


def test_fsdp_setups_without_a_compressed_form_are_refused_at_registration() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.integrations.accelerate_fsdp import check_fsdp_hooks

    local = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(nc.CheckpointError, match="LOCAL_STATE_DICT writes one torch.save file per rank.*SHARDED_STATE_DICT"):
        check_fsdp_hooks(local, async_save=False)
    sharded = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    with pytest.raises(nc.CheckpointError, match="async_save is not supported with FSDP"):
        check_fsdp_hooks(sharded, async_save=True)
    check_fsdp_hooks(sharded, async_save=False)
