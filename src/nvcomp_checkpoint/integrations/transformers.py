"""Hugging Face ``Trainer`` integration: compressed ``checkpoint-N`` directories, and resuming from them.

``NvcompTrainerCallback`` compresses the files each save writes (``async_save=True``: in the
background); ``NvcompTrainer`` (or ``NvcompTrainerMixin`` on your own Trainer subclass) resumes from what it wrote.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Callable

import safetensors
import safetensors.torch
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import reissue_pt_warnings

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.api import log_report
from nvcomp_checkpoint.report import merge_reports
from nvcomp_checkpoint.storage import fsync_path, storage_for

__all__ = [
    "NvcompTrainerCallback",
    "NvcompTrainerMixin",
    "NvcompTrainer",
    "compress_checkpoint",
    "decompress_checkpoint",
    "COMPRESSED_SUFFIX",
]

logger = logging.getLogger(__name__)

#: Appended to the name of each file the Trainer wrote (``optimizer.pt`` -> ``optimizer.pt.nvc``),
#: so :func:`decompress_checkpoint` knows what to write back.
COMPRESSED_SUFFIX = ".nvc"

# The Trainer's own names (transformers.utils / transformers.trainer); repeated here so this
# module reads without chasing constants through transformers' private modules.
_SAFE_WEIGHTS = "model.safetensors"
_TORCH_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"
_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Inside each compressed file the tree sits under one key, so tensor keys read like the rest of
# the library ("optimizer/state/0/exp_avg") and ``classify`` files step counters under "other".
_TREE_KEY = {_SAFE_WEIGHTS: "model", _TORCH_WEIGHTS: "model", _OPTIMIZER: "optimizer"}
_META_KEY = "transformers"


# -- conversion of one checkpoint directory ----------------------------------------------------


def compress_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    policy: nc.CodecPolicy | None = None,
    *,
    verify: bool = True,
    workers: int | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
) -> nc.SaveReport:
    """Replace the model weights and optimizer state of a Trainer checkpoint by compressed files.

    ``model.safetensors`` (or ``pytorch_model.bin``) and ``optimizer.pt`` become
    ``model.safetensors.nvc`` and ``optimizer.pt.nvc``; everything else (``trainer_state.json``,
    ``scheduler.pt``, RNG states, config) stays as the Trainer wrote it. At every instant the
    directory holds a complete copy of each file, plain or compressed, so a crash or a failure
    (disk full) at any point leaves a checkpoint that :class:`NvcompTrainerMixin` resumes from.
    The directory's modification time is kept, so ``save_total_limit`` rotation (which orders
    checkpoints by it) never mistakes an older checkpoint converted late for the newest.

    Args:
        checkpoint_dir: A ``checkpoint-N`` directory written by ``Trainer``.
        policy: Codec settings per component; defaults to ``CodecPolicy()``.
        verify: Decode each compressed file and compare it bit for bit with the plain file before
            deleting the plain file.
        workers: Compression threads (default: every core).
        stream_wrapper: Wraps each compressed file's output stream (throttling, byte counting
            ...); its ``write`` must pass every byte on, in order.

    Returns:
        One report for the files written: per-component sizes, codecs and time.

    Raises:
        CheckpointWriteError: Writing failed; the directory is as the Trainer left it.
        CheckpointError: ``verify`` found a difference; the plain files are kept.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise nc.errors.FormatError(f"{directory}: not a checkpoint directory written by the Trainer")
    stamp = directory.stat()
    start = time.perf_counter()
    plain = _plain_files(directory)
    _remove_stale_temporaries(directory)
    written: list[Path] = []
    reports: list[nc.SaveReport] = []
    try:
        for name in plain:
            tree, meta = _read_plain(directory / name)
            target = directory / (name + COMPRESSED_SUFFIX)
            key = _TREE_KEY[name]
            reports.append(nc.save(
                {key: tree}, target, policy, metadata={_META_KEY: meta}, workers=workers, stream_wrapper=stream_wrapper,
            ))
            written.append(target)
            if verify:
                _verify_copy(target, key, tree)
            del tree
    except BaseException as exc:
        # Undo this conversion so the directory is exactly what the Trainer wrote (and uses no
        # more space than that). A compressed file goes only while its plain file is still
        # there: two processes converting one directory (save_on_each_node on a shared file
        # system) must never remove the last copy.
        for path in written:
            if path.with_name(path.name[: -len(COMPRESSED_SUFFIX)]).is_file():
                path.unlink(missing_ok=True)
        fsync_path(directory)
        _restore_mtime(directory, stamp)
        if isinstance(exc, OSError):
            raise nc.errors.CheckpointWriteError(
                f"{directory}: compressing the checkpoint failed ({exc}). Its plain files are untouched and "
                "the Trainer resumes from them; free disk space before the next save."
            ) from exc
        if isinstance(exc, nc.errors.CheckpointError):
            raise type(exc)(f"{str(exc).rstrip('.')}. The plain files of {directory} are untouched and the Trainer resumes from them.") from exc
        raise
    # Every compressed file is durable (nc.save fsyncs it and renames it into place) before a
    # plain file goes. The weights go first: a plain Trainer then refuses the directory ("Can't
    # find a valid checkpoint") instead of loading the weights and silently skipping a
    # compressed optimizer.
    for name in plain:
        (directory / name).unlink(missing_ok=True)
    fsync_path(directory)
    _restore_mtime(directory, stamp)
    return merge_reports(str(directory), reports, time.perf_counter() - start)


