"""Accelerate integration: real ``Accelerator`` runs on the CPU, resumed in fresh processes.

A tiny model with dropout, AdamW, a StepLR scheduler and a ``register_for_checkpointing``
object is trained, saved with ``save_state`` and resumed in a new Python process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import fresh_process  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.accelerate import MANIFEST_NAME, MARKER_NAME, is_nvcomp_state_dir, register_nvcomp_hooks  # noqa: E402
from nvcomp_checkpoint.entrypoint import CheckpointSession  # noqa: E402

N_STEPS, M_STEPS = 4, 3

# The training program every test runs, in this process (imported) or in fresh ones.
SCRIPT = textwrap.dedent(
    '''
    """Train / save / resume a tiny model with Accelerate (written by tests/test_accelerate.py)."""
    import copy, errno, json, os, random, resource, signal, sys, threading, time
    import numpy as np
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
    from nvcomp_checkpoint.errors import CheckpointWriteError


    class Tracker:
        """A registered custom object: its state picks the next batch."""

        def __init__(self):
            self.seen = 0
            self.loss_sum = 0.0

        def state_dict(self):
            return {"seen": self.seen, "loss_sum": self.loss_sum}

        def load_state_dict(self, state):
            self.seen, self.loss_sum = state["seen"], state["loss_sum"]


    class Slow:
        """Stream wrapper: holds the first write of each file until `gate` (a threading.Event), if
        any, is set, then for `delay` seconds: a slow store, as slow as the test needs."""

        def __init__(self, inner, delay, gate=None):
            self.inner, self.delay, self.first, self.gate = inner, delay, True, gate

        def write(self, data):
            if self.first:
                self.first = False
                if self.gate is not None:
                    assert self.gate.wait(60), "the test never released the write"
                time.sleep(self.delay)
            return self.inner.write(data)


    class FailFiles:
        """Stream wrapper factory: the files numbered in `fail` (1-based, in save order) hit a full disk."""

        def __init__(self, *fail):
            self.fail, self.count = set(fail), 0

        def __call__(self, stream):
            self.count += 1
            return self if self.count in self.fail else stream

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


    def build(project_dir=None, total_limit=None, hooks=True, async_save=False, stream_wrapper=None, on_saved=None, leader_load=False):
        set_seed(0)
        config = ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=project_dir is not None, total_limit=total_limit
        )
        acc = Accelerator(cpu=True, project_config=config)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(128, 8),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        model, opt, sched = acc.prepare(model, opt, sched)
        tracker = Tracker()
        acc.register_for_checkpointing(tracker)
        if hooks:
            hooks = register_nvcomp_hooks(
                acc, async_save=async_save, stream_wrapper=stream_wrapper, on_saved=on_saved, leader_load=leader_load
            )
        else:
            hooks = None
        return acc, model, opt, sched, tracker, hooks


    def train(objs, steps):
        acc, model, opt, sched, tracker, _ = objs
        model.train()
        losses = []
        for _ in range(steps):
            g = torch.Generator().manual_seed(1000 + tracker.seen)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
            # Python, NumPy and torch RNGs (dropout) all shape the loss, so each must resume.
            x = x * (1 + 0.1 * random.random()) + torch.from_numpy(np.random.standard_normal(x.shape).astype("float32")) * 0.05
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            tracker.seen += 1
            tracker.loss_sum += loss.item()
            losses.append(loss.item())
        return losses


    def snapshot(objs):
        acc, model, opt, sched, tracker, _ = objs
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        return copy.deepcopy({
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "tracker": tracker.state_dict(),
            "rng": [torch.get_rng_state(), torch.from_numpy(keys.copy()), pos, has_gauss, cached, random.getstate()],
        })


    def main(mode, out, *args):
        torch.set_num_threads(1)  # the same float reduction order in every process
        if mode == "run":  # N steps, save with and without hooks, M more steps
            objs = build()
            train(objs, int(args[0]))
            objs[0].save_state(os.path.join(out, "hooked"))
            report = objs[5].last_report
            objs[5].remove()
            objs[0].save_state(os.path.join(out, "plain"))
            at_n = snapshot(objs)
            losses = train(objs, int(args[1]))
            torch.save({"at_n": at_n, "losses": losses, "final": snapshot(objs), "report": report.to_dict()}, os.path.join(out, "run.pt"))
        elif mode == "run-async":  # N steps, an async save, M more steps while it is written
            gate = threading.Event()  # the files are held until save_state has returned and been checked
            objs = build(async_save=True, stream_wrapper=lambda s: Slow(s, float(args[2]), gate))
            train(objs, int(args[0]))
            at_n = snapshot(objs)
            hooked = os.path.join(out, "hooked")
            objs[0].save_state(hooked)
            in_flight = objs[5].pending() and not os.path.exists(hooked)
            gate.set()
            losses = train(objs, int(args[1]))  # changes every parameter while the files are written
            objs[5].wait()
            report = objs[5].last_report
            torch.save({"at_n": at_n, "losses": losses, "final": snapshot(objs), "report": report.to_dict(),
                        "in_flight": in_flight}, os.path.join(out, "run-async.pt"))
        elif mode == "exit-pending":  # an async save to a slow store, and the process ends at once
            gate = threading.Event()  # held until checked; then each file still takes 0.3 s, past the exit
            objs = build(async_save=True, stream_wrapper=lambda s: Slow(s, 0.3, gate))
            train(objs, 2)
            torch.save(snapshot(objs), os.path.join(out, "at_save.pt"))
            objs[0].save_state(os.path.join(out, "ckpt"))
            pending = objs[5].pending()
            gate.set()
            print(json.dumps({"pending_at_exit": pending}))
        elif mode == "resume":  # load a directory, M more steps; again for each further (out, directory, mode)
            runs = [(out, args[0], args[2] if len(args) > 2 else "sync")] + [tuple(args[i : i + 3]) for i in range(3, len(args), 3)]
            for out, directory, how in runs:
                objs = build(async_save=how == "async")
                objs[0].load_state(directory)
                loaded = snapshot(objs)
                losses = train(objs, int(args[1]))
                torch.save({"loaded": loaded, "losses": losses, "final": snapshot(objs)}, out)
        elif mode == "disk-full":  # save, train, fill the disk, save again
            ckpt, ballast = args[0], args[1]
            objs = build()
            train(objs, 3)
            objs[0].save_state(ckpt)
            torch.save(snapshot(objs), out)
            train(objs, 2)
            if ballast == "rlimit":  # no private tmpfs here: a per-file size limit fails the write (EFBIG)
                limit = os.path.getsize(os.path.join(ckpt, "model.nvc")) // 2
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            else:  # leave half a checkpoint of free space on the file system
                st = os.statvfs(ckpt)
                used = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
                with open(ballast, "wb") as f:
                    f.write(b"\\0" * max(0, st.f_bavail * st.f_frsize - used // 2))
            iteration = objs[0].save_iteration
            try:
                objs[0].save_state(ckpt)
            except CheckpointWriteError as exc:
                print(json.dumps({"error": str(exc), "iteration_kept": objs[0].save_iteration == iteration}))
            else:
                print(json.dumps({"error": None}))
        elif mode == "crash":  # automatic naming, total_limit=1: killed while saving checkpoint_1
            objs = build(project_dir=out, total_limit=1)
            train(objs, 3)
            objs[0].save_state()
            torch.save(snapshot(objs), os.path.join(out, "at_save.pt"))
            train(objs, 2)
            model_file = os.path.join(out, "checkpoints", "checkpoint_0", "model.nvc")
            # model.nvc fits, optimizer.nvc does not: SIGXFSZ (which Python ignores unless
            # told otherwise) kills the process mid-save.
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            limit = os.path.getsize(model_file) + 4096
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            objs[0].save_state()
            print("not killed")
        elif mode == "resume-latest":  # automatic naming: load the newest, then save once more
            objs = build(project_dir=out, total_limit=1)
            objs[0].load_state()
            torch.save(snapshot(objs), os.path.join(out, "loaded.pt"))
            objs[0].project_configuration.iteration = int(args[0])
            objs[0].save_state()
        elif mode == "ddp":  # under torchrun: two processes share one directory, once per variant (args[0]: a,b,...)
            for variant in args[0].split(","):
                project = os.path.join(out, variant)
                slow = variant == "async"  # async, to a slow store: the commit lands after load_state is called
                objs = build(project_dir=project, total_limit=1, async_save=slow,
                             stream_wrapper=(lambda s: Slow(s, 1.0)) if slow else None, leader_load=variant == "leader")
                train(objs, 2)
                objs[0].save_state()
                saved = snapshot(objs)
                train(objs, 2)
                opened = []
                sys.addaudithook(lambda event, a, opened=opened: opened.append(os.fspath(a[0])) if event == "open" and isinstance(a[0], (str, os.PathLike)) else None)
                objs[0].load_state()
                rank = objs[0].process_index
                nvc = sorted({os.path.basename(p) for p in opened if str(p).endswith(".nvc")})
                result = {"saved": saved, "loaded": snapshot(objs), "nvc_opened": nvc}
                if variant == "leader":
                    # Rank 1 finds another directory (a node-local disk): every rank raises before the collective.
                    theirs = os.path.join(project, "checkpoints", "checkpoint_0") if rank == 0 else os.path.join(project, "elsewhere")
                    try:
                        objs[0].load_state(theirs)
                        result["differ"] = "loaded"
                    except Exception as exc:
                        result["differ"] = f"{type(exc).__name__}: {exc}"
                objs[5].remove()
                torch.save(result, os.path.join(project, f"rank{rank}.pt"))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    '''
)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("accelerate_script") / "acc_train.py"
    path.write_text(SCRIPT)
    return path


def _run(*args: str, check: bool = True, python: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the training program (or, with ``python=False``, any command) in a fresh process."""
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    if python:
        proc = fresh_process.run(args, cwd=os.getcwd(), env=env, timeout=240)
    else:
        proc = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _load_pt(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _module(script: Path):
    """The training program, imported into this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("acc_train", script)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(script: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fresh-process run: N steps, ``hooked/`` and ``plain/`` saved at N, then M more steps."""
    out = tmp_path_factory.mktemp("accelerate_run")
    _run(str(script), "run", str(out), str(N_STEPS), str(M_STEPS))
    return out


def _dir_bytes(path: Path, names: list[str] | None = None) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and (names is None or f.name in names))


