"""Thread pools for compression and decompression, that still work while the interpreter exits.

Once Python has begun to shut down (``atexit`` handlers, non-daemon threads finishing),
``ThreadPoolExecutor`` refuses new work; a save or load made then runs its jobs in the calling
thread instead of failing, as ``torch.save`` and ``torch.load`` work there too.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["worker_pool", "is_inline", "default_workers", "GPU_BATCH_BYTES"]

#: Raw bytes handed to nvCOMP per batch (by the writer; the reader groups GPU decodes alike):
#: large enough to fill the GPU, small enough to bound the compressed bytes held on the device per job.
GPU_BATCH_BYTES = 64 << 20


def default_workers() -> int:
    """Compression threads: every core (zstd releases the GIL), at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)))


class _InlineExecutor(Executor):
    """Runs each job when it is submitted; its future is done on return."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            fut.set_exception(exc)
        return fut


def worker_pool(workers: int, name: str) -> Executor:
    """A pool of ``workers`` threads, or an inline executor once the interpreter is exiting.

    Use it as a context manager, as ``ThreadPoolExecutor``.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    try:
        pool.submit(int).result()
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        pool.shutdown(wait=False)
        return _InlineExecutor()
    return pool


def is_inline(pool: Executor) -> bool:
    """True for the executor :func:`worker_pool` returns while the interpreter exits."""
    return isinstance(pool, _InlineExecutor)
