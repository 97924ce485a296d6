"""Hugging Face Accelerate integration: ``accelerator.save_state``/``load_state`` with compressed
model weights and optimizer state, committed atomically as a whole directory.

``register_nvcomp_hooks(accelerator, policy)`` makes every ``save_state`` write each model's
weights to ``model.nvc`` (``model_1.nvc`` ...) and each optimizer's state to ``optimizer.nvc``
(``optimizer_1.nvc`` ...) instead of ``model.safetensors`` and ``optimizer.bin``; everything else
(scheduler, RNG states, samplers, GradScaler, ``register_for_checkpointing`` objects, files written
by your own save hooks) is still written by Accelerate itself, unchanged.

Design
------
Why a wrapper: Accelerate's save pre-hook (``register_save_state_pre_hook``) sees only the models'
state dicts; ``save_state`` writes ``optimizer.bin`` itself (accelerate PR 991), and
``load_accelerator_state`` reads it with ``torch.load``. The registrar therefore replaces
``save_state`` and ``load_state`` *on this accelerator instance* (``handle.remove()`` puts them
back) and, inside each call, drives Accelerate's own method through its supported seams:

* model weights go through the documented pre-hooks: a save pre-hook, registered for the duration
  of one call so that it runs after every hook of yours, takes the state dicts out of the
  ``weights`` list (as Accelerate's docs say a hook that saves models itself must); the load
  pre-hook loads the models and empties the ``models`` list;
* optimizer state is the one thing with no hook: during the inner call the accelerator's
  optimizer list (``accelerator._optimizers``, the only private attribute touched) is swapped
  for an empty one, and the pre-hooks save / load the optimizers instead;
* with ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the wrapper picks
  ``checkpoints/checkpoint_<iteration>`` itself and turns automatic naming off for the inner
  call, because Accelerate deletes the oldest checkpoints *before* writing the new one.

Crash safety: a save is written into a hidden staging directory (``.<name>.nvckpt-staging`` next
to the target, or in ``project_dir`` with automatic naming, never inside ``checkpoints/``, whose
entries Accelerate sorts by number). When everything is written, every file is fsynced and a
manifest, ``nvcomp_checkpoint.json`` (the names, sizes and, for files other than ``.nvc``, BLAKE2b
digests), is written last; then the directory is renamed into place. Replacing an existing
directory is one atomic ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere the old directory is
renamed aside first and restored by the next ``save_state``/``load_state`` if a crash comes
between the two renames. So the target is always either the complete previous checkpoint or the
complete new one, never a mix of plain and compressed files. Only after the commit are
checkpoints beyond ``total_limit`` deleted (oldest first, renamed out of ``checkpoints/`` before
removal), so rotation can never delete the newest complete checkpoint. A failed save removes its
staging directory, leaves ``save_iteration`` unchanged and raises ``CheckpointWriteError``.

Saving into a directory that is not only a checkpoint: a directory is replaced as a whole only if
it holds nothing but saved state (Accelerate's files, ours, and what the previous save's manifest
lists). A target that is the current working directory or one of its ancestors
(``save_state(".")``, ``save_state("..")``), a symbolic link, or a directory holding anything else
(your notes, a ``save_pretrained`` folder, a project's sources) is updated in place instead, as
Accelerate updates it: the staging directory is ``.nvckpt-staging`` inside the target, and each
saved file is moved in with one atomic rename (folders are merged into, never replaced); everything
else in the directory is left alone, with the same inode. The previous manifest is removed first,
``.nvc`` files are moved before Accelerate's, and the new manifest comes last. The guarantee there
is per file, not per directory: a save that fails while writing (a full disk) leaves the previous
checkpoint untouched; a crash while the files are being renamed into place (a few renames) leaves
``.nvc`` files without a manifest, which ``load_state`` refuses as incomplete (save again, or load
another checkpoint), never a silent mix of old and new files. Files that this save does not write
stay, as with Accelerate (a ``model.safetensors`` of an earlier save without these hooks, with a
warning), except the previous save's ``.nvc`` files, which are deleted.

Async saves (``async_save=True``): ``save_state`` copies the model and optimizer state (a
snapshot; training may change every tensor as soon as it returns), lets Accelerate write its own
small files into the staging directory as usual, and returns; one background thread compresses
and writes the ``.nvc`` files into the staging directory. The commit (manifest, fsync, rename) and
then the ``total_limit`` rotation run on that thread only once every ``.nvc`` file is durable:
the same order as a synchronous save, only later, so the target is still always the complete
old or the complete new checkpoint. One ``save_state`` is in flight at a time: the next
``save_state``, ``load_state``, ``handle.wait()`` and ``handle.remove()`` first wait for the
pending one, and raise its error if it failed (its staging directory is then removed, nothing
is committed, and ``save_iteration`` goes back to the failed save's number, as for a synchronous
failure). The directory ``save_state`` returns appears only at the commit.

Loading: a directory with the manifest is checked against it (a missing, truncated or altered
file is named in the error) and loaded from the ``.nvc`` files; a directory without it (written
by plain Accelerate) is handed to Accelerate's own ``load_state`` untouched; a directory holding
``.nvc`` files but no manifest is refused as incomplete.

Scope: one process, or several (DDP) sharing a file system, where the main process (each node's
local main with ``save_on_each_node``) writes and commits, with barriers around the commit. FSDP,
DeepSpeed, Megatron-LM and XLA save sharded state with their own writers and are refused at
registration. Directories are local or mounted paths, as Accelerate's are.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import accelerate
import torch
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
)

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError, ChecksumError, FormatError
from nvcomp_checkpoint.api import log_report
from nvcomp_checkpoint.report import merge_reports
from nvcomp_checkpoint.storage import fsync_path

__all__ = [
    "register_nvcomp_hooks",
    "NvcompStateHooks",
    "MANIFEST_NAME",
    "is_nvcomp_state_dir",
]

logger = logging.getLogger(__name__)

#: Written last into a saved directory: its presence means the save completed.
MANIFEST_NAME = "nvcomp_checkpoint.json"
_FORMAT = "nvcomp-checkpoint/accelerate-state"
_VERSION = 1
_STAGING = ".nvckpt-staging"
_OLD = ".nvckpt-old"
_DELETING = ".nvckpt-deleting"
_STATE_FILE = re.compile(
    "|".join([
        rf"({re.escape(stem)})(_\d+)?\.{ext}"
        for stem, ext in (
            (SAFE_MODEL_NAME, "safetensors"), (MODEL_NAME, "bin"), (OPTIMIZER_NAME, "bin"), (SCHEDULER_NAME, "bin"),
            (SAMPLER_NAME, "bin"), ("dl_state_dict", "bin"), ("model", "nvc"), ("optimizer", "nvc"),
        )
    ] + [re.escape(SCALER_NAME), rf"{re.escape(RNG_STATE_NAME)}_\d+\.pkl", r"custom_checkpoint_\d+\.pkl"])
)
# Accelerate's own model and optimizer files, which these hooks write as .nvc instead.
_PLAIN_STATE_FILE = re.compile(
    rf"({re.escape(SAFE_MODEL_NAME)}|{re.escape(MODEL_NAME)})(_\d+)?\.(safetensors|bin)|{re.escape(OPTIMIZER_NAME)}(_\d+)?\.bin"
)
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
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
) -> "NvcompStateHooks":
    """Make ``accelerator.save_state``/``load_state`` compress model weights and optimizer state.

    Args:
        accelerator: The ``Accelerator`` whose checkpoints to compress.
        policy: Codec settings per component (weights, ``exp_avg``, ``exp_avg_sq`` ...);
            defaults to :class:`nvcomp_checkpoint.CodecPolicy()`.
        workers: Compression threads per file (default: every core).
        async_save: ``save_state`` returns once model and optimizer state are copied; the
            ``.nvc`` files, the commit and the rotation follow in the background (see the module
            docstring). Holds one extra copy of that state in host memory while a save is pending.
        on_saved: Called with the :class:`~nvcomp_checkpoint.SaveReport` of each ``save_state``
            once its directory is committed (with ``async_save``, on the background thread).
        stream_wrapper: Wraps the output stream of each ``.nvc`` file (throttling, byte
            counting ...); its ``write`` must pass every byte on, in order.

    Returns:
        A handle: ``handle.last_report`` is the :class:`~nvcomp_checkpoint.SaveReport` of the
        last committed save (per component, all ``.nvc`` files together), ``handle.wait()``
        waits for a pending async save, and ``handle.remove()`` restores Accelerate's own
        ``save_state``/``load_state``.

    Raises:
        CheckpointError: The accelerator uses DeepSpeed, FSDP, Megatron-LM or XLA, or already
            has these hooks.

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
    if isinstance(getattr(accelerator, "_nvcomp_state_hooks", None), NvcompStateHooks):
        raise CheckpointError(
            "register_nvcomp_hooks: this Accelerator already has nvcomp-checkpoint hooks; call .remove() on "
            "the handle returned by the first call before registering again."
        )
    if on_saved is not None and not callable(on_saved):
        raise TypeError(f"register_nvcomp_hooks(on_saved=...) takes a callable, got {type(on_saved).__name__}")
    return NvcompStateHooks(
        accelerator, policy or nc.CodecPolicy(), workers,
        async_save=async_save, on_saved=on_saved, stream_wrapper=stream_wrapper,
    )


