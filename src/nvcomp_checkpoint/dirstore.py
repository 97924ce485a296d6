"""A checkpoint directory committed as a whole: stage, fsync, manifest, commit, recover, rotate.

Used by the Accelerate integration (``save_state`` directories) and ``nvckpt compress/decompress``
of directories; every file operation goes through :mod:`nvcomp_checkpoint.storage`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from . import boundedjson
from .errors import CheckpointWriteError, ChecksumError, FormatError, MixedSaveError
from .filedigest import digest, index_digest
from .safepaths import inside_path
from .storage import LOCAL, temp_name
from .version import __version__

__all__ = [
    "DirectoryStore",
    "InstallError",
    "holds_cwd",
    "sync_tree",
    "rotate",
    "digest",
    "index_digest",
    "remove_quietly",
    "numbered_dirs",
    "STAGING_SUFFIX",
    "OLD_SUFFIX",
    "DELETING_SUFFIX",
    "MARKER_NAME",
    "write_marker",
]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: A short text file in a directory only this library can read: what its files are and what to call.
#: Other libraries' loaders fail on such a directory with their own "no model file" errors.
MARKER_NAME = "NVCOMP_CHECKPOINT.txt"

#: Suffixes of the temporary entries this module makes next to (or inside) a target.
STAGING_SUFFIX = ".nvckpt-staging"
OLD_SUFFIX = ".nvckpt-old"
DELETING_SUFFIX = ".nvckpt-deleting"


def sync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (deepest last), then ``root``'s parent."""
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            LOCAL.fsync(os.fspath(p))
    for d in sorted({p.parent for p in root.rglob("*")} | {root}):
        LOCAL.fsync(os.fspath(d))


class InstallError(CheckpointWriteError):
    """An in-place commit failed after it had begun to replace files."""


