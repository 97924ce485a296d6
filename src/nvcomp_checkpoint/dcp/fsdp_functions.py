"""FSDP model and optimizer state (FSDP1 and FSDP2) through the DCP rank files backend, with the
signatures of Accelerate's ``fsdp_utils`` functions.

Accelerate's ``save_state`` and the HF ``Trainer`` both write FSDP state with four functions of
``accelerate.utils.fsdp_utils`` that hard-code DCP's ``FileSystemWriter``; this module has the same
four functions, writing ``SHARDED_STATE_DICT`` as DCP rank files (:mod:`~nvcomp_checkpoint.dcp.rank_files`)
and ``FULL_STATE_DICT`` through :func:`nvcomp_checkpoint.save`, and :func:`nvcomp_fsdp_functions`
puts them in place of the framework's for the length of one call. Framework-free: the plugin and
the accelerator are used by the attributes Accelerate gives them, and what only Accelerate knows (how
a model's state dict is taken, its own plain files) comes from its ``fsdp_utils`` module, passed in
as ``helpers`` (the module the swapped-out functions belong to).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Callable, Iterator

import torch

from ..api import load, save
from ..errors import CheckpointError, FormatError
from ..policy import CodecPolicy
from ..report import SaveReport
from ..storage import LOCAL
from .rank_files import BackgroundRankFiles, RankFilesOptions, agree, read_rank_files, write_rank_files

__all__ = [
    "FSDP_FUNCTION_NAMES",
    "FSDP_MODEL_NAME",
    "OPTIMIZER_NAME",
    "ReportFn",
    "AddJobFn",
    "save_fsdp_model",
    "load_fsdp_model",
    "save_fsdp_optimizer",
    "load_fsdp_optimizer",
    "nvcomp_fsdp_functions",
    "fsdp_helpers_of",
    "is_sharded",
    "check_supported",
    "check_one_committer",
]

#: Accelerate's names of the model and optimizer state (``accelerate.utils.constants``): the DCP
#: directories keep them (``pytorch_model_fsdp_0/``, ``optimizer_0/``: Accelerate and the Trainer
#: find checkpoints by them); full state dicts take ``.nvc`` in place of ``.bin``.
FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"

#: The names under which Accelerate's ``save_state``/``load_state`` and the Trainer call them.
_LOG = logging.getLogger("nvcomp_checkpoint")
FSDP_FUNCTION_NAMES = ("save_fsdp_model", "save_fsdp_optimizer", "load_fsdp_model", "load_fsdp_optimizer")
_SWAP = threading.RLock()  # held while the FSDP functions are swapped (nvcomp_fsdp_functions)
#: ``fn(name, report)``: a file or DCP directory (``name`` inside the save's folder) is durable.
ReportFn = Callable[[str, SaveReport], Any]
StreamWrapper = Callable[[IO[bytes]], IO[bytes]]
#: ``add_job(name, job)``: the committing process's save takes ``job`` (a background write returning
#: the report of DCP directory ``name``) as one of its parts.
AddJobFn = Callable[[str, Callable[[], "SaveReport | None"]], Any]


def fsdp_helpers_of(namespace: ModuleType) -> ModuleType:
    """Accelerate's ``fsdp_utils`` module, found through the FSDP function ``namespace`` calls
    (``transformers.trainer`` imported it from there), also while ours are swapped in."""
    function = getattr(namespace, "load_fsdp_model", None)
    if isinstance(function, functools.partial) and isinstance(function.keywords.get("helpers"), ModuleType):
        helpers: ModuleType = function.keywords["helpers"]
        return helpers
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    if module is None:
        raise CheckpointError(
            f"{namespace.__name__} no longer calls load_fsdp_model: this version of it saves FSDP state another way, "
            "which nvcomp-checkpoint does not know. Pin the version nvcomp-checkpoint supports "
            "(accelerate 1.x, transformers 5.x) or save without nvcomp-checkpoint."
        )
    return module


@contextlib.contextmanager
def nvcomp_fsdp_functions(
    namespace: ModuleType,
    helpers: ModuleType,
    policy: CodecPolicy | None = None,
    *,
    workers: int | None = None,
    stream_wrapper: StreamWrapper | None = None,
    on_saved: ReportFn | None = None,
    background: BackgroundRankFiles | None = None,
    add_job: AddJobFn | None = None,
) -> Iterator[None]:
    """Let ``namespace`` (``accelerate.accelerator``, ``transformers.trainer``) call this module's
    four FSDP functions in place of Accelerate's while the block runs.

    Both modules call the functions by the names they imported, so the names are what is swapped;
    the previous ones come back when the block ends, also on error. ``helpers``: Accelerate's
    ``fsdp_utils`` module (:func:`fsdp_helpers_of`). ``on_saved`` gets the report of each file or
    DCP directory saved; ``background`` and ``add_job`` write sharded state in the background (see
    :func:`save_fsdp_model`).
    """
    saving: dict[str, Any] = dict(
        policy=policy, workers=workers, stream_wrapper=stream_wrapper, on_saved=on_saved, background=background, add_job=add_job
    )
    ours: dict[str, Callable[..., Any]] = {
        "save_fsdp_model": functools.partial(save_fsdp_model, helpers=helpers, **saving),
        "save_fsdp_optimizer": functools.partial(save_fsdp_optimizer, helpers=helpers, **saving),
        "load_fsdp_model": functools.partial(load_fsdp_model, helpers=helpers),
        "load_fsdp_optimizer": functools.partial(load_fsdp_optimizer, helpers=helpers),
    }
    missing = [name for name in FSDP_FUNCTION_NAMES if not callable(getattr(namespace, name, None))]
    if missing:
        raise CheckpointError(
            f"{namespace.__name__} no longer calls {', '.join(missing)}: this version of it saves FSDP state "
            "another way, which nvcomp-checkpoint does not know. Pin the version nvcomp-checkpoint supports "
            "(accelerate 1.x, transformers 5.x) or save without nvcomp-checkpoint."
        )
    # The names are the module's, shared by every thread: one swap at a time (nested ones, in the
    # same thread, unwind in order), so a thread never puts back another thread's functions.
    with _SWAP:
        previous = {name: getattr(namespace, name) for name in FSDP_FUNCTION_NAMES}
        for name, function in ours.items():
            setattr(namespace, name, function)
        try:
            yield
        finally:
            for name, function in previous.items():
                setattr(namespace, name, function)


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
    helpers: ModuleType,
    policy: CodecPolicy | None = None,
    workers: int | None = None,
    stream_wrapper: StreamWrapper | None = None,
    on_saved: ReportFn | None = None,
    background: BackgroundRankFiles | None = None,
    add_job: AddJobFn | None = None,
) -> None:
    """``accelerate.utils.save_fsdp_model`` with compressed files (``helpers``: Accelerate's ``fsdp_utils``).

    ``SHARDED_STATE_DICT``: every rank writes its shards into ``pytorch_model_fsdp_<i>/`` through
    :class:`~nvcomp_checkpoint.dcp.NvcompWriter`. ``FULL_STATE_DICT``: the main process writes
    ``pytorch_model_fsdp.nvc`` (``_<i>`` for later models) with :func:`nvcomp_checkpoint.save`.

    ``on_saved(name, report)``, on a process that passes it, once ``name`` (the directory or file
    name in ``output_dir``) is durable: a sharded save's report sums every rank's file
    (:func:`~nvcomp_checkpoint.dcp.dcp_report`, read after DCP's ``.metadata`` commit); a full
    one's is the main process's (other processes save nothing and get no call).

    ``background`` (sharded state, ``async_save``): this rank's shards are copied to host memory and
    written in the background on ``background``'s process group, agreed on by every rank; the process
    given ``add_job(name, job)`` (the one that commits) hands the write over as ``job``, whose report
    is the directory's, the others queue it on ``background``, which raises a failure at its next wait.

    Raises:
        CheckpointError: ``LOCAL_STATE_DICT`` or ``use_dcp=False`` (per-rank ``torch.save`` files).
    """
    check_supported(fsdp_plugin, use_dcp, output_dir)
    full = _is_full(fsdp_plugin)
    if not full:
        _check_accelerator_committer(accelerator, output_dir)
    LOCAL.makedirs(os.fspath(output_dir))
    if full:
        _set_full_config(fsdp_plugin, accelerator)  # as Accelerate: offload and rank 0 only when distributed
    with _state_dict_context(fsdp_plugin, model):
        state_dict = helpers._get_model_state_dict(
            model, adapter_only=adapter_only, sd_options=helpers._prepare_sd_options(fsdp_plugin)
        )
        if full:
            if accelerator.process_index == 0:
                name = _full_name(FSDP_MODEL_NAME, model_index)
                _report(
                    on_saved,
                    name,
                    save(state_dict, Path(output_dir) / name, policy, workers=workers, stream_wrapper=stream_wrapper),
                )
        else:
            name = f"{FSDP_MODEL_NAME}_{model_index}"
            options = RankFilesOptions(policy, workers, stream_wrapper)
            _dcp_save({"model": state_dict}, Path(output_dir) / name, options, on_saved, background, add_job)


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    helpers: ModuleType,
) -> Any:
    """``accelerate.utils.load_fsdp_model`` that reads what :func:`save_fsdp_model` wrote, and plain state.

    Sharded: ``pytorch_model_fsdp_<i>/`` is read with :class:`~nvcomp_checkpoint.dcp.NvcompReader`
    (compressed or plain). Full: ``pytorch_model_fsdp.nvc``, else Accelerate's own ``.bin``.
    """
    full = _is_full(fsdp_plugin)
    compressed = Path(input_dir) / _full_name(FSDP_MODEL_NAME, model_index)
    if full and not compressed.is_file():
        _check_state_dict_type(fsdp_plugin, Path(input_dir), FSDP_MODEL_NAME, model_index)
        return helpers.load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only, use_dcp)
    check_supported(fsdp_plugin, use_dcp, input_dir)
    if not full:
        _check_state_dict_type(fsdp_plugin, Path(input_dir), FSDP_MODEL_NAME, model_index)
    accelerator.wait_for_everyone()
    if full:
        _set_full_config(fsdp_plugin, accelerator)
    sd_options = helpers._prepare_sd_options(fsdp_plugin)
    with _state_dict_context(fsdp_plugin, model):
        if full:
            fsdp1 = int(fsdp_plugin.fsdp_version) == 1
            if fsdp1 and accelerator.process_index != 0 and not _is_fsdp1_module(model):
                # Accelerate's rule: an unwrapped FSDP1 model is loaded on rank 0 and synced from it.
                if not fsdp_plugin.sync_module_states:
                    raise ValueError(
                        "Set the `sync_module_states` flag to `True` so that model states are synced across processes "
                        "when initializing FSDP object"
                    )
                return None
            # FSDP2 broadcasts from rank 0: the others pass an empty state dict.
            state_dict = load(compressed) if fsdp1 or accelerator.is_main_process else {}
        else:
            state_dict = {"model": helpers._get_model_state_dict(model, adapter_only=adapter_only, sd_options=sd_options)}
            _dcp_load(state_dict, Path(input_dir) / f"{FSDP_MODEL_NAME}_{model_index}")
            state_dict = state_dict["model"]
        result = helpers._set_model_state_dict(model, state_dict, adapter_only=adapter_only, sd_options=sd_options)
    accelerator.wait_for_everyone()
    return result


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    use_dcp: bool = True,
    *,
    helpers: ModuleType,
    policy: CodecPolicy | None = None,
    workers: int | None = None,
    stream_wrapper: StreamWrapper | None = None,
    on_saved: ReportFn | None = None,
    background: BackgroundRankFiles | None = None,
    add_job: AddJobFn | None = None,
) -> None:
    """``accelerate.utils.save_fsdp_optimizer`` with compressed files: ``optimizer_<i>/`` (sharded)
    or ``optimizer.nvc`` (full, written by the main process); ``on_saved`` as for :func:`save_fsdp_model`."""
    check_supported(fsdp_plugin, use_dcp, output_dir)
    if not _is_full(fsdp_plugin):
        _check_accelerator_committer(accelerator, output_dir)
    LOCAL.makedirs(os.fspath(output_dir))
    with _state_dict_context(fsdp_plugin, model):
        state = _optimizer_state(fsdp_plugin, model, optimizer, helpers)
        if _is_full(fsdp_plugin):
            if accelerator.process_index == 0:
                name = _full_name(OPTIMIZER_NAME, optimizer_index)
                _report(
                    on_saved, name, save(state, Path(output_dir) / name, policy, workers=workers, stream_wrapper=stream_wrapper)
                )
        else:
            directory = Path(output_dir) / f"{OPTIMIZER_NAME}_{optimizer_index}"
            options = RankFilesOptions(policy, workers, stream_wrapper)
            _dcp_save({"optimizer": state}, directory, options, on_saved, background, add_job)


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    helpers: ModuleType,
) -> None:
    """``accelerate.utils.load_fsdp_optimizer`` that reads what :func:`save_fsdp_optimizer` wrote, and plain state."""
    full = _is_full(fsdp_plugin)
    compressed = Path(input_dir) / _full_name(OPTIMIZER_NAME, optimizer_index)
    if full and not compressed.is_file():
        _check_state_dict_type(fsdp_plugin, Path(input_dir), OPTIMIZER_NAME, optimizer_index)
        return helpers.load_fsdp_optimizer(
            fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index, adapter_only, use_dcp
        )
    check_supported(fsdp_plugin, use_dcp, input_dir)
    if not full:
        _check_state_dict_type(fsdp_plugin, Path(input_dir), OPTIMIZER_NAME, optimizer_index)
    accelerator.wait_for_everyone()
    sd_options = helpers._prepare_sd_options(fsdp_plugin)
    with _state_dict_context(fsdp_plugin, model):
        if full:
            # None on the ranks that receive the state from rank 0 (rank0_only), as Accelerate passes it.
            state: Any = None
            if accelerator.process_index == 0 or not fsdp_plugin.optim_state_dict_config.rank0_only:
                state = load(compressed)
        else:
            holder = {"optimizer": _optimizer_state(fsdp_plugin, model, optimizer, helpers)}
            _dcp_load(holder, Path(input_dir) / f"{OPTIMIZER_NAME}_{optimizer_index}")
            state = holder["optimizer"]
        if int(fsdp_plugin.fsdp_version) == 1:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=state))
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, state, options=sd_options)
    accelerator.wait_for_everyone()


# -- helpers ------------------------------------------------------------------------------------


def _type_name(fsdp_plugin: Any) -> str:
    kind = fsdp_plugin.state_dict_type
    return str(getattr(kind, "name", kind)).rsplit(".", 1)[-1]


def _is_full(fsdp_plugin: Any) -> bool:
    return _type_name(fsdp_plugin) == "FULL_STATE_DICT"


def is_sharded(fsdp_plugin: Any) -> bool:
    """Whether ``fsdp_plugin`` saves ``SHARDED_STATE_DICT`` (every rank writes its part of one DCP directory)."""
    return _type_name(fsdp_plugin) == "SHARDED_STATE_DICT"


def _full_name(stem: str, index: int) -> str:
    return f"{stem}.nvc" if index == 0 else f"{stem}_{index}.nvc"


def check_supported(fsdp_plugin: Any, use_dcp: bool, where: str | os.PathLike[str]) -> None:
    kind = _type_name(fsdp_plugin)
    if kind not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise CheckpointError(
            f"{where}: FSDP state_dict_type {kind} writes one torch.save file per rank, which nvcomp-checkpoint "
            "does not compress. Set fsdp_state_dict_type to SHARDED_STATE_DICT (compressed through "
            "torch.distributed.checkpoint) or FULL_STATE_DICT, or save without nvcomp-checkpoint's hooks."
        )
    if not use_dcp and kind == "SHARDED_STATE_DICT":
        raise CheckpointError(
            f"{where}: use_dcp=False writes one torch.save file per rank, which nvcomp-checkpoint does not "
            "compress. Leave use_dcp=True (the default), or save without nvcomp-checkpoint's hooks."
        )


def check_one_committer(save_on_each_node: bool, num_processes: int, where: str | os.PathLike[str], setting: str) -> None:
    """Sharded state needs one committing process: refuse ``save_on_each_node`` on several nodes.

    Every rank writes its shards into one directory, which DCP's coordinator commits; with
    ``save_on_each_node`` each node's main process would also stage, commit and copy to the tiers
    that same directory (on shared storage, racing the others; on node-local disks, each node's
    folder would hold only its own ranks' shards). The nodes are counted from ``LOCAL_WORLD_SIZE``
    (set by ``torchrun`` and ``accelerate launch``); without it the job is taken for one node.

    Raises:
        CheckpointError: ``save_on_each_node`` on more than one node, naming ``setting`` to change.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes) or num_processes)
    if save_on_each_node and num_processes > local:
        raise CheckpointError(
            f"{where}: save_on_each_node=True with FSDP SHARDED_STATE_DICT on {-(-num_processes // local)} nodes: every rank "
            "writes its shards into one checkpoint directory, on storage all nodes share, committed (and copied to the "
            f"tiers) by one process; each node's main process would commit it too. Set {setting} to False."
        )


def _check_accelerator_committer(accelerator: Any, where: str | os.PathLike[str]) -> None:
    config = getattr(accelerator, "project_configuration", None)
    check_one_committer(
        bool(getattr(config, "save_on_each_node", False)),
        accelerator.num_processes,
        where,
        "ProjectConfiguration(save_on_each_node=...)",
    )


def _check_state_dict_type(fsdp_plugin: Any, directory: Path, stem: str, index: int) -> None:
    """A directory saved with the other state dict type: say so, instead of 'No such file'."""
    sharded = directory / f"{stem}_{index}"
    full = [directory / _full_name(stem, index), directory / (_full_name(stem, index)[: -len(".nvc")] + ".bin")]
    if _is_full(fsdp_plugin) and not any(p.is_file() for p in full) and sharded.is_dir():
        raise FormatError(
            f"{directory}: holds {sharded.name}/, sharded state (SHARDED_STATE_DICT), but this run's FSDP plugin "
            "loads FULL_STATE_DICT. Set fsdp_state_dict_type to SHARDED_STATE_DICT to load it."
        )
    if not _is_full(fsdp_plugin) and not sharded.is_dir() and any(p.is_file() for p in full):
        raise FormatError(
            f"{directory}: holds {next(p.name for p in full if p.is_file())}, a full state dict (FULL_STATE_DICT), "
            "but this run's FSDP plugin loads SHARDED_STATE_DICT. Set fsdp_state_dict_type to FULL_STATE_DICT to load it."
        )


def _set_full_config(fsdp_plugin: Any, accelerator: Any) -> None:
    # FSDP raises with offload_to_cpu on a single GPU; Accelerate enables both only when distributed.
    multi = accelerator.num_processes > 1
    fsdp_plugin.state_dict_config.offload_to_cpu = multi
    fsdp_plugin.state_dict_config.rank0_only = multi


def _state_dict_context(fsdp_plugin: Any, model: torch.nn.Module) -> Any:
    if int(fsdp_plugin.fsdp_version) != 1:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        model, fsdp_plugin.state_dict_type, fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config
    )