@pytest.fixture(scope="module")
def trained_async(script: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same N steps in a fresh process, saved with ``async_save`` to a slow store, M more steps at once."""
    out = tmp_path_factory.mktemp("accelerate_async_run")
    _run(str(script), "run-async", str(out), str(N_STEPS), str(M_STEPS), "0.3")
    return out


@pytest.fixture(scope="module")
def resumed(trained: Path, trained_async: Path, script: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synchronous and the asynchronous run's ``hooked/`` each resumed for M steps, one after
    the other in one fresh process: ``sync.pt`` and ``async.pt``."""
    out = tmp_path_factory.mktemp("accelerate_resumed")
    sync, asynchronous = (str(d / "hooked") for d in (trained, trained_async))
    _run(str(script), "resume", str(out / "sync.pt"), sync, str(M_STEPS), "sync", str(out / "async.pt"), asynchronous, "async")
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_in_fresh_process_matches_uninterrupted_run(trained: Path, trained_async: Path, resumed: Path, mode: str) -> None:
    directory = trained if mode == "sync" else trained_async
    run = _load_pt(directory / ("run.pt" if mode == "sync" else "run-async.pt"))
    if mode == "async":
        # save_state returned before anything was on disk, and training went on meanwhile ...
        assert run["in_flight"]
        assert run["report"]["seconds"] - run["report"]["seconds_blocked"] >= 0.5  # two files held 0.3 s each
        # ... yet the files hold the state at step N: the same as the synchronous run's.
        assert_tree_equal(_load_pt(trained / "run.pt")["at_n"], run["at_n"])
        assert sorted(os.listdir(directory / "hooked")) == sorted(
            [
                MANIFEST_NAME,
                MARKER_NAME,
                "model.nvc",
                "optimizer.nvc",
                "scheduler.bin",
                "random_states_0.pkl",
                "custom_checkpoint_0.pkl",
            ]
        )
    resumed = _load_pt(resumed / f"{mode}.pt")
    # Model, optimizer, scheduler, custom object and every RNG bit-identical at step N ...
    assert_tree_equal(run["at_n"], resumed["loaded"])
    # ... and training continues exactly as the uninterrupted run did.
    assert resumed["losses"] == run["losses"]
    assert_tree_equal(run["final"], resumed["final"])
    assert run["at_n"]["tracker"]["seen"] == N_STEPS and run["at_n"]["scheduler"]["last_epoch"] == N_STEPS


def test_saved_directory_is_compressed_and_smaller(trained: Path) -> None:
    hooked, plain = trained / "hooked", trained / "plain"
    names = sorted(p.name for p in hooked.iterdir())
    assert names == sorted(
        [
            MANIFEST_NAME,
            MARKER_NAME,
            "model.nvc",
            "optimizer.nvc",
            "scheduler.bin",
            "random_states_0.pkl",
            "custom_checkpoint_0.pkl",
        ]
    )
    assert "model.safetensors" in os.listdir(plain) and "optimizer.bin" in os.listdir(plain)
    assert is_nvcomp_state_dir(hooked) and not is_nvcomp_state_dir(plain)
    assert nc.is_nvcomp_checkpoint(hooked / "optimizer.nvc") and nc.is_nvcomp_checkpoint(hooked / "model.nvc")
    with nc.open(hooked / "optimizer.nvc") as reader:
        assert {"exp_avg", "exp_avg_sq"} <= set(reader.summary())
    # Accelerate's other files are written by Accelerate, byte for byte as without the hooks.
    assert (hooked / "scheduler.bin").read_bytes() == (plain / "scheduler.bin").read_bytes()
    assert (hooked / "custom_checkpoint_0.pkl").read_bytes() == (plain / "custom_checkpoint_0.pkl").read_bytes()
    compressed = _dir_bytes(hooked, ["model.nvc", "optimizer.nvc"])
    uncompressed = _dir_bytes(plain, ["model.safetensors", "optimizer.bin"])
    assert compressed < 0.95 * uncompressed, (compressed, uncompressed)
    assert _dir_bytes(hooked) < _dir_bytes(plain)
    report = _load_pt(trained / "run.pt")["report"]
    assert report["stored_bytes"] == compressed
    assert set(report["components"]) >= {"weights", "exp_avg", "exp_avg_sq"}


def test_accelerate_without_the_hooks_fails_on_a_directory_that_says_what_to_call(trained: Path, script: Path) -> None:
    module = _module(script)
    objs = module.build(hooks=False)
    with pytest.raises(FileNotFoundError):  # Accelerate's own error: it looks for its model file
        objs[0].load_state(str(trained / "hooked"))
    text = (trained / "hooked" / MARKER_NAME).read_text()
    assert "register_nvcomp_hooks(accelerator)" in text and "load_state" in text


def test_plain_directory_still_loads(trained: Path, script: Path) -> None:
    objs = _module(script).build()
    objs[0].load_state(str(trained / "plain"))
    assert_tree_equal(_load_pt(trained / "run.pt")["at_n"], _module(script).snapshot(objs))


def _flip_byte(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "damage", "error"),
    [
        ("optimizer.nvc", "flip", nc.errors.ChecksumError),
        ("model.nvc", "truncate", nc.errors.FormatError),
        ("scheduler.bin", "flip", nc.errors.ChecksumError),
        ("custom_checkpoint_0.pkl", "delete", nc.errors.FormatError),
    ],
)
def test_damaged_file_is_named_at_load(trained: Path, script: Path, tmp_path: Path, name: str, damage: str, error: type) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "hooked", ckpt)
    target = ckpt / name
    if damage == "flip":
        _flip_byte(target, 0.5)
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    else:
        target.unlink()
    objs = _module(script).build()
    with pytest.raises(error, match=name.replace(".", r"\.")):
        objs[0].load_state(str(ckpt))


