"""Incremental (delta) checkpoints: save(base=...), chains, damaged or substituted bases, chain policy."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.delta import ChainPolicy, base_path_of, chain_of, retained
from nvcomp_checkpoint.errors import BaseCheckpointError, CheckpointError, FormatError
from nvcomp_checkpoint.format.layout import GUARD

G = len(GUARD)  # files start with the guard, then the magic (docs/format.md)

#: Fixed metadata: files of one state are byte-identical whatever the clock.
META = {"created_by": "test", "torch": "pinned", "created": 0.0}


def _state(step: int, seed: int = 0) -> dict:
    """A small training state after ``step`` AdamW-like steps: weights move a little each step."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g)
    m = torch.zeros(64, 96)
    v = torch.zeros(64, 96)
    for _ in range(step):
        grad = torch.randn(64, 96, generator=g) * 1e-2
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        w = w - 1e-3 * m / (v.sqrt() + 1e-8)
    return {
        "model": {
            "w": w.to(torch.bfloat16),
            "frozen": torch.arange(4096, dtype=torch.float32),
            "mask": torch.arange(3000) % 3 == 0,
            "phase": torch.complex(w[:8], w[8:16]),
        },
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}}},
        "step": step,
    }


def _save_chain(tmp_path: Path, steps: list[int]) -> list[Path]:
    paths = []
    for i, step in enumerate(steps):
        path = tmp_path / f"ckpt-{step}.nvc"
        nc.save(_state(step), path, base=paths[-1] if paths else None, metadata=META)
        paths.append(path)
    return paths


def test_delta_loads_bit_identical_and_is_smaller(tmp_path):
    base, later = _state(40), _state(80)
    nc.save(base, tmp_path / "base.nvc")
    delta = nc.save(later, tmp_path / "delta.nvc", base=tmp_path / "base.nvc")
    full = nc.save(later, tmp_path / "full.nvc")
    assert delta.stored_bytes < full.stored_bytes
    assert_tree_equal(later, nc.load(tmp_path / "delta.nvc"))
    with nc.open(tmp_path / "delta.nvc") as reader:
        assert reader.index.base is not None and reader.index.base.path == "base.nvc" and reader.index.base.depth == 1
        assert torch.equal(reader.read("model/w"), later["model"]["w"])
        assert torch.equal(reader.read("model/phase"), later["model"]["phase"])
        # An unchanged tensor is XORed to zeros: a few bytes.
        # First moments are new every step: not tried against the base (delta.XOR_COMPONENTS).
        assert reader.entry("optimizer/state/0/exp_avg").delta is None
        frozen = reader.entry("model/frozen")
        assert frozen.delta is not None and frozen.stored_bytes < 200
        assert all(err is None for _, err in reader.verify())


def test_delta_read_single_tensor_follows_chain(tmp_path):
    paths = _save_chain(tmp_path, [10, 20, 30, 40])
    want = _state(40)
    with nc.open(paths[-1]) as reader:
        assert reader.index.base.depth == 3
        assert torch.equal(reader.read("model/w"), want["model"]["w"])
        assert torch.equal(reader.read("optimizer/state/0/exp_avg"), want["optimizer"]["state"][0]["exp_avg"])


def test_chain_of_depth_three_loads_every_link(tmp_path):
    paths = _save_chain(tmp_path, [10, 20, 30, 40])
    for path, step in zip(paths, [10, 20, 30, 40]):
        assert_tree_equal(_state(step), nc.load(path))
    chain = chain_of(str(paths[-1]), nc.open)
    assert [Path(p) for p, _ in chain] == paths[::-1]
    assert [ref.depth if ref else 0 for _, ref in chain] == [3, 2, 1, 0]


def test_chain_moves_with_its_directory(tmp_path):
    paths = _save_chain(tmp_path / "run", [10, 20, 30])
    shutil.move(str(tmp_path / "run"), str(tmp_path / "moved"))
    assert_tree_equal(_state(30), nc.load(tmp_path / "moved" / paths[-1].name))


def test_missing_base_names_the_base(tmp_path):
    paths = _save_chain(tmp_path, [10, 20, 30])
    paths[0].unlink()
    for action in (lambda: nc.load(paths[-1]), lambda: nc.open(paths[-1]).read("model/w"), lambda: nc.load(paths[1])):
        with pytest.raises(BaseCheckpointError) as exc:
            action()
        assert str(paths[0]) in str(exc.value)


