"""Retention: which steps a tier keeps. Pure policy functions (no I/O, no lock), shared by the manager and ``nvckpt sync``.

:class:`TierRetention` applies them to the tiers of one manager, with what this run knows about them.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from ..delta import retained
from .units import TierStore, UnitManifest

__all__ = ["retained_steps", "steps_to_remove", "TierRetention"]

_LOG = logging.getLogger("nvcomp_checkpoint")


def retained_steps(steps: Iterable[int], keep: int | None, keep_every_steps: int | None, protect: Iterable[int] = ()) -> set[int]:
    """The steps a tier keeps: the newest ``keep``, multiples of ``keep_every_steps``, and ``protect``."""
    ordered = sorted(set(steps))
    kept = set(ordered if keep is None else ordered[-keep:])
    if keep_every_steps:
        kept |= {s for s in ordered if s % keep_every_steps == 0}
    return kept | (set(protect) & set(ordered))


def steps_to_remove(
    manifests: dict[int, UnitManifest],
    keep: int | None,
    keep_every_steps: int | None,
    protect: Iterable[int] = (),
) -> list[int]:
    """The steps of a tier that retention removes, oldest first: never its newest step, its newest full step,
    ``protect``, or a base that a kept delta needs (a chain goes as a whole)."""
    if keep is None or not manifests:
        return []
    keep_also = {max(manifests), *protect}
    full = [s for s, m in manifests.items() if not m.light]
    if full:
        keep_also.add(max(full))
    kept = retained_steps(manifests, keep, keep_every_steps, keep_also)
    kept = set(retained(sorted(kept), lambda s: manifests[s].base if s in manifests else None))
    return sorted(set(manifests) - kept)


def newer_steps(steps: Iterable[int], top: int | None, replaceable: set[int]) -> tuple[list[int], list[int]]:
    """Steps above ``top`` (the step just committed): those this run replaces (in ``replaceable``: it
    committed them, or resumed from an older step than them), and those it keeps, unseen."""
    newer = [] if top is None else sorted(s for s in steps if s > top)
    return [s for s in newer if s in replaceable], [s for s in newer if s not in replaceable]


class TierRetention:
    """Retention on the tiers of one manager, with what this run knows: the steps it committed on each
    tier, and the newer steps its last restore did not resume from (both may be replaced by its saves).

    A step is recorded as the manager's own (:meth:`committing`) before its manifest makes it visible:
    retention runs on several threads (a save's commit, the end of a copy), and one that listed the tier
    between the manifest and the record took the manager's newest step for a foreign run's.
    """

    def __init__(self, stores: list[TierStore], pinned: Callable[[], set[int]]) -> None:
        self.stores = stores
        self.pinned = pinned  # tier-0 steps that queued or running copies (or a delta being saved) still read
        self._lock = threading.Lock()
        self._locks = [threading.Lock() for _ in stores]
        self._own: dict[int, set[int]] = {}  # tier -> steps this manager committed there (or is committing)
        self._head: dict[int, int] = {}  # tier -> the step this manager committed there last (not a base)
        self._abandoned: dict[int, set[int]] = {}  # tier -> newer steps the last restore listed and did not resume from
        self._kept_newer: dict[int, tuple[int, ...]] = {}  # tier -> newer steps a save last warned it keeps

    @contextmanager
    def committing(self, i: int, step: int, *, newest: bool = True) -> Iterator[None]:
        """Record ``step`` as this manager's own on tier ``i`` for the commit in the ``with`` block (its
        manifest written there); forgotten if the block raises.

        ``newest``: the step is the run's newest on the tier (a save, or a copy of one): steps of this run
        above it are replaced (a restore went back). ``False`` for a base copied before its delta.
        """
        with self._lock:
            own = self._own.setdefault(i, set())
            before = (step in own, self._head.get(i))
            own.add(step)
            self._abandoned.get(i, set()).discard(step)  # saved again by this run: its own now
            if newest:
                self._head[i] = step
        try:
            yield
        except BaseException:
            with self._lock:
                if not before[0]:
                    own.discard(step)
                if newest and self._head.get(i) == step:
                    if before[1] is None:
                        self._head.pop(i, None)
                    else:
                        self._head[i] = before[1]
            raise

    def abandon(self, abandoned: dict[int, set[int]]) -> None:
        """What the last restore left above the step it resumed from, per tier (``{}``: not known yet)."""
        with self._lock:
            self._abandoned = abandoned

    def apply(self, i: int, committed: int | None = None) -> list[int]:
        """Delete the steps tier ``i`` no longer keeps; never its newest step or newest full step.

        ``committed``: the step just committed there (default: the one this manager committed there
        last; a commit recorded since then counts instead). Steps above it that this run abandoned (the
        last restore listed them there and resumed from an older step, or this manager committed
        them before going back) are removed first. Steps above it that this run never saw (restore()
        was not called, or could not list the tier) are kept, with a warning, and left out of the count.
        """
        store, tier = self.stores[i], self.stores[i].tier
        with self._locks[i]:
            manifests = store.manifests()
            with self._lock:
                own = set(self._own.get(i, ()))
                replaceable = own | self._abandoned.get(i, set())
                top = self._head.get(i, committed)
            replaced, kept_newer = newer_steps(manifests, top, replaceable)
            for step in replaced:
                _LOG.warning(
                    "%s: removing step %d, newer than step %d just saved: a run resumed from an older step "
                    "replaces the steps after it",
                    store.label,
                    step,
                    top,
                )
                store.remove_unit(step, manifests.pop(step).directory)
            for step in kept_newer:
                del manifests[step]
            if kept_newer and self._kept_newer.get(i) != tuple(kept_newer):
                self._kept_newer[i] = tuple(kept_newer)
                _LOG.warning(
                    "%s: steps %s are newer than step %d just saved, and this run did not see them when it restored "
                    "(restore() was not called, or could not list this tier): they are kept, and a restore prefers "
                    "them; remove them by hand if they belong to an abandoned run",
                    store.label,
                    kept_newer,
                    top,
                )
            expired = steps_to_remove(manifests, tier.keep, tier.keep_every_steps, self.pinned() if i == 0 else ())
            for step in expired:
                store.remove_unit(step, manifests[step].directory)
            if expired:
                _LOG.info("%s: retention removed steps %s", store.label, replaced + expired)
            return replaced + expired
