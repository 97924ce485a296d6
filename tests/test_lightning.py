"""The Lightning plugin, driven by the real Trainer and Fabric with a tiny model on the CPU."""

from __future__ import annotations

import csv
import errno
import json
import logging
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import fresh_process  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint import CodecPolicy  # noqa: E402
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError, FormatError, UnsafeCheckpointError  # noqa: E402
from nvcomp_checkpoint.lightning import (  # noqa: E402
    NvcompCheckpointIO,
    NvcompCheckpointMetrics,
    NvcompModelCheckpoint,
    load_from_checkpoint,
)

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
            torch.nn.Linear(32, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.Tanh(),
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
    trainer_kwargs.setdefault("logger", False)
    trainer = pl.Trainer(
        default_root_dir=str(root),
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins or [],
        callbacks=[log, *(callbacks or [])],
        **trainer_kwargs,
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

fit_tiny({root!r}, {epochs}, plugins=[NvcompCheckpointIO(async_save={async_save})], ckpt_path={ckpt!r},
         callbacks=[DumpRestoredState({dump!r}), LossLog({losses!r})])
"""


class SlowStream:
    """Holds the first write of each file for ``delay`` seconds: a slow disk or object store.

    With ``gate``, the first write also waits (up to 60 s) until that event is set: a store as
    slow as the test needs, however slow the machine is.
    """

    def __init__(self, inner: IO[bytes], delay: float, gate: threading.Event | None = None) -> None:
        self.inner, self.delay, self.first, self.gate = inner, delay, True, gate

    def write(self, data: Any) -> int:
        if self.first:
            self.first = False
            time.sleep(self.delay)
            if self.gate is not None:
                assert self.gate.wait(60), "the test never released the write"
        return self.inner.write(data)


def slow(delay: float) -> Any:
    return lambda stream: SlowStream(stream, delay)


def held(gate: threading.Event) -> Any:
    return lambda stream: SlowStream(stream, 0.0, gate)


class FailingSaves:
    """A stream wrapper whose saves number ``fail`` (1-based) and later hit a full disk (ENOSPC)."""

    def __init__(self, *fail: int) -> None:
        self.fail, self.count = set(fail), 0

    def __call__(self, stream: IO[bytes]) -> IO[bytes]:
        self.count += 1
        return DiskFull(stream) if self.count in self.fail else stream


class DiskFull:
    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The N-epoch run of ``runs`` again, with every checkpoint written in the background."""
    base = tmp_path_factory.mktemp("lightning-async-run")
    plugin = NvcompCheckpointIO(async_save=True)
    trainer, _, losses = fit_tiny(base, N_EPOCHS, plugins=[plugin], callbacks=[every_epoch(base)])
    return {"dir": base, "nvc_ckpt": base / ckpt_name(N_EPOCHS), "nvc_losses": losses, "plugin": plugin}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_in_a_fresh_process_continues_the_uninterrupted_run(runs, async_run, tmp_path, mode):
    n_steps = N_EPOCHS * BATCHES_PER_EPOCH
    saved = runs if mode == "sync" else async_run
    assert saved["nvc_losses"] == runs["plain_losses"][:n_steps]  # the plugin changes nothing in training
    assert nc.is_nvcomp_checkpoint(saved["nvc_ckpt"])

    dump, losses = tmp_path / "restored.pt", tmp_path / "losses.json"
    script = tmp_path / "resume.py"
    script.write_text(
        RESUME_SCRIPT.format(
            tests=str(TESTS_DIR),
            root=str(tmp_path / "resumed"),
            epochs=N_EPOCHS + M_EPOCHS,
            ckpt=str(saved["nvc_ckpt"]),
            dump=str(dump),
            losses=str(losses),
            async_save=mode == "async",
        )
    )
    proc = fresh_process.run([str(script)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # Model and optimizer state as restored in the fresh process == the uninterrupted run at step N.
    restored = torch.load(dump, weights_only=True)
    at_n = torch.load(runs["plain_ckpt"], weights_only=True)
    assert_tree_equal(at_n["state_dict"], restored["state_dict"], "state_dict")
    assert_tree_equal(at_n["optimizer_states"][0], restored["optimizer"], "optimizer")
    # ... and the M steps after it produce the same losses, bit for bit.
    assert json.loads(losses.read_text()) == runs["plain_losses"][n_steps:]
    # The resumed run's default ModelCheckpoint (top-1) rotated its saves; the last one landed
    # before the process exited.
    kept = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == [ckpt_name(N_EPOCHS + M_EPOCHS)]
    assert nc.load(kept / ckpt_name(N_EPOCHS + M_EPOCHS))["global_step"] == (N_EPOCHS + M_EPOCHS) * BATCHES_PER_EPOCH


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
        tmp_path,
        N_EPOCHS + M_EPOCHS,
        plugins=[NvcompCheckpointIO()],
        ckpt_path=runs["plain_ckpt"],
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
    top_k = ModelCheckpoint(
        dirpath=str(tmp_path / "ckpts"), monitor="step", mode="max", save_top_k=2, filename="{step}", save_last=True
    )
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
    # Lightning's own loaders read a compressed file with torch.load, which has no hook for another
    # format: the file's guard makes torch name ours (docs/lightning.md, "What stock loaders say").
    from lightning.fabric.utilities.cloud_io import _load as fabric_load
    from lightning.pytorch.core.saving import pl_load

    hints = ("nvcomp_checkpoint.load(path)", "Trainer(plugins=[NvcompCheckpointIO()])")
    for weights_only in (None, True):  # None: torch's default, weights-only
        for stock in (
            lambda: TinyModule.load_from_checkpoint(runs["nvc_ckpt"], weights_only=weights_only),
            lambda: pl_load(runs["nvc_ckpt"], weights_only=weights_only),
            lambda: fabric_load(str(runs["nvc_ckpt"]), weights_only=weights_only),
        ):
            with pytest.raises(pickle.UnpicklingError) as caught:
                stock()
            assert all(hint in str(caught.value) for hint in hints), str(caught.value)
    # Torch's advice, weights_only=False, reaches our refusal, which names the plugin's loaders.
    for stock in (
        lambda: TinyModule.load_from_checkpoint(runs["nvc_ckpt"], weights_only=False),
        lambda: fabric_load(runs["nvc_ckpt"], weights_only=False),
        # What a Trainer without the plugin resumes with.
        lambda: TorchCheckpointIO().load_checkpoint(runs["nvc_ckpt"], weights_only=False),
    ):
        with pytest.raises(FormatError) as refused:
            stock()
        assert all(h in str(refused.value) for h in (*hints, "NvcompCheckpointIO().load_checkpoint")), str(refused.value)


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
    plugin.save_checkpoint(
        ckpt,
        tmp_path / "mixed.ckpt",
        storage_options={
            "exp_avg_sq": {"codec": "zstd", "level": 3, "filter": "none"},
            "metadata": {"note": "x"},
        },
    )
    with nc.open(tmp_path / "mixed.ckpt") as reader:
        entry = reader.entry("optimizer_states/0/state/0/exp_avg_sq")
        assert (entry.codec.id, entry.codec.level, entry.filter) == ("zstd", 3, "none")
        assert reader.entry("state_dict/weight").filter == "rotplane"  # the plugin's (default) policy elsewhere
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
    assert (
        standalone.Trainer(
            default_root_dir=str(tmp_path), plugins=[plugin], logger=False, accelerator="cpu"
        ).strategy.checkpoint_io
        is plugin
    )


def test_remove_checkpoint(tmp_path):
    plugin = NvcompCheckpointIO()
    plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "never-there.ckpt")
    assert not any(tmp_path.iterdir())
    plugin.teardown()


def test_deepspeed_folders_removed_by_model_checkpoint_wait_for_the_deltas_that_need_them(tmp_path):
    # NvcompDeepSpeedStrategy's engine saves each rank file through the plugin's session (incremental=True) as
    # <checkpoint>/checkpoint/<rank file>; ModelCheckpoint removes whole folders, knowing nothing of chains.
    from nvcomp_checkpoint.incremental import DEFERRED_NAME, unit_base_of

    rank_file = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def save(plugin: NvcompCheckpointIO, name: str, step: int) -> str | None:
        path = tmp_path / name / "checkpoint" / rank_file
        path.parent.mkdir(parents=True)
        assert plugin.incremental is not None
        base = plugin.incremental.base_for(path, slot=rank_file)  # what the attached engine asks
        nc.save({"w": torch.full((256,), float(step))}, path, base=base)
        return base

    def file_of(name: str) -> str:
        return str(tmp_path / name / "checkpoint" / rank_file)

    plugin = NvcompCheckpointIO(incremental=True)
    assert save(plugin, "step=1.ckpt", 1) is None
    assert save(plugin, "step=2.ckpt", 2) == file_of("step=1.ckpt")
    assert save(plugin, "last.ckpt", 2) == file_of("step=2.ckpt")
    assert save(plugin, "step=3.ckpt", 3) == file_of("step=2.ckpt")  # last.ckpt, rewritten in place, is no base
    # The tiers and the removals find a folder's base unit through its tag folder.
    assert unit_base_of(str(tmp_path / "step=3.ckpt")) == str(tmp_path / "step=2.ckpt")

    def left() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir())

    plugin.remove_checkpoint(tmp_path / "step=1.ckpt")  # step=2 needs it
    assert left() == [DEFERRED_NAME, "last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert json.loads((tmp_path / DEFERRED_NAME).read_text()) == ["step=1.ckpt"]
    # A resumed run (a fresh plugin) reads the chains from the files and the deferred list from the folder.
    fresh = NvcompCheckpointIO(incremental=True)
    fresh.remove_checkpoint(tmp_path / "step=2.ckpt")  # last.ckpt and step=3 need it
    assert json.loads((tmp_path / DEFERRED_NAME).read_text()) == ["step=1.ckpt", "step=2.ckpt"]
    fresh.remove_checkpoint(tmp_path / "last.ckpt")
    assert left() == [DEFERRED_NAME, "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    fresh.remove_checkpoint(tmp_path / "step=3.ckpt")  # nothing needs the chain any more: it goes whole
    assert left() == []


# -- async saves ------------------------------------------------------------------------------
def _complete_checkpoints(directory: Path) -> list[str]:
    """The checkpoint files a reader sees (a save in progress is a hidden temporary file)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".ckpt" and not p.name.startswith("."))


def test_async_checkpoints_hold_the_state_of_their_own_step(runs, async_run):
    # Training changed the parameters while each file was still being written; the snapshot
    # taken by save_checkpoint is what landed, bit for bit as the synchronous torch.save run.
    for e in range(1, N_EPOCHS + 1):
        ours = NvcompCheckpointIO().load_checkpoint(async_run["dir"] / ckpt_name(e))
        plain = torch.load(runs["plain_dir"] / ckpt_name(e), weights_only=True)
        assert ours["global_step"] == plain["global_step"] == e * BATCHES_PER_EPOCH
        assert_tree_equal(plain["state_dict"], ours["state_dict"], ckpt_name(e))
        assert_tree_equal(plain["optimizer_states"], ours["optimizer_states"], ckpt_name(e))
    report = async_run["plugin"].last_report
    assert report is not None and report.path == str(async_run["nvc_ckpt"])
    assert report.stored_bytes == async_run["nvc_ckpt"].stat().st_size
    assert async_run["plugin"].pending() == 0


class DirectoryWatch:
    """Polls a checkpoint directory from a thread: when each complete checkpoint appeared and went."""

    def __init__(self, directory: Path, interval: float = 0.005) -> None:
        self.directory, self.interval = directory, interval
        self.appeared: dict[str, float] = {}
        self.vanished: dict[str, float] = {}
        self.empty_after_first: list[float] = []  # moments with no complete top-k checkpoint on disk
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seen: set[str] = set()
        while not self._stop.is_set():
            now = time.perf_counter()
            names = {n for n in _complete_checkpoints(self.directory) if n != "last.ckpt"}
            for name in names - seen:
                self.appeared.setdefault(name, now)
            for name in seen - names:
                self.vanished.setdefault(name, now)
            if self.appeared and not names:
                self.empty_after_first.append(now)
            seen = names
            time.sleep(self.interval)

    def __enter__(self) -> "DirectoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class RotationWatch(NvcompCheckpointIO):
    """The plugin, noting whether each save and removal returned while a write was still pending."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pending_after_save: list[int] = []
        self.pending_after_remove: list[int] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.pending_after_save.append(self.pending())

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        self.pending_after_remove.append(self.pending())


def test_async_top_k_rotation_never_removes_the_old_file_before_the_new_one_is_durable(tmp_path):
    # A slow store (each file's first write held 0.3 s) and top-1 rotation every 2 steps:
    # Lightning's AsyncCheckpointIO deletes the old best while the new one is still queued
    # (Lightning issue 14035); this plugin deletes it only once the new one is durable, without
    # holding up training meanwhile.
    ckpts = tmp_path / "ckpts"
    delay = 0.3
    plugin = RotationWatch(async_save=True, stream_wrapper=slow(delay))
    top1 = ModelCheckpoint(
        dirpath=str(ckpts), monitor="step", mode="max", save_top_k=1, every_n_train_steps=2, filename="{step}", save_last=True
    )
    with DirectoryWatch(ckpts) as watch:
        trainer, model, _ = fit_tiny(tmp_path, 2, plugins=[plugin], callbacks=[top1])

    # Saves and removals returned while the new file was still being written ...
    assert plugin.pending_after_save and min(plugin.pending_after_save) >= 1
    assert len(plugin.pending_after_remove) == 3 and min(plugin.pending_after_remove) >= 1
    # ... yet on disk, each old best went only after the next one had appeared, complete.
    assert watch.empty_after_first == []
    assert sorted(watch.vanished) == [f"step={s}.ckpt" for s in (2, 4, 6)]
    for old, new in zip((2, 4, 6), (4, 6, 8)):
        assert watch.vanished[f"step={old}.ckpt"] >= watch.appeared[f"step={new}.ckpt"], (old, new)
    assert _complete_checkpoints(ckpts) == ["last.ckpt", "step=8.ckpt"]
    best = NvcompCheckpointIO().load_checkpoint(top1.best_model_path)
    assert best["global_step"] == 8
    assert_tree_equal(model.state_dict(), best["state_dict"])
    assert_tree_equal(model.state_dict(), NvcompCheckpointIO().load_checkpoint(ckpts / "last.ckpt")["state_dict"])
    report = plugin.last_report
    assert report is not None and report.seconds - report.seconds_blocked >= 0.9 * delay


@pytest.mark.parametrize(
    ("case", "epochs", "fail", "top_k", "surfaces_at"),
    [
        ("rotation", 2, (2,), 1, "not removed"),  # the removal of the old best, queued behind it, is skipped
        ("next save", 3, (2,), -1, "not started"),
        ("teardown", 2, (2,), -1, "teardown"),  # the last save of fit fails: raised when fit ends
    ],
)
def test_async_background_failure_surfaces_and_keeps_the_previous_checkpoint(tmp_path, case, epochs, fail, top_k, surfaces_at):
    ckpts = tmp_path / "ckpts"
    plugin = NvcompCheckpointIO(async_save=True, stream_wrapper=FailingSaves(*fail))
    saving = ModelCheckpoint(dirpath=str(ckpts), save_top_k=top_k, filename="{epoch}-{step}")
    with pytest.raises(CheckpointWriteError) as info:
        fit_tiny(tmp_path, epochs, plugins=[plugin], callbacks=[saving])
    message = str(info.value)
    assert "disk is full" in message and str(ckpts / ckpt_name(2)) in message, message
    assert surfaces_at in message.lower(), message
    # Nothing after the failed save was written, the file before it is complete, no temporaries.
    assert _complete_checkpoints(ckpts) == [ckpt_name(1)]
    assert [p.name for p in ckpts.iterdir()] == [ckpt_name(1)]
    state = NvcompCheckpointIO().load_checkpoint(ckpts / ckpt_name(1))
    assert state["global_step"] == BATCHES_PER_EPOCH and state["optimizer_states"]
    assert plugin.pending() == 0


def test_async_failure_outside_the_trainer_is_raised_by_wait_and_the_plugin_goes_on(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    plugin = NvcompCheckpointIO(async_save=True)
    bad = tmp_path / "a-file" / "x.ckpt"
    plugin.save_checkpoint(_checkpoint(), bad)  # returns: the write happens in the background
    with pytest.raises(CheckpointWriteError, match="a-file"):
        plugin.wait()
    plugin.wait()  # reported once
    plugin.save_checkpoint(_checkpoint(), tmp_path / "ok.ckpt")
    plugin.save_checkpoint(_checkpoint(), bad)
    with pytest.raises(CheckpointWriteError, match="a-file"):
        plugin.teardown()
    assert_tree_equal(_checkpoint(), plugin.load_checkpoint(tmp_path / "ok.ckpt"))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_on_saved_fires_once_the_file_is_durable(tmp_path, async_save):
    calls: list[dict[str, Any]] = []

    def on_saved(report: nc.SaveReport) -> None:
        path = Path(report.path)
        calls.append(
            {
                "path": path,
                "complete": nc.is_nvcomp_checkpoint(path),
                "size": path.stat().st_size,
                "stored": report.stored_bytes,
                "thread": threading.current_thread() is threading.main_thread(),
            }
        )

    plugin = NvcompCheckpointIO(async_save=async_save, on_saved=on_saved, stream_wrapper=slow(0.3))
    ckpt = _checkpoint()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(ckpt, path)
    if async_save:
        assert not path.exists() and calls == []  # still being written
        ckpt["state_dict"]["weight"].add_(1.0)  # training goes on; the file keeps the snapshot
        plugin.wait()
    assert len(calls) == 1
    call = calls[0]
    assert call["path"] == path and call["complete"] and call["size"] == call["stored"]
    assert call["thread"] is (not async_save)  # async: called on the save thread
    loaded = plugin.load_checkpoint(path)
    assert_tree_equal(_checkpoint(), loaded)


def test_load_checkpoint_waits_for_a_pending_save(tmp_path):
    plugin = NvcompCheckpointIO(async_save=True, stream_wrapper=slow(0.3))
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(_checkpoint(), path)
    assert not path.exists()
    assert_tree_equal(_checkpoint(), plugin.load_checkpoint(path))  # not FileNotFoundError


def test_another_plugins_load_waits_for_a_pending_save_as_nc_load_does(tmp_path):
    plugin = NvcompCheckpointIO(async_save=True, stream_wrapper=slow(0.3))
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(_checkpoint(), path)
    assert not path.exists() and nc.has_pending_save(path)
    # A second Trainer's plugin, in the same process: it waits for the first one's save.
    assert_tree_equal(_checkpoint(), NvcompCheckpointIO().load_checkpoint(path))  # not FileNotFoundError
    plugin.save_checkpoint({**_checkpoint(), "epoch": 1}, path)
    assert nc.has_pending_save(path)
    assert nc.load(path)["epoch"] == 1  # nc.load waits too
    plugin.save_checkpoint({**_checkpoint(), "epoch": 2}, path)
    assert nc.has_pending_save(path)
    with nc.open(path) as reader:  # and nc.open
        assert reader.load()["epoch"] == 2
    plugin.teardown()


# Writes one frame of a save, then stays inside it until the test kills the process.
_KILLED_SAVE = """\
import sys, time, torch
import nvcomp_checkpoint as nc

def progress(nbytes):
    print("writing", flush=True)
    time.sleep(600)

nc.save({"w": torch.randn(1 << 18)}, sys.argv[1], workers=1, progress=progress)
"""


class ReleasesOnLoad(NvcompCheckpointIO):
    """Lets the held save of another plugin go on once the Trainer has picked its checkpoint path."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate, self.loaded = gate, []

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.loaded.append(os.path.basename(path))
        self.gate.set()
        return super().load_checkpoint(path, *args, **kwargs)


def test_hpc_resume_sees_no_checkpoint_in_a_killed_or_pending_saves_temporary_file(tmp_path):
    trainer, _, _ = fit_tiny(tmp_path, 1, plugins=[NvcompCheckpointIO()])
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    # SLURM kills the job while it writes hpc_ckpt_2.ckpt: its temporary file stays.
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "hpc_ckpt_2.ckpt")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert len(leftovers) == 1, leftovers
    dump = tmp_path / "restored.pt"
    fit_tiny(tmp_path, 2, plugins=[NvcompCheckpointIO()], ckpt_path="hpc", callbacks=[DumpRestoredState(str(dump))])
    assert "ckpt_" not in leftovers[0]  # what Lightning looks for: it takes every digit after it
    assert_tree_equal(torch.load(dump, weights_only=True)["state_dict"], nc.load(tmp_path / "hpc_ckpt_1.ckpt")["state_dict"])

    # An async save of hpc_ckpt_3.ckpt still writing (held until the next run loads): that run
    # resumes from the newest complete checkpoint; once the save is durable, from it. (The plugin
    # writes a save between runs at once, so the pending save is the API's, of the trainer's checkpoint.)
    gate = threading.Event()
    trainer, _, _ = fit_tiny(tmp_path, 1, plugins=[NvcompCheckpointIO()], enable_checkpointing=False)
    handle = nc.save_async(
        trainer._checkpoint_connector.dump_checkpoint(), tmp_path / "hpc_ckpt_3.ckpt", stream_wrapper=held(gate)
    )
    assert not (tmp_path / "hpc_ckpt_3.ckpt").exists() and [n for n in os.listdir(tmp_path) if n.startswith(".")]
    loader = ReleasesOnLoad(gate)
    fit_tiny(tmp_path, 2, plugins=[loader], ckpt_path="hpc")
    handle.result(timeout=60)
    fit_tiny(tmp_path, 2, plugins=[loader], ckpt_path="hpc", callbacks=[DumpRestoredState(str(dump))])
    assert loader.loaded == ["hpc_ckpt_1.ckpt", "hpc_ckpt_3.ckpt"]
    assert_tree_equal(torch.load(dump, weights_only=True)["state_dict"], nc.load(tmp_path / "hpc_ckpt_3.ckpt")["state_dict"])


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_metrics_reach_the_trainers_csv_logger(tmp_path, async_save, caplog):
    plugin = NvcompCheckpointIO(async_save=async_save)
    ckpts = tmp_path / "ckpts"
    csv_logger = CSVLogger(str(tmp_path / "logs"), name="run", version=0)
    with caplog.at_level(logging.INFO, logger="nvcomp_checkpoint"):
        fit_tiny(tmp_path, 2, plugins=[plugin], callbacks=[every_epoch(ckpts), NvcompCheckpointMetrics()], logger=csv_logger)
    rows = [r for r in _csv_rows(Path(csv_logger.log_dir) / "metrics.csv") if r.get("nvckpt/ratio")]
    assert [int(r["step"]) for r in rows] == [4, 8]  # one row per save, at the checkpoint's step
    for row, epochs in zip(rows, (1, 2)):
        stored, raw = float(row["nvckpt/stored_bytes"]), float(row["nvckpt/raw_bytes"])
        assert stored == (ckpts / ckpt_name(epochs)).stat().st_size
        assert float(row["nvckpt/ratio"]) == pytest.approx(raw / stored) and float(row["nvckpt/ratio"]) > 1.05
        for component in ("weights", "exp_avg", "exp_avg_sq"):
            assert float(row[f"nvckpt/ratio/{component}"]) > 1.05
        assert 0 <= float(row["nvckpt/seconds_blocked"]) <= float(row["nvckpt/seconds"])
        assert float(row["nvckpt/throughput_mb_s"]) > 0
    # The same numbers go through `logging`, one line per save.
    lines = [r for r in caplog.records if r.name == "nvcomp_checkpoint" and "nvckpt_report" in r.__dict__]
    assert [Path(r.nvckpt_report["path"]).name for r in lines] == [ckpt_name(1), ckpt_name(2)]
    assert all(r.getMessage().startswith(f"saved {ckpts / Path(r.nvckpt_report['path']).name}: ") for r in lines)
    assert all(r.nvckpt_report["seconds_blocked"] <= r.nvckpt_report["seconds"] for r in lines)


def test_metrics_callback_needs_the_plugin(tmp_path):
    with pytest.raises(CheckpointError, match=r"NvcompCheckpointMetrics.*plugins=\[NvcompCheckpointIO\(\)\]"):
        fit_tiny(tmp_path, 1, callbacks=[NvcompCheckpointMetrics()])
    # ... and finds it inside Lightning's AsyncCheckpointIO.
    metrics = NvcompCheckpointMetrics()
    plugin = NvcompCheckpointIO()
    fit_tiny(tmp_path / "wrapped", 1, plugins=[AsyncCheckpointIO(plugin)], callbacks=[metrics])
    assert metrics._attached is None and plugin._listeners == []  # detached at teardown


def test_async_plugin_with_fabric(tmp_path):
    plugin = NvcompCheckpointIO(async_save=True, stream_wrapper=slow(0.2))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    module = TinyModule()
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(tmp_path / "f.ckpt", {"model": model, "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = fabric.load(tmp_path / "f.ckpt")  # waits for the pending save
    assert state["step"] == 1
    assert_tree_equal(expected, state["model"])
    plugin.teardown()


def test_async_max_pending_bounds_the_saves_in_flight(tmp_path):
    # Two snapshots may be in flight; the third save waits for the first file to land.
    gate = threading.Event()  # the store takes every write only once the test says so
    plugin = NvcompCheckpointIO(async_save=True, max_pending=2, stream_wrapper=held(gate))
    ckpt = _checkpoint()
    expected, first_landed = [], []

    def save(i: int) -> None:
        ckpt["state_dict"]["weight"].add_(1.0)  # training between saves
        ckpt["global_step"] = i
        expected.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ckpt["state_dict"].items()})
        plugin.save_checkpoint(ckpt, tmp_path / f"{i}.ckpt")

    save(0)
    save(1)  # both returned while their writes are held: neither waited for the store
    assert plugin.pending() == 2
    third = threading.Thread(target=lambda: (save(2), first_landed.append((tmp_path / "0.ckpt").exists())))
    third.start()
    third.join(0.3)
    assert third.is_alive() and first_landed == []  # the third save waits for a free slot ...
    gate.set()
    third.join(60)
    assert first_landed == [True]  # ... which the first file landing frees
    plugin.teardown()
    for i in range(3):
        state = plugin.load_checkpoint(tmp_path / f"{i}.ckpt")
        assert state["global_step"] == i
        assert_tree_equal(expected[i], state["state_dict"])


class StepMetricModule(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("step_metric", float(self.global_step))  # lower is better: step 0's checkpoint is the best
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("callback", [ModelCheckpoint, NvcompModelCheckpoint])
def test_async_saves_with_repeating_names_keep_every_version(tmp_path, callback):
    # A fixed filename and save_top_k=-1: ModelCheckpoint names each save ckpt, ckpt-v1, ... by
    # looking for the file on disk, where a save in flight is not yet. The plain callback then
    # reuses a name and overwrites the best checkpoint; NvcompModelCheckpoint sees pending saves.
    ckpts = tmp_path / "ckpts"
    # The first save is held 5 s (then the rest run): the next names are chosen while it is in flight,
    # however slow the machine is.
    gate = threading.Event()
    release = threading.Timer(5.0, gate.set)
    release.start()
    plugin = NvcompCheckpointIO(async_save=True, max_pending=4, stream_wrapper=held(gate))
    ck = callback(dirpath=str(ckpts), filename="ckpt", monitor="step_metric", mode="min", save_top_k=-1, every_n_train_steps=1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_steps=4,
        plugins=[plugin],
        callbacks=[ck],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(StepMetricModule(), tiny_data())
    files = sorted(os.listdir(ckpts))
    best_step = nc.load(ck.best_model_path, weights_only=False)["global_step"]
    if callback is ModelCheckpoint:
        assert len(files) < 4  # the pitfall the README documents, shown so the subclass keeps its reason
    else:
        assert files == ["ckpt-v1.ckpt", "ckpt-v2.ckpt", "ckpt-v3.ckpt", "ckpt.ckpt"]
        assert best_step == 1 and float(ck.best_model_score) == 0.0


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoints_at_an_fsspec_url_are_saved_loaded_and_removed(async_save: bool) -> None:
    plugin = NvcompCheckpointIO(async_save=async_save)
    url = f"memory://nvckpt-lightning-{async_save}/ckpts/a.ckpt"
    plugin.save_checkpoint(_checkpoint(), url)
    assert_tree_equal(_checkpoint(), plugin.load_checkpoint(url))
    plugin.remove_checkpoint(url)
    plugin.wait()
    with pytest.raises(FileNotFoundError, match="a.ckpt"):
        plugin.load_checkpoint(url)
    plugin.teardown()


def _save_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nvckpt")]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plugin", "in-AsyncCheckpointIO"])
def test_a_save_outside_fit_leaves_no_writer_thread(tmp_path, wrapped):
    # Lightning's own tests fail a test that leaves a thread (its conftest's thread police): a
    # trainer.save_checkpoint after fit has no training to overlap, so it is written at once.
    before = set(threading.enumerate())
    plugin = NvcompCheckpointIO(async_save=True)
    trainer, model, _ = fit_tiny(tmp_path, 1, plugins=[AsyncCheckpointIO(plugin) if wrapped else plugin])
    assert [t for t in set(_save_threads()) - before] == []  # the end of fit stopped ours
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    if wrapped:  # Lightning's own wrapper writes in its thread pool; its teardown joins it
        trainer.strategy.checkpoint_io.teardown()
    assert (tmp_path / "after_fit.ckpt").is_file() and nc.is_nvcomp_checkpoint(tmp_path / "after_fit.ckpt")
    assert [t for t in set(_save_threads()) - before] == []
    # ... and the next fit saves in the background again.
    fit_tiny(tmp_path / "again", 1, plugins=[plugin], callbacks=[every_epoch(tmp_path / "again" / "ckpts")])
    assert plugin.last_report is not None and plugin.last_report.seconds_blocked < plugin.last_report.seconds
