"""DeepSpeed integration: what users import for DeepSpeed, with DeepSpeed's own classes.

The checkpoint engine, :func:`attach` and the functions the other integrations attach with are the
core's DeepSpeed backend (:mod:`nvcomp_checkpoint.entrypoint.deepspeed_engine`, framework-free) and are
re-exported here; what needs DeepSpeed itself stays here: :data:`DEEPSPEED_SAFE_GLOBALS` (the allow-list
resolved to DeepSpeed's classes), and an ``ImportError`` naming the extra to install without DeepSpeed.

``attach(engine)`` puts an :class:`NvcompCheckpointEngine` in ``engine.checkpoint_engine``; from then on
``engine.save_checkpoint(dir, tag)`` writes each file DeepSpeed asks for in this library's format under
DeepSpeed's own file names, commits the tag once every rank's files are durable (its manifest
:data:`MANIFEST_NAME`, then ``latest``), and ``engine.load_checkpoint(dir)`` reads ours and plain DeepSpeed
checkpoints alike, unpickling only the classes DeepSpeed writes.
"""

from __future__ import annotations

from typing import Any

from nvcomp_checkpoint.deepspeed_layout import (
    DEEPSPEED_PATTERNS,
    MANIFEST_NAME,
    SAFE_GLOBAL_NAMES,
    check_tag_complete,
    deepspeed_safe_globals,
    load_deepspeed_file,
)
from nvcomp_checkpoint.entrypoint.deepspeed_engine import (
    NvcompCheckpointEngine,
    attach,
    attach_after,
    attach_once,
    deepspeed_policy,
    deepspeed_torch_load,
    is_deepspeed_engine,
)
from nvcomp_checkpoint.version import install_hint

try:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
except ImportError as exc:  # pragma: no cover - exercised only without DeepSpeed
    raise ImportError(f"nvcomp_checkpoint.deepspeed needs DeepSpeed: {install_hint('deepspeed')}") from exc

__all__ = [
    "attach",
    "NvcompCheckpointEngine",
    "DEEPSPEED_PATTERNS",
    "DEEPSPEED_SAFE_GLOBALS",
    "MANIFEST_NAME",
    "deepspeed_policy",
    "deepspeed_safe_globals",
    "load_deepspeed_file",
    "check_tag_complete",
    "SAFE_GLOBAL_NAMES",
    "attach_once",
    "attach_after",
    "is_deepspeed_engine",
    "deepspeed_torch_load",
]

#: Every class DeepSpeed pickles into its checkpoint files: :data:`SAFE_GLOBAL_NAMES` resolved.
DEEPSPEED_SAFE_GLOBALS: tuple[Any, ...] = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
