"""Shared test helpers."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh contiguous copy: a one-element view may keep any stride (view(uint8) refuses
    # it), and lazy conj/neg views must show the values they stand for.
    flat = t.detach().cpu().resolve_conj().resolve_neg().reshape(-1)
    return flat.clone(memory_format=torch.contiguous_format).view(torch.uint8)


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Bit-identical tensors (same dtype, shape, bytes) and equal plain values, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: expected a tensor, got {type(b)}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.numel():
            ab, bb = _element_bytes(a), _element_bytes(b)
            assert torch.equal(ab, bb), f"{path}: tensor bytes differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)} != {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}/{i}")
        return
    if isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{path}: NaN lost"
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def tree_equal():
    return assert_tree_equal


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Puts back the number of CPU threads torch computes with, if a test changed it.

    Some tests compare an in-process run with a subprocess bit for bit: the thread count sets the
    float reduction order, so one test's ``torch.set_num_threads(1)`` must not reach a later module.
    """
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
