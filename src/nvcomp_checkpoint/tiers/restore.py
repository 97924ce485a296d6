"""Restore: the newest copy that checks across tiers and steps, and a copy fetched with its chain into a local folder."""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..deadline import Deadline
from ..errors import CheckpointError, FormatError, TierUnavailableError
from ..storage import LOCAL, is_storage_error, local_lock
from .chains import (
    chain_layout,
    chain_manifests,
    check_chain,
    decode_errors,
    laid_out_errors,
    lay_out,
    layout_key,
    lies_in_place,
    remove_quietly,
    scratch_folder,
)
from .schedule import run_within
from .units import QUOTE_CHARS, TierStore, UnitManifest, entry_path

__all__ = ["Restored", "Restorer", "is_damage"]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: ``open_unit(tier, manifest, layout)`` -> ``(path, state)``: what a restore does with a copy that checked.
OpenUnit = Callable[[int, UnitManifest, "list[tuple[UnitManifest, str]] | None"], "tuple[str, Any]"]


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


def is_damage(exc: BaseException) -> bool:
    """Whether a failed restore of a copy says the copy is bad, as opposed to its storage not answering."""
    if isinstance(exc, TierUnavailableError) or not isinstance(exc, CheckpointError):
        return False
    cause = exc.__cause__
    return cause is None or isinstance(cause, (FileNotFoundError, CheckpointError)) or not is_storage_error(cause)


