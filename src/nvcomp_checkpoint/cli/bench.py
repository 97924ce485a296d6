"""``nvckpt bench``: every available codec and filter on every component of a real checkpoint.

Each candidate is timed through ``nvcomp_checkpoint.save``/``load`` into memory (the real write
path, without the storage), and the recommended policy follows the pipelined write-time rule.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
import uuid
from typing import Any, Sequence

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, FormatError, UnsafeCheckpointError
from nvcomp_checkpoint.filters import KERNELS

from . import _policy
from ._ui import EXIT_OK, Reporter, check_workers, gbps, make_table, print_json, stderr_console, stdout_console
from .sources import DIRECTORY, NVCOMP, OTHER, SAFETENSORS, TORCH, Source, TensorInfo, dir_files, open_source, sniff

__all__ = ["add_parser", "run_bench", "recommend", "unreliable", "why_none", "write_seconds", "default_candidates", "plot_figure"]

_GB = 1e9
#: Bytes taken from one tensor per sample piece: large enough for full-size chunks' ratio,
#: small enough that a sample spans many tensors of the component.
_PIECE_BYTES = 1 << 20
#: Below this a tensor is stored raw by the default policy, so it says nothing about codecs.
_MIN_TENSOR_BYTES = 2048
#: A sample smaller than this (MiB, the largest component's) times mostly start-up costs, not throughput.
_RELIABLE_SAMPLE_MB = 4.0
_BASELINE = {
    "codec": "none",
    "level": None,
    "filter": "none",
    "device": "-",
    "ratio": 1.0,
    "compress_gbps": None,
    "decompress_gbps": None,
}


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "bench",
        parents=[common],
        help="measure every codec and filter on every component and recommend a policy for your storage speed",
        description=(
            "Compress a sample of every component (weights, exp_avg, exp_avg_sq, gradients, other) of a real "
            "checkpoint with every available codec and filter, on the CPU and on the GPU when there is one: "
            "ratio, compress and decompress throughput. The recommended codec per component is the one with "
            "the shortest pipelined write, max(raw / compress speed, stored / storage speed); `none` when no "
            "codec outruns the storage."
        ),
    )
    p.add_argument("path", help="checkpoint file or directory (any layout inspect reads)")
    p.add_argument(
        "--storage-gbps", type=float, default=5.0, help="storage write throughput, GB/s (default 5: a shared file system)"
    )
    p.add_argument("--sample-mb", type=float, default=16.0, help="MiB sampled per component (default 16)")
    p.add_argument(
        "--codecs",
        help="comma-separated candidates CODEC[:LEVEL][:FILTER][@cpu|@cuda] (default: zstd:1 and zstd:3 with both filters, plus every nvCOMP codec on a GPU)",
    )
    p.add_argument(
        "--portable", action="store_true", help="recommend only codecs with a CPU decoder (the file then loads anywhere)"
    )
    p.add_argument("--workers", type=int, help="CPU compression threads (default: every core)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per candidate; the fastest counts (default 2)")
    p.add_argument("--trust", action="store_true", help="load pickled Python objects in torch.save files (weights_only=False)")
    p.add_argument("--json", action="store_true", help="print every measurement and the recommended policy as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw ratio against compression throughput per codec (needs matplotlib)")
    p.add_argument(
        "--save-policy", metavar="FILE.json", help="write the recommended policy for `nvckpt compress --policy FILE.json`"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --save-policy: save it even from an unreliable run (a busy machine, a sample under "
        f"{_RELIABLE_SAMPLE_MB:g} MiB)",
    )
    p.set_defaults(func=run_bench)


# -- the rule ------------------------------------------------------------------------------
def write_seconds(raw_bytes: float, ratio: float, compress_gbps: float | None, storage_gbps: float) -> float:
    """Pipelined write time: the slower of compressing the raw bytes and storing the compressed ones."""
    compress_s = raw_bytes / (compress_gbps * _GB) if compress_gbps else 0.0
    return max(compress_s, raw_bytes / ratio / (storage_gbps * _GB))


def recommend(components: dict[str, Any], storage_gbps: float, portable: bool = False) -> dict[str, Any]:
    """The fastest write per component, and the totals of that choice.

    Args:
        components: ``{name: {"raw_bytes": int, "candidates": [{codec, level, filter, device, ratio,
            compress_gbps, ...}]}}`` as in ``bench --json``.
        storage_gbps: Storage write throughput.
        portable: Only consider codecs with a CPU decoder.

    Returns:
        ``{"choices": {name: candidate + write_s}, "ratio", "compress_gbps", "write_s", "raw_write_s"}``;
        ``compress_gbps`` is ``None`` when nothing is compressed.
    """
    choices: dict[str, Any] = {}
    total = stored = compress_s = write_s = 0.0
    for name, comp in components.items():
        raw = float(comp["raw_bytes"])
        options = [dict(_BASELINE)] + [c for c in comp["candidates"] if not (portable and c["codec"] in nc.GPU_ONLY_CODECS)]
        for c in options:
            c["write_s"] = write_seconds(raw, c["ratio"], c["compress_gbps"], storage_gbps)
        # Fastest write first; between equal times the smaller file (it is kept K times).
        best = min(options, key=lambda c: (round(c["write_s"], 9), -c["ratio"]))
        choices[name] = best
        total += raw
        stored += raw / best["ratio"]
        write_s += best["write_s"]
        if best["compress_gbps"]:
            compress_s += raw / (best["compress_gbps"] * _GB)
    return {
        "choices": choices,
        "ratio": total / stored if stored else 1.0,
        "compress_gbps": total / compress_s / _GB if compress_s else None,
        "write_s": write_s,
        "raw_write_s": total / (storage_gbps * _GB),
    }


def why_none(components: dict[str, Any], rec: dict[str, Any], storage_gbps: float, where: str) -> dict[str, str]:
    """Why each component whose measured codecs lost is recommended ``none``, in one sentence.

    A pipelined compressed write takes max(raw / codec speed, stored / storage speed), so with a
    ratio above 1 it beats writing raw exactly when the codec is faster than the storage: the
    fastest codec's speed is the storage speed below which compression starts to pay.
    """
    out: dict[str, str] = {}
    for name, comp in components.items():
        chosen = rec["choices"][name]
        shrinking = [c for c in comp["candidates"] if c["ratio"] > 1.0 and c["compress_gbps"]]
        if chosen["codec"] != "none" or not comp["candidates"]:
            continue
        if not shrinking:
            out[name] = f"{name}: none, because no codec made it smaller"
            continue
        fastest = max(shrinking, key=lambda c: c["compress_gbps"])
        raw_s = write_seconds(comp["raw_bytes"], 1.0, None, storage_gbps)
        codec_s = write_seconds(comp["raw_bytes"], fastest["ratio"], fastest["compress_gbps"], storage_gbps)
        out[name] = (
            f"{name}: none, because the fastest codec ({_label(fastest)}, {fastest['compress_gbps']:.3g} GB/s on "
            f"{where}) is slower than the storage ({storage_gbps:g} GB/s): {codec_s:.3g} s to compress it against "
            f"{raw_s:.3g} s to write it raw. Compression pays off on storage slower than "
            f"{fastest['compress_gbps']:.3g} GB/s, or on a machine with more cores or a GPU (nvCOMP)."
        )
    return out


def _policy_for(choices: dict[str, Any]) -> nc.CodecPolicy:
    specs: dict[str, Any] = {}
    for name, c in choices.items():
        if name in {comp.value for comp in nc.Component}:
            specs[name] = nc.CodecSpec(codec=c["codec"], level=c["level"], filter=c["filter"])
    return nc.CodecPolicy(**specs)


# -- sampling ------------------------------------------------------------------------------
def _open_all(path: str, trust: bool) -> list[Source]:
    kind = sniff(path)
    if kind == DIRECTORY:
        sources = []
        for rel, k in dir_files(path):
            if k in (NVCOMP, TORCH, SAFETENSORS):
                src = open_source(os.path.join(path, rel), trust=trust)
                try:
                    src.tensors()  # torch.save files load lazily: refuse them here, not halfway
                except UnsafeCheckpointError:
                    src.close()
                    continue  # rng_state.pth, training_args.bin: pickles without tensors worth measuring
                sources.append(src)
        if not sources:
            raise FormatError(f"{path}: holds no checkpoint files to measure")
        return sources
    if kind == OTHER:
        raise FormatError(f"{path}: not a checkpoint nvckpt reads")
    return [open_source(path, trust=trust)]


def _sample(items: list[tuple[Source, TensorInfo]], budget: int) -> list[torch.Tensor]:
    """Up to ``budget`` bytes of the component: a piece from the middle of each of many tensors.

    Tensors are visited in a low-discrepancy order (golden-ratio stride), so a sample of a few
    tensors still spans the whole model, first layers to last. Tensors the default policy
    stores raw (under 2 KiB) are left out: they say nothing about codecs.
    """
    items = [it for it in items if it[1].raw_bytes >= _MIN_TENSOR_BYTES]
    if not items:
        return []
    if sum(t.raw_bytes for _, t in items) <= budget:
        return [src.read(t.key).detach().reshape(-1).clone() for src, t in items]
    order = sorted(range(len(items)), key=lambda i: (i * 0.6180339887498949) % 1.0)
    take: dict[int, int] = {}
    collected = 0
    for i in order:
        if collected >= budget:
            break
        n = min(_PIECE_BYTES, items[i][1].raw_bytes, budget - collected)
        take[i] = n
        collected += n
    pieces = []
    for i in sorted(take):
        src, info = items[i]
        flat = src.read(info.key).detach().reshape(-1)
        count = max(1, take[i] // flat.element_size())
        start = max(0, (flat.numel() - count) // 2)
        pieces.append(flat[start : start + count].clone())
    return pieces


# -- measuring -----------------------------------------------------------------------------
def default_candidates() -> list[tuple[nc.CodecSpec, str]]:
    """``(spec, device)`` pairs worth measuring on this machine."""
    # rotplane at level 1 only: it is the default's filter for weights and second moments, and the
    # level changes little between the two plane filters.
    out = [(nc.CodecSpec("zstd", level, filt), "cpu") for level in (1, 3) for filt in ("byteplane", "none")]
    out.insert(1, (nc.CodecSpec("zstd", 1, "rotplane"), "cpu"))
    if nc.gpu_available():
        for codec in ("zstd",) + tuple(nc.GPU_ONLY_CODECS):
            for filt in ("byteplane", "rotplane", "none"):
                out.append((nc.CodecSpec(codec, 1 if codec == "zstd" else None, filt), "cuda"))
    return out


def _parse_candidates(text: str) -> list[tuple[nc.CodecSpec, str]]:
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        text_spec, _, device = part.strip().partition("@")
        spec = _policy.parse_spec(text_spec)
        if spec.codec == "none":
            continue  # always measured: it is the baseline
        device = device.strip().lower() or ("cuda" if nc.gpu_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise CheckpointError(f"--codecs {part.strip()!r}: device must be @cpu or @cuda")
        if device == "cuda" or spec.codec in nc.GPU_ONLY_CODECS:
            _policy.check_policy_runs_here(nc.CodecPolicy.uniform(spec, device="cuda"))
            device = "cuda"
        out.append((spec, device))
    if not out:
        raise CheckpointError(f"--codecs {text!r}: no codec to measure")
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(pieces: Sequence[torch.Tensor], spec: nc.CodecSpec, device: str, workers: int | None, repeat: int) -> dict[str, Any]:
    import fsspec

    tree = {f"s{i}": p.to(device) for i, p in enumerate(pieces)}
    raw = sum(p.numel() * p.element_size() for p in pieces)
    policy = nc.CodecPolicy.uniform(spec, device="auto")
    fs = fsspec.filesystem("memory")
    url = f"memory://nvckpt-bench-{uuid.uuid4().hex}/sample.nvc"
    best_c = best_d = float("inf")
    stored = raw
    try:
        if device == "cuda":  # first nvCOMP call pays for setup; keep it out of the timing
            nc.save({"w": tree["s0"]}, url, policy)
        for _ in range(max(1, repeat)):
            _sync(device)
            t0 = time.perf_counter()
            report = nc.save(tree, url, policy, workers=workers)
            _sync(device)
            best_c = min(best_c, time.perf_counter() - t0)
            stored = sum(c.stored_bytes for c in report.components.values())
            t0 = time.perf_counter()
            nc.load(url, map_location=device)
            _sync(device)
            best_d = min(best_d, time.perf_counter() - t0)
    finally:
        if fs.exists(url):
            fs.rm(url)
    return {
        "codec": spec.codec,
        "level": spec.level,
        "filter": spec.filter,
        "device": device,
        "sample_bytes": raw,
        "stored_bytes": stored,
        "ratio": raw / stored if stored else 1.0,
        "compress_gbps": raw / best_c / _GB,
        "decompress_gbps": raw / best_d / _GB,
    }


def _label(c: dict[str, Any]) -> str:
    level = f":{c['level']}" if c["level"] is not None else ""
    return f"{c['codec']}{level}/{c['filter']}" + (f"@{c['device']}" if c["device"] not in ("-", "cpu") else "")


def _plot(path: str, components: dict[str, Any], storage_gbps: float) -> None:
    fig = plot_figure(components, storage_gbps)
    import matplotlib.pyplot as plt  # imported (and the backend chosen) by plot_figure

    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_figure(components: dict[str, Any], storage_gbps: float) -> Any:
    """The ``--plot`` figure: ratio against compression speed, one marker per component."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError as exc:
        raise CheckpointError("--plot needs matplotlib: `pip install matplotlib`") from exc
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    labels = sorted({_label(c) for comp in components.values() for c in comp["candidates"]})
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(9, 5))
    speeds = [storage_gbps]
    measured = {name: comp for name, comp in components.items() if comp["candidates"]}
    for m, (name, comp) in zip(itertools.cycle(markers), measured.items()):
        for c in comp["candidates"]:
            ax.scatter(c["compress_gbps"], c["ratio"], marker=m, color=colors[_label(c)], s=50)
            speeds.append(c["compress_gbps"])
        ax.scatter([], [], marker=m, color="gray", label=name)
    for lab in labels:
        ax.scatter([], [], marker="s", color=colors[lab], label=lab)
    ax.axvline(storage_gbps, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(min(speeds) / 1.5, max(speeds) * 1.5)
    # Labels at 1-2-5 steps in plain numbers: matplotlib's default labels every minor tick of a
    # short log axis as 2x10^-1, 3x10^-1 ..., which run into each other.
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.text(
        storage_gbps,
        0.98,
        f"storage {storage_gbps:g} GB/s ",
        transform=ax.get_xaxis_transform(),
        rotation=90,
        ha="right",
        va="top",
        fontsize=8,
    )
    ax.set_xlabel("compression throughput (GB/s, this machine); right of the dashed line a codec outruns the storage")
    ax.set_ylabel("ratio (raw / stored)")
    ax.set_title("nvckpt bench: ratio against throughput per codec and component")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def unreliable(sample_bytes: int, cores: int) -> list[str]:
    """Why throughputs measured now would mislead (empty: none known).

    A machine whose other work fills its cores measures a fraction of its speed (0.005-0.03 GB/s
    seen on a shared 2-core machine, against 0.3-0.9 idle), and so recommends ``none`` everywhere.
    """
    reasons = []
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        load = 0.0
    if load >= cores:
        reasons.append(
            f"this machine is busy (load average {load:.1f} on {cores} cores): throughputs are measured low, "
            "and so is the storage speed below which compression pays; rerun when it is idle"
        )
    if sample_bytes < _RELIABLE_SAMPLE_MB * (1 << 20):
        reasons.append(
            f"the sample is small ({sample_bytes / (1 << 20):.2g} MiB of the largest component): throughputs are "
            f"mostly start-up costs; use --sample-mb {_RELIABLE_SAMPLE_MB:g} or more"
        )
    return reasons


def _refuse_to_save_from(reasons: list[str], args: argparse.Namespace) -> None:
    if reasons and args.save_policy and not args.force:
        raise CheckpointError(
            f"--save-policy {args.save_policy}: not written, the measurement is unreliable: {'; '.join(reasons)} "
            "(--force writes it anyway)"
        )


def run_bench(args: argparse.Namespace) -> int:
    if not (args.storage_gbps > 0):
        raise CheckpointError(f"--storage-gbps must be positive, got {args.storage_gbps}")
    if not (args.sample_mb > 0):
        raise CheckpointError(f"--sample-mb must be positive, got {args.sample_mb}")
    check_workers(args.workers)
    candidates = _parse_candidates(args.codecs) if args.codecs else default_candidates()
    reporter = Reporter(args.quiet)
    sources = _open_all(args.path, args.trust)
    budget = int(args.sample_mb * (1 << 20))
    try:
        reporter.start(f"reading {os.path.basename(args.path.rstrip('/'))}")
        by_comp: dict[str, list[tuple[Source, TensorInfo]]] = {}
        for src in sources:
            for t in src.tensors():
                by_comp.setdefault(t.component, []).append((src, t))
        order = [c.value for c in nc.Component]
        by_comp = {k: by_comp[k] for k in sorted(by_comp, key=lambda k: order.index(k) if k in order else len(order))}
        samples = {name: _sample(items, budget) for name, items in by_comp.items()}
    finally:
        reporter.stop()
        for src in sources:
            src.close()
    if not any(samples.values()):
        raise FormatError(f"{args.path}: holds no tensors large enough to measure (2 KiB or more)")
    # Checked before measuring: a refused --save-policy costs the user no wait.
    largest = max(sum(p.numel() * p.element_size() for p in v) for v in samples.values())
    warnings = unreliable(largest, _cores())
    _refuse_to_save_from(warnings, args)
    if not args.quiet:  # on stderr: stdout stays the result
        for why in warnings:
            stderr_console().print(f"nvckpt bench: warning: {why}", markup=False, highlight=False, soft_wrap=True)
    work = sum(p.numel() * p.element_size() for v in samples.values() for p in v) * len(candidates)
    task = reporter.start("measuring codecs", work)
    components: dict[str, Any] = {}
    try:
        for name, pieces in samples.items():
            sample_raw = sum(p.numel() * p.element_size() for p in pieces)
            cands = []
            for spec, device in candidates if pieces else []:  # nothing over 2 KiB: stored raw
                task.describe(f"{name}: {spec.codec}:{spec.level}/{spec.filter}@{device}")
                cands.append(_measure(pieces, spec, device, args.workers, args.repeat))
                task.advance(sample_raw)
            components[name] = {
                "raw_bytes": sum(t.raw_bytes for _, t in by_comp[name]),
                "tensors": len(by_comp[name]),
                "sampled_bytes": sample_raw,
                "candidates": cands,
            }
    finally:
        reporter.stop()

    rec = recommend(components, args.storage_gbps, args.portable)
    policy = _policy_for(rec["choices"])
    workers = args.workers or _cores()
    gpu = torch.cuda.get_device_name() if nc.gpu_available() else None
    reasons = why_none(components, rec, args.storage_gbps, f"{workers} CPU threads" + (f" and {gpu}" if gpu else ""))
    result = {
        "nvckpt": "bench",
        "path": args.path,
        "storage_gbps": args.storage_gbps,
        "workers": workers,
        "gpu": gpu,
        "plane_kernels": KERNELS,
        "components": components,
        "recommended": {
            "choices": {
                k: {kk: v[kk] for kk in ("codec", "level", "filter", "device", "ratio", "compress_gbps", "write_s")}
                for k, v in rec["choices"].items()
            },
            "ratio": rec["ratio"],
            "compress_gbps": rec["compress_gbps"],
            "write_s": rec["write_s"],
            "raw_write_s": rec["raw_write_s"],
            "why_none": reasons,
        },
        "recommended_policy": policy.to_dict(),
        "unreliable": warnings,
    }
    if args.save_policy:
        import json

        with open(args.save_policy, "w", encoding="utf-8") as f:
            json.dump(policy.to_dict(), f, indent=2)
    if args.plot:
        _plot(args.plot, components, args.storage_gbps)
        result["plot"] = os.path.abspath(args.plot)
        if not args.quiet:  # on stderr: stdout stays the result (--json | jq)
            stderr_console().print(f"plot written to {result['plot']}", markup=False, highlight=False, soft_wrap=True)
    if args.json:
        print_json(result)
        return EXIT_OK

    console = stdout_console()
    rows = []
    for name, comp in components.items():
        chosen = rec["choices"][name]
        for c in [dict(_BASELINE, write_s=write_seconds(comp["raw_bytes"], 1.0, None, args.storage_gbps))] + comp["candidates"]:
            mark = (
                "*"
                if (c["codec"], c["level"], c["filter"], c["device"])
                == (chosen["codec"], chosen["level"], chosen["filter"], chosen["device"])
                else ""
            )
            rows.append(
                [
                    name,
                    _label(c),
                    f"{c['ratio']:.3f}x",
                    gbps(c["compress_gbps"]),
                    gbps(c["decompress_gbps"]),
                    f"{write_seconds(comp['raw_bytes'], c['ratio'], c['compress_gbps'], args.storage_gbps):.3g}",
                    mark,
                ]
            )
    console.print(
        make_table(
            f"{args.path}: {result['workers']} CPU threads"
            + (f", GPU {result['gpu']}" if result["gpu"] else ", no GPU")
            + f", {KERNELS} byte planes"
            + f"; write s = whole component at {args.storage_gbps:g} GB/s storage",
            ["component", "codec/filter", "ratio", "compress GB/s", "decompress GB/s", "write s", "best"],
            rows,
            numeric_from=2,
        )
    )
    spec_text = ", ".join(f"{k}={_label(v)}" for k, v in rec["choices"].items())
    console.print(
        f"recommended at {args.storage_gbps:g} GB/s: {spec_text}\n"
        f"write {rec['write_s']:.3g} s instead of {rec['raw_write_s']:.3g} s uncompressed, ratio {rec['ratio']:.3f}x"
        + (
            f", {args.save_policy} written" if args.save_policy else " (--save-policy FILE.json keeps it for `compress --policy`)"
        ),
        markup=False,
        highlight=False,
    )
    for reason in reasons.values():
        console.print(reason, markup=False, highlight=False)
    if KERNELS != "compiled":
        console.print(
            "note: byte planes are split and joined by numpy here (no C compiler at install, or NVCOMP_CHECKPOINT_PURE_PYTHON"
            " set): loads are slower than with the compiled kernel; reinstall with a C compiler (cc) on the PATH",
            markup=False,
            highlight=False,
        )
    if any(v["codec"] in nc.GPU_ONLY_CODECS for v in rec["choices"].values()):
        console.print(
            "note: the recommended policy uses a GPU-only codec: such files load only on a CUDA machine (--portable avoids it)",
            markup=False,
            highlight=False,
        )
    return EXIT_OK
