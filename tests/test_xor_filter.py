"""The XOR filter of delta checkpoints: plane-selective XOR in numpy (CPU decoder) and torch (GPU path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvcomp_checkpoint.filters.xor import plane_mask, xor_bytes, xor_planes_, xor_planes_np_


def _reference(a: np.ndarray, b: np.ndarray, width: int, planes: list[bool]) -> np.ndarray:
    want = a.copy()
    for p, on in enumerate(planes):
        if on:
            want.reshape(-1, width)[:, p] ^= b.reshape(-1, width)[:, p]
    return want


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n_elements", [1, 3, 16, 1025])
def test_plane_selective_xor_matches_reference(width, n_elements):
    rng = np.random.default_rng(width * 1000 + n_elements)
    masks = [[True] * width, [False] * width] + [list(map(bool, rng.random(width) < 0.5)) for _ in range(6)]
    for planes in masks:
        a = rng.integers(0, 256, n_elements * width, dtype=np.uint8)
        b = rng.integers(0, 256, n_elements * width, dtype=np.uint8)
        want = _reference(a, b, width, planes)
        got_np = a.copy()
        xor_planes_np_(got_np, b, width, planes)
        assert np.array_equal(got_np, want), planes
        got_t = torch.from_numpy(a.copy())
        xor_planes_(got_t, torch.from_numpy(b), width, planes)
        assert np.array_equal(got_t.numpy(), want), planes


def test_xor_of_slices_at_chunk_offsets():
    # The decoder XORs chunks in place inside one tensor's bytes: views at item-size offsets.
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    b = rng.integers(0, 256, 4096, dtype=np.uint8)
    out = a.copy()
    xor_planes_np_(out[6:1030], b[6:1030], 2, [False, True])
    want = a.copy()
    want[6:1030] = _reference(a[6:1030], b[6:1030], 2, [False, True])
    assert np.array_equal(out, want)


def test_xor_bytes_is_an_involution():
    rng = np.random.default_rng(3)
    for n in (0, 5, 64, 1001):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert np.array_equal(xor_bytes(xor_bytes(a, b), b), a)


def test_plane_mask_is_a_signed_word():
    assert plane_mask(2, [False, True]) == -256  # 0xFF00 as int16
    assert plane_mask(4, [True, False, False, False]) == 0xFF
    assert plane_mask(8, [False] * 7 + [True]) == -(1 << 56)
