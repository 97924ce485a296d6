"""Lightning strategies whose sharded checkpoints go through :class:`~nvcomp_checkpoint.dcp.NvcompWriter`.

Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` save sharded state with
``torch.distributed.checkpoint`` themselves and never call the ``CheckpointIO``; these drop-ins
take the same arguments and write (and read) that state compressed, through the core's DCP rank
files backend (:mod:`nvcomp_checkpoint.dcp.rank_files`). An ``NvcompCheckpointIO`` passed as a
plugin gives them its policy, gets each sharded save's report (``on_saved``, ``last_report``,
``NvcompCheckpointMetrics``), copies each checkpoint directory to its ``tiers``, and with its
``async_save`` has each sharded save written in the background.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, ContextManager, Mapping, Optional, cast

import torch
from typing_extensions import override

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import CodecPolicy, SaveReport
from nvcomp_checkpoint.dcp import NvcompReader
from nvcomp_checkpoint.dcp.rank_files import (
    BackgroundRankFiles,
    RankFilesOptions,
    Record,
    check_tie,
    read_rank_files,
    save_rank_files,
    save_rank_files_async,
)
from nvcomp_checkpoint.entrypoint import as_policy, torch_weights_only
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.version import install_hint

try:
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover
    raise ImportError(f"nvcomp_checkpoint.lightning needs Lightning: {install_hint('lightning')}") from exc

__all__ = ["NvcompModelParallelStrategy", "NvcompFSDPStrategy", "check_sharded_checkpoint_io"]


def policy_of(policy: CodecPolicy | Mapping[str, Any] | None, strategy: Any) -> CodecPolicy | None:
    if policy is not None:
        return as_policy(policy, f"{type(strategy).__name__}(policy=...)")
    # An NvcompCheckpointIO passed as a plugin brings its policy along.
    io = strategy._checkpoint_io
    for _ in range(8):
        if io is None:
            break
        if isinstance(getattr(io, "policy", None), CodecPolicy):
            return io.policy
        io = getattr(io, "checkpoint_io", None)
    return None


class StrategyOptions:
    """``policy=`` and ``workers=`` of our Lightning strategies (a mixin before the Lightning base class):
    ``policy`` is the one given, else that of an ``NvcompCheckpointIO`` passed as a plugin."""

    def __init__(
        self, *args: Any, policy: CodecPolicy | Mapping[str, Any] | None = None, workers: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._nvckpt_policy = policy
        self.workers = workers

    @property
    def policy(self) -> CodecPolicy | None:
        return policy_of(self._nvckpt_policy, self)


class ShardedSaves(StrategyOptions):
    """What our two sharded strategies add to :class:`StrategyOptions`: ``last_report``, and the sharded
    saves an ``NvcompCheckpointIO(async_save=True)`` plugin has written in the background."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_report: SaveReport | None = None
        self._background = BackgroundRankFiles(type(self).__name__)
        # Between runs (before setup, after teardown) a save has no training to overlap: written at once.
        self._between_runs = True

    def pending(self) -> int:
        """Sharded saves not yet durable (0 or 1; 0 without ``async_save``)."""
        return self._background.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the sharded save written in the background is committed; raise its failure.

        Every rank must call it (each waits for its own part; a failure on any rank raises on every rank).

        Raises:
            nvcomp_checkpoint.errors.CheckpointWriteError: the background save failed on some rank.
            TimeoutError: still running after ``timeout`` seconds.
        """
        self._background.wait("wait()", timeout=timeout)

    def _wait_for_background(self, when: str, consequence: str = "") -> None:
        self._background.wait(when, consequence)

    def _begin_run(self) -> None:
        self._between_runs = False

    def _end_run(self) -> None:
        """Before Lightning's teardown: the save in flight committed (or its failure raised), then the plugin's teardown."""
        self._between_runs = True
        self._background.close("teardown, at the end of the run")

    def _remove_after_pending(self, filepath: Any, remove: Any) -> None:
        """``remove(filepath)`` (ModelCheckpoint's old top-k directory) once the save in flight, which
        usually replaces it, is committed; skipped (kept) if that save fails."""
        if not self._background.after_pending(lambda: remove(filepath), os.fspath(filepath)):
            remove(filepath)


def nvcomp_plugin(strategy: Any) -> Any:
    """The strategy's ``NvcompCheckpointIO`` (found by the method it offers sharded strategies,
    inside wrappers), or None."""
    io = strategy._checkpoint_io
    for _ in range(8):
        if io is None or callable(getattr(io, "saved_by_strategy", None)):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def _check_plugin_options(strategy: Any) -> None:
    """What an ``NvcompCheckpointIO`` offers for one-file saves and a sharded save cannot do."""
    plugin = nvcomp_plugin(strategy)
    if plugin is None:
        return
    check_options(
        "Lightning sharded (ModelParallel / FSDP)",
        "NvcompCheckpointIO",
        incremental=getattr(plugin, "incremental", None) is not None,
        async_save=getattr(plugin, "async_save", False),
    )


def _teardown(strategy: Any, lightning_teardown: Any) -> None:
    """The save in flight committed (its failure raised, on every rank), then Lightning's teardown
    and the plugin's; a failure of ours still lets both run."""
    try:
        strategy._end_run()
    except BaseException:
        try:
            lightning_teardown()
            _teardown_checkpoint_io(strategy)
        except Exception:  # noqa: BLE001 - the first error stays visible
            logging.getLogger("nvcomp_checkpoint").exception("%s: teardown after a failed save", type(strategy).__name__)
        raise
    lightning_teardown()
    _teardown_checkpoint_io(strategy)


