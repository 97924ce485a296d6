"""Storage tiers: every save lands on a fast tier, verified copies of the compressed file flow to slower ones.

:class:`CheckpointManager` owns the schedules, the background copies, retention per tier and a
restore that falls back across tiers and steps. The layout and commit rules are in ``docs/tiers.md``.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import queue
import re
import tempfile
import threading
import uuid
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, TypeVar

import xxhash

from . import metrics
from .api import load as _load
from .api import save as _save_sync
from .async_save import save_async as _save_async
from .delta import ChainPolicy, retained
from .errors import CheckpointError, CheckpointWriteError, CopyTimeoutError, FormatError, TierNotFoundError, TierUnavailableError
from .format.layout import FOOTER, FOOTER_MAGIC, MAGIC, unpack_footer
from .policy import CodecPolicy, Component, classify
from .reader import CheckpointReader
from .storage import (
    LOCAL, LocalStorage, Storage, abort_unfinished_uploads, is_storage_error, is_temp_name, is_url, list_names, local_lock, storage_for,
    upload_file, write_errors,
)

__all__ = [
    "Tier",
    "CheckpointManager",
    "Restored",
    "NotCopied",
    "TierCopies",
    "UnitManifest",
    "FileEntry",
    "TierStore",
    "chain_layout",
    "copy_unit",
    "light_tree",
    "retained_steps",
    "open_tier",
    "verify_unit",
]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: Bytes read and written per step of a copy: memory stays at this plus the object store's part.
COPY_CHUNK_BYTES = 8 << 20
MANIFEST_SUFFIX = ".manifest.json"
#: How much nicer than the process a copy thread runs (Linux schedules threads by their own nice value).
COPY_NICE = 10
_UNIT_RE = re.compile(r"^step-(\d+)(\.nvc)?$")
_MANIFEST_RE = re.compile(r"^step-(\d+)" + re.escape(MANIFEST_SUFFIX) + "$")
_MANIFEST_FORMAT = "nvckpt-unit"
#: Default seconds :meth:`CheckpointManager.restore` (and ``locate``, ``resume_path``) waits for the tiers'
#: listings; a tier not listed by then is unavailable (never taken for an empty one).
RESTORE_TIMEOUT_S = 120.0
#: Default seconds :meth:`CheckpointManager.wait` and :meth:`~CheckpointManager.close` wait for saves and copies.
CLOSE_TIMEOUT_S = 600.0
#: Characters of a storage error quoted in a message.
_QUOTE = 300

_K = TypeVar("_K")


class _Deadline:
    """One point in time that several waits share (``None``: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and not seconds >= 0:
            raise ValueError(f"timeout must be a non-negative number of seconds or None, got {seconds!r}")
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def _run_within(calls: dict[_K, Callable[[], Any]], deadline: _Deadline, name: str) -> dict[_K, tuple[Any, BaseException | None]]:
    """Run each call on a daemon thread of its own; ``(result, exception)`` of those that returned by the deadline.

    A call still running then is left out and left to finish on its own: a storage client whose
    own retries cannot be bounded (s3fs retries a read timeout for minutes) never holds the caller
    past the deadline, and the thread, a daemon, never holds the process at exit.
    """
    results: dict[_K, tuple[Any, BaseException | None]] = {}
    done = threading.Condition()

    def run(key: _K, fn: Callable[[], Any]) -> None:
        try:
            out: tuple[Any, BaseException | None] = (fn(), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out = (None, exc)
        with done:
            results[key] = out
            done.notify_all()

    for key, fn in calls.items():
        threading.Thread(target=run, args=(key, fn), name=f"nvckpt-{name}", daemon=True).start()
    with done:
        while len(results) < len(calls):
            left = deadline.left()
            if left == 0:
                break
            done.wait(left)
        return dict(results)


def _quote(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _QUOTE else text[: _QUOTE - 3] + "..."


def _is_damage(exc: BaseException) -> bool:
    """Whether a failed restore of a copy says the copy is bad, as opposed to its storage not answering."""
    if isinstance(exc, TierUnavailableError) or not isinstance(exc, CheckpointError):
        return False
    cause = exc.__cause__
    return cause is None or isinstance(cause, (FileNotFoundError, CheckpointError)) or not is_storage_error(cause)


def _unit_name(step: int, directory: bool) -> str:
    return f"step-{step:010d}" + ("" if directory else ".nvc")


@dataclass(frozen=True)
class Tier:
    """One place checkpoints are kept, with its schedule and retention.

    Args:
        url: A local folder or an fsspec URL (``s3://bucket/run1``); steps are stored under it.
        every_steps: A copy is due for every step that is a multiple of this.
        every_minutes: A copy is due once this many minutes passed since the last copy.
            With neither, every save is copied. Tier 0 takes every save and accepts neither.
            Either way, :meth:`CheckpointManager.close` copies the run's newest step to a tier
            whose schedule skipped it.
        keep: Newest steps kept (``None``: all).
        keep_every_steps: Also keep every step that is a multiple of this.
        name: Label in logs, metrics and ``nvckpt ls`` (default ``tier{i}``).
        storage_options: fsspec options (endpoint, credentials ...).
        part_size: Multipart upload part size on object stores (memory per upload in flight).
        retries: Attempts of a failed copy after the first.
        backoff_s: Wait before the first retry; doubled for each further one.
        max_queued: Copies waiting for this tier beyond the one running; a due copy that
            finds the queue full is skipped with a warning (training never waits for a copy).
        upload_concurrency: Parts uploaded at once from a local tier to an object store
            (memory in flight: ``part_size * upload_concurrency``).
    """

    url: str
    every_steps: int | None = None
    every_minutes: float | None = None
    keep: int | None = None
    keep_every_steps: int | None = None
    name: str | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False)
    part_size: int = 100 << 20
    retries: int = 3
    backoff_s: float = 1.0
    max_queued: int = 1
    upload_concurrency: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", os.fspath(self.url).rstrip("/") or "/")
        for name in ("every_steps", "keep", "keep_every_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Tier({self.url!r}): {name} must be a positive integer or None, got {value!r}")
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ValueError(f"Tier({self.url!r}): every_minutes must be positive or None, got {self.every_minutes!r}")
        if self.part_size < 5 << 20:
            raise ValueError(f"Tier({self.url!r}): part_size must be at least 5 MiB (S3's smallest part), got {self.part_size}")
        if self.retries < 0 or self.backoff_s < 0 or self.max_queued < 1 or self.upload_concurrency < 1:
            raise ValueError(f"Tier({self.url!r}): retries and backoff_s must be >= 0, max_queued and upload_concurrency >= 1")

    def write_options(self) -> dict[str, Any] | None:
        """The fsspec options for writing: the part size as the object store's block size.

        Reads use ``storage_options`` as given: a 100 MB block would make every small read
        (a footer, a manifest) fetch that much.
        """
        if not is_url(self.url):
            return self.storage_options
        return {"default_block_size": self.part_size, **(self.storage_options or {})}


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
        return _unit_name(self.step, self.directory)

    def to_json(self) -> bytes:
        doc = {
            "format": _MANIFEST_FORMAT, "version": 1, "step": self.step, "unit": self.unit, "directory": self.directory,
            "light": self.light, "created": self.created,
            "files": [{"path": f.path, "size": f.size, "index_xxh3": f.index_xxh3, "xxh3": f.xxh3} for f in self.files],
        }
        if self.base is not None:
            doc["base"] = self.base
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "UnitManifest":
        try:
            doc = json.loads(data)
            if doc.get("format") != _MANIFEST_FORMAT:
                raise ValueError("not a unit manifest")
            files = tuple(FileEntry(str(f["path"]), int(f["size"]), f.get("index_xxh3"), f.get("xxh3")) for f in doc["files"])
            base = doc.get("base")
            m = cls(
                int(doc["step"]), bool(doc["directory"]), bool(doc["light"]), files, float(doc["created"]),
                base=None if base is None else int(base),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{where}: damaged unit manifest ({exc})") from exc
        # Manifests written before the unit's name was recorded have none; their step is still checked.
        if "unit" in doc and doc["unit"] != m.unit:
            raise FormatError(f"{where}: names unit {str(doc['unit'])[:80]}, but its step {m.step} is unit {m.unit} (edited or forged)")
        return m


@dataclass(frozen=True)
class Restored:
    """The result of :meth:`CheckpointManager.restore`.

    Attributes:
        step: The step restored.
        state: The loaded tree (``None`` for a directory unit restored without a ``loader``).
        tier: Index of the tier it came from.
        tier_name: That tier's name.
        path: Where the copy lives.
        light: True for a weights-only save.
        skipped: ``(step, tier name, reason)`` for every newer or faster copy passed over
            (step ``-1`` for a tier that could not be listed).
        abandoned: ``(step, tier name)`` of each newer step the run does not resume from (light,
            damaged, or not asked for): each save of this run removes those above its step (tier 0
            at the save, another tier at the save's copy). Newer steps that could not be read
            (their storage did not answer) are not among them: they are kept.
    """

    step: int
    state: Any
    tier: int
    tier_name: str
    path: str
    light: bool
    skipped: tuple[tuple[int, str, str], ...] = ()
    abandoned: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class NotCopied:
    """A copy that :meth:`CheckpointManager.wait` or :meth:`~CheckpointManager.close` gave up waiting for.

    Attributes:
        step: The step.
        tier: The name of the tier it was going to (tier 0's name for a save still being written).
        path: Where the step still is (its tier-0 unit, or the file or folder it was adopted from).
        state: ``"saving"`` (tier 0 not durable yet), ``"copying"``, ``"queued"`` or ``"not started"``.
    """

    step: int
    tier: str
    path: str
    state: str


def _join(root: str, name: str) -> str:
    return f"{root}/{name}" if root != "/" else f"/{name}"


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
        return _join(self.root, _unit_name(step, directory))

    def manifest_path(self, step: int) -> str:
        return _join(self.root, f"step-{step:010d}{MANIFEST_SUFFIX}")

    def file_path(self, manifest: UnitManifest, entry: FileEntry) -> str:
        unit = self.unit_path(manifest.step, manifest.directory)
        return _join(unit, entry.path) if entry.path else unit

    def source_path(self, manifest: UnitManifest, entry: FileEntry) -> str:
        """Where a copy reads ``entry`` from: the adopted file or folder, else this tier's own path."""
        if manifest.source is None:
            return self.file_path(manifest, entry)
        return _join(manifest.source, entry.path) if entry.path else manifest.source

    # -- listing ------------------------------------------------------------------------------
    def unavailable(self, exc: BaseException) -> TierUnavailableError:
        """The error for this tier not answering (``exc``): what it holds is unknown."""
        return TierUnavailableError(
            f"{self.label} ({self.root}) cannot be listed ({_quote(exc)}); what it holds is unknown, so nothing is "
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
        fs = getattr(self.storage, "fs", None)
        if fs is None or not hasattr(fs, "call_s3") or "://" not in self.root:
            return  # a local folder not created yet, or a store whose buckets this cannot tell apart
        bucket = self.root.split("://", 1)[1].split("/", 1)[0]
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError as exc:
            raise TierNotFoundError(
                f"{self.label} ({self.root}): the bucket {bucket!r} does not exist (or not at this endpoint, for these "
                "credentials); create it, or correct the tier's URL or storage_options"
            ) from exc

    def steps(self) -> list[int]:
        """Steps whose manifest is committed, oldest first (raises :class:`TierUnavailableError` as :meth:`names`)."""
        return sorted(int(m.group(1)) for n in self.names() if (m := _MANIFEST_RE.match(n)))

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
        for d in ((True, False) if directory is None else (directory,)):
            self.storage.remove(self.unit_path(step, d))

    def clean_leftovers(self) -> list[str]:
        """Remove what interrupted saves and copies left: temporary files, unlisted units, unfinished uploads."""
        removed = abort_unfinished_uploads(self.storage, self.root + "/")
        names = list_names(self.storage, self.root)
        committed = {int(m.group(1)) for n in names if (m := _MANIFEST_RE.match(n))}
        for name in names:
            m = _UNIT_RE.match(name)
            leftover = (m is not None and int(m.group(1)) not in committed) or (
                name.startswith((".step-", "step-")) and ".tmp-" in name
            ) or is_temp_name(name)
            if leftover:
                self.storage.remove(_join(self.root, name))
                removed.append(_join(self.root, name))
        for step in committed:
            if not any(n in names for n in (f"step-{step:010d}", f"step-{step:010d}.nvc")):
                self.storage.remove(self.manifest_path(step))  # a unit removed by hand
                removed.append(self.manifest_path(step))
        return removed

    # -- checks -------------------------------------------------------------------------------
    def describe(self, step: int, directory: bool, light: bool, source: str | None = None, base: int | None = None) -> UnitManifest:
        """The manifest of a unit just written to this tier by a save (tier 0), or at ``source``."""
        unit = self.unit_path(step, directory) if source is None else source
        entries = []
        if directory:
            rels = _walk(self.storage, unit)
            if not rels:
                raise CheckpointError(f"{unit}: the directory for step {step} is empty or missing; write the unit before commit()")
        else:
            rels = [""]
        for rel in rels:
            path = _join(unit, rel) if rel else unit
            size = self.storage.size(path)
            digest = _index_digest(self.storage, path, size)
            whole = None if digest is not None else _file_xxh3(self.storage, path)
            entries.append(FileEntry(rel, size, digest, whole))
        return UnitManifest(step, directory, light, tuple(entries), time.time(), base=base, source=source)

    def _check_recorded_step(self, manifest: UnitManifest, path: str) -> None:
        """The step the file records itself (the manager's saves: ``nvckpt_step``) must be the manifest's."""
        try:
            with CheckpointReader(path, storage_options=self.tier.storage_options) as reader:
                meta = reader.metadata
        except (CheckpointError, OSError) as exc:
            raise FormatError(f"{path}: its index cannot be read ({_quote(exc)})") from exc
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
            path = self.file_path(manifest, entry) if at is None else _at(at, entry)
            try:
                size = self.storage.size(path)
            except FileNotFoundError as exc:
                raise FormatError(f"{path}: missing (step {manifest.step} is listed but its file is gone)") from exc
            if size != entry.size:
                raise FormatError(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or replaced)")
            if entry.index_xxh3 is not None and _index_digest(self.storage, path, size) != entry.index_xxh3:
                raise FormatError(f"{path}: the index digest differs from the manifest's (damaged or replaced)")
            if entry.xxh3 is not None and (full or entry.index_xxh3 is None) and _file_xxh3(self.storage, path) != entry.xxh3:
                raise FormatError(f"{path}: checksum mismatch against the manifest (damaged copy)")
            if not manifest.directory and entry.index_xxh3 is not None:
                self._check_recorded_step(manifest, path)


#: How many folders up (``../``) the base names of a chain laid out for a restore may reach.
_LAYOUT_DEPTH = 16


def chain_layout(store: TierStore, manifest: UnitManifest, manifests: dict[int, UnitManifest]) -> list[tuple[UnitManifest, str]]:
    """Each unit of the chain of ``manifest``, head first, with where it goes in a restore folder
    (a ``/``-separated relative path) so that every delta file finds its base by the name it records.

    A delta records its base relative to itself. The manager's own saves are named by step on every
    tier, so their chains lie in place (each unit at its tier name). A framework's checkpoints copied
    by the integrations (``tiers=``) keep the framework's base names (``epoch=0-step=4.ckpt``,
    ``../checkpoint_3/model.nvc``) while the tier names each unit by step: laid out like this, the
    head at its tier name and each base where its delta looks for it, the chain loads.

    Each delta file's base record (size and index digest) must be a file of the base unit that the
    manifest names: the chain is checked without a name on the tier having to match.

    Raises:
        FormatError: A broken chain: a base step not listed on the tier, a delta file whose base is
            not a file of that step, a base at an absolute path, or base names that disagree.
    """
    top = "/" + "/".join(["_"] * _LAYOUT_DEPTH)
    head = store.unit_path(manifest.step, manifest.directory)
    where = {manifest.step: posixpath.join(top, posixpath.basename(head))}
    chain, m = [manifest], manifest
    while m.base is not None:
        base = manifests.get(m.base)
        if base is None or m.base in where:
            raise FormatError(f"{head}: a delta whose base step {m.base} is not on {store.label} (a broken chain)")
        at = None
        for entry in m.files:
            path = store.file_path(m, entry)
            ref = _base_ref(store, path) if entry.index_xxh3 is not None else None
            if ref is None:
                continue
            if is_url(ref.path) or ref.path.startswith("/"):
                raise FormatError(f"{path}: records its base at an absolute place ({ref.path}), which a copy on a tier cannot follow")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(_at(where[m.step], entry)), ref.path))
            found = next((
                target[: len(target) - len(e.path) - 1] if e.path else target
                for e in base.files
                if (e.size, e.index_xxh3) == (ref.size, ref.index_xxh3) and (not e.path or target.endswith("/" + e.path))
            ), None)
            if found is None:
                raise FormatError(
                    f"{path}: its base ({ref.path}: {ref.size} bytes, index digest {ref.index_xxh3:016x}) is not a file of "
                    f"step {m.base} on {store.label} (a broken chain)"
                )
            if at not in (None, found):
                raise FormatError(f"{path}: the files of step {m.step} name their bases in different places ({at}, {found})")
            at = found
        if at is None:
            raise FormatError(f"{store.unit_path(m.step, m.directory)}: the manifest names base step {m.base}, but no file of it is a delta")
        if at in where.values():
            raise FormatError(f"{head}: two units of its chain would lie at {at}")
        where[base.step] = at
        chain.append(base)
        m = base
    up = max(posixpath.relpath(p, top).split("/").count("..") for p in where.values())
    if up >= _LAYOUT_DEPTH - 1:
        raise FormatError(f"{head}: its chain names bases {up} folders up; at most {_LAYOUT_DEPTH - 2} are followed")
    root = top
    for _ in range(up):
        root = posixpath.dirname(root)
    return [(u, posixpath.relpath(where[u.step], root)) for u in chain]


def _in_place(store: TierStore, layout: list[tuple[UnitManifest, str]]) -> bool:
    """Whether each unit of a chain lies at its own name on the tier (the chain loads there)."""
    return all(rel == posixpath.basename(store.unit_path(m.step, m.directory)) for m, rel in layout)


def _at(unit: str, entry: FileEntry) -> str:
    return _join(unit, entry.path) if entry.path else unit


def _base_ref(store: TierStore, path: str) -> Any:
    """The base record of the nvcomp-checkpoint file at ``path`` (None for a full file)."""
    try:
        with CheckpointReader(path, storage_options=store.tier.storage_options) as reader:
            return reader.index.base
    except (CheckpointError, OSError) as exc:
        raise FormatError(f"{path}: its index cannot be read ({exc})") from exc


def _check_chain(store: TierStore, manifest: UnitManifest, manifests: dict[int, UnitManifest], *, full: bool) -> list[tuple[UnitManifest, str]]:
    """Raise :class:`FormatError` unless every base of the delta ``manifest`` is committed on ``store``,
    checks and is the file its delta was written against; return the chain's :func:`chain_layout`.

    ``full``: also every byte of each base and, where the chain lies in place, every frame of the delta
    and of each base tensor it needs decodes. A chain that is not in place is decoded only once laid
    out: by :meth:`CheckpointManager.fetch`, or by :func:`verify_unit`.
    """
    layout = chain_layout(store, manifest, manifests)
    for m, _ in layout[1:]:
        store.check(m, full=full)
    if full and _in_place(store, layout):
        why = _decode_errors([store.file_path(manifest, e) for e in manifest.files if e.index_xxh3 is not None], store.tier.storage_options)
        if why is not None:
            raise FormatError(why)
    return layout


def verify_unit(store: TierStore, manifest: UnitManifest, *, full: bool = True) -> str | None:
    """``None`` if the unit checks against its manifest, else why not.

    ``full``: every byte of every file (and of each base of a delta) against the manifests, and every
    frame decodes. A delta whose chain keeps its framework's names (an integration's ``tiers=``) is
    laid out in a temporary folder first, as :meth:`CheckpointManager.fetch` does, and decoded there,
    following its chain. Without ``full``: sizes and index digests only.
    """
    try:
        store.check(manifest, full=full)
        if not full:
            return None
        if manifest.base is not None:
            layout = _check_chain(store, manifest, _chain_manifests(store, manifest), full=True)
            if _in_place(store, layout):
                return None
            tmp = _scratch_folder(tempfile.gettempdir(), "nvckpt-verify")
            try:
                head = _lay_out(store, layout, tmp, in_place=False)
                why = _decode_errors([_at(head, e) for e in manifest.files if e.index_xxh3 is not None], None)
            finally:
                _remove_quietly(tmp)
            return None if why is None else f"laid out with its chain, it does not decode: {why}"
        return _decode_errors([store.file_path(manifest, e) for e in manifest.files if e.index_xxh3 is not None], store.tier.storage_options)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"


def _scratch_folder(parent: str, prefix: str) -> str:
    """A new folder of this process in ``parent`` (a name no other process uses)."""
    path = os.path.join(parent, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    LOCAL.makedirs(path)
    return path


def _remove_quietly(path: str) -> None:
    try:
        LOCAL.remove(path)
    except OSError:
        _LOG.debug("could not remove %s", path, exc_info=True)


def _lay_out(src: TierStore, layout: list[tuple[UnitManifest, str]], root: str, *, in_place: bool) -> str:
    """Copy the chain ``layout`` (:func:`chain_layout`) from ``src`` into the local folder ``root``, bases
    first, each file checked; in place, each unit with its manifest. Returns the head's path."""
    local = TierStore(Tier(root, name="fetched"), "fetched")
    for m, rel in reversed(layout):
        copy_unit(src, local, m, to=None if in_place else _join(local.root, rel))
    return _join(local.root, layout[0][1])


def _layout_key(layout: list[tuple[UnitManifest, str]]) -> str:
    """A name for a laid-out chain that differs whenever a file or a place in it does."""
    doc = [[m.step, rel, [[e.path, e.size, e.index_xxh3, e.xxh3] for e in m.files]] for m, rel in layout]
    return xxhash.xxh3_64_hexdigest(json.dumps(doc).encode())


def _laid_out_errors(layout: list[tuple[UnitManifest, str]], folder: str, *, decode: bool) -> str | None:
    """Why the chain laid out in ``folder`` by an earlier fetch does not check (None: it does)."""
    local = TierStore(Tier(folder, name="fetched"), "fetched")
    try:
        for m, rel in layout:
            local.check(m, full=True, at=_join(local.root, rel))
        head = _join(local.root, layout[0][1])
        if decode or any(e.xxh3 is None for m, _ in layout for e in m.files):
            return _decode_errors([_at(head, e) for e in layout[0][0].files if e.index_xxh3 is not None], None)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def _chain_manifests(store: TierStore, manifest: UnitManifest) -> dict[int, UnitManifest]:
    """The manifests of the bases of ``manifest`` committed on ``store`` (read one by one, not the whole listing)."""
    out: dict[int, UnitManifest] = {}
    step = manifest.base
    while step is not None and step not in out and step != manifest.step:
        m = store.manifest(step)
        if m is None:
            break
        out[step], step = m, m.base
    return out


def _decode_errors(paths: list[str], storage_options: dict[str, Any] | None) -> str | None:
    """Why one of the nvcomp-checkpoint files at ``paths`` does not decode in full (None: they all do)."""
    for path in paths:
        with CheckpointReader(path, storage_options=storage_options) as reader:
            for tensor, err in reader.verify():
                if err is not None:
                    return f"tensor {tensor.key!r}: {err}"
    return None


def _is_dir(storage: Storage, path: str) -> bool:
    if isinstance(storage, LocalStorage):
        return os.path.isdir(path)
    return bool(storage.fs.isdir(path))  # type: ignore[attr-defined]


def _source_intact(src: TierStore, manifest: UnitManifest) -> bool:
    """Whether every file of an adopted unit is still there with its size."""
    try:
        return all(src.storage.size(src.source_path(manifest, e)) == e.size for e in manifest.files)
    except (FileNotFoundError, OSError):
        return False


def _walk(storage: Storage, root: str, prefix: str = "") -> list[str]:
    out = []
    for name, is_dir in sorted(list_names(storage, _join(root, prefix) if prefix else root).items()):
        rel = f"{prefix}/{name}" if prefix else name
        out.extend(_walk(storage, root, rel) if is_dir else [rel])
    return out


def _index_digest(storage: Storage, path: str, size: int) -> int | None:
    """The footer's xxh3 of the index for an nvcomp-checkpoint file, None for other files.

    Only the footer is read (one small range read on an object store).
    """
    if size < len(MAGIC) + FOOTER.size:
        return None
    with storage.open_read(path) as f:
        f.seek(size - FOOTER.size)
        data = f.read(FOOTER.size)
    if not data.endswith(FOOTER_MAGIC):
        return None
    _, _, digest = unpack_footer(data, size, path)
    return digest


def _file_xxh3(storage: Storage, path: str) -> int:
    h = xxhash.xxh3_64()
    with storage.open_read(path) as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            h.update(chunk)
    return h.intdigest()


ProgressFn = Callable[[int], None]


def copy_unit(
    src: TierStore, dst: TierStore, manifest: UnitManifest, progress: ProgressFn | None = None, *, to: str | None = None,
) -> UnitManifest:
    """Copy one unit's files byte for byte, check them on ``dst``, then commit its manifest there.

    Streams :data:`COPY_CHUNK_BYTES` at a time (object stores upload in ``part_size`` parts).
    A failure removes what this copy wrote; ``dst``'s other units are untouched.

    ``to``: put the unit at this path of ``dst`` (a chain laid out for a restore, :func:`chain_layout`)
    instead of its step name, checked, and commit no manifest (the folder is not a tier).

    Returns:
        The manifest committed on ``dst`` (with the whole-file checksums read on the way).
    """
    entries = []
    written: list[str] = []  # files this copy put in place (an atomic write that failed left none)
    if to is None:
        # A copy of this step already there (a resumed run saving the step again) is unlisted first:
        # its manifest would not describe the new bytes.
        dst.storage.remove(dst.manifest_path(manifest.step))
    else:
        dst.storage.remove(to)  # what an earlier restore left there
    try:
        for entry in manifest.files:
            s_path = src.source_path(manifest, entry)
            d_path = dst.file_path(manifest, entry) if to is None else _at(to, entry)
            if isinstance(src.storage, LocalStorage) and _upload_local(src, dst, manifest, entry, s_path, d_path, written, progress, entries):
                continue
            h = xxhash.xxh3_64()
            n = 0
            with src.storage.open_read(s_path) as fin, write_errors(d_path, f"copying step {manifest.step} to {dst.label}"):
                with dst.write_storage.open_write(d_path) as fout:
                    while chunk := fin.read(COPY_CHUNK_BYTES):
                        h.update(chunk)
                        fout.write(chunk)
                        n += len(chunk)
                        if progress is not None:
                            progress(len(chunk))
                    _check_source(s_path, entry, n, h.intdigest())
            written.append(d_path)
            entries.append(replace(entry, xxh3=h.intdigest()))
        committed = replace(manifest, files=tuple(entries), created=time.time(), source=None)
        dst.check(committed, at=to)
        if to is None:
            dst.write_manifest(committed)
        return committed
    except BaseException:
        for path in written:
            try:
                dst.storage.remove(path)
            except Exception:  # noqa: BLE001 - the endpoint may be down; the next manager cleans up
                _LOG.debug("could not remove the partial copy %s", path, exc_info=True)
        if manifest.directory or to is not None:
            try:
                dst.storage.remove(dst.unit_path(manifest.step, True) if to is None else to)
            except Exception:  # noqa: BLE001
                pass
        raise


def _check_source(s_path: str, entry: FileEntry, n: int, digest: int) -> None:
    if n != entry.size:
        raise FormatError(f"{s_path}: read {n} bytes, the manifest says {entry.size}; the source changed during the copy")
    if entry.xxh3 is not None and digest != entry.xxh3:
        raise FormatError(f"{s_path}: checksum mismatch against its manifest; the source copy is damaged")


def _upload_local(
    src: TierStore, dst: TierStore, manifest: UnitManifest, entry: FileEntry, s_path: str, d_path: str,
    written: list[str], progress: ProgressFn | None, entries: list[FileEntry],
) -> bool:
    """A local file to an object store: parts uploaded in parallel (s3fs ``put_file``); False where not possible."""
    if not getattr(dst.storage, "object_store", False):
        return False
    # The source is checked first (a committed unit does not change): read once, from the page cache.
    n, h = os.path.getsize(s_path), xxhash.xxh3_64()
    with src.storage.open_read(s_path) as fin:
        while chunk := fin.read(COPY_CHUNK_BYTES):
            h.update(chunk)
    _check_source(s_path, entry, n, h.intdigest())
    with write_errors(d_path, f"copying step {manifest.step} to {dst.label}"):
        if not upload_file(dst.storage, s_path, d_path, dst.tier.part_size, dst.tier.upload_concurrency, progress):
            return False
    written.append(d_path)
    entries.append(replace(entry, xxh3=h.intdigest()))
    return True


def retained_steps(steps: Iterable[int], keep: int | None, keep_every_steps: int | None, protect: Iterable[int] = ()) -> set[int]:
    """The steps a tier keeps: the newest ``keep``, multiples of ``keep_every_steps``, and ``protect``."""
    ordered = sorted(set(steps))
    kept = set(ordered if keep is None else ordered[-keep:])
    if keep_every_steps:
        kept |= {s for s in ordered if s % keep_every_steps == 0}
    return kept | (set(protect) & set(ordered))


def light_tree(state: Any) -> tuple[Any, list[str]]:
    """``state`` with only the tensors classified ``weights`` (and every plain value).

    A subtree that held tensors and keeps none (an optimizer, RNG states) is dropped whole, so
    that a light checkpoint never carries a half-empty optimizer state that would load silently.

    Returns:
        The light tree and the keys of the dropped subtrees.
    """
    import torch

    dropped: list[str] = []
    _GONE = object()

    def walk(obj: Any, path: tuple[Any, ...]) -> tuple[Any, bool, bool]:
        # -> (kept object or _GONE, had tensors, kept tensors)
        if isinstance(obj, torch.Tensor):
            keep = classify(path) == Component.WEIGHTS
            return (obj if keep else _GONE), True, keep
        if isinstance(obj, dict):
            out, had, kept = type(obj)() if type(obj) is not dict else {}, False, False
            for k, v in obj.items():
                nv, h, kp = walk(v, path + (k,))
                had, kept = had or h, kept or kp
                if nv is _GONE or (h and not kp):
                    dropped.append("/".join(str(p) for p in path + (k,)))
                    continue
                out[k] = nv
            return out, had, kept
        if isinstance(obj, (list, tuple)):
            items, had, kept = [], False, False
            for i, v in enumerate(obj):
                nv, h, kp = walk(v, path + (i,))
                had, kept = had or h, kept or kp
                items.append(None if nv is _GONE or (h and not kp) else nv)
            return (type(obj)(items) if type(obj) in (list, tuple) else items), had, kept
        return obj, False, False

    tree, _, _ = walk(state, ())
    outer = [d for d in dropped if not any(d.startswith(o + "/") for o in dropped)]
    return tree, outer


class _CopyQueue:
    """One background thread per destination tier, so a slow tier never holds up a fast one."""

    def __init__(self, manager: "CheckpointManager", index: int) -> None:
        self.manager = manager
        self.index = index
        tier = manager.tiers[index]
        # (unit, the tier-0 steps pinned for its copy: the unit and, for an adopted delta, its chain)
        self.queue: queue.Queue[tuple[UnitManifest, list[int]] | None] = queue.Queue(maxsize=tier.max_queued)
        #: Set by close(): copies still queued are dropped (reported by close), none is started.
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name=f"nvckpt-copy-{manager._stores[index].label}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # Copies are background work: below training threads in the scheduler, where the OS allows.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + COPY_NICE))
        except (AttributeError, OSError):
            pass
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.stopping:
                    self.manager._drop(*item)
                else:
                    self.manager._copy(self.index, *item)
            finally:
                if item is not None:
                    self.manager._copy_done(self.index, item[0])
                self.queue.task_done()


class CheckpointManager:
    """Saves to tier 0, copies to the other tiers on their schedules, applies retention, restores.

    Args:
        tiers: Fastest first. Tier 0 takes every save; a later tier receives a verified copy
            of the compressed unit when its schedule says so.
        async_save: Save with :func:`nvcomp_checkpoint.save_async` (return once the snapshot is
            taken); ``False`` saves synchronously.
        full_every: Every ``full_every``-th save (the first included) is full; the others keep
            only the tensors classified ``weights`` and are marked light, or, with
            ``incremental``, are deltas of the whole state. ``None``: all full (with
            ``incremental``: 10).
        incremental: Save each checkpoint as a delta against an earlier one
            (:func:`nvcomp_checkpoint.save` with ``base=``); the manifest records the base step.
            Retention keeps every base a kept step needs, a delta is committed on a tier only
            after its base, and restore treats a delta whose chain is broken as a damaged copy.
            The first save of a manager is full.
        delta_base: With ``incremental``: ``"previous"`` (each delta against the save before it:
            the smallest files, a load decodes up to ``full_every`` files) or ``"full"`` (against
            the last full save: a load decodes two files, and a copy to a sparse tier brings one
            base instead of the whole chain). See :class:`~nvcomp_checkpoint.ChainPolicy`.
        policy: Codec settings of the saves.
        workers: Compression threads.
        clean: Remove leftovers of interrupted saves and copies from every tier now. Only one
            manager may work on a tier root at a time.
        on_copy_progress: Called as ``fn(tier_name, step, nbytes)`` for each chunk copied.
        tier0_external: Tier 0 is a framework's own checkpoint folder (Lightning's
            ``ModelCheckpoint``, Accelerate's ``save_state``, the Trainer's ``checkpoint-N``),
            written and rotated by it: the manager never writes, cleans, retains or restores
            there; units come in through :meth:`adopt` and are copied to the other tiers.

    Example:
        >>> mgr = nc.CheckpointManager([nc.Tier("/nvme/run1", keep=2), nc.Tier("s3://b/run1", every_minutes=60, keep=24)])
        >>> r = mgr.restore()          # None on a fresh start
        >>> mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        >>> mgr.close()                # waits for saves and copies; raises the first failure
    """

    def __init__(
        self,
        tiers: list[Tier],
        *,
        async_save: bool = True,
        full_every: int | None = None,
        policy: CodecPolicy | None = None,
        workers: int | None = None,
        clean: bool = True,
        on_copy_progress: Callable[[str, int, int], None] | None = None,
        tier0_external: bool = False,
        incremental: bool = False,
        delta_base: str = "previous",
    ) -> None:
        if not tiers:
            raise ValueError("CheckpointManager needs at least one Tier")
        if tiers[0].every_steps is not None or tiers[0].every_minutes is not None:
            raise ValueError(f"Tier 0 ({tiers[0].url}) takes every save; give its schedule to a later tier instead")
        if is_url(tiers[0].url):
            _LOG.info("tier 0 is %s: every save is written there directly", tiers[0].url)
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise ValueError(f"full_every must be a positive integer or None, got {full_every!r}")
        self.tiers = list(tiers)
        self.async_save = async_save
        self.full_every = full_every
        self.policy = CodecPolicy.of(policy, "CheckpointManager(policy=...)")
        self.workers = workers
        self.on_copy_progress = on_copy_progress
        self.tier0_external = bool(tier0_external)
        if incremental and self.tier0_external:
            raise ValueError(
                "CheckpointManager(incremental=True, tier0_external=True): the framework writes tier 0 itself; give "
                "the framework's integration incremental=True instead (its files are then deltas, adopted with their base)"
            )
        self.incremental = bool(incremental)
        self.chain_policy: ChainPolicy | None = ChainPolicy(full_every or 10, delta_base) if incremental else None
        self._chain: list[int] = []  # steps saved since this manager started, while the chain is unbroken
        self._last_adopted: tuple[int, str] | None = None
        labels = [t.name or f"tier{i}" for i, t in enumerate(tiers)]
        if len(set(labels)) != len(labels):
            raise ValueError(f"tier names must differ, got {labels}")
        self._stores = [TierStore(t, label) for t, label in zip(tiers, labels)]
        self._lock = threading.RLock()
        self._retention_locks = [threading.Lock() for _ in tiers]
        self._pending_saves: list[Any] = []
        self._pinned: dict[int, int] = {}  # tier-0 step -> copies queued or running from it
        self._adopted: dict[str, int] = {}  # tier-0 path an adopted unit was read from -> its step
        self._adopted_units: dict[int, UnitManifest] = {}  # step -> its adopted unit, while it is on tier 0
        self._removals: dict[int, list[Callable[[], None]]] = {}  # step -> deletions waiting for its copies
        self._errors: list[BaseException] = []
        self._saves = 0
        self._last_copy: dict[int, tuple[int | None, float | None]] = {}
        self._queues: dict[int, _CopyQueue] = {}
        self._closed = False
        self._changed = threading.Condition(self._lock)  # a save committed or a copy ended
        self._save_steps: dict[Any, int] = {}  # pending save handle -> its step
        self._outstanding: dict[int, list[UnitManifest]] = {}  # tier -> copies queued or running, oldest first
        self._uncopied: dict[int, UnitManifest] = {}  # tier -> newest unit its schedule (or a full queue) skipped
        self._own: dict[int, set[int]] = {}  # tier -> steps this manager committed there
        # tier -> newer steps the last restore() listed there and did not resume from: a save above them removes them.
        self._abandoned: dict[int, set[int]] = {}
        self._kept_newer: dict[int, tuple[int, ...]] = {}  # tier -> newer steps a save last warned it keeps
        for i, store in enumerate(self._stores):
            if clean and not (i == 0 and self.tier0_external):
                try:
                    removed = store.clean_leftovers()
                except Exception as exc:  # noqa: BLE001 - an unreachable tier must not stop training
                    _LOG.warning("%s (%s): could not clean leftovers: %s", store.label, store.root, exc)
                    removed = []
                if removed:
                    _LOG.warning("%s: removed leftovers of interrupted saves or copies: %s", store.label, ", ".join(removed))
            if i:
                try:
                    steps = store.steps()
                except Exception:  # noqa: BLE001
                    steps = []
                self._last_copy[i] = (steps[-1] if steps else None, None)

    @property
    def names(self) -> list[str]:
        return [s.label for s in self._stores]

    # -- saving -------------------------------------------------------------------------------
    def unit_path(self, step: int, *, directory: bool = False) -> str:
        """Where a save of ``step`` goes on tier 0 (a folder for a sharded, multi-file unit)."""
        return self._stores[0].unit_path(step, directory)

    def save(self, step: int, state: Any, *, light: bool | None = None) -> Any:
        """Save ``state`` as ``step`` on tier 0; copies follow when the save is durable.

        Args:
            step: Training step (a non-negative integer; a higher step is a newer checkpoint).
            state: The tree to save.
            light: Force a light (weights-only) or full save; default from ``full_every``.

        Returns:
            The :class:`AsyncSaveHandle` (async) or :class:`SaveReport` (sync) of the tier-0 save.

        Raises:
            CheckpointWriteError: This or an earlier tier-0 save failed (a full disk ...); the
                previous checkpoints are untouched.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self._refuse_external("save()")
        try:
            self._raise_save_errors()
        except BaseException:
            self._chain = []  # a failed save is no base: the next one is full
            raise
        if light is None:
            light = self.full_every is not None and not self.incremental and self._saves % self.full_every != 0
        self._saves += 1
        base = None if light else self._next_base(step)
        tree = state
        meta: dict[str, Any] = {"nvckpt_step": step, "nvckpt_light": bool(light)}
        if light:
            tree, dropped = light_tree(state)
            meta["nvckpt_dropped"] = dropped
        if base is not None:
            meta["nvckpt_base_step"] = base
        path = self.unit_path(step)
        base_path = None if base is None else self.unit_path(base)
        opts = self.tiers[0].write_options()
        started = time.perf_counter()
        if base is not None:
            with self._lock:  # tier-0 retention keeps the base (and its chain) until this save is committed
                self._pinned[base] = self._pinned.get(base, 0) + 1
        if not self.async_save:
            try:
                report = _save_sync(tree, path, self.policy, metadata=meta, storage_options=opts, workers=self.workers, base=base_path)
            except BaseException:
                self._chain = []
                raise
            finally:
                self._unpin(base)
            blocked = time.perf_counter() - started
            metrics.record_blocked_seconds(blocked)
            metrics.record_save_seconds(self.names[0], "write", report.seconds)
            self._committed_on_tier0(step, False, bool(light), report, base)
            return report
        try:
            handle = _save_async(tree, path, self.policy, metadata=meta, storage_options=opts, workers=self.workers, base=base_path)
        except BaseException:
            self._chain = []
            self._unpin(base)
            raise
        blocked = time.perf_counter() - started
        metrics.record_blocked_seconds(blocked)
        metrics.record_save_seconds(self.names[0], "snapshot", blocked)
        with self._lock:
            self._pending_saves.append(handle)
            self._save_steps[handle] = step
        handle.add_done_callback(lambda h: self._on_saved(step, bool(light), h, base))
        return handle

    def _next_base(self, step: int) -> int | None:
        """The step the save of ``step`` is a delta against (None: a full save), and count the save."""
        if self.chain_policy is None:
            return None
        if self._chain and step <= self._chain[-1]:
            self._chain = []  # a run resumed from an older step starts a new chain
        base = self.chain_policy.base_for([str(s) for s in self._chain])
        if base is None:
            self._chain = []
        self._chain.append(step)
        return None if base is None else int(base)

    def _unpin(self, step: int | None) -> None:
        if step is None:
            return
        with self._lock:
            left = self._pinned.get(step, 1) - 1
            if left:
                self._pinned[step] = left
            else:
                self._pinned.pop(step, None)
            removals = [] if left else self._removals.pop(step, [])
            if removals:  # the unit goes: forget where it was adopted from
                self._forget_adopted(step)
        _run_removals(step, removals)

    def remove_after_copies(self, path: str | os.PathLike[str], delete: Callable[[], None]) -> bool:
        """Run ``delete`` (the framework's removal of an adopted unit) once its copies are done.

        A framework's own rotation (``ModelCheckpoint``'s top-k, Accelerate's ``total_limit``)
        may remove a checkpoint whose copies to the tiers are still queued or running; the
        deletion then waits for them (on the copy thread), so every tier due gets its copy.

        Returns:
            ``True`` if the deletion was deferred; ``False`` if it ran now.
        """
        spath = self._tier0_path(path)
        with self._lock:
            step = self._adopted.get(spath)
            if step is not None and self._pinned.get(step):
                self._removals.setdefault(step, []).append(delete)
                return True
            if step is not None:
                self._forget_adopted(step)
        delete()
        return False

    def _tier0_path(self, path: str | os.PathLike[str]) -> str:
        """``path`` as tier 0's storage names it (absolute for a local folder)."""
        _, spath = storage_for(os.fspath(path), self.tiers[0].storage_options)
        return os.path.abspath(spath) if isinstance(self._stores[0].storage, LocalStorage) else spath

    def _forget_adopted(self, step: int) -> None:
        with self._lock:
            for gone in [p for p, s in self._adopted.items() if s == step]:
                del self._adopted[gone]
            self._adopted_units.pop(step, None)

    def commit(self, step: int, *, light: bool = False, directory: bool | None = None) -> UnitManifest:
        """Register a unit written to :meth:`unit_path` by someone else (a sharded save), and copy it on.

        Raises:
            CheckpointError: Nothing is there for ``step``.
        """
        self._refuse_external("commit()")
        store = self._stores[0]
        if directory is None:
            names = list_names(store.storage, store.root)
            directory = names.get(f"step-{step:010d}", False)
        return self._committed_on_tier0(step, directory, light, None)

    def _refuse_external(self, what: str) -> None:
        if self.tier0_external:
            raise CheckpointError(
                f"CheckpointManager.{what}: tier 0 ({self.tiers[0].url}) belongs to the framework that writes it "
                "(tier0_external=True); hand each checkpoint it wrote to adopt(step, path) instead."
            )

    def adopt(
        self, step: int, path: str | os.PathLike[str], *, light: bool = False, base: str | os.PathLike[str] | None = None,
    ) -> UnitManifest | None:
        """Copy a file or folder someone else wrote and made durable (a framework's checkpoint) as ``step``.

        The unit stays where it is, owned and rotated by whoever wrote it; its size and digests
        are taken now, and the tiers due get a checked copy in the background, with their
        retention, exactly as for :meth:`save`. A copy whose source is deleted before it is done
        (the framework's own rotation) is skipped with a warning. Adopting the step adopted last
        again (Lightning's ``last.ckpt`` beside the top-k file) does nothing.

        Returns:
            The unit's manifest (``None`` when it repeats the last adopted step).

        A failed copy is logged at once and raised by :meth:`wait` / :meth:`close` (never here:
        adopt runs where the framework's save completes, often a background thread).

        ``base``: the unit is a delta (an integration's ``incremental=True``) against the unit adopted
        from this path; the manifest records that step, a copy brings the part of the chain a tier
        lacks first, and the framework's removal of a base waits for the copies that need it. A
        delta whose base this manager did not adopt is not copied (the error is raised by :meth:`wait`).

        Raises:
            CheckpointError: Nothing is at ``path`` (or an empty folder).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        store = self._stores[0]
        spath = self._tier0_path(path)  # absolute: the copy runs later, maybe after a chdir
        if not store.storage.exists(spath):
            raise CheckpointError(f"{spath}: nothing to adopt as step {step} (the checkpoint is not there)")
        if self._last_adopted == (step, spath):
            return None
        if self._last_adopted is not None and self._last_adopted[0] == step:
            _LOG.debug("step %d already adopted from %s; %s is not copied again", step, self._last_adopted[1], spath)
            return None
        base_step = None
        if base is not None:
            bpath = self._tier0_path(base)
            with self._lock:
                base_step = self._adopted.get(bpath)
            if base_step is None or base_step >= step:
                error = CheckpointWriteError(
                    f"{spath}: step {step} is a delta against {bpath}, which was not handed to the tiers as an earlier step "
                    "(saved without a step, by another process, or already removed); it is not copied to the tiers. "
                    "The next full save is."
                )
                _LOG.error("%s", error)
                with self._lock:
                    self._errors.append(error)
                return None
        directory = _is_dir(store.storage, spath)
        manifest = store.describe(step, directory, light, source=spath, base=base_step)
        self._last_adopted = (step, spath)
        with self._lock:
            self._adopted[spath] = step
            self._adopted_units[step] = manifest
        metrics.record_last_step(store.label, step)
        self._schedule_copies(manifest)
        return manifest

    def _on_saved(self, step: int, light: bool, handle: Any, base: int | None = None) -> None:
        try:
            self._commit_saved(step, light, handle, base)
        finally:
            self._unpin(base)
            with self._changed:
                if handle in self._pending_saves:
                    self._pending_saves.remove(handle)
                self._save_steps.pop(handle, None)
                self._changed.notify_all()

    def _commit_saved(self, step: int, light: bool, handle: Any, base: int | None = None) -> None:
        exc = handle.exception()  # seen here: the manager raises it from save() / wait()
        if exc is not None:
            with self._lock:
                self._errors.append(exc)
                self._chain = []  # no delta against a failed save: the next save is full
            _LOG.error("%s: save of step %d failed: %s", self.names[0], step, exc)
            return
        try:
            report = handle.result()
            metrics.record_save_seconds(self.names[0], "write", report.seconds)
            self._committed_on_tier0(step, False, light, report, base)
        except Exception as exc:  # noqa: BLE001 - kept and raised from save() / wait()
            with self._lock:
                self._errors.append(exc)
            _LOG.error("%s: committing step %d failed: %s", self.names[0], step, exc)

    def _committed_on_tier0(self, step: int, directory: bool, light: bool, report: Any, base: int | None = None) -> UnitManifest:
        store = self._stores[0]
        if base is not None and store.manifest(base) is None:
            with self._lock:
                self._chain = []
            raise CheckpointWriteError(
                f"{store.label}: step {step} is a delta against step {base}, which is not committed there (its save "
                f"failed or it was removed); step {step} is not committed. The next save is full."
            )
        manifest = store.describe(step, directory, light, base=base)
        store.write_manifest(manifest)
        with self._lock:
            self._own.setdefault(0, set()).add(step)
        metrics.record_bytes_written(store.label, manifest.stored_bytes)
        metrics.record_last_step(store.label, step)
        if report is not None and report.stored_bytes:
            metrics.record_ratio(report.raw_bytes / report.stored_bytes)
        self._schedule_copies(manifest)
        self._apply_retention(0, step)
        return manifest

    def _due(self, i: int, step: int, now: float) -> bool:
        tier = self.tiers[i]
        last_step, last_time = self._last_copy.get(i, (None, None))
        if last_step is not None and step <= last_step:
            return True  # a run resumed from an older step: its first save replaces the tier's newer ones
        if tier.every_steps is None and tier.every_minutes is None:
            return True
        if tier.every_steps is not None and step % tier.every_steps == 0:
            return True
        if tier.every_minutes is not None and (last_time is None or now - last_time >= tier.every_minutes * 60):
            return True
        return False

    def _schedule_copies(self, manifest: UnitManifest) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            # An adopted delta's copy may bring its chain: the framework's removal of a base waits for it too.
            pins = [manifest.step, *(m.step for m in self._adopted_chain(manifest))]
            for i in range(1, len(self.tiers)):
                if not self._due(i, manifest.step, now):
                    self._note_uncopied(i, manifest)
                    continue
                try:
                    self._enqueue(i, manifest, pins, block=False)
                except queue.Full:
                    metrics.record_copy_skipped(self.names[i])
                    _LOG.warning(
                        "%s is behind: the copy of step %d is skipped (a copy is running and %d more wait); "
                        "the next due save, or close(), copies a newer step instead",
                        self.names[i], manifest.step, self.tiers[i].max_queued,
                    )
                    self._note_uncopied(i, manifest)
                    continue
                self._last_copy[i] = (manifest.step, now)

    def _enqueue(self, i: int, manifest: UnitManifest, pins: list[int], *, block: bool, timeout: float | None = None) -> None:
        """Queue the copy of ``manifest`` to tier ``i`` (raises ``queue.Full``); the lock is held unless ``block``."""
        with self._lock:  # counted before the copy thread can end it
            q = self._queues.get(i)
            if q is None:
                q = self._queues[i] = _CopyQueue(self, i)
            for step in pins:
                self._pinned[step] = self._pinned.get(step, 0) + 1
            self._outstanding.setdefault(i, []).append(manifest)
        try:
            if block:
                q.queue.put((manifest, pins), timeout=timeout)
            else:
                q.queue.put_nowait((manifest, pins))
        except queue.Full:
            self._drop(manifest, pins)
            self._copy_done(i, manifest)
            raise
        with self._lock:
            newest = self._uncopied.get(i)
            if newest is not None and newest.step <= manifest.step:
                del self._uncopied[i]

    def _note_uncopied(self, i: int, manifest: UnitManifest) -> None:
        with self._lock:
            newest = self._uncopied.get(i)
            if newest is None or manifest.step >= newest.step:
                self._uncopied[i] = manifest

    def _drop(self, manifest: UnitManifest, pins: list[int]) -> None:
        """A queued copy that will not run: its tier-0 units are released."""
        for step in pins:
            self._unpin(step)

    def _copy_done(self, i: int, manifest: UnitManifest) -> None:
        with self._changed:
            pending = self._outstanding.get(i, [])
            for k, m in enumerate(pending):
                if m is manifest:
                    del pending[k]
                    break
            self._changed.notify_all()

    def _adopted_chain(self, manifest: UnitManifest) -> list[UnitManifest]:
        """The bases of an adopted delta that tier 0 still holds, nearest first (empty for the manager's own saves)."""
        chain, base = [], manifest.base
        while self.tier0_external and base is not None and base in self._adopted_units and len(chain) < len(self._adopted_units):
            chain.append(self._adopted_units[base])
            base = chain[-1].base
        return chain

    def _tier0_manifest(self, step: int) -> UnitManifest | None:
        """Step ``step`` on tier 0: its committed manifest, or the unit adopted there."""
        if self.tier0_external:
            with self._lock:
                return self._adopted_units.get(step)
        return self._stores[0].manifest(step)

    def _copy(self, i: int, manifest: UnitManifest, pins: list[int]) -> None:
        src, dst = self._stores[0], self._stores[i]
        tier = self.tiers[i]
        progress = None
        if self.on_copy_progress is not None:
            cb, label, step = self.on_copy_progress, dst.label, manifest.step
            progress = lambda n: cb(label, step, n)  # noqa: E731
        try:
            if manifest.base is not None:
                self._copy_bases(i, manifest)
            delay = tier.backoff_s
            for attempt in range(tier.retries + 1):
                started = time.perf_counter()
                try:
                    committed = copy_unit(src, dst, manifest, progress)
                except Exception as exc:  # noqa: BLE001
                    if manifest.source is not None and not _source_intact(src, manifest):
                        _LOG.warning(
                            "%s: step %d was removed or replaced at %s (by the rotation of whoever wrote it) before "
                            "its copy was done; the copy is skipped. Keep more checkpoints there for the copies to "
                            "finish.", dst.label, manifest.step, manifest.source,
                        )
                        return
                    if attempt == tier.retries or isinstance(exc, FormatError) and "source" in str(exc):
                        raise CheckpointWriteError(
                            f"{dst.label} ({dst.root}): copying step {manifest.step} failed after {attempt + 1} attempt(s): "
                            f"{exc}. The tier's previous copies are untouched; step {manifest.step} stays on "
                            f"{src.label} ({src.unit_path(manifest.step, manifest.directory)})."
                        ) from exc
                    _LOG.warning("%s: copying step %d failed (%s); retrying in %.1f s", dst.label, manifest.step, exc, delay)
                    time.sleep(delay)
                    delay *= 2
                    continue
                with self._lock:
                    self._own.setdefault(i, set()).add(manifest.step)
                metrics.record_save_seconds(dst.label, "copy", time.perf_counter() - started)
                metrics.record_bytes_written(dst.label, committed.stored_bytes)
                metrics.record_last_step(dst.label, manifest.step)
                _LOG.info("%s: step %d copied (%d bytes) in %.2f s", dst.label, manifest.step, committed.stored_bytes,
                          time.perf_counter() - started)
                break
            self._apply_retention(i, manifest.step)
        except Exception as exc:  # noqa: BLE001 - raised from wait() / close(); training goes on
            _LOG.error("%s", exc)
            with self._lock:
                self._errors.append(exc)
        finally:
            for step in pins:
                self._unpin(step)
            try:
                self._apply_retention(0)
            except Exception as exc:  # noqa: BLE001
                _LOG.warning("%s: retention failed: %s", self.names[0], exc)

    def _copy_bases(self, i: int, manifest: UnitManifest) -> None:
        """Commit the chain of the delta ``manifest`` on tier ``i``, oldest first, where it is not there yet.

        Raises:
            CheckpointWriteError: A base is not on tier 0 or its copy failed (the delta is then not copied).
        """
        src, dst = self._stores[0], self._stores[i]
        chain: list[UnitManifest] = []
        base = manifest.base
        while base is not None:
            m = self._tier0_manifest(base)
            if m is None:
                raise CheckpointWriteError(
                    f"{dst.label} ({dst.root}): step {manifest.step} is not copied: its base step {base} is no longer on "
                    f"{src.label} ({src.root})"
                )
            chain.append(m)
            base = m.base
        for m in reversed(chain):
            there = dst.manifest(m.step)
            if there is not None and [f.index_xxh3 for f in there.files] == [f.index_xxh3 for f in m.files]:
                continue  # committed there by its own copy, or by an earlier delta's
            try:
                self._copy_with_retries(i, m)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointWriteError(
                    f"{dst.label} ({dst.root}): step {manifest.step} is not copied: it is a delta against step {m.step}, "
                    f"whose copy there failed ({exc}). A delta is committed only after its base; the tier's previous "
                    f"copies are untouched, step {manifest.step} stays on {src.label}."
                ) from exc

    def _copy_with_retries(self, i: int, manifest: UnitManifest) -> UnitManifest:
        src, dst, tier = self._stores[0], self._stores[i], self.tiers[i]
        delay = tier.backoff_s
        for attempt in range(tier.retries + 1):
            try:
                committed = copy_unit(src, dst, manifest)
                with self._lock:
                    self._own.setdefault(i, set()).add(manifest.step)
                return committed
            except Exception as exc:  # noqa: BLE001
                if attempt == tier.retries:
                    raise
                _LOG.warning("%s: copying step %d failed (%s); retrying in %.1f s", dst.label, manifest.step, exc, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # -- retention ----------------------------------------------------------------------------
    def _apply_retention(self, i: int, committed: int | None = None) -> list[int]:
        """Delete the steps tier ``i`` no longer keeps; never its newest step or newest full step.

        ``committed``: the step just committed there. Steps above it that this run abandoned (the
        last :meth:`restore` listed them there and resumed from an older step, or this manager
        committed them) are removed first. Steps above it that this run never saw (restore() was
        not called, or could not list the tier) are kept, with a warning, and left out of the count.
        """
        tier, store = self.tiers[i], self._stores[i]
        with self._retention_locks[i]:
            manifests = store.manifests()
            removed: list[int] = []
            with self._lock:
                own = set(self._own.get(i, ()))
                abandoned = set(self._abandoned.get(i, ()))
            top = committed if committed is not None else max(own, default=None)
            newer = [] if top is None else sorted(s for s in manifests if s > top)
            kept_newer = []
            for step in newer:
                if step not in abandoned and step not in own:
                    kept_newer.append(step)
                    del manifests[step]
                    continue
                _LOG.warning(
                    "%s: removing step %d, newer than step %d just saved: a run resumed from an older step "
                    "replaces the steps after it", store.label, step, top,
                )
                store.remove_unit(step, manifests.pop(step).directory)
                removed.append(step)
            if kept_newer and self._kept_newer.get(i) != tuple(kept_newer):
                self._kept_newer[i] = tuple(kept_newer)
                _LOG.warning(
                    "%s: steps %s are newer than step %d just saved, and this run did not see them when it restored "
                    "(restore() was not called, or could not list this tier): they are kept, and a restore prefers "
                    "them; remove them by hand if they belong to an abandoned run", store.label, kept_newer, top,
                )
            if tier.keep is None or not manifests:
                return removed
            protect = {max(manifests)}
            full = [s for s, m in manifests.items() if not m.light]
            if full:
                protect.add(max(full))
            if i == 0:
                with self._lock:
                    protect |= set(self._pinned)
            kept = retained_steps(manifests, tier.keep, tier.keep_every_steps, protect)
            # A chain goes as a whole: every base a kept delta needs stays.
            kept = set(retained(sorted(kept), lambda s: manifests[s].base if s in manifests else None))
            for step in sorted(set(manifests) - kept):
                store.remove_unit(step, manifests[step].directory)
                removed.append(step)
            if removed:
                _LOG.info("%s: retention removed steps %s", store.label, removed)
            return removed

    # -- queries ------------------------------------------------------------------------------
    def steps(self, tier: int = 0) -> list[int]:
        """Steps with a complete, checked copy on ``tier``, oldest first."""
        return self._stores[tier].steps()

    def path(self, step: int, tier: int = 0) -> str | None:
        """Where ``step``'s copy lives on ``tier`` (None if it is not there)."""
        store = self._stores[tier]
        m = store.manifest(step)
        return None if m is None else store.unit_path(step, m.directory)

    def manifest(self, step: int, tier: int = 0) -> UnitManifest | None:
        return self._stores[tier].manifest(step)

    # -- waiting ------------------------------------------------------------------------------
    def _raise_save_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            for extra in errors[1:]:
                _LOG.error("further checkpoint failure: %s", extra)
            raise errors[0]

    def wait(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait for every pending save and copy; raise the first failure (each is raised once).

        Args:
            timeout: Seconds to wait at most (``None``: no limit). The copies go on in the background.

        Raises:
            CopyTimeoutError: Saves or copies still pending at the deadline (``exc.pending``: a
                :class:`NotCopied` for each, naming where the step still is).
        """
        self._wait_for(_Deadline(timeout), "wait()")
        self._raise_save_errors()

    def _wait_for(self, deadline: _Deadline, what: str, *, final: bool = False) -> None:
        """Wait for the pending saves and copies (``final``: and copy each tier's newest step its
        schedule skipped) until ``deadline``; raise :class:`CopyTimeoutError` naming what is left."""
        with self._changed:
            # A save's done callback may still be committing it and queueing copies.
            while self._pending_saves and not deadline.expired:
                self._changed.wait(deadline.left())
        if final and not self._pending_saves:
            self._copy_newest(deadline)
        with self._changed:
            while any(self._outstanding.values()) and not deadline.expired:
                self._changed.wait(deadline.left())
        left = self._not_copied(final=final)
        if left:
            listed = "; ".join(
                f"step {p.step} to {p.tier} ({p.state}; still at {p.path})" if p.state != "saving" else
                f"step {p.step} (still being saved to {p.path})" for p in left[:8]
            )
            more = f"; and {len(left) - 8} more" if len(left) > 8 else ""
            raise CopyTimeoutError(
                f"{what}: gave up after {deadline.seconds or 0:g} s with {len(left)} save(s) or copies not done: {listed}{more}. "
                "Nothing half-done is listed on a tier (a step is there once its manifest is); copy the steps left "
                "later with `nvckpt sync`, or pass a longer timeout", tuple(left),
            )

    def _copy_newest(self, deadline: _Deadline) -> None:
        """Queue the copy of each tier's newest step its schedule skipped (the end of a run has no next due save)."""
        with self._lock:
            newest = dict(self._uncopied)
        for i, manifest in sorted(newest.items()):
            if manifest.source is None and self._stores[0].manifest(manifest.step) is None:
                with self._lock:  # tier 0 no longer holds it (a later save removed it there)
                    self._uncopied.pop(i, None)
                continue
            pins = [manifest.step, *(m.step for m in self._adopted_chain(manifest))]
            _LOG.info("%s: copying step %d, the newest step, which its schedule skipped", self.names[i], manifest.step)
            try:
                self._enqueue(i, manifest, pins, block=True, timeout=deadline.left())
            except queue.Full:
                continue  # reported by _not_copied: it stays in _uncopied
            with self._lock:
                self._last_copy[i] = (manifest.step, time.monotonic())

    def _not_copied(self, *, final: bool) -> list[NotCopied]:
        with self._lock:
            out = [
                NotCopied(self._save_steps.get(h, -1), self.names[0], getattr(h, "path", self.names[0]), "saving")
                for h in self._pending_saves
            ]
            for i, pending in sorted(self._outstanding.items()):
                for k, m in enumerate(pending):
                    out.append(NotCopied(m.step, self.names[i], self._where(m), "copying" if k == 0 else "queued"))
            if final:
                for i, m in sorted(self._uncopied.items()):
                    if not any(p.step >= m.step for p in self._outstanding.get(i, [])):
                        out.append(NotCopied(m.step, self.names[i], self._where(m), "not started"))
        return out

    def _where(self, manifest: UnitManifest) -> str:
        return manifest.source if manifest.source is not None else self._stores[0].unit_path(manifest.step, manifest.directory)

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait for saves and copies, copy each tier's newest step its schedule skipped, stop the copy threads.

        Args:
            timeout: Seconds to wait at most (default :data:`CLOSE_TIMEOUT_S`, 10 minutes; ``None``:
                no limit). At the deadline, copies still queued are dropped; a copy still running is
                left to its thread (a daemon) and is committed only if it completes before the process
                exits: a tier lists a step only once its manifest is written, after the copy is checked.

        Raises:
            CopyTimeoutError: Saves or copies not done by the deadline (``exc.pending``: a
                :class:`NotCopied` for each, naming where the step still is); other failures are logged.
            CheckpointWriteError: A save or copy failed (the first one; the others are logged).
        """
        deadline = _Deadline(timeout)
        gave_up: CopyTimeoutError | None = None
        try:
            self._wait_for(deadline, "close()", final=True)
        except CopyTimeoutError as exc:
            gave_up = exc
        finally:
            self._stop_copies(deadline)
        if gave_up is not None:
            with self._lock:
                errors, self._errors = self._errors, []
            for error in errors:
                _LOG.error("checkpoint failure: %s", error)
            raise gave_up
        self._raise_save_errors()

    def _stop_copies(self, deadline: _Deadline) -> None:
        """No copy starts any more; the queued ones are dropped; each thread ends after the copy it runs."""
        with self._lock:
            self._closed = True
            queues, self._queues = list(self._queues.values()), {}
        for q in queues:
            q.stopping = True
            while True:
                try:
                    item = q.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._drop(*item)
                    self._copy_done(q.index, item[0])
                q.queue.task_done()
            q.queue.put_nowait(None)  # room: nothing is queued once the manager is closed
        for q in queues:
            q.thread.join(deadline.left())

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception as err:  # noqa: BLE001 - the body's exception is the one to see
                _LOG.error("while closing the checkpoint manager: %s", err)

    # -- restoring ----------------------------------------------------------------------------
    def fetch(self, step: int, tier: int, local_dir: str | os.PathLike[str]) -> str:
        """Copy ``step`` from ``tier`` into the folder ``local_dir`` (checked, with its chain); its local path.

        For a framework that loads only local paths (a ``save_state`` folder, a ``checkpoint-N``)
        from a copy on an object store, or a delta whose chain keeps its framework's names. The
        chain is laid out by :func:`chain_layout`, bases first: in place (each unit at its tier name,
        with its manifest) for the manager's own saves; else each base where its delta looks for it,
        and the delta then decoded in full, following its chain.

        The chain goes into a folder of its own, ``local_dir/step-NNNNNNNNNN-<digest>`` (the digest of
        its manifests): laid out in a temporary folder beside it, checked, then renamed into place.
        Several processes may fetch into one ``local_dir`` at once (every rank of a node): one lays
        the chain out while the others wait for it, and each gets the same checked folder. A folder
        already there is checked again and reused, never rewritten or removed (another process may be
        reading it): a damaged one is an error naming it.

        Raises:
            CheckpointError: ``tier`` does not hold ``step``, its chain is broken there, the laid-out
                delta does not decode, or an earlier fetch of the same chain in ``local_dir`` is damaged.
        """
        src = self._stores[tier]
        manifest = src.manifest(step)
        if manifest is None:
            raise CheckpointError(f"{src.label} ({src.root}): holds no step {step}")
        if manifest.base is None:
            layout = [(manifest, posixpath.basename(src.unit_path(step, manifest.directory)))]
        else:
            layout = chain_layout(src, manifest, _chain_manifests(src, manifest))
        in_place = _in_place(src, layout)
        root = os.path.abspath(os.fspath(local_dir))
        LOCAL.makedirs(root)
        name = f"step-{step:010d}-{_layout_key(layout)}"
        final = os.path.join(root, name)
        head = os.path.join(final, *layout[0][1].split("/"))
        # The lock only saves work (processes at once copy the chain once); the rename keeps it whole.
        with local_lock(os.path.join(root, f".{name}.lock")):
            if not LOCAL.isdir(final):
                tmp: str | None = _scratch_folder(root, f".{name}.tmp")
                try:
                    laid = _lay_out(src, layout, tmp, in_place=in_place)
                    if not in_place:
                        why = _decode_errors([_at(laid, e) for e in manifest.files if e.index_xxh3 is not None], None)
                        if why is not None:
                            raise FormatError(f"{head}: step {step} from {src.label}, laid out with its chain, does not decode: {why}")
                    try:
                        LOCAL.rename(tmp, final)  # atomic; a folder there (another process's) makes it fail
                        tmp = None
                        return head
                    except OSError:
                        if not LOCAL.isdir(final):
                            raise
                finally:
                    if tmp is not None:
                        _remove_quietly(tmp)
            why = _laid_out_errors(layout, final, decode=not in_place)
            if why is not None:
                raise FormatError(
                    f"{final}: step {step}, laid out there by an earlier fetch, does not check ({why}); remove that "
                    "folder once no process reads it, or fetch into another local_dir"
                )
            return head

    def locate(self, step: int | None = None, *, allow_light: bool = False, timeout: float | None = RESTORE_TIMEOUT_S) -> Restored | None:
        """The newest copy that checks (size, digests and every byte against its manifest), without loading it.

        For a framework that loads the checkpoint itself from ``r.path`` (``trainer.fit(ckpt_path=...)``,
        ``accelerator.load_state(...)``). Same order, fallback and ``timeout`` as :meth:`restore`; ``r.state`` is None.
        """
        def check_only(path: str, options: dict[str, Any] | None) -> None:
            return None

        return self.restore(step, allow_light=allow_light, loader=check_only, timeout=timeout, _every_byte=True)

    def resume_path(
        self, local_dir: str | os.PathLike[str], *, allow_light: bool = False, timeout: float | None = RESTORE_TIMEOUT_S,
    ) -> Restored | None:
        """:meth:`locate`, for a framework that loads a local path: ``r.path`` is loadable as it is.

        A copy on an object store, and a delta whose chain keeps its framework's names (the
        integrations' ``tiers=`` with ``incremental=True``), are first :meth:`fetch` ed into
        ``local_dir`` (a delta's whole chain, decoded once laid out); a candidate whose fetch or
        decode fails is skipped like any damaged copy, falling back to the next tier or older step.
        ``timeout`` bounds the listing, as for :meth:`restore`.
        """
        def open_unit(i: int, m: UnitManifest, layout: list[tuple[UnitManifest, str]] | None) -> str:
            store = self._stores[i]
            if not is_url(store.root) and (layout is None or _in_place(store, layout)):
                return store.unit_path(m.step, m.directory)
            path = self.fetch(m.step, i, local_dir)
            _LOG.info("step %d fetched from %s to %s", m.step, store.label, path)
            return path

        return self.restore(allow_light=allow_light, timeout=timeout, _every_byte=True, _open_unit=open_unit)

    def _list_tiers(self, deadline: _Deadline) -> tuple[dict[int, tuple[dict[int, UnitManifest], dict[int, str]]], dict[int, TierUnavailableError]]:
        """Every tier's :meth:`TierStore.listing`, at once, each on a thread of its own, by ``deadline``;
        and the error of each tier that could not be listed by then."""
        calls = {i: store.listing for i, store in enumerate(self._stores) if not (i == 0 and self.tier0_external)}
        answers = _run_within(calls, deadline, "list")
        listed, unavailable = {}, {}
        for i in calls:
            store = self._stores[i]
            if i not in answers:
                unavailable[i] = TierUnavailableError(
                    f"{store.label} ({store.root}) was not listed within {deadline.seconds or 0:g} s (unreachable or too "
                    "slow); what it holds is unknown, so nothing is taken from it or removed there: retry once it "
                    "answers, pass a longer timeout, or leave the tier out"
                )
                continue
            value, exc = answers[i]
            if exc is None:
                listed[i] = value
            else:
                unavailable[i] = exc if isinstance(exc, TierUnavailableError) else store.unavailable(exc)
            if i in unavailable:
                _LOG.warning("restore: %s", unavailable[i])
        return listed, unavailable

    def restore(
        self,
        step: int | None = None,
        *,
        allow_light: bool = False,
        map_location: Any = None,
        weights_only: bool = True,
        loader: Callable[[str, dict[str, Any] | None], Any] | None = None,
        timeout: float | None = RESTORE_TIMEOUT_S,
        _every_byte: bool = False,
        _open_unit: Callable[[int, UnitManifest, list[tuple[UnitManifest, str]] | None], str] | None = None,
    ) -> Restored | None:
        """Load the newest step whose copy checks and loads, fastest tier first.

        For each step, newest first, each tier holding it is tried in order; a copy that is
        missing, damaged or fails to load is skipped (logged with the reason) and the next
        tier, then the next older step, is tried.

        A tier that cannot be listed (unreachable, not answering by ``timeout``, its bucket
        missing) is never taken for an empty one: unless tier 0 holds the newest step (tier 0
        takes every save, so no tier can hold a newer one) and it restores, this raises.

        Args:
            step: Restore this step only (still falling back across tiers).
            allow_light: Also consider light (weights-only) saves; by default they are skipped
                so that a resumed run gets its optimizer state.
            map_location, weights_only: As for :func:`nvcomp_checkpoint.load`.
            loader: ``fn(path, storage_options) -> state`` for directory units (a sharded
                save); without one a directory unit is checked in full and returned with
                ``state=None``.
            timeout: Seconds to wait for the tiers' listings (all at once, default
                :data:`RESTORE_TIMEOUT_S`; ``None``: no limit). Reading the chosen copy is bounded by
                the store's own timeouts and retries (``storage_options``).

        Returns:
            A :class:`Restored` (``r.abandoned``: the newer steps the next saves remove), or None
            when every tier was listed and none holds any step (a fresh start).

        Raises:
            TierUnavailableError: A tier could not be listed, and the answer depends on it
                (:class:`~nvcomp_checkpoint.errors.TierNotFoundError`: its bucket does not exist).
            CheckpointError: Steps exist but no copy of any of them restores (every reason is named).
        """
        deadline = _Deadline(timeout)
        with self._lock:
            self._abandoned = {}  # known again only once this restore has listed the tiers
            handles = list(self._pending_saves)
        for h in handles:
            h.wait(deadline.left())
        listed, unavailable = self._list_tiers(deadline)
        found: dict[int, list[tuple[int, UnitManifest | str]]] = {}
        skipped: list[tuple[int, str, str]] = [(-1, self._stores[i].label, str(e)) for i, e in sorted(unavailable.items())]
        for i, (manifests, problems) in sorted(listed.items()):
            for s, entry in sorted({**manifests, **problems}.items()):
                found.setdefault(s, []).append((i, entry))
        # Tier 0 takes every save and keeps its newest: no other tier holds a step newer than that one.
        on_tier0 = [s for s, entries in found.items() if any(i == 0 for i, _ in entries)] if 0 in listed else []
        bound = max(on_tier0, default=None)

        def refuse() -> TierUnavailableError:
            first = unavailable[min(unavailable)]
            detail = "; ".join(f"step {s} on {t}: {r}" for s, t, r in skipped if s >= 0)[:_QUOTE]
            return type(first)(f"restore: {first}" + (f" (and the tiers listed restore no newer step: {detail})" if detail else ""))

        candidates = sorted(found, reverse=True) if step is None else ([step] if step in found else [])
        if not candidates:
            if unavailable:
                raise refuse()
            if step is not None:
                raise CheckpointError(f"step {step} is on no tier ({', '.join(s.root for s in self._stores)})")
            return None
        unread: set[int] = set()  # steps a copy of which could not be read (not found damaged): never abandoned
        for s in candidates:
            if unavailable and step is None and (bound is None or s < bound):
                raise refuse()
            for i, m in found[s]:
                store = self._stores[i]
                if isinstance(m, str):
                    _LOG.warning("restore: skipped step %d on %s: %s", s, store.label, m)
                    skipped.append((s, store.label, m))
                    continue
                where = store.unit_path(s, m.directory)
                if m.light and not allow_light:
                    skipped.append((s, store.label, "light (weights only); pass allow_light=True to use it"))
                    continue
                try:
                    store.check(m, full=m.directory or _every_byte)
                    opts = self.tiers[i].storage_options
                    layout = None if m.base is None else _check_chain(store, m, listed[i][0], full=_every_byte)
                    if _open_unit is not None:  # resume_path: a path to load, nothing loaded
                        where = _open_unit(i, m, layout)
                        state = None
                    elif loader is None and layout is not None and not _in_place(store, layout):
                        raise FormatError(
                            f"{where}: a delta whose chain keeps the names its framework gave it (copied by an integration's "
                            "tiers=); it loads laid out with its chain: use the integration's resume_path() or fetch()"
                        )
                    elif m.directory:
                        state = loader(where, opts) if loader is not None else None
                    elif loader is not None:
                        state = loader(where, opts)
                    else:
                        state = _load(where, map_location, weights_only=weights_only, storage_options=opts)
                except Exception as exc:  # noqa: BLE001 - any failure means: try the next copy
                    reason = f"{type(exc).__name__}: {exc}"
                    if not _is_damage(exc):
                        unread.add(s)
                    _LOG.warning("restore: skipped step %d on %s (%s): %s", s, store.label, where, reason)
                    skipped.append((s, store.label, reason))
                    continue
                return self._restored(Restored(s, state, i, store.label, where, m.light, tuple(skipped)), listed, unread)
        if unavailable:
            raise refuse()
        detail = "; ".join(f"step {s} on {t}: {r}" for s, t, r in skipped)
        raise CheckpointError(f"no copy of any step restores ({detail})")

    def _restored(self, r: Restored, listed: dict[int, tuple[dict[int, UnitManifest], dict[int, str]]], unread: set[int]) -> Restored:
        """Record which newer steps the run abandons (its saves remove them), say all of it in the log, return ``r`` with it."""
        abandoned: dict[int, set[int]] = {}
        kept: list[str] = []
        for i, (manifests, _) in sorted(listed.items()):
            newer = sorted(s for s in manifests if s > r.step)
            abandoned[i] = {s for s in newer if s not in unread}
            kept += [f"{s} on {self._stores[i].label}" for s in newer if s in unread]
        with self._lock:
            self._abandoned = abandoned
        pairs = tuple(sorted(((s, self._stores[i].label) for i, ss in abandoned.items() for s in ss), key=lambda p: (p[0], self.names.index(p[1]))))
        parts = [f"restore: step {r.step} ({'light' if r.light else 'full'}) from {r.tier_name}"]
        newer_skips = [f"step {s} on {t}: {why}" for s, t, why in r.skipped if s > r.step]
        other = [f"step {s} on {t}: {why}" if s >= 0 else f"{t}: {why}" for s, t, why in r.skipped if s <= r.step]
        if newer_skips:
            parts.append("newer steps not restored: " + "; ".join(newer_skips))
        if other:
            parts.append("also skipped: " + "; ".join(other))
        if pairs:
            parts.append("each save of this run removes the abandoned steps above it: " + "; ".join(
                f"{', '.join(str(s) for s in sorted(ss))} on {self._stores[i].label}" for i, ss in sorted(abandoned.items()) if ss
            ))
        if kept:
            parts.append("kept, since they could not be read (not found damaged): " + ", ".join(kept))
        parts.append(f"from {r.path}")
        _LOG.log(logging.WARNING if r.skipped or pairs else logging.INFO, "%s", "; ".join(parts))
        return replace(r, abandoned=pairs)


def open_tier(url: str, storage_options: dict[str, Any] | None = None, name: str | None = None) -> TierStore:
    """A :class:`TierStore` for a tier root URL (the CLI lists and syncs with it)."""
    tier = Tier(url, name=name, storage_options=storage_options)
    return TierStore(tier, name or tier.url)


def _run_removals(step: int, removals: list[Callable[[], None]]) -> None:
    for delete in removals:
        try:
            delete()
        except Exception as exc:  # noqa: BLE001 - a removal the framework asked for; the copies are done
            _LOG.warning("step %d: its copies are done, but removing the framework's checkpoint failed: %s", step, exc)


class TierCopies:
    """The ``tiers=`` argument of the integrations: copies of the checkpoints a framework writes itself.

    The framework's own checkpoint (Lightning's ``ModelCheckpoint`` file, Accelerate's
    ``save_state`` folder, the Trainer's ``checkpoint-N``) is tier 0, kept and rotated by the
    framework. Once a save is durable the integration calls :meth:`adopt`; a
    :class:`CheckpointManager` (``tier0_external=True``) copies it to the listed tiers on their
    schedules, checked, with their retention. :meth:`resume_path` is the newest restorable copy.

    Args:
        tiers: The tiers to copy to, fastest first (each a :class:`Tier`; none may be the framework's folder).
        owner: Names the integration in errors and labels tier 0 in logs and metrics.
        on_copy_progress: As for :class:`CheckpointManager`.
    """

    def __init__(self, tiers: Iterable[Tier], owner: str, *, on_copy_progress: Callable[[str, int, int], None] | None = None) -> None:
        if isinstance(tiers, (Tier, str, bytes, os.PathLike)):
            raise TypeError(f"{owner}(tiers=...) takes a list of nvcomp_checkpoint.Tier, got one {type(tiers).__name__}; wrap it in [...]")
        tiers = list(tiers)
        if not tiers:
            raise ValueError(f"{owner}(tiers=[]): give at least one nc.Tier to copy to, or leave tiers unset")
        bad = [t for t in tiers if not isinstance(t, Tier)]
        if bad:
            raise TypeError(
                f"{owner}(tiers=...) takes nvcomp_checkpoint.Tier objects, got {type(bad[0]).__name__} ({bad[0]!r}); "
                "write nc.Tier(url, every_minutes=..., keep=...)"
            )
        self.tiers = tiers
        self.owner = owner
        self.label = owner.split("(")[0]
        self.on_copy_progress = on_copy_progress
        self._manager: CheckpointManager | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # Lightning sends plugins to spawned processes
        return {"tiers": self.tiers, "owner": self.owner, "on_copy_progress": self.on_copy_progress}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("tiers"), state.pop("owner"), **state)  # type: ignore[misc]

    def manager(self, near: str | os.PathLike[str] | None = None) -> CheckpointManager:
        """The manager (made on first use; tier 0 is the folder of ``near``, or the working directory)."""
        with self._lock:
            if self._manager is None:
                root = os.path.dirname(os.path.abspath(os.fspath(near))) if near is not None and not is_url(os.fspath(near)) else None
                if near is not None and is_url(os.fspath(near)):
                    root = os.fspath(near).rstrip("/").rsplit("/", 1)[0]
                source = Tier(root or os.getcwd(), name=self.label)
                self._manager = CheckpointManager(
                    [source, *self.tiers], async_save=False, tier0_external=True, on_copy_progress=self.on_copy_progress,
                )
            return self._manager

    def adopt(self, step: int, path: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> None:
        """``path`` (a durable checkpoint file or folder of ``step``; a delta against ``base``) is copied to the tiers due."""
        self.manager(path).adopt(step, path, base=base)

    def wait(self, timeout: float | None = CLOSE_TIMEOUT_S, *, final: bool = False) -> None:
        """Wait for the copies started so far; raise the first failure (once).

        Args:
            timeout: As for :meth:`CheckpointManager.wait`.
            final: The end of the run: first copy each tier's newest step its schedule skipped
                (as :meth:`CheckpointManager.close` does); the manager stays open for later saves.

        Raises:
            CopyTimeoutError: Copies not done by the deadline (``exc.pending`` names each).
        """
        if self._manager is not None:
            self._manager._wait_for(_Deadline(timeout), f"{self.label}: waiting for the copies to the tiers", final=final)
            self._manager._raise_save_errors()

    def remove_after_copies(self, path: str | os.PathLike[str], delete: Callable[[], None]) -> bool:
        """The framework removes ``path``: now, or once its copies to the tiers are done (see
        :meth:`CheckpointManager.remove_after_copies`). Returns whether it was deferred."""
        if self._manager is None:
            delete()
            return False
        return self._manager.remove_after_copies(path, delete)

    def locate(self, step: int | None = None, timeout: float | None = RESTORE_TIMEOUT_S) -> Restored | None:
        """The newest copy on the tiers that checks (see :meth:`CheckpointManager.locate`)."""
        return self.manager().locate(step, timeout=timeout)

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None, timeout: float | None = RESTORE_TIMEOUT_S) -> str | None:
        """Where the newest restorable copy is (``None``: every tier was listed and none holds one, a fresh start).

        A tier that cannot be listed by ``timeout`` raises :class:`~nvcomp_checkpoint.errors.TierUnavailableError`
        (see :meth:`CheckpointManager.restore`).

        A copy on an object store, and a delta (``incremental=True``: its chain keeps the
        framework's file names), are first downloaded or laid out with their chain, checked, into
        ``local_dir`` (default ``.nvckpt-restore`` in the working directory), since frameworks
        load local paths (see :meth:`CheckpointManager.resume_path`).
        """
        target = local_dir if local_dir is not None else os.path.join(os.getcwd(), ".nvckpt-restore")
        found = self.manager().resume_path(target, timeout=timeout)
        if found is None:
            return None
        _LOG.info("%s: resume from step %d on %s (%s)", self.owner, found.step, found.tier_name, found.path)
        return found.path
