"""Byte-plane filter: element bytes regrouped so that byte k of every element lies together.

Trained floats have structured exponent bytes and noisy low mantissa bytes; split into planes,
the exponent plane compresses well and the noise planes can be stored raw (FACTS.md, ZipNN,
Blosc's shuffle). Planes are numbered from the least significant byte of the little-endian
element, so files are the same on every machine.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

__all__ = ["ByteplaneFilter", "FILTER_IDS", "plane_width"]

FILTER_IDS = ("none", "byteplane")

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch build is supported
    raise ImportError("nvcomp-checkpoint's byte-plane filter assumes a little-endian machine")


def plane_width(dtype: torch.dtype) -> int:
    """Bytes per plane group for ``dtype``: the scalar width (complex counts its two halves)."""
    width = torch.empty((), dtype=dtype).element_size()
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

    def split(self, data: np.ndarray) -> list[np.ndarray]:
        """Planes of ``data`` (1-D uint8, length a multiple of ``width``), each contiguous."""
        if self.width == 1:
            return [data]
        planes = data.reshape(-1, self.width).T.copy()
        return list(planes)

    def join_into(self, out: np.ndarray, plane: int, data: np.ndarray | bytes | memoryview) -> None:
        """Write one plane's bytes into ``out`` (1-D uint8 element bytes) in place."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        if self.width == 1:
            out[:] = src
        else:
            out.reshape(-1, self.width)[:, plane] = src

    def split_torch(self, data: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`split` for a 1-D uint8 tensor on any device (used on the GPU)."""
        if self.width == 1:
            return [data]
        planes = data.view(-1, self.width).t().contiguous()
        return list(planes.unbind(0))

    def join_torch(self, planes: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split_torch`: element bytes as one 1-D uint8 tensor."""
        if self.width == 1:
            return planes[0]
        return torch.stack(planes, dim=1).reshape(-1)