def _teardown_checkpoint_io(strategy: Any) -> None:
    """What Lightning's ``ModelParallelStrategy.teardown`` and ``FSDPStrategy.teardown`` leave out (the
    base ``Strategy.teardown`` does it): the ``CheckpointIO``'s teardown, where an ``NvcompCheckpointIO``
    waits for its copies to the tiers and pending saves, and raises their failures."""
    if strategy._checkpoint_io is not None:
        strategy._checkpoint_io.teardown()


def _is_sharded_dir(path: Path) -> bool:
    """Lightning's test for a sharded checkpoint: a directory with its ``meta.pt``."""
    return path.is_dir() and (path / _METADATA_FILENAME).is_file()


def _refuse_compressed_full_file(path: Path, strategy: str) -> None:
    """Lightning loads a full (one-file) checkpoint of a sharded strategy with ``torch.load`` itself."""
    if path.is_file():
        from nvcomp_checkpoint import is_nvcomp_checkpoint

        if is_nvcomp_checkpoint(path):
            raise CheckpointError(
                f"{path}: a compressed full checkpoint; {strategy} loads one-file checkpoints with torch.load "
                "(Lightning's code), which cannot read it. Save sharded checkpoints instead "
                "(save_distributed_checkpoint=True / state_dict_type='sharded'), or decompress this one first: "
                "nvckpt decompress <file> <file>.pt"
            )


#: The key of meta.pt's index metadata that ties it to the DCP save beside it.
_META_KEY = "lightning_sharded"


def _check_same_save(path: Path) -> None:
    """``meta.pt`` and the DCP files come from one save (see :func:`_save_lightning_checkpoint`);
    checked before any state is loaded. A ``meta.pt`` without the tie (older releases, Lightning's own) is not checked.

    Raises:
        MixedSaveError: ``meta.pt`` records another ``.metadata`` than the one beside it.
    """
    check_tie(path / _METADATA_FILENAME, _META_KEY, path)


def _load_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """``meta.pt``: ours (:func:`nvcomp_checkpoint.save`) or a plain ``torch.save`` one (older
    checkpoints, Lightning's stock strategies); ``weights_only=None`` is ``torch.load``'s default."""
    metadata: dict[str, Any] = nc.load(path / _METADATA_FILENAME, weights_only=torch_weights_only(weights_only))
    return metadata


