"""``from nvcomp_checkpoint.lightning import NvcompCheckpointIO``: the Lightning plugin.

A short name for :mod:`nvcomp_checkpoint.integrations.lightning`; needs the ``lightning``
extra (``nvcomp_checkpoint.version.install_hint``).
"""

from __future__ import annotations

from .integrations.lightning import (
    STORAGE_OPTION_KEYS,
    NvcompCheckpointIO,
    NvcompCheckpointMetrics,
    NvcompModelCheckpoint,
    NvcompModelCheckpointMixin,
    load_from_checkpoint,
    report_metrics,
)
from .integrations.lightning_deepspeed import NvcompDeepSpeedStrategy
from .integrations.lightning_sharded import NvcompFSDPStrategy, NvcompModelParallelStrategy, check_sharded_checkpoint_io

__all__ = [
    "NvcompCheckpointIO",
    "NvcompCheckpointMetrics",
    "NvcompModelCheckpoint",
    "NvcompModelCheckpointMixin",
    "load_from_checkpoint",
    "report_metrics",
    "STORAGE_OPTION_KEYS",
    "NvcompModelParallelStrategy",
    "NvcompFSDPStrategy",
    "NvcompDeepSpeedStrategy",
    "check_sharded_checkpoint_io",
]
