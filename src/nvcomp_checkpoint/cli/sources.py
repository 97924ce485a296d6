"""The checkpoint layouts ``nvckpt`` reads: ours, ``torch.save``/Lightning, safetensors, directories.

A file's layout is sniffed from its first bytes, never from its name, and every layout is listed
as the same :class:`TensorInfo` rows, so inspect, bench and compress treat them all alike.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import boundedjson
from nvcomp_checkpoint.errors import CheckpointError, FormatError, UnsafeCheckpointError
from nvcomp_checkpoint.filetype import HEAD_BYTES, NVCOMP, OTHER, SAFETENSORS, TORCH, kind_of
from nvcomp_checkpoint.format.skeleton import flatten
from nvcomp_checkpoint.format.torchsave import check_torch_archive
from nvcomp_checkpoint.storage import is_temp_name, is_url, storage_for

from ._ui import default_max_bytes

__all__ = [
    "NVCOMP",
    "TORCH",
    "SAFETENSORS",
    "DIRECTORY",
    "OTHER",
    "NVC_SUFFIX",
    "TensorInfo",
    "Source",
    "sniff",
    "open_source",
    "iter_tensors",
    "dir_files",
    "require_safetensors",
]

DIRECTORY = "directory"

#: Suffix of a file converted inside a directory: ``optimizer.pt`` becomes ``optimizer.pt.nvc``.
NVC_SUFFIX = ".nvc"


_KNOWN = "an nvcomp-checkpoint file, a torch.save / Lightning .ckpt file, a .safetensors file or a checkpoint directory"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as listed by ``inspect`` and sampled by ``bench``.

    Attributes:
        key: Tree path joined by ``/`` (``optimizer/state/0/exp_avg``); the tensor name for safetensors.
        component: ``weights``, ``exp_avg``, ``exp_avg_sq``, ``gradients`` or ``other``.
        dtype: Dtype name without ``torch.``.
        shape: The tensor's shape.
        raw_bytes: Bytes of the elements.
        stored_bytes: Bytes the file spends on it (``raw_bytes`` for uncompressed layouts).
        codec: ``zstd:1`` style codec and level; ``-`` for uncompressed layouts.
        filter: ``byteplane`` / ``none``; ``-`` for uncompressed layouts.
    """

    key: str
    component: str
    dtype: str
    shape: tuple[int, ...]
    raw_bytes: int
    stored_bytes: int
    codec: str = "-"
    filter: str = "-"

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "component": self.component,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "codec": self.codec,
            "filter": self.filter,
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sniff(path: str) -> str:
    """The layout of ``path`` from its first bytes: one of the module's kind constants.

    Raises:
        FormatError: ``path`` does not exist.
    """
    if not is_url(path) and os.path.isdir(path):
        return DIRECTORY
    storage, spath = storage_for(path)
    try:
        size = storage.size(spath)
        with storage.open_read(spath) as f:
            head = f.read(HEAD_BYTES)
    except FileNotFoundError as exc:
        raise FormatError(f"{path}: no such file or directory") from exc
    except IsADirectoryError as exc:  # an fsspec "directory"
        raise FormatError(f"{path}: is a directory; only local directories are supported") from exc
    return kind_of(head, size)


def require_safetensors() -> Any:
    """The ``safetensors.torch`` module, or an error that says how to install it."""
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - safetensors is in the test environment
        raise CheckpointError("reading or writing .safetensors needs the safetensors package: `pip install safetensors`") from exc
    return safetensors.torch


def iter_tensors(obj: Any) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """Every tensor of a tree with its path, each stored tensor once: exactly what ``save`` writes."""
    return iter(flatten(obj)[1])