class Restorer:
    """Finds the newest copy that checks across the tiers of one manager, and fetches a copy with its chain.

    Args:
        stores: The manager's tiers, fastest first.
        first: The first tier that restores may read (1 where tier 0 is a framework's own folder).
    """

    def __init__(self, stores: list[TierStore], first: int = 0) -> None:
        self._stores = stores
        self.first = first
        self.labels = [s.label for s in stores]

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
            layout = chain_layout(src, manifest, chain_manifests(src, manifest))
        in_place = lies_in_place(src, layout)
        root = os.path.abspath(os.fspath(local_dir))
        LOCAL.makedirs(root)
        name = f"step-{step:010d}-{layout_key(layout)}"
        final = os.path.join(root, name)
        head = os.path.join(final, *layout[0][1].split("/"))
        # The lock only saves work (processes at once copy the chain once); the rename keeps it whole.
        with local_lock(os.path.join(root, f".{name}.lock")):
            if not LOCAL.isdir(final):
                tmp = scratch_folder(root, f".{name}.tmp")
                renamed = False
                try:
                    laid = lay_out(src, layout, tmp, in_place=in_place)
                    if not in_place:
                        why = decode_errors([entry_path(laid, e) for e in manifest.files if e.index_xxh3 is not None], None)
                        if why is not None:
                            raise FormatError(
                                f"{head}: step {step} from {src.label}, laid out with its chain, does not decode: {why}"
                            )
                    try:
                        LOCAL.rename(tmp, final)  # atomic; a folder there (another process's) makes it fail
                        renamed = True
                        return head
                    except OSError:
                        if not LOCAL.isdir(final):
                            raise
                finally:
                    if not renamed:
                        remove_quietly(tmp)
            why = laid_out_errors(layout, final, decode=not in_place)
            if why is not None:
                raise FormatError(
                    f"{final}: step {step}, laid out there by an earlier fetch, does not check ({why}); remove that "
                    "folder once no process reads it, or fetch into another local_dir"
                )
            return head

    def find(
        self,
        step: int | None,
        *,
        allow_light: bool,
        every_byte: bool,
        open_unit: OpenUnit,
        deadline: Deadline,
    ) -> tuple[Restored | None, dict[int, set[int]], dict[int, int | None]]:
        """The newest step whose copy checks and opens, fastest tier first (see :meth:`CheckpointManager.restore`),
        the newer steps on each tier that the run abandons by resuming from it, and the newest step each
        tier listed holds (``None``: none).

        ``every_byte``: check every byte of a file unit (and of a delta's bases) against its manifest.
        ``open_unit(tier, manifest, layout)``: ``(path, state)`` of a copy that checked; raising skips it.
        """
        listed, unavailable = self._list_tiers(deadline)
        newest = {i: max(manifests, default=None) for i, (manifests, _) in listed.items()}
        found: dict[int, list[tuple[int, UnitManifest | str]]] = {}
        skipped: list[tuple[int, str, str]] = [(-1, self._stores[i].label, str(e)) for i, e in sorted(unavailable.items())]
        for i, (manifests, problems) in sorted(listed.items()):
            units: dict[int, UnitManifest | str] = {**manifests, **problems}
            for s, entry in sorted(units.items()):
                found.setdefault(s, []).append((i, entry))
        # Tier 0 takes every save and keeps its newest: no other tier holds a step newer than that one.
        on_tier0 = [s for s, entries in found.items() if any(i == 0 for i, _ in entries)] if 0 in listed else []
        bound = max(on_tier0, default=None)

        def refuse() -> TierUnavailableError:
            first = unavailable[min(unavailable)]
            detail = "; ".join(f"step {s} on {t}: {r}" for s, t, r in skipped if s >= 0)[:QUOTE_CHARS]
            return type(first)(
                f"restore: {first}" + (f" (and the tiers listed restore no newer step: {detail})" if detail else "")
            )

        candidates = sorted(found, reverse=True) if step is None else ([step] if step in found else [])
        if not candidates:
            if unavailable:
                raise refuse()
            if step is not None:
                raise CheckpointError(f"step {step} is on no tier ({', '.join(s.root for s in self._stores)})")
            return None, {}, newest
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
                    store.check(m, full=m.directory or every_byte)
                    layout = None if m.base is None else check_chain(store, m, listed[i][0], full=every_byte)
                    where, state = open_unit(i, m, layout)
                except Exception as exc:  # noqa: BLE001 - any failure means: try the next copy
                    reason = f"{type(exc).__name__}: {exc}"
                    if not is_damage(exc):
                        unread.add(s)
                    _LOG.warning("restore: skipped step %d on %s (%s): %s", s, store.label, where, reason)
                    skipped.append((s, store.label, reason))
                    continue
                restored, abandoned = self._restored(
                    Restored(s, state, i, store.label, where, m.light, tuple(skipped)), listed, unread
                )
                return restored, abandoned, newest
        if unavailable:
            raise refuse()
        detail = "; ".join(f"step {s} on {t}: {r}" for s, t, r in skipped)
        raise CheckpointError(f"no copy of any step restores ({detail})")

    def _restored(
        self, r: Restored, listed: dict[int, tuple[dict[int, UnitManifest], dict[int, str]]], unread: set[int]
    ) -> tuple[Restored, dict[int, set[int]]]:
        """``r`` with the newer steps the run abandons (its saves remove them), and those steps per tier; all of it said in the log."""
        abandoned: dict[int, set[int]] = {}
        kept: list[str] = []
        for i, (manifests, _) in sorted(listed.items()):
            newer = sorted(s for s in manifests if s > r.step)
            abandoned[i] = {s for s in newer if s not in unread}
            kept += [f"{s} on {self._stores[i].label}" for s in newer if s in unread]
        pairs = tuple(
            sorted(
                ((s, self._stores[i].label) for i, ss in abandoned.items() for s in ss),
                key=lambda p: (p[0], self.labels.index(p[1])),
            )
        )
        parts = [f"restore: step {r.step} ({'light' if r.light else 'full'}) from {r.tier_name}"]
        newer_skips = [f"step {s} on {t}: {why}" for s, t, why in r.skipped if s > r.step]
        other = [f"step {s} on {t}: {why}" if s >= 0 else f"{t}: {why}" for s, t, why in r.skipped if s <= r.step]
        if newer_skips:
            parts.append("newer steps not restored: " + "; ".join(newer_skips))
        if other:
            parts.append("also skipped: " + "; ".join(other))
        if pairs:
            parts.append(
                "each save of this run removes the abandoned steps above it: "
                + "; ".join(
                    f"{', '.join(str(s) for s in sorted(ss))} on {self._stores[i].label}"
                    for i, ss in sorted(abandoned.items())
                    if ss
                )
            )
        if kept:
            parts.append("kept, since they could not be read (not found damaged): " + ", ".join(kept))
        parts.append(f"from {r.path}")
        _LOG.log(logging.WARNING if r.skipped or pairs else logging.INFO, "%s", "; ".join(parts))
        return replace(r, abandoned=pairs), abandoned

    def _list_tiers(
        self, deadline: Deadline
    ) -> tuple[dict[int, tuple[dict[int, UnitManifest], dict[int, str]]], dict[int, TierUnavailableError]]:
        """Every tier's :meth:`TierStore.listing`, at once, each on a thread of its own, by ``deadline``;
        and the error of each tier that could not be listed by then."""
        calls = {i: store.listing for i, store in enumerate(self._stores) if i >= self.first}
        answers = run_within(calls, deadline, "list")
        listed, unavailable = {}, {}
        for i in calls:
            store = self._stores[i]
            if i not in answers:
                unavailable[i] = TierUnavailableError(
                    f"{store.label} ({store.root}) was not listed within {deadline.describe()} (unreachable or too "
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