def test_nvc_bytes_corrupted_in_place_are_caught_by_their_checksums(trained: Path, script: Path, tmp_path: Path) -> None:
    # Same size, different bytes: the manifest does not hash .nvc files; their frames do.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "hooked", ckpt)
    _flip_byte(ckpt / "model.nvc", 0.3)
    objs = _module(script).build()
    with pytest.raises(nc.errors.ChecksumError, match=r"model\.nvc"):
        objs[0].load_state(str(ckpt))


def test_an_nvc_file_of_another_save_is_refused_even_at_the_same_size(script: Path, tmp_path: Path) -> None:
    module = _module(script)
    objs = module.build()
    acc = objs[0]
    saves = []
    for step in (1, 2):
        module.train(objs, 1)
        acc.save_state(str(tmp_path / f"step{step}"))
        saves.append(module.snapshot(objs))
    for name in ("model.nvc", "optimizer.nvc"):
        mixed = tmp_path / f"mixed-{name}"
        shutil.copytree(tmp_path / "step2", mixed)
        shutil.copy(tmp_path / "step1" / name, mixed / name)  # step 1's weights with step 2's optimizer, or the reverse
        forged = json.loads((mixed / MANIFEST_NAME).read_text())
        forged["files"][name]["bytes"] = (mixed / name).stat().st_size  # as if both saves' files had the same size
        (mixed / MANIFEST_NAME).write_text(json.dumps(forged))
        fresh = module.build()
        with pytest.raises(nc.errors.MixedSaveError, match=rf"{re.escape(str(mixed / name))}: belongs to another save"):
            fresh[0].load_state(str(mixed))
    manifest = json.loads((tmp_path / "step2" / MANIFEST_NAME).read_text())
    for name in ("model.nvc", "optimizer.nvc"):  # each .nvc file's identity: its index digest
        with nc.open(tmp_path / "step2" / name) as reader:
            assert manifest["files"][name]["index_xxh3"] == reader.index_xxh3
    # A manifest written before index digests were recorded still loads.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "step2", old)
    for info in manifest["files"].values():
        info.pop("index_xxh3", None)
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    fresh = module.build()
    fresh[0].load_state(str(old))
    assert_tree_equal(saves[1], module.snapshot(fresh))


