"""The background copies of one manager: one thread per destination tier, its schedule, and what is left at a deadline."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .. import metrics
from ..deadline import Deadline
from ..errors import CheckpointWriteError, CopySourceGoneError
from ..failures import FailureLog
from .cleaning import Cleaning
from .retention import TierRetention
from .schedule import COPY_NICE, copy_due
from .tier0 import Pins, Tier0
from .transfer import copy_with_retries
from .units import TierStore, UnitManifest

__all__ = ["NotCopied", "Copier"]

_LOG = logging.getLogger("nvcomp_checkpoint")


@dataclass(frozen=True)
class NotCopied:
    """A copy that :meth:`CheckpointManager.wait` or :meth:`~CheckpointManager.close` gave up waiting for.

    Attributes:
        step: The step.
        tier: The name of the tier it was going to (tier 0's name for a save still being written).
        path: Where the step still is (its tier-0 unit, or the file or folder it was adopted from).
        state: ``"saving"`` (tier 0 not durable yet), ``"copying"``, ``"queued"`` or ``"not started"``.
    """

    step: int
    tier: str
    path: str
    state: str


class _CopyQueue:
    """One background thread per destination tier, so a slow tier never holds up a fast one."""

    def __init__(self, copier: "Copier", index: int) -> None:
        self.copier = copier
        self.index = index
        # (unit, the tier-0 steps pinned for its copy: the unit and, for an adopted delta, its chain)
        self.queue: queue.Queue[tuple[UnitManifest, list[int]] | None] = queue.Queue(maxsize=copier.stores[index].tier.max_queued)
        #: Set by stop(): copies still queued are dropped (reported by close), none is started.
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name=f"nvckpt-copy-{copier.stores[index].label}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # Copies are background work: below training threads in the scheduler, where the OS allows.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + COPY_NICE))
        except (AttributeError, OSError):
            pass
        cleaned = False
        while True:
            item = self.queue.get()  # taken first: a copy waiting for the cleaning counts as running, not queued
            try:
                if item is None:
                    return
                if not cleaned:
                    self.copier.cleaning.ready(self.index)  # a copy is never taken for a leftover of an interrupted one
                    cleaned = True
                if not self.stopping:
                    self.copier.copy(self.index, item[0])
            finally:
                if item is not None:
                    self.copier.done(self.index, *item, ran=not self.stopping)
                self.queue.task_done()


class Copier:
    """Copies tier-0 units to the other tiers on their schedules, checked, then applies their retention.

    A failed copy is logged at once and recorded in ``failures`` (raised by the manager's ``wait``).
    """

    def __init__(
        self,
        stores: list[TierStore],
        tier0: Tier0,
        pins: Pins,
        retention: TierRetention,
        failures: FailureLog,
        lock: threading.RLock,
        cleaning: Cleaning,
        on_copy_progress: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.stores, self.tier0, self.pins, self.retention, self.failures = stores, tier0, pins, retention, failures
        self.cleaning = cleaning
        self.on_copy_progress = on_copy_progress
        self._lock = lock
        self.changed = threading.Condition(lock)  # a save committed or a copy ended
        self._queues: dict[int, _CopyQueue] = {}
        self._closed = False
        self._outstanding: dict[int, list[UnitManifest]] = {}  # tier -> copies queued or running, oldest first
        self._uncopied: dict[int, UnitManifest] = {}  # tier -> newest unit its schedule (or a full queue) skipped
        # tier -> (step, monotonic time) of its last copy; before one, the newest step a restore listed there.
        self._last_copy: dict[int, tuple[int | None, float | None]] = {}

    def listed(self, newest: dict[int, int | None]) -> None:
        """The newest step a restore listed on each tier (a later tier whose newest step is above the run's
        next save gets that save, which replaces it); tiers copied to already keep their last copy."""
        with self._lock:
            for i, step in newest.items():
                if i > 0 and self._last_copy.get(i, (None, None))[1] is None:
                    self._last_copy[i] = (step, None)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, manifest: UnitManifest) -> None:
        """Queue the copies of a unit just committed (or adopted) on tier 0 to the tiers due."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            for i in range(1, len(self.stores)):
                label = self.stores[i].label
                if not copy_due(self.stores[i].tier, *self._last_copy.get(i, (None, None)), manifest.step, now):
                    self._note_uncopied(i, manifest)
                    continue
                try:
                    self._enqueue(i, manifest, block=False)
                except queue.Full:
                    metrics.record_copy_skipped(label)
                    _LOG.warning(
                        "%s is behind: the copy of step %d is skipped (a copy is running and %d more wait); "
                        "the next due save, or close(), copies a newer step instead",
                        label,
                        manifest.step,
                        self.stores[i].tier.max_queued,
                    )
                    self._note_uncopied(i, manifest)
                    continue
                self._last_copy[i] = (manifest.step, now)

    def copy_newest(self, deadline: Deadline) -> None:
        """Queue the copy of each tier's newest step its schedule skipped (the end of a run has no next due save)."""
        with self._lock:
            newest = dict(self._uncopied)
        for i, manifest in sorted(newest.items()):
            if manifest.source is None and self.tier0.manifest(manifest.step) is None:
                with self._lock:  # tier 0 no longer holds it (a later save removed it there)
                    self._uncopied.pop(i, None)
                continue
            _LOG.info("%s: copying step %d, the newest step, which its schedule skipped", self.stores[i].label, manifest.step)
            try:
                self._enqueue(i, manifest, block=True, timeout=deadline.left())
            except queue.Full:
                continue  # reported by not_copied: it stays in _uncopied
            with self._lock:
                self._last_copy[i] = (manifest.step, time.monotonic())

    def _enqueue(self, i: int, manifest: UnitManifest, *, block: bool, timeout: float | None = None) -> None:
        """Queue the copy of ``manifest`` to tier ``i`` (raises ``queue.Full``); the lock is held unless ``block``."""
        # An adopted delta's copy may bring its chain: the framework's removal of a base waits for it too.
        pins = [manifest.step, *(m.step for m in self.tier0.chain_of(manifest))]
        with self._lock:  # counted before the copy thread can end it
            q = self._queues.get(i)
            if q is None:
                q = self._queues[i] = _CopyQueue(self, i)
            self.pins.pin(pins)
            self._outstanding.setdefault(i, []).append(manifest)
        try:
            if block:
                q.queue.put((manifest, pins), timeout=timeout)
            else:
                q.queue.put_nowait((manifest, pins))
        except queue.Full:
            self.done(i, manifest, pins)
            raise
        with self._lock:
            newest = self._uncopied.get(i)
            if newest is not None and newest.step <= manifest.step:
                del self._uncopied[i]

    def _note_uncopied(self, i: int, manifest: UnitManifest) -> None:
        with self._lock:
            newest = self._uncopied.get(i)
            if newest is None or manifest.step >= newest.step:
                self._uncopied[i] = manifest

    def done(self, i: int, manifest: UnitManifest, pins: list[int], *, ran: bool = False) -> None:
        """A queued copy ended (or will not run): its tier-0 units are released."""
        self.pins.unpin(pins)
        if ran and self.tier0.managed:  # the unit copied may go from tier 0 now
            try:
                self.retention.apply(0)
            except Exception as exc:  # noqa: BLE001
                _LOG.warning("%s: retention failed: %s", self.stores[0].label, exc)
        with self.changed:
            pending = self._outstanding.get(i, [])
            for k, m in enumerate(pending):
                if m is manifest:
                    del pending[k]
                    break
            self.changed.notify_all()

    # -- copying ------------------------------------------------------------------------------
    def copy(self, i: int, manifest: UnitManifest) -> None:
        """Copy ``manifest`` (and the part of its chain tier ``i`` lacks) there, then apply that tier's retention."""
        src, dst = self.stores[0], self.stores[i]
        progress = None
        if self.on_copy_progress is not None:
            cb, label, step = self.on_copy_progress, dst.label, manifest.step
            progress = lambda n: cb(label, step, n)  # noqa: E731
        try:
            if manifest.base is not None:
                self._copy_bases(i, manifest)
            started = time.perf_counter()
            with self.retention.committing(i, manifest.step):
                committed = copy_with_retries(src, dst, manifest, progress)
            metrics.record_save_seconds(dst.label, "copy", time.perf_counter() - started)
            metrics.record_bytes_written(dst.label, committed.stored_bytes)
            metrics.record_last_step(dst.label, manifest.step)
            _LOG.info(
                "%s: step %d copied (%d bytes) in %.2f s",
                dst.label,
                manifest.step,
                committed.stored_bytes,
                time.perf_counter() - started,
            )
            self.retention.apply(i, manifest.step)
        except CopySourceGoneError as exc:  # the framework's rotation came first: not a failure of the run
            _LOG.warning("%s: %s", dst.label, exc)
        except Exception as exc:  # noqa: BLE001 - raised from wait() / close(); training goes on
            _LOG.error("%s", exc)
            self.failures.record(exc, what="a copy to the tiers failed")

    def _copy_bases(self, i: int, manifest: UnitManifest) -> None:
        """Commit the chain of the delta ``manifest`` on tier ``i``, oldest first, where it is not there yet.

        Raises:
            CheckpointWriteError: A base is not on tier 0 or its copy failed (the delta is then not copied).
        """
        src, dst = self.stores[0], self.stores[i]
        chain: list[UnitManifest] = []
        base = manifest.base
        while base is not None:
            m = self.tier0.manifest(base)
            if m is None:
                raise CheckpointWriteError(
                    f"{dst.label} ({dst.root}): step {manifest.step} is not copied: its base step {base} is no longer on "
                    f"{src.label} ({src.root})"
                )
            chain.append(m)
            base = m.base
        for m in reversed(chain):
            there = dst.manifest(m.step)
            if there is not None and [f.index_xxh3 for f in there.files] == [f.index_xxh3 for f in m.files]:
                continue  # committed there by its own copy, or by an earlier delta's
            try:
                with self.retention.committing(i, m.step, newest=False):
                    copy_with_retries(src, dst, m)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointWriteError(
                    f"{dst.label} ({dst.root}): step {manifest.step} is not copied: it is a delta against step {m.step}, "
                    f"whose copy there failed ({exc.__cause__ or exc}). A delta is committed only after its base; the tier's "
                    f"previous copies are untouched, step {manifest.step} stays on {src.label}."
                ) from exc

    # -- waiting and stopping -----------------------------------------------------------------
    def busy(self) -> bool:
        with self._lock:
            return any(self._outstanding.values())

    def not_copied(self, *, final: bool) -> list[NotCopied]:
        """The copies queued or running (``final``: and each tier's newest step its schedule skipped)."""
        with self._lock:
            out = []
            for i, pending in sorted(self._outstanding.items()):
                for k, m in enumerate(pending):
                    out.append(NotCopied(m.step, self.stores[i].label, self.where(m), "copying" if k == 0 else "queued"))
            if final:
                for i, m in sorted(self._uncopied.items()):
                    if not any(p.step >= m.step for p in self._outstanding.get(i, [])):
                        out.append(NotCopied(m.step, self.stores[i].label, self.where(m), "not started"))
        return out

    def where(self, manifest: UnitManifest) -> str:
        return manifest.source if manifest.source is not None else self.stores[0].unit_path(manifest.step, manifest.directory)

    def stop(self, deadline: Deadline) -> None:
        """No copy starts any more; the queued ones are dropped; each thread ends after the copy it runs."""
        with self._lock:
            self._closed = True
            queues, self._queues = list(self._queues.values()), {}
        for q in queues:
            q.stopping = True
            while True:
                try:
                    item = q.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.done(q.index, *item)
                q.queue.task_done()
            q.queue.put_nowait(None)  # room: nothing is queued once the manager is closed
        for q in queues:
            q.thread.join(deadline.left())
