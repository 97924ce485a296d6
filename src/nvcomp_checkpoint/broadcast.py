"""Leader-load of replicated state (DDP): one rank per node reads a checkpoint, the others receive it.

Every rank of a data-parallel job resumes from the same bytes; fetching them once per node from
object storage instead of once per rank cuts the storage traffic by the ranks per node.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import errors
from .api import load
from .errors import CheckpointError

__all__ = ["load_broadcast"]

_Readers = Literal["node", "one"]


class _TreePickler(pickle.Pickler):
    """Pickles a tree with its tensors left out (named by index), each distinct tensor once."""

    def __init__(self, f: io.BytesIO) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if obj.is_quantized or obj.layout != torch.strided:
            raise CheckpointError(
                f"load_broadcast sends dense tensors only; this checkpoint holds a {obj.layout} / quantized tensor "
                "(load it with nvcomp_checkpoint.load on every rank)"
            )
        idx = self._seen.get(id(obj))
        if idx is None:
            idx = self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        is_param = isinstance(obj, torch.nn.Parameter)
        return ("tensor", idx, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), is_param, bool(obj.requires_grad))


class _TreeUnpickler(pickle.Unpickler):
    """Rebuilds the tree with a tensor from ``make(idx, dtype, shape)`` for each left-out one."""

    def __init__(self, f: io.BytesIO, make: Any) -> None:
        super().__init__(f)
        self._make = make
        self._made: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        _, idx, dtype, shape, is_param, requires_grad = pid
        t = self._made.get(idx)
        if t is None:
            t = self._made[idx] = self._make(idx, getattr(torch, dtype), shape)
            if is_param:
                t = self._made[idx] = torch.nn.Parameter(t, requires_grad=requires_grad)
        return t


def _split(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    buf = io.BytesIO()
    p = _TreePickler(buf)
    p.dump(tree)
    return buf.getvalue(), p.tensors


def _moved(tree: Any, device: torch.device) -> Any:
    skeleton, tensors = _split(tree)
    return _TreeUnpickler(io.BytesIO(skeleton), lambda idx, dtype, shape: tensors[idx].to(device)).load()


def _target_device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise CheckpointError(
        f"load_broadcast takes a device (or None) for map_location, not {type(map_location).__name__}; "
        "move the tensors after loading"
    )


def _readers_of(group: Any, rank: int, world: int, readers: _Readers, node: str | None) -> list[int]:
    """The group ranks that share this rank's reader, the reader first."""
    if readers == "one":
        return list(range(world))
    if readers != "node":
        raise ValueError(f"readers must be 'node' or 'one', not {readers!r}")
    names: list[Any] = [None] * world
    dist.all_gather_object(names, node if node is not None else socket.gethostname(), group=group)
    return [r for r in range(world) if names[r] == names[rank]]


def load_broadcast(
    path: str | os.PathLike[str],
    map_location: str | torch.device | None = None,
    *,
    group: Any = None,
    readers: _Readers = "node",
    node: str | None = None,
    weights_only: bool = True,
    storage_options: dict[str, Any] | None = None,
    max_bytes: int | None = None,
) -> Any:
    """Load a checkpoint on every rank of ``group`` while reading it from storage once per node.

    For replicated state (DDP, or any tree every rank holds whole): the lowest rank of each node
    loads ``path`` with :func:`nvcomp_checkpoint.load` (checksums checked) and broadcasts the tree
    to the other ranks of its node over the process group; every rank returns a bit-identical
    tree. Call it on every rank of ``group`` (a collective). Without an initialized process group
    (or in a group of one) it is :func:`nvcomp_checkpoint.load`.

    Args:
        path: Local path or fsspec URL of a checkpoint saved by :func:`nvcomp_checkpoint.save`
            (or a plain ``torch.save`` file).
        map_location: ``None`` (every tensor on the CPU, where the reader loads it) or one
            device every tensor goes to once received.
        group: The process group (default: the whole job). On NCCL, tensors cross on this rank's
            current CUDA device.
        readers: ``"node"``: one reader per node (ranks are grouped by ``node``); ``"one"``: the
            group's first rank reads and sends to every other rank.
        node: This rank's node name (default: the host name). Ranks with equal names share a reader.
        weights_only, storage_options, max_bytes: As for :func:`nvcomp_checkpoint.load`, applied
            by the reading rank.

    Returns:
        The checkpoint's tree. Tensors that were views of one another arrive as separate
        tensors on the receiving ranks (the same tensor object reached twice stays one tensor).

    Raises:
        CheckpointError: on every rank, when the reader's load fails (its message, naming the
            file and the tensor); the reader raises the original error.
    """
    device = _target_device(map_location)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return load(path, map_location, weights_only=weights_only, storage_options=storage_options, max_bytes=max_bytes)
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    members = _readers_of(group, rank, world, readers, node)
    if len(members) == 1:
        return load(path, map_location, weights_only=weights_only, storage_options=storage_options, max_bytes=max_bytes)
    global_members = [dist.get_global_rank(group, r) for r in members]
    sub = group if len(members) == world else _node_group(global_members)
    src = global_members[0]
    comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(sub) == "nccl" else torch.device("cpu")
    if rank == members[0]:
        return _send(path, src, sub, comm, device, weights_only, storage_options, max_bytes)
    return _receive(path, src, sub, comm, device)


