"""Ratio and throughput of the nvCOMP GPU codecs on checkpoint-like tensors, bytes as they are
and split into byte planes, next to libzstd -1 on one CPU core; run on a GPU machine.

Components (seeded, synthetic, --size-mib each): bf16 weights ~N(0, 0.02), fp32 exp_avg
~N(0, 1e-4), fp32 exp_avg_sq (small positive squares), bf16 gradients with 50% zeros. Each is
cut into --chunk-kib chunks and sent through the library's own ``encode_batch`` /
``decode_batch`` (one nvCOMP batch per tensor), timed with CUDA events after a warm-up. The
plane layout counts the split (and the inverse on decode) in its time. Synthetic mantissas are
noisier than trained weights, so ratios here are a floor; docs/facts.md has real-checkpoint
ratios measured on the CPU.

Usage (from the repo root, on the GPU machine; benchmarks/gpu_check.sh does this):
    PYTHONPATH=src python3 benchmarks/gpu_codec_bench.py [--size-mib 256] [--chunk-kib 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:
    from nvcomp_checkpoint.codecs import nvcomp as gpu_codecs
    from nvcomp_checkpoint.codecs.cpu import ZstdCpuCodec
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from nvcomp_checkpoint.codecs import nvcomp as gpu_codecs
    from nvcomp_checkpoint.codecs.cpu import ZstdCpuCodec

MIB = 1 << 20
CODECS = ("zstd", "ans", "bitcomp", "gdeflate", "cascaded", "none")
LAYOUTS = ("tensor", "planes")


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    codec: str
    component: str
    layout: str
    raw_bytes: int
    ratio: float  # raw bytes / sum of frame sizes
    ratio_kept: float  # same, where a frame that does not shrink is stored raw instead
    compress_gbps: float
    decompress_gbps: float
    exact: bool  # the decoded bytes equal the input


def make_components(size_bytes: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The four synthetic checkpoint tensors, ``size_bytes`` each, made on the GPU from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(numel: int) -> torch.Tensor:
        return torch.randn(numel, generator=gen, device=device)

    n16, n32 = size_bytes // 2, size_bytes // 4
    grads = randn(n16) * 1e-3
    grads *= torch.rand(n16, generator=gen, device=device) < 0.5  # half the entries exactly zero
    return {
        "weights bf16": (randn(n16) * 0.02).to(torch.bfloat16),
        "exp_avg fp32": randn(n32) * 1e-4,
        "exp_avg_sq fp32": (randn(n32) * 1e-3).square(),
        "grads bf16": grads.to(torch.bfloat16),
    }


def to_planes(tensor: torch.Tensor) -> torch.Tensor:
    """Byte plane p = byte p of every element: shape (itemsize, numel), row-contiguous."""
    return tensor.view(torch.uint8).view(-1, tensor.element_size()).t().contiguous()


def from_planes(planes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_planes`, as flat bytes."""
    return planes.t().contiguous().view(-1)