@dataclass(frozen=True)
class DirectoryStore:
    """Directories whose completeness is stated by a manifest file written last.

    Attributes:
        manifest_name: The manifest's file name inside each directory.
        format: The manifest's ``format`` field, checked on read.
        version: The newest manifest version this code writes and reads.
    """

    manifest_name: str
    format: str
    version: int = 1

    # -- staging ----------------------------------------------------------------------------
    @staticmethod
    def staging_path(target: Path, *, inside: bool = False) -> Path:
        """Where to stage a save of ``target``: next to it, or ``inside`` it for an in-place update
        (on the same file system as the files it replaces)."""
        return target / STAGING_SUFFIX if inside else target.parent / f".{target.name}{STAGING_SUFFIX}"

    @staticmethod
    def fresh(staging: Path) -> Path:
        """Make ``staging`` an empty directory (one left by a save that crashed is removed)."""
        LOCAL.remove(os.fspath(staging))
        LOCAL.makedirs(os.fspath(staging))
        return staging

    # -- the manifest -----------------------------------------------------------------------
    def write_manifest(self, staging: Path, fields: dict[str, Any], *, hashed: Callable[[Path], bool] = lambda p: True) -> None:
        """fsync every staged file, then write the manifest (names, sizes, digests) last.

        A file that is not ``hashed`` (an nvcomp-checkpoint file, whose frames carry checksums of
        their own) gets its index digest (:func:`index_digest`) instead: what tells it from the
        same file of another save, even one of the same size.
        """
        files: dict[str, dict[str, Any]] = {}
        for p in sorted(staging.rglob("*")):
            if p.is_file():
                rel = p.relative_to(staging).as_posix()
                files[rel] = {"bytes": p.stat().st_size, "blake2b": digest(p) if hashed(p) else None}
                if not hashed(p) and (identity := index_digest(p)) is not None:
                    files[rel]["index_xxh3"] = identity
        sync_tree(staging)
        manifest = {"format": self.format, "version": self.version, "nvcomp_checkpoint": __version__, **fields, "files": files}
        LOCAL.write_bytes(os.fspath(staging / self.manifest_name), json.dumps(manifest, indent=1, sort_keys=True).encode())
        LOCAL.fsync(os.fspath(staging))

    def read_manifest(self, path: Path, *, quiet: bool = False) -> dict[str, Any] | None:
        """The manifest of ``path``; ``None`` if it has none (``quiet``: also if it is damaged)."""
        file = path / self.manifest_name
        if not file.is_file():
            return None
        try:
            with LOCAL.open_read(os.fspath(file)) as f:
                manifest = boundedjson.loads(f.read().decode("utf-8"), os.fspath(file), "manifest")
            if not isinstance(manifest, dict) or manifest.get("format") != self.format:
                raise FormatError(f"{file}: not an nvcomp-checkpoint manifest of {self.format}; the directory is damaged")
            if manifest.get("version", 0) > self.version:
                raise FormatError(
                    f"{file}: written by a newer nvcomp-checkpoint (manifest version {manifest.get('version')}); "
                    "upgrade nvcomp-checkpoint to load it."
                )
            for name in manifest.get("files", {}):
                # A manifest only ever names files inside its own directory.
                inside_path(name, where=os.fspath(file), what="lists the file")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            if quiet:
                return None
            raise FormatError(f"{file}: unreadable manifest ({exc}); the directory is damaged, load another checkpoint") from exc
        except FormatError:
            if quiet:
                return None
            raise
        return manifest

    def check_files(self, path: Path, manifest: dict[str, Any], *, identities: bool = True) -> None:
        """Every file the manifest lists is there, with its size and digest (and, with ``identities``,
        its index digest: a process that does not read the nvcomp-checkpoint files, whose reader
        checks for it, opens none of them)."""
        for rel, info in manifest.get("files", {}).items():
            file = path / rel
            if not file.is_file():
                raise FormatError(
                    f"{file}: missing; the save of {path} wrote it ({self.manifest_name} lists it). Restore the file "
                    "or load another checkpoint."
                )
            size = file.stat().st_size
            if size != info["bytes"]:
                raise FormatError(
                    f"{file}: {size} bytes, but the save wrote {info['bytes']} (truncated or replaced). Restore the "
                    "file or load another checkpoint."
                )
            # Manifests written before index digests were recorded have none: size and checksums only.
            if identities and "index_xxh3" in info:
                self._check_identity(file, info["index_xxh3"])
            if info.get("blake2b") and digest(file) != info["blake2b"]:
                raise ChecksumError(
                    f"{file}: its contents differ from what the save wrote (checksum mismatch). Restore the file or "
                    "load another checkpoint."
                )

    def _check_identity(self, file: Path, recorded: Any) -> None:
        if not isinstance(recorded, int) or isinstance(recorded, bool):
            raise FormatError(
                f"{file.parent / self.manifest_name}: an invalid index digest for {file.name}; the directory is damaged"
            )
        found = index_digest(file)
        if found is None:
            raise FormatError(
                f"{file}: no nvcomp-checkpoint footer, but the save wrote one (damaged or replaced). Restore the file or load another checkpoint."
            )
        if found != recorded:
            raise MixedSaveError(
                f"{file}: belongs to another save (its index digest differs from the one {self.manifest_name} "
                "records: a file copied in from another checkpoint?). Restore this save's file or load another checkpoint."
            )

    def checked_manifest(
        self,
        path: Path,
        *,
        lists: Iterable[str] = (),
        orphans: str = "*.nvc",
        identities: bool = True,
    ) -> dict[str, Any] | None:
        """The manifest of ``path`` once every file it lists checks (:meth:`check_files`); ``None``
        for a directory that no save through this store wrote.

        Args:
            path: The directory to load.
            lists: Manifest fields holding lists of file names, each of which must be in its file list.
            orphans: A glob of files that only a save through this store writes: a directory holding
                some but no manifest is a save that did not complete.
            identities: Check the index digests too (see :meth:`check_files`).

        Raises:
            FormatError: The manifest or a file it lists is missing, damaged or altered (named).
            ChecksumError: A listed file's contents differ from what the save wrote.
            MixedSaveError: A listed nvcomp-checkpoint file is another save's (its index digest differs).
        """
        manifest = self.read_manifest(path)
        if manifest is None:
            if path.is_dir() and any(path.glob(orphans)):
                raise FormatError(
                    f"{path}: holds {orphans.lstrip('*')} files but no {self.manifest_name}: the save that wrote it did "
                    "not complete (or the manifest was deleted). Load an earlier checkpoint."
                )
            return None
        files = manifest.get("files", {})
        for name in [name for field in lists for name in manifest.get(field, [])]:
            if name not in files:
                raise FormatError(f"{path / self.manifest_name}: {name} is not in the file list; the directory is damaged")
        self.check_files(path, manifest, identities=identities)
        return manifest

    # -- whole directory, or file by file ------------------------------------------------------
    def shared_with_others(self, target: Path, saved: Callable[[str], bool]) -> bool:
        """Whether ``target`` must be updated file by file (:meth:`install_in_place`) instead of
        replaced as a whole (:meth:`commit`).

        Replacing a directory gives it a new inode and drops whatever it held: the process's
        working directory would vanish, and your own files in it (notes, a ``save_pretrained``
        folder, a project's sources) would be lost. Only a directory holding nothing but saved
        state (names for which ``saved`` is true, and what its manifest lists) is replaced.
        """
        if not target.is_dir():
            return False
        return target.is_symlink() or holds_cwd(target) or bool(self.foreign_entries(target, saved))

    def foreign_entries(self, target: Path, saved: Callable[[str], bool]) -> list[str]:
        """Entries of ``target`` that no save wrote: neither ``saved`` names nor listed in its manifest."""
        listed = set((self.read_manifest(target, quiet=True) or {}).get("files", {}))
        owned = {rel.split("/", 1)[0] for rel in listed}
        foreign = []
        for name in LOCAL.listdir(os.fspath(target)):
            if saved(name) or name == self.manifest_name:
                continue
            entry = target / name
            if entry.is_dir() and not entry.is_symlink():
                files = (p for p in entry.rglob("*") if not p.is_dir())
                mine = name in owned and all(p.relative_to(target).as_posix() in listed for p in files)
            else:  # a link to a folder is yours even if a save wrote into it
                mine = name in listed and not entry.is_dir()
            if not mine:
                foreign.append(name)
        return foreign

    # -- commit and recovery ------------------------------------------------------------------
    def publish(
        self,
        staging: Path,
        target: Path,
        fields: dict[str, Any],
        *,
        marker: str,
        saved: Callable[[str], bool],
        hashed: Callable[[Path], bool] = lambda p: True,
        first: Callable[[str], bool] = lambda name: False,
        obsolete: Callable[[dict[str, Any]], Iterable[str]] = lambda previous: (),
    ) -> dict[str, Any] | None:
        """Complete a staged save: the marker, the manifest (:meth:`write_manifest`), then ``target``.

        ``target`` is replaced as a whole (:meth:`commit`; the directory it replaced is deleted),
        unless ``staging`` is inside it or it is shared with others (:meth:`shared_with_others`,
        with ``saved``): then the staged entries are installed one by one (:meth:`install_in_place`,
        with ``first``), and ``obsolete(previous manifest)`` names the previous save's files to delete.

        Returns:
            The manifest ``target`` had when it was updated in place (``{}`` if none); ``None``
            when it was replaced as a whole.

        Raises:
            InstallError: An in-place update failed after it had begun (see :meth:`install_in_place`).
        """
        write_marker(staging, marker)
        self.write_manifest(staging, fields, hashed=hashed)
        # Checked at the commit: an async save commits later, and the cwd or the directory may have changed.
        if staging.parent == target or self.shared_with_others(target, saved):
            previous = self.read_manifest(target, quiet=True) or {}
            self.install_in_place(staging, target, first=first, obsolete=obsolete(previous))
            return previous
        replaced = self.commit(staging, target)  # the commit point: nothing after it can fail the save
        if replaced is not None:
            remove_quietly(replaced)  # the previous checkpoint; leftovers are cleaned next time
        return None

    def commit(self, staging: Path, target: Path) -> Path | None:
        """Put the complete staging directory at ``target`` in one step (the commit point).

        Replacing an existing directory is one ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere
        the old one is renamed aside first, and :meth:`recover` puts it back after a crash
        between the two renames.

        Returns:
            Where the replaced directory now is, for the caller to delete (``None`` if there was none).
        """
        if target.exists() and not target.is_dir():
            raise CheckpointWriteError(f"{target}: exists and is not a directory; give a directory path")
        parent = os.fspath(target.parent)
        if not target.exists():
            LOCAL.rename(os.fspath(staging), os.fspath(target))
            LOCAL.fsync(parent)
            return None
        if LOCAL.exchange(os.fspath(staging), os.fspath(target)):
            LOCAL.fsync(parent)
            return staging
        old = self.old_path(target)
        LOCAL.remove(os.fspath(old))
        LOCAL.rename(os.fspath(target), os.fspath(old))
        try:
            # A crash right here leaves only `old`; recover() renames it back.
            LOCAL.rename(os.fspath(staging), os.fspath(target))
        except BaseException:
            LOCAL.rename(os.fspath(old), os.fspath(target))
            raise
        LOCAL.fsync(parent)
        return old

    @staticmethod
    def old_path(target: Path) -> Path:
        return target.parent / f".{target.name}{OLD_SUFFIX}"

    def recover(self, target: Path) -> None:
        """Undo a replacement interrupted between its two renames (see :meth:`commit`)."""
        target = Path(os.path.abspath(target))  # "." has a name and a parent only as an absolute path
        old = self.old_path(target)
        if not old.exists():
            return
        with contextlib.suppress(FileNotFoundError):  # another process got there first
            if target.exists():
                LOCAL.remove(os.fspath(old))
            else:
                _LOG.warning("%s: restoring the checkpoint that an interrupted save moved to %s", target, old)
                LOCAL.rename(os.fspath(old), os.fspath(target))

    def install_in_place(self, staging: Path, target: Path, *, first: Callable[[str], bool], obsolete: Iterable[str]) -> None:
        """Move the staged entries into ``target`` one by one, each with an atomic rename.

        The previous manifest goes first and the new one last; entries for which ``first`` is true
        move before the others, and ``obsolete`` names (files of the previous save that this one
        does not write) are deleted before the new manifest lands. Other entries of ``target`` are
        left alone; folders are merged into, never replaced.

        Raises:
            InstallError: A rename failed after the first change (the directory has no manifest).
        """
        _check_conflicts(staging, target)  # before anything changes: the previous checkpoint stays whole
        new = set(LOCAL.listdir(os.fspath(staging)))
        try:
            if (target / self.manifest_name).exists():
                LOCAL.remove(os.fspath(target / self.manifest_name))
                LOCAL.fsync(os.fspath(target))
            for name in sorted(new - {self.manifest_name}, key=lambda n: (not first(n), n)):
                _move_entry(staging / name, target / name)
            for name in obsolete:
                if name not in new:
                    LOCAL.remove(os.fspath(target / name))
            LOCAL.fsync(os.fspath(target))
            _move_entry(staging / self.manifest_name, target / self.manifest_name)  # the commit point
            LOCAL.fsync(os.fspath(target))
        except OSError as exc:
            raise InstallError(str(exc)) from exc
        LOCAL.remove(os.fspath(staging))  # empty by now


