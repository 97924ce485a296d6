"""Where checkpoint bytes go: local files and fsspec URLs (object storage, shared file systems).

This is the only module that opens files. A save is atomic everywhere: locally a temporary file
is fsynced and renamed; on object stores the object appears only when the upload completes and
a failed upload is aborted; elsewhere a temporary path is moved into place.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import hashlib
import io
import os
import re
import shutil
import socket
import stat
import sys
import threading
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, FormatError, NotARegularFileError
from .version import install_hint

__all__ = [
    "Storage",
    "LocalStorage",
    "FsspecStorage",
    "LOCAL",
    "storage_for",
    "open_checkpoint_stream",
    "ranged_fetch",
    "write_errors",
    "is_url",
    "fsync_path",
    "exchange_paths",
    "list_names",
    "is_storage_error",
    "abort_unfinished_uploads",
    "upload_file",
    "stale_temp_files",
    "local_lock",
    "temp_name",
    "temp_prefix",
    "is_temp_name",
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
#: ``.nvckpt-tmp-<8 hex of the target's name>-<pid>-<8 hex>@<host tag>``. The target's name is
#: never in it: frameworks find checkpoints by their names (Lightning's HPC resume takes every
#: digit of any name holding ``hpc_ckpt_``), and a killed or pending save's temporary file must
#: not look like one.
_TEMP_NAME = re.compile(r"^\.nvckpt-tmp-[0-9a-f]{8}-(?P<pid>\d+)-[0-9a-f]{8}(?:@(?P<host>[^@/]+))?$")
#: What earlier releases named them: ``.<target>.tmp-<pid>-<8 hex>@<host tag>`` (without the
#: tag: older still, never removed). Still cleaned up after an upgrade.
_LEGACY_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}(?:@(?P<host>[^@/]+))?$")


def temp_prefix(target_name: str) -> str:
    """How every temporary name of a save to a file named ``target_name`` begins."""
    return f".nvckpt-tmp-{hashlib.blake2b(os.fsencode(target_name), digest_size=4).hexdigest()}-"


def temp_name(target_name: str, *, tagged: bool = True) -> str:
    """A fresh temporary name for a save to ``target_name``, in the same directory (see :data:`_TEMP_NAME`).

    ``tagged``: with this host's tag, so that the next save can tell a dead writer's file
    (:func:`stale_temp_files`); a file system that other hosts share without PIDs (fsspec) gets none.
    """
    name = f"{temp_prefix(target_name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return f"{name}@{_HOST_TAG}" if tagged else name


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file of a save in progress or killed (this or an older release)."""
    return _TEMP_NAME.match(name) is not None or _LEGACY_TEMP_NAME.match(name) is not None


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``proto://...`` paths other than ``file://``."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


