"""GPU codecs (nvCOMP): bit-exact round trips, and zstd frames that libzstd reads both ways.

Tests marked ``gpu`` need CUDA and nvCOMP and skip without them (they run through
benchmarks/gpu_check.sh on a GPU machine); the unmarked tests run everywhere and check the facts
table, the error classes, and that the module imports and refuses clearly without a GPU stack.
The interop sizes are those the writer uses; each one that fails on a GPU is a fact to lower in
codecs/registry.py (gpu_max_chunk_bytes, gpu_decode_max_bytes), not a test to relax.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import zstandard

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import writer
from nvcomp_checkpoint.codecs import CODEC_IDS, GPU_ONLY_CODECS, codec_facts, gpu_chunk_bytes
from nvcomp_checkpoint.codecs import nvcomp as nvcomp_codecs
from nvcomp_checkpoint.codecs.cpu import LARGE_FRAME_BYTES, ZSTD_MAX_LEVEL, ZstdCpuCodec
from nvcomp_checkpoint.codecs.registry import CHUNK_CAP_BYTES, CODEC_FACTS
from nvcomp_checkpoint.codecs.zstd_frame import read_frame
from nvcomp_checkpoint.errors import (
    CheckpointError,
    CodecUnavailableError,
    FormatError,
    GpuCodecError,
    GpuOutOfMemoryError,
)
from nvcomp_checkpoint.format import layout

SRC = str(Path(__file__).resolve().parents[1] / "src")

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
    # zstd.h: "Chunk sizes must not exceed 16 MB"; gdeflate.h: "must not exceed 65536 bytes".
    assert nvcomp_codecs.MAX_ZSTD_FRAME_BYTES == 16 * MIB
    assert nvcomp_codecs.MAX_CHUNK_BYTES["ans"] == 16 * MIB
    assert nvcomp_codecs.MAX_CHUNK_BYTES["gdeflate"] == 64 * KIB


def test_every_limit_is_read_from_the_facts_table() -> None:
    assert set(CODEC_IDS) == set(CODEC_FACTS) and set(GPU_ONLY_CODECS) == {"ans", "bitcomp", "gdeflate", "cascaded"}
    assert codec_facts("zstd").max_level == ZSTD_MAX_LEVEL
    assert layout.MAX_CHUNK_BYTES == CHUNK_CAP_BYTES == 64 * MIB
    assert writer.GPU_ZSTD_CHUNK_LIMIT == codec_facts("zstd").gpu_max_chunk_bytes == 16 * MIB
    for facts in CODEC_FACTS.values():
        assert facts.default_chunk_bytes <= facts.max_chunk_bytes <= CHUNK_CAP_BYTES
        if facts.nvcomp_algorithm is not None:
            assert nvcomp_codecs.MAX_CHUNK_BYTES[facts.id] == facts.gpu_max_chunk_bytes
    # The GPU writer cuts a policy chunk to nvCOMP's limit, in whole elements.
    assert gpu_chunk_bytes("zstd", 64 * MIB, 4) == 16 * MIB
    assert gpu_chunk_bytes("zstd", 4 * MIB, 4) == 4 * MIB
    assert gpu_chunk_bytes("zstd", 16 * MIB + 6, 6) == 16 * MIB // 6 * 6


def test_codec_specs_take_their_chunk_limits_from_the_table() -> None:
    assert nc.CodecSpec().chunk_bytes == 4 * MIB
    assert nc.CodecSpec("gdeflate", None).chunk_bytes == 64 * KIB
    assert nc.CodecSpec.from_dict("gdeflate").chunk_bytes == 64 * KIB
    assert nc.CodecSpec("gdeflate", None).to_dict()["chunk_bytes"] == 64 * KIB
    with pytest.raises(ValueError, match="gdeflate.*at most 65536"):
        nc.CodecSpec("gdeflate", None, chunk_bytes=128 * KIB)
    with pytest.raises(ValueError, match="ans.*at most 16777216"):
        nc.CodecSpec("ans", None, chunk_bytes=32 * MIB)
    with pytest.raises(ValueError, match="64 MiB"):
        nc.CodecSpec("zstd", 1, chunk_bytes=CHUNK_CAP_BYTES + 1)
    assert nc.CodecSpec("zstd", 1, chunk_bytes=CHUNK_CAP_BYTES).chunk_bytes == CHUNK_CAP_BYTES


def test_device_errors_are_told_apart_from_format_errors() -> None:
    oom = nvcomp_codecs._device_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "decoding")
    assert isinstance(oom, GpuOutOfMemoryError) and "map_location='cpu'" in str(oom)
    nvcomp_oom = nvcomp_codecs._device_error(RuntimeError("cudaErrorMemoryAllocation"), "encoding")
    assert isinstance(nvcomp_oom, GpuOutOfMemoryError)
    binding = nvcomp_codecs._device_error(TypeError("decode(): incompatible function arguments"), "decoding")
    assert type(binding) is GpuCodecError and "nvCOMP 6.0" in str(binding)
    assert type(nvcomp_codecs._device_error(AttributeError("no attribute 'RAW'"), "x")) is GpuCodecError
    fault = nvcomp_codecs._device_error(
        RuntimeError("Encountered Cuda Error from previous asynchronous launches: an illegal memory access"), "decoding"
    )
    assert type(fault) is GpuCodecError and "restart the process" in str(fault)
    assert type(nvcomp_codecs._device_error(BufferError("stream"), "x")) is GpuCodecError
    # What nvCOMP says about the data itself stays a FormatError (the caller's default).
    assert nvcomp_codecs._device_error(RuntimeError("nvcompErrorCannotDecompress"), "decoding") is None
    assert nvcomp_codecs._device_error(ValueError("buffer too small"), "decoding") is None
    # Not a FormatError, so a caller that falls back or reports a damaged file tells them apart.
    assert issubclass(GpuCodecError, CheckpointError) and issubclass(GpuCodecError, RuntimeError)
    assert not issubclass(GpuCodecError, FormatError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA")
def test_gpu_codec_without_cuda_names_what_to_install() -> None:
    with pytest.raises(CodecUnavailableError, match=r"\.\[cu12\]' in a clone"):
        nvcomp_codecs.gpu_codec("zstd", 1, torch.device("cuda"))
    from nvcomp_checkpoint.codecs import gpu_codec

    with pytest.raises(CodecUnavailableError, match=r"\.\[cu12\]' in a clone"):
        gpu_codec("ans", None, torch.device("cuda"))


def test_gpu_codec_without_nvcomp_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvcomp() -> None:
        raise ModuleNotFoundError("No module named 'nvidia.nvcomp'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nvcomp_codecs, "_import_nvcomp", no_nvcomp)
    assert nvcomp_codecs.is_available() is False
    with pytest.raises(CodecUnavailableError, match=r"cu12.*cu13.*\.\[cu12\]' in a clone"):
        nvcomp_codecs.gpu_codec("zstd", 1, torch.device("cuda", 0))


def test_unknown_gpu_codec_is_refused() -> None:
    with pytest.raises(CodecUnavailableError, match="unknown GPU codec"):
        nvcomp_codecs.gpu_codec("lzma", None, torch.device("cuda"))


def test_gpu_only_codecs_see_bytes_never_floats() -> None:
    # nvCOMP ANS with "<f2" is fp16-only; bf16 through it did not round-trip.
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


# The frames the writer makes: a 4 MiB policy chunk split into byte planes gives frames of
# 1 MiB (fp32), 2 MiB (bf16) or 4 MiB (no filter, uint8), ragged at a tensor's end; on the GPU a
# chunk is cut to gpu_max_chunk_bytes (16 MiB); on the CPU a policy may ask for up to 64 MiB.
_GPU_WRITES = [1, 64 * KIB + 3, 1 * MIB, 2 * MIB + 1, 4 * MIB, 4 * MIB + 7, codec_facts("zstd").gpu_max_chunk_bytes]
_CPU_WRITES = [1, 64 * KIB + 3, 2 * MIB + 1, 4 * MIB, 4 * MIB + 7, 16 * MIB, codec_facts("zstd").gpu_decode_max_bytes]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["weights", "zeros"])
@pytest.mark.parametrize("size", _GPU_WRITES)
def test_zstd_gpu_encode_cpu_decode_bit_exact(cuda_device: torch.device, size: int, kind: str) -> None:
    data = _sample_bytes(size, seed=size) if kind == "weights" else torch.zeros(size, dtype=torch.uint8)
    codec = nvcomp_codecs.gpu_codec("zstd", 1, cuda_device)
    (frame,) = codec.encode_batch([data.to(cuda_device)])
    assert frame.dtype == torch.uint8 and frame.device == cuda_device and frame.dim() == 1
    frame_bytes = _host_bytes(frame)
    _assert_one_zstd_frame(frame_bytes)
    # nvCOMP's own frames must pass the host check, or the GPU would never decode them.
    assert read_frame(frame_bytes, size).content_size == size
    assert ZstdCpuCodec().decode(memoryview(frame_bytes), size) == _host_bytes(data)


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 3])
@pytest.mark.parametrize("size", _CPU_WRITES)
def test_zstd_cpu_encode_gpu_decode_bit_exact(cuda_device: torch.device, size: int, level: int) -> None:
    if level != 1 and size < LARGE_FRAME_BYTES:
        pytest.skip("level 3 only matters for large frames (level 1 uses other parameters there)")
    data = _sample_bytes(size, seed=size + 1)
    frame = ZstdCpuCodec(level).encode(memoryview(_host_bytes(data)))
    codec = nvcomp_codecs.gpu_codec("zstd", 1, cuda_device)
    frame_t = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(cuda_device)
    before = codec.host_decoded
    (out,) = codec.decode_batch([frame_t], [size], host_frames=[frame])
    assert codec.host_decoded == before, "the frame was decoded by libzstd, not by nvCOMP"
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


# ---------------------------------------------------------------------------------------------
# GPU: GPU-only codecs round-trip bit-exactly
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", GPU_ONLY)
@pytest.mark.parametrize("kind", ["bf16-random", "fp32-random", "bf16-zeros", "fp32-zeros"])
def test_gpu_only_codec_round_trip(cuda_device: torch.device, codec_id: str, kind: str) -> None:
    tensor = _tensor_kind(kind, 600_003, seed=11).to(cuda_device)
    data = tensor.view(torch.uint8)
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    # Chunks of 256 KiB (gdeflate: 64 KiB, its limit), plus a ragged tail and a 1-byte chunk.
    chunks = list(data.split(min(256 * KIB, codec.max_chunk_bytes))) + [data[:1]]
    sizes = [c.numel() for c in chunks]
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
    codec = nvcomp_codecs.gpu_codec(codec_id, None, cuda_device)
    tensor = _weights_bf16(min(200_001, codec.max_chunk_bytes // 2 - 1), seed=3).to(cuda_device)
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
    codec = nvcomp_codecs.gpu_codec(codec_id, level, cuda_device)
    data = _sample_bytes(min(300 * KIB, codec.max_chunk_bytes) - 5, seed=level).to(cuda_device)
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
            size = min(200 * KIB, codec.max_chunk_bytes) - seed
            chunks = [_sample_bytes(size, seed=seed * 10 + j).to(cuda_device) for j in range(4)]
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


_BAD_FRAMES_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {src!r})
    import torch
    from nvcomp_checkpoint.codecs import nvcomp as nvcomp_codecs
    from nvcomp_checkpoint.codecs.cpu import ZstdCpuCodec
    from nvcomp_checkpoint.errors import FormatError

    device = torch.device("cuda", 0)
    codec = nvcomp_codecs.gpu_codec("zstd", 1, device)
    data = (torch.randn(128 * 1024, generator=torch.Generator().manual_seed(8)) * 0.02).to(torch.bfloat16)
    raw = data.view(torch.uint8).numpy().tobytes()
    frame = ZstdCpuCodec(1).encode(memoryview(raw))
    bad = {{
        "truncated": (frame[: len(frame) // 2], len(raw)),
        "one byte more than the frame holds": (frame, len(raw) + 1),
        "one byte less than the frame holds": (frame, len(raw) - 1),
        "garbage": (bytes(range(256)) * 8, len(raw)),
    }}
    for name, (forged, size) in bad.items():
        on_gpu = torch.frombuffer(bytearray(forged), dtype=torch.uint8).to(device)
        for host in ([forged], None):  # the reader's host bytes, or a copy back from the GPU
            try:
                codec.decode_batch([on_gpu], [size], host_frames=host)
            except FormatError as exc:
                assert "not one nvCOMP may decode" in str(exc), exc
            else:
                raise AssertionError(name + ": no FormatError")
    # Bytes after the frame: libzstd ignores them (so does the CPU reader), nvCOMP never sees them.
    padded = frame + bytes(16)
    before = codec.host_decoded
    on_gpu = torch.frombuffer(bytearray(padded), dtype=torch.uint8).to(device)
    (out,) = codec.decode_batch([on_gpu], [len(raw)], host_frames=[padded])
    assert codec.host_decoded == before + 1 and out.cpu().numpy().tobytes() == raw
    # The CUDA context is still usable, and nvCOMP decodes a good frame.
    good = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(device)
    before = codec.host_decoded
    (out,) = codec.decode_batch([good], [len(raw)], host_frames=[frame])
    torch.cuda.synchronize()
    assert codec.host_decoded == before and out.cpu().numpy().tobytes() == raw
    print("OK")
    """
)


# In a process of its own: forged frames must never reach nvCOMP's decoder ("can only operate on
# valid input data", nvCOMP 5.1/5.3 release notes), and were one to, a sticky CUDA error would
# fail only this test, not every GPU test after it.
@pytest.mark.gpu
def test_forged_zstd_frames_never_reach_nvcomp(tmp_path: Path, cuda_device: torch.device) -> None:
    script = tmp_path / "bad_frames.py"
    script.write_text(_BAD_FRAMES_SCRIPT.format(src=SRC))
    done = subprocess.run([sys.executable, str(script)], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
