"""The DeepSpeed ZeRO backend: a checkpoint engine that writes every file of a DeepSpeed checkpoint compressed.

Framework-free: DeepSpeed's engine only calls methods on ``engine.checkpoint_engine`` (``create``, ``save``,
``load``, ``commit``, ``makedirs``, ``is_decoupled``, ``get_commit_info`` ...) and checks its type nowhere, so
:class:`NvcompCheckpointEngine` implements that interface without importing DeepSpeed. The integrations of
Accelerate, the HF Trainer and Lightning attach it through :func:`attach_after` and :func:`attach_once`;
:mod:`nvcomp_checkpoint.deepspeed` re-exports everything here for users, with DeepSpeed's own classes.

``attach(engine)`` puts an :class:`NvcompCheckpointEngine` in ``engine.checkpoint_engine``; from then on
``engine.save_checkpoint(dir, tag)`` writes each file DeepSpeed asks for (model states, each rank's ZeRO
optimizer partition, MoE expert files) in this library's format under DeepSpeed's own file names, and
``engine.load_checkpoint(dir)`` reads those and plain DeepSpeed checkpoints alike.

A tag is *committed* by :func:`~.commit.commit_on_every_rank`: once every rank's files are durable, rank 0
writes the tag's manifest (:data:`~nvcomp_checkpoint.deepspeed_layout.MANIFEST_NAME`, every file of every
rank with its size and digest) and only after it ``latest``, both atomically. A save killed at any moment
therefore leaves ``latest`` on the previous committed tag, a file that failed on one rank fails the save on
every rank, and a load of a tag whose manifest names a file that is missing fails on every rank, naming
the file.

Files are unpickled with ``weights_only=True`` and an allow-list of exactly the classes DeepSpeed
writes (:data:`~nvcomp_checkpoint.deepspeed_layout.SAFE_GLOBAL_NAMES`); any other class is refused, named
in the error.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from ..api import log_report, save_with_options
from ..async_save import AsyncSaveHandle, AsyncSaver
from ..deepspeed_layout import (
    LATEST_UNIVERSAL_NAME,
    load_deepspeed_file,
    read_latest,
    tag_file_records,
    tag_to_load,
    write_latest,
    write_manifest,
)
from ..deepspeed_layout import deepspeed_policy as _layout_policy
from ..delta import ChainPolicy
from ..errors import CheckpointWriteError, UnsafeCheckpointError
from ..incremental import unit_base_of
from ..policy import CodecPolicy
from ..report import SaveReport, merge_reports
from ..saveoptions import SaveOptions
from ..storage import LocalStorage
from ..tiers import Tier, TierCopies
from ..torchload import torch_load_reads_nvc
from .commit import FileRecords, commit_on_every_rank, this_rank, true_on_every_rank
from .loading import failed_on_any_rank
from .options import incremental_files
from .support import check_options

__all__ = [
    "CommitInfo",
    "NvcompCheckpointEngine",
    "attach",
    "attach_once",
    "attach_after",
    "is_deepspeed_engine",
    "deepspeed_policy",
    "deepspeed_torch_load",
]


def deepspeed_policy(policy: CodecPolicy | Mapping[str, Any] | str | None = None) -> CodecPolicy:
    """``policy`` (any form :meth:`CodecPolicy.of` takes) with ``DEEPSPEED_PATTERNS`` under the user's own patterns."""
    return _layout_policy(policy, "attach(policy=...)")


@dataclass(frozen=True)
class CommitInfo:
    """What DeepSpeed's decoupled commit reads of ``get_commit_info()`` (its ``CheckpointCommitInfo``'s fields)."""

    tag: str
    save_dir: str
    save_latest: bool


