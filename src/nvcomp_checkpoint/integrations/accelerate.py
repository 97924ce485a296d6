"""Hugging Face Accelerate integration: ``accelerator.save_state``/``load_state`` with compressed
model weights and optimizer state, committed atomically as a whole directory.

``register_nvcomp_hooks(accelerator, policy)`` makes every ``save_state`` write each model's
weights to ``model.nvc`` (``model_1.nvc`` ...) and each optimizer's state to ``optimizer.nvc``
(``optimizer_1.nvc`` ...) instead of ``model.safetensors`` and ``optimizer.bin``; everything else
(scheduler, RNG states, samplers, GradScaler, ``register_for_checkpointing`` objects, files written
by your own save hooks) is still written by Accelerate itself, unchanged. The design (why a
wrapper, crash safety, in-place updates, async saves) is in ``docs/accelerate.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import torch

from nvcomp_checkpoint.version import install_hint

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import (
        MODEL_NAME,
        OPTIMIZER_NAME,
        RNG_STATE_NAME,
        SAFE_MODEL_NAME,
        SAMPLER_NAME,
        SCALER_NAME,
        SCHEDULER_NAME,
        DistributedType,
        broadcast_object_list,
    )
except ImportError as exc:
    raise ImportError(
        f"nvcomp_checkpoint.accelerate needs Accelerate: {install_hint('accelerate')} ({exc})", name=exc.name
    ) from exc

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import ChainPolicy
from nvcomp_checkpoint.delta import retained
from nvcomp_checkpoint.dirstore import MARKER_NAME, DirectoryStore, InstallError, numbered_dirs, remove_quietly, rotate
from nvcomp_checkpoint.entrypoint import CheckpointSession, SessionOptions, SessionView, checked_on_every_rank, load_tree
from nvcomp_checkpoint.entrypoint.commit import gather_outcomes
from nvcomp_checkpoint.entrypoint.loading import leader_load_applies
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError, FormatError, StateSaveError
from nvcomp_checkpoint.incremental import IncrementalFiles, unit_base_of
from nvcomp_checkpoint.integrations import accelerate_fsdp
from nvcomp_checkpoint.savegroup import SaveGroup
from nvcomp_checkpoint.storage import LOCAL
from nvcomp_checkpoint.tiers import Tier, TierCopies

__all__ = [
    "register_nvcomp_hooks",
    "NvcompStateHooks",
    "MANIFEST_NAME",
    "MARKER_NAME",
    "is_nvcomp_state_dir",
]

logger = logging.getLogger(__name__)

#: Written last into a saved directory: its presence means the save completed.
MANIFEST_NAME = "nvcomp_checkpoint.json"
_STORE = DirectoryStore(MANIFEST_NAME, "nvcomp-checkpoint/accelerate-state", 1)
_STATE_FILE = re.compile(
    "|".join(
        [
            rf"({re.escape(stem)})(_\d+)?\.{ext}"
            for stem, ext in (
                (SAFE_MODEL_NAME, "safetensors"),
                (MODEL_NAME, "bin"),
                (OPTIMIZER_NAME, "bin"),
                (SCHEDULER_NAME, "bin"),
                (SAMPLER_NAME, "bin"),
                ("dl_state_dict", "bin"),
                ("model", "nvc"),
                ("optimizer", "nvc"),
            )
        ]
        + [re.escape(SCALER_NAME), rf"{re.escape(RNG_STATE_NAME)}_\d+\.pkl", r"custom_checkpoint_\d+\.pkl"]
        # DeepSpeed's: a tag folder per model (pytorch_model, pytorch_model_1 ...), `latest`, and the
        # recovery scripts it copies next to them.
        + [rf"{re.escape(MODEL_NAME)}(_\d+)?", "latest", r"zero_to_fp32\.py", r"zero_to_torch\.py"]
    )
)
# A DeepSpeed model's tag folder in a save_state directory (Accelerate's ckpt_id).
_DEEPSPEED_TAG = re.compile(rf"{re.escape(MODEL_NAME)}(_\d+)?")
# Accelerate's own model and optimizer files, which these hooks write as .nvc instead.
_PLAIN_STATE_FILE = re.compile(
    rf"({re.escape(SAFE_MODEL_NAME)}|{re.escape(MODEL_NAME)})(_\d+)?\.(safetensors|bin)|{re.escape(OPTIMIZER_NAME)}(_\d+)?\.bin"
)
_MARKER_TEXT = """\
This directory was written by accelerator.save_state() with nvcomp-checkpoint's hooks
(not on PyPI yet: install it from a clone of its repository with pip install -e '.[accelerate]').

model.nvc and optimizer.nvc (model_1.nvc ...) hold the model weights and optimizer state,
compressed losslessly; the other files are Accelerate's own. accelerator.load_state() without
the hooks fails on this directory with "No such file or directory: .../pytorch_model.bin".

With FSDP, pytorch_model_fsdp_0/ and optimizer_0/ hold every rank's shards, compressed (read them
with nvcomp_checkpoint.dcp.NvcompReader), or pytorch_model_fsdp.nvc and optimizer.nvc the full state.

- Load it: from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
           register_nvcomp_hooks(accelerator); accelerator.load_state("<this directory>")
