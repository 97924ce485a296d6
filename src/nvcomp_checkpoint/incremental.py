"""Incremental saves of the files a framework names itself: which earlier file each save is a delta
against, and deletions deferred until no kept delta needs the file (what every integration shares).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import threading
from typing import Any, Callable, Iterable

from . import boundedjson
from .credentials import StorageOptions
from .delta import ChainPolicy, base_path_of, retained
from .errors import CheckpointError, UnsafePathError
from .filetype import HEAD_BYTES, NVCOMP, kind_of
from .reader import CheckpointReader
from .safepaths import inside_path
from .storage import LOCAL, is_url, list_names, storage_for

__all__ = ["IncrementalFiles", "DEFERRED_NAME", "unit_base_of", "keep_with_bases"]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: Names of files whose removal waits for the deltas that need them, per folder (read by the next process).
DEFERRED_NAME = ".nvckpt-deferred-removals.json"


def _any_file(path: str) -> bool:
    return True


def _dirname(path: str) -> str:
    return posixpath.dirname(path) if is_url(path) else os.path.dirname(os.path.abspath(path))


def _child(folder: str, name: str) -> str:
    return posixpath.join(folder, name) if is_url(folder) else os.path.join(folder, name)


def _basename(path: str) -> str:
    return posixpath.basename(path) if is_url(path) else os.path.basename(path)


def _norm(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


def _under(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it."""
    sep = "/" if is_url(folder) else os.sep
    return path == folder or path.startswith(folder.rstrip(sep) + sep)


