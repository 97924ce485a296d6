"""Reads checkpoint files: the index first, then tensors on demand, decoded in parallel.

Every frame's checksum is checked before it reaches a decoder, and every size in the index is
checked against the file before anything is allocated.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Callable, Iterator, Mapping

import numpy as np
import torch
import xxhash

from .codecs import cpu_codec, gpu_available, gpu_codec, has_cpu_decoder
from .errors import ChecksumError, CodecUnavailableError, FormatError
from .filters import ByteplaneFilter
from .format.layout import FOOTER, MAGIC, Frame, Index, TensorEntry, unpack_footer
from .format.skeleton import decode_skeleton, unflatten
from .report import ComponentStats
from .storage import Storage, storage_for
from .writer import default_workers

__all__ = ["CheckpointReader", "MapLocation", "is_checkpoint_file"]

MapLocation = None | str | torch.device | Mapping[str, str] | Callable[..., Any]


def is_checkpoint_file(stream: IO[bytes]) -> bool:
    """True if the stream starts with this format's magic (the stream is rewound)."""
    head = stream.read(len(MAGIC))
    stream.seek(0)
    return head[:6] == MAGIC[:6]


def _target_device(entry: TensorEntry, map_location: MapLocation) -> torch.device:
    saved = entry.device
    if map_location is None:
        # As torch.load does, tensors return to the device they were saved from; unlike
        # torch.load, a file saved on a GPU still loads (on the CPU) where there is none.
        if saved.startswith("cuda") and not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device(saved)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, Mapping):
        return torch.device(map_location.get(saved, saved))
    return torch.device("cpu")  # callables are applied after decoding, as torch.load does