def write_marker(directory: Path, text: str) -> None:
    """Write :data:`MARKER_NAME` into ``directory`` (atomically)."""
    LOCAL.write_bytes(os.fspath(directory / MARKER_NAME), text.encode("utf-8"))


def remove_quietly(path: Path) -> None:
    """Delete ``path`` if possible: a leftover is removed by the next save (a fresh staging directory, recovery)."""
    with contextlib.suppress(OSError):
        LOCAL.remove(os.fspath(path))


def holds_cwd(target: Path) -> bool:
    """True if ``target`` is the current working directory or one of its ancestors."""
    try:
        want = os.stat(target)
        path = os.path.realpath(os.getcwd())
    except OSError:  # the cwd is already gone: nothing left to protect
        return False
    while True:
        try:
            if os.path.samestat(os.stat(path), want):
                return True
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def numbered_dirs(folder: Path, number: Callable[[str], int | None]) -> list[tuple[int, Path]]:
    """The folders in ``folder`` that ``number`` numbers (``checkpoint-12`` -> 12), by number; hidden ones never."""
    names = LOCAL.listdir(os.fspath(folder)) if folder.is_dir() else []
    return sorted(
        (n, folder / name)
        for name in names
        if not name.startswith(".") and (n := number(name)) is not None and (folder / name).is_dir()
    )


