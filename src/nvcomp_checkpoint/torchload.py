"""Opt-in: let ``torch.load`` read our files, so tools that only know ``torch.load`` read them too.

``enable_torch_load()`` (process-wide, undone by ``disable_torch_load()``) or ``with
torch_load_reads_nvc():`` (this thread or task only) puts a wrapper in ``torch.load``: a file or
stream that starts with our guard or magic is decoded by :func:`nvcomp_checkpoint.load` with
weights-only rules, anything else goes to the original ``torch.load`` unchanged. See
``docs/other-tools.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator

import torch

from .api import load
from .errors import UnsafeCheckpointError
from .filetype import HEAD_BYTES, NVCOMP, kind_of

__all__ = ["enable_torch_load", "disable_torch_load", "torch_load_reads_nvc", "torch_load_reads_nvc_now", "PathLoader"]

#: ``loader(path, map_location)``: how a scope reads one of our files given by path (default:
#: :func:`nvcomp_checkpoint.load`, weights-only). An integration passes its own (its allow-list, its checks).
PathLoader = Callable[[str, Any], Any]


@dataclass(frozen=True)
class _Reading:
    """How the wrapper reads our files where it is in force."""

    trust: bool
    loader: PathLoader | None


_LOCK = threading.Lock()
#: The ``torch.load`` the wrapper replaced (set at the first install, kept: another library may
#: wrap ours, and ours then stays in place, passing every call through when not in force).
_original: Callable[..., Any] | None = None
_global: _Reading | None = None
_scopes = 0  # scopes open in any thread: the wrapper stays installed while one is
_scoped: contextvars.ContextVar[_Reading | None] = contextvars.ContextVar("nvcomp_checkpoint_torch_load", default=None)


def _in_force() -> _Reading | None:
    return _scoped.get() or _global


def _head_of_path(path: str) -> tuple[bytes, int] | None:
    try:
        with open(path, "rb") as f:
            return f.read(HEAD_BYTES), os.fstat(f.fileno()).st_size
    except OSError:
        return None  # torch.load names the missing or unreadable file itself


def _head_of_stream(f: IO[bytes]) -> bytes | None:
    try:
        start = f.tell()
        head = f.read(HEAD_BYTES)
        f.seek(start)
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None  # not seekable: torch.load needs seek too and says so
    return head if isinstance(head, bytes) else None


def _local_file_of(f: Any) -> str | None:
    """The local file a stream reads from its first byte (a delta then finds its base next to it), or None."""
    name = getattr(f, "name", None)
    if not isinstance(name, str) or not os.path.isfile(name):
        return None
    try:
        return name if f.tell() == 0 and os.fstat(f.fileno()).st_size == os.path.getsize(name) else None
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _load_ours(f: Any, map_location: Any, weights_only: bool, reading: _Reading) -> Any:
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else _local_file_of(f)
    if path is not None:
        if reading.loader is not None and weights_only:
            return reading.loader(path, map_location)
        return load(path, map_location, weights_only=weights_only)
    # A stream with no file of its own (fsspec's remote files, BytesIO): its bytes go to a private
    # temporary file, which the reader needs to seek in. A delta's base cannot be found from there.
    folder = tempfile.mkdtemp(prefix="nvckpt-torch-load-")
    try:
        tmp = os.path.join(folder, "stream.nvc")
        with open(tmp, "wb") as out:
            shutil.copyfileobj(f, out)
        return load(tmp, map_location, weights_only=weights_only)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wrapper(f: Any, *args: Any, **kwargs: Any) -> Any:
    # The same signature as torch.load: f, map_location, pickle_module positionally, the rest by name.
    assert _original is not None
    reading = _in_force()
    if reading is None:
        return _original(f, *args, **kwargs)
    if isinstance(f, (str, os.PathLike)):
        found = _head_of_path(os.fspath(f))
        ours = found is not None and kind_of(found[0], found[1]) == NVCOMP
    else:
        head = _head_of_stream(f)
        ours = head is not None and kind_of(head, len(head) if len(head) < HEAD_BYTES else HEAD_BYTES + 1) == NVCOMP
    if not ours:
        return _original(f, *args, **kwargs)
    map_location = args[0] if args else kwargs.get("map_location")
    # Safe by default: weights-only rules for our files whatever the caller passed (tools pass
    # weights_only=False for their own trusted files, not for ours); trust=True honours it.
    weights_only = not (reading.trust and kwargs.get("weights_only") is False)
    try:
        return _load_ours(f, map_location, weights_only, reading)
    except UnsafeCheckpointError as exc:
        if reading.loader is not None:
            raise  # the loader words its own refusals
        # The reader's advice (weights_only=False) does not reach our files through this hook.
        raise UnsafeCheckpointError(
            f"{exc} (read through nvcomp_checkpoint's torch.load hook, which keeps weights-only rules for "
            "nvcomp-checkpoint files whatever weights_only the caller passes: allow the type with "
            "torch.serialization.add_safe_globals([...]), or, for a file you trust, use "
            "enable_torch_load(trust=True) / torch_load_reads_nvc(trust=True) / `nvckpt run --trust`)"
        ) from exc


def _install() -> None:
    """Put the wrapper in ``torch.load`` (under ``_LOCK``)."""
    global _original
    if torch.load is _wrapper:
        return
    _original = torch.load
    functools.update_wrapper(_wrapper, _original)
    torch.load = _wrapper


def _uninstall_if_unused() -> None:
    """Give ``torch.load`` back once neither the global switch nor any scope is on (under ``_LOCK``)."""
    if _global is None and _scopes == 0 and torch.load is _wrapper and _original is not None:
        torch.load = _original


def enable_torch_load(*, trust: bool = False, loader: PathLoader | None = None) -> None:
    """Make ``torch.load`` read our files in every thread of this process, until :func:`disable_torch_load`.

    For scripts and tools that load checkpoints with ``torch.load`` (evaluation scripts, converters,
    ``LightningModule.load_from_checkpoint``, a Trainer without our plugin). Other files go to
    the original ``torch.load`` unchanged.

    Args:
        trust: Our files are read with ``torch.load(weights_only=True)`` rules (torch's allow-list
            included) even where the caller passes ``weights_only=False``; with ``trust=True`` such a
            call unpickles arbitrary objects of our files, as ``torch.load`` does of its own.
        loader: As for :func:`torch_load_reads_nvc`.
    """
    global _global
    with _LOCK:
        _global = _Reading(trust, loader)
        _install()


def disable_torch_load() -> None:
    """Undo :func:`enable_torch_load`; ``torch.load`` is the original again unless a scope is open."""
    global _global
    with _LOCK:
        _global = None
        _uninstall_if_unused()


def torch_load_reads_nvc_now() -> bool:
    """Whether a ``torch.load`` called here now reads our files."""
    return torch.load is _wrapper and _in_force() is not None


@contextlib.contextmanager
def torch_load_reads_nvc(*, trust: bool = False, loader: PathLoader | None = None) -> Iterator[None]:
    """While the block runs, ``torch.load`` in this thread (or asyncio task) reads our files.

    Other threads are unaffected (unless :func:`enable_torch_load` is on); processes forked inside
    the block inherit it. Scopes nest; the innermost is in force.

    Args:
        trust: As for :func:`enable_torch_load`.
        loader: Reads one of our files given by path, as ``loader(path, map_location)``, for a
            weights-only load, and words its own errors; default :func:`nvcomp_checkpoint.load`.
            Streams always go to the default.
    """
    global _scopes
    with _LOCK:
        _scopes += 1
        _install()
    token = _scoped.set(_Reading(trust, loader))
    try:
        yield
    finally:
        _scoped.reset(token)
        with _LOCK:
            _scopes -= 1
            _uninstall_if_unused()
