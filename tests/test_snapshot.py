"""Snapshots of checkpoint trees (what ``save_async`` copies before it returns)."""

from __future__ import annotations

import torch

from nvcomp_checkpoint.snapshot import SnapshotBuffers


def test_many_small_tensors_and_large_ones_are_copied_exactly_and_apart() -> None:
    # Over 32 MiB, so the copy runs on the thread pool, with small tensors batched into shared jobs.
    gen = torch.Generator().manual_seed(0)
    tree = {
        "small": [torch.randn(100 + i, generator=gen) for i in range(600)],
        "bf16": torch.randn(3 << 20, generator=gen).to(torch.bfloat16),
        "big": torch.randn(9 << 20, generator=gen),
        "tail": torch.arange(7, dtype=torch.int64),
    }
    expected = {"small": [t.clone() for t in tree["small"]], **{k: tree[k].clone() for k in ("bf16", "big", "tail")}}
    buffers = SnapshotBuffers(reuse=True)
    for _ in range(2):  # the second take reuses the first one's arena
        snap = buffers.take(tree)
        for t in tree["small"]:
            t.add_(1)  # training goes on: the snapshot must not see it
        tree["big"].mul_(2)
        tree["bf16"].zero_()
        copied = snap.tree
        assert all(torch.equal(a, b) for a, b in zip(copied["small"], expected["small"]))
        assert all(torch.equal(copied[k], expected[k]) for k in ("bf16", "big", "tail"))
        assert copied["bf16"].dtype == torch.bfloat16 and copied["big"].shape == (9 << 20,)
        snap.release()
        expected = {"small": [t.clone() for t in tree["small"]], **{k: tree[k].clone() for k in ("bf16", "big", "tail")}}
