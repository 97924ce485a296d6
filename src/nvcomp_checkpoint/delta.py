"""Incremental checkpoints: a checkpoint stored as its difference from an earlier one (its base).

The writer XORs each tensor (of the components in :data:`XOR_COMPONENTS`) with the same tensor
of the base, also subtracts it (:data:`SUB_COMPONENTS`), and keeps, byte plane by byte plane,
whichever of the plain, XORed and subtracted plane stores smallest; the reader follows the chain of
bases back to a full checkpoint. The format is in ``docs/format.md`` ("Delta files").
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

import numpy as np
import torch
import xxhash

from .codecs import cpu_codec, gpu_available, has_cpu_decoder
from .credentials import StorageOptions
from .errors import BaseCheckpointError, CheckpointError, UnsafePathError, UnsupportedObjectError
from .filters.sub import SUB_WIDTHS, sub_bytes, undo_planes_, undo_planes_np_
from .filters.xor import xor_bytes, xor_planes_, xor_planes_np_
from .format.chain import MAX_CHAIN_DEPTH, SUB, XOR, BaseRef, TensorDelta
from .format.layout import TensorEntry
from .planechoice import smallest_form
from .safepaths import inside_path
from .storage import is_url

__all__ = [
    "BaseChain",
    "BaseSource",
    "ChainPolicy",
    "chain_policy_of",
    "base_path_of",
    "chain_of",
    "relative_base_path",
    "resolve_base_path",
    "retained",
    "pick_frames",
    "encode_cpu_chunk_against",
    "tries_sub",
    "undo_chunk_",
    "undo_chunk_np_",
    "MAX_CHAIN_DEPTH",
]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: Opens a checkpoint for reading (``CheckpointReader``; passed in so imports run one way).
OpenReader = Callable[..., Any]

#: Components whose tensors are tried against the base. Optimizer first moments and gradients
#: are new every step: against a base 40 steps earlier XOR won no byte on them (dense 1.218x and
#: 1.641x either way, MoE 1.192x and 1.836x; benchmarks/bench_incremental.py), and trying cost
#: a second compression and a decode of the base. Weights went from 1.48x to 1.69x (MoE) and
#: 3.31x (dense), second moments from 1.23x to 1.28-1.32x.
XOR_COMPONENTS = frozenset({"weights", "exp_avg_sq", "other"})
#: Components (of :data:`XOR_COMPONENTS`) whose planes may also be stored as planes of the
#: wrapping difference with the base (frame op "sub"): a third compression of each plane.
SUB_COMPONENTS = frozenset({"weights", "exp_avg_sq"})


# -- where the base lies -------------------------------------------------------------------


def _split_url(path: str) -> tuple[str, str]:
    scheme, rest = path.split("://", 1)
    host, _, tail = rest.partition("/")
    return f"{scheme}://{host}", "/" + tail


def relative_base_path(delta_path: str, base_path: str) -> str:
    """How a delta at ``delta_path`` records ``base_path``: relative to its directory when possible.

    A relative path keeps a chain valid when its directory is moved or copied as a whole.
    """
    delta_path, base_path = os.fspath(delta_path), os.fspath(base_path)
    if is_url(delta_path) or is_url(base_path):
        if not (is_url(delta_path) and is_url(base_path)):
            return base_path
        (droot, dpath), (broot, bpath) = _split_url(delta_path), _split_url(base_path)
        if droot != broot:
            return base_path
        return posixpath.relpath(bpath, posixpath.dirname(dpath))
    delta_dir = os.path.dirname(os.path.abspath(delta_path.removeprefix("file://")))
    base_abs = os.path.abspath(base_path.removeprefix("file://"))
    try:
        rel = os.path.relpath(base_abs, delta_dir)
    except ValueError:  # another drive (Windows)
        return base_abs
    return rel.replace(os.sep, "/")


def resolve_base_path(delta_path: str, stored: str) -> str:
    """The path of the base that a delta at ``delta_path`` records as ``stored``: next to the delta, on its store.

    The record is read from the file: it must be a relative path (``..`` allowed, a chain across
    sibling folders: ``../checkpoint-3/model.nvc``), never an absolute path or a URL, so that a file
    cannot make the reader open another host or store with the caller's credentials.

    Raises:
        UnsafePathError: ``stored`` is absolute, a URL, or not a path (checked by :func:`inside_path`).
    """
    delta_path = os.fspath(delta_path)
    inside_path(stored, where=delta_path, what="records its base at", up=True)
    if is_url(delta_path):
        root, dpath = _split_url(delta_path)
        return root + posixpath.normpath(posixpath.join(posixpath.dirname(dpath), stored))
    local = delta_path.removeprefix("file://")
    return os.path.normpath(os.path.join(os.path.dirname(local), *stored.split("/")))


def _file_key(path: str) -> str:
    """One spelling per file of a chain, to notice a file met twice."""
    return path if is_url(path) else os.path.abspath(path.removeprefix("file://"))


def _brief(exc: BaseException, limit: int = 240) -> str:
    """An error's text on one line, at most ``limit`` characters: a wrapped error never makes a long message."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _ChainBroken(BaseCheckpointError):
    """A delta tensor cannot be rebuilt because a file further down its chain failed.

    ``cause`` is the first failure's message (which names the file where the chain broke): each
    file above says it once more instead of wrapping the message of the file below, so the error
    stays short however deep the chain.
    """

    def __init__(self, where: str, key: str, cause: str) -> None:
        super().__init__(f"{where}: tensor {key!r} cannot be rebuilt from its chain of bases: {cause}")
        self.cause = cause