@dataclass
class _PendingTag:
    """The files one rank saved for the tag being written, until the tag is committed."""

    save_dir: str
    tag: str
    save_latest: bool
    step: int | None = None  # the engine's global step when the save began: the tiers name copies by it
    files: dict[str, str] = field(default_factory=dict)  # absolute path -> name in the tag dir
    handles: list[AsyncSaveHandle] = field(default_factory=list)
    reports: list[SaveReport] = field(default_factory=list)
    # A synchronous file's failure, raised by the commit on every rank: raised here, it would leave
    # the other ranks waiting in the commit's agreement until the backend's timeout.
    failed: list[tuple[str, Exception]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    blocked: float = 0.0  # seconds this rank's save() calls held training


class NvcompCheckpointEngine:
    """A DeepSpeed checkpoint engine with every file written compressed; built by :func:`attach`.

    It implements DeepSpeed's ``CheckpointEngine`` interface (DeepSpeed calls its methods and checks its
    type nowhere), without deriving from DeepSpeed's class: the core imports no framework.

    With ``async_save`` the engine is *decoupled* in DeepSpeed's sense: ``save_checkpoint`` returns once
    each file's snapshot is taken, and DeepSpeed commits the tag at the first optimizer step at which
    every rank's files are durable (or :meth:`wait` does, on every rank).

    Attributes:
        last_report: This rank's :class:`SaveReport` of the last committed tag (its files merged; ``path``
            is the tag folder), ``None`` before one.
        reports: Deprecated: the :class:`SaveReport` of each file of that tag; use ``last_report``.
    """

    def __init__(
        self,
        policy: CodecPolicy | Mapping[str, Any] | str | None = None,
        *,
        async_save: bool = False,
        workers: int | None = None,
        on_commit: Callable[[str, str, list[SaveReport]], None] | None = None,
        tiers: list[Tier] | None = None,
        incremental: bool | ChainPolicy = False,
        full_every: int | None = None,
        delta_base: str | None = None,
        on_saved: Callable[[SaveReport], None] | None = None,
    ) -> None:
        # Checked first: a wrong argument must not leave anything half set up.
        self.tiers: TierCopies | None = None if tiers is None else TierCopies(tiers, "attach")
        self.incremental = incremental_files("attach", incremental, full_every, delta_base)
        self.name = "NvcompCheckpointEngine"
        self.policy = deepspeed_policy(policy)
        self.async_save = async_save
        self.workers = workers
        if on_commit is not None:
            warnings.warn(
                "attach(on_commit=...) is deprecated: pass on_saved=callable(report), called with this rank's report "
                "of the committed tag (report.path is the tag folder)",
                DeprecationWarning,
                stacklevel=3,
            )
        if on_saved is not None and not callable(on_saved):
            raise TypeError(f"attach(on_saved=...) must be callable, got {type(on_saved).__name__}")
        self.on_commit = on_commit
        self.on_saved = on_saved
        self.reports: list[SaveReport] = []
        self.last_report: SaveReport | None = None
        #: Set by attach()'s save_checkpoint for the save under way: the caller's save_latest.
        self.latest_requested: bool | None = None
        self._pending: _PendingTag | None = None
        self._uncommitted: _PendingTag | None = None  # async: saved, waiting for DeepSpeed's commit
        self._saver = AsyncSaver(max_pending=2, report_errors=False, workers=workers, log_saves=False) if async_save else None
        #: Set by attach(): the engine's global step, read when a save begins.
        self.current_step: Callable[[], int | None] = lambda: None

    # -- DeepSpeed's CheckpointEngine interface -------------------------------------------------

    def create(self, info: Any) -> None:
        """Begin the tag ``info`` names (DeepSpeed's ``CheckpointCommitInfo``: ``tag``, ``save_dir``, ``save_latest``)."""
        # An async tag still uncommitted is committed first: every rank is here (save_checkpoint
        # is collective), and two tags' files must never be in flight under one `latest`. Copies to
        # the tiers go on in the background.
        self._commit_in_flight()
        save_latest = info.save_latest if self.latest_requested is None else self.latest_requested
        self._pending = _PendingTag(os.fspath(info.save_dir), str(info.tag), bool(save_latest), self.current_step())

    def save(self, state_dict: Any, path: str) -> None:
        """Write one file of the tag (compressed), or an export outside it (``torch.save``, atomically)."""
        pending = self._pending_for(path)
        path = os.fspath(path)
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(os.path.join(pending.save_dir, pending.tag)):
            # Outside the tag directory DeepSpeed writes exports for other tools (save_16bit_model's
            # pytorch_model.bin, read by from_pretrained): they stay torch.save files, written atomically.
            with LocalStorage().open_write(path) as f:
                torch.save(state_dict, f)
            return
        # incremental: each file is a delta against the same file of the previous tag (a full one every full_every).
        base = None if self.incremental is None else self.incremental.base_for(path, slot=os.path.basename(path))
        started = time.perf_counter()
        try:
            if self._saver is not None:
                pending.handles.append(self._saver.save(state_dict, path, self.policy, workers=self.workers, base=base))
            else:
                options = SaveOptions.of(path, "attach", policy=self.policy, workers=self.workers, base=base)
                pending.reports.append(save_with_options(state_dict, path, options))  # logged per tag, at the commit
        except Exception as exc:  # noqa: BLE001 - raised by the commit, on every rank (see _PendingTag.failed)
            if self.incremental is not None:
                self.incremental.failed(os.path.basename(path), path)
            pending.failed.append((path, exc))
            return
        except BaseException:
            if self.incremental is not None:
                self.incremental.failed(os.path.basename(path), path)
            raise
        pending.files[os.path.abspath(path)] = os.path.basename(path)
        pending.blocked += time.perf_counter() - started

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one file of a tag, ours or DeepSpeed's (:func:`~nvcomp_checkpoint.deepspeed_layout.load_deepspeed_file`)."""
        return load_deepspeed_file(path, map_location)

    def commit(self, info: Any) -> bool:
        """Commit the tag (synchronous saves), or hand it to DeepSpeed's later commit (``async_save``)."""
        pending = self._pending if self._uncommitted is None else self._uncommitted
        if pending is None:
            return True
        if self._saver is not None and pending is self._pending:
            # DeepSpeed's save_checkpoint is done with this tag: DeepSpeed calls commit later.
            self._uncommitted, self._pending = pending, None
            return True
        self._commit(pending)
        return True

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """``os.makedirs``, as DeepSpeed's engines do."""
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether data-parallel rank ``dp_rank`` writes the files one rank writes for all (DeepSpeed's rule: rank 0)."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether tags are committed after ``save_checkpoint`` returns (``async_save``)."""
        return self._saver is not None

    def set_commit_info(self, info: Any) -> None:
        """Part of DeepSpeed's interface; the tag is known from :meth:`create`."""

    def get_commit_info(self) -> CommitInfo | None:
        """The async tag to commit now, once every rank's files are durable (collective); ``None`` before."""
        # DeepSpeed's decoupled commit writes `latest` itself when save_latest is set, with a plain
        # open(): `latest` is ours to write, after the manifest, so DeepSpeed is told not to.
        if self._pending is not None and self._saver is not None:
            self._uncommitted, self._pending = self._pending, None
        if self._uncommitted is None:
            return None
        if not self._written_on_every_rank(self._uncommitted):
            # DeepSpeed asks at every optimizer step: the tag is committed at the first step where
            # every rank's files are durable, so the step never waits for the background writes.
            return None
        return CommitInfo(tag=self._uncommitted.tag, save_dir=self._uncommitted.save_dir, save_latest=False)

    def cleanup(self) -> None:
        """``engine.destroy()``: commit the tag in flight, stop the saver, bring the newest tag to every tier."""
        # engine.destroy() runs on every rank, so the collective commit is safe here.
        self.wait()
        if self._saver is not None:
            self._saver.close()
        if self.tiers is not None:
            # The end of the run: the newest tag reaches every tier whose schedule skipped it.
            self.tiers.wait(final=True)

    def preserves_storage_sharing(self) -> bool:
        """DeepSpeed clones each tensor of a view before saving it, so a file holds only its own bytes."""
        return True

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest tag copied to ``tiers`` that checks, as a local folder (None: no copy; a fresh start).

        Collective (call it on every rank): rank 0 finds the copy (downloading one from an object store
        into ``local_dir``, default ``.nvckpt-restore`` in the working directory) and every rank gets its
        path, so ``local_dir`` must be visible to every rank (one node, or a shared file system). Load it
        with ``engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path))``.

        Raises:
            ValueError: ``attach`` was given no ``tiers``.
        """
        if self.tiers is None:
            raise ValueError("NvcompCheckpointEngine.resume_path(): no tiers; pass attach(engine, tiers=[nc.Tier(...)])")
        found = [self.tiers.resume_path(local_dir) if this_rank() == 0 else None]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return found[0]

    # -- ours ----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Commit the async tag still in flight, if any, then wait for the copies to ``tiers`` (collective: call it on every rank)."""
        self._commit_in_flight()
        if self.tiers is not None:
            self.tiers.wait()

    def _commit_in_flight(self) -> None:
        if self._pending is not None and self._saver is not None and (self._pending.files or self._pending.failed):
            self._uncommitted, self._pending = self._pending, None
        if self._uncommitted is not None:
            self._commit(self._uncommitted)

    def _written_on_every_rank(self, pending: _PendingTag) -> bool:
        """Whether every rank's background writes of ``pending`` are done (failed ones count: the commit reports them).

        Collective: every rank asks at the same optimizer step, so they agree on when to commit.
        """
        return true_on_every_rank(all(handle.done() for handle in pending.handles))

    def _pending_for(self, path: str) -> _PendingTag:
        if self._pending is None:
            # DeepSpeed paths that save without create() (none today): the file's directory is its tag.
            tag_dir = os.path.dirname(os.path.abspath(path))
            self._pending = _PendingTag(os.path.dirname(tag_dir), os.path.basename(tag_dir), False)
        return self._pending

    def _durable(self, pending: _PendingTag) -> FileRecords:
        """This rank's part of the commit: its files durable, and their records; raises naming the first file that failed."""
        failed = list(pending.failed)
        for handle in pending.handles:
            exc = handle.exception()
            if exc is None:
                pending.reports.append(handle.result())
            elif isinstance(exc, Exception):
                failed.append((handle.path, exc))
            else:
                raise exc
        if failed:
            path, exc = failed[0]
            raise CheckpointWriteError(f"{path}: {type(exc).__name__}: {exc}") from exc
        return tag_file_records(pending.files)  # each rank records its own files: rank 0 may not see them

    def _commit(self, pending: _PendingTag) -> None:
        """Commit ``pending`` on every rank (:func:`~.commit.commit_on_every_rank`): the manifest, then ``latest``."""
        tag_dir = os.path.join(pending.save_dir, pending.tag)

        def finalize(records: FileRecords, world_size: int) -> None:
            if records:  # nothing of the tag's own (save_16bit_model): no tag to commit
                write_manifest(tag_dir, pending.tag, world_size, records)
                if pending.save_latest:
                    write_latest(pending.save_dir, pending.tag)

        try:
            records = commit_on_every_rank(f"{tag_dir} (tag {pending.tag!r})", lambda: self._durable(pending), finalize)
        except CheckpointWriteError:
            if self.incremental is not None:
                self.incremental.failed()  # the next save is a full one
            raise
        finally:
            if self._pending is pending:
                self._pending = None
            if self._uncommitted is pending:
                self._uncommitted = None
        if self.tiers is not None and this_rank() == 0 and records and pending.step is not None:
            # The committed tag is a folder unit of tier 0 (the save dir); a delta tag is adopted with its base tag.
            base = None if self.incremental is None else unit_base_of(tag_dir)
            self.tiers.adopt(pending.step, tag_dir, base)
        self.reports = pending.reports
        if pending.reports:  # one line per tag and rank, as every entry point logs one per checkpoint
            self.last_report = merge_reports(tag_dir, pending.reports, time.perf_counter() - pending.started, pending.blocked)
            log_report(self.last_report)
            if self.on_saved is not None:
                self.on_saved(self.last_report)
        if self.on_commit is not None:
            self.on_commit(pending.save_dir, pending.tag, pending.reports)


