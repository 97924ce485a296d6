"""The leftovers of interrupted saves and copies, removed from each tier in the background, never in a constructor.

A tier that does not answer (an object store in an outage) would hold a constructor for minutes of its
client's retries, past any deadline the caller gives the next call; so each tier is cleaned on a thread
of its own, and whatever writes to a tier (a save to tier 0, the copy thread of a later tier) waits for
that tier's cleaning first, so that it never removes a file being written.
"""

from __future__ import annotations

import logging
import threading

from ..deadline import Deadline
from .units import TierStore

__all__ = ["Cleaning"]

_LOG = logging.getLogger("nvcomp_checkpoint")


class Cleaning:
    """One background cleaning of each tier listed in ``which`` (the others count as clean)."""

    def __init__(self, stores: list[TierStore], which: list[bool]) -> None:
        self._done = [threading.Event() for _ in stores]
        for i, (store, clean) in enumerate(zip(stores, which)):
            if not clean:
                self._done[i].set()
                continue
            threading.Thread(
                target=self._run, args=(store, self._done[i]), name=f"nvckpt-clean-{store.label}", daemon=True
            ).start()

    @staticmethod
    def _run(store: TierStore, done: threading.Event) -> None:
        try:
            removed = store.clean_leftovers()
        except Exception as exc:  # noqa: BLE001 - an unreachable tier must not stop training
            _LOG.warning("%s (%s): could not clean leftovers: %s", store.label, store.root, exc)
            return
        finally:
            done.set()
        if removed:
            _LOG.warning("%s: removed leftovers of interrupted saves or copies: %s", store.label, ", ".join(removed))

    def ready(self, i: int, deadline: Deadline | None = None) -> bool:
        """Wait until tier ``i`` is cleaned (by ``deadline``; default: no limit); whether it is."""
        return self._done[i].wait(None if deadline is None else deadline.left())

    def wait(self, deadline: Deadline) -> bool:
        """Wait until every tier is cleaned, by ``deadline``; whether they are."""
        return all(self.ready(i, deadline) for i in range(len(self._done)))
