"""The checkpoint manager: saves to tier 0, copies to the other tiers on their schedules, retention, restore.

The jobs are modules of this package (schedule, units, chains, transfer, retention, restore, tier 0,
copier); the manager wires them. The layout and commit rules are in ``docs/tiers.md``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from ..api import load as _load
from ..credentials import redacted
from ..deadline import Deadline
from ..delta import ChainPolicy, chain_policy_of
from ..errors import CheckpointError, CopyTimeoutError, FormatError
from ..failures import FailureLog
from ..policy import CodecPolicy
from ..saveoptions import SaveOptions
from ..storage import is_url, list_names
from .chains import lies_in_place
from .cleaning import Cleaning
from .copier import Copier, NotCopied
from .restore import Restored, Restorer
from .retention import TierRetention
from .saving import Tier0Saves
from .schedule import CLOSE_TIMEOUT_S, RESTORE_TIMEOUT_S, Tier
from .tier0 import ExternalTier0, OwnTier0, Pins, Tier0
from .units import TierStore, UnitManifest

__all__ = ["CheckpointManager"]

_LOG = logging.getLogger("nvcomp_checkpoint")


class CheckpointManager:
    """Saves to tier 0, copies to the other tiers on their schedules, applies retention, restores.

    Args:
        tiers: Fastest first. Tier 0 takes every save; a later tier receives a verified copy
            of the compressed unit when its schedule says so.
        async_save: Save in the background (return once the snapshot is taken), through the
            manager's :class:`~nvcomp_checkpoint.savegroup.SaveSequence`; ``False`` saves synchronously.
        full_every: Every ``full_every``-th save (the first included) is full; the others keep
            only the tensors classified ``weights`` and are marked light, or, with
            ``incremental``, are deltas of the whole state. ``None``: all full (with
            ``incremental``: 10).
        incremental: Save each checkpoint as a delta against an earlier one
            (:func:`nvcomp_checkpoint.save` with ``base=``); the manifest records the base step.
            ``True`` (with ``full_every`` and ``delta_base``) or a :class:`~nvcomp_checkpoint.ChainPolicy`.
            Retention keeps every base a kept step needs, a delta is committed on a tier only
            after its base, and restore treats a delta whose chain is broken as a damaged copy.
            The first save of a manager is full.
        delta_base: With ``incremental=True``: ``"previous"`` (default) or ``"full"`` (see
            :class:`~nvcomp_checkpoint.ChainPolicy`). It and ``full_every`` are refused together with a
            ``ChainPolicy``, which holds both.
        policy: Codec settings of the saves.
        workers: Compression threads.
        clean: Remove leftovers of interrupted saves and copies from every tier, in the background (the
            constructor does no I/O on the tiers); a save to tier 0, :meth:`unit_path` and the copies to a
            tier wait for its cleaning first, :meth:`wait` and :meth:`close` for every tier's, within their
            deadline. Only one manager may work on a tier root at a time.
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
        incremental: bool | ChainPolicy = False,
        delta_base: str | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("CheckpointManager needs at least one Tier")
        if isinstance(tiers, Tier):
            raise TypeError("CheckpointManager(tiers=...) takes a list of nvcomp_checkpoint.Tier, got one Tier; wrap it in [...]")
        bad = [t for t in tiers if not isinstance(t, Tier)]
        if bad:  # a dict or a URL: named, credentials left out (a dict may hold storage_options)
            raise TypeError(
                f"CheckpointManager(tiers=...) takes nvcomp_checkpoint.Tier objects, got {type(bad[0]).__name__} "
                f"({redacted(bad[0])!r}); write nc.Tier(url, every_minutes=..., keep=..., storage_options=...)"
            )
        if tiers[0].every_steps is not None or tiers[0].every_minutes is not None:
            raise ValueError(f"Tier 0 ({tiers[0].url}) takes every save; give its schedule to a later tier instead")
        if is_url(tiers[0].url):
            _LOG.info("tier 0 is %s: every save is written there directly", tiers[0].url)
        if full_every is not None and (not isinstance(full_every, int) or isinstance(full_every, bool) or full_every < 1):
            raise ValueError(f"full_every must be a positive integer or None, got {full_every!r}")
        self.chain_policy: ChainPolicy | None = chain_policy_of(incremental, full_every, delta_base, "CheckpointManager")
        if self.chain_policy is not None and tier0_external:
            raise ValueError(
                "CheckpointManager(incremental=True, tier0_external=True): the framework writes tier 0 itself; give "
                "the framework's integration incremental=True instead (its files are then deltas, adopted with their base)"
            )
        self.tiers, self.async_save, self.workers, self.on_copy_progress = list(tiers), async_save, workers, on_copy_progress
        self.policy = CodecPolicy.of(policy, "CheckpointManager(policy=...)")
        SaveOptions(policy=self.policy, workers=workers)  # checks workers now, not at the first save
        self.tier0_external = bool(tier0_external)
        self.incremental = self.chain_policy is not None
        self.full_every = self.chain_policy.full_every if self.chain_policy is not None else full_every
        labels = [t.name or f"tier{i}" for i, t in enumerate(tiers)]
        if len(set(labels)) != len(labels):
            raise ValueError(f"tier names must differ, got {labels}")
        self._stores = [TierStore(t, label) for t, label in zip(tiers, labels)]
        self._lock = threading.RLock()
        self._failures = FailureLog()  # every failed save and copy, raised once by save(), wait() or close()
        self._tier0: Tier0 = (
            ExternalTier0(self._stores[0], self._lock, self._failures) if tier0_external else OwnTier0(self._stores[0])
        )
        self._pins = Pins(self._tier0, self._lock)
        self._retention = TierRetention(self._stores, self._pins.steps)
        self._restorer = Restorer(self._stores, first=0 if self._tier0.managed else 1)
        self._cleaning = Cleaning(self._stores, [clean and (i > 0 or self._tier0.managed) for i in range(len(tiers))])
        self._copier = Copier(
            self._stores, self._tier0, self._pins, self._retention, self._failures, self._lock, self._cleaning, on_copy_progress
        )
        self._tier0_saves = Tier0Saves(
            self._stores[0],
            self._copier,
            self._retention,
            self._pins,
            self._failures,
            async_save=async_save,
            policy=self.policy,
            workers=workers,
            full_every=self.full_every,
            chain_policy=self.chain_policy,
        )

    @property
    def names(self) -> list[str]:
        return [s.label for s in self._stores]

    # -- saving -------------------------------------------------------------------------------
    def unit_path(self, step: int, *, directory: bool = False) -> str:
        """Where a save of ``step`` goes on tier 0 (a folder for a sharded, multi-file unit); once tier 0 is
        cleaned of leftovers (which would take a unit being written there for one)."""
        self._cleaning.ready(0)
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
        self._tier0.check_writable("save()")
        self._cleaning.ready(0)
        return self._tier0_saves.save(step, state, light)

    def commit(self, step: int, *, light: bool = False, directory: bool | None = None) -> UnitManifest:
        """Register a unit written to :meth:`unit_path` by someone else (a sharded save), and copy it on.

        Raises:
            CheckpointError: Nothing is there for ``step``.
        """
        self._tier0.check_writable("commit()")
        self._cleaning.ready(0)
        store = self._stores[0]
        if directory is None:
            directory = list_names(store.storage, store.root).get(f"step-{step:010d}", False)
        return self._tier0_saves.committed(step, directory, light)

    def adopt(
        self, step: int, path: str | os.PathLike[str], *, light: bool = False, base: str | os.PathLike[str] | None = None
    ) -> UnitManifest | None:
        """Copy a file or folder someone else wrote and made durable (a framework's checkpoint) as ``step``.

        The unit stays where it is, owned and rotated by whoever wrote it; its size and digests
        are taken now, and the tiers due get a checked copy in the background, with their
        retention, exactly as for :meth:`save`. A copy whose source is deleted before it is done
        (the framework's own rotation) is skipped with a warning. Adopting the step adopted last
        again (Lightning's ``last.ckpt`` beside the top-k file) does nothing. A failed copy is
        logged at once and raised by :meth:`wait` / :meth:`close` (never here).

        ``base``: the unit is a delta (an integration's ``incremental=True``) against the unit adopted
        from this path; the manifest records that step, a copy brings the part of the chain a tier
        lacks first, and the framework's removal of a base waits for the copies that need it. A
        delta whose base this manager did not adopt is not copied (the error is raised by :meth:`wait`).

        Returns:
            The unit's manifest (``None`` when it repeats the last adopted step).

        Raises:
            CheckpointError: Nothing is at ``path`` (or an empty folder), or tier 0 is the manager's own.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(self._tier0, ExternalTier0):
            raise CheckpointError(
                f"CheckpointManager.adopt(): tier 0 ({self.tiers[0].url}) is the manager's own; pass tier0_external=True"
            )
        manifest = self._tier0.adopt(step, path, light, base)
        if manifest is not None:
            self._copier.schedule(manifest)
        return manifest

    def remove_after_copies(self, path: str | os.PathLike[str], delete: Callable[[], None]) -> bool:
        """Run ``delete`` (the framework's removal of an adopted unit) once its copies are done.

        A framework's own rotation may remove a checkpoint whose copies to the tiers are still
        queued or running; the deletion then waits for them (on the copy thread).

        Returns:
            ``True`` if the deletion was deferred; ``False`` if it ran now.
        """
        return self._pins.remove_after(path, delete)

    # -- queries ------------------------------------------------------------------------------
    def steps(self, tier: int = 0) -> list[int]:
        """Steps with a complete, checked copy on ``tier``, oldest first."""
        return self._stores[tier].steps()

    def path(self, step: int, tier: int = 0) -> str | None:
        """Where ``step``'s copy lives on ``tier`` (None if it is not there)."""
        m = self._stores[tier].manifest(step)
        return None if m is None else self._stores[tier].unit_path(step, m.directory)

    def manifest(self, step: int, tier: int = 0) -> UnitManifest | None:
        return self._stores[tier].manifest(step)

    # -- waiting ------------------------------------------------------------------------------
    def wait(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait for every pending save and copy; raise the first failure (each is raised once).

        Raises:
            CopyTimeoutError: Saves or copies still pending at the deadline (``exc.pending``: a
                :class:`NotCopied` for each, naming where the step still is).
        """
        self.wait_for_copies(Deadline(timeout, "CheckpointManager.wait(timeout=...)"), "wait()")

    def wait_for_copies(self, deadline: Deadline, what: str, *, final: bool = False) -> None:
        """:meth:`wait`, naming ``what`` at the deadline; ``final``: first copy each tier's newest step its schedule skipped."""
        self._wait_for(deadline, what, final=final)
        self._failures.raise_oldest()

    def _wait_for(self, deadline: Deadline, what: str, *, final: bool = False) -> None:
        """Wait for the pending saves and copies (``final``: and copy each tier's newest step its
        schedule skipped) until ``deadline``; raise :class:`CopyTimeoutError` naming what is left."""
        self._cleaning.wait(deadline)  # not reported at the deadline: a tier left uncleaned is no failure
        changed = self._copier.changed
        with changed:
            while self._tier0_saves.saving and not deadline.expired:  # a completion may still be queueing copies
                changed.wait(deadline.left())
        if final and not self._tier0_saves.saving:
            self._copier.copy_newest(deadline)
        with changed:
            while self._copier.busy() and not deadline.expired:
                changed.wait(deadline.left())
        with self._lock:
            left = [NotCopied(s, self.names[0], g.path, "saving") for g, s in self._tier0_saves.saving.items()]
        left += self._copier.not_copied(final=final)
        if left:
            listed = "; ".join(
                f"step {p.step} to {p.tier} ({p.state}; still at {p.path})"
                if p.state != "saving"
                else f"step {p.step} (still being saved to {p.path})"
                for p in left[:8]
            )
            more = f"; and {len(left) - 8} more" if len(left) > 8 else ""
            raise CopyTimeoutError(
                f"{what}: gave up after {deadline.describe()} with {len(left)} save(s) or copies not done: {listed}{more}. "
                "Nothing half-done is listed on a tier (a step is there once its manifest is); copy the steps left "
                "later with `nvckpt sync`, or pass a longer timeout",
                tuple(left),
            )

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait for saves and copies, copy each tier's newest step its schedule skipped, stop the copy threads.

        Args:
            timeout: Seconds to wait at most (default :data:`CLOSE_TIMEOUT_S`; ``None``: no limit). At the
                deadline, queued copies are dropped; a running copy is committed only if it completes.

        Raises:
            CopyTimeoutError: Saves or copies not done by the deadline (``exc.pending`` names each); other failures are logged.
            CheckpointWriteError: A save or copy failed (the first one; the others are logged).
        """
        deadline = Deadline(timeout, "CheckpointManager.close(timeout=...)")
        try:
            self._wait_for(deadline, "close()", final=True)
        except CopyTimeoutError:
            self._failures.log_all()
            raise
        finally:
            self._copier.stop(deadline)
            if not self._tier0_saves.saving:
                self._tier0_saves.sequence.close()
        self._failures.raise_oldest()

    # -- restoring ----------------------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        allow_light: bool = False,
        map_location: Any = None,
        weights_only: bool = True,
        loader: Callable[[str, dict[str, Any] | None], Any] | None = None,
        timeout: float | None = RESTORE_TIMEOUT_S,
    ) -> Restored | None:
        """Load the newest step whose copy checks and loads, fastest tier first.

        For each step, newest first, each tier holding it is tried in order; a copy that is missing, damaged
        or fails to load is skipped (logged with the reason) and the next tier, then the next older step, is
        tried. A tier that cannot be listed (unreachable, not answering by ``timeout``, its bucket missing) is
        never taken for an empty one: unless tier 0 holds the newest step and it restores, this raises.

        Args:
            step: Restore this step only (still falling back across tiers).
            allow_light: Also consider light (weights-only) saves; by default they are skipped
                so that a resumed run gets its optimizer state.
            map_location, weights_only: As for :func:`nvcomp_checkpoint.load`.
            loader: ``fn(path, storage_options) -> state`` for directory units (a sharded save); without
                one a directory unit is checked in full and returned with ``state=None``.
            timeout: Seconds to wait for the tiers' listings (all at once; ``None``: no limit).

        Returns:
            A :class:`Restored` (``r.abandoned``: the newer steps the next saves remove), or None
            when every tier was listed and none holds any step (a fresh start).

        Raises:
            TierUnavailableError: A tier could not be listed, and the answer depends on it
                (:class:`~nvcomp_checkpoint.errors.TierNotFoundError`: its bucket does not exist).
            CheckpointError: Steps exist but no copy of any of them restores (every reason is named).
        """

        def load(i: int, m: UnitManifest, layout: list[tuple[UnitManifest, str]] | None) -> tuple[str, Any]:
            store = self._stores[i]
            where, opts = store.unit_path(m.step, m.directory), store.tier.storage_options
            if loader is None and layout is not None and not lies_in_place(store, layout):
                raise FormatError(
                    f"{where}: a delta whose chain keeps the names its framework gave it (copied by an integration's "
                    "tiers=); it loads laid out with its chain: use the integration's resume_path() or fetch()"
                )
            if loader is not None:
                return where, loader(where, opts)
            return where, None if m.directory else _load(where, map_location, weights_only=weights_only, storage_options=opts)

        deadline = Deadline(timeout, "CheckpointManager.restore(timeout=...)")
        return self._find(step, allow_light, deadline, every_byte=False, open_unit=load)

    def locate(
        self, step: int | None = None, *, allow_light: bool = False, timeout: float | None = RESTORE_TIMEOUT_S
    ) -> Restored | None:
        """The newest copy that checks (every byte against its manifest), without loading it (``r.state`` is None).

        For a framework that loads the checkpoint itself from ``r.path``; same order, fallback and ``timeout`` as :meth:`restore`.
        """

        def check_only(i: int, m: UnitManifest, layout: list[tuple[UnitManifest, str]] | None) -> tuple[str, Any]:
            return self._stores[i].unit_path(m.step, m.directory), None

        deadline = Deadline(timeout, "CheckpointManager.locate(timeout=...)")
        return self._find(step, allow_light, deadline, every_byte=True, open_unit=check_only)

    def resume_path(
        self, local_dir: str | os.PathLike[str], *, allow_light: bool = False, timeout: float | None = RESTORE_TIMEOUT_S
    ) -> Restored | None:
        """:meth:`locate`, for a framework that loads a local path: ``r.path`` is loadable as it is.

        A copy on an object store, and a delta whose chain keeps its framework's names, are first
        :meth:`fetch` ed into ``local_dir``; a candidate whose fetch or decode fails is skipped like any damaged copy.
        """

        def local_path(i: int, m: UnitManifest, layout: list[tuple[UnitManifest, str]] | None) -> tuple[str, Any]:
            store = self._stores[i]
            if not is_url(store.root) and (layout is None or lies_in_place(store, layout)):
                return store.unit_path(m.step, m.directory), None
            path = self.fetch(m.step, i, local_dir)
            _LOG.info("step %d fetched from %s to %s", m.step, store.label, path)
            return path, None

        deadline = Deadline(timeout, "CheckpointManager.resume_path(timeout=...)")
        return self._find(None, allow_light, deadline, every_byte=True, open_unit=local_path)

    def _find(
        self, step: int | None, allow_light: bool, deadline: Deadline, *, every_byte: bool, open_unit: Any
    ) -> Restored | None:
        self._retention.abandon({})  # known again only once this restore has listed the tiers
        with self._lock:
            pending = list(self._tier0_saves.saving)
        for group in pending:
            group.finished.wait(deadline.left())
        found, abandoned, newest = self._restorer.find(
            step, allow_light=allow_light, every_byte=every_byte, open_unit=open_unit, deadline=deadline
        )
        self._retention.abandon(abandoned)
        self._copier.listed(newest)
        return found

    def fetch(self, step: int, tier: int, local_dir: str | os.PathLike[str]) -> str:
        """Copy ``step`` from ``tier`` into the folder ``local_dir`` (checked, with its chain); its local path.

        See :meth:`Restorer.fetch <nvcomp_checkpoint.tiers.restore.Restorer.fetch>` for the layout and for
        several processes fetching into one folder at once.

        Raises:
            CheckpointError: ``tier`` does not hold ``step``, its chain is broken there, the laid-out
                delta does not decode, or an earlier fetch of the same chain in ``local_dir`` is damaged.
        """
        return self._restorer.fetch(step, tier, local_dir)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self.close()
        except Exception as err:  # noqa: BLE001 - the body's exception is the one to see
            if exc_type is None:
                raise
            _LOG.error("while closing the checkpoint manager: %s", err)
