"""DCP checkpoint directories in the CLI: ``inspect`` and ``verify`` of ours and of plain ones.

A directory is a DCP checkpoint when it holds a ``.metadata`` file, or ``__0.metadata`` (a save
without collectives: one metadata file per rank, all of which must be there); its rank files are then
described from that metadata (plain ``.distcp`` files hold no per-tensor index of their own).
"""

from __future__ import annotations

import io
import math
import os
import re
from typing import Any, Collection

import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.errors import CheckpointError, SizeLimitError
from nvcomp_checkpoint.filetype import DCP_DIR, LIGHTNING_SHARDED_DIR, directory_kind

from .sources import TensorInfo

# torch.distributed.checkpoint (and our dcp package on it) is imported in the functions that need
# it: every nvckpt command imports this module, and that import alone costs about 0.7 s.

__all__ = [
    "DCP_OURS",
    "DCP_PLAIN",
    "is_dcp_dir",
    "dcp_kind",
    "describe_dcp",
    "verify_plain_dcp",
    "verify_ours_dcp",
    "uncommitted_save",
    "refuse_uncommitted_save",
]

#: ``format`` values of a DCP directory in inspect's and verify's output.
DCP_OURS = "dcp-nvcomp"
DCP_PLAIN = "dcp"


def is_dcp_dir(path: str) -> bool:
    """True when ``path`` is a local directory holding DCP's ``.metadata`` or ``__0.metadata`` (ours or plain)."""
    return os.path.isdir(path) and directory_kind(os.listdir(path)) in (DCP_DIR, LIGHTNING_SHARDED_DIR)


#: What a DCP save writes before its commit (``.metadata``, or ``__0.metadata`` without collectives):
#: rank files (ours and FileSystemWriter's) and the per-rank metadata of a save without collectives.
_DCP_PART = re.compile(r"__\d+_[0-9a-zA-Z]+\.(nvcdcp|distcp)|__\d+\.metadata")


def uncommitted_save(path: str) -> str | None:
    """Why the local directory ``path`` is a DCP save that did not finish (rank files, no commit
    record), or None when it is not one: such a directory is no checkpoint, whatever its files say."""
    if not os.path.isdir(path) or is_dcp_dir(path):
        return None
    parts = sorted(n for n in os.listdir(path) if _DCP_PART.fullmatch(n))
    if not parts:
        return None
    shown = ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
    return (
        f"{path}: holds files of a DCP save ({shown}) but no .metadata: the save did not finish (DCP writes .metadata "
        "last, once every rank's file is written), so this is not a checkpoint; load an earlier checkpoint"
    )


def refuse_uncommitted_save(path: str) -> None:
    """Raise for a DCP save that did not finish (see :func:`uncommitted_save`).

    Raises:
        CheckpointError: ``path`` is one.
    """
    why = uncommitted_save(path)
    if why is not None:
        raise CheckpointError(why)


def dcp_kind(path: str) -> str:
    """:data:`DCP_OURS` or :data:`DCP_PLAIN` for a DCP directory."""
    from nvcomp_checkpoint.dcp import read_stored_metadata
    from nvcomp_checkpoint.dcp.layout import holds_stored_items

    metadata = read_stored_metadata(path)
    return DCP_OURS if metadata is not None and holds_stored_items(metadata) else DCP_PLAIN


def _plain_info(metadata: Any, index: Any, info: Any) -> TensorInfo:
    """What a plain rank file spends on one item: its record's length; raw is the chunk's elements."""
    from nvcomp_checkpoint.dcp import fqn_component

    md = metadata.state_dict_metadata[index.fqn]
    codec = "+".join(d.split("/")[0] for d in (getattr(info, "transform_descriptors", None) or ())) or "-"
    component = fqn_component(index.fqn).value
    chunk = next((c for c in getattr(md, "chunks", ()) if tuple(c.offsets) == tuple(index.offset or ())), None)
    if chunk is None:  # a bytes item (pickled object written by the planner)
        return TensorInfo(index.fqn, "other", "bytes", (info.length,), info.length, info.length, codec)
    dtype = md.properties.dtype
    raw = math.prod(chunk.sizes) * dtype.itemsize
    key = index.fqn + (f"@{','.join(map(str, index.offset))}" if any(index.offset or ()) else "")
    return TensorInfo(key, component, str(dtype).removeprefix("torch."), tuple(chunk.sizes), raw, info.length, codec)