def rotate(
    ordered: list[Path],
    limit: int,
    keep: Path,
    trash: Path,
    when: Callable[[Path, Callable[[], None]], Any] | None = None,
) -> None:
    """Delete the oldest of ``ordered`` (oldest first) beyond ``limit``, never ``keep``.

    Runs only after ``keep`` is committed. Each is moved into ``trash`` (a folder outside the
    rotated one) before removal, so a crash mid-delete never leaves a half-deleted checkpoint
    among the rotated ones. ``when(path, delete)``: runs each deletion, now or later (e.g. once
    the checkpoint's copies to storage tiers are done); default: now.
    """
    excess = len(ordered) - limit
    if excess <= 0:
        return
    _LOG.warning("Deleting %d checkpoints beyond total_limit=%d.", excess, limit)
    for old in [d for d in ordered if d != keep][:excess]:
        (when or _now)(old, functools.partial(_delete_checkpoint, old, trash))


def _now(path: Path, delete: Callable[[], None]) -> None:
    delete()


def _delete_checkpoint(old: Path, trash: Path) -> None:
    if not LOCAL.exists(os.fspath(old)):
        return  # a deferred deletion that an earlier rotation already ran
    doomed = trash / f".{old.name}{DELETING_SUFFIX}"
    try:
        LOCAL.remove(os.fspath(doomed))
        LOCAL.rename(os.fspath(old), os.fspath(doomed))
        LOCAL.remove(os.fspath(doomed))
    except OSError as exc:
        _LOG.warning("%s: could not delete this old checkpoint (%s); the new one is saved.", old, exc)


