"""GPU codec benchmark: the writer's own GPU settings next to smaller chunks, so that the
measurement, not a guess, sets the GPU chunk size; GPU-only codecs at their defaults; libzstd.

Four synthetic checkpoint components (--size-mib each, seeded, made on the GPU): bf16 weights
~N(0, 0.02), fp32 exp_avg ~N(0, 1e-4), fp32 exp_avg_sq (small squares), bf16 gradients with 50%
zeros. Each is compressed exactly as the writer does on a GPU (``writer.plan_tensors`` with a
policy of that chunk size, then ``writer.encode_gpu_batch`` per ``writer.gpu_batches``: byte
planes, 64 MiB batches, chunks cut to nvCOMP's limit, frames that do not shrink kept raw) and
decoded as the reader does (``decode_batch`` with the frames' host bytes, so the host check of
every zstd frame is in the time, then the plane join), in 64 MiB groups. Times are wall-clock
with the device synchronized, median of --repeats after a warm-up.

zstd runs at the writer's chunk (4 MiB: frames of 1-2 MiB per plane) and at --chunk-kib
alternatives (nvCOMP's headers recommend 64 KiB); the last line names the fastest chunk size whose
ratio is within 1% of the best: the value for ``gpu_chunk_bytes`` of ``zstd`` in
codecs/registry.py. The CPU rows (libzstd -1, one core, first --cpu-sample-mib of each component)
also time the host check alone; without a GPU only they run (gpu_check.sh's dry run).

Usage (from the repo root; benchmarks/gpu_check.sh runs it):
    PYTHONPATH=src python3 benchmarks/gpu_codec_bench.py [--size-mib 64] [--json out.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e .`

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint import writer  # noqa: E402
from nvcomp_checkpoint.codecs import codec_facts  # noqa: E402
from nvcomp_checkpoint.codecs import nvcomp as gpu_codecs  # noqa: E402
from nvcomp_checkpoint.codecs.cpu import ZstdCpuCodec  # noqa: E402
from nvcomp_checkpoint.filters import ByteplaneFilter, plane_width  # noqa: E402

MIB = 1 << 20
KIB = 1 << 10
GPU_ONLY = ("ans", "bitcomp", "gdeflate", "cascaded")


@dataclass(frozen=True)
class Row:
    """One measurement: one codec and chunk size over one component (or all: ``component == "all"``)."""

    device: str
    codec: str
    chunk_kib: int
    component: str
    raw_bytes: int
    stored_bytes: int
    frames: int
    compress_s: float
    decompress_s: float
    host_check_s: float  # zstd only: the host check of every frame, alone (also inside decompress_s)
    host_decoded: int  # frames decode_batch gave to libzstd instead of nvCOMP (0 expected)
    exact: bool

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(1, self.stored_bytes)

    def gbps(self, seconds: float) -> float:
        return self.raw_bytes / seconds / 1e9 if seconds > 0 else float("nan")


def make_components(size_bytes: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The four synthetic checkpoint tensors, ``size_bytes`` each, made on ``device`` from ``seed``."""
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


