"""``NvcompWriter``: a torch.distributed.checkpoint ``StorageWriter`` that compresses each rank's shards.

Each rank writes one nvcomp-checkpoint file (byte planes, per-component codecs, xxh3 on every
frame); the coordinator writes ``.metadata`` last, atomically: that rename is the commit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import io
import os
import uuid
from typing import IO, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import xxhash
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..credentials import StorageOptions
from ..errors import CheckpointError, FormatError
from ..policy import CodecPolicy, CodecSpec, Component, classify
from ..storage import storage_for, write_errors
from ..writer import CheckpointWriter
from .layout import METADATA_NAME, SAVE_TAG, WORLD_SIZE_TAG, StoredItem, join, rank_metadata_name, shard_name
from .metadata_file import encode_metadata
from .reader import read_stored_metadata

__all__ = ["NvcompWriter", "FqnPolicy", "fqn_component", "bytes_key", "unique_key"]

#: The version ``FileSystemWriter`` records (torch.distributed.checkpoint.filesystem).
DCP_VERSION = "1.0.0"
#: Keys of byte entries in a rank file start with this (never a tensor FQN: DCP names are dotted).
_BYTES_PREFIX = "bytes:"


def fqn_component(fqn: str) -> Component:
    """The component of a DCP fully qualified name (``optim.state.layer.weight.exp_avg``).

    DCP flattens the state tree into dotted names; split back into a path, they classify as the
    nested tree does (``model.layer.weight`` -> weights, ``...exp_avg_sq`` -> exp_avg_sq).
    """
    return classify(tuple(fqn.split(".")))


@dataclasses.dataclass(frozen=True)
class FqnPolicy(CodecPolicy):
    """A :class:`CodecPolicy` that classifies DCP names: user patterns first (matched against the
    dotted name), then :func:`fqn_component`; byte entries (pickled objects) are ``other``."""

    def component_of(self, key: str, path: Sequence[Any]) -> Component:
        for pattern, comp in self.patterns.items():
            if fnmatch.fnmatchcase(key, pattern):
                return comp
        if key.startswith(_BYTES_PREFIX):
            return Component.OTHER
        return fqn_component(key.split("@", 1)[0])

    @classmethod
    def of(cls, policy: CodecPolicy | Mapping[str, Any] | str | CodecSpec | None, where: str = "policy") -> "FqnPolicy":
        """Any ``policy=`` form (:meth:`CodecPolicy.of`), classifying DCP names."""
        policy = CodecPolicy.of(policy, where)
        if isinstance(policy, FqnPolicy):
            return policy
        return cls(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(CodecPolicy)})


def bytes_key(fqn: str) -> str:
    """The key of a non-tensor (pickled) item in a rank file."""
    return _BYTES_PREFIX + fqn


def unique_key(base: str, offsets: tuple[Any, ...], used: set[str]) -> str:
    """``base``, or ``base@<offsets>`` when a rank holds several chunks of one tensor (``#2`` ...
    appended if that is taken too); added to ``used``."""
    key = base
    if key in used:
        tail = ",".join(str(o) for o in offsets)
        key = f"{base}@{tail}"
        n = 1
        while key in used:
            n += 1
            key = f"{base}@{tail}#{n}"
    used.add(key)
    return key


def _item_key(item: WriteItem, used: set[str]) -> str:
    """The key of a write item in its rank file: its FQN (see :func:`unique_key`)."""
    if item.type == WriteItemType.BYTE_IO:
        return unique_key(bytes_key(item.index.fqn), (item.index.index,), used)
    offsets = tuple(int(o) for o in item.tensor_data.chunk.offsets) if item.tensor_data is not None else (item.index.index,)
    return unique_key(item.index.fqn, offsets, used)


def _device_copy(obj: Any, on_device: Callable[[torch.Tensor], bool]) -> Any:
    """A copy of a state tree for ``staging="device"``: every tensor cloned where ``on_device`` says
    so (on its own device), else copied to the host; DTensors and ShardedTensors keep their layout;
    other values are deep-copied (as DCP's own stager does)."""

    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if on_device(t) else t.detach().to("cpu", copy=True)

    if isinstance(obj, DTensor):
        # Built from its spec, as DCP's own transports do: DTensor.from_local would move a host copy
        # back to the mesh's device (and on the current GPU).
        return DTensor(clone(obj.to_local()), obj._spec, requires_grad=False)
    if isinstance(obj, ShardedTensor):
        shards = obj.local_shards()
        if shards and all([on_device(shard.tensor) for shard in shards]):
            # Same devices: the shards' and the tensor's metadata stay as they are (as ShardedTensor.to builds it).
            cloned = [Shard(shard.tensor.detach().clone(), copy.deepcopy(shard.metadata)) for shard in shards]
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                cloned,
                sharded_tensor_metadata=copy.deepcopy(obj.metadata()),
                process_group=obj._process_group,
                init_rrefs=obj._init_rrefs,
            )
        return copy.deepcopy(obj) if all(shard.tensor.device.type == "cpu" for shard in shards) else obj.to(device="cpu")
    if isinstance(obj, torch.Tensor):
        return clone(obj)
    if isinstance(obj, dict):
        return {k: _device_copy(v, on_device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_device_copy(v, on_device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_device_copy(v, on_device) for v in obj)
    if obj is None or isinstance(obj, (int, float, str, bytes, bool)):
        return obj
    return copy.deepcopy(obj)


#: FileSystemWriter's options that mean nothing for a compressed writer, and why.
_REFUSED_OPTIONS = {
    "per_thread_copy_ahead": "FileSystemWriter's read-ahead of its copy threads; NvcompWriter compresses chunk by chunk "
    "with a bounded window (workers= sets the threads)",
    "_extensions": "a stream transform of FileSystemWriter (its ZStandard extension); NvcompWriter compresses with its "
    "policy= instead",
    "serialization_format": "FileSystemWriter's on-disk format; NvcompWriter writes its own (docs/format.md)",
}


class NvcompWriter(StorageWriter, BlockingAsyncStager):
    """Writes a DCP checkpoint directory whose rank files are compressed by nvcomp-checkpoint.

    Use it wherever DCP takes a ``storage_writer``:
    ``dcp.save(state_dict, storage_writer=NvcompWriter(path))``, ``dcp.async_save(...)``. Read it
    back with :class:`~nvcomp_checkpoint.dcp.NvcompReader`.

    Args:
        path: The checkpoint directory (local path or fsspec URL); created if missing. May be
            left out when ``dcp.save(..., checkpoint_id=path)`` gives it.
        policy: Codec settings per component; DCP names such as ``optim.state.layer.weight.exp_avg``
            are classified as ``exp_avg``; ``patterns`` and ``overrides`` globs match dotted names.
        workers: Compression threads per rank (default: every core, at most 16).
        storage_options: Passed to fsspec for URLs.
        cache_staged_state_dict: As for ``FileSystemWriter``: keep the pinned staging copy
            between ``dcp.async_save`` calls.
        stream_wrapper: Wraps each rank file's output stream (benchmarks throttle or count bytes
            with it); its ``write`` must pass every byte on, in order.
        world_size: Only for ``dcp.save(..., use_collectives=False)`` with a ``process_group``
            other than the default one: the number of ranks saving (recorded in each rank's
            metadata, so a reader can tell a whole checkpoint). Default: the default group's size.
        save_tag: Only for ``dcp.save(..., use_collectives=False)``: a name every rank of one save
            passes (the step, say), recorded in each rank's metadata; a directory whose ranks'
            tags differ (the parts of two saves) is refused when loaded.
        staging: How ``dcp.async_save`` copies the state before it returns to training.
            ``"host"`` (default, as ``FileSystemWriter``): every tensor to host memory, and the
            background save compresses on the CPU. ``"device"``: each tensor is cloned on its own
            device (a GPU-to-GPU copy, far faster than one to the host), and the background save
            compresses CUDA shards on their GPU with nvCOMP, so only compressed bytes cross to
            the host. It needs free GPU memory for the clones: tensors beyond
            ``device_budget_bytes`` per GPU (default: half its free memory) are copied to the
            host instead.
        device_budget_bytes: GPU memory per device that ``staging="device"`` may use for the
            clones. The background compression needs GPU memory of its own on top (nvCOMP's
            output and scratch buffers, bounded by the core's ``gpu_chunk_bytes`` batches).
        thread_count, single_file_per_rank, sync_files, overwrite: ``FileSystemWriter``'s options,
            so that this writer takes the same call: ``thread_count`` is ``workers``; the others
            are what this writer always does (one file per rank, fsynced, replacing the checkpoint
            at ``path``), and the opposite values are refused. ``per_thread_copy_ahead``,
            ``_extensions`` and ``serialization_format`` are refused with the reason.

    Every rank file and ``.metadata`` are fsynced before they are renamed into place.

    With ``dcp.save(..., use_collectives=False)`` there is no coordinator: each rank writes its
    rank file, then its own ``__<rank>.metadata`` (atomically); the checkpoint is committed once
    every rank's metadata is in place, which :class:`~nvcomp_checkpoint.dcp.NvcompReader` checks.
    Such a save needs a directory holding no checkpoint (each rank would replace only its own part).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        policy: CodecPolicy | None = None,
        *,
        workers: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_staged_state_dict: bool = False,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        world_size: int | None = None,
        save_tag: str | None = None,
        staging: str = "host",
        device_budget_bytes: int | None = None,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        overwrite: bool = True,
        **filesystem_writer_options: Any,
    ) -> None:
        # FileSystemWriter's options, so that a writer swapped in for it takes the same call: the
        # ones that mean something here are honoured, the others refused by name (docs/dcp.md).
        if filesystem_writer_options:
            name = sorted(filesystem_writer_options)[0]
            why = _REFUSED_OPTIONS.get(name, "it is not an option of NvcompWriter or FileSystemWriter")
            raise TypeError(f"NvcompWriter({name}=...): {why}")
        if not single_file_per_rank:
            raise ValueError("NvcompWriter(single_file_per_rank=False): each rank writes one compressed file; leave it True")
        if not sync_files:
            raise ValueError("NvcompWriter(sync_files=False): every file is fsynced before the save commits; leave it True")
        if not overwrite:
            raise ValueError(
                "NvcompWriter(overwrite=False): a save replaces the checkpoint at its path as a whole; check the path "
                "first (nvcomp_checkpoint.dcp.read_stored_metadata) to keep one"
            )
        if thread_count is not None:
            if workers is not None and workers != thread_count:
                raise ValueError(f"NvcompWriter(workers={workers}, thread_count={thread_count}): give one of them")
            if not isinstance(thread_count, int) or thread_count < 1:
                raise ValueError(f"NvcompWriter(thread_count={thread_count!r}): a positive number of compression threads")
            workers = thread_count
        if staging not in ("host", "device"):
            raise ValueError(f"NvcompWriter(staging={staging!r}): choose 'host' or 'device'")
        if staging == "device" and cache_staged_state_dict:
            raise ValueError(
                "NvcompWriter(staging='device', cache_staged_state_dict=True): the cache is a pinned host copy; "
                "device staging clones on the GPU for each save. Pass one of them."
            )
        if device_budget_bytes is not None and device_budget_bytes < 0:
            raise ValueError(f"NvcompWriter(device_budget_bytes={device_budget_bytes}): must be >= 0")
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path = os.fspath(path) if path is not None else ""
        self.policy = FqnPolicy.of(policy, "NvcompWriter(policy=...)")
        self.workers = workers
        self.storage_options = StorageOptions.of(storage_options)  # credentials out of every repr
        self.stream_wrapper = stream_wrapper
        self.save_id = uuid.uuid4().hex[:12]
        self.is_coordinator = False
        self.rank = 0
        self.world_size = world_size
        self.save_tag = None if save_tag is None else str(save_tag)
        self.use_collectives = True
        self.staging = staging
        self.device_budget_bytes = device_budget_bytes
        self._staged_on: int | None = None

    # -- AsyncStager -----------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The copy of ``state_dict`` that ``dcp.async_save`` writes in the background (see ``staging``)."""
        # DCP writes in a thread of its own, whose current CUDA device is the first: the write
        # runs on this (the training thread's) device instead.
        self._staged_on = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        if self.staging == "host":
            return BlockingAsyncStager.stage(self, state_dict)
        budget: dict[torch.device, int] = {}
        with torch.no_grad():
            staged = _device_copy(state_dict, lambda t: self._may_clone(t, budget))
        for device in budget:
            # The clones were queued on the current stream: done before training changes the source.
            torch.cuda.synchronize(device)
        return staged

    def _may_clone(self, t: torch.Tensor, budget: dict[torch.device, int]) -> bool:
        """Whether ``t`` is cloned on its device (else copied to the host): CPU tensors always; CUDA
        tensors while the device's budget lasts."""
        if t.device.type != "cuda":
            return t.device.type == "cpu"
        if t.device not in budget:
            budget[t.device] = (
                self.device_budget_bytes if self.device_budget_bytes is not None else torch.cuda.mem_get_info(t.device)[0] // 2
            )
        need = t.numel() * t.element_size()
        if need > budget[t.device]:
            return False
        budget[t.device] -= need
        return True

    # -- StorageWriter ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex[:12]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # A fresh id for every save, also when one writer serves several saves (DCP calls
        # reset() only when given a checkpoint_id): a save never reuses committed file names,
        # so a checkpoint in the directory stays whole until the new .metadata replaces it.
        self.save_id = uuid.uuid4().hex[:12]
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if not self.path:
            raise CheckpointError("NvcompWriter has no directory: pass NvcompWriter(path) or dcp.save(..., checkpoint_id=path)")
        self.use_collectives = kwargs.get("use_collectives", True) is not False

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        storage, spath = storage_for(self.path, self.storage_options)
        with write_errors(self.path, "creating the checkpoint directory"):
            storage.makedirs(spath)
        if not self.use_collectives:
            # Each rank commits alone: replacing a checkpoint would leave, after a failure on some
            # ranks, a directory mixing two saves. Ranks check only names no peer of this save writes.
            for name in (METADATA_NAME, rank_metadata_name(self.rank)):
                s, p = storage_for(join(self.path, name), self.storage_options)
                if s.exists(p):
                    raise CheckpointError(
                        f"{join(self.path, name)}: the directory holds a checkpoint; a save with use_collectives=False "
                        "(each rank committing its own part, no coordinator) needs a new directory per checkpoint. "
                        "Pass a fresh path, or save with collectives (the default), which replaces a checkpoint atomically."
                    )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each rank names its own file (rank and a save id of its own): nothing rides in the
        # plan, which DCP's plan caching may replay from an earlier save.
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        device, self._staged_on = self._staged_on, None  # set by stage() for this save only
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            fut.set_result(self._write_rank_file(plan, planner))
        return fut

    def _write_rank_file(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        if not plan.items:
            return []
        name = shard_name(self.rank, self.save_id)
        used: set[str] = set()
        keyed: list[tuple[WriteItem, str]] = [(item, _item_key(item, used)) for item in plan.items]
        tree: dict[str, torch.Tensor] = {}
        for item, key in keyed:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = data.getvalue()
                tree[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            else:
                # A DTensor's local shard, perhaps a view or on a GPU: the core writes the
                # values it shows, compressing CUDA tensors on their GPU where nvCOMP is present.
                assert isinstance(data, torch.Tensor)
                tree[key] = data.detach()
        where = join(self.path, name)
        storage, spath = storage_for(where, self.storage_options)
        with write_errors(where):
            with storage.open_write(spath) as stream:
                if self.stream_wrapper is not None:
                    stream = self.stream_wrapper(stream)
                writer = CheckpointWriter(stream, self.policy, where, workers=self.workers)
                index, _, _ = writer.write(tree, {"dcp_rank": self.rank, "dcp_file": name})
        # The file's identity, as its footer records it (the digest of the index bytes the writer
        # just wrote): a reader refuses another file under this name.
        identity = xxhash.xxh3_64_intdigest(index.to_json_bytes())
        # A name that shares its tensor with another (tied weights) is stored once, under the
        # other name: the file reads it back by either; its own stored size is 0.
        stored = {entry.key: entry.stored_bytes for entry in index.tensors}
        return [
            WriteResult(index=item.index, size_in_bytes=stored.get(key, 0), storage_data=StoredItem(name, key, identity))
            for item, key in keyed
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.storage_meta = self.storage_meta()
        if not self.use_collectives:
            self._finish_rank(metadata)
            return
        target = join(self.path, METADATA_NAME)
        storage, spath = storage_for(target, self.storage_options)
        previous = self._previous_files()
        with write_errors(target, "committing the checkpoint metadata"):
            with storage.open_write(spath) as stream:
                stream.write(encode_metadata(metadata))
        # Committed: the files of the checkpoint this one replaced are no longer referenced.
        current = {item.file for item in metadata.storage_data.values()}
        for name in sorted(previous - current):
            old = join(self.path, name)
            s, p = storage_for(old, self.storage_options)
            try:
                s.remove(p)
            except OSError:
                pass  # a leftover file is harmless: nothing references it

    def _finish_rank(self, metadata: Metadata) -> None:
        """A save without collectives: this rank's items only, committed by its own ``__<rank>.metadata``."""
        world = self.world_size
        if world is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not 0 <= self.rank < world:
            raise CheckpointError(
                f"{self.path}: rank {self.rank} of a save without collectives is outside a world of {world} ranks; "
                "pass NvcompWriter(..., world_size=<ranks of the process group>)"
            )
        assert metadata.storage_meta is not None
        tags = [f"{WORLD_SIZE_TAG}{world}"] + ([f"{SAVE_TAG}{self.save_tag}"] if self.save_tag is not None else [])
        metadata.storage_meta.modules = [*metadata.storage_meta.modules, *tags]
        target = join(self.path, rank_metadata_name(self.rank))
        storage, spath = storage_for(target, self.storage_options)
        with write_errors(target, "committing this rank's checkpoint metadata"):
            with storage.open_write(spath) as stream:
                stream.write(encode_metadata(metadata))

    def _previous_files(self) -> set[str]:
        """Rank files of the checkpoint already committed in this directory, if it is ours."""
        try:
            old = read_stored_metadata(self.path, self.storage_options)
        except (FormatError, CheckpointError):
            return set()
        if old is None:
            return set()
        # Ours, or a plain FileSystemWriter checkpoint's files (_StorageInfo.relative_path); reading
        # the metadata refused any name that is not a file of this directory.
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        values = (old.storage_data or {}).values()
        return {v.file for v in values if isinstance(v, StoredItem)} | {
            v.relative_path for v in values if isinstance(v, _StorageInfo)
        }

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True
