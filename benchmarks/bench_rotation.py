"""Rotated or plain byte planes chosen per tensor from a sample, against the per-component rule.

Saves one checkpoint with the default policy, once with ``choose_rotation=True`` (each tensor of
1 MiB or more gets whichever filter a sample of it says) and once as it is (each component's
filter: rotated weights and second moments, plain first moments and gradients),
interleaved (A B A B ...) so both see the same load from other processes; prints the ratio per
component of each, the per-tensor optimum (every tensor saved whole both ways, the smaller
kept), the save's CPU and wall seconds (min and median over the rounds), and the CPU seconds of
the sampling alone (once per round, on one thread).

    python benchmarks/bench_rotation.py                          # moe, bf16 weights (as bench_limits.py)
    python benchmarks/bench_rotation.py --checkpoint dense-pair  # the later checkpoint of bench_peers.py's dense pair
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import nvcomp_checkpoint as nc  # noqa: E402
from bench_limits import bf16_weights  # noqa: E402
from nvcomp_checkpoint.codecs import cpu_codec  # noqa: E402
from nvcomp_checkpoint.format.skeleton import flatten  # noqa: E402
from nvcomp_checkpoint.planechoice import choose_rotation  # noqa: E402
from nvcomp_checkpoint.writer import plan_tensors  # noqa: E402

#: The states measured: bench_limits.py's (moe with bf16 weights), and the later checkpoint of each
#: pair of bench_peers.py (bf16 weights, fp32 moments, bf16 gradients).
STATES: dict[str, Callable[[], dict[str, Any]]] = {
    "moe": lambda: bf16_weights(checkpoints.load_cached("moe")),
    "dense-pair": lambda: checkpoints.load_pair("dense")["later"],
    "moe-pair": lambda: checkpoints.load_pair("moe")["later"],
}


def per_component(path: Path) -> dict[str, tuple[int, int]]:
    """``{component: (raw bytes, stored bytes)}`` of a saved file."""
    out: dict[str, tuple[int, int]] = {}
    with nc.open(path) as reader:
        for t in reader.index.tensors:
            raw, stored = out.get(t.component, (0, 0))
            out[t.component] = (raw + t.nbytes, stored + t.stored_bytes)
    return out


def per_tensor(path: Path) -> dict[str, tuple[str, int, int]]:
    """``{key: (component, raw bytes, stored bytes)}`` of a saved file."""
    with nc.open(path) as reader:
        return {t.key: (t.component, t.nbytes, t.stored_bytes) for t in reader.index.tensors}


def sampling(state: Any) -> Callable[[], None]:
    """The writer's sampling alone: every tensor it would choose for, ranked as it does, on one thread."""
    policy = nc.CodecPolicy(choose_rotation=True)
    _, tensors = flatten(state)
    chosen = [item for item in plan_tensors(tensors, policy, "bench") if item.chooses_rotation]

    def run() -> None:
        for item in chosen:
            codec = cpu_codec(item.spec.codec, item.spec.level, item.spec.adaptive)
            flat = item.tensor.reshape(-1).view(torch.uint8).numpy()
            choose_rotation(flat, item.width, item.may_rotate, item.spec.filter == "rotplane", codec)

    return run


def optimum(state: Any, tmp: Path, workers: int) -> dict[str, tuple[int, int]]:
    """Per component, every tensor in whichever of rotated or plain planes stores it smaller (both saved whole)."""
    sizes = []
    for filt in ("rotplane", "byteplane"):
        policy = nc.CodecPolicy.uniform(nc.CodecSpec("zstd", 1, filt), choose_rotation=False)
        nc.save(state, tmp / f"all-{filt}.nvc", policy, workers=workers)
        sizes.append(per_tensor(tmp / f"all-{filt}.nvc"))
    out: dict[str, tuple[int, int]] = {}
    for key, (comp, raw, rotated) in sizes[0].items():
        plain = sizes[1][key][2]
        r, s = out.get(comp, (0, 0))
        out[comp] = (r + raw, s + min(rotated, plain))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="moe", choices=sorted(STATES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, default=None, help="compression threads (default: every core)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary directory)")
    args = p.parse_args(argv)
    workers = args.workers or len(os.sched_getaffinity(0))
    state = STATES[args.checkpoint]()
    print(f"load average at the start {os.getloadavg()}", flush=True)
    variants = {"per tensor": nc.CodecPolicy(choose_rotation=True), "per component": nc.CodecPolicy()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    sample_all = sampling(state)
    sampled: list[float] = []
    ratios: dict[str, dict[str, tuple[int, int]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_dir:
        tmp = Path(tmp_dir)
        for r in range(args.rounds):
            for name, policy in variants.items() if r % 2 == 0 else reversed(variants.items()):
                path = tmp / f"{name.replace(' ', '-')}.nvc"
                wall, cpu = time.perf_counter(), time.process_time()
                nc.save(state, path, policy, workers=workers)
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
                ratios[name] = per_component(path)
            cpu = time.thread_time()
            sample_all()
            sampled.append(time.thread_time() - cpu)
        ratios["per-tensor optimum"] = optimum(state, tmp, workers)
    print(f"load average at the end {os.getloadavg()}\n")
    comps = [c for c in ratios["per component"] if ratios["per component"][c][0] >= 1 << 20]
    print("| filter chosen | " + " | ".join(comps) + " | whole |")
    print("|---|" + "---|" * (len(comps) + 1))
    for name, got in ratios.items():
        whole = sum(raw for raw, _ in got.values()) / sum(stored for _, stored in got.values())
        print(f"| {name} | " + " | ".join(f"{got[c][0] / got[c][1]:.4f}" for c in comps) + f" | {whole:.4f} |")
    print(f"\n| save ({workers} workers, {args.rounds} rounds) | CPU s min | CPU s median | wall s min | wall s median |")
    print("|---|---|---|---|---|")
    for name, got in times.items():
        walls, cpus = [w for w, _ in got], [c for _, c in got]
        print(f"| {name} | {min(cpus):.3f} | {statistics.median(cpus):.3f} | {min(walls):.3f} | {statistics.median(walls):.3f} |")
    print(f"\nthe sampling alone (one thread): CPU s min {min(sampled):.4f}, median {statistics.median(sampled):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