def _our_info(t: Any) -> TensorInfo:
    """One entry of a rank file's index, as inspect lists it."""
    return TensorInfo(
        t.key, t.component, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.nbytes, t.stored_bytes, t.codec.label, t.filter
    )


def describe_dcp(path: str) -> dict[str, Any]:
    """Per rank file (sizes, items, raw bytes) and every stored item as :class:`TensorInfo`.

    The rank files, their sizes and (ours) their indexes come from
    :func:`nvcomp_checkpoint.dcp.report.read_dcp_files`, as a sharded save's report does: only
    indexes are read, never a pickled object, so no ``--trust`` is needed.
    """
    from nvcomp_checkpoint.dcp import read_dcp_files

    files = read_dcp_files(path)
    kind = DCP_OURS if files.compressed else DCP_PLAIN
    rows: list[dict[str, Any]] = []
    infos: list[TensorInfo] = []
    for rank, f in enumerate(files.rank_files):
        if files.compressed:
            file_infos = [_our_info(t) for t in f.tensors]
        else:
            file_infos = [_plain_info(files.metadata, index, info) for index, info in files.records[f.name]]
        infos.extend(file_infos)
        note = f"unreadable: {f.error}" if f.error else ("missing" if f.file_bytes is None else None)
        rows.append(
            {
                "file": f.name,
                "rank_file": rank,
                "format": kind,
                "file_bytes": f.file_bytes or 0,
                "items": f.items,
                "tensors": len(file_infos),
                "raw_bytes": sum(t.raw_bytes for t in file_infos),
                "stored_bytes": sum(t.stored_bytes for t in file_infos),
                **({} if note is None else {"note": note}),
            }
        )
    return {
        "path": path,
        "format": kind,
        "files": rows,
        "metadata_files": list(files.metadata_files),
        "metadata_bytes": files.metadata_bytes,
        "_infos": infos,
    }


