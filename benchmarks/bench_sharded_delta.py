"""Do incremental sharded saves pay? One rank's shard as a delta of the same rank's previous shard, against in full.

FSDP2 shards each parameter (and its AdamW moments) on dim 0; rank 0 of 2 holds the first half of
the rows. This trains on the CPU, takes rank 0's shard at a few steps and saves it with
:func:`nvcomp_checkpoint.save` in full and as a delta (``base=``) of an earlier step's, the bytes a
DCP rank file would hold either way. Two states: the tiny model of tests/test_lightning_sharded.py
(Adam) and an 8.4M-parameter fp32 MLP (AdamW). Run: ``python benchmarks/bench_sharded_delta.py``.
The numbers back the refusal of ``incremental`` for sharded saves (entrypoint/support.py).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

import nvcomp_checkpoint as nc


def rank_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int = 0, world: int = 2) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` FSDP2 ranks holds: its rows of every parameter and moment."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        rows = p.shape[0] // world
        part = slice(rank * rows, (rank + 1) * rows)
        out[f"state_dict.{name}"] = p.detach()[part].clone()
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer_0.state.{name}.{key}"] = state[key][part].clone()
        out[f"optimizer_0.state.{name}.step"] = state["step"].clone()
    return out


def train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], steps: int, at: set[int]
) -> dict[int, dict[str, Any]]:
    shards = {}
    for step in range(1, steps + 1):
        loss = model(batches[(step - 1) % len(batches)]).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in at:
            shards[step] = rank_shard(model, optimizer)
    return shards


def compare(label: str, shards: dict[int, dict[str, Any]], pairs: list[tuple[int, int]], folder: str) -> None:
    for base, new in pairs:
        base_path, full_path, delta_path = (os.path.join(folder, f"{label}-{n}.nvc") for n in (base, new, f"{new}-on-{base}"))
        nc.save(shards[base], base_path)
        nc.save(shards[new], full_path)
        nc.save(shards[new], delta_path, base=base_path)
        loaded = nc.load(delta_path)
        assert all(torch.equal(loaded[k], v) for k, v in shards[new].items()), "the delta does not load back"
        raw = sum(t.numel() * t.element_size() for t in shards[new].values())
        full, delta = os.path.getsize(full_path), os.path.getsize(delta_path)
        print(
            f"| {label} | {new - base} | {raw:,} | {full:,} ({full / raw:.3f}) | {delta:,} ({delta / raw:.3f}) | {delta / full:.3f} |"
        )


def main() -> None:
    print("| rank 0's shard of | steps since base | raw bytes | full file | delta file | delta / full |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        tiny = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
        batches = list(torch.randn(48, 24, generator=torch.Generator().manual_seed(1)).split(8))
        shards = train(tiny, torch.optim.Adam(tiny.parameters(), lr=1e-2), batches, 6, {3, 5, 6})
        compare("tiny Net, Adam", shards, [(3, 6), (5, 6)], folder)
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
        batches = list(torch.randn(64, 32, 1024, generator=torch.Generator().manual_seed(1)).unbind(0))
        optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-4, weight_decay=0.01)
        shards = train(mlp, optimizer, batches, 20, {10, 19, 20})
        compare("8.4M-param MLP, AdamW", shards, [(10, 20), (19, 20)], folder)


if __name__ == "__main__":
    main()