class Source:
    """One checkpoint file opened for listing, reading and converting its tensors.

    Use :func:`open_source`; close it (or use it as a context manager) when done.

    Attributes:
        path: The path as given.
        kind: The sniffed layout.
        file_bytes: Size of the file.
    """

    kind = OTHER

    def __init__(self, path: str, file_bytes: int) -> None:
        self.path = path
        self.file_bytes = file_bytes

    def tensors(self) -> list[TensorInfo]:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        """One tensor, on the CPU."""
        raise NotImplementedError

    def load(self) -> Any:
        """The whole tree, for conversion."""
        raise NotImplementedError

    @property
    def metadata(self) -> dict[str, Any]:
        return {}

    @property
    def raw_bytes(self) -> int:
        return sum(t.raw_bytes for t in self.tensors())

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class NvcompSource(Source):
    """A file written by :func:`nvcomp_checkpoint.save`."""

    kind = NVCOMP

    def __init__(self, path: str, trust: bool) -> None:
        self.reader = nc.open(path)
        super().__init__(path, self.reader.file_bytes)
        self.trust = trust

    def tensors(self) -> list[TensorInfo]:
        out = []
        for t in self.reader.index.tensors:
            level = f":{t.codec.level}" if t.codec.level is not None else ""
            out.append(
                TensorInfo(
                    t.key,
                    t.component,
                    _dtype_name(t.dtype),
                    tuple(t.shape),
                    t.nbytes,
                    t.stored_bytes,
                    f"{t.codec.id}{level}",
                    t.filter,
                )
            )
        return out

    def read(self, key: str) -> torch.Tensor:
        return self.reader.read(key, map_location="cpu")

    def load(self) -> Any:
        try:
            return self.reader.load(weights_only=not self.trust)
        except UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(f"{exc} (nvckpt: pass --trust)") from exc

    @property
    def metadata(self) -> dict[str, Any]:
        return self.reader.metadata

    @property
    def raw_bytes(self) -> int:
        return self.reader.raw_bytes

    def close(self) -> None:
        self.reader.close()


class TorchSource(Source):
    """A ``torch.save`` file: a bare state dict, a training checkpoint, a Lightning ``.ckpt``."""

    kind = TORCH

    def __init__(self, path: str, file_bytes: int, trust: bool) -> None:
        super().__init__(path, file_bytes)
        self.trust = trust
        self._tree: Any = None
        self._loaded = False
        self._by_key: dict[str, torch.Tensor] = {}
        self._infos: list[TensorInfo] = []

    def load(self) -> Any:
        if not self._loaded:
            self._tree = self._torch_load()
            self._loaded = True
            for where, t in iter_tensors(self._tree):
                key = "/".join(str(p) for p in where)
                self._by_key[key] = t
                nbytes = t.numel() * t.element_size() if t.layout == torch.strided else 0
                self._infos.append(
                    TensorInfo(key, nc.classify(where).value, _dtype_name(t.dtype), tuple(t.shape), nbytes, nbytes)
                )
        return self._tree

    def _torch_load(self) -> Any:
        weights_only = not self.trust
        if is_url(self.path):
            try:
                return nc.load(self.path, map_location="cpu", weights_only=weights_only)
            except UnsafeCheckpointError as exc:
                raise UnsafeCheckpointError(
                    f"{self.path}: holds Python objects that a weights-only load refuses; if you trust the file, pass --trust"
                ) from exc
        if weights_only:
            # The pickle scan nc.load runs first: what the weights-only unpickler would build but
            # the process cannot survive (a dict key of tuples 100,000 deep) is refused.
            storage, spath = storage_for(self.path)
            with storage.open_read(spath) as f:
                if f.read(4) == b"PK\x03\x04":
                    # Every tensor is handed to the writer whole: a view that spans more than the
                    # file holds and this machine's memory (a stride-0 view of 2**40 elements) is refused.
                    size = storage.size(spath)
                    check_torch_archive(f, size, self.path, max_bytes=max(size, default_max_bytes()))
        try:
            # mmap: a checkpoint larger than memory is listed and converted from the page cache.
            return torch.load(self.path, map_location="cpu", weights_only=weights_only, mmap=True)
        except pickle.UnpicklingError as exc:
            # torch's own text, not ours: torch raises a plain UnpicklingError for a refused object and
            # for a damaged pickle alike, with no type to tell them apart.
            if "Weights only load failed" in str(exc):
                raise UnsafeCheckpointError(
                    f"{self.path}: holds Python objects that a weights-only load refuses "
                    f"({_first_reason(exc)}); if you trust the file, pass --trust"
                ) from exc
            raise FormatError(f"{self.path}: not a readable torch.save file ({_one_line(exc)})") from exc
        except (RuntimeError, EOFError, ValueError, OSError) as exc:
            # torch's own text, not ours: torch.load(mmap=True) refuses a legacy file with a plain
            # RuntimeError, with no type of its own.
            if "mmap" in str(exc):
                # Legacy (non-zip) files cannot be memory-mapped; read them whole.
                return nc.load(self.path, map_location="cpu", weights_only=weights_only)
            raise FormatError(f"{self.path}: not a readable torch.save file ({_one_line(exc)})") from exc

    def tensors(self) -> list[TensorInfo]:
        self.load()
        return list(self._infos)

    def read(self, key: str) -> torch.Tensor:
        self.load()
        return self._by_key[key]


