"""Builds forged checkpoint files whose checksums are all valid, so that the reader's rules are tested.

Pickles are written opcode by opcode (protocol 2, the opcodes torch's weights-only unpickler
reads), wrapped in a torch.save archive, and spliced into a valid file as its object tree with
the format's own index and footer helpers.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import zipfile

import torch
import xxhash

from nvcomp_checkpoint.format.layout import FOOTER, GUARD, MAGIC, Frame, Index, pack_footer, unpack_footer
from nvcomp_checkpoint.format.skeleton import TensorRef

__all__ = [
    "pickle2",
    "archive",
    "with_object_tree",
    "int_op",
    "ref",
    "ref_with",
    "global_op",
    "str_op",
    "put",
    "get",
    "laughs",
    "deep_list",
    "deep_tuple_key",
    "codec_chain",
    "device_copy_of_a_view",
    "torch_saved",
    "with_base_path",
    "plain_view",
    "FORGED_TREES",
]

PROTO2 = b"\x80\x02"
STOP = b"."
EMPTY_LIST, EMPTY_DICT, EMPTY_TUPLE, MARK = b"]", b"}", b")", b"("
APPEND, APPENDS, SETITEM, SETITEMS = b"a", b"e", b"s", b"u"
TUPLE, TUPLE1, TUPLE2, REDUCE, NONE, NEWTRUE = b"t", b"\x85", b"\x86", b"R", b"N", b"\x88"


def pickle2(body: bytes) -> bytes:
    """A whole protocol-2 pickle around ``body`` (the opcodes that leave one value on the stack)."""
    return PROTO2 + body + STOP


def int_op(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    return b"J" + struct.pack("<i", n)


def str_op(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def global_op(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def ref_with(args: bytes) -> bytes:
    """``TensorRef(*args)``; ``args`` are the opcodes of one tuple."""
    return global_op(TensorRef.__module__, "TensorRef") + args + REDUCE


def ref(index: int) -> bytes:
    return ref_with(int_op(index) + TUPLE1)


def laughs(fan: int = 10, depth: int = 9) -> bytes:
    """A list holding one list ``fan`` times, ``depth`` levels down, ``TensorRef(0)`` at the bottom."""
    body = EMPTY_LIST + ref(0) + APPEND + put(0)
    for level in range(1, depth + 1):
        body += EMPTY_LIST + MARK + get(level - 1) * fan + APPENDS + put(level)
    return pickle2(body)


def deep_list(depth: int = 200_000) -> bytes:
    """``[[[ ... [TensorRef(0)] ... ]]]``, ``depth`` lists deep."""
    return pickle2(EMPTY_LIST * depth + ref(0) + APPEND * depth)


def deep_tuple_key(depth: int = 200_000) -> bytes:
    """``{((( ... ((),) ... ),): 1}``: hashing that key recurses ``depth`` levels in C."""
    return pickle2(EMPTY_DICT + EMPTY_TUPLE + TUPLE1 * depth + int_op(1) + SETITEM)


def codec_chain(levels: int = 40) -> bytes:
    """``encode(encode(... encode("ab", "latin1") ..., "hex"), "hex")``: each level doubles the bytes (2**40 here)."""
    ops = global_op("_codecs", "encode") + str_op("ab") + str_op("latin1") + TUPLE2 + REDUCE
    for _ in range(levels):
        ops = global_op("_codecs", "encode") + ops + str_op("hex") + TUPLE2 + REDUCE
    return pickle2(ops)


def device_copy_of_a_view() -> bytes:
    """``_rebuild_device_tensor_from_cpu_tensor(<stride-0 view of 2**30 elements>, float64, "cpu", False)``.

    With the storage record torch.save writes, torch.load(weights_only=True) of this materializes
    8 GiB; the reader refuses the global before the storage is needed.
    """
    view = (
        global_op("torch._utils", "_rebuild_tensor_v2")
        + MARK
        + MARK
        + str_op("storage")
        + global_op("torch", "FloatStorage")
        + str_op("0")
        + str_op("cpu")
        + int_op(1)
        + TUPLE
        + b"Q"
        + int_op(0)
        + b"J"
        + struct.pack("<i", 1 << 30)
        + TUPLE1
        + int_op(0)
        + TUPLE1
        + b"\x89"
        + global_op("collections", "OrderedDict")
        + EMPTY_TUPLE
        + REDUCE
        + TUPLE
        + REDUCE
    )
    return pickle2(
        global_op("torch._utils", "_rebuild_device_tensor_from_cpu_tensor")
        + MARK
        + view
        + global_op("torch", "float64")
        + str_op("cpu")
        + b"\x89"
        + TUPLE
        + REDUCE
    )


def torch_saved(tree: object) -> bytes:
    """``tree`` written by ``torch.save`` itself (its tensors and storages as torch records)."""
    buf = io.BytesIO()
    torch.save(tree, buf)
    return buf.getvalue()


def tensor_constructor(name: str = "FloatTensor", size: int = 1 << 30) -> bytes:
    """``{"w": TensorRef(0), "big": torch.<name>(size)}``: a tensor class the weights-only rules
    allow, called with a size (an uninitialized allocation; no storage record)."""
    return pickle2(
        EMPTY_DICT
        + MARK
        + str_op("w")
        + ref(0)
        + str_op("big")
        + global_op("torch", name)
        + b"J"
        + struct.pack("<i", size)
        + TUPLE1
        + REDUCE
        + SETITEMS
    )


def plain_view(
    size: tuple[int, ...],
    stride: tuple[int, ...],
    *,
    offset: int = 0,
    numel: int = 1,
    record_elements: int = 1,
    wrap: tuple[str, str, bytes] | None = None,
) -> bytes:
    """A torch.save archive of ``{"w": <a float32 view>}``, made with torch's own records.

    The view is ``_rebuild_tensor_v2`` of storage "0" (declared ``numel`` elements; its record holds
    ``record_elements``) at ``offset`` with ``size`` and ``stride``. ``wrap``: ``(module, name, args)``
    calls that global on the view and then ``args`` (pickled opcodes) instead, as
    ``_rebuild_device_tensor_from_cpu_tensor`` would be.
    """

    def ints(values: tuple[int, ...]) -> bytes:
        return MARK + b"".join(b"\x8a\x08" + struct.pack("<q", v) for v in values) + TUPLE

    view = (
        global_op("torch._utils", "_rebuild_tensor_v2")
        + MARK
        + MARK
        + str_op("storage")
        + global_op("torch", "FloatStorage")
        + str_op("0")
        + str_op("cpu")
        + b"\x8a\x08"
        + struct.pack("<q", numel)
        + TUPLE
        + b"Q"
        + b"\x8a\x08"
        + struct.pack("<q", offset)
        + ints(size)
        + ints(stride)
        + b"\x89"
        + global_op("collections", "OrderedDict")
        + EMPTY_TUPLE
        + REDUCE
        + TUPLE
        + REDUCE
    )
    if wrap is not None:
        view = global_op(wrap[0], wrap[1]) + MARK + view + wrap[2] + TUPLE + REDUCE
    pkl = pickle2(EMPTY_DICT + str_op("w") + view + SETITEM)
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(record_elements)}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def archive(pkl: bytes) -> bytes:
    """A torch.save archive (torch's own records) whose ``data.pkl`` is ``pkl``."""
    buf = io.BytesIO()
    torch.save(None, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def with_object_tree(valid: bytes, tree: bytes) -> bytes:
    """``valid`` (a file written by ``nc.save``) with its object tree frame replaced by ``tree``, stored raw.

    Every tensor frame moves with the new tree's size; the index and footer are written again
    with the format's own helpers, so every checksum of the result holds.
    """
    offset, size, _ = unpack_footer(valid[-FOOTER.size :], len(valid), "valid")
    index = Index.from_json_bytes(valid[offset : offset + size], offset, "valid")
    old = index.skeleton
    # The writer puts the object tree first, after the guard and the magic.
    assert old.offset == len(GUARD) + len(MAGIC) and valid[: old.offset] == GUARD + MAGIC
    frame = Frame(old.offset, len(tree), len(tree), xxhash.xxh3_64_intdigest(tree))
    delta = len(tree) - old.size
    tensors = tuple(
        dataclasses.replace(t, frames=tuple(dataclasses.replace(f, offset=f.offset + delta) for f in t.frames))
        for t in index.tensors
    )
    body = valid[: old.offset] + tree + valid[old.offset + old.size : offset]
    new_index = Index(frame, tensors, index.metadata).to_json_bytes()
    return body + new_index + pack_footer(len(body), len(new_index), xxhash.xxh3_64_intdigest(new_index))


# Object trees that load refuses, by name: (the skeleton bytes, the error class name, words of its message).
# Each goes with a file holding one tensor, TensorRef(0).
FORGED_TREES: dict[str, tuple[bytes, str, str]] = {
    "shared_subtrees": (archive(laughs()), "FormatError", "reaches one list twice"),
    "deep_list": (archive(deep_list()), "FormatError", "nests containers more than"),
    "deep_tuple_key": (archive(deep_tuple_key()), "FormatError", "nests containers more than"),
    "list_holds_itself": (
        archive(pickle2(EMPTY_LIST + put(0) + get(0) + APPEND + ref(0) + APPEND)),
        "FormatError",
        "reaches one list twice",
    ),
    "ref_of_list": (archive(pickle2(ref_with(EMPTY_LIST + TUPLE1))), "FormatError", "refers to tensor []"),
    "ref_of_str": (archive(pickle2(ref_with(str_op("0") + TUPLE1))), "FormatError", "refers to tensor '0'"),
    "ref_of_bool": (archive(pickle2(ref_with(NEWTRUE + TUPLE1))), "FormatError", "refers to tensor True"),
    "ref_of_none": (
        archive(pickle2(EMPTY_DICT + str_op("w") + ref_with(NONE + TUPLE1) + SETITEM)),
        "FormatError",
        "refers to tensor None at 'w'",
    ),
    "ref_negative": (archive(pickle2(ref(-1))), "FormatError", "refers to tensor -1"),
    "ref_past_the_index": (
        archive(pickle2(EMPTY_LIST + ref(0) + APPEND + EMPTY_LIST + ref(7) + APPEND + APPEND)),
        "FormatError",
        "refers to tensor 7 at '1/0'; the index holds 1",
    ),
    "bytearray_of_a_size": (
        archive(pickle2(global_op("builtins", "bytearray") + int_op(1 << 30) + TUPLE1 + REDUCE)),
        "FormatError",
        "bytearray from a size",
    ),
    "codec_chain": (archive(codec_chain()), "FormatError", "encodes something other than a string literal"),
    "device_copy_of_a_view": (archive(device_copy_of_a_view()), "FormatError", "_rebuild_device_tensor_from_cpu_tensor"),
    "not_a_pickle": (b"this object tree is no pickle at all " * 4, "FormatError", "not a torch.save archive"),
    "archive_of_garbage": (archive(b"\x80\x02\xff\xfe\xfd."), "FormatError", "no pickle opcode"),
    "legacy_torch_pickle": (pickle2(int_op(1)), "FormatError", "not a torch.save archive"),
    # Tensor data in the object tree: a writer stores every tensor in the tensor table. A stride-0
    # view of 2**40 elements saved by torch.save itself is 4 bytes of storage; loaded, it is a
    # tree a re-save turns into 4 TiB.
    "stride0_view": (
        torch_saved({"w": TensorRef(0), "opt": [{"big": torch.zeros(1).expand(1 << 40)}]}),
        "FormatError",
        "tensor data at 'opt/0/big'",
    ),
    "storage_in_tree": (
        torch_saved({"w": TensorRef(0), "s": torch.zeros(4).untyped_storage()}),
        "FormatError",
        "tensor data at 's'",
    ),
    "tensor_in_a_set": (
        torch_saved({"w": TensorRef(0), "s": {torch.zeros(1).expand(1 << 30)}}),
        "FormatError",
        "tensor data at 's'",
    ),
    "tensor_class_called_with_a_size": (
        archive(tensor_constructor()),
        "FormatError",
        "tensor data at 'big' (its pickle calls torch.FloatTensor)",
    ),
    "parameter_of_a_view": (
        torch_saved({"w": TensorRef(0), "p": torch.nn.Parameter(torch.zeros(1).expand(1 << 30))}),
        "FormatError",
        "tensor data at 'p'",
    ),
    "code_execution": (
        archive(pickle2(global_op("os", "system") + str_op("true") + TUPLE1 + REDUCE)),
        "UnsafeCheckpointError",
        "os.system",
    ),
}


def with_base_path(valid: bytes, path: str) -> bytes:
    """``valid`` (a delta written by ``nc.save(..., base=...)``) with its base record's path replaced by ``path``.

    The base's size, digest and depth stay; the index and footer are written again with the format's
    own helpers, so every checksum of the result holds.
    """
    offset, size, _ = unpack_footer(valid[-FOOTER.size :], len(valid), "valid")
    index = Index.from_json_bytes(valid[offset : offset + size], offset, "valid")
    assert index.base is not None, "not a delta"
    new_index = dataclasses.replace(index, base=dataclasses.replace(index.base, path=path)).to_json_bytes()
    return valid[:offset] + new_index + pack_footer(offset, len(new_index), xxhash.xxh3_64_intdigest(new_index))