def decompress_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Write back the plain files of a compressed checkpoint and remove the compressed ones.

    Use it to open a checkpoint with ``from_pretrained``, to resume with a plain ``Trainer``, or to
    hand the directory to a tool that expects the Trainer's files.

    Args:
        checkpoint_dir: A ``checkpoint-N`` directory converted by :func:`compress_checkpoint`.

    Returns:
        The names of the plain files written.
    """
    directory = Path(checkpoint_dir)
    _wait_for_conversions()
    stamp = directory.stat()
    restored = []
    for compressed in sorted(directory.glob("*" + COMPRESSED_SUFFIX)):
        name = compressed.name[: -len(COMPRESSED_SUFFIX)]
        if name not in _TREE_KEY:
            continue
        with nc.open(compressed) as reader:
            meta = reader.metadata.get(_META_KEY, {})
        tree = _load_tree(compressed, _TREE_KEY[name], "cpu")
        storage, path = storage_for(directory / name)
        # Atomic (temporary file, fsync, rename): a crash leaves the compressed file as it was.
        with storage.open_write(path) as stream:
            if name == _SAFE_WEIGHTS:
                stream.write(safetensors.torch.save(tree, metadata=meta.get("safetensors_metadata")))
            else:
                torch.save(tree, stream)
        compressed.unlink()
        restored.append(name)
    fsync_path(directory)
    _restore_mtime(directory, stamp)
    return restored


def _plain_files(directory: Path) -> list[str]:
    """The Trainer's files this integration compresses, weights first."""
    names = []
    if any((directory / index).exists() for index in _SHARD_INDEXES):
        # Sharded weights (models over the 50 GB shard size) stay as they are: the Trainer
        # loads them shard by shard; the optimizer state, the larger part, is still compressed.
        logger.info("%s: sharded model weights are left uncompressed", directory)
    elif (directory / _SAFE_WEIGHTS).is_file():
        names.append(_SAFE_WEIGHTS)
    elif (directory / _TORCH_WEIGHTS).is_file():
        names.append(_TORCH_WEIGHTS)
    if (directory / _OPTIMIZER).is_file():
        names.append(_OPTIMIZER)
    return names


