"""The load's byte-plane un-split against the alternatives at hand, one thread, in one run.

    PYTHONPATH=src python benchmarks/bench_unsplit.py [--mib 64]

Joins the 4 byte planes of float32 data back into elements with ours (``ByteplaneFilter.join``:
widen, shift and OR in blocks), a strided write per plane, ``np.stack(axis=1)``, and, when installed,
``numcodecs.Shuffle.decode`` (compiled). Prints GB/s (min of 7) and checks every result bit for bit.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

from nvcomp_checkpoint.filters import ByteplaneFilter


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

    def ours() -> None:
        ByteplaneFilter(4).join(out, planes)

    def strided() -> None:
        view = out.reshape(-1, 4)
        for p, src in enumerate(planes):
            view[:, p] = src

    def stacked() -> None:
        np.stack(planes, axis=1, out=out.reshape(-1, 4))

    candidates: list[tuple[str, Callable[[], object]]] = [("ours", ours), ("strided", strided), ("np.stack", stacked)]
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
        print(f"{name:10s} {speed:5.2f} GB/s")


if __name__ == "__main__":
    main()
