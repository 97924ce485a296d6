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

import contextlib
import logging
import os
import re
import time
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
    )
except ImportError as exc:
    raise ImportError(
        f"nvcomp_checkpoint.accelerate needs Accelerate: {install_hint('accelerate')} ({exc})", name=exc.name
    ) from exc

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import ChainPolicy
from nvcomp_checkpoint.dirstore import MARKER_NAME, DirectoryStore, InstallError, numbered_dirs, remove_quietly, rotate
from nvcomp_checkpoint.entrypoint import SaveEntryPoint, checked_on_every_rank, incremental_files, load_tree
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError, FormatError, StateSaveError
from nvcomp_checkpoint.incremental import keep_with_bases
from nvcomp_checkpoint.integrations import accelerate_fsdp
from nvcomp_checkpoint.savegroup import SaveGroup
from nvcomp_checkpoint.storage import LOCAL
from nvcomp_checkpoint.tiers import Tier

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
            (:class:`nvcomp_checkpoint.entrypoint.SaveEntryPoint`). With ``async_save``,
            ``save_state`` returns once model and optimizer state are copied (one extra copy in
            host memory); the ``.nvc`` files, the commit and the rotation follow in the background.
            ``on_saved`` runs once the directory is committed. The folder ``save_state`` writes is
            tier 0 (``total_limit`` is its retention); a copy is named by the save's iteration
            (``save_iteration``), ``load_state`` of a folder these hooks saved sets
            ``save_iteration`` to the one after it, and on a fresh node
            ``accelerator.load_state(hooks.resume_path())`` loads the newest copy that checks.
        incremental: Each ``.nvc`` file of a ``save_state`` folder is a delta against the same
            file of the previous folder these hooks saved (a full folder every ``full_every``,
            and the first save of a process); ``total_limit`` rotation keeps every folder a kept
            one needs. A folder updated in place is saved in full. With ``tiers``, a delta folder
            reaches a tier after its chain and ``resume_path(local_dir)`` lays it out there with its chain.
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
        last committed save (per component, all ``.nvc`` files together), ``handle.wait()``
        waits for a pending async save, and ``handle.remove()`` restores Accelerate's own
        ``save_state``/``load_state``.

    Raises:
        CheckpointError: The accelerator uses Megatron-LM or XLA, or FSDP with ``async_save``, or
            DeepSpeed with ``async_save``, ``tiers``, ``incremental`` or ``leader_load``, or already
            has these hooks. (FSDP state is compressed: sharded through
            :class:`~nvcomp_checkpoint.dcp.NvcompWriter`, full into ``.nvc`` files; see
            :mod:`nvcomp_checkpoint.integrations.accelerate_fsdp`. DeepSpeed's checkpoint is written
            compressed by :func:`nvcomp_checkpoint.deepspeed.attach`'s engine, attached to each
            DeepSpeed engine ``prepare`` creates: see ``docs/accelerate.md``.)

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


