"""Reads checkpoint files: the index first, then tensors on demand, decoded in parallel.

Every frame's checksum is checked before it reaches a decoder, and every size in the index is
checked against the file before anything is allocated.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import deque
from concurrent.futures import Executor, Future
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import xxhash

from .codecs import cpu_codec, gpu_available, gpu_codec, has_cpu_decoder
from .delta import BaseChain
from .errors import CheckpointError, ChecksumError, CodecUnavailableError, FormatError, SizeLimitError, UnsafeCheckpointError
from .filetype import HEAD_BYTES, NVCOMP, SAFETENSORS, TORCH, kind_of
from .filters import plane_filter
from .format.chain import MAX_CHAIN_DEPTH
from .format.layout import (
    FOOTER,
    FOOTER_MAGIC,
    GUARD,
    MAGIC,
    READ_VERSIONS,
    Frame,
    Index,
    TensorEntry,
    magic_offset,
    unpack_footer,
)
from .format.skeleton import check_skeleton, decode_skeleton, tensor_paths, unflatten
from .policy import Component
from .report import ComponentStats, ComponentSummary
from .storage import Storage, open_checkpoint_stream, ranged_fetch, storage_for
from .tensors import unique_key
from .version import install_hint
from .workers import GPU_BATCH_BYTES, default_workers, worker_pool

__all__ = ["CheckpointReader", "MapLocation"]

#: Raw bytes decoded per nvCOMP batch on the GPU: the writer's batch size, so memory stays bounded.
_GPU_GROUP_BYTES = GPU_BATCH_BYTES

MapLocation = None | str | torch.device | Mapping[str, str] | Callable[..., Any]

#: How far :meth:`CheckpointReader.load` reads and decodes ahead of the tensor it finishes:
#: enough to keep every core busy on models made of many small tensors, little memory.
READ_AHEAD_BYTES = 64 << 20
READ_AHEAD_TENSORS = 64

#: Storage other than a local file (object stores, fsspec URLs): a decoding worker reads the
#: chunks it decodes, of one tensor or of several small ones stored back to back, in one ranged
#: request of up to this many raw bytes (their stored bytes are fewer). 8 MiB is the part size
#: S3's performance guidance names for ranged GETs: about 128-190 requests per GB stored, so
#: per-request latency and price stay small next to the transfer, while memory holds one such
#: read per worker (not a tensor's whole stored bytes), and reading overlaps decoding.
REMOTE_READ_BYTES = 8 << 20

#: A tensor's frames may lie in at most 1 + one per this many stored bytes separate places of the
#: file (the writer stores them back to back: one place). More is a forged or corrupt index that
#: would cost a request per piece (a request per byte, at worst).
MIN_PIECE_BYTES = 64 << 10


def _target_device(entry: TensorEntry, map_location: MapLocation) -> torch.device:
    saved = entry.device
    if map_location is None:
        # As torch.load does, tensors return to the device they were saved from; unlike
        # torch.load, a file saved on a GPU still loads (on the CPU) where there is none.
        device = torch.device(saved)
        if device.type != "cpu" and not _backend_available(device.type):
            return torch.device("cpu")
        return device
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, Mapping):
        return torch.device(map_location.get(saved, saved))
    return torch.device("cpu")  # callables are applied after decoding, as torch.load does


def _check_device(device: torch.device, entry: TensorEntry, where: str) -> torch.device:
    """``device`` if tensors can be placed there in this process, else a clear error."""
    if device.type not in ("cpu", "meta") and not _backend_available(device.type):
        raise CheckpointError(
            f"{where}: map_location asks for {device} (tensor {entry.key!r}), but this process has no usable "
            f"{device.type} device (torch.{device.type}.is_available() is False); load with map_location='cpu'"
        )
    return device


def _backend_available(device_type: str) -> bool:
    """Whether tensors can be placed on ``device_type`` (cuda, xpu, mps ...) in this process."""
    if device_type == "mps":
        return torch.backends.mps.is_available()
    backend = getattr(torch, device_type, None)
    is_available = getattr(backend, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except Exception:  # noqa: BLE001 - a half-installed backend counts as absent
        return False


class CheckpointReader:
    """A checkpoint file opened for reading; use as a context manager.

    Args:
        path: Local path or fsspec URL.
        storage_options: Passed to fsspec for URLs.
        workers: Decompression threads.
        max_bytes: For files from untrusted sources: refuse, before allocating, to decode more
            than this many bytes in one ``load``, ``read``, ``read_many``, ``keys`` or
            ``verify`` (the object tree and the tensors asked for; a delta tensor counts once
            more per file of its chain below it, whose tensor of the same size is decoded to
            rebuild it). ``None``: no limit beyond the format's own.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        workers: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.storage: Storage
        self.storage, self._spath = storage_for(self.path, storage_options)
        self.workers = workers or default_workers()
        self._stream = open_checkpoint_stream(self.storage, self._spath, self.path)
        # One seek + read at a time: threads may read tensors of one reader at once.
        self._io_lock = threading.Lock()
        try:
            # The size of the file opened, not of the path: an atomic save may replace the path
            # meanwhile, and this reader keeps reading the file it opened.
            self._stream.seek(0, os.SEEK_END)
            self._size = self._stream.tell()
            self.index = self._read_index()
        except BaseException:
            self._stream.close()
            raise
        #: Local files are read by the decoding workers themselves (:meth:`_pread`).
        self._fd = _local_fd(self.storage, self._stream)
        #: Object stores are read by the decoding workers with stateless ranged requests
        #: (:meth:`_read_range`); other storage through the stream, one read at a time.
        self._fetch = ranged_fetch(self._stream) if self._fd is None else None
        #: Chunks queued for reading in batches of consecutive stored bytes, per worker pool.
        self._batches: weakref.WeakKeyDictionary[Executor, _Batches] = weakref.WeakKeyDictionary()
        #: Each decoding worker's read and plane buffers, reused from chunk to chunk.
        self._scratch = _Scratch()
        self._by_key = {t.key: (i, t) for i, t in enumerate(self.index.tensors)}
        self._aliases: dict[str, int] | None = None
        #: A delta file's base (delta.py), opened when a tensor first needs it.
        self.chain = BaseChain(self.index.base, self.path, type(self), storage_options) if self.index.base is not None else None

    # -- index -----------------------------------------------------------------------------
    def _read_at(self, offset: int, size: int) -> bytes:
        with self._io_lock:
            self._stream.seek(offset)
            data = self._stream.read(size)
        if len(data) != size:
            raise FormatError(f"{self.path}: file is truncated (wanted {size} bytes at {offset}, got {len(data)})")
        return data

    def _read_index(self) -> Index:
        size = self._size
        head = self._read_at(0, min(size, HEAD_BYTES))
        kind = kind_of(head, size)
        # Files written since the guard start with it (docs/format.md "The guard"), earlier ones
        # with the magic; offsets in the index are from the file's start either way.
        start = len(GUARD) if kind == NVCOMP and head[:6] != MAGIC[:6] else 0
        if size < start + len(MAGIC) + FOOTER.size:
            raise FormatError(f"{self.path}: {size} bytes is too small to be a checkpoint (truncated?)")
        if magic_offset(head) != start or kind != NVCOMP:
            # A damaged guard can look like another kind's first bytes; our footer tells.
            if kind == NVCOMP or self._read_at(size - len(FOOTER_MAGIC), len(FOOTER_MAGIC)) == FOOTER_MAGIC:
                raise FormatError(
                    f"{self.path}: an nvcomp-checkpoint file whose header is damaged (its guard or magic); "
                    "restore it from another copy"
                )
            raise FormatError(f"{self.path}: {_not_ours(kind)}")
        head = head[start:]
        if head[6] > READ_VERSIONS[-1]:
            raise FormatError(
                f"{self.path}: format version {head[6]}; this nvcomp-checkpoint reads versions up to {READ_VERSIONS[-1]}. Upgrade to read it."
            )
        if head[6] not in READ_VERSIONS or head[7] != MAGIC[7]:
            raise FormatError(
                f"{self.path}: damaged header (version byte {head[6]}, reserved byte {head[7]}; expected "
                f"{MAGIC[6]} and {MAGIC[7]}); restore the file from another copy"
            )
        data_start = start + len(MAGIC)
        offset, isize, digest = unpack_footer(self._read_at(size - FOOTER.size, FOOTER.size), size, self.path, data_start)
        data = self._read_at(offset, isize)
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise ChecksumError(f"{self.path}: the index is corrupt (checksum mismatch)")
        #: The footer's digest of the index: the file's identity, which a delta of it records.
        self.index_xxh3 = digest
        index = Index.from_json_bytes(data, offset, self.path, data_start)
        if index.version != head[6]:
            raise FormatError(
                f"{self.path}: the header says format version {head[6]}, the index {index.version}; the file is damaged"
            )
        return index

    # -- queries ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Keys of every tensor, as ``"optimizer/state/0/exp_avg"``.

        A tensor stored once but reached by several paths (tied weights) is listed under each.
        """
        return list(self._by_key) + list(self._alias_keys())

    def entry(self, key: str) -> TensorEntry:
        found = self._by_key.get(key)
        if found is not None:
            return found[1]
        alias = self._alias_keys().get(key)
        if alias is not None:
            return self.index.tensors[alias]
        raise KeyError(f"{self.path}: no tensor {key!r}; see reader.keys()")

    def _alias_keys(self) -> dict[str, int]:
        """Keys of the further paths to tensors stored once (tied weights), from the object tree."""
        if self._aliases is None:
            aliases: dict[str, int] = {}
            stored = self.index.skeleton
            # The tree is read only for this; a tree that a weights-only load refuses has no
            # aliases to offer (load(weights_only=False) still restores them).
            # A damaged tree (checksum mismatch) is reported by load() and verify(); the tensors
            # it does not hold stay listed and readable here. A tree whose checksum holds but
            # that breaks the format's rules (not a torch.save archive, shared or too deep
            # containers, a reference to no tensor) was made so: refused, as load() refuses it.
            self._check_size(stored.raw_size, "the object tree")
            try:
                skeleton = decode_skeleton(self._read_frame_bytes(stored, "the object tree"), weights_only=True, where=self.path)
            except (ChecksumError, UnsafeCheckpointError):
                skeleton = None
            first_path: set[int] = set()
            used = set(self._by_key)
            for path, index in tensor_paths(skeleton, self.path, len(self.index.tensors)):
                if index not in first_path:
                    first_path.add(index)  # the path the index names the tensor by
                    continue
                if 0 <= index < len(self.index.tensors):
                    # Named as the writer names paths that print alike: "#2", "#3" ... appended.
                    aliases[unique_key("/".join(str(p) for p in path), used)] = index
            self._aliases = aliases
        return self._aliases

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.index.metadata)

    def summary(self) -> ComponentSummary:
        """Per-component tensors, raw and stored bytes, codecs and filters.

        A dict of :class:`ComponentStats` by component that prints as the table
        ``SaveReport.table()`` prints.
        """
        stats: dict[str, ComponentStats] = {}
        for t in self.index.tensors:
            stats[t.component] = stats.get(t.component, ComponentStats()).add(t.nbytes, t.stored_bytes, t.codec.label, t.filter)
        order = [c.value for c in Component]
        ordered = {k: stats[k] for k in sorted(stats, key=lambda k: order.index(k) if k in order else len(order))}
        return ComponentSummary(ordered, self.raw_bytes, self.file_bytes)

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.index.tensors)

    @property
    def file_bytes(self) -> int:
        return self._size

    # -- tensors ---------------------------------------------------------------------------
    def read(self, key: str, map_location: MapLocation = None) -> torch.Tensor:
        """Decode one tensor (bit-identical to what was saved)."""
        entry = self.entry(key)
        self._check_size(self.decoded_bytes(entry), f"tensor {entry.key!r}")
        device = _check_device(_target_device(entry, map_location), entry, self.path)
        with worker_pool(self.workers, "nvckpt-decode") as pool:
            return self._finish(entry, self._decode(entry, device, pool), map_location)

    def decoded_bytes(self, entry: TensorEntry) -> int:
        """Bytes decoded to read ``entry``: its own, and for a delta tensor as many again per file of
        the chain below this one (each holds a tensor of the same size that the values build on;
        the chain's recorded depth, which the reader checks file by file, bounds it)."""
        if entry.delta is None or self.index.base is None:
            return entry.nbytes
        return entry.nbytes * (1 + min(self.index.base.depth, MAX_CHAIN_DEPTH))

    def read_component(self, component: str, map_location: MapLocation = None) -> dict[str, torch.Tensor]:
        """Every tensor of one component (``"weights"``, ``"exp_avg"`` ...), by key (``max_bytes``: their sum)."""
        keys = [t.key for t in self.index.tensors if t.component == component]
        return dict(self.read_many(keys, map_location))

    def load(self, map_location: MapLocation = None, *, weights_only: bool = True) -> Any:
        """The whole tree, as it was saved."""
        self._check_size(self.index.skeleton.raw_size + sum(map(self.decoded_bytes, self.index.tensors)), "the whole checkpoint")
        skeleton = decode_skeleton(
            self._read_frame_bytes(self.index.skeleton, "the object tree"), weights_only=weights_only, where=self.path
        )
        count = len(self.index.tensors)
        check_skeleton(skeleton, count, self.path)  # before any tensor is decoded
        tensors: list[torch.Tensor] = []
        with worker_pool(self.workers, "nvckpt-decode") as pool:
            # Tensors are decoded ahead of the one being finished, so that the many small
            # (one-chunk) tensors of a model keep every worker busy; the compressed bytes read
            # ahead are bounded.
            pending: deque[tuple[TensorEntry, Callable[[], torch.Tensor], int]] = deque()
            ahead = 0
            for entry in self.index.tensors:
                finish = self._start_decode(entry, _check_device(_target_device(entry, map_location), entry, self.path), pool)
                pending.append((entry, finish, entry.stored_bytes))
                ahead += entry.stored_bytes
                while pending and (ahead > READ_AHEAD_BYTES or len(pending) > READ_AHEAD_TENSORS):
                    done, finish, size = pending.popleft()
                    tensors.append(self._finish(done, finish(), map_location))
                    ahead -= size
            while pending:
                done, finish, _ = pending.popleft()
                tensors.append(self._finish(done, finish(), map_location))
        return unflatten(skeleton, lambda i: _lookup(tensors, i, self.path), where=self.path, tensor_count=count)

    def _check_size(self, nbytes: int, what: str) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise SizeLimitError(
                f"{self.path}: {what} decodes to {nbytes} bytes, over max_bytes={self.max_bytes}; "
                "raise max_bytes if you trust the file, or read single tensors with open()",
                needed=nbytes,
                limit=self.max_bytes,
            )

    def read_many(self, keys: list[str], map_location: MapLocation = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` for each of ``keys`` in that order, decoded ahead on one worker pool
        (as :meth:`load` does), for callers that want many tensors but not the whole tree.

        Raises:
            SizeLimitError: Before the first tensor is decoded, when ``keys`` add up to more than
                ``max_bytes`` (each counted as by :meth:`read`, once per time it is asked for).
        """
        entries = [self.entry(key) for key in keys]
        self._check_size(sum(map(self.decoded_bytes, entries)), f"reading {len(entries)} tensors")
        return self._read_many(keys, entries, map_location)

    def _read_many(
        self, keys: list[str], entries: list[TensorEntry], map_location: MapLocation
    ) -> Iterator[tuple[str, torch.Tensor]]:
        with worker_pool(self.workers, "nvckpt-decode") as pool:
            pending: deque[tuple[str, TensorEntry, Callable[[], torch.Tensor], int]] = deque()
            ahead = 0
            for key, entry in zip(keys, entries):
                device = _check_device(_target_device(entry, map_location), entry, self.path)
                pending.append((key, entry, self._start_decode(entry, device, pool), entry.stored_bytes))
                ahead += entry.stored_bytes
                while pending and (ahead > READ_AHEAD_BYTES or len(pending) > READ_AHEAD_TENSORS):
                    done_key, done, finish, size = pending.popleft()
                    ahead -= size
                    yield done_key, self._finish(done, finish(), map_location)
            while pending:
                done_key, done, finish, _ = pending.popleft()
                yield done_key, self._finish(done, finish(), map_location)

    def verify(self) -> Iterator[tuple[TensorEntry, Exception | None]]:
        """Check the object tree as ``load`` does, then decode every tensor on the CPU.

        The tree is decoded with the weights-only rules and every tensor reference in it is
        checked against the index, so a file passes exactly when ``load`` accepts it. A tensor
        is decoded chunk by chunk, its chunks discarded once checked: memory holds a chunk per
        worker, whatever the tensor's size. A delta tensor is rebuilt as ``read`` does (its
        values are checked against the digest of its base's), in memory for it and its bases.

        Yields:
            ``(entry, error or None)`` for each tensor.

        Raises:
            CheckpointError: The object tree is damaged, forged or holds objects that a
                weights-only load refuses (checked before any tensor).
            SizeLimitError: The tree and the tensors decode to more than ``max_bytes``
                (checked before anything is decoded).
        """
        self._check_size(self.index.skeleton.raw_size + sum(map(self.decoded_bytes, self.index.tensors)), "the whole checkpoint")
        skeleton = decode_skeleton(
            self._read_frame_bytes(self.index.skeleton, "the object tree"), weights_only=True, where=self.path
        )
        check_skeleton(skeleton, len(self.index.tensors), self.path)
        del skeleton
        with worker_pool(self.workers, "nvckpt-decode") as pool:
            for entry in self.index.tensors:
                try:
                    if entry.delta is None and has_cpu_decoder(entry.codec.id):
                        self._verify_chunks(entry, pool)
                    else:
                        device = (
                            torch.device("cpu")
                            if has_cpu_decoder(entry.codec.id) or not gpu_available()
                            else torch.device("cuda")
                        )
                        self._decode(entry, device, pool)
                except CheckpointError as exc:
                    yield entry, exc
                else:
                    yield entry, None

    def _verify_chunks(self, entry: TensorEntry, pool: Executor) -> None:
        """Read, checksum and decode ``entry``'s chunks, one per worker at a time, keeping none."""
        codec = cpu_codec(entry.codec.id)

        if self._fd is None:
            self._check_pieces(entry)

        def check(i: int, frames: tuple[Frame, ...]) -> None:
            for p, (f, data) in enumerate(zip(frames, self._chunk_data(frames))):
                self._checked_frame(entry, codec, i, p, f, data)

        in_flight: deque[Future[None]] = deque()
        try:
            for i, (_, _, frames) in enumerate(entry.chunks()):
                in_flight.append(pool.submit(check, i, frames))
                if len(in_flight) >= self.workers:
                    in_flight.popleft().result()
            while in_flight:
                in_flight.popleft().result()
        finally:
            for fut in in_flight:  # after a failure: the chunks not started are not decoded
                fut.cancel()

    def _check_frame(self, entry: TensorEntry, i: int, p: int, f: Frame, data: Any) -> None:
        """Refuse frame ``p`` of chunk ``i`` of ``entry`` unless its stored bytes ``data`` match its checksum."""
        if xxhash.xxh3_64_intdigest(data) != f.xxh:
            raise ChecksumError(
                f"{self.path}: tensor {entry.key!r}, chunk {i}"
                + (f" (byte plane {p})" if entry.planes > 1 else "")
                + f" at byte {f.offset} is corrupt (checksum mismatch); restore the file from another copy"
            )

    def _undecodable(self, entry: TensorEntry, i: int, p: int, f: Frame, exc: FormatError) -> FormatError:
        return FormatError(
            f"{self.path}: tensor {entry.key!r}, chunk {i}"
            + (f" (byte plane {p})" if entry.planes > 1 else "")
            + f" at byte {f.offset} does not decode: {exc}; the index or the frame is corrupt"
        )

    def _checked_frame(self, entry: TensorEntry, codec: Any, i: int, p: int, f: Frame, data: Any) -> Any:
        """Frame ``p`` of chunk ``i`` of ``entry`` (its stored bytes ``data``), checksummed and decoded."""
        self._check_frame(entry, i, p, f, data)
        try:
            return data if f.is_raw else codec.decode(data, f.raw_size)
        except FormatError as exc:
            raise self._undecodable(entry, i, p, f, exc) from exc

    def _checked_frame_into(self, entry: TensorEntry, codec: Any, i: int, p: int, f: Frame, data: Any, out: np.ndarray) -> None:
        """:meth:`_checked_frame` decoded into ``out`` (``f.raw_size`` bytes) instead of a new buffer."""
        data = data[: f.size]
        self._check_frame(entry, i, p, f, data)
        target = out.data
        if target.nbytes != f.raw_size:
            raise FormatError(f"{self.path}: tensor {entry.key!r}, chunk {i}: frame of {f.raw_size} bytes for {target.nbytes}")
        try:
            if f.is_raw:
                if len(data) != f.raw_size:
                    raise FormatError(f"raw frame holds {len(data)} bytes, the index says {f.raw_size}")
                target[:] = data
            else:
                codec.decode_into(data, target)
        except FormatError as exc:
            raise self._undecodable(entry, i, p, f, exc) from exc

    def _chunk_data(self, frames: tuple[Frame, ...]) -> list[memoryview]:
        """The stored bytes of each of ``frames`` (one chunk's), read in this (worker) thread."""
        if self._fd is None:
            return self._frames_data(frames)
        first = min(f.offset for f in frames)
        size = max(f.offset + f.size for f in frames) - first
        stored = sum(f.size for f in frames)
        if size == stored:  # back to back, as written: one read
            view = self._pread(first, size)
            return [view[f.offset - first : f.offset - first + f.size] for f in frames]
        # Planes apart (a forged index): each read on its own, never the bytes between them, so
        # the buffer holds the chunk's stored bytes, not a span that may be the whole file.
        view = self._scratch.array("read", stored).data
        out = []
        at = 0
        for f in frames:
            out.append(self._pread_into(view[at : at + f.size], f.offset))
            at += f.size
        return out

    def _frames_data(self, frames: list[Frame] | tuple[Frame, ...]) -> list[memoryview]:
        """The stored bytes of each of ``frames``, from storage other than a local file.

        Frames stored back to back are read in one request of at most :data:`REMOTE_READ_BYTES`
        (or one frame, if larger); no byte between frames is read, so a forged index cannot make
        a request span the file.
        """
        order = sorted(range(len(frames)), key=lambda k: frames[k].offset)
        out: list[memoryview] = [memoryview(b"")] * len(frames)
        k = 0
        while k < len(order):
            start = end = frames[order[k]].offset
            j = k
            while j < len(order):
                f = frames[order[j]]
                if f.offset != end or (j > k and f.offset + f.size - start > REMOTE_READ_BYTES):
                    break
                end += f.size
                j += 1
            view = memoryview(self._read_range(start, end - start))
            for m in order[k:j]:
                f = frames[m]
                out[m] = view[f.offset - start : f.offset - start + f.size]
            k = j
        return out

    def _read_range(self, offset: int, size: int) -> Any:
        """``size`` bytes at ``offset`` of a file that is not local: a ranged request of its own
        where the storage takes them (thread-safe), else a read of the stream under the lock."""
        if self._fetch is None:
            return self._read_at(offset, size)
        if size == 0:
            return b""
        try:
            data = self._fetch(offset, offset + size)
        except OSError as exc:
            # s3fs.utils.FileExpired: the object's ETag is no longer the one opened. A back end's
            # own class, matched by name, so that the reader imports no back end.
            if type(exc).__name__ != "FileExpired":
                raise
            raise CheckpointError(
                f"{self.path}: the file was replaced or changed since it was opened (reading {size} bytes at "
                f"{offset}); open it again"
            ) from exc
        if len(data) != size:
            raise FormatError(f"{self.path}: file is truncated (wanted {size} bytes at {offset}, got {len(data)})")
        return data

    def _check_pieces(self, entry: TensorEntry) -> None:
        """Refuse a tensor whose frames lie in more separate places of the file than
        :data:`MIN_PIECE_BYTES` allows: each costs a request where reads are requests."""
        frames = sorted(entry.frames, key=lambda f: f.offset)
        pieces = 1 + sum(1 for a, b in zip(frames, frames[1:]) if b.offset != a.offset + a.size)
        if pieces > 1 + entry.stored_bytes // MIN_PIECE_BYTES:
            raise FormatError(
                f"{self.path}: tensor {entry.key!r}: its {len(frames)} frames ({entry.stored_bytes} bytes) lie in "
                f"{pieces} separate places of the file (the writer stores a tensor's frames back to back), which "
                "would take a read request each; the index is corrupt or forged"
            )

    def _batches_of(self, pool: Executor) -> _Batches:
        with self._io_lock:
            batches = self._batches.get(pool)
            if batches is None:
                batches = self._batches[pool] = _Batches(pool, self._frames_data)
            return batches

    def _pread(self, offset: int, size: int) -> memoryview:
        """``size`` bytes at ``offset`` of the local file, in this thread's read buffer."""
        return self._pread_into(self._scratch.array("read", size).data, offset)

    def _pread_into(self, view: memoryview, offset: int) -> memoryview:
        """``view`` filled with the local file's bytes at ``offset``."""
        assert self._fd is not None
        size = len(view)
        done = 0
        while done < size:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise FormatError(f"{self.path}: file is truncated (wanted {size} bytes at {offset}, got {done})")
            done += got
        return view

    def _read_frame_bytes(self, frame: Frame, what: str) -> bytes:
        data = self._read_at(frame.offset, frame.size)
        if xxhash.xxh3_64_intdigest(data) != frame.xxh:
            raise ChecksumError(f"{self.path}: {what} is corrupt (checksum mismatch at byte {frame.offset})")
        if frame.is_raw:
            return data
        try:
            return bytes(cpu_codec("zstd").decode(memoryview(data), frame.raw_size))
        except FormatError as exc:
            raise FormatError(f"{self.path}: {what} at byte {frame.offset} does not decode: {exc}") from exc

    def _decode(self, entry: TensorEntry, device: torch.device, pool: Executor) -> torch.Tensor:
        return self._start_decode(entry, device, pool)()

    def _start_decode(self, entry: TensorEntry, device: torch.device, pool: Executor) -> Callable[[], torch.Tensor]:
        """Read ``entry``'s frames and queue their decoding; the returned call waits and gives the tensor."""
        if entry.delta is None or self.chain is None:
            return self._start_decode_stored(entry, device, pool)
        chain = self.chain
        if (device.type == "cuda" and gpu_available()) or not has_cpu_decoder(entry.codec.id):
            # On the GPU the XOR and the difference are undone on the device, once the tensor is decoded.
            finish = self._start_decode_stored(entry, device, pool)
            return lambda: chain.undo(entry, finish())
        # On the CPU each decoding worker undoes its own chunk's XOR and difference (in cache, in parallel).
        return self._start_decode_stored(entry, device, pool, after_chunk=chain.chunk_undoer(entry))

    def _start_decode_stored(
        self, entry: TensorEntry, device: torch.device, pool: Executor, after_chunk: Callable[..., None] | None = None
    ) -> Callable[[], torch.Tensor]:
        """:meth:`_start_decode` of the bytes as stored (a delta tensor's before its transforms are undone)."""
        if self._fd is None and entry.frames:
            self._check_pieces(entry)  # before a request is made
        if device.type == "cuda" and gpu_available():
            gpu_tensor = self._decode_gpu(entry, device)
            return lambda: gpu_tensor
        if not has_cpu_decoder(entry.codec.id) and gpu_available():
            # A GPU-only codec asked for elsewhere: decode on the GPU, then move the result.
            decoded = self._decode_gpu(entry, torch.device("cuda", torch.cuda.current_device()))
            return lambda: decoded.to(device)
        if not has_cpu_decoder(entry.codec.id):
            raise CodecUnavailableError(
                f"{self.path}: tensor {entry.key!r} was compressed with {entry.codec.id!r}, an nvCOMP codec "
                f"with no CPU decoder; load it on a CUDA machine with the cu12 (or cu13) extra ({install_hint('cu12')}), "
                "then convert it to a portable codec (nvckpt compress --policy zstd)."
            )
        flat = _allocate(entry, self.path)
        out = flat.numpy()
        futures: list[Future[None]] = []
        flush: Callable[[], None] | None = None
        if entry.frames:
            codec = cpu_codec(entry.codec.id)
            filt = plane_filter(entry.filter, entry.width, entry.rotate)
            planes = entry.planes
            scratch = self._scratch

            def decode_chunk(i: int, start: int, length: int, frames: tuple[Frame, ...], datas: list[memoryview]) -> None:
                dest = out[start : start + length]
                if planes == 1:
                    # Straight into the tensor's memory: no intermediate buffer.
                    self._checked_frame_into(entry, codec, i, 0, frames[0], datas[0], dest)
                else:
                    # Compressed planes are decoded into this worker's scratch buffer, raw planes
                    # stay where they were read; one pass (ByteplaneFilter.join, rotations undone
                    # in it) then writes the tensor's memory.
                    buf = scratch.array("planes", sum(f.raw_size for f in frames if not f.is_raw))
                    raws: list[np.ndarray] = []
                    at = 0
                    for p, (f, data) in enumerate(zip(frames, datas)):
                        if f.is_raw:
                            self._check_frame(entry, i, p, f, data)
                            raws.append(np.frombuffer(data, dtype=np.uint8))
                        else:
                            target = buf[at : at + f.raw_size]
                            at += f.raw_size
                            self._checked_frame_into(entry, codec, i, p, f, data, target)
                            raws.append(target)
                    filt.join(dest, raws)
                if after_chunk is not None:
                    after_chunk(start, frames, dest)

            if self._fd is not None:
                # A local file: each worker reads its chunk (os.preadv into a buffer of its own, no
                # lock), so reading overlaps decoding and memory holds a chunk per worker.
                def read_and_decode(i: int, start: int, length: int, frames: tuple[Frame, ...]) -> None:
                    decode_chunk(i, start, length, frames, self._chunk_data(frames))

                futures = [pool.submit(read_and_decode, i, s, n, fr) for i, (s, n, fr) in enumerate(entry.chunks())]
            else:
                # Other storage: the workers read consecutive chunks, of this and the next tensors,
                # in requests of up to REMOTE_READ_BYTES (_Batches).
                batches = self._batches_of(pool)
                futures = [
                    batches.add(fr, n, functools.partial(decode_chunk, i, s, n, fr))
                    for i, (s, n, fr) in enumerate(entry.chunks())
                ]
                flush = functools.partial(batches.flush, through=batches.added)

        def finish() -> torch.Tensor:
            if flush is not None:
                flush()  # where this tensor's last chunks are still gathered
            for fut in futures:
                fut.result()
            t = _typed(flat, entry)
            return t if device.type == "cpu" else t.to(device)

        return finish

    def _decode_gpu(self, entry: TensorEntry, device: torch.device) -> torch.Tensor:
        """Decode on ``device`` in groups of chunks, so GPU memory holds one group's frames at a time."""
        out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
        planes = entry.planes
        filt = plane_filter(entry.filter, entry.width, entry.rotate)
        chunks = entry.chunks()
        per_group = max(1, _GPU_GROUP_BYTES // max(1, entry.chunk_bytes))
        codec = gpu_codec(entry.codec.id, None, device) if entry.codec.id != "none" else None
        for g in range(0, len(chunks), per_group):
            group = chunks[g : g + per_group]
            frames = [f for _, _, fr in group for f in fr]
            base = min(f.offset for f in frames)
            span = self._read_at(base, max(f.offset + f.size for f in frames) - base)
            view = memoryview(span)
            for j, f in enumerate(frames):
                if xxhash.xxh3_64_intdigest(view[f.offset - base : f.offset - base + f.size]) != f.xxh:
                    # The same words as the CPU path: tensor, chunk, plane, what to do.
                    raise ChecksumError(
                        f"{self.path}: tensor {entry.key!r}, chunk {g + j // planes}"
                        + (f" (byte plane {j % planes})" if planes > 1 else "")
                        + f" at byte {f.offset} is corrupt (checksum mismatch); restore the file from another copy"
                    )
            host = torch.frombuffer(bytearray(span), dtype=torch.uint8).pin_memory()
            dev_span = host.to(device, non_blocking=True)
            pieces = [dev_span[f.offset - base : f.offset - base + f.size] for f in frames]
            todo = [i for i, f in enumerate(frames) if not f.is_raw]
            if todo and codec is not None:
                # The host bytes let zstd frames be checked before nvCOMP sees them (no copy back).
                on_host = [view[frames[i].offset - base : frames[i].offset - base + frames[i].size] for i in todo]
                results = codec.decode_batch([pieces[i] for i in todo], [frames[i].raw_size for i in todo], host_frames=on_host)
                for i, r in zip(todo, results):
                    pieces[i] = r
            for k, (start, length, _) in enumerate(group):
                parts = pieces[k * planes : (k + 1) * planes]
                target = out[start : start + length]
                target.copy_(filt.join_torch(parts) if planes > 1 else parts[0])
        return _typed(out, entry)

    def _finish(self, entry: TensorEntry, t: torch.Tensor, map_location: MapLocation) -> torch.Tensor:
        if callable(map_location) and not isinstance(map_location, Mapping):
            t = self._apply_map_location(entry, t, map_location)
        # Only float and complex tensors can require grad (an index claiming more is ignored).
        differentiable = t.is_floating_point() or t.is_complex()
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad and differentiable)
        if entry.requires_grad and differentiable:
            t.requires_grad_(True)
        return t

    def _apply_map_location(self, entry: TensorEntry, t: torch.Tensor, map_location: Callable[..., Any]) -> torch.Tensor:
        """``torch.load``'s rule: the storage the callable returns is used; ``None`` means the default."""
        storage = t.untyped_storage()
        moved = map_location(storage, entry.device)
        if moved is None:
            default = _check_device(_target_device(entry, None), entry, self.path)
            return t if default == t.device else t.to(default)
        if isinstance(moved, torch.TypedStorage):
            moved = moved._untyped_storage
        if not isinstance(moved, torch.UntypedStorage):
            raise CheckpointError(
                f"{self.path}: map_location returned {type(moved).__name__} for tensor {entry.key!r}; "
                "it must return a storage (as for torch.load) or None"
            )
        if moved is storage:
            return t
        if moved.nbytes() != storage.nbytes():
            raise CheckpointError(
                f"{self.path}: map_location returned a storage of {moved.nbytes()} bytes for tensor {entry.key!r}, "
                f"which has {storage.nbytes()}"
            )
        return torch.empty(0, dtype=t.dtype, device=moved.device).set_(moved, 0, t.shape, t.stride())

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()
        self._stream.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _not_ours(kind: str) -> str:
    """What a file that is not ours is, and what reads it."""
    if kind == TORCH:
        return (
            "a torch.save file, not an nvcomp-checkpoint file: nc.load(path) reads it (nc.open reads only "
            "compressed files; `nvckpt compress` converts it)"
        )
    if kind == SAFETENSORS:
        return (
            "a safetensors file, not an nvcomp-checkpoint file: read it with safetensors.torch.load_file "
            "(`nvckpt compress` converts it)"
        )
    return "not an nvcomp-checkpoint file (it does not start with the NVCKPT magic); `nvckpt inspect` says what it is"


def _allocate(entry: TensorEntry, where: str) -> torch.Tensor:
    """The result's memory: torch's allocator, not numpy's. numpy advises huge pages for large arrays,
    and where the kernel compacts memory on such a fault (transparent_hugepage/defrag "madvise", the
    common default) a fresh 1.5 GiB result took 0.22 to 11.9 s against a steady 0.9-1.2 s
    (benchmarks/README.md, scale sweep). ``THP_MEM_ALLOC_ENABLE=1`` asks torch for huge pages."""
    try:
        return torch.empty(entry.nbytes, dtype=torch.uint8)
    except (MemoryError, RuntimeError) as exc:
        # A legitimate huge tensor and a forged index look alike here; say both.
        raise CheckpointError(
            f"{where}: tensor {entry.key!r} needs {entry.nbytes} bytes of memory, which cannot be "
            "allocated here; read other tensors with nvcomp_checkpoint.open(), or check where the file came from"
        ) from exc


def _local_fd(storage: Storage, stream: Any) -> int | None:
    """The file descriptor of a local file opened for reading, where ``os.preadv`` can read it."""
    if not storage.is_local or not hasattr(os, "preadv"):
        return None
    try:
        return int(stream.fileno())
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        return None


class _Batches:
    """Chunks to decode, gathered in the order they are added (that of the file) into batches of
    up to :data:`REMOTE_READ_BYTES` raw bytes; a worker reads a batch's frames (:meth:`CheckpointReader._frames_data`:
    one request where they are stored back to back) and decodes its chunks.

    Used by the one thread that adds, as the worker pool it belongs to is.
    """

    def __init__(self, pool: Executor, read: Callable[[list[Frame]], list[memoryview]]) -> None:
        self.pool = pool
        self.read = read
        self.items: list[tuple[tuple[Frame, ...], Callable[[list[memoryview]], None], Future[None]]] = []
        self.raw = 0
        #: Chunks added and handed to workers so far.
        self.added = self.handed = 0

    def add(self, frames: tuple[Frame, ...], raw: int, job: Callable[[list[memoryview]], None]) -> Future[None]:
        """Queue ``job`` (called with the stored bytes of each of ``frames``, ``raw`` bytes decoded)."""
        if self.items and self.raw + raw > REMOTE_READ_BYTES:
            self.flush()
        fut: Future[None] = Future()
        self.items.append((frames, job, fut))
        self.raw += raw
        self.added += 1
        if self.raw >= REMOTE_READ_BYTES:
            self.flush()
        return fut

    def flush(self, through: int | None = None) -> None:
        """Hand the gathered chunks to a worker (only if the ``through``-th chunk added is among them:
        a tensor finished waits for its own chunks, the next tensors' small ones keep gathering)."""
        if self.items and (through is None or through > self.handed):
            items, self.items, self.raw = self.items, [], 0
            self.handed = self.added
            self.pool.submit(self._run, items)

    def _run(self, items: list[tuple[tuple[Frame, ...], Callable[[list[memoryview]], None], Future[None]]]) -> None:
        live = [item for item in items if item[2].set_running_or_notify_cancel()]
        try:
            datas = self.read([f for frames, _, _ in live for f in frames])
        except BaseException as exc:  # noqa: BLE001 - each chunk's future carries the read's failure
            for _, _, fut in live:
                fut.set_exception(exc)
            return
        at = 0
        for frames, job, fut in live:
            try:
                job(datas[at : at + len(frames)])
            except BaseException as exc:  # noqa: BLE001 - reported by the future, as pool.submit does
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            at += len(frames)


class _Scratch(threading.local):
    """Buffers of one thread, by name, grown to the largest size asked for and then reused."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, size: int) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.size < size:
            buf = self.buffers[name] = np.empty(size, dtype=np.uint8)
        return buf[:size]


def _typed(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """Reinterpret decoded bytes as the entry's dtype and shape."""
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype, device=flat.device)
    return flat.view(entry.dtype).reshape(entry.shape)


def _lookup(tensors: list[torch.Tensor], i: int, where: str) -> torch.Tensor:
    if type(i) is not int or not 0 <= i < len(tensors):
        raise FormatError(f"{where}: the object tree refers to tensor {i}, the index holds {len(tensors)}")
    return tensors[i]