def chain_too_deep(where: str, depth: int) -> BaseCheckpointError:
    """The error for a chain of bases deeper than :data:`MAX_CHAIN_DEPTH` (``depth``: that of ``where``)."""
    return BaseCheckpointError(
        f"{where}: its chain of bases is {depth} deep, over the limit of {MAX_CHAIN_DEPTH}; no writer of this version "
        "builds one (an older version could: load it there and save it in full, or `nvckpt rebase` it there)"
    )


def chain_loops(where: str, again: str) -> BaseCheckpointError:
    """The error for a chain of bases that reaches ``again`` a second time."""
    return BaseCheckpointError(
        f"{where}: its chain of bases loops back to {again} (a file met twice); its base records are corrupt or forged"
    )


# -- bytes of a tensor ------------------------------------------------------------------------


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's element bytes as a contiguous 1-D uint8 tensor on its device."""
    t = t.detach().resolve_conj().resolve_neg()
    flat = t.reshape(-1)
    if not flat.is_contiguous() or (flat.numel() == 1 and flat.stride(0) != 1):
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def bytes_xxh3(flat: torch.Tensor) -> int:
    """XXH3-64 of a 1-D uint8 tensor's bytes (a GPU tensor is copied to the host first)."""
    host = flat if flat.device.type == "cpu" else flat.cpu()
    return xxhash.xxh3_64_intdigest(host.numpy().data) if host.numel() else xxhash.xxh3_64_intdigest(b"")


# -- choosing frames ----------------------------------------------------------------------------

#: One frame as the writer hands it on: stored bytes, raw size, XXH3-64 of the stored bytes, op.
Encoded = tuple[Any, int, int, str]

#: One candidate form of a chunk's frames: (op, pieces, the codec's frame of each piece).
Form = tuple[str, Sequence[Any], Sequence[Any]]


def tries_sub(item: Any) -> bool:
    """Whether the writer also tries the difference with the base for ``item`` (a planned tensor
    with a base): its component is in :data:`SUB_COMPONENTS` and its width is one "sub" is defined for."""
    return item.component.value in SUB_COMPONENTS and item.width in SUB_WIDTHS


def pick_frames(forms: Sequence[Form], size: Callable[[Any], int]) -> list[tuple[Any, str]]:
    """For each frame, the smallest of every form's piece and its codec frame.

    ``forms`` is in order of preference (plain first, then XOR, then the difference): ties keep
    the earlier form (plain needs no base; XOR is the cheaper to undo), and a codec frame that
    does not shrink its piece is the piece itself (the format's raw rule). The same rule on the
    CPU and the GPU.
    """
    out = []
    for i in range(len(forms[0][1])):
        best: tuple[Any, str] | None = None
        for op, pieces, coded in forms:
            candidate = coded[i] if size(coded[i]) < size(pieces[i]) else pieces[i]
            if best is None or size(candidate) < size(best[0]):
                best = (candidate, op)
        assert best is not None
        out.append(best)
    return out