def is_nvcomp_state_dir(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a complete directory written by ``save_state`` with these hooks."""
    return (Path(path) / MANIFEST_NAME).is_file()


@dataclass
class _SaveCall:
    staging: Path
    optimizers: list[Any]
    iteration: int
    writes: bool
    step: int = 0
    models: list[str] = field(default_factory=list)
    optimizer_files: list[str] = field(default_factory=list)
    reports: dict[str, nc.SaveReport] = field(default_factory=dict)
    pending: "_PendingSave | None" = None  # set for an async save


@dataclass
class _PendingSave:
    """An async ``save_state`` whose ``.nvc`` files are being written; committed when all are durable."""

    call: _SaveCall
    target: Path
    shown: Path
    checkpoints: Path | None  # with automatic naming: where total_limit rotation runs
    total_limit: int | None
    started: float
    blocked: float = 0.0
    handles: dict[str, nc.AsyncSaveHandle] = field(default_factory=dict)
    done: int = 0
    sealed: bool = False  # save_state has handed over every file
    committing: bool = False
    abandoned: bool = False  # save_state failed itself and cleans up
    errors: list[BaseException] = field(default_factory=list)
    error: BaseException | None = None  # the outcome, once finished
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass
class _LoadCall:
    path: Path
    manifest: dict[str, Any]
    optimizers: list[Any]
    map_location: str | torch.device
    weights_only: bool
    model_kwargs: dict[str, Any]


class NvcompStateHooks:
    """The handle :func:`register_nvcomp_hooks` returns; see the module docstring for the design.

    Attributes:
        accelerator: The accelerator whose ``save_state``/``load_state`` are wrapped.
        policy: The codec policy of every save.
        workers: Compression threads per file.
        async_save: Whether ``save_state`` writes the ``.nvc`` files and commits in the background.
        on_saved: Called with the report of each committed save (with ``async_save``, on the
            background thread; it must not call :meth:`wait`).
        last_report: Per-component totals of the last committed save's ``.nvc`` files (``None``
            before the first save and on processes that write nothing); ``seconds_blocked`` is
            the time ``save_state`` held the caller, ``seconds`` the time until the commit.
        last_reports: The same, per file name.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        policy: nc.CodecPolicy,
        workers: int | None,
        *,
        async_save: bool = False,
        on_saved: Callable[[nc.SaveReport], Any] | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.policy = policy
        self.workers = workers
        self.async_save = bool(async_save)
        self.on_saved = on_saved
        self.stream_wrapper = stream_wrapper
        self.last_report: nc.SaveReport | None = None
        self.last_reports: dict[str, nc.SaveReport] = {}
        self._saver: nc.AsyncSaver | None = None
        self._pending: _PendingSave | None = None
        self._callback_thread: int | None = None  # the thread running on_saved, which must not wait
        self._saving: _SaveCall | None = None
        self._loading: _LoadCall | None = None
        # Whatever save_state/load_state were before (Accelerate's, or another wrapper's) is
        # what the inner call runs and what remove() puts back.
        self._previous = {name: accelerator.__dict__.get(name) for name in ("save_state", "load_state")}
        self._inner_save: Callable[..., Any] = accelerator.save_state
        self._inner_load: Callable[..., Any] = accelerator.load_state
        accelerator.save_state = self.save_state  # type: ignore[method-assign]
        accelerator.load_state = self.load_state  # type: ignore[method-assign]
        accelerator._nvcomp_state_hooks = self  # type: ignore[attr-defined]

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
            self.wait()
        finally:
            for name in ("save_state", "load_state"):
                previous = self._previous[name]
                if previous is None:
                    del acc.__dict__[name]
                else:
                    setattr(acc, name, previous)
            del acc.__dict__["_nvcomp_state_hooks"]
            saver, self._saver = self._saver, None
            if saver is not None:
                saver.close()

    # -- async saves ------------------------------------------------------------------------
    def pending(self) -> bool:
        """True while an async ``save_state`` is not yet committed (or failed)."""
        job = self._pending
        return job is not None and not job.finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until a pending async ``save_state`` is committed; raise its error if it failed.

        Raises:
            CheckpointWriteError: The background save failed; nothing was committed, the previous
                directory at its target is untouched, and ``save_iteration`` is back at its number.
            TimeoutError: Still pending after ``timeout`` seconds.
        """
        self._wait_pending(timeout)
        self._raise_pending("wait()")

    def _wait_pending(self, timeout: float | None = None) -> None:
        if self._callback_thread == threading.get_ident():
            raise RuntimeError(
                "NvcompStateHooks: save_state/load_state/wait() was called from on_saved, which runs on the "
                "background save thread and would wait for itself; call it from the training loop instead."
            )
        job = self._pending
        if job is not None and not job.finished.wait(timeout):
            raise TimeoutError(f"{job.target}: async save_state still running after {timeout} s")

    def _raise_pending(self, when: str) -> None:
        job = self._pending
        if job is None or not job.finished.is_set():
            return
        self._pending = None
        if job.error is not None:
            # As after a synchronous failure: the next save_state reuses the failed one's number.
            self.accelerator.project_configuration.iteration = job.call.iteration
            raise CheckpointWriteError(f"{job.error} (an async save_state; reported by {when})") from job.error

    def _async_saver(self, files: int) -> nc.AsyncSaver:
        # Room for every file of one save_state, so that handing over the optimizer state never
        # waits for the model file to be written; save_state itself allows one save in flight.
        if self._saver is None or self._saver.max_pending < files:
            if self._saver is not None:
                self._saver.close()  # idle: save_state waited for the previous save
            self._saver = nc.AsyncSaver(max_pending=max(1, files), workers=self.workers)
        return self._saver

    def _file_done(self, job: _PendingSave, name: str, handle: nc.AsyncSaveHandle) -> None:
        """One ``.nvc`` file is durable or failed (on the saver's thread)."""
        error = handle.exception()  # taken here: this handle reports it, once
        with job.lock:
            if error is not None:
                job.errors.append(error)
            else:
                job.call.reports[name] = handle.result()
            job.done += 1
        self._commit_if_complete(job)

    def _seal(self, job: _PendingSave) -> None:
        """save_state handed over every file: commit now if all are already durable, else when they are."""
        with job.lock:
            job.sealed = True
        self._commit_if_complete(job)

    def _commit_if_complete(self, job: _PendingSave) -> None:
        """Commit ``job`` once: when it is sealed and every file is in (called after either event)."""
        with job.lock:
            ready = job.sealed and not job.abandoned and not job.committing and job.done == len(job.handles)
            if ready:
                job.committing = True
        if ready:
            self._commit_pending(job)

    def _abandon(self, job: _PendingSave) -> None:
        """save_state failed on the caller's side: let the files already handed over finish, commit nothing."""
        with job.lock:
            job.abandoned = True
        for handle in list(job.handles.values()):
            handle.wait()
        job.finished.set()

    def _commit_pending(self, job: _PendingSave) -> None:
        """Manifest, commit and rotation of an async save; runs once every file is durable."""
        call, target = job.call, job.target
        try:
            try:
                if job.errors:
                    raise job.errors[0]
                _write_manifest(call, self.policy)
                replaced = _commit(call.staging, target)  # the commit point
            except BaseException as exc:  # noqa: BLE001 - kept for the caller, never lost
                shutil.rmtree(call.staging, ignore_errors=True)
                job.error = _save_failed(target, exc)
                job.error.__cause__ = exc
                logger.error("%s", job.error)
                return
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            if job.checkpoints is not None and job.total_limit is not None:
                _rotate(job.checkpoints, job.checkpoints.parent, job.total_limit, keep=target)
            self._committed(str(job.shown), call.reports, time.perf_counter() - job.started, job.blocked)
        finally:
            job.finished.set()

    def _committed(self, shown: str, reports: dict[str, nc.SaveReport], seconds: float, blocked: float) -> None:
        self.last_reports = dict(reports)
        self.last_report = report = merge_reports(shown, reports.values(), seconds, blocked)
        log_report(report, "save_state")
        if self.on_saved is not None:
            self._callback_thread = threading.get_ident()
            try:
                self.on_saved(report)
            except Exception:
                logger.exception("%s: the on_saved callback raised", shown)
            finally:
                self._callback_thread = None

    # -- saving ----------------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any) -> Path:
        """``Accelerator.save_state`` with compressed weights and optimizer state; same arguments.

        With ``async_save``, returns once the state is copied; the directory appears when the
        background save commits it (``hooks.wait()`` waits for that).

        Returns:
            The directory written (``checkpoints/checkpoint_<n>`` with automatic naming).

        Raises:
            CheckpointWriteError: Writing failed (the disk is full ...); the directory that was
                at the target before, if any, is untouched and ``save_iteration`` is unchanged.
                With ``async_save``: the previous, pending save failed (this one is not started).
        """
        acc = self.accelerator
        config = acc.project_configuration
        entered = time.perf_counter()
        if self.async_save:
            # One save in flight: its commit and rotation must land before this one starts.
            self._wait_pending()
            self._raise_pending("the next save_state")
        auto = bool(config.automatic_checkpoint_naming)
        if auto:
            checkpoints = Path(os.path.abspath(acc.project_dir)) / "checkpoints"
            shown = Path(os.path.join(acc.project_dir, "checkpoints", f"checkpoint_{acc.save_iteration}"))
            target = checkpoints / shown.name
            staging = checkpoints.parent / f".{target.name}{_STAGING}"
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
            staging = target.parent / f".{target.name}{_STAGING}"
        writes = self._writes()
        start = time.perf_counter()
        call = _SaveCall(staging, acc._optimizers, config.iteration, writes, acc.step)
        if self.async_save and writes:
            call.pending = _PendingSave(
                call, target, shown, checkpoints if auto else None, config.total_limit if auto else None, entered
            )
        replaced: Path | None = None
        try:
            if writes:
                target.parent.mkdir(parents=True, exist_ok=True)
                _recover(target)
            # Every rank writes into the staging directory, so all must choose it from the same,
            # recovered target.
            acc.wait_for_everyone()
            if not auto and _in_place(target):
                call.staging = staging = target / _STAGING  # same file system as the files it replaces
            if writes:
                if staging.exists():  # left by a save that crashed
                    shutil.rmtree(staging)
                staging.mkdir(parents=True)
            acc.wait_for_everyone()
            self._run_inner_save(call, auto, safe_serialization, save_model_func_kwargs)
            acc.wait_for_everyone()
            if call.pending is not None:
                call.pending.blocked = time.perf_counter() - entered
                self._pending = call.pending
                self._seal(call.pending)
            elif writes:
                _write_manifest(call, self.policy)
                replaced = _commit(staging, target)  # the commit point: nothing after it can fail the save
        except BaseException as exc:
            config.iteration = call.iteration
            if call.pending is not None and self._pending is not call.pending:
                self._abandon(call.pending)  # its files must stop writing into staging first
            if writes:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, (OSError, RuntimeError, CheckpointWriteError)):
                raise _save_failed(target, exc) from exc
            raise
        if self.async_save:
            return shown  # committed, rotated and reported by _commit_pending
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)  # the previous checkpoint; leftovers are cleaned next time
        if writes and auto and config.total_limit is not None:
            _rotate(checkpoints, checkpoints.parent, config.total_limit, keep=target)
        acc.wait_for_everyone()
        if writes:
            seconds = time.perf_counter() - start
            self._committed(str(shown), call.reports, seconds, seconds)
        return shown

    def _run_inner_save(self, call: _SaveCall, auto: bool, safe_serialization: bool, kwargs: dict[str, Any]) -> None:
        acc = self.accelerator
        config = acc.project_configuration
        handle = acc.register_save_state_pre_hook(self._save_hook)
        acc._optimizers = []
        config.automatic_checkpoint_naming = False
        self._saving = call
        try:
            self._inner_save(str(call.staging), safe_serialization=safe_serialization, **kwargs)
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
        if not call.writes:
            return
        meta = {"step": self.accelerator.step, "iteration": call.iteration}
        files = [(_numbered("model", i), state, "model", i) for i, state in enumerate(states)]
        files += [(_numbered("optimizer", i), opt.state_dict(), "optimizer", i) for i, opt in enumerate(call.optimizers)]
        job = call.pending
        saver = self._async_saver(len(files)) if job is not None else None
        for name, state, kind, i in files:
            metadata = {"accelerate": {"kind": kind, "index": i, **meta}}
            if job is None:
                call.reports[name] = nc.save(
                    state, call.staging / name, self.policy, workers=self.workers, metadata=metadata,
                    stream_wrapper=self.stream_wrapper,
                )
            else:
                assert saver is not None
                handle = saver.save(
                    state, call.staging / name, self.policy, workers=self.workers, metadata=metadata,
                    stream_wrapper=self.stream_wrapper,
                )
                with job.lock:
                    job.handles[name] = handle
                handle.add_done_callback(lambda h, name=name: self._file_done(job, name, h))
            (call.models if kind == "model" else call.optimizer_files).append(name)

    def _writes(self) -> bool:
        # The processes that accelerate.utils.save lets write are the ones that commit.
        acc = self.accelerator
        if acc.project_configuration.save_on_each_node:
            return acc.is_local_main_process
        return acc.is_main_process

    # -- loading ---------------------------------------------------------------------------
    def load_state(self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None, **load_model_func_kwargs: Any) -> None:
        """``Accelerator.load_state`` for directories saved with or without these hooks; same arguments.

        Raises:
            FormatError: A file listed in the manifest is missing, truncated or altered (named in
                the message), or the directory holds ``.nvc`` files but no manifest.
            ChecksumError: A ``.nvc`` file or another file of the directory is corrupt.
        """
        acc = self.accelerator
        if self.async_save:
            # The directory to load may be the one a pending save is about to commit.
            self._wait_pending()
            if acc.num_processes > 1:
                acc.wait_for_everyone()  # the other ranks wait for the main process's commit
            self._raise_pending("load_state")
        if input_dir is not None:
            path = Path(os.path.expanduser(os.fspath(input_dir)))
            _recover(path)
        elif acc.project_configuration.automatic_checkpoint_naming:
            path = _latest(Path(acc.project_dir) / "checkpoints")
        else:
            self._inner_load(None, load_kwargs, **load_model_func_kwargs)  # Accelerate's own error
            return
        manifest = _read_manifest(path)
        if manifest is None:
            if path.is_dir() and any(path.glob("*.nvc")):
                raise FormatError(
                    f"{path}: holds .nvc files but no {MANIFEST_NAME}: the save that wrote it did not complete "
                    "(or the manifest was deleted). Load an earlier checkpoint."
                )
            self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            return
        _check_files(path, manifest)
        if len(manifest["optimizers"]) != len(acc._optimizers):
            raise CheckpointError(
                f"{path}: holds the state of {len(manifest['optimizers'])} optimizer(s) "
                f"({', '.join(manifest['optimizers']) or 'none'}) but {len(acc._optimizers)} are prepared; "
                "prepare the same optimizers as the run that saved it."
            )
        map_location = load_model_func_kwargs.get("map_location")
        if map_location not in (None, "cpu", "on_device"):
            raise TypeError(
                "Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or `'on_device'`"
            )
        if map_location is None:
            # Accelerate's rule: the CPU unless several processes each own a device.
            multi = acc.num_processes > 1 and acc.multi_device and acc.distributed_type != DistributedType.MULTI_XPU
            map_location = "on_device" if multi else "cpu"
        call = _LoadCall(
            path, manifest, acc._optimizers,
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
            state = nc.load(call.path / name, map_location=call.map_location)
            model.load_state_dict(state, **call.model_kwargs)
        models.clear()
        for optimizer, name in zip(call.optimizers, call.manifest["optimizers"]):
            state = nc.load(call.path / name, map_location=call.map_location, weights_only=call.weights_only)
            optimizer.load_state_dict(state)


# -- directory helpers ---------------------------------------------------------------------
def _numbered(stem: str, i: int) -> str:
    return f"{stem}.nvc" if i == 0 else f"{stem}_{i}.nvc"


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(call: _SaveCall, policy: nc.CodecPolicy) -> None:
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(call.staging.rglob("*")):
        if p.is_file():
            rel = p.relative_to(call.staging).as_posix()
            # .nvc files carry a checksum per chunk; hashing them again would double the reads.
            files[rel] = {"bytes": p.stat().st_size, "blake2b": None if p.suffix == ".nvc" else _digest(p)}
            fsync_path(p)
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "nvcomp_checkpoint": nc.__version__,
        "accelerate": accelerate.__version__,
        "step": call.step,
        "iteration": call.iteration,
        "models": call.models,
        "optimizers": call.optimizer_files,
        "policy": policy.to_dict(),
        "files": files,
    }
    path = call.staging / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for d in sorted({p.parent for p in call.staging.rglob("*")} | {call.staging}):
        fsync_path(d)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    file = path / MANIFEST_NAME
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{file}: unreadable manifest ({exc}); the directory is damaged, load another checkpoint") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise FormatError(f"{file}: not an nvcomp-checkpoint Accelerate manifest; the directory is damaged")
    if manifest.get("version", 0) > _VERSION:
        raise FormatError(
            f"{file}: written by a newer nvcomp-checkpoint (manifest version {manifest.get('version')}); "
            "upgrade nvcomp-checkpoint to load it."
        )
    names = [*manifest.get("models", []), *manifest.get("optimizers", []), *manifest.get("files", {})]
    for name in names:
        # A manifest only ever names files inside its own directory.
        if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts:
            raise FormatError(f"{file}: lists an invalid file name {name!r}; the directory is damaged")
    return manifest