- Read one file: nvcomp_checkpoint.load("model.nvc")
"""
_UNSUPPORTED = {
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}


def register_nvcomp_hooks(
    accelerator: Accelerator,
    policy: nc.CodecPolicy | None = None,
    *,
    workers: int | None = None,
    async_save: bool = False,
    on_saved: Callable[[nc.SaveReport], Any] | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    tiers: list[Tier] | None = None,
    incremental: bool | ChainPolicy = False,
    full_every: int | None = None,
    delta_base: str | None = None,
    leader_load: bool = False,
) -> "NvcompStateHooks":
    """Make ``accelerator.save_state``/``load_state`` compress model weights and optimizer state.

    Args:
        accelerator: The ``Accelerator`` whose checkpoints to compress.
        policy, workers, async_save, on_saved, stream_wrapper, tiers: As for every integration
            (:class:`nvcomp_checkpoint.entrypoint.SessionOptions`). With ``async_save``,
            ``save_state`` returns once model and optimizer state are copied (one extra copy in
            host memory); the ``.nvc`` files, the commit and the rotation follow in the background.
            ``on_saved`` runs once the directory is committed. The folder ``save_state`` writes is
            tier 0 (``total_limit`` is its retention); a copy is named by the save's iteration
            (``save_iteration``), ``load_state`` of a folder these hooks saved sets
            ``save_iteration`` to the one after it, and on a fresh node
            ``accelerator.load_state(hooks.resume_path())`` loads the newest copy that checks.
        incremental: Each ``.nvc`` file of a ``save_state`` folder (with DeepSpeed: each file of
            its tags, every rank's partition) is a delta against the same file of the previous
            folder these hooks saved (a full folder every ``full_every``, and the first save of a
            process); ``total_limit`` rotation keeps every folder a kept one needs. A folder updated
            in place is saved in full. With ``tiers``, a delta folder reaches a tier after its chain
            and ``resume_path(local_dir)`` lays it out there with its chain.
            ``True`` (with ``full_every`` and ``delta_base``) or a :class:`~nvcomp_checkpoint.ChainPolicy`.
        full_every, delta_base: With ``incremental=True``: as for :class:`~nvcomp_checkpoint.ChainPolicy`
            (``full_every`` default 10, ``delta_base`` ``"previous"`` (default) or ``"full"``); refused
            together with a ``ChainPolicy``, which holds both.
        leader_load: In ``load_state`` of replicated (DDP) state, one process per node reads each
            ``.nvc`` file and sends it to the node's other processes over the process group
            (:func:`nvcomp_checkpoint.load_broadcast`), instead of every process reading the same
            bytes from a shared file system. Every process calls ``load_state``, as Accelerate
            requires anyway. FSDP state is read by each rank as before.

    Returns:
        A handle: ``handle.last_report`` is the :class:`~nvcomp_checkpoint.SaveReport` of the
        last committed save (per component, all its files together), ``handle.wait()``
        waits for a pending async save (with DeepSpeed: on every process), and ``handle.remove()``
        restores Accelerate's own ``save_state``/``load_state``.

    Raises:
        CheckpointError: The accelerator uses Megatron-LM or XLA, or
            DeepSpeed with ``leader_load`` (:class:`~nvcomp_checkpoint.errors.UnsupportedOptionError`,
            from the one check of ``entrypoint.support``), or already has these hooks. (FSDP state is
            compressed: sharded through :class:`~nvcomp_checkpoint.dcp.NvcompWriter`, in the background with
            ``async_save``, full into ``.nvc`` files; see :mod:`nvcomp_checkpoint.integrations.accelerate_fsdp`. DeepSpeed's checkpoint is
            written compressed by :func:`nvcomp_checkpoint.deepspeed.attach`'s engine, attached to each
            DeepSpeed engine ``prepare`` creates, with ``async_save`` and ``incremental`` passed on to
            it; the folder, its tier copies and its rotation stay these hooks': see ``docs/accelerate.md``.)

    Example:
        >>> accelerator = Accelerator()
        >>> model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        >>> hooks = register_nvcomp_hooks(accelerator)
        >>> accelerator.save_state("ckpt")          # model.nvc, optimizer.nvc, scheduler.bin ...
        >>> print(hooks.last_report.table())
        >>> accelerator.load_state("ckpt")          # also loads directories saved without hooks
        >>> hooks = register_nvcomp_hooks(accelerator, async_save=True)  # after hooks.remove()
        >>> accelerator.save_state("ckpt2")         # returns after the snapshot; committed later
        >>> hooks.wait()                            # raises if the background save failed
    """
    engine = _UNSUPPORTED.get(accelerator.distributed_type)
    if engine is not None:
        raise CheckpointError(
            f"register_nvcomp_hooks: this Accelerator uses {engine}, which saves sharded model and optimizer "
            "state with its own writer; nvcomp-checkpoint cannot take those files over. Call save_state "
            "without register_nvcomp_hooks, or compress a consolidated state dict with nvcomp_checkpoint.save()."
        )
    if accelerator.distributed_type == DistributedType.FSDP:
        accelerate_fsdp.check_fsdp_hooks(accelerator.state.fsdp_plugin, async_save)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_options(
            "Accelerate + DeepSpeed",
            "register_nvcomp_hooks",
            async_save=async_save,
            tiers=tiers,
            incremental=incremental,
            leader_load=leader_load,
        )
    if isinstance(getattr(accelerator, "_nvcomp_state_hooks", None), NvcompStateHooks):
        raise CheckpointError(
            "register_nvcomp_hooks: this Accelerator already has nvcomp-checkpoint hooks; call .remove() on "
            "the handle returned by the first call before registering again."
        )
    return NvcompStateHooks(
        accelerator,
        policy,
        workers,
        async_save=async_save,
        on_saved=on_saved,
        stream_wrapper=stream_wrapper,
        tiers=tiers,
        incremental=incremental,
        full_every=full_every,
        delta_base=delta_base,
        leader_load=leader_load,
    )


def is_nvcomp_state_dir(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a complete directory written by ``save_state`` with these hooks."""
    return (Path(path) / MANIFEST_NAME).is_file()


@dataclass
class _SaveCall:
    staging: Path
    target: Path
    optimizers: list[Any]
    iteration: int
    step: int = 0
    models: list[str] = field(default_factory=list)
    optimizer_files: list[str] = field(default_factory=list)
    group: SaveGroup | None = None
    background: bool = False


@dataclass
class _LoadCall:
    path: Path
    manifest: dict[str, Any]
    optimizers: list[Any]
    map_location: str | torch.device
    weights_only: bool
    model_kwargs: dict[str, Any]


class NvcompStateHooks:
    """The handle :func:`register_nvcomp_hooks` returns (design: ``docs/accelerate.md``).

    It holds a :class:`~nvcomp_checkpoint.entrypoint.CheckpointSession` (``session``), the one owner
    of the saves, their background errors, the copies to the tiers, the ``incremental`` chains and the
    removal of old folders; what is here is Accelerate's: wrapping ``save_state``/``load_state``,
    its folders, and (with DeepSpeed) the engines that write the ZeRO partitions.

    Attributes:
        accelerator: The accelerator whose ``save_state``/``load_state`` are wrapped.
        session: The :class:`~nvcomp_checkpoint.entrypoint.CheckpointSession` of these hooks.
        last_report: The last committed save's report, its files together (per component; ``None``
            before the first save and on processes that write nothing). With FSDP, its DCP
            directories too, each summed over every rank's file; with DeepSpeed, this process's
            files of each tag; on the process that commits.
        policy, workers, async_save, on_saved, stream_wrapper, tiers, incremental, leader_load: The options.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        policy: nc.CodecPolicy | None,
        workers: int | None,
        *,
        async_save: bool = False,
        on_saved: Callable[[nc.SaveReport], Any] | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        tiers: list[Tier] | None = None,
        incremental: bool | ChainPolicy = False,
        full_every: int | None = None,
        delta_base: str | None = None,
        leader_load: bool = False,
    ) -> None:
        # Converted and checked first: a wrong argument must not leave the accelerator half wrapped.
        options = SessionOptions.of(
            "register_nvcomp_hooks",
            policy,
            workers=workers,
            async_save=async_save,
            on_saved=on_saved,
            stream_wrapper=stream_wrapper,
            tiers=tiers,
            incremental=incremental,
            full_every=full_every,
            delta_base=delta_base,
        )
        self.session = CheckpointSession(
            "register_nvcomp_hooks",
            options,
            log_as="save_state",
            tiers_hint="register_nvcomp_hooks(accelerator, tiers=[nc.Tier(...)])",
        )
        self.accelerator = accelerator
        self.leader_load = leader_load
        self._last_reports: dict[str, nc.SaveReport] = {}
        self._saving: _SaveCall | None = None
        self._loading: _LoadCall | None = None
        # Whatever save_state/load_state were before (Accelerate's, or another wrapper's) is
        # what the inner call runs and what remove() puts back.
        self._previous = {name: accelerator.__dict__.get(name) for name in ("save_state", "load_state")}
        self._inner_save: Callable[..., Any] = accelerator.save_state
        self._inner_load: Callable[..., Any] = accelerator.load_state
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state
        accelerator._nvcomp_state_hooks = self
        self._restore_prepare: Callable[[], None] | None = None
        self._tags: _DeepSpeedTags | None = None
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            self._tags = _DeepSpeedTags(accelerator, self.session.incremental)
            self._restore_prepare = _attach_deepspeed(accelerator, options)

    # -- the options and the session's public surface, as before -------------------------------
    policy = SessionView[nc.CodecPolicy]("options.policy")
    workers = SessionView[int | None]("options.workers")
    async_save = SessionView[bool]("options.async_save")
    on_saved = SessionView[Callable[[nc.SaveReport], Any] | None]("options.on_saved")
    stream_wrapper = SessionView[Callable[[IO[bytes]], IO[bytes]] | None]("options.stream_wrapper")
    max_pending = SessionView[int]("options.max_pending")
    tiers = SessionView[TierCopies | None]("tiers")
    incremental = SessionView[IncrementalFiles | None]("incremental")
    last_report = SessionView[nc.SaveReport | None]("last_report")

    @property
    def last_reports(self) -> dict[str, nc.SaveReport]:
        """Deprecated: the last committed save's reports per file (or FSDP directory, or DeepSpeed tag); use ``last_report``."""
        warnings.warn(
            "NvcompStateHooks.last_reports is deprecated: use last_report, the save's report with its files together "
            "(as on every entry point)",
            DeprecationWarning,
            stacklevel=2,
        )
        return dict(self._last_reports)

    def pending(self) -> int:
        """Saves not yet committed (0 without ``async_save``)."""
        return self.session.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save (and copy to ``tiers``) is committed; raise the first background failure.

        With DeepSpeed it is collective (call it on every process, as ``save_state``): the tags the
        engines still hold are committed first, and a failure on any process raises on every one.

        Raises:
            CheckpointWriteError: A background save failed; what it would have replaced is untouched.
            TimeoutError: Saves still pending after ``timeout`` seconds.
        """
        if self._settles_on_every_rank:
            self._settle_on_every_rank("wait()")
        self.session.wait(timeout)

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest checkpoint folder on ``tiers`` that checks, as a local folder, or ``None`` (a fresh start).

        See :meth:`CheckpointSession.resume_path`. With several processes it is collective: the main
        process finds (and lays out into ``local_dir``, which every process must see) the copy, and
        every process gets its path. ``accelerator.load_state(path)`` loads it.

        Raises:
            ValueError: No ``tiers`` were given.
        """
        if self.session.tiers is None or not _distributed(self.accelerator):
            return self.session.resume_path(local_dir)
        found: list[Any] = [None]
        error: list[BaseException] = []
        if self.accelerator.is_main_process:
            try:
                found = [self.session.resume_path(local_dir)]
            except BaseException as exc:  # noqa: BLE001 - raised on every process below
                error.append(exc)
        _on_every_process(lambda: _reraise(error), "register_nvcomp_hooks.resume_path()")
        return broadcast_object_list(found)[0]

    def close(self, when: str = "close()") -> None:
        """Wait for pending saves and copies, stop the background threads, raise a failure (``when`` reports it)."""
        try:
            if self._settles_on_every_rank:
                self._settle_on_every_rank(when)
        finally:
            self.session.close(when)  # while a failure above propagates, its own are logged

    def remove(self) -> None:
        """Restore Accelerate's ``save_state``/``load_state`` on the accelerator.

        Raises:
            CheckpointWriteError: A pending async save failed (the hooks are still removed).
        """
        acc = self.accelerator
        if getattr(acc, "_nvcomp_state_hooks", None) is not self:
            return
        for name, bound in (("save_state", self.save_state), ("load_state", self.load_state)):
            if acc.__dict__.get(name) != bound:
                raise CheckpointError(
                    f"NvcompStateHooks.remove: accelerator.{name} was wrapped again after register_nvcomp_hooks; "
                    "remove that wrapper first."
                )
        try:
            self.close("remove()")
        finally:
            if self._restore_prepare is not None:
                self._restore_prepare()  # the engines stay attached: their checkpoints stay loadable
            for name in ("save_state", "load_state"):
                previous = self._previous[name]
                if previous is None:
                    del acc.__dict__[name]
                else:
                    setattr(acc, name, previous)
            del acc.__dict__["_nvcomp_state_hooks"]

    @property
    def _settles_on_every_rank(self) -> bool:
        # DeepSpeed, and FSDP with async_save: every process writes its part of a save in the background.
        return self._tags is not None or (self.async_save and self.accelerator.distributed_type == DistributedType.FSDP)

    def _settle_on_every_rank(self, when: str, consequence: str = "") -> None:
        """DeepSpeed: commit the engines' tags in flight; FSDP with ``async_save``: wait for this process's
        rank files written in the background; then wait for the pending saves, and raise a failure on every process.

        Collective. A save fails on the process that commits it (the main one), in the background:
        every process raises here, and takes the failed save's number as the next one, as the main
        process does, so that all name the next folder alike.
        """
        assert self._settles_on_every_rank
        rank_files: list[BaseException] = []
        try:
            if self._tags is not None:
                try:
                    self._tags.commit_in_flight()  # an engine's failed commit raises on every rank
                except BaseException:
                    # The folder that waited for the tag failed with it: one failure, raised once (this one).
                    self.session.settle()
                    with contextlib.suppress(CheckpointWriteError):
                        self.session.raise_errors(when)
                    raise
            else:
                try:  # every rank agreed on their outcome: a failure is this process's to raise too
                    accelerate_fsdp.wait_for_rank_files(self.accelerator, when, consequence)
                except CheckpointWriteError as exc:
                    rank_files.append(exc)
            self.session.settle()

            def raise_errors() -> None:
                _reraise(rank_files)
                self.session.raise_errors(when, consequence)

            _on_every_process(raise_errors, when)
        except BaseException:
            if _distributed(self.accelerator):
                config = self.accelerator.project_configuration
                config.iteration = broadcast_object_list([config.iteration])[0]
            raise

    # -- saving ----------------------------------------------------------------------------
    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> Path:
        """``Accelerator.save_state`` with compressed weights and optimizer state; same arguments.

        With ``async_save``, returns once the state is copied; the directory appears when the
        background save commits it (``hooks.wait()`` waits for that).

        Returns:
            The directory written (``checkpoints/checkpoint_<n>`` with automatic naming).

        Raises:
            CheckpointWriteError: Writing failed (the disk is full ...); the directory that was
                at the target before, if any, is untouched and ``save_iteration`` is unchanged.
                With ``async_save``: the previous, pending save failed (this one is not started).
                With DeepSpeed, raised on every process when it failed on any.
        """
        acc = self.accelerator
        config = acc.project_configuration
        entered = time.perf_counter()
        if self._settles_on_every_rank:
            # The previous save's tags (or FSDP rank files) and folder commit land before this one starts,
            # on every process.
            self._settle_on_every_rank("the next save_state")
        elif self.async_save:
            # One save in flight: its commit and rotation must land before this one starts.
            self.session.wait_for_saves("the next save_state")
        auto = bool(config.automatic_checkpoint_naming)
        if auto:
            checkpoints = Path(os.path.abspath(acc.project_dir)) / "checkpoints"
            shown = Path(os.path.join(acc.project_dir, "checkpoints", f"checkpoint_{acc.save_iteration}"))
            target = checkpoints / shown.name
            # A delta names its base relative to its own folder: staged at the depth it is committed at.
            staging = _STORE.staging_path(target if self.incremental is not None else checkpoints.parent / target.name)
            if target.exists():
                # Accelerate's own rule and message for automatic naming.
                raise ValueError(
                    f"Checkpoint directory {target} ({acc.save_iteration}) already exists. Please manually "
                    "override `self.save_iteration` with what iteration to start with."
                )
        else:
            if output_dir is None:
                raise ValueError("save_state needs an output_dir unless automatic_checkpoint_naming is enabled.")
            shown = Path(os.fspath(output_dir))
            # Absolute, so that "ckpt/" still has a parent to stage and rename in.
            target = Path(os.path.abspath(shown))
            staging = _STORE.staging_path(target)
        writes = self._writes()
        call = _SaveCall(staging, target, acc._optimizers, config.iteration, acc.step, background=self.async_save)
        rotation = (checkpoints, config.total_limit) if auto and config.total_limit is not None else None

        def write(group: SaveGroup | None) -> None:
            call.group = group
            if writes:
                LOCAL.makedirs(os.fspath(target.parent))
                _STORE.recover(target)
            # Every rank writes into the staging directory, so all must choose it from the same,
            # recovered target.
            acc.wait_for_everyone()
            if not auto and _STORE.shared_with_others(target, _is_state_file):
                call.staging = _STORE.staging_path(target, inside=True)
            if writes:
                _STORE.fresh(call.staging)
            acc.wait_for_everyone()
            self._run_inner_save(call, auto, safe_serialization, save_model_func_kwargs)
            acc.wait_for_everyone()

        def save() -> None:
            if not writes:
                write(None)
                return
            # The group commits once every part is durable (.nvc files, DeepSpeed's committed tags);
            # then the copies to the tiers.
            self.session.checkpoint(
                os.fspath(shown),
                entered,
                self._after_durable(call),
                write,
                background=self.async_save,
                info={"iteration": call.iteration},
                commit=lambda reports: self._commit(call, reports, rotation),
                failed=lambda exc: self._failed(call, exc),
            )

        try:
            if self._tags is not None:
                # A failure on the committing process (or a rank's tag) raises on every process.
                _on_every_process(save, "save_state")
            else:
                save()
        except BaseException as exc:
            config.iteration = call.iteration
            if self.incremental is not None:
                self.incremental.failed()  # the next save is a full one
            if writes:
                remove_quietly(call.staging)  # once its files have stopped writing into it
            # A StateSaveError is already the explained failure (a commit that failed, raised by the group).
            if isinstance(exc, (OSError, RuntimeError, CheckpointWriteError)) and not isinstance(exc, StateSaveError):
                raise _save_failed(target, exc) from exc
            raise
        if not self.async_save and self._tags is None:
            acc.wait_for_everyone()
        return shown

    def _after_durable(self, call: _SaveCall) -> list[Callable[[nc.SaveReport], Any]]:
        """What runs once the folder is committed: the copy to the tiers, a delta folder with its base folder
        (found through DeepSpeed's tag folders too: :func:`~nvcomp_checkpoint.incremental.unit_base_of`)."""
        return self.session.after_durable(call.iteration, call.target)

    def _commit(self, call: _SaveCall, reports: dict[str, nc.SaveReport], rotation: tuple[Path, int] | None) -> None:
        """Manifest, commit, rotation: runs once every part is durable (maybe in the background)."""
        fields = {
            "accelerate": accelerate.__version__,
            "step": call.step,
            "iteration": call.iteration,
            "models": call.models,
            "optimizers": call.optimizer_files,
            "policy": self.policy.to_dict(),
        }
        if self.accelerator.distributed_type == DistributedType.FSDP:
            fields.update(accelerate_fsdp.fsdp_manifest_fields(self.accelerator))
        target, new = call.target, set(LOCAL.listdir(os.fspath(call.staging)))
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            fields["deepspeed"] = {"tags": sorted(n for n in new if _DEEPSPEED_TAG.fullmatch(n))}
        previous = _STORE.publish(
            call.staging,
            target,
            fields,
            marker=_MARKER_TEXT,
            saved=_is_state_file,
            first=lambda n: n.endswith(".nvc"),
            # .nvc files (and DCP rank files, DeepSpeed's files written by our engine) carry a checksum per
            # chunk; hashing them again would double the reads.
            hashed=lambda p: p.suffix not in (".nvc", ".nvcdcp") and not _is_deepspeed_file(call.staging, p),
            obsolete=lambda previous: [
                *previous.get("models", []),
                *previous.get("optimizers", []),
                *accelerate_fsdp.replaced_files(previous, call.staging),
            ],
        )
        self._last_reports = dict(reports)
        if previous == {}:  # updated in place, a folder that no save with these hooks wrote
            left = sorted(n for n in LOCAL.listdir(os.fspath(target)) if _PLAIN_STATE_FILE.fullmatch(n) and n not in new)
            if left:
                logger.warning(
                    "%s: also holds %s, written without nvcomp-checkpoint; left in place, as Accelerate leaves "
                    "files it does not rewrite. load_state reads the .nvc files; if these are from an earlier "
                    "save_state, delete them to free the space.",
                    target,
                    ", ".join(left),
                )
        if rotation is not None:
            checkpoints, limit = rotation
            ordered = [p for _, p in numbered_dirs(checkpoints, _number)]
            if self.incremental is not None:  # a chain goes as a whole: the folders kept ones need stay
                needed = set(retained([os.fspath(p) for p in [*ordered[-limit:], target]], unit_base_of))
                ordered, limit = [p for p in ordered if os.fspath(p) not in needed], 0
            # Each folder goes once nothing needs it (CheckpointSession.remove): after this commit,
            # and after its copies to the tiers.
            rotate(
                ordered,
                limit,
                keep=target,
                trash=checkpoints.parent,
                when=lambda old, delete: self.session.remove(old, lambda _: delete()),
            )

    def _failed(self, call: _SaveCall, exc: BaseException) -> BaseException:
        remove_quietly(call.staging)
        if self.incremental is not None:
            self.incremental.failed()
        # As after a synchronous failure: the next save_state reuses the failed one's number.
        self.accelerator.project_configuration.iteration = call.iteration
        error = _save_failed(call.target, exc)
        error.__cause__ = exc
        return error

    def _run_inner_save(self, call: _SaveCall, auto: bool, safe_serialization: bool, kwargs: dict[str, Any]) -> None:
        acc = self.accelerator
        config = acc.project_configuration
        fsdp = acc.distributed_type == DistributedType.FSDP  # every rank writes its shards (accelerate_fsdp)
        # Every rank writes its partition through the attached engine (save_checkpoint per model).
        deepspeed = self._tags is not None
        handle = acc.register_save_state_pre_hook(self._save_hook)
        acc._optimizers = call.optimizers if fsdp or deepspeed else []
        config.automatic_checkpoint_naming = False
        self._saving = None if fsdp or deepspeed else call
        try:
            # The committing process's group gets each FSDP file's or DCP directory's report (all ranks' files).
            on_saved = call.group.add_report if call.group is not None else None
            # async_save: every rank's shards copied, then written in the background; the committing
            # process's group takes each DCP directory's write as a part (its commit waits for it).
            group, session = call.group, self.session
            background = accelerate_fsdp.rank_files_background(acc) if fsdp and self.async_save else None
            add_job = None if group is None else (lambda name, job: session.add_job(group, name, job))
            with (
                accelerate_fsdp.nvcomp_fsdp_functions(
                    accelerate.accelerator,
                    self.policy,
                    workers=self.workers,
                    stream_wrapper=self.stream_wrapper,
                    on_saved=on_saved,
                    background=background,
                    add_job=add_job,
                )
                if fsdp
                else self._tags.saving(call.staging, call.target)
                if self._tags is not None
                else contextlib.nullcontext()
            ):
                self._inner_save(str(call.staging), safe_serialization=safe_serialization, **kwargs)
            if self._tags is not None:
                if not self.async_save:
                    self._tags.commit_in_flight()  # an engine attached with async_save by someone else
                if call.group is not None:
                    self._tags.hand_over(self.session, call.group, background=self.async_save)
        finally:
            self._saving = None
            config.automatic_checkpoint_naming = auto
            acc._optimizers = call.optimizers
            handle.remove()

    def _save_hook(self, models: list[torch.nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        call = self._saving
        if call is None or Path(output_dir) != call.staging:
            return
        # What the hooks before this one left in `weights` is what Accelerate would have saved,
        # numbered the same way (model.safetensors, model_1.safetensors ...).
        states = list(weights)
        weights.clear()
        if call.group is None:
            return
        meta = {"step": self.accelerator.step, "iteration": call.iteration}
        files = [(_numbered("model", i), state, "model", i) for i, state in enumerate(states)]
        files += [(_numbered("optimizer", i), opt.state_dict(), "optimizer", i) for i, opt in enumerate(call.optimizers)]
        for name, state, kind, i in files:
            base = None
            if self.incremental is not None and call.staging.parent == call.target.parent:
                base = self.incremental.base_for(call.target / name, slot=name)
            path = call.staging / name
            options = self.session.save_options(path, metadata={"accelerate": {"kind": kind, "index": i, **meta}}, base=base)
            if call.background:
                self.session.add_file(call.group, name, state, path, options)
            else:
                call.group.add_report(name, self.session.save_now(state, path, options))
            (call.models if kind == "model" else call.optimizer_files).append(name)

    def _writes(self) -> bool:
        # The processes that accelerate.utils.save lets write are the ones that commit.
        acc = self.accelerator
        if acc.project_configuration.save_on_each_node:
            return acc.is_local_main_process
        return acc.is_main_process

    # -- loading ---------------------------------------------------------------------------
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """``Accelerator.load_state`` for directories saved with or without these hooks; same arguments.

        Raises:
            FormatError: A file listed in the manifest is missing, truncated or altered (named in
                the message), or the directory holds ``.nvc`` files but no manifest.
            ChecksumError: A ``.nvc`` file or another file of the directory is corrupt.
            MixedSaveError: A ``.nvc`` file was written by another save than the manifest's (a
                file copied in from another checkpoint, even one of the same size).
        """
        acc = self.accelerator
        deepspeed = self._tags is not None
        if self._settles_on_every_rank:
            # The directory to load may be the one a pending save is about to commit; its failure
            # on the committing process is raised on every process.
            self._settle_on_every_rank("load_state")
        elif self.async_save:
            # The directory to load may be the one a pending save is about to commit.
            self.session.settle()
            if acc.num_processes > 1:
                acc.wait_for_everyone()  # the other ranks wait for the main process's commit
        if input_dir is None and not acc.project_configuration.automatic_checkpoint_naming:
            if self.async_save:
                self.session.raise_errors("load_state")
            self._inner_load(None, load_kwargs, **load_model_func_kwargs)  # Accelerate's own error
            return

        def locate() -> tuple[Path, dict[str, Any] | None]:
            if self.async_save:
                self.session.raise_errors("load_state")
            if input_dir is not None:
                found = Path(os.path.expanduser(os.fspath(input_dir)))
                _STORE.recover(found)
            else:
                found = _latest(Path(acc.project_dir) / "checkpoints")
            # With leader_load only the process that reads the .nvc files opens them (their index
            # digests too); its verdict reaches the others through checked_on_every_rank.
            reads = not self.leader_load or acc.is_local_main_process
            return found, _STORE.checked_manifest(found, lists=("models", "optimizers"), identities=reads)

        # With leader_load the loads below are collectives: a failed background save (the main
        # process's) or a directory that differs on one node makes every rank raise, not wait. So
        # are DeepSpeed's (each rank loads its partition, and the engine agrees on the outcome).
        path, manifest = checked_on_every_rank(locate, "load_state", self.leader_load or deepspeed)
        if manifest is None:  # saved without these hooks
            self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            return
        if "deepspeed" in manifest or acc.distributed_type == DistributedType.DEEPSPEED:
            _check_deepspeed_loadable(acc, path, manifest)
            self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            self._next_iteration_after(manifest)
            return
        if "fsdp" in manifest or acc.distributed_type == DistributedType.FSDP:
            accelerate_fsdp.check_loadable(acc, path, manifest)
            with accelerate_fsdp.nvcomp_fsdp_functions(accelerate.accelerator):
                self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            self._next_iteration_after(manifest)
            return
        if len(manifest["optimizers"]) != len(acc._optimizers):
            raise CheckpointError(
                f"{path}: holds the state of {len(manifest['optimizers'])} optimizer(s) "
                f"({', '.join(manifest['optimizers']) or 'none'}) but {len(acc._optimizers)} are prepared; "
                "prepare the same optimizers as the run that saved it."
            )
        map_location = load_model_func_kwargs.get("map_location")
        if map_location not in (None, "cpu", "on_device"):
            raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or `'on_device'`")
        if map_location is None:
            # Accelerate's rule: the CPU unless several processes each own a device.
            multi = acc.num_processes > 1 and acc.multi_device and acc.distributed_type != DistributedType.MULTI_XPU
            map_location = "on_device" if multi else "cpu"
        call = _LoadCall(
            path,
            manifest,
            acc._optimizers,
            acc.device if map_location == "on_device" else "cpu",
            bool((load_kwargs or {}).get("weights_only", True)),
            {k: v for k, v in load_model_func_kwargs.items() if k != "map_location"},
        )
        handle = acc.register_load_state_pre_hook(self._load_hook)
        acc._optimizers = []
        self._loading = call
        try:
            self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
        finally:
            self._loading = None
            acc._optimizers = call.optimizers
            handle.remove()
        self._next_iteration_after(manifest)

    def _next_iteration_after(self, manifest: dict[str, Any]) -> None:
        if self.tiers is not None and isinstance(manifest.get("iteration"), int):
            # The tiers name copies by iteration: the next save must come after the one loaded.
            self.accelerator.project_configuration.iteration = manifest["iteration"] + 1

    def _load_hook(self, models: list[torch.nn.Module], input_dir: str) -> None:
        call = self._loading
        if call is None or Path(input_dir) != call.path:
            return
        names = call.manifest["models"]
        if len(names) != len(models):
            raise CheckpointError(
                f"{call.path}: holds {len(names)} model file(s) ({', '.join(names) or 'none'}) but "
                f"{len(models)} model(s) are left to load after your load hooks; prepare the same models "
                "and register the same hooks as the run that saved it."
            )
        for model, name in zip(models, names):
            state = load_tree(call.path / name, call.map_location, leader_load=self.leader_load)
            model.load_state_dict(state, **call.model_kwargs)
        models.clear()
        for optimizer, name in zip(call.optimizers, call.manifest["optimizers"]):
            state = load_tree(call.path / name, call.map_location, weights_only=call.weights_only, leader_load=self.leader_load)
            optimizer.load_state_dict(state)


# -- DeepSpeed --------------------------------------------------------------------------------
def _attach_deepspeed(accelerator: Accelerator, options: SessionOptions) -> Callable[[], None]:
    """Attach our checkpoint engine to each DeepSpeed engine the accelerator has prepared or will prepare.

    The engines write the ZeRO partition files (in the background with ``async_save``: they are then
    decoupled, and commit each tag at the first optimizer step at which every rank's files are durable)
    and each delta against the same file of the previous folder (``incremental``, through the session's
    chains, see :class:`_DeepSpeedTags`). The tiers are the session's: they copy the whole folder.
    """
    # Imported here: the hooks of an Accelerator without DeepSpeed must not need DeepSpeed.
    from nvcomp_checkpoint.entrypoint.deepspeed_engine import attach_after  # noqa: PLC0415

    def committed(report: nc.SaveReport) -> None:
        # Routed through the accelerator: an engine outlives the hooks that attached it (remove(), register again).
        hooks = getattr(accelerator, "_nvcomp_state_hooks", None)
        if isinstance(hooks, NvcompStateHooks) and hooks._tags is not None:
            hooks._tags.committed(report)

    return attach_after(
        accelerator,
        "prepare",
        lambda: list(accelerator._models),
        policy=options.policy,
        workers=options.workers,
        async_save=options.async_save,
        incremental=options.incremental or False,
        on_saved=committed,
    )


class _DeepSpeedTags:
    """The DeepSpeed tags of the folder being saved, as parts of its save (on every process).

    The session owns the folder's save; each tag (``pytorch_model/`` ...) is one of its parts, done
    when the engine has committed it on every rank (its ``on_saved``), so the folder's manifest, its
    copy to the tiers and the rotation come after every rank's partition is durable. With
    ``incremental``, the engines choose each file's base through the session's chains, by the path
    the file is committed at (a delta names its base relative to itself; the folder is staged at the
    depth it is committed at, as Accelerate's own ``.nvc`` files are).
    """

    def __init__(self, accelerator: Accelerator, incremental: IncrementalFiles | None) -> None:
        self.accelerator = accelerator
        self.incremental = incremental
        self._lock = threading.Lock()
        self._expected: dict[str, concurrent.futures.Future[nc.SaveReport]] = {}  # tag folder -> its commit
        self._current: dict[str, concurrent.futures.Future[nc.SaveReport]] = {}  # the tags of the save under way
        self._moves: tuple[Path, Path] | None = None  # (staging, target) of the save under way

    def _engines(self) -> list[Any]:
        from nvcomp_checkpoint.entrypoint.deepspeed_engine import NvcompCheckpointEngine  # noqa: PLC0415

        found = [getattr(m, "checkpoint_engine", None) for m in self.accelerator._models]
        return [e for e in found if isinstance(e, NvcompCheckpointEngine)]

    @contextlib.contextmanager
    def saving(self, staging: Path, target: Path) -> Any:
        """While Accelerate's ``save_state`` writes into ``staging``: expect each model's tag there."""
        tags = [_tag_key(staging / (MODEL_NAME if i == 0 else f"{MODEL_NAME}_{i}")) for i in range(len(self.accelerator._models))]
        with self._lock:
            self._current = {tag: concurrent.futures.Future() for tag in tags}
            self._expected.update(self._current)
        if self.incremental is not None:
            for engine in self._engines():
                if not isinstance(engine.incremental, _CommittedPaths):
                    engine.incremental = _CommittedPaths(self.incremental, self)
        self._moves = (staging, target)
        try:
            yield
        finally:
            self._moves = None

    def committed_path(self, path: str) -> tuple[str, str] | None:
        """Where a file staged now is committed, and its slot (its path in the folder); None outside a save."""
        moves = self._moves
        if moves is None:
            return None
        staging, target = moves
        rel = os.path.relpath(os.path.abspath(path), staging)
        if rel.startswith("..") or staging.parent != target.parent:
            return None  # not a file of the folder, or staged inside it (an in-place update: saved in full)
        return os.fspath(target / rel), rel.replace(os.sep, "/")

    def committed(self, report: nc.SaveReport) -> None:
        """An engine's ``on_saved``: its tag is committed on every rank."""
        with self._lock:
            future = self._expected.pop(_tag_key(report.path), None)
        if future is not None and not future.done():
            future.set_result(report)

    def commit_in_flight(self) -> None:
        """Commit the tags the engines still hold (collective: every process calls it, as ``save_state``).

        A tag expected and still not committed then never will be (its commit failed, raised on every
        rank where it ran): its folder's save fails with it.
        """
        error: BaseException | None = None
        for engine in self._engines():
            try:
                engine.wait()
            except BaseException as exc:  # noqa: BLE001 - ends the expected tags, then raised
                error = error or exc
        with self._lock:
            left, self._expected = self._expected, {}
        for tag, future in left.items():
            if not future.done():
                future.set_exception(
                    CheckpointWriteError(
                        f"{tag}: DeepSpeed did not commit this tag ({error or 'its commit failed on a rank, raised there'}); "
                        "the folder is not committed"
                    )
                )
        if error is not None:
            raise error

    def hand_over(self, session: CheckpointSession, group: SaveGroup, *, background: bool) -> None:
        """Each tag of the folder as a part of ``group``: its report once the engines have committed it."""
        with self._lock:
            mine, self._current = self._current, {}
        for tag, future in sorted(mine.items()):
            name = os.path.basename(tag)
            if not os.path.isdir(tag):
                with self._lock:
                    self._expected.pop(tag, None)  # a model Accelerate did not save through DeepSpeed
                continue
            if future.done() or not background:
                if not future.done():
                    raise CheckpointWriteError(f"{tag}: DeepSpeed did not commit this tag within save_state")
                group.add_report(name, future.result())
            else:
                session.add_job(group, name, functools.partial(_committed_report, future, tag))


class _CommittedPaths:
    """The session's ``incremental`` chains as a DeepSpeed engine's: each file by the path it is committed at."""

    def __init__(self, files: IncrementalFiles, tags: _DeepSpeedTags) -> None:
        self.files = files
        self.tags = tags
        self.storage_options = files.storage_options

    def base_for(self, path: str | os.PathLike[str], slot: str = "") -> str | None:
        moved = self.tags.committed_path(os.fspath(path))
        if moved is None:
            return None  # outside a save of these hooks (after remove(), an in-place update): in full
        return self.files.base_for(*moved)

    def failed(self, slot: str | None = None, path: str | os.PathLike[str] | None = None) -> None:
        moved = None if path is None else self.tags.committed_path(os.fspath(path))
        self.files.failed(None if moved is None else moved[1], None if moved is None else moved[0])


def _committed_report(future: concurrent.futures.Future[nc.SaveReport], tag: str) -> nc.SaveReport:
    """Wait (on the session's background thread) until the engines commit ``tag``; its report."""
    while True:
        try:
            return future.result(timeout=0.2)
        except concurrent.futures.TimeoutError:
            # The engines commit a tag in the training loop (an optimizer step, save_state, wait()); once
            # the main thread is gone none will, and the exit must not wait for it.
            if not threading.main_thread().is_alive():
                raise CheckpointWriteError(
                    f"{tag}: the process ended before DeepSpeed committed this tag (call hooks.wait() on every "
                    "process before the end of the run); the folder is not committed"
                ) from None


def _tag_key(path: str | os.PathLike[str]) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(path)))


def _distributed(accelerator: Accelerator) -> bool:
    return accelerator.num_processes > 1 and leader_load_applies()


def _on_every_process(action: Callable[[], Any], where: str) -> Any:
    """``action()`` on every process, raising on every one if it raised on any (collective when distributed).

    A save is committed by one process (and with DeepSpeed each rank writes its own partition): a
    failure there must not leave the others training on as if the checkpoint existed. The one
    agreement of every rank (:func:`~nvcomp_checkpoint.entrypoint.commit.gather_outcomes`, as the
    collective commit's): a process whose ``action`` raised raises its own error; the others a
    :class:`CheckpointWriteError` naming it and its message.
    """
    if not leader_load_applies():
        return action()
    result, error, outcomes = gather_outcomes(action, share=False)
    if error is not None:
        raise error
    failed = [(rank, outcome.error) for rank, outcome in enumerate(outcomes) if not outcome.ok]
    if failed:
        rank, message = failed[0]
        raise CheckpointWriteError(f"{where}: process {rank} failed, so every process raises: {message}")
    return result


def _reraise(errors: list[BaseException]) -> None:
    if errors:
        raise errors[0]


def _is_deepspeed_file(staging: Path, path: Path) -> bool:
    rel = path.relative_to(staging).parts
    return len(rel) == 2 and _DEEPSPEED_TAG.fullmatch(rel[0]) is not None


def _check_deepspeed_loadable(accelerator: Accelerator, path: Path, manifest: dict[str, Any]) -> None:
    """A DeepSpeed save loads into a DeepSpeed Accelerator only, and only with as many models as it holds."""
    tags = (manifest.get("deepspeed") or {}).get("tags")
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not isinstance(tags, list):
        saved = "DeepSpeed" if isinstance(tags, list) else "without DeepSpeed"
        raise CheckpointError(
            f"{path}: saved {saved}, but this Accelerator {'uses' if accelerator.distributed_type == DistributedType.DEEPSPEED else 'does not use'} "
            "DeepSpeed; load it with the same distributed setup as the run that saved it."
        )
    if len(tags) != len(accelerator._models):
        raise CheckpointError(
            f"{path}: holds {len(tags)} DeepSpeed model(s) ({', '.join(tags) or 'none'}) but {len(accelerator._models)} "
            "are prepared; prepare the same models as the run that saved it."
        )


# -- what is specific to Accelerate's directories ------------------------------------------
def _numbered(stem: str, i: int) -> str:
    return f"{stem}.nvc" if i == 0 else f"{stem}_{i}.nvc"


def _save_failed(target: Path, exc: BaseException) -> StateSaveError:
    if isinstance(exc, InstallError):
        return StateSaveError(
            f"{target}: save_state failed while moving the new files into this directory ({exc.__cause__}). It "
            f"now holds part of them and no {MANIFEST_NAME}, so load_state refuses it as incomplete. Fix the "
            "cause and save again, or load another checkpoint."
        )
    return StateSaveError(
        f"{target}: save_state failed ({exc}). Nothing was committed: the checkpoint directory "
        f"that was at {target}, if any, is untouched. Free space or fix the cause and save again."
    )


def _is_state_file(name: str) -> bool:
    """Files that a save_state writes, with or without these hooks (and their temporaries)."""
    temporary = name.startswith(".") and (".tmp-" in name or ".nvckpt-" in name)
    saved = _STATE_FILE.fullmatch(name) is not None or accelerate_fsdp.is_fsdp_state_name(name)
    return temporary or name in (MANIFEST_NAME, MARKER_NAME) or saved


def _number(name: str) -> int | None:
    # Accelerate's own ordering: the last run of digits in the name.
    found = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", name)
    return int(found[0]) if found else None


def _latest(checkpoints: Path) -> Path:
    dirs = numbered_dirs(checkpoints, _number)
    if not dirs:
        raise FormatError(f"{checkpoints}: no checkpoint to load (automatic_checkpoint_naming found no checkpoint_<n>)")
    return dirs[-1][1]
