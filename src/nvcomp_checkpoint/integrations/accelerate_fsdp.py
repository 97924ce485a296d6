"""Accelerate's FSDP state (FSDP1 and FSDP2) written and read by nvcomp-checkpoint: what is Accelerate's own.

The four functions that replace Accelerate's ``fsdp_utils`` (``SHARDED_STATE_DICT`` as DCP rank
files, ``FULL_STATE_DICT`` through :func:`nvcomp_checkpoint.save`) live in the core
(:mod:`nvcomp_checkpoint.dcp.fsdp_functions`, shared with the HF Trainer's FSDP checkpoints); here
they are bound to Accelerate's ``fsdp_utils``, with what ``register_nvcomp_hooks`` adds: its checks,
the manifest's FSDP fields, the names of a ``save_state`` directory's FSDP entries.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Callable, Iterator

import torch
from accelerate.utils import fsdp_utils as _accelerate_fsdp
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.dcp import fsdp_functions
from nvcomp_checkpoint.dcp.fsdp_functions import FSDP_FUNCTION_NAMES, AddJobFn, ReportFn, check_one_committer, is_sharded
from nvcomp_checkpoint.dcp.rank_files import BackgroundRankFiles
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.errors import CheckpointError, CheckpointWriteError

__all__ = [
    "save_fsdp_model",
    "load_fsdp_model",
    "save_fsdp_optimizer",
    "load_fsdp_optimizer",
    "nvcomp_fsdp_functions",
    "is_fsdp_state_name",
    "fsdp_manifest_fields",
    "check_loadable",
    "check_fsdp_hooks",
    "check_one_committer",
    "is_sharded",
    "replaced_files",
    "rank_files_background",
    "wait_for_rank_files",
    "FSDP_FUNCTION_NAMES",
]

# What these functions write: the DCP directories keep Accelerate's names (pytorch_model_fsdp_0/,
# optimizer_0/: Accelerate and the Trainer find checkpoints by them), the full state dicts take
# .nvc in place of .bin. Accelerate's own .bin names match too, for a directory saved without us.
_FSDP_NAME = re.compile(
    rf"{FSDP_MODEL_NAME}_\d+|{OPTIMIZER_NAME}_\d+|{FSDP_MODEL_NAME}(_\d+)?\.(nvc|bin)|{OPTIMIZER_NAME}(_\d+)?\.nvc"
)


def is_fsdp_state_name(name: str) -> bool:
    """True for the entries of a ``save_state`` directory that hold FSDP model or optimizer state."""
    return _FSDP_NAME.fullmatch(name) is not None


def fsdp_manifest_fields(accelerator: Any) -> dict[str, Any]:
    """What a manifest records of an FSDP save: the FSDP version and the state dict type."""
    plugin = accelerator.state.fsdp_plugin
    kind = plugin.state_dict_type
    return {"fsdp": {"version": int(plugin.fsdp_version), "state_dict_type": str(getattr(kind, "name", kind)).rsplit(".", 1)[-1]}}


@contextlib.contextmanager
def nvcomp_fsdp_functions(
    namespace: ModuleType,
    policy: nc.CodecPolicy | None = None,
    *,
    workers: int | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    on_saved: ReportFn | None = None,
    background: BackgroundRankFiles | None = None,
    add_job: AddJobFn | None = None,
) -> Iterator[None]:
    """Let ``namespace`` (``accelerate.accelerator``) call the compressing FSDP functions in place of
    Accelerate's while the block runs (:func:`nvcomp_checkpoint.dcp.fsdp_functions.nvcomp_fsdp_functions`;
    ``background`` and ``add_job``: sharded state written in the background, see :func:`rank_files_background`)."""
    with fsdp_functions.nvcomp_fsdp_functions(
        namespace,
        _accelerate_fsdp,
        policy,
        workers=workers,
        stream_wrapper=stream_wrapper,
        on_saved=on_saved,
        background=background,
        add_job=add_job,
    ):
        yield


@dataclass
class _Background:
    saves: BackgroundRankFiles
    iteration: int | None = None  # the project iteration of the oldest save not waited for


# Per Accelerator: the FSDP rank files this process writes in the background (register_nvcomp_hooks(async_save=True)).
_BACKGROUND: "weakref.WeakKeyDictionary[Any, _Background]" = weakref.WeakKeyDictionary()
_BACKGROUND_LOCK = threading.Lock()


def rank_files_background(accelerator: Any) -> BackgroundRankFiles:
    """The background saves of ``accelerator``'s sharded FSDP state on this process, for the
    save_state now starting (one per accelerator: its gloo process group is made once, by every rank
    at its first async save_state)."""
    with _BACKGROUND_LOCK:
        if accelerator not in _BACKGROUND:
            _BACKGROUND[accelerator] = _Background(BackgroundRankFiles("register_nvcomp_hooks"))
        background = _BACKGROUND[accelerator]
        if background.iteration is None:
            background.iteration = accelerator.project_configuration.iteration
        return background.saves


def wait_for_rank_files(accelerator: Any, when: str, consequence: str = "") -> None:
    """Wait for this process's FSDP rank files written in the background, and raise their failure
    (agreed on by every rank: the processes that commit nothing raise it too), naming ``when``.

    As on the committing process, after a failure the next ``save_state`` reuses the failed one's
    number (``project_configuration.iteration``), so that every rank names it alike."""
    with _BACKGROUND_LOCK:
        background = _BACKGROUND.get(accelerator)
        if background is None:
            return
        iteration, background.iteration = background.iteration, None
    try:
        background.saves.wait(when, consequence)
    except CheckpointWriteError:
        if iteration is not None:
            accelerator.project_configuration.iteration = iteration
        raise


# -- the four functions: Accelerate's signatures, plus the codec policy --------------------------


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    policy: nc.CodecPolicy | None = None,
    workers: int | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    on_saved: ReportFn | None = None,
) -> None:
    """``accelerate.utils.save_fsdp_model`` with compressed files
    (:func:`nvcomp_checkpoint.dcp.fsdp_functions.save_fsdp_model`)."""
    fsdp_functions.save_fsdp_model(
        fsdp_plugin,
        accelerator,
        model,
        output_dir,
        model_index,
        adapter_only,
        use_dcp,
        helpers=_accelerate_fsdp,
        policy=policy,
        workers=workers,
        stream_wrapper=stream_wrapper,
        on_saved=on_saved,
    )


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> Any:
    """``accelerate.utils.load_fsdp_model`` that reads what :func:`save_fsdp_model` wrote, and plain state."""
    return fsdp_functions.load_fsdp_model(
        fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only, use_dcp, helpers=_accelerate_fsdp
    )


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    use_dcp: bool = True,
    *,
    policy: nc.CodecPolicy | None = None,
    workers: int | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    on_saved: ReportFn | None = None,
) -> None:
    """``accelerate.utils.save_fsdp_optimizer`` with compressed files: ``optimizer_<i>/`` (sharded)
    or ``optimizer.nvc`` (full, written by the main process); ``on_saved`` as for :func:`save_fsdp_model`."""
    fsdp_functions.save_fsdp_optimizer(
        fsdp_plugin,
        accelerator,
        optimizer,
        model,
        output_dir,
        optimizer_index,
        use_dcp,
        helpers=_accelerate_fsdp,
        policy=policy,
        workers=workers,
        stream_wrapper=stream_wrapper,
        on_saved=on_saved,
    )


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """``accelerate.utils.load_fsdp_optimizer`` that reads what :func:`save_fsdp_optimizer` wrote, and plain state."""
    fsdp_functions.load_fsdp_optimizer(
        fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index, adapter_only, use_dcp, helpers=_accelerate_fsdp
    )


def replaced_files(previous_manifest: dict[str, Any], staging: Path) -> list[str]:
    """Files of the previous save's FSDP entries that a save updating its directory in place does
    not rewrite (rank files carry a fresh save id each time): deleted before the new manifest lands,
    as merging the new shard directories into the old ones would otherwise keep them forever."""
    return [
        name
        for name in previous_manifest.get("files", {})
        if "/" in name and is_fsdp_state_name(name.split("/", 1)[0]) and not (staging / name).exists()
    ]


def check_fsdp_hooks(fsdp_plugin: Any, async_save: bool) -> None:
    """What ``register_nvcomp_hooks`` refuses of an FSDP Accelerator, before the first save."""
    fsdp_functions.check_supported(fsdp_plugin, True, "register_nvcomp_hooks")
    check_options("Accelerate + FSDP", "register_nvcomp_hooks", async_save=async_save)


def check_loadable(accelerator: Any, path: Path, manifest: dict[str, Any]) -> None:
    """A ``save_state`` directory of these hooks and the accelerator that loads it agree on FSDP."""
    saved = manifest.get("fsdp")
    fsdp = (
        getattr(getattr(accelerator, "state", None), "fsdp_plugin", None) is not None
        and str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) == "FSDP"
    )
    if saved is not None and not fsdp:
        raise CheckpointError(
            f"{path}: saved with FSDP ({saved.get('state_dict_type')}), but this Accelerator does not use FSDP; "
            "load it with an FSDP Accelerator, as the run that saved it."
        )
    if saved is None and fsdp:
        raise CheckpointError(
            f"{path}: saved without FSDP (model.nvc, optimizer.nvc), but this Accelerator uses FSDP; load it with "
            "the Accelerator setup that saved it, or load model.nvc with nvcomp_checkpoint.load() into the model "
            "before preparing it."
        )
