"""What ties a file to the save that wrote it: its size and a digest, recorded in a manifest at commit
and checked at load (Accelerate folders, ``nvckpt`` folders, DeepSpeed tags, HF Trainer folders).

An nvcomp-checkpoint file's digest is its *index digest*: the xxh3 of its index, which the writer
computed while writing and put in the footer, so recording it costs one small read of the footer (no
read-back of the file). The index holds the xxh3 of every frame and the reader checks frames against
it, so the index digest stands for the whole file. Any other file gets a BLAKE2b-128 of its bytes (a
full read).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from .errors import ChecksumError, FormatError, MixedSaveError
from .format.layout import FOOTER, FOOTER_MAGIC, MAGIC, unpack_footer
from .storage import LOCAL, Storage

__all__ = ["digest", "index_digest", "file_record", "record_problem", "valid_record"]


def digest(path: str | os.PathLike[str]) -> str:
    """BLAKE2b-128 of a file, in hex."""
    h = hashlib.blake2b(digest_size=16)
    with LOCAL.open_read(os.fspath(path)) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def index_digest(path: str | os.PathLike[str], *, storage: Storage = LOCAL, size: int | None = None) -> int | None:
    """The xxh3 of an nvcomp-checkpoint file's index, as its footer records it (the reader checks
    the index against it): the file's identity, read in one small read (one range read on an object
    store). ``None`` for other files.

    Args:
        path: The file, on ``storage``.
        storage: Where the file is (default: the local file system).
        size: The file's size, if known (saves a stat).

    Raises:
        FormatError: The file ends in a footer whose fields are impossible (named).
    """
    where = os.fspath(path)
    if size is None:
        size = storage.size(where)
    if size < len(MAGIC) + FOOTER.size:
        return None
    with storage.open_read(where) as f:
        f.seek(size - FOOTER.size)
        data = f.read(FOOTER.size)
    if not data.endswith(FOOTER_MAGIC):
        return None
    return unpack_footer(data, size, where)[2]


def file_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"bytes": size, "index_xxh3": ...}`` for an nvcomp-checkpoint file, ``{"bytes": size, "blake2b": ...}`` for any other."""
    size = os.path.getsize(path)
    identity = index_digest(path)
    if identity is not None:
        return {"bytes": size, "index_xxh3": identity}
    return {"bytes": size, "blake2b": digest(path)}


def valid_record(record: Any) -> bool:
    """Whether ``record`` has the form :func:`file_record` writes (what a manifest read from disk must hold)."""
    if not isinstance(record, dict):
        return False
    size, xxh3, blake = record.get("bytes"), record.get("index_xxh3"), record.get("blake2b")
    return (
        isinstance(size, int)
        and not isinstance(size, bool)
        and size >= 0
        and (xxh3 is None or (isinstance(xxh3, int) and not isinstance(xxh3, bool)))
        and (blake is None or isinstance(blake, str))
        and (xxh3 is not None or blake is not None)
    )


def record_problem(path: str | os.PathLike[str], record: dict[str, Any], save: str) -> FormatError | None:
    """What is wrong with the file at ``path`` against its :func:`file_record` (None: it is the file ``save`` wrote).

    ``save`` names the save in the message (``"tag 'g4'"``). A missing file is left to the caller.

    Returns:
        A :class:`FormatError` (size differs), :class:`MixedSaveError` (another save's file: its digest
        differs) or :class:`ChecksumError` (a plain file's bytes differ), each naming the file; or None.
    """
    where = os.fspath(path)
    size = os.path.getsize(where)
    if size != record["bytes"]:
        return FormatError(f"{where}: {size} bytes, but {save} committed {record['bytes']}; the file was changed or truncated")
    fix = "Restore this save's file or load another checkpoint."
    if record.get("index_xxh3") is not None:
        try:
            found = index_digest(where)
        except FormatError as exc:
            return exc
        if found != record["index_xxh3"]:
            return MixedSaveError(
                f"{where}: not the file {save} committed (its index digest differs from the manifest's: a file "
                f"copied in from another save, run or tag?). {fix}"
            )
    elif record.get("blake2b") is not None and digest(where) != record["blake2b"]:
        return ChecksumError(f"{where}: its contents differ from what {save} committed (checksum mismatch). {fix}")
    return None
