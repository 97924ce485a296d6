"""Writes one checkpoint file front to back, compressing chunks in parallel.

Call order: :func:`plan_tensors` classifies every tensor and picks its spec and device, then
:class:`CheckpointWriter` writes the magic, the skeleton frame, every tensor's frames (in
order, from a bounded window of compression jobs, by a thread of its own) and, last, the index
and footer.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from functools import partial
from typing import IO, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import xxhash

from .boundedjson import MAX_METADATA_DEPTH, json_depth
from .codecs import CodecConfig, codec_facts, cpu_codec, gpu_available, gpu_chunk_bytes, gpu_codec, has_cpu_decoder
from .delta import BaseSource, encode_cpu_chunk_against, pick_frames, tries_sub
from .errors import CodecUnavailableError, UnsupportedObjectError
from .filters import ByteplaneFilter, exponent_rotation, plane_filter, plane_width
from .filters.sub import sub_bytes_torch
from .format.chain import DELTA_FORMAT_VERSION, SUB, SUB_FORMAT_VERSION, XOR, TensorDelta
from .format.layout import (
    DELTA_MAGIC,
    GUARD,
    MAGIC,
    MAX_INDEX_BYTES,
    QUANTIZED_DTYPES,
    ROTATE_FORMAT_VERSION,
    ROTATE_MAGIC,
    SAVE_METADATA_KEYS,
    SUB_MAGIC,
    Frame,
    Index,
    TensorEntry,
    pack_footer,
)
from .format.skeleton import encode_skeleton, flatten
from .planechoice import choose_rotation
from .policy import CodecPolicy, CodecSpec, Component, key_string, warn_unmatched_overrides
from .report import ComponentStats
from .tensors import SOURCE_DEVICE_ATTR, flat_bytes, unique_key
from .version import __version__, install_hint
from .workers import GPU_BATCH_BYTES, default_workers, worker_pool

__all__ = [
    "PlannedTensor",
    "plan_tensors",
    "planned_copy",
    "TreePlan",
    "CheckpointWriter",
    "PinnedRing",
    "pre_encode_on_gpu",
    "default_workers",
    "SOURCE_DEVICE_ATTR",
]

#: Largest chunk compressed with nvCOMP's Zstd (the facts table, codecs/registry.py, says why).
#: Chunks of a larger policy chunk size are cut to the codec's limit on the GPU (the index records
#: each tensor's chunk size, so any reader follows).
GPU_ZSTD_CHUNK_LIMIT = codec_facts("zstd").gpu_max_chunk_bytes

#: GPU batches in flight: one compressing, one crossing to the host, one being written.
GPU_BATCHES_IN_FLIGHT = 3
#: Jobs queued at once whatever their size (bounds the bookkeeping for many tiny tensors).
MAX_JOBS_IN_FLIGHT = 256


@dataclass
class PlannedTensor:
    """A tensor of the tree with the decisions made about it."""

    key: str
    tensor: torch.Tensor
    component: Component
    spec: CodecSpec
    width: int
    chunk_bytes: int
    device: torch.device | None  # where compression runs; None = CPU
    #: Delta files: the base tensor this one is XORed with (delta.py), and its bytes' XXH3-64.
    base_key: str | None = None
    base_xxh3: int = 0
    #: Filter "rotplane": bits each element is rotated by (filters.exponent_rotation); 0 = none.
    rotate: int = 0
    #: Bits the writer may rotate it by instead, choosing from a sample (CodecPolicy.choose_rotation).
    may_rotate: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def filter_id(self) -> str:
        """The filter the index records: a "rotplane" spec is plain byte planes for a dtype it does not rotate."""
        if self.rotate:
            return "rotplane"
        return "none" if self.spec.filter == "none" else "byteplane"

    @property
    def planes(self) -> int:
        return 1 if self.filter_id == "none" else self.width

    def plane_filter(self) -> ByteplaneFilter:
        return plane_filter(self.filter_id, self.width, self.rotate)

    @property
    def chooses_rotation(self) -> bool:
        """Whether the writer picks rotated or plain planes for it from a sample (planechoice.py): it
        may be rotated, is compressed on the CPU from host memory, and has no base (a delta's planes are plain)."""
        return bool(self.may_rotate) and self.device is None and self.base_key is None and self.tensor.device.type == "cpu"


def _check_tensor(key: str, t: torch.Tensor, where: str) -> None:
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedObjectError(f"{where}: tensor {key!r} has layout {t.layout}; call .to_dense() before saving")
    if t.device.type == "meta":
        raise UnsupportedObjectError(f"{where}: tensor {key!r} is on the meta device and has no data to save")
    if t.is_quantized or t.dtype in QUANTIZED_DTYPES:  # a plain view with a quantized dtype has no scale either
        raise UnsupportedObjectError(f"{where}: tensor {key!r} is quantized; call .dequantize() or use torch.save")
    if t.is_nested:
        raise UnsupportedObjectError(f"{where}: tensor {key!r} is a nested tensor; save its components instead")


def _compress_device(key: str, t: torch.Tensor, spec: CodecSpec, policy: CodecPolicy, where: str) -> torch.device | None:
    gpu_only = not has_cpu_decoder(spec.codec)
    if spec.codec == "none" and policy.device == "auto":
        return None
    if policy.device == "cpu":
        if gpu_only:
            raise CodecUnavailableError(
                f"{where}: tensor {key!r} uses GPU-only codec {spec.codec!r} but the policy says device='cpu'; "
                "use codec 'zstd' or device='auto'"
            )
        return None
    if policy.device.startswith("cuda") or gpu_only or t.is_cuda:
        if gpu_available():
            if policy.device.startswith("cuda"):
                requested = torch.device(policy.device)
                # Resolved here, in the caller's thread: worker threads start on device 0,
                # which would put every rank of a multi-GPU run on GPU 0.
                return requested if requested.index is not None else torch.device("cuda", torch.cuda.current_device())
            return t.device if t.is_cuda else torch.device("cuda", torch.cuda.current_device())
        if gpu_only or policy.device.startswith("cuda"):
            raise CodecUnavailableError(
                f"{where}: tensor {key!r} needs nvCOMP on a CUDA GPU for codec {spec.codec!r} "
                f"(policy device {policy.device!r}), and none is usable here. Install the cu12 (or cu13) extra on a "
                f"CUDA machine ({install_hint('cu12')}), or use codec 'zstd', which runs on the CPU too."
            )
    return None  # a CUDA tensor without nvCOMP is compressed on the CPU, chunk by chunk


def plan_tensors(tensors: Sequence[tuple[tuple[Any, ...], torch.Tensor]], policy: CodecPolicy, where: str) -> list[PlannedTensor]:
    """Classify every tensor and choose its spec, plane width, chunk size and device."""
    planned = []
    used: set[str] = set()
    for path, t in tensors:
        key = key_string(path)
        _check_tensor(key, t, where)
        component = policy.component_of(key, path)
        nbytes = t.numel() * t.element_size()
        spec = policy.spec_for(key, component, nbytes)
        key = unique_key(key, used)
        device, chunk = _placement(key, t, spec, policy, where)
        rotate = exponent_rotation(t.dtype) if spec.filter == "rotplane" else 0
        may_rotate = policy.rotation_to_choose(spec, t.dtype, nbytes)
        planned.append(
            PlannedTensor(key, t, component, spec, plane_width(t.dtype), chunk, device, rotate=rotate, may_rotate=may_rotate)
        )
    if policy.overrides:
        warn_unmatched_overrides(policy, [p.key for p in planned], where)
    return planned


def _placement(key: str, t: torch.Tensor, spec: CodecSpec, policy: CodecPolicy, where: str) -> tuple[torch.device | None, int]:
    """Where ``t`` is compressed, and its chunk size there."""
    itemsize = t.element_size()
    chunk = max(itemsize, spec.chunk_bytes // itemsize * itemsize)
    device = _compress_device(key, t, spec, policy, where)
    if device is not None and spec.codec != "none":
        chunk = gpu_chunk_bytes(spec.codec, chunk, itemsize)
    return device, chunk


def planned_copy(item: PlannedTensor, copy: torch.Tensor, policy: CodecPolicy, where: str) -> PlannedTensor:
    """``item`` planned for ``copy``, a copy of its tensor (an async snapshot's).

    The key, component and spec stay; a copy on another device (a CUDA tensor staged to host
    memory) is compressed where a tensor on that device would be, as a plan of the copy says.
    """
    if copy.device == item.tensor.device:
        return replace(item, tensor=copy)
    device, chunk = _placement(item.key, copy, item.spec, policy, where)
    return replace(item, tensor=copy, device=device, chunk_bytes=chunk)


@dataclass(frozen=True)
class TreePlan:
    """A tree flattened and planned before the write (by an async snapshot), so the writer
    does neither again.

    Attributes:
        skeleton: :func:`flatten`'s skeleton of the tree.
        tensors: Its tensors planned, in the skeleton's order (``TensorRef(i)`` is ``tensors[i]``).
        wait_for: Called with a tensor's index before anything reads its bytes: the snapshot
            may still be copying it. Raises if that copy failed (the save then fails).
    """

    skeleton: Any
    tensors: tuple[PlannedTensor, ...]
    wait_for: Callable[[int], None] | None = None


def checked_metadata(metadata: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """A copy of ``metadata`` through JSON, or an error naming ``where`` if it is not JSON.

    Raises:
        UnsupportedObjectError: A value is not JSON, the metadata is nested deeper than
            :data:`~nvcomp_checkpoint.boundedjson.MAX_METADATA_DEPTH` levels, or is over the index limit.
    """
    too_deep = (
        f"{where}: metadata is nested deeper than {MAX_METADATA_DEPTH} levels of lists and dicts, more than a "
        "checkpoint's index holds (readers refuse deeper JSON as damaged); flatten it, or store it as a JSON string"
    )
    try:
        text = json.dumps(dict(metadata or {}), allow_nan=False)
    except RecursionError as exc:  # nested ~1000 deep: the encoder recursed once per level
        raise UnsupportedObjectError(too_deep) from exc
    except (TypeError, ValueError) as exc:
        raise UnsupportedObjectError(
            f"{where}: metadata must be JSON (str, int, finite float, bool, None, lists, dicts with str keys): {exc}"
        ) from exc
    if json_depth(text) > MAX_METADATA_DEPTH:
        raise UnsupportedObjectError(too_deep)
    if len(text) > MAX_INDEX_BYTES // 2:
        raise UnsupportedObjectError(
            f"{where}: metadata of {len(text) / 2**30:.2f} GiB as JSON; the index that holds it is limited to "
            f"{MAX_INDEX_BYTES >> 30} GiB: store large values as tensors in the checkpoint itself"
        )
    loaded: dict[str, Any] = json.loads(text)
    return loaded


# (frame bytes, raw size, xxh3-64 of the frame, op against the base) in order; the hash is taken
# in the worker thread so the thread that writes does nothing but write.
_Encoded = list[tuple[bytes | memoryview | np.ndarray, int, int, str]]


@dataclass
class _InFlight:
    """A job between its submission and its write: its weight in the window, its compression
    (in a worker) and its write (in the writing thread, which waits for the compression)."""

    weight: int
    encoded: Future[_Encoded]
    written: Future[list[int]]


def _encode_cpu_chunk(data: np.ndarray, item: PlannedTensor) -> _Encoded:
    parts = item.plane_filter().split(data)
    codec = cpu_codec(item.spec.codec, item.spec.level, item.spec.adaptive)
    out: _Encoded = []
    for part in parts:
        # ``part.data``: the array's bytes as a memoryview (a 1-D uint8 array), what codecs and xxhash take.
        frame = codec.encode(part.data) if item.spec.codec != "none" else None
        if frame is not None and len(frame) < len(part):
            out.append((frame, len(part), xxhash.xxh3_64_intdigest(frame), ""))
        else:  # no codec, or a frame that does not shrink: stored raw (smaller, and faster to read)
            out.append((part, len(part), xxhash.xxh3_64_intdigest(part.data), ""))
    return out


#: Frames of one GPU batch, still on the device, with the raw size and the op of each.
GpuFrames = tuple[list[torch.Tensor], list[int], list[str]]


def gpu_batches(item: PlannedTensor) -> list[list[int]]:
    """Chunk start offsets of each GPU batch of ``item``, in file order."""
    per_batch = max(1, GPU_BATCH_BYTES // item.chunk_bytes)
    starts = list(range(0, item.nbytes, item.chunk_bytes))
    return [starts[b : b + per_batch] for b in range(0, len(starts), per_batch)]


def encode_gpu_batch(flat: torch.Tensor, starts: list[int], item: PlannedTensor, base: torch.Tensor | None = None) -> GpuFrames:
    """Compress one batch of chunks on ``item.device``; the frames stay in GPU memory.

    A frame that does not shrink is the raw piece, which may be a view of ``flat``. With
    ``base`` (the base tensor's bytes), each frame is plain, XORed with the base or their
    difference, computed on the device, whichever stores smallest (delta.pick_frames, the CPU's rule).
    """
    device = item.device
    assert device is not None
    with torch.cuda.device(device):
        src = flat[starts[0] : min(starts[-1] + item.chunk_bytes, flat.numel())]
        if src.device != device:
            src = src.to(device, non_blocking=False)
        filt = item.plane_filter()
        pieces: list[torch.Tensor] = []
        for s in starts:
            chunk = src[s - starts[0] : s - starts[0] + item.chunk_bytes]
            pieces.extend(filt.split_torch(chunk))
        sizes = [p.numel() for p in pieces]
        if item.spec.codec == "none":
            return pieces, sizes, [""] * len(pieces)
        codec = gpu_codec(item.spec.codec, item.spec.level, device)
        if base is not None:
            return _encode_gpu_against(src, base, starts, item, pieces, codec)
        encoded = codec.encode_batch(pieces)
        frames = [e if e.numel() < p.numel() else p for e, p in zip(encoded, pieces)]
        return frames, sizes, [""] * len(pieces)


def _encode_gpu_against(
    src: torch.Tensor, base: torch.Tensor, starts: list[int], item: PlannedTensor, pieces: list[torch.Tensor], codec: Any
) -> GpuFrames:
    """The frames of one GPU batch of a tensor with a base: the XOR and the difference run on the device."""
    ref = base[starts[0] : starts[0] + src.numel()]
    if ref.device != src.device:
        ref = ref.to(src.device)
    filt = item.plane_filter()
    transformed = [(XOR, torch.bitwise_xor(src, ref))]
    if tries_sub(item):
        transformed.append((SUB, sub_bytes_torch(src, ref, item.width)))
    tpieces: list[list[torch.Tensor]] = []
    for _, values in transformed:
        parts: list[torch.Tensor] = []
        for s in starts:
            chunk = values[s - starts[0] : s - starts[0] + item.chunk_bytes]
            parts.extend(filt.split_torch(chunk))
        tpieces.append(parts)
    # One nvCOMP batch for every form of every piece.
    encoded = codec.encode_batch(pieces + [p for parts in tpieces for p in parts])
    n = len(pieces)
    forms = [("", pieces, encoded[:n])] + [
        (op, parts, encoded[n * (k + 1) : n * (k + 2)]) for k, ((op, _), parts) in enumerate(zip(transformed, tpieces))
    ]
    chosen = pick_frames(forms, lambda t: t.numel())
    return [f for f, _ in chosen], [p.numel() for p in pieces], [op for _, op in chosen]


def _gpu_frames_to_host(batch: GpuFrames, device: torch.device, ring: PinnedRing, seq: int) -> _Encoded:
    """Copy one batch's frames into its reused pinned buffer: only compressed bytes cross."""
    frames, raw_sizes, ops = batch
    with torch.cuda.device(device):
        packed = torch.cat([f.reshape(-1) for f in frames])
        staging = ring.buffer(seq, packed.numel())
        staging.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        host = staging.numpy()
    out: _Encoded = []
    pos = 0
    for f, raw_size, op in zip(frames, raw_sizes, ops):
        frame = host[pos : pos + f.numel()]
        out.append((frame, raw_size, xxhash.xxh3_64_intdigest(frame.data), op))
        pos += f.numel()
    return out


def _encode_gpu_chunks(
    flat: torch.Tensor, starts: list[int], item: PlannedTensor, ring: PinnedRing, seq: int, base: torch.Tensor | None = None
) -> _Encoded:
    ring.acquire(seq)
    assert item.device is not None
    return _gpu_frames_to_host(encode_gpu_batch(flat, starts, item, base), item.device, ring, seq)


def _to_host(flat: torch.Tensor, start: int, end: int) -> np.ndarray:
    """Bytes ``start:end`` of a device tensor's flat bytes, copied to the host."""
    return flat[start:end].cpu().numpy()


def _cpu_job(chunk: np.ndarray | Callable[[], np.ndarray], item: PlannedTensor, base: np.ndarray | None) -> _Encoded:
    """One chunk compressed on the CPU, against ``base`` (the base's same bytes) where given; a callable
    ``chunk`` copies a device tensor's bytes to the host first (in the job, one chunk at a time)."""
    data = chunk() if callable(chunk) else chunk
    return _encode_cpu_chunk(data, item) if base is None else encode_cpu_chunk_against(data, base, item)


def _pre_encoded_to_host(batch: GpuFrames, item: PlannedTensor, ring: PinnedRing, seq: int) -> _Encoded:
    ring.acquire(seq)
    # The frames' own device: the one they were compressed on, in the caller's thread.
    return _gpu_frames_to_host(batch, batch[0][0].device, ring, seq)


def pre_encode_on_gpu(
    tensors: Sequence[tuple[tuple[Any, ...], torch.Tensor]],
    policy: CodecPolicy,
    where: str,
    budget: Callable[[torch.device], int],
) -> dict[int, list[GpuFrames]]:
    """Compress the CUDA tensors the policy sends to their GPU, keeping the frames in GPU memory.

    This is the GPU half of an async snapshot: once it returns, training may change the
    tensors, and the writer only copies the (smaller) frames to the host. Tensors beyond
    ``budget(device)`` raw bytes per device are left out (the caller copies them instead).

    Returns:
        ``{id(tensor): [frames of each GPU batch]}``, as :class:`CheckpointWriter` takes it.
    """
    out: dict[int, list[GpuFrames]] = {}
    used: dict[torch.device, int] = {}
    for item in plan_tensors(tensors, policy, where):
        t = item.tensor
        if item.device is None or t.device != item.device or item.nbytes == 0 or id(t) in out:
            continue
        if used.get(t.device, 0) + item.nbytes > budget(t.device):
            continue
        used[t.device] = used.get(t.device, 0) + item.nbytes
        flat = flat_bytes(t)
        batches = []
        for group in gpu_batches(item):
            frames, raw_sizes, ops = encode_gpu_batch(flat, group, item)
            batches.append((_compact(frames), raw_sizes, ops))
        out[id(t)] = batches
    for device in used:
        torch.cuda.current_stream(device).synchronize()
    return out


def _compact(frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """The frames copied into one allocation of their total size.

    A frame stored raw may be a view of the live tensor (training's next step would change what
    gets written) or of the batch's whole plane buffer, and compressed frames are views into the
    codec's output, which also holds the frames that were not kept: held as they are, a snapshot
    would pin up to twice its budget of GPU memory.
    """
    packed = torch.empty(sum(f.numel() for f in frames), dtype=torch.uint8, device=frames[0].device)
    out, pos = [], 0
    for f in frames:
        dest = packed[pos : pos + f.numel()]
        dest.copy_(f.reshape(-1))
        out.append(dest)
        pos += f.numel()
    return out


class PinnedRing:
    """Reused pinned host buffers for the compressed output of GPU batches.

    GPU batch ``k`` uses slot ``k % slots`` and may start only once batch ``k - slots`` has been
    written: the writer drains batches in order, so waiting on an older batch cannot deadlock,
    and host and GPU memory stay bounded by ``slots`` batches whatever the checkpoint size.
    """

    _cache: list[torch.Tensor] = []  # buffers kept across saves: pinning is slow
    _cache_lock = threading.Lock()

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child: the parent's pinned buffers are not the child's, nor a held lock."""
        cls._cache_lock = threading.Lock()
        cls._cache = []

    def __init__(self, slots: int = GPU_BATCHES_IN_FLIGHT) -> None:
        self.slots = slots
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._issued = 0
        self._written = 0
        self._cond = threading.Condition()

    def ticket(self) -> int:
        """The next batch's sequence number (taken in file order, by the thread that queues the jobs)."""
        seq, self._issued = self._issued, self._issued + 1
        return seq

    def acquire(self, seq: int) -> None:
        """Block until batch ``seq`` may run (batch ``seq - slots`` has been written)."""
        with self._cond:
            self._cond.wait_for(lambda: seq < self._written + self.slots)

    def buffer(self, seq: int, nbytes: int) -> torch.Tensor:
        """Batch ``seq``'s pinned buffer, at least ``nbytes`` long."""
        slot = seq % self.slots
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            with PinnedRing._cache_lock:
                fits = [b for b in PinnedRing._cache if b.numel() >= nbytes]
                if fits:
                    PinnedRing._cache.remove(fits[0])
                    buf = fits[0]
                else:
                    buf = torch.empty(max(nbytes, GPU_BATCH_BYTES), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buf
        return buf[:nbytes]

    def abort(self) -> None:
        """Release every waiting batch (the save failed; nothing more will be written)."""
        with self._cond:
            self._written = 1 << 62
            self._cond.notify_all()

    def written(self) -> None:
        """The oldest outstanding batch is on the stream; its slot may be reused."""
        with self._cond:
            self._written += 1
            self._cond.notify_all()

    def close(self) -> None:
        with PinnedRing._cache_lock:
            for buf in self._buffers:
                if buf is not None and len(PinnedRing._cache) < 2 * GPU_BATCHES_IN_FLIGHT:
                    PinnedRing._cache.append(buf)
        self._buffers = [None] * self.slots


class CheckpointWriter:
    """Writes one checkpoint to a binary stream.

    Args:
        stream: Where bytes go, written strictly sequentially (the frames from the writer's own
            thread, one call at a time; the caller's thread writes the head and the index).
        policy: The codec policy.
        where: The path, for error messages and the report.
        workers: Compression threads (default: every core, at most 16).
        depth: Chunks in flight per worker; bounds the extra memory of a save.
        progress: Called with the raw bytes of each frame once it is written, in the calling thread.
        pre_encoded: ``{id(tensor): [batch frames ...]}`` for tensors already compressed on their
            GPU (by :func:`pre_encode_on_gpu`, for an async snapshot); planned like any other.
        base: The checkpoint this one is written as a delta of (``delta.BaseSource``), or None.
    """

    def __init__(
        self,
        stream: IO[bytes],
        policy: CodecPolicy,
        where: str,
        *,
        workers: int | None = None,
        depth: int = 2,
        progress: Callable[[int], None] | None = None,
        pre_encoded: Mapping[int, list[GpuFrames]] | None = None,
        base: BaseSource | None = None,
    ) -> None:
        self.stream = stream
        self.base = base
        self.pre_encoded = pre_encoded or {}
        self.policy = policy
        self.where = where
        self.workers = workers or default_workers()
        self.depth = max(1, depth)
        self.progress = progress
        self._pos = 0
        self._write_failed = False
        self._wait_for: Callable[[int], None] | None = None

    def _write(self, data: bytes | memoryview | np.ndarray) -> int:
        self.stream.write(data.data if isinstance(data, np.ndarray) else data)
        n = len(data) if not isinstance(data, np.ndarray) else data.nbytes
        self._pos += n
        return n

    @property
    def bytes_written(self) -> int:
        """Bytes written to the stream so far (the file's size once :meth:`write` returned)."""
        return self._pos

    def write(
        self, obj: Any, metadata: dict[str, Any] | None = None, *, plan: TreePlan | None = None
    ) -> tuple[Index, dict[str, ComponentStats], int]:
        """Write ``obj``; returns the index, per-component stats and the raw tensor bytes.

        With ``plan`` (``obj``'s, made earlier), ``obj`` is not flattened and planned again.
        """
        metadata = checked_metadata(metadata, self.where)  # before the first byte: the index is written last
        if plan is None:
            skeleton, tensors = flatten(obj, where=self.where)
            planned = plan_tensors(tensors, self.policy, self.where)
        else:
            skeleton, planned = plan.skeleton, list(plan.tensors)
        self._wait_for = plan.wait_for if plan is not None else None
        if self.base is not None:
            for item in planned:
                # A tensor an async snapshot compressed already is stored plain.
                if item.spec.codec != "none" and item.nbytes and id(item.tensor) not in self.pre_encoded:
                    item.base_key = self.base.match(item.key, item.tensor, item.component.value)
                    if item.base_key is not None:
                        item.rotate = 0  # the format's deltas are of plain byte planes
        try:
            skeleton_bytes = encode_skeleton(skeleton, self.where)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            # torch.save names the object's type only ("Can't pickle local object ...").
            raise UnsupportedObjectError(
                f"{self.where}: the checkpoint tree holds an object that cannot be pickled ({exc}); "
                "remove it from the tree or replace it with plain values (numbers, strings, dicts, lists)"
            ) from exc
        if len(skeleton_bytes) > MAX_INDEX_BYTES:
            # The reader refuses a larger object tree (it bounds what a forged header can allocate).
            raise UnsupportedObjectError(
                f"{self.where}: the non-tensor part of the checkpoint pickles to {len(skeleton_bytes) / 2**30:.2f} GiB, "
                f"over the format's limit of {MAX_INDEX_BYTES >> 30} GiB; store large arrays and byte strings as "
                "torch tensors (torch.from_numpy, torch.frombuffer), which are compressed and streamed"
            )
        version = self._version(planned)
        self._write(GUARD)  # a stock torch.load stops here, naming our loader (format/guard.py)
        magics = {DELTA_FORMAT_VERSION: DELTA_MAGIC, SUB_FORMAT_VERSION: SUB_MAGIC, ROTATE_FORMAT_VERSION: ROTATE_MAGIC}
        self._write(MAGIC if version is None else magics[version])
        skel_frame = self._write_skeleton(skeleton_bytes)
        frames_of: list[list[Frame]] = [[] for _ in planned]
        self._ring = PinnedRing()
        try:
            self._compress_and_write(planned, frames_of)
        finally:
            self._ring.close()
        return self._finish(planned, frames_of, skel_frame, metadata, version)

    def _version(self, planned: list[PlannedTensor]) -> int | None:
        """The file's format version, decided before its first byte (the magic holds it): 4 when
        some tensor has filter "rotplane" or may get it (chosen when its jobs are queued), else 3
        when some tensor may get "sub" frames (an older reader then refuses the file), 2 for
        another delta, None (1) for a full file."""
        if any(item.rotate or item.chooses_rotation for item in planned):
            return ROTATE_FORMAT_VERSION
        if self.base is None:
            return None
        return (
            SUB_FORMAT_VERSION if any(item.base_key is not None and tries_sub(item) for item in planned) else DELTA_FORMAT_VERSION
        )

    def _compress_and_write(self, planned: list[PlannedTensor], frames_of: list[list[Frame]]) -> None:
        # Worker threads read CUDA tensors on their own (default) stream: the kernels that made
        # them, queued on the caller's current stream, must be done first.
        for device in {item.tensor.device for item in planned if item.tensor.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
        self._write_failed = False
        # One thread writes, in file order, while this one queues jobs: the exit of the inner
        # pool (the writer) comes first, so no write is still running when the stream closes.
        with worker_pool(self.workers, "nvckpt-compress") as pool, worker_pool(1, "nvckpt-write") as writes:
            window: deque[_InFlight] = deque()
            try:
                self._fill_and_drain(pool, writes, window, planned, frames_of)
            except BaseException:
                # Before the pools' shutdown waits for their threads: no write may start after
                # this, none may stay blocked on a pinned slot, and queued jobs need not run.
                self._write_failed = True
                self._ring.abort()
                for job in window:
                    job.written.cancel()
                    job.encoded.cancel()
                raise

    def _fill_and_drain(
        self,
        pool: Executor,
        writes: Executor,
        window: deque[_InFlight],
        planned: list[PlannedTensor],
        frames_of: list[list[Frame]],
    ) -> None:
        # The window is bounded in bytes, not in jobs: with a job count, one full chunk at
        # the head held back the small tensors behind it and left workers idle (2 workers
        # ran at 1.45x one; bounded in bytes, 1.6x). GPU batches are bounded by the pinned ring.
        # A job leaves the window once written (not once compressed): the bound holds the
        # compressed bytes waiting for the writer too, so writing off this thread adds no memory.
        unit = max((item.chunk_bytes for item in planned), default=1)
        budget = self.workers * self.depth * unit
        # Jobs run in this thread while the interpreter exits (workers.worker_pool): each job is
        # then compressed and written at submit, as a GPU batch waits for a slot only a write frees.
        in_flight = 0
        for idx, nbytes, on_gpu, job in self._jobs_once_copied(planned):
            weight = min(nbytes, unit)
            encoded = pool.submit(job)
            written = writes.submit(self._write_job, idx, on_gpu, encoded, frames_of)
            window.append(_InFlight(weight, encoded, written))
            in_flight += weight
            # Writes done already are reaped at once: an error surfaces before more is queued.
            while window and (window[0].written.done() or in_flight > budget or len(window) > MAX_JOBS_IN_FLIGHT):
                in_flight -= self._reap(window)
        while window:
            self._reap(window)

    def _finish(
        self,
        planned: list[PlannedTensor],
        frames_of: list[list[Frame]],
        skel_frame: Frame,
        metadata: dict[str, Any] | None,
        version: int | None = None,
    ) -> tuple[Index, dict[str, ComponentStats], int]:
        entries = []
        stats: dict[str, ComponentStats] = {}
        raw_total = 0
        for item, frames in zip(planned, frames_of):
            entry = TensorEntry(
                key=item.key,
                dtype=item.tensor.dtype,
                shape=tuple(item.tensor.shape),
                component=item.component.value,
                codec=CodecConfig(item.spec.codec, item.spec.level),
                filter=item.filter_id,
                width=item.width,
                chunk_bytes=item.chunk_bytes,
                frames=tuple(frames),
                # A GPU tensor an async snapshot staged in host memory records its own GPU.
                device=str(getattr(item.tensor, SOURCE_DEVICE_ATTR, item.tensor.device)),
                requires_grad=bool(item.tensor.requires_grad),
                parameter=isinstance(item.tensor, torch.nn.Parameter),
                delta=TensorDelta(item.base_key, item.base_xxh3) if item.base_key and any(f.op for f in frames) else None,
                rotate=item.rotate,
            )
            entries.append(entry)
            comp = stats.get(entry.component, ComponentStats())
            stats[entry.component] = comp.add(entry.nbytes, entry.stored_bytes, entry.codec.label, entry.filter)
            raw_total += entry.nbytes
        meta = dict(zip(SAVE_METADATA_KEYS, (f"nvcomp-checkpoint {__version__}", torch.__version__, time.time())))
        meta.update(metadata or {})
        index = Index(skel_frame, tuple(entries), meta, self.base.ref if self.base is not None else None, version)
        index_bytes = index.to_json_bytes()
        if len(index_bytes) > MAX_INDEX_BYTES:
            # The reader refuses a larger index; fail the save (nothing lands at the path) rather
            # than leave a file that never loads.
            raise UnsupportedObjectError(
                f"{self.where}: the checkpoint's index ({len(entries)} tensors and the metadata) is "
                f"{len(index_bytes) / 2**30:.2f} GiB, over the format's limit of {MAX_INDEX_BYTES >> 30} GiB; "
                "keep large values out of metadata, or join many small tensors into fewer large ones"
            )
        index_offset = self._pos
        self._write(index_bytes)
        self._write(pack_footer(index_offset, len(index_bytes), xxhash.xxh3_64_intdigest(index_bytes)))
        ordered: dict[str, ComponentStats] = {c.value: stats[c.value] for c in Component if c.value in stats}
        return index, ordered, raw_total

    def _write_skeleton(self, data: bytes) -> Frame:
        frame = cpu_codec("zstd", 3).encode(memoryview(data))
        if len(frame) >= len(data):
            frame = data
        offset = self._pos
        self._write(frame)
        return Frame(offset, len(frame), len(data), xxhash.xxh3_64_intdigest(frame))

    def _write_job(self, idx: int, on_gpu: bool, encoded: Future[_Encoded], frames_of: list[list[Frame]]) -> list[int]:
        """In the writing thread: write one job's frames once compressed; returns their raw sizes.

        Jobs are written in the order they were queued (one thread). After a failed write, or
        once the calling thread has given up, later jobs write nothing: the file is discarded.
        """
        if self._write_failed:
            return []
        try:
            frames = encoded.result()
            if self._write_failed:  # the calling thread gave up while this job was compressed
                return []
            sizes = []
            for data, raw_size, digest, op in frames:
                offset = self._pos
                size = self._write(data)
                frames_of[idx].append(Frame(offset, size, raw_size, digest, op))
                sizes.append(raw_size)
            # The future keeps its result until the calling thread reaps it: the bytes go now.
            frames.clear()
        except BaseException:
            self._write_failed = True
            raise
        if on_gpu:
            self._ring.written()
        return sizes

    def _reap(self, window: deque[_InFlight]) -> int:
        """Wait until the oldest job is written (raising its error, the writer's or the
        compression's, in this thread); returns its weight in the window."""
        job = window.popleft()
        for raw_size in job.written.result():
            if self.progress is not None:
                self.progress(raw_size)
        return job.weight

    def _jobs_once_copied(self, planned: list[PlannedTensor]) -> Iterator[tuple[int, int, bool, Callable[[], _Encoded]]]:
        """:meth:`_jobs`, each tensor's first job held until its snapshot copy is done.

        Waited for here, on the writing thread, not in the jobs: the workers stay free for the
        tensors before it, and a failed copy stops the save before the next job is queued.
        """
        wait_for = self._wait_for
        if wait_for is None:
            yield from self._jobs(planned)
            return
        waited = -1
        for job in self._jobs(planned):
            if job[0] != waited:
                waited = job[0]
                wait_for(waited)
            yield job

    def _jobs(self, planned: list[PlannedTensor]) -> Iterator[tuple[int, int, bool, Callable[[], _Encoded]]]:
        """``(tensor index, raw bytes, job)`` for every compression job, in file order."""
        for idx, item in enumerate(planned):
            if item.nbytes == 0:
                continue
            pre = self.pre_encoded.get(id(item.tensor)) if item.device is not None else None
            if pre is not None:
                # Compressed on the GPU when an async snapshot was taken: only the copy to the
                # host and the write are left.
                for batch in pre:
                    seq = self._ring.ticket()
                    yield idx, sum(batch[1]), True, partial(_pre_encoded_to_host, batch, item, self._ring, seq)
                continue
            flat = flat_bytes(item.tensor)
            base = None
            if item.base_key is not None and self.base is not None:
                # Read here, one tensor at a time: the jobs of this tensor hold it until written.
                base, item.base_xxh3 = self.base.values(item.base_key, item.device or torch.device("cpu"))
            if item.device is not None:
                for group in gpu_batches(item):
                    nbytes = min(group[-1] + item.chunk_bytes, item.nbytes) - group[0]
                    seq = self._ring.ticket()
                    yield idx, nbytes, True, partial(_encode_gpu_chunks, flat, group, item, self._ring, seq, base)
                continue
            on_cpu = flat.device.type == "cpu"
            host = flat.numpy() if on_cpu else None
            if item.chooses_rotation and host is not None:
                if self._wait_for is not None:
                    self._wait_for(idx)  # the sample reads the tensor: an async snapshot's copy of it must be done
                codec = cpu_codec(item.spec.codec, item.spec.level, item.spec.adaptive)
                # Before its first job: every chunk of a tensor has the filter its index entry records.
                item.rotate = choose_rotation(host, item.width, item.may_rotate, item.spec.filter == "rotplane", codec)
            base_host = base.numpy() if base is not None else None
            for start in range(0, item.nbytes, item.chunk_bytes):
                end = min(start + item.chunk_bytes, item.nbytes)
                # A device tensor compressed on the CPU crosses over one chunk at a time, in the job.
                chunk = host[start:end] if host is not None else partial(_to_host, flat, start, end)
                ref = None if base_host is None else base_host[start:end]
                yield idx, end - start, False, partial(_cpu_job, chunk, item, ref)