def _save_lightning_checkpoint(
    strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any, model_key: str
) -> None:
    """A Lightning checkpoint dict saved as a compressed sharded directory (weights under ``model_key``, as Lightning's strategy does).

    The sharded state goes to the DCP rank files backend; Lightning's ``meta.pt`` (loops, callbacks
    ...) is its record: written last by rank 0, compressed and checksummed (callbacks such as an EMA
    can hold a full copy of the weights there), under Lightning's name, which its
    ``_is_sharded_checkpoint`` tests for, so a save that dies midway leaves a directory that
    Lightning does not take for a checkpoint. Its index records a digest of the DCP ``.metadata``
    it was saved with: a load refuses a ``meta.pt`` or DCP files of another save.

    With an ``NvcompCheckpointIO(async_save=True)`` plugin, during a run: returns once every rank's
    shards are copied to host memory; the rank files, ``.metadata`` and ``meta.pt`` are written in
    the background, and the plugin gets the report (and copies the directory to its tiers) once
    every rank agreed that it is durable.
    """
    if storage_options is not None:
        raise TypeError(
            f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported for sharded "
            f"checkpoints; set the codec policy with {type(strategy).__name__}(policy=...)"
        )
    plugin = nvcomp_plugin(strategy)  # its options were checked at setup (check_sharded_checkpoint_io)
    path = Path(strategy.broadcast(filepath))
    converted = {model_key: checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    workers = strategy.workers if strategy.workers is not None or plugin is None else plugin.workers
    options = RankFilesOptions(strategy.policy, workers, None if plugin is None else plugin.stream_wrapper)
    record = Record(_METADATA_FILENAME, checkpoint, _META_KEY)

    def committed(report: SaveReport) -> None:  # global rank 0, once every rank's part and meta.pt are committed
        strategy.last_report = report
        if plugin is not None:
            plugin.saved_by_strategy(report, checkpoint, path)

    if getattr(plugin, "async_save", False) and not strategy._between_runs:
        save_rank_files_async(strategy._background, converted, path, options, record=record, on_committed=committed)
        return
    strategy._wait_for_background(f"the save to {path}", "That save was not started.")
    report = save_rank_files(converted, path, options, record=record)
    if report is not None:
        committed(report)


def _remove_checkpoint(strategy: Any, filepath: Any, remove: Any) -> None:
    """Lightning's removal of an old checkpoint (global rank 0), queued behind the save in flight."""
    strategy._remove_after_pending(filepath, remove)


class NvcompModelParallelStrategy(ShardedSaves, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism) with compressed sharded checkpoints.

    Takes ModelParallelStrategy's arguments, plus:

    Args:
        policy: Codec settings per component (DCP names such as ``optimizer_0.state.layer.weight.exp_avg``
            are classified as ``exp_avg``). Default: the policy of an ``NvcompCheckpointIO``
            passed as a plugin, else :class:`CodecPolicy()`.
        workers: Compression threads per rank.

    With ``save_distributed_checkpoint=True`` (the default), each rank's shard is written by
    :class:`~nvcomp_checkpoint.dcp.NvcompWriter`; loading reads such a directory or a plain one
    written by Lightning's ``ModelParallelStrategy``, on any number of ranks. With ``False`` the
    full checkpoint is one file written by the ``CheckpointIO``, as in Lightning.

    Attributes:
        last_report: On global rank 0, the :class:`~nvcomp_checkpoint.SaveReport` of the last
            sharded save (every rank's file and ``meta.pt``); ``None`` before one and on the other
            ranks. An ``NvcompCheckpointIO`` plugin gets it too (its ``last_report``, ``on_saved``,
            ``NvcompCheckpointMetrics``), and copies each checkpoint directory to its ``tiers``
            (``trainer.fit(ckpt_path=plugin.resume_path())`` resumes from the newest copy). With the
            plugin's ``async_save``, each sharded save returns once every rank's shards are copied to
            host memory and is committed in the background (one at a time; :meth:`wait`, the next save,
            a load and the end of the run wait for it, and raise its failure on every rank). The
            plugin's ``incremental`` is refused for sharded saves.

    Example:
        >>> strategy = NvcompModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        >>> Trainer(strategy=strategy, devices=2).fit(model)
    """

    @override
    def setup(self, trainer: Any) -> None:
        check_sharded_checkpoint_io(self)  # before the first step, not at the first save
        super().setup(trainer)
        self._begin_run()

    @override
    def teardown(self) -> None:
        _teardown(self, super().teardown)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        _remove_checkpoint(self, filepath, super().remove_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        _save_lightning_checkpoint(self, checkpoint, filepath, storage_options, model_key="state_dict")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_dir(path):
            _refuse_compressed_full_file(path, type(self).__name__)
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # A checkpoint still being written must not be read as missing or as the older one.
        self._wait_for_background(f"load_checkpoint({os.fspath(path)!r})", "Nothing was loaded.")
        _check_same_save(path)  # before any state changes
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(self.model)}
        read_rank_files(module_state, path)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            read_rank_files(optim_state, path)
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
            )
        return _load_meta(path, weights_only)


class NvcompFSDPStrategy(ShardedSaves, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) with compressed sharded checkpoints (``state_dict_type="sharded"``).

    Takes FSDPStrategy's arguments, plus ``policy`` and ``workers``, and reports and copies to the
    plugin's tiers as :class:`NvcompModelParallelStrategy`. FSDP1 runs on CUDA GPUs here: without CUDA the
    strategy refuses at construction; on the CPU use :class:`NvcompModelParallelStrategy` (FSDP2).

    Raises:
        CheckpointError: no CUDA device in this process.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            raise CheckpointError(
                "NvcompFSDPStrategy wraps Lightning's FSDPStrategy (FSDP1), which needs a CUDA GPU, and this process "
                "has none; on the CPU use nvcomp_checkpoint.lightning.NvcompModelParallelStrategy (FSDP2, "
                "fully_shard in configure_model) with data_parallel_size=<processes>, tensor_parallel_size=1"
            )
        super().__init__(*args, **kwargs)

    @override
    def setup(self, trainer: Any) -> None:
        check_sharded_checkpoint_io(self)
        super().setup(trainer)
        self._begin_run()

    @override
    def teardown(self) -> None:
        _teardown(self, super().teardown)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        _remove_checkpoint(self, filepath, super().remove_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        _save_lightning_checkpoint(self, checkpoint, filepath, storage_options, model_key="model")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_dir(path):
            _refuse_compressed_full_file(path, type(self).__name__)
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # A checkpoint still being written must not be read as missing or as the older one.
        self._wait_for_background(f"load_checkpoint({os.fspath(path)!r})", "Nothing was loaded.")
        _check_same_save(path)  # before any state changes
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert self.model is not None and self.lightning_module is not None
        # Lightning annotates its helper as a Generator; it returns FSDP's state_dict_type context manager.
        with cast(ContextManager[None], _get_sharded_state_dict_context(self.model)):
            module_state = {"model": self.model.state_dict()}
            read_rank_files(module_state, path)
            self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
                for idx, optimizer in enumerate(self.optimizers):
                    key = f"optimizer_{idx}"
                    optim_state = load_sharded_optimizer_state_dict(
                        model_state_dict=module_state["model"], optimizer_key=key, storage_reader=NvcompReader(path)
                    )
                    flattened = FSDP.optim_state_dict_to_load(
                        optim_state_dict=optim_state[key], model=self.model, optim=optimizer
                    )
                    optimizer.load_state_dict(flattened)
        return _load_meta(path, weights_only)


def check_sharded_checkpoint_io(strategy: Any) -> None:
    """Refuse a stock sharded strategy given an ``NvcompCheckpointIO``: its checkpoints would be uncompressed.

    Lightning's ``ModelParallelStrategy`` (with ``save_distributed_checkpoint=True``) and
    ``FSDPStrategy`` (with ``state_dict_type="sharded"``) never call the ``CheckpointIO`` for
    their sharded saves. Ours with sharded saves: refuse the plugin options they cannot honour.

    Raises:
        CheckpointError: naming the strategy to use instead, or the plugin option to drop.
    """
    if isinstance(strategy, NvcompModelParallelStrategy):
        if strategy._save_distributed_checkpoint:
            _check_plugin_options(strategy)
        return
    if isinstance(strategy, NvcompFSDPStrategy):
        if strategy._state_dict_type == "sharded":
            _check_plugin_options(strategy)
        return
    io = getattr(strategy, "_checkpoint_io", None)
    for _ in range(8):
        if io is None or type(io).__name__ == "NvcompCheckpointIO":
            break
        io = getattr(io, "checkpoint_io", None)
    if io is None:
        return
    if isinstance(strategy, ModelParallelStrategy) and strategy._save_distributed_checkpoint:
        replacement = "NvcompModelParallelStrategy"
    elif isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "sharded":
        replacement = "NvcompFSDPStrategy"
    else:
        return
    raise CheckpointError(
        f"NvcompCheckpointIO was given to Lightning's {type(strategy).__name__}, which saves sharded checkpoints "
        "with torch.distributed.checkpoint and never calls the CheckpointIO: they would be written uncompressed. "
        f"Use strategy=nvcomp_checkpoint.lightning.{replacement}(...) with the same arguments (it takes the "
        "plugin's policy), or drop the plugin."
    )
