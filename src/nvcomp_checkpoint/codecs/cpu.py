"""CPU codecs: libzstd through ``zstandard``, and ``none`` (bytes stored as they are).

A frame written here is a standard Zstd frame, so nvCOMP's Zstd decoder (RAW bitstream) reads
it, and frames nvCOMP writes in RAW mode are read here.
"""

from __future__ import annotations

import threading

import zstandard

from ..errors import FormatError
from .registry import CHUNK_CAP_BYTES

__all__ = ["ZstdCpuCodec", "NoneCpuCodec", "LARGE_FRAME_BYTES", "PICK_SAMPLE_BYTES", "ZSTD_MAX_LEVEL", "spread_sample"]

#: Level-1 frames at least this large (libzstd's largest source-size class) are compressed with
#: libzstd's level-1 parameters for that class except for a small hash table, of 2**10 or 2**6
#: entries (instead of 2**14), whichever compresses a sample of the frame smaller. Exponent
#: planes have short matches that cost more than they save; a small table finds fewer of them:
#: 2**10 is about 40% faster than 2**14 and 2-3% smaller, and 2**6 is faster again and leaves
#: a bf16 weight's exponent plane within 0.1% of a Huffman-only coding of it, while the zero runs
#: of optimizer moments and gradients still need 2**10 (benchmarks/README.md, "Peer coders").
#: Frames stay standard Zstd frames. Smaller level-1 frames of :data:`SMALL_FRAME_BYTES` or more
#: choose between the same two sets by compressing the whole frame with both: libzstd's own
#: level 1 for small sources looks for 5-byte matches, which cost a bf16 exponent plane 13%
#: (MiniLM's 384 x 384 matrices have 144 KiB planes).
LARGE_FRAME_BYTES = 256 << 10
#: Below this a frame is mostly headers and its Huffman table (tens of bytes either way): it
#: keeps libzstd's level 1, and the bytes of files such as tests/data/golden_v1.nvc stay as they were.
SMALL_FRAME_BYTES = 4 << 10
#: Bytes of a large frame compressed with each candidate parameter set to choose one (four
#: pieces spread over the frame): on the checkpoints of benchmarks/ a 32 KiB sample picks what
#: compressing whole planes would.
PICK_SAMPLE_BYTES = 32 << 10
#: An adaptive frame takes the strong level only where it saves at least this share of the
#: sample over the better fast set: smaller gains (a bf16 weight's exponent plane, 0.1%) cost
#: 100x the time of level 1 for almost nothing (benchmarks/README.md, "Peer coders").
ADAPTIVE_MIN_GAIN = 0.01
#: Highest level libzstd accepts (negative levels, faster than 1, are accepted too).
ZSTD_MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL


def _fast_params(hash_log: int) -> zstandard.ZstdCompressionParameters:
    return zstandard.ZstdCompressionParameters(
        window_log=19,
        chain_log=13,
        hash_log=hash_log,
        search_log=1,
        min_match=7,
        target_length=0,
        strategy=zstandard.STRATEGY_FAST,
        write_content_size=1,
        write_checksum=0,
    )


#: The level-1 parameter sets a large frame chooses from, fastest first (a tie keeps the first).
#: 2**13 entries (libzstd's own level-1 table for large sources) win on planes whose repeats lie
#: farther apart than 2**10 entries remember: the high plane of a MoE's bf16 gradients codes
#: 5% smaller with it (3.55x against 3.37x; benchmarks/README.md, "Limits").
_LARGE_LEVEL1 = {"fast6": _fast_params(6), "fast10": _fast_params(10), "fast13": _fast_params(13)}
_LARGE_LEVEL1_ORDER = ("fast6", "fast10", "fast13")
#: Frames under LARGE_FRAME_BYTES are compressed whole with each set: two sets there, as before.
_SMALL_LEVEL1_ORDER = ("fast6", "fast10")


