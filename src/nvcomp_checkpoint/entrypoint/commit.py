"""How a checkpoint that several ranks write becomes visible, and its load-side twin: one agreement of every rank.

:func:`commit_on_every_rank` is the one collective commit: every rank's parts durable, one agreement,
the coordinator finalizes, every rank waits for it. :func:`gather_outcomes` is the agreement itself,
which the collective loads of :mod:`.loading` (``failed_on_any_rank``, ``checked_on_every_rank``) use too,
so a failure on any rank is raised on every rank, at save and at load, with one message form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointWriteError

__all__ = [
    "FileRecords",
    "RankOutcome",
    "distributed",
    "this_rank",
    "gather_outcomes",
    "commit_on_every_rank",
    "true_on_every_rank",
]

_T = TypeVar("_T")

#: A rank's files of one checkpoint: name in the checkpoint -> record (size and digest, see ``filedigest.file_record``).
FileRecords = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank's part of a collective step came to, as every rank receives it.

    Attributes:
        ok: The part succeeded.
        value: Its result, where the caller shares it (``None`` otherwise, and when the part failed).
        error: ``"ExceptionType: message"`` of the failure (the message names the file), ``None`` when ``ok``.
    """

    ok: bool
    value: Any = None
    error: str | None = None


def distributed() -> bool:
    """Whether a default process group exists: the collective steps below are collectives only then."""
    return dist.is_available() and dist.is_initialized()


def this_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if distributed() else 0


def gather_outcomes(
    action: Callable[[], _T], *, share: bool = True, process_group: Any = None
) -> tuple[_T | None, Exception | None, list[RankOutcome]]:
    """Run this rank's ``action`` and learn every rank's outcome: one ``all_gather_object`` on the default group
    (or on ``process_group``, spanning every rank: a background save's own, see :mod:`nvcomp_checkpoint.dcp.rank_files`).

    Collective where :func:`distributed` (every rank must call it); otherwise this rank's outcome alone.
    An ``Exception`` of ``action`` is caught (every rank must learn of it before going on) and returned;
    anything else (``KeyboardInterrupt``) goes through.

    Args:
        action: This rank's part.
        share: Send ``action()``'s result to every rank (it must be picklable); otherwise only whether it raised.

    Returns:
        ``(result, error, outcomes)``: this rank's result and exception (one of them ``None``), and every
        rank's :class:`RankOutcome`, indexed by rank.
    """
    result: _T | None = None
    error: Exception | None = None
    try:
        result = action()
    except Exception as exc:  # noqa: BLE001 - returned, and raised by the caller once every rank knows
        error = exc
    mine = (
        RankOutcome(True, result if share else None)
        if error is None
        else RankOutcome(False, None, f"{type(error).__name__}: {error}")
    )
    if not distributed():
        return result, error, [mine]
    outcomes: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(outcomes, mine, group=process_group)
    return result, error, outcomes


def commit_on_every_rank(
    where: str,
    durable: Callable[[], Mapping[str, Mapping[str, Any]]],
    finalize: Callable[[FileRecords, int], None],
    *,
    coordinator: int = 0,
    process_group: Any = None,
) -> FileRecords:
    """Commit a checkpoint whose parts every rank writes: visible on every rank, or raised on every rank.

    The protocol, collective where :func:`distributed` (every rank calls it, in the same order of
    commits); without a process group, the same steps on one rank:

    1. **Every rank's parts durable**: ``durable()`` waits for this rank's files and returns their
       :data:`FileRecords` (name -> size and digest, taken by the rank that wrote them: the coordinator
       may not see another node's files), or raises, naming the file.
    2. **One agreement**: every rank's outcome, one ``all_gather_object`` (:func:`gather_outcomes`).
       If any rank failed, every rank raises :class:`CheckpointWriteError`, naming the failing rank and its
       error (a rank's own error is chained); nothing is finalized. Two ranks recording one name with
       different records are refused the same way.
    3. **The coordinator finalizes**: ``finalize(records, world_size)`` on rank ``coordinator`` with every
       rank's records, in the order a kill cannot break: the manifest first, then the pointer that makes
       the checkpoint visible (``latest``, a ``meta`` file) written last, each atomically.
    4. **A barrier that carries the outcome**: the coordinator broadcasts whether ``finalize`` succeeded;
       no rank returns before the pointer is written, and a failed finalize raises on every rank.

    Used by the DeepSpeed backend (:mod:`.deepspeed_engine`: a tag's manifest, then ``latest``); a backend
    of DCP rank files commits the same way (its ``.metadata`` or manifest as the pointer).

    Args:
        where: The checkpoint, as the errors name it (its folder, and tag).
        durable: This rank's step 1.
        finalize: The coordinator's step 3.
        coordinator: The rank that finalizes.
        process_group: The group of the agreement and the barrier, spanning every rank (default: the
            default group); a commit made in the background uses one of its own, so that its collectives
            never meet the training's.

    Returns:
        Every rank's file records, merged (the same on every rank).

    Raises:
        CheckpointWriteError: On every rank, when a rank's parts failed or the finalize did.
    """
    _, error, outcomes = gather_outcomes(
        lambda: {name: dict(record) for name, record in durable().items()}, process_group=process_group
    )
    failed = [(rank, outcome.error) for rank, outcome in enumerate(outcomes) if not outcome.ok]
    if error is not None:
        raise CheckpointWriteError(
            f"{where}: rank {this_rank()} failed to write its files ({type(error).__name__}: {error}); not committed on any rank"
        ) from error
    if failed:
        rank, message = failed[0]
        raise CheckpointWriteError(f"{where}: rank {rank} failed to write its files ({message}); not committed on any rank")
    records: FileRecords = {}
    owner: dict[str, int] = {}
    for rank, outcome in enumerate(outcomes):
        for name, record in outcome.value.items():
            if name in records and records[name] != record:
                raise CheckpointWriteError(
                    f"{where}: ranks {owner[name]} and {rank} both wrote {name} with different contents; not committed on any rank"
                )
            records[name], owner[name] = record, rank
    finalize_error: Exception | None = None
    if this_rank() == coordinator:
        try:
            finalize(records, len(outcomes))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before going on
            finalize_error = exc
    told = [None if finalize_error is None else f"{type(finalize_error).__name__}: {finalize_error}"]
    if distributed():
        dist.broadcast_object_list(told, src=coordinator, group=process_group)
    if finalize_error is not None:
        raise CheckpointWriteError(f"{where}: finalizing the commit failed ({told[0]}); not committed") from finalize_error
    if told[0] is not None:
        raise CheckpointWriteError(f"{where}: rank {coordinator} failed to finalize the commit ({told[0]}); not committed")
    return records


def true_on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on every rank: collective where :func:`distributed`, cheap enough for every step.

    One integer ``all_reduce`` on a device the group's backend takes (NCCL: the current CUDA device;
    gloo or MPI: the CPU); any other backend gets an ``all_gather_object``.
    """
    if not distributed():
        return flag
    backend = str(dist.get_backend())
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    elif backend in ("gloo", "mpi") or "cpu:" in backend:  # "cpu:gloo,cuda:nccl": the CPU has its own
        device = torch.device("cpu")
    else:
        _, _, outcomes = gather_outcomes(lambda: flag)
        return all(outcome.value for outcome in outcomes)
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())
