"""The non-tensor part of a checkpoint tree (its "skeleton").

Tensors found in dicts, lists and tuples are replaced by :class:`TensorRef` placeholders; the
rest (numbers, strings, RNG states, Lightning loop state ...) is serialized with ``torch.save``
and read back with ``torch.load(weights_only=True)``, so loading follows exactly PyTorch's
rules for what a file may construct. Arbitrary Python objects need ``weights_only=False``.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Callable

import torch

from ..errors import FormatError, UnsafeCheckpointError, UnsupportedObjectError

__all__ = ["TensorRef", "flatten", "tensor_paths", "unflatten", "encode_skeleton", "decode_skeleton", "weights_only_detail"]


class TensorRef:
    """Placeholder for the tensor stored at ``index`` in the checkpoint's tensor table."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (TensorRef, (self.index,))

    def __repr__(self) -> str:
        return f"TensorRef({self.index})"


def _tensor_identity(t: torch.Tensor) -> tuple[Any, ...]:
    # Two entries of a tree that are the same view of the same storage (tied weights) are
    # stored once and come back as one tensor object, as torch.save does. The lazy conj/neg
    # bits are part of the identity: ``z`` and ``z.conj()`` share storage but hold other values.
    # So are the Parameter type and requires_grad, which the file records per tensor: ``p`` and
    # ``p.detach()`` come back as a Parameter and a plain tensor, as with torch.save.
    return (
        t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device,
        t.is_conj(), t.is_neg(), isinstance(t, torch.nn.Parameter), t.requires_grad,
    )


def flatten(obj: Any, where: str = "checkpoint") -> tuple[Any, list[tuple[tuple[Any, ...], torch.Tensor]]]:
    """Split ``obj`` into a skeleton and its tensors.

    Args:
        obj: The checkpoint tree.
        where: The file, for error messages.

    Returns:
        ``(skeleton, tensors)`` where ``tensors[i] = (path, tensor)`` and the skeleton holds
        ``TensorRef(i)`` where the tensor was. Containers are copied, tensors are not.

    Raises:
        UnsupportedObjectError: A container holds itself, or a lazy module's parameter has not
            been initialized.
    """
    tensors: list[tuple[tuple[Any, ...], torch.Tensor]] = []
    seen: dict[tuple[Any, ...], int] = {}
    open_containers: set[int] = set()

    def walk(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, (dict, list, tuple)):
            if id(node) in open_containers:
                raise UnsupportedObjectError(
                    f"{where}: the checkpoint tree contains itself at {_path_text(path)}; remove the cycle before saving"
                )
            open_containers.add(id(node))
            try:
                return walk_container(node, path)
            finally:
                open_containers.discard(id(node))
        if isinstance(node, torch.Tensor):
            if isinstance(node, torch.nn.parameter.UninitializedTensorMixin):
                raise UnsupportedObjectError(
                    f"{where}: tensor {_path_text(path)} is a lazy module's parameter that is not initialized "
                    "yet; run one forward pass (or initialize_parameters) before saving"
                )
            if type(node) is not torch.Tensor and not isinstance(node, torch.nn.Parameter):
                # Tensor subclasses (DTensor, FakeTensor ...) carry state we cannot rebuild.
                return node
            # Sparse, nested and meta tensors have no storage to compare; the writer refuses them.
            # Empty tensors hold no bytes to share, and every empty storage has data_ptr 0.
            plain = (
                node.device.type != "meta" and node.layout == torch.strided and not node.is_nested
                and node.numel() > 0
            )
            ident = _tensor_identity(node) if plain else None
            if ident is not None and ident in seen:
                return TensorRef(seen[ident])
            index = len(tensors)
            tensors.append((path, node))
            if ident is not None:
                seen[ident] = index
            return TensorRef(index)
        return node

    def walk_container(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, dict):
            new = node.copy() if type(node) in (dict,) else copy.copy(node)
            for key, value in node.items():
                new[key] = walk(value, path + (key,))
            return new
        if isinstance(node, list):
            new_list = copy.copy(node) if type(node) is not list else list(node)
            for i, value in enumerate(node):
                new_list[i] = walk(value, path + (i,))
            return new_list
        if isinstance(node, tuple):
            items = [walk(value, path + (i,)) for i, value in enumerate(node)]
            if hasattr(node, "_fields"):  # namedtuple
                return type(node)(*items)
            return type(node)(items) if type(node) is not tuple else tuple(items)
        return node

    return walk(obj, ()), tensors


def _path_text(path: tuple[Any, ...]) -> str:
    return repr("/".join(str(p) for p in path)) if path else "its root"


def tensor_paths(skeleton: Any) -> list[tuple[tuple[Any, ...], int]]:
    """``(path, tensor index)`` of every :class:`TensorRef` in a skeleton, in tree order.

    A tensor reached by several paths (tied weights) is listed once per path.
    """
    found: list[tuple[tuple[Any, ...], int]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, TensorRef):
            found.append((path, node.index))
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, path + (key,))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, path + (i,))

    walk(skeleton, ())
    return found


def unflatten(skeleton: Any, resolve: Callable[[int], Any]) -> Any:
    """Inverse of :func:`flatten`: ``TensorRef(i)`` replaced by ``resolve(i)``."""

    def walk(node: Any) -> Any:
        if isinstance(node, TensorRef):
            return resolve(node.index)
        if isinstance(node, dict):
            for key, value in node.items():
                node[key] = walk(value)
            return node
        if isinstance(node, list):
            for i, value in enumerate(node):
                node[i] = walk(value)
            return node
        if isinstance(node, tuple):
            items = [walk(v) for v in node]
            if hasattr(node, "_fields"):
                return type(node)(*items)
            return type(node)(items) if type(node) is not tuple else tuple(items)
        return node

    return walk(skeleton)


def encode_skeleton(skeleton: Any) -> bytes:
    """Serialize a skeleton with ``torch.save``'s default pickle protocol.

    The default protocol matters: ``torch.load(weights_only=True)`` rejects protocol 4 streams.
    """
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def decode_skeleton(data: bytes, *, weights_only: bool, where: str) -> Any:
    """Deserialize a skeleton; with ``weights_only`` nothing but safe types is constructed.

    Raises:
        UnsafeCheckpointError: the skeleton holds objects that ``weights_only`` refuses.
        FormatError: the bytes are not a skeleton.
    """
    try:
        if weights_only:
            # Added for good, never removed: the ``safe_globals`` context manager edits one
            # process-wide set, so its exit in one thread broke loads running in others.
            torch.serialization.add_safe_globals([TensorRef])
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except pickle.UnpicklingError as exc:
        if weights_only and "Weights only load failed" in str(exc):
            detail = weights_only_detail(exc)
            raise UnsafeCheckpointError(
                f"{where}: the checkpoint holds Python objects that a weights-only load refuses "
                f"({detail}). If you trust this file, load it with weights_only=False, or allow "
                "the type with torch.serialization.add_safe_globals([...])."
            ) from exc
        raise FormatError(f"{where}: the checkpoint's object tree is corrupt: {exc}") from exc
    except (RuntimeError, EOFError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise FormatError(f"{where}: the checkpoint's object tree is corrupt: {exc}") from exc


def weights_only_detail(exc: BaseException) -> str:
    """The part of a torch (weights-only) load error that names the refused type or opcode.

    torch wraps it in a page of advice, in a layout that changes between releases.
    """
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:")[-1]
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    useful = [p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the documentation"))]
    chosen = useful or paragraphs or [""]
    return chosen[0].splitlines()[0][:300]
