"""The "sub" transform of delta files: the wrapping difference of bit patterns, its undoing on the
CPU (numpy) and in torch (the GPU path), and delta files holding "sub" frames end to end."""

from __future__ import annotations

import itertools
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.delta import pick_frames, undo_chunk_, undo_chunk_np_
from nvcomp_checkpoint.errors import BaseCheckpointError, CheckpointError, ChecksumError, FormatError
from nvcomp_checkpoint.filters.sub import sub_bytes, sub_bytes_torch, undo_planes_, undo_planes_np_
from nvcomp_checkpoint.format.layout import GUARD

G = len(GUARD)  # files start with the guard, then the magic (docs/format.md)

META = {"created_by": "test", "torch": "pinned", "created": 0.0}


# -- the transform ------------------------------------------------------------------------------


def _reference_undo(stored: np.ndarray, base: np.ndarray, width: int, ops: list[str]) -> np.ndarray:
    """docs/format.md's rule, element by element with Python integers."""
    out = bytearray(stored.tobytes())
    for i in range(0, len(out), width):
        x, b = list(out[i : i + width]), int.from_bytes(base[i : i + width].tobytes(), "little")
        for k, op in enumerate(ops):
            if op == "xor":
                x[k] ^= b >> (8 * k) & 0xFF
            elif op == "sub":
                borrow = int.from_bytes(bytes(x[:k]), "little") < b % 256**k
                x[k] = (x[k] + (b >> (8 * k) & 0xFF) + borrow) % 256
        out[i : i + width] = bytes(x)
    return np.frombuffer(bytes(out), np.uint8)


def _stored(x: np.ndarray, base: np.ndarray, width: int, ops: list[str]) -> np.ndarray:
    """What a writer stores for planes ``ops`` of ``x``: plane k of x, of x ^ base, or of x - base."""
    forms = {"": x, "xor": x ^ base, "sub": sub_bytes(x, base, width)}
    out = x.copy().reshape(-1, width)
    for k, op in enumerate(ops):
        out[:, k] = forms[op].reshape(-1, width)[:, k]
    return out.reshape(-1)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_every_mix_of_plane_ops_undoes_to_the_values(width):
    rng = np.random.default_rng(width)
    # Random bytes, and small steps of both signs (borrows across every byte boundary).
    base = rng.integers(0, 256, 300 * width, dtype=np.uint8)
    word = {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]
    steps = rng.integers(-300, 300, 300).astype(np.int64).astype(word)
    inputs = [rng.integers(0, 256, 300 * width, dtype=np.uint8), (base.view(word) + steps).view(np.uint8), base.copy()]
    for x, ops in itertools.product(inputs, itertools.product(["", "xor", "sub"], repeat=width)):
        ops = list(ops)
        stored = _stored(x, base, width, ops)
        assert np.array_equal(_reference_undo(stored, base, width, ops), x), ops
        got = stored.copy()
        undo_planes_np_(got, base, width, ops)
        assert np.array_equal(got, x), ops
        got = stored.copy()
        undo_chunk_np_(got, base, width, ops)
        assert np.array_equal(got, x), ops
        t = torch.from_numpy(stored.copy())
        undo_chunk_(t, torch.from_numpy(base), width, ops)
        assert np.array_equal(t.numpy(), x), ops
        if "sub" in ops:
            t = torch.from_numpy(stored.copy())
            undo_planes_(t, torch.from_numpy(base), width, ops)
            assert np.array_equal(t.numpy(), x), ops


@pytest.mark.parametrize("width", [1, 2, 4])
def test_difference_wraps_the_same_in_numpy_and_torch(width):
    rng = np.random.default_rng(10 + width)
    x = rng.integers(0, 256, 4096 * width, dtype=np.uint8)
    base = rng.integers(0, 256, 4096 * width, dtype=np.uint8)
    d = sub_bytes(x, base, width)
    assert np.array_equal(sub_bytes_torch(torch.from_numpy(x), torch.from_numpy(base), width).numpy(), d)
    words = [
        int.from_bytes(x[i : i + width].tobytes(), "little") - int.from_bytes(base[i : i + width].tobytes(), "little")
        for i in range(0, 64 * width, width)
    ]
    assert d[: 64 * width].tobytes() == b"".join((w % 256**width).to_bytes(width, "little") for w in words)


def test_unfiltered_chunk_takes_one_op_for_every_byte():
    rng = np.random.default_rng(5)
    x, base = rng.integers(0, 256, 4000, dtype=np.uint8), rng.integers(0, 256, 4000, dtype=np.uint8)
    got = sub_bytes(x, base, 4)
    undo_planes_np_(got, base, 4, ["sub"])
    assert np.array_equal(got, x)