def _timed(fn: Callable[[], object], device: torch.device | None) -> tuple[float, object]:
    if device is not None:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device is not None:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def bench_gpu(codec_id: str, chunk_bytes: int, name: str, tensor: torch.Tensor, repeats: int) -> Row:
    """The writer's GPU compression and the reader's GPU decompression of one tensor."""
    device = tensor.device
    spec = nc.CodecSpec(codec_id, 1 if codec_id == "zstd" else None, "byteplane", chunk_bytes=chunk_bytes)
    policy = nc.CodecPolicy.uniform(spec, device=str(device), min_compress_bytes=0)
    (item,) = writer.plan_tensors([((name,), tensor)], policy, "gpu_codec_bench")
    assert item.device == device, f"the writer would not compress {name} on {device}"
    flat = tensor.reshape(-1).view(torch.uint8)
    codec = gpu_codecs.gpu_codec(codec_id, None, device)
    planes = item.planes
    filt = ByteplaneFilter(item.width)

    def encode() -> tuple[list[torch.Tensor], list[int]]:
        frames: list[torch.Tensor] = []
        sizes: list[int] = []
        for group in writer.gpu_batches(item):
            f, s, _ops = writer.encode_gpu_batch(flat, group, item)
            frames += f
            sizes += s
        return frames, sizes

    def decode(frames: list[torch.Tensor], sizes: list[int], host: list[bytes]) -> torch.Tensor:
        out = torch.empty(item.nbytes, dtype=torch.uint8, device=device)
        starts = list(range(0, item.nbytes, item.chunk_bytes))
        per_group = max(1, writer.GPU_BATCH_BYTES // item.chunk_bytes)  # the reader's groups
        for g in range(0, len(starts), per_group):
            lo, hi = g * planes, min(len(starts), g + per_group) * planes
            pieces = frames[lo:hi]
            todo = [i for i in range(lo, hi) if frames[i].numel() < sizes[i]]  # the rest is stored raw
            if todo:
                decoded = codec.decode_batch(
                    [frames[i] for i in todo], [sizes[i] for i in todo], host_frames=[host[i] for i in todo]
                )
                for i, d in zip(todo, decoded, strict=True):
                    pieces[i - lo] = d
            for k in range(g, min(len(starts), g + per_group)):
                parts = pieces[(k - g) * planes : (k - g + 1) * planes]
                joined = filt.join_torch(parts) if planes > 1 else parts[0]
                out[starts[k] : starts[k] + joined.numel()].copy_(joined)
        return out

    def to_host(frames: list[torch.Tensor]) -> list[bytes]:
        """The frames' bytes in host memory: what the reader reads from the file."""
        packed = torch.cat([f.reshape(-1) for f in frames]).cpu().numpy().tobytes()
        out, pos = [], 0
        for f in frames:
            out.append(packed[pos : pos + f.numel()])
            pos += f.numel()
        return out

    frames, sizes = encode()  # warm-up: codec creation, allocator growth
    host = to_host(frames)
    decode(frames, sizes, host)
    enc, dec = [], []
    before = codec.host_decoded if hasattr(codec, "host_decoded") else 0
    restored = flat
    for _ in range(repeats):
        seconds, (frames, sizes) = _timed(encode, device)
        enc.append(seconds)
        host = to_host(frames)
        seconds, restored = _timed(lambda f=frames, s=sizes, h=host: decode(f, s, h), device)
        dec.append(seconds)
    host_decoded = (codec.host_decoded if hasattr(codec, "host_decoded") else 0) - before
    check_s = 0.0
    if codec_id == "zstd":
        todo = [i for i in range(len(frames)) if frames[i].numel() < sizes[i]]
        limit = codec_facts("zstd").gpu_decode_max_bytes
        check_s, _ = _timed(
            lambda: gpu_codecs.zstd_frames_for_host([host[i] for i in todo], [sizes[i] for i in todo], limit), None
        )
    return Row(
        device="cuda",
        codec=codec_id,
        chunk_kib=item.chunk_bytes // KIB,
        component=name,
        raw_bytes=item.nbytes,
        stored_bytes=sum(min(f.numel(), s) for f, s in zip(frames, sizes, strict=True)),
        frames=len(frames),
        compress_s=statistics.median(enc),
        decompress_s=statistics.median(dec),
        host_check_s=check_s,
        host_decoded=host_decoded,
        exact=bool(torch.equal(restored, flat)),
    )


def bench_cpu(chunk_bytes: int, name: str, tensor: torch.Tensor, sample_bytes: int) -> Row:
    """libzstd -1 on one core over the first ``sample_bytes``, as the CPU writer cuts it; and the host check."""
    sample = tensor.reshape(-1).view(torch.uint8)[:sample_bytes].cpu()
    width = plane_width(tensor.dtype)
    filt = ByteplaneFilter(width)
    chunks = [sample[i : i + chunk_bytes].numpy() for i in range(0, sample.numel(), chunk_bytes)]
    pieces = [bytes(p) for c in chunks for p in filt.split(c)]
    codec = ZstdCpuCodec(1)
    enc_s, frames = _timed(lambda: [codec.encode(memoryview(p)) for p in pieces], None)
    dec_s, restored = _timed(lambda: [codec.decode(memoryview(f), len(p)) for f, p in zip(frames, pieces, strict=True)], None)
    limit = codec_facts("zstd").gpu_decode_max_bytes
    check_s, routed = _timed(lambda: gpu_codecs.zstd_frames_for_host(frames, [len(p) for p in pieces], limit), None)
    return Row(
        device="cpu x1",
        codec="zstd",
        chunk_kib=chunk_bytes // KIB,
        component=name,
        raw_bytes=len(sample),
        stored_bytes=sum(min(len(f), len(p)) for f, p in zip(frames, pieces, strict=True)),
        frames=len(frames),
        compress_s=enc_s,
        decompress_s=dec_s,
        host_check_s=check_s,
        host_decoded=len(routed),
        exact=[bytes(r) for r in restored] == pieces,
    )


def summarize(rows: list[Row]) -> list[Row]:
    """One row per (device, codec, chunk size) over all components: sums of bytes and seconds."""
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.device, r.codec, r.chunk_kib), []).append(r)
    return [
        Row(
            device=d,
            codec=c,
            chunk_kib=k,
            component="all",
            raw_bytes=sum(r.raw_bytes for r in g),
            stored_bytes=sum(r.stored_bytes for r in g),
            frames=sum(r.frames for r in g),
            compress_s=sum(r.compress_s for r in g),
            decompress_s=sum(r.decompress_s for r in g),
            host_check_s=sum(r.host_check_s for r in g),
            host_decoded=sum(r.host_decoded for r in g),
            exact=all(r.exact for r in g),
        )
        for (d, c, k), g in groups.items()
    ]


def choose_gpu_chunk(summary: list[Row]) -> Row | None:
    """The fastest zstd GPU chunk size (compress + decompress) with a ratio within 1% of the best."""
    zstd = [r for r in summary if r.device == "cuda" and r.codec == "zstd" and r.exact and r.host_decoded == 0]
    if not zstd:
        return None
    best_ratio = max(r.ratio for r in zstd)
    return min((r for r in zstd if r.ratio >= 0.99 * best_ratio), key=lambda r: r.compress_s + r.decompress_s)