class SafetensorsSource(Source):
    """A ``.safetensors`` file (model weights only; no optimizer state, no tree)."""

    kind = SAFETENSORS

    def __init__(self, path: str, file_bytes: int) -> None:
        super().__init__(path, file_bytes)
        if is_url(path):
            raise CheckpointError(f"{path}: safetensors files are read from local paths only; copy it locally first")
        self._header = _safetensors_header(path, file_bytes)

    def tensors(self) -> list[TensorInfo]:
        out = []
        for key, meta in self._header.items():
            if key == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            component = nc.classify((key,)).value
            out.append(
                TensorInfo(
                    key,
                    component,
                    _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]),
                    tuple(meta["shape"]),
                    end - begin,
                    end - begin,
                )
            )
        return out

    def read(self, key: str) -> torch.Tensor:
        require_safetensors()
        from safetensors import safe_open

        try:
            with safe_open(self.path, framework="pt", device="cpu") as f:
                return f.get_tensor(key)
        except OSError:
            raise  # main names the file and the reason
        except Exception as exc:  # safetensors raises its own SafetensorError, and torch's errors for dtypes it lacks
            raise FormatError(f"{self.path}: cannot read tensor {key!r} ({_one_line(exc)})") from exc

    def load(self) -> Any:
        st = require_safetensors()
        try:
            return st.load_file(self.path, device="cpu")
        except OSError:
            raise  # main names the file and the reason
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise FormatError(f"{self.path}: not a readable safetensors file ({_one_line(exc)})") from exc

    @property
    def metadata(self) -> dict[str, Any]:
        meta = self._header.get("__metadata__") or {}
        return {str(k): str(v) for k, v in meta.items()}


#: safetensors dtype codes, spelled as torch spells them.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
}

