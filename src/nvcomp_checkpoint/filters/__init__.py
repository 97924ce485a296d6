"""Byte-level transforms applied before a codec (they know bytes and tensors only)."""

from __future__ import annotations

from .byteplane import FILTER_IDS, KERNELS, ByteplaneFilter, plane_width
from .rotate import ROTATE_WIDTHS, RotatedByteplaneFilter, exponent_rotation

__all__ = [
    "ByteplaneFilter",
    "FILTER_IDS",
    "KERNELS",
    "ROTATE_WIDTHS",
    "RotatedByteplaneFilter",
    "exponent_rotation",
    "plane_filter",
    "plane_width",
]


def plane_filter(filter_id: str, width: int, rotate: int = 0) -> ByteplaneFilter:
    """The filter that splits a chunk into its frames: one plane (``"none"``), byte planes, or
    byte planes of words rotated left by ``rotate`` bits (``"rotplane"``)."""
    if filter_id == "rotplane":
        return RotatedByteplaneFilter(width, rotate)
    return ByteplaneFilter(width if filter_id == "byteplane" else 1)
