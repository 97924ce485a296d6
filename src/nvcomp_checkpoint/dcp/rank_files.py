"""The DCP rank files backend: every rank's shards of one checkpoint folder, written through
:class:`~nvcomp_checkpoint.dcp.NvcompWriter` and read through :class:`~nvcomp_checkpoint.dcp.NvcompReader`.

What the sharded integrations share (Lightning's ModelParallel / FSDP strategies, the FSDP state of
Accelerate and the HF Trainer), framework-free: the folder's preparation, DCP's plan and commit
(``.metadata``, written by the coordinator once every rank's file is durable), a record written
last beside the rank files and tied to that ``.metadata`` by its digest, one agreement after which
a failure on any rank raises on every rank, and the same save in the background
(:class:`BackgroundRankFiles`: staged on the caller's thread, written and agreed on a gloo process
group of its own, so that its collectives never meet the training's).
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

import torch.distributed as dist

from ..api import is_nvcomp_checkpoint, save
from ..api import open as open_checkpoint
from ..entrypoint.commit import commit_on_every_rank, distributed, gather_outcomes, this_rank
from ..errors import CheckpointWriteError, MixedSaveError
from ..policy import CodecPolicy
from ..report import SaveReport
from ..storage import storage_for, write_errors
from .layout import METADATA_NAME
from .reader import NvcompReader
from .writer import NvcompWriter

__all__ = [
    "TIE_FIELD",
    "RankFilesOptions",
    "Record",
    "BackgroundRankFiles",
    "metadata_digest",
    "check_tie",
    "prepare_folder",
    "write_rank_files",
    "read_rank_files",
    "agree",
    "save_rank_files",
    "save_rank_files_async",
]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: The field of a record's tie: BLAKE2b-128 of the ``.metadata`` it was committed with.
TIE_FIELD = "dcp_metadata_blake2b"


@dataclass(frozen=True)
class RankFilesOptions:
    """How every rank writes its file: the codec ``policy``, compression ``workers`` and ``stream_wrapper``."""

    policy: CodecPolicy | None = None
    workers: int | None = None
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None

    def writer(self, directory: str | os.PathLike[str]) -> NvcompWriter:
        return NvcompWriter(directory, self.policy, workers=self.workers, stream_wrapper=self.stream_wrapper)


@dataclass(frozen=True)
class Record:
    """What the coordinator writes last beside the rank files (Lightning's ``meta.pt``): the checkpoint's commit.

    Attributes:
        name: Its file name in the folder.
        state: What it holds, saved with :func:`nvcomp_checkpoint.save`.
        key: The index metadata key under which it records its tie (:data:`TIE_FIELD`) to ``.metadata``.
    """

    name: str
    state: Any
    key: str


# -- identity ---------------------------------------------------------------------------------


def metadata_digest(directory: str | os.PathLike[str]) -> str | None:
    """BLAKE2b-128 of the folder's DCP ``.metadata`` (``None`` if there is none: DCP's load names that).

    ``.metadata`` names every rank file by its save's id, so the digest names one save's rank files.
    """
    storage, spath = storage_for(os.path.join(os.fspath(directory), METADATA_NAME))
    if not storage.exists(spath):
        return None
    with storage.open_read(spath) as f:
        return hashlib.blake2b(f.read(), digest_size=16).hexdigest()


def check_tie(record: str | os.PathLike[str], key: str, directory: str | os.PathLike[str]) -> None:
    """The record at ``record`` and the DCP files in ``directory`` come from one save; checked before
    any state is loaded. A record without a tie (older releases, a framework's own) is not checked.

    Raises:
        MixedSaveError: the record ties itself to another ``.metadata`` than the one beside it.
    """
    if not is_nvcomp_checkpoint(record):
        return
    with open_checkpoint(record) as reader:
        tie = reader.metadata.get(key)
    recorded = tie.get(TIE_FIELD) if isinstance(tie, dict) else None
    if recorded is None:
        return
    found = metadata_digest(directory)
    if found is not None and found != recorded:
        meta = os.path.join(os.fspath(directory), METADATA_NAME)
        raise MixedSaveError(
            f"{os.fspath(record)}: belongs to another save than {meta} and the rank files beside it (one or the "
            "other was copied in from another checkpoint); resuming would mix two training states. Restore the "
            "directory as one save wrote it, or load another checkpoint."
        )


# -- the steps --------------------------------------------------------------------------------


def _distributed() -> bool:
    return distributed() and dist.get_world_size() > 1


def agree(error: BaseException | None, where: str, process_group: Any = None) -> None:
    """One agreement of every rank on a step's outcome (a collective of ``process_group``, or of the
    default group, spanning every rank; also a barrier): the core's
    :func:`~nvcomp_checkpoint.entrypoint.commit.gather_outcomes`.

    Raises:
        BaseException: this rank's own ``error``, on this rank.
        CheckpointWriteError: on the other ranks, when any rank failed, naming the ranks and why
            (as DCP's ``_DistWrapper`` raises a rank's failure on every rank).
    """
    if error is not None and not isinstance(error, Exception):
        raise error  # an interrupt: no rank waits for an agreement this rank will not reach

    def mine() -> None:
        if error is not None:
            raise error

    _, own, outcomes = gather_outcomes(mine, share=False, process_group=process_group)
    if own is not None:
        raise own
    failed = [(rank, outcome.error) for rank, outcome in enumerate(outcomes) if not outcome.ok]
    if failed:
        said = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise CheckpointWriteError(f"{where}: not saved, because a rank failed ({said}); nothing was committed.")


def prepare_folder(directory: str | os.PathLike[str], *, coordinator: bool, record: str | None = None) -> None:
    """On the coordinator: the checkpoint folder made (a file in its place removed) and its old
    ``record`` removed before any rank file is written, so a save that dies midway leaves a folder
    no framework takes for a checkpoint. Not a collective: the caller agrees after it."""
    if not coordinator:
        return
    path = os.fspath(directory)
    storage, _ = storage_for(path)
    with write_errors(path, "preparing the checkpoint directory"):
        if os.path.isfile(path):
            storage.remove(path)
        storage.makedirs(path)
        if record is not None:
            storage.remove(os.path.join(path, record))


def write_rank_files(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    options: RankFilesOptions = RankFilesOptions(),
    *,
    process_group: Any = None,
    planner: Any = None,
    writer: NvcompWriter | None = None,
) -> None:
    """Every rank's shards of ``state`` into ``directory`` (a collective of ``process_group``): DCP's
    plan, each rank's file (fsynced), then ``.metadata`` by the coordinator, DCP's commit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(
            state,
            storage_writer=writer if writer is not None else options.writer(directory),
            planner=planner,
            process_group=process_group,
        )
    except CheckpointException as exc:
        # DCP raises every rank's failure on every rank, as one exception whose text is tracebacks.
        said = "; ".join(f"rank {rank}: {str(error).strip()}" for rank, (error, _) in sorted(exc.failures.items()))
        raise CheckpointWriteError(f"{os.fspath(directory)}: the sharded save failed ({said}); nothing was committed.") from exc


