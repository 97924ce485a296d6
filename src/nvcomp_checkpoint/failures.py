"""Failures of background work, each reported exactly once: the oldest raised, the others logged.

One class for every background saver (``AsyncSaver``, ``SaveSequence``, ``CheckpointManager``), so
that "raise the oldest once, log the rest" is written once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Failure", "FailureLog"]

_LOG = logging.getLogger("nvcomp_checkpoint")


@dataclass(frozen=True)
class Failure:
    """One failure nobody has been told of yet.

    Attributes:
        error: The exception.
        key: What it is about, for :meth:`FailureLog.take` by key (a file's path key), or None.
        source: The object that failed (a save handle, a group): reported through it, it is forgotten here.
        what: Names the work in the log line when it is logged instead of raised.
    """

    error: BaseException
    key: str | None = None
    source: Any = None
    what: str = "a checkpoint save failed"


class FailureLog:
    """The failures of one background saver, oldest first, each reported once (raised or logged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: list[Failure] = []

    def record(
        self, error: BaseException, *, key: str | None = None, source: Any = None, what: str = "a checkpoint save failed"
    ) -> None:
        with self._lock:
            self._failed.append(Failure(error, key, source, what))

    def forget(self, source: Any) -> None:
        """The failure of ``source`` was reported through it (its ``result()``): not again here."""
        with self._lock:
            self._failed = [f for f in self._failed if f.source is not source]

    def has(self, key: str | None = None) -> bool:
        with self._lock:
            return any(key is None or f.key == key for f in self._failed)

    def oldest(self) -> Failure | None:
        with self._lock:
            return self._failed[0] if self._failed else None

    def take(self, key: str | None = None) -> list[Failure]:
        """The failures (about ``key``, if given), oldest first; they are reported by whoever takes them."""
        with self._lock:
            taken = [f for f in self._failed if key is None or f.key == key]
            self._failed = [f for f in self._failed if f not in taken]
        return taken

    def raise_oldest(self, key: str | None = None, *, wrap: Callable[[BaseException, int], BaseException] | None = None) -> None:
        """Raise the oldest failure (about ``key``), logging the others; nothing if there is none.

        Args:
            wrap: ``wrap(error, others)`` -> the exception to raise instead (its cause is ``error``);
                ``others`` is the number of failures logged.
        """
        failed = self.take(key)
        if not failed:
            return
        for later in failed[1:]:
            _LOG.error("%s: %s", later.what, later.error)
        error = failed[0].error
        if wrap is None:
            raise error
        raise wrap(error, len(failed) - 1) from error

    def log_all(self) -> None:
        """Log every failure instead of raising it (while another error propagates)."""
        for failure in self.take():
            _LOG.error("%s: %s", failure.what, failure.error)

    def __bool__(self) -> bool:
        return self.has()
