"""DeepSpeed's load forms on a compressed folder against stock DeepSpeed on a plain one, for tests/test_deepspeed_load_forms.py.

``python -m torch.distributed.run --nproc_per_node N tests/deepspeed_load_forms.py MODE STAGE ROOT``:

* ``forms`` (2 ranks): a stock engine and an attached one train 3 steps and save tag ``t3`` (stock:
  ``ROOT/plain``, attached: ``ROOT/ours``), train 2 steps, save ``t5``, train 2 steps (the losses after
  each tag: ``ROOT/ref.json``). Then for each load form (full with and without a tag,
  ``load_optimizer_states=False``, ``load_module_only=True``, ``load_lr_scheduler_states=False``) a
  fresh stock engine loads ``plain`` and a fresh attached engine ``ours``; each records what the load
  gave (step, learning rate, scheduler step, client state) and the next 2 losses (``ROOT/forms.json``).
* ``universal`` (1 rank): a world of 1 loads the universal checkpoints DeepSpeed's ``ds_to_universal``
  made of each folder's ``t3`` (``ROOT/universal-plain``: a stock engine, ``ROOT/universal-ours``: an
  attached one) and trains 2 steps (``ROOT/universal.json``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from deepspeed_train import TinyGPT, init, train  # noqa: E402
from nvcomp_checkpoint.deepspeed import attach  # noqa: E402

#: Each load form: load_checkpoint's keyword arguments.
FORMS = {
    "full-latest": {},
    "full-tag": {"tag": "t3"},
    "no-optimizer": {"load_optimizer_states": False},
    "no-optimizer-tag": {"tag": "t3", "load_optimizer_states": False},
    "module-only": {"tag": "t3", "load_module_only": True},
    "no-lr-scheduler": {"tag": "t3", "load_lr_scheduler_states": False},
}


def make_engine(stage: int, universal: bool = False) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A scheduler whose state matters: load_lr_scheduler_states=False must show.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": universal},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def state(engine: deepspeed.DeepSpeedEngine, client: dict | None) -> dict:
    return {
        "step": engine.global_steps,
        "lr": engine.get_lr()[0],
        "scheduler_step": engine.lr_scheduler.last_epoch,
        "client": sorted((client or {}).get("note", {}).items()),
        "losses": train(engine, 2),
    }


def main() -> None:
    mode, stage, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    init()
    rank = torch.distributed.get_rank()
    results: dict = {}
    if mode == "forms":
        engine = make_engine(stage)
        attached = make_engine(stage)
        attach(attached)
        # universal_checkpoint_info: what ds_to_universal requires of a checkpoint (Megatron writes it).
        client = {"universal_checkpoint_info": {}, "note": {"by": "test"}}
        ref = {}
        train(engine, 3)
        train(attached, 3)
        for tag in ("t3", "t5"):  # t5: 2 steps after t3, so `latest` and tag="t3" differ
            engine.save_checkpoint(os.path.join(root, "plain"), tag=tag, client_state=client)
            attached.save_checkpoint(os.path.join(root, "ours"), tag=tag, client_state=client)
            ref[tag] = {"stock": train(engine, 2), "attached": train(attached, 2)}
        if rank == 0:
            with open(os.path.join(root, "ref.json"), "w") as f:
                json.dump(ref, f)
        for form, kwargs in FORMS.items():
            results[form] = {}
            for folder in ("plain", "ours"):
                engine = make_engine(stage)
                if folder == "ours":
                    attach(engine)
                path, client = engine.load_checkpoint(os.path.join(root, folder), **kwargs)
                assert path is not None, (form, folder)
                results[form][folder] = dict(state(engine, client), path=os.path.relpath(path, os.path.join(root, folder)))
        name = "forms.json"
    elif mode == "universal":
        for folder in ("plain", "ours"):
            engine = make_engine(stage, universal=True)
            if folder == "ours":
                attach(engine)
            path, client = engine.load_checkpoint(os.path.join(root, f"universal-{folder}"), tag="t3_universal")
            assert path is not None, folder
            results[folder] = state(engine, client)
        name = "universal.json"
    else:
        raise SystemExit(f"unknown mode {mode}")
    if rank == 0:
        with open(os.path.join(root, name), "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
