"""Lightning's ``DeepSpeedStrategy`` with every file of its checkpoints written compressed.

``DeepSpeedStrategy`` saves and loads through ``deepspeed_engine.save_checkpoint`` /
``load_checkpoint`` and never calls the ``CheckpointIO``; :class:`NvcompDeepSpeedStrategy` attaches
:func:`nvcomp_checkpoint.deepspeed.attach`'s checkpoint engine to the DeepSpeed engine as soon as the
strategy has created it, so the same checkpoint folders (``latest``, ``checkpoint/``) hold our files.
Each checkpoint goes through the ``NvcompCheckpointIO``'s session, which owns ``async_save``, the
copies to the tiers, the ``incremental`` chains and the removals, as for every other save.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import Any, Optional

from typing_extensions import override

from nvcomp_checkpoint import SaveReport
from nvcomp_checkpoint.entrypoint import CheckpointSession, SessionOptions
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError
from nvcomp_checkpoint.version import install_hint

try:
    from lightning.pytorch.strategies import DeepSpeedStrategy
except ImportError as exc:  # pragma: no cover
    raise ImportError(f"nvcomp_checkpoint.lightning needs Lightning: {install_hint('lightning')}") from exc

from .lightning_sharded import StrategyOptions, nvcomp_plugin

__all__ = ["NvcompDeepSpeedStrategy", "check_deepspeed_checkpoint_io"]


class _TagCommit:
    """The commit of one checkpoint's DeepSpeed tag, as the one part of its group in the session.

    DeepSpeed's engine writes the rank files (in the background with ``async_save``) and commits the
    tag on every rank together (a collective, at an optimizer step, the next save or the end of the
    run); the session's part waits here for that outcome.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._outcome = threading.Event()
        self._report: SaveReport | None = None
        self._error: BaseException | None = None

    def committed(self, report: SaveReport) -> None:
        if not self._outcome.is_set():
            self._report = report
            self._outcome.set()

    def failed(self, error: BaseException) -> None:
        if not self._outcome.is_set():
            self._error = error
            self._outcome.set()

    def done(self) -> bool:
        return self._outcome.is_set()

    def result(self) -> SaveReport:
        """This rank's report of the committed tag (run as the session's background part), or the failure."""
        self._outcome.wait()
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report