#: Bits per element of every dtype safetensors defines (F4 and F6 are packed, several to a byte).
_SAFETENSORS_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _safetensors_header(path: str, file_bytes: int) -> dict[str, Any]:
    """The header of a safetensors file, checked by the rules safetensors itself loads by.

    The header is all inspect needs ("sizes only"): no tensor bytes are read. Every entry is
    checked here, so a damaged file is refused by inspect and bench exactly as ``load_file``
    would refuse it, with one line that names the file and the tensor.

    Raises:
        FormatError: the header is not JSON, an entry is malformed, or the tensors do not
            exactly cover the data section (truncated, overlapping or stray bytes).
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    corrupt = f"{path}: the safetensors header is corrupt"
    try:
        header = boundedjson.loads(raw.decode("utf-8"), path, "safetensors header")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{corrupt} ({_one_line(exc)})") from exc
    if not isinstance(header, dict):
        raise FormatError(f"{corrupt} (a JSON object is expected, found a {type(header).__name__})")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError(f"{corrupt} (__metadata__ must be an object of strings, found {_one_line(repr(meta))})")
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise FormatError(
                f"{corrupt} (tensor {key!r} is a {type(entry).__name__}, not an object of dtype, shape and data_offsets)"
            )
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        bits = _SAFETENSORS_BITS.get(dtype) if isinstance(dtype, str) else None
        if bits is None:
            raise FormatError(
                f"{corrupt} (tensor {key!r} has dtype {dtype!r}; safetensors defines {', '.join(_SAFETENSORS_BITS)})"
            )
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise FormatError(
                f"{corrupt} (tensor {key!r} has shape {_one_line(repr(shape))}; a list of non-negative integers is expected)"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets)) and 0 <= offsets[0] <= offsets[1]):
            raise FormatError(
                f"{corrupt} (tensor {key!r} has data_offsets {_one_line(repr(offsets))}; [begin, end] with 0 <= begin <= end is expected)"
            )
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if (numel * bits) % 8 or end - begin != numel * bits // 8:
            size = numel * bits // 8 if (numel * bits) % 8 == 0 else numel * bits / 8
            raise FormatError(
                f"{corrupt} (tensor {key!r} is {dtype}{shape}, {size} bytes, but its data_offsets "
                f"[{begin}, {end}] span {end - begin} bytes)"
            )
        spans.append((begin, end, key))
    data_bytes = file_bytes - 8 - n
    last = max((end for _, end, _ in spans), default=0)
    if last > data_bytes:
        raise FormatError(
            f"{path}: is truncated: its header places tensor data up to byte {last} of the data section, which holds "
            f"only {data_bytes} bytes (an interrupted copy or download?)"
        )
    # safetensors loads only files whose tensors tile the data section exactly, in any order.
    covered, previous = 0, None
    for begin, end, key in sorted(spans):
        if begin < covered:
            raise FormatError(f"{corrupt} (the data of tensors {previous!r} and {key!r} overlap)")
        if begin > covered:
            raise FormatError(f"{corrupt} (bytes {covered} to {begin} of the data section belong to no tensor)")
        covered, previous = end, key
    if covered < data_bytes:
        raise FormatError(f"{path}: is damaged: {data_bytes - covered} bytes follow the last tensor's data")
    return header


def _first_reason(exc: BaseException) -> str:
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:")[-1]
    return _one_line(text.strip().splitlines()[0] if text.strip() else text)


def _one_line(exc: BaseException | str) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def open_source(path: str, *, trust: bool = False) -> Source:
    """Open one checkpoint file of any layout the CLI reads.

    Args:
        path: A local path or fsspec URL of a file (not a directory).
        trust: Load ``torch.save`` pickles with ``weights_only=False`` (only for trusted files).

    Raises:
        FormatError: missing file or a layout the CLI does not read.
    """
    kind = sniff(path)
    if kind == NVCOMP:
        return NvcompSource(path, trust)
    if kind == DIRECTORY:
        raise FormatError(f"{path}: is a directory; pass a checkpoint file")
    storage, spath = storage_for(path)
    size = storage.size(spath)
    if kind == TORCH:
        return TorchSource(path, size, trust)
    if kind == SAFETENSORS:
        return SafetensorsSource(path, size)
    raise FormatError(f"{path}: not a checkpoint nvckpt reads; expected {_KNOWN}")


def dir_files(root: str) -> list[tuple[str, str]]:
    """``(relative path, kind)`` of every file under ``root``, sorted; hidden temp files skipped."""
    out = []
    base = Path(root)
    for p in sorted(base.rglob("*")):
        if not p.is_file() or is_temp_name(p.name):
            continue
        out.append((p.relative_to(base).as_posix(), sniff(str(p))))
    return out
