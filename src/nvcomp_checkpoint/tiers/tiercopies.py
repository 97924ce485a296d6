"""The integrations' ``tiers=`` option: copies of the checkpoints a framework writes and rotates itself."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Iterable

from ..credentials import redacted
from ..deadline import Deadline
from ..storage import is_url
from .manager import CheckpointManager
from .restore import Restored
from .schedule import CLOSE_TIMEOUT_S, RESTORE_TIMEOUT_S, Tier

__all__ = ["TierCopies"]

_LOG = logging.getLogger("nvcomp_checkpoint")


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

    def __init__(
        self, tiers: Iterable[Tier], owner: str, *, on_copy_progress: Callable[[str, int, int], None] | None = None
    ) -> None:
        if isinstance(tiers, (Tier, str, bytes, os.PathLike)):
            raise TypeError(
                f"{owner}(tiers=...) takes a list of nvcomp_checkpoint.Tier, got one {type(tiers).__name__}; wrap it in [...]"
            )
        tiers = list(tiers)
        if not tiers:
            raise ValueError(f"{owner}(tiers=[]): give at least one nc.Tier to copy to, or leave tiers unset")
        bad = [t for t in tiers if not isinstance(t, Tier)]
        if bad:
            raise TypeError(
                f"{owner}(tiers=...) takes nvcomp_checkpoint.Tier objects, got {type(bad[0]).__name__} ({redacted(bad[0])!r}); "
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
                root = (
                    os.path.dirname(os.path.abspath(os.fspath(near)))
                    if near is not None and not is_url(os.fspath(near))
                    else None
                )
                if near is not None and is_url(os.fspath(near)):
                    root = os.fspath(near).rstrip("/").rsplit("/", 1)[0]
                source = Tier(root or os.getcwd(), name=self.label)
                self._manager = CheckpointManager(
                    [source, *self.tiers],
                    async_save=False,
                    tier0_external=True,
                    on_copy_progress=self.on_copy_progress,
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
        deadline = Deadline(timeout, f"{self.label}.wait(timeout=...)")
        if self._manager is not None:
            self._manager.wait_for_copies(deadline, f"{self.label}: waiting for the copies to the tiers", final=final)

    def remove_after_copies(self, path: str | os.PathLike[str], delete: Callable[[], None]) -> bool:
        """The framework removes ``path``: now, or once its copies to the tiers are done (see
        :meth:`CheckpointManager.remove_after_copies`). Returns whether it was deferred."""
        if self._manager is None:
            delete()
            return False
        return self._manager.remove_after_copies(path, delete)

    def locate(self, step: int | None = None, timeout: float | None = RESTORE_TIMEOUT_S) -> Restored | None:
        """The newest copy on the tiers that checks (see :meth:`CheckpointManager.locate`)."""
        deadline = Deadline(timeout, f"{self.label}.locate(timeout=...)")
        return self.manager().locate(step, timeout=deadline.left())

    def resume_path(
        self, local_dir: str | os.PathLike[str] | None = None, timeout: float | None = RESTORE_TIMEOUT_S
    ) -> str | None:
        """Where the newest restorable copy is (``None``: every tier was listed and none holds one, a fresh start).

        A tier that cannot be listed by ``timeout`` raises :class:`~nvcomp_checkpoint.errors.TierUnavailableError`
        (see :meth:`CheckpointManager.restore`).

        A copy on an object store, and a delta (``incremental=True``: its chain keeps the
        framework's file names), are first downloaded or laid out with their chain, checked, into
        ``local_dir`` (default ``.nvckpt-restore`` in the working directory), since frameworks
        load local paths (see :meth:`CheckpointManager.resume_path`).
        """
        deadline = Deadline(timeout, f"{self.label}.resume_path(timeout=...)")
        target = local_dir if local_dir is not None else os.path.join(os.getcwd(), ".nvckpt-restore")
        found = self.manager().resume_path(target, timeout=deadline.left())
        if found is None:
            return None
        _LOG.info("%s: resume from step %d on %s (%s)", self.owner, found.step, found.tier_name, found.path)
        return found.path
