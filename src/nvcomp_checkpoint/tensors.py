"""Tensors as the writer, the reader and the async snapshot all see them: byte views and unique keys."""

from __future__ import annotations

import torch

__all__ = ["flat_bytes", "unique_key", "SOURCE_DEVICE_ATTR"]

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
