"""``nc.load_broadcast``: replicated state read from storage once per node, sent to the other ranks.

4 real gloo ranks (spawned processes) load one checkpoint through an fsspec file system that
counts every byte it reads: one reader for the whole (one-node) job reads exactly what a single
``nc.load`` reads, two "nodes" read it twice, every rank gets a bit-identical tree; a damaged
file fails on every rank instead of leaving the receivers waiting.
"""

from __future__ import annotations

import json
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from fresh_process import spawn_ranks
from nvcomp_checkpoint.errors import CheckpointError, ChecksumError


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
    """Local files under ``countfile://``; every byte read through it is counted (per process)."""

    protocol = ("countfile",)
    bytes_read = 0

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if "r" not in mode:
            return super()._open(path, mode, block_size, **kwargs)
        return _CountingOpener(self._strip_protocol(path), mode, fs=self, **kwargs)


fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)


def _tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, 256, generator=g) * 0.02
    tied = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    return {
        "model": {
            "embed.weight": tied,
            "head.weight": tied,
            "w": torch.nn.Parameter(w, requires_grad=False),
            "mask": torch.rand(300, generator=g) > 0.5,
            "empty": torch.empty(0, 7),
        },
        "optimizer": {
            "state": {
                0: {
                    "exp_avg": torch.randn(512, 256, generator=g) * 1e-3,
                    "exp_avg_sq": torch.rand(512, 256, generator=g) * 1e-6,
                    "step": torch.tensor(40.0),
                }
            },
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "epoch": 4,
    }


def _rank(rank: int, world: int, port: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    out = Path(root)
    url = "countfile://" + str(out / "ckpt.nvc")
    counts: dict[str, int] = {}
    try:
        for name, load in (
            ("one_node", lambda: nc.load_broadcast(url)),
            ("two_nodes", lambda: nc.load_broadcast(url, node=f"node{rank // 2}")),
            # Again: the node groups made by the first call serve the second.
            ("two_nodes_again", lambda: nc.load_broadcast(url, node=f"node{rank // 2}")),
            ("one_reader", lambda: nc.load_broadcast(url, readers="one", node=f"node{rank}")),
            ("every_rank", lambda: nc.load(url)),
        ):
            dist.barrier()
            CountingFileSystem.bytes_read = 0
            tree = load()
            counts[name] = CountingFileSystem.bytes_read
            torch.save(tree, out / f"{name}_{rank}.pt")
        try:
            nc.load_broadcast("countfile://" + str(out / "damaged.nvc"))
        except CheckpointError as exc:
            counts["damaged_error"] = type(exc).__name__  # type: ignore[assignment]
            counts["damaged_message"] = str(exc)  # type: ignore[assignment]
        (out / f"counts_{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def test_four_ranks_read_the_checkpoint_once(tmp_path: Path) -> None:
    tree = _tree()
    nc.save(tree, tmp_path / "ckpt.nvc")
    data = bytearray((tmp_path / "ckpt.nvc").read_bytes())
    with nc.open(tmp_path / "ckpt.nvc") as reader:
        frame = reader.entry(reader.keys()[-1]).frames[0]
    data[frame.offset + frame.size // 2] ^= 0x20
    (tmp_path / "damaged.nvc").write_bytes(bytes(data))
    # What one nc.load reads through the counting file system: the reference for every case.
    CountingFileSystem.bytes_read = 0
    nc.load("countfile://" + str(tmp_path / "ckpt.nvc"))
    once = CountingFileSystem.bytes_read
    assert once >= (tmp_path / "ckpt.nvc").stat().st_size

    spawn_ranks(_rank, 4, str(tmp_path))

    counts = [json.loads((tmp_path / f"counts_{r}.json").read_text()) for r in range(4)]
    assert [c["one_node"] for c in counts] == [once, 0, 0, 0]
    assert [c["two_nodes"] for c in counts] == [once, 0, once, 0]
    assert [c["two_nodes_again"] for c in counts] == [once, 0, once, 0]
    assert [c["one_reader"] for c in counts] == [once, 0, 0, 0]
    assert sum(c["every_rank"] for c in counts) == 4 * once
    for name in ("one_node", "two_nodes", "two_nodes_again", "one_reader", "every_rank"):
        for r in range(4):
            got = torch.load(tmp_path / f"{name}_{r}.pt", weights_only=True)
            assert_tree_equal(got, tree, f"{name} rank {r}")
            # The same tensor reached twice (tied weights) is still one tensor on every rank.
            assert got["model"]["embed.weight"].data_ptr() == got["model"]["head.weight"].data_ptr()
    for r, c in enumerate(counts):
        assert c["damaged_error"] == "ChecksumError", (r, c)
        assert "damaged.nvc" in c["damaged_message"], (r, c)


def test_without_a_process_group_it_is_load(tmp_path: Path) -> None:
    tree = _tree()
    nc.save(tree, tmp_path / "ckpt.nvc")
    assert_tree_equal(nc.load_broadcast(tmp_path / "ckpt.nvc"), tree)
    with pytest.raises(CheckpointError, match="map_location"):
        nc.load_broadcast(tmp_path / "ckpt.nvc", map_location={"cuda:0": "cpu"})
    with pytest.raises(ChecksumError):
        data = bytearray((tmp_path / "ckpt.nvc").read_bytes())
        with nc.open(tmp_path / "ckpt.nvc") as reader:
            frame = reader.entry(reader.keys()[0]).frames[0]
        data[frame.offset] ^= 1
        (tmp_path / "bad.nvc").write_bytes(bytes(data))
        nc.load_broadcast(tmp_path / "bad.nvc")
