"""Tests of the Hugging Face Trainer integration: compressed checkpoint-N directories and resuming.

Real ``Trainer`` runs of a tiny GPT-2 built from a config (no download); resumes run in a fresh process.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
from transformers import GPT2LMHeadModel, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints  # noqa: E402

import fresh_process  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.dirconvert import is_placeholder  # noqa: E402
from nvcomp_checkpoint.storage import is_temp_name  # noqa: E402
from nvcomp_checkpoint.transformers import (  # noqa: E402
    NvcompTrainer,
    NvcompTrainerCallback,
    compress_checkpoint,
    decompress_checkpoint,
)

# The training script: imported by the tests for in-process runs and run as a fresh process for
# resumes and for the failing conversion, so both sides train exactly the same thing.
SCRIPT = textwrap.dedent(
    '''
    """A tiny GPT-2 trained by the Hugging Face Trainer, with or without compressed checkpoints."""
    from __future__ import annotations

    import argparse
    import copy
    import json
    import os
    import resource

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from nvcomp_checkpoint.transformers import NvcompTrainer, NvcompTrainerCallback


    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int = 64, length: int = 16, vocab: int = 128, seed: int = 0) -> None:
            self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.x[i]}


    def tiny_model() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))


    class Snapshots(TrainerCallback):
        """Model and optimizer state in memory at every save, as the uninterrupted run has them."""

        def __init__(self) -> None:
            self.at: dict[int, dict] = {}

        def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.at[state.global_step] = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


    class DumpAtStart(TrainerCallback):
        """Writes the state a (resumed) run starts training from."""

        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": state.global_step}, self.path)


    class FullDiskAt(TrainerCallback):
        """Once the Trainer has written checkpoint-<step>, no file may grow past the size of its
        model.safetensors: the (smaller) compressed weights still fit, the optimizer state does not,
        so the conversion fails half-way as on a disk that fills up."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                limit = os.path.getsize(os.path.join(args.output_dir, f"checkpoint-{self.step}", "model.safetensors"))
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


    def run(output_dir, max_steps, save_steps, *, compress=True, resume=None, callbacks=(), eval_data=False,
            nvcomp=None, after=(), stock=False, **extra):
        """`nvcomp`: keyword arguments of NvcompTrainerCallback; `after`: callbacks that run after it;
        `stock`: the stock Trainer with the callback (else NvcompTrainer when compressing)."""
        args = TrainingArguments(
            output_dir=output_dir, max_steps=max_steps, save_steps=save_steps, per_device_train_batch_size=4,
            logging_steps=1, learning_rate=1e-3, seed=1, report_to=[], use_cpu=True, disable_tqdm=True, **extra,
        )
        callbacks = list(callbacks) + ([NvcompTrainerCallback(**(nvcomp or {}))] if compress else []) + list(after)
        trainer = (NvcompTrainer if compress and not stock else Trainer)(
            model=tiny_model(), args=args, train_dataset=Tokens(),
            eval_dataset=Tokens(8, seed=1) if eval_data else None, callbacks=callbacks,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer


    def losses(trainer) -> dict[int, float]:
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


    if __name__ == "__main__":
        p = argparse.ArgumentParser()
        p.add_argument("output_dir")
        p.add_argument("--max-steps", type=int, default=8)
        p.add_argument("--save-steps", type=int, default=4)
        p.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
        p.add_argument("--dump", default=None)
        p.add_argument("--log", default=None)
        p.add_argument("--full-disk-at", type=int, default=None)
        p.add_argument("--async-save", action="store_true")
        p.add_argument("--stock", action="store_true", help="the stock Trainer with NvcompTrainerCallback")
        a = p.parse_args()
        callbacks = ([DumpAtStart(a.dump)] if a.dump else []) + ([FullDiskAt(a.full_disk_at)] if a.full_disk_at else [])
        resume = True if a.resume == "latest" else a.resume
        trainer = run(a.output_dir, a.max_steps, a.save_steps, resume=resume, callbacks=callbacks,
                      nvcomp={"async_save": a.async_save}, stock=a.stock)
        if a.log:
            with open(a.log, "w") as f:
                json.dump(losses(trainer), f)
    '''
)

PLAIN_FILES = ("model.safetensors", "optimizer.pt")
NVC_FILES = ("model.safetensors.nvc", "optimizer.pt.nvc")


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModuleType]:
    path = tmp_path_factory.mktemp("script") / "hf_tiny_run.py"
    path.write_text(SCRIPT)
    spec = importlib.util.spec_from_file_location("hf_tiny_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


@pytest.fixture(scope="module")
def runs(script: tuple[Path, ModuleType], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted plain run (the reference) and the same run with compressed checkpoints."""
    _, mod = script
    root = tmp_path_factory.mktemp("runs")
    snapshots = mod.Snapshots()
    plain = mod.run(str(root / "plain"), 8, 2, compress=False, callbacks=[snapshots])
    callback_run = mod.run(str(root / "nvc"), 8, 4)
    async_run = mod.run(str(root / "nvc-async"), 8, 4, nvcomp={"async_save": True})
    return {
        "plain_dir": root / "plain",
        "nvc_dir": root / "nvc",
        "nvc_async_dir": root / "nvc-async",
        "nvc_async_losses": mod.losses(async_run),
        "plain_losses": mod.losses(plain),
        "nvc_losses": mod.losses(callback_run),
        "at": snapshots.at,
        "report": next(cb for cb in callback_run.callback_handler.callbacks if isinstance(cb, NvcompTrainerCallback)).last_report,
    }


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # The subprocess computes with as many threads as the in-process reference runs (the thread
    # count sets the float reduction order, and the tests compare the two bit for bit).
    env = dict(
        os.environ,
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    return fresh_process.run(args, cwd=cwd, env=env, timeout=300)


def _plain(checkpoint: Path) -> set[str]:
    """The Trainer's own model and optimizer files in ``checkpoint`` (a placeholder is none)."""
    return {n for n in PLAIN_FILES if (checkpoint / n).is_file() and not is_placeholder(checkpoint / n)}


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def _trainer_files_state(checkpoint: Path) -> dict[str, Any]:
    """What the Trainer wrote, read from plain files with the Trainer's own readers."""
    return {
        "model": safetensors.torch.load_file(str(checkpoint / "model.safetensors")),
        "optimizer": torch.load(checkpoint / "optimizer.pt", weights_only=True),
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoints_hold_compressed_files_bit_identical_to_the_trainers(runs: dict[str, Any], mode: str) -> None:
    # Compressing after each save (or during the steps after it) does not disturb training.
    directory = runs["nvc_dir"] if mode == "sync" else runs["nvc_async_dir"]
    assert runs["nvc_losses" if mode == "sync" else "nvc_async_losses"] == runs["plain_losses"]
    for step in (4, 8):
        ckpt = directory / f"checkpoint-{step}"
        names = {p.name for p in ckpt.iterdir()}
        assert set(NVC_FILES) <= names and not _plain(ckpt) and all(is_placeholder(ckpt / n) for n in PLAIN_FILES), names
        assert {"trainer_state.json", "scheduler.pt", "rng_state.pth"} <= names
        assert not [n for n in names if is_temp_name(n)]
        reference = _trainer_files_state(runs["plain_dir"] / f"checkpoint-{step}")
        assert_tree_equal(nc.load(ckpt / "model.safetensors.nvc")["model"], reference["model"])
        assert_tree_equal(nc.load(ckpt / "optimizer.pt.nvc")["optimizer"], reference["optimizer"])
        with nc.open(ckpt / "optimizer.pt.nvc") as reader:
            assert {"exp_avg", "exp_avg_sq"} <= set(reader.summary())
    report = runs["report"]
    assert report is not None and {"weights", "exp_avg", "exp_avg_sq"} <= set(report.components)
    assert "exp_avg_sq" in report.table()


def test_checkpoint_directory_is_smaller_than_the_plain_one(runs: dict[str, Any]) -> None:
    for step in (4, 8):
        plain = _dir_bytes(runs["plain_dir"] / f"checkpoint-{step}")
        packed = _dir_bytes(runs["nvc_dir"] / f"checkpoint-{step}")
        assert packed < plain, (step, packed, plain)
        plain_files = sum((runs["plain_dir"] / f"checkpoint-{step}" / n).stat().st_size for n in PLAIN_FILES)
        packed_files = sum((runs["nvc_dir"] / f"checkpoint-{step}" / n).stat().st_size for n in NVC_FILES)
        assert packed_files < 0.95 * plain_files, (step, packed_files, plain_files)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_in_a_fresh_process_matches_the_uninterrupted_run(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path, mode: str
) -> None:
    path, _ = script
    out = tmp_path / "resumed"
    shutil.copytree(runs["nvc_dir" if mode == "sync" else "nvc_async_dir"] / "checkpoint-4", out / "checkpoint-4")
    proc = _python(
        [str(path), str(out), "--resume", "latest", "--dump", str(tmp_path / "start.pt"), "--log", str(tmp_path / "log.json")]
        + (["--async-save"] if mode == "async" else []),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    start = torch.load(tmp_path / "start.pt", weights_only=True)
    assert start["step"] == 4
    # Model (tied weights included) and optimizer state are bit-identical at step 4 ...
    assert_tree_equal(start["model"], runs["at"][4]["model"])
    assert_tree_equal(start["optimizer"], runs["at"][4]["optimizer"])
    # ... and training continues exactly as the uninterrupted run did.
    resumed = {int(k): v for k, v in json.loads((tmp_path / "log.json").read_text()).items()}
    assert resumed == runs["plain_losses"]
    assert set(NVC_FILES) <= {p.name for p in (out / "checkpoint-8").iterdir()}


@pytest.mark.parametrize("damaged", ["optimizer.pt.nvc", "model.safetensors.nvc"])
def test_corrupted_checkpoint_names_the_file_at_resume(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path, damaged: str
) -> None:
    _, mod = script
    out = tmp_path / "out"
    for step in (4, 8):
        shutil.copytree(runs["nvc_dir"] / f"checkpoint-{step}", out / f"checkpoint-{step}")
    target = out / "checkpoint-8" / damaged
    data = bytearray(target.read_bytes())
    data[len(data) // 3] ^= 0x5A
    target.write_bytes(bytes(data))
    with pytest.raises(nc.CheckpointError) as info:
        mod.run(str(out), 8, 4, resume=True)
    message = str(info.value)
    assert str(target) in message and "corrupt" in message
    assert "checkpoint-4" in message  # the way out: the earlier checkpoint


def test_failed_conversion_leaves_every_checkpoint_loadable(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    path, mod = script
    out = tmp_path / "out"
    proc = _python([str(path), str(out), "--save-steps", "2", "--full-disk-at", "4"], tmp_path)
    assert proc.returncode != 0
    assert "CheckpointWriteError" in proc.stderr and str(out / "checkpoint-4") in proc.stderr, proc.stderr[-4000:]
    # The failed conversion was undone: checkpoint-4 is exactly what the Trainer wrote ...
    names4 = {p.name for p in (out / "checkpoint-4").iterdir()}
    assert (
        _plain(out / "checkpoint-4") == set(PLAIN_FILES)
        and not set(NVC_FILES) & names4
        and not [n for n in names4 if is_temp_name(n)]
    ), names4
    assert_tree_equal(_trainer_files_state(out / "checkpoint-4"), _trainer_files_state(runs["plain_dir"] / "checkpoint-4"))
    # ... the checkpoint before it is compressed and loads ...
    assert set(NVC_FILES) <= {p.name for p in (out / "checkpoint-2").iterdir()}
    dump = tmp_path / "at2.pt"
    mod.run(str(tmp_path / "probe"), 2, 2, resume=str(out / "checkpoint-2"), callbacks=[mod.DumpAtStart(str(dump))])
    start = torch.load(dump, weights_only=True)
    assert_tree_equal(start["model"], runs["at"][2]["model"])
    assert_tree_equal(start["optimizer"], runs["at"][2]["optimizer"])
    # ... and the run resumes from the newest (plain) checkpoint as if nothing had happened.
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    trainer = mod.run(str(out), 8, 2, resume=True)
    assert mod.losses(trainer) == runs["plain_losses"]
    assert set(NVC_FILES) <= {p.name for p in (out / "checkpoint-8").iterdir()}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rotation_keeps_the_newest_and_the_best_checkpoint(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path, mode: str
) -> None:
    _, mod = script
    out = tmp_path / "out"
    # The loss falls, so "greater is better" makes an early checkpoint the best one: rotation
    # must keep it and the newest, and the best model must load from its compressed file.
    trainer = mod.run(
        str(out),
        8,
        2,
        eval_data=True,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
        nvcomp={"async_save": mode == "async"},
    )
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best_step = max(evals, key=lambda s: (evals[s], -s))
    assert best_step != 8, evals  # the test needs a best checkpoint that is not the newest
    assert trainer.state.best_model_checkpoint == str(out / f"checkpoint-{best_step}")
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert kept == sorted([f"checkpoint-{best_step}", "checkpoint-8"])
    for name in kept:
        assert set(NVC_FILES) <= {p.name for p in (out / name).iterdir()}
    best = nc.load(out / f"checkpoint-{best_step}" / "model.safetensors.nvc")["model"]
    final = trainer.model.state_dict()
    assert_tree_equal({k: final[k] for k in best}, best)
    assert not torch.equal(
        final["transformer.h.0.attn.c_attn.weight"], runs["at"][8]["model"]["transformer.h.0.attn.c_attn.weight"]
    )


def test_late_conversion_does_not_change_rotation_order(runs: dict[str, Any], tmp_path: Path) -> None:
    for step in (2, 4):
        shutil.copytree(runs["plain_dir"] / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    now = os.stat(tmp_path).st_mtime
    os.utime(tmp_path / "checkpoint-2", (now - 100, now - 100))
    os.utime(tmp_path / "checkpoint-4", (now - 50, now - 50))
    # Converting the older checkpoint now (a retry after a failure) must not make it look newest:
    # the Trainer's rotation orders checkpoints by directory mtime.
    report = compress_checkpoint(tmp_path / "checkpoint-2")
    assert report.stored_bytes < report.raw_bytes
    assert os.stat(tmp_path / "checkpoint-2").st_mtime == pytest.approx(now - 100)
    rotate_checkpoints(str(tmp_path), save_total_limit=1, use_mtime=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_plain_trainer_refuses_a_compressed_checkpoint_until_decompressed(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    _, mod = script
    ckpt = tmp_path / "out" / "checkpoint-4"
    shutil.copytree(runs["nvc_dir"] / "checkpoint-4", ckpt)
    # Loudly, never a silent resume with fresh optimizer state: the placeholder model.safetensors
    # makes safetensors say what the weights are.
    with pytest.raises(
        safetensors.SafetensorError,
        match="compressed by nvcomp-checkpoint into model.safetensors.nvc; load it with NvcompTrainer",
    ):
        mod.run(str(tmp_path / "probe"), 4, 4, compress=False, resume=str(ckpt))
    assert sorted(decompress_checkpoint(ckpt)) == sorted(PLAIN_FILES)
    names = {p.name for p in ckpt.iterdir()}
    assert _plain(ckpt) == set(PLAIN_FILES) and not set(NVC_FILES) & names
    with safetensors.safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert_tree_equal(_trainer_files_state(ckpt), _trainer_files_state(runs["plain_dir"] / "checkpoint-4"))
    dump = tmp_path / "start.pt"
    mod.run(str(tmp_path / "probe"), 4, 4, compress=False, resume=str(ckpt), callbacks=[mod.DumpAtStart(str(dump))])
    start = torch.load(dump, weights_only=True)
    assert_tree_equal(start["optimizer"], runs["at"][4]["optimizer"])
    model = GPT2LMHeadModel.from_pretrained(str(ckpt))
    assert_tree_equal(model.state_dict(), runs["at"][4]["model"])


@pytest.mark.parametrize(
    "extra", [{"fsdp": True}, {"push_to_hub": True, "hub_strategy": "checkpoint"}], ids=["fsdp", "hub-checkpoint"]
)
def test_callback_rejects_setups_it_cannot_convert(tmp_path: Path, extra: dict[str, Any]) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **extra)
    with pytest.raises(nc.CheckpointError, match="NvcompTrainerCallback"):
        NvcompTrainerCallback().on_init_end(args, TrainerState(), TrainerControl())


def test_plain_checkpoints_still_resume_with_nvcomp_trainer(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    # A run that switches to compressed checkpoints resumes from its last plain one.
    _, mod = script
    shutil.copytree(runs["plain_dir"] / "checkpoint-6", tmp_path / "out" / "checkpoint-6")
    trainer = mod.run(str(tmp_path / "out"), 8, 2, resume=True)
    assert isinstance(trainer, NvcompTrainer)
    assert mod.losses(trainer) == runs["plain_losses"]
    assert set(NVC_FILES) <= {p.name for p in (tmp_path / "out" / "checkpoint-8").iterdir()}


# -- async conversion ---------------------------------------------------------------------------
class SlowStream:
    """Holds the first write of each compressed file for ``delay`` seconds (a slow disk).

    With ``release``, the first write also waits (up to 60 s) until that event is set, so a
    conversion is still running when training reaches its next step, however slow the steps are.
    """

    def __init__(self, inner: IO[bytes], delay: float, release: threading.Event | None = None) -> None:
        self.inner, self.delay, self.first, self.release = inner, delay, True, release

    def write(self, data: Any) -> int:
        if self.first:
            self.first = False
            time.sleep(self.delay)
            if self.release is not None:
                self.release.wait(timeout=60)
        return self.inner.write(data)


class FailFiles:
    """Stream wrapper factory: the compressed files numbered in ``fail`` (1-based) hit a full disk."""

    def __init__(self, *fail: int) -> None:
        self.fail, self.count = set(fail), 0

    def __call__(self, stream: IO[bytes]) -> IO[bytes]:
        self.count += 1
        return self if self.count in self.fail else stream  # type: ignore[return-value]

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _state_of(checkpoint: Path) -> str:
    names = {p.name for p in checkpoint.iterdir()}
    if any(is_temp_name(n) for n in names):
        return "writing"
    plain, packed = bool(_plain(checkpoint)), bool(set(NVC_FILES) & names)
    return {(True, False): "plain", (False, True): "compressed", (True, True): "converting"}.get((plain, packed), "empty")


class WatchCheckpoints(TrainerCallback):
    """Runs after NvcompTrainerCallback: what the Trainer's next save and rotation would find."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = Path(output_dir)
        self.in_progress_seen = 0
        self.before_save: list[dict[str, str]] = []
        self.saw_conversion = threading.Event()  # releases the held conversion (SlowStream)

    def _states(self) -> dict[str, str]:
        return {p.name: _state_of(p) for p in sorted(self.output_dir.glob("checkpoint-*"))}

    def on_step_end(self, args, state, control, **kwargs):
        states = self._states()
        if control.should_save:
            self.before_save.append(states)  # our callback has waited: the Trainer saves and rotates now
        else:
            in_progress = any(v != "compressed" for v in states.values())
            self.in_progress_seen += in_progress
            if in_progress:
                self.saw_conversion.set()


def test_async_conversion_overlaps_training_and_finishes_before_the_next_save(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    _, mod = script
    out = tmp_path / "out"
    delay = 0.3
    reports: list[tuple[nc.SaveReport, str, bool]] = []

    def on_saved(report: nc.SaveReport) -> None:
        reports.append((report, _state_of(Path(report.path)), threading.current_thread() is threading.main_thread()))

    watch = WatchCheckpoints(str(out))
    trainer = mod.run(
        str(out),
        8,
        2,
        save_total_limit=1,
        after=[watch],
        nvcomp={"async_save": True, "on_saved": on_saved, "stream_wrapper": lambda s: SlowStream(s, delay, watch.saw_conversion)},
    )
    # Training went on while checkpoints were converted (two files held 0.3 s each) ...
    assert watch.in_progress_seen >= 1
    # ... but whenever the Trainer was about to save and rotate, every checkpoint was finished.
    assert len(watch.before_save) == 4
    for states in watch.before_save:
        assert set(states.values()) <= {"compressed"}, states
    assert mod.losses(trainer) == runs["plain_losses"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-8"]
    assert _state_of(out / "checkpoint-8") == "compressed"
    assert_tree_equal(nc.load(out / "checkpoint-8" / "optimizer.pt.nvc")["optimizer"], runs["at"][8]["optimizer"])
    # on_saved: once per checkpoint, when its directory was compressed; on the background thread
    # except for the last save, which ends training and is converted before on_save returns.
    assert [Path(r.path).name for r, _, _ in reports] == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]
    assert all(state == "compressed" for _, state, _ in reports)
    assert [main for _, _, main in reports] == [False, False, False, False]
    last = reports[-1][0]
    assert last.seconds - last.seconds_blocked >= 2 * delay * 0.9 and last.seconds_blocked < delay
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, NvcompTrainerCallback))
    assert callback.last_report is last and not callback.pending()


@pytest.mark.parametrize(("fail", "reported_by"), [(4, "the next save"), (8, "end of training")])
def test_async_conversion_failure_is_raised_and_leaves_the_trainers_files(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path, fail: int, reported_by: str
) -> None:
    # File 4 is checkpoint-4's optimizer.pt.nvc (raised before the save at step 6); file 8 is
    # checkpoint-8's (the save that ends training: raised by its on_save).
    _, mod = script
    out = tmp_path / "out"
    failing = f"checkpoint-{fail}"
    with pytest.raises(nc.errors.CheckpointWriteError) as info:
        mod.run(str(out), 8, 2, nvcomp={"async_save": True, "stream_wrapper": FailFiles(fail)})
    message = str(info.value)
    assert str(out / failing) in message and "disk is full" in message and reported_by in message, message
    assert "untouched" in message
    # The failed conversion was undone: exactly the Trainer's files, which resume.
    assert _state_of(out / failing) == "plain"
    assert_tree_equal(_trainer_files_state(out / failing), _trainer_files_state(runs["plain_dir"] / failing))
    assert all(_state_of(p) == "compressed" for p in out.glob("checkpoint-*") if p.name != failing)
    assert get_last_checkpoint(str(out)) == str(out / failing)
    if fail < 8:  # the run resumes from the plain checkpoint and converts its later saves
        trainer = mod.run(str(out), 8, 2, resume=True, nvcomp={"async_save": True})
        assert mod.losses(trainer) == runs["plain_losses"]  # the restored log history, then the same losses
        assert _state_of(out / "checkpoint-8") == "compressed"


@pytest.mark.parametrize("with_scheduler", [True, False])
def test_optimizer_state_loads_with_its_scheduler_and_a_converted_folder_without_it_is_refused(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path, with_scheduler: bool
) -> None:
    # The Trainer loads optimizer.pt only next to scheduler.pt (and skips both without it); the
    # compressed one loads with it, and a converted folder without it is refused.
    from transformers import Trainer

    _, mod = script
    compressed = tmp_path / "nvc"
    shutil.copytree(runs["nvc_dir"] / "checkpoint-4", compressed)
    plain = tmp_path / "plain"
    shutil.copytree(compressed, plain)
    decompress_checkpoint(plain)
    if not with_scheduler:
        (compressed / "scheduler.pt").unlink()
        (plain / "scheduler.pt").unlink()
    loaded = {}
    for name, cls, ckpt in (("nvc", NvcompTrainer, compressed), ("plain", Trainer, plain)):
        args = TrainingArguments(output_dir=str(tmp_path / f"out-{name}"), max_steps=8, report_to=[], use_cpu=True)
        trainer = cls(model=mod.tiny_model(), args=args, train_dataset=mod.Tokens())
        trainer.create_optimizer_and_scheduler(num_training_steps=8)
        if name == "nvc" and not with_scheduler:
            # A converted folder is refused without it: the Trainer's own files would load neither, without a word.
            with pytest.raises(nc.errors.CheckpointNotFoundError, match=re.escape(f"{compressed / 'scheduler.pt'}: missing")):
                trainer._load_optimizer_and_scheduler(str(ckpt))
            continue
        trainer._load_optimizer_and_scheduler(str(ckpt))
        loaded[name] = trainer.optimizer.state_dict()
    assert bool(loaded["plain"]["state"]) is with_scheduler
    if with_scheduler:
        assert_tree_equal(loaded["plain"], loaded["nvc"])


# -- a stock Trainer with the callback alone ---------------------------------------------------
@pytest.fixture(scope="module")
def stock_run(script: tuple[Path, ModuleType], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock ``Trainer`` with only ``NvcompTrainerCallback``: its output directory."""
    _, mod = script
    out = tmp_path_factory.mktemp("stock") / "out"
    trainer = mod.run(str(out), 8, 4, stock=True)
    assert type(trainer).__name__ == "Trainer"
    return out


def test_stock_trainer_checkpoints_keep_the_weights_and_compress_the_optimizer_state(
    runs: dict[str, Any], stock_run: Path
) -> None:
    ckpt = stock_run / "checkpoint-4"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "optimizer.pt.nvc", "scheduler.pt"} <= names and is_placeholder(ckpt / "optimizer.pt"), names
    # A Trainer without the callback would resume with a fresh optimizer state: the directory says so.
    from nvcomp_checkpoint.transformers import MARKER_NAME

    assert "NvcompTrainerCallback" in (ckpt / MARKER_NAME).read_text()
    reference = _trainer_files_state(runs["plain_dir"] / "checkpoint-4")
    assert_tree_equal(nc.load(ckpt / "optimizer.pt.nvc")["optimizer"], reference["optimizer"])
    # What transformers reads itself stays readable by it.
    model = GPT2LMHeadModel.from_pretrained(str(ckpt))
    assert_tree_equal(model.state_dict(), runs["at"][4]["model"])


@pytest.mark.parametrize(("resume", "mode"), [("latest", "sync"), ("path", "async")])
def test_stock_trainer_resumes_in_a_fresh_process_with_the_uninterrupted_runs_losses(
    runs: dict[str, Any], stock_run: Path, script: tuple[Path, ModuleType], tmp_path: Path, resume: str, mode: str
) -> None:
    path, _ = script
    out = tmp_path / "resumed"
    source = tmp_path / "elsewhere" / "checkpoint-4" if resume == "path" else out / "checkpoint-4"
    shutil.copytree(stock_run / "checkpoint-4", source)
    proc = _python(
        [
            str(path),
            str(out),
            "--stock",
            "--resume",
            "latest" if resume == "latest" else str(source),
            "--dump",
            str(tmp_path / "start.pt"),
            "--log",
            str(tmp_path / "log.json"),
        ]
        + (["--async-save"] if mode == "async" else []),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    start = torch.load(tmp_path / "start.pt", weights_only=True)
    assert start["step"] == 4
    assert_tree_equal(start["model"], runs["at"][4]["model"])
    assert_tree_equal(start["optimizer"], runs["at"][4]["optimizer"])
    resumed = {int(k): v for k, v in json.loads((tmp_path / "log.json").read_text()).items()}
    assert resumed == runs["plain_losses"]
    names = {p.name for p in (out / "checkpoint-8").iterdir()}
    assert {"model.safetensors", "optimizer.pt.nvc"} <= names and is_placeholder(out / "checkpoint-8" / "optimizer.pt")


def test_a_trainer_without_the_callback_refuses_a_converted_checkpoint_naming_it(
    stock_run: Path, script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    # The stock Trainer skips a missing optimizer.pt without a word; the placeholder makes its own
    # weights-only load fail, naming the callback. Never a resume with a fresh optimizer state.
    _, mod = script
    ckpt = tmp_path / "out" / "checkpoint-4"
    shutil.copytree(stock_run / "checkpoint-4", ckpt)
    with pytest.raises(pickle.UnpicklingError, match="resume_with_NvcompTrainerCallback"):
        mod.run(str(tmp_path / "probe"), 8, 4, compress=False, resume=str(ckpt))
    # Told to trust the file, the placeholder says what it is.
    with pytest.raises(
        nc.errors.FormatError, match=r"optimizer\.pt: a placeholder; the state is in optimizer\.pt\.nvc.*NvcompTrainerCallback"
    ):
        torch.load(ckpt / "optimizer.pt", weights_only=False)


def test_a_converted_pytorch_model_bin_is_refused_by_torch_load_naming_nvcomp_trainer(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    weights = {"w": torch.arange(600.0).reshape(20, 30)}
    torch.save(weights, ckpt / "pytorch_model.bin")
    compress_checkpoint(ckpt)
    assert is_placeholder(ckpt / "pytorch_model.bin") and (ckpt / "pytorch_model.bin.nvc").is_file()
    with pytest.raises(pickle.UnpicklingError, match="resume_with_NvcompTrainer"):
        torch.load(ckpt / "pytorch_model.bin", weights_only=True)  # what the Trainer and from_pretrained call
    compress_checkpoint(ckpt)  # again: a placeholder is no plain file to convert
    assert decompress_checkpoint(ckpt) == ["pytorch_model.bin"]
    assert_tree_equal(torch.load(ckpt / "pytorch_model.bin", weights_only=True), weights)


@pytest.mark.parametrize("missing", ["optimizer.pt.nvc", "scheduler.pt"])
def test_a_converted_checkpoint_missing_part_of_its_optimizer_state_is_refused(
    stock_run: Path, script: tuple[Path, ModuleType], tmp_path: Path, missing: str
) -> None:
    _, mod = script
    ckpt = tmp_path / "out" / "checkpoint-4"
    shutil.copytree(stock_run / "checkpoint-4", ckpt)
    (ckpt / missing).unlink()
    for stock in (True, False):  # the callback on a stock Trainer, and NvcompTrainer
        with pytest.raises(nc.errors.CheckpointNotFoundError, match=re.escape(f"{ckpt / missing}: missing")):
            mod.run(str(tmp_path / "probe"), 8, 4, resume=str(ckpt), stock=stock)


def test_stock_trainer_load_best_model_at_end_loads_the_best_weights(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    _, mod = script
    out = tmp_path / "out"
    trainer = mod.run(
        str(out),
        8,
        2,
        stock=True,
        eval_data=True,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
    )
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best_step = max(evals, key=lambda s: (evals[s], -s))
    assert best_step != 8, evals
    best = safetensors.torch.load_file(str(out / f"checkpoint-{best_step}" / "model.safetensors"))
    final = trainer.model.state_dict()
    assert_tree_equal({k: final[k] for k in best}, best)
    assert not torch.equal(
        final["transformer.h.0.attn.c_attn.weight"], runs["at"][8]["model"]["transformer.h.0.attn.c_attn.weight"]
    )


def test_compressed_weights_with_a_stock_trainer_are_refused_when_it_is_created(
    script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    _, mod = script
    with pytest.raises(nc.CheckpointError, match=r"compress_weights=True.*NvcompTrainer"):
        mod.run(str(tmp_path / "out"), 2, 2, stock=True, nvcomp={"compress_weights": True})


def test_a_directory_with_compressed_weights_says_what_it_is(runs: dict[str, Any], tmp_path: Path) -> None:
    from nvcomp_checkpoint.transformers import MARKER_NAME

    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(runs["nvc_dir"] / "checkpoint-4", ckpt)
    text = (ckpt / MARKER_NAME).read_text()
    assert "NvcompTrainer" in text and "decompress_checkpoint" in text
    with pytest.raises(safetensors.SafetensorError, match="into model.safetensors.nvc; load it with NvcompTrainer"):
        GPT2LMHeadModel.from_pretrained(str(ckpt))  # the placeholder, never randomly initialised weights
    decompress_checkpoint(ckpt)
    assert not (ckpt / MARKER_NAME).exists()
    assert_tree_equal(GPT2LMHeadModel.from_pretrained(str(ckpt)).state_dict(), runs["at"][4]["model"])


def test_a_stock_trainer_asked_to_resume_from_compressed_weights_is_refused_when_created(
    runs: dict[str, Any], script: tuple[Path, ModuleType], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, mod = script
    ckpt = tmp_path / "out" / "checkpoint-4"
    shutil.copytree(runs["nvc_dir"] / "checkpoint-4", ckpt)  # written by NvcompTrainer: weights compressed
    with pytest.raises(
        nc.CheckpointError, match=r"checkpoint-4: a stock Trainer cannot read its compressed weights.*NvcompTrainer"
    ):
        mod.run(str(tmp_path / "probe"), 4, 4, stock=True, resume_from_checkpoint=str(ckpt))
    # Found in output_dir, where resume_from_checkpoint=True would look: a warning before train().
    with caplog.at_level("WARNING", logger="nvcomp_checkpoint.integrations.transformers"):
        mod.run(str(tmp_path / "out"), 6, 6, stock=True)
    assert any("cannot read its compressed weights" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("missing", ["safetensors", "transformers", "accelerate"])
def test_import_without_a_framework_package_names_the_extra_to_install(missing: str) -> None:
    # ``None`` in sys.modules makes ``import <missing>`` fail as on a machine without it.
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{missing!r}] = None
        try:
            from nvcomp_checkpoint.transformers import NvcompTrainerCallback
        except ImportError as exc:
            print(type(exc).__name__, exc)
        else:
            sys.exit("imported without {missing}")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(
        "ImportError nvcomp_checkpoint.transformers needs transformers, accelerate and safetensors: "
        "pip install -e '.[transformers]' in a clone of the nvcomp-checkpoint repository"
    ), proc.stdout
    assert missing in proc.stdout, proc.stdout


def test_the_marker_says_how_to_read_each_file_as_torch_load_read_it(tmp_path: Path) -> None:
    # What NVCOMP_CHECKPOINT.txt tells a user to run gives back what torch.load gave for the plain file.
    import safetensors.torch

    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.transformers import MARKER_NAME, compress_checkpoint

    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    plain = {
        "optimizer.pt": torch.load(folder / "optimizer.pt"),
        "model.safetensors": safetensors.torch.load_file(folder / "model.safetensors"),
    }
    compress_checkpoint(folder)
    marker = (folder / MARKER_NAME).read_text()
    for name, expected in plain.items():
        (line,) = [ln for ln in marker.splitlines() if f'load("{name}.nvc")' in ln]
        expression = line.split(": ", 1)[1].strip()
        assert expression.startswith("nvcomp_checkpoint.load("), line
        with pytest.MonkeyPatch.context() as mp:  # run as a user would, in the checkpoint's folder
            mp.chdir(folder)
            got = eval(expression, {"nvcomp_checkpoint": nc}, {})  # the marker's own text
        assert_tree_equal(got, expected)


def test_a_stock_trainer_is_told_once_that_its_weights_stay_plain(
    script: tuple[Path, ModuleType], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # With a stock Trainer a checkpoint compresses far less than its optimizer state: the log says why, once.
    _, mod = script
    with caplog.at_level(logging.INFO, logger="nvcomp_checkpoint"):
        mod.run(str(tmp_path / "out"), 4, 2, stock=True)
    said = [r.getMessage() for r in caplog.records if "stays as the Trainer wrote it" in r.getMessage()]
    assert len(said) == 1, said
    assert re.search(r"checkpoint-2: model\.safetensors \([\d.]+ KiB, \d+% of the checkpoint\)", said[0]), said
    assert "NvcompTrainer" in said[0]
    saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compressed ")]
    assert len(saved) == 2, saved  # one line per checkpoint (checkpoint-2, checkpoint-4), not one per file


def test_an_optimizer_state_of_another_checkpoint_is_refused_naming_it(
    stock_run: Path, script: tuple[Path, ModuleType], tmp_path: Path
) -> None:
    # optimizer.pt.nvc of checkpoint-8 copied into checkpoint-4: the resume would go on from step 4
    # with step 8's moments, without a word, if nothing tied the file to its folder.
    _, mod = script
    ckpt = tmp_path / "out" / "checkpoint-4"
    shutil.copytree(stock_run / "checkpoint-4", ckpt)
    shutil.copyfile(stock_run / "checkpoint-8" / "optimizer.pt.nvc", ckpt / "optimizer.pt.nvc")
    for stock in (True, False):  # the callback on a stock Trainer, and NvcompTrainer
        with pytest.raises(nc.errors.MixedSaveError, match=re.escape(f"{ckpt / 'optimizer.pt.nvc'}: written for step 8")):
            mod.run(str(tmp_path / "probe"), 8, 4, resume=str(ckpt), stock=stock)


def test_the_callbacks_rotation_keeps_the_folders_kept_deltas_need_and_deletes_the_rest(tmp_path: Path) -> None:
    # What NvcompTrainer's rotation runs under DeepSpeed with incremental (save_total_limit=1), on DeepSpeed's
    # layout: checkpoint-4's tag is a delta of checkpoint-3's, checkpoint-2 the best model, checkpoint-1 free.
    from nvcomp_checkpoint.transformers import NvcompTrainerCallback

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    for step in (1, 2, 3, 4):
        tag = tmp_path / f"checkpoint-{step}" / f"global_step{step}"
        tag.mkdir(parents=True)
        base = tmp_path / "checkpoint-3" / "global_step3" / "zero.pt" if step == 4 else None
        nc.save(state, tag / "zero.pt", base=base)
    callback = NvcompTrainerCallback(incremental=True)
    callback.rotates, callback._rotation = True, (1, str(tmp_path / "checkpoint-2"))
    callback._rotate(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert_tree_equal(nc.load(tmp_path / "checkpoint-4" / "global_step4" / "zero.pt"), state)  # its chain whole
    callback._rotation = (2, None)
    callback._rotate(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