def attach(
    engine: Any,
    *,
    policy: CodecPolicy | Mapping[str, Any] | str | None = None,
    async_save: bool = False,
    workers: int | None = None,
    on_commit: Callable[[str, str, list[SaveReport]], None] | None = None,
    tiers: list[Tier] | None = None,
    incremental: bool | ChainPolicy = False,
    full_every: int | None = None,
    delta_base: str | None = None,
    leader_load: bool = False,
    on_saved: Callable[[SaveReport], None] | None = None,
) -> NvcompCheckpointEngine:
    """Make ``engine`` (a ``deepspeed.DeepSpeedEngine``) save compressed checkpoints and load ours and plain ones.

    Call it on every rank after ``deepspeed.initialize``. ``engine.save_checkpoint(dir, tag)`` then
    keeps DeepSpeed's file names and ``latest``; ``latest`` names a tag only once every rank's files
    of it are durable. ``save_latest=False`` still commits the tag (its manifest), without ``latest``.

    Args:
        engine: The DeepSpeed engine.
        policy: Codec settings (see :meth:`CodecPolicy.of`); ``DEEPSPEED_PATTERNS`` classify the
            flat fp32 master partitions as weights under the user's own ``patterns``.
        async_save: Snapshot each file and write it in the background; the tag is committed at the
            first optimizer step at which every rank's files are durable (a step never waits for the
            writes), or by the next ``save_checkpoint``, ``engine.destroy()`` or
            ``NvcompCheckpointEngine.wait()`` (all collective), which wait for them.
        workers: Compression threads per rank (default: every core).
        on_commit: Deprecated: called on every rank as ``on_commit(save_dir, tag, reports)`` once a tag is
            committed; use ``on_saved``.
        tiers: :class:`~nvcomp_checkpoint.Tier` s each committed tag is copied to (by rank 0, in the
            background, named by the engine's global step at the save); the save folder is tier 0.
            ``NvcompCheckpointEngine.resume_path()`` finds the newest copy that checks (a fresh node).
        incremental: Each file of a tag is saved as a delta against the same file of the previous tag
            this process saved, a full tag every ``full_every`` (default 10) tags; ``delta_base``:
            ``"previous"`` (default) or ``"full"``; or a :class:`~nvcomp_checkpoint.ChainPolicy` saying both. A delta tag
            needs its base tags: remove a tag only when no kept tag is a delta against it.
        on_saved: Called on every rank with that rank's :class:`SaveReport` of a tag once the tag is committed
            (``report.path`` is the tag folder), as every entry point's ``on_saved``; also ``engine.last_report``.
        leader_load: Refused: every rank of a ZeRO run reads its own partition file, so there is no
            file one rank could read for the others (see docs/deepspeed.md).

    Raises:
        ValueError: ``leader_load=True``, or an invalid ``tiers`` / ``full_every``.

    Returns:
        The installed :class:`NvcompCheckpointEngine` (``engine.checkpoint_engine``).
    """
    check_options("DeepSpeed", "attach", leader_load=leader_load)
    old = getattr(engine, "checkpoint_engine", None)
    if old is not None and getattr(old, "is_decoupled", lambda: False)():
        raise ValueError(
            f"attach(): the engine already has a decoupled checkpoint engine ({type(old).__name__}) with saves in flight; attach before saving"
        )
    ours = NvcompCheckpointEngine(
        policy,
        async_save=async_save,
        workers=workers,
        on_commit=on_commit,
        tiers=tiers,
        incremental=incremental,
        full_every=full_every,
        delta_base=delta_base,
        on_saved=on_saved,
    )
    ours.current_step = lambda: getattr(engine, "global_steps", None)
    engine.checkpoint_engine = ours
    original = engine.save_checkpoint

    def save_checkpoint(
        save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None, save_latest: bool = True, **kwargs: Any
    ) -> bool:
        # DeepSpeed writes `latest` with a plain open() right after commit(), on rank 0 alone: a kill
        # then leaves it empty or truncated. Ours is written by the commit, atomically, once every
        # rank's files are durable; DeepSpeed is told not to write it.
        ours.latest_requested = save_latest
        try:
            return original(save_dir, tag, client_state={} if client_state is None else client_state, save_latest=False, **kwargs)
        finally:
            ours.latest_requested = None

    save_checkpoint.__doc__ = original.__doc__
    engine.save_checkpoint = save_checkpoint
    _check_latest_on_load(engine)
    _load_through_hook(engine)
    return ours


