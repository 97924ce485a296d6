"""How far can any lossless coder go on these checkpoints? The strongest general coders, per byte plane.

Run ``python benchmarks/bench_bound.py`` (about 10 minutes on 2 cores). For every checkpoint of
``bench_checkpoint.py``, every tensor is split into byte planes as nvcomp-checkpoint splits it,
and every plane is compressed with the strongest general-purpose coders at hand: xz (LZMA2,
``-9e``, which models literals in context) and zstd ``-19`` with long-distance matching; the
smaller of the two is kept for each plane, or the raw plane when neither shrinks it. The sum is
what a format that picked, plane by plane, the best of those coders at their slowest settings
would store. It is compared with ``zstd -1`` on the ``torch.save`` file (the bar of issue 2:
1.15x its ratio) and with nvcomp-checkpoint's default save.

The point of the table: if even this bound stays under 1.15x, no setting of a byte-wise coder
reaches the target on this checkpoint, and what is left is the structure a single checkpoint
does not hold (the previous checkpoint as a reference, for instance).
"""

from __future__ import annotations

import argparse
import io
import lzma
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import methods  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.filters import ByteplaneFilter, plane_width  # noqa: E402
from nvcomp_checkpoint.report import format_table  # noqa: E402

__all__ = ["main"]

_XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def _best_coded(plane: bytes) -> tuple[int, int, int]:
    """(xz -9e bytes, zstd -19 --long bytes, best of those and raw) for one plane."""
    xz = len(lzma.compress(plane, format=lzma.FORMAT_RAW, filters=_XZ_FILTERS))
    params = zstandard.ZstdCompressionParameters.from_level(19, enable_ldm=True, window_log=27)
    zs = len(zstandard.ZstdCompressor(compression_params=params).compress(plane))
    return xz, zs, min(xz, zs, len(plane))


def _planes(obj: Any) -> list[tuple[str, bytes]]:
    """(component, plane bytes) of every tensor; planes of one component and index are joined."""
    joined: dict[tuple[str, int], io.BytesIO] = {}

    def add(path: tuple[str, ...], t: torch.Tensor) -> None:
        comp = nc.classify(path).value
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        if not data.nbytes:
            return
        for i, plane in enumerate(ByteplaneFilter(plane_width(t.dtype)).split(data)):
            joined.setdefault((comp, i), io.BytesIO()).write(plane.tobytes())

    methods.map_tensors(obj, add)
    return [(comp, buf.getvalue()) for (comp, _i), buf in sorted(joined.items())]


def _zstd_cli_bytes(path: Path) -> int:
    proc = subprocess.run(["zstd", "-q", "-T0", "-1", "-c", str(path)], check=True, capture_output=True)
    return len(proc.stdout)


def measure(ckpt: str, workers: int) -> dict[str, Any]:
    obj = checkpoints.load_cached(ckpt)
    planes = _planes(obj)
    raw = sum(len(p) for _c, p in planes)
    with ProcessPoolExecutor(workers) as pool:
        coded = list(pool.map(_best_coded, [p for _c, p in planes]))
    per_comp: dict[str, dict[str, int]] = {}
    for (comp, plane), (xz, zs, best) in zip(planes, coded):
        a = per_comp.setdefault(comp, {"raw": 0, "xz": 0, "zstd19": 0, "best": 0})
        a["raw"] += len(plane)
        a["xz"] += min(xz, len(plane))
        a["zstd19"] += min(zs, len(plane))
        a["best"] += best
    with tempfile.TemporaryDirectory() as tmp:
        ours = nc.save(obj, Path(tmp) / "ckpt.nvc").stored_bytes
    return {
        "raw": raw,
        "zstd1_file": _zstd_cli_bytes(checkpoints.checkpoint_path(ckpt)),
        "ours": ours,
        "components": per_comp,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", default=list(checkpoints.CHECKPOINTS), choices=list(checkpoints.CHECKPOINTS))
    parser.add_argument("--workers", type=int, default=2, help="processes compressing planes (default 2)")
    args = parser.parse_args(argv)
    rows, comp_rows = [], []
    for ckpt in args.checkpoints:
        started = time.perf_counter()
        r = measure(ckpt, args.workers)
        best = sum(a["best"] for a in r["components"].values())
        z1 = r["raw"] / r["zstd1_file"]
        rows.append(
            [
                ckpt,
                f"{r['raw'] / 1e6:.1f}",
                f"{z1:.3f}",
                f"{1.15 * z1:.3f}",
                f"{r['raw'] / r['ours']:.3f} ({r['raw'] / r['ours'] / z1:.3f}x)",
                f"{r['raw'] / best:.3f} ({r['raw'] / best / z1:.3f}x)",
            ]
        )
        for comp, a in r["components"].items():
            comp_rows.append(
                [
                    ckpt,
                    comp,
                    f"{a['raw'] / 1e6:.1f}",
                    f"{a['raw'] / a['xz']:.3f}",
                    f"{a['raw'] / a['zstd19']:.3f}",
                    f"{a['raw'] / a['best']:.3f}",
                ]
            )
        print(f"[{time.perf_counter() - started:5.0f}s] {ckpt} done", flush=True)
    print()
    print(
        format_table(
            [
                "checkpoint",
                "tensor MB",
                "zstd -1 on torch.save file",
                "1.15x of that (target)",
                "nvcomp-checkpoint (x zstd -1)",
                "best of xz -9e / zstd -19 per plane (x zstd -1)",
            ],
            rows,
        )
    )
    print()
    print(
        format_table(
            ["checkpoint", "component", "raw MB", "xz -9e per plane", "zstd -19 --long per plane", "best per plane"], comp_rows
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
