"""XOR of element bytes against a reference (the same tensor in an earlier checkpoint).

Weights move by small steps: most high bytes of a weight equal the earlier ones, so the XOR of
the two bit patterns is mostly zeros in the sign/exponent planes. The XOR may be taken for some
byte planes only (``planes_mask``): bytes of the other planes are left as they are.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["xor_bytes", "xor_planes_", "xor_planes_np_", "plane_mask"]

#: Signed torch word types as wide as an element (bitwise ops do not care about the sign).
_TORCH_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def xor_bytes(data: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``data ^ ref`` as a new 1-D uint8 array (both 1-D uint8 of one length)."""
    if data.size % 8 == 0:
        # Word-wide: 8x fewer numpy element steps than bytes.
        return np.bitwise_xor(data.view(np.uint64), ref.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(data, ref)


def xor_planes_np_(out: np.ndarray, ref: np.ndarray, width: int, planes: Sequence[bool]) -> None:
    """:func:`xor_planes_` for one chunk in numpy (1-D uint8 arrays), run in a decoding worker."""
    if not any(planes):
        return
    # 8-byte words when the chunk allows: fewer steps; the mask repeats every ``width`` bytes.
    wide = out.size % 8 == 0 and 8 % width == 0 and out.ctypes.data % 8 == 0 and ref.ctypes.data % 8 == 0
    word = np.uint64 if wide else _WORDS[width]
    o, r = out.view(word), ref.view(word)
    if all(planes):
        np.bitwise_xor(o, r, out=o)
        return
    reps = 8 // width if wide else 1
    mask = word(sum(0xFF << (8 * k) for k, on in enumerate(list(planes) * reps) if on))
    np.bitwise_xor(o, np.bitwise_and(r, mask), out=o)


def plane_mask(width: int, planes: Sequence[bool]) -> int:
    """The little-endian word whose byte ``k`` is 0xFF where ``planes[k]``, as a signed ``width``-byte int."""
    value = sum(0xFF << (8 * k) for k, on in enumerate(planes) if on)
    bits = 8 * width
    return value - (1 << bits) if width > 1 and value >= 1 << (bits - 1) else value


def xor_planes_(out: torch.Tensor, ref: torch.Tensor, width: int, planes: Sequence[bool]) -> None:
    """XOR the byte planes flagged in ``planes`` of ``ref`` into ``out``, in place.

    ``out`` and ``ref`` are 1-D uint8 tensors of one length (a multiple of ``width``) on one
    device; the same code runs on the CPU and on a GPU.
    """
    if not any(planes):
        return
    word = _TORCH_WORDS[width]
    o, r = out.view(word), ref.view(word)
    if all(planes):
        o.bitwise_xor_(r)
    else:
        o.bitwise_xor_(r & plane_mask(width, planes))