def _check_latest_on_load(engine: Any) -> None:
    """Make ``engine.load_checkpoint(dir)`` read ``latest`` under the rule for paths read from files, and fail on every rank if it fails on any.

    DeepSpeed joins the tag ``latest`` names to the folder as written: ``../other_run/g4`` or an
    absolute path would load another run's tag. The tag is read here (a tag folder of ``dir``, or
    :class:`UnsafePathError`) and handed to DeepSpeed by name; a tag (``latest``'s or the caller's)
    whose folder is missing is :class:`DeepSpeedTagNotFoundError`, naming the tags that are there.
    """
    original = getattr(engine, "load_checkpoint", None)
    if original is None:
        return  # an object with DeepSpeed's save interface only: there is no load to guard

    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(engine, "load_universal_checkpoint", lambda: False)():
            if tag is None:  # a universal checkpoint has its own pointer
                tag = read_latest(load_dir, LATEST_UNIVERSAL_NAME)
        else:
            # A tag that is not there (`latest` naming a removed tag) is named with the fix, on every rank,
            # before DeepSpeed fails on a bare assertion.
            tag = tag_to_load(load_dir, tag)
        # Each rank reads and checks its own files (its ZeRO partition): a damaged or swapped rank-1 file
        # fails rank 1 alone, and a resume that falls back on the error would train the ranks from
        # different steps. The load-side twin of the commit makes every rank raise, naming the rank and file.
        return failed_on_any_rank(lambda: original(load_dir, tag, *args, **kwargs), os.path.join(load_dir, str(tag)))

    load_checkpoint.__doc__ = original.__doc__
    engine.load_checkpoint = load_checkpoint


