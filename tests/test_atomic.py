"""A save is atomic: killed, out of space or failing, it leaves the previous checkpoint intact.

Real processes are SIGKILLed mid-write; a real 2 MiB tmpfs fills up; a real RLIMIT_FSIZE stops
a child's writes; an fsspec file system with a quota raises ENOSPC from the stream's write.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointWriteError, UnsupportedObjectError
from nvcomp_checkpoint.storage import temp_prefix

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _incompressible(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _previous(path: Path) -> tuple[dict[str, Any], bytes]:
    tree = {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "step": 1}
    nc.save(tree, path)
    return tree, path.read_bytes()


def _leftovers(directory: Path, name: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != name)


# -- SIGKILL in the middle of a save -------------------------------------------------------------

_SLOW_SAVE = textwrap.dedent(
    """
    import sys, torch
    import nvcomp_checkpoint as nc

    g = torch.Generator().manual_seed(0)
    tree = {"model": {f"layer{i}": torch.randn(2 << 20, generator=g) for i in range(8)}}  # 64 MiB

    def progress(nbytes):
        print("frame", nbytes, flush=True)
        sys.stdin.readline()  # the test says when to go on: the save is in flight until it is killed

    print("start", flush=True)
    nc.save(tree, sys.argv[1], workers=1, progress=progress)
    print("done", flush=True)
    """
)


def _kill_mid_write(target: Path) -> list[int]:
    """Runs a save to ``target``, frame by frame as this test allows, and SIGKILLs it while its temporary file grows."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVE, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    sizes: list[int] = []
    deadline = time.monotonic() + 120
    try:
        assert proc.stdin is not None and proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"the saving process ended early (rc {proc.poll()})"
            assert line.strip() != "done", "the save finished before it could be killed"
            temps = [p for p in target.parent.iterdir() if p.name.startswith(temp_prefix(target.name))]
            if temps and temps[0].stat().st_size > 0:
                sizes.append(temps[0].stat().st_size)
            if len(sizes) >= 6 and sizes[-1] > sizes[0] > 0:
                break
            proc.stdin.write("\n")  # the next frame
            proc.stdin.flush()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return sizes


def test_kill_mid_write_keeps_previous_checkpoint(tmp_path):
    target = tmp_path / "ckpt.nvc"
    tree, before = _previous(target)
    sizes = _kill_mid_write(target)
    assert sizes[-1] > sizes[0] > 0  # killed while the temporary file was growing
    assert target.read_bytes() == before
    assert_tree_equal(tree, nc.load(target))
    # A killed process cannot clean up: its temporary file stays, hidden, next to the target.
    leftovers = _leftovers(tmp_path, "ckpt.nvc")
    assert len(leftovers) == 1 and leftovers[0].startswith(temp_prefix("ckpt.nvc"))


def test_kill_mid_write_leaves_no_file_at_target(tmp_path):
    target = tmp_path / "fresh.nvc"
    _kill_mid_write(target)
    assert not target.exists()
    assert not nc.is_nvcomp_checkpoint(target)


# -- failures inside the save --------------------------------------------------------------------


def test_error_from_tree_keeps_previous_and_cleans_up(tmp_path):
    target = tmp_path / "ckpt.nvc"
    tree, before = _previous(target)
    bad = {"model": {"ok": torch.ones(10_000), "bad": torch.empty(4, device="meta")}}
    with pytest.raises(UnsupportedObjectError, match="meta"):
        nc.save(bad, target)
    assert target.read_bytes() == before and _leftovers(tmp_path, "ckpt.nvc") == []


def test_error_from_progress_callback_keeps_previous_and_cleans_up(tmp_path):
    target = tmp_path / "ckpt.nvc"
    tree, before = _previous(target)
    calls = []

    def progress(nbytes: int) -> None:
        calls.append(nbytes)
        if len(calls) == 3:
            raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of a save

    with pytest.raises(KeyboardInterrupt):
        nc.save({"w": _incompressible(1 << 20, 1).float()}, target, progress=progress)
    assert len(calls) == 3
    assert target.read_bytes() == before and _leftovers(tmp_path, "ckpt.nvc") == []
    assert_tree_equal(tree, nc.load(target))


def test_metadata_that_is_not_json_fails_before_writing(tmp_path):
    # Was: a ValueError from json.dumps after every tensor had been compressed and written.
    target = tmp_path / "ckpt.nvc"
    tree, before = _previous(target)
    for bad in ({"loss": float("nan")}, {"obj": object()}):
        with pytest.raises(UnsupportedObjectError, match="metadata must be JSON"):
            nc.save({"w": torch.ones(10)}, target, metadata=bad)
    assert target.read_bytes() == before and _leftovers(tmp_path, "ckpt.nvc") == []


