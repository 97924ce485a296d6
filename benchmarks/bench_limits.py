"""What this machine can do at best, next to what our save and load do, on the same tensors in one run.

Limits: the storage (a file as large as ours written and fsynced; read back with its pages dropped
from the cache, and from the cache), a memory copy of the tensor bytes, and libzstd alone on the
exact byte planes our writer produces (each plane compressed at level 1; each of our compressed
frames decompressed into a buffer allocated once, each raw frame copied), on one thread and on
every core. Ours: ``nc.save`` (fsynced) and ``CheckpointReader.load`` with as many workers as
cores. Every throughput is MB/s of tensor bytes, and ours is also given as a share of the limits.
Rounds are interleaved (every measurement once per round) and the best of each is kept, so that
load from other processes on a shared machine hits one round of each rather than every round
of one. The run is stored with its commit, machine and load (``results_store``).

    python benchmarks/bench_limits.py                    # moe, bf16 weights (builds it once, ~15 s)
    python benchmarks/bench_limits.py --store            # ... and make this run the baseline
    python benchmarks/compare.py                         # the newest run against the baseline
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.reader import CheckpointReader  # noqa: E402
from results_store import environment, metric, write_run  # noqa: E402

MB = 1e6
#: Pieces a storage write or read is made of (as our writer's and reader's chunks).
IO_PIECE = 4 << 20


def bf16_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the model's floating tensors in bf16 (moments fp32, gradients bf16, as a bf16 run)."""
    model = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state["model"].items()}
    return {**state, "model": model}


def tensor_bytes(state: Any) -> int:
    total = 0
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            total += node.numel() * node.element_size()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def planes_and_frames(path: Path) -> tuple[list[np.ndarray], list[tuple[bytes, int]], list[bytes]]:
    """Our file's byte planes (decoded), its compressed frames ``(frame, raw size)`` and its raw frames."""
    planes: list[np.ndarray] = []
    compressed: list[tuple[bytes, int]] = []
    raw: list[bytes] = []
    dctx = zstandard.ZstdDecompressor()
    with CheckpointReader(path) as reader, open(path, "rb") as f:
        data = f.read()
        for entry in reader.index.tensors:
            for _, _, frames in entry.chunks():
                for fr in frames:
                    stored = data[fr.offset : fr.offset + fr.size]
                    if fr.is_raw:
                        raw.append(stored)
                        planes.append(np.frombuffer(stored, dtype=np.uint8))
                    else:
                        if entry.codec.id != "zstd":
                            raise SystemExit(f"{path}: tensor {entry.key!r} uses {entry.codec.id}; run with the default policy")
                        compressed.append((stored, fr.raw_size))
                        planes.append(np.frombuffer(dctx.decompress(stored, max_output_size=fr.raw_size), dtype=np.uint8))
    return planes, compressed, raw


def component_ratios(path: Path) -> dict[str, dict[str, float]]:
    """Per component: ours, ``zstd -1`` on each whole tensor, and ``zstd -1`` on each of our planes."""
    cctx = zstandard.ZstdCompressor(level=1)
    dctx = zstandard.ZstdDecompressor()
    raw: dict[str, int] = {}
    sizes: dict[str, dict[str, int]] = {}
    with CheckpointReader(path) as reader, open(path, "rb") as f:
        data = f.read()
        for entry in reader.index.tensors:
            c = entry.component
            raw[c] = raw.get(c, 0) + entry.nbytes
            got = sizes.setdefault(c, {"ours": 0, "zstd -1 per tensor": 0, "zstd -1 on our planes": 0})
            got["ours"] += entry.stored_bytes
            got["zstd -1 per tensor"] += len(
                cctx.compress(reader.read(entry.key).contiguous().view(-1).view(torch.uint8).numpy())
            )
            for _, _, frames in entry.chunks():
                for fr in frames:
                    stored = data[fr.offset : fr.offset + fr.size]
                    plane = stored if fr.is_raw else dctx.decompress(stored, max_output_size=fr.raw_size)
                    got["zstd -1 on our planes"] += min(len(plane), len(cctx.compress(plane)))
    return {c: {m: raw[c] / n for m, n in got.items()} for c, got in sizes.items() if raw[c] >= 1 << 20}


