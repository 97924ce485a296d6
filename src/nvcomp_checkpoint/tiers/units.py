"""The units of a tier (one step's file or folder) and their manifests, the commit point of a copy.

:class:`TierStore` lists, reads, checks, writes and removes the committed units of one tier root.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .. import boundedjson
from ..errors import CheckpointError, FormatError, NestingLimitError, TierNotFoundError, TierUnavailableError, UnsafePathError
from ..filedigest import index_digest
from ..reader import CheckpointReader
from ..safepaths import inside_path
from ..storage import Storage, abort_unfinished_uploads, is_temp_name, list_names, storage_for, write_errors
from .schedule import Tier

__all__ = ["FileEntry", "UnitManifest", "TierStore", "open_tier", "MANIFEST_SUFFIX", "COPY_CHUNK_BYTES"]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: Bytes read and written per step of a copy: memory stays at this plus the object store's part.
COPY_CHUNK_BYTES = 8 << 20
MANIFEST_SUFFIX = ".manifest.json"
UNIT_RE = re.compile(r"^step-(\d+)(\.nvc)?$")
MANIFEST_RE = re.compile(r"^step-(\d+)" + re.escape(MANIFEST_SUFFIX) + "$")
MANIFEST_FORMAT = "nvckpt-unit"
#: Characters of a storage error quoted in a message.
QUOTE_CHARS = 300


def quote(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


def unit_name(step: int, directory: bool) -> str:
    return f"step-{step:010d}" + ("" if directory else ".nvc")


@dataclass(frozen=True)
class FileEntry:
    """One file of a unit: its path inside the unit (``""`` for a single-file unit) and checks."""

    path: str
    size: int
    index_xxh3: int | None = None  # nvcomp-checkpoint files: the footer's digest of the index
    xxh3: int | None = None  # the whole file's xxh3-64, where it was read in full


@dataclass(frozen=True)
class UnitManifest:
    """What a tier holds for one step: written last, after the copy is checked, it is the commit point."""

    step: int
    directory: bool
    light: bool
    files: tuple[FileEntry, ...]
    created: float
    #: The step this unit is a delta against (an incremental save), None for a full checkpoint.
    base: int | None = None
    #: Where the unit's bytes are when a framework wrote them itself (see :meth:`CheckpointManager.adopt`);
    #: never stored: a committed copy lives at its tier's own path.
    source: str | None = field(default=None, compare=False)

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def unit(self) -> str:
        """The unit's name on a tier (``step-0000000300.nvc``, or the folder name of a directory unit)."""
        return unit_name(self.step, self.directory)

    def to_json(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "step": self.step,
            "unit": self.unit,
            "directory": self.directory,
            "light": self.light,
            "created": self.created,
            "files": [{"path": f.path, "size": f.size, "index_xxh3": f.index_xxh3, "xxh3": f.xxh3} for f in self.files],
        }
        if self.base is not None:
            doc["base"] = self.base
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "UnitManifest":
        try:
            doc = boundedjson.loads(data, where, "unit manifest")
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError("not a unit manifest")
            files = tuple(FileEntry(str(f["path"]), int(f["size"]), f.get("index_xxh3"), f.get("xxh3")) for f in doc["files"])
            base = doc.get("base")
            m = cls(
                int(doc["step"]),
                bool(doc["directory"]),
                bool(doc["light"]),
                files,
                float(doc["created"]),
                base=None if base is None else int(base),
            )
        except NestingLimitError:
            raise  # names the file and the depth already
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{where}: damaged unit manifest ({exc})") from exc
        for f in m.files:
            # The one place a unit's file paths are read: every copy, check, listing and fetch joins them.
            if m.directory:
                inside_path(f.path, where=where, what=f"names, as a file of directory unit {m.unit},")
            elif f.path:
                # The unit is one file: a path would be joined below the file's own name.
                raise UnsafePathError(
                    f"{where}: names the file {f.path[:200]!r} in the single-file unit {m.unit}, whose one file has no "
                    "path of its own; the manifest is forged or damaged"
                )
        # Manifests written before the unit's name was recorded have none; their step is still checked.
        if "unit" in doc and doc["unit"] != m.unit:
            raise FormatError(
                f"{where}: names unit {str(doc['unit'])[:80]}, but its step {m.step} is unit {m.unit} (edited or forged)"
            )
        return m


def join_path(root: str, name: str) -> str:
    return f"{root}/{name}" if root != "/" else f"/{name}"


def entry_path(unit: str, entry: FileEntry) -> str:
    return join_path(unit, entry.path) if entry.path else unit


