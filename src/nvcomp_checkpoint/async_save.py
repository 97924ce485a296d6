"""Asynchronous saves: snapshot the checkpoint, return to training, compress and write in the background.

One worker thread per :class:`AsyncSaver` writes snapshots in order; no save error is dropped silently.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import queue
import threading
import time
from dataclasses import replace
from typing import IO, Any, Callable, Mapping

from . import pending
from .api import log_report, write_checkpoint
from .codecs import gpu_available
from .deadline import Deadline
from .errors import CheckpointError, CheckpointWriteError
from .failures import FailureLog
from .pending import has_pending_save, path_key, wait_for_path, wait_for_saves
from .policy import CodecPolicy
from .report import SaveReport
from .saveoptions import SaveOptions
from .snapshot import Snapshot, SnapshotBuffers
from .writer import PinnedRing, TreePlan, plan_tensors, planned_copy, pre_encode_on_gpu

__all__ = [
    "AsyncSaveHandle",
    "AsyncSaver",
    "save_async",
    "wait_for_saves",
    "wait_for_path",
    "has_pending_save",
    "default_saver",
    "run_callback",
]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: Chunks in flight per compression worker of a background save (a synchronous save has 2): the
#: snapshot is held already, so the window is all an async save adds; with the writes made by
#: their own thread one chunk each keeps the workers busy (benchmarks/README.md, "Save pipeline
#: and window memory").
ASYNC_DEPTH = 1

DoneCallback = Callable[["AsyncSaveHandle"], Any]


def run_callback(fn: Callable[[Any], Any], arg: Any, where: str, what: str) -> None:
    """Call ``fn(arg)`` as every done and on_saved callback is called: what it raises is logged, never raised.

    A failing observer must not turn a durable save into a failed one; on a background thread
    even ``sys.exit()`` is caught, since ending that thread would strand the saves behind it.
    """
    try:
        fn(arg)
    except Exception:
        _LOG.exception("%s: %s raised", where, what)
    except BaseException:
        if threading.current_thread() is threading.main_thread():
            raise
        _LOG.exception("%s: %s raised", where, what)


class AsyncSaveHandle:
    """A save under way: ask for its :class:`SaveReport`, or be called when the file is durable.

    Created by :meth:`AsyncSaver.save` / :func:`save_async`; not constructed directly.

    Attributes:
        path: Where the checkpoint is being written.
        snapshot_seconds: Time spent copying the tree.
        snapshot_host_bytes: Tensor bytes the snapshot holds in host memory.
        snapshot_gpu_bytes: Tensor bytes the snapshot holds in GPU memory.
    """

    def __init__(self, saver: "AsyncSaver", path: str, started: float) -> None:
        self.path = path
        self.snapshot_seconds = 0.0
        self.snapshot_host_bytes = 0
        self.snapshot_gpu_bytes = 0
        self.key = path_key(path)
        self._saver = saver
        self._started = started
        self._blocked = 0.0
        # Set once save() has returned it (or raised): the report's seconds_blocked is known.
        self._returned = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[DoneCallback] = []
        self._report: SaveReport | None = None
        self._error: BaseException | None = None
        self._error_seen = False

    def done(self) -> bool:
        """True once the save has finished: the file is durable, or the save failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save finishes; False if ``timeout`` seconds passed first (``None``/``inf``: no limit).

        Raises only for a ``timeout`` that is not a number >= 0 (``TypeError``/``ValueError``).
        """
        return self._done.wait(Deadline(timeout, "AsyncSaveHandle.wait(timeout=...)").left())

    def result(self, timeout: float | None = None) -> SaveReport:
        """The save's report once the file is durable.

        Returns:
            The :class:`SaveReport`; ``seconds_blocked`` is the time :func:`save_async` held the
            caller (waiting for a free slot plus the snapshot), ``seconds`` the time from that
            call until the file was durable.

        Raises:
            CheckpointError: The save failed (the previous file at the path is untouched).
            TimeoutError: The save did not finish within ``timeout`` seconds.
        """
        deadline = Deadline(timeout, "AsyncSaveHandle.result(timeout=...)")
        if not self._done.wait(deadline.left()):
            raise TimeoutError(f"{self.path}: async save still running after {deadline.describe()}")
        if self._error is not None:
            self._mark_seen()
            raise self._error
        assert self._report is not None
        return self._report

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (which then counts as reported), or None if it succeeded."""
        deadline = Deadline(timeout, "AsyncSaveHandle.exception(timeout=...)")
        if not self._done.wait(deadline.left()):
            raise TimeoutError(f"{self.path}: async save still running after {deadline.describe()}")
        if self._error is not None:
            self._mark_seen()
        return self._error

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(handle)`` once the file is durable or the save failed (at once if it has).

        Callbacks run on the saver's worker thread, in the order they were added; one that
        raises is logged and does not stop the others.
        """
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def _mark_seen(self) -> None:
        with self._lock:
            self._error_seen = True
        self._saver._forget_error(self)

    def _set_done(self) -> list[DoneCallback]:
        """Mark the save finished; returns the callbacks to run."""
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _run_callback(self, fn: DoneCallback) -> None:
        run_callback(fn, self, self.path, "a done callback of the async save")

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "pending"
        return f"<AsyncSaveHandle {self.path!r} {state}>"


class AsyncSaver:
    """Saves checkpoints in the background, one at a time, in the order they were asked for.

    :meth:`save` blocks only while it waits for a free slot (at most ``max_pending`` saves
    snapshotted but not yet durable, so memory stays bounded) and while it copies the tree.
    One worker thread then compresses and writes each snapshot with :func:`nvcomp_checkpoint.save`'s
    pipeline. An error is kept until someone sees it: :meth:`AsyncSaveHandle.result`, the
    next :meth:`save`, :meth:`wait` or :meth:`close` raise it.

    Args:
        max_pending: Saves that may be snapshotted and not yet durable; each holds a full copy
            of its checkpoint's tensors. The next :meth:`save` waits for a slot.
        gpu_budget_bytes: GPU memory per device a snapshot of GPU tensors may use (``None``:
            a quarter of the free memory at the time; beyond it, tensors are copied to host
            memory through ``pinned_bytes`` of pinned staging buffers).
        pinned_bytes: Pinned host memory for staging GPU tensors.
        reuse_buffers: Keep host snapshot memory for the next save (the copy then skips page
            faults); :meth:`release_buffers` frees it.
        workers: Compression threads of the background save (default: every core).
        report_errors: ``False``: a failed save's error goes only to its handle (``result()``,
            ``exception()``, done callbacks), whose owner reports it; :meth:`save`, :meth:`wait`,
            :meth:`close` and :func:`wait_for_saves` never raise it.
        overlap: Start compressing each tensor as soon as the snapshot has copied it, while
            :meth:`save` still copies the rest (the file is durable sooner). ``False``: the
            background save starts once the whole snapshot is taken (on a machine with few
            cores, :meth:`save` then shares them with nothing of ours and returns sooner).
        log_saves: Log each durable save (one INFO line on logger ``nvcomp_checkpoint``). ``False``
            for an owner that logs a checkpoint of several files once, when it commits it.

    Example:
        >>> saver = AsyncSaver(max_pending=1)
        >>> handle = saver.save({"model": model.state_dict()}, "step100.nvc")
        >>> ...  # train on; the tensors may change at once
        >>> saver.close()  # waits, and raises if a save failed
    """

    def __init__(
        self,
        *,
        max_pending: int = 1,
        gpu_budget_bytes: int | None = None,
        pinned_bytes: int = 64 << 20,
        reuse_buffers: bool = True,
        workers: int | None = None,
        report_errors: bool = True,
        overlap: bool = True,
        log_saves: bool = True,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        SaveOptions(workers=workers)  # checks workers now, not at the first save
        self.max_pending = max_pending
        self.workers = workers
        self.report_errors = report_errors
        self.overlap = overlap
        self.log_saves = log_saves
        self.buffers = SnapshotBuffers(
            gpu_budget_bytes=gpu_budget_bytes, pinned_bytes=pinned_bytes, reuse=reuse_buffers, max_pooled=max_pending
        )
        self._slots = threading.Semaphore(max_pending)
        self._queue: queue.Queue[tuple[AsyncSaveHandle, Snapshot, SaveOptions] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._live: list[AsyncSaveHandle] = []  # not yet finished
        self._failures = FailureLog()  # failed saves whose error nobody has seen yet
        pending.register_saver(self)

    # -- saving ------------------------------------------------------------------------------
    def save(
        self,
        obj: Any,
        path: str | os.PathLike[str],
        policy: CodecPolicy | Mapping[str, Any] | str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        workers: int | None = None,
        progress: Callable[[int], None] | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        base: str | os.PathLike[str] | None = None,
    ) -> AsyncSaveHandle:
        """Snapshot ``obj`` and save it to ``path`` in the background.

        Returns once the snapshot is taken: every tensor and value of ``obj`` may change
        afterwards without affecting the file. The background save starts while the snapshot
        is still copying: it compresses each tensor once its copy is done. Arguments are those of
        :func:`nvcomp_checkpoint.save`. With ``base`` the file is a delta of it, written once
        every pending save to ``base`` has landed; tensors the snapshot compressed on the GPU
        are stored plain.

        Returns:
            An :class:`AsyncSaveHandle`.

        Raises:
            CheckpointWriteError: An earlier save of this saver failed and nobody has seen its
                error yet (this save is then not started).
            UnsupportedObjectError, CodecUnavailableError: ``obj`` cannot be saved with ``policy``
                (raised here, before anything is copied).
            CheckpointWriteError: A tensor could not be copied (raised here, and only here;
                nothing is written).
        """
        started = time.perf_counter()
        options = SaveOptions.of(
            path,
            "save_async",
            policy=policy,
            metadata=metadata,
            storage_options=storage_options,
            workers=workers,
            progress=progress,
            stream_wrapper=stream_wrapper,
            base=base,
        )
        return self.submit(obj, path, options, started=started)

    def submit(
        self, obj: Any, path: str | os.PathLike[str], options: SaveOptions, *, started: float | None = None
    ) -> AsyncSaveHandle:
        """:meth:`save` with its options already built (:meth:`SaveOptions.of`); ``started``: when the caller's save began.

        ``options.workers`` ``None`` is this saver's ``workers``.
        """
        started = time.perf_counter() if started is None else started
        where = os.fspath(path)
        if options.workers is None and self.workers is not None:
            options = replace(options, workers=self.workers)
        policy = options.policy
        if _EXITING:
            # The exit flush has run (and closed every saver): a background thread would be
            # killed with the interpreter, so the save is made here and now.
            return self._save_now(obj, where, started, options)
        if self._closed:
            raise CheckpointError(f"{where}: this AsyncSaver is closed; create a new one to save")
        # Saves to this file by other savers land first, so the newest save wins, as it does
        # within one saver.
        _wait_for_other_savers(self, path_key(where))
        self._acquire_slot()
        try:
            self.raise_errors()
            # Refuse what the writer would refuse while the caller can still see the traceback.
            # On a GPU with nvCOMP, CUDA tensors are compressed into GPU memory right away: the
            # snapshot is then the (smaller) compressed frames, not a raw copy.
            pre_encode = (lambda tensors, budget: pre_encode_on_gpu(tensors, policy, where, budget)) if gpu_available() else None
            # The plan is kept for the writer (it does not plan again), and the host copies run
            # on while the worker starts compressing the tensors already copied.
            snapshot = self.buffers.take(
                obj,
                validate=lambda tensors: plan_tensors(tensors, policy, where),
                pre_encode=pre_encode,
                where=where,
                background=self.overlap,
            )
        except BaseException:
            self._slots.release()
            raise
        handle = AsyncSaveHandle(self, where, started)
        handle.snapshot_host_bytes, handle.snapshot_gpu_bytes = snapshot.host_bytes, snapshot.gpu_bytes
        with self._lock:
            if self._closed:
                snapshot.release()
                self._slots.release()
                raise CheckpointError(f"{where}: this AsyncSaver was closed while saving; create a new one to save")
            self._live.append(handle)
            pending.register(handle)
            self._ensure_worker()
            self._queue.put((handle, snapshot, options))
        try:
            snapshot.wait_copied()  # the caller may change its tensors once this returns
        except BaseException:
            snapshot.cancel()
            if snapshot.copy_failed and not self.is_worker_thread():
                # The background write stops at the first tensor not copied; once it has, no
                # temporary file is left. The error is raised here only, never again.
                handle.wait()
            raise
        finally:
            handle.snapshot_seconds = snapshot.seconds
            handle._blocked = time.perf_counter() - started
            handle._returned.set()
        _LOG.debug("%s: async snapshot of %d bytes in %.3f s", where, snapshot.raw_bytes, snapshot.seconds)
        return handle

    def _save_now(self, obj: Any, where: str, started: float, options: SaveOptions) -> AsyncSaveHandle:
        """A save made in the caller's thread, returned as a finished handle; errors are raised."""
        report = write_checkpoint(obj, where, options=options)
        handle = AsyncSaveHandle(self, where, started)
        handle._report = replace(report, seconds=time.perf_counter() - started, seconds_blocked=time.perf_counter() - started)
        if self.log_saves:
            log_report(handle._report, "saved (synchronously: the interpreter is exiting)")
        handle._set_done()
        return handle

    def _reset_after_fork(self) -> None:
        # The worker thread and the parent's pending saves do not exist in a forked child; the
        # saver itself stays usable, and registered for the exit flush.
        self._slots = threading.Semaphore(self.max_pending)
        self._queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread = None
        self._live = []
        self._failures = FailureLog()
        self.buffers.reset_after_fork()

    def _acquire_slot(self) -> None:
        # Back-pressure: wait for a save to finish rather than hold another full copy in memory.
        while not self._slots.acquire(timeout=1.0):
            if self._thread is not None and not self._thread.is_alive() and not self._closed:
                raise CheckpointError("the async save worker thread died; create a new AsyncSaver")

    def _ensure_worker(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="nvckpt-async-save", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, snapshot, options = item
            report: SaveReport | None = None
            error: BaseException | None = None
            try:
                plan = TreePlan(
                    snapshot.skeleton,
                    tuple(planned_copy(p, t, options.policy, handle.path) for p, t in zip(snapshot.checked, snapshot.tensors)),
                    snapshot.wait_copied,
                )
                report = write_checkpoint(
                    None, handle.path, options=options, pre_encoded=snapshot.pre_encoded, plan=plan, depth=ASYNC_DEPTH
                )
                handle._returned.wait()
                report = replace(report, seconds=time.perf_counter() - handle._started, seconds_blocked=handle._blocked)
            except BaseException as exc:  # noqa: BLE001 - a waiter must never hang on a dead save
                error = (
                    exc
                    if isinstance(exc, CheckpointError)
                    else CheckpointWriteError(
                        f"{handle.path}: async save failed: {exc!r}. Any previous file at this path is untouched."
                    )
                )
                if error is not exc:
                    error.__cause__ = exc
            finally:
                snapshot.release()  # waits for copies still running
            # A failed copy was raised by save() to its caller, who never got this handle.
            callers = error is not None and snapshot.copy_failed
            # The outcome is set before the slot is freed: the next save() looks for errors then.
            handle._report, handle._error = report, error
            with self._lock:
                self._live.remove(handle)
                if error is not None and self.report_errors and not callers:
                    self._failures.record(error, key=handle.key, source=handle, what=f"{handle.path}: async save failed")
            pending.unregister(handle)
            if callers:
                _LOG.debug("%s: async save stopped: its snapshot failed (raised by save_async): %s", handle.path, error)
            elif error is not None:
                _LOG.warning(
                    "%s: async save failed: %s (raised by result(), the next save, or wait_for_saves())",
                    handle.path,
                    error,
                )
            else:
                assert report is not None
                if self.log_saves:
                    log_report(report, "saved (async)")
            callbacks = handle._set_done()
            # Done before the slot frees: a save() that was waiting sees this one finished.
            self._slots.release()
            for fn in callbacks:
                handle._run_callback(fn)

    # -- waiting and errors ------------------------------------------------------------------
    def pending(self) -> int:
        """Saves snapshotted and not yet finished."""
        with self._lock:
            return len(self._live)

    def wait(self, path: str | os.PathLike[str] | None = None, timeout: float | None = None) -> None:
        """Wait for pending saves (all, or those to ``path``), then raise any unseen error.

        Raises:
            CheckpointWriteError: A save (to ``path``, if given) failed and nobody saw the error.
            TimeoutError: Saves still pending after ``timeout`` seconds.
        """
        deadline = Deadline(timeout, "AsyncSaver.wait(timeout=...)")
        key = None if path is None else path_key(path)
        with self._lock:
            todo = [h for h in self._live if key is None or h.key == key]
        for handle in todo:
            if threading.current_thread() is self._thread:
                break  # a done callback waiting on its own worker's queue would never return
            if not handle.wait(deadline.left()):
                raise TimeoutError(f"{handle.path}: async save still running after {deadline.describe()}")
        self.raise_errors(key)

    def raise_errors(self, key: str | None = None) -> None:
        """Raise the oldest error nobody has seen yet (of saves to path ``key``, if given); log the others."""

        def wrap(error: BaseException, others: int) -> CheckpointWriteError:
            more = f" ({others} more failed saves are logged)" if others else ""
            return CheckpointWriteError(f"an earlier async save failed{more}: {error}")

        self._failures.raise_oldest(key, wrap=wrap)

    def is_worker_thread(self) -> bool:
        """True on this saver's worker thread, where its done callbacks run."""
        return self._thread is threading.current_thread()

    def has_unseen_error(self, key: str) -> bool:
        """True if a save to the file ``key`` (see :func:`pending.path_key`) failed and nobody saw it."""
        return self._failures.has(key)

    def _forget_error(self, handle: AsyncSaveHandle) -> None:
        self._failures.forget(handle)

    def release_buffers(self) -> None:
        """Free the host memory kept for the next snapshot."""
        self.buffers.clear()

    def close(self, timeout: float | None = None) -> None:
        """Finish every pending save, stop the worker, and raise any unseen error."""
        deadline = Deadline(timeout, "AsyncSaver.close(timeout=...)")
        with self._lock:
            already = self._closed
            self._closed = True
            thread = self._thread
        if not already and thread is not None and thread.is_alive():
            self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(deadline.left())
            if thread.is_alive():
                raise TimeoutError(f"async saves still running after {deadline.describe()}")
        pending.unregister_saver(self)
        self.buffers.clear()
        self.raise_errors()

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError:
            _LOG.exception("async save failed while another error was being raised")


# -- the process-wide saver ----------------------------------------------------------------
_DEFAULT: AsyncSaver | None = None
_DEFAULT_LOCK = threading.Lock()


def _wait_for_other_savers(saver: AsyncSaver, key: str) -> None:
    if pending.on_saver_worker():
        # A done callback runs on a saver's worker thread: waiting there for a save queued behind
        # it on that same worker would never end, so ordering gives way to progress.
        return
    for handle in pending.pending_for(key):
        if handle._saver is not saver:
            handle.wait()


def default_saver() -> AsyncSaver:
    """The process-wide saver behind :func:`save_async` (``max_pending=1``), created on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = AsyncSaver()
        return _DEFAULT


def save_async(
    obj: Any,
    path: str | os.PathLike[str],
    policy: CodecPolicy | Mapping[str, Any] | str | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> AsyncSaveHandle:
    """Save a checkpoint in the background; returns once a consistent snapshot is taken.

    Training may change every tensor as soon as this returns. The file appears at ``path`` only
    when complete and durable, as with :func:`nvcomp_checkpoint.save`; ``load``/``open`` of the
    same path wait for it. At most one save is pending (the process-wide :func:`default_saver`):
    a second call waits for the first to finish. Use an :class:`AsyncSaver` for other settings.

    Example:
        >>> handle = nc.save_async({"model": model.state_dict(), "optimizer": opt.state_dict()}, "step100.nvc")
        >>> handle.add_done_callback(lambda h: print("durable:", h.path))
        >>> optimizer.step()  # safe: the snapshot is already taken
        >>> handle.result().seconds_blocked

    Raises:
        CheckpointWriteError: An earlier async save failed and nobody has seen its error.
    """
    return default_saver().save(
        obj,
        path,
        policy,
        metadata=metadata,
        storage_options=storage_options,
        workers=workers,
        progress=progress,
        stream_wrapper=stream_wrapper,
        base=base,
    )


#: Set once the exit flush has run; later async saves are made synchronously.
_EXITING = False


def _flush_at_exit() -> None:
    """Let pending saves land before the interpreter exits, and report errors nobody saw."""
    global _EXITING
    _EXITING = True
    for saver in pending.savers():
        try:
            saver.close()
        except Exception as exc:
            _LOG.error("nvcomp_checkpoint: an async checkpoint save failed and the error was never retrieved: %s", exc)


def _after_fork_in_child() -> None:
    # The worker threads do not exist in a forked child: every saver starts afresh there, and
    # stays registered, so that saves the child makes land before it exits.
    global _DEFAULT_LOCK
    _DEFAULT_LOCK = threading.Lock()
    pending.reset_after_fork()
    for saver in pending.savers():
        saver._reset_after_fork()
    PinnedRing.reset_after_fork()


# Pending saves must land before concurrent.futures stops taking jobs at shutdown (it does so in
# threading's exit hooks, which run before atexit's), so flush from a hook registered after its.
_register_thread_exit = getattr(threading, "_register_atexit", None)
if _register_thread_exit is not None:
    _register_thread_exit(_flush_at_exit)
else:  # pragma: no cover - every CPython >= 3.9 has it
    atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
