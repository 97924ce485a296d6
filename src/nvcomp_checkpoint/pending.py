"""Which async saves are pending, per file: ``save``, ``load`` and ``open`` of a path wait for them.

A registry below both the public API and the async saver, so that neither imports the other.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable, Protocol

from .deadline import Deadline
from .storage import is_url

__all__ = [
    "path_key",
    "register_saver",
    "unregister_saver",
    "savers",
    "register",
    "unregister",
    "pending_for",
    "on_saver_worker",
    "wait_for_saves",
    "wait_for_path",
    "has_pending_save",
    "reset_after_fork",
]


class _Saver(Protocol):
    def wait(self, path: str | os.PathLike[str] | None = None, timeout: float | None = None) -> None: ...
    def is_worker_thread(self) -> bool: ...
    def has_unseen_error(self, key: str) -> bool: ...


class _Handle(Protocol):
    key: str

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


_LOCK = threading.Lock()
_SAVERS: list[Any] = []
_PENDING: dict[str, list[Any]] = {}


def path_key(path: str | os.PathLike[str]) -> str:
    """One spelling per file, so that ``ckpt.nvc`` and ``./ckpt.nvc`` wait for each other."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if is_url(text):
        return text
    # Symlinks resolved: Lightning's save_last="link" reads a checkpoint through a link.
    return os.path.realpath(text)


def register_saver(saver: _Saver) -> None:
    with _LOCK:
        _SAVERS.append(saver)


def unregister_saver(saver: _Saver) -> None:
    with _LOCK:
        if saver in _SAVERS:
            _SAVERS.remove(saver)


def savers() -> list[Any]:
    with _LOCK:
        return list(_SAVERS)


def register(handle: _Handle) -> None:
    with _LOCK:
        if not handle.done():
            _PENDING.setdefault(handle.key, []).append(handle)


def unregister(handle: _Handle) -> None:
    with _LOCK:
        handles = _PENDING.get(handle.key, [])
        if handle in handles:
            handles.remove(handle)
        if not handles:
            _PENDING.pop(handle.key, None)


def pending_for(key: str) -> list[Any]:
    with _LOCK:
        return list(_PENDING.get(key, []))


def on_saver_worker() -> bool:
    """True on the worker thread of some saver (where its done callbacks run)."""
    return any(s.is_worker_thread() for s in savers())


def wait_for_saves(path: str | os.PathLike[str] | None = None, timeout: float | None = None) -> None:
    """Wait for every pending async save (or those to ``path``) of every saver; raise unseen errors.

    Call it before removing or rotating checkpoint files, or before moving a ``latest`` pointer.

    Raises:
        CheckpointWriteError: A save failed and nobody saw its error.
        TimeoutError: Saves still pending after ``timeout`` seconds.
    """
    deadline = Deadline(timeout, "wait_for_saves(timeout=...)")
    for saver in savers():
        saver.wait(path, deadline.left())


def has_pending_save(path: str | os.PathLike[str]) -> bool:
    """True while an async save to ``path`` (of any saver) is snapshotted but not yet durable.

    For code that decides a file name by looking for the file on disk: a pending save has not
    created it yet.
    """
    with _LOCK:
        return bool(_PENDING.get(path_key(path)))


def wait_for_path(path: str | os.PathLike[str], *, raise_errors: bool = True) -> None:
    """Wait for pending async saves to ``path`` (used by ``save``, ``load`` and ``open``).

    Args:
        path: The checkpoint file.
        raise_errors: Raise a failed save's error (and count it as seen); with False, only wait.

    Raises:
        CheckpointWriteError: A save to ``path`` failed and nobody saw its error.
    """
    key = path_key(path)
    if not raise_errors:
        if on_saver_worker():
            return  # never wait on the thread that must finish it
        for handle in pending_for(key):
            handle.wait()
        return
    with _LOCK:
        idle = key not in _PENDING
        candidates: Iterable[Any] = list(_SAVERS)
    if idle and not any(s.has_unseen_error(key) for s in candidates):
        return  # the common case: nothing pending, no lock held beyond this check
    wait_for_saves(path)


def reset_after_fork() -> None:
    """In a forked child: no save of the parent is pending there."""
    global _LOCK
    _LOCK = threading.Lock()
    _PENDING.clear()