class TierStore:
    """The committed units of one tier root: list, read, check, write and remove them."""

    def __init__(self, tier: Tier, label: str) -> None:
        self.tier = tier
        self.label = label
        self.storage: Storage
        self.storage, self.root = storage_for(tier.url, tier.storage_options)
        self.write_storage: Storage = storage_for(tier.url, tier.write_options())[0]

    # -- names --------------------------------------------------------------------------------
    def unit_path(self, step: int, directory: bool) -> str:
        return join_path(self.root, unit_name(step, directory))

    def manifest_path(self, step: int) -> str:
        return join_path(self.root, f"step-{step:010d}{MANIFEST_SUFFIX}")

    def file_path(self, manifest: UnitManifest, entry: FileEntry) -> str:
        unit = self.unit_path(manifest.step, manifest.directory)
        return join_path(unit, entry.path) if entry.path else unit

    def source_path(self, manifest: UnitManifest, entry: FileEntry) -> str:
        """Where a copy reads ``entry`` from: the adopted file or folder, else this tier's own path."""
        if manifest.source is None:
            return self.file_path(manifest, entry)
        return join_path(manifest.source, entry.path) if entry.path else manifest.source

    # -- listing ------------------------------------------------------------------------------
    def unavailable(self, exc: BaseException) -> TierUnavailableError:
        """The error for this tier not answering (``exc``): what it holds is unknown."""
        return TierUnavailableError(
            f"{self.label} ({self.root}) cannot be listed ({quote(exc)}); what it holds is unknown, so nothing is "
            "taken from it or removed there: retry once it answers, or leave the tier out"
        )

    def names(self) -> dict[str, bool]:
        """The entries of the tier root (``{name: is_folder}``); an empty one for a root not created yet.

        Raises:
            TierNotFoundError: The root's bucket does not exist (a configuration error).
            TierUnavailableError: The tier cannot be listed (unreachable, access denied ...).
        """
        try:
            names = list_names(self.storage, self.root)
            if not names:
                self._check_bucket()
        except TierUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to list means: unknown, never empty
            raise self.unavailable(exc) from exc
        return names

    def _check_bucket(self) -> None:
        """An empty listing is an empty prefix of a bucket that exists, or an error naming the bucket."""
        if "://" not in self.root:
            return  # a local folder not created yet
        # None: a store whose buckets cannot be told apart from an empty prefix (taken as empty).
        if self.storage.bucket_exists(self.root) is False:
            bucket = self.root.split("://", 1)[1].split("/", 1)[0]
            raise TierNotFoundError(
                f"{self.label} ({self.root}): the bucket {bucket!r} does not exist (or not at this endpoint, for these "
                "credentials); create it, or correct the tier's URL or storage_options"
            )

    def steps(self) -> list[int]:
        """Steps whose manifest is committed, oldest first (raises :class:`TierUnavailableError` as :meth:`names`)."""
        return sorted(int(m.group(1)) for n in self.names() if (m := MANIFEST_RE.match(n)))

    def manifest(self, step: int) -> UnitManifest | None:
        """The manifest committed for ``step`` (None: none is).

        Raises:
            FormatError: It is damaged, or it is another step's (a unit copied under another step's name).
        """
        path = self.manifest_path(step)
        try:
            with self.storage.open_read(path) as f:
                data = f.read(1 << 24)
        except FileNotFoundError:
            return None
        except IsADirectoryError as exc:  # damage, not an outage: the step is left out, the tier still listed
            raise FormatError(f"{path}: is a directory, not a unit manifest; the step is not used") from exc
        m = UnitManifest.from_json(data, path)
        if m.step != step:
            raise FormatError(
                f"{path}: records step {m.step} under the name of step {step} (a unit copied or renamed under another "
                "step's name); not used"
            )
        return m

    def listing(self) -> tuple[dict[int, UnitManifest], dict[int, str]]:
        """The committed manifests by step, and why each manifest that does not check is left out.

        Raises:
            TierUnavailableError: The tier, or one of its manifests, cannot be read.
        """
        out, problems = {}, {}
        for step in self.steps():
            try:
                m = self.manifest(step)
            except FormatError as exc:
                problems[step] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - unreadable is not absent
                raise self.unavailable(exc) from exc
            if m is not None:
                out[step] = m
        return out, problems

    def manifests(self) -> dict[int, UnitManifest]:
        """The committed manifests by step; one that does not check is left out, with a warning."""
        out, problems = self.listing()
        for why in problems.values():
            _LOG.warning("%s: %s; the step is not listed", self.label, why)
        return out

    # -- writing ------------------------------------------------------------------------------
    def write_manifest(self, manifest: UnitManifest) -> None:
        path = self.manifest_path(manifest.step)
        with write_errors(path, "committing the unit manifest"):
            with self.storage.open_write(path) as f:
                f.write(manifest.to_json())

    def remove_unit(self, step: int, directory: bool | None = None) -> None:
        """Unlist the step first (its manifest goes), then remove its bytes."""
        self.storage.remove(self.manifest_path(step))
        for d in (True, False) if directory is None else (directory,):
            self.storage.remove(self.unit_path(step, d))

    def clean_leftovers(self) -> list[str]:
        """Remove what interrupted saves and copies left: temporary files, unlisted units, unfinished uploads."""
        removed = abort_unfinished_uploads(self.storage, self.root + "/")
        names = list_names(self.storage, self.root)
        committed = {int(m.group(1)) for n in names if (m := MANIFEST_RE.match(n))}
        for name in names:
            m = UNIT_RE.match(name)
            leftover = (
                (m is not None and int(m.group(1)) not in committed)
                or (name.startswith((".step-", "step-")) and ".tmp-" in name)
                or is_temp_name(name)
            )
            if leftover:
                self.storage.remove(join_path(self.root, name))
                removed.append(join_path(self.root, name))
        for step in committed:
            if not any(n in names for n in (f"step-{step:010d}", f"step-{step:010d}.nvc")):
                self.storage.remove(self.manifest_path(step))  # a unit removed by hand
                removed.append(self.manifest_path(step))
        return removed

    # -- checks -------------------------------------------------------------------------------
    def describe(
        self, step: int, directory: bool, light: bool, source: str | None = None, base: int | None = None
    ) -> UnitManifest:
        """The manifest of a unit just written to this tier by a save (tier 0), or at ``source``."""
        unit = self.unit_path(step, directory) if source is None else source
        entries = []
        if directory:
            rels = walk_files(self.storage, unit)
            if not rels:
                raise CheckpointError(
                    f"{unit}: the directory for step {step} is empty or missing; write the unit before commit()"
                )
        else:
            rels = [""]
        for rel in rels:
            path = join_path(unit, rel) if rel else unit
            size = self.storage.size(path)
            digest = index_digest(path, storage=self.storage, size=size)
            whole = None if digest is not None else file_xxh3(self.storage, path)
            entries.append(FileEntry(rel, size, digest, whole))
        return UnitManifest(step, directory, light, tuple(entries), time.time(), base=base, source=source)

    def _check_recorded_step(self, manifest: UnitManifest, path: str) -> None:
        """The step the file records itself (the manager's saves: ``nvckpt_step``) must be the manifest's."""
        try:
            with CheckpointReader(path, storage_options=self.tier.storage_options) as reader:
                meta = reader.metadata
        except (CheckpointError, OSError) as exc:
            raise FormatError(f"{path}: its index cannot be read ({quote(exc)})") from exc
        if "nvckpt_step" not in meta:
            return  # a file written by someone else (adopted), or before steps were recorded: the manifest's checks stand
        recorded = meta["nvckpt_step"]
        if recorded != manifest.step or isinstance(recorded, bool):
            raise FormatError(
                f"{path}: the file records step {str(recorded)[:40]}, its manifest step {manifest.step} (a file put under "
                "another step's name); not used"
            )

    def check(self, manifest: UnitManifest, *, full: bool = False, at: str | None = None) -> None:
        """Raise :class:`FormatError` unless every file has its size and digest (``full``: every byte).

        ``at``: the unit is there (a restore folder) instead of at its own path on this tier.
        """
        for entry in manifest.files:
            path = self.file_path(manifest, entry) if at is None else entry_path(at, entry)
            try:
                size = self.storage.size(path)
            except FileNotFoundError as exc:
                raise FormatError(f"{path}: missing (step {manifest.step} is listed but its file is gone)") from exc
            if size != entry.size:
                raise FormatError(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or replaced)")
            if entry.index_xxh3 is not None and index_digest(path, storage=self.storage, size=size) != entry.index_xxh3:
                raise FormatError(f"{path}: the index digest differs from the manifest's (damaged or replaced)")
            if entry.xxh3 is not None and (full or entry.index_xxh3 is None) and file_xxh3(self.storage, path) != entry.xxh3:
                raise FormatError(f"{path}: checksum mismatch against the manifest (damaged copy)")
            if not manifest.directory and entry.index_xxh3 is not None:
                self._check_recorded_step(manifest, path)


def is_folder(storage: Storage, path: str) -> bool:
    return storage.isdir(path)


def walk_files(storage: Storage, root: str, prefix: str = "") -> list[str]:
    out = []
    for name, is_dir in sorted(list_names(storage, join_path(root, prefix) if prefix else root).items()):
        rel = f"{prefix}/{name}" if prefix else name
        out.extend(walk_files(storage, root, rel) if is_dir else [rel])
    return out


def file_xxh3(storage: Storage, path: str) -> int:
    h = xxhash.xxh3_64()
    with storage.open_read(path) as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            h.update(chunk)
    return h.intdigest()


def open_tier(url: str, storage_options: dict[str, Any] | None = None, name: str | None = None) -> TierStore:
    """A :class:`TierStore` for a tier root URL (the CLI lists and syncs with it)."""
    tier = Tier(url, name=name, storage_options=storage_options)
    return TierStore(tier, name or tier.url)