def test_substituted_base_is_refused(tmp_path):
    paths = _save_chain(tmp_path, [10, 20])
    # Another checkpoint of the same shapes at the base's path (the same run, another step).
    nc.save(_state(15), paths[0], metadata=META)
    with pytest.raises(BaseCheckpointError, match="not the checkpoint the delta was written against") as exc:
        nc.load(paths[1])
    assert str(paths[0]) in str(exc.value)


def test_base_resaved_with_other_metadata_is_refused(tmp_path):
    paths = _save_chain(tmp_path, [10, 20])
    # The same tensors, so a base whose values would undo the delta right: still another file.
    nc.save(_state(10), paths[0], metadata=dict(META, note="resaved"))
    with pytest.raises(BaseCheckpointError):
        nc.load(paths[1])


def test_damaged_base_never_gives_wrong_tensors(tmp_path):
    paths = _save_chain(tmp_path, [10, 20])
    with nc.open(paths[0]) as reader:
        frame = reader.entry("model/w").frames[-1]
    data = bytearray(paths[0].read_bytes())
    data[frame.offset] ^= 0x40
    paths[0].write_bytes(bytes(data))
    with pytest.raises(BaseCheckpointError, match="model/w") as exc:
        nc.load(paths[1])
    assert str(paths[0]) in str(exc.value)
    with nc.open(paths[1]) as reader:
        failed = [entry.key for entry, err in reader.verify() if err is not None]
    assert "model/w" in failed


def test_fuzzed_delta_raises_or_loads_exactly(tmp_path):
    paths = _save_chain(tmp_path, [10, 20])
    want = _state(20)
    clean = paths[1].read_bytes()
    rng = random.Random(1234)
    outcomes = {"error": 0, "exact": 0}
    for trial in range(120):
        data = bytearray(clean)
        for _ in range(rng.choice([1, 1, 2, 8])):
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
        fuzzed = tmp_path / "fuzzed.nvc"
        fuzzed.write_bytes(bytes(data))
        try:
            back = nc.load(fuzzed)
        except CheckpointError:
            outcomes["error"] += 1
            continue
        assert_tree_equal(want, back)  # never wrong data
        outcomes["exact"] += 1
    assert outcomes["error"] > 100  # every byte is covered by a checksum


def test_base_state_writes_the_same_file(tmp_path):
    base, later = _state(10), _state(20)
    nc.save(base, tmp_path / "base.nvc", metadata=META)
    nc.save(later, tmp_path / "from_file.nvc", base=tmp_path / "base.nvc", metadata=META)
    nc.save(later, tmp_path / "from_state.nvc", base=tmp_path / "base.nvc", base_state=base, metadata=META)
    assert (tmp_path / "from_file.nvc").read_bytes() == (tmp_path / "from_state.nvc").read_bytes()


def test_wrong_base_state_fails_on_load(tmp_path):
    nc.save(_state(10), tmp_path / "base.nvc")
    nc.save(_state(20), tmp_path / "delta.nvc", base=tmp_path / "base.nvc", base_state=_state(11))
    with pytest.raises(BaseCheckpointError, match="base_state"):
        nc.load(tmp_path / "delta.nvc")


def test_changed_and_new_tensors_are_stored_plain(tmp_path):
    base = _state(10)
    later = _state(20)
    later["model"]["w"] = later["model"]["w"].float()  # dtype changed
    later["model"]["frozen"] = torch.arange(2048, dtype=torch.float32)  # shape changed
    later["model"]["new"] = torch.randn(100)
    del later["model"]["mask"]
    nc.save(base, tmp_path / "base.nvc")
    nc.save(later, tmp_path / "delta.nvc", base=tmp_path / "base.nvc")
    with nc.open(tmp_path / "delta.nvc") as reader:
        for key in ("model/w", "model/frozen", "model/new"):
            entry = reader.entry(key)
            assert entry.delta is None and not any(f.op for f in entry.frames), key
    assert_tree_equal(later, nc.load(tmp_path / "delta.nvc"))


def test_delta_cannot_replace_its_own_base(tmp_path):
    nc.save(_state(10), tmp_path / "a.nvc")
    with pytest.raises(CheckpointError, match="its own base"):
        nc.save(_state(20), tmp_path / "a.nvc", base=tmp_path / "a.nvc")
    assert_tree_equal(_state(10), nc.load(tmp_path / "a.nvc"))


