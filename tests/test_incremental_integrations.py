"""``incremental=True`` in the integrations: real Lightning and Accelerate loops on tiny models.

Lightning: ModelCheckpoint(save_top_k=2) with deltas, a resume in a fresh process from a delta of
depth 2 (bit-identical state, the same next losses), removals deferred until no kept delta needs
the file, across processes. Accelerate: save_state with total_limit keeps the folders a kept
delta needs. The HF Trainer callback refuses the option.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import fresh_process  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.incremental import DEFERRED_NAME, IncrementalFiles  # noqa: E402
from nvcomp_checkpoint.lightning import NvcompCheckpointIO  # noqa: E402
from test_lightning import BATCHES_PER_EPOCH, TinyModule, fit_tiny  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent


class StepLogged(TinyModule):
    """TinyModule that logs its step, so that ModelCheckpoint(monitor="gstep", mode="max") keeps the newest k."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("gstep", float(self.global_step))
        return super().training_step(batch, batch_idx)


def newest_two(dirpath: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(dirpath), save_top_k=2, monitor="gstep", mode="max", filename="{step}")


def name(step: int) -> str:
    return f"step={step}.ckpt"


def base_name(path: Path) -> str | None:
    with nc.open(path) as r:
        return None if r.index.base is None else r.index.base.path


class DumpAt(pl.Callback):
    """Saves (plain torch.save) the model and optimizer state once ``global_step`` reaches ``step``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            torch.save({"state_dict": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}, self.path)


RESUME = """\
import sys
sys.path.insert(0, {tests!r})
import test_lightning
from test_incremental_integrations import StepLogged, newest_two
from test_lightning import DumpRestoredState, LossLog, fit_tiny
from nvcomp_checkpoint.lightning import NvcompCheckpointIO
from pathlib import Path

test_lightning.TinyModule = StepLogged
fit_tiny({root!r}, 5, plugins=[NvcompCheckpointIO(incremental=True, full_every=4)], ckpt_path={ckpt!r},
         callbacks=[newest_two(Path({ckpts!r})), DumpRestoredState({dump!r}), LossLog({losses!r})])
