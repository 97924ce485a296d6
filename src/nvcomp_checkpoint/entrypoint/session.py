"""The checkpoint session every framework integration holds: one owner of "what a checkpoint is".

An integration (Lightning's ``NvcompCheckpointIO``, Accelerate's hooks, the Trainer's callback) holds a
:class:`CheckpointSession` by composition, as Lightning's ``_WrappingCheckpointIO`` holds its
``checkpoint_io``, and keeps only what its framework needs. The session owns the sequence of saves
(synchronous or ``async_save``), the background errors, the copies to the tiers, the ``incremental``
bookkeeping and the one order in which an old checkpoint is removed. Its options are one frozen value,
:class:`SessionOptions`, converted and checked in one place.

A checkpoint goes through the session as::

    group = session.begin(path, started, after)      # or session.checkpoint(path, started, after, hand_over)
    session.add_file(group, "model", state, path, session.save_options(path))
    session.seal(group)                               # durable now, or once the background parts are
    ...
    session.remove(old_path, delete)                  # after the saves, deltas and copies that need it
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import IO, Any, Callable, Generic, Mapping, TypeVar, overload

from ..api import save_with_options
from ..deadline import Deadline
from ..delta import ChainPolicy, chain_policy_of
from ..incremental import IncrementalFiles, unit_base_of
from ..policy import CodecPolicy
from ..report import SaveReport
from ..savegroup import SavedCallback, SaveGroup, SaveSequence
from ..saveoptions import SaveOptions
from ..tiers import Tier, TierCopies

__all__ = ["CheckpointSession", "SessionOptions", "SessionView"]

_LOG = logging.getLogger("nvcomp_checkpoint")
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionOptions:
    """The options every entry point takes, converted and checked once (:meth:`of`).

    Attributes:
        policy: Codec settings per component; the default is portable (zstd over byte planes),
            loadable without a GPU.
        workers: Compression threads per file (``None``: every core).
        async_save: Write in the background: the save returns once the state is copied (a
            snapshot, or the framework's own files on disk); the checkpoint appears only once complete
            and durable. A background failure is raised by the next save, load, ``wait``, or the
            end of the run, whichever comes first, and only once.
        on_saved: Called with the :class:`~nvcomp_checkpoint.SaveReport` of each save once it is
            durable (with ``async_save``, on the background thread; it must not call ``wait``).
        stream_wrapper: Wraps each compressed file's output stream (throttling, byte counting ...);
            its ``write`` must pass every byte on, in order.
        tiers: :class:`~nvcomp_checkpoint.Tier` s to copy each durable checkpoint to (a shared file
            system, an object store), each on its own schedule and with its own retention. Where the
            framework writes its checkpoints is tier 0, rotated by the framework; copies run in the
            background, named by the checkpoint's step, and ``resume_path`` is the newest that checks.
            With ``incremental``, a delta is copied after the part of its chain a tier lacks, and tier
            retention keeps the bases of the deltas it keeps.
        max_pending: With ``async_save``, saves that may be in flight at once; the next waits for a slot.
        incremental: Each save a delta against an earlier one (a :class:`~nvcomp_checkpoint.ChainPolicy`),
            or ``None``: every save in full. ``incremental=True, full_every=N, delta_base=...`` and
            ``incremental=ChainPolicy(...)`` are one spelling once converted.
    """

    policy: CodecPolicy = dataclasses.field(default_factory=CodecPolicy)
    workers: int | None = None
    async_save: bool = False
    on_saved: SavedCallback | None = None
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None
    tiers: tuple[Tier, ...] | None = None
    max_pending: int = 1
    incremental: ChainPolicy | None = None

    @classmethod
    def of(
        cls,
        label: str,
        policy: CodecPolicy | Mapping[str, Any] | str | None = None,
        *,
        workers: int | None = None,
        async_save: bool = False,
        on_saved: SavedCallback | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        tiers: list[Tier] | tuple[Tier, ...] | None = None,
        max_pending: int = 1,
        incremental: bool | ChainPolicy = False,
        full_every: int | None = None,
        delta_base: str | None = None,
    ) -> SessionOptions:
        """The options as a user gives them to entry point ``label``, converted and checked.

        Raises:
            TypeError, ValueError: an option of the wrong type or value, named with ``label``.
        """
        converted = CodecPolicy.of(policy, f"{label}(policy=...)")
        SaveOptions(policy=converted, workers=workers)  # checks workers now, not at the first save
        if tiers is not None and not isinstance(tiers, (list, tuple)):
            TierCopies(tiers, label)  # its TypeError names the fix (one Tier: "wrap it in [...]")
        return cls(
            policy=converted,
            workers=workers,
            async_save=bool(async_save),
            on_saved=on_saved,
            stream_wrapper=stream_wrapper,
            tiers=None if tiers is None else tuple(tiers),
            max_pending=max_pending,
            incremental=chain_policy_of(incremental, full_every, delta_base, label),
        )


class CheckpointSession:
    """The saves, tier copies, ``incremental`` chains and removals of one entry point.

    Args:
        label: What the user called (``NvcompCheckpointIO``, ``register_nvcomp_hooks`` ...), named in errors.
        options: The entry point's :class:`SessionOptions`.
        log_as: The verb of the one log line per checkpoint ("saved", "save_state").
        tiers_hint: How the user passes tiers, for the error of ``resume_path`` without them.
        incremental_options: Keyword arguments of :class:`~nvcomp_checkpoint.incremental.IncrementalFiles`
            (``can_be_base``, ``storage_options``) when ``options.incremental`` is set.

    Attributes:
        options: The :class:`SessionOptions`.
        last_report: The :class:`~nvcomp_checkpoint.SaveReport` of the most recent durable save
            (``None`` before one); ``seconds_blocked`` is the time the save held training,
            ``seconds`` the time until it was durable. ``last_report.table()`` prints it.
        tiers: The copies to ``options.tiers`` (None without tiers).
        incremental: The ``incremental`` bookkeeping, or None.
    """

    def __init__(
        self,
        label: str,
        options: SessionOptions,
        *,
        log_as: str = "saved",
        tiers_hint: str | None = None,
        incremental_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(options, SessionOptions):
            raise TypeError(f"{label}: CheckpointSession takes SessionOptions, got {type(options).__name__}")
        # Checked first: a wrong argument must not leave anything half set up.
        self.tiers: TierCopies | None = None if options.tiers is None else TierCopies(list(options.tiers), label)
        # Checks max_pending; runs every on_saved callback and owns every background error.
        self._saves = SaveSequence(
            label, max_pending=options.max_pending, workers=options.workers, on_saved=options.on_saved, log_as=log_as
        )
        self.incremental: IncrementalFiles | None = (
            None
            if options.incremental is None
            else IncrementalFiles(label, options.incremental, **dict(incremental_options or {}))
        )
        self.options = options
        self.label = label
        self._tiers_hint = tiers_hint or f"{label}(tiers=[nc.Tier(...)])"

    @property
    def policy(self) -> CodecPolicy:
        return self.options.policy

    @property
    def async_save(self) -> bool:
        return self.options.async_save

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
        self.wait_for_saves("wait()", timeout=deadline.left())
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
            raise ValueError(f"{self.label}.resume_path(): no tiers; pass {self._tiers_hint}")
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
            self.raise_errors(when)
        if self.tiers is not None:
            try:
                # The end of the run: the newest step reaches every tier whose schedule skipped it.
                self.tiers.wait(final=True)
            except Exception as exc:  # noqa: BLE001 - the first error stays visible
                if not propagating:
                    raise
                _LOG.error("a checkpoint copy to a tier failed: %s", exc)

    # -- what the integrations call -----------------------------------------------------------
    def wait_for_saves(self, when: str, consequence: str = "", timeout: float | None = None) -> None:
        """Wait for the pending saves (not the tier copies) and raise a failure, naming ``when``."""
        self._saves.wait(timeout)
        self.raise_errors(when, consequence)

    def settle(self) -> None:
        """Wait for the pending saves; a failure stays for the next call that reports errors."""
        self._saves.wait()

    def raise_errors(self, when: str, consequence: str = "") -> None:
        """Raise the oldest failure of a background save nobody was told of yet (once), naming ``when``."""
        self._saves.raise_errors(when, consequence)

    def failed_save_info(self) -> Mapping[str, Any] | None:
        """The ``info`` given to :meth:`checkpoint` of the oldest failed save not yet reported (None: none)."""
        failed = self._saves.failed_group()
        return None if failed is None else failed.info

    def wait_for_slot(self) -> None:
        """Back-pressure: wait until fewer than ``max_pending`` saves are in flight."""
        self._saves.wait_for_slot()

    def after_durable(self, step: int | None, path: str | os.PathLike[str], *more: SavedCallback) -> list[SavedCallback]:
        """What runs once a save of ``step`` at ``path`` is durable: ``more``, then the copy to the tiers."""
        if self.tiers is None or step is None:
            return list(more)
        tiers, incremental = self.tiers, self.incremental

        def adopt(report: SaveReport) -> None:
            # A delta is adopted with its base (read from the file): the tiers copy its chain first.
            base = None if incremental is None else unit_base_of(os.fspath(path), incremental.storage_options)
            tiers.adopt(step, path, base)

        return [*more, adopt]

    def saved(self, report: SaveReport, after: list[SavedCallback]) -> None:
        """A synchronous save is durable: record it and run its callbacks."""
        self._saves.notify(report, after)

    def begin(self, path: Any, started: float, after: list[SavedCallback], **fields: Any) -> SaveGroup:
        """Begin a checkpoint at ``path`` as one group of parts (``fields``: of :meth:`SaveSequence.begin`)."""
        return self._saves.begin(path, started=started, notify=after, **fields)

    def seal(self, group: SaveGroup, *, background: bool = True) -> SaveReport | None:
        """No more parts: ``group`` completes now, or once its last background part is durable.

        ``background=False``: wait for the group and return its report (or raise its error).
        """
        group.blocked = time.perf_counter() - group.started if background else 0.0
        self._saves.seal(group)
        return None if background else self._saves.result(group)

    def abandon(self, group: SaveGroup) -> None:
        """Parts already added finish; nothing of ``group`` is committed."""
        self._saves.abandon(group)

    def checkpoint(
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
        group = self.begin(path, started, after, **fields)
        try:
            hand_over(group)
        except BaseException:
            self.abandon(group)
            raise
        return self.seal(group, background=background)

    def save_options(
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
            policy=self.options.policy if policy is None else policy,
            metadata=metadata,
            storage_options=storage_options,
            workers=self.options.workers,
            stream_wrapper=self.options.stream_wrapper,
            base=base,
        )

    def save_now(self, obj: Any, path: Any, options: SaveOptions) -> SaveReport:
        """``obj`` saved to ``path`` in the caller's thread (hand the report to :meth:`saved` or a group)."""
        return save_with_options(obj, path, options)

    def add_file(self, group: SaveGroup, name: str, obj: Any, path: Any, options: SaveOptions) -> None:
        """Part ``name`` of ``group``: ``obj`` saved to ``path`` in the background (``options``: from :meth:`save_options`)."""
        self._saves.save(group, name, obj, path, options)

    def add_job(self, group: SaveGroup, name: str, job: Callable[[], SaveReport]) -> None:
        """Part ``name`` of ``group``: ``job`` run on the background thread (a conversion), its report the part's."""
        self._saves.run(group, name, job)

    def remove(self, path: str | os.PathLike[str], delete: Callable[[str], None]) -> None:
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


class SessionView(Generic[_T]):
    """A read-only attribute of an entry point that is its session's, declared in one line::

        class NvcompCheckpointIO(CheckpointIO):
            policy = SessionView[CodecPolicy]("options.policy")
            tiers = SessionView[TierCopies | None]("tiers")

    reads ``self.session.options.policy`` / ``self.session.tiers``. Setting it raises ``AttributeError``:
    the options are frozen when the session is built.
    """

    def __init__(self, path: str) -> None:
        self._path = tuple(path.split("."))
        self.__doc__ = f"The session's ``{path}`` (read-only)."

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> SessionView[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value: Any = obj.session  # type: ignore[attr-defined]
        for part in self._path:
            value = getattr(value, part)
        return value

    def __set__(self, obj: object, value: Any) -> None:
        raise AttributeError(
            f"{type(obj).__name__}.{getattr(self, '_name', self._path[-1])} is read-only: it is the session's "
            f"{'.'.join(self._path)}, fixed when the entry point is made; pass it there"
        )
