"""The non-tensor part of a checkpoint tree (its "skeleton").

Tensors found in dicts, lists and tuples are replaced by :class:`TensorRef` placeholders (a
tensor anywhere else is refused: tensor bytes never go through pickle); the rest (numbers, strings, RNG states, Lightning loop state ...) is serialized with ``torch.save``
and read back with ``torch.load(weights_only=True)``, so loading follows exactly PyTorch's
rules for what a file may construct. Arbitrary Python objects need ``weights_only=False``.
"""

from __future__ import annotations

import copy
import io
import pickle
import zipfile
from typing import Any, Callable

import torch

from ..errors import FormatError, UnsafeCheckpointError, UnsupportedObjectError
from .picklescan import PicklePolicy, builds_tensor, scan_pickle
from .torchsave import MAX_PICKLE_NESTING, archive_pickle, storage_records

__all__ = [
    "TensorRef",
    "flatten",
    "tensor_paths",
    "check_skeleton",
    "unflatten",
    "encode_skeleton",
    "decode_skeleton",
    "weights_only_detail",
    "MAX_TREE_DEPTH",
    "MAX_TREE_NODES",
    "MAX_PICKLE_NESTING",
]


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
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.device,
        t.is_conj(),
        t.is_neg(),
        isinstance(t, torch.nn.Parameter),
        t.requires_grad,
    )


#: Containers deeper than this are refused by the writer (UnsupportedObjectError) and by the
#: reader (FormatError): torch.save spends two of Python's 1000 recursion levels per level of
#: the tree (measured: 497 levels at most from an empty stack), so deeper trees would save or
#: not depending on the caller's stack; and a reader must not hand a user a tree that breaks
#: recursive code (deepcopy, repr, ==).
MAX_TREE_DEPTH = 256
#: Items (containers, tensors and plain values inside dicts, lists and tuples) a tree may hold,
#: and path components that the tensor paths of a tree may add up to. A model with a million
#: tensors and its Adam state stays well under it.
MAX_TREE_NODES = 1 << 24
assert MAX_PICKLE_NESTING == MAX_TREE_DEPTH + 16  # a little over the tree depth, for the argument tuples pickle adds

#: The scan of an object tree's pickle before a weights-only load: the first global that builds
#: tensor data, or a storage reference, is reported (a writer stores every tensor in the tensor table).
TREE_POLICY = PicklePolicy(max_nesting=MAX_PICKLE_NESTING, persistent_ids=True, report_tensor_data=True)

_CONTAINERS = (dict, list, tuple)
_STORAGES = (torch.UntypedStorage, torch.storage.TypedStorage)


class _Level:
    """One container being walked: where it hangs in its parent, and its copy or new items."""

    __slots__ = ("node", "items", "out", "parent", "key", "depth", "changed")

    def __init__(self, node: Any, items: Any, out: Any, parent: "_Level | None", key: Any, depth: int) -> None:
        self.node, self.items, self.out, self.parent, self.key, self.depth = node, items, out, parent, key, depth
        self.changed = False


def _path_of(level: _Level | None, key: Any) -> tuple[Any, ...]:
    parts = [key]
    while level is not None and level.parent is not None:
        parts.append(level.key)
        level = level.parent
    return tuple(reversed(parts))