class Storage(abc.ABC):
    """The operations a checkpoint writer, reader, directory commit and tier copy need.

    Every operation is abstract, as in DCP's ``FileSystemBase``: a backend implements all of them
    (a class that misses one cannot be instantiated), so callers never ask which backend they hold.
    What differs between backends is asked through the capability properties (:attr:`is_local`,
    :attr:`is_object_store`), never by type.
    """

    @property
    @abc.abstractmethod
    def is_local(self) -> bool:
        """Whether paths are this machine's OS paths (``os.path`` applies; a process's files can be
        told apart by host and PID, see :func:`stale_temp_files`)."""

    @property
    @abc.abstractmethod
    def is_object_store(self) -> bool:
        """Whether this is an object store (S3, GCS, Azure ...): no directories, no rename; an object
        appears whole when its upload completes."""

    @abc.abstractmethod
    def open_write(self, path: str, *, mode: int | None = None) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary stream whose bytes appear at ``path`` only if the block exits cleanly.

        Args:
            mode: The permission bits the file gets (a converted file keeps its source's, as ``gzip``
                does); ``None``: ``0o666`` less the umask, as ``open`` gives. Back ends without
                permission bits (object stores) have nothing to set.
        """

    @abc.abstractmethod
    def open_read(self, path: str) -> IO[bytes]:
        """A seekable binary stream of the file at ``path``."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The size in bytes of the file at ``path``."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether anything (a file, a directory, an object prefix) is at ``path``."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove the file or the whole directory at ``path``; nothing there is not an error."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` and its parents (a no-op where there are no directories)."""

    # Directory operations: what a directory commit (stage, fsync, rename into place) needs.
    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names of the entries of the directory ``path``, sorted.

        Raises:
            FileNotFoundError: Nothing is at ``path``.
        """

    @abc.abstractmethod
    def list_entries(self, path: str) -> dict[str, bool]:
        """The entries of the directory (or object prefix) ``path``: ``{name: is_directory}``; empty if
        it does not exist. Object-store listings are fetched afresh (another process may have
        changed them since this one last looked)."""

    @abc.abstractmethod
    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (on an object store: a prefix with objects below it)."""

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``, replacing a file there (atomic where the storage allows it)."""

    @abc.abstractmethod
    def exchange(self, a: str, b: str) -> bool:
        """Swap two paths atomically; False where the storage cannot (then rename twice)."""

    @abc.abstractmethod
    def fsync(self, path: str) -> None:
        """Make a file's bytes, or a directory's entries, durable (a no-op where not needed)."""

    @abc.abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy the file ``src`` to ``dst`` on this storage, byte for byte, made durable."""

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file atomically and durably."""

    @abc.abstractmethod
    def bucket_exists(self, path: str) -> bool | None:
        """Whether the bucket holding ``path`` exists, on an object store that can tell (S3); None elsewhere.

        An empty listing of an S3 prefix is the same for a missing bucket and an empty prefix: this
        tells a typo in a bucket's name from a fresh one.
        """

    @abc.abstractmethod
    def remove_stale_temp_files(self, directory: str) -> list[str]:
        """Remove the temporary files that killed saves left in ``directory`` (see :func:`stale_temp_files`);
        returns their paths. Only a storage whose writers can be told dead (:attr:`is_local`) has any."""

    @abc.abstractmethod
    def abort_unfinished_uploads(self, prefix: str) -> list[str]:
        """Abort the unfinished multipart uploads under ``prefix`` (a killed upload's parts); returns their keys.

        Only S3-compatible stores keep such uploads; elsewhere this does nothing.
        """

    @abc.abstractmethod
    def upload_file(
        self,
        local_path: str,
        path: str,
        part_size: int,
        max_concurrency: int,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Upload the local file ``local_path`` to ``path`` in ``part_size`` parts, ``max_concurrency`` at a time.

        The object appears only when the upload completes (a failed multipart upload is aborted by
        the back end; a killed one is left for :meth:`abort_unfinished_uploads`). Memory in flight
        is at most ``part_size * max_concurrency``.

        Returns:
            False (nothing done) where this storage has no parallel upload (not an object store);
            the caller then streams the file through :meth:`open_write`.
        """


class LocalStorage(Storage):
    """Local and mounted file systems (NFS, Lustre, GPFS) through the OS."""

    @property
    def is_local(self) -> bool:
        return True

    @property
    def is_object_store(self) -> bool:
        return False

    @contextlib.contextmanager
    def open_write(self, path: str, *, mode: int | None = None) -> Iterator[IO[bytes]]:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(temp_name(target.name))
        # Owner-only while written when a mode is asked for, then that mode, before the file appears at
        # `path`: no moment at which a file converted from a private one is readable by others.
        f = open_for_writing(tmp, private=mode is not None)
        try:
            yield f
            f.flush()
            if mode is not None:
                os.chmod(f.fileno() if os.chmod in os.supports_fd else tmp, stat.S_IMODE(mode))
            os.fsync(f.fileno())
            f.close()
            retired = _retire_link(target)
            try:
                os.replace(tmp, target)
                fsync_path(target.parent)
            finally:
                if retired is not None:
                    _unlink_later(retired)
        except BaseException:
            # close() flushes the buffer and fails again on a full disk; the temporary file
            # must go all the same.
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def open_read(self, path: str) -> IO[bytes]:
        """A regular file, opened for reading; a FIFO, device or socket is refused before any read
        (:class:`NotARegularFileError`): opened without blocking, checked on the descriptor itself."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(mode):
                raise NotARegularFileError(
                    f"{path}: not a regular file (a FIFO, a device or a socket); a checkpoint's file is never read from "
                    "one (it blocks or never ends): replace it with the real file, or remove it"
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def makedirs(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def list_entries(self, path: str) -> dict[str, bool]:
        try:
            with os.scandir(path) as it:
                return {e.name: e.is_dir() for e in it}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def exchange(self, a: str, b: str) -> bool:
        return exchange_paths(a, b)

    def fsync(self, path: str) -> None:
        fsync_path(path)

    def copy(self, src: str, dst: str) -> None:
        """Copy one file or link byte for byte, with its times and mode, made durable."""
        shutil.copy2(src, dst, follow_symlinks=False)
        if not os.path.islink(dst):
            fsync_path(dst)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def bucket_exists(self, path: str) -> bool | None:
        return None

    def remove_stale_temp_files(self, directory: str) -> list[str]:
        return stale_temp_files(os.path.abspath(directory), remove=True)

    def abort_unfinished_uploads(self, prefix: str) -> list[str]:
        return []  # a local write has no parts left behind: a killed one leaves a temporary file

    def upload_file(
        self,
        local_path: str,
        path: str,
        part_size: int,
        max_concurrency: int,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        return False

    def set_times(self, path: str, stat: os.stat_result) -> None:
        """Give ``path`` the access and modification times of ``stat`` (rotation orders by them).

        Local only, so not part of :class:`Storage`: the folders whose times a rotation orders by
        (a Trainer's ``checkpoint-N``) are local; object stores have no settable times.
        """
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def exchange_paths(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the file system or kernel cannot exchange: fall back to two renames
    raise OSError(err, os.strerror(err), os.fspath(b))


#: A local file being written asks the kernel to start writing its dirty pages to the device every
#: this many bytes, so that the fsync ending a save waits for the last few MiB instead of the whole
#: file: without it a save of a large checkpoint compresses into the page cache at full speed, then
#: sits in fsync while the disk writes everything (the device idle until then).
WRITEBACK_BYTES = 32 << 20
#: ``SYNC_FILE_RANGE_WRITE`` of <linux/fs.h>.
SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """Linux's ``sync_file_range`` (Python's ``os`` has none), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if fn(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return sync_file_range


_SYNC_FILE_RANGE = _libc_sync_file_range()


class _WritebackFile(io.FileIO):
    """:class:`io.FileIO` that starts the writeback of its dirty pages every :data:`WRITEBACK_BYTES`."""

    _unsynced = 0

    def write(self, b: Any, /) -> int:
        n = super().write(b) or 0
        self._unsynced += n
        if self._unsynced >= WRITEBACK_BYTES:
            self._unsynced = 0
            # SYNC_FILE_RANGE_WRITE queues the writes and returns (it waits only when the
            # device's queue is full: back-pressure at the disk's speed). The fsync at the end
            # still makes the file durable; this only starts it early.
            if _SYNC_FILE_RANGE is not None:
                with contextlib.suppress(OSError):
                    _SYNC_FILE_RANGE(self.fileno(), 0, 0, SYNC_FILE_RANGE_WRITE)
        return n


#: A file a save replaces is unlinked off the saving thread from this size on: freeing a large
#: file's blocks is slow (replacing a 155 MB file took 30-65 ms on this machine's ext4, mounted
#: with ``discard``, against 0.04 ms for a rename to a free name) and was the tail of every save
#: over an earlier one (benchmarks/README.md, "Save pipeline and window memory").
RETIRE_BYTES = 32 << 20


def _retire_link(target: Path) -> Path | None:
    """A second, temporary name for the file at ``target`` when replacing it would free many blocks.

    Only a regular file of :data:`RETIRE_BYTES` or more with no other name; None where there is
    none, or where the file system makes no hard links. The name is a temporary file's of this
    process (:func:`temp_name`): a process killed before it unlinks it leaves what the next
    save's :func:`stale_temp_files` removes.
    """
    try:
        st = os.lstat(target)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size < RETIRE_BYTES or st.st_nlink != 1:
        return None
    keep = target.with_name(temp_name(target.name))
    try:
        os.link(target, keep, follow_symlinks=False)
    except (OSError, NotImplementedError):
        return None
    return keep


def _unlink_later(path: Path) -> None:
    """Unlink ``path`` in a thread of its own; the interpreter waits for it at exit (not a daemon)."""

    def unlink() -> None:
        with contextlib.suppress(OSError):
            path.unlink()

    try:
        threading.Thread(target=unlink, name="nvckpt-unlink").start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        unlink()


def _owner_only(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def open_for_writing(path: str | os.PathLike[str], *, private: bool = False) -> IO[bytes]:
    """``open(path, "wb")``, with early writeback where the kernel has ``sync_file_range`` (Linux);
    ``private``: created owner-only (0600) whatever the umask."""
    opener = _owner_only if private else None
    if _SYNC_FILE_RANGE is None:
        return open(path, "wb", opener=opener)
    return io.BufferedWriter(_WritebackFile(path, "w", opener=opener))


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
        match = _TEMP_NAME.match(name) or _LEGACY_TEMP_NAME.match(name)
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
    """Any fsspec file system, addressed by URL (``s3://bucket/key``, ``memory://x``).

    Attributes:
        fs: The fsspec file system (for this module; callers use the :class:`Storage` operations).
        object_store: Same as :attr:`is_object_store` (kept for callers of earlier releases).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.object_store = any(p in _OBJECT_STORES for p in protocols)

    @property
    def is_local(self) -> bool:
        # Even fsspec's "file" protocol: its temporary names carry no host tag (see temp_name).
        return False

    @property
    def is_object_store(self) -> bool:
        return self.object_store

    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    @contextlib.contextmanager
    def open_write(self, path: str, *, mode: int | None = None) -> Iterator[IO[bytes]]:
        # `mode` is not applied: object stores have no permission bits, and fsspec sets none elsewhere.
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
        tmp = f"{parent}/{temp_name(target.rsplit('/', 1)[-1], tagged=False)}" if parent else temp_name(target, tagged=False)
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

    def _ls(self, p: str) -> list[dict[str, Any]]:
        try:
            return self.fs.ls(p, detail=True, refresh=True) if self.object_store else self.fs.ls(p, detail=True)
        finally:
            # A cached listing would make later size/exists calls miss objects written since
            # (by another process, or another client of this one).
            if self.object_store:
                self.fs.invalidate_cache(p)

    def list_entries(self, path: str) -> dict[str, bool]:
        p = self._path(path).rstrip("/")
        try:
            entries = self._ls(p)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            if name and str(e["name"]).rstrip("/") != p:
                out[name] = e.get("type") == "directory"
        return out

    def listdir(self, path: str) -> list[str]:
        p = self._path(path).rstrip("/")
        if not self.fs.isdir(p):
            # fsspec lists a file as itself; os.listdir's contract is an error.
            if self.fs.exists(p):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return sorted(self.list_entries(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(self._path(path)))

    def rename(self, src: str, dst: str) -> None:
        # Atomic on file systems that rename a file; on object stores a copy and a delete.
        s, d = self._path(src).rstrip("/"), self._path(dst).rstrip("/")
        if not self.fs.isdir(s):
            self.fs.mv(s, d)
            return
        # A folder file by file: fsspec's recursive mv also copies the prefix itself, which s3fs refuses.
        for file in self.fs.find(s):
            moved = d + file[len(s) :]
            if not self.object_store:
                self.fs.makedirs(moved.rsplit("/", 1)[0], exist_ok=True)
            self.fs.mv(file, moved)
        if self.fs.exists(s):  # the emptied folders, where the file system has folders
            self.fs.rm(s, recursive=True)

    def exchange(self, a: str, b: str) -> bool:
        return False  # fsspec has no atomic swap: the caller renames twice

    def fsync(self, path: str) -> None:
        pass  # fsspec's close() (the upload's completion) is what makes bytes durable there

    def copy(self, src: str, dst: str) -> None:
        self.fs.copy(self._path(src), self._path(dst))

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def bucket_exists(self, path: str) -> bool | None:
        if not hasattr(self.fs, "call_s3"):  # s3fs only: other stores' buckets cannot be told apart this way
            return None
        bucket = self._path(path).split("/", 1)[0]
        try:
            self.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return False
        return True

    def remove_stale_temp_files(self, directory: str) -> list[str]:
        # Temporary names here carry no host tag (hosts share the store without sharing PIDs): a dead
        # writer's file cannot be told from a live one's, so none is removed.
        return []

    def abort_unfinished_uploads(self, prefix: str) -> list[str]:
        if not hasattr(self.fs, "list_multipart_uploads"):  # an fsspec back end other than s3fs
            return []
        p = self._path(prefix).strip("/")
        bucket, _, key_prefix = p.partition("/")
        aborted = []
        for upload in self.fs.list_multipart_uploads(bucket):
            key = upload.get("Key", "")
            if key.startswith(key_prefix):
                self.fs.abort_mpu(bucket, key, upload["UploadId"])
                aborted.append(f"{bucket}/{key}")
        return aborted

    def upload_file(
        self,
        local_path: str,
        path: str,
        part_size: int,
        max_concurrency: int,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        if not self.object_store or not hasattr(self.fs, "_upload_file_part_concurrent"):  # s3fs's parallel upload only
            return False
        from fsspec.callbacks import Callback

        class _Progress(Callback):
            def relative_update(self, inc: int = 1) -> None:
                if progress is not None:
                    progress(inc)

        self.fs.put_file(local_path, self._path(path), callback=_Progress(), chunksize=part_size, max_concurrency=max_concurrency)
        return True


LOCAL = _LOCAL = LocalStorage()


def file_mode_of(path: str | os.PathLike[str]) -> int | None:
    """The permission bits of the local file ``path`` (``None`` for a URL or a file that is not there): what a
    file converted from it gets (``open_write(..., mode=)``), as ``cp -p``, ``gzip`` and ``zstd`` keep them:
    a 0600 file stays private."""
    if is_url(path):
        return None
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def storage_for(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> tuple[Storage, str]:
    """The storage that holds ``path``, and the path as that storage names it."""
    text = os.fspath(path)
    if text.startswith("file://"):
        return _LOCAL, text[len("file://") :]
    if is_url(text):
        try:
            return FsspecStorage(text, storage_options), text
        except (ValueError, ImportError) as exc:
            backend = (
                f"the s3 extra: {install_hint('s3')}"
                if text.startswith(("s3://", "s3a://"))
                else "its fsspec backend (gcsfs for gs://, adlfs for az://)"
            )
            raise CheckpointError(
                f"{text}: no file system for this URL ({exc}); check the protocol and install {backend}"
            ) from exc
    return _LOCAL, text


#: Packages whose exceptions are a storage failure (fsspec and its object-store back ends).
_STORAGE_MODULES = (
    "fsspec",
    "s3fs",
    "botocore",
    "aiobotocore",
    "boto3",
    "gcsfs",
    "google",
    "adlfs",
    "azure",
    "ocifs",
    "aiohttp",
    "requests",
    "urllib3",
)


def is_storage_error(exc: BaseException) -> bool:
    """True for a failure of the storage itself: an ``OSError``, or an error type of fsspec or one
    of its back ends (botocore's ``NoCredentialsError`` ...), as opposed to a bug or a caller's error."""
    return isinstance(exc, OSError) or type(exc).__module__.startswith(_STORAGE_MODULES)


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
        if not is_storage_error(exc):
            raise
        raise CheckpointWriteError(
            f"{where}: {what} failed: {type(exc).__name__}: {exc}. Any previous file at this path is untouched."
        ) from exc


def open_checkpoint_stream(storage: Storage, path: str, where: str) -> IO[bytes]:
    """``storage.open_read(path)``, with every failure turned into an error that names ``where``."""
    try:
        return storage.open_read(path)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{where}: no such checkpoint file") from exc
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


def list_names(storage: Storage, path: str) -> dict[str, bool]:
    """``storage.list_entries(path)`` (see :meth:`Storage.list_entries`)."""
    return storage.list_entries(path)


def abort_unfinished_uploads(storage: Storage, prefix: str) -> list[str]:
    """``storage.abort_unfinished_uploads(prefix)`` (see :meth:`Storage.abort_unfinished_uploads`)."""
    return storage.abort_unfinished_uploads(prefix)


def upload_file(
    storage: Storage,
    local_path: str,
    path: str,
    part_size: int,
    max_concurrency: int,
    progress: Callable[[int], None] | None = None,
) -> bool:
    """``storage.upload_file(...)`` (see :meth:`Storage.upload_file`)."""
    return storage.upload_file(local_path, path, part_size, max_concurrency, progress)


@contextlib.contextmanager
def local_lock(path: str | os.PathLike[str]) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the local file ``path`` (created, never removed: removing a
    lock file races with its next user). Yields False where the OS or file system has none."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False
        yield locked
    finally:
        os.close(fd)  # releases the lock


def ranged_fetch(stream: Any) -> Callable[[int, int], bytes] | None:
    """``(start, end) -> bytes`` of the opened object, safe to call from several threads at once,
    where the storage has it: the files of fsspec's asynchronous back ends (s3fs, gcsfs, adlfs,
    HTTP), whose ranged fetch is a request of its own that names the object as it was opened
    (s3fs: its ETag, so a replaced object fails instead of mixing two files). ``None`` otherwise."""
    try:
        from fsspec.spec import AbstractBufferedFile
    except ImportError:
        return None
    if isinstance(stream, AbstractBufferedFile) and getattr(stream.fs, "async_impl", False):
        fetch: Callable[[int, int], bytes] = stream._fetch_range
        return fetch
    return None
