"""Where a save's wall time goes: each part of ``nc.save`` timed in the thread that runs it.

On ``moe`` with bf16 weights (as bench_limits.py), repeated saves over the same file; for the
fastest save it prints, per thread (the caller, the compression workers, the writer) and per
part (the plane split, zstd, the writes, ``sync_file_range``, the fsyncs, the rename), the wall
time spent in it and its thread CPU time (``time.thread_time``), and how busy the workers were
between their first job and their last. Patching adds a few microseconds per call.

    PYTHONPATH=src python benchmarks/profile_save.py               # 2 workers, 5 saves
    PYTHONPATH=src python benchmarks/profile_save.py --workers 1 --saves 9
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_limits  # noqa: E402  (benchmarks/ is not a package)
import checkpoints  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint import storage, writer  # noqa: E402
from nvcomp_checkpoint.codecs import cpu  # noqa: E402
from nvcomp_checkpoint.filters import byteplane, rotate  # noqa: E402

#: (thread, part, start, end, thread CPU s) of every timed call of the current save.
EVENTS: list[tuple[str, str, float, float, float]] = []
#: Parts being timed in each thread: a call inside another of the same part (a rotated split
#: that calls the plain one) is counted once.
_ACTIVE = threading.local()


def timed(owner: Any, name: str, part: str) -> None:
    """Replace ``owner.name`` with a wrapper that records each call in :data:`EVENTS`."""
    real = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.__dict__.setdefault("parts", set())
        if part in active:
            return real(*args, **kwargs)
        active.add(part)
        wall, cpu_s = time.perf_counter(), time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            active.discard(part)
            thread = threading.current_thread().name.split("_")[0]
            EVENTS.append((thread, part, wall, time.perf_counter(), time.thread_time() - cpu_s))

    setattr(owner, name, call)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--saves", type=int, default=5)
    args = p.parse_args(argv)
    timed(writer, "_cpu_job", "compression job")
    timed(byteplane.ByteplaneFilter, "split", "plane split")
    timed(rotate.RotatedByteplaneFilter, "split", "plane split")
    timed(cpu.ZstdCpuCodec, "encode", "zstd")
    timed(writer.CheckpointWriter, "_write", "write")
    timed(writer.CheckpointWriter, "_compress_and_write", "compressing and writing")
    timed(os, "fsync", "fsync")
    timed(os, "replace", "rename")
    if storage._SYNC_FILE_RANGE is not None:
        timed(storage, "_SYNC_FILE_RANGE", "sync_file_range")
    state = bench_limits.bf16_weights(checkpoints.load_cached("moe"))
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    best: tuple[float, float, float, list[tuple[str, str, float, float, float]]] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe.nvc"
        nc.save(state, path, workers=args.workers)  # warm-up; every save below replaces a file
        for _ in range(args.saves):
            EVENTS.clear()
            start, cpu_s = time.perf_counter(), time.process_time()
            nc.save(state, path, workers=args.workers)
            wall = time.perf_counter() - start
            if best is None or wall < best[0]:
                best = (wall, time.process_time() - cpu_s, start, list(EVENTS))
    assert best is not None
    wall, cpu_s, start, events = best
    print(f"fastest of {args.saves} saves: {wall:.3f} s wall, {cpu_s:.3f} s CPU (process), {args.workers} workers\n")
    print("| thread | part | calls | wall s | CPU s |\n|---|---|---|---|---|")
    parts: dict[tuple[str, str], list[float]] = {}
    for thread, part, a, b, c in events:
        got = parts.setdefault((thread, part), [0, 0.0, 0.0])
        got[0] += 1
        got[1] += b - a
        got[2] += c
    for (thread, part), (n, w, c) in sorted(parts.items()):
        print(f"| {thread} | {part} | {n:.0f} | {w:.3f} | {c:.3f} |")
    jobs = [(a, b, c) for thread, part, a, b, c in events if part == "compression job"]
    if jobs:
        span = max(b for _, b, _ in jobs) - min(a for a, _, _ in jobs)
        in_job = sum(b - a for a, b, _ in jobs)
        on_cpu = sum(c for _, _, c in jobs)
        print(
            f"\nworkers: in a job {in_job:.3f} s of the {args.workers * span:.3f} s they had "
            f"({in_job / (args.workers * span):.0%}), on a CPU {on_cpu:.3f} s of it"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
