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


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: nc.CodecSpec.parse("zstd:1:bytplane"), "did you mean 'byteplane'?"),
        (lambda: nc.CodecSpec(codec="zstd", filter="rotplan"), "did you mean 'rotplane'?"),
        (lambda: nc.CodecSpec.parse("zsdt:3"), "did you mean 'zstd'?"),
        (lambda: nc.CodecPolicy.from_dict({"weigths": "zstd"}), "did you mean 'weights'?"),
        (lambda: nc.CodecSpec.from_dict({"codec": "zstd", "lvl": 3}), "did you mean 'level'?"),
    ],
    ids=["filter-in-shorthand", "filter", "codec", "policy-key", "spec-key"],
)
def test_a_misspelt_name_gets_a_did_you_mean(make, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert fragment in str(info.value), str(info.value)


def test_unknown_spec_keys_list_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        nc.CodecPolicy.from_dict({"weights": {"codec": "zstd", "compression": 3}})
    assert "unknown codec spec keys ['compression']; the keys are: codec, level, filter, chunk_bytes, adaptive" in str(info.value)


@pytest.mark.parametrize("text", ["none:3", "none:byteplane", "none:1:rotplane"])
def test_none_takes_no_level_and_no_filter(text: str) -> None:
    # `none` stores bytes as they are: a level or filter there is a mistake, not a setting.
    with pytest.raises(ValueError, match=r"'none' stores the bytes as they are: it takes no level and no filter; write 'none'"):
        nc.CodecSpec.parse(text)
    with pytest.raises(ValueError, match="takes no level and no filter"):
        nc.CodecPolicy.from_dict({"weights": text})
    with pytest.raises(ValueError, match="takes no level and no filter"):
        nc.CodecSpec.from_dict({"codec": "none", "level": 3})
    assert nc.CodecSpec.parse("none") == nc.CodecSpec.from_dict({"codec": "none", "level": None, "filter": "none"})
