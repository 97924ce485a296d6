"""The HF ``Trainer``'s FSDP checkpoints (FSDP1 and FSDP2) compressed by nvcomp-checkpoint.

The Trainer saves and loads FSDP state with Accelerate's four ``fsdp_utils`` functions, imported
into ``transformers.trainer``; :class:`~nvcomp_checkpoint.transformers.NvcompTrainerMixin` runs
those steps with the core's (:mod:`nvcomp_checkpoint.dcp.fsdp_functions`: DCP rank files) in their
place, bound to the ``fsdp_utils`` module the Trainer calls.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import transformers.trainer
from transformers.trainer_pt_utils import reissue_pt_warnings

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.dcp.fsdp_functions import (
    FSDP_FUNCTION_NAMES,
    check_one_committer,
    fsdp_helpers_of,
    is_sharded,
    load_fsdp_optimizer,
    nvcomp_fsdp_functions,
)
from nvcomp_checkpoint.entrypoint import checkpoint_report

# The Trainer takes its FSDP functions from Accelerate, which transformers imports only where it is
# installed: without them this module has nothing to swap.
if not all(callable(getattr(transformers.trainer, name, None)) for name in FSDP_FUNCTION_NAMES):
    raise ImportError(
        "transformers.trainer has no FSDP functions of Accelerate's: accelerate is not installed", name="accelerate"
    )

__all__ = [
    "fsdp_enabled",
    "save_fsdp_state",
    "loading_fsdp_state",
    "load_fsdp_optimizer_and_scheduler",
    "check_fsdp_callback",
    "with_fsdp_reports",
    "wait_for_every_rank",
]

_SCHEDULER = "scheduler.pt"
_FULL_OPTIMIZER = "optimizer.nvc"  # accelerate_fsdp's name for a full optimizer state (index 0)


def fsdp_enabled(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False))


def _callback(trainer: Any) -> Any:
    """The trainer's NvcompTrainerCallback (by duck type: this module may not import its own caller)."""
    for callback in trainer.callback_handler.callbacks:
        if type(callback).__name__ == "NvcompTrainerCallback":
            return callback
    return None


# Per callback, per checkpoint directory: the reports of the FSDP state saved into it, until the
# callback's on_save merges them into that checkpoint's report (with_fsdp_reports).
_REPORTS: "weakref.WeakKeyDictionary[Any, dict[str, dict[str, nc.SaveReport]]]" = weakref.WeakKeyDictionary()
_REPORTS_LOCK = threading.Lock()


def save_fsdp_state(trainer: Any, save: Callable[[str], None], output_dir: str) -> None:
    """Run the Trainer's ``_save_optimizer_and_scheduler`` with the FSDP state compressed.

    Compressed only when the trainer has an ``NvcompTrainerCallback`` (its ``policy`` and
    ``workers`` apply); without one the Trainer's own files are written. On the processes that
    save (``args.should_save``), the report of each DCP directory (every rank's files) or full
    ``.nvc`` file is kept for the callback's report of this checkpoint.
    """
    callback = _callback(trainer)
    if callback is None:
        save(output_dir)
        return
    if is_sharded(trainer.accelerator.state.fsdp_plugin):
        check_one_committer(
            trainer.args.save_on_each_node, trainer.args.world_size, output_dir, "TrainingArguments(save_on_each_node=...)"
        )
    saved: dict[str, nc.SaveReport] = {}
    on_saved = saved.__setitem__ if trainer.args.should_save else None
    helpers = fsdp_helpers_of(transformers.trainer)
    stream_wrapper = getattr(callback, "stream_wrapper", None)
    with nvcomp_fsdp_functions(
        transformers.trainer, helpers, callback.policy, workers=callback.workers, stream_wrapper=stream_wrapper, on_saved=on_saved
    ):
        save(output_dir)
    if saved:
        with _REPORTS_LOCK:
            _REPORTS.setdefault(callback, {})[os.path.abspath(output_dir)] = saved


def with_fsdp_reports(callback: Any, directory: str | os.PathLike[str], converted: nc.SaveReport) -> nc.SaveReport:
    """The report of one checkpoint: the callback's conversion of ``directory`` with the FSDP state
    :func:`save_fsdp_state` wrote there merged in (``converted`` alone without FSDP)."""
    with _REPORTS_LOCK:
        saved = _REPORTS.get(callback, {}).pop(os.path.abspath(directory), None)
    if not saved:
        return converted
    parts = [converted, *saved.values()]
    seconds = sum(r.seconds for r in parts)
    return checkpoint_report(converted.path, seconds, reports=parts, seconds_blocked=seconds) or converted


def wait_for_every_rank(trainer: Any) -> None:
    """After ``Trainer._save_checkpoint`` under FSDP: every rank has written its files (its RNG state,
    its FSDP state) before the main process's ``on_save`` converts and reports the directory; the
    Trainer itself has no barrier there. A collective: every rank must reach it (FSDP saves are
    collectives already, so a rank that fails its save leaves the others waiting there as well)."""
    if trainer.args.world_size > 1:
        trainer.accelerator.wait_for_everyone()


def loading_fsdp_state() -> Any:
    """A context in which the Trainer's FSDP loads read compressed and plain state."""
    return nvcomp_fsdp_functions(transformers.trainer, fsdp_helpers_of(transformers.trainer))


def load_fsdp_optimizer_and_scheduler(trainer: Any, checkpoint: str | os.PathLike[str]) -> bool:
    """Load a full (``FULL_STATE_DICT``) compressed optimizer state and the scheduler, as the
    Trainer does for ``optimizer.bin``; the Trainer does not know ``optimizer.nvc`` and would
    skip it. Returns False (nothing loaded) when the checkpoint holds no such file."""
    directory = Path(checkpoint)
    if not (directory / _FULL_OPTIMIZER).is_file() or not (directory / _SCHEDULER).is_file():
        return False
    load_fsdp_optimizer(
        trainer.accelerator.state.fsdp_plugin,
        trainer.accelerator,
        trainer.optimizer,
        trainer.model,
        directory,
        helpers=fsdp_helpers_of(transformers.trainer),
    )
    with warnings.catch_warnings(record=True) as caught:
        trainer.lr_scheduler.load_state_dict(torch.load(directory / _SCHEDULER, weights_only=True))
    reissue_pt_warnings(caught)
    return True


def check_fsdp_callback(trainer: Any, resumes_itself: bool, compress_weights: bool | None, output_dir: str) -> None:
    """Refuse, when the Trainer is created, what could not resume from compressed FSDP state."""
    if not resumes_itself:
        raise nc.CheckpointError(
            f"{output_dir}: NvcompTrainerCallback with FSDP compresses the FSDP state through NvcompTrainerMixin; "
            f"a stock {type(trainer).__name__ if trainer is not None else 'Trainer'} could neither write nor resume "
            "from it. Use "
            "nvcomp_checkpoint.transformers.NvcompTrainer (or put NvcompTrainerMixin first in your Trainer class's bases)."
        )
    if compress_weights:
        raise nc.CheckpointError(
            f"{output_dir}: NvcompTrainerCallback(compress_weights=True) with FSDP: the model state is already "
            "compressed in pytorch_model_fsdp_0/ (or pytorch_model_fsdp.nvc); the model.safetensors a full state dict "
            "also writes stays plain for from_pretrained. Leave compress_weights unset."
        )