def verify_plain_dcp(path: str, max_bytes: int | None = None) -> list[dict[str, Any]]:
    """Read every item of a plain DCP directory as DCP's reader does; failures as ``{file, tensor, error}``.

    Plain rank files carry no checksums: this finds truncated and missing files, records that
    point past a file's end, tensor items that no longer decode to the dtype and shape the
    metadata gives, and byte items that the weights-only rules refuse (DCP unpickles them with
    ``torch.load(weights_only=False)``). A flipped bit inside a tensor's elements cannot be seen
    in a plain file. ``max_bytes`` bounds each item read and decoded.
    """
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    from nvcomp_checkpoint.dcp import read_dcp_files
    from nvcomp_checkpoint.dcp.layout import check_byte_item, check_tensor_item

    files = read_dcp_files(path)
    metadata = files.metadata
    registry = ExtensionRegistry()
    failures: list[dict[str, Any]] = []
    for name, items in files.records.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            failures.extend(_missing(full, items))
            continue
        size = os.path.getsize(full)
        with open(full, "rb") as f:
            for index, info in sorted(items, key=lambda kv: kv[1].offset):

                def fail(msg: str, full: str = full, fqn: str = index.fqn) -> None:
                    failures.append({"file": full, "tensor": fqn, "error": f"{full}: tensor {fqn!r}: {msg}"})

                if info.offset + info.length > size:
                    fail(f"needs bytes {info.offset}..{info.offset + info.length} and the file has {size} (truncated)")
                    continue
                if max_bytes is not None and info.length > max_bytes:
                    fail(f"{info.length} bytes, over max_bytes={max_bytes}")
                    continue
                f.seek(info.offset)
                data: Any = io.BytesIO(f.read(info.length))
                try:
                    for ext in registry.from_descriptor_list(getattr(info, "transform_descriptors", None) or ()):
                        if isinstance(ext, StreamTransformExtension):  # as DCP's FileSystemReader applies them
                            data = ext.transform_from(data)
                    # A transform (zstd) may expand without bound: no more than max_bytes is taken.
                    raw = data.read() if max_bytes is None else data.read(max_bytes + 1)
                    if max_bytes is not None and len(raw) > max_bytes:
                        fail(f"decodes to more than max_bytes={max_bytes}")
                        continue
                    md = metadata.state_dict_metadata[index.fqn]
                    if not hasattr(md, "chunks"):
                        # A byte item: DCP's planner unpickles it with torch.load(weights_only=False).
                        check_byte_item(raw, full, index.fqn)
                        continue
                    check_tensor_item(raw, full, index.fqn)
                    t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ()))
                    if not isinstance(t, torch.Tensor) or t.dtype != md.properties.dtype or tuple(t.shape) != tuple(chunk.sizes):
                        got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                        fail(f"decodes to {got}, the metadata says {md.properties.dtype}{list(chunk.sizes)}")
                except CheckpointError as exc:  # a byte item refused: the message names the file and the item
                    failures.append({"file": full, "tensor": index.fqn, "error": " ".join(str(exc).split())})
                except Exception as exc:  # noqa: BLE001 - any decode failure is the item's damage
                    fail(f"does not decode ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
    return failures


def _missing(full: str, items: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    """One failure per item of a rank file that is not there."""
    return [{"file": full, "tensor": index.fqn, "error": f"{full}: missing (named by .metadata)"} for index, _ in items]


def verify_ours_dcp(path: str, verified: Collection[str] = (), max_bytes: int | None = None) -> list[dict[str, Any]]:
    """Checks of our DCP directory beyond each rank file's own checksums, as ``NvcompReader`` makes
    them on load: every record's file exists, reads, is the file the save wrote (its index digest),
    and holds the record's key with the shape and dtype the metadata states; and every byte item
    passes the weights-only rules (DCP unpickles it with ``torch.load(weights_only=False)``).

    A rank file that does not read is reported here unless it is one of ``verified`` (the files
    verify checks on their own, whose damage it names). ``max_bytes`` bounds each byte item decoded.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from nvcomp_checkpoint.dcp import read_dcp_files
    from nvcomp_checkpoint.dcp.layout import check_byte_item
    from nvcomp_checkpoint.dcp.reader import rank_file_problems

    files = read_dcp_files(path)
    failures: list[dict[str, Any]] = []
    for f in files.rank_files:
        full = os.path.join(path, f.name)
        items = files.records[f.name]
        if f.error is not None:
            if full not in verified or f.foreign:
                failures.append({"file": full, "tensor": None, "error": f.error})
            continue
        if f.file_bytes is None:
            failures.extend(_missing(full, items))
            continue
        try:
            with nc.open(full, max_bytes=max_bytes) as reader:
                problems = rank_file_problems(reader, items, files.metadata)
                failures.extend({"file": full, "tensor": fqn, "error": " ".join(str(exc).split())} for fqn, exc in problems)
                if problems:
                    continue
                for index, info in items:
                    if isinstance(files.metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                        try:
                            check_byte_item(reader.read(info.key).numpy().tobytes(), full, index.fqn)
                        except CheckpointError as exc:  # refused, over max_bytes, or damaged
                            failures.append({"file": full, "tensor": index.fqn, "error": " ".join(str(exc).split())})
        except SizeLimitError as exc:
            failures.append({"file": full, "tensor": None, "error": str(exc)})
        except CheckpointError:
            continue  # the rank file's own verify names the damage
    return failures