def read_rank_files(state: dict[str, Any], directory: str | os.PathLike[str], *, planner: Any = None) -> None:
    """``state`` filled in place from the DCP folder ``directory`` (compressed or plain), on any number of ranks."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=NvcompReader(directory), planner=planner)


def _commit_record(directory: Path, record: Record, options: RankFilesOptions) -> SaveReport:
    # fsync + rename: the folder's commit, tied to the .metadata DCP committed.
    tie = {record.key: {TIE_FIELD: metadata_digest(directory)}}
    return save(
        record.state,
        directory / record.name,
        options.policy,
        workers=options.workers,
        stream_wrapper=options.stream_wrapper,
        metadata=tie,
    )


def _report(directory: Path, started: float, written: SaveReport | None, blocked: float | None) -> SaveReport | None:
    # After the agreement, and never raising: reading the rank files' indexes cannot fail a committed save.
    from ..entrypoint.reports import checkpoint_report

    reports = [written] if written is not None else []
    return checkpoint_report(
        directory, time.perf_counter() - started, reports=reports, dcp_dirs=[directory], seconds_blocked=blocked
    )


def _finish(
    directory: Path,
    record: Record | None,
    options: RankFilesOptions,
    where: str,
    process_group: Any,
    error: BaseException | None,
) -> SaveReport | None:
    """The one collective commit (:func:`~nvcomp_checkpoint.entrypoint.commit.commit_on_every_rank`):
    every rank's files durable (DCP's ``.metadata`` is committed, or ``error`` says why not), one
    agreement, the coordinator writes the record last, a barrier that carries its outcome; raises on
    every rank if any failed. Returns the record's report on the coordinator."""
    written: list[SaveReport] = []

    def durable() -> dict[str, dict[str, Any]]:
        if error is not None:
            raise error
        return {}  # the rank files' sizes and checksums are in DCP's .metadata and their own indexes

    def finalize(records: Any, world: int) -> None:
        if record is not None:
            written.append(_commit_record(directory, record, options))

    if error is not None and not isinstance(error, Exception):
        raise error
    commit_on_every_rank(where, durable, finalize, process_group=process_group)
    return written[0] if written else None


