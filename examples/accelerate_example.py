"""Accelerate example: ``save_state`` with compressed weights and optimizer state, then resume.

Run with ``python examples/accelerate_example.py``: about 6 s on an idle 2-core CPU machine (longer on a busy one), after
imports. Without ``--out DIR`` it leaves its project in a temporary folder
(``$TMPDIR/nvckpt-accelerate-*``) and prints where; delete it when done.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from safetensors.torch import save as safetensors_bytes

from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
from nvcomp_checkpoint.report import format_bytes, format_table


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.1)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


class StepCounter:
    """A custom object saved with the checkpoint (``accelerator.register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def setup(project_dir: str) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, object, StepCounter]:
    set_seed(0)
    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def train(
    accelerator: Accelerator, model: torch.nn.Module, optimizer, scheduler, counter: StepCounter, steps: int
) -> list[float]:
    losses = []
    model.train()
    for _ in range(steps):
        g = torch.Generator().manual_seed(counter.step)  # the data follows the saved step
        x = torch.randint(0, 512, (8, 32), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, dims=1).flatten())
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.step += 1
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default=None, help="project directory (default: a temporary one)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # identical float reduction order in the run and the resumed run
    project = args.out or tempfile.mkdtemp(prefix="nvckpt-accelerate-")
    os.makedirs(project, exist_ok=True)
    accelerator, model, optimizer, scheduler, counter = setup(project)
    hooks = register_nvcomp_hooks(accelerator)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"training a {n_params / 1e6:.2f} M-parameter model for {args.steps} steps; checkpoints in {project}/checkpoints")
    for _ in range(0, args.steps, args.every):
        train(accelerator, model, optimizer, scheduler, counter, args.every)
        saved = accelerator.save_state()  # checkpoints/checkpoint_<n>, at most total_limit=2 kept
        print(f"  step {counter.step}: {hooks.last_report}")
    print(f"kept: {sorted(os.listdir(os.path.join(project, 'checkpoints')))}")

    # What plain save_state writes for the two big files: model.safetensors and optimizer.bin.
    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    plain = len(safetensors_bytes({k: v.contiguous() for k, v in model.state_dict().items()})) + buf.getbuffer().nbytes
    report = hooks.last_report
    print()
    print(f"last checkpoint: {saved}  ({', '.join(sorted(os.listdir(saved)))})")
    print(report.table())
    print()
    print(
        format_table(
            ["save_state", "model + optimizer files", "smaller by"],
            [
                ["plain Accelerate", format_bytes(plain), "1.000x"],
                ["with register_nvcomp_hooks", format_bytes(report.stored_bytes), f"{plain / report.stored_bytes:.3f}x"],
            ],
        )
    )

    # Resume into fresh objects from the newest checkpoint, as a restarted job would.
    expected = train(accelerator, model, optimizer, scheduler, counter, 5)
    accelerator2, model2, optimizer2, scheduler2, counter2 = setup(project)
    register_nvcomp_hooks(accelerator2)
    accelerator2.load_state()
    resumed = train(accelerator2, model2, optimizer2, scheduler2, counter2, 5)
    same = expected == resumed
    print()
    print(f"resumed at step {counter2.step - 5}: next 5 losses {'identical' if same else 'DIFFERENT'} to the uninterrupted run")
    print("  uninterrupted:", [round(v, 6) for v in expected])
    print("  resumed:      ", [round(v, 6) for v in resumed])
    if not same:
        raise SystemExit("resume mismatch")


if __name__ == "__main__":
    main()
