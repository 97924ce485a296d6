"""Example: a stock Hugging Face ``Trainer`` whose checkpoints' optimizer state is compressed, then resumed.

Runs on the CPU in about 25 s on an idle 2-core machine (longer on a busy one): ``python examples/hf_trainer_example.py [--output-dir DIR]``.
Without ``--output-dir`` its checkpoints go to a temporary folder that is removed at the end.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from nvcomp_checkpoint.report import format_bytes
from nvcomp_checkpoint.transformers import NvcompTrainerCallback


class RandomTokens(torch.utils.data.Dataset):
    """Language-model samples of random tokens: enough to move the weights and the Adam moments."""

    def __init__(self, n: int = 256, length: int = 64, vocab: int = 1024) -> None:
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make_trainer(output_dir: str, max_steps: int) -> tuple[Trainer, NvcompTrainerCallback]:
    torch.manual_seed(0)
    # Built from a config: nothing is downloaded.
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=64))
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        save_steps=10,
        save_total_limit=2,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    # Compresses optimizer.pt of every checkpoint-N and loads it back when a run resumes; the
    # weights stay as the Trainer wrote them (NvcompTrainer compresses those too).
    callback = NvcompTrainerCallback()
    return Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[callback]), callback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default=None, help="where checkpoint-N directories go (default: a temporary one)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = opts.output_dir or tmp

        trainer, callback = make_trainer(out, max_steps=20)
        trainer.train()
        report = callback.last_report
        assert report is not None
        print(f"\nWhat the last save wrote ({report.path}), per component:\n")
        print(report.table())
        print(f"\noptimizer state: {format_bytes(report.raw_bytes)} -> {format_bytes(report.stored_bytes)}")
        print("files:", ", ".join(sorted(p.name for p in Path(report.path).iterdir())))

        # A later run (a fresh process in real life) continues from the newest compressed checkpoint.
        resumed, _ = make_trainer(out, max_steps=30)
        resumed.train(resume_from_checkpoint=True)
        print(
            f"\nresumed from step 20 and trained to step {resumed.state.global_step}; kept:",
            ", ".join(sorted(p.name for p in Path(out).glob("checkpoint-*"))),
        )


if __name__ == "__main__":
    main()