def test_chunk_slices_at_element_offsets():
    # The decoder undoes chunks in place inside one tensor's bytes: views at item-size offsets.
    rng = np.random.default_rng(8)
    x, base = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)
    ops = ["", "sub", "xor", "sub"]
    out = x.copy()
    out[4:2052] = _stored(x[4:2052], base[4:2052], 4, ops)
    undo_planes_np_(out[4:2052], base[4:2052], 4, ops)
    assert np.array_equal(out, x)


def test_difference_is_refused_for_other_widths():
    with pytest.raises(ValueError, match="widths"):
        sub_bytes(np.zeros(16, np.uint8), np.zeros(16, np.uint8), 8)
    with pytest.raises(ValueError, match="widths"):
        undo_planes_np_(np.zeros(16, np.uint8), np.zeros(16, np.uint8), 8, ["sub"] * 8)


def test_pick_frames_prefers_plain_then_xor_on_ties():
    pieces = [b"aaaa", b"bbbb", b"cccc"]
    forms = [("", pieces, [b"12345"] * 3), ("xor", pieces, [b"123", b"12", b"1"]), ("sub", pieces, [b"123", b"1", b"1"])]
    assert [op for _, op in pick_frames(forms, len)] == ["xor", "sub", "xor"]
    assert [op for _, op in pick_frames(forms[:1] + [("sub", pieces, [b"xxxx"] * 3)], len)] == ["", "", ""]


# -- delta files with "sub" frames ------------------------------------------------------------


