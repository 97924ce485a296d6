"""The load's byte-plane un-split against the alternatives at hand, one thread, in one run.

    PYTHONPATH=src python benchmarks/bench_unsplit.py [--mib 64]

Joins the 4 byte planes of float32 data back into elements with ours (``ByteplaneFilter.join``: the
compiled one-pass kernel when it is built, and its numpy fallback: widen, shift and OR in blocks), with
and without the exponent rotation, a strided write per plane, ``np.stack(axis=1)``, and, when installed,
``numcodecs.Shuffle.decode`` (compiled). Prints GB/s (min of 7) and checks every result bit for bit.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

from nvcomp_checkpoint.filters import KERNELS, ByteplaneFilter, RotatedByteplaneFilter


def _best(fn: Callable[[], object], nbytes: int, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return nbytes / min(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="float32 data size in MiB")
    args = parser.parse_args()
    n = args.mib * 1024 * 1024 // 4
    data = np.random.default_rng(0).standard_normal(n).astype(np.float32).view(np.uint8)
    planes = ByteplaneFilter(4).split(data)
    out = np.empty_like(data)

    rotated = RotatedByteplaneFilter(4, 1)
    rotated_planes = rotated.split(data)

    def ours() -> None:
        ByteplaneFilter(4).join(out, planes)

    def ours_numpy() -> None:
        ByteplaneFilter(4)._join_numpy(out, planes)

    def ours_rotated() -> None:
        rotated.join(out, rotated_planes)

    def ours_rotated_numpy() -> None:
        rotated._join_numpy(out, rotated_planes)

    def strided() -> None:
        view = out.reshape(-1, 4)
        for p, src in enumerate(planes):
            view[:, p] = src

    def stacked() -> None:
        np.stack(planes, axis=1, out=out.reshape(-1, 4))

    candidates: list[tuple[str, Callable[[], object]]] = [(f"ours ({KERNELS})", ours), ("ours (numpy)", ours_numpy)]
    candidates += [(f"ours, rotated ({KERNELS})", ours_rotated), ("ours, rotated (numpy)", ours_rotated_numpy)]
    candidates += [("strided", strided), ("np.stack", stacked)]
    try:
        from numcodecs import Shuffle

        shuffled, shuffle = np.concatenate(planes), Shuffle(elementsize=4)
        candidates.append(("numcodecs", lambda: shuffle.decode(shuffled)))
    except ImportError:
        print("numcodecs is not installed: its Shuffle is left out")
    for name, fn in candidates:
        speed = _best(fn, data.nbytes)
        result = fn()
        joined = out if result is None else np.frombuffer(result, dtype=np.uint8)
        assert np.array_equal(joined, data), name
        print(f"{name:28s} {speed:5.2f} GB/s")


if __name__ == "__main__":
    main()