def _check_files(path: Path, manifest: dict[str, Any]) -> None:
    listed = manifest.get("files", {})
    for name in [*manifest["models"], *manifest["optimizers"]]:
        if name not in listed:
            raise FormatError(f"{path / MANIFEST_NAME}: {name} is not in the file list; the directory is damaged")
    for rel, info in listed.items():
        file = path / rel
        if not file.is_file():
            raise FormatError(
                f"{file}: missing; the save of {path} wrote it ({MANIFEST_NAME} lists it). Restore the file "
                "or load another checkpoint."
            )
        size = file.stat().st_size
        if size != info["bytes"]:
            raise FormatError(
                f"{file}: {size} bytes, but the save wrote {info['bytes']} (truncated or replaced). Restore the "
                "file or load another checkpoint."
            )
        if info.get("blake2b") and _digest(file) != info["blake2b"]:
            raise ChecksumError(
                f"{file}: its contents differ from what the save wrote (checksum mismatch). Restore the file or "
                "load another checkpoint."
            )




def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the file system or kernel cannot exchange: fall back to two renames
    raise OSError(err, os.strerror(err), os.fspath(b))


def _commit(staging: Path, target: Path) -> Path | None:
    """Move the complete staging directory to ``target``: replace it atomically, or update it in place.

    Returns:
        Where the replaced checkpoint now is, for the caller to delete (``None`` if there was none).
    """
    if target.exists() and not target.is_dir():
        raise CheckpointWriteError(f"{target}: exists and is not a directory; save_state needs a directory path")
    # Checked again here: an async save commits later, and the cwd or the directory may have changed.
    if staging.parent == target or _in_place(target):
        _install_in_place(staging, target)
        return None
    if not target.exists():
        os.rename(staging, target)
        fsync_path(target.parent)
        return None
    if _exchange(staging, target):
        fsync_path(target.parent)
        return staging
    old = target.parent / f".{target.name}{_OLD}"
    if old.exists():
        shutil.rmtree(old)
    os.rename(target, old)
    try:
        # A crash right here leaves only `old`; _recover() renames it back on the next save or load.
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    fsync_path(target.parent)
    return old


