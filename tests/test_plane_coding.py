"""How byte planes are coded on the CPU: level 1's sampled choice of parameters, and the
``adaptive`` spec behind ``CodecPolicy.max_ratio``.

Every frame either policy writes must stay a standard Zstd frame (or raw) that today's reader,
libzstd and the host check guarding nvCOMP's decoder all accept: the file format does not change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.codecs.cpu import LARGE_FRAME_BYTES, ZstdCpuCodec, _fast_params
from nvcomp_checkpoint.codecs.zstd_frame import read_frame
from nvcomp_checkpoint.filters import ByteplaneFilter

FLOAT8 = [getattr(torch, n) for n in dir(torch) if n.startswith("float8_") and isinstance(getattr(torch, n), torch.dtype)]
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    *FLOAT8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.complex64,
    torch.bool,
]
#: Elements per test tensor: every byte plane is a large frame, so the sampled choice runs.
NUMEL = LARGE_FRAME_BYTES + 3


def _tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(NUMEL, generator=g, dtype=torch.float64) * 0.02
    values[NUMEL // 3 : NUMEL // 2] = 0  # a run of zeros, as in untouched embedding rows
    if dtype.is_complex:
        return torch.complex(values, values.flip(0)).to(dtype)
    if dtype == torch.bool:
        return values > 0
    if dtype.is_floating_point:
        return values.to(dtype)
    return (
        (values * 1000).round().clamp(-100, 100).to(dtype)
        if dtype != torch.uint8
        else (values * 1000).abs().clamp(0, 255).to(dtype)
    )


def _frames(path) -> list[tuple[str, bytes, int]]:
    """(key, stored bytes, raw size) of every frame in the file."""
    out = []
    data = path.read_bytes()
    with nc.open(path) as reader:
        for key in reader.keys():
            for frame in reader.entry(key).frames:
                out.append((key, data[frame.offset : frame.offset + frame.size], frame.raw_size))
    return out


@pytest.mark.parametrize("policy", ["default", "max_ratio"])
def test_every_dtype_round_trips_and_every_frame_is_standard_zstd(tmp_path, policy: str) -> None:
    tree = {str(dt).removeprefix("torch."): _tensor(dt, i) for i, dt in enumerate(DTYPES)}
    # Level 9 stands for max_ratio's level 19 here: the same code path, a fraction of the time.
    pol = nc.CodecPolicy() if policy == "default" else nc.CodecPolicy.max_ratio(level=9)
    path = tmp_path / "planes.nvc"
    nc.save(tree, path, policy=pol)
    assert_tree_equal(nc.load(path), tree)
    compressed = 0
    for key, frame, raw_size in _frames(path):
        if len(frame) == raw_size:
            continue  # stored raw
        compressed += 1
        # One standard frame, accepted by the host check in front of nvCOMP and read by libzstd.
        assert read_frame(frame, raw_size).content_size == raw_size, key
        assert len(zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw_size)) == raw_size, key
    assert compressed >= len(DTYPES)  # the zero run makes at least one plane of each compress


def _bf16_exponent_plane(scale: float) -> bytes:
    torch.manual_seed(0)
    weights = (torch.randn(1 << 19) * scale).to(torch.bfloat16)
    return ByteplaneFilter(2).split(weights.view(torch.uint8).numpy())[1].tobytes()


@pytest.mark.parametrize("scale", [0.02, 1.0])
@pytest.mark.parametrize("nbytes", [1 << 19, 200 << 10, 100 << 10, 40 << 10, 16 << 10])
def test_level1_codes_a_bf16_exponent_plane_as_small_as_level19(scale: float, nbytes: int) -> None:
    # A trained weight's exponent plane has short matches that cost more than they save;
    # level 1 must not spend bits on them (libzstd's optimal parser at level 19 does not),
    # whatever the plane's size: a 384 x 384 bf16 matrix's plane is 144 KiB.
    plane = _bf16_exponent_plane(scale)[:nbytes]
    ours = len(ZstdCpuCodec(1).encode(memoryview(plane)))
    best = len(zstandard.ZstdCompressor(level=19).compress(plane))
    # (Below 16 KiB a frame's headers and Huffman table dominate: a few bytes either way.)
    assert ours <= best * 1.005, f"level 1: {ours} bytes, level 19: {best}"


def _adam_state() -> dict:
    """A real AdamW state of an embedding of which only some rows were used (zero moments)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4096, 128)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        emb(torch.randint(0, 1500, (64, 16))).square().mean().backward()
        opt.step()
    return {"model": emb.state_dict(), "optimizer": opt.state_dict(), "gradients": {"weight": emb.weight.grad.to(torch.bfloat16)}}


def _sparse_state() -> dict:
    """Mostly-zero gradients and moments, as of a mixture of experts' unrouted experts."""
    torch.manual_seed(0)
    g = torch.randn(1 << 20) * 1e-3
    g[torch.rand(1 << 20) < 0.8] = 0
    return {"gradients": {"w": g.to(torch.bfloat16)}, "optimizer": {"state": {0: {"exp_avg": g * 0.1, "exp_avg_sq": g * g}}}}


