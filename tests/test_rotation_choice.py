"""Rotated or plain byte planes chosen per tensor from a sample (``CodecPolicy(choose_rotation=True)``,
``planechoice.py``): which filter each kind of tensor gets, bit-exact round trips of both, the
default that keeps each component's filter, and the ranking rule the delta writer shares.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.codecs import cpu_codec
from nvcomp_checkpoint.format.layout import ROTATE_FORMAT_VERSION
from nvcomp_checkpoint.planechoice import ROTATION_CHOICE_MIN_BYTES, smallest_form

#: Elements of a bf16 tensor just over the size from which the writer chooses.
_N = ROTATION_CHOICE_MIN_BYTES // 2 + 4096
CHOOSING = nc.CodecPolicy(choose_rotation=True)


def _bf16(sign: np.ndarray, exponent: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """bf16 values of these signs (0/1) and biased exponents, with random 7-bit mantissas."""
    words = (sign.astype(np.uint16) << 15) | (exponent.astype(np.uint16) << 7) | rng.integers(0, 128, sign.size, dtype=np.uint16)
    return torch.from_numpy(words.view(np.int16).copy()).view(torch.bfloat16)


def _plain_wins(seed: int = 0) -> torch.Tensor:
    # Signs in long runs and the exponent's last bit random (exponents 128 and 129): plain planes
    # keep the runs in a top plane of two values and lose the bit to the (random) low plane; the
    # rotation puts the random bit in the top plane and the runs among random mantissa bits.
    rng = np.random.default_rng(seed)
    runs = rng.integers(64, 4096, _N // 64)
    sign = np.repeat(np.arange(runs.size) % 2, runs)[:_N]
    return _bf16(sign, rng.integers(128, 130, _N), rng)


def _rotation_wins(seed: int = 1) -> torch.Tensor:
    # Random signs and two exponents (120, 123) whose last bit follows from the others: plain planes
    # store that bit in the random low plane, the rotated top plane holds the whole exponent.
    rng = np.random.default_rng(seed)
    return _bf16(rng.integers(0, 2, _N), np.where(rng.random(_N) < 0.5, 120, 123), rng)


def _filters(path: Path) -> dict[str, tuple[str, int]]:
    with nc.open(path) as reader:
        return {t.key: (t.filter, t.rotate) for t in reader.index.tensors}


def _stored(path: Path, key: str) -> int:
    with nc.open(path) as reader:
        return reader.entry(key).stored_bytes


def _state() -> dict:
    # Weights default to rotated planes, gradients to plain ones: each tensor is the other kind.
    return {"model": {"w": _plain_wins()}, "gradients": {"w": _rotation_wins()}}


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_each_tensor_gets_the_planes_that_store_it_smaller_and_round_trips_bit_exact(tmp_path: Path) -> None:
    state = _state()
    nc.save(state, tmp_path / "chosen.nvc", CHOOSING)
    nc.save(state, tmp_path / "per-component.nvc")
    assert _filters(tmp_path / "chosen.nvc") == {"model/w": ("byteplane", 0), "gradients/w": ("rotplane", 1)}
    for key in ("model/w", "gradients/w"):
        # ... and the choice is right on the whole tensor, by more than the noise of a sample.
        assert _stored(tmp_path / "chosen.nvc", key) < 0.97 * _stored(tmp_path / "per-component.nvc", key), key
    back = nc.load(tmp_path / "chosen.nvc")
    assert _bit_equal(back["model"]["w"], state["model"]["w"]) and _bit_equal(back["gradients"]["w"], state["gradients"]["w"])
    with nc.open(tmp_path / "chosen.nvc") as reader:
        assert reader.index.version == ROTATE_FORMAT_VERSION
        reader.verify()


def test_by_default_every_tensor_keeps_its_components_filter(tmp_path: Path) -> None:
    state = _state()
    for policy in (nc.CodecPolicy(), nc.CodecPolicy(choose_rotation=False)):
        nc.save(state, tmp_path / "a.nvc", policy)
        assert _filters(tmp_path / "a.nvc") == {"model/w": ("rotplane", 1), "gradients/w": ("byteplane", 0)}
        assert_tree_equal(state, nc.load(tmp_path / "a.nvc"))
    # Plain planes throughout: the version an older reader reads. Choosing, the file may hold rotated
    # planes, decided after its header: version 4, whichever planes the tensors got.
    for policy, version in ((nc.CodecPolicy.uniform("zstd:1"), 1), (nc.CodecPolicy.uniform("zstd:1", choose_rotation=True), 4)):
        nc.save({"model": {"w": _plain_wins()}}, tmp_path / "b.nvc", policy)
        assert _filters(tmp_path / "b.nvc") == {"model/w": ("byteplane", 0)}
        with nc.open(tmp_path / "b.nvc") as reader:
            assert reader.index.version == version


def test_small_tensors_other_dtypes_and_raw_specs_keep_their_filter(tmp_path: Path) -> None:
    small = _plain_wins()[: ROTATION_CHOICE_MIN_BYTES // 2 - 1]
    state = {
        "model": {"small": small, "half": _plain_wins().view(torch.float16), "raw": _rotation_wins()},
        "gradients": {"small": _rotation_wins()[: small.numel()]},
    }
    nc.save(state, tmp_path / "a.nvc", CHOOSING.with_overrides(overrides={"model/raw": "none"}))
    assert _filters(tmp_path / "a.nvc") == {
        "model/small": ("rotplane", 1),
        "model/half": ("byteplane", 0),  # fp16: no 8-bit exponent after the sign, never rotated
        "model/raw": ("none", 0),
        "gradients/small": ("byteplane", 0),
    }
    assert_tree_equal(state, nc.load(tmp_path / "a.nvc"))


def test_a_delta_keeps_plain_planes_against_its_base_and_chooses_for_the_rest(tmp_path: Path) -> None:
    base = _state()
    later = {"model": {"w": _plain_wins(seed=2)}, "gradients": {"w": _rotation_wins(seed=3)}}
    nc.save(base, tmp_path / "base.nvc", CHOOSING)
    nc.save(later, tmp_path / "delta.nvc", CHOOSING, base=tmp_path / "base.nvc")
    # Weights are stored against the base (plain planes, as the format wants); gradients are not.
    assert _filters(tmp_path / "delta.nvc") == {"model/w": ("byteplane", 0), "gradients/w": ("rotplane", 1)}
    back = nc.load(tmp_path / "delta.nvc")
    assert _bit_equal(back["model"]["w"], later["model"]["w"]) and _bit_equal(back["gradients"]["w"], later["gradients"]["w"])


def test_an_async_save_chooses_as_a_sync_save_does(tmp_path: Path) -> None:
    state = _state()
    nc.save(state, tmp_path / "sync.nvc", CHOOSING)
    with nc.AsyncSaver() as saver:
        saver.save(state, tmp_path / "async.nvc", policy=CHOOSING).result(timeout=60)
    assert (
        _filters(tmp_path / "async.nvc")
        == _filters(tmp_path / "sync.nvc")
        == {
            "model/w": ("byteplane", 0),
            "gradients/w": ("rotplane", 1),
        }
    )
    assert_tree_equal(state, nc.load(tmp_path / "async.nvc"))


def test_the_presets_keep_each_components_filter_and_the_switch_is_a_checked_policy_field() -> None:
    # Off in every preset: measured, it lost on one checkpoint's gradients (benchmarks/README.md).
    assert not any(p.choose_rotation for p in (nc.CodecPolicy(), nc.CodecPolicy.max_ratio(), nc.CodecPolicy.uniform("zstd:3")))
    assert nc.CodecPolicy.max_ratio(choose_rotation=True).choose_rotation
    on = nc.CodecPolicy.from_dict({"choose_rotation": True})
    assert on.choose_rotation and nc.CodecPolicy.from_dict(on.to_dict()) == on
    with pytest.raises(ValueError, match="choose_rotation must be a bool, got str 'no'"):
        nc.CodecPolicy(choose_rotation="no")  # type: ignore[arg-type]


def test_the_ranking_keeps_the_earlier_form_on_ties_and_within_the_margin() -> None:
    codec = cpu_codec("zstd", 1)
    rng = np.random.default_rng(0)
    noise, zeros = rng.integers(0, 256, 4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    assert smallest_form(codec, [[noise], [zeros]]) == 1
    assert smallest_form(codec, [[zeros], [zeros.copy()]]) == 0  # a tie keeps the earlier
    assert smallest_form(codec, [[noise], [noise.copy()], [zeros]]) == 2
    # A form that stores smaller by no more than the margin does not displace the earlier one.
    assert smallest_form(codec, [[noise], [zeros]], margin=4096) == 0


def test_the_writer_samples_a_snapshot_tensor_only_once_its_copy_is_done(tmp_path: Path) -> None:
    # An async save hands the writer tensors still being copied, and a wait per tensor: the sample
    # must read the copy, not what was in its buffer before (zeros here: a tie, the spec's rotation).
    from nvcomp_checkpoint.format.skeleton import flatten
    from nvcomp_checkpoint.writer import CheckpointWriter, TreePlan, plan_tensors

    value = _plain_wins()
    copy = torch.zeros_like(value)
    skeleton, tensors = flatten({"model": {"w": copy}})
    policy = CHOOSING
    plan = TreePlan(skeleton, tuple(plan_tensors(tensors, policy, "test")), lambda index: copy.copy_(value))
    with open(tmp_path / "a.nvc", "wb") as stream:
        CheckpointWriter(stream, policy, str(tmp_path / "a.nvc")).write(None, plan=plan)
    assert _filters(tmp_path / "a.nvc") == {"model/w": ("byteplane", 0)}
    assert _bit_equal(nc.load(tmp_path / "a.nvc")["model"]["w"], value)