class NvcompStateHooks(SaveEntryPoint):
    """The handle :func:`register_nvcomp_hooks` returns (design: ``docs/accelerate.md``).

    The options (``policy``, ``workers``, ``async_save`` ...), :meth:`wait`, :meth:`pending` and
    :meth:`resume_path` are :class:`~nvcomp_checkpoint.entrypoint.SaveEntryPoint`'s.

    Attributes:
        accelerator: The accelerator whose ``save_state``/``load_state`` are wrapped.
        last_report: Per-component totals of the last committed save's ``.nvc`` files (``None``
            before the first save and on processes that write nothing). With FSDP, its DCP
            directories too, each summed over every rank's file, on the process that commits.
        last_reports: The same, per file (or FSDP directory) name.
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
        # Checked first: a wrong argument must not leave the accelerator half wrapped.
        self.incremental = incremental_files("register_nvcomp_hooks", incremental, full_every, delta_base)
        super().__init__(
            "register_nvcomp_hooks",
            policy,
            workers=workers,
            async_save=async_save,
            on_saved=on_saved,
            stream_wrapper=stream_wrapper,
            tiers=tiers,
            log_as="save_state",
            tiers_hint="register_nvcomp_hooks(accelerator, tiers=[nc.Tier(...)])",
        )
        self.accelerator = accelerator
        self.leader_load = leader_load
        self.last_reports: dict[str, nc.SaveReport] = {}
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
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            self._restore_prepare = _attach_deepspeed(accelerator, self.policy, self.workers)

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

    def _raise_errors(self, when: str, consequence: str = "") -> None:
        failed = self._failed_save_info()
        if failed is not None:
            # As after a synchronous failure: the next save_state reuses the failed one's number.
            self.accelerator.project_configuration.iteration = failed["iteration"]
        super()._raise_errors(when, consequence)

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
        """
        acc = self.accelerator
        config = acc.project_configuration
        entered = time.perf_counter()
        if self.async_save:
            # One save in flight: its commit and rotation must land before this one starts.
            self._wait_for_saves("the next save_state")
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

        try:
            if not writes:
                write(None)
            else:  # the group commits once every .nvc file is durable; then the copies to the tiers
                self._save_group(
                    os.fspath(shown),
                    entered,
                    self._after_durable(call.iteration, call.target),
                    write,
                    background=self.async_save,
                    info={"iteration": call.iteration},
                    commit=lambda reports: self._commit(call, reports, rotation),
                    failed=lambda exc: self._failed(call, exc),
                )
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
        if not self.async_save:
            acc.wait_for_everyone()
        return shown

    def _commit(self, call: _SaveCall, reports: dict[str, nc.SaveReport], rotation: tuple[Path, int] | None) -> None:
        """Manifest, commit, rotation: runs once every ``.nvc`` file is durable (maybe in the background)."""
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
        self.last_reports = dict(reports)
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
                needed = keep_with_bases([os.fspath(p) for p in [*ordered[-limit:], target]])
                ordered, limit = [p for p in ordered if os.fspath(p) not in needed], 0
            # Each folder goes once nothing needs it (SaveEntryPoint._remove_checkpoint): after this commit,
            # and after its copies to the tiers.
            rotate(
                ordered,
                limit,
                keep=target,
                trash=checkpoints.parent,
                when=lambda old, delete: self._remove_checkpoint(old, lambda _: delete()),
            )

    def _failed(self, call: _SaveCall, exc: BaseException) -> BaseException:
        remove_quietly(call.staging)
        if self.incremental is not None:
            self.incremental.failed()
        error = _save_failed(call.target, exc)
        error.__cause__ = exc
        return error

    def _run_inner_save(self, call: _SaveCall, auto: bool, safe_serialization: bool, kwargs: dict[str, Any]) -> None:
        acc = self.accelerator
        config = acc.project_configuration
        fsdp = acc.distributed_type == DistributedType.FSDP  # every rank writes its shards (accelerate_fsdp)
        # Every rank writes its partition through the attached engine (save_checkpoint per model).
        deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        handle = acc.register_save_state_pre_hook(self._save_hook)
        acc._optimizers = call.optimizers if fsdp or deepspeed else []
        config.automatic_checkpoint_naming = False
        self._saving = None if fsdp or deepspeed else call
        try:
            # The committing process's group gets each FSDP file's or DCP directory's report (all ranks' files).
            on_saved = call.group.add_report if call.group is not None else None
            with (
                accelerate_fsdp.nvcomp_fsdp_functions(
                    accelerate.accelerator, self.policy, workers=self.workers, on_saved=on_saved
                )
                if fsdp
                else contextlib.nullcontext()
            ):
                self._inner_save(str(call.staging), safe_serialization=safe_serialization, **kwargs)
            if deepspeed and call.group is not None:
                _report_deepspeed(acc, call)
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
            options = self._options(path, metadata={"accelerate": {"kind": kind, "index": i, **meta}}, base=base)
            if call.background:
                self._save_file(call.group, name, state, path, options)
            else:
                call.group.add_report(name, self._save_now(state, path, options))
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
        if self.async_save:
            # The directory to load may be the one a pending save is about to commit.
            self._settle_saves()
            if acc.num_processes > 1:
                acc.wait_for_everyone()  # the other ranks wait for the main process's commit
        if input_dir is None and not acc.project_configuration.automatic_checkpoint_naming:
            if self.async_save:
                self._raise_errors("load_state")
            self._inner_load(None, load_kwargs, **load_model_func_kwargs)  # Accelerate's own error
            return

        def locate() -> tuple[Path, dict[str, Any] | None]:
            if self.async_save:
                self._raise_errors("load_state")
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
        # process's) or a directory that differs on one node makes every rank raise, not wait.
        path, manifest = checked_on_every_rank(locate, "load_state", self.leader_load)
        if manifest is None:  # saved without these hooks
            self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            return
        if "deepspeed" in manifest or acc.distributed_type == DistributedType.DEEPSPEED:
            _check_deepspeed_loadable(acc, path, manifest)
            self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            return
        if "fsdp" in manifest or acc.distributed_type == DistributedType.FSDP:
            accelerate_fsdp.check_loadable(acc, path, manifest)
            with accelerate_fsdp.nvcomp_fsdp_functions(accelerate.accelerator):
                self._inner_load(os.fspath(path), load_kwargs, **load_model_func_kwargs)
            if self.tiers is not None and isinstance(manifest.get("iteration"), int):
                acc.project_configuration.iteration = manifest["iteration"] + 1
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
        if self.tiers is not None and isinstance(manifest.get("iteration"), int):
            # The tiers name copies by iteration: the next save must come after the one loaded.
            acc.project_configuration.iteration = manifest["iteration"] + 1

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
def _attach_deepspeed(accelerator: Accelerator, policy: nc.CodecPolicy, workers: int | None) -> Callable[[], None]:
    """Attach our checkpoint engine to each DeepSpeed engine the accelerator has prepared or will prepare."""
    # Imported here: the hooks of an Accelerator without DeepSpeed must not need DeepSpeed.
    from nvcomp_checkpoint.entrypoint.deepspeed_engine import attach_after  # noqa: PLC0415

    return attach_after(accelerator, "prepare", lambda: list(accelerator._models), policy=policy, workers=workers)


def _report_deepspeed(accelerator: Accelerator, call: _SaveCall) -> None:
    """Give the save's group this process's reports of the DeepSpeed files (its own partition and model states)."""
    for model in accelerator._models:
        engine = getattr(model, "checkpoint_engine", None)
        for report in getattr(engine, "reports", None) or []:
            name = os.path.relpath(report.path, call.staging).replace(os.sep, "/")
            if not name.startswith(".."):
                call.group.add_report(name, report)  # type: ignore[union-attr]


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
