"""The base class of the framework integrations: their shared options, sequence of saves, tier copies
and removal of old checkpoints, behind a named protected interface (see :class:`SaveEntryPoint`)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO, Any, Callable, Mapping

from ..api import save_with_options
from ..deadline import Deadline
from ..incremental import IncrementalFiles, unit_base_of
from ..policy import CodecPolicy
from ..report import SaveReport
from ..savegroup import SavedCallback, SaveGroup, SaveSequence
from ..saveoptions import SaveOptions
from ..tiers import Tier, TierCopies
from .options import as_policy

__all__ = ["SaveEntryPoint"]

_LOG = logging.getLogger("nvcomp_checkpoint")


class SaveEntryPoint:
    """The options, saves and tier copies of one integration; the integration adds its framework's interface.

    Args (the same in every integration, documented here once):
        policy: Codec settings per component (a :class:`~nvcomp_checkpoint.CodecPolicy` or its dict
            form); the default is portable (zstd over byte planes), loadable without a GPU.
        workers: Compression threads per file (default: every core).
        async_save: Write in the background: the save returns once the state is copied (a
            snapshot, or the framework's own files on disk); the checkpoint appears only once complete
            and durable. A background failure is raised by the next save, load, :meth:`wait`, or the
            end of the run, whichever comes first, and only once.
        on_saved: Called with the :class:`~nvcomp_checkpoint.SaveReport` of each save once it is
            durable (with ``async_save``, on the background thread; it must not call :meth:`wait`).
        stream_wrapper: Wraps each compressed file's output stream (throttling, byte counting ...);
            its ``write`` must pass every byte on, in order.
        tiers: :class:`~nvcomp_checkpoint.Tier` s to copy each durable checkpoint to (a shared file
            system, an object store), each on its own schedule and with its own retention. Where the
            framework writes its checkpoints is tier 0, rotated by the framework; copies run in the
            background, named by the checkpoint's step, and :meth:`resume_path` is the newest that checks.
            With the integration's ``incremental=True``, a delta is copied after the part of its chain a
            tier lacks, and tier retention keeps the bases of the deltas it keeps.
        max_pending: With ``async_save``, saves that may be in flight at once; the next waits for a slot.

    Attributes:
        last_report: The :class:`~nvcomp_checkpoint.SaveReport` of the most recent durable save
            (``None`` before one); ``seconds_blocked`` is the time the save held training,
            ``seconds`` the time until it was durable. ``last_report.table()`` prints it.
        incremental: The integration's ``incremental=True`` bookkeeping (:func:`incremental_files`), or None.

    For the integrations, the protected interface (an integration uses these and nothing else of the
    base; its sequence of saves is private to it):

    - saving: :meth:`_wait_for_slot`, :meth:`_save_group` (a checkpoint as one group of parts), whose
      ``hand_over`` adds :meth:`_save_file` (a file written in the background) or :meth:`_run_job` (a job
      on the background thread); :meth:`_saved` for a synchronous save; :meth:`_after_durable` for
      what runs once a save is durable (the copies to the tiers).
    - waiting and errors: :meth:`_wait_for_saves` (wait, then raise a failure), :meth:`_settle_saves`
      (wait, failures kept for whoever reports them), :meth:`_raise_errors` (may be extended, as
      Accelerate does with :meth:`_failed_save_info`), :meth:`close`.
    - removing an old checkpoint: :meth:`_remove_checkpoint`, in the one order documented there.
    """

    incremental: IncrementalFiles | None = None

    def __init__(
        self,
        label: str,
        policy: CodecPolicy | Mapping[str, Any] | None = None,
        *,
        workers: int | None = None,
        async_save: bool = False,
        on_saved: SavedCallback | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        tiers: list[Tier] | None = None,
        max_pending: int = 1,
        log_as: str = "saved",
        tiers_hint: str | None = None,
    ) -> None:
        # Checked first: a wrong argument must not leave anything half set up.
        self.tiers: TierCopies | None = None if tiers is None else TierCopies(tiers, label)
        # Checks max_pending and on_saved; runs every on_saved callback and owns every background error.
        self._saves = SaveSequence(label, max_pending=max_pending, workers=workers, on_saved=on_saved, log_as=log_as)
        self.policy: CodecPolicy = as_policy(policy, f"{label}(policy=...)")
        SaveOptions(policy=self.policy, workers=workers)  # checks workers now, not at the first save
        self.workers = workers
        self.async_save = bool(async_save)
        self.max_pending = max_pending
        self.on_saved = on_saved
        self.stream_wrapper = stream_wrapper
        self._tiers_hint = tiers_hint or f"{label}(tiers=[nc.Tier(...)])"

    @property
    def last_report(self) -> SaveReport | None:
        return self._saves.last_report

    def pending(self) -> int:
        """Saves not yet durable (0 without ``async_save``)."""
        return self._saves.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save (and copy to ``tiers``) is durable; raise the first background failure.

        Raises:
            nvcomp_checkpoint.errors.CheckpointWriteError: A background save failed; what it would
                have replaced is untouched.
            TimeoutError: Saves still pending after ``timeout`` seconds (``None`` or ``inf``: no limit), one
                deadline for the saves and the copies to ``tiers``
                (:class:`~nvcomp_checkpoint.errors.CopyTimeoutError` for copies).
        """
        deadline = Deadline(timeout, f"{self._saves.label}.wait(timeout=...)")
        self._wait_for_saves("wait()", timeout=deadline.left())
        if self.tiers is not None:
            self.tiers.wait(deadline.left())

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest checkpoint copy on ``tiers`` that checks (every file), or ``None`` (a fresh start).

        Resumes on a fresh node, where tier 0 is gone; damaged or incomplete newer copies, and
        deltas whose chain is broken on a tier, are skipped (logged), falling back to the next
        tier, then to older steps. A copy on an object store, and a delta (``incremental=True``)
        with its chain, are downloaded or laid out, checked, into ``local_dir`` first (default
        ``.nvckpt-restore`` in the working directory).

        Raises:
            ValueError: No ``tiers`` were given.
        """
        if self.tiers is None:
            raise ValueError(f"{type(self).__name__}.resume_path(): no tiers; pass {self._tiers_hint}")
        return self.tiers.resume_path(local_dir)

    def close(self, when: str) -> None:
        """Wait for pending saves and copies, stop the background threads, raise a failure (``when`` reports it).

        While another exception is propagating, failures are logged instead, so the first error
        stays visible. A later save starts the threads again.
        """
        self._saves.close()
        propagating = sys.exc_info()[1] is not None
        if propagating:
            self._saves.log_errors()
        else:
            self._raise_errors(when)
        if self.tiers is not None:
            try:
                # The end of the run: the newest step reaches every tier whose schedule skipped it.
                self.tiers.wait(final=True)
            except Exception as exc:  # noqa: BLE001 - the first error stays visible
                if not propagating:
                    raise
                _LOG.error("a checkpoint copy to a tier failed: %s", exc)

    # -- for the integrations ---------------------------------------------------------------
    def _wait_for_saves(self, when: str, consequence: str = "", timeout: float | None = None) -> None:
        """Wait for the pending saves (not the tier copies) and raise a failure, naming ``when``."""
        self._saves.wait(timeout)
        self._raise_errors(when, consequence)

    def _settle_saves(self) -> None:
        """Wait for the pending saves; a failure stays for the next call that reports errors."""
        self._saves.wait()

    def _raise_errors(self, when: str, consequence: str = "") -> None:
        """Raise the oldest failure of a background save nobody was told of yet (once), naming ``when``."""
        self._saves.raise_errors(when, consequence)

    def _failed_save_info(self) -> Mapping[str, Any] | None:
        """The ``info`` given to :meth:`_save_group` of the oldest failed save not yet reported (None: none)."""
        failed = self._saves.failed_group()
        return None if failed is None else failed.info

    def _wait_for_slot(self) -> None:
        """Back-pressure: wait until fewer than ``max_pending`` saves are in flight."""
        self._saves.wait_for_slot()

    def _after_durable(self, step: int | None, path: str | os.PathLike[str], *more: SavedCallback) -> list[SavedCallback]:
        """What runs once a save of ``step`` at ``path`` is durable: ``more``, then the copy to the tiers."""
        if self.tiers is None or step is None:
            return list(more)
        tiers, incremental = self.tiers, self.incremental

        def adopt(report: SaveReport) -> None:
            # A delta is adopted with its base (read from the file): the tiers copy its chain first.
            base = None if incremental is None else unit_base_of(os.fspath(path), incremental.storage_options)
            tiers.adopt(step, path, base)

        return [*more, adopt]

    def _saved(self, report: SaveReport, after: list[SavedCallback]) -> None:
        """A synchronous save is durable: record it and run its callbacks."""
        self._saves.notify(report, after)

    def _save_group(
        self,
        path: Any,
        started: float,
        after: list[SavedCallback],
        hand_over: Callable[[SaveGroup], Any],
        *,
        background: bool = True,
        **fields: Any,
    ) -> SaveReport | None:
        """Begin a save of ``path`` as one group, let ``hand_over`` add its parts, then seal it.

        If ``hand_over`` raises, the parts already handed over finish and nothing is committed.
        ``background=False``: wait for the group and return its report (or raise its error).
        ``fields``: of :meth:`SaveSequence.begin` (``commit``, ``failed``, ``info``).
        """
        group = self._saves.begin(path, started=started, notify=after, **fields)
        try:
            hand_over(group)
        except BaseException:
            self._saves.abandon(group)
            raise
        group.blocked = time.perf_counter() - started if background else 0.0
        self._saves.seal(group)  # completes now, or once the last background part is durable
        return None if background else self._saves.result(group)

    def _options(
        self,
        path: Any,
        *,
        policy: CodecPolicy | None = None,
        metadata: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        base: str | os.PathLike[str] | None = None,
    ) -> SaveOptions:
        """The options of one save to ``path``: this entry point's ``policy`` (unless the save has its own),
        ``workers`` and ``stream_wrapper``, with the save's index ``metadata``, fsspec options and delta ``base``."""
        return SaveOptions.of(
            path,
            self._saves.label,
            policy=self.policy if policy is None else policy,
            metadata=metadata,
            storage_options=storage_options,
            workers=self.workers,
            stream_wrapper=self.stream_wrapper,
            base=base,
        )

    def _save_now(self, obj: Any, path: Any, options: SaveOptions) -> SaveReport:
        """``obj`` saved to ``path`` in the caller's thread (hand the report to :meth:`_saved` or a group)."""
        return save_with_options(obj, path, options)

    def _save_file(self, group: SaveGroup, name: str, obj: Any, path: Any, options: SaveOptions) -> None:
        """Part ``name`` of ``group``: ``obj`` saved to ``path`` in the background (``options``: from :meth:`_options`)."""
        self._saves.save(group, name, obj, path, options)

    def _run_job(self, group: SaveGroup, name: str, job: Callable[[], SaveReport]) -> None:
        """Part ``name`` of ``group``: ``job`` run on the background thread (a conversion), its report the part's."""
        self._saves.run(group, name, job)

    def _remove_checkpoint(self, path: str | os.PathLike[str], delete: Callable[[str], None]) -> None:
        """Delete the checkpoint (a file or a folder) at ``path`` with ``delete(path)``, once nothing needs it.

        The one deletion order, the same in every integration; each stage waits for the one before:

        1. The saves pending now (``async_save``): the checkpoint removed is usually the one the
           newest pending save replaces, and must outlive it. The removal is queued behind them and
           runs on the thread that completes the last one; if one of them fails, it is skipped (the
           checkpoint kept, named by the next error). Without pending saves: now. Called from a
           group's ``commit`` (Accelerate's rotation), it runs once that commit is done.
        2. The deltas that still need it (``incremental=True``): a file a kept delta is saved against
           waits until that delta is removed (:meth:`IncrementalFiles.remove`, which remembers it across
           runs). A folder (Accelerate's ``save_state``) is never asked for while a kept one needs it:
           its rotation keeps chains whole (:func:`~nvcomp_checkpoint.incremental.keep_with_bases`).
        3. Its copies to the tiers (``tiers=``): queued or running copies read it, so the deletion
           waits for them (:meth:`TierCopies.remove_after_copies`), on the copy thread.

        The Trainer's callback calls none of this: the Trainer deletes its own ``checkpoint-N``.
        """
        where = os.fspath(path)
        tiers, incremental = self.tiers, self.incremental

        def after_copies(p: str) -> None:
            if tiers is None:
                delete(p)
            else:
                tiers.remove_after_copies(p, lambda: delete(p))

        def after_saves() -> None:
            if incremental is None:
                after_copies(where)
            else:
                incremental.remove(where, after_copies)

        if not self._saves.after_pending(after_saves, where):
            after_saves()