#: On the CPU, a plane larger than twice this is chosen from a compressed sample of each form
#: (its first ``PICK_SAMPLE_BYTES``), and only the chosen form is compressed whole; 0: every form
#: whole. Compressing three forms whole made a delta save 1.67-3.19x a full save (dense and MoE,
#: three runs); sampled 1.16-1.82x, with the same ratio to 3 decimals (benchmarks/README.md).
PICK_SAMPLE_BYTES = 128 << 10


def encode_cpu_chunk_against(data: np.ndarray, base: np.ndarray, item: Any) -> list[Encoded]:
    """Frames of one chunk of a tensor that has a base, each plain, XORed or subtracted (``item``: a planned tensor)."""
    filt = item.plane_filter()
    codec = cpu_codec(item.spec.codec, item.spec.level, item.spec.adaptive)
    transformed = [("", data), (XOR, xor_bytes(data, base))]
    if tries_sub(item):
        transformed.append((SUB, sub_bytes(data, base, item.width)))
    split = [(op, filt.split(values)) for op, values in transformed]
    sample = PICK_SAMPLE_BYTES
    out: list[Encoded] = []
    for i, plain in enumerate(split[0][1]):
        candidates = [(op, pieces[i]) for op, pieces in split]
        if sample and len(plain) > 2 * sample:
            # Ties keep the earlier form, as pick_frames does.
            candidates = [candidates[smallest_form(codec, [[piece[:sample]] for _, piece in candidates])]]
        ((frame, op),) = pick_frames([(op, [piece], [codec.encode(piece.data)]) for op, piece in candidates], len)
        out.append((frame, len(plain), xxhash.xxh3_64_intdigest(frame), op))
    return out


def undo_chunk_np_(dest: np.ndarray, base: np.ndarray, width: int, ops: Sequence[str]) -> None:
    """Undo one chunk's transforms in place (numpy): ``dest`` its joined planes, ``ops`` its frames' ops."""
    if SUB in ops:
        undo_planes_np_(dest, base, width, ops)
    elif any(ops):
        xor_planes_np_(dest, base, width, [op == XOR for op in ops])


def undo_chunk_(dest: torch.Tensor, base: torch.Tensor, width: int, ops: Sequence[str]) -> None:
    """:func:`undo_chunk_np_` in torch, on any device (the GPU reader's path)."""
    if SUB in ops:
        undo_planes_(dest, base, width, ops)
    elif any(ops):
        xor_planes_(dest, base, width, [op == XOR for op in ops])


def undo_delta_(flat: torch.Tensor, base: torch.Tensor, entry: TensorEntry) -> None:
    """Turn the decoded bytes of a delta tensor (1-D uint8) into its values, in place."""
    for start, length, frames in entry.chunks():
        undo_chunk_(flat[start : start + length], base[start : start + length], entry.width, [f.op for f in frames])


# -- reading: the chain --------------------------------------------------------------------------


