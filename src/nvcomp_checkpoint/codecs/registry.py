"""The one table of codec facts: id, portability, chunk limits, levels and nvCOMP options.

Policy, writer, reader and the nvCOMP codecs read their limits from here, so a limit changes in
one place. Every number cites the nvCOMP 6.0 header or docstring it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

__all__ = [
    "CodecFacts",
    "CODEC_FACTS",
    "CHUNK_CAP_BYTES",
    "MIN_CHUNK_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "codec_facts",
    "gpu_chunk_bytes",
    "nvcomp_options",
]

#: Largest chunk of any tensor, on any device: the file format's cap (docs/format.md). A CPU
#: job holds a few chunks, and the reader decodes a chunk in one call, so this bounds memory.
CHUNK_CAP_BYTES = 64 << 20
#: Smallest chunk a policy may ask for (smaller chunks cost more index than they save).
MIN_CHUNK_BYTES = 1 << 10
#: The policy's chunk size unless a codec needs another: measured on the CPU (benchmarks/README.md).
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class CodecFacts:
    """What is known about one codec id.

    Attributes:
        id: The id stored in the checkpoint index.
        portable: A CPU implementation reads and writes the same bytes, so files load anywhere.
        nvcomp_algorithm: ``nvcomp.Codec(algorithm=...)``; None: no nvCOMP implementation.
        max_chunk_bytes: Largest ``CodecSpec.chunk_bytes`` accepted for this codec.
        default_chunk_bytes: ``CodecSpec.chunk_bytes`` when the policy does not say.
        gpu_max_chunk_bytes: Largest raw chunk nvCOMP compresses as one chunk; the writer cuts
            larger policy chunks to this on the GPU (the index records the chunk size used).
        gpu_decode_max_bytes: Largest raw frame handed to nvCOMP's decoder; a larger frame of a
            portable codec is decoded on the CPU instead (see ``zstd`` below for why).
        gpu_chunk_bytes: Chunk size the GPU writer prefers, once measured (None: the policy's).
        min_level, max_level: Accepted levels (None for max: no upper bound; both None: no levels).
        default_level: Level used when the policy gives none.
        level_option: The ``nvcomp.Codec`` keyword a level sets (None: the GPU has no level).
        options: Fixed ``nvcomp.Codec`` keywords (every GPU-only codec sees bytes, ``|u1``).
    """

    id: str
    portable: bool
    nvcomp_algorithm: str | None
    max_chunk_bytes: int = CHUNK_CAP_BYTES
    default_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    gpu_max_chunk_bytes: int = CHUNK_CAP_BYTES
    gpu_decode_max_bytes: int = CHUNK_CAP_BYTES
    gpu_chunk_bytes: int | None = None
    min_level: int | None = None
    max_level: int | None = None
    default_level: int | None = None
    level_option: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        if not MIN_CHUNK_BYTES <= self.default_chunk_bytes <= self.max_chunk_bytes <= CHUNK_CAP_BYTES:
            raise ValueError(f"codec {self.id!r}: chunk limits must satisfy 1 KiB <= default <= max <= 64 MiB")

    @property
    def has_levels(self) -> bool:
        return self.min_level is not None

    def check_level(self, level: int | None) -> None:
        """Refuse a level this codec's encoder would reject, before any data is written.

        Raises:
            ValueError: ``level`` is out of range (the message gives the range).
        """
        if level is None or not self.has_levels:
            return
        assert self.min_level is not None
        if level < self.min_level or (self.max_level is not None and level > self.max_level):
            top = "" if self.max_level is None else f"..{self.max_level}"
            raise ValueError(f"{self.id} level must be in {self.min_level}{top}, got {level}")


# nvCOMP 6.0 facts behind the table (headers of nvidia-libnvcomp-cu13==6.0.0.12, include/nvcomp/):
#
# * zstd.h: nvcompZstdCompressionMaxAllowedChunkSize is (1 << 31) - 1, but the doc of
#   nvcompBatchedZstdCompressAsync says "Chunk sizes must not exceed 16 MB". We take the stricter
#   one: the GPU writer cuts zstd chunks to 16 MiB. The decoder's limit, (1 << 31) - 1, is above
#   our 64 MiB cap, but NVIDIA's samples only show libzstd reading nvCOMP RAW chunks of at most
#   128 KiB, so both directions at 4 MiB, 16 MiB, 64 MiB and odd sizes are checked on a GPU by
#   tests/test_gpu_codecs.py. If nvCOMP fails to read libzstd's large frames, lower
#   gpu_decode_max_bytes: frames above it then decode on the CPU (correct, slower). If libzstd
#   fails to read nvCOMP's, lower gpu_max_chunk_bytes: the GPU writer then writes smaller chunks.
# * gdeflate.h: nvcompGdeflateCompressionMaxAllowedChunkSize is 1 << 31 with the note "caution is
#   advised when using chunk sizes above 64KB" (slow, much temporary memory), and the doc of
#   nvcompBatchedGdeflateCompressAsync says "Chunk sizes must not exceed 65536 bytes". We take
#   the stricter: GDeflate chunks are 64 KiB at most, which is also the size nvCOMP recommends.
#   GDeflate is GPU-only, so its chunks are made small by the policy itself (default 64 KiB),
#   not cut by the writer. The decoder takes (1 << 32) + 288, so no file of ours exceeds it.
# * ans.h, bitcomp.h, cascaded.h: *CompressionMaxAllowedChunkSize is 1 << 24 (16 MiB);
#   decompression takes 1 << 25 of compressed bytes.
# * Every header: "For best performance, a chunk size of 65536 bytes is recommended". Whether
#   that beats our 4 MiB chunks on whole checkpoints is measured by benchmarks/gpu_codec_bench.py
#   (the writer's settings next to smaller chunks); gpu_chunk_bytes takes the winner.
_FACTS = (
    CodecFacts(
        "zstd",
        portable=True,
        nvcomp_algorithm="Zstd",
        gpu_max_chunk_bytes=16 << 20,
        gpu_decode_max_bytes=CHUNK_CAP_BYTES,
        # libzstd's levels (ZSTD_minCLevel() is -(1 << 17)); nvCOMP's Zstd has none: its
        # nvcompBatchedZstdCompressOpts_t is "Currently empty", so the level is the CPU's only.
        min_level=-(1 << 17),
        max_level=22,
        default_level=1,
    ),
    CodecFacts("none", portable=True, nvcomp_algorithm=None),
    CodecFacts(
        # ANS has no level; "|u1" is ans.h's NVCOMP_TYPE_UCHAR. bf16 as "<f2" did not round-trip.
        "ans",
        portable=False,
        nvcomp_algorithm="ANS",
        max_chunk_bytes=16 << 20,
        gpu_max_chunk_bytes=16 << 20,
        gpu_decode_max_bytes=16 << 20,
        options={"data_type": "|u1"},
    ),
    CodecFacts(
        # algorithm_type 0 = default (best ratio), 1 = "sparse" (many zeros, usually faster).
        "bitcomp",
        portable=False,
        nvcomp_algorithm="Bitcomp",
        max_chunk_bytes=16 << 20,
        gpu_max_chunk_bytes=16 << 20,
        gpu_decode_max_bytes=16 << 20,
        min_level=0,
        max_level=1,
        default_level=0,
        level_option="algorithm_type",
        options={"data_type": "|u1"},
    ),
    CodecFacts(
        # algorithm_type 0 (entropy only, fastest) .. 5 (best ratio); nvCOMP's default is 1.
        "gdeflate",
        portable=False,
        nvcomp_algorithm="GDeflate",
        max_chunk_bytes=64 << 10,
        default_chunk_bytes=64 << 10,
        gpu_max_chunk_bytes=64 << 10,
        gpu_decode_max_bytes=CHUNK_CAP_BYTES,
        min_level=0,
        max_level=5,
        default_level=1,
        level_option="algorithm_type",
    ),
    CodecFacts(
        # compression_level: how many optional RLE/delta stages are tried per internal chunk
        # (nvCOMP's default 3; "values above the current stage capacity select the highest").
        "cascaded",
        portable=False,
        nvcomp_algorithm="Cascaded",
        max_chunk_bytes=16 << 20,
        gpu_max_chunk_bytes=16 << 20,
        gpu_decode_max_bytes=16 << 20,
        min_level=0,
        max_level=None,
        default_level=None,
        level_option="compression_level",
        options={"data_type": "|u1"},
    ),
)

#: Every known codec by id (read-only).
CODEC_FACTS: Mapping[str, CodecFacts] = MappingProxyType({f.id: f for f in _FACTS})


def codec_facts(codec_id: str) -> CodecFacts:
    """The facts of ``codec_id``.

    Raises:
        KeyError: unknown id (the message lists the known ones).
    """
    try:
        return CODEC_FACTS[codec_id]
    except KeyError:
        raise KeyError(f"unknown codec {codec_id!r}; known codecs: {', '.join(CODEC_FACTS)}") from None


def gpu_chunk_bytes(codec_id: str, requested: int, itemsize: int = 1) -> int:
    """The chunk size the GPU writer uses for ``requested`` (a multiple of ``itemsize``).

    At most nvCOMP's limit for the codec, and at most the measured GPU chunk size once there is one.
    """
    facts = codec_facts(codec_id)
    limit = facts.gpu_max_chunk_bytes
    if facts.gpu_chunk_bytes is not None:
        limit = min(limit, facts.gpu_chunk_bytes)
    chunk = min(requested, limit)
    return max(itemsize, chunk // itemsize * itemsize)


def nvcomp_options(codec_id: str, level: int | None) -> dict[str, Any]:
    """The algorithm-specific ``nvcomp.Codec`` keywords for ``codec_id`` at ``level``.

    Raises:
        ValueError: ``level`` is out of range, or the codec has no nvCOMP implementation.
    """
    facts = codec_facts(codec_id)
    if facts.nvcomp_algorithm is None:
        raise ValueError(f"no nvCOMP algorithm for codec {codec_id!r}")
    facts.check_level(level)
    options = dict(facts.options)
    value = facts.default_level if level is None else level
    if facts.level_option is not None and value is not None:
        options[facts.level_option] = value
    return options
