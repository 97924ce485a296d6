"""The files of a compressed DCP checkpoint directory (specified in ``docs/dcp.md``).

One nvcomp-checkpoint file per rank and save (``__<rank>_<save id>.nvcdcp``), and ``.metadata``:
a pickle that stops a stock ``FileSystemReader`` with the reader to use, then our own record.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import ChecksumError, FormatError
from ..safepaths import inside_path

__all__ = [
    "METADATA_NAME",
    "SHARD_SUFFIX",
    "RECORD_MAGIC",
    "StoredItem",
    "holds_stored_items",
    "shard_name",
    "rank_metadata_name",
    "WORLD_SIZE_TAG",
    "SAVE_TAG",
    "encode_metadata",
    "decode_metadata",
    "is_compressed_metadata",
    "refuse_stock_reader",
    "safe_unpickle",
    "check_file_name",
    "check_byte_item",
]

#: DCP's commit point, as ``FileSystemWriter`` names it.
METADATA_NAME = ".metadata"
SHARD_SUFFIX = ".nvcdcp"
#: Starts our record after the refusal pickle: name, record version 1, reserved zero byte.
RECORD_MAGIC = b"NVCDCP\x01\x00"
#: magic, payload size (u64), xxh3-64 of the payload (u64); little-endian.
_RECORD_HEAD = struct.Struct("<8sQQ")
#: A DCP metadata pickle larger than this is refused before it is read (a forged size field).
MAX_METADATA_BYTES = 1 << 30


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP write item lives: the rank file (a plain file name inside the checkpoint
    directory) and its tensor key in that file. A ``storage_data`` value of DCP's ``Metadata``;
    pickled by its class path ``nvcomp_checkpoint.dcp.layout.StoredItem``, which is part of the format.

    ``index_xxh3`` is the rank file's identity: its footer's digest of its index (as
    ``CheckpointReader.index_xxh3`` reads it). A reader refuses a file under that name with another
    index (a rank file of another checkpoint). ``None`` in checkpoints written before it was
    recorded (their pickles lack the field; the class default stands in).
    """

    file: str
    key: str
    index_xxh3: int | None = None


def holds_stored_items(metadata: Any) -> bool:
    """True when a DCP ``Metadata``'s records are :class:`StoredItem` (written by ``NvcompWriter``),
    False for a plain (``FileSystemWriter``) one."""
    return any(isinstance(v, StoredItem) for v in (metadata.storage_data or {}).values())


#: In ``storage_meta.modules`` of a per-rank metadata file (a save without collectives): the
#: number of ranks that saved, so a reader can tell a whole checkpoint from one missing ranks.
WORLD_SIZE_TAG = "nvcomp_checkpoint.dcp.world_size="
#: With it, the caller's ``NvcompWriter(save_tag=...)``: the same on every rank of one save, so a
#: directory mixing the parts of two saves (a retry into it) is refused.
SAVE_TAG = "nvcomp_checkpoint.dcp.save_tag="


def rank_metadata_name(rank: int) -> str:
    """One rank's metadata in a save without collectives (``dcp.save(..., use_collectives=False)``),
    as DCP's ``FileSystemWriter`` names it."""
    return f"__{rank}{METADATA_NAME}"


def shard_name(rank: int, save_id: str) -> str:
    """The rank file of one save: unique per save, so a save into a directory that holds a
    checkpoint never touches that checkpoint's files before the new metadata commits."""
    return f"__{rank}_{save_id}{SHARD_SUFFIX}"


def refuse_stock_reader(message: str) -> None:
    """Called by a stock ``pickle.load`` of our ``.metadata``: stops a plain DCP reader with the
    reader to use, instead of a confusing failure deep in a rank file."""
    from ..errors import FormatError as _FormatError

    raise _FormatError(message)


class _Refusal:
    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (refuse_stock_reader, (self.message,))


_REFUSAL_TEXT = (
    "this directory is a DCP checkpoint compressed by nvcomp-checkpoint; its rank files are not "
    "torch.save data. Load it with torch.distributed.checkpoint.load(state_dict, "
    "storage_reader=nvcomp_checkpoint.dcp.NvcompReader(path))"
)
#: Every ``.metadata`` we write starts with this pickle (protocol 2: the same bytes on every Python).
REFUSAL_PICKLE = pickle.dumps(_Refusal(_REFUSAL_TEXT), protocol=2)
#: How that pickle starts whatever its message says: PROTO 2, then GLOBAL of the refusal.
REFUSAL_HEAD = b"\x80\x02cnvcomp_checkpoint.dcp.layout\nrefuse_stock_reader\n"
assert REFUSAL_PICKLE.startswith(REFUSAL_HEAD)