class _InstallError(CheckpointWriteError):
    """An in-place save failed after it had begun to replace files (see :func:`_install_in_place`)."""


def _save_failed(target: Path, exc: BaseException) -> CheckpointWriteError:
    if isinstance(exc, _InstallError):
        return CheckpointWriteError(
            f"{target}: save_state failed while moving the new files into this directory ({exc.__cause__}). It "
            f"now holds part of them and no {MANIFEST_NAME}, so load_state refuses it as incomplete. Fix the "
            "cause and save again, or load another checkpoint."
        )
    return CheckpointWriteError(
        f"{target}: save_state failed ({exc}). Nothing was committed: the checkpoint directory "
        f"that was at {target}, if any, is untouched. Free space or fix the cause and save again."
    )


def _is_state_file(name: str) -> bool:
    """Files that a save_state writes, with or without these hooks (and their temporaries)."""
    temporary = name.startswith(".") and (".tmp-" in name or ".nvckpt-" in name)
    return temporary or name == MANIFEST_NAME or _STATE_FILE.fullmatch(name) is not None


def _in_place(target: Path) -> bool:
    """Whether ``target`` must be updated file by file instead of replaced as a whole directory.

    Replacing a directory gives it a new inode and drops whatever it held: the process's working
    directory (``save_state(".")``) would vanish, and your own files and folders in it (notes, a
    ``save_pretrained`` folder, a project's sources) would have to be copied and would lose
    anything written to them meanwhile. Only a directory holding nothing but saved state is replaced.
    """
    if not target.is_dir():
        return False
    return target.is_symlink() or _holds_cwd(target) or bool(_foreign_entries(target))