def _state(step: int) -> dict:
    """A training state after ``step`` Adam-like steps: second moments decay slowly, weights move a little."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 96, generator=g)
    m, v = torch.zeros(128, 96), torch.full((128, 96), 1e-4)
    for _ in range(step):
        grad = torch.randn(128, 96, generator=g) * 1e-3
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        w = w - 1e-4 * m / (v.sqrt() + 1e-8)
    return {
        "model": {"w": w.to(torch.bfloat16), "w32": w.clone(), "ids": torch.arange(1000, dtype=torch.int64)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}}},
        "step": step,
    }


def _ops(path: Path) -> dict[str, list[str]]:
    with nc.open(path) as reader:
        return {t.key: [f.op for f in t.frames] for t in reader.index.tensors}


def _chain(tmp_path: Path, steps: list[int]) -> list[Path]:
    paths: list[Path] = []
    for step in steps:
        path = tmp_path / f"ckpt-{step}.nvc"
        nc.save(_state(step), path, base=paths[-1] if paths else None, metadata=META)
        paths.append(path)
    return paths


def test_delta_with_sub_frames_loads_and_reads_bit_exactly(tmp_path):
    paths = _chain(tmp_path, [20, 30, 40])
    for path, step in zip(paths[1:], (30, 40)):
        assert path.read_bytes()[: G + 8] == GUARD + b"NVCKPT\x03\x00"
        ops = _ops(path)
        assert "sub" in ops["optimizer/state/0/exp_avg_sq"], ops
        assert "sub" not in ops["optimizer/state/0/exp_avg"]  # first moments are not tried
        want = _state(step)
        assert_tree_equal(want, nc.load(path))
        with nc.open(path) as reader:
            for key in reader.keys():
                assert_tree_equal(dict(reader.read_many([key]))[key], reader.read(key))
            assert_tree_equal(want["optimizer"]["state"][0]["exp_avg_sq"], reader.read("optimizer/state/0/exp_avg_sq"))
            assert_tree_equal(want["model"]["w"], reader.read("model/w"))
            assert all(err is None for _, err in reader.verify())


def test_sub_shrinks_second_moments_against_xor_alone(tmp_path, monkeypatch):
    base = tmp_path / "base.nvc"
    nc.save(_state(20), base)
    with_sub = nc.save(_state(40), tmp_path / "sub.nvc", base=base)
    monkeypatch.setattr(nc.delta, "SUB_COMPONENTS", frozenset())
    xor_only = nc.save(_state(40), tmp_path / "xor.nvc", base=base)
    assert (tmp_path / "xor.nvc").read_bytes()[G : G + 8] == b"NVCKPT\x02\x00"  # nothing tried: version 2
    with nc.open(tmp_path / "sub.nvc") as a, nc.open(tmp_path / "xor.nvc") as b:
        sa, sb = a.entry("optimizer/state/0/exp_avg_sq").stored_bytes, b.entry("optimizer/state/0/exp_avg_sq").stored_bytes
    assert sa < sb and with_sub.stored_bytes < xor_only.stored_bytes


def test_form_chosen_from_a_sample_loads_exactly_and_stores_about_as_small(tmp_path, monkeypatch):
    base = tmp_path / "base.nvc"
    nc.save(_state(20), base)
    monkeypatch.setattr(nc.delta, "PICK_SAMPLE_BYTES", 0)  # every form of every plane compressed whole
    whole = nc.save(_state(40), tmp_path / "whole.nvc", base=base)
    monkeypatch.setattr(nc.delta, "PICK_SAMPLE_BYTES", 2048)  # planes of 12 KiB: chosen from 2 KiB samples
    sampled = nc.save(_state(40), tmp_path / "sampled.nvc", base=base)
    assert_tree_equal(_state(40), nc.load(tmp_path / "sampled.nvc"))
    assert "sub" in _ops(tmp_path / "sampled.nvc")["optimizer/state/0/exp_avg_sq"]
    # Frames only: the index also holds the save's time, whose printed length varies by a byte or so.
    frames = {}
    for name in ("whole", "sampled"):
        with nc.open(tmp_path / f"{name}.nvc") as reader:
            frames[name] = sum(t.stored_bytes for t in reader.index.tensors)
    assert frames["whole"] <= frames["sampled"] < 1.03 * frames["whole"]
    assert sampled.stored_bytes < 1.03 * whole.stored_bytes


def test_rebase_of_a_sub_delta_stands_alone(tmp_path):
    from nvcomp_checkpoint.cli.main import main

    paths = _chain(tmp_path, [20, 30])
    assert main(["rebase", "-q", str(paths[1]), str(tmp_path / "full.nvc")]) == 0
    for p in paths:
        p.unlink()
    with nc.open(tmp_path / "full.nvc") as reader:
        # A full file: no base, and version 4 for the default policy's rotated weight planes.
        assert reader.index.base is None and reader.index.version == 4
    assert_tree_equal(_state(30), nc.load(tmp_path / "full.nvc"))


def test_damaged_sub_frame_names_tensor_chunk_and_plane(tmp_path):
    paths = _chain(tmp_path, [20, 30])
    with nc.open(paths[1]) as reader:
        entry = reader.entry("optimizer/state/0/exp_avg_sq")
    plane = next(p for p, f in enumerate(entry.frames) if f.op == "sub")
    frame = entry.frames[plane]
    data = bytearray(paths[1].read_bytes())
    data[frame.offset + frame.size // 2] ^= 0x10
    paths[1].write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"exp_avg_sq.*byte plane {plane % entry.planes}"):
        nc.load(paths[1])
    with nc.open(paths[1]) as reader:
        assert [e.key for e, err in reader.verify() if err is not None] == ["optimizer/state/0/exp_avg_sq"]


def test_damaged_base_of_a_sub_delta_never_gives_wrong_tensors(tmp_path):
    paths = _chain(tmp_path, [20, 30])
    with nc.open(paths[0]) as reader:
        frame = reader.entry("optimizer/state/0/exp_avg_sq").frames[0]
    data = bytearray(paths[0].read_bytes())
    data[frame.offset] ^= 0x40
    paths[0].write_bytes(bytes(data))
    with pytest.raises(BaseCheckpointError, match="exp_avg_sq"):
        nc.load(paths[1])


def test_fuzzed_sub_delta_raises_or_loads_exactly(tmp_path):
    paths = _chain(tmp_path, [20, 30])
    want = _state(30)
    clean = paths[1].read_bytes()
    rng = random.Random(99)
    errors = 0
    for _ in range(80):
        data = bytearray(clean)
        for _ in range(rng.choice([1, 2, 8])):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        fuzzed = tmp_path / "fuzzed.nvc"
        fuzzed.write_bytes(bytes(data))
        try:
            back = nc.load(fuzzed)
        except CheckpointError:
            errors += 1
            continue
        assert_tree_equal(want, back)  # never wrong data
    assert errors > 70


def _rewrite_index(path: Path, edit) -> None:
    """Apply ``edit`` to the index JSON and write it back with a valid digest and footer."""
    data = path.read_bytes()
    offset, size, _, magic = struct.unpack("<QQQ8s", data[-32:])
    doc = json.loads(data[offset : offset + size])
    edit(doc)
    index = json.dumps(doc, separators=(",", ":")).encode()
    head = bytearray(data[:offset])
    if "version" in doc and isinstance(doc["version"], int) and 0 < doc["version"] < 256:
        head[G + 6] = doc["version"]
    path.write_bytes(bytes(head) + index + struct.pack("<QQQ8s", offset, len(index), xxhash.xxh3_64_intdigest(index), magic))


def _first_sub(doc: dict) -> tuple[dict, list]:
    for t in doc["tensors"]:
        for f in t["frames"]:
            if f[3:] == ["sub"]:
                return t, f
    raise AssertionError("no sub frame")


def test_sub_frame_in_a_version_two_index_is_refused(tmp_path):
    paths = _chain(tmp_path, [20, 30])
    _rewrite_index(paths[1], lambda doc: doc.update(version=2))
    with pytest.raises(FormatError, match="'sub' in a version-2 file"):
        nc.open(paths[1])


def test_sub_frame_of_an_eight_byte_tensor_is_refused(tmp_path):
    paths = _chain(tmp_path, [20, 30])

    def edit(doc: dict) -> None:
        ids = next(t for t in doc["tensors"] if t["key"] == "model/ids")
        ids["frames"][0] = ids["frames"][0][:3] + ["sub"]
        ids["delta"] = {"key": "model/ids", "xxh3": "0" * 16}

    _rewrite_index(paths[1], edit)
    with pytest.raises(FormatError, match="width 8"):
        nc.open(paths[1])


def test_newer_format_version_asks_to_upgrade(tmp_path):
    paths = _chain(tmp_path, [20, 30])
    data = bytearray(paths[1].read_bytes())
    data[G + 6] = 5
    paths[1].write_bytes(bytes(data))
    with pytest.raises(FormatError, match="version 5.*Upgrade"):
        nc.open(paths[1])


def test_header_and_index_versions_must_agree_for_sub_deltas(tmp_path):
    paths = _chain(tmp_path, [20, 30])
    data = bytearray(paths[1].read_bytes())
    data[G + 6] = 2  # a version-2 header on a file whose index says 3
    paths[1].write_bytes(bytes(data))
    with pytest.raises(FormatError, match="version"):
        nc.open(paths[1])


def test_forged_sub_op_on_a_plain_tensor_is_refused_or_exact(tmp_path):
    # A frame op turned to "sub" without a delta record is refused at open.
    paths = _chain(tmp_path, [20, 30])

    def edit(doc: dict) -> None:
        t = next(t for t in doc["tensors"] if t["key"] == "optimizer/state/0/exp_avg")
        t["frames"][0] = t["frames"][0][:3] + ["sub"]

    _rewrite_index(paths[1], edit)
    with pytest.raises(FormatError, match="delta record"):
        nc.open(paths[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the difference is taken and undone on the device)")
def test_gpu_sub_delta_matches_the_cpu(tmp_path):
    base, later = _state(20), _state(40)
    nc.save(base, tmp_path / "base.nvc")
    on_gpu = {
        "model": {k: v.cuda() for k, v in later["model"].items()},
        "optimizer": {"state": {0: {k: v.cuda() for k, v in later["optimizer"]["state"][0].items()}}},
        "step": 40,
    }
    nc.save(on_gpu, tmp_path / "gpu.nvc", base=tmp_path / "base.nvc")
    nc.save(later, tmp_path / "cpu.nvc", base=tmp_path / "base.nvc", policy=nc.CodecPolicy(device="cpu"))
    assert "sub" in _ops(tmp_path / "gpu.nvc")["optimizer/state/0/exp_avg_sq"]
    for name in ("gpu.nvc", "cpu.nvc"):
        assert_tree_equal(later, nc.load(tmp_path / name, map_location="cpu"))
        back = nc.load(tmp_path / name, map_location="cuda")
        assert back["optimizer"]["state"][0]["exp_avg_sq"].is_cuda
        assert_tree_equal(later, back)
    rng = np.random.default_rng(0)
    x, b = rng.integers(0, 256, 1 << 16, dtype=np.uint8), rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for width in (1, 2, 4):
        for ops in itertools.product(["", "xor", "sub"], repeat=width):
            stored = _stored(x, b, width, list(ops))
            t = torch.from_numpy(stored.copy()).cuda()
            undo_chunk_(t, torch.from_numpy(b).cuda(), width, list(ops))
            assert np.array_equal(t.cpu().numpy(), x), ops
        assert np.array_equal(
            sub_bytes_torch(torch.from_numpy(x).cuda(), torch.from_numpy(b).cuda(), width).cpu().numpy(), sub_bytes(x, b, width)
        )