class IncrementalFiles:
    """Bookkeeping of an integration's ``incremental=True``: bases, ``full_every`` counting, deferred deletion.

    Files are grouped in slots (Accelerate: one per file name of a ``save_state`` folder; Lightning:
    one for every ``.ckpt``); each save of a slot is a delta against the slot's previous save, a full
    file every ``full_every`` saves (:class:`~nvcomp_checkpoint.ChainPolicy`). The first save of a
    process is full, so a resumed run never depends on files it did not write.

    Args:
        owner: Names the integration in messages.
        policy: When a save of a slot is full, and its base otherwise (default: ``ChainPolicy()``, a full
            file every 10 saves); an integration's keywords become one by :func:`~nvcomp_checkpoint.delta.chain_policy_of`.
        can_be_base: False for paths the framework rewrites in place (Lightning's ``last.ckpt``):
            a file others depend on must not change.
        storage_options: fsspec options for URLs.
        keep_needed_folders: A folder asked to be removed waits, as a file does, while a kept delta needs a
            file in it (Lightning's DeepSpeed checkpoint folders, which ``ModelCheckpoint`` rotates knowing
            nothing of chains). Without it a folder goes at once: Accelerate's rotation keeps chains whole
            itself (:func:`keep_with_bases`).
    """

    def __init__(
        self,
        owner: str,
        policy: ChainPolicy | None = None,
        *,
        can_be_base: Callable[[str], bool] | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_needed_folders: bool = False,
    ) -> None:
        if policy is not None and not isinstance(policy, ChainPolicy):
            raise TypeError(f"{owner}: IncrementalFiles takes a ChainPolicy, got {type(policy).__name__}")
        self.policy = ChainPolicy() if policy is None else policy
        self.owner = owner
        self.can_be_base = can_be_base or _any_file
        self.storage_options = StorageOptions.of(storage_options)
        self.keep_needed_folders = keep_needed_folders
        self._history: dict[str, list[str]] = {}  # slot -> paths saved in its current chain
        self._written: set[str] = set()  # every path saved by this process (a second save rewrites it)
        self._doomed: set[str] = set()
        # Deleted by a call that deferred the real deletion (tier copies still reading it): listed until it is gone.
        self._going: set[str] = set()
        self._bases: dict[str, str | None] = {}  # what this process saved (or is saving) each path against
        self._loaded_dirs: set[str] = set()
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:  # Lightning sends plugins to spawned processes
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # -- saving ------------------------------------------------------------------------------
    def base_for(self, path: str | os.PathLike[str], slot: str = "") -> str | None:
        """The earlier file to save ``path`` against (None: save in full); call just before the save."""
        path = _norm(path)
        with self._lock:
            # Saved again: the framework keeps it (and the folder it is saved in) after all.
            self._doomed -= {d for d in self._doomed if _under(path, d)}
            self._going.discard(path)
            history = self._history.setdefault(slot, [])
            rewritten = path in self._written
            self._written.add(path)
            if rewritten:
                needed_by = [p for p in self._live() if p != path and path in self._chain(p)]
                if needed_by:
                    _LOG.warning(
                        "%s: %s is saved again while %s are deltas against it; those cannot be loaded until they "
                        "are saved again. Give files that are rewritten in place a name the can_be_base rule excludes.",
                        self.owner,
                        path,
                        ", ".join(needed_by),
                    )
            candidates = [p for p in history if p != path and self.can_be_base(p)]
            base = self.policy.base_for(candidates)
            if base is not None and (base in self._doomed or base not in self._written or path in self._chain(base)):
                # A delta cannot replace a file of its own chain, keep a removed file alive, or follow a deleted one.
                base = None
            if base is None:
                history.clear()
            if self.can_be_base(path) and not rewritten:
                history.append(path)
            self._bases[path] = base
            return base

    def failed(self, slot: str | None = None, path: str | os.PathLike[str] | None = None) -> None:
        """A save failed: the next save of ``slot`` (None: of every slot) is full.

        ``path``: the file that save was writing; what it was to be saved against is forgotten, so
        its chain is read from the file there (an earlier save of it, if any) again.
        """
        with self._lock:
            for s in [slot] if slot is not None else list(self._history):
                self._history.pop(s, None)
            if path is not None:
                self._bases.pop(_norm(path), None)

    # -- removing ----------------------------------------------------------------------------
    def remove(self, path: str | os.PathLike[str], delete: Callable[[str], None]) -> list[str]:
        """Delete ``path`` with ``delete`` once no kept delta needs it, and any earlier deferred file now free.

        Returns:
            The paths deleted now.
        """
        path = _norm(path)
        storage, spath = storage_for(path, self.storage_options)
        if storage.isdir(spath) and not self.keep_needed_folders:
            # A folder unit (Accelerate's save_state): its rotation already kept the folders that kept
            # deltas need (keep_with_bases), so it goes now.
            delete(path)
            return [path]
        with self._lock:
            self._load_deferred(_dirname(path))
            self._doomed.add(path)
            return self._collect(delete)

    def collect(self, delete: Callable[[str], None]) -> list[str]:
        """Delete the deferred files no kept delta needs any more (after a rewrite freed them)."""
        with self._lock:
            return self._collect(delete)

    @property
    def deferred(self) -> list[str]:
        """Files whose removal waits for a kept delta that needs them."""
        with self._lock:
            return sorted(self._doomed)

    def _collect(self, delete: Callable[[str], None]) -> list[str]:
        gone = {p for p in self._going if not self._exists(p)}  # deferred deletions that have run since
        self._going -= gone
        needed: set[str] = set()
        for p in self._live():
            needed.update(self._chain(p))

        def is_needed(p: str) -> bool:  # a folder is needed while a file in it is
            return any(_under(n, p) for n in needed)

        done = []
        for p in sorted(p for p in self._doomed if not is_needed(p)):
            try:
                delete(p)
            except FileNotFoundError:
                pass
            self._doomed.discard(p)
            # Deleted: it (and what was saved in it) no longer needs its bases. A path is in _written until
            # then so that a save that is not durable yet (async) counts as kept.
            for gone_path in [w for w in self._written | set(self._bases) if _under(w, p)]:
                self._written.discard(gone_path)
                self._bases.pop(gone_path, None)
            if self._exists(p):  # ``delete`` deferred it (tier copies read it): listed until it is gone
                self._going.add(p)
            done.append(p)
        kept = sorted(p for p in self._doomed if is_needed(p))
        if kept:
            _LOG.info("%s: keeping %s until the deltas that need them are removed", self.owner, ", ".join(kept))
        for folder in {_dirname(p) for p in [*done, *kept, *gone]}:
            self._store_deferred(folder)
        return done

    def _exists(self, path: str) -> bool:
        storage, spath = storage_for(path, self.storage_options)
        try:
            return storage.exists(spath)
        except OSError:
            return True  # unknown: keep it listed; the next process checks again

    def _live(self) -> list[str]:
        """Checkpoint files that are kept: this process's and those beside the deferred ones, not deferred."""
        folders = {_dirname(p) for p in self._doomed | self._written | self._going}
        found = set(self._written)
        for folder in folders:
            storage, root = storage_for(folder, self.storage_options)
            try:
                names = list_names(storage, root)
            except (FileNotFoundError, OSError):
                continue
            found.update(
                _child(folder, n) for n, d in names.items() if (self.keep_needed_folders or not d) and not n.startswith(".")
            )
        leaving = self._doomed | self._going
        return sorted(p for p in found if not any(_under(p, d) for d in leaving))

    def _chain(self, path: str) -> list[str]:
        """The bases ``path`` needs, nearest first (empty for a full file, a missing one or another kind of file)."""
        out: list[str] = []
        current = path
        while True:
            if current in self._bases:  # known before the file is durable (an async save)
                base = self._bases[current]
            elif not is_url(current) and os.path.isdir(current):
                base = unit_base_of(current, self.storage_options)  # a folder unit: read from its delta files
            else:
                try:
                    base = base_path_of(current, CheckpointReader, self.storage_options)
                except (CheckpointError, OSError, ValueError):
                    return out
            if base is None or base in out:
                return out
            base = _norm(base)
            out.append(base)
            current = base

    # The deferred set outlives the process: a resumed run deletes what the previous one had to keep.
    # One small JSON list per folder, written whole (a rename locally, a single PUT on an object store).
    def _load_deferred(self, folder: str) -> None:
        if folder in self._loaded_dirs:
            return
        self._loaded_dirs.add(folder)
        storage, _ = storage_for(folder, self.storage_options)
        try:
            with storage.open_read(_child(folder, DEFERRED_NAME)) as f:
                names = boundedjson.loads(f.read(), _child(folder, DEFERRED_NAME), "list of deferred deletions")
        except (FileNotFoundError, ValueError):
            return
        if isinstance(names, list):
            paths = []
            for n in names:
                # Files listed here are deleted later: only plain names of this folder are taken.
                try:
                    paths.append(
                        _child(folder, inside_path(n, where=_child(folder, DEFERRED_NAME), what="lists the file", single=True))
                    )
                except UnsafePathError as exc:
                    _LOG.warning("%s; the name is left out", exc)
            # A path this process saved again is its new file, not the one listed.
            self._doomed.update(p for p in paths if p not in self._written and storage.exists(p))

    def _store_deferred(self, folder: str) -> None:
        storage, _ = storage_for(folder, self.storage_options)
        names = sorted(_basename(p) for p in self._doomed | self._going if _dirname(p) == folder)
        target = _child(folder, DEFERRED_NAME)
        if not names:
            storage.remove(target)
            return
        with storage.open_write(target) as f:
            f.write(json.dumps(names).encode())


