"""One save's options as one frozen value, built and checked once from the public keywords of
``save``/``save_async`` (or an integration's settings) and passed down whole, by keyword."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Mapping

from .credentials import StorageOptions
from .policy import CodecPolicy
from .writer import checked_metadata

__all__ = ["SaveOptions"]


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """What one save is asked to do, besides the tree and the path: every field of :func:`nvcomp_checkpoint.save`.

    Keyword-only, so that ``metadata`` (stored in the file's index) and ``storage_options`` (handed to
    fsspec: credentials, endpoints), both dicts, can never trade places; ``repr`` leaves out the
    storage options, kept as :class:`~nvcomp_checkpoint.credentials.StorageOptions` (credentials
    shown as ``***``). Build it with :meth:`of`, which converts and checks the public keywords.

    Attributes:
        policy: The codec policy (already converted by :meth:`CodecPolicy.of`).
        metadata: JSON-safe values for the index (a private JSON copy; empty: none).
        storage_options: fsspec options for URLs, never written anywhere.
        workers: Compression threads (``None``: the saver's or every core).
        progress: Called with the raw bytes of each chunk as it is written.
        stream_wrapper: Wraps the output stream.
        base: The checkpoint this save is a delta against (``None``: a full save).
        base_state: With ``base``: the state saved there, kept by the caller.
        file_mode: Permission bits of the new local file (``None``: ``0o666`` less the umask).
    """

    policy: CodecPolicy = field(default_factory=CodecPolicy)
    metadata: dict[str, Any] = field(default_factory=dict)
    storage_options: StorageOptions | None = field(default=None, repr=False)
    workers: int | None = None
    progress: Callable[[int], None] | None = field(default=None, repr=False)
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = field(default=None, repr=False)
    base: str | None = None
    base_state: Any = field(default=None, repr=False)
    file_mode: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, CodecPolicy):
            raise TypeError(f"SaveOptions.policy must be a CodecPolicy (see SaveOptions.of), got {type(self.policy).__name__}")
        if not isinstance(self.metadata, dict):
            raise TypeError(f"SaveOptions.metadata must be a dict, got {type(self.metadata).__name__}")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise TypeError(f"SaveOptions.storage_options must be a dict or None, got {type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", StorageOptions.of(self.storage_options))
        if self.workers is not None and (not isinstance(self.workers, int) or isinstance(self.workers, bool)):
            raise TypeError(f"workers must be a positive int or None (every core), got {self.workers!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be a positive int or None (every core), got {self.workers!r}")
        if self.base is not None and not isinstance(self.base, str):
            raise TypeError(f"SaveOptions.base must be a str path or None (see SaveOptions.of), got {type(self.base).__name__}")
        if self.file_mode is not None and (
            not isinstance(self.file_mode, int) or isinstance(self.file_mode, bool) or not 0 <= self.file_mode <= 0o7777
        ):
            raise ValueError(f"file_mode must be permission bits (0 to 0o7777, such as 0o600) or None, got {self.file_mode!r}")
        if self.base_state is not None and self.base is None:
            raise ValueError("base_state is the state saved to `base`; pass base= too")

    @classmethod
    def of(
        cls,
        path: str | os.PathLike[str],
        caller: str,
        *,
        policy: CodecPolicy | Mapping[str, Any] | str | None = None,
        metadata: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        workers: int | None = None,
        progress: Callable[[int], None] | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        base: str | os.PathLike[str] | None = None,
        base_state: Any = None,
        file_mode: int | None = None,
    ) -> SaveOptions:
        """The options of a save to ``path`` from the public keywords, each converted and checked here.

        Args:
            path: Where the save goes (named by errors about the metadata).
            caller: The public call, named by errors (``"save"``, ``"save_async"``).

        Raises:
            TypeError, ValueError: A keyword has the wrong type or value (the message names it).
            UnsupportedObjectError: ``metadata`` is not JSON, or too large for the index.
        """
        where = os.fspath(path)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                f"{where}: {caller}(storage_options=...) must be a dict of fsspec options, got {type(storage_options).__name__}"
            )
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"{where}: {caller}(metadata=...) must be a dict, got {type(metadata).__name__}")
        return cls(
            policy=CodecPolicy.of(policy, f"{caller}(policy=...)"),
            # A JSON copy taken now: the caller may change its dict while a background save runs.
            metadata=checked_metadata(metadata, where),
            storage_options=StorageOptions.of(storage_options),
            workers=workers,
            progress=progress,
            stream_wrapper=stream_wrapper,
            base=None if base is None else os.fspath(base),
            base_state=base_state,
            file_mode=file_mode,
        )