def _is_fsdp1_module(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return type(model) is FSDP


def _optimizer_state(fsdp_plugin: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, helpers: ModuleType) -> Any:
    if int(fsdp_plugin.fsdp_version) == 2:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=helpers._prepare_sd_options(fsdp_plugin))
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.optim_state_dict(model, optimizer)


def _report(on_saved: ReportFn | None, name: str, report: SaveReport | None) -> None:
    # The state is committed: a failing report callback is logged, never a failed save (the other
    # ranks are already on their way to the next collective).
    if on_saved is None or report is None:
        return
    try:
        on_saved(name, report)
    except Exception as exc:  # noqa: BLE001
        _LOG.warning("%s: committed, but its save report could not be recorded (%s: %s)", report.path, type(exc).__name__, exc)


def _dcp_save(
    state: dict[str, Any],
    directory: Path,
    options: RankFilesOptions,
    on_saved: ReportFn | None,
    background: BackgroundRankFiles | None = None,
    add_job: AddJobFn | None = None,
) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ..entrypoint.reports import checkpoint_report

    LOCAL.makedirs(os.fspath(directory))
    started = time.perf_counter()
    if background is None:
        write_rank_files(state, directory, options, planner=DefaultSavePlanner())
        if on_saved is not None:
            # dcp.save returns on every rank once the coordinator has committed .metadata, which it
            # does after every rank's file is durable: the directory is whole here.
            _report(on_saved, directory.name, checkpoint_report(directory, time.perf_counter() - started, dcp_dirs=[directory]))
        return
    group = background.process_group()  # every rank, at the same point: a collective the first time
    writer = options.writer(directory)
    where = f"{directory}: FSDP state saved in the background"
    staged, error = None, None
    try:
        staged = writer.stage(state)
    except BaseException as exc:  # noqa: BLE001 - no rank may go on to the background collectives alone
        error = exc
    agree(error, where)
    assert staged is not None  # else agree raised
    blocked = time.perf_counter() - started

    def job() -> SaveReport | None:
        failed: BaseException | None = None
        try:
            write_rank_files(staged, directory, options, process_group=group, planner=DefaultSavePlanner(), writer=writer)
        except BaseException as exc:  # noqa: BLE001 - DCP raised it on every rank; agreed on all the same
            failed = exc
        agree(failed, where, group)
        return checkpoint_report(directory, time.perf_counter() - started, dcp_dirs=[directory], seconds_blocked=blocked)

    if add_job is not None:
        add_job(directory.name, job)
    else:
        background.submit(job, os.fspath(directory))


def _dcp_load(state: dict[str, Any], directory: Path) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    read_rank_files(state, directory, planner=DefaultLoadPlanner())
