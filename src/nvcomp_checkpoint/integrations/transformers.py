"""Hugging Face ``Trainer`` integration: compressed ``checkpoint-N`` directories, and resuming from them.

``NvcompTrainerCallback`` compresses the files each save writes (``async_save=True``: in the
background); ``NvcompTrainer`` (or ``NvcompTrainerMixin`` on your own Trainer subclass) resumes from what it wrote.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import struct
import sys
import time
import warnings
import weakref
from pathlib import Path
from types import FrameType
from typing import IO, Any, Callable, NoReturn, TypeVar

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.dirconvert import (
    PLACEHOLDER_TAG,
    SUFFIX,
    PlainFile,
    check_identity,
    compress_in_place,
    compressed_copy,
    decompress_in_place,
    is_placeholder,
)
from nvcomp_checkpoint.dirstore import MARKER_NAME, numbered_dirs
from nvcomp_checkpoint.entrypoint import checked_on_every_rank, load_tree
from nvcomp_checkpoint.entrypoint.loading import failed_on_any_rank, leader_load_applies
from nvcomp_checkpoint.entrypoint.session import CheckpointSession, SessionOptions, SessionView
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.incremental import keep_with_bases
from nvcomp_checkpoint.report import format_bytes, merge_reports
from nvcomp_checkpoint.tiers import Tier, TierCopies
from nvcomp_checkpoint.version import install_hint

try:  # transformers_fsdp imports Accelerate's FSDP helpers (the Trainer saves FSDP state with them)
    import safetensors
    import safetensors.torch
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_pt_utils import reissue_pt_warnings

    from nvcomp_checkpoint.integrations import transformers_fsdp
except ImportError as exc:
    raise ImportError(
        f"nvcomp_checkpoint.transformers needs transformers, accelerate and safetensors: {install_hint('transformers')} ({exc})",
        name=exc.name,
    ) from exc

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
COMPRESSED_SUFFIX = SUFFIX

# The Trainer's own names (transformers.utils / transformers.trainer); repeated here so this
# module reads without chasing constants through transformers' private modules.
_SAFE_WEIGHTS = "model.safetensors"
_TORCH_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"
_WEIGHTS = (_SAFE_WEIGHTS, _TORCH_WEIGHTS)
_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Inside each compressed file the tree sits under one key, so tensor keys read like the rest of
# the library ("optimizer/state/0/exp_avg") and ``classify`` files step counters under "other".
_TREE_KEY = {_SAFE_WEIGHTS: "model", _TORCH_WEIGHTS: "model", _OPTIMIZER: "optimizer"}
_META_KEY = "transformers"

#: Written into a converted checkpoint directory: what the files are, and how to read them (the
#: Trainer and ``from_pretrained`` fail on the placeholders with messages of their own).
_MARKER_TEXT = f"""\
This checkpoint directory was compressed by nvcomp-checkpoint. To install it:
{install_hint("transformers")}.

optimizer.pt.nvc (and model.safetensors.nvc, if present) hold the Trainer's optimizer.pt (and
model.safetensors), compressed losslessly. optimizer.pt (and model.safetensors) are small
placeholders that transformers alone refuses to load:
- a Trainer without NvcompTrainerCallback fails to resume with "Weights only load failed ...
  Unsupported global: ...resume_with_NvcompTrainerCallback";
- with compressed weights, the Trainer and from_pretrained fail with "unknown variant
  `compressed by nvcomp-checkpoint into model.safetensors.nvc ...`".

- Resume training: keep NvcompTrainerCallback in the Trainer's callbacks (with compressed weights,
  use nvcomp_checkpoint.transformers.NvcompTrainer, or NvcompTrainerMixin on your Trainer class).
- Get the plain files back (from_pretrained, other tools):
    python -c "from nvcomp_checkpoint.transformers import decompress_checkpoint; decompress_checkpoint('<this directory>')"
