"""Byte planes of element words rotated left by a few bits: a float's whole exponent in one plane.

bf16 is ``sign | 8 exponent bits | 7 mantissa bits`` and fp32 ``sign | 8 | 23``: plain byte planes
put the sign and 7 exponent bits in the top plane and the exponent's last bit with the noisy
mantissa. Rotated left by one bit, the top byte is exactly the exponent (a few dozen values in
a trained tensor) and the sign joins the mantissa (ZipNN's transform, docs/format.md version 4).
"""

from __future__ import annotations

import numpy as np
import torch

from .byteplane import SPLIT_BLOCK_BYTES, ByteplaneFilter

__all__ = ["ROTATE_WIDTHS", "RotatedByteplaneFilter", "exponent_rotation"]

#: Element widths (bytes) the rotation is defined for in the format.
ROTATE_WIDTHS = (2, 4)
#: Left rotation that makes the top byte of an element the whole exponent, per dtype: the
#: dtypes whose sign is followed by exactly 8 exponent bits. Others keep plain byte planes.
_EXPONENT_ROTATION = {torch.bfloat16: 1, torch.float32: 1}
_SIGNED = {2: torch.int16, 4: torch.int32}
_NUMPY_WORDS = {2: np.uint16, 4: np.uint32}


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
        self.rotate = self.rotation = rotate
        self._bits = 8 * width
        self._word = _NUMPY_WORDS[width]
        self._block = SPLIT_BLOCK_BYTES // width

    def _split_numpy(self, data: np.ndarray) -> list[np.ndarray]:
        """Planes of the rotated words of ``data`` (1-D uint8, length a multiple of ``width``), in numpy."""
        if self.rotate >= 8:
            return super()._split_numpy(data)
        # Under a byte of rotation, plane k > 0 is the word shifted right by 8k - r and narrowed,
        # as fast as a plain plane, and plane 0 is (low byte << r) | (top r bits), in uint8: the
        # rotated words are never formed (fp32 split in 2.6 ms per 4 MiB instead of 3.8 ms).
        n = data.size // self.width
        planes = np.empty((self.width, n), dtype=np.uint8)
        words = data.view(self._word)
        block = self._block
        shifted = np.empty(min(block, n), dtype=words.dtype)
        top = np.empty(min(block, n), dtype=np.uint8)
        for start in range(0, n, block):
            end = min(n, start + block)
            src, tmp, low = words[start:end], shifted[: end - start], planes[0, start:end]
            for p in range(1, self.width):
                np.right_shift(src, 8 * p - self.rotate, out=tmp)
                np.copyto(planes[p, start:end], tmp, casting="unsafe")
            np.right_shift(src, self._bits - self.rotate, out=tmp)
            np.copyto(top[: end - start], tmp, casting="unsafe")
            np.copyto(low, src, casting="unsafe")
            np.multiply(low, np.uint8(1 << self.rotate), out=low)  # wraps; numpy's uint8 shift is 40x slower
            np.bitwise_or(low, top[: end - start], out=low)
        return list(planes)

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
