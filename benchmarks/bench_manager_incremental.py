"""CheckpointManager with ``incremental=True`` against full saves, on a real fine-tuning run.

Run ``python benchmarks/bench_manager_incremental.py`` (``--steps``, ``--every``, ``--full-every``).
all-MiniLM-L6-v2 is fine-tuned with AdamW (``checkpoints._finetune_minilm``: bf16 weights, fp32
moments, bf16 gradients in the saved state); every ``--every`` steps the same state is saved by
three managers, each on its own tier-0 folder: full saves, deltas against the previous save, and
deltas against the last full save. Printed: bytes stored over all saves, the ratio, the mean save
time and the time to restore the last step (which decodes its chain).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.report import format_table  # noqa: E402

__all__ = ["main"]

VARIANTS: dict[str, dict[str, Any]] = {
    "full saves": {},
    "incremental, base previous": {"incremental": True, "delta_base": "previous"},
    "incremental, base full": {"incremental": True, "delta_base": "full"},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps of the fine-tuning run")
    ap.add_argument("--every", type=int, default=10, help="a save every this many steps")
    ap.add_argument("--full-every", type=int, default=10, help="full_every of the incremental managers")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        managers = {
            name: nc.CheckpointManager(
                [nc.Tier(root / str(i))], async_save=False, full_every=args.full_every if kw else None, **kw
            )
            for i, (name, kw) in enumerate(VARIANTS.items())
        }
        raw = {n: 0 for n in VARIANTS}
        stored = {n: 0 for n in VARIANTS}
        seconds: dict[str, list[float]] = {n: [] for n in VARIANTS}
        last: dict[str, Any] = {}

        def on_step(done: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            if done % args.every:
                return
            state = copy.deepcopy(checkpoints._minilm_state(model, opt, bf16_weights=True))
            last["state"], last["step"] = state, done
            for name, mgr in managers.items():
                report = mgr.save(done, state)
                raw[name] += report.raw_bytes
                stored[name] += report.stored_bytes
                seconds[name].append(report.seconds)

        checkpoints._finetune_minilm(steps=args.steps, on_step=on_step)
        rows = []
        for name, mgr in managers.items():
            mgr.close()
            start = time.perf_counter()
            r = mgr.restore(last["step"])
            restore_s = time.perf_counter() - start
            assert r is not None and r.step == last["step"]
            chain = 0
            m = mgr.manifest(r.step)
            while m is not None and m.base is not None:
                chain += 1
                m = mgr.manifest(m.base)
            rows.append(
                [
                    name,
                    str(len(seconds[name])),
                    f"{stored[name] / 1e6:.1f}",
                    f"{raw[name] / stored[name]:.3f}x",
                    f"{stored['full saves'] / stored[name]:.3f}x",
                    f"{sum(seconds[name]) / len(seconds[name]):.2f}",
                    f"{restore_s:.2f} (chain {chain})",
                ]
            )
    print(
        f"MiniLM fine-tune, {args.steps} steps, a save every {args.every}, full_every={args.full_every}; bf16 weights, fp32 AdamW, bf16 grads"
    )
    print(format_table(["manager", "saves", "stored MB", "ratio", "vs full saves", "save s (mean)", "restore last s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