def plot_ratios(ratios: dict[str, dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = list(ratios)
    methods = list(next(iter(ratios.values())))
    fig, ax = plt.subplots(figsize=(7.5, 3.2), dpi=90)
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(comps))]
        bars = ax.bar(xs, [ratios[c][m] for c in comps], width, label=m)
        ax.bar_label(bars, fmt="%.3f", fontsize=6)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(comps))], comps, fontsize=8)
    ax.set_ylabel("compression ratio")
    ax.set_ylim(1.0, max(max(r.values()) for r in ratios.values()) * 1.08)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _on_threads(jobs: list[Callable[[], None]], threads: int) -> None:
    if threads == 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(threads) as pool:
        for fut in [pool.submit(job) for job in jobs]:
            fut.result()


def zstd_compress(planes: list[np.ndarray], threads: int) -> Callable[[], None]:
    local = threading.local()

    def one(plane: np.ndarray) -> Callable[[], None]:
        def job() -> None:
            cctx = getattr(local, "cctx", None)
            if cctx is None:
                cctx = local.cctx = zstandard.ZstdCompressor(level=1)
            cctx.compress(plane)

        return job

    jobs = [one(p) for p in planes]
    return lambda: _on_threads(jobs, threads)


def zstd_decompress(compressed: list[tuple[bytes, int]], raw: list[bytes], threads: int) -> Callable[[], None]:
    """Every compressed frame decoded and every raw frame copied, into buffers allocated once."""
    local = threading.local()
    outs = [np.empty(size, dtype=np.uint8) for _, size in compressed] + [np.empty(len(r), dtype=np.uint8) for r in raw]

    def decode(frame: bytes, out: np.ndarray) -> Callable[[], None]:
        def job() -> None:
            dctx = getattr(local, "dctx", None)
            if dctx is None:
                dctx = local.dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(frame) as reader:
                reader.readinto(out.data)

        return job

    def copy(frame: bytes, out: np.ndarray) -> Callable[[], None]:
        return lambda: np.copyto(out, np.frombuffer(frame, dtype=np.uint8))

    jobs = [decode(f, o) for (f, _), o in zip(compressed, outs)] + [copy(r, o) for r, o in zip(raw, outs[len(compressed) :])]
    return lambda: _on_threads(jobs, threads)


def memcpy(nbytes: int, threads: int) -> Callable[[], None]:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # touched: the copy, not page faults
    step = -(-nbytes // threads)
    jobs = [lambda a=a: np.copyto(dst[a : a + step], src[a : a + step]) for a in range(0, nbytes, step)]
    return lambda: _on_threads(jobs, threads)


def drop_cache(path: Path) -> bool:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (no root needed)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def storage_write(path: Path, nbytes: int) -> Callable[[], None]:
    piece = np.random.default_rng(0).integers(0, 256, IO_PIECE, dtype=np.uint8).tobytes()

    def run() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, piece[: min(left, IO_PIECE)])
            os.fsync(fd)
        finally:
            os.close(fd)

    return run