def chunked(data: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """1-D contiguous chunks; a 2-D plane tensor is chunked row by row (no chunk spans planes)."""
    rows = [data] if data.dim() == 1 else list(data.unbind(0))
    return [c for row in rows for c in row.split(chunk_bytes)]


def cuda_time_s(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Seconds ``fn`` takes on the device's current stream, measured with CUDA events."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    result = fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3, result


def bench_gpu(codec_id: str, name: str, tensor: torch.Tensor, layout: str, chunk_bytes: int, repeats: int) -> Row:
    device = tensor.device
    codec = gpu_codecs.gpu_codec(codec_id, None, device)
    raw = tensor.view(torch.uint8).reshape(-1)
    itemsize = tensor.element_size()

    def encode() -> tuple[list[torch.Tensor], list[int]]:
        data = to_planes(tensor) if layout == "planes" else raw
        chunks = chunked(data, chunk_bytes)
        return codec.encode_batch(chunks), [c.numel() for c in chunks]

    def decode(frames: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
        flat = torch.cat(codec.decode_batch(frames, sizes))
        return from_planes(flat.view(itemsize, -1)) if layout == "planes" else flat

    frames, sizes = encode()  # warm-up: first-use codec creation, allocator growth
    decode(frames, sizes)
    enc_times, dec_times = [], []
    for _ in range(repeats):
        seconds, (frames, sizes) = cuda_time_s(encode, device)
        enc_times.append(seconds)
        seconds, restored = cuda_time_s(lambda f=frames, s=sizes: decode(f, s), device)
        dec_times.append(seconds)
    exact = bool(torch.equal(restored, raw))
    stored = sum(f.numel() for f in frames)
    kept = sum(min(f.numel(), s) for f, s in zip(frames, sizes, strict=True))
    nbytes = raw.numel()
    return Row(
        codec=codec_id,
        component=name,
        layout=layout,
        raw_bytes=nbytes,
        ratio=nbytes / stored,
        ratio_kept=nbytes / kept,
        compress_gbps=nbytes / statistics.median(enc_times) / 1e9,
        decompress_gbps=nbytes / statistics.median(dec_times) / 1e9,
        exact=exact,
    )


def bench_cpu(name: str, tensor: torch.Tensor, layout: str, chunk_bytes: int, sample_bytes: int) -> Row:
    """libzstd -1 on one core over the first ``sample_bytes`` of the tensor: the CPU alternative."""
    sample = tensor.view(torch.uint8)[:sample_bytes].view(tensor.dtype)
    data = to_planes(sample) if layout == "planes" else sample.view(torch.uint8)
    chunks = [bytes(c.cpu().numpy()) for c in chunked(data, chunk_bytes)]
    codec = ZstdCpuCodec(1)
    t0 = time.perf_counter()
    frames = [codec.encode(memoryview(c)) for c in chunks]
    t1 = time.perf_counter()
    restored = [codec.decode(memoryview(f), len(c)) for f, c in zip(frames, chunks, strict=True)]
    t2 = time.perf_counter()
    nbytes = sum(len(c) for c in chunks)
    return Row(
        codec="cpu zstd-1 x1",
        component=name,
        layout=layout,
        raw_bytes=nbytes,
        ratio=nbytes / sum(len(f) for f in frames),
        ratio_kept=nbytes / sum(min(len(f), len(c)) for f, c in zip(frames, chunks, strict=True)),
        compress_gbps=nbytes / (t1 - t0) / 1e9,
        decompress_gbps=nbytes / (t2 - t1) / 1e9,
        exact=restored == chunks,
    )


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'codec':<14} {'component':<16} {'layout':<7} {'ratio':>6} {'kept':>6} "
        f"{'comp GB/s':>10} {'dec GB/s':>9}  exact"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.codec:<14} {r.component:<16} {r.layout:<7} {r.ratio:6.3f} {r.ratio_kept:6.3f} "
            f"{r.compress_gbps:10.2f} {r.decompress_gbps:9.2f}  {'yes' if r.exact else 'NO'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="bytes per component (default 256 MiB)")
    parser.add_argument("--chunk-kib", type=int, default=256, help="raw bytes per frame (default 256 KiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up; the median is shown")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec ids")
    parser.add_argument("--cpu-sample-mib", type=int, default=16, help="bytes per component for the CPU row (0: skip)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting new runs after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args(argv)

    reason = gpu_codecs.unavailable_reason()
    if reason is not None:
        print(
            f"gpu_codec_bench: not run: it needs a CUDA GPU and nvCOMP, but {reason}. "
            "Run benchmarks/gpu_check.sh on the GPU machine.",
            file=sys.stderr,
        )
        return 2
    codec_ids = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = sorted(set(codec_ids) - set(CODECS))
    if unknown:
        parser.error(f"unknown codecs {unknown}; choose from {', '.join(CODECS)}")

    from nvidia import nvcomp

    device = torch.device("cuda", torch.cuda.current_device())
    print(
        f"gpu_codec_bench: {torch.cuda.get_device_name(device)}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), nvCOMP {nvcomp.__version__} (CUDA {nvcomp.__cuda_version__}); "
        f"{args.size_mib} MiB per component, {args.chunk_kib} KiB chunks, median of {args.repeats}",
        flush=True,
    )
    started = time.perf_counter()
    components = make_components(args.size_mib * MIB, device, args.seed)
    chunk_bytes = args.chunk_kib * 1024
    rows: list[Row] = []
    skipped: list[str] = []

    if args.cpu_sample_mib > 0:
        sample_bytes = min(args.cpu_sample_mib, args.size_mib) * MIB
        for name, tensor in components.items():
            for layout in LAYOUTS:
                rows.append(bench_cpu(name, tensor, layout, chunk_bytes, sample_bytes))
    for codec_id in codec_ids:
        for name, tensor in components.items():
            for layout in LAYOUTS:
                label = f"{codec_id}/{name}/{layout}"
                if time.perf_counter() - started > args.budget_s:
                    skipped.append(label)
                    continue
                try:
                    row = bench_gpu(codec_id, name, tensor, layout, chunk_bytes, args.repeats)
                except Exception as exc:  # one failing codec must not hide the others' numbers
                    print(f"gpu_codec_bench: {label} failed: {type(exc).__name__}: {exc}", flush=True)
                    skipped.append(label)
                    continue
                rows.append(row)
                if args.json:  # after every row: a run killed by its timeout keeps what it measured
                    args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
                print(
                    f"  {label}: ratio {row.ratio:.3f}, {row.compress_gbps:.1f} / {row.decompress_gbps:.1f} GB/s"
                    f"{'' if row.exact else ', ROUND TRIP DIFFERS'}",
                    flush=True,
                )
    print()
    print_table(rows)
    print(
        f"\nratio = raw / stored; kept = the same when frames that do not shrink are stored raw; "
        f"cpu rows: libzstd -1 on one core over the first {args.cpu_sample_mib} MiB. "
        f"Total {time.perf_counter() - started:.0f} s."
    )
    if skipped:
        print(f"not measured (failed or over the {args.budget_s:.0f} s budget): {', '.join(skipped)}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if any(not r.exact for r in rows) or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
