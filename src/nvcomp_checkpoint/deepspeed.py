"""``from nvcomp_checkpoint.deepspeed import attach``: compressed DeepSpeed checkpoints.

A short name for :mod:`nvcomp_checkpoint.integrations.deepspeed`; needs the ``deepspeed``
extra (``nvcomp_checkpoint.version.install_hint``).
"""

from __future__ import annotations

from .integrations.deepspeed import (
    DEEPSPEED_PATTERNS,
    DEEPSPEED_SAFE_GLOBALS,
    MANIFEST_NAME,
    NvcompCheckpointEngine,
    attach,
    attach_after,
    attach_once,
    check_tag_complete,
    deepspeed_policy,
    deepspeed_safe_globals,
    deepspeed_torch_load,
    is_deepspeed_engine,
    load_deepspeed_file,
)

__all__ = [
    "attach",
    "attach_after",
    "attach_once",
    "is_deepspeed_engine",
    "NvcompCheckpointEngine",
    "DEEPSPEED_PATTERNS",
    "DEEPSPEED_SAFE_GLOBALS",
    "MANIFEST_NAME",
    "check_tag_complete",
    "deepspeed_policy",
    "deepspeed_safe_globals",
    "load_deepspeed_file",
    "deepspeed_torch_load",
]
