"""The codec interface: a codec id is a promise about bytes, not about hardware.

The CPU and the GPU implementation of one id read and write the same bytes, so where the work
runs is a run-time choice and never a format choice (the numcodecs/zarr rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

__all__ = ["CodecConfig", "CpuCodec", "GpuCodec"]


@dataclass(frozen=True)
class CodecConfig:
    """A JSON-safe description of a codec, stored in the checkpoint index.

    Attributes:
        id: The codec id (``"zstd"``, ``"ans"``, ``"none"`` ...).
        level: Compression level where the codec has one (ignored by decoders).
    """

    id: str
    level: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``zstd:3`` (id and level) or ``none``: how reports and ``nvckpt`` name a codec."""
        return self.id if self.level is None else f"{self.id}:{self.level}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.level is not None:
            out["level"] = self.level
        if self.options:
            out["options"] = dict(self.options)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CodecConfig":
        return cls(id=str(data["id"]), level=data.get("level"), options=dict(data.get("options", {})))


class CpuCodec(Protocol):
    """Encodes and decodes one frame of bytes on the CPU. Must be safe to call from threads."""

    id: str

    def encode(self, data: memoryview) -> bytes:
        """Compress ``data`` into one self-contained frame."""
        ...

    def estimate(self, data: memoryview) -> int:
        """About the size :meth:`encode` gives ``data``, in one quick pass (to rank transforms of it)."""
        ...

    def decode(self, frame: memoryview, raw_size: int) -> bytes | bytearray | memoryview:
        """Decompress one frame; the result must be exactly ``raw_size`` bytes."""
        ...

    def decode_into(self, frame: memoryview, out: memoryview) -> None:
        """Decompress one frame into ``out`` (writable, 1-D bytes), which it must fill exactly."""
        ...


class GpuCodec(Protocol):
    """Encodes and decodes batches of frames on one CUDA device."""

    id: str

    def encode_batch(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Compress 1-D contiguous uint8 CUDA tensors; one frame (uint8 CUDA tensor) each."""
        ...

    def decode_batch(
        self,
        frames: Sequence[torch.Tensor],
        raw_sizes: Sequence[int],
        *,
        host_frames: Sequence[bytes | bytearray | memoryview] | None = None,
    ) -> list[torch.Tensor]:
        """Decompress frames (1-D uint8 CUDA tensors) into tensors of ``raw_sizes`` bytes.

        ``host_frames``, when given, are the same frames in host memory: an implementation may
        check them there before its GPU decoder sees them.
        """
        ...
