"""Storage tiers: bytes moved per tier, a save's blocking time with copies due, upload throughput to S3.

A local S3 endpoint (moto's standalone server, its own process) stands for the object store and
a second folder for the shared file system. Run: ``python benchmarks/bench_tiers.py`` (needs
``moto[server]`` and ``s3fs``; ``--checkpoint mlp`` avoids building the cached transformer checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.report import format_bytes, format_table  # noqa: E402
from nvcomp_checkpoint.tiers import TierStore, copy_unit  # noqa: E402

BUCKET = "bench"
os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})


def _mlp_checkpoint(hidden: int = 1536, layers: int = 6, steps: int = 3) -> dict[str, Any]:
    """A small MLP trained a few AdamW steps on the CPU (weights + both Adam moments)."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(16, hidden)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def load_checkpoint(name: str) -> dict[str, Any]:
    if name == "mlp":
        return _mlp_checkpoint()
    from checkpoints import load_cached

    state = load_cached(name)
    state.pop("gradients", None)  # a resumable training checkpoint: weights and optimizer
    return state


class Moto:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from exc
                time.sleep(0.1)
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        self.options = {"client_kwargs": {"endpoint_url": self.endpoint}, "key": "bench", "secret": "bench"}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def bench_bytes_moved(state: dict[str, Any], work: Path, moto: Moto, saves: int) -> list[list[str]]:
    """Every save to tier 0, every save copied to both other tiers: bytes moved vs bytes stored."""
    moved: dict[str, int] = {"shared": 0, "object": 0}
    lock = threading.Lock()

    def count(tier: str, step: int, n: int) -> None:
        with lock:
            moved[tier] += n

    tiers = [
        nc.Tier(work / "local", name="local"),
        nc.Tier(work / "shared", name="shared"),
        nc.Tier(f"s3://{BUCKET}/moved", name="object", storage_options=moto.options),
    ]
    written0 = 0
    with nc.CheckpointManager(tiers, on_copy_progress=count) as mgr:
        for step in range(1, saves + 1):
            written0 += mgr.save(step, state).result().stored_bytes
            mgr.wait()
        stored = [sum(mgr.manifest(s, i).stored_bytes for s in mgr.steps(i)) for i in range(3)]
    raw = sum(t.numel() * t.element_size() for t in _tensors(state)) * saves
    rows = []
    for i, (name, sent) in enumerate([("local", written0), ("shared", moved["shared"]), ("object", moved["object"])]):
        rows.append(
            [
                name,
                str(saves),
                format_bytes(sent),
                format_bytes(stored[i]),
                "yes" if sent == stored[i] else "NO",
                f"{raw / sent:.3f}x",
            ]
        )
    return rows


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _train_for(seconds: float) -> int:
    """Stand-in for training between saves: matmuls on the CPU for ``seconds``; returns iterations."""
    a = torch.randn(384, 384)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        n += 1
    return n


def bench_blocking(state: dict[str, Any], work: Path, moto: Moto, saves: int, gap: float) -> list[list[str]]:
    """The time ``mgr.save`` holds training, with one tier and with copies due on two more."""
    configs = {
        "1 tier (local)": lambda d: [nc.Tier(d / "local", keep=2)],
        "3 tiers, copies due on 2 folders": lambda d: [
            nc.Tier(d / "local", keep=2),
            nc.Tier(d / "shared", keep=2),
            nc.Tier(d / "third", keep=2),
        ],
        "3 tiers, copies due on folder + S3": lambda d: [
            nc.Tier(d / "local", keep=2),
            nc.Tier(d / "shared", keep=2),
            nc.Tier(f"s3://{BUCKET}/blocking-{d.name}", keep=2, storage_options=moto.options),
        ],
    }
    rows = []
    base = None
    for label, make in configs.items():
        d = work / str(len(rows))
        d.mkdir(parents=True)
        blocked, iters = [], 0
        with nc.CheckpointManager(make(d)) as mgr:
            for step in range(1, saves + 1):
                t = time.perf_counter()
                mgr.save(step, state)
                blocked.append(time.perf_counter() - t)
                iters += _train_for(gap)
        med = statistics.median(blocked[1:] or blocked)
        base = base or med
        rows.append(
            [
                label,
                f"{med * 1e3:.0f} ms",
                f"{max(blocked) * 1e3:.0f} ms",
                f"{(med / base - 1) * 100:+.0f}%",
                f"{iters / (saves * gap):.1f}/s",
            ]
        )
    return rows


