"""A tier's configuration and its copy schedule, and calls bounded by a deadline."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from ..credentials import StorageOptions
from ..deadline import Deadline
from ..storage import is_url

__all__ = ["Tier", "copy_due", "run_within", "CLOSE_TIMEOUT_S", "RESTORE_TIMEOUT_S", "COPY_NICE"]

#: How much nicer than the process a copy thread runs (Linux schedules threads by their own nice value).
COPY_NICE = 10
#: Default seconds :meth:`CheckpointManager.restore` (and ``locate``, ``resume_path``) waits for the tiers'
#: listings; a tier not listed by then is unavailable (never taken for an empty one).
RESTORE_TIMEOUT_S = 120.0
#: Default seconds :meth:`CheckpointManager.wait` and :meth:`~CheckpointManager.close` wait for saves and copies.
CLOSE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Tier:
    """One place checkpoints are kept, with its schedule and retention.

    Args:
        url: A local folder or an fsspec URL (``s3://bucket/run1``); steps are stored under it.
        every_steps: A copy is due for every step that is a multiple of this.
        every_minutes: A copy is due once this many minutes passed since the last copy.
            With neither, every save is copied. Tier 0 takes every save and accepts neither.
            Either way, :meth:`CheckpointManager.close` copies the run's newest step to a tier
            whose schedule skipped it.
        keep: Newest steps kept (``None``: all).
        keep_every_steps: Also keep every step that is a multiple of this.
        name: Label in logs, metrics and ``nvckpt ls`` (default ``tier{i}``).
        storage_options: fsspec options (endpoint, credentials ...): kept as
            :class:`~nvcomp_checkpoint.credentials.StorageOptions`, whose ``repr`` and ``str`` show credentials as ``***``.
        part_size: Multipart upload part size on object stores (memory per upload in flight).
        retries: Attempts of a failed copy after the first.
        backoff_s: Wait before the first retry; doubled for each further one.
        max_queued: Copies waiting for this tier beyond the one running; a due copy that
            finds the queue full is skipped with a warning (training never waits for a copy).
        upload_concurrency: Parts uploaded at once from a local tier to an object store
            (memory in flight: ``part_size * upload_concurrency``).
    """

    url: str
    every_steps: int | None = None
    every_minutes: float | None = None
    keep: int | None = None
    keep_every_steps: int | None = None
    name: str | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False)
    part_size: int = 100 << 20
    retries: int = 3
    backoff_s: float = 1.0
    max_queued: int = 1
    upload_concurrency: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", os.fspath(self.url).rstrip("/") or "/")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(
                f"Tier({self.url!r}): storage_options must be a dict of fsspec options, got {type(self.storage_options).__name__}"
            )
        object.__setattr__(self, "storage_options", StorageOptions.of(self.storage_options))
        for name in ("every_steps", "keep", "keep_every_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Tier({self.url!r}): {name} must be a positive integer or None, got {value!r}")
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ValueError(f"Tier({self.url!r}): every_minutes must be positive or None, got {self.every_minutes!r}")
        if self.part_size < 5 << 20:
            raise ValueError(f"Tier({self.url!r}): part_size must be at least 5 MiB (S3's smallest part), got {self.part_size}")
        if self.retries < 0 or self.backoff_s < 0 or self.max_queued < 1 or self.upload_concurrency < 1:
            raise ValueError(f"Tier({self.url!r}): retries and backoff_s must be >= 0, max_queued and upload_concurrency >= 1")

    def write_options(self) -> dict[str, Any] | None:
        """The fsspec options for writing: the part size as the object store's block size.

        Reads use ``storage_options`` as given: a 100 MB block would make every small read
        (a footer, a manifest) fetch that much.
        """
        if not is_url(self.url):
            return self.storage_options
        return StorageOptions({"default_block_size": self.part_size, **(self.storage_options or {})})


_K = TypeVar("_K")


def run_within(calls: dict[_K, Callable[[], Any]], deadline: Deadline, name: str) -> dict[_K, tuple[Any, BaseException | None]]:
    """Run each call on a daemon thread of its own; ``(result, exception)`` of those that returned by the deadline.

    A call still running then is left out and left to finish on its own: a storage client whose
    own retries cannot be bounded (s3fs retries a read timeout for minutes) never holds the caller
    past the deadline, and the thread, a daemon, never holds the process at exit.
    """
    results: dict[_K, tuple[Any, BaseException | None]] = {}
    done = threading.Condition()

    def run(key: _K, fn: Callable[[], Any]) -> None:
        try:
            out: tuple[Any, BaseException | None] = (fn(), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out = (None, exc)
        with done:
            results[key] = out
            done.notify_all()

    for key, fn in calls.items():
        threading.Thread(target=run, args=(key, fn), name=f"nvckpt-{name}", daemon=True).start()
    with done:
        while len(results) < len(calls):
            left = deadline.left()
            if left == 0:
                break
            done.wait(left)
        return dict(results)


def copy_due(tier: Tier, last_step: int | None, last_time: float | None, step: int, now: float) -> bool:
    """Whether ``tier`` gets a copy of ``step`` (its last copy: ``last_step`` at monotonic ``last_time``)."""
    if last_step is not None and step <= last_step:
        return True  # a run resumed from an older step: its first save replaces the tier's newer ones
    if tier.every_steps is None and tier.every_minutes is None:
        return True
    if tier.every_steps is not None and step % tier.every_steps == 0:
        return True
    return tier.every_minutes is not None and (last_time is None or now - last_time >= tier.every_minutes * 60)