# -- DeepSpeed's own torch.load of our files ----------------------------------------------------
# DeepSpeed reads most files through engine.checkpoint_engine.load, but some with torch.load itself:
# ZeRO-3's load_checkpoint(load_optimizer_states=False) calls zero_to_fp32, and so do the zero_to_fp32
# script, ds_to_universal and the universal loader. There a scope of the core's torch.load hook reads
# our files as the engine does: DeepSpeed's allow-list, the tag's manifest checked.


@contextlib.contextmanager
def deepspeed_torch_load() -> Iterator[None]:
    """While the block runs, DeepSpeed's ``torch.load`` of one of our files reads it (this thread only).

    For DeepSpeed's functions that open rank files themselves::

        with deepspeed_torch_load():
            state = get_fp32_state_dict_from_zero_checkpoint("ckpt")

    Our files are read as the attached engine reads them (:func:`load_deepspeed_file`: weights-only,
    ``DEEPSPEED_SAFE_GLOBALS`` allowed, the tag's manifest checked), whatever ``weights_only``
    DeepSpeed passes; plain files go to ``torch.load`` unchanged. For DeepSpeed's scripts, ``nvckpt run``.
    """
    with torch_load_reads_nvc(loader=_load_for_deepspeed):
        yield


def _load_for_deepspeed(path: str, map_location: Any) -> Any:
    try:
        return load_deepspeed_file(path, map_location)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{exc} (DeepSpeed read this nvcomp-checkpoint file through the torch.load hook, which allows "
            "DeepSpeed's own classes and keeps weights-only rules for the rest, whatever weights_only DeepSpeed "
            "passes: if you trust the file, allow the class with torch.serialization.add_safe_globals([...]) "
            "before the call)"
        ) from exc


