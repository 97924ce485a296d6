"""Bit-exact round trips of every dtype, shape and memory layout a checkpoint can hold.

Each case goes through a real file on disk with every codec/filter pair a CPU can write.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal

CHUNK = 4096

FLOAT8 = [getattr(torch, n) for n in dir(torch) if n.startswith("float8_") and isinstance(getattr(torch, n), torch.dtype)]
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, *FLOAT8]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
# Packed sub-byte types: checkpoints of quantized models hold them as plain storage.
PACKED = [torch.float4_e2m1fn_x2] if hasattr(torch, "float4_e2m1fn_x2") else []
DTYPES = [*FLOATS, *INTS, *COMPLEX, torch.bool, *PACKED]

SPECS = {
    f"{codec}-{filt}": nc.CodecSpec(codec=codec, level=1 if codec == "zstd" else None, filter=filt, chunk_bytes=CHUNK)
    for codec in ("zstd", "none")
    for filt in ("byteplane", "none")
}


def _policy(spec: nc.CodecSpec) -> nc.CodecPolicy:
    # min_compress_bytes=0: even tiny tensors go through the spec under test.
    return nc.CodecPolicy.uniform(spec, min_compress_bytes=0)


def _random_tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """``numel`` elements whose bytes are half structured (compressible) and half random."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    half = nbytes // 2
    structured = (torch.arange(half) // 64 % 7).to(torch.uint8)
    noise = torch.randint(0, 256, (nbytes - half,), dtype=torch.uint8, generator=g)
    return torch.cat([structured, noise]).view(dtype)


def _roundtrip(tmp_path, obj, policy: nc.CodecPolicy, name: str = "ckpt.nvc"):
    path = tmp_path / name
    nc.save(obj, path, policy)
    back = nc.load(path)
    with nc.open(path) as reader:
        problems = [(e.key, err) for e, err in reader.verify() if err is not None]
        assert not problems, problems
    return back, path


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtype_roundtrip_multi_chunk(tmp_path, dtype, spec_name):
    """Several chunks and a partial last chunk, for every dtype and codec/filter pair."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 2 * CHUNK // itemsize + 37  # two full chunks and a short third one
    t = _random_tensor(dtype, numel).reshape(-1, 1) if numel % 2 else _random_tensor(dtype, numel)
    spec = SPECS[spec_name]
    back, path = _roundtrip(tmp_path, {"t": t, "scalar": t.reshape(-1)[5].clone()}, _policy(spec))
    assert_tree_equal({"t": t, "scalar": t.reshape(-1)[5].clone()}, back)

    with nc.open(path) as reader:
        entry = reader.entry("t")
        assert entry.dtype == dtype and entry.shape == tuple(t.shape)
        assert entry.codec.id == spec.codec and entry.filter == spec.filter
        planes = entry.width if spec.filter == "byteplane" else 1
        assert len(entry.frames) == 3 * planes
        assert [c[1] for c in entry.chunks()] == [CHUNK, CHUNK, 37 * itemsize]
        if spec.codec == "none":
            assert all(f.is_raw for f in entry.frames)
        else:
            # The structured first chunk shrinks; the random last bytes are stored raw.
            assert any(not f.is_raw for f in entry.frames)
        assert_tree_equal(t, reader.read("t"))


def _bits(fmt: str, dtype: torch.dtype, words: list[int]) -> torch.Tensor:
    data = struct.pack("<" + fmt * len(words), *words)
    return torch.frombuffer(bytearray(data), dtype=dtype).clone()


SPECIAL_VALUES = {
    # quiet NaN, NaN with payloads (both signs), signalling NaN, +-inf, -0.0, smallest subnormal
    torch.float32: _bits(
        "I", torch.int32, [0x7FC00000, 0x7FC12345, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001]
    ).view(torch.float32),
    torch.float64: _bits(
        "Q",
        torch.int64,
        [
            0x7FF8000000000000,
            0x7FF8DEADBEEF0001,
            0xFFF0000000000001,
            0x7FF0000000000000,
            0xFFF0000000000000,
            0x8000000000000000,
            1,
        ],
    ).view(torch.float64),
    torch.float16: _bits("H", torch.int16, [0x7E00, 0x7E01, 0xFD55, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001]).view(torch.float16),
    torch.bfloat16: _bits("H", torch.int16, [0x7FC0, 0x7FC1, 0xFF81, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001]).view(
        torch.bfloat16
    ),
}


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("dtype", list(SPECIAL_VALUES), ids=str)
def test_nan_payloads_and_infinities_keep_their_bits(tmp_path, dtype, spec_name):
    special = SPECIAL_VALUES[dtype]
    # Repeated so the zstd path actually compresses these bytes instead of storing them raw.
    t = special.repeat(600)
    back, _ = _roundtrip(tmp_path, {"t": t}, _policy(SPECS[spec_name]))
    assert_tree_equal({"t": t}, back)
    assert back["t"].isnan().sum() == t.isnan().sum() > 0


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_zero_size_and_zero_dim(tmp_path, spec_name):
    tree = {
        "empty": torch.empty(0),
        "empty_3d": torch.empty(3, 0, 5, dtype=torch.bfloat16),
        "empty_int": torch.empty(0, 4, dtype=torch.int64),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "scalar_bool": torch.tensor(True),
        "scalar_half": torch.tensor(-0.0, dtype=torch.float16),
        "step": torch.tensor(17),
    }
    back, path = _roundtrip(tmp_path, tree, _policy(SPECS[spec_name]))
    assert_tree_equal(tree, back)
    assert back["scalar"].dim() == 0 and back["empty_3d"].shape == (3, 0, 5)
    with nc.open(path) as reader:
        assert reader.entry("empty_3d").frames == ()
        assert reader.read("empty_3d").shape == (3, 0, 5)


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_non_contiguous_views(tmp_path, spec_name):
    base = _random_tensor(torch.float32, 64 * 48).reshape(64, 48)
    cbase = _random_tensor(torch.complex64, 40 * 3, seed=1).reshape(40, 3)
    tree = {
        "transposed": base.t(),
        "step_slice": base[1::3, ::2],
        "column": base[:, 5],
        # One element with stride 2: "contiguous", yet view(uint8) refuses it (regression).
        "one_strided": base[0, :2][::2],
        "expanded": base[:, :1].expand(64, 32),
        "permuted": base.reshape(4, 16, 48).permute(2, 0, 1),
        "channels_last": _random_tensor(torch.bfloat16, 2 * 3 * 8 * 8).reshape(2, 3, 8, 8).to(memory_format=torch.channels_last),
        # Lazy conjugate / negative views cannot be viewed as bytes directly (regression).
        "conj": cbase.conj(),
        "neg": torch._neg_view(cbase) if hasattr(torch, "_neg_view") else -cbase,
    }
    assert not any(tree[k].is_contiguous() for k in ("transposed", "step_slice", "column", "expanded", "permuted"))
    back, _ = _roundtrip(tmp_path, tree, _policy(SPECS[spec_name]))
    # Values are bit-identical; the layout comes back contiguous.
    assert_tree_equal({k: v.resolve_conj().resolve_neg() for k, v in tree.items()}, back)
    assert torch.equal(back["conj"], cbase.conj()) and not back["conj"].is_conj()


def test_non_contiguous_view_spanning_chunks(tmp_path):
    base = _random_tensor(torch.float16, 16 * CHUNK).reshape(64, -1)
    view = base[::2, 1::3]
    assert view.numel() * 2 > 3 * CHUNK
    back, path = _roundtrip(tmp_path, {"v": view}, _policy(SPECS["zstd-byteplane"]))
    assert_tree_equal({"v": view}, back)
    with nc.open(path) as reader:
        assert len(reader.entry("v").chunks()) > 3


def test_shared_storage_parameters_and_requires_grad(tmp_path):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied weights
    frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    leaf = torch.randn(5, requires_grad=True)
    tree = {
        "emb": emb.weight,
        "head": head.weight,
        "again": [emb.weight, {"x": emb.weight}],
        "frozen": frozen,
        "leaf": leaf,
        "plain": torch.randn(3),
    }
    back, path = _roundtrip(tmp_path, tree, nc.CodecPolicy())
    assert_tree_equal(tree, back)
    assert back["emb"] is back["head"] is back["again"][0] is back["again"][1]["x"]
    assert isinstance(back["emb"], torch.nn.Parameter) and back["emb"].requires_grad
    assert isinstance(back["frozen"], torch.nn.Parameter) and not back["frozen"].requires_grad
    assert type(back["leaf"]) is torch.Tensor and back["leaf"].requires_grad and back["leaf"].is_leaf
    assert not back["plain"].requires_grad
    with nc.open(path) as reader:
        # Stored once, not once per reference; readable by every path.
        assert len(reader.index.tensors) == 4
        assert set(reader.keys()) == {"emb", "head", "again/0", "again/1/x", "frozen", "leaf", "plain"}
        assert torch.equal(reader.read("again/1/x"), emb.weight.detach())


def test_state_dict_of_tied_model_loads_into_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30, bias=False))
    model[1].weight = model[0].weight
    state = model.state_dict(keep_vars=True)
    back, _ = _roundtrip(tmp_path, state, nc.CodecPolicy())
    assert back["0.weight"] is back["1.weight"]
    fresh = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30, bias=False))
    fresh.load_state_dict(back)
    assert torch.equal(fresh[0].weight, model[0].weight)


# -- property: any tensor save accepts round-trips bit-exactly --------------------------------

_HYP_DTYPES = [*FLOATS, *INTS, *COMPLEX, torch.bool]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_HYP_DTYPES))
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=4))
    numel = 1
    for d in shape:
        numel *= d
    seed = draw(st.integers(0, 2**31 - 1))
    t = _random_tensor(dtype, numel, seed).reshape(shape)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["permute", "slice", "expand", "unsqueeze", "as_strided"]))
        if op == "permute" and t.dim() > 1:
            t = t.permute(draw(st.permutations(range(t.dim()))))
        elif op == "slice" and t.dim() > 0:
            dim = draw(st.integers(0, t.dim() - 1))
            start = draw(st.integers(0, max(0, t.shape[dim] - 1)))
            step = draw(st.integers(1, 3))
            t = t[(slice(None),) * dim + (slice(start, None, step),)]
        elif op == "expand":
            t = t.unsqueeze(0).expand(draw(st.integers(1, 3)), *t.shape)
        elif op == "unsqueeze":
            t = t.unsqueeze(draw(st.integers(0, t.dim())))
        elif op == "as_strided" and t.numel() > 1:
            # Overlapping windows over the same storage.
            t = t.contiguous().reshape(-1).as_strided((t.numel() - 1, 2), (1, 1))
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=_tensors(), spec_name=st.sampled_from(list(SPECS)), chunk=st.sampled_from([1024, 1536, 4096]))
def test_property_accepted_tensor_roundtrips(tmp_path, t, spec_name, chunk):
    spec = SPECS[spec_name]
    policy = nc.CodecPolicy.uniform(
        nc.CodecSpec(codec=spec.codec, level=spec.level, filter=spec.filter, chunk_bytes=chunk), min_compress_bytes=0
    )
    back, path = _roundtrip(tmp_path, {"t": t}, policy, name="prop.nvc")
    assert_tree_equal({"t": t}, back)
    with nc.open(path) as reader:
        assert_tree_equal(t, reader.read("t"))