- Read one file as torch.load / safetensors read the plain one (each compressed file holds the
  plain file's contents under one key: "optimizer" or "model"):
    optimizer.pt: nvcomp_checkpoint.load("optimizer.pt.nvc")["optimizer"]
    model.safetensors: nvcomp_checkpoint.load("model.safetensors.nvc")["model"]
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

    Each plain file is replaced by a small placeholder under its own name, which transformers
    refuses to load with an error naming what reads the compressed copy: without it, a Trainer
    lacking :class:`NvcompTrainerCallback` would skip the missing ``optimizer.pt`` and resume
    with a fresh optimizer state without a word.

    Args:
        checkpoint_dir: A ``checkpoint-N`` directory written by ``Trainer``.
        policy, workers, stream_wrapper: As for every integration
            (:class:`nvcomp_checkpoint.entrypoint.session.SessionOptions`).
        verify: Decode each compressed file and compare it bit for bit with the plain file before
            replacing the plain file.
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
    files = [
        PlainFile(name, _TREE_KEY[name], _read_plain, placeholder=_placeholder(name))
        for name in _plain_files(directory)
        if weights or name == _OPTIMIZER
    ]
    # The weights go first: a plain Trainer then refuses the directory ("Can't find a valid
    # checkpoint") instead of loading the weights and silently skipping a compressed optimizer.
    return compress_in_place(
        directory,
        files,
        policy,
        meta_key=_META_KEY,
        marker=_MARKER_TEXT,
        resumes="the Trainer resumes from them",
        verify=verify,
        workers=workers,
        stream_wrapper=stream_wrapper,
        identity={"step": _folder_step(directory)},
    )


def decompress_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Write back the plain files of a compressed checkpoint and remove the compressed ones.

    Use it to open a checkpoint with ``from_pretrained``, to resume with a plain ``Trainer``, or to
    hand the directory to a tool that expects the Trainer's files.

    Args:
        checkpoint_dir: A ``checkpoint-N`` directory converted by :func:`compress_checkpoint`.

    Returns:
        The names of the plain files written.
    """
    _wait_for_conversions()
    return decompress_in_place(
        Path(checkpoint_dir),
        _TREE_KEY,
        _write_plain,
        meta_key=_META_KEY,
        load_tree=lambda path, key: _load_tree(path, key, "cpu"),
    )


def _write_plain(name: str, tree: Any, meta: dict[str, Any], stream: IO[bytes]) -> None:
    if name == _SAFE_WEIGHTS:
        stream.write(safetensors.torch.save(tree, metadata=meta.get("safetensors_metadata")))
    else:
        torch.save(tree, stream)


def _plain_files(directory: Path) -> list[str]:
    """The Trainer's files this integration compresses, weights first (placeholders are converted already)."""
    names = []
    plain = lambda name: (directory / name).is_file() and not is_placeholder(directory / name)  # noqa: E731
    if any((directory / index).exists() for index in _SHARD_INDEXES):
        # Sharded weights (models over the 50 GB shard size) stay as they are: the Trainer
        # loads them shard by shard; the optimizer state, the larger part, is still compressed.
        logger.info("%s: sharded model weights are left uncompressed", directory)
    elif plain(_SAFE_WEIGHTS):
        names.append(_SAFE_WEIGHTS)
    elif plain(_TORCH_WEIGHTS):
        names.append(_TORCH_WEIGHTS)
    if plain(_OPTIMIZER):
        names.append(_OPTIMIZER)
    return names


# -- placeholders: what stays under the Trainer's names ---------------------------------------
# The stock Trainer skips a missing optimizer.pt without a word (and resumes with a fresh optimizer
# state); a placeholder in the file's own format makes its loader (and from_pretrained) fail
# instead, with a message that names what reads the compressed copy.


def resume_with_NvcompTrainerCallback(name: str) -> NoReturn:  # noqa: N802 - its name is the message torch shows
    """What a placeholder ``optimizer.pt`` stands for (torch's weights-only load refuses it, naming
    this function); called only by a load told to trust the file."""
    raise nc.errors.FormatError(
        f"{name}: a placeholder; the state is in {name}{SUFFIX}, compressed by nvcomp-checkpoint. Resume with "
        "NvcompTrainerCallback in the Trainer's callbacks, or run nvcomp_checkpoint.transformers.decompress_checkpoint() on the folder."
    )


def resume_with_NvcompTrainer(name: str) -> NoReturn:  # noqa: N802 - as above, for pytorch_model.bin
    """What a placeholder ``pytorch_model.bin`` stands for (see :func:`resume_with_NvcompTrainerCallback`)."""
    raise nc.errors.FormatError(
        f"{name}: a placeholder; the weights are in {name}{SUFFIX}, compressed by nvcomp-checkpoint. Load them with "
        "nvcomp_checkpoint.transformers.NvcompTrainer, or run decompress_checkpoint() on the folder."
    )


class _Refusal:
    """Pickles as a call of ``fn(name)``: a global that torch's weights-only unpickler refuses by name."""

    def __init__(self, fn: Callable[[str], NoReturn], name: str) -> None:
        self.fn, self.name = fn, name

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, (self.name,))


def _placeholder(name: str) -> bytes:
    """A small file in ``name``'s format that the Trainer's loader (and ``from_pretrained``) refuses loudly."""
    if name == _SAFE_WEIGHTS:
        # safetensors reports the dtype it does not know, verbatim.
        dtype = f"compressed by nvcomp-checkpoint into {name}{SUFFIX}; load it with NvcompTrainer (see {MARKER_NAME})"
        header = json.dumps(
            {
                "__metadata__": {PLACEHOLDER_TAG.decode(): name + SUFFIX},
                "weights": {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]},
            }
        ).encode()
        return struct.pack("<Q", len(header)) + header
    buffer = io.BytesIO()
    fn = resume_with_NvcompTrainerCallback if name == _OPTIMIZER else resume_with_NvcompTrainer
    torch.save({PLACEHOLDER_TAG.decode(): _Refusal(fn, name)}, buffer)
    return buffer.getvalue()


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
        raise nc.errors.FormatError(
            f"{path}: the Trainer's file cannot be read with torch.load(weights_only=True): {exc}"
        ) from exc
    return tree, {"file": path.name}


def _load_tree(path: Path | str, key: str, map_location: Any, leader_load: bool = False) -> Any:
    """The tree stored under ``key`` in one of our files; errors name the file and a way out.
    ``leader_load``: read once per node and broadcast (:func:`~nvcomp_checkpoint.entrypoint.load_tree`)."""
    path = Path(path)
    try:
        _check_converted(path, leader_load)
        saved = load_tree(path, map_location, leader_load=leader_load)
    except nc.errors.CheckpointError as exc:
        raise type(exc)(f"{str(exc).rstrip('.')}. {_resume_hint(path.parent)}") from exc
    if not isinstance(saved, dict) or key not in saved:
        raise nc.errors.FormatError(
            f"{path}: holds no {key!r} entry; it was not written by NvcompTrainerCallback. {_resume_hint(path.parent)}"
        )
    return saved[key]


def _check_converted(path: Path, leader_load: bool) -> None:
    """Refuse a converted file of another checkpoint than its folder's (:func:`check_identity`, :class:`MixedSaveError`).

    With ``leader_load`` the rank that reads the file for its node checks it (the others open no
    file), and every rank learns the outcome before the collective load.
    """
    if not (leader_load and leader_load_applies()):
        check_identity(path, {"step": _folder_step(path.parent)})
        return
    reads = int(os.environ.get("LOCAL_RANK", "0")) == 0  # the lowest rank of its node: load_broadcast's reader
    failed_on_any_rank(lambda: check_identity(path, {"step": _folder_step(path.parent)}) if reads else None, str(path))


