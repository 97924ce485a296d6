"""Golden-file tests: a checkpoint written once by ``tests/data/make_golden.py`` decodes forever.

The golden files of versions 1, 2 and 3 were written before the guard; ``golden_v1_guard.nvc`` is
``golden_v1.nvc`` with it (``make_golden_guard.py``), and today's writer reproduces it.

Also pins that the writer is deterministic (same tree, same metadata: same bytes) and that the
file follows ``docs/format.md``: a reader written from the document alone decodes it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zstandard

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "golden_v1.nvc"
#: golden_v1.nvc as a writer with the guard writes it (docs/format.md "The guard").
GOLDEN_GUARD = DATA / "golden_v1_guard.nvc"
#: The guard, as docs/format.md states it.
GUARD = (
    b"\x80\x02cnvcomp_checkpoint.format.guard\n"
    b"compressed_by_nvcomp-checkpoint:load_it_with_nvcomp_checkpoint.load(path)"
    b"_or_Lightning_Trainer(plugins=[NvcompCheckpointIO()])\n."
)
EXPECTED = json.loads((DATA / "golden_v1.expected.json").read_text())

_spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
assert _spec is not None and _spec.loader is not None
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)


def _versions_match() -> tuple[bool, str]:
    made = EXPECTED["metadata"]["generated_with"]
    here = {"torch": torch.__version__, "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION))}
    same = here["libzstd"] == made["libzstd"] and here["torch"].split(".")[:2] == made["torch"].split(".")[:2]
    return same, f"golden file written with torch {made['torch']} / libzstd {made['libzstd']}, here {here}"


# -- (a) the golden file decodes to the expected tree ----------------------------------------


def test_golden_decodes_to_expected_tree():
    back = nc.load(GOLDEN)
    assert_tree_equal(make_golden.golden_tree(), back)
    # Pinned independently of the generator, so a changed generator cannot hide a changed reader.
    assert back["epoch"] == 3 and back["global_step"] == 40 and math.isnan(back["best_metric"])
    assert back["tags"] == ["golden", None, True, (1, 2.5)]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["model"]["embed.weight"] is back["model"]["head.weight"]
    assert isinstance(back["model"]["embed.weight"], torch.nn.Parameter)
    assert list(back["optimizer"]["state"]) == [0]


def test_golden_tensor_digests():
    with nc.open(GOLDEN) as reader:
        assert reader.metadata == EXPECTED["metadata"]
        stored = [t.key for t in reader.index.tensors]
        assert sorted(stored) == sorted(EXPECTED["tensors"])
        # The tied head is stored once and read through the object tree's second path to it.
        assert set(reader.keys()) - set(stored) == {"model/head.weight"}
        assert torch.equal(reader.read("model/head.weight"), reader.read(reader.entry("model/head.weight").key))
        for key, want in EXPECTED["tensors"].items():
            t = reader.read(key)
            assert (str(t.dtype), list(t.shape)) == (want["dtype"], want["shape"]), key
            assert make_golden.tensor_digest(t) == want["sha256"], key
        assert all(err is None for _, err in reader.verify())
        codecs = {(reader.entry(k).codec.id, reader.entry(k).filter) for k in reader.keys()}
    # The file exercises every codec/filter pair a CPU writes.
    assert codecs == {("zstd", "byteplane"), ("zstd", "none"), ("none", "byteplane"), ("none", "none")}


def test_golden_multi_chunk_entry():
    with nc.open(GOLDEN) as reader:
        entry = reader.entry("model/fc.weight")
    assert entry.chunk_bytes == 1024 and entry.width == 4 and len(entry.frames) == 3 * 4
    assert [n for _, n, _ in entry.chunks()] == [1024, 1024, 32 * 24 * 4 - 2048]
    # Noisy low planes are stored raw, the exponent plane is compressed.
    assert any(f.is_raw for f in entry.frames) and any(not f.is_raw for f in entry.frames)


# -- a reader written from docs/format.md alone ------------------------------------------------


def _spec_reader(data: bytes, base: dict[str, np.ndarray] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Decodes a version-1 file, or a version-2 or -3 delta given its base's tensors, following docs/format.md alone."""
    start = len(GUARD) if data.startswith(GUARD) else 0  # the guard, or a file written before it
    version = data[start + 6]
    assert data[start : start + 6] == b"NVCKPT" and data[start + 7] == 0 and version in ((1,) if base is None else (2, 3))
    index_offset, index_size, index_hash, magic = struct.unpack("<QQQ8s", data[-32:])
    assert magic == b"NVCKEND\x00" and index_offset + index_size == len(data) - 32
    raw_index = data[index_offset : index_offset + index_size]
    assert xxhash.xxh3_64_intdigest(raw_index) == index_hash
    index = json.loads(raw_index)
    assert index["format"] == "nvcomp-checkpoint" and index["version"] == version
    assert ("base" in index) == (base is not None)

    def frame_bytes(offset: int, size: int, raw_size: int, digest: str, codec: str) -> bytes:
        stored = data[offset : offset + size]
        assert f"{xxhash.xxh3_64_intdigest(stored):016x}" == digest
        if size == raw_size:
            return stored
        assert codec == "zstd"
        return zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_size)

    tensors = {}
    for t in index["tensors"]:
        itemsize = torch.empty((), dtype=getattr(torch, t["dtype"])).element_size()
        nbytes = math.prod(t["shape"]) * itemsize
        planes = t["width"] if t["filter"] == "byteplane" else 1
        out = np.empty(nbytes, dtype=np.uint8)
        frames = iter(t["frames"])
        ref = None
        if "delta" in t:
            ref = base[t["delta"]["key"]]
            assert f"{xxhash.xxh3_64_intdigest(ref.tobytes()):016x}" == t["delta"]["xxh3"]
        width = t["width"]
        for start in range(0, nbytes, t["chunk_bytes"]):
            length = min(t["chunk_bytes"], nbytes - start)
            ops = []
            for p in range(planes):
                offset, size, digest, *op = next(frames)
                raw = np.frombuffer(frame_bytes(offset, size, length // planes, digest, t["codec"]["id"]), np.uint8)
                ops.append(op)
                if op == ["xor"]:
                    # The XOR of this plane with the same plane of the base tensor's chunk.
                    raw = raw ^ ref[start : start + length].reshape(-1, planes)[:, p]
                else:
                    assert op in ([], ["sub"]) and (op == [] or version == 3)
                # Plane p holds byte p of every little-endian scalar of the chunk.
                out[start : start + length].reshape(-1, planes)[:, p] = raw
            if ["sub"] in ops:
                _undo_sub(out[start : start + length], ref[start : start + length], width, ops * (width // planes))
        assert next(frames, None) is None
        tensors[t["key"]] = out
    s_off, s_size, s_raw, s_hash = index["skeleton"]
    skeleton = frame_bytes(s_off, s_size, s_raw, s_hash, "zstd")
    assert zipfile.is_zipfile(io.BytesIO(skeleton))  # a torch.save archive
    return index, tensors


def _undo_sub(chunk: np.ndarray, ref: np.ndarray, width: int, ops: list[list[str]]) -> None:
    """docs/format.md's rule for "sub" bytes, element by element with Python integers: byte k of
    ``x`` is ``(D_k + b_k + borrow) mod 256``, borrow 1 when ``x mod 256**k < b mod 256**k``."""
    assert width in (1, 2, 4)
    elems, bases = chunk.reshape(-1, width), ref.reshape(-1, width)
    for i in range(elems.shape[0]):
        x, b = [int(v) for v in elems[i]], int.from_bytes(bases[i].tobytes(), "little")
        for k in range(width):
            if ops[k] == ["sub"]:
                low_x = int.from_bytes(bytes(x[:k]), "little")
                x[k] = (x[k] + (b >> (8 * k) & 0xFF) + (low_x < b % 256**k)) % 256
        elems[i] = x


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_GUARD], ids=["v1", "v1-guard"])
def test_golden_matches_format_document(golden):
    data = golden.read_bytes()
    index, tensors = _spec_reader(data)
    assert index["metadata"] == EXPECTED["metadata"]
    for key, want in EXPECTED["tensors"].items():
        assert make_golden.hashlib.sha256(tensors[key].tobytes()).hexdigest() == want["sha256"], key
    # Frames lie in the data region, in file order, without overlaps.
    spans = sorted([tuple(index["skeleton"][:2])] + [(f[0], f[1]) for t in index["tensors"] for f in t["frames"]])
    assert spans[0][0] == (len(GUARD) if golden == GOLDEN_GUARD else 0) + 8
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b
    assert spans[-1][0] + spans[-1][1] <= struct.unpack("<Q", data[-32:-24])[0]


# -- the guard (a layout revision of every version) ---------------------------------------------


def _as_guarded(data: bytes) -> bytes:
    """A file written before the guard as a writer with it writes it, by docs/format.md alone: the
    guard in front, every offset (frames, skeleton, index) moved by its length, the index
    re-serialized compactly in its key order and its digest in the footer updated."""
    index_offset, index_size, _, magic = struct.unpack("<QQQ8s", data[-32:])
    index = json.loads(data[index_offset : index_offset + index_size])
    shift = len(GUARD)
    index["skeleton"][0] += shift
    for t in index["tensors"]:
        for frame in t["frames"]:
            frame[0] += shift
    raw = json.dumps(index, separators=(",", ":"), allow_nan=False).encode()
    footer = struct.pack("<QQQ8s", index_offset + shift, len(raw), xxhash.xxh3_64_intdigest(raw), magic)
    return GUARD + data[:index_offset] + raw + footer


def test_golden_guard_is_the_golden_file_with_the_guard():
    assert not GOLDEN.read_bytes().startswith(GUARD) and GOLDEN.read_bytes()[:6] == b"NVCKPT"
    assert GOLDEN_GUARD.read_bytes() == _as_guarded(GOLDEN.read_bytes())


def test_golden_guard_decodes_to_expected_tree():
    assert_tree_equal(make_golden.golden_tree(), nc.load(GOLDEN_GUARD))
    with nc.open(GOLDEN_GUARD) as reader:
        assert reader.metadata == EXPECTED["metadata"]
        for key, want in EXPECTED["tensors"].items():
            assert make_golden.tensor_digest(reader.read(key)) == want["sha256"], key
        assert all(err is None for _, err in reader.verify())


# -- (b) today's writer reproduces the golden bytes (with the guard) ------------------------------


def _resave(tmp_path: Path, workers: int | None = 1, name: str = "resave.nvc") -> bytes:
    path = tmp_path / name
    # The golden file's own metadata, in its key order: the index JSON keeps insertion order.
    with nc.open(GOLDEN) as reader:
        metadata = reader.metadata
    nc.save(make_golden.golden_tree(), path, make_golden.golden_policy(), metadata=metadata, workers=workers)
    return path.read_bytes()


def test_resave_reproduces_golden_bytes(tmp_path):
    same, why = _versions_match()
    if not same:
        # The test extra pins both (pyproject.toml), so CI always runs this test.
        message = f"compressed bytes depend on library versions: {why}; pip install -e '.[test]' installs the pinned ones"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    fresh = _resave(tmp_path)
    golden = GOLDEN_GUARD.read_bytes()
    if fresh != golden:
        first = next(i for i, (a, b) in enumerate(zip(fresh, golden)) if a != b) if len(fresh) == len(golden) else None
        pytest.fail(f"writer output changed: {len(fresh)} vs {len(golden)} bytes, first difference at {first}")


def test_resave_same_layout_any_version(tmp_path):
    """Everything but compressed payloads is pinned whatever the torch/libzstd versions."""
    fresh = _resave(tmp_path)
    with nc.open(GOLDEN) as old, nc.open(tmp_path / "resave.nvc") as new:
        assert new.metadata == old.metadata
        assert new.keys() == old.keys()
        for key in old.keys():
            a, b = old.entry(key), new.entry(key)
            fields = (
                "dtype",
                "shape",
                "component",
                "codec",
                "filter",
                "width",
                "chunk_bytes",
                "device",
                "requires_grad",
                "parameter",
            )
            assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], key
            assert [f.raw_size for f in a.frames] == [f.raw_size for f in b.frames], key
            for fa, fb in zip(a.frames, b.frames):
                if fa.is_raw and fb.is_raw:
                    assert (fa.size, fa.xxh) == (fb.size, fb.xxh), key
    assert fresh[: len(GUARD) + 8] == GUARD + GOLDEN.read_bytes()[:8]


def test_writer_is_deterministic_across_worker_counts(tmp_path):
    one = _resave(tmp_path, workers=1, name="w1.nvc")
    assert _resave(tmp_path, workers=2, name="w2.nvc") == one
    assert _resave(tmp_path, workers=5, name="w5.nvc") == one


def test_default_metadata_is_the_only_difference(tmp_path):
    tree = make_golden.golden_tree()
    for name in ("a.nvc", "b.nvc"):
        nc.save(tree, tmp_path / name, make_golden.golden_policy())
    a, b = (tmp_path / "a.nvc").read_bytes(), (tmp_path / "b.nvc").read_bytes()
    (ia, _, _, _), (ib, _, _, _) = (struct.unpack("<QQQ8s", x[-32:]) for x in (a, b))
    assert ia == ib and a[:ia] == b[:ib]  # magic, skeleton and every tensor frame
    ja, jb = (json.loads(x[ia:-32]) for x in (a, b))
    for doc in (ja, jb):
        assert set(doc["metadata"]) == {"created_by", "torch", "created"}
        assert doc["metadata"]["torch"] == torch.__version__
        assert doc["metadata"]["created_by"] == f"nvcomp-checkpoint {nc.__version__}"
        doc["metadata"].pop("created")
    assert ja == jb


# -- the delta golden file (format version 2) ----------------------------------------------------

GOLDEN_DELTA = DATA / "golden_v2_delta.nvc"
EXPECTED_DELTA = json.loads((DATA / "golden_v2_delta.expected.json").read_text())

_dspec = importlib.util.spec_from_file_location("make_golden_delta", DATA / "make_golden_delta.py")
assert _dspec is not None and _dspec.loader is not None
make_golden_delta = importlib.util.module_from_spec(_dspec)
_dspec.loader.exec_module(make_golden_delta)


def test_golden_delta_decodes_to_expected_tree():
    back = nc.load(GOLDEN_DELTA)
    assert_tree_equal(make_golden_delta.golden_delta_tree(), back)
    assert back["global_step"] == 41 and back["model"]["embed.weight"] is back["model"]["head.weight"]
    with nc.open(GOLDEN_DELTA) as reader:
        assert reader.metadata == EXPECTED_DELTA["metadata"]
        assert reader.index.base is not None and (reader.index.base.path, reader.index.base.depth) == ("golden_v1.nvc", 1)
        for key, want in EXPECTED_DELTA["tensors"].items():
            assert make_golden.tensor_digest(reader.read(key)) == want["sha256"], key
        # XOR frames on byte planes and on unfiltered chunks, plain frames beside them.
        ops = {key: [f.op for f in reader.entry(key).frames] for key in ("model/fc.weight", "optimizer/state/0/exp_avg_sq")}
        assert reader.entry("optimizer/state/0/exp_avg_sq").filter == "none"
    assert all(any(o) and (key == "optimizer/state/0/exp_avg_sq" or not all(o)) for key, o in ops.items()), ops


def test_golden_delta_matches_format_document():
    _, base = _spec_reader(GOLDEN.read_bytes())
    index, tensors = _spec_reader(GOLDEN_DELTA.read_bytes(), base)
    assert index["base"]["path"] == "golden_v1.nvc" and index["base"]["size"] == GOLDEN.stat().st_size
    assert index["base"]["index_xxh3"] == f"{struct.unpack('<QQQ8s', GOLDEN.read_bytes()[-32:])[2]:016x}"
    for key, want in EXPECTED_DELTA["tensors"].items():
        assert make_golden.hashlib.sha256(tensors[key].tobytes()).hexdigest() == want["sha256"], key


def test_resave_reproduces_golden_delta_bytes(tmp_path, monkeypatch):
    same, why = _versions_match()
    if not same:
        pytest.skip(f"compressed bytes depend on library versions: {why}")
    # Written before the difference ("sub", version 3) was tried: XOR only.
    monkeypatch.setattr(nc.delta, "SUB_COMPONENTS", frozenset())
    shutil.copy(GOLDEN, tmp_path / GOLDEN.name)
    with nc.open(GOLDEN_DELTA) as reader:
        metadata = reader.metadata
    path = tmp_path / "delta.nvc"
    nc.save(
        make_golden_delta.golden_delta_tree(),
        path,
        make_golden_delta.golden_delta_policy(),
        metadata=metadata,
        workers=1,
        base=tmp_path / GOLDEN.name,
    )
    assert path.read_bytes() == _as_guarded(GOLDEN_DELTA.read_bytes())


# -- the "sub" golden file (format version 3) ----------------------------------------------------

GOLDEN_SUB = DATA / "golden_v3_sub.nvc"
EXPECTED_SUB = json.loads((DATA / "golden_v3_sub.expected.json").read_text())


def test_golden_sub_decodes_to_expected_tree():
    back = nc.load(GOLDEN_SUB)
    assert_tree_equal(make_golden_delta.golden_delta_tree(), back)
    with nc.open(GOLDEN_SUB) as reader:
        assert reader.index.version == 3 and reader.metadata == EXPECTED_SUB["metadata"]
        for key, want in EXPECTED_SUB["tensors"].items():
            assert make_golden.tensor_digest(reader.read(key)) == want["sha256"], key
        assert all(err is None for _, err in reader.verify())
        ops = {t.key: [f.op for f in t.frames] for t in reader.index.tensors}
    # "sub" planes of bf16 and fp32 chunks beside XOR planes, above plain planes (the borrow
    # from below), and on unfiltered chunks.
    assert ops["model/embed.weight"] == ["sub", "xor"]
    assert ops["model/fc.weight"][:4] == ["", "", "sub", "xor"]
    assert ops["optimizer/state/0/exp_avg_sq"] == ["sub", "sub"]


def test_golden_sub_matches_format_document():
    _, base = _spec_reader(GOLDEN.read_bytes())
    index, tensors = _spec_reader(GOLDEN_SUB.read_bytes(), base)
    assert index["version"] == 3 and index["base"]["path"] == "golden_v1.nvc"
    for key, want in EXPECTED_SUB["tensors"].items():
        assert make_golden.hashlib.sha256(tensors[key].tobytes()).hexdigest() == want["sha256"], key


def test_resave_reproduces_golden_sub_bytes(tmp_path):
    same, why = _versions_match()
    if not same:
        pytest.skip(f"compressed bytes depend on library versions: {why}")
    shutil.copy(GOLDEN, tmp_path / GOLDEN.name)
    with nc.open(GOLDEN_SUB) as reader:
        metadata = reader.metadata
    path = tmp_path / "sub.nvc"
    nc.save(
        make_golden_delta.golden_delta_tree(),
        path,
        make_golden_delta.golden_delta_policy(),
        metadata=metadata,
        workers=1,
        base=tmp_path / GOLDEN.name,
    )
    assert path.read_bytes() == _as_guarded(GOLDEN_SUB.read_bytes())
