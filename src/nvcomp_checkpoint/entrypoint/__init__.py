"""What every framework integration shares, framework-free.

- ``session``: :class:`CheckpointSession`, held by composition by Lightning's ``NvcompCheckpointIO``,
  Accelerate's ``NvcompStateHooks`` and the Trainer's ``NvcompTrainerCallback`` (the saves, the background
  errors, the tier copies, the ``incremental`` chains and the one removal order), and its options,
  :class:`SessionOptions`, converted and checked once.
- ``support``: what each stack (a framework on one kind of checkpoint files) supports, and the one check.
- ``commit``: the one collective commit (every rank's parts durable, one agreement, the coordinator
  finalizes) and the agreement the collective loads use.
- ``deepspeed_engine``: the DeepSpeed ZeRO partition files backend (``attach``), duck-typed.
- ``options``, ``loading``, ``reports``: per-save options, the loading rules, the save reports.

The DCP rank files backend is :mod:`nvcomp_checkpoint.dcp.rank_files`.
"""

from __future__ import annotations

from .loading import checked_on_every_rank, leader_load_applies, load_as_torch, load_tree, torch_weights_only
from .options import POLICY_OPTION_KEYS, as_policy, incremental_files, policy_and_metadata
from .reports import checkpoint_report, report_metrics
from .session import CheckpointSession, SessionOptions, SessionView

__all__ = [
    "CheckpointSession",
    "SessionOptions",
    "SessionView",
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