class _FailingStream:
    """Passes writes to the real stream and fails the ``fail_at``-th with EIO, noting each write's thread."""

    def __init__(self, stream: Any, fail_at: int) -> None:
        self.stream, self.fail_at = stream, fail_at
        self.threads: list[threading.Thread] = []

    def write(self, data: Any) -> int:
        self.threads.append(threading.current_thread())
        if len(self.threads) == self.fail_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def test_error_in_the_writing_thread_surfaces_in_the_caller(tmp_path):
    # Frames are written by the writer's own thread while the caller queues compression jobs:
    # its error must reach the caller, name the file, stop the writes and leave no file behind.
    target = tmp_path / "ckpt.nvc"
    tree, before = _previous(target)
    streams: list[_FailingStream] = []

    def wrap(stream: Any) -> _FailingStream:
        streams.append(_FailingStream(stream, fail_at=6))
        return streams[-1]

    big = {f"w{i}": torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)) for i in range(4)}  # 16 MiB
    with pytest.raises(CheckpointWriteError) as info:
        nc.save(big, target, workers=2, stream_wrapper=wrap)
    msg = str(info.value)
    assert str(target) in msg and "Input/output error" in msg and "untouched" in msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    threads = streams[0].threads
    assert len(threads) == 6  # nothing written after the failed write
    # The guard and magic come from the caller; the frames, the failed one too, from the writing thread.
    assert threads[0] is threading.main_thread()
    assert threads[-1] is not threading.main_thread() and threads[-1].name.startswith("nvckpt-write")
    assert target.read_bytes() == before and _leftovers(tmp_path, "ckpt.nvc") == []
    assert_tree_equal(tree, nc.load(target))


# -- out of space --------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 2 MiB tmpfs (needs root and mount rights; skipped otherwise)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_disk_full_on_real_tmpfs(tiny_tmpfs):
    target = tiny_tmpfs / "ckpt.nvc"
    tree, before = _previous(target)
    big = {"w": _incompressible(3 << 20, 2)}  # random bytes: stored raw, 3 MiB > 2 MiB
    with pytest.raises(CheckpointWriteError) as info:
        nc.save(big, target)
    msg = str(info.value)
    assert "disk is full" in msg and str(target) in msg and "untouched" in msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert target.read_bytes() == before and _leftovers(tiny_tmpfs, "ckpt.nvc") == []
    assert_tree_equal(tree, nc.load(target))
    # The space of the failed attempt is given back: a smaller checkpoint fits now.
    small = {"w": _incompressible(1 << 20, 3)}
    nc.save(small, target)
    assert_tree_equal(small, nc.load(target))


def test_file_size_limit_in_child(tmp_path):
    """RLIMIT_FSIZE makes the kernel fail the write (EFBIG) in a real child process."""
    target = tmp_path / "ckpt.nvc"
    tree, before = _previous(target)
    child = textwrap.dedent(
        """
        import resource, signal, sys, torch
        import nvcomp_checkpoint as nc
        from nvcomp_checkpoint.errors import CheckpointWriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        big = {"w": torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)}
        try:
            nc.save(big, sys.argv[1])
        except CheckpointWriteError as exc:
            print("CheckpointWriteError", exc.__cause__.errno, str(exc))
        """
    )
    proc = subprocess.run([sys.executable, "-c", child, str(target)], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"CheckpointWriteError {errno.EFBIG} "), proc.stdout
    assert "untouched" in proc.stdout
    assert target.read_bytes() == before and _leftovers(tmp_path, "ckpt.nvc") == []
    assert_tree_equal(tree, nc.load(target))


class _QuotaFile(MemoryFile):
    """An in-memory file whose ``write`` fails with ENOSPC past its file system's quota."""

    def write(self, data: Any) -> int:
        fs = self.fs
        used = sum(f.size for p, f in fs.store.items() if f is not self)
        if used + self.tell() + memoryview(data).nbytes > fs.quota:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return super().write(data)


class QuotaMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory file system with a byte quota (a full remote disk, without the remote)."""

    protocol = "quotamem"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]

    def __init__(self, *args: Any, quota: int = 1 << 20, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quota = quota

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.removeprefix("quotamem://"))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode:
            f = _QuotaFile(self, self._strip_protocol(path))
            f.commit()
            return f
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("quotamem", QuotaMemoryFileSystem, clobber=True)


def test_stream_write_raises_enospc(tmp_path):
    QuotaMemoryFileSystem.store.clear()
    options = {"quota": 600_000}
    target = "quotamem://run/ckpt.nvc"
    tree = {"w": torch.arange(20_000, dtype=torch.float32)}
    nc.save(tree, target, storage_options=options)
    before = QuotaMemoryFileSystem.store["/run/ckpt.nvc"].getvalue()

    with pytest.raises(CheckpointWriteError, match="disk is full") as info:
        nc.save({"w": _incompressible(1 << 20, 4)}, target, storage_options=options)
    assert target in str(info.value)
    assert sorted(QuotaMemoryFileSystem.store) == ["/run/ckpt.nvc"]  # the temporary object is gone
    assert QuotaMemoryFileSystem.store["/run/ckpt.nvc"].getvalue() == before
    assert_tree_equal(tree, nc.load(target, storage_options=options))