def table(rows: list[Row]) -> str:
    lines = [
        "| device | codec | chunk | component | ratio | comp GB/s | dec GB/s | host check GB/s | to libzstd | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        check = f"{r.gbps(r.host_check_s):.1f}" if r.host_check_s else "-"
        lines.append(
            f"| {r.device} | {r.codec} | {r.chunk_kib} KiB | {r.component} | {r.ratio:.3f} | {r.gbps(r.compress_s):.2f} "
            f"| {r.gbps(r.decompress_s):.2f} | {check} | {r.host_decoded} | {'yes' if r.exact else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64, help="bytes per component (default 64 MiB)")
    parser.add_argument("--chunk-kib", default="4096,1024,256,64", help="zstd chunk sizes; the first is the writer's")
    parser.add_argument("--codecs", default=",".join(GPU_ONLY), help="GPU-only codecs, at their default chunk size")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up; the median is shown")
    parser.add_argument("--cpu-sample-mib", type=int, default=8, help="bytes per component for the CPU rows (0: none)")
    parser.add_argument("--budget-s", type=float, default=50.0, help="start no new GPU measurement after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write rows, summary and choice here")
    args = parser.parse_args(argv)
    chunks = [int(c) * KIB for c in args.chunk_kib.split(",") if c.strip()]
    others = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = sorted(set(others) - set(GPU_ONLY))
    if unknown:
        parser.error(f"unknown GPU-only codecs {unknown}; choose from {', '.join(GPU_ONLY)}")

    reason = gpu_codecs.unavailable_reason()
    device = torch.device("cuda", torch.cuda.current_device()) if reason is None else torch.device("cpu")
    started = time.perf_counter()
    if reason is None:
        from nvidia import nvcomp

        print(
            f"gpu_codec_bench: {torch.cuda.get_device_name(device)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"nvCOMP {nvcomp.__version__}; {args.size_mib} MiB per component, median of {args.repeats}",
            flush=True,
        )
    else:
        print(f"gpu_codec_bench: GPU rows not run ({reason}); CPU rows only", flush=True)
    components = make_components(args.size_mib * MIB, device, args.seed)
    rows: list[Row] = []
    skipped: list[str] = []

    def record(row: Row) -> None:
        rows.append(row)
        print(
            f"  {row.device} {row.codec} {row.chunk_kib} KiB {row.component}: ratio {row.ratio:.3f}, "
            f"{row.gbps(row.compress_s):.2f} / {row.gbps(row.decompress_s):.2f} GB/s"
            f"{'' if row.exact else ', ROUND TRIP DIFFERS'}",
            flush=True,
        )
        if args.json:  # after every row: a run stopped by its timeout keeps what it measured
            write_json(args.json, rows, skipped)

    for chunk in chunks if args.cpu_sample_mib > 0 else []:
        for name, tensor in components.items():
            record(bench_cpu(chunk, name, tensor, args.cpu_sample_mib * MIB))
    if reason is None:
        runs = [("zstd", c) for c in chunks] + [(c, codec_facts(c).default_chunk_bytes) for c in others]
        for codec_id, chunk in runs:
            for name, tensor in components.items():
                label = f"{codec_id}/{chunk // KIB} KiB/{name}"
                if time.perf_counter() - started > args.budget_s:
                    skipped.append(label)
                    continue
                try:
                    record(bench_gpu(codec_id, chunk, name, tensor, args.repeats))
                except Exception as exc:  # noqa: BLE001 - one failing codec must not hide the others' numbers
                    print(f"gpu_codec_bench: {label} failed: {type(exc).__name__}: {exc}", flush=True)
                    skipped.append(label)
    summary = summarize(rows)
    print()
    print(table(summary))
    choice = choose_gpu_chunk(summary)
    if choice is not None:
        print(
            f"\nmeasured GPU zstd chunk: {choice.chunk_kib} KiB (fastest with a ratio within 1% of the best); "
            f"the writer's is {chunks[0] // KIB} KiB"
        )
    if skipped:
        print(f"not measured (failed or over the {args.budget_s:.0f} s budget): {', '.join(skipped)}")
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        write_json(args.json, rows, skipped)
    return 1 if any(not r.exact for r in rows) or skipped else 0


def write_json(path: Path, rows: list[Row], skipped: list[str]) -> None:
    summary = summarize(rows)
    choice = choose_gpu_chunk(summary)

    def plain(r: Row) -> dict[str, object]:
        return {
            **asdict(r),
            "ratio": r.ratio,
            "compress_gbps": r.gbps(r.compress_s),
            "decompress_gbps": r.gbps(r.decompress_s),
            "host_check_gbps": r.gbps(r.host_check_s) if r.host_check_s else None,
        }

    path.write_text(
        json.dumps(
            {
                "rows": [plain(r) for r in rows],
                "summary": [plain(r) for r in summary],
                "skipped": skipped,
                "gpu_zstd_chunk_kib": choice.chunk_kib if choice else None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