def _resume_hint(checkpoint: Path) -> str:
    step = _step_of(checkpoint.name)
    if step is None or not checkpoint.parent.is_dir():
        return "Resume from another checkpoint."
    earlier = [p for s, p in numbered_dirs(checkpoint.parent, _step_of) if s < step]
    if not earlier:
        return "There is no earlier checkpoint in this directory to resume from."
    return f"Resume from an earlier checkpoint instead: trainer.train(resume_from_checkpoint={str(earlier[-1])!r})."


def _say_weights_stay_plain(directory: Path) -> bool:
    """Log once (INFO) that the weights stay plain, and their share of the checkpoint: with a stock
    Trainer a whole checkpoint compresses far less than its optimizer state, and the reason is easy to miss."""
    weights = [directory / name for name in _WEIGHTS if (directory / name).is_file()]
    if not weights:
        return False
    size = sum(p.stat().st_size for p in weights)
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    logger.info(
        "%s: %s (%s, %.0f%% of the checkpoint) stays as the Trainer wrote it, uncompressed, so that a stock Trainer "
        "and from_pretrained read it; only the optimizer state is compressed. nvcomp_checkpoint.transformers."
        "NvcompTrainer (or NvcompTrainerMixin first in your Trainer's bases) compresses the weights too.",
        directory,
        ", ".join(p.name for p in weights),
        format_bytes(size),
        100.0 * size / total if total else 0.0,
    )
    return True


def _folder_step(directory: Path) -> int | None:
    """The step a checkpoint folder was saved at: ``global_step`` of its trainer_state.json (which the
    Trainer writes before the callback converts), else the N of its name ``checkpoint-N``."""
    try:
        with open(directory / "trainer_state.json", "rb") as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        step = None
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return _step_of(directory.name)


def _step_of(name: str) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", name)
    return int(match.group(1)) if match else None


# -- the callback ------------------------------------------------------------------------------


