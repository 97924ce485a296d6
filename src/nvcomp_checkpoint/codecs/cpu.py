"""CPU codecs: libzstd through ``zstandard``, and ``none`` (bytes stored as they are).

A frame written here is a standard Zstd frame, so nvCOMP's Zstd decoder (RAW bitstream) reads
it, and frames nvCOMP writes in RAW mode are read here.
"""

from __future__ import annotations

import threading

import zstandard

from ..errors import FormatError

__all__ = ["ZstdCpuCodec", "NoneCpuCodec"]


class ZstdCpuCodec:
    """Zstandard on the CPU; one compressor per thread (they are not thread-safe).

    ``zstandard`` releases the GIL while it compresses, so a thread pool scales across cores.
    """

    id = "zstd"

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._local = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            # write_content_size keeps frames self-describing; checksums live in our index.
            cctx = zstandard.ZstdCompressor(level=self.level, write_checksum=False)
            self._local.cctx = cctx
        return cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = zstandard.ZstdDecompressor()
            self._local.dctx = dctx
        return dctx

    def encode(self, data: memoryview) -> bytes:
        return self._cctx().compress(data)

    def decode(self, frame: memoryview, raw_size: int) -> bytes:
        dctx = self._dctx()
        try:
            out = dctx.decompress(frame, max_output_size=raw_size)
            if len(out) < raw_size:
                # nvCOMP's batched encoder may write several frames back to back; read them all.
                with dctx.stream_reader(frame, read_across_frames=True) as reader:
                    out = reader.read(raw_size)
        except zstandard.ZstdError as exc:
            raise FormatError(f"corrupt zstd frame: {exc}") from exc
        if len(out) != raw_size:
            raise FormatError(f"zstd frame decoded to {len(out)} bytes, the index says {raw_size}")
        return out


class NoneCpuCodec:
    """Bytes stored as they are."""

    id = "none"

    def __init__(self, level: int | None = None) -> None:
        self.level = None

    def encode(self, data: memoryview) -> bytes:
        return bytes(data)

    def decode(self, frame: memoryview, raw_size: int) -> memoryview:
        if len(frame) != raw_size:
            raise FormatError(f"raw frame holds {len(frame)} bytes, the index says {raw_size}")
        return frame