#: Node subgroups by (default process group, member ranks), kept for the life of the job.
_NODE_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _node_group(global_members: list[int]) -> Any:
    """The process group of one node's ranks, created by its members only (the other ranks need
    not take part), once: a group of the same ranks made again would be named as the first (the
    name is a hash of the ranks) and find that group's stale addresses in the store."""
    key = (id(dist.group.WORLD), tuple(global_members))
    sub = _NODE_GROUPS.get(key)
    if sub is not None:
        try:
            if dist.get_process_group_ranks(sub) == global_members:
                return sub
        except (ValueError, KeyError, RuntimeError):
            pass  # destroyed with its job (a new one was started in this process since)
    sub = _NODE_GROUPS[key] = dist.new_group(global_members, use_local_synchronization=True)
    return sub


def _broadcast_bytes(data: bytes | None, src: int, group: Any, comm: torch.device) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=comm)
    dist.broadcast(size, src=src, group=group)
    if data is not None:
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(comm)
            if data
            else torch.empty(0, dtype=torch.uint8, device=comm)
        )
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=comm)
    dist.broadcast(buf, src=src, group=group)
    return data if data is not None else buf.cpu().numpy().tobytes()


def _send(
    path: Any,
    src: int,
    group: Any,
    comm: torch.device,
    device: torch.device | None,
    weights_only: bool,
    storage_options: Any,
    max_bytes: Any,
) -> Any:
    try:
        tree = load(path, "cpu", weights_only=weights_only, storage_options=storage_options, max_bytes=max_bytes)
        skeleton, tensors = _split(tree)
    except Exception as exc:
        # The receivers wait for a tree: they are sent the failure instead, and raise it too.
        _broadcast_bytes(pickle.dumps(("error", type(exc).__name__, str(exc))), src, group, comm)
        raise
    _broadcast_bytes(pickle.dumps(("tree", skeleton)), src, group, comm)
    for t in tensors:
        if t.numel():
            dist.broadcast(t.detach().contiguous().reshape(-1).view(torch.uint8).to(comm), src=src, group=group)
    return _moved(tree, device) if device is not None else tree


def _receive(path: Any, src: int, group: Any, comm: torch.device, device: torch.device | None) -> Any:
    kind, *rest = pickle.loads(_broadcast_bytes(None, src, group, comm))
    if kind == "error":
        name, message = rest
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = CheckpointError
        raise cls(f"{message} (read by rank {src} for this rank)")
    made: dict[int, torch.Tensor] = {}

    def make(idx: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        t = made[idx] = torch.empty(shape, dtype=dtype)
        return t

    tree = _TreeUnpickler(io.BytesIO(rest[0]), make).load()
    for idx in range(len(made)):  # the sender's order: by index
        t = made[idx]
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            if comm.type == "cpu":
                dist.broadcast(flat, src=src, group=group)
            else:
                staged = torch.empty_like(flat, device=comm)
                dist.broadcast(staged, src=src, group=group)
                flat.copy_(staged)
    return _moved(tree, device) if device is not None else tree
