"""``max_bytes`` on ``load``/``open``: a file from an untrusted source cannot make the reader allocate more.

The forged file is valid in every way: 270 KB of Zstd frames that decode to 8 GiB of zeros,
written with the format's own helpers and checksums. The limit is checked before anything is
allocated, so a child whose address space is capped at 1 GiB above its start refuses it cleanly.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.codecs import CodecConfig, cpu_codec
from nvcomp_checkpoint.errors import SizeLimitError
from nvcomp_checkpoint.format.layout import FOOTER, MAX_CHUNK_BYTES, Frame, Index, TensorEntry, pack_footer, unpack_footer

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
HUGE = 8 << 30


def _zeros_file(path, small, claimed: int = HUGE) -> None:
    """``small`` (a file of ``nc.save``) with a tensor "zeros" of ``claimed`` bytes (8 GiB) appended, stored as Zstd frames of zeros."""
    data = small.read_bytes()
    offset, size, _ = unpack_footer(data[-FOOTER.size :], len(data), str(small))
    index = Index.from_json_bytes(data[offset : offset + size], offset, str(small))
    frame = bytes(cpu_codec("zstd").encode(memoryview(bytes(MAX_CHUNK_BYTES))))
    body = data[:offset]
    frames = []
    for _ in range(claimed // MAX_CHUNK_BYTES):
        frames.append(Frame(len(body), len(frame), MAX_CHUNK_BYTES, xxhash.xxh3_64_intdigest(frame)))
        body += frame
    zeros = TensorEntry(
        "zeros", torch.uint8, (claimed,), "other", CodecConfig("zstd", 1), "none", 1, MAX_CHUNK_BYTES, tuple(frames)
    )
    new_index = dataclasses.replace(index, tensors=index.tensors + (zeros,)).to_json_bytes()
    path.write_bytes(body + new_index + pack_footer(len(body), len(new_index), xxhash.xxh3_64_intdigest(new_index)))


@pytest.fixture(scope="module")
def zeros(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zeros")
    small = directory / "small.nvc"
    nc.save({"w": torch.arange(100.0)}, small)
    path = directory / "zeros.nvc"
    _zeros_file(path, small)
    return path


def test_the_forged_file_is_small_and_consistent(zeros):
    assert zeros.stat().st_size < 400_000
    with nc.open(zeros) as reader:
        assert reader.raw_bytes == HUGE + 400 and reader.keys() == ["w", "zeros"]
        assert torch.equal(reader.read("w"), torch.arange(100.0))


def test_max_bytes_refuses_before_allocating(zeros):
    child = textwrap.dedent(
        """
        import resource, sys
        import nvcomp_checkpoint as nc
        from nvcomp_checkpoint.errors import SizeLimitError
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
        path = sys.argv[1]
        for what, run in (("load", lambda: nc.load(path, max_bytes=256 << 20)),
                          ("read", lambda: nc.open(path, max_bytes=256 << 20).read("zeros")),
                          ("read_many", lambda: list(nc.open(path, max_bytes=256 << 20).read_many(["w", "zeros"])))):
            try:
                run()
                print(what, "LOADED")
            except SizeLimitError as exc:
                print(what, "refused", str(exc).split(": ", 1)[1][:200])
        print("w", nc.open(path, max_bytes=256 << 20).read("w").sum().item())
        result = nc.verify(path, max_bytes=256 << 20)
        print("verify", result.ok, [type(p.error).__name__ for p in result.problems])
        """
    )
    proc = subprocess.run([sys.executable, "-c", child, str(zeros)], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("load refused the whole checkpoint decodes to") and "max_bytes=268435456" in lines[0], lines
    assert lines[1].startswith("read refused tensor 'zeros' decodes to 8589934592 bytes"), lines
    assert lines[2].startswith("read_many refused reading 2 tensors decodes to 8589934992 bytes"), lines
    assert lines[3] == "w 4950.0", lines
    assert lines[4] == "verify False ['SizeLimitError']", lines


def test_a_file_within_max_bytes_loads(tmp_path):
    path = tmp_path / "ok.nvc"
    tree = {"w": torch.ones(1000), "step": 3}
    nc.save(tree, path)
    with nc.open(path) as reader:
        needed = reader.index.skeleton.raw_size + reader.raw_bytes
    assert nc.load(path, max_bytes=needed)["step"] == 3
    with pytest.raises(SizeLimitError, match=f"{needed} bytes, over max_bytes={needed - 1}"):
        nc.load(path, max_bytes=needed - 1)
    with nc.open(path, max_bytes=100) as reader:
        with pytest.raises(SizeLimitError, match="the object tree"):
            reader.keys()


def test_a_plain_torch_file_is_compared_by_its_size(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(1000)}, path)
    assert torch.equal(nc.load(path, max_bytes=path.stat().st_size)["w"], torch.ones(1000))
    with pytest.raises(SizeLimitError, match="torch.save file"):
        nc.load(path, max_bytes=1000)


def test_read_many_counts_every_tensor_it_is_asked_for(tmp_path):
    path = tmp_path / "two.nvc"
    nc.save({"a": torch.ones(1000), "b": torch.ones(1000)}, path)
    with nc.open(path, max_bytes=6000) as reader:
        assert [k for k, _ in reader.read_many(["a"])] == ["a"]
        with pytest.raises(SizeLimitError, match="reading 2 tensors decodes to 8000 bytes, over max_bytes=6000"):
            next(reader.read_many(["a", "b"]))  # refused before the first tensor is decoded
        with pytest.raises(SizeLimitError, match="reading 2 tensors"):
            reader.read_component(reader.entry("a").component)


def test_verify_counts_what_it_decodes(tmp_path):
    path = tmp_path / "ok.nvc"
    nc.save({"w": torch.ones(1000), "step": 3}, path)
    with nc.open(path) as reader:
        needed = reader.index.skeleton.raw_size + reader.raw_bytes
    assert nc.verify(path, max_bytes=needed).ok
    result = nc.verify(path, max_bytes=needed - 1)
    assert not result.ok and [(p.tensor, type(p.error)) for p in result.problems] == [(None, SizeLimitError)]
    assert f"over max_bytes={needed - 1}" in str(result.problems[0].error)


def test_a_delta_counts_the_base_tensors_of_its_chain(tmp_path):
    """Reading a delta tensor decodes the same tensor in each file of its chain: all of it counts."""
    w = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    paths = [tmp_path / f"c{i}.nvc" for i in range(3)]
    for i, path in enumerate(paths):
        nc.save({"w": w + (torch.arange(4096) < i)}, path, base=paths[i - 1] if i else None)
    with nc.open(paths[2]) as reader:
        assert reader.index.base.depth == 2 and reader.entry("w").delta is not None
        skeleton = reader.index.skeleton.raw_size
    chain_bytes = 3 * 4096 * 4  # the delta's tensor and the base tensor in each of its two bases
    with nc.open(paths[2], max_bytes=chain_bytes) as reader:
        assert torch.equal(reader.read("w"), w + (torch.arange(4096) < 2))
    with nc.open(paths[2], max_bytes=chain_bytes - 1) as reader:
        with pytest.raises(SizeLimitError, match=f"tensor 'w' decodes to {chain_bytes} bytes"):
            reader.read("w")
    with pytest.raises(SizeLimitError):
        nc.load(paths[2], max_bytes=skeleton + chain_bytes - 1)
    assert nc.load(paths[2], max_bytes=skeleton + chain_bytes)["w"].shape == (4096,)
    assert not nc.verify(paths[2], max_bytes=skeleton + chain_bytes - 1).ok
    assert nc.verify(paths[2], max_bytes=skeleton + chain_bytes).ok


def test_verify_decodes_chunk_by_chunk_in_bounded_memory(tmp_path):
    """A valid 2 GiB tensor (in 140 KB) verifies in a child whose address space is capped below it,
    its resident memory growing by a chunk per decoding thread at most."""
    small = tmp_path / "small.nvc"
    nc.save({"w": torch.arange(100.0)}, small)
    path = tmp_path / "zeros2g.nvc"
    _zeros_file(path, small, 2 << 30)
    child = textwrap.dedent(
        """
        import os, resource, sys, time
        import nvcomp_checkpoint as nc
        cores = os.cpu_count()
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30) + cores * (64 << 20), resource.RLIM_INFINITY))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        result = nc.verify(sys.argv[1])
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
        print(result.ok, grown, cores, round(time.perf_counter() - start, 1), [str(p.error)[:200] for p in result.problems])
        """
    )
    proc = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, grown_mb, cores, _ = proc.stdout.split()[:4]
    assert ok == "True", proc.stdout
    # A chunk of 64 MiB in flight per decoding thread, and the interpreter's own growth.
    assert int(grown_mb) < 64 * int(cores) + 200, proc.stdout


def test_cli_verify_refuses_a_file_over_the_default_limit_quickly(tmp_path, capsys):
    """A file under 1 MB whose index declares more than this machine's memory: refused at once by
    ``nvckpt verify`` (default --max-bytes: the physical memory), verified with an explicit limit."""
    from nvcomp_checkpoint.cli.main import main
    from nvcomp_checkpoint.cli.verify import default_max_bytes

    small = tmp_path / "small.nvc"
    nc.save({"w": torch.arange(100.0)}, small)
    claimed = (default_max_bytes() // MAX_CHUNK_BYTES + 1) * MAX_CHUNK_BYTES
    path = tmp_path / "claims.nvc"
    _zeros_file(path, small, claimed)
    assert path.stat().st_size < (default_max_bytes() >> 14) + 100_000  # about 2 KB per 64 MiB declared
    start = time.perf_counter()
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert time.perf_counter() - start < 5, out
    assert f"over --max-bytes {default_max_bytes()}; if you trust the file, pass --max-bytes" in out, out
    assert main(["verify", str(small), "--max-bytes", "1M"]) == 0
    assert main(["verify", str(small), "--max-bytes", "100"]) == 1
    assert "over --max-bytes 100;" in capsys.readouterr().out
