"""Sharded checkpoints on a GPU at world size 1: what the CPU test suite cannot run.

One step of ``benchmarks/gpu_check.sh``. Each case saves in one fresh process and resumes in
another (Accelerate and Lightning keep process-wide state), then compares in this one:

- ``dcp_cuda_shards``: FSDP2 shards on the GPU through ``NvcompWriter`` (nvCOMP when present),
  reread bit-exactly on the CPU without a process group.
- ``accelerate_fsdp2_sharded``, ``accelerate_fsdp1_sharded``, ``accelerate_fsdp1_full``:
  ``register_nvcomp_hooks`` + ``save_state``, then ``load_state`` in a fresh process: the
  model and optimizer state bit-identical, and the next 3 losses those of the uninterrupted run.
- ``trainer_fsdp2_sharded``: ``NvcompTrainer`` + ``NvcompTrainerCallback`` with FSDP2, resumed
  from ``checkpoint-2``: the losses of steps 3 and 4 as in the uninterrupted run.
- ``lightning_fsdp1_sharded``: ``NvcompFSDPStrategy(state_dict_type="sharded")`` fit for 2
  epochs, resumed from the first epoch's checkpoint: the losses of steps 3-5 as uninterrupted.

``--device cpu`` (the dry run) runs what the CPU allows: the DCP case on gloo, and the FSDP2
Accelerate case with ``distributed_type`` set to FSDP by hand (Accelerate picks FSDP only with
an accelerator device); the others are reported as skipped. Every case prints one line
``gpu_fsdp_check: {json}`` as soon as it ends (``gpu_check_table.py`` reads them from the log).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

SAVE_STEPS, NEXT_STEPS = 2, 3


# -- shared by the phases ------------------------------------------------------------------------
def _world_of_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )


def _model(seed: int, width: int = 256) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )


def _as_lists(tree: Any) -> Any:
    # A full FSDP2 load broadcasts rank 0's optimizer state, which turns Adam's betas tuple into a
    # list (with Accelerate's own files too); everything else must be identical.
    if isinstance(tree, dict):
        return {k: _as_lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_as_lists(v) for v in tree]
    return tree


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bits, NaNs too
        return None if same else f"{path}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:4]} differ"
        for k in a:
            found = _first_difference(a[k], b[k], f"{path}/{k}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}/{i}")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def _files(root: Path, suffix: str) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(f"*{suffix}"))


# -- dcp_cuda_shards -----------------------------------------------------------------------------
def phase_dcp_cuda_shards(work: Path, device: str, phase: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nvcomp_checkpoint.dcp import NvcompReader, NvcompWriter

    # dcp.async_save needs a CPU backend in the group (its plans cross on gloo).
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (1,))
    model = _model(0, width=1024).to(device=device, dtype=torch.bfloat16)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(SAVE_STEPS):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(device=device, dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    devices = sorted({str(t.device.type) for t in msd.values()})
    start = time.perf_counter()
    dcp.save({"model": msd, "optim": osd}, storage_writer=NvcompWriter(work / "ckpt"))
    seconds = time.perf_counter() - start
    full = {k: v.full_tensor().cpu().clone() for k, v in msd.items()}  # not an alias: the weights change below
    # dcp.async_save staged in host memory (the default) and on the GPU: time until it returns
    # (training waits) and until the files are durable; the device-staged one must hold the state
    # of its call although the weights change right after it.
    staged: dict[str, tuple[float, float]] = {}
    for staging in ("host", "device"):
        start = time.perf_counter()
        pending = dcp.async_save(
            {"model": msd, "optim": osd}, storage_writer=NvcompWriter(work / f"async_{staging}", staging=staging)
        )
        blocked = time.perf_counter() - start
        if staging == "device":
            with torch.no_grad():
                for v in msd.values():
                    v.to_local().add_(1)
        pending.result()
        staged[staging] = (blocked, time.perf_counter() - start)
    # Where the device staging puts the DTensors' local shards: on their GPU within the budget, on
    # the host past it (budget 0), never moved back to the GPU.
    placed = {}
    for budget in (None, 0):
        copy = NvcompWriter(work / "unused", staging="device", device_budget_bytes=budget).stage({"model": msd})
        placed[budget] = sorted({t.to_local().device.type for t in copy["model"].values()})
    dist.destroy_process_group()
    # Reread on the CPU, in this process without a process group: the GPU's frames decode anywhere.
    diffs = []
    for name in ("ckpt", "async_device"):
        target = {"model": {k: torch.empty_like(v) for k, v in full.items()}}
        dcp.load(target, storage_reader=NvcompReader(work / name), no_dist=True)
        diffs.append(_first_difference(full, target["model"], name))
    diff = next((d for d in diffs if d is not None), None)
    leaves = torch.utils._pytree.tree_leaves({"model": msd, "optim": osd})
    raw = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    torch.save(
        {"diff": diff, "devices": devices, "raw": raw, "seconds": seconds, "staged": staged, "placed": placed}, work / "result.pt"
    )


def case_dcp_cuda_shards(work: Path, device: str, run: Callable[[str], None]) -> tuple[bool, str]:
    run("run")
    r = torch.load(work / "result.pt", weights_only=False)
    stored = sum(p.stat().st_size for p in (work / "ckpt").glob("*.nvcdcp"))
    ok = r["diff"] is None and r["devices"] == [device] and stored > 0 and r["placed"] == {None: [device], 0: ["cpu"]}
    detail = (
        f"shards on {','.join(r['devices'])}, bf16 model + Adam state {r['raw'] / 2**20:.2f} MiB -> rank file "
        f"{stored / 2**20:.2f} MiB, save {r['seconds']:.2f} s; async_save blocked/total: "
        + ", ".join(f"{k}-staged {b:.3f}/{t:.2f} s" for k, (b, t) in r["staged"].items())
        + f"; CPU reread of the weights (sync, device-staged async): {r['diff'] or 'bit-exact'}"
        + f"; device staging puts shards on {r['placed'][None]} (budget 0: {r['placed'][0]})"
    )
    return ok, detail


# -- Accelerate ----------------------------------------------------------------------------------
def _accelerator(version: int, kind: str, device: str, seed: int) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=kind)
    if device == "cuda":
        acc = Accelerator(fsdp_plugin=plugin)
        if acc.distributed_type != DistributedType.FSDP:
            raise RuntimeError(f"Accelerator chose {acc.distributed_type}, not FSDP")
    else:
        acc = Accelerator(cpu=True)
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    model = _model(seed)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    acc.state.distributed_type = DistributedType.FSDP  # prepare() puts MULTI_CPU back on the CPU
    return acc, model, opt


def _accelerate_train(acc: Any, model: Any, opt: Any, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).to(acc.device)
        loss = model(x).square().mean()
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        losses.append(float(loss))
    return losses


def _accelerate_state(model: Any, opt: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, {"model": msd, "optim": osd})


def _accelerate_phase(version: int, kind: str) -> Callable[[Path, str, str], None]:
    def phase(work: Path, device: str, phase: str) -> None:
        from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

        acc, model, opt = _accelerator(version, kind, device, seed=0 if phase == "save" else 1)
        if phase == "save":
            _accelerate_train(acc, model, opt, 0, SAVE_STEPS)
        hooks = register_nvcomp_hooks(acc)
        if phase == "save":
            acc.save_state(str(work / "ckpt"))
        else:
            acc.load_state(str(work / "ckpt"))
        hooks.remove()
        state = _accelerate_state(model, opt)
        losses = _accelerate_train(acc, model, opt, SAVE_STEPS, NEXT_STEPS)
        torch.save({"state": state, "losses": losses}, work / f"{phase}.pt")

    return phase


def _accelerate_case(kind: str) -> Callable[[Path, str, Callable[[str], None]], tuple[bool, str]]:
    def case(work: Path, device: str, run: Callable[[str], None]) -> tuple[bool, str]:
        run("save")
        run("resume")
        saved = torch.load(work / "save.pt", weights_only=False)
        resumed = torch.load(work / "resume.pt", weights_only=False)
        diff = _first_difference(_as_lists(saved["state"]), _as_lists(resumed["state"]), "state")
        ckpt = work / "ckpt"
        ours = _files(ckpt, ".nvcdcp") if kind == "SHARDED_STATE_DICT" else _files(ckpt, ".nvc")
        plain = _files(ckpt, ".distcp") + _files(ckpt, ".bin")
        same = resumed["losses"] == saved["losses"]
        ok = diff is None and same and bool(ours) and not plain
        stored = sum((ckpt / n).stat().st_size for n in ours)
        losses = "equal" if same else f"{saved['losses']} vs {resumed['losses']}"
        detail = (
            f"{len(ours)} compressed files ({stored / 2**10:.0f} KiB), plain: {plain or 'none'}; state "
            f"{diff or 'bit-identical'}; next {NEXT_STEPS} losses {losses}"
        )
        return ok, detail

    return case


# -- HF Trainer ----------------------------------------------------------------------------------
def phase_trainer(work: Path, device: str, phase: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from nvcomp_checkpoint.transformers import NvcompTrainer, NvcompTrainerCallback

    torch.manual_seed(0 if phase == "save" else 1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=str(work / "out"),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        save_total_limit=None,
        fsdp="full_shard",
        fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT", "transformer_layer_cls_to_wrap": ["GPT2Block"]},
    )
    trainer = NvcompTrainer(model=model, args=args, train_dataset=data, callbacks=[NvcompTrainerCallback()])
    if not trainer.is_fsdp_enabled:
        raise RuntimeError("the Trainer did not enable FSDP")
    trainer.train(resume_from_checkpoint=str(work / "out" / "checkpoint-2") if phase == "resume" else None)
    losses = [[h["step"], h["loss"]] for h in trainer.state.log_history if "loss" in h]
    (work / f"{phase}.json").write_text(json.dumps(losses))


def case_trainer(work: Path, device: str, run: Callable[[str], None]) -> tuple[bool, str]:
    run("save")
    ckpt = work / "out" / "checkpoint-2"
    ours, plain = _files(ckpt, ".nvcdcp"), _files(ckpt, ".distcp")
    run("resume")
    saved = json.loads((work / "save.json").read_text())
    resumed = json.loads((work / "resume.json").read_text())
    tail = [s for s in saved if s[0] > 2]
    ok = bool(ours) and not plain and resumed == tail and len(tail) == 2
    return ok, f"checkpoint-2: {len(ours)} compressed rank files, plain: {plain or 'none'}; steps 3-4 losses {resumed} vs {tail}"


# -- Lightning -----------------------------------------------------------------------------------
def phase_lightning(work: Path, device: str, phase: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nvcomp_checkpoint.lightning import NvcompFSDPStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(0 if phase == "save" else 1)
            self.losses: list[list[float]] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.net(batch).square().mean()
            self.losses.append([self.global_step, float(loss)])
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> Any:
            data = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(data, batch_size=8)

    model = Net()
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=NvcompFSDPStrategy(state_dict_type="sharded"),
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=str(work / phase), save_top_k=-1, every_n_epochs=1)],
    )
    first = work / "save" / "epoch=0-step=3.ckpt"
    trainer.fit(model, ckpt_path=str(first) if phase == "resume" else None)
    (work / f"{phase}.json").write_text(json.dumps(model.losses))


def case_lightning(work: Path, device: str, run: Callable[[str], None]) -> tuple[bool, str]:
    run("save")
    ckpt = work / "save" / "epoch=0-step=3.ckpt"
    ours, plain = _files(ckpt, ".nvcdcp"), _files(ckpt, ".distcp")
    run("resume")
    saved = json.loads((work / "save.json").read_text())
    resumed = json.loads((work / "resume.json").read_text())
    ok = bool(ours) and not plain and resumed == saved[3:] and len(saved) == 6
    losses = "equal" if resumed == saved[3:] else f"{resumed} vs {saved[3:]}"
    return ok, f"epoch=0-step=3.ckpt: {len(ours)} compressed rank files, plain: {plain or 'none'}; steps 3-5 losses {losses}"


# -- the cases, in order -------------------------------------------------------------------------
# name: (needs CUDA even for a dry run, the phase function, the case function)
CASES: dict[str, tuple[bool, Callable[..., None], Callable[..., tuple[bool, str]]]] = {
    "dcp_cuda_shards": (False, phase_dcp_cuda_shards, case_dcp_cuda_shards),
    "accelerate_fsdp2_sharded": (False, _accelerate_phase(2, "SHARDED_STATE_DICT"), _accelerate_case("SHARDED_STATE_DICT")),
    "accelerate_fsdp1_sharded": (True, _accelerate_phase(1, "SHARDED_STATE_DICT"), _accelerate_case("SHARDED_STATE_DICT")),
    "trainer_fsdp2_sharded": (True, phase_trainer, case_trainer),
    "lightning_fsdp1_sharded": (True, phase_lightning, case_lightning),
    "accelerate_fsdp1_full": (True, _accelerate_phase(1, "FULL_STATE_DICT"), _accelerate_case("FULL_STATE_DICT")),
}
_WHY_CUDA = {
    "accelerate_fsdp1_sharded": "FSDP1 does not run on the CPU (Inconsistent compute device)",
    "accelerate_fsdp1_full": "FSDP1 does not run on the CPU (Inconsistent compute device)",
    "trainer_fsdp2_sharded": "the Trainer enables FSDP only with an accelerator device",
    "lightning_fsdp1_sharded": "NvcompFSDPStrategy (FSDP1) needs CUDA",
}


def _report(row: dict[str, Any]) -> None:
    print("gpu_fsdp_check: " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no case after this many seconds")
    parser.add_argument("--phase-timeout-s", type=float, default=120.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--phase", nargs=3, metavar=("CASE", "PHASE", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.phase:
        name, phase, work = args.phase
        _world_of_one()
        CASES[name][1](Path(work), args.device, phase)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        _report({"case": "all", "ok": False, "detail": "no CUDA device (use --device cpu for a dry run)"})
        return 1
    started, failed = time.perf_counter(), 0
    for name in args.cases.split(","):
        needs_cuda, _, case = CASES[name]
        if args.device == "cpu" and needs_cuda:
            _report({"case": name, "ok": None, "seconds": 0.0, "detail": f"not run in the dry run: {_WHY_CUDA[name]}"})
            continue
        if time.perf_counter() - started > args.budget_s:
            _report(
                {"case": name, "ok": False, "seconds": 0.0, "detail": f"not started: the {args.budget_s:.0f} s budget is spent"}
            )
            failed += 1
            continue
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"gpu_fsdp_{name}_") as tmp:
            work = Path(tmp)

            def run(phase: str, name: str = name, work: Path = work) -> None:
                cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--phase", name, phase, str(work)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.phase_timeout_s)
                if proc.returncode != 0:
                    raise RuntimeError(f"{phase} phase exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")

            try:
                ok, detail = case(work, args.device, run)
            except Exception as exc:  # one case's failure is its row; the next case still runs
                ok, detail = False, f"{type(exc).__name__}: {exc}"[-2000:]
        failed += not ok
        _report({"case": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 1), "detail": detail})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