def save_rank_files(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    options: RankFilesOptions = RankFilesOptions(),
    *,
    record: Record | None = None,
    planner: Any = None,
) -> SaveReport | None:
    """One sharded checkpoint, on every rank (a collective of the default process group).

    The coordinator (global rank 0) prepares the folder; every rank writes its file; DCP's
    coordinator commits ``.metadata``; the coordinator writes ``record`` (the commit for a
    framework that looks for it); one agreement; a failure on any rank raises on every rank.

    Returns:
        On the coordinator, the save's report (every rank's file and the record); ``None`` elsewhere.
    """
    started = time.perf_counter()
    path = Path(os.fspath(directory))
    where = f"{path}: sharded checkpoint"
    error: BaseException | None = None
    try:
        prepare_folder(path, coordinator=this_rank() == 0, record=None if record is None else record.name)
    except BaseException as exc:  # noqa: BLE001 - agreed on below
        error = exc
    agree(error, where)
    write_rank_files(state, path, options, planner=planner)
    written = _finish(path, record, options, where, None, None)
    if this_rank() != 0:
        return None
    return _report(path, started, written, None)


def save_rank_files_async(
    background: "BackgroundRankFiles",
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    options: RankFilesOptions = RankFilesOptions(),
    *,
    record: Record | None = None,
    on_committed: Callable[[SaveReport], Any] | None = None,
) -> None:
    """:func:`save_rank_files` in the background: returns once this rank's shards (and, on the
    coordinator, the record's state) are copied to host memory.

    Called on every rank. The previous background save is waited for first (its failure raised
    here, on every rank); the folder is prepared as for a synchronous save; then the background
    thread writes the rank files through DCP, the coordinator writes the record, and every rank
    agrees, all on the gloo process group of ``background``. ``on_committed(report)`` runs on the
    coordinator's background thread once every rank agreed that the checkpoint is durable.
    """
    started = time.perf_counter()
    path = Path(os.fspath(directory))
    where = f"{path}: sharded checkpoint saved in the background"
    background.wait(f"the save to {path}", "That save was not started.")
    group = background.process_group()
    error: BaseException | None = None
    try:
        prepare_folder(path, coordinator=this_rank() == 0, record=None if record is None else record.name)
    except BaseException as exc:  # noqa: BLE001 - agreed on below
        error = exc
    agree(error, where)
    writer = options.writer(path)
    staged = None
    try:
        staged = writer.stage(state)
        if record is not None and this_rank() == 0:
            record = Record(record.name, copy.deepcopy(record.state), record.key)
    except BaseException as exc:  # noqa: BLE001 - no rank may go on to the background collectives alone
        error = exc
    agree(error, where)
    assert staged is not None  # else agree raised
    blocked = time.perf_counter() - started

    def job() -> None:
        failed: BaseException | None = None
        try:
            write_rank_files(staged, path, options, process_group=group, writer=writer)
        except BaseException as exc:  # noqa: BLE001 - DCP raised it on every rank; agreed on below all the same
            failed = exc
        written = _finish(path, record, options, where, group, failed)
        if this_rank() == 0 and on_committed is not None:
            report = _report(path, started, written, blocked)
            if report is None:
                return
            try:
                on_committed(report)
            except Exception as exc:  # noqa: BLE001 - committed on every rank: a failure of this rank alone would split them
                _LOG.warning(
                    "%s: committed, but what follows its commit failed (%s: %s)", path, type(exc).__name__, exc, exc_info=True
                )

    background.submit(job, os.fspath(path))


