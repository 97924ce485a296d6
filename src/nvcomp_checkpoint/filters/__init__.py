"""Byte-level transforms applied before a codec (they know bytes and tensors only)."""

from __future__ import annotations

from .byteplane import FILTER_IDS, ByteplaneFilter, plane_width

__all__ = ["ByteplaneFilter", "FILTER_IDS", "plane_width"]