"""


def test_lightning_top_k_with_deltas_resumes_bit_identical_in_a_fresh_process(tmp_path, monkeypatch):
    import test_lightning

    monkeypatch.setattr(test_lightning, "TinyModule", StepLogged)
    ckpts, at_12 = tmp_path / "ckpts", tmp_path / "at-12.pt"
    plugin = NvcompCheckpointIO(incremental=True, full_every=4)
    _, model, losses = fit_tiny(tmp_path / "run", 5, plugins=[plugin], callbacks=[newest_two(ckpts), DumpAt(12, at_12)])
    # Saves at steps 4 (full), 8, 12, 16 (each a delta of the one before), 20 (full). ModelCheckpoint
    # removed 4, 8 and 12 (top 2: 16 and 20); 16 still needs them all: they stay, listed for removal.
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([name(s) for s in (4, 8, 12, 16, 20)] + [DEFERRED_NAME])
    assert [base_name(ckpts / name(s)) for s in (4, 8, 12, 16, 20)] == [None, name(4), name(8), name(12), None]
    assert sorted(json.loads((ckpts / DEFERRED_NAME).read_text())) == sorted([name(4), name(8), name(12)])
    assert_tree_equal(model.state_dict(), nc.load(ckpts / name(20), weights_only=False)["state_dict"])

    # A fresh process resumes from step 12 (a delta of depth 2).
    dump, loss_file = tmp_path / "restored.pt", tmp_path / "losses.json"
    script = tmp_path / "resume.py"
    script.write_text(
        RESUME.format(
            tests=str(TESTS_DIR),
            root=str(tmp_path / "resumed"),
            ckpt=str(ckpts / name(12)),
            ckpts=str(tmp_path / "ckpts2"),
            dump=str(dump),
            losses=str(loss_file),
        )
    )
    proc = fresh_process.run([str(script)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    restored, expected = torch.load(dump, weights_only=True), torch.load(at_12, weights_only=True)
    assert_tree_equal(expected["state_dict"], restored["state_dict"], "state_dict")
    assert_tree_equal(expected["optimizer"], restored["optimizer"], "optimizer")
    assert json.loads(loss_file.read_text()) == losses[3 * BATCHES_PER_EPOCH :]
    # ModelCheckpoint removing 16 in a later process: the chain the first run had to keep goes too.
    deleted = IncrementalFiles("test").remove(ckpts / name(16), os.remove)
    assert sorted(Path(p).name for p in deleted) == sorted(name(s) for s in (4, 8, 12, 16))
    assert sorted(p.name for p in ckpts.iterdir()) == [name(20)]


def test_lightning_async_saves_with_deltas_and_last_ckpt(tmp_path):
    ckpts = tmp_path / "ckpts"
    plugin = NvcompCheckpointIO(incremental=True, full_every=2, async_save=True)
    callback = ModelCheckpoint(dirpath=str(ckpts), save_top_k=-1, filename="{step}", save_last=True)
    trainer, model, _ = fit_tiny(tmp_path / "run", 3, plugins=[plugin], callbacks=[callback])
    assert [base_name(ckpts / name(s)) for s in (4, 8, 12)] == [None, name(4), None]
    # last.ckpt, rewritten in place after each save, is a delta of the file saved just before it
    # and never a base itself.
    assert base_name(ckpts / "last.ckpt") == name(12)
    assert_tree_equal(model.state_dict(), nc.load(ckpts / name(12), weights_only=False)["state_dict"])
    assert_tree_equal(model.state_dict(), nc.load(ckpts / "last.ckpt", weights_only=False)["state_dict"])
    assert nc.load(ckpts / name(8), weights_only=False)["global_step"] == 8


def test_last_ckpt_is_never_a_base_and_a_delta_never_replaces_its_chain(tmp_path):
    book = IncrementalFiles("test", nc.ChainPolicy(10), can_be_base=lambda p: not Path(p).name.startswith("last"))
    a, last, b = tmp_path / "a.ckpt", tmp_path / "last.ckpt", tmp_path / "b.ckpt"
    assert book.base_for(a) is None
    assert book.base_for(last) == str(a)
    assert book.base_for(b) == str(a)  # last.ckpt is rewritten in place: never a base
    assert book.base_for(a) is None  # a is b's base: saving over it cannot be a delta of b


def test_a_wrong_full_every_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="full_every must be an int >= 1"):
        NvcompCheckpointIO(incremental=True, full_every=0)


# -- Accelerate ------------------------------------------------------------------------------
def _accelerate_build(project: Path, total_limit: int | None, incremental: bool) -> tuple[Any, ...]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    set_seed(0)
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit)
    acc = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    hooks = register_nvcomp_hooks(acc, incremental=incremental, full_every=3) if incremental else None
    return acc, model, opt, hooks


def _accelerate_step(objs: tuple[Any, ...], i: int) -> float:
    acc, model, opt, _ = objs
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_accelerate_save_state_with_total_limit_keeps_the_folders_kept_deltas_need(tmp_path):
    pytest.importorskip("accelerate")
    objs = _accelerate_build(tmp_path / "inc", total_limit=2, incremental=True)
    acc = objs[0]
    checkpoints = tmp_path / "inc" / "checkpoints"
    kept_by_step = []
    snapshots = {}
    for i in range(5):
        _accelerate_step(objs, i)
        acc.save_state()
        snapshots[i] = {k: v.clone() for k, v in objs[1].state_dict().items()}
        kept_by_step.append(sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")))
    # 0 full, 1 and 2 deltas (1 of 0, 2 of 1), 3 full, 4 delta of 3. total_limit=2 keeps the newest
    # two and every folder they need: 0 stays while 1 or 2 is kept.
    assert kept_by_step == [
        ["checkpoint_0"],
        ["checkpoint_0", "checkpoint_1"],
        ["checkpoint_0", "checkpoint_1", "checkpoint_2"],
        ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"],
        ["checkpoint_3", "checkpoint_4"],
    ]
    for name, base in (("checkpoint_3", None), ("checkpoint_4", "../checkpoint_3/model.nvc")):
        assert base_name(checkpoints / name / "model.nvc") == base
    assert base_name(checkpoints / "checkpoint_4" / "optimizer.nvc") == "../checkpoint_3/optimizer.nvc"
    # load_state of the newest (a delta) restores the state it saved, optimizer included.
    expected_opt = copy.deepcopy(objs[2].state_dict())
    _accelerate_step(objs, 99)
    acc.load_state()
    assert_tree_equal(snapshots[4], objs[1].state_dict())
    assert_tree_equal(expected_opt, objs[2].state_dict())


def test_hf_callback_refuses_incremental_with_the_fix(tmp_path):
    transformers_cb = pytest.importorskip("nvcomp_checkpoint.transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    # Refused when the Trainer is built (on_init_end): without DeepSpeed; under DeepSpeed NvcompTrainer keeps chains.
    callback = transformers_cb.NvcompTrainerCallback(incremental=True)
    with pytest.raises(ValueError, match="CheckpointManager"):
        callback.on_init_end(TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerState(), TrainerControl())


class _DiskFull:
    """An output stream whose device fills up while ``full["on"]``: ``write`` raises ENOSPC."""

    def __init__(self, stream: Any, full: dict[str, bool]) -> None:
        self.stream, self.full = stream, full

    def write(self, data: Any) -> int:
        if self.full["on"]:
            raise OSError(28, "No space left on device")
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def test_a_failed_async_save_is_never_the_base_of_the_next(tmp_path: Path) -> None:
    # The failure is raised by wait() (ModelCheckpoint's remove_checkpoint or teardown may be
    # first too), not by the next save: that save must still be full, not a delta against a
    # file that never landed.
    full = {"on": False}
    plugin = NvcompCheckpointIO(async_save=True, incremental=True, full_every=5, stream_wrapper=lambda s: _DiskFull(s, full))
    state = lambda step: {"w": torch.randn(1000, generator=torch.Generator().manual_seed(step)), "global_step": step}  # noqa: E731
    plugin.save_checkpoint(state(1), tmp_path / "a-1.ckpt")
    plugin.wait()
    full["on"] = True
    plugin.save_checkpoint(state(2), tmp_path / "a-2.ckpt")
    with pytest.raises(nc.errors.CheckpointError):
        plugin.wait()
    full["on"] = False
    plugin.save_checkpoint(state(3), tmp_path / "a-3.ckpt")
    plugin.wait()
    plugin.teardown()
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["a-1.ckpt", "a-3.ckpt"]
    with nc.open(tmp_path / "a-3.ckpt") as reader:
        assert reader.chain is None  # full: the save before it failed
    assert torch.equal(nc.load(tmp_path / "a-3.ckpt")["w"], state(3)["w"])


def _small_save(book: IncrementalFiles, path: Path, step: int) -> str | None:
    base = book.base_for(path)
    nc.save({"w": torch.full((256,), float(step)), "step": torch.tensor(step)}, path, base=base)
    return base


def test_a_deleted_delta_no_longer_keeps_its_base(tmp_path: Path) -> None:
    # ModelCheckpoint's order (save the new file, then remove the k-th best) with s1 the best for a while.
    book = IncrementalFiles("test", nc.ChainPolicy(3))
    p = {s: tmp_path / f"s{s}.ckpt" for s in range(1, 7)}
    names = lambda: sorted(f.name for f in tmp_path.glob("*.ckpt"))  # noqa: E731
    for s in (1, 2, 3):
        _small_save(book, p[s], s)
    book.remove(p[2], os.remove)  # s3 needs s2
    assert _small_save(book, p[4], 4) is None  # full (full_every=3)
    assert sorted(Path(q).name for q in book.remove(p[3], os.remove)) == ["s2.ckpt", "s3.ckpt"]
    assert _small_save(book, p[5], 5) == str(p[4])
    book.remove(p[4], os.remove)  # s5 needs s4
    assert _small_save(book, p[6], 6) == str(p[5])
    # s2 and s3 are gone: nothing needs s1 any more.
    assert [Path(q).name for q in book.remove(p[1], os.remove)] == ["s1.ckpt"]
    assert names() == ["s4.ckpt", "s5.ckpt", "s6.ckpt"]
    assert [Path(q).name for q in book.deferred] == ["s4.ckpt"]
    assert json.loads((tmp_path / DEFERRED_NAME).read_text()) == ["s4.ckpt"]


def test_a_deleted_file_is_never_the_base_of_the_next_save(tmp_path: Path) -> None:
    book = IncrementalFiles("test", nc.ChainPolicy(5))
    a, b, c = (tmp_path / f"{x}.ckpt" for x in "abc")
    _small_save(book, a, 1)
    _small_save(book, b, 2)
    book.remove(a, os.remove)  # b needs a
    book.remove(b, os.remove)  # both go
    assert not a.exists() and not b.exists()
    assert _small_save(book, c, 3) is None
    assert nc.load(c)["step"] == 3


def test_a_removal_deferred_by_the_tier_copies_stays_listed_until_it_runs(tmp_path: Path) -> None:
    import threading

    from nvcomp_checkpoint.tiers import Tier, TierCopies

    release, started = threading.Event(), threading.Event()

    def hold(tier: str, step: int, nbytes: int) -> None:  # the copy to the tier is slow
        started.set()
        release.wait(30)

    folder = tmp_path / "ckpts"
    folder.mkdir()
    tiers = TierCopies([Tier(tmp_path / "shared")], "test", on_copy_progress=hold)
    book = IncrementalFiles("test", nc.ChainPolicy(1))
    a, b, c = folder / "a.ckpt", folder / "b.ckpt", folder / "c.ckpt"
    _small_save(book, a, 1)
    tiers.adopt(1, a)
    assert started.wait(30)
    # The framework removes a while its copy runs: the tier copies defer the real deletion.
    delete = lambda path: tiers.remove_after_copies(path, lambda: Path(path).unlink(missing_ok=True))  # noqa: E731
    assert book.remove(a, delete) == [str(a)]
    assert a.exists()
    assert json.loads((folder / DEFERRED_NAME).read_text()) == ["a.ckpt"]
    # The process dies here: the next one finds a listed and deletes it at its first removal.
    fresh = IncrementalFiles("test", nc.ChainPolicy(1))
    _small_save(fresh, c, 2)
    assert sorted(Path(q).name for q in fresh.remove(c, os.remove)) == ["a.ckpt", "c.ckpt"]
    assert not a.exists() and not (folder / DEFERRED_NAME).exists()
    # Had it lived on: the copy finishes and runs the deletion; the next removal unlists a.
    release.set()
    tiers.wait()
    _small_save(book, b, 3)
    assert book.remove(b, delete) == [str(b)]
    assert not (folder / DEFERRED_NAME).exists() and sorted(p.name for p in folder.iterdir()) == []