class CheckpointReader:
    """A checkpoint file opened for reading; use as a context manager.

    Args:
        path: Local path or fsspec URL.
        storage_options: Passed to fsspec for URLs.
        workers: Decompression threads.
    """

    def __init__(self, path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, workers: int | None = None) -> None:
        self.path = os.fspath(path)
        self.storage: Storage
        self.storage, self._spath = storage_for(self.path, storage_options)
        self.workers = workers or default_workers()
        try:
            self._stream = self.storage.open_read(self._spath)
        except FileNotFoundError as exc:
            raise FormatError(f"{self.path}: no such checkpoint file") from exc
        except IsADirectoryError as exc:
            raise FormatError(f"{self.path}: is a directory, not a checkpoint file") from exc
        try:
            self.index = self._read_index()
        except BaseException:
            self._stream.close()
            raise
        self._by_key = {t.key: (i, t) for i, t in enumerate(self.index.tensors)}

    # -- index -----------------------------------------------------------------------------
    def _read_at(self, offset: int, size: int) -> bytes:
        self._stream.seek(offset)
        data = self._stream.read(size)
        if len(data) != size:
            raise FormatError(f"{self.path}: file is truncated (wanted {size} bytes at {offset}, got {len(data)})")
        return data

    def _read_index(self) -> Index:
        size = self.storage.size(self._spath)
        if size < len(MAGIC) + FOOTER.size:
            raise FormatError(f"{self.path}: {size} bytes is too small to be a checkpoint (truncated?)")
        head = self._read_at(0, len(MAGIC))
        if head[:6] != MAGIC[:6]:
            raise FormatError(f"{self.path}: not an nvcomp-checkpoint file (no NVCKPT magic)")
        if head != MAGIC:
            raise FormatError(f"{self.path}: format version {head[6]}; this nvcomp-checkpoint reads version {MAGIC[6]}. Upgrade to read it.")
        offset, isize, digest = unpack_footer(self._read_at(size - FOOTER.size, FOOTER.size), size, self.path)
        data = self._read_at(offset, isize)
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise ChecksumError(f"{self.path}: the index is corrupt (checksum mismatch)")
        return Index.from_json_bytes(data, offset, self.path)

    # -- queries ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Keys of every tensor, as ``"optimizer/state/0/exp_avg"``."""
        return list(self._by_key)

    def entry(self, key: str) -> TensorEntry:
        try:
            return self._by_key[key][1]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {key!r}; see reader.keys()") from None

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.index.metadata)

    def summary(self) -> dict[str, ComponentStats]:
        """Per-component tensors, raw and stored bytes, codecs and filters."""
        stats: dict[str, ComponentStats] = {}
        for t in self.index.tensors:
            stats[t.component] = stats.get(t.component, ComponentStats()).add(t.nbytes, t.stored_bytes, t.codec.id, t.filter)
        return stats

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.index.tensors)

    @property
    def file_bytes(self) -> int:
        return self.storage.size(self._spath)

    # -- tensors ---------------------------------------------------------------------------
    def read(self, key: str, map_location: MapLocation = None) -> torch.Tensor:
        """Decode one tensor (bit-identical to what was saved)."""
        entry = self.entry(key)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return self._finish(entry, self._decode(entry, _target_device(entry, map_location), pool), map_location)

    def read_component(self, component: str, map_location: MapLocation = None) -> dict[str, torch.Tensor]:
        """Every tensor of one component (``"weights"``, ``"exp_avg"`` ...), by key."""
        return {t.key: self.read(t.key, map_location) for t in self.index.tensors if t.component == component}

    def load(self, map_location: MapLocation = None, *, weights_only: bool = True) -> Any:
        """The whole tree, as it was saved."""
        skeleton = decode_skeleton(self._read_frame_bytes(self.index.skeleton, "the object tree"), weights_only=weights_only, where=self.path)
        tensors: list[torch.Tensor] = []
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for entry in self.index.tensors:
                t = self._decode(entry, _target_device(entry, map_location), pool)
                tensors.append(self._finish(entry, t, map_location))
        return unflatten(skeleton, lambda i: _lookup(tensors, i, self.path))

    def verify(self) -> Iterator[tuple[TensorEntry, Exception | None]]:
        """Decode every tensor on the CPU; yields ``(entry, error or None)`` for each."""
        self._read_frame_bytes(self.index.skeleton, "the object tree")
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for entry in self.index.tensors:
                try:
                    device = torch.device("cpu") if has_cpu_decoder(entry.codec.id) or not gpu_available() else torch.device("cuda")
                    self._decode(entry, device, pool)
                except (FormatError, CodecUnavailableError) as exc:
                    yield entry, exc
                else:
                    yield entry, None

    def _read_frame_bytes(self, frame: Frame, what: str) -> bytes:
        data = self._read_at(frame.offset, frame.size)
        if xxhash.xxh3_64_intdigest(data) != frame.xxh:
            raise ChecksumError(f"{self.path}: {what} is corrupt (checksum mismatch at byte {frame.offset})")
        if frame.is_raw:
            return data
        return bytes(cpu_codec("zstd").decode(memoryview(data), frame.raw_size))

    def _span(self, entry: TensorEntry) -> tuple[int, bytes]:
        first = entry.frames[0].offset
        last = max(f.offset + f.size for f in entry.frames)
        return first, self._read_at(first, last - first)

    def _decode(self, entry: TensorEntry, device: torch.device, pool: ThreadPoolExecutor) -> torch.Tensor:
        if device.type == "cuda" and gpu_available():
            return self._decode_gpu(entry, device)
        if not has_cpu_decoder(entry.codec.id):
            raise CodecUnavailableError(
                f"{self.path}: tensor {entry.key!r} was compressed with {entry.codec.id!r}, an nvCOMP codec "
                "with no CPU decoder; load it on a CUDA machine with `pip install nvcomp-checkpoint[cu12]` "
                "(or [cu13]), then convert it to a portable codec (nvckpt compress --policy zstd)."
            )
        out = np.empty(entry.nbytes, dtype=np.uint8)
        if entry.frames:
            base, span = self._span(entry)
            view = memoryview(span)
            codec = cpu_codec(entry.codec.id)
            filt = ByteplaneFilter(entry.width)
            planes = entry.planes

            def decode_chunk(i: int, start: int, length: int, frames: tuple[Frame, ...]) -> None:
                dest = out[start : start + length]
                for p, f in enumerate(frames):
                    data = view[f.offset - base : f.offset - base + f.size]
                    if xxhash.xxh3_64_intdigest(data) != f.xxh:
                        raise ChecksumError(
                            f"{self.path}: tensor {entry.key!r}, chunk {i}"
                            + (f" (byte plane {p})" if planes > 1 else "")
                            + f" at byte {f.offset} is corrupt (checksum mismatch); restore the file from another copy"
                        )
                    raw = data if f.is_raw else codec.decode(data, f.raw_size)
                    if planes > 1:
                        filt.join_into(dest, p, raw)
                    else:
                        dest[:] = np.frombuffer(raw, dtype=np.uint8)

            futures = [pool.submit(decode_chunk, i, s, n, fr) for i, (s, n, fr) in enumerate(entry.chunks())]
            for fut in futures:
                fut.result()
        t = torch.from_numpy(out)
        t = _typed(t, entry)
        return t if device.type == "cpu" else t.to(device)

    def _decode_gpu(self, entry: TensorEntry, device: torch.device) -> torch.Tensor:
        out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
        if entry.frames:
            base, span = self._span(entry)
            for f in entry.frames:
                if xxhash.xxh3_64_intdigest(memoryview(span)[f.offset - base : f.offset - base + f.size]) != f.xxh:
                    raise ChecksumError(f"{self.path}: tensor {entry.key!r}: frame at byte {f.offset} is corrupt (checksum mismatch)")
            dev_span = torch.frombuffer(bytearray(span), dtype=torch.uint8).to(device)
            frames = [dev_span[f.offset - base : f.offset - base + f.size] for f in entry.frames]
            decoded: list[torch.Tensor] = list(frames)
            todo = [i for i, f in enumerate(entry.frames) if not f.is_raw]
            if todo and entry.codec.id != "none":
                codec = gpu_codec(entry.codec.id, None, device)
                results = codec.decode_batch([frames[i] for i in todo], [entry.frames[i].raw_size for i in todo])
                for i, r in zip(todo, results):
                    decoded[i] = r
            filt = ByteplaneFilter(entry.width)
            planes = entry.planes
            for ci, (start, length, _) in enumerate(entry.chunks()):
                parts = decoded[ci * planes : (ci + 1) * planes]
                out[start : start + length] = filt.join_torch(parts) if planes > 1 else parts[0]
        return _typed(out, entry)

    def _finish(self, entry: TensorEntry, t: torch.Tensor, map_location: MapLocation) -> torch.Tensor:
        if callable(map_location) and not isinstance(map_location, Mapping):
            moved = map_location(t.untyped_storage(), entry.device)
            if moved is not None and isinstance(moved, torch.UntypedStorage) and moved.device != t.device:
                t = torch.empty(0, dtype=t.dtype, device=moved.device).set_(moved, 0, t.shape, t.stride())
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        if entry.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _typed(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """Reinterpret decoded bytes as the entry's dtype and shape."""
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype, device=flat.device)
    return flat.view(entry.dtype).reshape(entry.shape)


def _lookup(tensors: list[torch.Tensor], i: int, where: str) -> torch.Tensor:
    if not 0 <= i < len(tensors):
        raise FormatError(f"{where}: the object tree refers to tensor {i}, the index holds {len(tensors)}")
    return tensors[i]