class NvcompDeepSpeedStrategy(StrategyOptions, DeepSpeedStrategy):
    """``DeepSpeedStrategy`` whose checkpoints are compressed; takes its arguments, plus ``policy`` and ``workers``.

    Each ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``'s saves) writes DeepSpeed's folder
    at ``path`` with every file compressed under DeepSpeed's own names; ``latest`` names the tag only
    once every rank's files are durable, and a rank that failed fails the save on every rank.
    ``fit(ckpt_path=...)`` loads ours and plain DeepSpeed folders. The policy is ``policy``, else that
    of an ``NvcompCheckpointIO`` passed as a plugin.

    The plugin's options apply to these folders (its session owns them, as for its own saves):

    - ``async_save=True``: each rank's files are snapshotted and written in the background; the tag is
      committed at the first optimizer step at which every rank's files are durable (or at the next
      save, ``plugin.wait()`` or the end of the run, all on every rank together). ``ModelCheckpoint``'s
      removal of an older folder waits for that commit.
    - ``tiers=[...]``: rank 0 copies each committed folder to the tiers, named by its ``global_step``;
      on a fresh node ``trainer.fit(ckpt_path=plugin.resume_path(local_dir))`` resumes from the newest
      copy (give each rank of a node its own ``local_dir``).
    - ``incremental=True``: each rank file is a delta against the same file of the previous checkpoint
      (``last.ckpt`` is never a base); a folder ``ModelCheckpoint`` removes is kept while a kept delta
      needs it, and a tier gets a delta after its chain.

    Like ``DeepSpeedStrategy``, it runs on CUDA GPUs only (Lightning refuses other accelerators in
    ``setup_environment``).

    Attributes:
        last_report: This rank's :class:`SaveReport` of the last committed checkpoint (``path`` is the
            checkpoint folder), ``None`` before one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._own_session: CheckpointSession | None = None
        self._in_flight: _TagCommit | None = None
        self._running = False

    @property
    def session(self) -> CheckpointSession:
        """The plugin's session, else (no ``NvcompCheckpointIO``) one of this strategy's own, with its policy."""
        plugin = nvcomp_plugin(self)
        if plugin is not None:
            session: CheckpointSession = plugin.session
            return session
        if self._own_session is None:
            label = type(self).__name__
            self._own_session = CheckpointSession(label, SessionOptions.of(label, self.policy, workers=self.workers))
        return self._own_session

    @property
    def last_report(self) -> SaveReport | None:
        return self.session.last_report

    @property
    def last_reports(self) -> list[SaveReport]:
        """Deprecated: ``[last_report]``; use ``last_report``."""
        warnings.warn(
            "NvcompDeepSpeedStrategy.last_reports is deprecated: use last_report (this rank's files of the checkpoint, merged)",
            DeprecationWarning,
            stacklevel=2,
        )
        report = self.last_report
        return [] if report is None else [report]

    @override
    def setup(self, trainer: Any) -> None:
        self._running = True
        super().setup(trainer)

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        # The engine exists from here on; Lightning restores a checkpoint only after setup
        # (restore_checkpoint_after_setup), so a resume already reads through our engine.
        from nvcomp_checkpoint.entrypoint.deepspeed_engine import attach_once  # noqa: PLC0415

        session = self.session
        ours = attach_once(
            self.deepspeed_engine,
            policy=self.policy,
            workers=self.workers,
            async_save=session.async_save,
            on_saved=self._committed,
        )
        if session.incremental is not None:
            # One owner of the chains: the engine saves each rank file against the base the session's
            # bookkeeping names, so the session's removals know what a kept delta needs.
            ours.incremental = session.incremental
        plugin = nvcomp_plugin(self)
        if plugin is not None:
            plugin.commit_in_flight = self.commit_in_flight

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:  # Lightning's refusal: DeepSpeed takes no per-save options
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        folder = os.fspath(self.broadcast(filepath))
        session = self.session
        # One tag in flight at a time (DeepSpeed's engine commits the previous one at the next save anyway).
        self.commit_in_flight()
        session.raise_errors(f"the next save, to {folder}", "That save was not started.")
        started = time.perf_counter()
        plugin = nvcomp_plugin(self)
        # Rank 0 copies the folder to the tiers; every rank's report goes to on_saved and the metrics.
        after = [] if plugin is None else plugin.after_durable(checkpoint, folder, copy=self.is_global_zero)
        tag = _TagCommit(folder)
        group = session.begin(folder, started, after)
        session.add_job(group, "deepspeed", tag.result)
        self._in_flight = tag
        try:
            super().save_checkpoint(checkpoint, folder)
        except BaseException as exc:
            self._in_flight = None
            tag.failed(exc)
            session.seal(group, background=False)  # raises the failure here, once
            raise
        if not session.async_save:
            self._in_flight = None  # committed inside DeepSpeed's save_checkpoint
            tag.failed(CheckpointWriteError(f"{folder}: DeepSpeed's save returned without committing the tag"))
            session.seal(group, background=False)
            return
        session.seal(group)
        if not self._running:  # between runs (a save after fit): no optimizer step follows to commit it
            self.commit_in_flight()

    def commit_in_flight(self) -> None:
        """Commit the checkpoint still written in the background (``async_save``), on every rank together,
        and raise a failure of it (or of an earlier background save). Call it on every rank."""
        tag = self._in_flight
        if tag is None:
            return
        try:
            if not tag.done():
                engine = self.deepspeed_engine
                try:
                    engine.checkpoint_engine.wait()  # collective: the engine's on_saved completes `tag`
                except BaseException as exc:
                    tag.failed(exc)
                # Not committed, not failed now: its commit at an optimizer step failed (raised there).
                tag.failed(
                    CheckpointWriteError(f"{tag.path}: its DeepSpeed tag was not committed; see the error raised in training")
                )
        finally:
            self._in_flight = None
        self.session.wait_for_saves(f"the commit of {tag.path}", "The checkpoint was not committed.")

    def _committed(self, report: SaveReport) -> None:
        # The engine's on_saved, on every rank, once every rank's files of the tag are durable and `latest` names it.
        tag = self._in_flight
        if tag is not None:
            tag.committed(report)

    @override
    def teardown(self) -> None:
        self._running = False
        try:
            if sys.exc_info()[1] is None:
                self.commit_in_flight()  # the last checkpoint is committed before the run ends
            elif self._in_flight is not None:
                # No collective while an error propagates (a rank may be gone): the tag stays uncommitted.
                self._in_flight.failed(CheckpointWriteError(f"{self._in_flight.path}: not committed, the run failed"))
                self._in_flight = None
        finally:
            super().teardown()  # ... checkpoint_io.teardown(): the plugin's session waits for the tiers
            if self._own_session is not None:
                self._own_session.close("teardown, at the end of the run")


def check_deepspeed_checkpoint_io(strategy: Any) -> None:
    """Refuse Lightning's stock ``DeepSpeedStrategy`` given an ``NvcompCheckpointIO`` (it never calls the
    plugin), and the plugin options :class:`NvcompDeepSpeedStrategy` cannot honour.

    Raises:
        CheckpointError: naming :class:`NvcompDeepSpeedStrategy`, or the option to drop.
    """
    if not isinstance(strategy, DeepSpeedStrategy):
        return
    plugin = nvcomp_plugin(strategy)
    if plugin is None:
        return
    if isinstance(strategy, NvcompDeepSpeedStrategy):
        check_options(
            "Lightning + DeepSpeed",
            "NvcompCheckpointIO",
            async_save=getattr(plugin, "async_save", False),
            tiers=getattr(plugin, "tiers", None),
            incremental=getattr(plugin, "incremental", None) is not None,
            leader_load=getattr(plugin, "leader_load", False),
        )
        return
    raise CheckpointError(
        f"NvcompCheckpointIO was given to Lightning's {type(strategy).__name__}, which saves through the DeepSpeed "
        "engine and never calls the CheckpointIO: its checkpoints would be written uncompressed. Use "
        "strategy=nvcomp_checkpoint.lightning.NvcompDeepSpeedStrategy(...) with the same arguments (it takes the "
        "plugin's policy), or drop the plugin."
    )
