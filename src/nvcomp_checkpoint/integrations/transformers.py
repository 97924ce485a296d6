"""Hugging Face ``Trainer`` integration: compressed ``checkpoint-N`` directories, and resuming from them.

``NvcompTrainerCallback`` compresses the files each save writes (``async_save=True``: in the
background); ``NvcompTrainer`` (or ``NvcompTrainerMixin`` on your own Trainer subclass) resumes from what it wrote.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import IO, Any, Callable

import safetensors
import safetensors.torch
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import reissue_pt_warnings

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.dirstore import MARKER_NAME, write_marker
from nvcomp_checkpoint.report import merge_reports
from nvcomp_checkpoint.savegroup import SaveSequence
from nvcomp_checkpoint.storage import LOCAL, stale_temp_files
from nvcomp_checkpoint.tiers import Tier, TierCopies
from nvcomp_checkpoint.tensors import first_difference

__all__ = [
    "NvcompTrainerCallback",
    "NvcompTrainerMixin",
    "NvcompTrainer",
    "compress_checkpoint",
    "decompress_checkpoint",
    "COMPRESSED_SUFFIX",
    "MARKER_NAME",
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

#: Written into a checkpoint directory whose model weights are compressed: what the files are,
#: and how to read them (the Trainer and ``from_pretrained`` only say that no weights were found).
_MARKER_TEXT = """\
This checkpoint directory was compressed by nvcomp-checkpoint (https://pypi.org/project/nvcomp-checkpoint/).

optimizer.pt.nvc (and model.safetensors.nvc, if present) hold the Trainer's optimizer.pt (and
model.safetensors), compressed losslessly. transformers alone cannot read them:
- a Trainer without NvcompTrainerCallback resumes with a FRESH optimizer state (it skips a
  missing optimizer.pt without a word);
- with compressed weights, Trainer(resume_from_checkpoint=...) says "Can't find a valid
  checkpoint" and from_pretrained says "no file named model.safetensors".

- Resume training: keep NvcompTrainerCallback in the Trainer's callbacks (with compressed weights,
  use nvcomp_checkpoint.transformers.NvcompTrainer, or NvcompTrainerMixin on your Trainer class).
- Get the plain files back (from_pretrained, other tools):
    python -c "from nvcomp_checkpoint.transformers import decompress_checkpoint; decompress_checkpoint('<this directory>')"
