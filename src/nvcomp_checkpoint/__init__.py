"""nvcomp-checkpoint: lossless compression of training checkpoints, on the GPU or the CPU.

``save``/``load``/``open`` write and read one compressed file per checkpoint; ``CodecPolicy``
chooses codecs per component (weights, optimizer moments, gradients, the rest).
"""

from __future__ import annotations

from . import errors
from .api import VerifyProblem, VerifyResult, is_nvcomp_checkpoint, load, open, save, verify
from .async_save import AsyncSaveHandle, AsyncSaver, save_async
from .broadcast import load_broadcast
from .codecs import GPU_ONLY_CODECS, PORTABLE_CODECS, gpu_available
from .delta import ChainPolicy, retained
from .errors import CheckpointError
from .metrics import serve_metrics
from .pending import has_pending_save, wait_for_saves
from .policy import CodecPolicy, CodecSpec, Component, classify
from .reader import CheckpointReader
from .report import ComponentStats, SaveReport
from .tiers import CheckpointManager, Restored, Tier
from .torchload import disable_torch_load, enable_torch_load, torch_load_reads_nvc
from .version import __version__

__all__ = [
    "__version__",
    "save",
    "load",
    "load_broadcast",
    "open",
    "verify",
    "VerifyResult",
    "VerifyProblem",
    "is_nvcomp_checkpoint",
    "save_async",
    "wait_for_saves",
    "has_pending_save",
    "AsyncSaver",
    "AsyncSaveHandle",
    "CodecPolicy",
    "CodecSpec",
    "Component",
    "classify",
    "CheckpointReader",
    "ChainPolicy",
    "retained",
    "SaveReport",
    "ComponentStats",
    "CheckpointError",
    "errors",
    "gpu_available",
    "PORTABLE_CODECS",
    "GPU_ONLY_CODECS",
    "Tier",
    "CheckpointManager",
    "Restored",
    "serve_metrics",
    "enable_torch_load",
    "disable_torch_load",
    "torch_load_reads_nvc",
]