def test_nvc_files_without_manifest_are_refused_as_incomplete(trained: Path, script: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "hooked", ckpt)
    (ckpt / MANIFEST_NAME).unlink()
    objs = _module(script).build()
    with pytest.raises(nc.errors.FormatError, match="did not complete"):
        objs[0].load_state(str(ckpt))


def _private_tmpfs_works(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = where / "probe"
    probe.mkdir()
    cmd = ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{probe}'"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_failed_save_leaves_previous_checkpoint_loadable(script: Path, tmp_path: Path) -> None:
    # A real ENOSPC on a small private tmpfs when this kernel allows one (no root needed with
    # user namespaces); otherwise RLIMIT_FSIZE makes the kernel fail the write with EFBIG.
    disk = tmp_path / "disk"
    disk.mkdir()
    ckpt, snap, loaded = disk / "ckpt", tmp_path / "at_save.pt", tmp_path / "loaded.pt"
    if _private_tmpfs_works(tmp_path):
        inner = (
            f"mount -t tmpfs -o size=8m tmpfs '{disk}' && "
            f"'{sys.executable}' '{script}' disk-full '{snap}' '{ckpt}' '{disk / 'ballast'}' && "
            f"'{sys.executable}' '{script}' resume '{loaded}' '{ckpt}' 0"
        )
        proc = _run("unshare", "-rm", "sh", "-c", inner, python=False)
        expected = "No space left on device"
    else:
        proc = _run(str(script), "disk-full", str(snap), str(ckpt), "rlimit")
        _run(str(script), "resume", str(loaded), str(ckpt), "0")
        expected = "File too large"
    result = json.loads(proc.stdout.strip().splitlines()[0])
    assert result["error"] is not None, "the save on a full disk did not fail"
    assert str(ckpt) in result["error"] and expected in result["error"] and "untouched" in result["error"]
    assert result["iteration_kept"]
    # The previous checkpoint loads in a fresh process, exactly as it was saved.
    assert_tree_equal(_load_pt(snap), _load_pt(loaded)["loaded"])


def test_crash_mid_save_with_total_limit_keeps_newest_complete_checkpoint(script: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    proc = _run(str(script), "crash", str(project), check=False)
    assert proc.returncode == -signal.SIGXFSZ, (proc.returncode, proc.stdout, proc.stderr)
    # Plain Accelerate would have deleted checkpoint_0 (total_limit=1) before writing checkpoint_1.
    assert os.listdir(project / "checkpoints") == ["checkpoint_0"]
    assert is_nvcomp_state_dir(project / "checkpoints" / "checkpoint_0")
    staging = project / ".checkpoint_1.nvckpt-staging"
    assert (staging / "model.nvc").is_file() and not (staging / MANIFEST_NAME).exists()
    # A fresh process resumes from checkpoint_0, then saves checkpoint_1, rotating checkpoint_0 out.
    _run(str(script), "resume-latest", str(project), "1")
    assert_tree_equal(_load_pt(project / "at_save.pt"), _load_pt(project / "loaded.pt"))
    assert os.listdir(project / "checkpoints") == ["checkpoint_1"]
    assert is_nvcomp_state_dir(project / "checkpoints" / "checkpoint_1")
    assert not [p for p in os.listdir(project) if p.startswith(".")]


def test_total_limit_rotation_matches_accelerate_and_keeps_newest(script: Path, tmp_path: Path) -> None:
    module = _module(script)
    names, last = {}, {}
    for hooks in (True, False):
        project = tmp_path / ("hooked" if hooks else "plain")
        objs = module.build(project_dir=str(project), total_limit=2, hooks=hooks)
        for i in range(4):
            module.train(objs, 1)
            saved = objs[0].save_state()
            assert os.fspath(saved) == str(project / "checkpoints" / f"checkpoint_{i}")
        names[hooks] = sorted(os.listdir(project / "checkpoints"))
        last[hooks] = module.snapshot(objs)
    assert names[True] == names[False] == ["checkpoint_2", "checkpoint_3"]
    project = tmp_path / "hooked"
    assert all(is_nvcomp_state_dir(project / "checkpoints" / n) for n in names[True])
    # load_state() with automatic naming picks the newest, as Accelerate does.
    objs = module.build(project_dir=str(project), total_limit=2)
    module.train(objs, 2)  # move away from the saved state first
    objs[0].load_state()
    fresh = module.snapshot(objs)
    for key in ("model", "optimizer", "scheduler", "tracker"):
        assert_tree_equal(last[True][key], fresh[key])
    # Accelerate's rule for an existing checkpoint_<n> still applies.
    objs[0].project_configuration.iteration = 3
    with pytest.raises(ValueError, match="already exists"):
        objs[0].save_state()


def test_user_hooks_still_run_and_compose(script: Path, tmp_path: Path) -> None:
    objs = _module(script).build(hooks=False)
    acc = objs[0]
    seen: dict[str, object] = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (len(models), len(weights), sorted(weights[0]))
        Path(output_dir, "extra.json").write_text('{"note": 1}')

    def load_hook(models, input_dir):
        seen["load"] = (len(models), json.loads(Path(input_dir, "extra.json").read_text()))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    hooks = register_nvcomp_hooks(acc)  # registered after the user's, still runs after them
    acc.save_state(str(tmp_path / "ckpt"))
    assert seen["save"][:2] == (1, 1) and "0.weight" in seen["save"][2]
    assert "extra.json" in json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_text())["files"]
    acc.load_state(str(tmp_path / "ckpt"))
    assert seen["load"] == (1, {"note": 1})
    assert hooks.last_report is not None and hooks.last_report.stored_bytes == sum(
        (tmp_path / "ckpt" / n).stat().st_size for n in ("model.nvc", "optimizer.nvc")
    )
    # One name per idea: last_report; the per-file dict is deprecated. The hooks hold their session.
    with pytest.warns(DeprecationWarning, match="last_report"):
        assert sorted(hooks.last_reports) == ["model.nvc", "optimizer.nvc"]
    assert isinstance(hooks.session, CheckpointSession) and hooks.policy is hooks.session.options.policy


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_overwrite_same_directory_and_remove(
    script: Path, tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:  # the path taken on file systems and platforms without RENAME_EXCHANGE
        from nvcomp_checkpoint.storage import LocalStorage

        monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
    module = _module(script)
    objs = module.build()
    acc, ckpt = objs[0], tmp_path / "ckpt"
    objs[5].remove()
    acc.save_state(str(ckpt))  # a plain directory first
    hooks = register_nvcomp_hooks(acc)
    module.train(objs, 2)
    acc.save_state(str(ckpt))  # replaces it as a whole: no stale model.safetensors next to model.nvc
    state = module.snapshot(objs)
    assert sorted(os.listdir(ckpt)) == sorted(
        [
            MANIFEST_NAME,
            MARKER_NAME,
            "model.nvc",
            "optimizer.nvc",
            "scheduler.bin",
            "random_states_0.pkl",
            "custom_checkpoint_0.pkl",
        ]
    )
    module.train(objs, 1)
    acc.save_state(str(ckpt))  # compressed over compressed
    state = module.snapshot(objs)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    with pytest.raises(nc.errors.CheckpointError, match="already has"):
        register_nvcomp_hooks(acc)
    hooks.remove()
    acc.save_state(str(tmp_path / "plain"))  # Accelerate's own save_state again
    assert {"model.safetensors", "optimizer.bin"} <= set(os.listdir(tmp_path / "plain"))
    fresh = module.build()
    fresh[0].load_state(str(ckpt))
    for key in ("model", "optimizer", "scheduler", "tracker"):
        assert_tree_equal(state[key], module.snapshot(fresh)[key])


STATE_FILES = [
    MANIFEST_NAME,
    MARKER_NAME,
    "model.nvc",
    "optimizer.nvc",
    "scheduler.bin",
    "random_states_0.pkl",
    "custom_checkpoint_0.pkl",
]


def _identity(*paths: Path) -> dict[Path, tuple[int, int, bytes | None]]:
    """Inode, device and (for files) contents: what must not change in entries a save does not own."""
    return {p: (p.stat().st_ino, p.stat().st_dev, p.read_bytes() if p.is_file() else None) for p in paths}


@pytest.mark.parametrize(
    ("where", "async_save"),
    [(".", False), ("absolute", False), ("..", False), (".", True)],
    ids=["dot", "absolute-cwd", "parent-of-cwd", "dot-async"],
)
def test_save_into_the_working_directory_keeps_it_and_its_contents(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, async_save: bool
) -> None:
    # Plain Accelerate writes its files into the directory and leaves the rest alone; replacing
    # the directory would delete the process's working directory and re-create everything in it.
    module = _module(script)
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.txt").write_text("keep")
    (work / "notes.txt").write_text("mine")
    cwd = work / "data" if where == ".." else work
    monkeypatch.chdir(cwd)
    target = str(cwd) if where == "absolute" else where
    objs = module.build(async_save=async_save)
    acc, hooks = objs[0], objs[5]
    module.train(objs, 2)
    acc.save_state(str(work / "ckpt_a"))  # another checkpoint in the same directory
    hooks.wait()
    kept = _identity(
        work, work / "notes.txt", work / "data", work / "data" / "train.txt", work / "ckpt_a", *(work / "ckpt_a").iterdir()
    )
    for _ in range(2):  # into a directory without, then with, a previous checkpoint
        module.train(objs, 1)
        assert os.fspath(acc.save_state(target)) == target
        state = module.snapshot(objs)
        hooks.wait()
    assert os.getcwd() == str(cwd)  # still there: relative paths keep working
    Path("after.txt").write_text("x")
    Path("after.txt").unlink()
    assert _identity(*kept) == kept  # the same directories and files, not copies
    assert sorted(os.listdir(work)) == sorted([*STATE_FILES, "notes.txt", "data", "ckpt_a"])
    assert sorted(json.loads((work / MANIFEST_NAME).read_text())["files"]) == sorted(STATE_FILES[1:])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    hooks.remove()
    fresh = module.build()
    fresh[0].load_state(target)
    assert_tree_equal(state, module.snapshot(fresh))  # model, optimizer, scheduler, RNGs: bit-identical


def test_failed_save_into_the_working_directory_leaves_previous_checkpoint(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _module(script)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    objs = module.build(stream_wrapper=module.FailFiles(3))  # the second save's model file hits a full disk
    acc = objs[0]
    module.train(objs, 2)
    acc.save_state(".")
    state = module.snapshot(objs)
    kept = _identity(work, *work.iterdir())
    module.train(objs, 1)
    with pytest.raises(nc.errors.CheckpointWriteError, match="untouched"):
        acc.save_state(".")
    assert os.getcwd() == str(work)
    assert _identity(*kept) == kept and sorted(os.listdir(work)) == sorted([*STATE_FILES, "notes.txt"])
    fresh = module.build()
    fresh[0].load_state(".")
    assert_tree_equal(state, module.snapshot(fresh))


def test_a_failed_save_is_explained_whatever_the_directory_is_called(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether a failure is already save_state's explained error is decided by its type: a path that
    # reads like that error's text must not keep a file's error from being explained.
    from nvcomp_checkpoint.errors import StateSaveError

    module = _module(script)
    work = tmp_path / "save_state failed (disk)"
    work.mkdir()
    monkeypatch.chdir(work)
    objs = module.build(stream_wrapper=module.FailFiles(3))  # the second save's model file hits a full disk
    acc = objs[0]
    module.train(objs, 1)
    acc.save_state(str(work / "ckpt"))
    with pytest.raises(StateSaveError) as info:
        acc.save_state(str(work / "ckpt"))
    assert isinstance(info.value, nc.errors.CheckpointWriteError)  # what callers catch
    message = str(info.value)
    assert message.startswith(f"{work / 'ckpt'}: save_state failed") and "Nothing was committed" in message
    assert "disk is full" in message


def test_directory_with_files_of_your_own_is_updated_in_place(
    script: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A checkpoint directory where you also keep notes and a tokenizer folder (or a project root):
    # the save writes its files into it, file by file, as Accelerate does, and leaves the rest alone.
    module = _module(script)
    objs = module.build()
    acc, ckpt = objs[0], tmp_path / "ckpt"
    objs[5].remove()
    acc.save_state(str(ckpt))  # a plain directory first ...
    (ckpt / "notes.txt").write_text("mine")  # ... where the user also keeps files of their own
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "vocab.json").write_text("{}")
    kept = _identity(ckpt, ckpt / "notes.txt", ckpt / "tokenizer", ckpt / "tokenizer" / "vocab.json")
    hooks = register_nvcomp_hooks(acc)
    for _ in range(2):  # over the plain files, then over compressed ones
        module.train(objs, 1)
        with caplog.at_level("WARNING", logger="nvcomp_checkpoint.integrations.accelerate"):
            acc.save_state(str(ckpt))
        state = module.snapshot(objs)
    assert _identity(*kept) == kept
    # Accelerate's own model and optimizer files of the plain save stay, as Accelerate leaves
    # files it does not rewrite; the first save said so once.
    assert sorted(os.listdir(ckpt)) == sorted([*STATE_FILES, "notes.txt", "tokenizer", "model.safetensors", "optimizer.bin"])
    warned = [r.getMessage() for r in caplog.records if "written without nvcomp-checkpoint" in r.getMessage()]
    assert len(warned) == 1 and "model.safetensors, optimizer.bin" in warned[0]
    assert sorted(json.loads((ckpt / MANIFEST_NAME).read_text())["files"]) == sorted(STATE_FILES[1:])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    assert not [p for p in os.listdir(ckpt) if p.startswith(".")]
    hooks.remove()
    fresh = module.build()
    fresh[0].load_state(str(ckpt))
    assert_tree_equal(state, module.snapshot(fresh))


def test_interrupted_replacement_is_recovered_at_load(trained: Path, script: Path, tmp_path: Path) -> None:
    # Where RENAME_EXCHANGE is unavailable, a crash between the two renames leaves only
    # `.ckpt.nvckpt-old`; load_state puts it back.
    shutil.copytree(trained / "hooked", tmp_path / ".ckpt.nvckpt-old")
    module = _module(script)
    objs = module.build()
    objs[0].load_state(str(tmp_path / "ckpt"))
    assert is_nvcomp_state_dir(tmp_path / "ckpt") and not (tmp_path / ".ckpt.nvckpt-old").exists()
    assert_tree_equal(_load_pt(trained / "run.pt")["at_n"]["model"], module.snapshot(objs)["model"])


_DDP_MODES = ("sync", "async", "leader")


@pytest.fixture(scope="module")
def ddp_run(script: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``torchrun`` of two processes that share a directory, once per mode in turn: a launcher
    and two ranks importing Accelerate once instead of once per mode."""
    out = tmp_path_factory.mktemp("accelerate_ddp")
    _run(
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), "ddp", str(out), ",".join(_DDP_MODES)
    )
    return out


@pytest.mark.parametrize("mode", _DDP_MODES)
def test_two_processes_share_one_directory(ddp_run: Path, mode: str) -> None:
    # DDP on the CPU (gloo): the main process writes and commits, every rank its RNG state. With
    # async saves, rank 1's load_state must wait for rank 0's background commit. With leader_load,
    # rank 0 alone reads the .nvc files and rank 1 receives their state over the process group.
    project = ddp_run / mode
    ckpt = project / "checkpoints" / "checkpoint_0"
    files = json.loads((ckpt / MANIFEST_NAME).read_text())["files"]
    assert {"model.nvc", "optimizer.nvc", "random_states_0.pkl", "random_states_1.pkl"} <= set(files)
    for rank in (0, 1):
        result = _load_pt(project / f"rank{rank}.pt")
        assert_tree_equal(result["saved"], result["loaded"])
        read_by_this_rank = mode != "leader" or rank == 0
        assert result["nvc_opened"] == (["model.nvc", "optimizer.nvc"] if read_by_this_rank else []), (rank, result["nvc_opened"])
        if mode == "leader":
            assert result["differ"].startswith("CheckpointError: load_state: the ranks see different checkpoint files"), result[
                "differ"
            ]


def test_async_commit_and_rotation_wait_until_the_files_are_durable(script: Path, tmp_path: Path) -> None:
    # Automatic naming, total_limit=1, a slow store: a reader of checkpoints/ must always find one
    # complete checkpoint, and rotation must never remove it before the next one is committed.
    module = _module(script)
    project = tmp_path / "project"
    committed: list[tuple[str, bool]] = []

    def on_saved(report: nc.SaveReport) -> None:
        committed.append((Path(report.path).name, is_nvcomp_state_dir(report.path)))

    gate = threading.Event()  # closed: the store holds each file until the test has looked
    objs = module.build(
        project_dir=str(project),
        total_limit=1,
        async_save=True,
        stream_wrapper=lambda s: module.Slow(s, 0.3, gate),
        on_saved=on_saved,
    )
    acc, hooks = objs[0], objs[5]
    checkpoints = project / "checkpoints"

    module.train(objs, 1)
    acc.save_state()
    assert hooks.pending() and not (checkpoints / "checkpoint_0").exists()
    staging = project / ".checkpoint_0.nvckpt-staging"
    assert (staging / "scheduler.bin").is_file() and not (staging / MANIFEST_NAME).exists()  # Accelerate's files: at once
    gate.set()
    hooks.wait()
    assert os.listdir(checkpoints) == ["checkpoint_0"] and is_nvcomp_state_dir(checkpoints / "checkpoint_0")

    gate.clear()  # nothing is being written: checkpoint_1's files will be held
    module.train(objs, 1)
    acc.save_state()  # checkpoint_1, pending: total_limit=1 must not have removed checkpoint_0 yet
    assert hooks.pending()
    assert os.listdir(checkpoints) == ["checkpoint_0"] and is_nvcomp_state_dir(checkpoints / "checkpoint_0")

    module.train(objs, 1)
    at_save = module.snapshot(objs)
    gate.set()  # from here on each file is only slow (0.3 s)
    acc.save_state()  # waited for checkpoint_1's commit and rotation first
    assert committed[-1] == ("checkpoint_1", True)
    assert os.listdir(checkpoints) == ["checkpoint_1"] and is_nvcomp_state_dir(checkpoints / "checkpoint_1")
    assert hooks.pending() and acc.save_iteration == 3
    module.train(objs, 2)  # training goes on while checkpoint_2 is written

    acc.load_state()  # waits for checkpoint_2, then loads the newest
    loaded = module.snapshot(objs)
    for key in ("model", "optimizer", "scheduler", "tracker"):
        assert_tree_equal(at_save[key], loaded[key])
    assert os.listdir(checkpoints) == ["checkpoint_2"]
    assert committed == [("checkpoint_0", True), ("checkpoint_1", True), ("checkpoint_2", True)]
    report = hooks.last_report
    assert report is not None and report.path.endswith("checkpoint_2")
    assert report.seconds - report.seconds_blocked >= 0.5  # the two files were written after save_state returned
    assert report.stored_bytes == sum((checkpoints / "checkpoint_2" / n).stat().st_size for n in ("model.nvc", "optimizer.nvc"))
    assert not [p for p in os.listdir(project) if p.startswith(".")]
    hooks.remove()


def test_async_failure_commits_nothing_and_is_raised_by_the_next_call(script: Path, tmp_path: Path) -> None:
    module = _module(script)
    project = tmp_path / "project"
    # Files 1-2 are checkpoint_0; the optimizer file of checkpoint_1 (file 4) and then the model
    # file of the save after it (file 7: 5-6 are the retried checkpoint_1) hit a full disk.
    objs = module.build(project_dir=str(project), total_limit=1, async_save=True, stream_wrapper=module.FailFiles(4, 7))
    acc, hooks = objs[0], objs[5]
    checkpoints = project / "checkpoints"
    module.train(objs, 1)
    acc.save_state()
    hooks.wait()
    at_0 = module.snapshot(objs)

    module.train(objs, 1)
    acc.save_state()  # returns: the failure happens in the background
    module.train(objs, 1)
    with pytest.raises(nc.errors.CheckpointWriteError) as info:
        acc.save_state()  # reports it, and is not started itself
    message = str(info.value)
    assert str(checkpoints / "checkpoint_1") in message and "disk is full" in message and "untouched" in message
    assert "next save_state" in message
    assert os.listdir(checkpoints) == ["checkpoint_0"]  # not rotated away
    assert not [p for p in os.listdir(project) if p.startswith(".")]  # staging removed
    assert acc.save_iteration == 1  # as after a synchronous failure: the number is reused

    acc.save_state()  # the retry commits checkpoint_1 and rotates checkpoint_0 out
    at_1 = module.snapshot(objs)
    hooks.wait()
    assert os.listdir(checkpoints) == ["checkpoint_1"]

    module.train(objs, 1)
    acc.save_state()  # checkpoint_2 fails in the background ...
    with pytest.raises(nc.errors.CheckpointWriteError, match="checkpoint_2.*load_state"):
        acc.load_state()  # ... and load_state says so instead of silently loading checkpoint_1
    assert os.listdir(checkpoints) == ["checkpoint_1"]
    acc.load_state()
    loaded = module.snapshot(objs)
    for key in ("model", "optimizer", "scheduler", "tracker"):
        assert_tree_equal(at_1[key], loaded[key])
    assert not torch.equal(at_0["model"]["0.weight"], at_1["model"]["0.weight"])
    hooks.remove()


def test_async_save_pending_at_exit_is_committed_before_the_process_ends(script: Path, tmp_path: Path) -> None:
    proc = _run(str(script), "exit-pending", str(tmp_path))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"pending_at_exit": True}
    assert is_nvcomp_state_dir(tmp_path / "ckpt")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    objs = _module(script).build()
    objs[0].load_state(str(tmp_path / "ckpt"))
    fresh = _module(script).snapshot(objs)
    saved = _load_pt(tmp_path / "at_save.pt")
    for key in ("model", "optimizer", "scheduler", "tracker"):
        assert_tree_equal(saved[key], fresh[key])


def test_import_without_accelerate_names_the_extra_to_install() -> None:
    # ``None`` in sys.modules makes ``import accelerate`` fail as on a machine without it.
    code = textwrap.dedent("""
        import sys
        sys.modules["accelerate"] = None
        try:
            from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
        except ImportError as exc:
            print(type(exc).__name__, exc.name, exc)
        else:
            sys.exit("imported without Accelerate")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(
        "ImportError accelerate nvcomp_checkpoint.accelerate needs Accelerate: "
        "pip install -e '.[accelerate]' in a clone of the nvcomp-checkpoint repository, or "
        'pip install "$(ls dist/nvcomp_checkpoint-'
    ), proc.stdout
