"""Tensors as the writer, the reader and the async snapshot all see them: byte views, unique keys, bit-for-bit comparison."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["flat_bytes", "unique_key", "first_difference", "SOURCE_DEVICE_ATTR"]

#: Attribute set on a host copy of a GPU tensor (by an async snapshot): the device the tensor
#: lives on, recorded in the index so that a load returns it there.
SOURCE_DEVICE_ATTR = "_nvckpt_source_device"


def unique_key(key: str, used: set[str]) -> str:
    """``key``, or ``key#2``, ``key#3`` ... when two paths print alike (``{"a/b": x, "a": {"b": y}}``,
    ``{0: x, "0": y}``), so that every tensor of a file has a key of its own to be read by."""
    unique, n = key, 1
    while unique in used:
        n += 1
        unique = f"{key}#{n}"
    used.add(unique)
    return unique


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a 1-D uint8 tensor on its own device (copies only if strided)."""
    # Lazy conjugate/negative views (``z.conj()``) cannot be reinterpreted as bytes; store
    # the values they denote, as torch.save does.
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        # A one-element view (``x[::2]`` of two elements) counts as contiguous with any
        # stride, which view(uint8) refuses.
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def first_difference(a: Any, b: Any, path: str) -> str | None:
    """The key of the first value that is not bit-identical, or None."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return path
        if a.numel() and not torch.equal(flat_bytes(a), flat_bytes(b)):
            return path
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return path
        for k in a:
            found = first_difference(a[k], b[k], f"{path}/{k}")
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}/{i}")
            if found is not None:
                return found
        return None
    if isinstance(a, float) and a != a:  # NaN (Adam's eps, betas are never NaN, but a user value may be)
        return None if isinstance(b, float) and b != b else path
    return None if a == b else path
