"""The manager's own saves to tier 0: full, light or a delta (its ChainPolicy), through one SaveSequence,
each committed by its manifest once durable, then copied on."""

from __future__ import annotations

import threading
import time
from typing import Any

from .. import metrics
from ..api import save_with_options
from ..delta import ChainPolicy
from ..errors import CheckpointWriteError
from ..failures import FailureLog
from ..policy import CodecPolicy
from ..savegroup import SaveGroup, SaveSequence
from ..saveoptions import SaveOptions
from .copier import Copier
from .light import light_tree
from .retention import TierRetention
from .tier0 import Pins
from .units import TierStore, UnitManifest

__all__ = ["Tier0Saves"]


class Tier0Saves:
    """Saves to tier 0 in order, each a group of one :class:`~nvcomp_checkpoint.savegroup.SaveSequence` whose
    failures go to the manager's :class:`~nvcomp_checkpoint.failures.FailureLog` (raised by the next save)."""

    def __init__(
        self,
        store: TierStore,
        copier: Copier,
        retention: TierRetention,
        pins: Pins,
        failures: FailureLog,
        *,
        async_save: bool,
        policy: CodecPolicy,
        workers: int | None,
        full_every: int | None,
        chain_policy: ChainPolicy | None,
    ) -> None:
        self.store, self.copier, self.retention, self.pins = store, copier, retention, pins
        self.async_save, self.policy, self.workers = async_save, policy, workers
        self.full_every, self.chain_policy = full_every, chain_policy
        self._failures = failures
        self.changed = copier.changed
        self.sequence = SaveSequence(f"CheckpointManager({store.label})", max_pending=1, workers=workers, failures=failures)
        self.saving: dict[SaveGroup, int] = {}  # background saves not yet committed -> their step
        self._chain: list[int] = []  # steps saved since the manager started, while the chain is unbroken
        self._count = 0

    def save(self, step: int, state: Any, light: bool | None) -> Any:
        """A save of ``step`` (see :meth:`CheckpointManager.save`)."""
        try:
            self._failures.raise_oldest()
        except BaseException:
            self._chain = []  # a failed save is no base: the next one is full
            raise
        if light is None:
            light = self.full_every is not None and self.chain_policy is None and self._count % self.full_every != 0
        self._count += 1
        base = None if light else self._next_base(step)
        tree = state
        meta: dict[str, Any] = {"nvckpt_step": step, "nvckpt_light": bool(light)}
        if light:
            tree, meta["nvckpt_dropped"] = light_tree(state)
        if base is not None:
            meta["nvckpt_base_step"] = base
        pins = [] if base is None else [base]  # tier-0 retention keeps the base until this save is committed
        self.pins.pin(pins)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.pins.unpin(pins)
                with self.changed:
                    self.saving.pop(group, None)
                    self.changed.notify_all()

        def commit(reports: dict[str, Any]) -> None:
            try:
                metrics.record_save_seconds(self.store.label, "write", reports["unit"].seconds)
                self.committed(step, False, bool(light), reports["unit"], base)
            finally:
                release()

        def failed(error: BaseException | None = None) -> None:
            self._chain = []  # no delta against a failed save: the next save is full
            release()

        started = time.perf_counter()
        group = self.sequence.begin(
            self.store.unit_path(step, False), started=started, commit=commit, failed=failed, info={"step": step}
        )
        path = self.store.unit_path(step, False)
        try:
            options = SaveOptions.of(
                path,
                "CheckpointManager.save",
                policy=self.policy,
                metadata=meta,
                storage_options=self.store.tier.write_options(),
                workers=self.workers,
                base=None if base is None else self.store.unit_path(base, False),
            )
            if self.async_save:
                with self.changed:
                    self.saving[group] = step
                handle = self.sequence.save(group, "unit", tree, path, options)
            else:
                report = save_with_options(tree, path, options)
                group.add_report("unit", report)
        except BaseException:
            self.sequence.abandon(group)  # calls no callback of the group: its cleanup is done here
            failed()
            raise
        blocked = time.perf_counter() - started
        metrics.record_blocked_seconds(blocked)
        self.sequence.seal(group)
        if self.async_save:
            metrics.record_save_seconds(self.store.label, "snapshot", blocked)
            return handle
        self.sequence.result(group)
        return report

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

    def committed(self, step: int, directory: bool, light: bool, report: Any = None, base: int | None = None) -> UnitManifest:
        """Commit the unit of ``step`` written to tier 0 (its manifest), queue its copies, apply tier 0's retention."""
        store = self.store
        if base is not None and store.manifest(base) is None:
            self._chain = []
            raise CheckpointWriteError(
                f"{store.label}: step {step} is a delta against step {base}, which is not committed there (its save "
                f"failed or it was removed); step {step} is not committed. The next save is full."
            )
        manifest = store.describe(step, directory, light, base=base)
        with self.retention.committing(0, step):
            store.write_manifest(manifest)
        metrics.record_bytes_written(store.label, manifest.stored_bytes)
        metrics.record_last_step(store.label, step)
        if report is not None and report.stored_bytes:
            metrics.record_ratio(report.raw_bytes / report.stored_bytes)
        self.copier.schedule(manifest)
        self.retention.apply(0, step)
        return manifest
