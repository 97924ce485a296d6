"""The Lightning plugin, driven by the real Trainer and Fabric with a tiny model on the CPU."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from nvcomp_checkpoint import CodecPolicy  # noqa: E402
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError, UnsafeCheckpointError  # noqa: E402
from nvcomp_checkpoint.lightning import NvcompCheckpointIO, load_from_checkpoint  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
BATCHES_PER_EPOCH = 4
N_EPOCHS = 2  # trained before the checkpoint that is resumed (N = 8 steps)
M_EPOCHS = 2  # trained after it (M = 8 steps)


# -- the model and the run, shared with the fresh process that resumes -----------------------
class TinyModule(pl.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
            torch.nn.Linear(hidden, 8),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def tiny_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16 * BATCHES_PER_EPOCH, 32, generator=g), torch.randn(16 * BATCHES_PER_EPOCH, 8, generator=g)
    # No shuffling: a resumed epoch sees the same batches as the uninterrupted one.
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class LossLog(pl.Callback):
    """Records (global step, loss) of every batch; writes them as JSON when given a path."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.losses: list[list[float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append([trainer.global_step, outputs["loss"].item()])

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps(self.losses))


class DumpRestoredState(pl.Callback):
    """Saves (plain torch.save) the model and optimizer state as restored, before training goes on."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        torch.save({"state_dict": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}, self.path)


def fit_tiny(
    root: str | os.PathLike[str],
    max_epochs: int,
    plugins: list[Any] | None = None,
    callbacks: list[Any] | None = None,
    ckpt_path: str | os.PathLike[str] | None = None,
    **trainer_kwargs: Any,
) -> tuple[Any, TinyModule, list[list[float]]]:
    """Seed, build a fresh TinyModule and Trainer, fit; returns (trainer, model, losses)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    pl.seed_everything(0, verbose=False)
    log = LossLog()
    trainer = pl.Trainer(
        default_root_dir=str(root), max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=plugins or [],
        callbacks=[log, *(callbacks or [])], **trainer_kwargs,
    )
    model = TinyModule()
    trainer.fit(model, tiny_data(), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trainer, model, log.losses


def every_epoch(dirpath: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(dirpath), save_top_k=-1, filename="{epoch}-{step}")


def ckpt_name(epochs: int) -> str:
    return f"epoch={epochs - 1}-step={epochs * BATCHES_PER_EPOCH}.ckpt"


RESUME_SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
from test_lightning import DumpRestoredState, LossLog, fit_tiny
from nvcomp_checkpoint.lightning import NvcompCheckpointIO

fit_tiny({root!r}, {epochs}, plugins=[NvcompCheckpointIO()], ckpt_path={ckpt!r},
         callbacks=[DumpRestoredState({dump!r}), LossLog({losses!r})])
"""


# -- two runs shared by the tests: N epochs with the plugin, N+M epochs with torch.save -------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("lightning-runs")
    nvc_dir, plain_dir = base / "nvcomp", base / "plain"
    plugin = NvcompCheckpointIO()
    _, _, nvc_losses = fit_tiny(nvc_dir, N_EPOCHS, plugins=[plugin], callbacks=[every_epoch(nvc_dir)])
    _, _, plain_losses = fit_tiny(plain_dir, N_EPOCHS + M_EPOCHS, callbacks=[every_epoch(plain_dir)])
    return {
        "nvc_ckpt": nvc_dir / ckpt_name(N_EPOCHS),
        "plain_ckpt": plain_dir / ckpt_name(N_EPOCHS),
        "plain_dir": plain_dir,
        "nvc_losses": nvc_losses,
        "plain_losses": plain_losses,
        "report": plugin.last_report,
    }


def test_resume_in_a_fresh_process_continues_the_uninterrupted_run(runs, tmp_path):
    n_steps = N_EPOCHS * BATCHES_PER_EPOCH
    assert runs["nvc_losses"] == runs["plain_losses"][:n_steps]  # the plugin changes nothing in training
    assert nc.is_nvcomp_checkpoint(runs["nvc_ckpt"])

    dump, losses = tmp_path / "restored.pt", tmp_path / "losses.json"
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.format(
        tests=str(TESTS_DIR), root=str(tmp_path / "resumed"), epochs=N_EPOCHS + M_EPOCHS,
        ckpt=str(runs["nvc_ckpt"]), dump=str(dump), losses=str(losses),
    ))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # Model and optimizer state as restored in the fresh process == the uninterrupted run at step N.
    restored = torch.load(dump, weights_only=True)
    at_n = torch.load(runs["plain_ckpt"], weights_only=True)
    assert_tree_equal(at_n["state_dict"], restored["state_dict"], "state_dict")
    assert_tree_equal(at_n["optimizer_states"][0], restored["optimizer"], "optimizer")
    # ... and the M steps after it produce the same losses, bit for bit.
    assert json.loads(losses.read_text()) == runs["plain_losses"][n_steps:]


def test_checkpoint_files_are_smaller_than_torch_checkpoint_io(runs):
    nvc, plain = runs["nvc_ckpt"].stat().st_size, runs["plain_ckpt"].stat().st_size
    assert nvc < 0.95 * plain, f"{nvc} bytes vs {plain} bytes written by TorchCheckpointIO"
    report = runs["report"]
    assert report is not None and report.stored_bytes == nvc
    assert {"weights", "exp_avg", "exp_avg_sq"} <= set(report.components)
    assert "exp_avg_sq" in report.table()


def test_a_run_that_adds_the_plugin_resumes_from_its_plain_ckpt(runs, tmp_path):
    assert not nc.is_nvcomp_checkpoint(runs["plain_ckpt"])
    _, _, losses = fit_tiny(
        tmp_path, N_EPOCHS + M_EPOCHS, plugins=[NvcompCheckpointIO()], ckpt_path=runs["plain_ckpt"],
        callbacks=[every_epoch(tmp_path)],
    )
    assert losses == runs["plain_losses"][N_EPOCHS * BATCHES_PER_EPOCH :]
    assert nc.is_nvcomp_checkpoint(tmp_path / ckpt_name(N_EPOCHS + M_EPOCHS))  # new saves are compressed


@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
def test_a_corrupt_checkpoint_fails_the_resume_naming_the_file(runs, tmp_path, damage):
    bad = tmp_path / "damaged.ckpt"
    data = bytearray(runs["nvc_ckpt"].read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        fit_tiny(tmp_path / "run", N_EPOCHS + M_EPOCHS, plugins=[NvcompCheckpointIO()], ckpt_path=bad)
    assert str(bad) in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_plain_ckpt_saved_on_a_gpu_loads_on_a_cpu_only_machine(tmp_path, monkeypatch):
    ckpt = _checkpoint()
    with monkeypatch.context() as m:  # torch.save records every storage as saved from cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(ckpt, tmp_path / "gpu.ckpt")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "gpu.ckpt", weights_only=True)
    assert_tree_equal(TorchCheckpointIO().load_checkpoint(tmp_path / "gpu.ckpt"), ckpt)
    assert_tree_equal(NvcompCheckpointIO().load_checkpoint(tmp_path / "gpu.ckpt"), ckpt)


def test_missing_checkpoint_raises_file_not_found_as_torch_checkpoint_io(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.ckpt"):
        NvcompCheckpointIO().load_checkpoint(tmp_path / "nothing.ckpt")


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of the given size mounted in tmp_path (root only); None where mounting is refused."""
    mounted: list[Path] = []

    def mount(size: int) -> Path | None:
        where = tmp_path / "small-disk"
        where.mkdir()
        if os.geteuid() != 0 or not shutil.which("mount"):
            return None
        size = (size + 4095) // 4096 * 4096
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if proc.returncode != 0:
            return None
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_save_that_fills_the_disk_leaves_the_previous_checkpoint(runs, tmp_path, small_disk, monkeypatch):
    # Room for one checkpoint and a half: the first save fits, the second runs out of space.
    disk = small_disk(int(1.5 * runs["nvc_ckpt"].stat().st_size))
    if disk is None:
        # Not root, or no mount here: the disk "fills" at the fsync of the second save (where a
        # full disk shows up on file systems with delayed allocation).
        disk = tmp_path / "small-disk"
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            done = [p for p in disk.iterdir() if p.name.endswith(".ckpt") and not p.name.startswith(".")]
            if stat.S_ISREG(os.fstat(fd).st_mode) and done:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    # save_top_k=1 without a monitor rotates: save epoch 1, then delete epoch 0.
    rotating = ModelCheckpoint(dirpath=str(disk), save_top_k=1, filename="{epoch}-{step}")
    with pytest.raises(CheckpointWriteError, match="disk is full") as info:
        fit_tiny(tmp_path / "run", 2, plugins=[NvcompCheckpointIO()], callbacks=[rotating])
    assert ckpt_name(2) in str(info.value)
    assert [p.name for p in disk.iterdir()] == [ckpt_name(1)]  # no temporary file left behind
    state = NvcompCheckpointIO().load_checkpoint(disk / ckpt_name(1))
    assert state["global_step"] == BATCHES_PER_EPOCH and state["optimizer_states"]


def test_model_checkpoint_keeps_top_k_and_removes_the_rest(tmp_path):
    top_k = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), monitor="step", mode="max", save_top_k=2,
                            filename="{step}", save_last=True)
    trainer, model, _ = fit_tiny(tmp_path, 4, plugins=[NvcompCheckpointIO()], callbacks=[top_k])
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["last.ckpt", "step=12.ckpt", "step=16.ckpt"]
    assert all(nc.is_nvcomp_checkpoint(tmp_path / "ckpts" / n) for n in names)
    best = NvcompCheckpointIO().load_checkpoint(top_k.best_model_path)
    assert best["global_step"] == 16
    assert_tree_equal(model.state_dict(), best["state_dict"])