def _holds_cwd(target: Path) -> bool:
    """True if ``target`` is the current working directory or one of its ancestors."""
    try:
        want = os.stat(target)
        path = os.path.realpath(os.getcwd())
    except OSError:  # the cwd is already gone: nothing left to protect
        return False
    while True:
        try:
            if os.path.samestat(os.stat(path), want):
                return True
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def _quiet_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return _read_manifest(path)
    except FormatError:
        return None


def _foreign_entries(target: Path) -> list[str]:
    """Entries of ``target`` that no save_state wrote: neither state files nor listed in its manifest."""
    listed = set((_quiet_manifest(target) or {}).get("files", {}))
    owned = {rel.split("/", 1)[0] for rel in listed}
    foreign = []
    for name in os.listdir(target):
        if _is_state_file(name):
            continue
        entry = target / name
        if entry.is_dir() and not entry.is_symlink():
            files = (p for p in entry.rglob("*") if not p.is_dir())
            mine = name in owned and all(p.relative_to(target).as_posix() in listed for p in files)
        else:  # a link to a folder is yours even if a save wrote into it
            mine = name in listed and not entry.is_dir()
        if not mine:
            foreign.append(name)
    return foreign


def _install_in_place(staging: Path, target: Path) -> None:
    """Move the saved files from ``staging`` into ``target`` one by one, each with an atomic rename.

    The previous manifest goes first and the new one comes last, and ``.nvc`` files come before
    Accelerate's: after a crash in between, the directory holds ``.nvc`` files but no manifest,
    which load_state refuses as incomplete, rather than a silent mix of old and new files. Other
    entries are left alone, as Accelerate leaves them; folders are merged into, never replaced.
    """
    _check_conflicts(staging, target)  # before anything changes: the previous checkpoint stays whole
    previous = _quiet_manifest(target)
    new = set(os.listdir(staging))
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target / MANIFEST_NAME)
            fsync_path(target)
        for name in sorted(new - {MANIFEST_NAME}, key=lambda n: (not n.endswith(".nvc"), n)):
            _move_entry(staging / name, target / name)
        # .nvc files of the previous save that this one does not write (fewer models, say).
        for name in [*(previous or {}).get("models", []), *(previous or {}).get("optimizers", [])]:
            if name not in new:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target / name)
        fsync_path(target)
        _move_entry(staging / MANIFEST_NAME, target / MANIFEST_NAME)  # the commit point
        fsync_path(target)
    except OSError as exc:
        raise _InstallError(str(exc)) from exc
    if previous is None:
        left = sorted(n for n in os.listdir(target) if _PLAIN_STATE_FILE.fullmatch(n) and n not in new)
        if left:
            logger.warning(
                "%s: also holds %s, written without nvcomp-checkpoint; left in place, as Accelerate leaves "
                "files it does not rewrite. load_state reads the .nvc files; if these are from an earlier "
                "save_state, delete them to free the space.",
                target, ", ".join(left),
            )
    shutil.rmtree(staging, ignore_errors=True)  # empty by now


