"""Lightning example: compressed checkpoints written in the background, with their metrics logged.

Trains the same small model twice, saving every few steps (top-1 rotation plus ``last.ckpt``): once
with synchronous saves, once with ``NvcompCheckpointIO(async_save=True)``; prints how long training
waited for checkpoints in each run and what ``NvcompCheckpointMetrics`` wrote to the CSV logger.
``python examples/lightning_async_example.py`` runs on the CPU in about 75 s on an idle 2-core machine
(two training runs; longer on a busy one). Without ``--out DIR`` it leaves both runs in a temporary folder
(``$TMPDIR/nvckpt-lightning-async-*``); delete it when done.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import tempfile
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from nvcomp_checkpoint import SaveReport
from nvcomp_checkpoint.lightning import NvcompCheckpointIO, NvcompCheckpointMetrics
from nvcomp_checkpoint.report import format_bytes, format_table

VOCAB = 512


class TinyLM(pl.LightningModule):
    def __init__(self, dim: int = 256, layers: int = 4, lr: float = 1e-3) -> None:
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
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data(batches: int) -> torch.utils.data.DataLoader:
    x = torch.randint(0, VOCAB, (8 * batches, 32), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=8)


def run(out: str, async_save: bool, steps: int, every: int) -> dict[str, Any]:
    """One training run; returns the wall time and what the saves cost the training loop."""
    durable: list[SaveReport] = []
    # on_saved: the "checkpoint finished" hook; with async_save it runs on the save thread.
    # max_pending=2: the top-k file and last.ckpt of one step are both in flight without waiting
    # for each other (two snapshots in host memory at most).
    plugin = NvcompCheckpointIO(async_save=async_save, max_pending=2, on_saved=durable.append)
    ckpt = ModelCheckpoint(
        dirpath=out, filename="{step}", monitor="step", mode="max", save_top_k=1, every_n_train_steps=every, save_last=True
    )
    trainer = pl.Trainer(
        default_root_dir=out,
        max_steps=steps,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin],
        callbacks=[ckpt, NvcompCheckpointMetrics()],
        logger=CSVLogger(out, name="logs", version=0),
        log_every_n_steps=every,
    )
    pl.seed_everything(0, verbose=False)
    start = time.perf_counter()
    trainer.fit(TinyLM(), data(steps))
    wall = time.perf_counter() - start
    return {
        "wall": wall,
        "saves": len(durable),
        "blocked": sum(r.seconds_blocked or 0.0 for r in durable),
        "seconds": sum(r.seconds for r in durable),
        "raw": durable[-1].raw_bytes,
        "stored": durable[-1].stored_bytes,
        "csv": os.path.join(out, "logs", "version_0", "metrics.csv"),
        "files": sorted(n for n in os.listdir(out) if n.endswith(".ckpt")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--every", type=int, default=6, help="save every N steps")
    parser.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="(lightning|pytorch_lightning|lightning_fabric)")
    base = args.out or tempfile.mkdtemp(prefix="nvckpt-lightning-async-")

    results = {}
    for mode in ("sync", "async"):
        results[mode] = run(os.path.join(base, mode), mode == "async", args.steps, args.every)
    r = results["async"]
    print(
        f"{args.steps} steps, a checkpoint every {args.every} (top-1 + last.ckpt): {r['saves']} saves of "
        f"{format_bytes(r['raw'])} -> {format_bytes(r['stored'])} ({r['raw'] / r['stored']:.3f}x); runs in {base}"
    )
    print(
        format_table(
            ["saves", "fit wall time", "training blocked by saves", "save time until durable", "files left"],
            [
                [mode, f"{x['wall']:.2f} s", f"{x['blocked']:.2f} s", f"{x['seconds']:.2f} s", " ".join(x["files"])]
                for mode, x in results.items()
            ],
        )
    )

    # What NvcompCheckpointMetrics sent to the Trainer's logger (here a CSVLogger).
    with open(r["csv"], newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("nvckpt/ratio")]
    print(f"\n{r['csv']} (async run, one row per save):")
    print(
        format_table(
            ["step", "ratio", "weights", "exp_avg", "exp_avg_sq", "blocked s", "total s", "MB/s"],
            [
                [
                    row["step"],
                    f"{float(row['nvckpt/ratio']):.3f}x",
                    f"{float(row['nvckpt/ratio/weights']):.3f}x",
                    f"{float(row['nvckpt/ratio/exp_avg']):.3f}x",
                    f"{float(row['nvckpt/ratio/exp_avg_sq']):.3f}x",
                    f"{float(row['nvckpt/seconds_blocked']):.3f}",
                    f"{float(row['nvckpt/seconds']):.3f}",
                    f"{float(row['nvckpt/throughput_mb_s']):.0f}",
                ]
                for row in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