def bench_upload(state: dict[str, Any], work: Path, moto: Moto) -> list[list[str]]:
    """Time from a checkpoint in memory to a durable object on S3: our tier copy vs torch.save + s3fs put."""
    import s3fs

    fs = s3fs.S3FileSystem(**moto.options, skip_instance_cache=True)
    raw = sum(t.numel() * t.element_size() for t in _tensors(state))
    rows = []
    # torch.save to local disk, then an s3fs put of the uncompressed file.
    work.mkdir(parents=True, exist_ok=True)
    plain = work / "plain.pt"
    t0 = time.perf_counter()
    with open(plain, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    fs.put(str(plain), f"{BUCKET}/upload/plain.pt")
    t2 = time.perf_counter()
    size = plain.stat().st_size
    rows.append(
        [
            "torch.save + s3fs put",
            format_bytes(size),
            f"{t1 - t0:.2f} s",
            f"{t2 - t1:.2f} s",
            f"{t2 - t0:.2f} s",
            f"{size / (t2 - t1) / 1e6:.0f} MB/s",
            f"{raw / (t2 - t0) / 1e6:.0f} MB/s",
        ]
    )
    # nc.save to tier 0, then the tier copy (multipart, checked, committed).
    tiers = [nc.Tier(work / "up-local"), nc.Tier(f"s3://{BUCKET}/upload", storage_options=moto.options)]
    mgr = nc.CheckpointManager(tiers, async_save=False)
    src, dst = mgr._stores
    t0 = time.perf_counter()
    mgr.save(1, state)  # also queues the copy; measured separately below
    t1 = time.perf_counter()
    mgr.close()
    manifest = mgr.manifest(1)
    t2 = time.perf_counter()
    copy_unit(src, TierStore(nc.Tier(f"s3://{BUCKET}/upload2", storage_options=moto.options), "object2"), manifest)
    t3 = time.perf_counter()
    size = manifest.stored_bytes
    rows.append(
        [
            "nc save + tier copy",
            format_bytes(size),
            f"{t1 - t0:.2f} s",
            f"{t3 - t2:.2f} s",
            f"{(t1 - t0) + (t3 - t2):.2f} s",
            f"{size / (t3 - t2) / 1e6:.0f} MB/s",
            f"{raw / ((t1 - t0) + (t3 - t2)) / 1e6:.0f} MB/s",
        ]
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", default="mlp", help="mlp (built here), or minilm / minilm-bf16 / moe from checkpoints.py")
    p.add_argument("--saves", type=int, default=4, help="saves per configuration")
    p.add_argument("--gap", type=float, default=3.0, help="seconds of stand-in training between saves")
    p.add_argument("--json", help="also write the tables to this JSON file")
    args = p.parse_args()
    state = load_checkpoint(args.checkpoint)
    raw = sum(t.numel() * t.element_size() for t in _tensors(state))
    print(f"checkpoint {args.checkpoint}: {format_bytes(raw)} of tensors, {os.cpu_count()} cores", flush=True)
    moto = Moto()
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    out: dict[str, Any] = {}
    try:
        rows = bench_bytes_moved(state, work / "moved", moto, args.saves)
        out["bytes_moved"] = rows
        print("\nBytes moved per tier (every save copied to every tier)")
        print(format_table(["tier", "saves", "bytes moved", "bytes stored", "equal", "raw / moved"], rows))
        rows = bench_blocking(state, work / "blocking", moto, args.saves, args.gap)
        out["blocking"] = rows
        print(f"\nBlocking time of mgr.save (async; {args.gap:g} s of stand-in training between saves)")
        print(format_table(["configuration", "median blocked", "max blocked", "vs 1 tier", "training iters"], rows))
        rows = bench_upload(state, work / "upload", moto)
        out["upload"] = rows
        print("\nFrom memory to a durable object on the local S3 endpoint")
        print(format_table(["method", "uploaded", "local save", "upload", "total", "upload MB/s", "raw MB/s end to end"], rows))
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