class NvcompTrainerCallback(TrainerCallback):
    """Compresses the optimizer state (and, with :class:`NvcompTrainer`, the model weights) of every checkpoint.

    With a stock ``Trainer`` (or ``SFTTrainer`` ...), the model weights stay as the Trainer wrote
    them, so ``train(resume_from_checkpoint=...)``, ``load_best_model_at_end`` and
    ``from_pretrained`` of a checkpoint folder work unchanged; ``optimizer.pt`` becomes
    ``optimizer.pt.nvc`` (and a placeholder that a Trainer without this callback refuses to
    resume from), which this callback loads into the optimizer (and ``scheduler.pt`` into
    the scheduler, as the Trainer does) when training begins. With :class:`NvcompTrainer` (or
    :class:`NvcompTrainerMixin`) the weights are compressed too (``compress_weights``).

    With ``async_save=True``, each conversion runs in the background; the callback waits for it
    before the Trainer saves (and rotates) again, and at the end of training (``docs/transformers.md``).

    Under DeepSpeed the attached engine writes the ZeRO partitions compressed (in the background with
    ``async_save``) and converts nothing else; ``checkpoint-N`` is recorded (``last_report``, ``on_saved``)
    and copied to ``tiers`` once the engine has committed its tag on every rank.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
        ...                   callbacks=[NvcompTrainerCallback(async_save=True)])
        >>> trainer.train(resume_from_checkpoint=True)

    Args:
        policy, workers, async_save, on_saved, stream_wrapper, tiers: As for every integration
            (:class:`nvcomp_checkpoint.entrypoint.session.SessionOptions`). ``async_save`` converts each
            checkpoint in the background (see above); ``on_saved`` runs once the compressed files are
            durable and the plain ones removed. ``output_dir`` is tier 0 (with ``save_total_limit``
            as its retention); copies are named by the step N, and
            ``trainer.train(resume_from_checkpoint=callback.resume_path())`` resumes on a fresh node.
        verify: Decode each compressed file and compare it bit for bit before deleting the plain one.
        compress_weights: ``None`` (default): compress the weights only when the Trainer is an
            :class:`NvcompTrainerMixin`, which can resume from them. ``True`` with a stock
            Trainer is refused when the Trainer is created.
        incremental: ``True`` or a :class:`~nvcomp_checkpoint.ChainPolicy`: under DeepSpeed, each ZeRO file of a
            tag is a delta against the same file of the previous tag; with :class:`NvcompTrainer` (which hands the
            Trainer's ``save_total_limit`` rotation to the callback, keeping the folders kept deltas need), or
            with ``save_total_limit=None``. Refused when the Trainer is built (``ValueError``) without DeepSpeed,
            and with a stock Trainer that rotates: it deletes old ``checkpoint-N`` folders itself, which could
            delete a base that a kept delta needs.
        leader_load: On resume of replicated (DDP) state, one process per node reads each
            compressed file and sends it to the node's other processes over the process group
            (:func:`nvcomp_checkpoint.load_broadcast`), instead of every process reading the same
            bytes from a shared file system. Each load is a collective: the Trainer resumes, and loads
            the best model at the end (``load_best_model_at_end``), on every process, with
            :class:`NvcompTrainerMixin`, which first waits for the main process's conversions and
            for every rank, and agrees on which files to read; with a stock Trainer only the
            optimizer state of a resume is read this way.

    Attributes:
        last_report: The :class:`~nvcomp_checkpoint.SaveReport` of the latest conversion.
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
        incremental: bool | nc.ChainPolicy = False,
        leader_load: bool = False,
    ) -> None:
        options = SessionOptions.of(
            "NvcompTrainerCallback",
            policy,
            workers=workers,
            async_save=async_save,
            on_saved=on_saved,
            stream_wrapper=stream_wrapper,
            tiers=tiers,
            incremental=incremental,
        )
        #: The saves, tier copies and their errors: the callback holds the one session every integration holds.
        self.session = CheckpointSession("NvcompTrainerCallback", options, log_as="compressed")
        self.verify = verify
        self.leader_load = leader_load
        self.compress_weights = compress_weights
        self._weights = bool(compress_weights)
        self._resumes_itself = False  # the Trainer is an NvcompTrainerMixin: it loads what we wrote
        self._deepspeed = False  # the Trainer runs DeepSpeed: its engine writes compressed files itself
        # DeepSpeed only. Every rank keeps both (each rank's engine reports each committed tag): the
        # checkpoint-N folders whose tag the engine has not committed yet (folder -> step, whether this
        # process records it), and the tags committed before on_save saw their folder (folder -> report).
        self._ds_waiting: dict[str, tuple[int, bool]] = {}
        self._ds_committed: dict[str, nc.SaveReport] = {}
        self._ds_engines: Callable[[], list[Any]] = list
        #: DeepSpeed with ``incremental`` under NvcompTrainer: the Trainer's rotation is ours, chains kept whole.
        self.rotates = False
        self._rotation: tuple[int | None, str | None] = (None, None)  # save_total_limit, best_model_checkpoint
        self._said_weights_stay_plain = False  # logged once per callback, at its first save
        _CALLBACKS.add(self)

    # -- the session's public surface, as the callback has always offered it ----------------------
    policy = SessionView[nc.CodecPolicy]("policy")
    workers = SessionView[int | None]("options.workers")
    async_save = SessionView[bool]("async_save")
    on_saved = SessionView[Callable[[nc.SaveReport], Any] | None]("options.on_saved")
    stream_wrapper = SessionView[Callable[[IO[bytes]], IO[bytes]] | None]("options.stream_wrapper")
    tiers = SessionView[TierCopies | None]("tiers")
    last_report = SessionView[nc.SaveReport | None]("last_report")

    def pending(self) -> int:
        """Saves not yet durable (0 without ``async_save``); under DeepSpeed, with the tags not yet committed."""
        return self.session.pending() + len(self._ds_waiting)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save (and copy to ``tiers``) is durable; raise the first background failure.

        Under DeepSpeed with ``async_save`` the tag in flight is committed first, which is a collective:
        call it on every rank. See :meth:`~nvcomp_checkpoint.entrypoint.session.CheckpointSession.wait`.
        """
        self._commit_deepspeed()
        self.session.wait(timeout)

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest checkpoint copy on ``tiers`` that checks, for ``trainer.train(resume_from_checkpoint=...)``
        on a fresh node, or ``None`` (a fresh start). See
        :meth:`~nvcomp_checkpoint.entrypoint.session.CheckpointSession.resume_path`.

        Raises:
            ValueError: No ``tiers`` were given.
        """
        return self.session.resume_path(local_dir)

    def close(self, when: str = "close()") -> None:
        """Wait for pending saves and copies, stop the background threads, raise a failure (``when`` reports it)."""
        self.session.close(when)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Reject the setups whose checkpoints this callback cannot convert, or that could not resume."""
        trainer = (_trainer_locals() or {}).get("self")
        if args.deepspeed or getattr(trainer, "is_deepspeed_enabled", False):
            self._attach_deepspeed(args, trainer)
            return
        fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
        if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in ("checkpoint", "all_checkpoints"):
            # The Trainer uploads checkpoint-N in the background while on_save would rewrite it.
            raise nc.CheckpointError(
                f"{args.output_dir}: hub_strategy={args.hub_strategy!r} uploads each checkpoint directory in the "
                "background while NvcompTrainerCallback rewrites it. Use hub_strategy='every_save' or 'end'."
            )
        check_options("HF Trainer", f"{args.output_dir}: NvcompTrainerCallback", incremental=self.session.incremental is not None)
        self._resumes_itself = isinstance(trainer, NvcompTrainerMixin)
        if self.compress_weights and trainer is not None and not self._resumes_itself:
            raise nc.CheckpointError(
                f"{args.output_dir}: NvcompTrainerCallback(compress_weights=True) with a stock {type(trainer).__name__}: "
                "it could neither resume from nor load the best model from compressed weights. Use "
                "nvcomp_checkpoint.transformers.NvcompTrainer (or put NvcompTrainerMixin first in your Trainer "
                "class's bases), or leave compress_weights unset to keep the weights plain."
            )
        self._weights = self._resumes_itself if self.compress_weights is None else bool(self.compress_weights)
        if fsdp:  # NvcompTrainerMixin writes the FSDP state compressed itself (integrations/transformers_fsdp.py)
            transformers_fsdp.check_fsdp_callback(trainer, self._resumes_itself, self.compress_weights, _output_dir(args))
            self._weights = False
        if trainer is not None and not self._resumes_itself:
            # on_train_begin restores the optimizer state the Trainer skipped: first, so that the
            # other callbacks' on_train_begin see the state training resumes from.
            callbacks = trainer.callback_handler.callbacks
            if self in callbacks:
                callbacks.remove(self)
                callbacks.insert(0, self)
            _skip_optimizer_placeholder(trainer)
            self._check_stock_resume(args, trainer)

    def _attach_deepspeed(self, args: TrainingArguments, trainer: Trainer | None) -> None:
        """DeepSpeed: the engine writes the checkpoint's DeepSpeed part (``global_stepN/``, ``latest``) compressed.

        The Trainer creates the engine in ``accelerator.prepare`` and, on a resume, loads the DeepSpeed
        checkpoint right after it, before any callback runs: our engine is attached there. The
        Trainer's other files (``model.safetensors``, the export ``from_pretrained`` reads, the
        scheduler, RNG states) stay as it writes them; this callback converts nothing itself.

        The engine writes the ZeRO partition files (with ``async_save``, in the background) and commits
        the tag on every rank; ``checkpoint-N`` becomes a checkpoint of the session (its report, its
        copies to the tiers) only once the engine's ``on_saved`` says the tag is committed
        (:meth:`_deepspeed_committed`). A failure on any rank fails that commit on every rank.
        """
        self._resumes_itself = isinstance(trainer, NvcompTrainerMixin)
        chains = self.session.incremental is not None
        options: dict[str, Any] = {
            "async_save": self.async_save,
            "tiers": self.tiers,
            "leader_load": self.leader_load,
            "compress_weights": self.compress_weights,
        }
        where = f"{args.output_dir}: NvcompTrainerCallback"
        if self._resumes_itself:
            check_options("HF Trainer + DeepSpeed", where, incremental=chains, **options)
        else:
            # A stock Trainer deletes old folders itself: refused only where it does (save_total_limit).
            check_options(
                "HF Trainer + DeepSpeed, stock Trainer", where, incremental=chains and bool(args.save_total_limit), **options
            )
        self.rotates = chains and self._resumes_itself
        if trainer is None:
            raise nc.CheckpointError(
                f"{args.output_dir}: NvcompTrainerCallback with DeepSpeed must be passed to the Trainer "
                "(Trainer(..., callbacks=[NvcompTrainerCallback()])), so it can attach to the DeepSpeed engine "
                "before a resume loads the checkpoint."
            )
        from nvcomp_checkpoint.entrypoint.deepspeed_engine import attach_after, is_deepspeed_engine  # noqa: PLC0415

        self._deepspeed = True
        self._weights = False
        accelerator = trainer.accelerator
        self._ds_engines = lambda: [m for m in accelerator._models if is_deepspeed_engine(m)]
        attach_after(
            accelerator,
            "prepare",
            lambda: list(accelerator._models),
            policy=self.policy,
            workers=self.workers,
            async_save=self.async_save,
            incremental=self.session.options.incremental or False,
            on_saved=self._deepspeed_committed,
        )

    def _deepspeed_committed(self, report: nc.SaveReport) -> None:
        """The engine's ``on_saved``: a tag is committed on every rank (``report.path``: ``checkpoint-N/global_stepN``).

        Runs on every rank, in the training thread: inside ``save_checkpoint`` without ``async_save`` (before
        :meth:`on_save` sees the folder), at a later optimizer step or in :meth:`_commit_deepspeed` with it.
        """
        directory = os.path.dirname(os.path.abspath(report.path))
        waiting = self._ds_waiting.pop(directory, None)
        if waiting is None:
            self._ds_committed[directory] = report
        else:
            self._record_deepspeed(directory, report, *waiting)

    def _record_deepspeed(self, directory: str, report: nc.SaveReport, step: int, records: bool) -> None:
        """``checkpoint-N`` is complete (its tag committed, the Trainer's files written): the main process
        records it (``last_report``, ``on_saved``) and hands it to the tiers, which copy the whole folder."""
        if not records:
            return
        folder = merge_reports(directory, [report], report.seconds, report.seconds_blocked)
        # With incremental, the tiers get the folder with its base (found through global_stepN's deltas).
        self.session.saved(folder, self.session.after_durable(step, directory))
        if self.rotates:
            self._rotate(os.path.dirname(directory))

    def _rotate(self, run_dir: str) -> None:
        """The Trainer's ``save_total_limit`` rotation, keeping the folders that kept deltas need (``incremental``).

        :class:`NvcompTrainerMixin` turns the Trainer's own rotation off for it; it runs once the newest
        folder is recorded, so its base is read from its committed files. Each folder goes through the
        session's one deletion order (after the copies to the tiers that read it).
        """
        limit, best = self._rotation
        if not limit or limit <= 0:
            return
        found = [os.path.abspath(p) for _, p in numbered_dirs(Path(run_dir), _step_of)]
        keep = found[-limit:] + ([os.path.abspath(best)] if best else [])
        kept = keep_with_bases(keep, self.session.incremental.storage_options if self.session.incremental else None)
        for path in found:
            if os.path.normpath(path) not in {os.path.normpath(k) for k in kept}:
                logger.info("Deleting older checkpoint [%s] due to args.save_total_limit", path)
                self.session.remove(path, lambda p: shutil.rmtree(p, ignore_errors=True))

    def _commit_deepspeed(self) -> None:
        """Commit the tag the engine still writes in the background (``async_save``): a collective, every rank calls it.

        A failure on any rank raises here on every rank, and that checkpoint is never recorded nor copied.
        """
        if not (self._deepspeed and self.async_save):
            return
        from nvcomp_checkpoint.entrypoint.deepspeed_engine import NvcompCheckpointEngine  # noqa: PLC0415

        try:
            for engine in self._ds_engines():
                if isinstance(engine.checkpoint_engine, NvcompCheckpointEngine):
                    engine.checkpoint_engine.wait()
        finally:
            # Every tag saved so far is committed now, or failed (raised on every rank, now or at an earlier step).
            for directory, (_, records) in self._ds_waiting.items():
                if records:
                    logger.error("%s: its DeepSpeed tag was not committed; the checkpoint is not recorded nor copied", directory)
            self._ds_waiting.clear()

    def _check_stock_resume(self, args: TrainingArguments, trainer: Trainer) -> None:
        """A stock Trainer cannot read compressed weights: say so now, not with its own error at train()."""
        fix = (
            f"a stock {type(trainer).__name__} cannot read its compressed weights (it would say \"Can't find a "
            'valid checkpoint"). Resume with nvcomp_checkpoint.transformers.NvcompTrainer (or NvcompTrainerMixin '
            "first in your Trainer class's bases), or run decompress_checkpoint() on it first."
        )
        wanted = args.resume_from_checkpoint  # set by the example scripts' --resume_from_checkpoint
        if isinstance(wanted, str) and os.path.isdir(wanted) and compressed_copy(wanted, _WEIGHTS) is not None:
            raise nc.CheckpointError(f"{wanted}: {fix}")
        latest = _newest_checkpoint(_output_dir(args))
        if latest is not None and compressed_copy(latest, _WEIGHTS) is not None:
            logger.warning("%s: if this run resumes from it, %s", latest, fix)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Resuming with a stock Trainer: load the compressed optimizer state it skipped."""
        if self._deepspeed:
            self._check_deepspeed_attached()
            return
        if self._resumes_itself:
            return
        checkpoint = _resumed_checkpoint(args, state)
        if checkpoint is None:
            return
        compressed = _settled(
            args.world_size, self.leader_load, lambda: _compressed_optimizer(checkpoint), f"resuming from {checkpoint}"
        )
        optimizer = kwargs.get("optimizer")
        if compressed and optimizer is not None:  # else the Trainer loaded it itself, or nothing is to load
            _load_optimizer_and_scheduler(checkpoint, args, optimizer, kwargs.get("lr_scheduler"), self.leader_load)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Convert the checkpoint the Trainer has just written (after its rotation)."""
        if self._deepspeed:  # written compressed by the DeepSpeed engine
            self._on_deepspeed_save(args, state, control)
            return
        entered = time.perf_counter()
        if self.tiers is not None:
            # The Trainer has no barrier between writing checkpoint-N and on_save: every rank's
            # files (its rng_state_<rank>.pth) must be there before the main process copies it.
            _every_rank_waits(args.world_size)
        if not args.should_save:
            return  # other ranks: the main process owns the checkpoint files
        self.session.wait_for_saves("on_save")  # normally nothing is pending here: see on_step_end
        directory = _saved_checkpoint(_output_dir(args), state.global_step)
        if directory is None:
            logger.warning("NvcompTrainerCallback: no checkpoint-%d directory under %s", state.global_step, args.output_dir)
            return
        if not self._weights and not self._said_weights_stay_plain:
            self._said_weights_stay_plain = _say_weights_stay_plain(directory)

        def convert() -> Any:
            return transformers_fsdp.with_fsdp_reports(
                self,
                directory,
                compress_checkpoint(
                    directory,
                    self.policy,
                    verify=self.verify,
                    workers=self.workers,
                    stream_wrapper=self.stream_wrapper,
                    weights=self._weights,
                ),
            )

        # Copies to the tiers start once the converted directory is durable (the group's completion).
        after = self.session.after_durable(state.global_step, directory)
        if not self.async_save:
            self.session.saved(convert(), after)
            return
        self.session.checkpoint(directory, entered, after, lambda group: self.session.add_job(group, directory.name, convert))
        if control.should_training_stop:
            # The last save: nothing left to overlap with, and what follows (loading the best
            # model, the final rotation, the end of the process) must see a finished directory.
            self.session.wait_for_saves("on_save at the end of training")

    def _on_deepspeed_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        """Record ``checkpoint-N`` now if its tag is committed, else once the engine commits it (every rank)."""
        if self.tiers is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            # As in on_save: every rank's files (rng_state_<rank>.pth) are written before the folder is copied;
            # DeepSpeed's process group, which the Trainer may count as one process (CPU-only machines).
            torch.distributed.barrier()
        found = _saved_checkpoint(_output_dir(args), state.global_step)
        directory = os.path.abspath(found if found is not None else Path(_output_dir(args), f"checkpoint-{state.global_step}"))
        committed = self._ds_committed.pop(directory, None)
        self._ds_committed.clear()  # tags of folders no on_save will ask for
        self._rotation = (args.save_total_limit, state.best_model_checkpoint)
        if getattr(args, "save_only_model", False):
            return  # the engine saved no tag: the folder cannot resume DeepSpeed, nothing to record
        if self.async_save:
            # The save's tag is in flight whatever was committed before (an earlier save_checkpoint of the
            # same folder, ZeRO-3's save_model, is committed by the next one's start): wait for its commit.
            self._ds_waiting[directory] = (state.global_step, _records(args))
            if control.should_training_stop:
                # The last save: what follows (the best model's load, the end of the process) sees it committed.
                self._commit_deepspeed()
        elif committed is not None:
            self._record_deepspeed(directory, committed, state.global_step, _records(args))

    def _check_deepspeed_attached(self) -> None:
        from nvcomp_checkpoint.entrypoint.deepspeed_engine import NvcompCheckpointEngine, is_deepspeed_engine  # noqa: PLC0415

        trainer = (_trainer_locals() or {}).get("self")
        engine = getattr(trainer, "model_wrapped", None)
        if (
            engine is not None
            and is_deepspeed_engine(engine)
            and not isinstance(engine.checkpoint_engine, NvcompCheckpointEngine)
        ):
            # The Trainer prepared its engine through another accelerator than the one seen at on_init_end.
            raise nc.CheckpointError(
                f"NvcompTrainerCallback: the Trainer's DeepSpeed engine ({type(engine).__name__}) was created without "
                "the callback seeing it, so its checkpoints would be written uncompressed; pass the callback to "
                "the Trainer's constructor."
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Before the Trainer saves (and rotates), let the pending conversion finish."""
        if control.should_save:
            self._commit_deepspeed()
            self.session.wait_for_saves("the next save")

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """As :meth:`on_step_end`, for ``save_strategy="epoch"``."""
        if control.should_save:
            self._commit_deepspeed()
            self.session.wait_for_saves("the next save")

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """With ``save_strategy="best"`` the decision to save comes after evaluation: wait here."""
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self._commit_deepspeed()
            self.session.wait_for_saves("the next save")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Wait for the pending conversion (and the copies to ``tiers``) and raise its error.

        A failed conversion leaves its directory with the Trainer's plain files, which resume.
        """
        self._commit_deepspeed()
        self.close("on_train_end")


# Callbacks of this process, so that loading a checkpoint waits for their conversions.
_CALLBACKS: "weakref.WeakSet[NvcompTrainerCallback]" = weakref.WeakSet()


def _wait_for_conversions() -> None:
    """Wait for every background conversion of this process (their errors stay for their callback)."""
    for callback in list(_CALLBACKS):
        if callback.pending():
            callback.session.settle()


_T = TypeVar("_T")


def _settled(world_size: int, leader_load: bool, decide: Callable[[], _T], where: str) -> _T:
    """``decide`` (which of a checkpoint's files to read, plain or compressed) once the checkpoint is
    settled on every rank, with the same outcome on every rank.

    Only the main process converts a checkpoint (in ``on_save``, in the background with
    ``async_save``); another rank that looked meanwhile would see the plain file, read it while it is
    being removed, and with ``leader_load`` skip the collective load the main process enters. So this
    process's conversions finish first, then every rank waits for the others (a collective when
    ``world_size > 1``: every rank of the job calls it, as the Trainer's loads run on every rank),
    then each decides; with ``leader_load`` the decisions are agreed before the collective
    (:func:`~nvcomp_checkpoint.entrypoint.checked_on_every_rank`).
    """
    _wait_for_conversions()
    _every_rank_waits(world_size)
    return checked_on_every_rank(decide, where, leader_load)


def _records(args: TrainingArguments) -> bool:
    """Whether this process records a DeepSpeed checkpoint (its report, its copies to the tiers, the rotation):
    the Trainer's main process, and of DeepSpeed's process group rank 0 alone (with ``save_on_each_node``, or
    where the Trainer counts one process per rank as on CPU-only machines, several processes save as the
    main one; one copy per tier)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return False
    return bool(args.should_save)


def _every_rank_waits(world_size: int) -> None:
    """A barrier of the Trainer's processes (what Accelerate's ``wait_for_everyone`` does for DDP and FSDP)."""
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _compressed_optimizer(checkpoint: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint``'s optimizer state is compressed (to load with its scheduler.pt).

    Raises:
        CheckpointNotFoundError: The folder was converted (a placeholder optimizer.pt, or an
            optimizer.pt.nvc) but optimizer.pt.nvc or scheduler.pt is missing: resuming would
            start a fresh optimizer or schedule without a word, where the Trainer's own files load both.
    """
    directory = Path(checkpoint)
    compressed = compressed_copy(directory, (_OPTIMIZER,)) is not None
    missing = None
    if is_placeholder(directory / _OPTIMIZER) and not compressed:
        missing = _OPTIMIZER + COMPRESSED_SUFFIX
    elif compressed and not (directory / _SCHEDULER).is_file():
        missing = _SCHEDULER
    if missing is not None:
        raise nc.errors.CheckpointNotFoundError(
            f"{directory / missing}: missing from this converted checkpoint (its optimizer state is compressed, and "
            f"{missing} is part of it); resuming would start a fresh optimizer state. Restore the file. {_resume_hint(directory)}"
        )
    return compressed


