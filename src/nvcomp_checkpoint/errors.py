"""Exception classes of nvcomp-checkpoint.

Every error derives from :class:`CheckpointError` and says which file, which tensor and what
the user can do about it.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "CheckpointError",
    "FormatError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "NotARegularFileError",
    "CodecUnavailableError",
    "GpuCodecError",
    "GpuOutOfMemoryError",
    "UnsafeCheckpointError",
    "UnsupportedObjectError",
    "CheckpointWriteError",
    "StateSaveError",
    "BaseCheckpointError",
    "SizeLimitError",
    "TierUnavailableError",
    "TierNotFoundError",
    "CopyTimeoutError",
    "CopySourceError",
    "CopySourceGoneError",
    "MixedSaveError",
    "UnsafePathError",
    "UnsupportedOptionError",
    "NestingLimitError",
    "DeepSpeedTagNotFoundError",
]


class CheckpointError(Exception):
    """Base class of every error raised by nvcomp-checkpoint."""


class FormatError(CheckpointError):
    """The file is not a checkpoint, is truncated, or its index is inconsistent."""


class CheckpointNotFoundError(FormatError, FileNotFoundError):
    """No file at the checkpoint's path (local or object storage).

    A :class:`FormatError`, as before it existed, and a ``FileNotFoundError`` (``errno`` ENOENT),
    so that ``except FileNotFoundError:`` around ``load`` works as it does around ``torch.load``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT


class ChecksumError(FormatError):
    """A chunk's stored bytes do not match the checksum written with them."""


class NotARegularFileError(FormatError, OSError):
    """A path read as a checkpoint's file is a FIFO, a device or a socket (a manifest or a listing names
    it): refused before any byte is read, since reading one blocks for ever or never ends."""


class CodecUnavailableError(CheckpointError):
    """A codec needed to write or read a tensor is not available on this machine."""


class GpuCodecError(CheckpointError, RuntimeError):
    """nvCOMP or CUDA failed for a reason that is not the file's: a CUDA fault, a driver or
    binding mismatch. Unlike :class:`FormatError`, the same file may load elsewhere (on the CPU).
    """


class GpuOutOfMemoryError(GpuCodecError):
    """The GPU ran out of memory while compressing or decompressing."""


class UnsafeCheckpointError(CheckpointError):
    """Loading would run code from the file; it needs an explicit ``weights_only=False``."""


class UnsupportedObjectError(CheckpointError):
    """An object in the tree cannot be saved (for example a tensor subclass or meta tensor)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the previous file at the target path is untouched."""


class StateSaveError(CheckpointWriteError):
    """A save of a whole checkpoint directory (Accelerate's ``save_state``) failed: names the directory
    and what is left there. The final error of that save, never wrapped again."""


class BaseCheckpointError(CheckpointError):
    """A delta checkpoint's base is missing, is another file than the one it was written
    against, or cannot be read: the delta's tensors cannot be rebuilt (never guessed)."""


class SizeLimitError(CheckpointError):
    """Decoding would take more memory than the caller's ``max_bytes`` allows (refused before allocating).

    ``needed`` and ``limit``: the bytes the call would decode and the caller's limit, where known.
    """

    def __init__(self, message: str, *, needed: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.limit = limit


class TierUnavailableError(CheckpointError, OSError):
    """A storage tier could not be listed or read in time (unreachable, timed out, access denied).

    Never taken for an empty tier: what it holds is unknown, so a restore that needs it raises
    this instead of starting fresh, and no retention removes anything there on its account.
    """


class TierNotFoundError(TierUnavailableError, FileNotFoundError):
    """A tier's bucket does not exist: a configuration error (a typo, another account or region)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT


class CopyTimeoutError(CheckpointError, TimeoutError):
    """``wait(timeout=...)`` or ``close(timeout=...)`` gave up on copies not done by the deadline.

    ``pending`` names each one: the step, the tier it was going to, and where it still is.
    """

    def __init__(self, message: str, pending: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.pending = pending


class CopySourceError(FormatError):
    """The unit a copy to a tier reads changed during the copy or does not match its manifest.

    A retry would read the same bytes, so none is made; the tier's previous copies are untouched.
    """


class CopySourceGoneError(CopySourceError):
    """An adopted unit (a framework's own checkpoint) was removed or replaced by the framework's
    rotation before its copy was done: the copy is skipped, which is not a failure of the run."""


class MixedSaveError(FormatError):
    """A file of a checkpoint directory was written by another save than the rest of it (a file
    copied in from an earlier or later checkpoint): loading it would mix two training states."""


class UnsafePathError(FormatError):
    """A path read from a file or a store (a manifest entry, ``latest``, a delta's base record) would
    leave its checkpoint's folder or prefix, or name another store or host: refused before anything
    is read or written there."""


class UnsupportedOptionError(CheckpointError, ValueError):
    """An option the entry point's stack cannot honour (``entrypoint.support``): the message names the
    option, the stack, why, and what to do instead."""


class NestingLimitError(FormatError, ValueError):
    """A JSON document read from a file (an index, a manifest, ``latest``'s tag) is nested deeper than
    :data:`nvcomp_checkpoint.boundedjson.MAX_JSON_DEPTH` levels: no file this library writes is, so the file is
    damaged or forged. A ``ValueError`` too, as ``json``'s own decoding errors are."""


class DeepSpeedTagNotFoundError(CheckpointNotFoundError):
    """A DeepSpeed checkpoint folder's ``latest`` (or the caller's ``tag=``) names a tag that is not there."""