class BackgroundRankFiles:
    """The sharded saves of one entry point written in the background, in order, on one thread.

    Each rank holds one. The background collectives (DCP's plan, gather and commit, and the final
    agreement) run on a gloo process group made for this (as torch's ``dcp.async_save`` is given
    one), so they never interleave with the training's collectives on the default group. A failed
    save fails on every rank (DCP's and :func:`agree`'s collectives), and is raised once by the next
    :meth:`wait` (the next save, a load, the end of the run), on every rank.

    Args:
        label: Names the entry point in errors.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Submitted saves not yet waited for: (future, what, actions to run once it is durable).
        self._pending: list[tuple[concurrent.futures.Future[None], str, list[tuple[Callable[[], None], str]]]] = []
        self._lock = threading.Lock()
        self._group: Any = None

    def __getstate__(self) -> dict[str, Any]:  # Lightning may send the strategy to spawned processes
        return {"label": self.label}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["label"])  # type: ignore[misc]

    def process_group(self) -> Any:
        """The gloo group of the background collectives, made on first use (a collective: every rank
        calls this at the same point, which each sharded save is)."""
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def submit(self, job: Callable[[], Any], what: str) -> None:
        """Run ``job`` (one save, ``what`` names it) on the background thread, after those submitted before."""
        actions: list[tuple[Callable[[], None], str]] = []
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvckpt-dcp")
            future = self._pool.submit(self._run, job, actions)
            self._pending.append((future, what, actions))

    def _run(self, job: Callable[[], Any], actions: list[tuple[Callable[[], None], str]]) -> None:
        try:
            job()
        except BaseException:
            with self._lock:
                kept, actions[:] = list(actions), []
            for _, what in kept:
                _LOG.warning("%s: not removed, because the checkpoint save before its removal failed", what)
            raise
        with self._lock:
            todo, actions[:] = list(actions), []
        for action, what in todo:
            try:
                action()
            except Exception as exc:  # an old checkpoint left behind must not fail the new one
                _LOG.warning("%s: could not remove this old checkpoint (%s); the new one is saved", what, exc)

    def pending(self) -> int:
        """Saves not yet durable."""
        with self._lock:
            return sum(1 for future, _, _ in self._pending if not future.done())

    def after_pending(self, action: Callable[[], None], what: str) -> bool:
        """Run ``action`` once the saves pending now are durable (skipped if the last fails); False if none is pending."""
        with self._lock:
            if not self._pending or self._pending[-1][0].done():
                return False
            self._pending[-1][2].append((action, what))
            return True

    def wait(self, when: str, consequence: str = "", timeout: float | None = None) -> None:
        """Wait for the pending saves; raise the first failure (once), naming ``when`` as the reporter.

        Raises:
            CheckpointWriteError: a background save failed (on every rank: they agreed on it).
            TimeoutError: still running after ``timeout`` seconds.
        """
        with self._lock:
            pending = list(self._pending)
        first: tuple[BaseException, str] | None = None
        for future, what, _ in pending:
            try:
                error = future.exception(timeout)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"{what}: sharded save still running after {timeout} s") from None
            if error is not None and first is None:
                first = (error, what)
        with self._lock:
            self._pending = [p for p in self._pending if p not in pending]
        if first is not None:
            error, what = first
            raise CheckpointWriteError(
                f"{str(error).rstrip('.')} ({what}: saved in the background by {self.label}; reported by {when})."
                f"{' ' + consequence if consequence else ''}"
            ) from error

    def close(self, when: str) -> None:
        """Wait for the pending saves and stop the thread; raise a failure (logged instead while
        another exception propagates, so the first error stays visible). A later save starts it again."""
        propagating = sys.exc_info()[1] is not None
        try:
            self.wait(when)
        except CheckpointWriteError as exc:
            if not propagating:
                raise
            _LOG.error("%s", exc)
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)
