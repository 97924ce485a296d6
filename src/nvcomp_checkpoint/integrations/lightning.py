"""Lightning integration: a ``CheckpointIO`` plugin that writes compressed checkpoints.

``Trainer(plugins=[NvcompCheckpointIO()])`` and ``Fabric(plugins=[NvcompCheckpointIO()])`` save
every checkpoint with :func:`nvcomp_checkpoint.save` (or, with ``async_save=True``, snapshot it and
write it in the background) and load with :func:`nvcomp_checkpoint.load`; the
``NvcompCheckpointMetrics`` callback sends each save's sizes, ratios and times to the Trainer's loggers.
"""

from __future__ import annotations

import collections
import inspect
import io
import os
import sys
import time
import weakref
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
from typing_extensions import override

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import ChainPolicy, CodecPolicy, SaveReport
from nvcomp_checkpoint.async_save import wait_for_path
from nvcomp_checkpoint.credentials import StorageOptions
from nvcomp_checkpoint.entrypoint import (
    POLICY_OPTION_KEYS,
    CheckpointSession,
    SessionOptions,
    SessionView,
    checked_on_every_rank,
    load_as_torch,
    policy_and_metadata,
    report_metrics,
)
from nvcomp_checkpoint.incremental import IncrementalFiles
from nvcomp_checkpoint.savegroup import SavedCallback
from nvcomp_checkpoint.saveoptions import SaveOptions
from nvcomp_checkpoint.storage import storage_for
from nvcomp_checkpoint.tiers import Tier, TierCopies
from nvcomp_checkpoint.version import install_hint

if TYPE_CHECKING:  # checked against the unified package; the standalone ones have the same classes
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
else:
    try:  # the unified package: `lightning.pytorch.Trainer` and `lightning.fabric.Fabric`
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    except ImportError:  # pragma: no cover - only the standalone packages are installed
        try:
            from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        except ImportError as exc:
            raise ImportError(f"nvcomp_checkpoint.lightning needs Lightning: {install_hint('lightning')}") from exc

    try:  # the Trainer's callbacks; Fabric-only installs have no `lightning.pytorch`
        from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    except ImportError:  # pragma: no cover
        try:
            from pytorch_lightning.callbacks import Callback, ModelCheckpoint
        except ImportError:
            Callback = ModelCheckpoint = object

__all__ = [
    "NvcompCheckpointIO",
    "NvcompCheckpointMetrics",
    "NvcompModelCheckpoint",
    "NvcompModelCheckpointMixin",
    "NvcompStrategyCheck",
    "strategy_check_callbacks",
    "load_from_checkpoint",
    "STORAGE_OPTION_KEYS",
    "report_metrics",
]

#: Keys accepted in ``storage_options`` of a single save: a whole ``policy``, any
#: :class:`CodecPolicy` field (``exp_avg``, ``overrides`` ...) applied on top of it, and
#: ``metadata`` stored in the file's index.
STORAGE_OPTION_KEYS = POLICY_OPTION_KEYS

_LIGHTNING_HINT = (
    " With Lightning, pass weights_only=False to trainer.fit/validate/test(ckpt_path=...), "
    "fabric.load(...) or load_from_checkpoint(...)."
)


def _storage_as_loaded(storage: Any, location: str) -> Any:
    """Lightning's default ``map_location`` for plain files: every tensor stays where
    ``torch.load`` put it, on the CPU (so a file saved on a GPU loads on a CPU-only machine)."""
    return storage


#: The tag Lightning's ``DeepSpeedStrategy`` saves every checkpoint folder's files under (``<path>/checkpoint/``).
DEEPSPEED_TAG = "checkpoint"


def _not_last(path: str) -> bool:
    # ModelCheckpoint rewrites last.ckpt in place: a delta against it would lose its base. A rank file of a
    # DeepSpeed checkpoint (<path>/checkpoint/<file>) is named by its checkpoint folder.
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    name = parts[-3] if len(parts) >= 3 and parts[-2] == DEEPSPEED_TAG else parts[-1]
    return not name.startswith(getattr(ModelCheckpoint, "CHECKPOINT_NAME_LAST", None) or "last")


class NvcompCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints compressed, per component (weights, optimizer moments ...).

    One class serves both ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``, and can be
    wrapped in Lightning's ``AsyncCheckpointIO``. It loads plain ``torch.save`` checkpoints
    too, so a run that adds the plugin resumes from its old ``.ckpt`` files.

    With ``async_save=True``, saves are snapshotted and written in the background, and
    :meth:`remove_checkpoint` (``ModelCheckpoint``'s top-k rotation) waits until the saves before it
    are durable, skipped if one failed: the run always keeps a complete checkpoint. Use it instead
    of Lightning's ``AsyncCheckpointIO`` (issue 14035). Design: ``docs/lightning.md``.

    The saves, their background errors, the copies to the tiers, the ``incremental`` chains and the
    order of removals belong to :attr:`session` (a :class:`~nvcomp_checkpoint.entrypoint.CheckpointSession`,
    held as Lightning's ``_WrappingCheckpointIO`` holds its ``checkpoint_io``); this class is Lightning's
    interface to it. Our strategies (``NvcompDeepSpeedStrategy``, ``NvcompModelParallelStrategy``) save
    through the same session.

    Args:
        policy, workers, async_save, max_pending, on_saved, stream_wrapper, tiers: As for every
            integration (:class:`nvcomp_checkpoint.entrypoint.SessionOptions`). ``on_saved`` is the
            "checkpoint finished" hook of Lightning issue 19414. ``ModelCheckpoint``'s folder is tier 0,
            with its own top-k; copies are named by the checkpoint's ``global_step``, and
            ``trainer.fit(ckpt_path=plugin.resume_path())`` resumes on a fresh node.
        fsspec_options: Options for fsspec when paths are URLs (credentials, endpoint ...).
        incremental: Save each checkpoint as a delta against the previous one this process saved
            (a full one every ``full_every``; ``last.ckpt``, rewritten in place, is never a base).
            :meth:`remove_checkpoint` keeps a file that a kept delta needs until that delta is removed.
            With ``tiers``, a delta reaches a tier after its chain and ``resume_path(local_dir)`` lays it
            out there with its chain.
            ``True`` (with ``full_every`` and ``delta_base``) or a :class:`~nvcomp_checkpoint.ChainPolicy`.
        full_every, delta_base: With ``incremental=True``: as for :class:`~nvcomp_checkpoint.ChainPolicy`
            (``full_every`` default 10, ``delta_base`` ``"previous"`` (default) or ``"full"``); refused
            together with a ``ChainPolicy``, which holds both.
        leader_load: On resume of replicated (DDP) state, one rank per node reads the checkpoint
            and sends it to the node's other ranks over the process group
            (:func:`nvcomp_checkpoint.load_broadcast`), instead of every rank fetching the same
            bytes from object storage or a shared file system. Every rank must load together, as
            ``trainer.fit/validate/test(ckpt_path=...)`` and ``fabric.load`` do; tensors arrive on
            the CPU unless ``map_location`` names a device. Before that collective the ranks agree on
            their own checks: if one fails (a background save that failed, the file missing on one
            node), every rank raises instead of waiting. Sharded strategies read their own shards.

    Attributes:
        session: The :class:`~nvcomp_checkpoint.entrypoint.CheckpointSession` every save goes through.
        last_report: The :class:`SaveReport` of the most recent completed save (``None`` before one);
            ``plugin.last_report.table()`` prints what each component took.

    Example:
        >>> plugin = NvcompCheckpointIO(async_save=True, on_saved=lambda r: print("durable:", r.path))
        >>> trainer = Trainer(plugins=[plugin], callbacks=[NvcompCheckpointMetrics()])
        >>> trainer.save_checkpoint("x.ckpt", storage_options={"weights": {"codec": "zstd", "level": 3}})
    """

    def __init__(
        self,
        policy: CodecPolicy | Mapping[str, Any] | None = None,
        *,
        workers: int | None = None,
        fsspec_options: dict[str, Any] | None = None,
        async_save: bool = False,
        max_pending: int = 1,
        on_saved: SavedCallback | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        tiers: list[Tier] | None = None,
        incremental: bool | ChainPolicy = False,
        full_every: int | None = None,
        delta_base: str | None = None,
        leader_load: bool = False,
    ) -> None:
        CheckpointIO.__init__(self)
        options = SessionOptions.of(
            "NvcompCheckpointIO",
            policy,
            workers=workers,
            async_save=async_save,
            on_saved=on_saved,
            stream_wrapper=stream_wrapper,
            tiers=tiers,
            max_pending=max_pending,
            incremental=incremental,
            full_every=full_every,
            delta_base=delta_base,
        )
        self.session = CheckpointSession(
            "NvcompCheckpointIO",
            options,
            # A DeepSpeed checkpoint folder ModelCheckpoint removes waits for the kept deltas that need it.
            incremental_options={
                "storage_options": fsspec_options or None,
                "can_be_base": _not_last,
                "keep_needed_folders": True,
            },
        )
        self.leader_load = leader_load
        _register_with_standalone_packages()
        self.fsspec_options = StorageOptions(fsspec_options or {})  # credentials out of its repr
        self._listeners: list[Callable[[SaveReport, dict[str, Any]], None]] = []
        _LIVE_PLUGINS.add(self)
        #: Set by teardown (the end of fit/validate/test), cleared when the next run sets up: a save
        #: between runs (``trainer.save_checkpoint`` after ``fit``) has no training to overlap and
        #: nothing to stop a writer thread after it, so it is written at once.
        self._between_runs = False
        #: Set by a strategy whose checkpoints are committed collectively (``NvcompDeepSpeedStrategy``): commits
        #: the checkpoint in flight, so that :meth:`wait` does not wait for an optimizer step that never comes.
        self.commit_in_flight: Callable[[], None] | None = None

    # -- the session's options and state, as this class has always offered them ------------------
    policy = SessionView[CodecPolicy]("options.policy")
    workers = SessionView[int | None]("options.workers")
    async_save = SessionView[bool]("options.async_save")
    max_pending = SessionView[int]("options.max_pending")
    on_saved = SessionView[SavedCallback | None]("options.on_saved")
    stream_wrapper = SessionView[Callable[[IO[bytes]], IO[bytes]] | None]("options.stream_wrapper")
    tiers = SessionView[TierCopies | None]("tiers")
    incremental = SessionView[IncrementalFiles | None]("incremental")
    last_report = SessionView[SaveReport | None]("last_report")

    def pending(self) -> int:
        """Saves not yet durable (0 without ``async_save``)."""
        return self.session.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save (and copy to ``tiers``) is durable; raise the first background failure.

        With ``NvcompDeepSpeedStrategy`` the checkpoint in flight is committed first, on every rank
        together: call it on every rank.

        Raises:
            nvcomp_checkpoint.errors.CheckpointWriteError: A background save failed; what it would
                have replaced is untouched.
            TimeoutError: Saves still pending after ``timeout`` seconds (``None``: no limit).
        """
        if self.commit_in_flight is not None:
            self.commit_in_flight()
        self.session.wait(timeout)

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest checkpoint copy on ``tiers`` that checks (every file), or ``None`` (a fresh start).

        For ``trainer.fit(ckpt_path=plugin.resume_path())`` on a fresh node, where tier 0 is gone; see
        :meth:`CheckpointSession.resume_path`. A delta is laid out with its chain into ``local_dir``
        (default ``.nvckpt-restore``): under several ranks of one node, give each its own.

        Raises:
            ValueError: No ``tiers`` were given.
        """
        return self.session.resume_path(local_dir)

    def close(self, when: str) -> None:
        """Wait for pending saves and copies, stop the background threads, raise a failure (``when`` names it)."""
        self.session.close(when)

    def after_durable(self, checkpoint: Mapping[str, Any], path: Any, *, copy: bool = True) -> list[SavedCallback]:
        """What runs once a checkpoint a strategy writes itself is durable at ``path``: ``NvcompCheckpointMetrics``
        gets its report, and (``copy``) the tiers a copy of ``path`` named by its ``global_step``."""
        info = _counters(checkpoint)
        return self.session.after_durable(
            info.get("global_step") if copy else None, path, lambda r: self._tell_listeners(r, info)
        )

    def policy_for(self, storage_options: Optional[Any]) -> tuple[CodecPolicy, dict[str, Any] | None]:
        """The policy and index metadata of one save, given Lightning's ``storage_options``.

        Raises:
            TypeError: ``storage_options`` is not a dict.
            ValueError: it has keys this plugin does not know, or invalid values.
        """
        return policy_and_metadata(storage_options, self.policy, "NvcompCheckpointIO")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path``, compressed; the file appears only once complete.

        With ``async_save``, returns once the checkpoint is snapshotted (after waiting for a free
        slot, see ``max_pending``); the file appears when the background write is durable.

        Args:
            checkpoint: The checkpoint dict Lightning built (or the state given to ``fabric.save``).
            path: Local path or fsspec URL.
            storage_options: Per-save settings: ``{"policy": CodecPolicy(...)}``, any
                :class:`CodecPolicy` field (``{"exp_avg": "zstd"}``), ``{"metadata": {...}}``.

        Raises:
            ValueError: ``storage_options`` has an unknown key.
            nvcomp_checkpoint.errors.CheckpointWriteError: the write failed (disk full ...);
                any previous file at ``path`` is untouched. With ``async_save``: an earlier
                background save failed, and this one was not started.
        """
        started = time.perf_counter()
        session = self.session
        policy, metadata = self.policy_for(storage_options)
        info = _counters(checkpoint)  # Lightning's counters, readable with `nvckpt inspect`
        metadata = {"written_by": type(self).__name__, **info, **(metadata or {})}
        after = self.after_durable(checkpoint, path)

        def options(base: str | None) -> SaveOptions:
            return session.save_options(
                path, policy=policy, metadata=metadata, storage_options=self.fsspec_options or None, base=base
            )

        try:
            if not self.async_save or self._between_runs:
                session.raise_errors(f"the next save, to {os.fspath(path)}", "That save was not started.")
                base = self.incremental.base_for(path) if self.incremental is not None else None
                session.saved(session.save_now(checkpoint, path, options(base)), after)
                return
            session.wait_for_slot()
            session.raise_errors(f"the next save, to {os.fspath(path)}", "That save was not started.")
            base = self.incremental.base_for(path) if self.incremental is not None else None
            built = options(base)
            session.checkpoint(
                path,
                started,
                after,
                lambda group: session.add_file(group, "checkpoint", checkpoint, path, built),
                failed=lambda exc: self._save_failed(path),  # in the background: whoever raises the error later
            )
        except BaseException:
            self._save_failed(path)
            raise

    def saved_by_strategy(self, report: SaveReport, checkpoint: Mapping[str, Any], path: Any) -> None:
        """A checkpoint a sharded strategy wrote itself (``NvcompModelParallelStrategy``'s directory) is
        durable: as for a save of this plugin, ``report`` becomes :attr:`last_report`, ``on_saved`` and
        ``NvcompCheckpointMetrics`` get it, and the tiers a copy of ``path`` named by its ``global_step``."""
        self.session.saved(report, self.after_durable(checkpoint, path))

    def _save_failed(self, path: Any) -> None:
        if self.incremental is not None:
            self.incremental.failed(path=os.fspath(path))  # the next save is a full one

    def _tell_listeners(self, report: SaveReport, info: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            listener(report, info)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load a checkpoint written by this plugin, or a plain ``torch.save`` one.

        Args:
            path: Local path or fsspec URL.
            map_location: As for ``torch.load``. ``None``: tensors of a compressed file return
                to the device they were saved from (the CPU where that GPU is absent) and are
                decompressed there; a plain ``torch.save`` file loads onto the CPU, as Lightning's
                ``TorchCheckpointIO`` loads it.
            weights_only: As Lightning passes it: ``None`` is ``torch.load``'s default
                (weights-only from torch 2.6 on), ``False`` is for files you trust.

        Raises:
            FileNotFoundError: nothing at ``path`` (as Lightning's ``TorchCheckpointIO``).
            nvcomp_checkpoint.errors.FormatError: the file is corrupt or truncated (names it).
            nvcomp_checkpoint.errors.UnsafeCheckpointError: the file holds Python objects that
                a weights-only load refuses.
        """
        options = self.fsspec_options or None
        where = f"load_checkpoint({os.fspath(path)!r})"

        def check() -> None:
            if self.async_save:
                # A checkpoint still being written must not be read as missing, or as the older one.
                self.session.wait_for_saves(where, "Nothing was loaded; fix the cause and save again.")
            # And for another plugin's (a second Trainer in this process), as nc.load waits for any saver's.
            wait_for_path(path)
            storage, spath = storage_for(path, options)
            if not storage.exists(spath):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")

        # With leader_load the load is a collective: every rank learns of a failed check (a background
        # save that failed on rank 0, a file missing on one node) before it, instead of waiting in it.
        checked_on_every_rank(check, where, self.leader_load)
        return load_as_torch(
            path,
            map_location,
            weights_only,
            hint=_LIGHTNING_HINT,
            storage_options=options,
            leader_load=self.leader_load,
            plain_map_location=_storage_as_loaded,
        )

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (``ModelCheckpoint`` calls this for old top-k files).

        With ``async_save``, the file removed is usually the one the newest checkpoint replaces,
        and must outlive the write of that one: while saves are pending, the deletion is queued
        behind them and done on the background thread once they are all durable (skipped, keeping
        the file, if one of them fails). :meth:`wait` and :meth:`teardown` wait for it too.

        Raises:
            nvcomp_checkpoint.errors.CheckpointWriteError: A background save failed; ``path`` is
                then kept, since it may be the newest complete checkpoint.
        """
        if self.async_save:
            where = os.fspath(path)
            self.session.raise_errors(
                f"remove_checkpoint({where!r})", f"{where} was not removed: it may be the newest complete checkpoint."
            )
        # After the pending saves, the deltas that need it and its copies to the tiers (CheckpointSession.remove).
        self.session.remove(path, self._delete)

    def _delete(self, path: str) -> None:
        storage, spath = storage_for(path, self.fsspec_options or None)
        storage.remove(spath)

    @override
    def teardown(self) -> None:
        """Wait for pending saves (and copies to ``tiers``), stop the background thread, and raise a background failure.

        The Trainer calls this at the end of ``fit``/``validate``/``test``; a later save starts
        a new background thread. While another exception is propagating (the Trainer tears down
        after an error too), a background failure is logged instead, so the first error stays visible.
        """
        self._between_runs = True
        self.session.close("teardown, at the end of the run")


def _counters(checkpoint: Any) -> dict[str, int]:
    """Lightning's ``epoch`` and ``global_step`` of a checkpoint dict (those it has)."""
    if not isinstance(checkpoint, Mapping):
        return {}
    return {k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)}


#: Every NvcompCheckpointIO alive: Lightning's callbacks factory adds the strategy check only when one exists.
_LIVE_PLUGINS: "weakref.WeakSet[NvcompCheckpointIO]" = weakref.WeakSet()


def _check_strategy(trainer: Any) -> None:
    """Refuse, at setup, a stock sharded or DeepSpeed strategy that would write uncompressed checkpoints
    while an :class:`NvcompCheckpointIO` sits on it (see ``check_sharded_checkpoint_io``)."""
    from .lightning_deepspeed import check_deepspeed_checkpoint_io
    from .lightning_sharded import check_sharded_checkpoint_io

    check_sharded_checkpoint_io(trainer.strategy)
    check_deepspeed_checkpoint_io(trainer.strategy)
    plugin = _find_plugin(getattr(trainer.strategy, "checkpoint_io", None))
    if plugin is not None:  # a run begins: its saves go to the background again (async_save)
        plugin._between_runs = False


class NvcompStrategyCheck(Callback):
    """Raises at ``setup`` (before any step) when the Trainer's strategy would bypass
    :class:`NvcompCheckpointIO` (Lightning's ``ModelParallelStrategy`` / ``FSDPStrategy`` saving
    sharded checkpoints). Lightning adds it to every Trainer built while an ``NvcompCheckpointIO``
    exists, through the ``lightning.pytorch.callbacks_factory`` entry point this package declares."""

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _check_strategy(trainer)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Lightning's AsyncCheckpointIO does not pass teardown on to the plugin it wraps: the run's
        # end is told here too (after the strategy's teardown), so no writer thread outlives the run.
        plugin = _find_plugin(getattr(trainer.strategy, "checkpoint_io", None))
        if plugin is not None:
            plugin.teardown()


def strategy_check_callbacks() -> list[Any]:
    """The callbacks Lightning's entry point adds to a new Trainer: the check, when a plugin exists."""
    return [NvcompStrategyCheck()] if len(_LIVE_PLUGINS) else []


class NvcompModelCheckpointMixin:
    """Makes a ``ModelCheckpoint`` count a checkpoint still being written in the background as existing.

    With ``NvcompCheckpointIO(async_save=True)`` a save in flight has not written its file yet, so
    the next save with a repeating name would overwrite it (``docs/lightning.md``). With the standalone
    ``pytorch_lightning`` package: ``class MyCheckpoint(NvcompModelCheckpointMixin, pytorch_lightning.callbacks.ModelCheckpoint)``.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _check_strategy(trainer)  # a stock sharded strategy would save uncompressed: say so before training
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        if super().file_exists(filepath, trainer):  # type: ignore[misc]
            return True
        # Every rank takes part in the reduction, as in ModelCheckpoint.file_exists.
        pending = nc.has_pending_save(filepath) if trainer.is_global_zero else False
        return bool(trainer.strategy.reduce_boolean_decision(pending, all=False))


class NvcompModelCheckpoint(NvcompModelCheckpointMixin, ModelCheckpoint):
    """``lightning.pytorch``'s ``ModelCheckpoint`` with :class:`NvcompModelCheckpointMixin`; same arguments."""


class NvcompCheckpointMetrics(Callback):
    """Sends the sizes, ratios and times of every checkpoint save to the Trainer's loggers.

    Each durable save's :func:`report_metrics` go to ``logger.log_metrics(..., step=<the checkpoint's
    global_step>)`` on the training thread, at the next batch, epoch or validation end and at the
    end of ``fit`` (``docs/lightning.md``).

    Args:
        plugin: The plugin whose saves to report; by default the :class:`NvcompCheckpointIO` the
            Trainer saves with (also inside Lightning's ``AsyncCheckpointIO``).
        prefix: Prepended to every metric name.

    Example:
        >>> trainer = Trainer(plugins=[NvcompCheckpointIO(async_save=True)],
        ...                   callbacks=[NvcompCheckpointMetrics()], logger=CSVLogger("logs"))
    """

    def __init__(self, plugin: NvcompCheckpointIO | None = None, *, prefix: str = "nvckpt/") -> None:
        super().__init__()
        self.plugin = plugin
        self.prefix = prefix
        self._queue: collections.deque[tuple[SaveReport, Any]] = collections.deque()
        self._attached: NvcompCheckpointIO | None = None

    def _on_saved(self, report: SaveReport, info: dict[str, Any]) -> None:
        # Any thread: only queue here (deque appends are atomic); logging happens in _flush.
        self._queue.append((report, info.get("global_step")))

    def _attach(self, plugin: NvcompCheckpointIO) -> None:
        if self._attached is plugin:
            return
        self._detach()
        plugin._listeners.append(self._on_saved)
        self._attached = plugin

    def _detach(self) -> None:
        if self._attached is not None:
            listeners = self._attached._listeners
            if self._on_saved in listeners:
                listeners.remove(self._on_saved)
            self._attached = None

    def _flush(self, trainer: Any) -> None:
        while self._queue:
            report, step = self._queue.popleft()
            metrics = report_metrics(report, self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step if step is None else step)

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Find the plugin (or take the one given) and listen to its saves."""
        _check_strategy(trainer)
        plugin = self.plugin if self.plugin is not None else _find_plugin(trainer.strategy.checkpoint_io)
        if plugin is None:
            raise nc.CheckpointError(
                "NvcompCheckpointMetrics: this Trainer does not save with NvcompCheckpointIO "
                f"(its CheckpointIO is {type(trainer.strategy.checkpoint_io).__name__}); pass "
                "Trainer(plugins=[NvcompCheckpointIO()]), or NvcompCheckpointMetrics(plugin=...)."
            )
        self._attach(plugin)

    @override
    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._flush(trainer)

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush(trainer)

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush(trainer)

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        # After the strategy's teardown, which waited for every pending save.
        self._flush(trainer)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._flush(trainer)
        self._detach()


def _find_plugin(checkpoint_io: Any) -> NvcompCheckpointIO | None:
    """The :class:`NvcompCheckpointIO` in ``checkpoint_io``, looking inside wrappers (``AsyncCheckpointIO``)."""
    for _ in range(8):
        if isinstance(checkpoint_io, NvcompCheckpointIO):
            return checkpoint_io
        checkpoint_io = getattr(checkpoint_io, "checkpoint_io", None)
        if checkpoint_io is None:
            return None
    return None


def _register_with_standalone_packages() -> None:
    # `pytorch_lightning.Trainer` and `lightning_fabric.Fabric` check plugins against their own
    # copy of CheckpointIO; registering makes this class acceptable to them too. Only done when
    # the user imported them: importing them here would reroute Lightning's rank-zero logging.
    module = sys.modules.get("lightning_fabric.plugins.io.checkpoint_io")
    standalone = getattr(module, "CheckpointIO", None)
    if standalone is not None and standalone is not CheckpointIO and not issubclass(NvcompCheckpointIO, standalone):
        standalone.register(NvcompCheckpointIO)


_register_with_standalone_packages()


def load_from_checkpoint(
    cls: Any,
    checkpoint_path: str | os.PathLike[str],
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    *,
    weights_only: bool | None = None,
    fsspec_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for files written by this plugin.

    Lightning's ``LightningModule.load_from_checkpoint`` reads the file with ``torch.load``
    itself, not through the Trainer's ``CheckpointIO``, so it cannot read a compressed file.
    This decompresses the file, then hands the checkpoint to ``cls.load_from_checkpoint``, so
    hyper-parameters, ``strict``, ``hparams_file`` and ``**kwargs`` behave exactly as there.
    Plain ``torch.save`` checkpoints go straight to ``cls.load_from_checkpoint``.

    Args:
        cls: A ``LightningModule`` or ``LightningDataModule`` subclass.
        checkpoint_path: Local path or fsspec URL.
        map_location, hparams_file, strict, weights_only, **kwargs: As for
            ``LightningModule.load_from_checkpoint``.
        fsspec_options: Options for fsspec when the path is a URL.

    Note:
        The decompressed checkpoint is serialized once in memory to hand it over: peak memory
        is about twice the checkpoint.

    Example:
        >>> model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")
    """
    accepts_weights_only = "weights_only" in inspect.signature(cls.load_from_checkpoint).parameters
    extra = dict(kwargs)
    if not nc.is_nvcomp_checkpoint(checkpoint_path, storage_options=fsspec_options):
        if accepts_weights_only:
            extra["weights_only"] = weights_only
        return cls.load_from_checkpoint(
            checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **extra
        )
    checkpoint = load_as_torch(checkpoint_path, map_location, weights_only, hint=_LIGHTNING_HINT, storage_options=fsspec_options)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    if accepts_weights_only:
        # These bytes were just written from a checkpoint that already passed the caller's
        # weights_only check; a second check would only refuse what was already accepted.
        extra["weights_only"] = False
    # map_location was applied while decompressing; Lightning's default keeps devices as they are.
    return cls.load_from_checkpoint(buffer, hparams_file=hparams_file, strict=strict, **extra)