def _read_plain(path: Path) -> tuple[Any, dict[str, Any]]:
    """A file the Trainer wrote, read with the Trainer's own rules (weights only), and its metadata."""
    # The Trainer's files are read with their own libraries rather than through nc.load so that
    # optimizer.pt is memory-mapped: a second full copy of the optimizer state in RAM is avoided.
    if path.name == _SAFE_WEIGHTS:
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        return safetensors.torch.load_file(str(path), device="cpu"), {"file": path.name, "safetensors_metadata": meta}
    try:
        tree = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError ... for an unreadable file
        raise nc.errors.FormatError(f"{path}: the Trainer's file cannot be read with torch.load(weights_only=True): {exc}") from exc
    return tree, {"file": path.name}


def _verify_copy(target: Path, key: str, original: Any) -> None:
    decoded = _load_tree(target, key, "cpu")
    difference = _first_difference(original, decoded, key)
    if difference is not None:
        raise nc.errors.FormatError(
            f"{target}: the compressed copy differs from the Trainer's file at {difference!r}; "
            "please report this as a bug (pass verify=False only to skip this check)."
        )


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The key of the first value that is not bit-identical, or None."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return path
        if a.numel() and not torch.equal(_bytes_of(a), _bytes_of(b)):
            return path
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return path
        for k in a:
            found = _first_difference(a[k], b[k], f"{path}/{k}")
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}/{i}")
            if found is not None:
                return found
        return None
    if isinstance(a, float) and a != a:  # NaN (Adam's eps, betas are never NaN, but a user value may be)
        return None if isinstance(b, float) and b != b else path
    return None if a == b else path


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _load_tree(path: Path | str, key: str, map_location: Any) -> Any:
    """The tree stored under ``key`` in one of our files; errors name the file and a way out."""
    path = Path(path)
    try:
        saved = nc.load(path, map_location=map_location)
    except nc.errors.CheckpointError as exc:
        raise type(exc)(f"{str(exc).rstrip('.')}. {_resume_hint(path.parent)}") from exc
    if not isinstance(saved, dict) or key not in saved:
        raise nc.errors.FormatError(f"{path}: holds no {key!r} entry; it was not written by NvcompTrainerCallback. {_resume_hint(path.parent)}")
    return saved[key]


def _resume_hint(checkpoint: Path) -> str:
    step = _step_of(checkpoint.name)
    if step is None or not checkpoint.parent.is_dir():
        return "Resume from another checkpoint."
    earlier = sorted(
        (s, p.name) for p in checkpoint.parent.iterdir() if p.is_dir() and (s := _step_of(p.name)) is not None and s < step
    )
    if not earlier:
        return "There is no earlier checkpoint in this directory to resume from."
    return f"Resume from an earlier checkpoint instead: trainer.train(resume_from_checkpoint={str(checkpoint.parent / earlier[-1][1])!r})."


def _step_of(name: str) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", name)
    return int(match.group(1)) if match else None


def _remove_stale_temporaries(directory: Path) -> None:
    # A conversion killed mid-write leaves nc.save's temporary file (".<name>.tmp-<pid>-<id>").
    for name in _TREE_KEY:
        for stale in directory.glob(f".{name}{COMPRESSED_SUFFIX}.tmp-*"):
            stale.unlink(missing_ok=True)


def _restore_mtime(directory: Path, stamp: os.stat_result) -> None:
    os.utime(directory, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))




# -- the callback ------------------------------------------------------------------------------


