"""Lightning's ModelParallelStrategy (FSDP2) with compressed sharded checkpoints.

A real ``Trainer`` on 2 CPU processes (gloo) fits, saves through NvcompModelParallelStrategy,
and a fresh pair of processes resumes from that checkpoint, and from a plain one written by the
stock strategy, with the uninterrupted run's next losses.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import assert_tree_equal, run_python

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.cli.main import main  # noqa: E402
from nvcomp_checkpoint.dcp import is_compressed_dcp_checkpoint  # noqa: E402
from nvcomp_checkpoint.errors import CheckpointError  # noqa: E402
from nvcomp_checkpoint.lightning import (  # noqa: E402
    NvcompCheckpointIO,
    NvcompFSDPStrategy,
    NvcompModelParallelStrategy,
    check_sharded_checkpoint_io,
)

_SCRIPT = textwrap.dedent(
    '''
    import json, os, sys, threading, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from nvcomp_checkpoint import Tier
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO, NvcompModelParallelStrategy

    torch.set_num_threads(1)


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
            self.losses = []

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch).square().mean()
            self.losses.append([self.global_step, float(loss)])
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            data = torch.randn(48, 24, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(data, batch_size=8)


    class Ema(L.Callback):
        """Tensor state in meta.pt, as an EMA callback's full copy of the weights: each saved state
        is also written aside (torch.save) by rank 0, each loaded one too, to compare bit for bit."""

        def __init__(self, out):
            self.out, self.steps = Path(out), 0
            self.ema = {"w": torch.zeros(48, 24), "half": torch.zeros(8, 48, dtype=torch.bfloat16)}

        def on_train_batch_end(self, trainer, *args):
            self.steps += 1
            g = torch.Generator().manual_seed(self.steps)
            self.ema = {k: (v * 0.9 + torch.randn(v.shape, generator=g).to(v.dtype)) for k, v in self.ema.items()}

        def state_dict(self):
            state = {"steps": self.steps, "ema": {k: v.clone() for k, v in self.ema.items()}}
            if torch.distributed.get_rank() == 0:
                torch.save(state, self.out.parent / f"{self.out.name}_ema_saved_{self.steps}.pt")
            return state

        def load_state_dict(self, state):
            self.steps, self.ema = state["steps"], state["ema"]
            if torch.distributed.get_rank() == 0:
                torch.save(state, self.out.parent / f"{self.out.name}_ema_loaded.pt")


    class Kill(L.Callback):
        """The async run dies in the middle of its second save: once the first is committed and on the
        tier, every write is held (forever), and the processes exit when training ends, the save in flight."""

        def __init__(self, strategy, plugin, root, durable):
            self.strategy, self.plugin, self.root, self.durable = strategy, plugin, root, durable
            self.held = threading.Event()

        def wrap(self, stream):
            held = self.held

            class Held:
                def write(self, data):
                    if held.is_set():
                        threading.Event().wait()
                    return stream.write(data)

                def __getattr__(self, name):
                    return getattr(stream, name)

            return Held()

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.strategy.wait()
                self.plugin.wait()
                self.held.set()

        def on_train_end(self, trainer, pl_module):
            rank = trainer.global_rank
            reports = {"strategy": self.strategy.last_report, "plugin": self.plugin.last_report}
            reports = {k: None if r is None else r.to_dict() for k, r in reports.items()}
            out = dict(reports, on_saved=self.durable, pending=self.strategy.pending(), losses=pl_module.losses)
            (self.root / f"reports_{rank}.json").write_text(json.dumps(out))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


    def fit(strategy, out, epochs, ckpt_path=None, losses_name=None, plugins=(), callbacks=()):
        model = Net()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False, plugins=list(plugins),
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1), Ema(out), *callbacks],
        )
        trainer.fit(model, ckpt_path=ckpt_path)
        if losses_name and trainer.global_rank == 0:
            Path(losses_name).write_text(json.dumps(model.losses))
        return trainer.global_rank


    mode, root = sys.argv[1], Path(sys.argv[2])
    kwargs = dict(data_parallel_size=2, tensor_parallel_size=1)
    if mode == "first":
        # The uninterrupted run, with Lightning's own strategy.
        fit(ModelParallelStrategy(**kwargs), root / "plain", 2, losses_name=root / "full.json")
        # Ours saves in the background (async_save); the plugin gets each sharded save's report and
        # copies checkpoint directories to the tier. Killed in the middle of its second save (Kill).
        durable = []
        strategy = NvcompModelParallelStrategy(**kwargs)
        kill = Kill(strategy, None, root, durable)
        kill.plugin = plugin = NvcompCheckpointIO(
            async_save=True,
            stream_wrapper=kill.wrap,
            tiers=[Tier(str(root / "tier"), every_minutes=60)],
            on_saved=lambda r: durable.append(r.path),
        )
        fit(strategy, root / "ours", 2, plugins=[plugin], callbacks=[kill])
        raise SystemExit("the async run was to be killed at the end of its training")
    else:
        # The local checkpoints are gone: every rank resumes from the newest copy on the tier.
        plugin = NvcompCheckpointIO(tiers=[Tier(str(root / "tier"))])
        newest = plugin.resume_path()
        rank = fit(NvcompModelParallelStrategy(**kwargs), root / "resumed", 2, newest, root / "resume_ours.json", plugins=[plugin])
        (root / f"newest_{rank}.json").write_text(json.dumps(newest))
        first = "epoch=0-step=3.ckpt"
        # Building the report of a committed save fails (a rank file unreadable right after the
        # commit): the save still counts, with a warning, and no rank waits at the barrier.
        import logging
        import nvcomp_checkpoint.dcp

        warned = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())
        logging.getLogger("nvcomp_checkpoint").addHandler(handler)

        def unreadable(path, **kwargs):
            raise OSError(f"{path}: unreadable (test)")

        nvcomp_checkpoint.dcp.dcp_report = unreadable
        strategy = NvcompModelParallelStrategy(**kwargs)
        fit(strategy, root / "resumed_plain", 2, root / "plain" / first, root / "resume_plain.json")
        report = None if strategy.last_report is None else strategy.last_report.to_dict()
        (root / f"unreported_{rank}.json").write_text(json.dumps({"warned": warned, "report": report}))
    # Each rank (this process and the one Lightning launched) ends without interpreter teardown:
    # a gloo worker thread still freeing a finished collective then aborts the process (see
    # tests/fresh_process.py, _rank_entry). Everything above is written and closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    '''
)


def _run(script: Path, mode: str, root: Path) -> None:
    run_python(str(script), mode, str(root), cwd=root, world=2)


@pytest.mark.slow
def test_fit_then_resume_in_fresh_processes_gives_the_same_losses(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    _run(script, "first", tmp_path)
    ours = tmp_path / "ours" / "epoch=0-step=3.ckpt"
    plain = tmp_path / "plain" / "epoch=0-step=3.ckpt"
    # Killed in the middle of its async save of step 6: a directory that is no checkpoint (no meta.pt,
    # no .metadata), while step 3's, committed in the background, is whole.
    killed = tmp_path / "ours" / "epoch=1-step=6.ckpt"
    assert killed.is_dir() and not (killed / "meta.pt").exists() and not (killed / ".metadata").exists()
    assert is_compressed_dcp_checkpoint(ours)
    assert (ours / "meta.pt").is_file() and len(list(ours.glob("*.nvcdcp"))) == 2
    assert (plain / ".metadata").is_file() and not is_compressed_dcp_checkpoint(plain)
    # meta.pt (loops, callbacks' state) is ours, compressed and checksummed; the stock strategy's is torch.save.
    assert nc.is_nvcomp_checkpoint(ours / "meta.pt") and not nc.is_nvcomp_checkpoint(plain / "meta.pt")
    assert main(["verify", "-q", str(ours)]) == 0
    assert main(["verify", "-q", str(plain)]) == 0
    _check_reports(tmp_path)
    assert _tier_steps(tmp_path) == [3]  # the first save, due at once; the run died before its end
    shutil.rmtree(tmp_path / "ours")  # the local checkpoints, as on a fresh node: it resumes from step 3

    _run(script, "resume", tmp_path)
    full = json.loads((tmp_path / "full.json").read_text())
    assert [s for s, _ in full] == list(range(6))
    # The async run trained as the uninterrupted one until it was killed (its save overlapped step 4 to 6).
    assert json.loads((tmp_path / "reports_0.json").read_text())["losses"] == full
    # plugin.resume_path(), on every rank, is the tier's copy; it resumes with the uninterrupted run's losses.
    assert {json.loads((tmp_path / f"newest_{r}.json").read_text()) for r in range(2)} == {
        str(tmp_path / "tier" / "step-0000000003")
    }
    for name in ("resume_ours.json", "resume_plain.json"):
        resumed = json.loads((tmp_path / name).read_text())
        assert resumed == full[3:], name
    assert _tier_steps(tmp_path) == [3, 6]  # the resumed run's save is copied too
    # The callback's tensors come back bit-identical from our meta.pt (the tier's copy) and from a plain one.
    for run in ("ours", "plain"):
        saved = torch.load(tmp_path / f"{run}_ema_saved_3.pt", weights_only=True)
        loaded = torch.load(tmp_path / f"resumed{'' if run == 'ours' else '_plain'}_ema_loaded.pt", weights_only=True)
        assert saved["steps"] == loaded["steps"] == 3, run
        for key, tensor in saved["ema"].items():
            assert tensor.dtype == loaded["ema"][key].dtype and torch.equal(
                tensor.view(torch.uint8), loaded["ema"][key].view(torch.uint8)
            ), (run, key)
    # The resumed run saved compressed checkpoints too.
    assert is_compressed_dcp_checkpoint(tmp_path / "resumed" / "epoch=1-step=6.ckpt")
    # A report that could not be built: the checkpoint is committed and loads, rank 0 warned, and its
    # report covers meta.pt alone.
    unreported = tmp_path / "resumed_plain" / "epoch=1-step=6.ckpt"
    assert is_compressed_dcp_checkpoint(unreported) and main(["verify", "-q", str(unreported)]) == 0
    got = [json.loads((tmp_path / f"unreported_{r}.json").read_text()) for r in range(2)]
    assert got[1] == {"warned": [], "report": None}, got[1]
    assert [w for w in got[0]["warned"] if "report could not be built" in w] == [
        f"{unreported}: committed, but its save report could not be built "
        f"(OSError: {unreported}: unreadable (test)); the report covers the other files only"
    ], got[0]["warned"]
    with nc.open(unreported / "meta.pt") as meta:
        assert got[0]["report"]["raw_bytes"] == meta.raw_bytes


def _tier_steps(root: Path) -> list[int]:
    tier = root / "tier"
    steps = sorted(int(p.name.split("-")[1]) for p in tier.iterdir() if p.is_dir())
    for step in steps:  # each copy is the whole directory: both ranks' files, .metadata, meta.pt
        copy = tier / f"step-{step:010d}"
        assert len(list(copy.glob("*.nvcdcp"))) == 2 and (copy / ".metadata").is_file() and (copy / "meta.pt").is_file(), step
    return steps


def _check_reports(root: Path) -> None:
    """Rank 0's report of the committed sharded save (strategy and plugin alike) is what the directory
    holds; rank 1 has none; the save in flight when the run was killed has none."""
    from nvcomp_checkpoint.dcp import read_dcp_files

    last = root / "ours" / "epoch=0-step=3.ckpt"
    got = [json.loads((root / f"reports_{rank}.json").read_text()) for rank in range(2)]
    assert {k: v for k, v in got[1].items() if k != "losses"} == {"strategy": None, "plugin": None, "on_saved": [], "pending": 1}
    assert got[0]["on_saved"] == [str(last)] and got[0]["pending"] == 1
    report = got[0]["strategy"]
    assert report == got[0]["plugin"] and report["path"] == str(last)
    assert report["seconds_blocked"] < report["seconds"]  # training went on while it was written
    with nc.open(last / "meta.pt") as meta:
        meta_raw = meta.raw_bytes
    assert report["stored_bytes"] == sum(p.stat().st_size for p in last.iterdir())
    assert report["raw_bytes"] == read_dcp_files(str(last)).raw_bytes + meta_raw
    weights = 24 * 48 + 48 + 48 * 8 + 8  # every parameter once, whichever rank held its shard
    assert report["components"]["weights"]["raw_bytes"] >= weights * 4
    assert report["components"]["exp_avg"]["raw_bytes"] == report["components"]["exp_avg_sq"]["raw_bytes"] == weights * 4


def test_stock_sharded_strategy_with_nvcomp_plugin_is_refused() -> None:
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    strategy.checkpoint_io = NvcompCheckpointIO()
    with pytest.raises(CheckpointError, match="NvcompModelParallelStrategy"):
        check_sharded_checkpoint_io(strategy)
    # What it says to use passes the check, as does the stock strategy saving one full file.
    ours = NvcompModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    ours.checkpoint_io = NvcompCheckpointIO()
    check_sharded_checkpoint_io(ours)
    full = ModelParallelStrategy(save_distributed_checkpoint=False)
    full.checkpoint_io = NvcompCheckpointIO()
    check_sharded_checkpoint_io(full)


def test_plugin_options_a_sharded_save_cannot_honour_are_refused(tmp_path: Path) -> None:
    from nvcomp_checkpoint import Tier

    for plugin, match in (
        (
            NvcompCheckpointIO(incremental=True),
            r"NvcompCheckpointIO\(incremental=\.\.\.\) with Lightning sharded.*Drop incremental=True",
        ),
    ):
        strategy = NvcompModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        strategy.checkpoint_io = plugin
        with pytest.raises(CheckpointError, match=match):
            check_sharded_checkpoint_io(strategy)
        # One-file checkpoints go through the plugin, which honours them.
        full = NvcompModelParallelStrategy(save_distributed_checkpoint=False)
        full.checkpoint_io = plugin
        check_sharded_checkpoint_io(full)
        plugin.teardown()
    # Tiers and async_save are honoured: each sharded checkpoint directory is copied, written in the
    # background (test_fit_then_resume_..., test_async_sharded_save_commits_in_the_background).
    strategy = NvcompModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    strategy.checkpoint_io = NvcompCheckpointIO(tiers=[Tier(str(tmp_path / "tier"))], async_save=True)
    check_sharded_checkpoint_io(strategy)


def test_stock_fsdp_sharded_with_nvcomp_plugin_is_refused() -> None:
    strategy = FSDPStrategy(state_dict_type="sharded")
    strategy.checkpoint_io = NvcompCheckpointIO()
    with pytest.raises(CheckpointError, match="NvcompFSDPStrategy"):
        check_sharded_checkpoint_io(strategy)


def test_strategy_takes_the_plugin_policy() -> None:
    from nvcomp_checkpoint import CodecPolicy

    policy = CodecPolicy(weights={"codec": "zstd", "level": 3})
    strategy = NvcompModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    strategy.checkpoint_io = NvcompCheckpointIO(policy=policy)
    assert strategy.policy == policy
    assert NvcompModelParallelStrategy(policy={"other": "none"}).policy == CodecPolicy(other="none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_fsdp1_strategy_refuses_without_cuda() -> None:
    with pytest.raises(CheckpointError, match="NvcompModelParallelStrategy"):
        NvcompFSDPStrategy(state_dict_type="sharded")


def test_compressed_full_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    nc.save({"state_dict": {"w": torch.ones(4)}}, path)
    with pytest.raises(CheckpointError, match="nvckpt decompress"):
        NvcompModelParallelStrategy(save_distributed_checkpoint=False).load_checkpoint(path)


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 4)


def _one_process_strategy(seed: int) -> tuple[NvcompModelParallelStrategy, torch.optim.Optimizer]:
    """The strategy as fit() leaves it, in this one process (no process group): a module and an Adam that has stepped."""
    torch.manual_seed(seed)
    module = _Linear()
    optimizer = torch.optim.Adam(module.parameters())
    module.net(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    strategy = NvcompModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    strategy.model, strategy._lightning_module, strategy.optimizers = module, module, [optimizer]
    return strategy, optimizer


def _save(path: Path, seed: int) -> dict[str, Any]:
    strategy, optimizer = _one_process_strategy(seed)
    state = {"state_dict": strategy.lightning_module_state_dict(), "optimizer_states": [strategy.optimizer_state(optimizer)]}
    strategy.save_checkpoint({**state, "epoch": seed}, path)
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_meta_pt_or_dcp_files_of_another_save_are_refused(tmp_path: Path) -> None:
    saved = {seed: _save(tmp_path / f"save{seed}", seed) for seed in (1, 2)}
    meta_of_other = tmp_path / "meta_of_other"
    shutil.copytree(tmp_path / "save1", meta_of_other)
    shutil.copy(tmp_path / "save2" / "meta.pt", meta_of_other / "meta.pt")
    dcp_of_other = tmp_path / "dcp_of_other"
    shutil.copytree(tmp_path / "save2", dcp_of_other)
    for p in dcp_of_other.iterdir():
        if p.name != "meta.pt":
            p.unlink()
    for p in (tmp_path / "save1").iterdir():
        if p.name != "meta.pt":
            shutil.copy(p, dcp_of_other / p.name)
    for mixed in (meta_of_other, dcp_of_other):
        strategy, _ = _one_process_strategy(3)
        before = {k: v.clone() for k, v in strategy.model.state_dict().items()}
        with pytest.raises(nc.errors.MixedSaveError, match=rf"{re.escape(str(mixed / 'meta.pt'))}: belongs to another save"):
            strategy.load_checkpoint(mixed)
        assert_tree_equal(before, strategy.model.state_dict())  # refused before any state changed
    # A meta.pt that records no DCP save (older releases) still loads; so does a whole one.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "save2", old)
    nc.save(nc.load(old / "meta.pt"), old / "meta.pt")
    for path in (tmp_path / "save2", old):
        strategy, optimizer = _one_process_strategy(3)
        assert strategy.load_checkpoint(path) == {"epoch": 2}
        assert_tree_equal(saved[2]["state_dict"], strategy.lightning_module_state_dict())
        assert_tree_equal(saved[2]["optimizer_states"][0], strategy.optimizer_state(optimizer))


class _Gate:
    """A stream wrapper that holds every write until ``release`` is set, and then fails them if ``fail`` is."""

    def __init__(self) -> None:
        self.release, self.writing, self.fail = threading.Event(), threading.Event(), False

    def __call__(self, stream: Any) -> Any:
        gate = self

        class Held:
            def write(self, data: Any) -> int:
                gate.writing.set()
                assert gate.release.wait(30), "the test never released the write"
                if gate.fail:
                    raise OSError("disk full (test)")
                written: int = stream.write(data)
                return written

            def __getattr__(self, name: str) -> Any:
                return getattr(stream, name)

        return Held()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_sharded_save_commits_in_the_background(tmp_path: Path) -> None:
    gate, durable = _Gate(), []
    plugin = NvcompCheckpointIO(async_save=True, stream_wrapper=gate, on_saved=lambda r: durable.append(r.path))
    strategy, optimizer = _one_process_strategy(1)
    strategy.checkpoint_io = plugin
    check_sharded_checkpoint_io(strategy)  # async_save is honoured for sharded saves
    strategy._begin_run()  # during a run (setup); between runs a save is written at once

    def save(name: str) -> tuple[Path, dict[str, Any]]:
        state = {"state_dict": strategy.lightning_module_state_dict(), "optimizer_states": [strategy.optimizer_state(optimizer)]}
        expected = {k: {kk: vv.clone() for kk, vv in v.items()} if k == "state_dict" else v for k, v in state.items()}
        expected["optimizer_states"] = [copy.deepcopy(state["optimizer_states"][0])]
        strategy.save_checkpoint({**state, "epoch": name}, tmp_path / name)
        return tmp_path / name, expected

    first, saved = save("first")
    # Returned while every write is held: nothing is committed, and Lightning takes nothing for a checkpoint.
    assert gate.writing.wait(10) and strategy.pending() == 1
    assert not (first / "meta.pt").exists() and not (first / ".metadata").exists()
    with torch.no_grad():  # training goes on: the save holds the state of its step, copied before it returned
        strategy.model.net.weight.add_(1.0)
    optimizer.step()
    gate.release.set()
    strategy.wait()
    assert strategy.pending() == 0 and durable == [str(first)] and strategy.last_report is not None
    loader, loaded_optimizer = _one_process_strategy(7)
    assert loader.load_checkpoint(first) == {"epoch": "first"}
    assert_tree_equal(saved["state_dict"], loader.lightning_module_state_dict())
    assert_tree_equal(saved["optimizer_states"][0], loader.optimizer_state(loaded_optimizer))

    # ModelCheckpoint's removal of the checkpoint the pending save replaces waits for its commit.
    gate.release.clear()
    second, _ = save("second")
    assert gate.writing.wait(10)
    strategy.remove_checkpoint(first)
    assert (first / "meta.pt").is_file()
    gate.release.set()
    strategy.wait()
    assert not first.exists() and (second / "meta.pt").is_file()

    # A failed background save: nothing committed, its removal skipped, and the next save (on every
    # rank: they agreed on it) raises it without starting.
    gate.release.clear()
    gate.fail = True
    third, _ = save("third")
    strategy.remove_checkpoint(second)
    gate.release.set()
    with pytest.raises(nc.errors.CheckpointWriteError, match=r"disk full \(test\).*third.*reported by the save to .*fourth"):
        save("fourth")
    assert not (third / "meta.pt").exists() and not (tmp_path / "fourth").exists() and (second / "meta.pt").is_file()
    gate.fail = False
    strategy._end_run()
    plugin.teardown()
    assert durable == [str(first), str(second)]


_CHECK_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import torch
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO, NvcompModelCheckpoint, NvcompModelParallelStrategy

    torch.set_num_threads(1)


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)
            self.steps = 0

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)


    def run(mode, root):
        kwargs = dict(data_parallel_size=1, tensor_parallel_size=1)
        strategy = NvcompModelParallelStrategy(**kwargs) if mode == "ours" else ModelParallelStrategy(**kwargs)
        plugins = [] if mode == "no_plugin" else [NvcompCheckpointIO()]
        callbacks = [NvcompModelCheckpoint(dirpath=root / "ckpt")] if mode == "callback" else []
        model = Net()
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=plugins, callbacks=callbacks, max_epochs=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=mode == "callback")
        out = {"callbacks": [type(c).__name__ for c in trainer.callbacks]}
        try:
            trainer.fit(model)
        except Exception as exc:
            out.update(error=type(exc).__name__, message=str(exc))
        out["steps"] = model.steps
        return out


    # Several fits in one process (Lightning's import is most of the time); plugins die in between.
    import gc
    results = {}
    for mode in sys.argv[1].split(","):
        results[mode] = run(mode, Path(sys.argv[2]))
        gc.collect()
    print("RESULT " + json.dumps(results))
    """
)


