"""The two kinds of tier 0: the manager's own folder, or a framework's folder whose checkpoints are adopted.

Both sit behind one protocol, so that the manager never asks which one it has. :class:`Pins` keeps
tier-0 units that copies (or a delta being saved) still read.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Protocol

from .. import metrics
from ..errors import CheckpointError, CheckpointWriteError
from ..failures import FailureLog
from ..storage import storage_for
from .units import TierStore, UnitManifest, is_folder

__all__ = ["Tier0", "OwnTier0", "ExternalTier0", "Pins"]

_LOG = logging.getLogger("nvcomp_checkpoint")


class Tier0(Protocol):
    store: TierStore
    #: Whether the manager cleans, retains and restores from tier 0 (it does not in a framework's folder).
    managed: bool

    def check_writable(self, what: str) -> None: ...
    def manifest(self, step: int) -> UnitManifest | None: ...
    def chain_of(self, manifest: UnitManifest) -> list[UnitManifest]: ...
    def step_at(self, path: str | os.PathLike[str]) -> int | None: ...
    def forget(self, step: int) -> None: ...


class OwnTier0:
    """Tier 0 written by the manager's own saves (and :meth:`CheckpointManager.commit`)."""

    managed = True

    def __init__(self, store: TierStore) -> None:
        self.store = store

    def check_writable(self, what: str) -> None:
        return None

    def manifest(self, step: int) -> UnitManifest | None:
        return self.store.manifest(step)

    def chain_of(self, manifest: UnitManifest) -> list[UnitManifest]:
        return []  # the copy of a delta reads its bases from tier 0's manifests as it goes

    def step_at(self, path: str | os.PathLike[str]) -> int | None:
        return None

    def forget(self, step: int) -> None:
        return None


class ExternalTier0:
    """Tier 0 is a framework's own checkpoint folder, written and rotated by it: the manager never writes,
    cleans, retains or restores there; units come in through :meth:`adopt` and are copied on."""

    managed = False

    def __init__(self, store: TierStore, lock: threading.RLock, failures: FailureLog) -> None:
        self.store = store
        self._lock = lock
        self._failures = failures
        self._adopted: dict[str, int] = {}  # tier-0 path an adopted unit was read from -> its step
        self._units: dict[int, UnitManifest] = {}  # step -> its adopted unit, while it is on tier 0
        self._last: tuple[int, str] | None = None

    def check_writable(self, what: str) -> None:
        raise CheckpointError(
            f"CheckpointManager.{what}: tier 0 ({self.store.tier.url}) belongs to the framework that writes it "
            "(tier0_external=True); hand each checkpoint it wrote to adopt(step, path) instead."
        )

    def path(self, path: str | os.PathLike[str]) -> str:
        """``path`` as tier 0's storage names it (absolute for a local folder)."""
        _, spath = storage_for(os.fspath(path), self.store.tier.storage_options)
        return os.path.abspath(spath) if self.store.storage.is_local else spath

    def adopt(
        self, step: int, path: str | os.PathLike[str], light: bool, base: str | os.PathLike[str] | None
    ) -> UnitManifest | None:
        """The manifest of the unit at ``path`` as ``step`` (None: not to be copied); see :meth:`CheckpointManager.adopt`."""
        spath = self.path(path)  # absolute: the copy runs later, maybe after a chdir
        if not self.store.storage.exists(spath):
            raise CheckpointError(f"{spath}: nothing to adopt as step {step} (the checkpoint is not there)")
        if self._last == (step, spath):
            return None
        if self._last is not None and self._last[0] == step:
            _LOG.debug("step %d already adopted from %s; %s is not copied again", step, self._last[1], spath)
            return None
        base_step = None
        if base is not None:
            bpath = self.path(base)
            base_step = self.step_at(bpath)
            if base_step is None or base_step >= step:
                error = CheckpointWriteError(
                    f"{spath}: step {step} is a delta against {bpath}, which was not handed to the tiers as an earlier step "
                    "(saved without a step, by another process, or already removed); it is not copied to the tiers. "
                    "The next full save is."
                )
                _LOG.error("%s", error)
                self._failures.record(error, what="a copy to the tiers failed")
                return None
        manifest = self.store.describe(step, is_folder(self.store.storage, spath), light, source=spath, base=base_step)
        self._last = (step, spath)
        with self._lock:
            self._adopted[spath] = step
            self._units[step] = manifest
        metrics.record_last_step(self.store.label, step)
        return manifest

    def manifest(self, step: int) -> UnitManifest | None:
        with self._lock:
            return self._units.get(step)

    def chain_of(self, manifest: UnitManifest) -> list[UnitManifest]:
        """The bases of an adopted delta that tier 0 still holds, nearest first."""
        with self._lock:
            chain: list[UnitManifest] = []
            base = manifest.base
            while base is not None and base in self._units and len(chain) < len(self._units):
                chain.append(self._units[base])
                base = chain[-1].base
        return chain

    def step_at(self, path: str | os.PathLike[str]) -> int | None:
        with self._lock:
            return self._adopted.get(self.path(path))

    def forget(self, step: int) -> None:
        with self._lock:
            for gone in [p for p, s in self._adopted.items() if s == step]:
                del self._adopted[gone]
            self._units.pop(step, None)


class Pins:
    """Tier-0 steps that copies (or a delta being saved) still read, and the removals waiting for them."""

    def __init__(self, tier0: Tier0, lock: threading.RLock) -> None:
        self.tier0 = tier0
        self._lock = lock
        self._count: dict[int, int] = {}  # step -> copies queued or running from it (and saves of its deltas)
        self._removals: dict[int, list[Callable[[], None]]] = {}  # step -> deletions waiting for its copies

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._count)

    def pin(self, steps: list[int]) -> None:
        with self._lock:
            for step in steps:
                self._count[step] = self._count.get(step, 0) + 1

    def unpin(self, steps: list[int]) -> None:
        for step in steps:
            with self._lock:
                left = self._count.get(step, 1) - 1
                if left:
                    self._count[step] = left
                else:
                    self._count.pop(step, None)
                removals = [] if left else self._removals.pop(step, [])
            if removals:  # the unit goes: forget where it was adopted from
                self.tier0.forget(step)
            for delete in removals:
                try:
                    delete()
                except Exception as exc:  # noqa: BLE001 - a removal the framework asked for; the copies are done
                    _LOG.warning("step %d: its copies are done, but removing the framework's checkpoint failed: %s", step, exc)

    def remove_after(self, path: str | os.PathLike[str], delete: Callable[[], None]) -> bool:
        """Run ``delete`` once no copy reads the unit adopted from ``path``; whether it was deferred."""
        step = self.tier0.step_at(path)
        with self._lock:
            if step is not None and self._count.get(step):
                self._removals.setdefault(step, []).append(delete)
                return True
        if step is not None:
            self.tier0.forget(step)
        delete()
        return False