def _load_through_hook(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` run inside :func:`deepspeed_torch_load` (every load form reads our files)."""
    original = getattr(engine, "load_checkpoint", None)
    if original is None:
        return  # an object with DeepSpeed's save interface only: there is no load to hook

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with deepspeed_torch_load():
            return original(*args, **kwargs)

    load_checkpoint.__doc__ = original.__doc__
    engine.load_checkpoint = load_checkpoint


# -- attaching to the engines a framework creates ------------------------------------------------
# Accelerate, the HF Trainer and Lightning create their DeepSpeed engines inside their own calls
# (Accelerator.prepare, DeepSpeedStrategy.init_deepspeed), and load a checkpoint right after; the
# integrations attach there through these two functions, so all three attach the same way.


def attach_once(engine: Any, **options: Any) -> NvcompCheckpointEngine:
    """:func:`attach` unless ``engine`` already saves through an :class:`NvcompCheckpointEngine`; returns that engine.

    Frameworks call save and load many times on one engine; attaching again would wrap
    ``save_checkpoint`` twice and drop the engine of the first attach.
    """
    current = getattr(engine, "checkpoint_engine", None)
    if isinstance(current, NvcompCheckpointEngine):
        return current
    return attach(engine, **options)


def is_deepspeed_engine(obj: Any) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine`` (what ``deepspeed.initialize`` returns).

    DeepSpeed is not imported: where its engine module is not loaded, no object is one of its engines.
    """
    module = sys.modules.get("deepspeed.runtime.engine")
    engine_class = getattr(module, "DeepSpeedEngine", None)
    return isinstance(engine_class, type) and isinstance(obj, engine_class)


def attach_after(owner: Any, method: str, engines: Callable[[], Iterable[Any]], **options: Any) -> Callable[[], None]:
    """Attach to each DeepSpeed engine ``engines()`` yields, now and after every call of ``owner.<method>``.

    ``owner.<method>`` is where a framework creates its engines (``Accelerator.prepare``): wrapping
    it attaches before anything the framework does next, such as the HF Trainer's resume, which
    loads the DeepSpeed checkpoint right after ``prepare``, before any callback runs.

    Args:
        owner: The object whose method creates the engines.
        method: The method's name; it is replaced by a wrapper on ``owner`` itself.
        engines: Lists the objects to attach to; those that are not DeepSpeed engines are skipped.
        **options: :func:`attach`'s keyword arguments.

    Returns:
        A function that puts ``owner.<method>`` back (the engines stay attached).
    """

    def attach_all() -> None:
        for engine in engines():
            if is_deepspeed_engine(engine):
                attach_once(engine, **options)

    inner = getattr(owner, method)
    had_own = method in vars(owner)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = inner(*args, **kwargs)
        attach_all()
        return result

    setattr(owner, method, wrapper)
    attach_all()

    def restore() -> None:
        if vars(owner).get(method) is wrapper:
            if had_own:
                setattr(owner, method, inner)
            else:
                delattr(owner, method)

    return restore
