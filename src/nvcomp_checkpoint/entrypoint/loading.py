"""How the integrations load: ``torch.load``'s ``weights_only`` rules, and a collective load (``leader_load``)
whose checks every rank agrees on before it.

:func:`failed_on_any_rank` is the load-side twin of :func:`~.commit.commit_on_every_rank`: one agreement of
every rank's outcome (:func:`~.commit.gather_outcomes`), and a failure on any rank raised on every rank."""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from ..api import is_nvcomp_checkpoint, load
from ..broadcast import load_broadcast
from ..errors import CheckpointError, UnsafeCheckpointError
from .commit import gather_outcomes

__all__ = [
    "torch_weights_only",
    "load_as_torch",
    "load_tree",
    "leader_load_applies",
    "checked_on_every_rank",
    "failed_on_any_rank",
]

_T = TypeVar("_T")

_TRUE = ("1", "y", "yes", "true")
_TORCH_WEIGHTS_ONLY_DEFAULT = torch.torch_version.TorchVersion(torch.__version__) >= "2.6"


def torch_weights_only(weights_only: bool | None) -> bool:
    """What ``torch.load(weights_only=weights_only)`` does: ``None`` is weights-only from torch 2.6 on;
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` are honoured as torch honours them."""
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
            return False
        return _TORCH_WEIGHTS_ONLY_DEFAULT
    return bool(weights_only)


def load_as_torch(
    path: Any,
    map_location: Any,
    weights_only: bool | None,
    *,
    hint: str,
    storage_options: dict[str, Any] | None = None,
    leader_load: bool = False,
    plain_map_location: Any = None,
) -> Any:
    """:func:`load_tree` with ``torch.load``'s ``weights_only`` rules (:func:`torch_weights_only`),
    as a framework's loader passes them; a file a weights-only load refuses is named in an
    ``UnsafeCheckpointError`` that ends with ``hint`` (how to pass ``weights_only=False`` there)."""
    try:
        return load_tree(
            path,
            map_location,
            weights_only=torch_weights_only(weights_only),
            storage_options=storage_options,
            leader_load=leader_load,
            plain_map_location=plain_map_location,
        )
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc}{hint}") from exc


def load_tree(
    path: Any,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    storage_options: dict[str, Any] | None = None,
    leader_load: bool = False,
    plain_map_location: Any = None,
) -> Any:
    """:func:`nvcomp_checkpoint.load`, or with ``leader_load`` where :func:`leader_load_applies`,
    :func:`nvcomp_checkpoint.load_broadcast`: a collective in which one rank per node reads ``path``
    and the node's other ranks receive the tree (on the CPU, unless ``map_location`` is a device).

    ``plain_map_location``: the ``map_location`` for a plain ``torch.save`` file when ``map_location``
    is ``None`` (a framework's own default for its plain files); the collective loads those on the CPU."""
    if leader_load and leader_load_applies():
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        return load_broadcast(path, device, weights_only=weights_only, storage_options=storage_options)
    if (
        map_location is None
        and plain_map_location is not None
        and not is_nvcomp_checkpoint(path, storage_options=storage_options)
    ):
        map_location = plain_map_location
    return load(path, map_location, weights_only=weights_only, storage_options=storage_options)


def leader_load_applies() -> bool:
    """Whether a ``leader_load`` option makes a load collective: a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checked_on_every_rank(check: Callable[[], _T], where: str, leader_load: bool) -> _T:
    """Run this rank's ``check`` before a collective load, with an outcome every rank agrees on.

    A rank's own checks (a failed background save, a file missing on its node, the choice between a
    plain and a compressed file) can differ between ranks; a rank that raises while the others
    enter a ``leader_load`` collective would leave them waiting until the backend's timeout. With
    ``leader_load`` where :func:`leader_load_applies`, this is a collective (``all_gather_object``
    on the default group, gloo or NCCL) that every rank must call: if ``check`` raised on any rank,
    every rank raises (its own error, or a ``CheckpointError`` naming the failing rank and its
    message); if the ranks' results differ, every rank raises a ``CheckpointError`` naming them.
    Otherwise it is ``check()``.

    Returns:
        ``check()``'s result (picklable, compared with ``==`` across ranks).
    """
    if not (leader_load and leader_load_applies()):
        return check()
    result, outcomes = _agreed(check, where, "failed before the collective load (leader_load), so no rank loads")
    mine = dist.get_rank()
    differ = [rank for rank, value in enumerate(outcomes) if value != result]
    if differ:
        rank = differ[0]
        raise CheckpointError(
            f"{where}: the ranks see different checkpoint files before the collective load (leader_load): rank {mine} "
            f"found {result!r}, rank {rank} found {outcomes[rank]!r}. Give every rank the same files (a shared "
            "file system) or drop leader_load."
        )
    return result


def failed_on_any_rank(action: Callable[[], _T], where: str) -> _T:
    """Run this rank's part of a load in which each rank reads its own files, and raise on every rank if it failed on any.

    A rank that finds its file damaged or of another save raises, while the others load theirs and
    return: a caller that falls back on the error (a fresh start, an older checkpoint) would then
    train the ranks from different states. Where :func:`leader_load_applies`, this is a collective
    (one ``all_gather_object`` of each rank's outcome on the default group, after ``action``) that
    every rank must call: if ``action`` raised on any rank, every rank raises (its own error, or a
    ``CheckpointError`` naming the failing rank and its message, which names the file).

    Returns:
        ``action()``'s result on this rank (not sent to the other ranks).
    """
    if not leader_load_applies():
        return action()
    box: list[_T] = []
    _agreed(lambda: box.append(action()), where, "failed to load its part of the checkpoint, so no rank goes on")
    return box[0]


def _agreed(check: Callable[[], Any], where: str, failed: str) -> tuple[Any, list[Any]]:
    """``check()`` on this rank and every rank's result (:func:`~.commit.gather_outcomes`, as the commit agrees); raises on every rank if any failed."""
    result, error, outcomes = gather_outcomes(check)
    if error is not None:
        raise error
    failures = [(rank, outcome.error) for rank, outcome in enumerate(outcomes) if not outcome.ok]
    if failures:
        rank, message = failures[0]
        raise CheckpointError(f"{where}: rank {rank} {failed}: {message}")
    return result, [outcome.value for outcome in outcomes]
