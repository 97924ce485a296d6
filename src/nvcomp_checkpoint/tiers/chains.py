"""Chains of deltas on a tier: which bases a delta needs, where each goes so that the chain loads, and their checks."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import tempfile
import uuid
from typing import Any

import xxhash

from ..deepspeed_layout import OTHER_FILE, classify_file, deepspeed_safe_globals
from ..errors import CheckpointError, FormatError
from ..reader import CheckpointReader
from ..safepaths import inside_path
from ..storage import LOCAL
from .schedule import Tier
from .transfer import copy_unit
from .units import TierStore, UnitManifest, entry_path, join_path

__all__ = ["chain_layout", "verify_unit"]

_LOG = logging.getLogger("nvcomp_checkpoint")

LAYOUT_DEPTH = 16


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
            not a file of that step, or base names that disagree; UnsafePathError (a FormatError): a base record that is
            absolute, a URL or not a path.
    """
    top = "/" + "/".join(["_"] * LAYOUT_DEPTH)
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
            ref = base_ref(store, path) if entry.index_xxh3 is not None else None
            if ref is None:
                continue
            inside_path(ref.path, where=path, what="records its base at", up=True)
            target = posixpath.normpath(posixpath.join(posixpath.dirname(entry_path(where[m.step], entry)), ref.path))
            found = next(
                (
                    target[: len(target) - len(e.path) - 1] if e.path else target
                    for e in base.files
                    if (e.size, e.index_xxh3) == (ref.size, ref.index_xxh3) and (not e.path or target.endswith("/" + e.path))
                ),
                None,
            )
            if found is None:
                raise FormatError(
                    f"{path}: its base ({ref.path}: {ref.size} bytes, index digest {ref.index_xxh3:016x}) is not a file of "
                    f"step {m.base} on {store.label} (a broken chain)"
                )
            if at not in (None, found):
                raise FormatError(f"{path}: the files of step {m.step} name their bases in different places ({at}, {found})")
            at = found
        if at is None:
            raise FormatError(
                f"{store.unit_path(m.step, m.directory)}: the manifest names base step {m.base}, but no file of it is a delta"
            )
        if at in where.values():
            raise FormatError(f"{head}: two units of its chain would lie at {at}")
        where[base.step] = at
        chain.append(base)
        m = base
    up = max(posixpath.relpath(p, top).split("/").count("..") for p in where.values())
    if up >= LAYOUT_DEPTH - 1:
        raise FormatError(f"{head}: its chain names bases {up} folders up; at most {LAYOUT_DEPTH - 2} are followed")
    root = top
    for _ in range(up):
        root = posixpath.dirname(root)
    return [(u, posixpath.relpath(where[u.step], root)) for u in chain]


def lies_in_place(store: TierStore, layout: list[tuple[UnitManifest, str]]) -> bool:
    """Whether each unit of a chain lies at its own name on the tier (the chain loads there)."""
    return all(rel == posixpath.basename(store.unit_path(m.step, m.directory)) for m, rel in layout)


def base_ref(store: TierStore, path: str) -> Any:
    """The base record of the nvcomp-checkpoint file at ``path`` (None for a full file)."""
    try:
        with CheckpointReader(path, storage_options=store.tier.storage_options) as reader:
            return reader.index.base
    except (CheckpointError, OSError) as exc:
        raise FormatError(f"{path}: its index cannot be read ({exc})") from exc


