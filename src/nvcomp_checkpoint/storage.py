"""Where checkpoint bytes go: local files and fsspec URLs (object storage, shared file systems).

This is the only module that opens files. A save is atomic everywhere: locally a temporary file
is fsynced and renamed; on object stores the object appears only when the upload completes and
a failed upload is aborted; elsewhere a temporary path is moved into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

from .errors import CheckpointError, CheckpointWriteError, FormatError

__all__ = [
    "Storage", "LocalStorage", "FsspecStorage", "storage_for", "open_checkpoint_stream", "write_errors", "is_url", "fsync_path",
    "stale_temp_files",
]

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2"}

#: Who writes a local temporary file: this host and its PID namespace, so that a file of a
#: dead process can be told from one of a live process on another host (a shared file system)
#: or in another container. The PID follows in the name.
try:
    _PID_NAMESPACE = os.stat("/proc/self/ns/pid").st_ino
except OSError:
    _PID_NAMESPACE = 0
_HOST_TAG = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:32] + f"~{_PID_NAMESPACE:x}"
#: ``.<target>.tmp-<pid>-<8 hex>@<host tag>``; files without the tag predate it (never removed).
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}(?:@(?P<host>[^@/]+))?$")


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``proto://...`` paths other than ``file://``."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


class Storage:
    """The handful of operations a checkpoint writer and reader need."""

    def open_write(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary stream whose bytes appear at ``path`` only if the block exits cleanly."""
        raise NotImplementedError

    def open_read(self, path: str) -> IO[bytes]:
        """A seekable binary stream of the file at ``path``."""
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        raise NotImplementedError


class LocalStorage(Storage):
    """Local and mounted file systems (NFS, Lustre, GPFS) through the OS."""

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        name = f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Tagged so that the next save can tell a dead writer's file (stale_temp_files); a name
        # that would pass the file system's 255 bytes goes untagged (never removed, as before).
        tagged = f"{name}@{_HOST_TAG}"
        tmp = target.with_name(tagged if len(os.fsencode(tagged)) <= 255 else name)
        f = open(tmp, "wb")
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, target)
            fsync_path(target.parent)
        except BaseException:
            # close() flushes the buffer and fails again on a full disk; the temporary file
            # must go all the same.
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        p = Path(path)
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def makedirs(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Make a file's bytes, or a directory's entries (renames, removals), durable.

    A file that cannot be fsynced raises; a directory that cannot is skipped, since not every
    platform and file system allows it.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        if p.is_file():
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if p.is_file():
            raise
    finally:
        os.close(fd)


def stale_temp_files(directory: str | os.PathLike[str], *, remove: bool = False) -> list[str]:
    """Temporary files in ``directory`` left by local saves whose process is gone.

    A save killed before it completes (SIGKILL, a crashed node) cannot remove its temporary
    file. One is stale when it was written on this host, in this PID namespace, by a process
    that no longer runs (or is a zombie); a file of a live process, of another host or of an
    older version (no host tag) is never listed, so never removed.

    Args:
        directory: A local directory.
        remove: Delete the stale files (a save does, before it writes).

    Returns:
        The paths of the stale files, sorted (those removed, with ``remove``).
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    stale = []
    for name in names:
        match = _TEMP_NAME.match(name)
        if match is None or match.group("host") != _HOST_TAG:
            continue
        pid = int(match.group("pid"))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass  # gone
        except (PermissionError, OverflowError, OSError):
            continue  # alive, owned by another user (or not a PID we can ask about)
        else:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:  # a zombie has exited: only its parent has not reaped it
                    if f.read().rsplit(b")", 1)[-1].split()[0] != b"Z":
                        continue
            except (OSError, IndexError):
                continue
        path = os.path.join(directory, name)
        if remove:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue  # another save removed it first
            except OSError:
                continue  # left for the next save; this one must not fail for it
        stale.append(path)
    return stale


class FsspecStorage(Storage):
    """Any fsspec file system, addressed by URL (``s3://bucket/key``, ``memory://x``)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.object_store = any(p in _OBJECT_STORES for p in protocols)

    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        target = self._path(path)
        parent = target.rsplit("/", 1)[0] if "/" in target else ""
        if parent and not self.object_store:
            self.fs.makedirs(parent, exist_ok=True)
        if self.object_store:
            # The object becomes visible only when the (multipart) upload completes;
            # discard() aborts it, leaving any previous object at the key as it was.
            f = self.fs.open(target, "wb")
            try:
                yield f
            except BaseException:
                with contextlib.suppress(Exception):
                    f.discard()
                # A discarded file must not try to upload from its finalizer (s3fs fails there
                # with "'NoneType' object has no attribute 'tell'").
                with contextlib.suppress(Exception):
                    f.closed = True
                raise
            f.close()
            return
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        f = self.fs.open(tmp, "wb")
        try:
            yield f
            f.close()
            self.fs.mv(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(self._path(path), "rb")

    def size(self, path: str) -> int:
        return int(self.fs.size(self._path(path)))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._path(path)))

    def remove(self, path: str) -> None:
        p = self._path(path)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=self.fs.isdir(p))

    def makedirs(self, path: str) -> None:
        if not self.object_store:
            self.fs.makedirs(self._path(path), exist_ok=True)


