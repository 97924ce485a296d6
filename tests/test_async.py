"""Async saves: snapshot consistency, ordering, back-pressure, errors, crash safety, callbacks.

Background writes are held at a gate (a stream wrapper) where a test needs a save to be
"still under way"; nothing is mocked: real files, real threads, real subprocesses.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointWriteError, UnsupportedObjectError

SRC = str(Path(__file__).resolve().parents[1] / "src")


class GatedStream:
    """Passes writes on only once ``gate`` is set; ``started`` is set at the first write."""

    def __init__(self, inner: IO[bytes], gate: threading.Event, started: threading.Event) -> None:
        self.inner, self.gate, self.started = inner, gate, started

    def write(self, data: Any) -> int:
        self.started.set()
        if not self.gate.wait(30):
            raise RuntimeError("test gate never opened")
        return self.inner.write(data)


def gated() -> tuple[Any, threading.Event, threading.Event]:
    gate, started = threading.Event(), threading.Event()
    return (lambda s: GatedStream(s, gate, started)), gate, started


class DiskFullStream:
    """Every write also goes to /dev/full, so the kernel answers ENOSPC as on a full disk."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.full = open("/dev/full", "wb", buffering=0)  # noqa: SIM115

    def write(self, data: Any) -> int:
        try:
            self.full.write(b"\0")
        except OSError:
            self.full.close()
            raise
        return self.inner.write(data)


def open_later(gate: threading.Event, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, gate.set)
    timer.start()
    return timer


def tiny_training_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 64)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture(autouse=True)
def _no_leftover_saves():
    yield
    nc.wait_for_saves(timeout=60)


# -- consistency --------------------------------------------------------------------------------
def test_training_right_after_save_async_does_not_reach_the_file(tmp_path: Path) -> None:
    """Lightning issue 20953: a background save must not see the next optimizer step."""
    model, opt = tiny_training_state()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "meta": {"step": 1, "seen": [1]}}
    expected = copy.deepcopy(ckpt)
    wrap, gate, started = gated()
    path = tmp_path / "step1.nvc"
    with nc.AsyncSaver() as saver:
        handle = saver.save(ckpt, path, stream_wrapper=wrap)
        assert started.wait(10)  # the background save is under way, held before its first write
        for _ in range(3):
            train_step(model, opt)  # in place: parameters and AdamW moments
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpt["meta"]["step"] = 4
        ckpt["meta"]["seen"].append(4)
        changed = model.state_dict()
        assert not torch.equal(changed["0.weight"], expected["model"]["0.weight"])
        gate.set()
        report = handle.result(timeout=30)
    loaded = nc.load(path)
    assert_tree_equal(expected["model"], loaded["model"])
    assert_tree_equal(expected["optimizer"]["state"], loaded["optimizer"]["state"])
    assert loaded["meta"] == {"step": 1, "seen": [1]}
    assert report.seconds_blocked is not None and report.seconds_blocked < report.seconds