def storage_read(path: Path, cold: bool) -> Callable[[], None]:
    buf = np.empty(IO_PIECE, dtype=np.uint8)

    def run() -> None:
        if cold:
            drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buf.data]):
                pass
        finally:
            os.close(fd)

    return run


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall s, CPU s of the whole process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="moe", choices=sorted(checkpoints.CHECKPOINTS))
    p.add_argument("--fp32-weights", action="store_true", help="keep the weights as trained (default: bf16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=None, help="threads for ours and for 'all cores' (default: every core)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary directory)")
    p.add_argument("--store", action="store_true", help="make this run the stored baseline (benchmarks/results/)")
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown")
    p.add_argument("--plot", type=Path, help="also draw the ratio per component (PNG)")
    args = p.parse_args(argv)
    env = environment()
    threads = args.workers or len(os.sched_getaffinity(0))
    state = checkpoints.load_cached(args.checkpoint)
    if not args.fp32_weights:
        state = bf16_weights(state)
    raw = tensor_bytes(state)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ours = Path(tmp) / "ours.nvc"
        scratch = Path(tmp) / "storage.bin"
        nc.save(state, ours, workers=threads)
        stored = ours.stat().st_size
        planes, compressed, raw_frames = planes_and_frames(ours)
        plain_ratio = raw / sum(len(zstandard.ZstdCompressor(level=1).compress(p)) for p in planes)
        ratios = component_ratios(ours)

        def load() -> None:
            with CheckpointReader(ours, workers=threads) as reader:
                reader.load()

        def load_cold() -> None:
            drop_cache(ours)
            load()

        cases: dict[str, Callable[[], None]] = {
            "storage write+fsync": storage_write(scratch, stored),
            "storage read, cache dropped": storage_read(scratch, cold=True),
            "storage read, cached": storage_read(scratch, cold=False),
            "memcpy, 1 thread": memcpy(raw, 1),
            f"memcpy, {threads} threads": memcpy(raw, threads),
            "zstd -1 compress planes, 1 thread": zstd_compress(planes, 1),
            f"zstd -1 compress planes, {threads} threads": zstd_compress(planes, threads),
            "zstd decompress planes, 1 thread": zstd_decompress(compressed, raw_frames, 1),
            f"zstd decompress planes, {threads} threads": zstd_decompress(compressed, raw_frames, threads),
            f"ours: save (fsync), {threads} workers": lambda: nc.save(state, ours, workers=threads),
            f"ours: load, cached, {threads} workers": load,
            f"ours: load, cache dropped, {threads} workers": load_cold,
        }
        best: dict[str, tuple[float, float]] = {}
        for r in range(args.rounds):
            for name, fn in cases.items():
                wall, cpu = timed(fn)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, cpu)
            print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    mbps = {name: raw / MB / wall for name, (wall, _) in best.items()}
    dec_all = mbps[f"zstd decompress planes, {threads} threads"]
    comp_all = mbps[f"zstd -1 compress planes, {threads} threads"]
    save = mbps[f"ours: save (fsync), {threads} workers"]
    load_mbps = mbps[f"ours: load, cached, {threads} workers"]
    print(
        f"\n{args.checkpoint}{'' if args.fp32_weights else ' (bf16 weights)'}: {raw / MB:.1f} MB of tensors, "
        f"ours {stored / MB:.1f} MB (ratio {raw / stored:.4f}; zstd -1 on the same planes {plain_ratio:.4f}); "
        f"{threads} threads; load average {os.getloadavg()[0]:.2f} at the end\n"
    )
    rows = [("measurement", "wall s", "CPU s", "MB/s of tensor bytes", "CPU s per GB")]
    for name, (wall, cpu) in best.items():
        rows.append((name, f"{wall:.3f}", f"{cpu:.3f}", f"{mbps[name]:.0f}", f"{cpu / (raw / 1e9):.2f}"))

    def cpu_of(name: str) -> float:
        return best[name][1]

    share = [
        ("ours: load / zstd decompress, same threads", load_mbps / dec_all),
        ("ours: save / zstd -1 compress, same threads", save / comp_all),
        (
            "ours: load / storage read, cache dropped",
            mbps[f"ours: load, cache dropped, {threads} workers"] / (mbps["storage read, cache dropped"] * raw / stored),
        ),
        ("ours: save / storage write+fsync", save / (mbps["storage write+fsync"] * raw / stored)),
        ("ours: load / memcpy, same threads", load_mbps / mbps[f"memcpy, {threads} threads"]),
        # CPU time does not depend on what else the machine runs as much as wall time does.
        (
            "ours: load / zstd decompress, per CPU-second",
            cpu_of("zstd decompress planes, 1 thread") / cpu_of(f"ours: load, cached, {threads} workers"),
        ),
        (
            "ours: save / zstd -1 compress, per CPU-second",
            cpu_of("zstd -1 compress planes, 1 thread") / cpu_of(f"ours: save (fsync), {threads} workers"),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["", "| share of the limit | |", "|---|---|"] + [f"| {n} | {v:.0%} |" for n, v in share]
    methods = list(next(iter(ratios.values())))
    lines += ["", "| component | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    lines += [f"| {c} | " + " | ".join(f"{r[m]:.4f}" for m in methods) + " |" for c, r in ratios.items()]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    metrics = {f"{name} MB/s": metric(v, "MB/s", "higher") for name, v in mbps.items()}
    metrics.update(
        {f"{name} CPU s/GB": metric(best[name][1] / (raw / 1e9), "s/GB", "lower") for name in best if name.startswith("ours")}
    )
    metrics.update({n: metric(v, "share", "higher") for n, v in share})
    metrics["ratio"] = metric(raw / stored, "x", "exact")
    metrics.update({f"ratio {c}": metric(r["ours"], "x", "exact") for c, r in ratios.items()})
    if args.plot:
        plot_ratios(
            ratios, args.plot, f"Ratio per component, {args.checkpoint} ({'fp32' if args.fp32_weights else 'bf16'} weights)"
        )
    env.update(
        checkpoint=args.checkpoint, bf16_weights=not args.fp32_weights, threads=threads, tensor_bytes=raw, rounds=args.rounds
    )
    print(f"\nstored {write_run('limits', metrics, env, store=args.store)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
