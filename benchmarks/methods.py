"""The ways of storing a checkpoint that the benchmark compares, each as a save and a load function.

Every save ends with the bytes durable (fsync), as ``nc.save`` does; every load returns the tree
with bit-identical tensors, which the benchmark checks once per method.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import nvcomp_checkpoint as nc

__all__ = ["Method", "METHODS", "dir_bytes", "map_tensors", "remove_output"]


def dir_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def map_tensors(obj: Any, fn: Callable[[tuple[str, ...], torch.Tensor], Any], path: tuple[str, ...] = ()) -> Any:
    """A copy of a dict/list/tuple tree with every tensor replaced by ``fn(path, tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn, path + (str(k),)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, path + (str(i),)) for i, v in enumerate(obj))
    return obj


def _fsync_path(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def remove_output(path: Path) -> None:
    """Delete a saved file or DCP directory."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# -- nvcomp-checkpoint -----------------------------------------------------------------------
def _ours_save(obj: Any, path: Path) -> None:
    nc.save(obj, path)  # fsync + rename inside


def _ours_load(path: Path) -> Any:
    return nc.load(path)


def _ours_components(path: Path, obj: Any) -> dict[str, int]:
    with nc.open(path) as reader:
        return {name: s.stored_bytes for name, s in reader.summary().items()}


# -- torch.save --------------------------------------------------------------------------------
def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


# -- torch.save, then the zstd CLI -------------------------------------------------------------
def _zstd_cli() -> str:
    exe = shutil.which("zstd")
    if exe is None:
        raise RuntimeError("the zstd command-line tool is missing: apt-get install -y zstd")
    return exe


#: Largest peak RSS (bytes) of a child process run by :func:`_run_child` in this process.
child_peak = 0


def _run_child(cmd: list[str]) -> None:
    """Run ``cmd``, recording its peak RSS from /proc while it runs.

    getrusage(RUSAGE_CHILDREN) cannot be used: a child spawned from a large process inherits
    that process's RSS high-water mark at exec, so it would report the parent's size.
    """
    global child_peak
    proc = subprocess.Popen(cmd)
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    child_peak = max(child_peak, int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            pass  # the process is exiting
        time.sleep(0.002)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _zstd_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".pt")
    with open(tmp, "wb") as f:
        torch.save(obj, f)  # an intermediate file: only the compressed one must be durable
    _run_child([_zstd_cli(), "-q", "-f", "-T0", "-1", str(tmp), "-o", str(path)])
    _fsync_path(path)
    tmp.unlink()


def _zstd_load(path: Path) -> Any:
    tmp = path.with_name(path.name + ".pt")
    _run_child([_zstd_cli(), "-q", "-f", "-d", str(path), "-o", str(tmp)])
    try:
        return torch.load(tmp, map_location="cpu", weights_only=True)
    finally:
        tmp.unlink()


# -- torch.distributed.checkpoint with its ZStandard extension ---------------------------------
def _dcp_save(obj: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    remove_output(path)
    # Single process (no process group): DCP's no_dist mode; sync_files=True fsyncs each file.
    dcp.save(obj, storage_writer=dcp.FileSystemWriter(str(path), _extensions=[ZStandard()]), no_dist=True)


def _dcp_load(path: Path, like: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    # DCP loads in place: the caller needs the tree with tensors of the right shapes first.
    target = map_tensors(like, lambda _p, t: torch.empty_like(t))
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return target


def _dcp_components(path: Path, obj: Any) -> dict[str, int]:
    import torch.distributed.checkpoint as dcp

    comp_of: dict[str, str] = {}
    map_tensors(obj, lambda p, t: comp_of.__setitem__(".".join(p), nc.classify(p).value))
    out: dict[str, int] = {}
    for idx, info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.items():
        comp = comp_of.get(idx.fqn)
        if comp is not None:  # non-tensor items (pickled values) are not a component
            out[comp] = out.get(comp, 0) + info.length
    return out


# -- ZipNN (Huffman over byte groups), one compressed buffer per tensor ------------------------
_ZIPNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _zipnn() -> Any:
    from zipnn import ZipNN

    return ZipNN(input_format="torch")  # threads: every core, its default


def _zipnn_save(obj: Any, path: Path) -> dict[str, int]:
    znn = _zipnn()
    sizes: dict[str, int] = {}

    def encode(p: tuple[str, ...], t: torch.Tensor) -> Any:
        comp = nc.classify(p).value
        if t.dtype not in _ZIPNN_DTYPES or t.numel() * t.element_size() < 2048:
            sizes[comp] = sizes.get(comp, 0) + t.numel() * t.element_size()
            return t
        # ZipNN 0.5.4 reorders the bits of its input in place (bit_reorder): it gets a copy, whose
        # cost is part of its save time, and the caller's tensor stays as it was.
        data = znn.compress(t.detach().clone().contiguous())
        sizes[comp] = sizes.get(comp, 0) + len(data)
        # Compressed bytes go in a uint8 tensor: pickled `bytes` would grow ~1.5x (docs/facts.md, Pickle).
        return {"__zipnn__": torch.frombuffer(bytearray(data), dtype=torch.uint8)}

    tree = map_tensors(obj, encode)
    _torch_save(tree, path)
    return sizes


def _zipnn_load(path: Path) -> Any:
    znn = _zipnn()
    tree = torch.load(path, map_location="cpu", weights_only=True)

    def decode(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {"__zipnn__"}:
                return znn.decompress(memoryview(node["__zipnn__"].numpy()))
            return {k: decode(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(decode(v) for v in node)
        return node

    return decode(tree)


@dataclass(frozen=True)
class Method:
    """One way of storing a checkpoint.

    Attributes:
        name: Shown in the tables.
        suffix: File (or directory) name suffix.
        save: ``save(obj, path)``; may return per-component stored bytes.
        load: ``load(path, like)``; ``like`` is the saved tree (DCP needs it to allocate).
        components: Per-component stored bytes of a saved file, where the method can tell.
        children: True when part of the work runs in child processes (their peak memory counts).
    """

    name: str
    suffix: str
    save: Callable[[Any, Path], Any]
    load: Callable[[Path, Any], Any]
    components: Callable[[Path, Any], dict[str, int]] | None = None
    children: bool = False


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("nvcomp-checkpoint", ".nvc", _ours_save, lambda p, _l: _ours_load(p), _ours_components),
        Method("torch.save", ".pt", _torch_save, lambda p, _l: _torch_load(p)),
        Method("torch.save+zstd -1", ".pt.zst", _zstd_save, lambda p, _l: _zstd_load(p), children=True),
        Method("DCP+ZStandard", ".dcp", _dcp_save, _dcp_load, _dcp_components),
        Method("ZipNN", ".znn", _zipnn_save, lambda p, _l: _zipnn_load(p)),
    )
}