def encode_metadata(metadata: Any) -> bytes:
    """``.metadata``: the refusal pickle, then magic, size, xxh3 and the pickled DCP ``Metadata``."""
    payload = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return REFUSAL_PICKLE + _RECORD_HEAD.pack(RECORD_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def is_compressed_metadata(head: bytes) -> bool:
    """Whether the first bytes of a ``.metadata`` file are ours."""
    return head.startswith(REFUSAL_HEAD)


def _record_start(data: bytes, where: str) -> int:
    """The offset just past the refusal pickle's STOP, found without running the pickle."""
    try:
        for op, _, pos in pickletools.genops(io.BytesIO(data[:4096])):
            if op.name == "STOP" and pos is not None:  # a BytesIO always tells its position
                return pos + 1
    except Exception as exc:  # noqa: BLE001 - damaged bytes raise ValueError and others
        raise FormatError(f"{where}: the metadata's leading record is damaged ({exc})") from exc
    raise FormatError(f"{where}: the metadata's leading record is damaged (no end)")


def decode_metadata(data: bytes, where: str) -> Any:
    """The DCP ``Metadata`` of our ``.metadata`` bytes, checked and unpickled with the allow-list.

    Raises:
        FormatError: truncated, a newer record version, or a type outside the allow-list.
        ChecksumError: the payload does not match its digest.
    """
    start = _record_start(data, where)
    head = data[start : start + _RECORD_HEAD.size]
    if len(head) != _RECORD_HEAD.size:
        raise FormatError(f"{where}: truncated ({len(data)} bytes); restore the checkpoint from another copy")
    magic, size, digest = _RECORD_HEAD.unpack(head)
    if magic[:6] != RECORD_MAGIC[:6]:
        raise FormatError(f"{where}: not an nvcomp-checkpoint DCP metadata record")
    if magic[6] != RECORD_MAGIC[6]:
        raise FormatError(f"{where}: DCP record version {magic[6]}; this nvcomp-checkpoint reads {RECORD_MAGIC[6]}. Upgrade it.")
    payload = data[start + _RECORD_HEAD.size :]
    if size > MAX_METADATA_BYTES or len(payload) != size:
        raise FormatError(f"{where}: the record claims {size} bytes of metadata, the file holds {len(payload)} (truncated?)")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise ChecksumError(f"{where}: the checkpoint metadata is corrupt (checksum mismatch); restore it from another copy")
    return safe_unpickle(payload, where)


#: Every global a DCP ``Metadata`` pickle may name, as exact ``(module, qualname)`` pairs (no dotted
#: names: protocol 4 resolves ``module`` + ``"os.system"`` through the module's attributes): DCP's
#: metadata dataclasses and enum (also where torch 2.0-2.1 kept TensorProperties), the storage records
#: of both writers, ``torch.Size``, layouts, and paths (``StorageMeta.checkpoint_id``). Torch dtypes
#: are allowed by value (a ``torch`` attribute that is a ``torch.dtype``). Found by listing the globals
#: of real metadata (tensors, DTensor and ShardedTensor shards, byte items, tied weights, both
#: writers, with and without collectives); pinned by tests/test_dcp_forgery.py.
_ALLOWED_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("nvcomp_checkpoint.dcp.layout", "StoredItem"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch._utils", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
#: Containers nest no deeper in DCP metadata (Metadata > dict > TensorStorageMetadata > list > chunk > Size).
MAX_METADATA_NESTING = 32
#: What the calls of a metadata pickle may copy (elements passed to constructors and ``BUILD``
#: states, see :func:`_check_metadata_pickle`), beyond one element per byte of the pickle.
_COPY_SLACK = 1 << 16
#: A text (protocol 0) argument longer than this is refused; a decimal integer longer than
#: Python's own limit for ``int(str)``.
_MAX_TEXT_ARG = 1 << 20
_MAX_DIGITS = 4300


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise FormatError(
            f"{self.where}: the checkpoint metadata holds a {module[:100]}.{name[:100]}, which is not a DCP metadata type; "
            "nvcomp_checkpoint.dcp.NvcompReader does not build it. If you trust the checkpoint, load it with "
            "torch.distributed.checkpoint.FileSystemReader"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(f"{self.where}: the checkpoint metadata holds a persistent id, which DCP metadata never does")


def safe_unpickle(data: bytes, where: str) -> Any:
    """Unpickle DCP metadata with the allow-list: no code from the file runs, and what it builds is
    bounded by its size (:func:`_check_metadata_pickle` runs first).

    Raises:
        FormatError: a global outside the allow-list, a pickle that would build more than its
            size allows, or bytes that are not a pickle.
    """
    _check_metadata_pickle(data, where)
    try:
        return _MetadataUnpickler(data, where).load()
    except FormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises many types
        raise FormatError(f"{where}: the checkpoint metadata does not unpickle ({type(exc).__name__}: {str(exc)[:200]})") from exc


_OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
#: Per opcode byte, its argument: 0 none, n > 0 that many bytes, -1 a line (two for GLOBAL and INST),
#: -2..-5 a length of 1, 4 (signed), 4, 8 bytes then that many bytes; None for a byte that is no opcode.
_ARG: list[int | None] = [None] * 256
for _code, _op in _OPS.items():
    _ARG[_code] = 0 if _op.arg is None else _op.arg.n
_LENGTH_WIDTH = {-2: 1, -3: 4, -4: 4, -5: 8}
# Opcodes by what they do to the stack (see _check_metadata_pickle).
_SCALARS = frozenset(b"IJKML\x8a\x8bN\x88\x89FGc")
_STRINGS = frozenset(b"STUBC\x8e\x96V\x8cX\x8d")
_REFUSED = {
    0x50: "a persistent id",
    0x51: "a persistent id",
    0x82: "an extension code",
    0x83: "an extension code",
    0x84: "an extension code",
    0x97: "an out-of-band buffer",
    0x98: "an out-of-band buffer",
}


def _check_metadata_pickle(data: bytes, where: str) -> None:
    """Refuse, before anything is built, a pickle that would take memory or time out of proportion
    to its size.

    One pass over the opcodes that simulates the unpickler's stack, each value with its size (items
    of a container, characters of a string) and nesting depth. Refused: a length or frame that
    runs past the end (the C unpickler allocates the stated length before reading); a memo index
    beyond the next free one (it sizes its memo to twice the index, zeroed); containers nested more
    than :data:`MAX_METADATA_NESTING` deep; decimal integers of more digits than ``int()`` parses;
    persistent ids, extension codes and out-of-band buffers (DCP writes none); and calls that copy
    more than the pickle's size allows: each call (``REDUCE``, ``NEWOBJ``, ``INST``, ``OBJ``) and
    each ``BUILD`` is charged the size of its arguments or state and of their items, which a
    writer's pickle spells out once each (a memoized list handed to ``torch.Size`` again and again
    is not). What is left, the allow-list unpickler refuses by itself.

    Raises:
        FormatError: The pickle is refused or is not a pickle.
    """
    # A leaf (scalar, string) is its size, an int; a container is [size, depth, items], items being
    # a tuple's (a call's arguments), else None. One branch per opcode, the most frequent first:
    # this runs over every byte of the metadata.
    stack: list[Any] = []
    push = stack.append
    pop = stack.pop
    marks: list[int] = []
    memo: list[Any] = []
    budget = len(data) + _COPY_SLACK
    limit = MAX_METADATA_NESTING
    pos, end = 0, len(data)
    unpack_from = struct.unpack_from

    def refuse(why: str) -> FormatError:
        return FormatError(f"{where}: the checkpoint metadata is refused: {why} (byte {pos}); DCP never writes this")

    def cost(v: Any) -> int:
        if type(v) is int:
            return v
        c = v[0]
        if v[2]:
            for item in v[2]:
                c += item if type(item) is int else item[0]
        return c

    def container(items: Any, tuple_items: bool) -> list[Any]:
        depth = 0
        for item in items:
            if type(item) is not int and item[1] > depth:
                depth = item[1]
        if depth >= limit:
            raise refuse(f"containers nested more than {limit} deep")
        return [len(items), depth + 1, tuple(items) if tuple_items else None]

    def grow(items: list[Any], count: int) -> None:
        target = stack[-1]
        if type(target) is int or target[2] is not None:
            raise refuse("items added to something that is not a list, dict or set")
        target[0] += count
        for item in items:
            if type(item) is not int and item[1] >= target[1]:
                if item[1] >= limit:
                    raise refuse(f"containers nested more than {limit} deep")
                target[1] = item[1] + 1

    def to_mark() -> list[Any]:
        mark = marks.pop()
        items = stack[mark:]
        del stack[mark:]
        return items

    try:
        while pos < end:
            code = data[pos]
            pos += 1
            if code == 0x94:  # MEMOIZE
                memo.append(stack[-1])
            elif code == 0x6A:  # LONG_BINGET
                push(memo[unpack_from("<I", data, pos)[0]])
                pos += 4
            elif code == 0x68:  # BINGET
                push(memo[data[pos]])
                pos += 1
            elif code == 0x4B:  # BININT1
                pos += 1
                push(1)
            elif code == 0x28:  # MARK
                marks.append(len(stack))
            elif code == 0x81 or code == 0x52:  # NEWOBJ, REDUCE: cls(*args), func(*args)
                args = pop()
                charged = cost(args)
                budget -= charged
                stack[-1] = [charged or 1, 0 if type(args) is int else args[1], None]
            elif code == 0x29:  # EMPTY_TUPLE
                push([0, 1, ()])
            elif code == 0x85:  # TUPLE1
                stack[-1] = container(stack[-1:], True)
            elif code == 0x62:  # BUILD: the state goes into the object
                state = pop()
                budget -= cost(state)
                target = stack[-1]
                if type(state) is not int and type(target) is not int and state[1] >= target[1]:
                    if state[1] >= limit:
                        raise refuse(f"containers nested more than {limit} deep")
                    target[1] = state[1] + 1
            elif code == 0x75:  # SETITEMS
                items = to_mark()
                grow(items, len(items) // 2)
            elif code == 0x7D or code == 0x5D or code == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
                push([0, 1, None])
            elif code == 0x86 or code == 0x87:  # TUPLE2, TUPLE3
                k = code - 0x84
                items = stack[-k:]
                if len(items) != k:
                    raise refuse("a tuple of missing items")
                del stack[-k:]
                push(container(items, True))
            elif code == 0x8C:  # SHORT_BINUNICODE
                n = data[pos]
                pos += 1 + n
                push(n)
            elif code == 0x72 or code == 0x71:  # LONG_BINPUT, BINPUT
                if code == 0x72:
                    index = unpack_from("<I", data, pos)[0]
                    pos += 4
                else:
                    index = data[pos]
                    pos += 1
                if index == len(memo):
                    memo.append(stack[-1])
                elif index < len(memo):
                    memo[index] = stack[-1]
                else:
                    raise refuse(f"a memo index of {index} after {len(memo)} memo entries")
            elif code == 0x4D:  # BININT2
                pos += 2
                push(1)
            elif code == 0x65 or code == 0x90:  # APPENDS, ADDITEMS
                items = to_mark()
                grow(items, len(items))
            elif code == 0x61:  # APPEND
                item = pop()
                grow([item], 1)
            elif code == 0x73:  # SETITEM
                value = pop()
                key = pop()
                grow([key, value], 1)
            elif code == 0x74:  # TUPLE
                push(container(to_mark(), True))
            elif code in (0x6C, 0x64, 0x91):  # LIST, DICT, FROZENSET
                push(container(to_mark(), False))
            elif code == 0x93:  # STACK_GLOBAL
                pop()
                stack[-1] = 1
            elif code == 0x92:  # NEWOBJ_EX: cls.__new__(cls, *args, **kwargs)
                kwargs = pop()
                args = pop()
                charged = cost(args) + cost(kwargs)
                budget -= charged
                stack[-1] = [charged or 1, 0, None]
            elif code == 0x69 or code == 0x6F:  # INST, OBJ: cls(*items)
                if code == 0x69:
                    pos = _skip_text(data, pos, end, 2, refuse)
                items = to_mark()
                charged = sum(cost(v) for v in items)
                budget -= charged
                push([charged or 1, 0, None])
            elif code == 0x30:  # POP
                pop()
            elif code == 0x31:  # POP_MARK
                to_mark()
            elif code == 0x32:  # DUP
                push(stack[-1])
            elif code == 0x95:  # FRAME: the C unpickler reads the whole frame first
                size = unpack_from("<Q", data, pos)[0]
                pos += 8
                if size > end - pos:
                    raise refuse(f"a frame of {size} bytes where {end - pos} are left")
            elif code == 0x80:  # PROTO
                pos += 1
            elif code == 0x2E:  # STOP
                return
            elif code in _REFUSED:
                raise refuse(_REFUSED[code])
            else:  # the rarer ones, by their argument
                width = _ARG[code]
                if width is None:
                    raise refuse(f"{code:#04x} is no pickle opcode")
                if width == -1:  # text (protocol 0)
                    start = pos
                    pos = _skip_text(data, pos, end, 2 if code == 0x63 else 1, refuse)
                    text = data[start : pos - 1]
                    if code in (0x49, 0x4C) and len(text) > _MAX_DIGITS:
                        raise refuse(f"an integer of {len(text)} digits")
                    if code == 0x70 or code == 0x67:  # PUT, GET
                        index = int(text)
                        if code == 0x67:
                            push(memo[index])
                        elif index == len(memo):
                            memo.append(stack[-1])
                        elif 0 <= index < len(memo):
                            memo[index] = stack[-1]
                        else:
                            raise refuse(f"a memo index of {index} after {len(memo)} memo entries")
                        continue
                    size = len(text)
                elif width < 0:  # a length, then that many bytes: the C unpickler allocates the length first
                    w = _LENGTH_WIDTH[width]
                    size = data[pos] if w == 1 else unpack_from("<i" if width == -3 else "<I" if w == 4 else "<Q", data, pos)[0]
                    pos += w
                    if size < 0 or size > end - pos:
                        raise refuse(f"a length of {size} bytes where {end - pos} are left")
                    pos += size
                else:
                    pos += width
                    size = 1
                if code in _STRINGS:
                    push(size)
                elif code in _SCALARS:
                    push(1)
                else:
                    raise refuse(_OPS[code].name)
            if budget < 0:
                raise refuse(f"its calls copy more than its {len(data)} bytes allow (memoized values handed on again and again)")
    except FormatError:
        raise
    except (IndexError, KeyError, ValueError, TypeError, struct.error) as exc:
        raise FormatError(
            f"{where}: the checkpoint metadata is not a pickle (malformed near byte {pos}: {type(exc).__name__})"
        ) from exc
    raise FormatError(f"{where}: the checkpoint metadata is not a pickle (it ends without STOP); restore it from another copy")


def _skip_text(data: bytes, pos: int, end: int, lines: int, refuse: Any) -> int:
    """The position after ``lines`` newline-ended text arguments starting at ``pos``."""
    for _ in range(lines):
        stop = data.find(b"\n", pos, min(end, pos + _MAX_TEXT_ARG))
        if stop < 0:
            raise refuse("a text argument without its end")
        pos = stop + 1
    return pos


def check_file_name(name: Any, where: str, fqn: str) -> str:
    """``name``, a rank file's name as the metadata records it, if it is a plain file name inside the
    checkpoint directory (:func:`~nvcomp_checkpoint.safepaths.inside_path`, one component).

    Raises:
        UnsafePathError: Anything else (``../other/x``, ``/abs``, ``a/b``): a forged or damaged record.
    """
    return inside_path(name, where=where, what=f"item {fqn[:200]!r} names the file", single=True)


def check_byte_item(data: bytes, where: str, fqn: str) -> None:
    """Refuse a DCP byte item (``torch.save`` of a non-tensor value, which DCP's planner unpickles
    with ``torch.load(weights_only=False)``) that the weights-only rules of object trees refuse.

    Raises:
        UnsafeCheckpointError: It would build objects outside the weights-only allow-list (code).
        FormatError: It is not a torch.save archive, or its pickle is refused by the scan that
            bounds what it builds (sizes, nesting).
    """
    from ..errors import UnsafeCheckpointError
    from ..format.skeleton import decode_skeleton, weights_only_detail

    try:
        decode_skeleton(data, weights_only=True, where=f"{where}: DCP item {fqn[:200]!r}")
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{where}: DCP item {fqn[:200]!r} holds Python objects that a weights-only load refuses "
            f"({weights_only_detail(exc.__cause__ or exc)}); DCP would unpickle it with torch.load(weights_only=False). "
            "If you trust this checkpoint, load it with NvcompReader(path, weights_only=False)"
        ) from exc


def join(directory: str, name: str) -> str:
    """``directory/name`` for local paths and URLs alike."""
    if "://" in directory:
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)
