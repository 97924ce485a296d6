"""Choosing between forms of the same bytes from a compressed sample of each, smallest kept.

Two writers choose this way: a delta's plain, XORed or subtracted planes (``delta.py``, per
plane) and a tensor's rotated or plain byte planes (the writer, per tensor: the format records
the filter per tensor).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .codecs import CpuCodec
from .codecs.cpu import spread_sample
from .filters import plane_filter

__all__ = [
    "ROTATION_CHOICE_MIN_BYTES",
    "ROTATION_SAMPLE_BYTES",
    "ROTATION_MIN_GAIN",
    "stored_estimate",
    "smallest_form",
    "choose_rotation",
]

#: Tensors smaller than this keep their spec's filter: a sample costs about the same whatever the
#: tensor's size (0.3 ms), and these hold little of a checkpoint (on the MoE of benchmarks/,
#: tensors of 1 MiB and more hold 91% of its bytes).
ROTATION_CHOICE_MIN_BYTES = 1 << 20
#: Bytes of a tensor (four pieces spread over it) split both ways and compressed to choose.
#: Smaller samples miss repeats that lie rows apart (a MoE's bf16 expert gradients: a 16 KiB
#: sample took rotation where whole tensors code 5% smaller plain; benchmarks/README.md,
#: "Rotation per tensor").
ROTATION_SAMPLE_BYTES = 64 << 10
#: The other filter than the spec's is taken only when its sample stores at least this share of
#: the sample's raw bytes smaller: the two differ by one bit per element, and without a margin
#: the MoE's gradients came out 0.9% larger than with each component's filter (0.2% smaller with it).
ROTATION_MIN_GAIN = 0.001


def stored_estimate(codec: CpuCodec, pieces: Sequence[np.ndarray]) -> int:
    """About the bytes frames of ``pieces`` (1-D uint8 arrays) store: each piece's
    :meth:`~nvcomp_checkpoint.codecs.base.CpuCodec.estimate`, or its own size where that is not
    smaller (a frame that does not shrink is stored raw)."""
    return sum(min(codec.estimate(piece.data), len(piece)) for piece in pieces)


def smallest_form(codec: CpuCodec, forms: Sequence[Sequence[np.ndarray]], margin: int = 0) -> int:
    """The index of the form whose pieces :func:`stored_estimate` says store smallest.

    ``forms`` is in order of preference: a later form is taken only when it stores more than
    ``margin`` bytes less than the one chosen so far, so ties keep the earlier.
    """
    best, best_size = 0, stored_estimate(codec, forms[0])
    for i, pieces in enumerate(forms[1:], start=1):
        size = stored_estimate(codec, pieces)
        if size < best_size - margin:
            best, best_size = i, size
    return best


def choose_rotation(data: np.ndarray, width: int, rotate: int, rotated_first: bool, codec: CpuCodec) -> int:
    """``rotate`` or 0 (plain byte planes): how a tensor's bytes store smaller, judged on a sample.

    Args:
        data: The tensor's bytes (1-D uint8, a whole number of ``width``-byte elements).
        width: Bytes per element.
        rotate: The rotation the format defines for the dtype (``filters.exponent_rotation``).
        rotated_first: The spec's filter is ``"rotplane"``: the rotation stays unless plain planes
            store :data:`ROTATION_MIN_GAIN` of the sample smaller (and the other way round).
        codec: The tensor's codec, whose estimate ranks the two.
    """
    sample = np.frombuffer(spread_sample(data.data, ROTATION_SAMPLE_BYTES, align=width), dtype=np.uint8)
    order = (rotate, 0) if rotated_first else (0, rotate)
    forms = [plane_filter("rotplane" if r else "byteplane", width, r).split(sample) for r in order]
    return order[smallest_form(codec, forms, margin=int(ROTATION_MIN_GAIN * sample.size))]
