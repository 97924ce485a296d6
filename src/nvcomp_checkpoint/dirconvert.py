"""Converting files of a directory in place: ``FILE`` becomes ``FILE.nvc`` and back.

At every instant each file is in the directory complete, plain or compressed, so a crash or a
failure (disk full) at any point leaves a directory that loads. The Trainer integration converts
its ``checkpoint-N`` directories with it.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from .api import load, save
from .api import open as open_checkpoint
from .dirstore import MARKER_NAME, write_marker
from .errors import CheckpointError, CheckpointWriteError, FormatError, MixedSaveError
from .policy import CodecPolicy
from .report import SaveReport, merge_reports
from .storage import LOCAL, stale_temp_files
from .tensors import first_difference

__all__ = [
    "PlainFile",
    "compress_in_place",
    "decompress_in_place",
    "compressed_copy",
    "is_placeholder",
    "SUFFIX",
    "PLACEHOLDER_TAG",
    "IDENTITY_KEY",
    "check_identity",
]

#: Appended to the name of each converted file (``optimizer.pt`` -> ``optimizer.pt.nvc``).
SUFFIX = ".nvc"

#: The metadata key of each converted file's identity: what ties it to its directory (see :func:`check_identity`).
IDENTITY_KEY = "nvckpt_directory"

#: Bytes every placeholder holds (see :class:`PlainFile`), which tell it from the file it stands for.
PLACEHOLDER_TAG = b"nvcomp-checkpoint-placeholder"
#: The largest placeholder: anything bigger is a real file, whatever it holds.
_PLACEHOLDER_MAX_BYTES = 4096


@dataclass(frozen=True)
class PlainFile:
    """A file to compress: its name in the directory, the key its tree is stored under inside
    the compressed file, and how to read it (the tree and metadata to keep with it).

    ``placeholder``: bytes left under the plain name once the compressed copy is durable, instead
    of removing it: a small file in the plain file's format (holding :data:`PLACEHOLDER_TAG`) that
    the framework's own loader refuses loudly, naming what reads the compressed copy. Without
    it, a loader that skips a missing file (the Trainer's optimizer.pt) would go on without the state.
    """

    name: str
    key: str
    read: Callable[[Path], tuple[Any, dict[str, Any]]]
    placeholder: bytes | None = None

    def __post_init__(self) -> None:
        if self.placeholder is not None and (
            PLACEHOLDER_TAG not in self.placeholder or len(self.placeholder) > _PLACEHOLDER_MAX_BYTES
        ):
            raise ValueError(
                f"{self.name}: a placeholder must hold PLACEHOLDER_TAG and be at most {_PLACEHOLDER_MAX_BYTES} bytes"
            )


def is_placeholder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a placeholder left by :func:`compress_in_place` (its compressed copy is ``path + SUFFIX``)."""
    try:
        if os.path.getsize(path) > _PLACEHOLDER_MAX_BYTES:
            return False
        with LOCAL.open_read(os.fspath(path)) as f:
            return PLACEHOLDER_TAG in f.read(_PLACEHOLDER_MAX_BYTES + 1)
    except OSError:  # missing, or a folder
        return False


def _is_plain(path: Path) -> bool:
    return path.is_file() and not is_placeholder(path)


def compress_in_place(
    directory: Path,
    files: Sequence[PlainFile],
    policy: CodecPolicy | None = None,
    *,
    meta_key: str,
    marker: str,
    resumes: str,
    verify: bool = True,
    workers: int | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    identity: Mapping[str, Any] | None = None,
) -> SaveReport:
    """Replace ``files`` (in this order) by compressed copies; see the module docstring.

    Each compressed file holds ``{file.key: tree}`` with the file's metadata under ``meta_key``
    in its index. Every compressed file is durable before a plain one goes; then the ``marker``
    text is written, so whoever opens the directory learns what its files are. The directory's
    modification time is kept (rotations order checkpoints by it).

    Args:
        resumes: Who reads the plain files when this fails (``"the Trainer resumes from them"``).
        verify: Decode each compressed file and compare it bit for bit with the plain tree
            before the plain file is deleted.
        identity: What identifies the directory's save (``{"step": 40}``), kept in each compressed
            file's metadata under :data:`IDENTITY_KEY` with a save id common to the files of this
            call, for :func:`check_identity` at load.

    Raises:
        CheckpointWriteError: Writing failed; the directory is as it was.
        CheckpointError: ``verify`` found a difference, or a file could not be read; the plain
            files are kept.
    """
    stamp = directory.stat()
    start = time.perf_counter()
    stale_temp_files(directory, remove=True)  # a conversion killed mid-write left save()'s temporary file
    written: list[Path] = []
    reports: list[SaveReport] = []
    extra = {} if identity is None else {IDENTITY_KEY: {**identity, "save_id": uuid.uuid4().hex}}
    try:
        for file in files:
            tree, meta = file.read(directory / file.name)
            target = directory / (file.name + SUFFIX)
            reports.append(
                save(
                    {file.key: tree},
                    target,
                    policy,
                    metadata={meta_key: meta, **extra},
                    workers=workers,
                    stream_wrapper=stream_wrapper,
                    file_mode=stat.S_IMODE((directory / file.name).stat().st_mode),
                )
            )
            written.append(target)
            if verify:
                _verify_copy(target, file.key, tree)
            del tree
    except BaseException as exc:
        # Undo, so the directory is exactly what it was (and uses no more space than that). A
        # compressed file goes only while its plain file is still there: two processes converting
        # one directory (a shared file system) must never remove the last copy.
        for path in written:
            if path.with_name(path.name[: -len(SUFFIX)]).is_file():
                LOCAL.remove(str(path))
        _sync(directory, stamp)
        if isinstance(exc, OSError):
            raise CheckpointWriteError(
                f"{directory}: compressing the checkpoint failed ({exc}). Its plain files are untouched and "
                f"{resumes}; free disk space before the next save."
            ) from exc
        if isinstance(exc, CheckpointError):
            raise type(exc)(f"{str(exc).rstrip('.')}. The plain files of {directory} are untouched and {resumes}.") from exc
        raise
    if files:
        write_marker(directory, marker)
    for file in files:
        if file.placeholder is None:
            LOCAL.remove(str(directory / file.name))
        else:  # replaces the plain file in one rename: a loader sees one or the other, never neither
            LOCAL.write_bytes(str(directory / file.name), file.placeholder)
    _sync(directory, stamp)
    return merge_reports(str(directory), reports, time.perf_counter() - start)


def decompress_in_place(
    directory: Path,
    keys: Mapping[str, str],
    write: Callable[[str, Any, dict[str, Any], IO[bytes]], None],
    *,
    meta_key: str,
    load_tree: Callable[[Path, str], Any],
) -> list[str]:
    """Write back the plain file of each ``NAME.nvc`` whose ``NAME`` is in ``keys`` (over its
    placeholder, if any); remove the compressed ones.

    ``write(name, tree, meta, stream)`` writes one plain file (atomically: a crash leaves the
    compressed file as it was); ``load_tree(path, key)`` reads the tree stored under ``key``.

    Returns:
        The names of the plain files written.
    """
    stamp = directory.stat()
    restored = []
    for compressed in sorted(directory.glob("*" + SUFFIX)):
        name = compressed.name[: -len(SUFFIX)]
        if name not in keys:
            continue
        with open_checkpoint(compressed) as reader:
            meta = reader.metadata.get(meta_key, {})
        tree = load_tree(compressed, keys[name])
        with LOCAL.open_write(str(directory / name), mode=stat.S_IMODE(compressed.stat().st_mode)) as stream:
            write(name, tree, meta, stream)
        LOCAL.remove(str(compressed))
        restored.append(name)
    if not any(directory.glob("*" + SUFFIX)):
        LOCAL.remove(str(directory / MARKER_NAME))
    _sync(directory, stamp)
    return restored


def compressed_copy(directory: str | os.PathLike[str] | None, names: Sequence[str]) -> Path | None:
    """The compressed copy of the first of ``names`` in ``directory``, if none of the plain files is there
    (a placeholder is no plain file)."""
    if directory is None or any(_is_plain(Path(directory) / name) for name in names):
        return None  # a plain file wins: it is what the framework wrote
    found = [p for name in names if (p := Path(directory) / (name + SUFFIX)).is_file()]
    return found[0] if found else None


def check_identity(path: str | os.PathLike[str], expected: Mapping[str, Any]) -> None:
    """Raise unless the converted file ``path`` was written for its directory's save.

    Its identity (:data:`IDENTITY_KEY`) must agree with ``expected`` (what the directory says of its
    save, such as ``{"step": 40}``) on each key both hold, and its save id with that of every other
    converted file of the directory. A file converted before identities were recorded has none:
    it is not checked.

    Raises:
        MixedSaveError: The file was converted for another save (an earlier checkpoint's file copied in), named.
    """
    path = Path(path)
    mine = _identity_of(path)
    if mine is None:
        return
    for key, value in expected.items():
        if key in mine and value is not None and mine[key] != value:
            raise MixedSaveError(
                f"{path}: written for {key} {mine[key]!r}, but {path.parent} is the save of {key} {value!r} (a file "
                "copied in from another checkpoint?). Restore this checkpoint's file or resume from another checkpoint."
            )
    for other in sorted(path.parent.glob("*" + SUFFIX)):
        theirs = _identity_of(other) if other != path else None
        if theirs is not None and theirs.get("save_id") != mine.get("save_id"):
            raise MixedSaveError(
                f"{path}: not converted with {other.name} (their save ids differ: one of them was copied in from "
                "another checkpoint). Restore this checkpoint's files or resume from another checkpoint."
            )


def _identity_of(path: Path) -> dict[str, Any] | None:
    with open_checkpoint(path) as reader:
        found = reader.metadata.get(IDENTITY_KEY)
    return found if isinstance(found, dict) else None


def _verify_copy(target: Path, key: str, original: Any) -> None:
    decoded = load(target, map_location="cpu")[key]
    difference = first_difference(original, decoded, key)
    if difference is not None:
        raise FormatError(
            f"{target}: the compressed copy differs from the plain file at {difference!r}; "
            "please report this as a bug (pass verify=False only to skip this check)."
        )


def _sync(directory: Path, stamp: os.stat_result) -> None:
    LOCAL.fsync(str(directory))
    LOCAL.set_times(str(directory), stamp)
