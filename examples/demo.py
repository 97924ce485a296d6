"""Demo: train a tiny model on the CPU, save compressed checkpoints, resume, and report.

Run with ``bash scripts/demo.sh`` (sets up .venv first) or ``python examples/demo.py``: about 45 s
on an idle 2-core CPU machine (longer on a busy one). Without ``--out DIR`` it leaves its checkpoints in a temporary folder
(``$TMPDIR/nvckpt-demo-*``) and prints where; delete it when done.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.report import format_bytes, format_table


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=layers)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def batch(step: int, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (8, 32), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "gradients": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "step": step,
        "rng": torch.get_rng_state(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", default=None, help="directory for checkpoints (default: a temporary one)")
    args = parser.parse_args()

    torch.manual_seed(0)
    out = args.out or tempfile.mkdtemp(prefix="nvckpt-demo-")
    os.makedirs(out, exist_ok=True)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(
        f"training a {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M-parameter model for {args.steps} steps; checkpoints in {out}"
    )
    last = None
    for start in range(0, args.steps, args.every):
        train(model, opt, range(start, start + args.every))
        step = start + args.every
        last = os.path.join(out, f"step-{step:05d}.nvc")
        report = nc.save(checkpoint(model, opt, step), last)
        print(f"  step {step}: {report}")

    # What torch.save would have written for the same tree.
    buf = io.BytesIO()
    torch.save(checkpoint(model, opt, args.steps), buf)
    plain = buf.getbuffer().nbytes

    # Resume into fresh objects and check that training continues identically.
    expected = train(model, opt, range(args.steps, args.steps + 5))
    state = nc.load(last)
    model2 = TinyLM()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    resumed = train(model2, opt2, range(args.steps, args.steps + 5))
    same = expected == resumed

    print()
    print(f"last checkpoint: {last}")
    print(report.table())
    print()
    rows = [
        ["torch.save", format_bytes(plain), "1.000x"],
        ["nvcomp-checkpoint", format_bytes(report.stored_bytes), f"{plain / report.stored_bytes:.3f}x"],
    ]
    print(format_table(["writer", "file size", "smaller by"], rows))
    print()
    print(f"resumed from step {state['step']}: next 5 losses {'identical' if same else 'DIFFERENT'} to the uninterrupted run")
    print("  uninterrupted:", [round(v, 6) for v in expected])
    print("  resumed:      ", [round(v, 6) for v in resumed])
    if not same:
        raise SystemExit("resume mismatch")
    saved = sorted(n for n in os.listdir(out) if n.endswith(".nvc"))
    size = sum(os.path.getsize(os.path.join(out, n)) for n in saved)
    print()
    kept = "--out DIR chooses where" if args.out else "a temporary directory; --out DIR chooses where, delete it when done"
    print(f"checkpoints kept in {out}: {len(saved)} file{'s' if len(saved) != 1 else ''}, {format_bytes(size)} ({kept})")
    print("next:")
    print(f"  nvckpt inspect {last}    # what is in a checkpoint, per component")
    print(f"  nvckpt verify {out}    # check every checksum, as a load would")
    print('  README.md, "Use": save, load and open in your own training loop')


if __name__ == "__main__":
    main()
