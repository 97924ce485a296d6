"""What kind of file a checkpoint is, from its first bytes: ours, ``torch.save``, safetensors, or other.

The one sniffer behind ``nc.load`` (which refuses what it cannot read before unpickling it) and
the ``nvckpt`` commands; a file's kind never comes from its name. A checkpoint *directory*
(DCP, Lightning sharded, Accelerate, HF Trainer) is told by the names of the files in it;
:func:`path_contents` says which of the two (or nothing) is at a path.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Collection, Mapping

from .errors import FormatError
from .format.layout import GUARD, MAGIC
from .storage import Storage, list_names, open_checkpoint_stream

__all__ = [
    "NVCOMP",
    "TORCH",
    "SAFETENSORS",
    "OTHER",
    "HEAD_BYTES",
    "ZIP_HEAD",
    "kind_of",
    "DCP_DIR",
    "LIGHTNING_SHARDED_DIR",
    "ACCELERATE_DIR",
    "HF_TRAINER_DIR",
    "directory_kind",
    "PathContents",
    "path_contents",
]

NVCOMP = "nvcomp-checkpoint"
TORCH = "torch.save"
SAFETENSORS = "safetensors"
OTHER = "other"

#: How many leading bytes :func:`kind_of` needs: the guard and the magic.
HEAD_BYTES = max(9, len(GUARD) + len(MAGIC))

#: The first bytes of a zip archive: what ``torch.save`` writes by default.
ZIP_HEAD = b"PK\x03\x04"
#: ``torch.save(..., _use_new_zipfile_serialization=False)`` starts with a pickle's PROTO opcode
#: (protocol 2 by default, up to 5 with ``pickle_protocol``).
_PICKLE_PROTOCOLS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
#: Larger safetensors headers are refused by safetensors itself (``MAX_HEADER_SIZE``).
_MAX_SAFETENSORS_HEADER = 100_000_000


def kind_of(head: bytes, size: int) -> str:
    """The kind of a file of ``size`` bytes that starts with ``head`` (at least :data:`HEAD_BYTES` of them, if it has them).

    Ours: the magic first (files written before the guard), or the guard's bytes as far as the
    head or the guard goes (the reader then checks it whole, and says "truncated" for a file
    that ends inside it). ``torch.save`` never starts with that pickle: it starts with its
    magic number, not a GLOBAL.
    """
    n = min(len(head), len(GUARD))
    if head[:6] == MAGIC[:6] or (n and head[:n] == GUARD[:n] and (n >= 3 or len(head) >= size)):
        return NVCOMP
    if head[:4] == ZIP_HEAD or head[:2] in _PICKLE_PROTOCOLS:
        return TORCH
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if n <= _MAX_SAFETENSORS_HEADER and 8 + n <= size:
            return SAFETENSORS
    return OTHER


DCP_DIR = "torch.distributed.checkpoint"
LIGHTNING_SHARDED_DIR = "Lightning sharded"
ACCELERATE_DIR = "Accelerate save_state"
HF_TRAINER_DIR = "Hugging Face Trainer"

#: The names that mark each kind of directory: DCP commits ``.metadata`` (``__0.metadata`` ... for a
#: save without collectives); Lightning's sharded strategies add ``meta.pt``; the Trainer writes
#: ``trainer_state.json``; Accelerate's ``save_state`` writes ``random_states_<rank>.pkl``, and with
#: our hooks ``model.nvc`` / ``optimizer.nvc``.
_DCP_METADATA = (".metadata", "__0.metadata")
_LIGHTNING_META = "meta.pt"
_TRAINER_STATE = "trainer_state.json"
_ACCELERATE_FILE = re.compile(r"random_states_\d+\.pkl|(model|optimizer)(_\d+)?\.nvc")


def directory_kind(names: Collection[str]) -> str | None:
    """The kind of checkpoint directory whose entries are ``names`` (file and folder names), or None."""
    if any(n in names for n in _DCP_METADATA):
        return LIGHTNING_SHARDED_DIR if _LIGHTNING_META in names else DCP_DIR
    if _TRAINER_STATE in names:
        return HF_TRAINER_DIR
    if any(_ACCELERATE_FILE.fullmatch(n) for n in names):
        return ACCELERATE_DIR
    return None


@dataclass(frozen=True)
class PathContents:
    """What :func:`path_contents` found at a path: nothing, a file, or a directory.

    Attributes:
        exists: Something is there.
        file_kind: A file's kind (:func:`kind_of`); ``None`` for a directory or nothing.
        names: A directory's entries (``{name: is_folder}``, empty for an empty one); ``None`` otherwise.
    """

    exists: bool
    file_kind: str | None = None
    names: Mapping[str, bool] | None = None

    @property
    def is_dir(self) -> bool:
        return self.names is not None

    @property
    def directory_kind(self) -> str | None:
        """The kind of checkpoint directory (:func:`directory_kind`), or ``None`` (not one, or not a directory)."""
        return directory_kind(self.names) if self.names else None


def path_contents(storage: Storage, spath: str, where: str) -> PathContents:
    """What is at ``spath`` of ``storage`` (named ``where`` in errors): a file's first bytes are sniffed,
    a directory's (or object prefix's) entries listed. Callers word their own message from it.

    Raises:
        CheckpointError: A file that cannot be opened (permission denied, a storage failure).
        OSError: The listing or the read failed.
    """
    names = list_names(storage, spath)
    if names:
        return PathContents(True, names=names)
    if not storage.exists(spath):
        return PathContents(False)
    if storage.isdir(spath):
        return PathContents(True, names={})
    try:
        with open_checkpoint_stream(storage, spath, where) as f:
            head = f.read(HEAD_BYTES)
    except FormatError as exc:
        if isinstance(exc.__cause__, IsADirectoryError):  # an empty folder of an fsspec file system
            return PathContents(True, names={})
        raise
    return PathContents(True, file_kind=kind_of(head, storage.size(spath)))
