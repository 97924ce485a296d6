"""Filter "rotplane" (format version 4): byte planes of element words rotated left, so a bf16 or
fp32 exponent is one whole plane. Bit-exact round trips on every bit pattern, what the index
records, and the reader's rules for forged records.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import FormatError
from nvcomp_checkpoint.filters import RotatedByteplaneFilter, exponent_rotation, plane_filter
from nvcomp_checkpoint.format.layout import READ_VERSIONS, ROTATE_FORMAT_VERSION

_WORDS = {2: (np.uint16, torch.int16), 4: (np.uint32, torch.int32)}
#: Bit patterns every float test holds on purpose: +-0, +-inf, quiet and signalling NaNs with
#: payloads, the largest and smallest normals and subnormals.
_SPECIAL = {
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7F7F, 0x0080, 0x0001, 0x807F, 0xFFFF],
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F7FFFFF]
    + [0x00800000, 0x00000001, 0x807FFFFF, 0xFFFFFFFF],
}


def _bit_patterns(width: int, n: int, seed: int) -> np.ndarray:
    """``n`` random words of ``width`` bytes with the special patterns at the front, as uint8."""
    word = _WORDS[width][0]
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << (8 * width), n, dtype=np.uint64).astype(word)
    special = np.array(_SPECIAL[width], dtype=word)[:n]
    words[: special.size] = special
    return words.view(np.uint8)


def _rotated_planes(data: np.ndarray, width: int, rotate: int) -> list[np.ndarray]:
    """The planes by definition (docs/format.md): plane k is byte k of the rotated word."""
    words = data.view(_WORDS[width][0]).astype(np.uint64)
    bits = 8 * width
    rot = ((words << np.uint64(rotate)) | (words >> np.uint64(bits - rotate))) & np.uint64((1 << bits) - 1)
    return [((rot >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8) for k in range(width)]


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("n", [1, 7, 12, 70001])
def test_every_rotation_splits_to_its_definition_and_joins_back_in_numpy_and_torch(width: int, n: int) -> None:
    data = _bit_patterns(width, n, seed=n + width)
    # Every rotation on small runs; on the large one (blocks of the numpy path), the ones in use.
    for rotate in range(1, 8 * width) if n < 100 else (1, 3, 8 * width - 1):
        filt = RotatedByteplaneFilter(width, rotate)
        want = _rotated_planes(data, width, rotate)
        planes = filt.split(data)
        assert [p.tobytes() for p in planes] == [w.tobytes() for w in want]
        out = np.zeros_like(data)
        filt.join(out, [p.tobytes() for p in planes])
        assert out.tobytes() == data.tobytes()
        tplanes = filt.split_torch(torch.from_numpy(data.copy()))
        assert [p.numpy().tobytes() for p in tplanes] == [w.tobytes() for w in want]
        assert filt.join_torch(tplanes).numpy().tobytes() == data.tobytes()


def test_rotation_by_one_puts_the_whole_exponent_in_the_top_plane() -> None:
    values = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.0, float("inf")])
    for dtype, width, bias_bits in ((torch.bfloat16, 2, 7), (torch.float32, 4, 23)):
        data = values.to(dtype).view(_WORDS[width][1]).numpy().view(np.uint8)
        top = plane_filter("rotplane", width, exponent_rotation(dtype)).split(data)[-1]
        exponent = (data.view(_WORDS[width][0]).astype(np.int64) >> bias_bits) & 0xFF
        assert top.tolist() == exponent.tolist() == [127, 127, 128, 126, 0, 255]
    assert exponent_rotation(torch.float16) == exponent_rotation(torch.int32) == 0


def test_the_filter_refuses_what_the_format_does_not_define() -> None:
    for width, rotate in ((1, 1), (8, 1), (2, 0), (2, 16), (4, 32), (4, -1)):
        with pytest.raises(ValueError):
            RotatedByteplaneFilter(width, rotate)
    with pytest.raises(ValueError, match="whole chunks"):
        RotatedByteplaneFilter(2, 1).join_into(np.zeros(4, np.uint8), 0, b"\x00\x00")


def _bit_pattern_state(seed: int) -> dict:
    """Every float the filter rotates as raw bit patterns (NaNs, infinities, -0.0 ...), odd sizes."""

    def floats(width: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        data = _bit_patterns(width, n, seed + n)
        return torch.from_numpy(data.copy()).view(_WORDS[width][1]).view(dtype).reshape(shape)

    return {
        "model": {
            "w": floats(2, 3 * 1001 * 7, torch.bfloat16, (3, 1001, 7)),
            "odd": floats(2, 1025, torch.bfloat16, (1025,)),
            "half": floats(2, 4097, torch.float16, (4097,)),
            "ids": torch.arange(3001, dtype=torch.int64),
        },
        "optimizer": {"state": {0: {"exp_avg": floats(4, 70001, torch.float32, (70001,)), "step": torch.tensor(3.0)}}},
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def _entries(path: Path) -> dict:
    with nc.open(path) as reader:
        return {t.key: t for t in reader.index.tensors}


@pytest.mark.parametrize("chunk_bytes", [64 << 10, 4 << 20])
def test_rotplane_files_round_trip_every_bit_pattern_and_record_the_filter(tmp_path: Path, chunk_bytes: int) -> None:
    state = _bit_pattern_state(seed=chunk_bytes)
    spec = nc.CodecSpec("zstd", 1, "rotplane", chunk_bytes=chunk_bytes)
    path = tmp_path / "rot.nvc"
    nc.save(state, path, policy=nc.CodecPolicy.uniform(spec, min_compress_bytes=0))
    assert_tree_equal(state, nc.load(path))
    with nc.open(path) as reader:
        assert reader.index.version == ROTATE_FORMAT_VERSION
        assert reader.read("model/w").view(torch.int16).equal(state["model"]["w"].view(torch.int16))
        reader.verify()
    entries = _entries(path)
    for key in ("model/w", "model/odd", "optimizer/state/0/exp_avg", "empty"):
        assert (entries[key].filter, entries[key].rotate) == ("rotplane", 1), key
    for key in ("model/half", "model/ids"):  # no 8-bit exponent after the sign: plain byte planes
        assert (entries[key].filter, entries[key].rotate) == ("byteplane", 0), key
    assert path.read_bytes().find(b"NVCKPT\x04\x00") >= 0


def test_a_file_without_rotated_tensors_keeps_its_old_version(tmp_path: Path) -> None:
    # Files an older reader reads stay readable by it: version 4 only where a tensor needs it.
    state = {"half": torch.randn(4096).half(), "ids": torch.arange(4096)}
    path = tmp_path / "plain.nvc"
    nc.save(state, path, policy=nc.CodecPolicy.uniform("zstd:1:rotplane"))
    with nc.open(path) as reader:
        assert reader.index.version == 1


def test_rotplane_is_a_policy_filter_and_a_shorthand() -> None:
    assert nc.CodecSpec.parse("zstd:3:rotplane") == nc.CodecSpec("zstd", 3, "rotplane")
    assert nc.CodecPolicy.from_dict({"weights": {"codec": "zstd", "filter": "rotplane"}}).weights.filter == "rotplane"


def _rewrite_index(path: Path, edit) -> None:
    """Apply ``edit`` to the index JSON and write the file back with a valid digest, footer and header version."""
    data = path.read_bytes()
    offset, _, _, magic = struct.unpack("<QQQ8s", data[-32:])
    doc = json.loads(data[offset:-32])
    edit(doc)
    index = json.dumps(doc, separators=(",", ":")).encode()
    head = bytearray(data[:offset])
    at = head.find(b"NVCKPT")
    head[at + 6] = doc["version"]
    path.write_bytes(bytes(head) + index + struct.pack("<QQQ8s", offset, len(index), xxhash.xxh3_64_intdigest(index), magic))


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "forged.nvc"
    nc.save(_bit_pattern_state(seed=5), path, policy=nc.CodecPolicy.uniform("zstd:1:rotplane"))
    return path


def _tensor(doc: dict, key: str) -> dict:
    return next(t for t in doc["tensors"] if t["key"] == key)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: _tensor(d, "model/w").pop("rotate"), "integer 'rotate'"),
        (lambda d: _tensor(d, "model/w").update(rotate=0), "integer 'rotate'"),
        (lambda d: _tensor(d, "model/w").update(rotate=16), "integer 'rotate'"),
        (lambda d: _tensor(d, "model/w").update(rotate="1"), "integer 'rotate'"),
        (lambda d: _tensor(d, "model/w").update(rotate=True), "integer 'rotate'"),
        (lambda d: _tensor(d, "model/w").update(rotate=1.0), "integer 'rotate'"),
        (lambda d: _tensor(d, "model/ids").update(filter="rotplane", rotate=1), "width 8"),
        (lambda d: _tensor(d, "model/half").update(rotate=1), "'rotate' field with filter 'byteplane'"),
        (lambda d: _tensor(d, "model/w").update(filter="rotplanes"), "unknown codec 'zstd' or filter 'rotplanes'"),
        (lambda d: d.update(version=3, base={"path": "b.nvc", "size": 1, "index_xxh3": "0" * 16, "depth": 1}), "version-3"),
        (lambda d: d.update(version=1), "version-1"),
        (
            lambda d: (
                d.update(base={"path": "b.nvc", "size": 1, "index_xxh3": "0" * 16, "depth": 1})
                or _tensor(d, "model/w").update(delta={"key": "model/w", "xxh3": "0" * 16})
            ),
            "with a delta record",
        ),
    ],
)
def test_forged_rotation_records_are_refused(tmp_path: Path, edit, message: str) -> None:
    path = _saved(tmp_path)
    _rewrite_index(path, edit)
    with pytest.raises(FormatError, match=message):
        nc.open(path)


def test_forged_rotation_amount_decodes_other_values_never_crashes(tmp_path: Path) -> None:
    # A valid but different rotation is a different file: the reader decodes it (checksums cover
    # stored bytes, not values) without error, and rotating back by hand gives the saved values.
    path = _saved(tmp_path)
    want = _bit_pattern_state(seed=5)["model"]["w"]
    _rewrite_index(path, lambda d: _tensor(d, "model/w").update(rotate=3))
    with nc.open(path) as reader:
        got = reader.read("model/w").view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    # Stored planes are rot1(x); read back as rotr3(rot1(x)) = rotr2(x): rotate left 2 to undo.
    undone = ((got << 2) | (got >> 14)) & 0xFFFF
    assert undone.astype(np.uint16).tobytes() == want.view(torch.int16).numpy().tobytes()


def test_this_reader_reads_version_four_and_asks_to_upgrade_for_five(tmp_path: Path) -> None:
    assert ROTATE_FORMAT_VERSION in READ_VERSIONS
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[data.find(b"NVCKPT") + 6] = 5
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="version 5.*Upgrade"):
        nc.open(path)


def test_delta_against_a_rotated_base_stores_plain_byte_plane_deltas_and_rotates_new_tensors(tmp_path: Path) -> None:
    policy = nc.CodecPolicy.uniform("zstd:1:rotplane")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(257, 129, generator=g).to(torch.bfloat16)
    base_state = {"model": {"w": w}}
    later = {"model": {"w": (w.float() + 1e-3).to(torch.bfloat16), "new": torch.randn(5000, generator=g)}}
    nc.save(base_state, tmp_path / "base.nvc", policy=policy)
    nc.save(later, tmp_path / "delta.nvc", policy=policy, base=tmp_path / "base.nvc")
    assert_tree_equal(later, nc.load(tmp_path / "delta.nvc"))
    with nc.open(tmp_path / "delta.nvc") as reader:
        assert reader.index.version == ROTATE_FORMAT_VERSION and reader.index.base is not None
    entries = _entries(tmp_path / "delta.nvc")
    assert entries["model/w"].delta is not None and (entries["model/w"].filter, entries["model/w"].rotate) == ("byteplane", 0)
    assert (entries["model/new"].filter, entries["model/new"].rotate) == ("rotplane", 1)


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    return tree


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the rotation runs on the device)")
def test_gpu_rotplane_save_and_load_match_the_cpu(tmp_path: Path) -> None:
    state = _bit_pattern_state(seed=9)
    cpu_policy = nc.CodecPolicy.uniform("zstd:1:rotplane", min_compress_bytes=0, device="cpu")
    gpu_policy = nc.CodecPolicy.uniform("zstd:1:rotplane", min_compress_bytes=0, device="cuda")
    nc.save(state, tmp_path / "cpu.nvc", policy=cpu_policy)
    nc.save(state, tmp_path / "gpu.nvc", policy=gpu_policy)
    for name in ("cpu.nvc", "gpu.nvc"):
        assert_tree_equal(state, nc.load(tmp_path / name))
        on_device = nc.load(tmp_path / name, map_location="cuda")
        assert on_device["model"]["w"].is_cuda
        assert_tree_equal(state, _to_cpu(on_device))
    gpu_entries = _entries(tmp_path / "gpu.nvc")
    assert (gpu_entries["model/w"].filter, gpu_entries["model/w"].rotate) == ("rotplane", 1)
    data = torch.from_numpy(_bit_patterns(4, 70001, 1).copy())
    filt = RotatedByteplaneFilter(4, 1)
    on_gpu = filt.split_torch(data.cuda())
    assert [p.cpu().numpy().tobytes() for p in on_gpu] == [p.tobytes() for p in filt.split(data.numpy())]
    assert filt.join_torch(on_gpu).cpu().numpy().tobytes() == data.numpy().tobytes()


def test_default_and_max_ratio_rotate_weights_and_second_moments_only() -> None:
    # Measured in benchmarks/README.md ("Peer coders"): the rotation pays on weights and second
    # moments and loses on first moments and gradients, whose signs come in runs.
    for policy in (nc.CodecPolicy(), nc.CodecPolicy.max_ratio()):
        filters = {c: getattr(policy, c).filter for c in ("weights", "exp_avg", "exp_avg_sq", "gradients", "other")}
        assert filters == {
            "weights": "rotplane",
            "exp_avg": "byteplane",
            "exp_avg_sq": "rotplane",
            "gradients": "byteplane",
            "other": "byteplane",
        }
    assert nc.CodecPolicy.max_ratio().weights.adaptive