def _rebuilt_tuple(node: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    if hasattr(node, "_fields"):  # namedtuple
        return type(node)(*items)
    return type(node)(items) if type(node) is not tuple else tuple(items)


def _items(node: Any) -> Any:
    # Values are replaced in place while a dict is iterated; its size never changes.
    return iter(node.items()) if isinstance(node, dict) else enumerate(node)


def flatten(obj: Any, where: str = "checkpoint") -> tuple[Any, list[tuple[tuple[Any, ...], torch.Tensor]]]:
    """Split ``obj`` into a skeleton and its tensors.

    Args:
        obj: The checkpoint tree.
        where: The file, for error messages.

    Returns:
        ``(skeleton, tensors)`` where ``tensors[i] = (path, tensor)`` and the skeleton holds
        ``TensorRef(i)`` where the tensor was. Containers are copied, tensors are not.

    Raises:
        UnsupportedObjectError: A container holds itself, the tree is deeper than
            :data:`MAX_TREE_DEPTH` or holds more than :data:`MAX_TREE_NODES` items, a lazy
            module's parameter has not been initialized, or tensor bytes would be pickled with
            the skeleton (a tensor subclass, a storage, a set holding a tensor: named by path).
    """
    tensors: list[tuple[tuple[Any, ...], torch.Tensor]] = []
    seen: dict[tuple[Any, ...], int] = {}
    open_containers: set[int] = set()
    count = 0

    def leaf(node: Any, level: _Level | None, key: Any) -> Any:
        if isinstance(node, torch.Tensor):
            path = _path_of(level, key) if level is not None else ()
            if isinstance(node, torch.nn.parameter.UninitializedTensorMixin):
                raise UnsupportedObjectError(
                    f"{where}: tensor {_path_text(path)} is a lazy module's parameter that is not initialized "
                    "yet; run one forward pass (or initialize_parameters) before saving"
                )
            if type(node) is not torch.Tensor and not isinstance(node, torch.nn.Parameter):
                # Tensor subclasses (DTensor, FakeTensor ...) carry state we cannot rebuild, and
                # pickling them would put tensor bytes in the object tree.
                raise UnsupportedObjectError(
                    f"{where}: tensor {_path_text(path)[:200]} is a {type(node).__name__[:60]} (a tensor subclass); only plain "
                    "tensors and nn.Parameters are stored: convert it (t.as_subclass(torch.Tensor); a DTensor: t.full_tensor())"
                )
            # Sparse, nested and meta tensors have no storage to compare; the writer refuses them.
            # Empty tensors hold no bytes to share, and every empty storage has data_ptr 0.
            plain = node.device.type != "meta" and node.layout == torch.strided and not node.is_nested and node.numel() > 0
            ident = _tensor_identity(node) if plain else None
            if ident is not None and ident in seen:
                return TensorRef(seen[ident])
            index = len(tensors)
            tensors.append((path, node))
            if ident is not None:
                seen[ident] = index
            return TensorRef(index)
        if _holds_state(node):
            what = "model" if isinstance(node, torch.nn.Module) else "optimizer"
            raise UnsupportedObjectError(
                f"{where}: {_path_text(_path_of(level, key) if level is not None else ())[:200]} is a "
                f"{type(node).__name__[:60]} object, not its state: save {what}.state_dict() instead "
                f"({{'{what}': {what}.state_dict()}}) and load it back with {what}.load_state_dict(...)"
            )
        if isinstance(node, _STORAGES):
            raise UnsupportedObjectError(
                f"{where}: {_path_text(_path_of(level, key) if level is not None else ())[:200]} is a tensor storage; only "
                "tensors are stored (outside the pickled object tree): save a tensor viewing it instead"
            )
        if isinstance(node, (set, frozenset)) and any(isinstance(item, torch.Tensor) for item in node):
            raise UnsupportedObjectError(
                f"{where}: {_path_text(_path_of(level, key) if level is not None else ())[:200]} holds a tensor inside a "
                f"{type(node).__name__}; tensors are stored outside the pickled object tree, found in dicts, lists and "
                "tuples only: store them in a list"
            )
        return node

    def open_level(node: Any, parent: _Level | None, key: Any, depth: int) -> _Level:
        if id(node) in open_containers:
            path = _path_of(parent, key) if parent is not None else ()
            raise UnsupportedObjectError(
                f"{where}: the checkpoint tree contains itself at {_path_text(path)}; remove the cycle before saving"
            )
        if depth > MAX_TREE_DEPTH:
            raise UnsupportedObjectError(
                f"{where}: the checkpoint tree nests containers more than {MAX_TREE_DEPTH} deep (at "
                f"{_path_text(_path_of(parent, key))[:200]}); flatten it before saving"
            )
        open_containers.add(id(node))
        if isinstance(node, dict):
            out: Any = node.copy() if type(node) is dict else copy.copy(node)
        elif isinstance(node, list):
            out = copy.copy(node) if type(node) is not list else list(node)
        else:
            out = list(node)
        return _Level(node, _items(node), out, parent, key, depth)

    if not isinstance(obj, _CONTAINERS):
        return leaf(obj, None, None), tensors
    stack = [open_level(obj, None, None, 1)]
    result: Any = None
    while stack:
        level = stack[-1]
        for key, value in level.items:
            count += 1
            if count > MAX_TREE_NODES:
                raise UnsupportedObjectError(
                    f"{where}: the checkpoint tree holds more than {MAX_TREE_NODES} items; "
                    "store large collections of numbers as tensors"
                )
            if isinstance(value, _CONTAINERS):
                stack.append(open_level(value, level, key, level.depth + 1))
                break
            level.out[key] = leaf(value, level, key)
        else:
            stack.pop()
            open_containers.discard(id(level.node))
            done = _rebuilt_tuple(level.node, level.out) if isinstance(level.node, tuple) else level.out
            if stack:
                stack[-1].out[level.key] = done
            else:
                result = done
    return result, tensors


def _holds_state(node: Any) -> bool:
    """A model or optimizer object whose tensors would go into the pickled tree (a loss module without any is fine)."""
    if isinstance(node, torch.optim.Optimizer):
        return True
    if isinstance(node, torch.nn.Module):
        return next(iter(node.parameters()), None) is not None or next(iter(node.buffers()), None) is not None
    return False


def _path_text(path: tuple[Any, ...]) -> str:
    return repr("/".join(str(p) for p in path)) if path else "its root"


def _walk_skeleton(
    skeleton: Any, where: str, tensor_count: int | None, on_ref: Callable[[int, _Level | None, Any], Any], rebuild: bool
) -> Any:
    """Visit every :class:`TensorRef` of a skeleton once, without recursion; returns the new root.

    ``on_ref(index, level, key)`` gives the value that replaces the reference when ``rebuild``
    (dicts and lists are changed in place, tuples rebuilt). A non-empty container reached twice
    (shared, or a cycle: the writer copies every container, so only a forged file has one), a
    tree deeper than :data:`MAX_TREE_DEPTH`, more than :data:`MAX_TREE_NODES` items, and a
    reference that is not ``TensorRef(i)`` with ``0 <= i < tensor_count`` are refused, so the
    work is linear in the size of the tree whatever its shape.

    Raises:
        FormatError: The tree breaks one of these rules.
    """
    limit = tensor_count if tensor_count is not None else float("inf")

    def bad_ref(index: Any, level: _Level | None, key: Any) -> FormatError:
        path = _path_of(level, key) if level is not None else ()
        held = f"; the index holds {tensor_count}" if tensor_count is not None else ""
        return FormatError(
            f"{where}: the checkpoint's object tree refers to tensor {_short(index)} at {_path_text(path)[:200]}"
            f"{held}; the file is corrupt or forged"
        )

    if isinstance(skeleton, TensorRef):
        index = getattr(skeleton, "index", None)
        if type(index) is not int or not 0 <= index < limit:
            raise bad_ref(index, None, None)
        return on_ref(index, None, None)
    if not isinstance(skeleton, _CONTAINERS) or not skeleton:
        return skeleton
    seen = {id(skeleton)}
    count = 0
    stack = [_Level(skeleton, _items(skeleton), None, None, None, 1)]
    result: Any = skeleton
    # The loop is the hot path of every load: locals, exact type checks first.
    while stack:
        level = stack[-1]
        node = level.node
        in_place = rebuild and not isinstance(node, tuple)
        for key, value in level.items:
            count += 1
            kind = type(value)
            if kind is TensorRef:
                index = getattr(value, "index", None)
                if type(index) is not int or not 0 <= index < limit:
                    raise bad_ref(index, level, key)
                new = on_ref(index, level, key)
                if in_place:
                    node[key] = new
                elif rebuild:
                    _put(level, key, new)
            elif (kind is dict or kind is list or kind is tuple or isinstance(value, _CONTAINERS)) and value:
                if id(value) in seen:
                    raise FormatError(
                        f"{where}: the checkpoint's object tree reaches one {kind.__name__} twice (at "
                        f"{_path_text(_path_of(level, key))[:200]}); a writer copies every container, so the file is "
                        "corrupt or forged"
                    )
                if level.depth >= MAX_TREE_DEPTH:
                    raise FormatError(
                        f"{where}: the checkpoint's object tree nests containers more than {MAX_TREE_DEPTH} deep; "
                        "the file is corrupt or forged"
                    )
                seen.add(id(value))
                stack.append(_Level(value, _items(value), None, level, key, level.depth + 1))
                break
        else:
            if count > MAX_TREE_NODES:
                raise FormatError(
                    f"{where}: the checkpoint's object tree holds more than {MAX_TREE_NODES} items; the file is corrupt or forged"
                )
            stack.pop()
            done = node
            if rebuild and level.changed and isinstance(done, tuple):
                done = _rebuilt_tuple(done, level.out)
            if not stack:
                result = done
            elif rebuild and done is not node:
                _put(stack[-1], level.key, done)
            continue
        if count > MAX_TREE_NODES:
            raise FormatError(
                f"{where}: the checkpoint's object tree holds more than {MAX_TREE_NODES} items; the file is corrupt or forged"
            )
    return result


def _put(level: _Level, key: Any, value: Any) -> None:
    if isinstance(level.node, tuple):
        if level.out is None:
            level.out = list(level.node)
        level.out[key] = value
        level.changed = True
    else:
        level.node[key] = value


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a forged object's repr may raise anything
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def tensor_paths(skeleton: Any, where: str = "checkpoint", tensor_count: int | None = None) -> list[tuple[tuple[Any, ...], int]]:
    """``(path, tensor index)`` of every :class:`TensorRef` in a skeleton, in tree order.

    A tensor reached by several paths (tied weights) is listed once per path.

    Raises:
        FormatError: The tree breaks a rule of :func:`_walk_skeleton`, or its paths add up to
            more than :data:`MAX_TREE_NODES` components.
    """
    found: list[tuple[tuple[Any, ...], int]] = []
    budget = [MAX_TREE_NODES]

    def collect(index: int, level: _Level | None, key: Any) -> None:
        path = _path_of(level, key) if level is not None else ()
        budget[0] -= len(path) + 1
        if budget[0] < 0:
            raise FormatError(
                f"{where}: the checkpoint's object tree names its tensors by paths too long to list; the file is corrupt or forged"
            )
        found.append((path, index))

    _walk_skeleton(skeleton, where, tensor_count, collect, rebuild=False)
    return found


def check_skeleton(skeleton: Any, tensor_count: int, where: str) -> None:
    """Raise :class:`FormatError` unless ``load`` would accept the tree (see :func:`_walk_skeleton`)."""
    _walk_skeleton(skeleton, where, tensor_count, lambda *_: None, rebuild=False)


def unflatten(skeleton: Any, resolve: Callable[[int], Any], *, where: str = "checkpoint", tensor_count: int | None = None) -> Any:
    """Inverse of :func:`flatten`: ``TensorRef(i)`` replaced by ``resolve(i)``.

    Raises:
        FormatError: The tree breaks a rule of :func:`_walk_skeleton`.
    """
    return _walk_skeleton(skeleton, where, tensor_count, lambda index, *_: resolve(index), rebuild=True)


class _TreePickler(pickle.Pickler):
    """torch.save's pickler for object trees: a tensor anywhere in the tree is refused.

    :func:`flatten` takes the tensors of dicts, lists and tuples out of the tree; one inside any
    other object (a class instance ...) would be pickled with its bytes. torch.save subclasses this
    class and looks storages up first, so a bare storage is caught by :func:`~.torchsave.storage_records`.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            raise _TensorInTree(f"a tensor ({type(obj).__module__}.{type(obj).__name__})"[:120])
        return NotImplemented


class _TensorInTree(Exception):
    """Raised from inside torch.save; :func:`encode_skeleton` turns it into UnsupportedObjectError."""


class _TreePickleModule:
    """The ``pickle_module`` of torch.save for object trees (only ``Pickler`` is used)."""

    Pickler = _TreePickler
    __name__ = "pickle"


def encode_skeleton(skeleton: Any, where: str = "checkpoint") -> bytes:
    """Serialize a skeleton with ``torch.save``'s default pickle protocol.

    The default protocol matters: ``torch.load(weights_only=True)`` rejects protocol 4 streams.

    Raises:
        UnsupportedObjectError: The skeleton holds a tensor or a storage (inside an object that
            :func:`flatten` does not walk): tensor bytes never go through pickle.
    """
    buf = io.BytesIO()
    fix = (
        "tensors are stored outside the pickled object tree, found in dicts, lists and tuples only: "
        "move it into one, or out of the object"
    )
    try:
        torch.save(skeleton, buf, pickle_module=_TreePickleModule)
    except _TensorInTree as exc:
        raise UnsupportedObjectError(f"{where}: the checkpoint tree holds {exc} inside an object; {fix}") from None
    except RecursionError as exc:
        # flatten() bounds the depth of dicts, lists and tuples; other objects can nest too.
        raise UnsupportedObjectError(
            f"{where}: the checkpoint tree nests objects too deep for torch.save's pickler here; flatten it before saving"
        ) from exc
    data = buf.getvalue()
    if storage_records(zipfile.ZipFile(io.BytesIO(data)).namelist()):
        raise UnsupportedObjectError(f"{where}: the checkpoint tree holds a tensor storage inside an object; {fix}")
    return data


def decode_skeleton(data: bytes, *, weights_only: bool, where: str) -> Any:
    """Deserialize a skeleton; with ``weights_only`` nothing but safe types is constructed.

    With ``weights_only`` the pickle is first scanned (:func:`~.picklescan.scan_pickle`) for
    what the weights-only unpickler would build but the interpreter cannot survive, and for state
    set on a module-level object (an enum member). In both modes
    a tree holding tensor data (a storage record; with ``weights_only`` also a call that builds a
    tensor or storage) is refused before torch builds anything.

    Raises:
        UnsafeCheckpointError: the skeleton holds objects that ``weights_only`` refuses.
        FormatError: the bytes are not a skeleton, or hold tensor data (the place is named).
    """
    corrupt = f"{where}: the checkpoint's object tree is corrupt"
    if not data.startswith(_ZIP_MAGIC):
        # torch.save's zip archive is what every writer of this format stores; anything else
        # (a legacy torch pickle, random bytes) is damage, not an object the rules refuse.
        raise FormatError(f"{corrupt}: it is not a torch.save archive (it starts with {bytes(data[:8])!r})")
    pkl, _, stored = archive_pickle(io.BytesIO(data), len(data), corrupt)
    records = list(stored)
    # Tensor bytes never go through pickle: a writer stores every tensor in the tensor table, so
    # tensor data in the tree (a storage record, or a call that builds a tensor) is forged. Found
    # before torch builds anything: a stride-0 view of 2**40 elements is 4 bytes of storage here,
    # and 4 TiB once a caller copies or re-saves it.
    found: str | None = None
    if weights_only:
        found = scan_pickle(pkl, corrupt, TREE_POLICY)
    if found is None and records:
        found = f"its archive holds {len(records)} tensor storage record(s)"
    if found is not None:
        at = _tensor_data_path(pkl, corrupt)
        raise FormatError(
            f"{where}: the checkpoint's object tree holds tensor data at {at[:200] if at else 'an unknown place'} ({found[:120]}); "
            "a writer stores every tensor outside the tree, so the file is corrupt or forged"
        )
    try:
        if weights_only:
            # Added for good, never removed: the ``safe_globals`` context manager edits one
            # process-wide set, so its exit in one thread broke loads running in others.
            torch.serialization.add_safe_globals([TensorRef])
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except pickle.UnpicklingError as exc:
        # torch's own text, not ours: torch raises a plain UnpicklingError both for an object a weights-only
        # load refuses and for a damaged pickle ("Unsupported operand"), with no types to tell them apart.
        if weights_only and "Weights only load failed" in str(exc) and "Unsupported operand" not in str(exc):
            detail = weights_only_detail(exc)
            raise UnsafeCheckpointError(
                f"{where}: the checkpoint holds Python objects that a weights-only load refuses "
                f"({detail}). If you trust this file, load it with weights_only=False, or allow "
                "the type with torch.serialization.add_safe_globals([...])."
            ) from exc
        raise FormatError(f"{corrupt}: {weights_only_detail(exc)}") from exc
    except (RuntimeError, EOFError, ValueError, KeyError, AttributeError, TypeError, IndexError, MemoryError) as exc:
        raise FormatError(f"{corrupt}: {type(exc).__name__}: {str(exc)[:300]}") from exc


_ZIP_MAGIC = b"PK\x03\x04"


class _Stub:
    """What :func:`_tensor_data_path` builds for a global: nothing of the file's runs or is allocated.

    ``tensor_data``: the global builds a tensor or storage (:func:`_builds_tensor`); an object made
    by a call, or given a state, holding such a thing carries it too, so the place found is the
    outermost dict, list or tuple item that holds the tensor data.
    """

    tensor_data = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Stub":
        self = object.__new__(cls)
        self.carries = cls.tensor_data or any(_carries(a) for a in args)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        values = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else (state,)
        self.carries = self.carries or any(_carries(v) for v in values)


def _carries(value: Any) -> bool:
    """Whether a value of the locating unpickler is, or directly holds, tensor data."""
    if isinstance(value, _Stub):
        return value.carries
    if isinstance(value, type):
        return issubclass(value, _Stub) and value.tensor_data
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(isinstance(v, _Stub) and v.carries for v in value)
    return False


class _LocatingUnpickler(pickle.Unpickler):
    """Unpickles an object tree with every global but plain containers replaced by a :class:`_Stub`."""

    _REAL = {"collections.OrderedDict": dict, "builtins.set": set, "builtins.frozenset": frozenset}

    def find_class(self, module: str, name: str) -> Any:
        real = self._REAL.get(f"{module}.{name}")
        if real is not None:
            return real
        return type("_Stub", (_Stub,), {"tensor_data": builds_tensor(f"{module}.{name}")})

    def persistent_load(self, pid: Any) -> Any:
        stub = _Stub()
        stub.carries = True
        return stub


def _tensor_data_path(pkl: bytes, corrupt: str) -> str | None:
    """Where in the tree (a quoted path, or "its root") the pickle of a refused object tree puts tensor data.

    Only for a pickle the scan accepts but for its tensor data (so nesting and sizes are
    bounded): it is unpickled with :class:`_LocatingUnpickler` (no global of the file is called)
    and walked once. None when that cannot be done.
    """
    try:
        scan_pickle(pkl, corrupt, TREE_POLICY)
        root = _LocatingUnpickler(io.BytesIO(pkl)).load()
    except Exception:  # noqa: BLE001 - locating is a courtesy of the error message; the file is refused anyway
        return None
    stack: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if isinstance(node, _CONTAINERS):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict) and any(_carries(k) for k in node):
                return _path_text(path)
            items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            stack.extend((value, (*path, key)) for key, value in reversed(items))
        elif _carries(node):
            return _path_text(path)
    return None


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
