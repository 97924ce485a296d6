"""The index fields of a delta checkpoint (format version 2): the base's identity and per-tensor deltas.

Specified in ``docs/format.md`` ("Delta files"); a version-1 file has none of these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from ..filters.sub import SUB_WIDTHS

__all__ = [
    "FRAME_OPS",
    "XOR",
    "SUB",
    "BaseRef",
    "TensorDelta",
    "DELTA_FORMAT_VERSION",
    "SUB_FORMAT_VERSION",
    "SUB_WIDTHS",
    "MAX_CHAIN_DEPTH",
]

#: Index ``version`` (and magic version byte) of a file that records a base.
DELTA_FORMAT_VERSION = 2
#: A frame's transform against the base: "" stored as is, "xor" XORed with the same byte plane
#: of the same chunk of the base tensor's bytes.
XOR = "xor"
#: "sub": the same byte plane of the wrapping difference ``(x - b) mod 2**(8*width)`` of each
#: little-endian ``width``-byte element and the base's (format version 3, docs/format.md).
SUB = "sub"
FRAME_OPS = ("", XOR, SUB)
#: Index ``version`` (and magic version byte) of a delta file that may hold ``sub`` frames: a
#: version-2 reader refuses it ("Upgrade") instead of taking differences for values.
SUB_FORMAT_VERSION = 3
#: Element widths ``sub`` frames are defined for: SUB_WIDTHS, (1, 2, 4).
#: Deltas a chain may stack on its full checkpoint: a writer refuses (``save(base=...)``) or
#: avoids (a :class:`ChainPolicy` saves in full) a deeper one, and a reader refuses to follow one.
#: A load decodes every file of the chain (65 at most), and the reader follows it through a few
#: Python frames per file, so a depth near 200 exhausted the interpreter's stack.
MAX_CHAIN_DEPTH = 64


def _hex64(value: Any, what: str, where: str) -> int:
    text = str(value)
    if len(text) != 16:
        raise FormatError(f"{where}: {what} must be 16 hex digits, got {text[:40]!r}")
    try:
        return int(text, 16)
    except ValueError as exc:
        raise FormatError(f"{where}: {what} must be 16 hex digits, got {text[:40]!r}") from exc


@dataclass(frozen=True)
class BaseRef:
    """Which checkpoint a delta file was written against.

    Attributes:
        path: The base's path relative to the delta's directory (``/``-separated, ``..`` allowed);
            files of older versions may hold an absolute path or URL, which readers refuse
            (:func:`nvcomp_checkpoint.delta.resolve_base_path`).
        size: The base file's size in bytes.
        index_xxh3: The base's footer digest (XXH3-64 of its index): its identity.
        depth: Chain depth of this file: 1 when the base is a full checkpoint, else base's + 1.
    """

    path: str
    size: int
    index_xxh3: int
    depth: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "index_xxh3": f"{self.index_xxh3:016x}", "depth": self.depth}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "BaseRef":
        try:
            path, size, depth = data["path"], int(data["size"]), int(data["depth"])
            digest = _hex64(data["index_xxh3"], "the base's index_xxh3", where)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise FormatError(f"{where}: malformed base record in the index ({exc!r})") from exc
        if not isinstance(path, str) or not path or "\x00" in path:
            raise FormatError(f"{where}: the index names no valid base path ({path!r:.80})")
        if size < 0 or depth < 1:
            raise FormatError(f"{where}: impossible base record (size {size}, depth {depth})")
        return cls(path, size, digest, depth)


@dataclass(frozen=True)
class TensorDelta:
    """Which tensor of the base a tensor's ``xor`` frames are XORed with.

    Attributes:
        key: The base tensor's key (same dtype and shape as this tensor).
        xxh3: XXH3-64 of the base tensor's element bytes the writer used: a reader checks the
            values it reads from the base against it before undoing the XOR.
    """

    key: str
    xxh3: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "xxh3": f"{self.xxh3:016x}"}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "TensorDelta":
        try:
            key = data["key"]
            digest = _hex64(data["xxh3"], "the base tensor's xxh3", where)
        except (KeyError, TypeError) as exc:
            raise FormatError(f"{where}: malformed delta record ({exc!r})") from exc
        if not isinstance(key, str):
            raise FormatError(f"{where}: the delta record's base key is not a string")
        return cls(key, digest)