def check_chain(
    store: TierStore, manifest: UnitManifest, manifests: dict[int, UnitManifest], *, full: bool
) -> list[tuple[UnitManifest, str]]:
    """Raise :class:`FormatError` unless every base of the delta ``manifest`` is committed on ``store``,
    checks and is the file its delta was written against; return the chain's :func:`chain_layout`.

    ``full``: also every byte of each base and, where the chain lies in place, every frame of the delta
    and of each base tensor it needs decodes. A chain that is not in place is decoded only once laid
    out: by :meth:`CheckpointManager.fetch`, or by :func:`verify_unit`.
    """
    layout = chain_layout(store, manifest, manifests)
    for m, _ in layout[1:]:
        store.check(m, full=full)
    if full and lies_in_place(store, layout):
        why = decode_errors(
            [store.file_path(manifest, e) for e in manifest.files if e.index_xxh3 is not None], store.tier.storage_options
        )
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
            layout = check_chain(store, manifest, chain_manifests(store, manifest), full=True)
            if lies_in_place(store, layout):
                return None
            tmp = scratch_folder(tempfile.gettempdir(), "nvckpt-verify")
            try:
                head = lay_out(store, layout, tmp, in_place=False)
                why = decode_errors([entry_path(head, e) for e in manifest.files if e.index_xxh3 is not None], None)
            finally:
                remove_quietly(tmp)
            return None if why is None else f"laid out with its chain, it does not decode: {why}"
        return decode_errors(
            [store.file_path(manifest, e) for e in manifest.files if e.index_xxh3 is not None], store.tier.storage_options
        )
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"


def scratch_folder(parent: str, prefix: str) -> str:
    """A new folder of this process in ``parent`` (a name no other process uses)."""
    path = os.path.join(parent, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    LOCAL.makedirs(path)
    return path


def remove_quietly(path: str) -> None:
    try:
        LOCAL.remove(path)
    except OSError:
        _LOG.debug("could not remove %s", path, exc_info=True)


def lay_out(src: TierStore, layout: list[tuple[UnitManifest, str]], root: str, *, in_place: bool) -> str:
    """Copy the chain ``layout`` (:func:`chain_layout`) from ``src`` into the local folder ``root``, bases
    first, each file checked; in place, each unit with its manifest. Returns the head's path."""
    local = TierStore(Tier(root, name="fetched"), "fetched")
    for m, rel in reversed(layout):
        copy_unit(src, local, m, to=None if in_place else join_path(local.root, rel))
    return join_path(local.root, layout[0][1])


def layout_key(layout: list[tuple[UnitManifest, str]]) -> str:
    """A name for a laid-out chain that differs whenever a file or a place in it does."""
    doc = [[m.step, rel, [[e.path, e.size, e.index_xxh3, e.xxh3] for e in m.files]] for m, rel in layout]
    return xxhash.xxh3_64_hexdigest(json.dumps(doc).encode())


def laid_out_errors(layout: list[tuple[UnitManifest, str]], folder: str, *, decode: bool) -> str | None:
    """Why the chain laid out in ``folder`` by an earlier fetch does not check (None: it does)."""
    local = TierStore(Tier(folder, name="fetched"), "fetched")
    try:
        for m, rel in layout:
            local.check(m, full=True, at=join_path(local.root, rel))
        head = join_path(local.root, layout[0][1])
        if decode or any(e.xxh3 is None for m, _ in layout for e in m.files):
            return decode_errors([entry_path(head, e) for e in layout[0][0].files if e.index_xxh3 is not None], None)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def chain_manifests(store: TierStore, manifest: UnitManifest) -> dict[int, UnitManifest]:
    """The manifests of the bases of ``manifest`` committed on ``store`` (read one by one, not the whole listing)."""
    out: dict[int, UnitManifest] = {}
    step = manifest.base
    while step is not None and step not in out and step != manifest.step:
        m = store.manifest(step)
        if m is None:
            break
        out[step], step = m, m.base
    return out


def decode_errors(paths: list[str], storage_options: dict[str, Any] | None) -> str | None:
    """Why one of the nvcomp-checkpoint files at ``paths`` does not decode in full (None: they all do).

    A DeepSpeed rank file (a copied tag) is read with DeepSpeed's allow-list, as every loader of it
    does: its optimizer state holds DeepSpeed's loss scaler.
    """
    for path in paths:
        deepspeed = classify_file(posixpath.basename(path)).kind != OTHER_FILE
        with deepspeed_safe_globals() if deepspeed else contextlib.nullcontext():
            with CheckpointReader(path, storage_options=storage_options) as reader:
                for tensor, err in reader.verify():
                    if err is not None:
                        return f"tensor {tensor.key!r}: {err}"
    return None