class NvcompTrainerCallback(TrainerCallback):
    """Compresses the model weights and optimizer state of every checkpoint the Trainer saves.

    Resuming needs :class:`NvcompTrainer` (or :class:`NvcompTrainerMixin`), because the Trainer
    loads checkpoints with its own code and knows only its plain files.

    With ``async_save=True``, ``on_save`` hands the conversion of ``checkpoint-N`` (read the
    Trainer's files, compress, verify, remove the plain files) to a background thread and returns,
    so training goes on meanwhile. The Trainer's files on disk are the snapshot: nothing writes to
    ``checkpoint-N`` again, and at every moment each file is there complete, plain or compressed.
    Before the Trainer saves again (and rotates old checkpoints with ``save_total_limit``), the
    callback waits for the pending conversion, so rotation never deletes a directory being
    converted; the save that ends training is converted before ``on_save`` returns, so loading
    the best model and the last rotation see finished directories; :class:`NvcompTrainerMixin`
    waits before loading any checkpoint. A failed conversion (its directory is left as the
    Trainer wrote it, which still resumes) is raised before the next save, or by ``on_train_end``.

    Example:
        >>> trainer = NvcompTrainer(model=model, args=args, train_dataset=ds,
        ...                         callbacks=[NvcompTrainerCallback(async_save=True)])
        >>> trainer.train(resume_from_checkpoint=True)

    Args:
        policy: Codec settings per component; defaults to ``CodecPolicy()``.
        verify: Decode each compressed file and compare it bit for bit before deleting the plain one.
        workers: Compression threads (default: every core).
        async_save: Convert each checkpoint in the background (see above).
        on_saved: Called with the :class:`~nvcomp_checkpoint.SaveReport` of each conversion once
            the compressed files are durable and the plain ones removed (with ``async_save``, on
            the background thread).
        stream_wrapper: Wraps each compressed file's output stream (throttling, byte counting ...).

    Attributes:
        last_report: The :class:`~nvcomp_checkpoint.SaveReport` of the latest conversion;
            ``seconds_blocked`` is the time ``on_save`` held training, ``seconds`` the time
            until the conversion was done.
    """

    def __init__(
        self,
        policy: nc.CodecPolicy | None = None,
        *,
        verify: bool = True,
        workers: int | None = None,
        async_save: bool = False,
        on_saved: Callable[[nc.SaveReport], Any] | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    ) -> None:
        if on_saved is not None and not callable(on_saved):
            raise TypeError(f"NvcompTrainerCallback(on_saved=...) takes a callable, got {type(on_saved).__name__}")
        self.policy = policy
        self.verify = verify
        self.workers = workers
        self.async_save = bool(async_save)
        self.on_saved = on_saved
        self.stream_wrapper = stream_wrapper
        self.last_report: nc.SaveReport | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[Path, concurrent.futures.Future[nc.SaveReport]] | None = None
        self._callback_thread: int | None = None  # the thread running on_saved, which must not wait

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Reject the setups whose checkpoints this callback cannot convert safely."""
        if args.deepspeed or args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
            raise nc.CheckpointError(
                f"{args.output_dir}: NvcompTrainerCallback compresses the Trainer's own optimizer.pt and model "
                "weights; with DeepSpeed or FSDP the optimizer state is written in their own sharded format, "
                "which it does not convert. Remove the callback for this run."
            )
        if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in ("checkpoint", "all_checkpoints"):
            # The Trainer uploads checkpoint-N in the background while on_save would rewrite it.
            raise nc.CheckpointError(
                f"{args.output_dir}: hub_strategy={args.hub_strategy!r} uploads each checkpoint directory in the "
                "background while NvcompTrainerCallback rewrites it. Use hub_strategy='every_save' or 'end'."
            )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Convert the checkpoint the Trainer has just written (after its rotation)."""
        entered = time.perf_counter()
        if not args.should_save:
            return  # other ranks: the main process owns the checkpoint files
        self.wait("on_save")  # normally nothing is pending here: see on_step_end
        directory = _saved_checkpoint(args.output_dir, state.global_step)
        if directory is None:
            logger.warning("NvcompTrainerCallback: no checkpoint-%d directory under %s", state.global_step, args.output_dir)
            return
        if not self.async_save:
            report = compress_checkpoint(
                directory, self.policy, verify=self.verify, workers=self.workers, stream_wrapper=self.stream_wrapper
            )
            self._converted(report)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvckpt-hf-convert")
        blocked = time.perf_counter() - entered
        future = self._executor.submit(self._convert, directory, entered, blocked)
        self._pending = (directory, future)
        _register_conversion(future)
        if control.should_training_stop:
            # The last save: nothing left to overlap with, and what follows (loading the best
            # model, the final rotation, the end of the process) must see a finished directory.
            self.wait("on_save at the end of training")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Before the Trainer saves (and rotates), let the pending conversion finish."""
        if control.should_save:
            self.wait("the next save")

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """As :meth:`on_step_end`, for ``save_strategy="epoch"``."""
        if control.should_save:
            self.wait("the next save")

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """With ``save_strategy="best"`` the decision to save comes after evaluation: wait here."""
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self.wait("the next save")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Wait for the pending conversion and raise its error."""
        self.wait("on_train_end")
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def pending(self) -> bool:
        """True while a background conversion runs."""
        return self._pending is not None and not self._pending[1].done()

    def wait(self, when: str = "wait()") -> None:
        """Wait for the pending background conversion; raise its error if it failed.

        Raises:
            CheckpointError: The conversion failed; its directory holds the Trainer's plain files
                (the Trainer resumes from them).
        """
        if self._callback_thread == threading.get_ident():
            raise RuntimeError(
                "NvcompTrainerCallback.wait() was called from on_saved, which runs on the conversion thread "
                "and would wait for itself; call it from the training loop instead."
            )
        pending, self._pending = self._pending, None
        if pending is None:
            return
        directory, future = pending
        error = future.exception()
        if error is None:
            return
        message = f"{str(error).rstrip('.')}. (Converted in the background; reported by {when}.)"
        if isinstance(error, nc.CheckpointError):
            raise type(error)(message) from error
        raise nc.errors.CheckpointWriteError(f"{directory}: compressing the checkpoint failed: {message}") from error

    def _convert(self, directory: Path, entered: float, blocked: float) -> nc.SaveReport:
        """The background job: convert, then report (the error, if any, waits for :meth:`wait`)."""
        try:
            report = compress_checkpoint(
                directory, self.policy, verify=self.verify, workers=self.workers, stream_wrapper=self.stream_wrapper
            )
        except BaseException as exc:
            logger.error("%s (raised before the next save or by on_train_end)", exc)
            raise
        report = replace(report, seconds=time.perf_counter() - entered, seconds_blocked=blocked)
        self._converted(report)
        return report

    def _converted(self, report: nc.SaveReport) -> None:
        self.last_report = report
        log_report(report, "compressed")
        if self.on_saved is not None:
            self._callback_thread = threading.get_ident()
            try:
                self.on_saved(report)
            except Exception:
                logger.exception("%s: the on_saved callback raised", report.path)
            finally:
                self._callback_thread = None