def test_missing_base_at_save_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="nope.nvc"):
        nc.save(_state(20), tmp_path / "delta.nvc", base=tmp_path / "nope.nvc")
    assert not (tmp_path / "delta.nvc").exists()


def test_full_file_keeps_format_version_one(tmp_path):
    # Version 1 unless a tensor has rotated planes (version 4: the default's weights).
    nc.save(_state(10), tmp_path / "full.nvc", policy=nc.CodecPolicy.uniform("zstd:1"))
    assert (tmp_path / "full.nvc").read_bytes()[: G + 8] == GUARD + b"NVCKPT\x01\x00"
    nc.save(_state(10), tmp_path / "rotated.nvc")
    assert (tmp_path / "rotated.nvc").read_bytes()[: G + 8] == GUARD + b"NVCKPT\x04\x00"
    _save_chain(tmp_path, [1, 2])
    # Version 3: the writer tried the difference ("sub" frames) on the weights.
    assert (tmp_path / "ckpt-2.nvc").read_bytes()[G : G + 8] == b"NVCKPT\x03\x00"


def test_delta_header_and_index_version_must_agree(tmp_path):
    paths = _save_chain(tmp_path, [1, 2])
    data = bytearray(paths[1].read_bytes())
    data[G + 6] = 1  # a version-1 header on a delta file
    paths[1].write_bytes(bytes(data))
    with pytest.raises(FormatError, match="version"):
        nc.load(paths[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the XOR runs on the device)")
def test_gpu_delta_loads_as_cpu_delta(tmp_path):
    base, later = _state(10), _state(20)
    nc.save(base, tmp_path / "base.nvc")
    on_gpu = {"model": {k: v.cuda() for k, v in later["model"].items()}, "optimizer": later["optimizer"], "step": 20}
    nc.save(on_gpu, tmp_path / "gpu.nvc", base=tmp_path / "base.nvc")
    nc.save(later, tmp_path / "cpu.nvc", base=tmp_path / "base.nvc", policy=nc.CodecPolicy(device="cpu"))
    with nc.open(tmp_path / "gpu.nvc") as g:
        # The XOR ran on the device: the frames of the bf16 weights use it.
        assert any(f.op for f in g.entry("model/w").frames)
    assert_tree_equal(later, nc.load(tmp_path / "gpu.nvc", map_location="cpu"))
    back = nc.load(tmp_path / "cpu.nvc", map_location="cuda")
    assert back["model"]["w"].is_cuda
    assert_tree_equal(later, back)


# -- chain policy ----------------------------------------------------------------------------


def test_chain_policy_full_every_previous():
    policy = ChainPolicy(full_every=3)
    saved: list[str] = []
    bases = []
    for n in range(7):
        bases.append(policy.base_for(saved))
        saved.append(f"c{n}")
    assert bases == [None, "c0", "c1", None, "c3", "c4", None]


def test_chain_policy_full_every_against_last_full():
    policy = ChainPolicy(full_every=3, base="full")
    saved: list[str] = []
    bases = []
    for n in range(6):
        bases.append(policy.base_for(saved))
        saved.append(f"c{n}")
    assert bases == [None, "c0", "c0", None, "c3", "c3"]


def test_chain_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="full_every"):
        ChainPolicy(full_every=0)
    with pytest.raises(ValueError, match="base"):
        ChainPolicy(base="latest")


def test_retention_keeps_every_base_a_kept_checkpoint_needs(tmp_path):
    policy = ChainPolicy(full_every=3)
    saved: list[str] = []
    for step in range(1, 8):
        path = str(tmp_path / f"ckpt-{step}.nvc")
        nc.save(_state(step), path, base=policy.base_for(saved))
        saved.append(path)
    keep_last_two = saved[-2:]  # ckpt-6 (delta of 5, of 4, full) and ckpt-7 (full)
    kept = retained(keep_last_two, lambda p: base_path_of(p, nc.open))
    assert sorted(Path(p).name for p in kept) == ["ckpt-4.nvc", "ckpt-5.nvc", "ckpt-6.nvc", "ckpt-7.nvc"]
    for path in set(saved) - set(kept):
        Path(path).unlink()
    for path in kept:
        nc.load(path)


# -- command line ------------------------------------------------------------------------------