def _skip_optimizer_placeholder(trainer: Trainer) -> None:
    """The stock Trainer's optimizer load skips a converted checkpoint (the callback's ``on_train_begin``
    loads optimizer.pt.nvc instead), where it would fail on the placeholder optimizer.pt."""
    stock = trainer._load_optimizer_and_scheduler
    if getattr(stock, "_nvcomp_skips_placeholder", False):
        return

    def load(checkpoint: str | None) -> None:
        if checkpoint is not None and is_placeholder(Path(checkpoint) / _OPTIMIZER):
            return None
        return stock(checkpoint)

    load._nvcomp_skips_placeholder = True  # type: ignore[attr-defined]
    trainer._load_optimizer_and_scheduler = load  # type: ignore[method-assign]


def _output_dir(args: TrainingArguments) -> str:
    """``args.output_dir``, which the Trainer sets (``"trainer_output"`` when not given) before any callback runs."""
    if args.output_dir is None:
        raise nc.CheckpointError(
            "NvcompTrainerCallback: TrainingArguments.output_dir is None; the callback converts the checkpoint-N "
            "folders under it: pass TrainingArguments(output_dir=...)"
        )
    return str(args.output_dir)


def _trainer_locals(needs: str = "self") -> dict[str, Any] | None:
    """The local variables of the innermost ``Trainer`` method on the stack that has ``needs``
    (callbacks are not handed the Trainer itself)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), Trainer) and needs in frame.f_locals:
            return frame.f_locals
        frame = frame.f_back
    return None


def _resumed_checkpoint(args: TrainingArguments, state: TrainerState) -> Path | None:
    """The checkpoint ``train(resume_from_checkpoint=...)`` resumes from, or ``None`` for a fresh run.

    The Trainer keeps it in a local variable of its training loop (transformers 4 and 5); if
    that is ever gone, a run that starts at a step > 0 resumes from ``checkpoint-<step>``.
    """
    found = _trainer_locals("resume_from_checkpoint")
    if found is not None:
        found = found["resume_from_checkpoint"]
        return Path(found) if isinstance(found, (str, os.PathLike)) else None
    if state.global_step == 0:
        return None
    guess = _saved_checkpoint(_output_dir(args), state.global_step)
    if guess is None:
        raise nc.CheckpointError(
            f"{args.output_dir}: NvcompTrainerCallback cannot tell which checkpoint this run resumed from (step "
            f"{state.global_step}); resume with nvcomp_checkpoint.transformers.NvcompTrainer instead."
        )
    return guess


def _load_optimizer_and_scheduler(
    checkpoint: Path, args: TrainingArguments, optimizer: Any, scheduler: Any, leader_load: bool = False
) -> None:
    """What ``Trainer._load_optimizer_and_scheduler`` does, from the compressed optimizer state
    (there, with its scheduler.pt: :func:`_compressed_optimizer`)."""
    logger.info("Loading the compressed optimizer state from %s.", checkpoint / (_OPTIMIZER + COMPRESSED_SUFFIX))
    # As the Trainer does: the CPU for one process, each rank's own device when distributed.
    map_location = args.device if args.world_size > 1 and args.device.type != "cpu" else "cpu"
    optimizer.load_state_dict(_load_tree(checkpoint / (_OPTIMIZER + COMPRESSED_SUFFIX), "optimizer", map_location, leader_load))
    if scheduler is not None:
        with warnings.catch_warnings(record=True) as caught:
            scheduler.load_state_dict(torch.load(checkpoint / _SCHEDULER, weights_only=True))
        reissue_pt_warnings(caught)


def _newest_checkpoint(output_dir: str) -> Path | None:
    """``checkpoint-<largest step>`` in ``output_dir`` (what ``resume_from_checkpoint=True`` picks)."""
    found = numbered_dirs(Path(output_dir), _step_of)
    return found[-1][1] if found else None


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
    exists only compressed, the compressed copy is read instead (``docs/transformers.md``).

    Collectives it adds with several processes (the Trainer calls these methods on every rank):
    each load (resume, best model at the end) first waits for this process's conversions and then
    for every rank, since the main process may still be converting the directory the others would
    read; under FSDP, each save ends with a barrier before the callback's ``on_save``.
    """

    # What the mixin uses of the Trainer it is mixed into (annotations only: the Trainer sets them;
    # Any where the Trainer's own annotation differs between transformers 4 and 5).
    args: TrainingArguments
    state: TrainerState
    model: Any
    optimizer: Any
    lr_scheduler: Any
    callback_handler: Any
    _issue_warnings_after_load: Callable[[Any], None]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        fsdp = transformers_fsdp.fsdp_enabled(self)
        weights = self._nvcomp_settled(
            lambda: None if fsdp else compressed_copy(resume_from_checkpoint, _WEIGHTS), f"resuming from {resume_from_checkpoint}"
        )
        if fsdp:
            with transformers_fsdp.loading_fsdp_state():
                return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        if weights is None or self._nvcomp_delegates():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        logger.info("Loading model from %s.", weights)
        model = self.model if model is None else model
        self._nvcomp_load_weights(model, weights)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        fsdp = transformers_fsdp.fsdp_enabled(self)
        compressed = self._nvcomp_settled(
            lambda: False if fsdp else _compressed_optimizer(checkpoint), f"resuming from {checkpoint}"
        )
        if fsdp:
            if transformers_fsdp.load_fsdp_optimizer_and_scheduler(self, checkpoint):
                return None
            with transformers_fsdp.loading_fsdp_state():
                return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        if not compressed or self._nvcomp_delegates():
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        _load_optimizer_and_scheduler(
            Path(checkpoint),
            self.args,
            self.optimizer,
            self.lr_scheduler,
            self._nvcomp_leader_load(),
        )

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        fsdp = transformers_fsdp.fsdp_enabled(self)
        weights = self._nvcomp_settled(
            lambda: compressed_copy(best, _WEIGHTS) if best and not fsdp else None, f"loading the best model from {best}"
        )
        if fsdp:
            with transformers_fsdp.loading_fsdp_state():
                return super()._load_best_model()  # type: ignore[misc]
        if weights is None or self._nvcomp_delegates():
            return super()._load_best_model()  # type: ignore[misc]
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        self._nvcomp_load_weights(self.model, weights)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        # The Trainer rotates old checkpoints inside this call: none may still be converting.
        _wait_for_conversions()
        rotates = any(isinstance(cb, NvcompTrainerCallback) and cb.rotates for cb in self.callback_handler.callbacks)
        limit = self.args.save_total_limit
        if rotates:
            # incremental: the callback rotates once the folder is committed, keeping the bases of kept deltas.
            self.args.save_total_limit = None
        try:
            super()._save_checkpoint(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.args.save_total_limit = limit
        if transformers_fsdp.fsdp_enabled(self):
            # A collective, under FSDP only (whose saves are collectives already): every rank's FSDP
            # files are written before the main process's on_save converts and reports the directory.
            transformers_fsdp.wait_for_every_rank(self)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not transformers_fsdp.fsdp_enabled(self):
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        # FSDP state is written compressed by every rank here (the callback converts nothing under FSDP).
        transformers_fsdp.save_fsdp_state(self, super()._save_optimizer_and_scheduler, output_dir)  # type: ignore[misc]

    def _nvcomp_load_weights(self, model: torch.nn.Module, weights: Path) -> None:
        # Loaded on the CPU, non-strict, with the Trainer's own warnings: as the Trainer loads
        # model.safetensors (tied weights are absent from the file by design).
        state_dict = _load_tree(weights, "model", "cpu", self._nvcomp_leader_load())
        load_result = model.load_state_dict(state_dict, False)
        del state_dict
        self._issue_warnings_after_load(load_result)

    def _nvcomp_leader_load(self) -> bool:
        # The option lives on the callback, which holds the integration's settings.
        callbacks = self.callback_handler.callbacks
        return any(isinstance(cb, NvcompTrainerCallback) and cb.leader_load for cb in callbacks)

    def _nvcomp_settled(self, decide: Callable[[], _T], where: str) -> _T:
        return _settled(self.args.world_size, self._nvcomp_leader_load(), decide, where)

    def _nvcomp_delegates(self) -> bool:
        # DeepSpeed loads checkpoints its own way (the callback refuses it); FSDP goes through
        # transformers_fsdp before this is asked.
        return bool(getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False))


class NvcompTrainer(NvcompTrainerMixin, Trainer):
    """``transformers.Trainer`` that also resumes from compressed checkpoints (see :class:`NvcompTrainerMixin`)."""
