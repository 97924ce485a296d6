"""Wrapping integer difference of element bit patterns against a reference, and its undoing.

A slowly moving value (an optimizer's second moment, a weight taking small steps) has a small
difference from its earlier bit pattern: ``D = (x - b) mod 2**(8 * width)`` is mostly 0x00 or
0xFF in its high bytes. Undoing it plane by plane, low to high, needs the borrow from the planes
below, so :func:`undo_planes_np_` / :func:`undo_planes_` undo a chunk's planes of any mix of
stored-as-is, XORed and subtracted planes at once.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["SUB_WIDTHS", "sub_bytes", "sub_bytes_torch", "undo_planes_np_", "undo_planes_"]

#: Element widths (bytes) the difference is defined for in the format (docs/format.md).
SUB_WIDTHS = (1, 2, 4)

_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_TORCH_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
#: Frame ops of the format (format/chain.py; repeated here so filters import nothing of ours).
_XOR, _SUB = "xor", "sub"


def _check_width(width: int) -> None:
    if width not in SUB_WIDTHS:
        raise ValueError(f"the integer difference is defined for element widths {SUB_WIDTHS}, not {width}")


def sub_bytes(data: np.ndarray, ref: np.ndarray, width: int) -> np.ndarray:
    """``(data - ref) mod 2**(8*width)`` per little-endian ``width``-byte element, as new 1-D uint8."""
    _check_width(width)
    word = _WORDS[width]
    return np.subtract(data.view(word), ref.view(word)).view(np.uint8)


def _plane_ops(ops: Sequence[str], width: int) -> list[str]:
    """One op per byte of an element: an unfiltered chunk (one frame) applies its op to every byte."""
    if len(ops) == width:
        return list(ops)
    if len(ops) == 1:
        return list(ops) * width
    raise ValueError(f"{len(ops)} frame ops for elements of {width} bytes")


def _runs(ops: list[str]) -> list[tuple[int, int]]:
    """``(first, last)`` byte of each maximal run of subtracted planes, low to high."""
    runs: list[tuple[int, int]] = []
    for k, op in enumerate(ops):
        if op == _SUB:
            if runs and runs[-1][1] == k - 1:
                runs[-1] = (runs[-1][0], k)
            else:
                runs.append((k, k))
    return runs


def _mask(first: int, last: int) -> int:
    return ((1 << (8 * (last + 1))) - 1) ^ ((1 << (8 * first)) - 1)


def undo_planes_np_(out: np.ndarray, ref: np.ndarray, width: int, ops: Sequence[str]) -> None:
    """Turn one chunk's stored bytes into its values, in place (numpy, in a decoding worker).

    ``out`` holds the chunk's joined planes, ``ref`` the base's bytes of the same chunk (1-D
    uint8, one length); ``ops[p]`` is plane ``p``'s op ("", "xor", "sub"), or one op for an
    unfiltered chunk. A "sub" plane ``k`` becomes ``(D_k + b_k + borrow_k) mod 256``, the borrow
    being 1 where the element's bytes below ``k`` (already final) are below the base's.
    """
    per_byte = _plane_ops(ops, width)
    if not any(per_byte):
        return
    if _SUB in per_byte:
        _check_width(width)
    word = _WORDS.get(width)
    if word is None:  # XOR only (checked above): byte columns
        view, rview = out.reshape(-1, width), ref.reshape(-1, width)
        for k, op in enumerate(per_byte):
            if op == _XOR:
                view[:, k] ^= rview[:, k]
        return
    o, r = out.view(word), ref.view(word)
    full = (1 << (8 * width)) - 1
    xor_mask = sum(0xFF << (8 * k) for k, op in enumerate(per_byte) if op == _XOR)
    if xor_mask == full:
        np.bitwise_xor(o, r, out=o)
        return
    tmp = np.empty_like(o)
    if xor_mask:
        np.bitwise_and(r, word(xor_mask), out=tmp)
        np.bitwise_xor(o, tmp, out=o)
    for first, last in _runs(per_byte):
        # In-place word operations, no per-byte borrow: below the run, the difference's bytes are
        # (x - b) of the final bytes there, so adding b to them carries exactly the borrow into
        # the run; carries out of the run's top byte are masked off. A 4 MiB fp32 chunk of
        # planes plain, plain, sub, sub: 2.5 ms (an explicit borrow compare took 32 ms).
        mask = _mask(first, last)
        if first == 0 and mask == full:
            np.add(o, r, out=o)  # unsigned: wraps modulo 2**(8*width)
            continue
        low = (1 << (8 * first)) - 1
        if first:
            np.subtract(o, r, out=tmp)
            np.bitwise_and(tmp, word(low), out=tmp)
            if mask | low == full:
                # The run reaches the top: the whole word is (its difference) + b.
                np.bitwise_and(o, word(mask), out=o)
                np.bitwise_or(o, tmp, out=o)
                np.add(o, r, out=o)
                continue
            np.bitwise_or(tmp, np.bitwise_and(o, word(full ^ low)), out=tmp)
            np.add(tmp, r, out=tmp)
        else:
            np.add(o, r, out=tmp)
        np.bitwise_and(tmp, word(mask), out=tmp)
        np.bitwise_and(o, word(full ^ mask), out=o)
        np.bitwise_or(o, tmp, out=o)


def _unsigned(t: torch.Tensor, width: int) -> torch.Tensor:
    """1-D uint8 element bytes as unsigned element values in a type wide enough for their sums
    (int32 up to 2-byte elements: half the GPU memory of int64 for bf16)."""
    wide = torch.int32 if width <= 2 else torch.int64
    if width == 1:
        return t.to(wide)
    return t.view(_TORCH_SIGNED[width]).to(wide) & ((1 << (8 * width)) - 1)


def _to_bytes(values: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`_unsigned` for values in ``[0, 2**(8*width))``: exact casts, no wrapping relied on."""
    if width == 1:
        return values.to(torch.uint8)
    half = 1 << (8 * width - 1)
    signed = torch.where(values >= half, values - 2 * half, values)
    return signed.to(_TORCH_SIGNED[width]).view(torch.uint8)


def sub_bytes_torch(data: torch.Tensor, ref: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`sub_bytes` for 1-D uint8 tensors on any device (the GPU writer's path)."""
    _check_width(width)
    return _to_bytes((_unsigned(data, width) - _unsigned(ref, width)) & ((1 << (8 * width)) - 1), width)


def undo_planes_(out: torch.Tensor, ref: torch.Tensor, width: int, ops: Sequence[str]) -> None:
    """:func:`undo_planes_np_` for 1-D uint8 tensors on any device (the GPU reader's path).

    Computed on wider element values and masked: the same bytes as the numpy path.
    """
    per_byte = _plane_ops(ops, width)
    if _SUB not in per_byte:
        raise ValueError("undo_planes_ is for chunks with subtracted planes; XOR alone is filters.xor")
    _check_width(width)
    o, r = _unsigned(out, width), _unsigned(ref, width)
    full = (1 << (8 * width)) - 1
    xor_mask = sum(0xFF << (8 * k) for k, op in enumerate(per_byte) if op == _XOR)
    if xor_mask:
        o = o ^ (r & xor_mask)
    for first, last in _runs(per_byte):
        mask = _mask(first, last)
        value = (o & mask) + (r & mask)
        if first:
            low = (1 << (8 * first)) - 1
            value = value + ((o & low) < (r & low)).to(o.dtype) * (1 << (8 * first))
        o = (o & (full ^ mask)) | (value & mask)
    out.copy_(_to_bytes(o, width))
