"""Sharded-checkpoint benchmark: DCP with NvcompWriter against DCP's FileSystemWriter, plain and with ZStandard.

Run ``python benchmarks/bench_dcp.py``: 2 ranks (gloo, CPU) hold a real training checkpoint
sharded along dim 0 as FSDP2 shards it (DTensors, ``Shard(0)``); each method saves it (files
fsynced) and loads it back into sharded tensors, checked bit-identical. Prints a table and the
issue's targets; ``--markdown FILE`` writes them as Markdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import nvcomp_checkpoint as nc  # noqa: E402

__all__ = ["main"]

OURS = "DCP+NvcompWriter"
PLAIN = "DCP"
ZSTD = "DCP+ZStandard"
METHODS = (PLAIN, ZSTD, OURS)


def _writer(method: str, path: Path, workers: int) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    from nvcomp_checkpoint.dcp import NvcompWriter

    if method == PLAIN:
        return dcp.FileSystemWriter(str(path))  # sync_files=True: every file fsynced
    if method == ZSTD:
        return dcp.FileSystemWriter(str(path), _extensions=[ZStandard()])
    return NvcompWriter(path, workers=workers)  # fsync + rename of every file inside


def _reader(method: str, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    from nvcomp_checkpoint.dcp import NvcompReader

    return NvcompReader(path) if method == OURS else dcp.FileSystemReader(str(path))


def _shard(tree: Any, mesh: Any) -> Any:
    """Every tensor of ``tree`` as a DTensor: ``Shard(0)`` as FSDP2 shards parameters and their
    optimizer state, ``Replicate()`` for scalars (the optimizer's step)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if isinstance(tree, torch.Tensor):
        return distribute_tensor(tree, mesh, [Shard(0)] if tree.dim() > 0 else [Replicate()])
    if isinstance(tree, dict):
        return {k: _shard(v, mesh) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_shard(v, mesh) for v in tree]
    return tree


def _empty_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: _empty_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_empty_like(v) for v in tree]
    return tree


def _local_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        la, lb = a.to_local(), b.to_local()
        # Compared as bytes: NaN == NaN, and -0.0 differs from 0.0.
        return (
            la.dtype == lb.dtype
            and la.shape == lb.shape
            and torch.equal(la.reshape(-1).view(torch.uint8), lb.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_local_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_local_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()  # the slowest rank's time: a save is done when every rank is
    return time.perf_counter() - start


def _rank(rank: int, world: int, port: int, source: str, out: str, rounds: int, workers: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    mesh = init_device_mesh("cpu", (world,))
    state = _shard(torch.load(source, map_location="cpu", weights_only=True), mesh)
    root = Path(out)
    results: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in METHODS}
    sizes: dict[str, int] = {}
    for r in range(rounds):
        for method in METHODS:  # interleaved: a noisy neighbour hits one round of each method
            path = root / f"{method}"
            if rank == 0 and path.exists():
                shutil.rmtree(path)
            dist.barrier()
            results[method]["save"].append(_timed(lambda: dcp.save(state, storage_writer=_writer(method, path, workers))))
            target = _empty_like(state)
            results[method]["load"].append(_timed(lambda: dcp.load(target, storage_reader=_reader(method, path))))
            if r == 0 and not _local_equal(target, state):
                raise AssertionError(f"{method}: the loaded shards differ from the saved ones")
            if rank == 0:
                sizes[method] = _dir_bytes(path)
    if rank == 0:
        components = _component_ratios(root / OURS)
        (root / "dcp_results.json").write_text(json.dumps({"times": results, "sizes": sizes, "components": components}))
    dist.destroy_process_group()


def _component_ratios(path: Path) -> dict[str, list[int]]:
    raw: dict[str, list[int]] = {}
    for f in sorted(path.glob("*.nvcdcp")):
        with nc.open(f) as reader:
            for comp, stats in reader.summary().items():
                acc = raw.setdefault(comp, [0, 0])
                acc[0] += stats.raw_bytes
                acc[1] += stats.stored_bytes
    return raw


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default="moe", choices=sorted(checkpoints.CHECKPOINTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="compression threads per rank (2 ranks on 2 cores: 1)")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)

    source = checkpoints.build_checkpoint(args.checkpoint)
    out = checkpoints.OUT_DIR / "dcp"
    out.mkdir(parents=True, exist_ok=True)
    state = torch.load(source, map_location="cpu", weights_only=True)
    raw = _tensor_bytes(state)
    unsharded = nc.save(state, out / "unsharded.nvc", workers=args.workers)
    del state

    mp.start_processes(
        _rank, args=(2, _free_port(), str(source), str(out), args.rounds, args.workers), nprocs=2, start_method="spawn", join=True
    )
    data = json.loads((out / "dcp_results.json").read_text())
    best = {m: {k: min(v) for k, v in data["times"][m].items()} for m in METHODS}
    sizes = data["sizes"]
    lines = [
        f"### {args.checkpoint}: {raw / 1e6:.1f} MB of tensors, 2 ranks (Shard(0) DTensors), best of {args.rounds} rounds, "
        f"{args.workers} compression thread(s) per rank",
        "",
        "| method | stored MB | ratio | save s | load s |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        lines.append(f"| {m} | {sizes[m] / 1e6:.1f} | {raw / sizes[m]:.3f} | {best[m]['save']:.2f} | {best[m]['load']:.2f} |")
    lines.append(
        f"| nc.save, unsharded (1 process) | {unsharded.stored_bytes / 1e6:.1f} | {unsharded.ratio:.3f} | {unsharded.seconds:.2f} | |"
    )
    lines += ["", "| component | raw MB | DCP+NvcompWriter ratio |", "|---|---|---|"]
    for comp, (r, s) in data["components"].items():
        lines.append(f"| {comp} | {r / 1e6:.1f} | {r / s:.3f} |")
    ours_ratio, zstd_ratio = raw / sizes[OURS], raw / sizes[ZSTD]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**NOT met**"

    lines += [
        "",
        "| target | result |",
        "|---|---|",
        f"| ratio >= 1.08x DCP+ZStandard | {verdict(ours_ratio >= 1.08 * zstd_ratio)}: {ours_ratio:.3f} vs {zstd_ratio:.3f} ({ours_ratio / zstd_ratio:.3f}x) |",
        f"| ratio within 2% of nc.save unsharded | {verdict(abs(ours_ratio / unsharded.ratio - 1) <= 0.02)}: {ours_ratio:.3f} vs {unsharded.ratio:.3f} |",
        f"| save <= 0.8x DCP+ZStandard | {verdict(best[OURS]['save'] <= 0.8 * best[ZSTD]['save'])}: {best[OURS]['save']:.2f} s vs {best[ZSTD]['save']:.2f} s |",
        f"| load <= plain DCP + 20% | {verdict(best[OURS]['load'] <= 1.2 * best[PLAIN]['load'])}: {best[OURS]['load']:.2f} s vs {best[PLAIN]['load']:.2f} s |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
