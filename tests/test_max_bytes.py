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

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.codecs import CodecConfig, cpu_codec
from nvcomp_checkpoint.errors import SizeLimitError
from nvcomp_checkpoint.format.layout import FOOTER, MAX_CHUNK_BYTES, Frame, Index, TensorEntry, pack_footer, unpack_footer

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
HUGE = 8 << 30


def _zeros_file(path, small) -> None:
    """``small`` (a file of ``nc.save``) with a tensor "zeros" of 8 GiB appended, stored as Zstd frames of zeros."""
    data = small.read_bytes()
    offset, size, _ = unpack_footer(data[-FOOTER.size :], len(data), str(small))
    index = Index.from_json_bytes(data[offset : offset + size], offset, str(small))
    frame = bytes(cpu_codec("zstd").encode(memoryview(bytes(MAX_CHUNK_BYTES))))
    body = data[:offset]
    frames = []
    for _ in range(HUGE // MAX_CHUNK_BYTES):
        frames.append(Frame(len(body), len(frame), MAX_CHUNK_BYTES, xxhash.xxh3_64_intdigest(frame)))
        body += frame
    zeros = TensorEntry("zeros", torch.uint8, (HUGE,), "other", CodecConfig("zstd", 1), "none", 1, MAX_CHUNK_BYTES, tuple(frames))
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
                          ("read", lambda: nc.open(path, max_bytes=256 << 20).read("zeros"))):
            try:
                run()
                print(what, "LOADED")
            except SizeLimitError as exc:
                print(what, "refused", str(exc).split(": ", 1)[1][:200])
        print("w", nc.open(path, max_bytes=256 << 20).read("w").sum().item())
        """
    )
    proc = subprocess.run([sys.executable, "-c", child, str(zeros)], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("load refused the whole checkpoint decodes to") and "max_bytes=268435456" in lines[0], lines
    assert lines[1].startswith("read refused tensor 'zeros' decodes to 8589934592 bytes"), lines
    assert lines[2] == "w 4950.0", lines


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
