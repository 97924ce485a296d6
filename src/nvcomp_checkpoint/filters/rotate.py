"""Byte planes of element words rotated left by a few bits: a float's whole exponent in one plane.

bf16 is ``sign | 8 exponent bits | 7 mantissa bits`` and fp32 ``sign | 8 | 23``: plain byte planes
put the sign and 7 exponent bits in the top plane and the exponent's last bit with the noisy
mantissa. Rotated left by one bit, the top byte is exactly the exponent (a few dozen values in
a trained tensor) and the sign joins the mantissa (ZipNN's transform, docs/format.md version 4).
"""

from __future__ import annotations

import numpy as np
import torch

from .byteplane import ByteplaneFilter

__all__ = ["ROTATE_WIDTHS", "RotatedByteplaneFilter", "exponent_rotation"]

#: Element widths (bytes) the rotation is defined for in the format.
ROTATE_WIDTHS = (2, 4)
#: Left rotation that makes the top byte of an element the whole exponent, per dtype: the
#: dtypes whose sign is followed by exactly 8 exponent bits. Others keep plain byte planes.
_EXPONENT_ROTATION = {torch.bfloat16: 1, torch.float32: 1}
_SIGNED = {2: torch.int16, 4: torch.int32}


def exponent_rotation(dtype: torch.dtype) -> int:
    """The rotation ``filter="rotplane"`` applies to ``dtype`` (0: none, plain byte planes)."""
    return _EXPONENT_ROTATION.get(dtype, 0)


class RotatedByteplaneFilter(ByteplaneFilter):
    """Rotates each little-endian ``width``-byte word left by ``rotate`` bits, then splits byte planes.

    Args:
        width: Bytes per element, 2 or 4.
        rotate: Bits, ``1 <= rotate < 8 * width``.
    """

    id = "rotplane"
    _transforms = True

    def __init__(self, width: int, rotate: int) -> None:
        if width not in ROTATE_WIDTHS:
            raise ValueError(f"the rotated byte-plane filter is defined for widths {ROTATE_WIDTHS}, not {width}")
        if not 0 < rotate < 8 * width:
            raise ValueError(f"rotation of {width}-byte words must be 1 to {8 * width - 1} bits, got {rotate}")
        super().__init__(width)
        self.rotate = rotate
        self._bits = 8 * width

    def _forward(self, words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        np.left_shift(words, self.rotate, out=out)
        np.right_shift(words, self._bits - self.rotate, out=scratch)
        np.bitwise_or(out, scratch, out=out)
        return out

    def _inverse_(self, words: np.ndarray, scratch: np.ndarray) -> None:
        np.left_shift(words, self._bits - self.rotate, out=scratch)
        np.right_shift(words, self.rotate, out=words)
        np.bitwise_or(words, scratch, out=words)

    # torch has shifts on signed words only: ``>>`` is arithmetic there, so the bits it drags
    # in from the sign are masked off; ``<<`` wraps (two's complement), as on unsigned words.
    def _forward_torch(self, data: torch.Tensor) -> torch.Tensor:
        if data.numel() == 0:
            return data
        x = data.view(_SIGNED[self.width])
        low = (x >> (self._bits - self.rotate)) & ((1 << self.rotate) - 1)
        return ((x << self.rotate) | low).view(torch.uint8)

    def _inverse_torch(self, data: torch.Tensor) -> torch.Tensor:
        if data.numel() == 0:
            return data
        x = data.view(_SIGNED[self.width])
        high = (x >> self.rotate) & ((1 << (self._bits - self.rotate)) - 1)
        return ((x << (self._bits - self.rotate)) | high).view(torch.uint8)
