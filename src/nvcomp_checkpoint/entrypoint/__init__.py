"""What every framework integration shares: the base class :class:`SaveEntryPoint` (``base``), the options
(``options``), the loading rules (``loading``) and the save reports (``reports``).

Lightning's ``NvcompCheckpointIO``, Accelerate's ``NvcompStateHooks`` and the Trainer's
``NvcompTrainerCallback`` derive from :class:`SaveEntryPoint` and keep only what their framework needs.
"""

from __future__ import annotations

from .base import SaveEntryPoint
from .loading import checked_on_every_rank, leader_load_applies, load_as_torch, load_tree, torch_weights_only
from .options import POLICY_OPTION_KEYS, as_policy, incremental_files, policy_and_metadata
from .reports import checkpoint_report, report_metrics
from .session import CheckpointSession, SessionOptions

__all__ = [
    "SaveEntryPoint",
    "CheckpointSession",
    "SessionOptions",
    "as_policy",
    "policy_and_metadata",
    "POLICY_OPTION_KEYS",
    "torch_weights_only",
    "load_as_torch",
    "load_tree",
    "leader_load_applies",
    "checked_on_every_rank",
    "checkpoint_report",
    "report_metrics",
    "incremental_files",
]
