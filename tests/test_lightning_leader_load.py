"""``NvcompCheckpointIO(leader_load=True)``: a DDP resume reads the checkpoint once per node.

A real ``Trainer`` on 2 CPU processes (DDP, gloo) saves compressed checkpoints; a fresh pair of
processes resumes from one through an fsspec file system that counts the bytes each process reads:
rank 0 reads the file, rank 1 reads nothing and receives the state over the process group, and
the resumed run has the uninterrupted run's next losses. A file missing on one rank only makes
every rank raise before the collective (the subprocess timeout fails a hang).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import nvcomp_checkpoint as nc  # noqa: E402
from conftest import run_python  # noqa: E402

_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import fsspec
    import torch
    import lightning as L
    from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
    from lightning.pytorch.callbacks import ModelCheckpoint
    from nvcomp_checkpoint.entrypoint import checked_on_every_rank
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO

    torch.set_num_threads(1)


    class CountingOpener(LocalFileOpener):
        def read(self, *args):
            data = self.f.read(*args)
            CountingFileSystem.bytes_read += len(data)
            return data

        def readinto(self, b):
            n = self.f.readinto(b) or 0
            CountingFileSystem.bytes_read += n
            return n


    class CountingFileSystem(LocalFileSystem):
        protocol = ("countfile",)
        bytes_read = 0

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            if "r" not in mode:
                return super()._open(path, mode, block_size, **kwargs)
            return CountingOpener(self._strip_protocol(path), mode, fs=self, **kwargs)


    fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.net(batch).square().mean()
            self.losses.append([self.global_step, float(loss)])
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            data = torch.randn(48, 24, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(data, batch_size=8)


    mode, root = sys.argv[1], Path(sys.argv[2])
    leader = mode == "resume"
    model = Net()
    plugin = NvcompCheckpointIO(leader_load=leader)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=root / mode, save_top_k=-1, every_n_epochs=1)],
    )
    ckpt = "countfile://" + str(root / "first" / "epoch=0-step=3.ckpt") if leader else None
    trainer.fit(model, ckpt_path=ckpt)
    out = {"losses": model.losses, "bytes_read": CountingFileSystem.bytes_read}
    if leader:
        # The file is missing on rank 1 only (a node-local disk): every rank raises, none waits in the collective.
        here = root / "first" / "epoch=0-step=3.ckpt" if trainer.global_rank == 0 else root / "absent.ckpt"
        try:
            plugin.load_checkpoint(here)
            out["missing_on_one_rank"] = "loaded"
        except Exception as exc:
            out["missing_on_one_rank"] = f"{type(exc).__name__}: {exc}"
        # Ranks whose checks find different things (here: their rank) refuse the collective together.
        try:
            checked_on_every_rank(lambda: trainer.global_rank, "probe", leader_load=True)
        except Exception as exc:
            out["differ"] = f"{type(exc).__name__}: {exc}"
    (root / f"{mode}_{trainer.global_rank}.json").write_text(json.dumps(out))
    """
)


def _run(script: Path, mode: str, root: Path, own_launcher: bool = False) -> None:
    run_python(str(script), mode, str(root), cwd=root, world=2, own_launcher=own_launcher)


@pytest.mark.slow
def test_ddp_resume_reads_the_checkpoint_on_one_rank_and_continues_the_run(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    _run(script, "first", tmp_path, own_launcher=True)  # Lightning's own DDP launcher starts rank 1
    ckpt = tmp_path / "first" / "epoch=0-step=3.ckpt"
    assert nc.is_nvcomp_checkpoint(ckpt)

    _run(script, "resume", tmp_path)
    first = [json.loads((tmp_path / f"first_{r}.json").read_text()) for r in (0, 1)]
    resumed = [json.loads((tmp_path / f"resume_{r}.json").read_text()) for r in (0, 1)]
    size = ckpt.stat().st_size
    # Rank 0 read the file (once, plus at most a header's worth); rank 1 read none of it.
    assert size <= resumed[0]["bytes_read"] < 2 * size, (resumed[0]["bytes_read"], size)
    assert resumed[1]["bytes_read"] == 0
    assert resumed[1]["missing_on_one_rank"].startswith("FileNotFoundError: "), resumed[1]
    assert resumed[0]["missing_on_one_rank"].startswith("CheckpointError: "), resumed[0]
    assert "rank 1 failed before the collective load" in resumed[0]["missing_on_one_rank"]
    assert "absent.ckpt" in resumed[0]["missing_on_one_rank"]
    for rank in (0, 1):
        assert resumed[rank]["differ"].startswith("CheckpointError: probe: the ranks see different checkpoint files"), resumed[
            rank
        ]
    for rank in (0, 1):
        full = first[rank]["losses"]
        assert [s for s, _ in full] == list(range(6))
        assert resumed[rank]["losses"] == full[3:], rank


def test_without_a_process_group_leader_load_is_a_plain_load(tmp_path: Path) -> None:
    import torch

    from nvcomp_checkpoint.lightning import NvcompCheckpointIO

    state = {"state_dict": {"w": torch.randn(64, 32), "b": torch.arange(7, dtype=torch.bfloat16)}, "global_step": 3}
    plugin = NvcompCheckpointIO(leader_load=True)
    plugin.save_checkpoint(state, tmp_path / "a.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["global_step"] == 3
    for key, tensor in state["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], tensor)
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
