"""Byte-plane filter: element bytes regrouped so that byte k of every element lies together.

Trained floats have structured exponent bytes and noisy low mantissa bytes; split into planes,
the exponent plane compresses well and the noise planes can be stored raw (docs/facts.md, ZipNN,
Blosc's shuffle). Planes are numbered from the least significant byte of the little-endian
element, so files are the same on every machine.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Sequence

import numpy as np
import torch

__all__ = ["ByteplaneFilter", "FILTER_IDS", "KERNELS", "plane_width"]

#: Filter ids of the format: "rotplane" is byte planes of rotated words (filters/rotate.py).
FILTER_IDS = ("none", "byteplane", "rotplane")

#: Unsigned words as wide as an element: planes are taken out of them by shifts.
_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Shifted words handled per step, sized to stay in a core's L2 cache.
SPLIT_BLOCK_BYTES = 256 << 10
_JOIN_BLOCK = 1 << 17

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch build is supported
    raise ImportError("nvcomp-checkpoint's byte-plane filter assumes a little-endian machine")

#: Set to 1 to run the numpy code even where the compiled kernels are built (to compare them).
PURE_PYTHON_ENV = "NVCOMP_CHECKPOINT_PURE_PYTHON"
_planes: ModuleType | None = None
if os.environ.get(PURE_PYTHON_ENV, "") in ("", "0"):
    try:  # the one-pass split/join (_planes.c), built at install when a C compiler is there (setup.py)
        _planes = importlib.import_module(f"{__package__}._planes")
    except ImportError:
        _planes = None
#: Which code splits and joins byte planes: "compiled" (one pass, filters/_planes.c) or "numpy"
#: (the same bytes, about 3x slower to join: the install found no C compiler, or PURE_PYTHON_ENV is set).
KERNELS = "compiled" if _planes is not None else "numpy"


def plane_width(dtype: torch.dtype) -> int:
    """Bytes per plane group for ``dtype``: the scalar width (complex counts its two halves)."""
    width = dtype.itemsize  # not torch.empty(...).element_size(): an allocation per tensor of every save
    if dtype.is_complex:
        width //= 2
    return width


class ByteplaneFilter:
    """Splits a run of elements into ``width`` planes and joins them back.

    Args:
        width: Bytes per element (1 makes the filter an identity with a single plane).
    """

    id = "byteplane"

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"byte-plane width must be positive, got {width}")
        self.width = width

    #: Left rotation of the element words before they are split (a subclass's business).
    rotation = 0

    def split(self, data: np.ndarray) -> list[np.ndarray]:
        """Planes of ``data`` (1-D uint8, length a multiple of ``width``), each contiguous."""
        if self.width == 1:
            return [data]
        if _planes is not None and self.width in _WORDS:
            planes = np.empty((self.width, data.size // self.width), dtype=np.uint8)
            _planes.split(data, list(planes), self.rotation)
            return list(planes)
        return self._split_numpy(data)

    def _split_numpy(self, data: np.ndarray) -> list[np.ndarray]:
        """:meth:`split` in numpy (the fallback, and the reference the compiled kernel is tested against)."""
        n = data.size // self.width
        planes = np.empty((self.width, n), dtype=np.uint8)
        if self.width not in _WORDS:
            np.copyto(planes, data.reshape(n, self.width).T)
            return list(planes)
        # Each plane is the element word shifted and narrowed to a byte, a block at a time so
        # the shifted words stay in cache: same bytes as numpy's strided transpose copy, 1.3x
        # (8-byte) to 3.5x (2-byte elements) faster (measured in benchmarks/README.md).
        words = data.view(_WORDS[self.width])
        block = SPLIT_BLOCK_BYTES // self.width
        shifted = np.empty(min(block, n), dtype=words.dtype)
        staged = np.empty_like(shifted) if self._transforms else shifted
        for start in range(0, n, block):
            end = min(n, start + block)
            src, tmp = self._forward(words[start:end], staged[: end - start], shifted[: end - start]), shifted[: end - start]
            np.copyto(planes[0, start:end], src, casting="unsafe")
            for p in range(1, self.width):
                np.right_shift(src, 8 * p, out=tmp)
                np.copyto(planes[p, start:end], tmp, casting="unsafe")
        return list(planes)

    def join(self, out: np.ndarray, planes: Sequence[np.ndarray | bytes | bytearray | memoryview]) -> None:
        """Inverse of :meth:`split`: write every plane of one run of elements into ``out`` (1-D uint8)."""
        if _planes is not None and self.width in _WORDS:
            if len(planes) != self.width:
                raise ValueError(f"byte-plane join needs {self.width} planes, got {len(planes)}")
            _planes.join(out, planes, self.rotation)  # checks every length; ValueError on a mismatch
            return
        self._join_numpy(out, planes)

    def _join_numpy(self, out: np.ndarray, planes: Sequence[np.ndarray | bytes | bytearray | memoryview]) -> None:
        """:meth:`join` in numpy (the fallback, and the reference the compiled kernel is tested against)."""
        srcs = [np.frombuffer(p, dtype=np.uint8) if not isinstance(p, np.ndarray) else p for p in planes]
        if self.width == 1:
            out[:] = srcs[0]
            return
        if len(srcs) != self.width:
            raise ValueError(f"byte-plane join needs {self.width} planes, got {len(srcs)}")
        if self.width not in _WORDS or (self.width == 8 and not self._transforms):
            # For 8-byte words the strided write per plane is the faster way.
            view = out.reshape(-1, self.width)
            for p, src in enumerate(srcs):
                view[:, p] = src
            return
        # Widen each plane and OR it in at its shift, a block at a time (about 1.5x faster than
        # a strided write per plane for 4-byte elements, 3x for 2-byte ones; benchmarks/README.md).
        words = out.view(_WORDS[self.width])
        n = words.size
        shifted = np.empty(min(_JOIN_BLOCK, n), dtype=words.dtype)
        for start in range(0, n, _JOIN_BLOCK):
            end = min(n, start + _JOIN_BLOCK)
            dst, tmp = words[start:end], shifted[: end - start]
            np.copyto(dst, srcs[0][start:end])
            for p in range(1, self.width):
                np.copyto(tmp, srcs[p][start:end])
                np.left_shift(tmp, 8 * p, out=tmp)
                np.bitwise_or(dst, tmp, out=dst)
            self._inverse_(dst, tmp)

    #: Whether the element words are transformed before they are split (a subclass's business).
    _transforms = False

    def _forward(self, words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """The words to split (``out`` and ``scratch``: buffers of their length): the words themselves."""
        return words

    def _inverse_(self, words: np.ndarray, scratch: np.ndarray) -> None:
        """Undo :meth:`_forward` on joined words, in place (``scratch``: a buffer of their length)."""

    def join_into(self, out: np.ndarray, plane: int, data: np.ndarray | bytes | memoryview) -> None:
        """Write one plane's bytes into ``out`` (1-D uint8 element bytes) in place."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        if self._transforms:
            raise ValueError(f"filter {self.id!r} joins whole chunks only (its planes mix the bits of an element)")
        if self.width == 1:
            out[:] = src
        else:
            out.reshape(-1, self.width)[:, plane] = src

    def split_torch(self, data: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`split` for a 1-D uint8 tensor on any device (used on the GPU)."""
        if self.width == 1:
            return [data]
        planes = self._forward_torch(data).view(-1, self.width).t().contiguous()
        return list(planes.unbind(0))

    def join_torch(self, planes: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split_torch`: element bytes as one 1-D uint8 tensor."""
        if self.width == 1:
            return planes[0]
        return self._inverse_torch(torch.stack(planes, dim=1).reshape(-1))

    def _forward_torch(self, data: torch.Tensor) -> torch.Tensor:
        """:meth:`_forward` for 1-D uint8 element bytes on any device (a new tensor or ``data``)."""
        return data

    def _inverse_torch(self, data: torch.Tensor) -> torch.Tensor:
        """:meth:`_inverse_` for 1-D uint8 element bytes on any device (a new tensor or ``data``)."""
        return data
