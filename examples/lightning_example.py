"""Lightning example: train a tiny language model with compressed checkpoints, then resume.

``Trainer(plugins=[NvcompCheckpointIO()])`` is the only change a Lightning script needs; this
runs on the CPU in about 30 s on an idle 2-core machine (longer on a busy one): ``python examples/lightning_example.py``.
Without ``--out DIR`` it leaves its checkpoints in a temporary folder (``$TMPDIR/nvckpt-lightning-*``);
delete it when done.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from nvcomp_checkpoint import CodecPolicy
from nvcomp_checkpoint.lightning import NvcompCheckpointIO, load_from_checkpoint
from nvcomp_checkpoint.report import format_bytes, format_table

VOCAB = 512


class TinyLM(pl.LightningModule):
    def __init__(self, dim: int = 128, layers: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=layers)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data(batches: int = 8) -> torch.utils.data.DataLoader:
    x = torch.randint(0, VOCAB, (8 * batches, 32), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=8)


def trainer(out: str, epochs: int, plugin: NvcompCheckpointIO) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=out,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin],
        callbacks=[
            ModelCheckpoint(dirpath=out, filename="{epoch}-{step}", save_top_k=2, monitor="step", mode="max", save_last=True)
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for checkpoints (default: a temporary one)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    out = args.out or tempfile.mkdtemp(prefix="nvckpt-lightning-")
    os.makedirs(out, exist_ok=True)

    # Second moments compress a little better at level 3; everything else keeps the defaults.
    plugin = NvcompCheckpointIO(policy=CodecPolicy(exp_avg_sq={"codec": "zstd", "level": 3}))
    pl.seed_everything(0, verbose=False)
    model = TinyLM()
    print(
        f"training a {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M-parameter model for {args.epochs} epochs; checkpoints in {out}"
    )
    trainer(out, args.epochs, plugin).fit(model, data())
    last = os.path.join(out, "last.ckpt")

    print(f"\nwhat the last save wrote ({plugin.last_report}):")
    print(plugin.last_report.table())

    # The same checkpoint as Lightning's default TorchCheckpointIO writes it.
    checkpoint = plugin.load_checkpoint(last)
    plain = os.path.join(out, "plain-torch-save.ckpt")
    TorchCheckpointIO().save_checkpoint(checkpoint, plain)
    ours, theirs = os.path.getsize(last), os.path.getsize(plain)
    print()
    print(
        format_table(
            ["writer", "file size", "smaller by"],
            [
                ["TorchCheckpointIO", format_bytes(theirs), "1.000x"],
                ["NvcompCheckpointIO", format_bytes(ours), f"{theirs / ours:.3f}x"],
            ],
        )
    )

    # Resume in a new Trainer from the compressed file (old plain .ckpt files load too).
    resumed = TinyLM()
    t2 = trainer(out, args.epochs + 1, plugin)
    t2.fit(resumed, data(), ckpt_path=last)
    print(f"\nresumed from {os.path.basename(last)} at step {checkpoint['global_step']}, trained on to step {t2.global_step}")

    # LightningModule.load_from_checkpoint reads files with torch.load; this helper decompresses
    # first. last.ckpt now holds the end of the resumed run.
    restored = load_from_checkpoint(TinyLM, last)
    same = all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), resumed.state_dict().values()))
    print(
        f"load_from_checkpoint({os.path.basename(last)}): hparams {dict(restored.hparams)}, weights "
        f"{'identical' if same else 'DIFFERENT'} to the resumed model"
    )
    if not same:
        raise SystemExit("load_from_checkpoint mismatch")


if __name__ == "__main__":
    main()
