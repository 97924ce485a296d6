"""A ``CodecSpec`` that cannot work is refused when it is made, naming the field."""

from __future__ import annotations

import pytest

import nvcomp_checkpoint as nc


def test_out_of_range_zstd_level_is_refused_when_the_spec_is_made() -> None:
    # Before: accepted here, then a bare ValueError from zstandard in a worker mid-save.
    with pytest.raises(ValueError, match="level"):
        nc.CodecSpec(codec="zstd", level=99)
    with pytest.raises(ValueError, match="level"):
        nc.CodecSpec(codec="gdeflate", level=9)
    nc.CodecSpec(codec="zstd", level=22)
    nc.CodecSpec(codec="zstd", level=-5)


def test_codec_spec_with_wrong_types_names_the_field() -> None:
    with pytest.raises(ValueError, match="level must be an int"):
        nc.CodecSpec(codec="zstd", level="3")
    with pytest.raises(ValueError, match="chunk_bytes must be an int"):
        nc.CodecSpec(codec="zstd", chunk_bytes=4.5e6)
