"""The on-disk layout of a checkpoint file (specified in ``docs/format.md``).

``GUARD | MAGIC | skeleton frame | tensor frames ... | index (JSON) | footer``: written strictly
front to back, so it streams to object storage; the index at the end is the commit point. Files
written before the guard start with the magic and read as before.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from .. import boundedjson
from ..codecs import CODEC_IDS, CodecConfig
from ..codecs.registry import CHUNK_CAP_BYTES
from ..errors import FormatError
from ..filters import FILTER_IDS, ROTATE_WIDTHS
from . import guard
from .chain import DELTA_FORMAT_VERSION, FRAME_OPS, SUB, SUB_FORMAT_VERSION, SUB_WIDTHS, BaseRef, TensorDelta

__all__ = [
    "GUARD",
    "MAGIC",
    "magic_offset",
    "SAVE_METADATA_KEYS",
    "DELTA_MAGIC",
    "SUB_MAGIC",
    "ROTATE_MAGIC",
    "ROTATE_FORMAT_VERSION",
    "READ_VERSIONS",
    "FORMAT_VERSION",
    "FOOTER",
    "FOOTER_MAGIC",
    "MAX_INDEX_BYTES",
    "MAX_CHUNK_BYTES",
    "Frame",
    "TensorEntry",
    "Index",
    "pack_footer",
    "unpack_footer",
    "dtype_from_name",
    "dtype_name",
    "QUANTIZED_DTYPES",
]

FORMAT_VERSION = 1
#: 8 bytes: the name, then the major format version as one byte, then a reserved zero byte.
MAGIC = b"NVCKPT" + bytes([FORMAT_VERSION, 0])
#: The magic of a delta file (version 2: version 1 plus a base, docs/format.md "Delta files").
DELTA_MAGIC = b"NVCKPT" + bytes([DELTA_FORMAT_VERSION, 0])
#: The magic of a delta file that may hold ``sub`` frames (version 3: version 2 plus that op).
SUB_MAGIC = b"NVCKPT" + bytes([SUB_FORMAT_VERSION, 0])
#: A file that may hold tensors with filter "rotplane" (version 4: versions 1 to 3 plus that
#: filter, with or without a base): a version-3 reader refuses it ("Upgrade").
ROTATE_FORMAT_VERSION = 4
ROTATE_MAGIC = b"NVCKPT" + bytes([ROTATE_FORMAT_VERSION, 0])
#: Format versions this reader reads, oldest first.
READ_VERSIONS = (FORMAT_VERSION, DELTA_FORMAT_VERSION, SUB_FORMAT_VERSION, ROTATE_FORMAT_VERSION)
FOOTER_MAGIC = b"NVCKEND\x00"
#: Starts every file written since the guard (docs/format.md "The guard"), before the magic: one
#: protocol-2 pickle, ``PROTO 2, GLOBAL guard.MODULE guard.NAME, STOP``, fixed ASCII bytes. A stock
#: ``torch.load`` stops on it with the loader to use; readers compare it exactly, never unpickle it.
GUARD = b"\x80\x02c" + guard.MODULE.encode("ascii") + b"\n" + guard.NAME.encode("ascii") + b"\n."
#: The index metadata every save writes itself (a converted or rebased file gets fresh ones).
SAVE_METADATA_KEYS = ("created_by", "torch", "created")
#: index offset (u64), index size (u64), xxh3-64 of the index (u64), FOOTER_MAGIC; little-endian.
FOOTER = struct.Struct("<QQQ8s")
MAX_INDEX_BYTES = 1 << 30
MAX_CHUNK_BYTES = CHUNK_CAP_BYTES  # the facts table's cap (codecs/registry.py)

_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype) and not name.startswith("_")}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: Quantized dtypes: their values need a scale and zero point that the format does not store,
#: so the writer refuses them (UnsupportedObjectError) and the reader refuses them in an index.
QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def dtype_from_name(name: str, where: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise FormatError(f"{where}: unknown dtype {name!r} (written by a newer torch?)")
    if dtype in QUANTIZED_DTYPES:
        raise FormatError(
            f"{where}: dtype {name!r} is quantized, which no writer of this format stores; the index is corrupt or forged"
        )
    return dtype


def magic_offset(head: bytes) -> int | None:
    """Where the magic lies in a file that starts with ``head`` (at least ``len(GUARD) + 6`` bytes of
    it, if it has them): just after the exact guard, or at 0 (files written before the guard);
    None when neither."""
    if head.startswith(GUARD) and head[len(GUARD) : len(GUARD) + 6] == MAGIC[:6]:
        return len(GUARD)
    return 0 if head[:6] == MAGIC[:6] else None


def pack_footer(index_offset: int, index_size: int, index_hash: int) -> bytes:
    return FOOTER.pack(index_offset, index_size, index_hash, FOOTER_MAGIC)


def unpack_footer(data: bytes, file_size: int, where: str, data_start: int = len(MAGIC)) -> tuple[int, int, int]:
    """Footer fields, checked against the file size so nothing absurd is allocated.

    ``data_start``: where the file's data begins (after the guard and the magic); the default,
    the magic's length, is the lowest any file has.
    """
    if len(data) != FOOTER.size:
        raise FormatError(f"{where}: file is truncated (no complete footer)")
    offset, size, digest, magic = FOOTER.unpack(data)
    if magic != FOOTER_MAGIC:
        raise FormatError(
            f"{where}: no checkpoint footer; the file is truncated (an interrupted save?) or not an nvcomp-checkpoint file"
        )
    if size > MAX_INDEX_BYTES or offset < data_start or offset + size != file_size - FOOTER.size:
        raise FormatError(
            f"{where}: footer claims an index of {size} bytes at {offset}, impossible in a file of {file_size} bytes"
        )
    return offset, size, digest


@dataclass(frozen=True)
class Frame:
    """One stored frame: ``size`` bytes at ``offset``, decoding to ``raw_size`` bytes."""

    offset: int
    size: int
    raw_size: int
    xxh: int
    #: Transform against the base (format/chain.py): "" = none, "xor", "sub".
    op: str = ""

    @property
    def is_raw(self) -> bool:
        # A writer stores a frame raw whenever the codec does not shrink it, so equal sizes
        # mean raw bytes; no flag is needed.
        return self.size == self.raw_size


@dataclass(frozen=True)
class TensorEntry:
    """Everything the index says about one tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    component: str
    codec: CodecConfig
    filter: str
    width: int
    chunk_bytes: int
    frames: tuple[Frame, ...]
    device: str = "cpu"
    requires_grad: bool = False
    parameter: bool = False
    #: The base tensor that ``xor`` and ``sub`` frames refer to (delta files only).
    delta: TensorDelta | None = None
    #: Filter "rotplane": bits each element word is rotated left by before its byte planes.
    rotate: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize  # not torch.empty(...): an allocation per call, 5% of a load

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.frames)

    @property
    def planes(self) -> int:
        return self.width if self.filter in ("byteplane", "rotplane") else 1

    def chunks(self) -> list[tuple[int, int, tuple[Frame, ...]]]:
        """``(byte offset, byte length, frames)`` for each chunk of the tensor's bytes."""
        out = []
        p = self.planes
        for i in range(0, len(self.frames), p):
            start = (i // p) * self.chunk_bytes
            out.append((start, min(self.chunk_bytes, self.nbytes - start), self.frames[i : i + p]))
        return out

    def to_json(self) -> dict[str, Any]:
        doc = {
            "key": self.key,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "component": self.component,
            "codec": self.codec.to_json(),
            "filter": self.filter,
            "width": self.width,
            "chunk_bytes": self.chunk_bytes,
            "frames": [[f.offset, f.size, f"{f.xxh:016x}"] + ([f.op] if f.op else []) for f in self.frames],
            "device": self.device,
            "requires_grad": self.requires_grad,
            "parameter": self.parameter,
        }
        if self.filter == "rotplane":
            doc["rotate"] = self.rotate
        if self.delta is not None:
            doc["delta"] = self.delta.to_json()
        return doc


def chunk_frame_sizes(nbytes: int, chunk_bytes: int, planes: int) -> list[int]:
    """Raw size of every frame of a tensor of ``nbytes`` bytes, chunk-major, plane-minor."""
    sizes = []
    for start in range(0, nbytes, chunk_bytes):
        length = min(chunk_bytes, nbytes - start)
        sizes.extend([length // planes] * planes)
    return sizes


def _entry_from_json(
    data: Any, data_start: int, data_end: int, where: str, has_base: bool = False, version: int = FORMAT_VERSION
) -> TensorEntry:
    try:
        key = str(data["key"])
        dtype = dtype_from_name(str(data["dtype"]), where)
        shape = tuple(int(d) for d in data["shape"])
        codec = CodecConfig.from_json(data["codec"])
        filt = str(data["filter"])
        width = int(data["width"])
        chunk_bytes = int(data["chunk_bytes"])
        raw_frames = data["frames"]
        component = str(data["component"])
        device = str(data.get("device", "cpu"))
        requires_grad = bool(data.get("requires_grad", False))
        parameter = bool(data.get("parameter", False))
        delta_json = data.get("delta")
        rotate_json = data.get("rotate")
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"{where}: malformed tensor entry in the index ({exc!r})") from exc
    where_t = f"{where}, tensor {key!r}"
    if delta_json is not None and not has_base:
        raise FormatError(f"{where_t}: a delta against a base, in a file that records no base")
    delta = TensorDelta.from_json(delta_json, where_t) if delta_json is not None else None
    if any(d < 0 or d >= 1 << 63 for d in shape):
        raise FormatError(f"{where_t}: impossible dimension in shape {list(shape)[:8]}")
    try:
        saved_device = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise FormatError(f"{where_t}: invalid device {device[:80]!r} in the index") from exc
    if saved_device.type == "meta":
        raise FormatError(f"{where_t}: the index says the tensor lives on the meta device, which holds no data")
    if codec.id not in CODEC_IDS or filt not in FILTER_IDS:
        raise FormatError(f"{where_t}: unknown codec {codec.id!r} or filter {filt!r}")
    itemsize = dtype.itemsize
    if width < 1 or itemsize % width or not (0 < chunk_bytes <= MAX_CHUNK_BYTES) or chunk_bytes % itemsize:
        raise FormatError(f"{where_t}: inconsistent width {width} / chunk size {chunk_bytes} for {dtype}")
    rotate = _checked_rotation(filt, rotate_json, width, version, delta is not None, where_t)
    planes = width if filt in ("byteplane", "rotplane") else 1
    numel = math.prod(shape)
    # Checked before anything is allocated: the frames must tile exactly the bytes the shape
    # claims, and every frame must lie inside the data region of the file.
    n_chunks = -(-numel * itemsize // chunk_bytes)
    if not isinstance(raw_frames, list) or len(raw_frames) != n_chunks * planes:
        raise FormatError(
            f"{where_t}: shape {list(shape)} needs {n_chunks * planes} frames, the index lists "
            f"{len(raw_frames) if isinstance(raw_frames, list) else 'none'}"
        )
    sizes = chunk_frame_sizes(numel * itemsize, chunk_bytes, planes)
    frames = []
    for raw, raw_size in zip(raw_frames, sizes):
        try:
            offset, size, digest = int(raw[0]), int(raw[1]), int(str(raw[2]), 16)
            op = raw[3] if len(raw) == 4 else ""
        except (TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
            raise FormatError(f"{where_t}: malformed frame record {raw!r:.200}") from exc
        if len(raw) not in (3, 4) or op not in FRAME_OPS or (op and delta is None):
            raise FormatError(f"{where_t}: malformed frame record {raw!r:.200} (a frame op needs a delta record)")
        if op == SUB and (version < SUB_FORMAT_VERSION or width not in SUB_WIDTHS):
            raise FormatError(
                f"{where_t}: frame op 'sub' in a version-{version} file, or for elements of width {width} "
                f"(it needs version {SUB_FORMAT_VERSION} and width {' / '.join(map(str, SUB_WIDTHS))}); the index is corrupt"
            )
        if offset < data_start or size < 0 or offset + size > data_end or size > raw_size:
            raise FormatError(f"{where_t}: frame at {offset} (+{size}) lies outside the data region")
        if codec.id == "none" and size != raw_size:
            raise FormatError(f"{where_t}: raw frame at {offset} holds {size} bytes, the shape needs {raw_size}")
        frames.append(Frame(offset, size, raw_size, digest, op))
    return TensorEntry(
        key,
        dtype,
        shape,
        component,
        codec,
        filt,
        width,
        chunk_bytes,
        tuple(frames),
        device,
        requires_grad,
        parameter,
        delta,
        rotate,
    )


def _checked_rotation(filt: str, value: Any, width: int, version: int, has_delta: bool, where: str) -> int:
    """The entry's ``rotate`` (0 unless the filter is "rotplane"), or a FormatError for a record no writer makes."""
    if filt != "rotplane":
        if value is not None:
            raise FormatError(f"{where}: a 'rotate' field with filter {filt!r} (only 'rotplane' has one); the index is corrupt")
        return 0
    if version < ROTATE_FORMAT_VERSION:
        raise FormatError(
            f"{where}: filter 'rotplane' in a version-{version} file (it needs version {ROTATE_FORMAT_VERSION}); the index is corrupt"
        )
    if has_delta:
        raise FormatError(f"{where}: filter 'rotplane' with a delta record (deltas use plain byte planes); the index is corrupt")
    if type(value) is not int or width not in ROTATE_WIDTHS or not 0 < value < 8 * width:
        raise FormatError(
            f"{where}: filter 'rotplane' needs an integer 'rotate' of 1 to 8 * width - 1 bits and width "
            f"{' or '.join(map(str, ROTATE_WIDTHS))}; the index has rotate {value!r:.40} and width {width}"
        )
    return value


def _reject_constant(name: str) -> Any:
    # Writers use allow_nan=False: NaN / Infinity in an index is damage, and int(inf) raises.
    raise ValueError(f"{name} is not valid in an index")


@dataclass(frozen=True)
class Index:
    """The parsed, validated index of a checkpoint file."""

    skeleton: Frame
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, Any]
    #: The checkpoint this one is a delta of (format version 2 or 3), or None.
    base: BaseRef | None = None
    #: The format version: 4 when some tensor has filter "rotplane"; else 1 without a base;
    #: with one, 3 when the writer may have stored ``sub`` frames (it tried the difference on
    #: some tensor), else 2. None: the lowest that fits.
    version: int | None = None

    def __post_init__(self) -> None:
        if self.version is None:
            has_sub = any(f.op == SUB for t in self.tensors for f in t.frames)
            derived = FORMAT_VERSION if self.base is None else SUB_FORMAT_VERSION if has_sub else DELTA_FORMAT_VERSION
            if any(t.filter == "rotplane" for t in self.tensors):
                derived = ROTATE_FORMAT_VERSION
            object.__setattr__(self, "version", derived)

    def to_json_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": "nvcomp-checkpoint",
            "version": self.version,
            "skeleton": [self.skeleton.offset, self.skeleton.size, self.skeleton.raw_size, f"{self.skeleton.xxh:016x}"],
            "tensors": [t.to_json() for t in self.tensors],
            "metadata": self.metadata,
        }
        if self.base is not None:
            doc["base"] = self.base.to_json()
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes, data_end: int, where: str, data_start: int = len(MAGIC)) -> "Index":
        """The index in ``data``; every frame must lie in ``[data_start, data_end)``: after the
        guard (if any) and the magic, before the index."""
        try:
            doc = boundedjson.loads(data.decode("utf-8"), where, "index", parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, NaN
            raise FormatError(f"{where}: the index is not valid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != "nvcomp-checkpoint":
            raise FormatError(f"{where}: not an nvcomp-checkpoint index")
        version = doc.get("version")
        if version not in READ_VERSIONS or type(version) is not int:
            raise FormatError(
                f"{where}: format version {version!r}; this nvcomp-checkpoint reads "
                f"versions {', '.join(map(str, READ_VERSIONS))}. Upgrade nvcomp-checkpoint to read it."
            )
        # Version 2 is version 1 plus a base, version 3 version 2 plus "sub" frames: a base
        # record exactly in versions 2 and 3. Version 4 (filter "rotplane") may have one or not.
        if version != ROTATE_FORMAT_VERSION and (version >= DELTA_FORMAT_VERSION) != ("base" in doc):
            raise FormatError(f"{where}: format version {version} {'without' if 'base' in doc else 'with'} a base record")
        base = BaseRef.from_json(doc["base"], where) if "base" in doc else None
        try:
            s_off, s_size, s_raw, s_hash = doc["skeleton"]
            skeleton = Frame(int(s_off), int(s_size), int(s_raw), int(str(s_hash), 16))
            tensors_json = doc["tensors"]
            metadata = doc.get("metadata", {})
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise FormatError(f"{where}: malformed index ({exc!r})") from exc
        if not (data_start <= skeleton.offset and 0 <= skeleton.size and skeleton.offset + skeleton.size <= data_end) or not (
            0 <= skeleton.raw_size <= MAX_INDEX_BYTES
        ):
            raise FormatError(f"{where}: skeleton frame lies outside the file")
        if not isinstance(tensors_json, list) or not isinstance(metadata, dict):
            raise FormatError(f"{where}: malformed index")
        tensors = tuple(_entry_from_json(t, data_start, data_end, where, base is not None, version) for t in tensors_json)
        _check_no_overlaps(skeleton, tensors, where)
        return cls(skeleton, tensors, metadata, base, version)


def _check_no_overlaps(skeleton: Frame, tensors: tuple[TensorEntry, ...], where: str) -> None:
    """Every stored byte belongs to one frame: a forged index cannot decode one region twice."""
    spans = [(skeleton.offset, skeleton.size, "the object tree")]
    spans += [(f.offset, f.size, t.key) for t in tensors for f in t.frames]
    spans.sort()
    for (a_off, a_size, a_key), (b_off, _, b_key) in zip(spans, spans[1:]):
        if a_off + a_size > b_off:
            raise FormatError(f"{where}: frames of {a_key!r} and {b_key!r} overlap at byte {b_off}; the index is corrupt")
