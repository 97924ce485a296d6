"""Quantized dtypes are refused by the writer and by the reader alike; other torch dtypes round-trip.

A quantized tensor's values need a scale and zero point that the format does not store, so a
reader that accepted ``qint8`` in an index would hand out tensors nothing can use.
"""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import FormatError, UnsupportedObjectError
from nvcomp_checkpoint.format.layout import FOOTER, QUANTIZED_DTYPES, dtype_name

QUANTIZED = sorted(QUANTIZED_DTYPES, key=str)
# Bit containers and sub-byte integer types: no arithmetic, but torch.save keeps them and so do we.
SHELLS = [torch.bits8, torch.bits16, torch.uint1, torch.uint4, torch.int3]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_the_writer_refuses_quantized_dtypes(tmp_path, dtype):
    raw = torch.zeros(4 * dtype.itemsize, dtype=torch.uint8)
    path = tmp_path / "q.nvc"
    with pytest.raises(UnsupportedObjectError, match="quantized"):
        nc.save({"q": raw.view(dtype)}, path)  # a plain view: not is_quantized, still no scale
    if dtype in (torch.qint8, torch.quint8, torch.qint32):
        real = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, dtype)
        with pytest.raises(UnsupportedObjectError, match="dequantize"):
            nc.save({"q": real}, path)
    assert not path.exists()


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_the_reader_refuses_quantized_dtypes(tmp_path, dtype):
    path = tmp_path / "q.nvc"
    nc.save({"q": torch.zeros(4 * dtype.itemsize, dtype=torch.uint8)}, path)
    data = path.read_bytes()
    offset, size, _, magic = FOOTER.unpack(data[-FOOTER.size :])
    index = json.loads(data[offset : offset + size])
    index["tensors"][0]["dtype"] = dtype_name(dtype)
    index["tensors"][0]["shape"] = [4]
    raw = json.dumps(index).encode()
    path.write_bytes(data[:offset] + raw + FOOTER.pack(offset, len(raw), xxhash.xxh3_64_intdigest(raw), magic))
    for call in (lambda: nc.load(path), lambda: nc.open(path)):
        with pytest.raises(FormatError, match=f"dtype '{dtype_name(dtype)}' is quantized"):
            call()


@pytest.mark.parametrize("dtype", SHELLS, ids=str)
def test_bit_container_dtypes_round_trip(tmp_path, dtype):
    t = torch.arange(16, dtype=torch.uint8).view(dtype)
    path = tmp_path / "s.nvc"
    nc.save({"s": t}, path)
    back = nc.load(path)["s"]
    assert back.dtype == dtype
    assert_tree_equal(t.view(torch.uint8), back.view(torch.uint8))
