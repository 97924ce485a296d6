"""The ``lightning.pytorch.callbacks_factory`` entry point: Lightning calls it for every new Trainer.

It imports nothing: without ``nvcomp_checkpoint.integrations.lightning`` imported, no
``NvcompCheckpointIO`` exists and there is nothing to check.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["callbacks"]


def callbacks() -> list[Any]:
    """``[NvcompStrategyCheck()]`` while an ``NvcompCheckpointIO`` exists, else ``[]``."""
    module = sys.modules.get("nvcomp_checkpoint.integrations.lightning")
    return [] if module is None else module.strategy_check_callbacks()
