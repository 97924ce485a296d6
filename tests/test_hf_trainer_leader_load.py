"""``NvcompTrainerCallback(leader_load=True)``: a DDP resume reads each compressed file once per node.

The Hugging Face Trainer on 2 CPU processes (torchrun, gloo) saves compressed checkpoints; fresh
processes resume from one. With ``leader_load`` rank 0 alone opens the ``.nvc`` files (an audit hook
lists every file a process opens) and rank 1 receives their state over the process group; both
continue with the uninterrupted run's losses. The resumed run converts in the background and loads
the best model at the end in one collective.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import run_python

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from nvcomp_checkpoint.dirconvert import is_placeholder  # noqa: E402

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.transformers import NvcompTrainer, NvcompTrainerCallback

    torch.set_num_threads(1)


    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}


    mode, root = sys.argv[1], sys.argv[2]
    opened = []
    if mode != "first":
        sys.addaudithook(lambda event, a: opened.append(os.fspath(a[0])) if event == "open" and isinstance(a[0], (str, os.PathLike)) else None)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
    leader = mode == "leader"
    # The leader run also converts in the background and loads the best model at the end (checkpoint-6).
    best = dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3, metric_for_best_model="loss") if leader else {}
    args = TrainingArguments(
        output_dir=os.path.join(root, mode), max_steps=6, save_steps=3, per_device_train_batch_size=4, logging_steps=1,
        learning_rate=1e-3, seed=1, report_to=[], use_cpu=True, disable_tqdm=True, **best,
    )
    tiers = [nc.Tier(os.path.join(root, "tier"))] if mode == "first" else None
    callback = NvcompTrainerCallback(leader_load=leader, tiers=tiers, async_save=leader)
    trainer = NvcompTrainer(
        model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens() if leader else None, callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=None if mode == "first" else os.path.join(root, "first", "checkpoint-3"))
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    names = lambda step: sorted({os.path.basename(p) for p in opened if f"checkpoint-{step}" + os.sep in p})
    out = {"losses": losses, "nvc_opened": [n for n in names(3) if n.endswith(".nvc")],
           "best_opened": [n for n in names(6) if n.startswith("model.safetensors")], "best": trainer.state.best_model_checkpoint}
    if leader:
        out["best_weights"] = {k: v.sum().item() for k, v in trainer.model.state_dict().items() if k.endswith("c_attn.weight")}
    with open(os.path.join(root, f"{mode}_{trainer.args.process_index}.json"), "w") as f:
        json.dump(out, f)
    # Each rank ends without interpreter teardown: a gloo worker thread still freeing a finished
    # collective then aborts the process (see tests/fresh_process.py, _rank_entry). Everything above is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def _torchrun(script: Path, mode: str, root: Path) -> None:
    run_python(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        mode,
        str(root),
        cwd=root,
        OMP_NUM_THREADS="1",
    )


@pytest.mark.slow
def test_ddp_resume_reads_each_file_on_one_rank_and_continues_the_run(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    _torchrun(script, "first", tmp_path)
    assert sorted(p.name for p in (tmp_path / "first" / "checkpoint-3").glob("*.nvc")) == [
        "model.safetensors.nvc",
        "optimizer.pt.nvc",
    ]
    # The tier copies (made by rank 0 once every rank has written its files) hold both ranks' RNG state.
    copies = sorted(p for p in (tmp_path / "tier").rglob("rng_state_*.pth"))
    assert [p.name for p in copies] == ["rng_state_0.pth", "rng_state_1.pth"] * 2, copies
    _torchrun(script, "leader", tmp_path)
    full = json.loads((tmp_path / "first_0.json").read_text())["losses"]
    assert sorted(int(s) for s in full) == list(range(1, 7))
    leader = [json.loads((tmp_path / f"leader_{rank}.json").read_text()) for rank in (0, 1)]
    for rank, resumed in enumerate(leader):
        expected = ["model.safetensors.nvc", "optimizer.pt.nvc"] if rank == 0 else []
        assert resumed["nvc_opened"] == expected, (rank, resumed["nvc_opened"])
        # The best model was loaded in one collective, once rank 0's background conversion was done on
        # every rank: rank 0 read its compressed weights, rank 1 nothing of it.
        assert resumed["best"].endswith("checkpoint-6"), resumed["best"]
        assert ("model.safetensors.nvc" in resumed["best_opened"]) == (rank == 0), (rank, resumed["best_opened"])
    # Rank 1 read only the placeholder under the plain name (a few hundred bytes that say the weights
    # are compressed, read by each rank to choose the file), never the weights.
    assert leader[1]["best_opened"] == ["model.safetensors"], leader[1]["best_opened"]
    assert is_placeholder(tmp_path / "leader" / "checkpoint-6" / "model.safetensors")
    assert leader[0]["best_weights"] == leader[1]["best_weights"]
    for rank, resumed in enumerate(leader):
        # The resumed run's log starts with the checkpoint's history (steps 1-3), then trains on.
        assert resumed["losses"] == full, rank
