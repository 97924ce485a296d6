"""Whole saves and loads of CUDA tensors: compressed on the GPU, decoded on the GPU and on the CPU.

The codec tests (tests/test_gpu_codecs.py) check nvCOMP frame by frame; these check the writer
and the reader around them: byte planes of odd sizes and offsets (nvCOMP wants aligned buffers),
tensors made on a side stream, and a save made while the interpreter exits (jobs run inline).
Tests marked ``gpu`` skip without CUDA and nvCOMP; the others run everywhere.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.codecs import nvcomp as nvcomp_codecs
from nvcomp_checkpoint.writer import _compact

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is False")
    if not nc.gpu_available():
        pytest.skip("needs nvCOMP (module nvidia.nvcomp): pip install nvcomp-checkpoint[cu12] or [cu13]")
    return torch.device("cuda", torch.cuda.current_device())


def _odd_tree(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3_000_017, generator=g)
    return {
        "w": base.to(device),  # fp32, ragged last chunk
        "offset": base.to(device)[5:1_000_005],  # starts 20 bytes into its storage
        "bf16": (torch.randn(1_234_567, generator=g) * 0.02).to(torch.bfloat16).to(device),
        "f64": torch.randn(77_777, generator=g, dtype=torch.float64).to(device),
        "u8": torch.randint(0, 7, (999_999,), generator=g, dtype=torch.uint8).to(device),
        "t": torch.randn(513, 257, generator=g).to(device).t(),  # non-contiguous
        "cpu": torch.randn(4_097, generator=g),
    }


# -- everywhere: the alignment helpers -----------------------------------------------------------
def test_aligned_copies_only_misaligned_buffers() -> None:
    data = torch.arange(256, dtype=torch.int32).view(torch.uint8)
    assert data.data_ptr() % nvcomp_codecs.NVCOMP_ALIGNMENT == 0
    assert nvcomp_codecs._aligned(data) is data
    for start in (1, 3, 8, 15):
        moved = nvcomp_codecs._aligned(data[start:])
        assert moved.data_ptr() % nvcomp_codecs.NVCOMP_ALIGNMENT == 0 and torch.equal(moved, data[start:])


def test_packed_frames_start_aligned_and_hold_their_bytes() -> None:
    sources = [torch.arange(n, dtype=torch.uint8) for n in (5, 17, 1, 64, 33)]
    packed = nvcomp_codecs._pack_aligned(sources, [s.numel() for s in sources], torch.device("cpu"))
    for src, out in zip(sources, packed):
        assert out.data_ptr() % nvcomp_codecs.NVCOMP_ALIGNMENT == 0
        assert torch.equal(out, src)


def test_snapshot_frames_are_compacted_away_from_their_sources() -> None:
    live = torch.arange(1000, dtype=torch.uint8)
    planes = torch.zeros(4000, dtype=torch.uint8)
    frames = [live[10:20], planes[:100]]  # a raw view of the live tensor, a plane of a big buffer
    kept = _compact(frames)
    assert [torch.equal(a, b) for a, b in zip(kept, frames)] == [True, True]
    storage = kept[0].untyped_storage()
    assert kept[1].untyped_storage().data_ptr() == storage.data_ptr() and storage.nbytes() == 110
    live.zero_()
    assert torch.equal(kept[0], torch.arange(10, 20, dtype=torch.uint8))


# -- on a GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["zstd", "ans"])
def test_cuda_tensors_save_and_load_on_gpu_and_cpu(tmp_path: Path, cuda_device: torch.device, codec: str) -> None:
    tree = _odd_tree(cuda_device)
    spec = nc.CodecSpec(codec=codec, level=1 if codec == "zstd" else None, chunk_bytes=1 << 20)
    policy = nc.CodecPolicy(weights=spec, other=spec)
    path = tmp_path / f"{codec}.nvc"
    report = nc.save(tree, path, policy)
    assert report.stored_bytes < report.raw_bytes
    on_gpu = nc.load(path)  # back to the saved devices, decoded there
    assert on_gpu["w"].device == cuda_device and on_gpu["cpu"].device.type == "cpu"
    assert_tree_equal(tree, on_gpu)
    assert_tree_equal(tree, nc.load(path, map_location=str(cuda_device)))
    if codec == "zstd":  # portable: the same file decodes on the CPU
        assert_tree_equal(tree, nc.load(path, map_location="cpu"))
        with nc.open(path) as reader:
            assert all(err is None for _, err in reader.verify())


def _zstd_host_decodes(device: torch.device) -> int:
    codec = nvcomp_codecs.gpu_codec("zstd", None, device)
    return codec.host_decoded


@pytest.mark.gpu
def test_the_default_policy_round_trips_through_nvcomp_and_libzstd(tmp_path: Path, cuda_device: torch.device) -> None:
    # The writer's real settings (4 MiB chunks, byte planes, 16 MiB cap on the GPU): written by
    # nvCOMP, read back by libzstd on the CPU, and by nvCOMP without a frame left to libzstd.
    tree = _odd_tree(cuda_device)
    tree["big"] = torch.randn(9 << 20, generator=torch.Generator().manual_seed(1)).to(cuda_device)  # 36 MiB
    path = tmp_path / "default.nvc"
    nc.save(tree, path)
    assert_tree_equal(tree, nc.load(path, map_location="cpu"))
    before = _zstd_host_decodes(cuda_device)
    assert_tree_equal(tree, nc.load(path, map_location=str(cuda_device)))
    assert _zstd_host_decodes(cuda_device) == before, "frames nvCOMP wrote were decoded by libzstd"


@pytest.mark.gpu
@pytest.mark.parametrize("filt", ["byteplane", "none"])
def test_a_cpu_written_file_of_64_mib_chunks_loads_on_the_gpu(tmp_path: Path, cuda_device: torch.device, filt: str) -> None:
    # The largest frames a file can hold (the 64 MiB chunk cap, no filter): libzstd's frames,
    # decoded by nvCOMP up to the facts table's gpu_decode_max_bytes, by libzstd above it.
    g = torch.Generator().manual_seed(2)
    tree = {
        "w": torch.randn((64 << 20) // 4 + 1001, generator=g),
        "b": (torch.randn(5 << 20, generator=g) * 0.02).to(torch.bfloat16),
    }
    policy = nc.CodecPolicy.uniform(nc.CodecSpec("zstd", 1, filt, chunk_bytes=64 << 20), device="cpu")
    path = tmp_path / "cpu64.nvc"
    nc.save(tree, path, policy)
    before = _zstd_host_decodes(cuda_device)
    loaded = nc.load(path, map_location=str(cuda_device))
    assert loaded["w"].device == cuda_device
    assert_tree_equal(tree, {k: v.cpu() for k, v in loaded.items()})
    assert _zstd_host_decodes(cuda_device) == before


@pytest.mark.gpu
def test_tensor_made_on_a_side_stream_is_saved_as_it_ends_up(tmp_path: Path, cuda_device: torch.device) -> None:
    side = torch.cuda.Stream(cuda_device)
    with torch.cuda.stream(side):
        big = torch.randn(8 << 20, device=cuda_device)
        for _ in range(20):  # enough queued work that an unordered read sees it unfinished
            big.mul_(1.0001).add_(1e-4)
        nc.save({"big": big}, tmp_path / "side.nvc")  # no synchronize before the save
        expected = big.cpu()
    assert torch.equal(nc.load(tmp_path / "side.nvc", map_location="cpu")["big"], expected)


_EXIT_GPU_SAVE = textwrap.dedent(
    """
    import atexit, sys, torch
    sys.path.insert(0, {src!r})
    import nvcomp_checkpoint as nc
    import nvcomp_checkpoint.writer as writer
    writer.GPU_BATCH_BYTES = 4 << 20  # many batches, more than the pinned ring's slots

    value = torch.arange(16 << 20, dtype=torch.float32, device="cuda")

    def at_exit():
        nc.save({{"v": value}}, {out!r})

    atexit.register(at_exit)
    """
)


@pytest.mark.gpu
def test_gpu_save_while_the_interpreter_exits_does_not_hang(tmp_path: Path, cuda_device: torch.device) -> None:
    out = tmp_path / "exit.nvc"
    script = tmp_path / "exit_gpu.py"
    script.write_text(_EXIT_GPU_SAVE.format(src=SRC, out=str(out)))
    done = subprocess.run([sys.executable, str(script)], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert torch.equal(nc.load(out, map_location="cpu")["v"], torch.arange(16 << 20, dtype=torch.float32))