def unit_base_of(path: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """The unit a checkpoint file or folder (a ``save_state`` folder) is a delta against, or None.

    For a folder: the folder that holds the base of the first delta file in it at the same depth, whatever
    the file's name (DeepSpeed's rank files keep their ``.pt`` names) and however deep it lies (Lightning's
    DeepSpeed checkpoint folder holds the tag folder ``checkpoint/`` with the rank files).
    """
    path = _norm(path)
    if not is_url(path) and os.path.isdir(path):
        for rel in _files_below(path):
            full = os.path.join(path, rel)
            if rel.endswith(".nvc") or _is_ours(full):
                try:
                    base = base_path_of(full, CheckpointReader, storage_options)
                except (CheckpointError, OSError):
                    continue
                if base is not None:
                    unit = os.path.abspath(base)
                    for _ in range(rel.count(os.sep) + 1):
                        unit = os.path.dirname(unit)
                    return unit
        return None
    try:
        base = base_path_of(path, CheckpointReader, storage_options)
    except (CheckpointError, OSError):
        return None
    return None if base is None else _norm(base)


#: How deep :func:`unit_base_of` looks into a folder unit for a delta file.
_UNIT_DEPTH = 4


def _files_below(folder: str, depth: int = _UNIT_DEPTH) -> list[str]:
    """The files of ``folder`` as paths relative to it: its own first, then each subfolder's (sorted)."""
    try:
        with os.scandir(folder) as it:
            entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
    except OSError:
        return []
    files = [name for name, is_dir in entries if not is_dir]
    if depth > 1:
        for name, is_dir in entries:
            if is_dir:
                files.extend(os.path.join(name, rel) for rel in _files_below(os.path.join(folder, name), depth - 1))
    return files


def _is_ours(path: str) -> bool:
    """Whether the local file at ``path`` is one of this library's (by its first bytes)."""
    try:
        with LOCAL.open_read(path) as f:
            head = f.read(HEAD_BYTES)
        return kind_of(head, os.path.getsize(path)) == NVCOMP
    except (OSError, CheckpointError):  # a folder, a FIFO, a file gone meanwhile: not a delta of ours
        return False


def keep_with_bases(keep: Iterable[str], storage_options: dict[str, Any] | None = None) -> set[str]:
    """``keep`` and every unit a kept one needs, transitively (for a rotation: a chain goes as a whole)."""
    return set(retained([_norm(p) for p in keep], lambda p: unit_base_of(p, storage_options)))