def _check_run(tmp_path: Path, mode: str, entry_point: bool) -> dict[str, Any]:
    """Fits in one process (``mode``: comma-separated), stock or our strategy; ``entry_point`` installs the package's entry points
    (as pip does: a dist-info directory on the path, written from pyproject.toml)."""
    import tomllib

    script = tmp_path / "check.py"
    script.write_text(_CHECK_SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if entry_point:
        project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
        site = tmp_path / "site"
        info = site / "nvcomp_checkpoint_entry_points-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvcomp-checkpoint-entry-points\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            "".join(
                f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
                for group, points in project["entry-points"].items()
            )
        )
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(line[len("RESULT ") :])


def test_stock_strategy_with_plugin_fails_at_setup_through_the_entry_point(tmp_path: Path) -> None:
    runs = _check_run(tmp_path, "plugin,no_plugin,ours", entry_point=True)
    got = runs["plugin"]
    assert "NvcompStrategyCheck" in got["callbacks"], got
    assert got.get("error") == "CheckpointError" and "NvcompModelParallelStrategy" in str(got["message"]), got
    assert got["steps"] == 0, got  # refused before training, not after an epoch of uncompressed saves
    # Without a plugin alive the entry point adds nothing; our strategy with the plugin passes.
    got = runs["no_plugin"]
    assert "NvcompStrategyCheck" not in got["callbacks"] and "error" not in got and got["steps"] == 2, got
    got = runs["ours"]
    assert "NvcompStrategyCheck" in got["callbacks"] and "error" not in got and got["steps"] == 2, got


def test_stock_strategy_with_nvcomp_model_checkpoint_fails_at_setup(tmp_path: Path) -> None:
    got = _check_run(tmp_path, "callback", entry_point=False)["callback"]
    assert got.get("error") == "CheckpointError" and "NvcompModelParallelStrategy" in str(got["message"]), got
    assert got["steps"] == 0, got