- Read one file: nvcomp_checkpoint.load("optimizer.pt.nvc")
"""


# -- conversion of one checkpoint directory ----------------------------------------------------


def compress_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    policy: nc.CodecPolicy | None = None,
    *,
    verify: bool = True,
    workers: int | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    weights: bool = True,
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
        weights: Compress the model weights too. Without them the directory stays loadable by
            the stock ``Trainer`` and ``from_pretrained``; :class:`NvcompTrainerCallback`
            restores the optimizer state when training begins.

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
    plain = [name for name in _plain_files(directory) if weights or name == _OPTIMIZER]
    stale_temp_files(directory, remove=True)  # a conversion killed mid-write left nc.save's temporary file
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
                LOCAL.remove(str(path))
        LOCAL.fsync(str(directory))
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
    if plain:
        # A directory that only this library reads whole says so to whoever opens it.
        write_marker(directory, _MARKER_TEXT)
    for name in plain:
        LOCAL.remove(str(directory / name))
    LOCAL.fsync(str(directory))
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
        # Atomic (temporary file, fsync, rename): a crash leaves the compressed file as it was.
        with LOCAL.open_write(str(directory / name)) as stream:
            if name == _SAFE_WEIGHTS:
                stream.write(safetensors.torch.save(tree, metadata=meta.get("safetensors_metadata")))
            else:
                torch.save(tree, stream)
        LOCAL.remove(str(compressed))
        restored.append(name)
    if not any(directory.glob("*" + COMPRESSED_SUFFIX)):
        LOCAL.remove(str(directory / MARKER_NAME))
    LOCAL.fsync(str(directory))
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
    difference = first_difference(original, decoded, key)
    if difference is not None:
        raise nc.errors.FormatError(
            f"{target}: the compressed copy differs from the Trainer's file at {difference!r}; "
            "please report this as a bug (pass verify=False only to skip this check)."
        )


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


def _restore_mtime(directory: Path, stamp: os.stat_result) -> None:
    LOCAL.set_times(str(directory), stamp)




# -- the callback ------------------------------------------------------------------------------


class NvcompTrainerCallback(TrainerCallback):
    """Compresses the optimizer state (and, with :class:`NvcompTrainer`, the model weights) of every checkpoint.

    With a stock ``Trainer`` (or ``SFTTrainer`` ...), the model weights stay as the Trainer wrote
    them, so ``train(resume_from_checkpoint=...)``, ``load_best_model_at_end`` and
    ``from_pretrained`` of a checkpoint folder work unchanged; ``optimizer.pt`` becomes
    ``optimizer.pt.nvc``, which this callback loads into the optimizer (and ``scheduler.pt`` into
    the scheduler, as the Trainer does) when training begins. With :class:`NvcompTrainer` (or
    :class:`NvcompTrainerMixin`) the weights are compressed too (``compress_weights``).

    With ``async_save=True``, ``on_save`` hands the conversion of ``checkpoint-N`` (read the
    Trainer's files, compress, verify, remove the plain files) to a background thread and returns.
    The Trainer's files on disk are the snapshot: at every moment each file is there complete,
    plain or compressed. Before the Trainer saves again (and rotates old checkpoints), the callback
    waits for the pending conversion; the save that ends training is converted before ``on_save``
    returns. A failed conversion (its directory is left as the Trainer wrote it, which still
    resumes) is raised before the next save, or by ``on_train_end``.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
        ...                   callbacks=[NvcompTrainerCallback(async_save=True)])
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
        compress_weights: ``None`` (default): compress the weights only when the Trainer is an
            :class:`NvcompTrainerMixin`, which can resume from them. ``True`` with a stock
            Trainer is refused when the Trainer is created.
        tiers: :class:`~nvcomp_checkpoint.Tier` s to copy each converted ``checkpoint-N`` folder
            to (a shared file system, an object store), on their schedules, with their retention;
            ``output_dir`` is tier 0 (with ``save_total_limit`` as its retention). A copy is named
            by the step N and starts once the conversion is durable. On a fresh node,
            ``trainer.train(resume_from_checkpoint=callback.resume_path())`` resumes from the
            newest copy that checks. Copies never hold up training; ``on_train_end`` waits
            for them and raises a failed one.
        incremental: Refused (``ValueError``): the Trainer deletes old ``checkpoint-N`` folders
            itself, which could delete a base that a kept delta needs.

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
        compress_weights: bool | None = None,
        tiers: list[Tier] | None = None,
        incremental: bool = False,
    ) -> None:
        if incremental:
            raise ValueError(
                "NvcompTrainerCallback(incremental=True) is not supported: the Trainer deletes old checkpoint-N "
                "folders itself (save_total_limit, best-model rotation) without asking, which would delete bases "
                "that kept deltas need. Save in full here, or use nc.CheckpointManager(tiers, incremental=True) or "
                "the Lightning / Accelerate integrations' incremental=True."
            )
        self.tiers: TierCopies | None = None if tiers is None else TierCopies(tiers, "NvcompTrainerCallback")
        self._saves = SaveSequence("NvcompTrainerCallback", workers=workers, on_saved=on_saved, log_as="compressed")
        self.policy = policy
        self.verify = verify
        self.workers = workers
        self.async_save = bool(async_save)
        self.on_saved = on_saved
        self.stream_wrapper = stream_wrapper
        self.compress_weights = compress_weights
        self._weights = bool(compress_weights)
        self._resumes_itself = False  # the Trainer is an NvcompTrainerMixin: it loads what we wrote
        _CALLBACKS.add(self)

    @property
    def last_report(self) -> nc.SaveReport | None:
        return self._saves.last_report

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Reject the setups whose checkpoints this callback cannot convert, or that could not resume."""
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
        trainer = _calling_trainer()
        self._resumes_itself = isinstance(trainer, NvcompTrainerMixin)
        if self.compress_weights and trainer is not None and not self._resumes_itself:
            raise nc.CheckpointError(
                f"{args.output_dir}: NvcompTrainerCallback(compress_weights=True) with a stock {type(trainer).__name__}: "
                "it could neither resume from nor load the best model from compressed weights. Use "
                "nvcomp_checkpoint.transformers.NvcompTrainer (or put NvcompTrainerMixin first in your Trainer "
                "class's bases), or leave compress_weights unset to keep the weights plain."
            )
        self._weights = self._resumes_itself if self.compress_weights is None else bool(self.compress_weights)
        if trainer is not None and not self._resumes_itself:
            # on_train_begin restores the optimizer state the Trainer skipped: first, so that the
            # other callbacks' on_train_begin see the state training resumes from.
            callbacks = trainer.callback_handler.callbacks
            if self in callbacks:
                callbacks.remove(self)
                callbacks.insert(0, self)
            self._check_stock_resume(args, trainer)

    def _check_stock_resume(self, args: TrainingArguments, trainer: Trainer) -> None:
        """A stock Trainer cannot read compressed weights: say so now, not with its own error at train()."""
        fix = (
            f"a stock {type(trainer).__name__} cannot read its compressed weights (it would say \"Can't find a "
            "valid checkpoint\"). Resume with nvcomp_checkpoint.transformers.NvcompTrainer (or NvcompTrainerMixin "
            "first in your Trainer class's bases), or run decompress_checkpoint() on it first."
        )
        wanted = args.resume_from_checkpoint  # set by the example scripts' --resume_from_checkpoint
        if isinstance(wanted, str) and os.path.isdir(wanted) and _compressed_weights(wanted) is not None:
            raise nc.CheckpointError(f"{wanted}: {fix}")
        latest = _newest_checkpoint(args.output_dir)
        if latest is not None and _compressed_weights(latest) is not None:
            logger.warning("%s: if this run resumes from it, %s", latest, fix)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Resuming with a stock Trainer: load the compressed optimizer state it skipped."""
        if self._resumes_itself:
            return
        checkpoint = _resumed_checkpoint(args, state)
        if checkpoint is None:
            return
        _wait_for_conversions()
        optimizer, scheduler = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        compressed = checkpoint / (_OPTIMIZER + COMPRESSED_SUFFIX)
        if not compressed.is_file() or (checkpoint / _OPTIMIZER).is_file() or optimizer is None:
            return  # the Trainer loaded (or had nothing to load) itself
        if not (checkpoint / _SCHEDULER).is_file():
            return  # as the Trainer: an optimizer state without its scheduler is not from the same save
        logger.info("Loading the compressed optimizer state from %s.", compressed)
        _load_optimizer_and_scheduler(checkpoint, args, optimizer, scheduler)

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
        convert = lambda: compress_checkpoint(  # noqa: E731
            directory, self.policy, verify=self.verify, workers=self.workers, stream_wrapper=self.stream_wrapper,
            weights=self._weights,
        )
        step = state.global_step
        # Copies to the tiers start once the converted directory is durable (the group's completion).
        after = [] if self.tiers is None else [lambda report: self._copy_to_tiers(step, directory)]
        if not self.async_save:
            self._saves.notify(convert(), after)
            return
        group = self._saves.begin(directory, started=entered, notify=after)
        self._saves.run(group, directory.name, convert)
        group.blocked = time.perf_counter() - entered
        self._saves.seal(group)
        if control.should_training_stop:
            # The last save: nothing left to overlap with, and what follows (loading the best
            # model, the final rotation, the end of the process) must see a finished directory.
            self.wait("on_save at the end of training")

    def _copy_to_tiers(self, step: int, directory: Path) -> None:
        assert self.tiers is not None
        self.tiers.adopt(step, directory)

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest ``checkpoint-N`` copy on ``tiers`` that checks (every file), or ``None`` (a fresh start).

        ``trainer.train(resume_from_checkpoint=callback.resume_path())`` resumes from it on a
        fresh node, where ``output_dir`` is gone; damaged or incomplete newer copies are skipped.
        A copy on an object store is downloaded, checked, into ``local_dir`` first (default
        ``.nvckpt-restore`` in the working directory).

        Raises:
            ValueError: The callback has no ``tiers``.
        """
        if self.tiers is None:
            raise ValueError("NvcompTrainerCallback.resume_path(): no tiers; pass NvcompTrainerCallback(tiers=[nc.Tier(...)])")
        return self.tiers.resume_path(local_dir)

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
        """Wait for the pending conversion (and the copies to ``tiers``) and raise its error."""
        self.wait("on_train_end")
        self._saves.close()
        if self.tiers is not None:
            self.tiers.wait()

    def pending(self) -> bool:
        """True while a background conversion runs."""
        return self._saves.pending() > 0

    def wait(self, when: str = "wait()") -> None:
        """Wait for the pending background conversion; raise its error if it failed.

        Raises:
            CheckpointError: The conversion failed; its directory holds the Trainer's plain files
                (the Trainer resumes from them).
        """
        self._saves.wait()
        self._saves.raise_errors(when)


# Callbacks of this process, so that loading a checkpoint waits for their conversions.
_CALLBACKS: "weakref.WeakSet[NvcompTrainerCallback]" = weakref.WeakSet()


def _wait_for_conversions() -> None:
    """Wait for every background conversion of this process (their errors stay for their callback)."""
    for callback in list(_CALLBACKS):
        if callback.pending():
            callback._saves.wait()


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose event this is: callbacks are not handed the Trainer itself."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _resumed_checkpoint(args: TrainingArguments, state: TrainerState) -> Path | None:
    """The checkpoint ``train(resume_from_checkpoint=...)`` resumes from, or ``None`` for a fresh run.

    The Trainer keeps it in a local variable of its training loop (transformers 4 and 5); if
    that is ever gone, a run that starts at a step > 0 resumes from ``checkpoint-<step>``.
    """
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        if isinstance(frame.f_locals.get("self"), Trainer) and "resume_from_checkpoint" in frame.f_locals:
            found = frame.f_locals["resume_from_checkpoint"]
            return Path(found) if isinstance(found, (str, os.PathLike)) else None
        frame = frame.f_back
    if state.global_step == 0:
        return None
    guess = _saved_checkpoint(args.output_dir, state.global_step)
    if guess is None:
        raise nc.CheckpointError(
            f"{args.output_dir}: NvcompTrainerCallback cannot tell which checkpoint this run resumed from (step "
            f"{state.global_step}); resume with nvcomp_checkpoint.transformers.NvcompTrainer instead."
        )
    return guess


def _load_optimizer_and_scheduler(checkpoint: Path, args: TrainingArguments, optimizer: Any, scheduler: Any) -> None:
    """What ``Trainer._load_optimizer_and_scheduler`` does, from the compressed optimizer state."""
    # As the Trainer does: the CPU for one process, each rank's own device when distributed.
    map_location = args.device if args.world_size > 1 and args.device.type != "cpu" else "cpu"
    optimizer.load_state_dict(_load_tree(checkpoint / (_OPTIMIZER + COMPRESSED_SUFFIX), "optimizer", map_location))
    if scheduler is not None:
        with warnings.catch_warnings(record=True) as caught:
            scheduler.load_state_dict(torch.load(checkpoint / _SCHEDULER, weights_only=True))
        reissue_pt_warnings(caught)


def _newest_checkpoint(output_dir: str) -> Path | None:
    """``checkpoint-<largest step>`` in ``output_dir`` (what ``resume_from_checkpoint=True`` picks)."""
    found = [(s, p) for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and (s := _step_of(p.name)) is not None]
    return max(found)[1] if found else None


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
        _load_optimizer_and_scheduler(Path(checkpoint), self.args, self.optimizer, self.lr_scheduler)  # type: ignore[attr-defined]

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