def _check_conflicts(staging: Path, target: Path) -> None:
    for root, dirs, files in os.walk(staging):
        rel = Path(root).relative_to(staging)
        for name in dirs:
            dst = target / rel / name
            if os.path.lexists(dst) and not dst.is_dir():
                raise CheckpointWriteError(f"{dst}: is a file, but this save writes a folder there; move the file away")
        for name in files:
            dst = target / rel / name
            if dst.is_dir():
                raise CheckpointWriteError(f"{dst}: is a folder, but this save writes a file there; move the folder away")


def _move_entry(src: Path, dst: Path) -> None:
    """Move one saved file, or the files of one saved folder, to ``dst``; each file in one rename."""
    if src.is_dir() and not src.is_symlink():
        if not dst.is_dir():  # an existing folder (or a link to one) is merged into
            LOCAL.makedirs(os.fspath(dst))
        for name in LOCAL.listdir(os.fspath(src)):
            _move_entry(src / name, dst / name)
        LOCAL.fsync(os.fspath(dst))
        LOCAL.remove(os.fspath(src))  # empty by now
        return
    try:
        LOCAL.rename(os.fspath(src), os.fspath(dst))
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        # dst is on another file system (a mount point or a link to a folder elsewhere): copy
        # next to it first, so that the rename that replaces it stays atomic.
        tmp = dst.with_name(temp_name(dst.name))
        try:
            LOCAL.copy(os.fspath(src), os.fspath(tmp))
            LOCAL.rename(os.fspath(tmp), os.fspath(dst))
        except BaseException:
            with contextlib.suppress(OSError):
                LOCAL.remove(os.fspath(tmp))
            raise
        LOCAL.remove(os.fspath(src))