def test_cli_compress_base_inspect_verify_rebase(tmp_path, capsys):
    from nvcomp_checkpoint.cli.main import main

    for step in (10, 20, 30):
        torch.save(_state(step), tmp_path / f"s{step}.pt")
    assert main(["compress", "-q", str(tmp_path / "s10.pt"), str(tmp_path / "a.nvc")]) == 0
    assert main(["compress", "-q", str(tmp_path / "s20.pt"), str(tmp_path / "b.nvc"), "--base", str(tmp_path / "a.nvc")]) == 0
    assert main(["compress", "-q", str(tmp_path / "s30.pt"), str(tmp_path / "c.nvc"), "--base", str(tmp_path / "b.nvc")]) == 0
    capsys.readouterr()
    assert main(["inspect", "--no-tree", str(tmp_path / "c.nvc")]) == 0
    out = capsys.readouterr().out
    assert "chain:" in out and "depth 2" in out and "a.nvc (full" in out
    assert main(["verify", "--json", str(tmp_path / "c.nvc")]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 3
    assert main(["rebase", "-q", str(tmp_path / "c.nvc"), str(tmp_path / "full.nvc")]) == 0
    with nc.open(tmp_path / "full.nvc") as reader:
        assert reader.index.base is None
    assert_tree_equal(_state(30), nc.load(tmp_path / "full.nvc"))
    (tmp_path / "a.nvc").unlink()
    assert main(["verify", str(tmp_path / "c.nvc")]) == 1
    assert "a.nvc" in capsys.readouterr().out
    assert main(["rebase", "-q", str(tmp_path / "c.nvc"), str(tmp_path / "full2.nvc")]) == 2
    assert "a.nvc" in capsys.readouterr().err and not (tmp_path / "full2.nvc").exists()
    assert_tree_equal(_state(30), nc.load(tmp_path / "full.nvc"))  # the rebased copy stands alone


def test_async_delta_after_async_base(tmp_path):
    first = nc.save_async(_state(10), tmp_path / "a.nvc")
    second = nc.save_async(_state(20), tmp_path / "b.nvc", base=tmp_path / "a.nvc")
    first.result()
    second.result()
    with nc.open(tmp_path / "b.nvc") as reader:
        assert reader.index.base is not None and reader.entry("model/w").delta is not None
    assert_tree_equal(_state(20), nc.load(tmp_path / "b.nvc"))


def test_chain_on_an_fsspec_url_records_a_relative_base(tmp_path):
    root = f"memory://{tmp_path.name}"
    nc.save(_state(10), f"{root}/a.nvc")
    nc.save(_state(20), f"{root}/sub/b.nvc", base=f"{root}/a.nvc")
    with nc.open(f"{root}/sub/b.nvc") as reader:
        assert reader.index.base.path == "../a.nvc" and reader.chain.path == f"{root}/a.nvc"
    assert_tree_equal(_state(20), nc.load(f"{root}/sub/b.nvc"))


def test_save_over_a_file_of_the_base_chain_is_refused(tmp_path):
    paths = _save_chain(tmp_path, [10, 20])  # ckpt-20 is a delta of ckpt-10
    with pytest.raises(CheckpointError, match="chain of the base"):
        nc.save(_state(30), paths[0], base=paths[1])
    assert_tree_equal(_state(20), nc.load(paths[1]))


def test_delta_pointing_at_a_base_tensor_of_another_size_is_refused_before_decoding(tmp_path):
    # A forged delta (index rewritten, digests recomputed) whose tensor names a larger base
    # tensor: refused from the index sizes, before the base tensor is decoded.
    import xxhash

    from nvcomp_checkpoint.format.layout import FOOTER, pack_footer

    paths = _save_chain(tmp_path, [1, 2])
    data = paths[1].read_bytes()
    offset, size, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    index = json.loads(data[offset : offset + size])
    entry = next(t for t in index["tensors"] if t.get("delta") and t["key"] == "model/w")
    entry["delta"]["key"] = "model/frozen"  # 16384 bytes in the base; model/w has 12288
    raw = json.dumps(index).encode()
    paths[1].write_bytes(data[:offset] + raw + pack_footer(offset, len(raw), xxhash.xxh3_64_intdigest(raw)))
    with pytest.raises(BaseCheckpointError, match="'model/frozen' has 16384 bytes"):
        nc.load(paths[1])