class ZstdCpuCodec:
    """Zstandard on the CPU; one compressor per thread (they are not thread-safe).

    ``zstandard`` releases the GIL while it compresses, so a thread pool scales across cores.

    Args:
        level: libzstd's level. Level 1 compresses frames of :data:`LARGE_FRAME_BYTES` or more
            with the better of two fast parameter sets on a sample.
        adaptive: Each frame of :data:`LARGE_FRAME_BYTES` or more is compressed with ``level``
            where that compresses a sample of it at least :data:`ADAPTIVE_MIN_GAIN` smaller
            than the better level-1 set does, else like level 1 (``CodecPolicy.max_ratio``): libzstd's strong levels win big on exponent planes
            with structure and lose on others, and they cost far more time than level 1.
    """

    id = "zstd"

    def __init__(self, level: int = 1, adaptive: bool = False) -> None:
        self.level = level
        self.adaptive = adaptive
        self._local = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            # write_content_size keeps frames self-describing; checksums live in our index.
            cctx = zstandard.ZstdCompressor(level=self.level, write_checksum=False)
            self._local.cctx = cctx
        return cctx

    def _cctx_named(self, name: str) -> zstandard.ZstdCompressor:
        named = getattr(self._local, "named", None)
        if named is None:
            named = self._local.named = {}
        cctx = named.get(name)
        if cctx is None:
            cctx = named[name] = zstandard.ZstdCompressor(compression_params=_LARGE_LEVEL1[name])
        return cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = zstandard.ZstdDecompressor()
            self._local.dctx = dctx
        return dctx

    def encode(self, data: memoryview) -> bytes:
        data = memoryview(data)
        if SMALL_FRAME_BYTES <= data.nbytes < LARGE_FRAME_BYTES and self.level == 1:
            # Both sets on the whole frame: smaller than a sample plus the frame, and exact.
            frames = [self._cctx_named(name).compress(data) for name in _SMALL_LEVEL1_ORDER]
            return min(frames, key=len)
        if data.nbytes >= LARGE_FRAME_BYTES and (self.level == 1 or self.adaptive):
            sample = spread_sample(data.cast("B"), PICK_SAMPLE_BYTES)
            fast = [self._cctx_named(name) for name in _LARGE_LEVEL1_ORDER]
            sizes = [len(c.compress(sample)) for c in fast]
            best = min(range(len(fast)), key=lambda i: (sizes[i], i))
            if self.adaptive and self.level != 1:
                strong = self._cctx()
                if len(strong.compress(sample)) <= sizes[best] * (1 - ADAPTIVE_MIN_GAIN):
                    return strong.compress(data)
            return fast[best].compress(data)
        return self._cctx().compress(data)

    def estimate(self, data: memoryview) -> int:
        # One compression with libzstd's own parameters for the level: the delta writer ranks
        # a sample's forms with it, where choosing a parameter set per form would cost twice.
        return len(self._cctx().compress(data))

    def decode(self, frame: memoryview, raw_size: int) -> bytes | bytearray:
        dctx = self._dctx()
        try:
            declared = zstandard.frame_content_size(frame)  # -1: not in the frame header
            if declared > raw_size:
                raise FormatError(f"zstd frame declares {declared} bytes, the index says {raw_size}")
            # One-shot decoding allocates the declared size, or raw_size when none is declared;
            # both are bounded here. Anything else streams, so that a forged index size never
            # allocates more than the frames really hold.
            out: bytes | bytearray
            if declared == raw_size or (declared < 0 and raw_size <= _ONE_SHOT_LIMIT):
                out = dctx.decompress(frame, max_output_size=raw_size)
            else:
                out = b""
            if len(out) < raw_size:
                # nvCOMP's batched encoder may write several frames back to back; read them all.
                out = _read_across_frames(dctx, frame, raw_size)
        except zstandard.ZstdError as exc:
            raise FormatError(f"corrupt zstd frame: {exc}") from exc
        if len(out) != raw_size:
            raise FormatError(f"zstd frame decoded to {len(out)} bytes, the index says {raw_size}")
        return out

    def decode_into(self, frame: memoryview, out: memoryview) -> None:
        raw_size = out.nbytes
        if raw_size < _INTO_MIN_BYTES:
            out[:] = self.decode(frame, raw_size)
            return
        try:
            declared = zstandard.frame_content_size(frame)
            if declared == raw_size:
                # libzstd decodes a frame whose declared size fits the output in one pass straight
                # into it (ZSTD_decompressStream's single-pass path): no bytes object, no copy.
                done = 0
                with self._dctx().stream_reader(frame) as reader:
                    while done < raw_size:
                        got = reader.readinto(out[done:])
                        if not got:
                            break
                        done += got
                if done == raw_size:
                    return
        except zstandard.ZstdError as exc:
            raise FormatError(f"corrupt zstd frame: {exc}") from exc
        # No declared size, a forged one, or several frames back to back (nvCOMP): decode's checks.
        out[:] = self.decode(frame, raw_size)


def spread_sample(data: memoryview, nbytes: int, align: int = 1) -> bytes:
    """About ``nbytes`` of ``data`` (1-D bytes) in four pieces spread over it, or all of it if not
    larger: planes change along a tensor (the zero rows of an embedding's moments may all lie past
    its first rows). With ``align``, pieces start and end on multiples of it (whole elements)."""
    piece = nbytes // 4 // align * align
    if len(data) <= 4 * piece or piece == 0:
        return bytes(data)
    step = (len(data) - piece) // 3 // align * align
    return b"".join(data[i * step : i * step + piece] for i in range(4))


#: Below this ``decode_into`` decodes to a new buffer and copies: a stream reader costs more
#: than the copy of a small frame.
_INTO_MIN_BYTES = 64 << 10

#: Largest output decoded in one call without a size from the frame header: a chunk's cap.
_ONE_SHOT_LIMIT = CHUNK_CAP_BYTES


def _read_across_frames(dctx: zstandard.ZstdDecompressor, frame: memoryview, raw_size: int) -> bytearray:
    out = bytearray()
    with dctx.stream_reader(frame, read_across_frames=True) as reader:
        while len(out) < raw_size:
            piece = reader.read(min(raw_size - len(out), 1 << 20))
            if not piece:
                break
            out += piece
    return out


class NoneCpuCodec:
    """Bytes stored as they are."""

    id = "none"

    def __init__(self, level: int | None = None) -> None:
        self.level = None

    def encode(self, data: memoryview) -> bytes:
        return bytes(data)

    def estimate(self, data: memoryview) -> int:
        return len(data)

    def decode(self, frame: memoryview, raw_size: int) -> memoryview:
        if len(frame) != raw_size:
            raise FormatError(f"raw frame holds {len(frame)} bytes, the index says {raw_size}")
        return frame

    def decode_into(self, frame: memoryview, out: memoryview) -> None:
        out[:] = self.decode(frame, out.nbytes)