class BaseChain:
    """The base of one delta file, opened when first needed and checked to be that base.

    Args:
        ref: The base record of the delta's index.
        delta_path: The delta file (its base path is relative to its directory).
        open_reader: Opens a checkpoint (``CheckpointReader``).
        storage_options: Passed on to the base's reader.
    """

    def __init__(
        self, ref: BaseRef, delta_path: str, open_reader: OpenReader, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.ref = ref
        self.delta_path = delta_path
        #: Why the base record cannot be followed (raised when the base is first needed: the delta's
        #: own index and its plain tensors still read); ``path`` is then the record as written.
        self.unsafe: UnsafePathError | None = None
        try:
            self.path = resolve_base_path(delta_path, ref.path)
        except UnsafePathError as exc:
            self.path, self.unsafe = ref.path, exc
        self._open_reader = open_reader
        self._storage_options = StorageOptions.of(storage_options)
        self._reader: Any = None
        self._lock = threading.Lock()

    def _what(self) -> str:
        return f"{self.delta_path}: its base checkpoint {self.path}"

    def reader(self) -> Any:
        """The base's reader, after checking that the file at the base's path is that base.

        Raises:
            BaseCheckpointError: The base is missing, another file, or unreadable.
        """
        with self._lock:
            if self._reader is None:
                self._reader = self._open()
            return self._reader

    def _open(self) -> Any:
        if self.unsafe is not None:
            raise self.unsafe
        if self.ref.depth > MAX_CHAIN_DEPTH:
            raise chain_too_deep(self.delta_path, self.ref.depth)
        if _file_key(self.path) == _file_key(self.delta_path):
            raise chain_loops(self.delta_path, self.path)
        fix = "restore it, or load the delta where its base is (a delta and its chain move together)"
        try:
            reader = self._open_reader(self.path, storage_options=self._storage_options)
        except (CheckpointError, OSError) as exc:
            raise BaseCheckpointError(f"{self._what()} cannot be opened ({_brief(exc)}); {fix}") from exc
        base_depth = reader.index.base.depth if reader.index.base is not None else 0
        if reader.file_bytes != self.ref.size or reader.index_xxh3 != self.ref.index_xxh3 or base_depth != self.ref.depth - 1:
            reader.close()
            raise BaseCheckpointError(
                f"{self._what()} is not the checkpoint the delta was written against (the delta records "
                f"{self.ref.size} bytes, index digest {self.ref.index_xxh3:016x}, depth {self.ref.depth - 1}; the file has "
                f"{reader.file_bytes} bytes, digest {reader.index_xxh3:016x}, depth {base_depth}); put the original base back"
            )
        return reader

    def base_bytes(self, delta: TensorDelta, device: torch.device, key: str, nbytes: int) -> torch.Tensor:
        """The base tensor's element bytes on ``device``, checked against the digest the writer recorded.

        ``nbytes`` is the delta tensor's size: a base tensor of another size is refused before it is
        decoded (a forged delta cannot make the reader decode more than the delta's own tensors).
        """
        reader = self.reader()
        try:
            size = reader.entry(delta.key).nbytes
        except KeyError as exc:
            raise BaseCheckpointError(f"{self._what()} holds no tensor {delta.key!r}, which tensor {key!r} needs") from exc
        if size != nbytes:
            raise BaseCheckpointError(
                f"{self._what()}: tensor {delta.key!r} has {size} bytes, tensor {key!r} of the delta {nbytes}"
            )
        try:
            t = reader.read(delta.key, map_location=device)
        except BaseCheckpointError as exc:
            raise _ChainBroken(self.delta_path, key, exc.cause if isinstance(exc, _ChainBroken) else _brief(exc, 320)) from exc
        except CheckpointError as exc:
            raise BaseCheckpointError(
                f"{self._what()}: tensor {delta.key!r} (needed by {key!r}) cannot be read: {_brief(exc)}"
            ) from exc
        flat = flat_bytes(t)
        if bytes_xxh3(flat) != delta.xxh3:
            raise BaseCheckpointError(
                f"{self._what()}: tensor {delta.key!r} holds other values than the delta's tensor {key!r} was "
                "written against (was the delta saved with a base_state that was not the base file's state?)"
            )
        return flat

    def undo(self, entry: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        """The tensor ``entry`` stands for, from its decoded bytes ``t`` (modified in place)."""
        assert entry.delta is not None
        flat = t.detach().reshape(-1).view(torch.uint8)
        base = self.base_bytes(entry.delta, flat.device, entry.key, entry.nbytes)
        if base.numel() != flat.numel():
            raise BaseCheckpointError(
                f"{self._what()}: tensor {entry.delta.key!r} has {base.numel()} bytes, tensor {entry.key!r} of the delta {flat.numel()}"
            )
        undo_delta_(flat, base, entry)
        return t

    def chunk_undoer(self, entry: TensorEntry) -> Callable[[int, Sequence[Any], np.ndarray], None]:
        """For the CPU decoder: ``undo(chunk start, frames, decoded chunk)`` undoes one chunk's XOR and difference.

        The base tensor is read (following the chain) now, before the chunks are decoded.
        """
        assert entry.delta is not None
        base = self.base_bytes(entry.delta, torch.device("cpu"), entry.key, entry.nbytes)
        if base.numel() != entry.nbytes:
            raise BaseCheckpointError(
                f"{self._what()}: tensor {entry.delta.key!r} has {base.numel()} bytes, tensor {entry.key!r} of the delta {entry.nbytes}"
            )
        host = base.numpy()

        def undo(start: int, frames: Sequence[Any], dest: np.ndarray) -> None:
            undo_chunk_np_(dest, host[start : start + dest.size], entry.width, [f.op for f in frames])

        return undo

    def close(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None


# -- writing: where base values come from -----------------------------------------------------


class BaseSource:
    """The base a delta is written against: its identity, and each matching tensor's values.

    Values are read back from the base file tensor by tensor (bounded memory), or taken from
    ``base_state``, a copy of the base's state the caller kept (no decoding; the reader checks
    it was the base's state, by a digest of each tensor the delta uses).
    """

    def __init__(
        self,
        reader: Any,
        ref: BaseRef,
        base_state: Mapping[str, torch.Tensor] | None = None,
        components: frozenset[str] | None = None,
    ) -> None:
        self.reader = reader
        self.ref = ref
        self.base_state = base_state
        self.components = XOR_COMPONENTS if components is None else components
        self._entries = {t.key: t for t in reader.index.tensors}

    @classmethod
    def open(
        cls,
        base: str | os.PathLike[str],
        delta_path: str,
        open_reader: OpenReader,
        *,
        base_state: Any = None,
        storage_options: dict[str, Any] | None = None,
    ) -> "BaseSource":
        """Open the base of a delta about to be written at ``delta_path``."""
        base_path = os.fspath(base)
        stored = relative_base_path(delta_path, base_path)
        try:
            inside_path(stored, where=delta_path, what="would record its base at", up=True)
        except UnsafePathError as exc:
            # A reader follows only a base next to the delta, on its store: no file is written that none could load.
            raise BaseCheckpointError(
                f"{delta_path}: its base {base_path} is on another store than the delta (another bucket, host or "
                "drive), which a delta cannot name: save the base where the delta goes, or save in full (no base=)"
            ) from exc
        if resolve_base_path(delta_path, stored) == resolve_base_path(delta_path, relative_base_path(delta_path, delta_path)) or (
            not is_url(base_path) and os.path.abspath(base_path) == os.path.abspath(delta_path)
        ):
            raise UnsupportedObjectError(f"{delta_path}: a delta cannot replace its own base; save it under another path")
        try:
            reader = open_reader(base_path, storage_options=storage_options)
        except CheckpointError as exc:
            raise BaseCheckpointError(f"{delta_path}: the base checkpoint {base_path} cannot be opened: {_brief(exc)}") from exc
        depth = (reader.index.base.depth if reader.index.base is not None else 0) + 1
        try:
            if depth > MAX_CHAIN_DEPTH:
                # A clear error rather than a full save behind the caller's back: base= asked for a
                # delta. ChainPolicy (CheckpointManager, the integrations) saves in full instead.
                raise BaseCheckpointError(
                    f"{delta_path}: its base {base_path} is {depth - 1} deep in its chain; a delta of it would be {depth} "
                    f"deep, over the limit of {MAX_CHAIN_DEPTH}: save it without base= (a full checkpoint), or make the "
                    "base a full checkpoint first (`nvckpt rebase`)"
                )
            _refuse_overwriting_the_chain(base_path, reader, delta_path, open_reader, storage_options)
        except BaseException:
            reader.close()
            raise
        ref = BaseRef(stored, reader.file_bytes, reader.index_xxh3, depth)
        state = _keyed_tensors(base_state, delta_path) if base_state is not None else None
        return cls(reader, ref, state)

    def match(self, key: str, t: torch.Tensor, component: str) -> str | None:
        """The base key of the tensor stored under ``key`` in the delta, if the base has one like it
        and tensors of ``component`` are tried against the base (:data:`XOR_COMPONENTS`)."""
        if component not in self.components:
            return None
        entry = self._entries.get(key)
        if entry is None or entry.dtype != t.dtype or entry.shape != tuple(t.shape) or entry.nbytes == 0:
            return None
        if not (has_cpu_decoder(entry.codec.id) or gpu_available()):
            return None  # a base tensor in an nvCOMP-only codec cannot be read here: store plain
        return key

    def values(self, key: str, device: torch.device) -> tuple[torch.Tensor, int]:
        """The base tensor ``key``'s bytes (1-D uint8 on ``device``) and their XXH3-64."""
        kept = self.base_state.get(key) if self.base_state is not None else None
        entry = self._entries[key]
        if kept is not None and kept.dtype == entry.dtype and tuple(kept.shape) == entry.shape:
            flat = flat_bytes(kept)
            digest = bytes_xxh3(flat)
            return (flat if flat.device == device else flat.to(device)), digest
        flat = flat_bytes(self.reader.read(key, map_location=device))
        return flat, bytes_xxh3(flat)

    def close(self) -> None:
        self.reader.close()


def _same_file(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        return a == b
    return os.path.abspath(a.removeprefix("file://")) == os.path.abspath(b.removeprefix("file://"))


def _refuse_overwriting_the_chain(
    base_path: str, reader: Any, delta_path: str, open_reader: OpenReader, storage_options: dict[str, Any] | None
) -> None:
    """A save over a file of its own base's chain would leave a delta whose chain is gone.

    The chain is walked by its base records (no identity checks: a broken link ends the walk), each
    file once and at most :data:`MAX_CHAIN_DEPTH` files deep, so forged records that loop end it too.

    Raises:
        UnsupportedObjectError: ``delta_path`` is a file of the chain.
        BaseCheckpointError: The chain loops back on itself or is deeper than the limit.
    """
    current, ref = base_path, reader.index.base
    seen = {_file_key(base_path)}
    while ref is not None:
        try:
            current = resolve_base_path(current, ref.path)
        except UnsafePathError:
            return  # a forged record further back is the base's own problem, reported when it is read
        if _file_key(current) in seen:
            raise chain_loops(f"{delta_path}: the base {base_path}", current)
        seen.add(_file_key(current))
        if len(seen) > MAX_CHAIN_DEPTH + 1:
            raise chain_too_deep(f"{delta_path}: the base {base_path}", len(seen) - 1)
        if _same_file(current, delta_path):
            raise UnsupportedObjectError(
                f"{delta_path}: is in the chain of the base {base_path} (a base of it); writing there would "
                "leave the delta without its chain: save under another path"
            )
        try:
            with open_reader(current, storage_options=storage_options) as older:
                ref = older.index.base
        except CheckpointError:
            return  # a broken chain further back is the base's own problem, reported when it is read


def _keyed_tensors(state: Any, where: str) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` of a tree, keyed as the writer keys the tensors it stores."""
    from .format.skeleton import flatten
    from .policy import key_string
    from .tensors import unique_key  # the writer's own naming of paths that print alike

    _, tensors = flatten(state, where=where)
    used: set[str] = set()
    return {unique_key(key_string(path), used): t for path, t in tensors}


# -- chains on disk -----------------------------------------------------------------------------


def base_path_of(path: str, open_reader: OpenReader, storage_options: dict[str, Any] | None = None) -> str | None:
    """The resolved base path of the checkpoint at ``path``, or None for a full checkpoint."""
    with open_reader(path, storage_options=storage_options) as reader:
        ref = reader.index.base
    return None if ref is None else resolve_base_path(path, ref.path)


def chain_of(
    path: str, open_reader: OpenReader, storage_options: dict[str, Any] | None = None
) -> list[tuple[str, BaseRef | None]]:
    """``[(path, its base record)]`` from ``path`` back to the full checkpoint at the chain's root.

    Each base is checked to be the file its delta was written against.

    Raises:
        BaseCheckpointError: A base is missing or another file, or the chain loops or is deeper
            than :data:`MAX_CHAIN_DEPTH`.
    """
    out: list[tuple[str, BaseRef | None]] = []
    seen: set[str] = set()
    current = path
    while True:
        seen.add(_file_key(current))
        reader = open_reader(current, storage_options=storage_options)
        with reader:
            ref = reader.index.base
        out.append((current, ref))
        if ref is None:
            return out
        chain = BaseChain(ref, current, open_reader, storage_options)
        if _file_key(chain.path) in seen:
            raise chain_loops(path, chain.path)
        chain.reader()  # checks identity, and the depth against the limit
        chain.close()
        current = chain.path


# -- a chain policy --------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainPolicy:
    """When a save is a full checkpoint and which checkpoint a delta is written against.

    Args:
        full_every: A full checkpoint every ``full_every`` saves (1: every save is full).
        base: ``"previous"``: a delta's base is the save before it (a chain of up to
            ``full_every - 1`` deltas; smallest files, a load decodes the whole chain), or
            ``"full"``: the last full checkpoint (a load decodes two files).

    A ``CheckpointManager`` asks :meth:`base_for` before each save and :func:`retained` before
    deleting old checkpoints.

    With ``base="previous"`` a chain never grows past :data:`MAX_CHAIN_DEPTH` deltas: a larger
    ``full_every`` logs a warning once and a full checkpoint is written every
    ``MAX_CHAIN_DEPTH + 1`` saves instead (a training run is never stopped by a save that
    ``save(base=...)`` would refuse).
    """

    full_every: int = 10
    base: str = "previous"

    def __post_init__(self) -> None:
        if not isinstance(self.full_every, int) or isinstance(self.full_every, bool) or self.full_every < 1:
            raise ValueError(f"full_every must be an int >= 1, got {self.full_every!r}")
        if self.base not in ("previous", "full"):
            raise ValueError(f"base must be 'previous' or 'full', got {self.base!r}")
        if self.base == "previous" and self.full_every > MAX_CHAIN_DEPTH + 1:
            _LOG.warning(
                "ChainPolicy(full_every=%d, base='previous') would chain %d deltas, over the limit of %d: a full "
                "checkpoint is written every %d saves instead (or use base='full')",
                self.full_every,
                self.full_every - 1,
                MAX_CHAIN_DEPTH,
                MAX_CHAIN_DEPTH + 1,
            )

    @property
    def _period(self) -> int:
        """Saves from one full checkpoint to the next."""
        return min(self.full_every, MAX_CHAIN_DEPTH + 1) if self.base == "previous" else self.full_every

    def base_for(self, saved: Sequence[str]) -> str | None:
        """The base of the next save, given every save so far in order (None: save in full).

        Saves are counted from the first one; save ``n`` is full when ``n % full_every == 0``
        (``full_every`` at most ``MAX_CHAIN_DEPTH + 1`` with ``base="previous"``).
        """
        n = len(saved)
        period = self._period
        if n % period == 0:
            return None
        if self.base == "previous":
            return saved[-1]
        return saved[n - n % period]


def chain_policy_of(
    incremental: bool | ChainPolicy, full_every: int | None, delta_base: str | None, where: str
) -> ChainPolicy | None:
    """The one conversion of every ``incremental=`` argument (the manager, every integration): ``None`` without it.

    Args:
        incremental: ``False``, ``True`` (with ``full_every`` and ``delta_base``) or a :class:`ChainPolicy`.
        full_every: With ``incremental=True``: a full save every ``full_every`` saves (``None``: 10).
        delta_base: With ``incremental=True``: ``"previous"`` or ``"full"`` (``None``: ``"previous"``).
        where: The constructor, named by errors (``"NvcompCheckpointIO"``).

    Raises:
        TypeError: ``incremental`` is neither a bool nor a :class:`ChainPolicy`.
        ValueError: A :class:`ChainPolicy` together with ``full_every`` or ``delta_base`` (two answers
            to one question), or an invalid ``full_every`` / ``delta_base``.
    """
    if isinstance(incremental, ChainPolicy):
        given = [name for name, value in (("full_every", full_every), ("delta_base", delta_base)) if value is not None]
        if given:
            keywords = ", ".join(f"{name}=..." for name in given)
            raise ValueError(
                f"{where}(incremental=ChainPolicy(...), {keywords}): both say how the chain runs; give them in the "
                f"ChainPolicy only: incremental=ChainPolicy(full_every={incremental.full_every}, base={incremental.base!r})"
            )
        return incremental
    if not isinstance(incremental, bool):
        raise TypeError(
            f"{where}(incremental=...) takes True, False or a ChainPolicy(full_every=..., base=...), "
            f"got {type(incremental).__name__}"
        )
    if not incremental:
        return None
    try:
        return ChainPolicy(10 if full_every is None else full_every, "previous" if delta_base is None else delta_base)
    except ValueError as exc:
        name = "delta_base" if delta_base is not None and delta_base not in ("previous", "full") else "full_every"
        raise ValueError(f"{where}(incremental=True, {name}=...): {exc}") from None


_Unit = TypeVar("_Unit", bound=Hashable)


def retained(keep: Iterable[_Unit], base_of: Callable[[_Unit], _Unit | None]) -> list[_Unit]:
    """``keep`` and every base a kept checkpoint needs, transitively (a chain goes as a whole).

    Args:
        keep: The checkpoints a retention rule keeps (paths, or the steps of a tier's units).
        base_of: The base of a checkpoint, or None (e.g. ``lambda p: base_path_of(p, nc.open)``).

    Returns:
        The checkpoints not to delete, in the order first met.
    """
    out: list[_Unit] = []
    seen: set[_Unit] = set()
    for path in keep:
        current: _Unit | None = path
        while current is not None and current not in seen:
            seen.add(current)
            out.append(current)
            current = base_of(current)
    return out
