"""Saves of several files as one unit, and the ordered sequence of such saves that an entry point makes.

Every entry point that saves in the background (``save_async``'s callers, the Lightning, Accelerate
and Transformers integrations) uses this module for what they have in common: one completion per
unit, one owner per error, actions that wait until a save is durable, and on_saved callbacks that
never wait for themselves.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .api import log_report
from .async_save import AsyncSaveHandle, AsyncSaver, run_callback
from .deadline import Deadline
from .errors import CheckpointWriteError
from .failures import FailureLog
from .report import SaveReport, merge_reports
from .saveoptions import SaveOptions

__all__ = ["SaveGroup", "SaveSequence", "SavedCallback"]

_LOG = logging.getLogger("nvcomp_checkpoint")

SavedCallback = Callable[[SaveReport], Any]


@dataclass(eq=False)
class SaveGroup:
    """Files saved as one checkpoint: it is durable when every file is, and it fails as a whole.

    Created by :meth:`SaveSequence.begin`. Files are added with :meth:`SaveSequence.save` (in the
    background), :meth:`SaveSequence.run` (a background job) or :meth:`add_report` (written by
    the caller); :meth:`SaveSequence.seal` says that no more come. Once sealed and every part is
    in, the group completes exactly once, on the thread that brought the last part: ``commit``
    runs (a failure there fails the group), then the actions queued behind it, then the
    ``on_saved`` callbacks with the merged report.

    Attributes:
        path: What the group saves (a file or a checkpoint directory), as the user named it.
        commit: Called with the per-file reports once every file is durable; makes the
            checkpoint visible (a directory commit). Raising fails the group.
        failed: Called with the error instead of ``commit`` when a part failed (cleanup).
        error: The group's error once finished (``None`` if it succeeded).
        report: The merged report once finished and successful.
        reports: Per-file reports, by name.
        info: The entry point's own data about this save (a step, an iteration ...).
    """

    path: str
    started: float
    commit: Callable[[dict[str, SaveReport]], None] | None = None
    failed: Callable[[BaseException], BaseException | None] | None = None
    notify: list[SavedCallback] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    blocked: float = 0.0
    reports: dict[str, SaveReport] = field(default_factory=dict)
    error: BaseException | None = None
    report: SaveReport | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    _parts: int = 0
    _done: int = 0
    _sealed: bool = False
    _abandoned: bool = False
    _completing: bool = False
    _errors: list[BaseException] = field(default_factory=list)
    _after: list[tuple[Callable[[], None], int, str]] | None = field(default_factory=list)  # None once taken
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _idle: threading.Event = field(default_factory=threading.Event)  # every part handed over is done
    _caller: int = field(default_factory=threading.get_ident)  # the thread that began the group

    def __post_init__(self) -> None:
        self._idle.set()

    def _add_part(self) -> None:
        with self._lock:
            self._parts += 1
            self._idle.clear()

    def add_report(self, name: str, report: SaveReport) -> None:
        """A file written by the caller, durable already."""
        with self._lock:
            self.reports[name] = report

    def done(self) -> bool:
        return self.finished.is_set()


class SaveSequence:
    """The saves of one entry point, in order: back-pressure, one error owner, actions after durability.

    Background files go through one :class:`~nvcomp_checkpoint.AsyncSaver` whose errors go only to
    this sequence (never raised by ``wait_for_saves`` or the saver), and each failed group's error
    is raised once: by :meth:`SaveGroup`'s caller through :meth:`result`, or by :meth:`raise_errors`.

    Args:
        label: Names the entry point in errors (``NvcompCheckpointIO``).
        max_pending: Groups that may be in flight; :meth:`begin` waits for a free one.
        workers: Compression threads per file.
        on_saved: Called with the report of each completed group (also on a background thread).
        log_as: The verb of the INFO line logged per completed group (``log_report``: one line per
            checkpoint, whatever its files, in every entry point).
        failures: Where failed groups are recorded (a :class:`~nvcomp_checkpoint.failures.FailureLog` the
            entry point shares with its other background work); a log of its own by default.
    """

    def __init__(
        self,
        label: str,
        *,
        max_pending: int = 1,
        workers: int | None = None,
        on_saved: SavedCallback | None = None,
        log_as: str = "saved",
        failures: FailureLog | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"{label}: max_pending must be at least 1, got {max_pending}")
        if on_saved is not None and not callable(on_saved):
            raise TypeError(f"{label}(on_saved=...) takes a callable, got {type(on_saved).__name__}")
        self.label = label
        self.max_pending = max_pending
        self.workers = workers
        self.on_saved = on_saved
        self.log_as = log_as
        self.last_report: SaveReport | None = None
        self._lock = threading.Lock()
        self._groups: list[SaveGroup] = []  # begun, not yet finished
        self.failures = failures if failures is not None else FailureLog()  # failed groups not yet reported
        self._kept: list[str] = []  # actions skipped because a save before them failed
        self._failed_count = 0
        self._saver: AsyncSaver | None = None
        self._jobs: concurrent.futures.ThreadPoolExecutor | None = None
        self._threads = threading.local()  # .completing: this thread runs a completion and must not wait

    # -- pickling (Lightning sends plugins to spawned processes) -------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("label", "max_pending", "workers", "on_saved", "log_as")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("label"), **state)  # type: ignore[misc]

    # -- starting a group -------------------------------------------------------------------
    def wait_for_slot(self) -> None:
        """Wait until fewer than ``max_pending`` groups are in flight (back-pressure)."""
        self.guard("a new save")
        while True:
            with self._lock:
                running = [g for g in self._groups if not g.finished.is_set()]
                self._groups = running
                if len(running) < self.max_pending:
                    return
            running[0].finished.wait()

    def begin(self, path: str | os.PathLike[str], *, started: float | None = None, **fields: Any) -> SaveGroup:
        """A new group, after waiting for a free slot; ``fields`` are :class:`SaveGroup`'s."""
        self.wait_for_slot()
        group = SaveGroup(os.fspath(path), time.perf_counter() if started is None else started, **fields)
        with self._lock:
            self._groups.append(group)
        return group

    def save(self, group: SaveGroup, name: str, obj: Any, path: str | os.PathLike[str], options: SaveOptions) -> AsyncSaveHandle:
        """Snapshot ``obj`` and write it to ``path`` in the background as part ``name`` of ``group``.

        ``options``: the save's (``options.workers`` ``None`` is the sequence's ``workers``).
        """
        handle = self._async_saver().submit(obj, path, options)
        group._add_part()

        def done(h: AsyncSaveHandle) -> None:
            error = h.exception()  # taken here: the group owns it
            self._part_done(group, name, error, None if error is not None else h.result())

        handle.add_done_callback(done)
        return handle

    def run(self, group: SaveGroup, name: str, job: Callable[[], SaveReport]) -> None:
        """Run ``job`` on the sequence's background thread as part ``name`` of ``group``."""
        if self._jobs is None:
            self._jobs = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvckpt-job")
        group._add_part()

        def work() -> None:
            try:
                report = job()
            except BaseException as exc:  # noqa: BLE001 - owned by the group, reported once
                self._part_done(group, name, exc, None)
                return
            self._part_done(group, name, None, report)

        self._jobs.submit(work)

    def seal(self, group: SaveGroup) -> None:
        """No more parts: complete now if every part is in, else when the last one is."""
        with group._lock:
            group._sealed = True
        self._complete_if_ready(group)

    def abandon(self, group: SaveGroup) -> None:
        """The caller failed while handing parts over: let those finish, complete nothing."""
        with group._lock:
            group._abandoned = True
        group._idle.wait()
        with self._lock:
            if group in self._groups:
                self._groups.remove(group)
            # Whatever waited for this checkpoint to be durable must not run: it never will be.
            actions, group._after = group._after or [], None
            self._kept.extend(what for _, _, what in actions)
        group.finished.set()

    def result(self, group: SaveGroup) -> SaveReport:
        """Wait for ``group``; its report, or its error raised here (and nowhere else)."""
        self.guard("result()")
        group.finished.wait()
        if group.error is not None:
            self.failures.forget(group)
            raise group.error
        assert group.report is not None
        return group.report

    # -- actions after durability -----------------------------------------------------------
    def after_pending(self, action: Callable[[], None], what: str) -> bool:
        """Run ``action`` once every group begun so far is durable (on the thread completing the
        last of them); skipped, with ``what`` kept for the next error, if one of them failed.

        Returns:
            False if nothing is pending: the caller runs ``action`` itself, now.
        """
        with self._lock:
            open_groups = [g for g in self._groups if not g.finished.is_set()]
            if not open_groups:
                return False
            last, before = open_groups[-1], self._failed_count
            if last._after is not None:
                last._after.append((action, before, what))
                return True
            # The last group has just taken its actions (its outcome, counted in _failed_count, is set).
            if last.error is not None:
                before -= 1
        self.wait()
        self._run_actions([(action, before, what)])
        return True

    # -- waiting and errors -----------------------------------------------------------------
    def guard(self, what: str) -> None:
        """Refuse to wait on the thread that runs this sequence's completions and callbacks."""
        if getattr(self._threads, "completing", False):
            raise RuntimeError(
                f"{self.label}: {what} was called from an on_saved callback, which runs on the background "
                "save thread and would wait for itself; call it from the training loop instead."
            )

    def pending(self) -> int:
        """Groups not yet finished."""
        with self._lock:
            return sum(1 for g in self._groups if not g.finished.is_set())

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every group begun so far (errors stay for :meth:`raise_errors`)."""
        deadline = Deadline(timeout, f"{self.label}: wait(timeout=...)")
        self.guard("wait()")
        with self._lock:
            groups = list(self._groups)
        for group in groups:
            if not group.finished.wait(deadline.left()):
                raise TimeoutError(f"{group.path}: async save still running after {deadline.describe()}")
        with self._lock:
            self._groups = [g for g in self._groups if not g.finished.is_set()]

    def failed_group(self) -> SaveGroup | None:
        """The oldest finished group whose error nobody has been told of yet."""
        oldest = self.failures.oldest()
        return None if oldest is None else oldest.source

    def raise_errors(self, when: str, consequence: str = "") -> None:
        """Raise the oldest unreported failure (once), naming ``when`` as the reporter; log the others."""
        with self._lock:
            kept, self._kept = self._kept, []
        if not self.failures:
            return
        if kept:
            consequence = (
                f"{consequence} Not removed, so that the run keeps its newest complete checkpoint: {', '.join(kept)}.".strip()
            )

        def wrap(error: BaseException, others: int) -> CheckpointWriteError:
            more = f" ({others} more failed saves are logged)" if others else ""
            return CheckpointWriteError(
                f"{str(error).rstrip('.')} (saved in the background; reported by {when}){more}."
                f"{' ' + consequence if consequence else ''}"
            )

        self.failures.raise_oldest(wrap=wrap)

    def log_errors(self) -> None:
        """Log unreported failures instead of raising them (while another error propagates)."""
        self.failures.log_all()

    def close(self) -> None:
        """Wait for everything, stop the background threads (a later save starts them again)."""
        self.wait()
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()  # its errors belong to the groups; it raises none
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.shutdown(wait=True)

    # -- internals --------------------------------------------------------------------------
    def _async_saver(self) -> AsyncSaver:
        if self._saver is None:
            # Room for every file of max_pending groups; the group count is the back-pressure.
            # Its files are not logged one by one: notify() logs each checkpoint once it is committed.
            self._saver = AsyncSaver(
                max_pending=max(2, 2 * self.max_pending), workers=self.workers, report_errors=False, log_saves=False
            )
        return self._saver

    def _part_done(self, group: SaveGroup, name: str, error: BaseException | None, report: SaveReport | None) -> None:
        with group._lock:
            if error is not None:
                group._errors.append(error)
            elif report is not None:
                group.reports[name] = report
            group._done += 1
            if group._done == group._parts:
                group._idle.set()
        self._complete_if_ready(group)

    def _complete_if_ready(self, group: SaveGroup) -> None:
        with group._lock:
            ready = group._sealed and not group._abandoned and not group._completing and group._done == group._parts
            if ready:
                group._completing = True
        if ready:
            self._complete(group)

    def _complete(self, group: SaveGroup) -> None:
        previous = getattr(self._threads, "completing", False)
        self._threads.completing = True
        try:
            error: BaseException | None = group._errors[0] if group._errors else None
            if error is None and group.commit is not None:
                try:
                    group.commit(dict(group.reports))
                except BaseException as exc:  # noqa: BLE001 - owned by the group, reported once
                    error = exc
            if error is not None and group.failed is not None:
                try:
                    error = group.failed(error) or error
                except BaseException as exc:  # noqa: BLE001
                    _LOG.exception("%s: cleaning up after a failed save raised", group.path)
                    error = error or exc
            with self._lock:
                if error is not None:
                    self._failed_count += 1
                    self.failures.record(error, source=group, what="an async checkpoint save failed")
                actions, group._after = group._after or [], None
                group.error = error
            if error is None:
                seconds = time.perf_counter() - group.started
                group.report = merge_reports(group.path, group.reports.values(), seconds, group.blocked or seconds)
            elif threading.get_ident() != group._caller:
                # Failed in the background: said now, raised later by whoever reports it.
                _LOG.error("%s", error)
            self._run_actions(actions)
            if group.report is not None:
                self.notify(group.report, group.notify)
        finally:
            self._threads.completing = previous
            group.finished.set()

    def _run_actions(self, actions: Iterable[tuple[Callable[[], None], int, str]]) -> None:
        for action, failures_before, what in actions:
            if self._failed_count != failures_before:
                with self._lock:
                    self._kept.append(what)
                _LOG.warning("%s: not removed, because a checkpoint save before its removal failed", what)
                continue
            try:
                action()
            except Exception as exc:  # an old file left behind must not fail the new checkpoint
                _LOG.warning("%s: could not remove this old checkpoint (%s); the new one is saved", what, exc)

    def notify(self, report: SaveReport, callbacks: Iterable[SavedCallback] = ()) -> None:
        """A save is durable: the one place on_saved callbacks run (logged, never raising; on a
        background completion they cannot wait for themselves, see :meth:`guard`). Entry points
        call it for their synchronous saves too."""
        self.last_report = report
        log_report(report, self.log_as)
        for fn in [*([self.on_saved] if self.on_saved is not None else []), *callbacks]:
            run_callback(fn, report, report.path, "the on_saved callback")
