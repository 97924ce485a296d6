"""Leader-load benchmark: every rank ``nc.load``-ing one replicated checkpoint against ``nc.load_broadcast``.

Run ``python benchmarks/bench_load_broadcast.py``: 4 ranks (gloo, CPU, spawned) resume from one
compressed checkpoint of a real training run (``moe``, benchmarks/checkpoints.py) through an fsspec
file system that counts every byte read from storage. Methods: every rank loads it; one reader
per node (all 4 ranks on one node); one reader per node with the ranks split into 2 "nodes".
Prints bytes read from storage and the slowest rank's load time (each tree checked bit-identical
to the saved one); ``--markdown FILE`` writes the table as Markdown.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import nvcomp_checkpoint as nc  # noqa: E402

__all__ = ["main"]

METHODS = ("every rank nc.load", "load_broadcast, 1 node", "load_broadcast, 2 nodes")


class _CountingOpener(LocalFileOpener):
    def read(self, *args: Any) -> bytes:
        data = self.f.read(*args)
        CountingFileSystem.bytes_read += len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = self.f.readinto(b) or 0
        CountingFileSystem.bytes_read += n
        return n


class CountingFileSystem(LocalFileSystem):
    """Local files under ``countfile://``, every byte read counted (per process)."""

    protocol = ("countfile",)
    bytes_read = 0

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if "r" not in mode:
            return super()._open(path, mode, block_size, **kwargs)
        return _CountingOpener(self._strip_protocol(path), mode, fs=self, **kwargs)


fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _rank(rank: int, world: int, port: int, root: str, rounds: int) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    url = "countfile://" + str(Path(root) / "ckpt.nvc")
    expected = torch.load(Path(root) / "ref.pt", weights_only=True)
    loads = {
        METHODS[0]: lambda: nc.load(url),
        METHODS[1]: lambda: nc.load_broadcast(url),
        METHODS[2]: lambda: nc.load_broadcast(url, node=f"node{rank // 2}"),
    }
    out: dict[str, Any] = {}
    try:
        for r in range(rounds):
            for name, load in loads.items():  # interleaved rounds: the machine's load hits each alike
                dist.barrier()
                CountingFileSystem.bytes_read = 0
                start = time.perf_counter()
                tree = load()
                seconds = time.perf_counter() - start
                dist.barrier()
                row = out.setdefault(name, {"bytes": CountingFileSystem.bytes_read, "seconds": [], "identical": True})
                row["seconds"].append(seconds)
                row["identical"] = row["identical"] and _equal(tree, expected)
                del tree
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="moe", choices=sorted(checkpoints.CHECKPOINTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--markdown", help="also write the table to this Markdown file")
    args = p.parse_args(argv)
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        state = checkpoints.load_cached(args.checkpoint)
        torch.save(state, root / "ref.pt")
        nc.save(state, root / "ckpt.nvc")
        file_bytes = (root / "ckpt.nvc").stat().st_size
        raw = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(world, port, str(root), args.rounds), nprocs=world, start_method="spawn", join=True)
        ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]
    lines = [
        f"{args.checkpoint}: {raw / 1e6:.1f} MB of tensors, {file_bytes / 1e6:.1f} MB file; {world} gloo ranks on this machine, "
        f"best of {args.rounds} interleaved rounds",
        "",
        "| method | MB read from storage | x the file | slowest rank s | bit-identical |",
        "|---|---|---|---|---|",
    ]
    for name in METHODS:
        read = sum(r[name]["bytes"] for r in ranks)
        slowest = min(max(r[name]["seconds"][i] for r in ranks) for i in range(args.rounds))
        identical = all(r[name]["identical"] for r in ranks)
        lines.append(f"| {name} | {read / 1e6:.1f} | {read / file_bytes:.2f} | {slowest:.2f} | {'yes' if identical else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