_LOCAL = LocalStorage()


def storage_for(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> tuple[Storage, str]:
    """The storage that holds ``path``, and the path as that storage names it."""
    text = os.fspath(path)
    if text.startswith("file://"):
        return _LOCAL, text[len("file://"):]
    if is_url(text):
        try:
            return FsspecStorage(text, storage_options), text
        except (ValueError, ImportError) as exc:
            raise CheckpointError(
                f"{text}: no file system for this URL ({exc}); check the protocol and install its fsspec "
                "backend (s3fs for s3://, gcsfs for gs://, adlfs for az://)"
            ) from exc
    return _LOCAL, text


#: Packages whose exceptions are a storage failure (fsspec and its object-store back ends).
_STORAGE_MODULES = (
    "fsspec", "s3fs", "botocore", "aiobotocore", "boto3", "gcsfs", "google", "adlfs", "azure",
    "ocifs", "aiohttp", "requests", "urllib3",
)


@contextlib.contextmanager
def write_errors(where: str, what: str = "writing the checkpoint") -> Iterator[None]:
    """Turn a failed write into a :class:`CheckpointWriteError` that names ``where``.

    The storage's own errors (``OSError``, and the types of fsspec's back ends: botocore's
    ``NoCredentialsError`` ...) are translated; anything else (a bug, a caller's callback that
    raised, an out-of-memory error) passes through as it was raised.
    """
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        hint = " (the disk is full)" if exc.errno == errno.ENOSPC else ""
        raise CheckpointWriteError(
            f"{where}: {what} failed{hint}: {exc.strerror or exc}. Any previous file at this path is untouched."
        ) from exc
    except Exception as exc:  # noqa: BLE001
        if not type(exc).__module__.startswith(_STORAGE_MODULES):
            raise
        raise CheckpointWriteError(
            f"{where}: {what} failed: {type(exc).__name__}: {exc}. Any previous file at this path is untouched."
        ) from exc


def open_checkpoint_stream(storage: Storage, path: str, where: str) -> IO[bytes]:
    """``storage.open_read(path)``, with every failure turned into an error that names ``where``."""
    try:
        return storage.open_read(path)
    except FileNotFoundError as exc:
        raise FormatError(f"{where}: no such checkpoint file") from exc
    except IsADirectoryError as exc:
        raise FormatError(f"{where}: is a directory, not a checkpoint file") from exc
    except NotADirectoryError as exc:
        raise FormatError(f"{where}: no such checkpoint file (a parent of it is not a directory)") from exc
    except PermissionError as exc:
        raise CheckpointError(f"{where}: permission denied reading the checkpoint ({exc})") from exc
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - fsspec back ends raise their own types (botocore ...)
        raise CheckpointError(f"{where}: cannot open the checkpoint: {type(exc).__name__}: {exc}") from exc