def _check_conflicts(staging: Path, target: Path) -> None:
    for root, dirs, files in os.walk(staging):
        rel = Path(root).relative_to(staging)
        for name in dirs:
            dst = target / rel / name
            if os.path.lexists(dst) and not dst.is_dir():
                raise CheckpointWriteError(f"{dst}: is a file, but this save writes a folder there; move the file away")
        for name in files:
            dst = target / rel / name
            if dst.is_dir():
                raise CheckpointWriteError(f"{dst}: is a folder, but this save writes a file there; move the folder away")


def _move_entry(src: Path, dst: Path) -> None:
    """Move one saved file, or the files of one saved folder, to ``dst``; each file in one rename."""
    if src.is_dir() and not src.is_symlink():
        dst.mkdir(exist_ok=True)  # an existing folder (or a link to one) is merged into, as Accelerate writes
        for name in sorted(os.listdir(src)):
            _move_entry(src / name, dst / name)
        fsync_path(dst)
        src.rmdir()
        return
    try:
        os.replace(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        # dst is on another file system (a mount point or a link to a folder elsewhere): copy
        # next to it first, so that the rename that replaces it stays atomic.
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        try:
            shutil.copy2(src, tmp, follow_symlinks=False)
            if not tmp.is_symlink():
                fsync_path(tmp)
            os.replace(tmp, dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.unlink(src)


def _recover(target: Path) -> None:
    """Undo a replacement interrupted between its two renames (see :func:`_commit`)."""
    target = Path(os.path.abspath(target))  # "." has a name and a parent only as an absolute path
    old = target.parent / f".{target.name}{_OLD}"
    if not old.exists():
        return
    with contextlib.suppress(FileNotFoundError):  # another process got there first
        if target.exists():
            shutil.rmtree(old)
        else:
            logger.warning("%s: restoring the checkpoint that an interrupted save moved to %s", target, old)
            os.rename(old, target)


def _number(name: str) -> int | None:
    # Accelerate's own ordering: the last run of digits in the name.
    found = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", name)
    return int(found[0]) if found else None


def _numbered_dirs(checkpoints: Path) -> list[Path]:
    entries = []
    for name in os.listdir(checkpoints) if checkpoints.is_dir() else []:
        n = _number(name)
        if n is not None and not name.startswith("."):
            entries.append((n, checkpoints / name))
    return [p for _, p in sorted(entries)]


def _latest(checkpoints: Path) -> Path:
    dirs = _numbered_dirs(checkpoints)
    if not dirs:
        raise FormatError(f"{checkpoints}: no checkpoint to load (automatic_checkpoint_naming found no checkpoint_<n>)")
    return dirs[-1]


def _rotate(checkpoints: Path, project_dir: Path, limit: int, keep: Path) -> None:
    """Delete the oldest checkpoints beyond ``limit``; runs only after ``keep`` is committed."""
    dirs = _numbered_dirs(checkpoints)
    excess = len(dirs) - limit
    if excess <= 0:
        return
    logger.warning("Deleting %d checkpoints beyond total_limit=%d.", excess, limit)
    for old in [d for d in dirs if d != keep][:excess]:
        # Out of checkpoints/ first, so a crash mid-delete never leaves a half-deleted
        # checkpoint_<n> for load_state to pick.
        doomed = project_dir / f".{old.name}{_DELETING}"
        try:
            if doomed.exists():
                shutil.rmtree(doomed)
            os.rename(old, doomed)
            shutil.rmtree(doomed)
        except OSError as exc:
            logger.warning("%s: could not delete this old checkpoint (%s); the new one is saved.", old, exc)
