"""GPU save benchmark: a checkpoint trained on the GPU, saved sync and async, reloaded bit-exactly.

The checkpoint is real training state: a transformer encoder (torch only, no download) trained a
few AdamW steps on the GPU, with its bf16 gradients; --mb sets its size. Side by side on one
device: ``torch.save`` (sync, the copy to the host included), ``nvcomp_checkpoint.save``
(compressed on the GPU) and ``AsyncSaver.save`` (blocked = the compressed GPU snapshot). Every file
written is then loaded on the CPU and on the GPU and compared bit for bit with the live state.
``--device cpu`` runs the same on the CPU (gpu_check.sh's dry run). Exits 2 without the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e .`

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.report import format_table  # noqa: E402


def trained_checkpoint(total_mb: int, device: torch.device, steps: int = 3) -> dict[str, Any]:
    """Model, AdamW state and bf16 gradients of a transformer trained ``steps`` steps on ``device``.

    About 12 bytes of state per fp32 parameter (weight, exp_avg, exp_avg_sq) plus 2 of gradient.
    """
    torch.manual_seed(0)
    d_model = 512
    per_layer = 12 * d_model * d_model  # attention 4 d^2 + feed-forward 2 * 4 d^2
    layers = max(1, round(total_mb * (1 << 20) / 14 / per_layer))
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, layers), torch.nn.Linear(d_model, d_model)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, 32, d_model, device=device)
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - x).square().mean()
        loss.backward()
        opt.step()
    grads = {n: p.grad.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "gradients": grads, "step": steps}


def tensors_of(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in tensors_of(value, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in tensors_of(value, f"{prefix}/{i}").items()}
    return {}


def bit_identical(a: Any, b: Any) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return ta.keys() == tb.keys() and all(
        x.dtype == tb[k].dtype
        and x.shape == tb[k].shape
        and torch.equal(x.detach().cpu().reshape(-1).view(torch.uint8), tb[k].detach().cpu().reshape(-1).view(torch.uint8))
        for k, x in ta.items()
    )


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=512, help="checkpoint size in MiB (about)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of the steps)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and (not torch.cuda.is_available() or not nc.gpu_available()):
        print("gpu_async_bench: needs a CUDA GPU and nvCOMP (pip install nvcomp-checkpoint[cu13]); nothing measured")
        return 2
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    ckpt = trained_checkpoint(args.mb, device)
    sync()
    raw = sum(t.numel() * t.element_size() for t in tensors_of(ckpt).values())
    print(f"gpu_async_bench: {raw / 2**20:.0f} MiB of trained state on {device} in {time.perf_counter() - t0:.1f} s", flush=True)
    out_dir = tempfile.mkdtemp(prefix="nvckpt-gpu-bench-")
    results: dict[str, dict[str, float]] = {}

    def best(name: str, fn: Callable[[int], dict[str, float]]) -> None:
        runs = [fn(i) for i in range(args.reps)]
        results[name] = {k: min(r[k] for r in runs) for k in runs[0]}

    def torch_save(i: int) -> dict[str, float]:
        path = os.path.join(out_dir, f"plain-{i}.pt")
        sync()
        t0 = time.perf_counter()
        torch.save(ckpt, path)
        fsync(path)
        dt = time.perf_counter() - t0
        return {"blocked_s": dt, "durable_s": dt, "bytes": os.path.getsize(path)}

    def nc_save(i: int) -> dict[str, float]:
        path = os.path.join(out_dir, f"sync-{i}.nvc")
        sync()
        t0 = time.perf_counter()
        report = nc.save(ckpt, path)
        dt = time.perf_counter() - t0
        return {"blocked_s": dt, "durable_s": dt, "bytes": report.stored_bytes}

    saver = nc.AsyncSaver()

    def nc_save_async(i: int) -> dict[str, float]:
        path = os.path.join(out_dir, f"async-{i}.nvc")
        sync()
        t0 = time.perf_counter()
        handle = saver.save(ckpt, path)
        blocked = time.perf_counter() - t0
        report = handle.result()
        return {
            "blocked_s": blocked,
            "durable_s": time.perf_counter() - t0,
            "bytes": report.stored_bytes,
            "snapshot_gpu_bytes": handle.snapshot_gpu_bytes,
        }

    best("torch.save", torch_save)
    best(f"nc.save ({device.type})", nc_save)
    best(f"nc.save_async ({device.type})", nc_save_async)
    saver.close()
    # Every file written on the device reads back bit-identically, on the CPU and on the device.
    checks: dict[str, bool] = {}
    for name in ("sync-0.nvc", "async-0.nvc", f"async-{args.reps - 1}.nvc"):
        path = os.path.join(out_dir, name)
        checks[f"{name} on cpu"] = bit_identical(ckpt, nc.load(path, map_location="cpu"))
        if device.type == "cuda":
            checks[f"{name} on {device}"] = bit_identical(ckpt, nc.load(path, map_location=str(device)))
    rows = [[name, f"{r['blocked_s']:.3f}", f"{r['durable_s']:.3f}", f"{raw / r['bytes']:.3f}x"] for name, r in results.items()]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"save of {raw / 2**20:.0f} MiB of trained state on {where} (best of {args.reps}, fsync included)")
    print(format_table(["method", "blocked s", "to durable s", "ratio"], rows))
    for name, ok in checks.items():
        print(f"reload {name}: {'bit-identical' if ok else 'DIFFERS'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "raw_bytes": raw, "results": results, "reloads": checks}, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
