"""Codec registry: which codec ids exist, and where each can run.

A codec id names a byte format. ``zstd`` and ``none`` have a CPU and a GPU implementation that
read and write the same bytes; ``ans`` (and the other nvCOMP-only ids) exist only on the GPU, so a
file that uses them needs a CUDA machine with nvCOMP to load. What is known about each id (chunk
limits, levels, nvCOMP options) is one table, :mod:`.registry`.
"""

from __future__ import annotations

from functools import cache

import torch

from ..errors import CodecUnavailableError
from ..version import install_hint
from .base import CodecConfig, CpuCodec, GpuCodec
from .cpu import NoneCpuCodec, ZstdCpuCodec
from .registry import CODEC_FACTS, CodecFacts, codec_facts, gpu_chunk_bytes

__all__ = [
    "CodecConfig",
    "CodecFacts",
    "CODEC_FACTS",
    "codec_facts",
    "gpu_chunk_bytes",
    "CpuCodec",
    "GpuCodec",
    "CODEC_IDS",
    "PORTABLE_CODECS",
    "GPU_ONLY_CODECS",
    "cpu_codec",
    "gpu_codec",
    "gpu_available",
    "has_cpu_decoder",
    "check_level",
]

_CPU_CODECS = {"zstd": ZstdCpuCodec, "none": NoneCpuCodec}
#: Codecs with a CPU and a GPU implementation: files using only these load anywhere.
PORTABLE_CODECS = tuple(f.id for f in CODEC_FACTS.values() if f.portable)
#: nvCOMP codecs with no maintained CPU decoder (NVIDIA/nvcomp issues 62, 80, 104).
GPU_ONLY_CODECS = tuple(f.id for f in CODEC_FACTS.values() if not f.portable)
CODEC_IDS = PORTABLE_CODECS + GPU_ONLY_CODECS


def check_level(codec_id: str, level: int | None) -> None:
    """Refuse a level ``codec_id``'s encoder would reject, before any data is written.

    Raises:
        ValueError: ``level`` is out of the codec's range (from the facts table).
    """
    codec_facts(codec_id).check_level(level)


def has_cpu_decoder(codec_id: str) -> bool:
    """Whether frames of ``codec_id`` can be decoded without a GPU."""
    return codec_id in _CPU_CODECS


@cache
def cpu_codec(codec_id: str, level: int | None = None, adaptive: bool = False) -> CpuCodec:
    """The CPU implementation of ``codec_id`` (cached; instances are thread-safe).

    ``adaptive`` (zstd only): each large frame takes the parameter set, of level 1's and
    ``level``'s, that compresses a sample of it smallest (:class:`.cpu.ZstdCpuCodec`).

    Raises:
        CodecUnavailableError: ``codec_id`` has no CPU implementation.
    """
    cls = _CPU_CODECS.get(codec_id)
    if cls is None:
        if codec_id in GPU_ONLY_CODECS:
            raise CodecUnavailableError(
                f"codec {codec_id!r} is an nvCOMP GPU codec with no CPU implementation; "
                f"it needs a CUDA GPU and the cu12 (or cu13) extra: {install_hint('cu12')}. "
                f"Portable codecs are: {', '.join(PORTABLE_CODECS)}"
            )
        raise CodecUnavailableError(f"unknown codec {codec_id!r}; known codecs: {', '.join(CODEC_IDS)}")
    if adaptive and codec_id == "zstd":
        return ZstdCpuCodec(1 if level is None else level, adaptive=True)
    return cls(level) if level is not None else cls()


def gpu_available() -> bool:
    """True when a CUDA device and the nvCOMP Python package can both be used."""
    if not torch.cuda.is_available():
        return False
    from . import nvcomp

    return nvcomp.is_available()


def gpu_codec(codec_id: str, level: int | None, device: torch.device) -> GpuCodec:
    """The nvCOMP implementation of ``codec_id`` on ``device``.

    Raises:
        CodecUnavailableError: no CUDA device, no nvCOMP, or an unknown codec.
    """
    if codec_id not in CODEC_IDS:
        raise CodecUnavailableError(f"unknown codec {codec_id!r}; known codecs: {', '.join(CODEC_IDS)}")
    from . import nvcomp  # imported lazily so `import nvcomp_checkpoint` never needs CUDA

    return nvcomp.gpu_codec(codec_id, level, device)