def test_max_ratio_is_smaller_than_the_default_and_never_larger_per_component(tmp_path) -> None:
    # Where the planes have structure a strong level finds, it is taken ...
    sparse = _sparse_state()
    default = nc.save(sparse, tmp_path / "sparse-default.nvc")
    best = nc.save(sparse, tmp_path / "sparse-max.nvc", policy=nc.CodecPolicy.max_ratio())
    for comp in ("exp_avg", "exp_avg_sq", "gradients"):
        assert best.components[comp].stored_bytes < default.components[comp].stored_bytes * 0.95, comp
    assert_tree_equal(nc.load(tmp_path / "sparse-max.nvc"), sparse)
    # ... and where it is not, a plane keeps level 1's coding: never larger.
    state = _adam_state()
    default = nc.save(state, tmp_path / "default.nvc")
    best = nc.save(state, tmp_path / "max.nvc", policy=nc.CodecPolicy.max_ratio())
    for comp in ("weights", "exp_avg", "exp_avg_sq", "gradients"):
        assert best.components[comp].stored_bytes <= default.components[comp].stored_bytes, comp
    assert_tree_equal(nc.load(tmp_path / "max.nvc"), state)


def test_adaptive_is_a_checked_spec_field() -> None:
    spec = nc.CodecSpec(codec="zstd", level=9, adaptive=True)
    assert nc.CodecSpec.from_dict(spec.to_dict()) == spec
    policy = nc.CodecPolicy.from_dict({"exp_avg": {"codec": "zstd", "level": 9, "adaptive": True}})
    assert policy.exp_avg.adaptive and not policy.weights.adaptive
    assert nc.CodecPolicy.from_dict(nc.CodecPolicy.max_ratio().to_dict()) == nc.CodecPolicy.max_ratio()
    with pytest.raises(ValueError, match="adaptive applies to codec 'zstd' only"):
        nc.CodecSpec(codec="none", level=None, filter="none", adaptive=True)
    with pytest.raises(ValueError, match="adaptive must be a bool"):
        nc.CodecSpec(adaptive="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exp_avg: adaptive must be a bool"):
        nc.CodecPolicy.from_dict({"exp_avg": {"codec": "zstd", "adaptive": 1}})


def test_the_sampled_choice_never_loses_to_either_parameter_set_on_whole_planes() -> None:
    # The choice is made on a sample; on planes of one kind throughout it picks the winner.
    from nvcomp_checkpoint.codecs.cpu import _LARGE_LEVEL1

    rng = np.random.default_rng(0)
    zeros_and_values = np.where(rng.random(1 << 20) < 0.5, 0, rng.integers(60, 64, 1 << 20)).astype(np.uint8)
    for plane in (_bf16_exponent_plane(0.02), np.sort(zeros_and_values).tobytes()):
        ours = len(ZstdCpuCodec(1).encode(memoryview(plane)))
        each = [len(zstandard.ZstdCompressor(compression_params=p).compress(plane)) for p in _LARGE_LEVEL1.values()]
        assert ours == min(each)


def test_a_plane_whose_repeats_lie_far_apart_gets_the_large_hash_table() -> None:
    # 500 distinct 64-byte runs in random order: more 7-byte contexts than 2**10 table
    # entries keep, far fewer than 2**13 (the high plane of a MoE's bf16 gradients is alike).
    rng = np.random.default_rng(0)
    blocks = rng.integers(120, 128, (500, 64), dtype=np.uint8)
    plane = blocks[rng.integers(0, 500, (1 << 20) // 64)].tobytes()
    ours = len(ZstdCpuCodec(1).encode(memoryview(plane)))
    hash10 = len(zstandard.ZstdCompressor(compression_params=_fast_params(10)).compress(plane))
    assert ours < 0.5 * hash10


def _frame_bytes(path, key: str) -> list[bytes]:
    data = path.read_bytes()
    with nc.open(path) as reader:
        return [data[f.offset : f.offset + f.size] for f in reader.entry(key).frames]


def test_a_delta_codes_its_plain_planes_as_a_full_save_of_the_same_policy_does(tmp_path) -> None:
    # max_ratio's adaptive coding holds in deltas too: a plane stored plain (no base form wins on
    # unrelated values) is the very frame a full save writes, not a non-adaptive level-19 frame.
    g = torch.Generator().manual_seed(3)
    shape = (LARGE_FRAME_BYTES + 5, 2)
    base = {"model": {"w": (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)}}
    later = {"model": {"w": (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)}}
    policy = nc.CodecPolicy.uniform(nc.CodecSpec("zstd", 19, "byteplane", adaptive=True))
    nc.save(base, tmp_path / "base.nvc", policy=policy)
    nc.save(later, tmp_path / "full.nvc", policy=policy)
    nc.save(later, tmp_path / "delta.nvc", policy=policy, base=tmp_path / "base.nvc")
    with nc.open(tmp_path / "delta.nvc") as reader:
        assert not any(f.op for f in reader.entry("model/w").frames)
    assert _frame_bytes(tmp_path / "delta.nvc", "model/w") == _frame_bytes(tmp_path / "full.nvc", "model/w")
    assert_tree_equal(nc.load(tmp_path / "delta.nvc"), later)