def test_async_checkpoint_io_wrapping_the_plugin(runs, tmp_path):
    # Every epoch kept: Lightning's AsyncCheckpointIO removes old top-k files on the caller's
    # thread while their saves may still be queued (Lightning issue 14035), whatever the plugin.
    plugin = NvcompCheckpointIO()
    epochs = N_EPOCHS + M_EPOCHS
    keep_all = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1, filename="{epoch}-{step}", save_last=True)
    trainer, model, _ = fit_tiny(tmp_path, epochs, plugins=[AsyncCheckpointIO(plugin)], callbacks=[keep_all])
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == sorted(["last.ckpt", *(ckpt_name(e) for e in range(1, epochs + 1))])
    # Each file holds the state at its own step, as the synchronous torch.save run wrote it,
    # not a mix of steps (the save ran in a thread while training went on).
    for e in range(1, epochs + 1):
        ours = plugin.load_checkpoint(tmp_path / "ckpts" / ckpt_name(e))
        plain = torch.load(runs["plain_dir"] / ckpt_name(e), weights_only=True)
        assert ours["global_step"] == plain["global_step"] == e * BATCHES_PER_EPOCH
        assert_tree_equal(plain["state_dict"], ours["state_dict"], ckpt_name(e))
        assert_tree_equal(plain["optimizer_states"], ours["optimizer_states"], ckpt_name(e))
    last = plugin.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert_tree_equal(model.state_dict(), last["state_dict"])
    assert_tree_equal(trainer.optimizers[0].state_dict(), last["optimizer_states"][0])
    assert plugin.last_report is not None