def test_async_save_loads_bit_identical_and_matches_sync_save(tmp_path: Path) -> None:
    torch.manual_seed(1)
    base = torch.randn(64, 48)
    shared = torch.randn(300)
    tree: dict[str, Any] = {
        "fp32": torch.randn(513, 17),
        "big": torch.randn(9_000_000),  # over 32 MiB: copied by the snapshot's thread pool
        "bf16": torch.randn(4099).to(torch.bfloat16),
        "fp16": torch.randn(33, 65).half(),
        "f64": torch.randn(3, 1000, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (2000,)),
        "u8": torch.randint(0, 255, (5000,), dtype=torch.uint8),
        "bool": torch.rand(777) > 0.5,
        "c64": torch.randn(100, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "strided": base.t()[::2],
        "param": torch.nn.Parameter(torch.randn(20, 20)),
        "frozen": torch.nn.Parameter(torch.randn(7), requires_grad=False),
        "tied": [shared, shared],
        "nested": ({"x": torch.arange(10)}, [1, "two", 3.0, None]),
    }
    with nc.AsyncSaver() as saver:
        saver.save(tree, tmp_path / "async.nvc").result(timeout=60)
    nc.save(tree, tmp_path / "sync.nvc")
    loaded = nc.load(tmp_path / "async.nvc")
    assert_tree_equal(tree, loaded)
    assert loaded["tied"][0] is loaded["tied"][1]
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
    assert isinstance(loaded["frozen"], torch.nn.Parameter) and not loaded["frozen"].requires_grad
    with nc.open(tmp_path / "async.nvc") as a, nc.open(tmp_path / "sync.nvc") as s:
        assert a.keys() == s.keys()
        for key in a.keys():
            ea, es = a.entry(key), s.entry(key)
            assert (ea.dtype, ea.shape, ea.component, ea.device, ea.parameter, ea.requires_grad) == (
                es.dtype,
                es.shape,
                es.component,
                es.device,
                es.parameter,
                es.requires_grad,
            ), key
            assert [f.xxh for f in ea.frames] == [f.xxh for f in es.frames], key
        assert all(err is None for _, err in a.verify())


def test_host_copy_of_a_gpu_tensor_records_its_gpu(tmp_path: Path) -> None:
    """A GPU tensor staged to host memory by a snapshot is recorded on its GPU, as a sync save would."""
    t = torch.randn(1000)
    setattr(t, nc.snapshot.SOURCE_DEVICE_ATTR, "cuda:0")
    nc.save({"w": t}, tmp_path / "staged.nvc")
    with nc.open(tmp_path / "staged.nvc") as reader:
        assert reader.entry("w").device == "cuda:0"
    out = nc.load(tmp_path / "staged.nvc", map_location="cpu")["w"]
    assert torch.equal(out, t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gpu_budget", [None, 0], ids=["on-gpu", "staged-through-pinned"])
def test_gpu_snapshot_on_device_or_staged(tmp_path: Path, gpu_budget: int | None) -> None:
    torch.manual_seed(0)
    tree = {
        "w": torch.randn(3_000_000, device="cuda"),  # 12 MB: a dozen pieces of the 1 MiB halves
        "b": torch.randn(1001, device="cuda").to(torch.bfloat16),
        "strided": torch.randn(300, 200, device="cuda").t(),
        "cpu": torch.randn(100),
    }
    expected = {k: v.clone() for k, v in tree.items()}
    gpu_bytes = sum(v.numel() * v.element_size() for v in tree.values() if v.is_cuda)
    wrap, gate, _ = gated()
    with nc.AsyncSaver(gpu_budget_bytes=gpu_budget, pinned_bytes=2 << 20) as saver:
        handle = saver.save(tree, tmp_path / "gpu.nvc", stream_wrapper=wrap)
        if gpu_budget == 0:
            assert handle.snapshot_gpu_bytes == 0
        elif nc.gpu_available():
            # With nvCOMP the GPU tensors are compressed into GPU memory: smaller than a copy.
            assert 0 < handle.snapshot_gpu_bytes < gpu_bytes
        else:
            assert handle.snapshot_gpu_bytes == gpu_bytes
        tree["w"].add_(1.0)  # on the current stream, right after the snapshot returned
        tree["b"].zero_()
        gate.set()
        handle.result(timeout=120)
    loaded = nc.load(tmp_path / "gpu.nvc")
    assert loaded["w"].device.type == "cuda" and loaded["cpu"].device.type == "cpu"
    assert_tree_equal(expected, loaded)


# -- ordering and waiting ----------------------------------------------------------------------
def test_two_async_saves_to_one_path_end_with_the_newer(tmp_path: Path) -> None:
    path = tmp_path / "latest.nvc"
    wrap, gate, _ = gated()
    with nc.AsyncSaver(max_pending=2) as saver:
        first = saver.save({"v": torch.full((10_000,), 1.0)}, path, stream_wrapper=wrap)
        second = saver.save({"v": torch.full((10_000,), 2.0)}, path, stream_wrapper=wrap)
        gate.set()
        r2 = second.result(timeout=30)
        assert first.done()  # one worker: saves finish in the order they were asked for
    assert r2.path == os.fspath(path)
    assert torch.equal(nc.load(path)["v"], torch.full((10_000,), 2.0))


def test_load_and_open_wait_for_a_pending_save_to_the_same_path(tmp_path: Path) -> None:
    path = tmp_path / "fresh.nvc"
    value = torch.randn(5000)
    wrap, gate, started = gated()
    handle = nc.save_async({"v": value}, path, stream_wrapper=wrap)
    assert started.wait(10) and not path.exists()
    open_later(gate, 0.3)
    loaded = nc.load(str(path))  # no file yet: without waiting this raises FormatError
    assert handle.done()
    assert torch.equal(loaded["v"], value)

    wrap, gate, started = gated()
    handle = nc.save_async({"v": value * 2}, f"file://{path}", stream_wrapper=wrap)
    assert started.wait(10)
    open_later(gate, 0.3)
    with nc.open(path) as reader:  # another spelling of the same file
        assert handle.done()
        assert torch.equal(reader.read("v"), value * 2)


def test_sync_save_after_async_save_to_the_same_path_wins(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.nvc"
    wrap, gate, started = gated()
    handle = nc.save_async({"v": torch.zeros(4000)}, path, stream_wrapper=wrap)
    assert started.wait(10)
    open_later(gate, 0.3)
    nc.save({"v": torch.ones(4000)}, path)  # waits for the older async save, then overwrites it
    assert handle.done()
    assert torch.equal(nc.load(path)["v"], torch.ones(4000))


def test_back_pressure_bounds_pending_saves(tmp_path: Path) -> None:
    wrap, gate, _ = gated()
    with nc.AsyncSaver(max_pending=2) as saver:
        h1 = saver.save({"v": torch.randn(3000)}, tmp_path / "1.nvc", stream_wrapper=wrap)
        h2 = saver.save({"v": torch.randn(3000)}, tmp_path / "2.nvc", stream_wrapper=wrap)
        assert saver.pending() == 2
        third: dict[str, Any] = {}

        def save_third() -> None:
            third["handle"] = saver.save({"v": torch.randn(3000)}, tmp_path / "3.nvc", stream_wrapper=wrap)
            third["first_done_then"] = h1.done()

        t = threading.Thread(target=save_third)
        t.start()
        t.join(0.5)
        assert t.is_alive(), "a third save must wait while two are pending"
        assert saver.pending() == 2 and not h1.done()
        gate.set()
        t.join(30)
        assert not t.is_alive()
        assert third["first_done_then"]
        third["handle"].result(timeout=30)
        h2.result(timeout=30)
    for name in ("1", "2", "3"):
        assert nc.is_nvcomp_checkpoint(tmp_path / f"{name}.nvc")


def test_snapshot_memory_is_reused_across_saves(tmp_path: Path) -> None:
    tree = {"a": torch.randn(10_000), "b": torch.randn(3, 333)}
    with nc.AsyncSaver() as saver:
        saver.save(tree, tmp_path / "1.nvc").result(timeout=30)
        pooled = saver.buffers.pooled_bytes
        assert pooled >= 4 * (10_000 + 999)
        arena = saver.buffers._free[0]
        wrap, gate, started = gated()
        h = saver.save(tree, tmp_path / "2.nvc", stream_wrapper=wrap)
        assert started.wait(10)
        assert saver.buffers.pooled_bytes == 0  # the pending save holds the arena
        gate.set()
        h.result(timeout=30)
        assert saver.buffers._free[0] is arena
        saver.release_buffers()
        assert saver.buffers.pooled_bytes == 0
    assert_tree_equal(tree, nc.load(tmp_path / "2.nvc"))


# -- callbacks and metrics ---------------------------------------------------------------------
def test_done_callbacks_fire_after_the_file_is_durable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cb.nvc"
    seen: list[Any] = []
    value = torch.randn(2000)
    wrap, gate, _ = gated()
    handle = nc.save_async({"v": value}, path, stream_wrapper=wrap)

    def check(h: nc.AsyncSaveHandle) -> None:
        # load() from the callback must not wait on the save that is calling it
        seen.append((h.done(), path.exists(), torch.equal(nc.load(path)["v"], value)))

    def broken(h: nc.AsyncSaveHandle) -> None:
        raise ValueError("callback bug")

    handle.add_done_callback(broken)
    handle.add_done_callback(check)
    assert seen == []
    with caplog.at_level(logging.ERROR, logger="nvcomp_checkpoint"):
        gate.set()
        handle.result(timeout=30)
        deadline = time.monotonic() + 60  # the callbacks run on the save thread, just after result() returns
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    assert seen == [(True, True, True)]
    assert any("done callback" in r.getMessage() for r in caplog.records)
    late: list[str] = []
    handle.add_done_callback(lambda h: late.append(h.path))  # already done: runs at once
    assert late == [os.fspath(path)]


def test_every_save_is_logged_with_its_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = tiny_training_state()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    with caplog.at_level(logging.INFO, logger="nvcomp_checkpoint"):
        sync = nc.save(ckpt, tmp_path / "sync.nvc")
        report = nc.save_async(ckpt, tmp_path / "async.nvc").result(timeout=30)
    logged = {r.nvckpt_report["path"]: r for r in caplog.records if hasattr(r, "nvckpt_report")}
    assert set(logged) == {os.fspath(tmp_path / "sync.nvc"), os.fspath(tmp_path / "async.nvc")}
    info = logged[os.fspath(tmp_path / "async.nvc")].nvckpt_report
    assert info["raw_bytes"] == report.raw_bytes == sync.raw_bytes
    assert info["stored_bytes"] == report.stored_bytes == os.path.getsize(tmp_path / "async.nvc")
    assert set(info["components"]) == {"weights", "exp_avg", "exp_avg_sq", "other"}
    assert info["seconds_blocked"] <= info["seconds"]
    assert "async" in logged[os.fspath(tmp_path / "async.nvc")].getMessage()
    assert report.throughput_mb_s > 0 and report.ratio > 1.0


# -- errors ------------------------------------------------------------------------------------
def test_background_error_reaches_result_and_the_next_save(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a regular file where a directory should be")  # stops root too
    bad = blocker / "ckpt.nvc"
    with nc.AsyncSaver() as saver:
        handle = saver.save({"v": torch.randn(100)}, bad)
        with pytest.raises(CheckpointWriteError, match="not_a_dir"):
            handle.result(timeout=30)
        # seen through result(): the next save is not blocked by it
        saver.save({"v": torch.randn(100)}, tmp_path / "ok1.nvc").result(timeout=30)

        saver.save({"v": torch.randn(100)}, bad).wait(30)  # nobody asks for this one's result
        with pytest.raises(CheckpointWriteError, match="earlier async save failed.*not_a_dir"):
            saver.save({"v": torch.randn(100)}, tmp_path / "never.nvc")
        assert not (tmp_path / "never.nvc").exists()
        saver.save({"v": torch.randn(100)}, tmp_path / "ok2.nvc").result(timeout=30)  # reported once only

        saver.save({"v": torch.randn(100)}, bad)
        with pytest.raises(CheckpointWriteError, match="not_a_dir"):
            saver.wait()
    saver2 = nc.AsyncSaver()
    saver2.save({"v": torch.randn(100)}, bad)
    with pytest.raises(CheckpointWriteError, match="not_a_dir"):
        saver2.close()


def test_disk_full_during_async_save_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.nvc"
    previous = {"v": torch.randn(20_000)}
    nc.save(previous, path)
    handle = nc.save_async({"v": torch.randn(20_000)}, path, stream_wrapper=DiskFullStream)
    with pytest.raises(CheckpointWriteError, match="disk is full"):
        handle.result(timeout=30)
    assert_tree_equal(previous, nc.load(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.nvc"]  # no temporary file left


def test_unseen_error_is_raised_by_wait_for_saves_and_by_load_of_that_path(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.nvc"
    nc.save({"v": torch.zeros(10)}, path)
    handle = nc.save_async({"v": torch.randn(5000)}, path, stream_wrapper=DiskFullStream)
    handle.wait(30)
    with pytest.raises(CheckpointWriteError, match="disk is full"):
        nc.load(path)  # would silently return the older checkpoint otherwise
    assert torch.equal(nc.load(path)["v"], torch.zeros(10))  # reported once
    nc.save_async({"v": torch.randn(5000)}, path, stream_wrapper=DiskFullStream).wait(30)
    with pytest.raises(CheckpointWriteError, match="disk is full"):
        nc.wait_for_saves()


def test_unsaveable_tree_fails_in_the_caller_before_any_copy(tmp_path: Path) -> None:
    with nc.AsyncSaver() as saver:
        with pytest.raises(UnsupportedObjectError, match="meta device"):
            saver.save({"ok": torch.ones(3), "m": torch.empty(5, device="meta")}, tmp_path / "x.nvc")
        assert saver.pending() == 0
        saver.save({"v": torch.ones(3)}, tmp_path / "y.nvc").result(timeout=30)  # the slot came back


# -- processes ---------------------------------------------------------------------------------
def test_async_save_to_an_fsspec_url(tmp_path: Path) -> None:
    url = f"memory://nvckpt-async-test/{tmp_path.name}/ckpt.nvc"
    tree = {"w": torch.randn(40_000), "step": 7}
    wrap, gate, started = gated()
    handle = nc.save_async(tree, url, stream_wrapper=wrap)
    assert started.wait(10)
    open_later(gate, 0.2)
    assert_tree_equal(tree, nc.load(url))  # waits for the upload to complete
    assert handle.done()


_FORK_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys
    import numpy as np, torch
    import nvcomp_checkpoint as nc

    out = sys.argv[1]
    # The parent's saver has a worker thread and a copy pool; a forked child has neither.
    nc.save_async({"v": torch.from_numpy(np.zeros(5_000_000, dtype=np.float32))}, out + "/parent.nvc").result(timeout=60)

    def child():
        # numpy, not torch.ones: torch's OpenMP pool can hang in a forked child (a libgomp limit);
        # the save itself copies and compresses without OpenMP.
        value = torch.from_numpy(np.ones(5_000_000, dtype=np.float32))
        report = nc.save_async({"v": value}, out + "/child.nvc").result(timeout=60)
        os._exit(0 if report.raw_bytes == 20_000_000 else 3)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(90)
    sys.exit(proc.exitcode if proc.exitcode is not None else 4)
    """
)


def test_forked_child_can_save_async(tmp_path: Path) -> None:
    # Run in a fresh interpreter: after a whole test session the parent holds thread pools
    # (OpenMP, BLAS) whose state a fork cannot carry, which says nothing about our saver.
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert torch.equal(nc.load(tmp_path / "child.nvc")["v"], torch.ones(5_000_000))


_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {src!r})
    import nvcomp_checkpoint as nc

    class Slow:
        def __init__(self, inner):
            self.inner, self.n = inner, 0
        def write(self, data):
            self.n += 1
            if self.n == 3:
                print("WRITING", flush=True)
            time.sleep(0.05)
            return self.inner.write(data)

    torch.manual_seed(0)
    nc.save({{"v": torch.zeros(1000)}}, {prev!r})
    handle = nc.save_async({{"v": torch.randn(4 << 20)}}, {target!r}, stream_wrapper=Slow)
    {after}
    """
)


def _child(tmp_path: Path, target: str, after: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(src=SRC, prev=str(tmp_path / "prev.nvc"), target=target, after=after))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("target", ["new.nvc", "prev.nvc"])
def test_sigkill_during_background_write_leaves_previous_checkpoint(tmp_path: Path, target: str) -> None:
    proc = _child(tmp_path, str(tmp_path / target), "time.sleep(60)")
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip() == "WRITING", proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert torch.equal(nc.load(tmp_path / "prev.nvc")["v"], torch.zeros(1000))
    if target == "new.nvc":
        assert not (tmp_path / "new.nvc").exists()


def test_interpreter_exit_waits_for_pending_save_and_reports_errors(tmp_path: Path) -> None:
    proc = _child(tmp_path, str(tmp_path / "landed.nvc"), "print('EXITING', flush=True)")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "EXITING" in out
    assert nc.load(tmp_path / "landed.nvc")["v"].shape == (4 << 20,)

    (tmp_path / "file").write_text("x")
    proc = _child(tmp_path, str(tmp_path / "file" / "bad.nvc"), "")
    _, err = proc.communicate(timeout=120)
    assert "async checkpoint save failed" in err and "bad.nvc" in err


def test_snapshot_keeps_pre_encoded_tensors_and_copies_the_rest() -> None:
    """The merge an async snapshot does when CUDA tensors were compressed on their GPU: those
    stay as they are in the tree (the writer reads only their shape), every other tensor is
    copied, and the frames are dropped on release."""
    from nvcomp_checkpoint.snapshot import SnapshotBuffers

    big, small = torch.randn(1000), torch.randn(10)
    tree = {"big": big, "small": small, "again": big, "n": 1}
    frames = torch.zeros(40, dtype=torch.uint8)
    seen: list[int] = []

    def pre_encode(tensors, budget):
        seen.append(len(tensors))
        return {id(big): [([frames], [4000])]}

    snap = SnapshotBuffers().take(tree, pre_encode=pre_encode)
    assert seen == [2]  # the tied tensor is one tensor
    assert snap.tree["big"] is big and snap.tree["again"] is big
    assert snap.tree["small"] is not small and torch.equal(snap.tree["small"], small)
    assert snap.gpu_bytes == 40 and snap.host_bytes == small.numel() * 4
    small.add_(1.0)
    assert not torch.equal(snap.tree["small"], small)
    assert id(big) in snap.pre_encoded
    snap.release()
    assert snap.pre_encoded == {}


# -- second review (2026-11-29) -------------------------------------------------------------------
def test_metadata_is_copied_when_the_save_starts(tmp_path: Path) -> None:
    path = tmp_path / "m.nvc"
    meta = {"step": 1, "nested": {"loss": [0.5]}}
    wrap, gate, started = gated()
    handle = nc.save_async({"w": torch.randn(1000)}, path, metadata=meta, stream_wrapper=wrap)
    meta["step"] = 2
    meta["nested"]["loss"].append(0.4)
    gate.set()
    handle.result(timeout=30)
    with nc.open(path) as reader:
        assert reader.metadata["step"] == 1 and reader.metadata["nested"] == {"loss": [0.5]}


def test_newest_save_wins_across_savers(tmp_path: Path) -> None:
    path = tmp_path / "p.nvc"
    wrap, gate, started = gated()
    with nc.AsyncSaver() as s1, nc.AsyncSaver() as s2:
        s1.save({"v": torch.full((5000,), 1.0)}, path, stream_wrapper=wrap)
        assert started.wait(10)
        open_later(gate, 0.3)
        s2.save({"v": torch.full((5000,), 2.0)}, path)  # waits for s1's save to this file first
    assert torch.equal(nc.load(path)["v"], torch.full((5000,), 2.0))


def test_reads_through_a_symlink_wait_for_the_pending_save(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    value = torch.randn(5000)
    wrap, gate, started = gated()
    handle = nc.save_async({"v": value}, real / "c.nvc", stream_wrapper=wrap)
    assert started.wait(10)
    open_later(gate, 0.3)
    assert nc.is_nvcomp_checkpoint(tmp_path / "link" / "c.nvc")  # waited: the file is there
    assert handle.done()
    assert torch.equal(nc.load(tmp_path / "link" / "c.nvc")["v"], value)


_FORK_HELD_SAVER = textwrap.dedent(
    """
    import os, sys
    import numpy as np, torch
    sys.path.insert(0, {src!r})
    import nvcomp_checkpoint as nc

    saver = nc.AsyncSaver()  # made in the parent, used in the child
    saver.save({{"v": torch.zeros(10)}}, {out!r} + "/parent.nvc").result(timeout=60)
    saver.buffers._lock.acquire()  # as if the parent's worker held it at the fork
    pid = os.fork()
    if pid == 0:
        saver.save({{"v": torch.from_numpy(np.ones(3_000_000, dtype=np.float32))}}, {out!r} + "/child.nvc")
        sys.exit(0)  # a normal exit: the exit flush must land the pending save
    saver.buffers._lock.release()
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_saver_made_before_fork_lands_the_childs_save_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "fork_held.py"
    script.write_text(_FORK_HELD_SAVER.format(src=SRC, out=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert torch.equal(nc.load(tmp_path / "child.nvc")["v"], torch.ones(3_000_000))


_LATE_SAVES = textwrap.dedent(
    """
    import atexit, sys, threading, time, torch
    sys.path.insert(0, {src!r})
    import nvcomp_checkpoint as nc

    def late():
        time.sleep(0.5)  # the main thread has returned; the interpreter is shutting down
        nc.save_async({{"v": torch.full((100_000,), 1.0)}}, {out!r} + "/thread.nvc")

    held = nc.AsyncSaver()  # closed by the exit flush, before the atexit handler runs

    def at_exit():
        nc.save({{"v": torch.full((100_000,), 2.0)}}, {out!r} + "/atexit_sync.nvc")
        nc.save_async({{"v": torch.full((100_000,), 3.0)}}, {out!r} + "/atexit_async.nvc")
        held.save({{"v": torch.full((100_000,), 4.0)}}, {out!r} + "/atexit_held.nvc")

    atexit.register(at_exit)
    threading.Thread(target=late).start()
    """
)


def test_saves_made_while_the_interpreter_exits_land(tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(_LATE_SAVES.format(src=SRC, out=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name, value in (("thread", 1.0), ("atexit_sync", 2.0), ("atexit_async", 3.0), ("atexit_held", 4.0)):
        assert torch.equal(nc.load(tmp_path / f"{name}.nvc")["v"], torch.full((100_000,), value)), name
    assert not list(tmp_path.glob(".*tmp*")), "a temporary file was left behind"


def test_a_callback_that_calls_sys_exit_does_not_stop_later_saves(tmp_path: Path) -> None:
    wrap, gate, started = gated()
    with nc.AsyncSaver(max_pending=2) as saver:
        first = saver.save({"v": torch.ones(100)}, tmp_path / "1.nvc", stream_wrapper=wrap)
        first.add_done_callback(lambda h: sys.exit(3))
        second = saver.save({"v": torch.zeros(100)}, tmp_path / "2.nvc")  # queued behind the first
        gate.set()
        assert second.wait(30), "the worker thread died with the callback"
    assert torch.equal(nc.load(tmp_path / "2.nvc")["v"], torch.zeros(100))


def test_a_done_callback_that_saves_to_a_path_queued_on_its_own_worker_does_not_deadlock(tmp_path: Path) -> None:
    wrap, gate, _ = gated()
    with nc.AsyncSaver(max_pending=2) as saver:
        h1 = saver.save({"v": torch.ones(1000)}, tmp_path / "step1.nvc", stream_wrapper=wrap)
        h1.add_done_callback(lambda h: nc.save_async({"v": torch.zeros(10)}, tmp_path / "latest.nvc"))
        h2 = saver.save({"v": torch.ones(1000)}, tmp_path / "latest.nvc")  # queued behind h1
        gate.set()
        assert h2.wait(30), "the worker waited on itself"
    nc.wait_for_saves(timeout=30)


def test_is_nvcomp_checkpoint_waits_but_leaves_a_failed_saves_error_to_be_reported(tmp_path: Path) -> None:
    path = tmp_path / "p.nvc"
    nc.save({"v": torch.ones(10)}, path)
    nc.save_async({"v": torch.randn(5000)}, path, stream_wrapper=DiskFullStream).wait(30)
    assert nc.is_nvcomp_checkpoint(path)  # the previous file, intact
    with pytest.raises(CheckpointWriteError, match="disk is full"):
        nc.wait_for_saves()


def test_async_refusal_of_a_cycle_names_the_file(tmp_path: Path) -> None:
    d: dict = {"x": torch.ones(4)}
    d["self"] = d
    with pytest.raises(UnsupportedObjectError, match=r"cyc\.nvc.*contains itself"):
        nc.save_async(d, tmp_path / "cyc.nvc")