# Conversions under way in this process, so that loading a checkpoint waits for them.
_CONVERSIONS: set[concurrent.futures.Future[Any]] = set()
_CONVERSIONS_LOCK = threading.Lock()


def _register_conversion(future: concurrent.futures.Future[Any]) -> None:
    with _CONVERSIONS_LOCK:
        _CONVERSIONS.add(future)

    def forget(done: concurrent.futures.Future[Any]) -> None:
        with _CONVERSIONS_LOCK:
            _CONVERSIONS.discard(done)

    future.add_done_callback(forget)


def _wait_for_conversions() -> None:
    """Wait for every background conversion of this process (their errors go to their callback)."""
    with _CONVERSIONS_LOCK:
        pending = list(_CONVERSIONS)
    if pending:
        concurrent.futures.wait(pending)


def _saved_checkpoint(output_dir: str, step: int) -> Path | None:
    name = f"checkpoint-{step}"
    direct = Path(output_dir) / name
    if direct.is_dir():
        return direct
    # Hyper-parameter search writes to <output_dir>/<run name>/checkpoint-N: take the newest.
    nested = [p for p in Path(output_dir).glob(f"*/{name}") if p.is_dir()]
    return max(nested, key=lambda p: p.stat().st_mtime) if nested else None


# -- resuming ----------------------------------------------------------------------------------


