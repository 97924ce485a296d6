"""GPU save benchmark: seconds blocked and seconds to durable for GPU-resident checkpoints.

Side by side on one CUDA device: ``torch.save`` (sync, the copy to the host included),
``nvcomp_checkpoint.save`` (compressed on the GPU) and ``nvcomp_checkpoint.save_async``
(blocked = the compressed GPU snapshot). Run by ``benchmarks/gpu_check.sh``; exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.report import format_table


def make_checkpoint(total_mb: int, device: torch.device) -> dict:
    """A synthetic training state on the GPU: bf16 weights, fp32 AdamW moments, bf16 gradients."""
    g = torch.Generator(device=device).manual_seed(0)
    n = total_mb * (1 << 20) // 12  # 2 (weights) + 4 + 4 (moments) + 2 (grads) bytes per parameter
    rows = max(1, n // 4096)
    w = (torch.randn(rows, 4096, device=device, generator=g) * 0.02).to(torch.bfloat16)
    m = torch.randn(rows, 4096, device=device, generator=g) * 1e-4
    v = (torch.randn(rows, 4096, device=device, generator=g) * 1e-3).square()
    grad = (torch.randn(rows, 4096, device=device, generator=g) * 1e-3).to(torch.bfloat16)
    grad[:, ::2] = 0
    return {
        "model": {"w": w},
        "optimizer": {"state": {0: {"step": torch.tensor(10.0), "exp_avg": m, "exp_avg_sq": v}}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
        "gradients": {"w": grad},
    }


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=1024, help="checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not nc.gpu_available():
        print("gpu_async_bench: needs a CUDA GPU and nvCOMP (pip install nvcomp-checkpoint[cu13]); nothing measured")
        return 2
    device = torch.device("cuda", 0)
    ckpt = make_checkpoint(args.mb, device)
    raw = sum(t.numel() * t.element_size() for t in (ckpt["model"]["w"], ckpt["gradients"]["w"],
                                                      ckpt["optimizer"]["state"][0]["exp_avg"], ckpt["optimizer"]["state"][0]["exp_avg_sq"]))
    out_dir = tempfile.mkdtemp(prefix="nvckpt-gpu-bench-")
    results: dict[str, dict[str, float]] = {}

    def best(name: str, fn) -> None:
        runs = [fn(i) for i in range(args.reps)]
        results[name] = {k: min(r[k] for r in runs) for k in runs[0]}

    def torch_save(i: int) -> dict[str, float]:
        path = os.path.join(out_dir, f"plain-{i}.pt")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.save(ckpt, path)
        fsync(path)
        dt = time.perf_counter() - t0
        return {"blocked_s": dt, "durable_s": dt, "bytes": os.path.getsize(path)}

    def nc_save(i: int) -> dict[str, float]:
        path = os.path.join(out_dir, f"sync-{i}.nvc")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = nc.save(ckpt, path)
        dt = time.perf_counter() - t0
        return {"blocked_s": dt, "durable_s": dt, "bytes": report.stored_bytes}

    saver = nc.AsyncSaver()

    def nc_save_async(i: int) -> dict[str, float]:
        path = os.path.join(out_dir, f"async-{i}.nvc")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = saver.save(ckpt, path)
        blocked = time.perf_counter() - t0
        report = handle.result()
        return {"blocked_s": blocked, "durable_s": time.perf_counter() - t0, "bytes": report.stored_bytes,
                "snapshot_gpu_bytes": handle.snapshot_gpu_bytes}

    best("torch.save", torch_save)
    best("nc.save (GPU)", nc_save)
    best("nc.save_async (GPU)", nc_save_async)
    saver.close()
    # A file written on the GPU must read back bit-identically, on the CPU too.
    back = nc.load(os.path.join(out_dir, "async-0.nvc"), map_location="cpu")
    same = torch.equal(back["model"]["w"], ckpt["model"]["w"].cpu()) and torch.equal(
        back["optimizer"]["state"][0]["exp_avg_sq"], ckpt["optimizer"]["state"][0]["exp_avg_sq"].cpu())
    rows = [[name, f"{r['blocked_s']:.3f}", f"{r['durable_s']:.3f}", f"{raw / r['bytes']:.3f}x"] for name, r in results.items()]
    print(f"GPU save of {raw / 2**20:.0f} MiB on {torch.cuda.get_device_name(device)} (best of {args.reps}, fsync included)")
    print(format_table(["method", "blocked s", "to durable s", "ratio"], rows))
    print(f"async file read back on the CPU bit-identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw_bytes": raw, "results": results, "bit_identical": same}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
