"""GPU codecs (nvCOMP): bit-exact round trips, and zstd frames that libzstd reads both ways.

Tests marked ``gpu`` need CUDA and nvCOMP and skip without them (they run through
benchmarks/gpu_check.sh on a GPU machine); the unmarked tests run everywhere and check that the
module imports and refuses clearly when the GPU stack is missing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import zstandard

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.codecs import nvcomp as nvcomp_codecs
from nvcomp_checkpoint.codecs.cpu import ZstdCpuCodec
from nvcomp_checkpoint.errors import ChecksumError, CodecUnavailableError, FormatError

KIB = 1024
MIB = 1024 * KIB
GPU_ONLY = ("ans", "bitcomp", "gdeflate", "cascaded")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cuda_device() -> torch.device:
    """The current CUDA device, or a skip that says what is missing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is False")
    pytest.importorskip(
        "nvidia.nvcomp",
        reason="needs nvCOMP (module nvidia.nvcomp): pip install nvcomp-checkpoint[cu12] or [cu13]",
    )
    return torch.device("cuda", torch.cuda.current_device())


def _weights_bf16(numel: int, seed: int) -> torch.Tensor:
    """bf16 values like trained weights, N(0, 0.02), generated on the CPU so they are seeded."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16)


def _sample_bytes(size: int, seed: int = 0) -> torch.Tensor:
    """``size`` bytes (CPU uint8): weight-like bf16 bytes, so they compress a little."""
    return _weights_bf16((size + 1) // 2, seed).view(torch.uint8)[:size].clone()


def _tensor_kind(kind: str, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "bf16-random":
        return (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16)
    if kind == "fp32-random":
        return torch.randn(numel, generator=gen) * 1e-4
    if kind == "bf16-zeros":
        return torch.zeros(numel, dtype=torch.bfloat16)
    if kind == "fp32-zeros":
        return torch.zeros(numel, dtype=torch.float32)
    raise AssertionError(kind)


def _host_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _assert_one_zstd_frame(frame: bytes) -> None:
    """``frame`` is exactly one standard Zstd frame, nothing before or after it."""
    dobj = zstandard.ZstdDecompressor().decompressobj()
    dobj.decompress(frame)
    assert dobj.eof, "libzstd did not reach the end of the frame"
    assert dobj.unused_data == b"", f"{len(dobj.unused_data)} bytes follow the first zstd frame"


# ---------------------------------------------------------------------------------------------
# everywhere (no GPU needed)
# ---------------------------------------------------------------------------------------------


def test_module_imports_and_is_available_is_a_bool() -> None:
    assert isinstance(nvcomp_codecs.is_available(), bool)
    assert nvcomp_codecs.MAX_ZSTD_FRAME_BYTES >= 16 * MIB
    assert nvcomp_codecs.MAX_CHUNK_BYTES["ans"] == 16 * MIB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA")
def test_gpu_codec_without_cuda_names_what_to_install() -> None:
    with pytest.raises(CodecUnavailableError, match=r"nvcomp-checkpoint\[cu12\]"):
        nvcomp_codecs.gpu_codec("zstd", 1, torch.device("cuda"))
    from nvcomp_checkpoint.codecs import gpu_codec

    with pytest.raises(CodecUnavailableError, match=r"nvcomp-checkpoint\[cu12\]"):
        gpu_codec("ans", None, torch.device("cuda"))


def test_gpu_codec_without_nvcomp_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvcomp() -> None:
        raise ModuleNotFoundError("No module named 'nvidia.nvcomp'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nvcomp_codecs, "_import_nvcomp", no_nvcomp)
    assert nvcomp_codecs.is_available() is False
    with pytest.raises(CodecUnavailableError, match=r"nvcomp-checkpoint\[cu12\].*\[cu13\]"):
        nvcomp_codecs.gpu_codec("zstd", 1, torch.device("cuda", 0))


def test_unknown_gpu_codec_is_refused() -> None:
    with pytest.raises(CodecUnavailableError, match="unknown GPU codec"):
        nvcomp_codecs.gpu_codec("lzma", None, torch.device("cuda"))


def test_gpu_only_codecs_see_bytes_never_floats() -> None:
    # nvCOMP ANS with "<f2" is fp16-only; bf16 through it did not round-trip (docs/facts.md, nvCOMP).
    for codec_id in ("ans", "bitcomp", "cascaded"):
        assert nvcomp_codecs._codec_options(codec_id, None)["data_type"] == "|u1"
    assert "data_type" not in nvcomp_codecs._codec_options("zstd", 3)


@pytest.mark.parametrize(("codec_id", "level"), [("gdeflate", 6), ("gdeflate", -1), ("bitcomp", 2), ("cascaded", -1)])
def test_out_of_range_levels_are_refused_at_construction(codec_id: str, level: int) -> None:
    with pytest.raises(ValueError, match="level"):
        nvcomp_codecs.NvcompGpuCodec(codec_id, level, torch.device("cuda", 0))


def test_empty_zstd_frame_is_what_libzstd_writes_and_reads() -> None:
    assert zstandard.ZstdCompressor(level=1).compress(b"") == nvcomp_codecs.EMPTY_ZSTD_FRAME
    assert ZstdCpuCodec().decode(memoryview(nvcomp_codecs.EMPTY_ZSTD_FRAME), 0) == b""


# ---------------------------------------------------------------------------------------------
# GPU: zstd frames are standard frames, both ways
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_is_available_on_a_gpu_machine(cuda_device: torch.device) -> None:
    assert nvcomp_codecs.is_available() is True


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 64 * KIB + 3, 4 * MIB])
def test_zstd_gpu_encode_cpu_decode_bit_exact(cuda_device: torch.device, size: int) -> None:
    data = _sample_bytes(size, seed=size)
    codec = nvcomp_codecs.gpu_codec("zstd", 1, cuda_device)
    (frame,) = codec.encode_batch([data.to(cuda_device)])
    assert frame.dtype == torch.uint8 and frame.device == cuda_device and frame.dim() == 1
    frame_bytes = _host_bytes(frame)
    _assert_one_zstd_frame(frame_bytes)
    assert ZstdCpuCodec().decode(memoryview(frame_bytes), size) == _host_bytes(data)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 64 * KIB + 3, 4 * MIB, 16 * MIB])
def test_zstd_cpu_encode_gpu_decode_bit_exact(cuda_device: torch.device, size: int) -> None:
    data = _sample_bytes(size, seed=size + 1)
    frame = ZstdCpuCodec(1).encode(memoryview(_host_bytes(data)))
    codec = nvcomp_codecs.gpu_codec("zstd", 1, cuda_device)
    frame_t = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(cuda_device)
    (out,) = codec.decode_batch([frame_t], [size])
    assert out.dtype == torch.uint8 and out.numel() == size
    assert torch.equal(out.cpu(), data)


@pytest.mark.gpu
def test_zstd_batch_of_mixed_sizes_with_an_empty_chunk(cuda_device: torch.device) -> None:
    sizes = [3, 0, 256 * KIB, 64 * KIB + 3, 1 * MIB]
    chunks = [_sample_bytes(s, seed=i) for i, s in enumerate(sizes)]
    codec = nvcomp_codecs.gpu_codec("zstd", 1, cuda_device)
    frames = codec.encode_batch([c.to(cuda_device) for c in chunks])
    assert len(frames) == len(sizes)
    cpu = ZstdCpuCodec()
    for frame, chunk, size in zip(frames, chunks, sizes, strict=True):
        assert cpu.decode(memoryview(_host_bytes(frame)), size) == _host_bytes(chunk)
    decoded = codec.decode_batch(frames, sizes)
    for out, chunk in zip(decoded, chunks, strict=True):
        assert torch.equal(out.cpu(), chunk)


@pytest.mark.gpu
def test_zstd_decode_refuses_a_wrong_raw_size(cuda_device: torch.device) -> None:
    data = _sample_bytes(100 * KIB, seed=7)
    frame = ZstdCpuCodec(1).encode(memoryview(_host_bytes(data)))
    frame_t = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(cuda_device)
    codec = nvcomp_codecs.gpu_codec("zstd", 1, cuda_device)
    for wrong in (100 * KIB + 1, 100 * KIB - 1):
        with pytest.raises(FormatError):
            codec.decode_batch([frame_t], [wrong])


# ---------------------------------------------------------------------------------------------
# GPU: GPU-only codecs round-trip bit-exactly
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", GPU_ONLY)
@pytest.mark.parametrize("kind", ["bf16-random", "fp32-random", "bf16-zeros", "fp32-zeros"])
def test_gpu_only_codec_round_trip(cuda_device: torch.device, codec_id: str, kind: str) -> None:
    tensor = _tensor_kind(kind, 600_003, seed=11).to(cuda_device)
    data = tensor.view(torch.uint8)
    # Chunks of 256 KiB, plus a ragged tail and a 1-byte chunk.
    chunks = list(data.split(256 * KIB)) + [data[:1]]
    sizes = [c.numel() for c in chunks]
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    frames = codec.encode_batch(chunks)
    assert [f.dtype for f in frames] == [torch.uint8] * len(chunks)
    decoded = codec.decode_batch(frames, sizes)
    for out, chunk in zip(decoded, chunks, strict=True):
        assert torch.equal(out, chunk)
    if kind.endswith("zeros"):
        assert sum(f.numel() for f in frames) < sum(sizes) // 4, f"{codec_id} did not shrink zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", GPU_ONLY)
def test_gpu_only_codec_takes_bf16_tensors_as_bytes(cuda_device: torch.device, codec_id: str) -> None:
    tensor = _weights_bf16(200_001, seed=3).to(cuda_device)
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    (frame,) = codec.encode_batch([tensor])
    (out,) = codec.decode_batch([frame], [tensor.numel() * 2])
    assert torch.equal(out.view(torch.bfloat16), tensor)


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", GPU_ONLY)
def test_gpu_only_codec_largest_chunk(cuda_device: torch.device, codec_id: str) -> None:
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    size = min(codec.max_chunk_bytes, 16 * MIB)
    data = _sample_bytes(size, seed=5).to(cuda_device)
    (frame,) = codec.encode_batch([data])
    (out,) = codec.decode_batch([frame], [size])
    assert torch.equal(out, data)


@pytest.mark.gpu
@pytest.mark.parametrize(("codec_id", "level"), [("gdeflate", 0), ("gdeflate", 5), ("bitcomp", 1), ("cascaded", 1)])
def test_levels_round_trip(cuda_device: torch.device, codec_id: str, level: int) -> None:
    data = _sample_bytes(300 * KIB + 5, seed=level).to(cuda_device)
    codec = nvcomp_codecs.gpu_codec(codec_id, level, cuda_device)
    (frame,) = codec.encode_batch([data])
    (out,) = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device).decode_batch([frame], [data.numel()])
    assert torch.equal(out, data)


# ---------------------------------------------------------------------------------------------
# GPU: none, streams, threads, argument checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_none_codec_is_a_device_copy(cuda_device: torch.device) -> None:
    data = _sample_bytes(12345, seed=1).to(cuda_device)
    codec = nvcomp_codecs.gpu_codec("none", None, cuda_device)
    (frame,) = codec.encode_batch([data])
    assert torch.equal(frame, data) and frame.data_ptr() != data.data_ptr()
    (out,) = codec.decode_batch([frame], [data.numel()])
    assert torch.equal(out, data)
    with pytest.raises(FormatError):
        codec.decode_batch([frame], [data.numel() + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", ["zstd", "ans"])
def test_runs_on_a_side_stream(cuda_device: torch.device, codec_id: str) -> None:
    data = _sample_bytes(1 * MIB + 1, seed=9).to(cuda_device)
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    side = torch.cuda.Stream(cuda_device)
    side.wait_stream(torch.cuda.current_stream(cuda_device))
    with torch.cuda.stream(side):
        # Produced on the side stream itself, so nvCOMP must run after this kernel.
        doubled = torch.cat([data, data])
        frames = codec.encode_batch([doubled])
        (out,) = codec.decode_batch(frames, [doubled.numel()])
        equal = torch.equal(out, doubled)
    assert equal


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", ["zstd", "ans", "gdeflate"])
def test_threads_share_one_codec_object(cuda_device: torch.device, codec_id: str) -> None:
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            torch.cuda.set_device(cuda_device)
            chunks = [_sample_bytes(200 * KIB + seed, seed=seed * 10 + j).to(cuda_device) for j in range(4)]
            for _ in range(5):
                frames = codec.encode_batch(chunks)
                decoded = codec.decode_batch(frames, [c.numel() for c in chunks])
                for out, chunk in zip(decoded, chunks, strict=True):
                    if not torch.equal(out, chunk):
                        raise AssertionError(f"thread {seed}: round trip differs")
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


@pytest.mark.gpu
def test_argument_errors(cuda_device: torch.device) -> None:
    codec = nvcomp_codecs.gpu_codec("ans", None, cuda_device)
    with pytest.raises(ValueError, match="is on cpu"):
        codec.encode_batch([torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode_batch([torch.zeros(10, 10, dtype=torch.uint8, device=cuda_device).t()])
    with pytest.raises(ValueError, match="at most"):
        codec.encode_batch([torch.zeros(codec.max_chunk_bytes + 1, dtype=torch.uint8, device=cuda_device)])
    with pytest.raises(ValueError, match="raw sizes"):
        codec.decode_batch([torch.zeros(10, dtype=torch.uint8, device=cuda_device)], [])


@pytest.mark.gpu
def test_a_corrupt_frame_is_refused_before_nvcomp_decodes_it(cuda_device: torch.device, tmp_path: Path) -> None:
    # What nvCOMP does with a damaged frame is nvCOMP's behaviour; what we guarantee is that the
    # reader checks each frame's xxh3 checksum first, so a GPU load of a damaged file fails with
    # a ChecksumError naming the tensor and never hands nvCOMP the bad bytes.
    path = tmp_path / "damaged.nvc"
    nc.save({"w": _weights_bf16(256 * KIB, seed=8)}, path)
    with nc.open(path) as reader:
        frame = next(f for f in reader.entry("w").frames if not f.is_raw)
    data = bytearray(path.read_bytes())
    data[frame.offset + frame.size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="'w'"):
        nc.load(path, map_location=cuda_device)