class NvcompTrainerMixin:
    """Lets a ``Trainer`` (sub)class resume from checkpoints converted by :class:`NvcompTrainerCallback`.

    Put it first in the bases of your Trainer class: ``class MyTrainer(NvcompTrainerMixin,
    SFTTrainer)``. Plain checkpoints still load through the Trainer's own code; for each file that
    exists only compressed, the compressed copy is read instead. Overrides the Trainer's
    ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler`` and ``_load_best_model``, and
    makes them and ``_save_checkpoint`` wait for background conversions (tested with transformers 5).
    """

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        _wait_for_conversions()  # a directory is read only once its async conversion is done
        weights = _compressed_weights(resume_from_checkpoint)
        if weights is None or self._nvcomp_delegates():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        logger.info("Loading model from %s.", weights)
        model = self.model if model is None else model  # type: ignore[attr-defined]
        self._nvcomp_load_weights(model, weights)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        _wait_for_conversions()
        compressed = Path(checkpoint) / (_OPTIMIZER + COMPRESSED_SUFFIX) if checkpoint is not None else None
        if (
            compressed is None
            or not compressed.is_file()
            or (Path(checkpoint) / _OPTIMIZER).is_file()
            or self._nvcomp_delegates()
        ):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        scheduler = Path(checkpoint) / _SCHEDULER
        if not scheduler.is_file():
            # The Trainer loads the optimizer and the scheduler together or not at all: an
            # optimizer state without its scheduler is not from the same save.
            return None
        args = self.args  # type: ignore[attr-defined]
        # As the Trainer does: the CPU for one process, each rank's own device when distributed.
        map_location = args.device if args.world_size > 1 and args.device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(_load_tree(compressed, "optimizer", map_location))  # type: ignore[attr-defined]
        with warnings.catch_warnings(record=True) as caught:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))  # type: ignore[attr-defined]
        reissue_pt_warnings(caught)

    def _load_best_model(self) -> None:
        _wait_for_conversions()
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        weights = _compressed_weights(best) if best else None
        if weights is None or self._nvcomp_delegates():
            return super()._load_best_model()  # type: ignore[misc]
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)  # type: ignore[attr-defined]
        self._nvcomp_load_weights(self.model, weights)  # type: ignore[attr-defined]

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        # The Trainer rotates old checkpoints inside this call: none may still be converting.
        _wait_for_conversions()
        return super()._save_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def _nvcomp_load_weights(self, model: torch.nn.Module, weights: Path) -> None:
        # Loaded on the CPU, non-strict, with the Trainer's own warnings: as the Trainer loads
        # model.safetensors (tied weights are absent from the file by design).
        state_dict = _load_tree(weights, "model", "cpu")
        load_result = model.load_state_dict(state_dict, False)
        del state_dict
        self._issue_warnings_after_load(load_result)  # type: ignore[attr-defined]

    def _nvcomp_delegates(self) -> bool:
        # DeepSpeed and FSDP load checkpoints their own way; the callback refuses them.
        return bool(getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False))


def _compressed_weights(checkpoint: str | os.PathLike[str]) -> Path | None:
    """The compressed weights of a checkpoint, if the plain ones are gone."""
    directory = Path(checkpoint)
    for name in (_SAFE_WEIGHTS, _TORCH_WEIGHTS):
        if (directory / name).is_file():
            return None  # the Trainer's own file wins: it is what the Trainer wrote
    for name in (_SAFE_WEIGHTS, _TORCH_WEIGHTS):
        compressed = directory / (name + COMPRESSED_SUFFIX)
        if compressed.is_file():
            return compressed
    return None


class NvcompTrainer(NvcompTrainerMixin, Trainer):
    """``transformers.Trainer`` that also resumes from compressed checkpoints (see :class:`NvcompTrainerMixin`)."""