def test_load_from_checkpoint(runs):
    model = load_from_checkpoint(TinyModule, runs["nvc_ckpt"])
    saved = NvcompCheckpointIO().load_checkpoint(runs["nvc_ckpt"])
    assert isinstance(model, TinyModule) and model.hparams.hidden == 256
    assert_tree_equal(saved["state_dict"], model.state_dict())
    # kwargs override saved hyper-parameters, as with LightningModule.load_from_checkpoint
    assert load_from_checkpoint(TinyModule, runs["nvc_ckpt"], lr=0.5).hparams.lr == 0.5
    # a plain checkpoint goes straight to Lightning
    plain = load_from_checkpoint(TinyModule, runs["plain_ckpt"])
    assert_tree_equal(torch.load(runs["plain_ckpt"], weights_only=True)["state_dict"], plain.state_dict())


def test_fabric_save_and_load(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[NvcompCheckpointIO()])
    assert isinstance(fabric.strategy.checkpoint_io, NvcompCheckpointIO)

    def setup(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        module = TinyModule()
        return fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))

    def step(model: Any, opt: Any, i: int) -> float:
        x, y = [t[i * 16 : (i + 1) * 16] for t in tiny_data().dataset.tensors]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        return loss.item()

    model, opt = setup(0)
    for i in range(3):
        step(model, opt, i)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
    assert nc.is_nvcomp_checkpoint(path)

    model2, opt2 = setup(1)  # different weights, empty optimizer state
    remainder = fabric.load(path, {"model": model2, "optimizer": opt2})
    assert remainder == {"step": 3}
    assert_tree_equal(model.state_dict(), model2.state_dict())
    assert_tree_equal(opt.state_dict(), opt2.state_dict())
    assert [step(model, opt, 3)] == [step(model2, opt2, 3)]
    full = fabric.load(path)
    assert full["step"] == 3 and set(full) == {"model", "optimizer", "step"}


def _checkpoint() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 0, "global_step": 1}


