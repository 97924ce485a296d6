"""Storage tiers: every save lands on a fast tier, verified copies of the compressed file flow to slower ones.

One module per job: ``schedule`` (:class:`Tier` and when a copy is due), ``units`` (a step's unit and
its manifest on a tier), ``chains`` (deltas and their bases), ``transfer`` (checked copies, one retry
loop), ``retention`` (pure policy functions), ``restore``, ``tier0`` (the manager's own tier 0 or a
framework's), ``copier`` (the background copies), ``manager`` (:class:`CheckpointManager`) and
``tiercopies`` (the integrations' ``tiers=``). The layout and commit rules are in ``docs/tiers.md``.
"""

from __future__ import annotations

from .chains import chain_layout, verify_unit
from .copier import NotCopied
from .light import light_tree
from .manager import CheckpointManager
from .restore import Restored
from .retention import retained_steps
from .schedule import CLOSE_TIMEOUT_S, COPY_NICE, RESTORE_TIMEOUT_S, Tier  # noqa: F401 - the defaults, as before the split
from .tiercopies import TierCopies
from .transfer import copy_unit
from .units import COPY_CHUNK_BYTES, MANIFEST_SUFFIX, FileEntry, TierStore, UnitManifest, open_tier  # noqa: F401

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