def test_storage_options_choose_the_policy_of_one_save(tmp_path):
    plugin = NvcompCheckpointIO()
    ckpt = _checkpoint()
    plugin.save_checkpoint(ckpt, tmp_path / "raw.ckpt", storage_options={"policy": CodecPolicy.uniform("none")})
    assert all(s.codecs == ("none",) for s in plugin.last_report.components.values())
    plugin.save_checkpoint(ckpt, tmp_path / "mixed.ckpt", storage_options={
        "exp_avg_sq": {"codec": "zstd", "level": 3, "filter": "none"}, "metadata": {"note": "x"},
    })
    with nc.open(tmp_path / "mixed.ckpt") as reader:
        entry = reader.entry("optimizer_states/0/state/0/exp_avg_sq")
        assert (entry.codec.id, entry.codec.level, entry.filter) == ("zstd", 3, "none")
        assert reader.entry("state_dict/weight").filter == "byteplane"  # the plugin's policy elsewhere
        assert reader.metadata["note"] == "x" and reader.metadata["global_step"] == 1
    assert_tree_equal(ckpt, plugin.load_checkpoint(tmp_path / "mixed.ckpt"))
    assert plugin.policy == CodecPolicy()  # per-save options do not stick


def test_storage_options_reject_what_they_cannot_honour(tmp_path):
    plugin = NvcompCheckpointIO()
    with pytest.raises(ValueError, match=r"unknown storage_options key\(s\) \['compresion'\].*'policy'.*exp_avg"):
        plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt", storage_options={"compresion": "zstd"})
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt", storage_options="zstd")
    with pytest.raises(ValueError, match="unknown codec"):
        plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt", storage_options={"weights": "lz5"})
    assert not any(tmp_path.iterdir())  # nothing was written


def test_trainer_save_checkpoint_passes_storage_options(tmp_path):
    trainer, _, _ = fit_tiny(tmp_path, 1, plugins=[NvcompCheckpointIO()], enable_checkpointing=False)
    trainer.save_checkpoint(tmp_path / "manual.ckpt", storage_options={"weights": "none", "metadata": {"run": "a"}})
    with nc.open(tmp_path / "manual.ckpt") as reader:
        assert reader.summary()["weights"].codecs == ("none",)
        assert reader.metadata["run"] == "a"
    with pytest.raises(ValueError, match="unknown storage_options"):
        trainer.save_checkpoint(tmp_path / "bad.ckpt", storage_options={"bogus": 1})


class Opaque:
    """Not a type that a weights-only load may construct."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


@pytest.mark.parametrize("force", [None, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"])
@pytest.mark.parametrize("weights_only", [None, True, False])
def test_weights_only_behaves_as_torch_checkpoint_io(tmp_path, monkeypatch, weights_only, force):
    if force:
        monkeypatch.setenv(force, "1")
    ckpt = {**_checkpoint(), "hyper_parameters": {"thing": Opaque()}}
    torch_io, ours = TorchCheckpointIO(), NvcompCheckpointIO()
    torch_io.save_checkpoint(ckpt, tmp_path / "plain.ckpt")
    ours.save_checkpoint(ckpt, tmp_path / "nvc.ckpt")

    def outcome(io: Any, path: Path) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                loaded = io.load_checkpoint(path, weights_only=weights_only)
            except (pickle.UnpicklingError, UnsafeCheckpointError):
                return "refused"
        assert_tree_equal(ckpt, loaded)
        return "loaded"

    expected = outcome(torch_io, tmp_path / "plain.ckpt")
    assert outcome(ours, tmp_path / "nvc.ckpt") == expected
    assert outcome(ours, tmp_path / "plain.ckpt") == expected  # old plain files follow the same rule
    if expected == "refused":
        with pytest.raises(UnsafeCheckpointError, match=r"weights_only=False to trainer\.fit"):
            ours.load_checkpoint(tmp_path / "nvc.ckpt", weights_only=weights_only)


def test_one_class_is_accepted_by_trainer_and_fabric(tmp_path):
    plugin = NvcompCheckpointIO()
    trainer = pl.Trainer(default_root_dir=str(tmp_path), plugins=[plugin], logger=False, accelerator="cpu")
    assert trainer.strategy.checkpoint_io is plugin
    assert Fabric(accelerator="cpu", plugins=[plugin]).strategy.checkpoint_io is plugin


def test_the_standalone_pytorch_lightning_package_accepts_it_too(tmp_path):
    standalone = pytest.importorskip("pytorch_lightning")
    plugin = NvcompCheckpointIO()  # registers with the standalone package's CheckpointIO
    assert standalone.Trainer(default_root_dir=str(tmp_path), plugins=[plugin], logger=False,
                              accelerator="cpu").strategy.checkpoint_io is plugin


def test_remove_checkpoint(tmp_path):
    plugin = NvcompCheckpointIO()
    plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "never-there.ckpt")
    assert not any(tmp_path.iterdir())
    plugin.teardown()
