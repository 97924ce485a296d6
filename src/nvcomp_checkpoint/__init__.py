"""nvcomp-checkpoint: lossless compression of training checkpoints, on the GPU or the CPU.

``save``/``load``/``open`` write and read one compressed file per checkpoint; ``CodecPolicy``
chooses codecs per component (weights, optimizer moments, gradients, the rest).

The public names are imported on first use (PEP 562): ``import nvcomp_checkpoint`` costs no torch
import, so ``nvckpt --help`` and ``nvckpt --version`` answer at once.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import CheckpointError
from .version import __version__

if TYPE_CHECKING:
    from .api import VerifyProblem, VerifyResult, is_nvcomp_checkpoint, load, open, save, verify
    from .async_save import AsyncSaveHandle, AsyncSaver, save_async
    from .broadcast import load_broadcast
    from .codecs import GPU_ONLY_CODECS, PORTABLE_CODECS, gpu_available
    from .delta import ChainPolicy, retained
    from .metrics import serve_metrics
    from .pending import has_pending_save, wait_for_saves
    from .policy import CodecPolicy, CodecSpec, Component, classify
    from .reader import CheckpointReader
    from .report import ComponentStats, SaveReport
    from .tiers import CheckpointManager, Restored, Tier
    from .torchload import disable_torch_load, enable_torch_load, torch_load_reads_nvc

#: Where each public name lives (imported by ``__getattr__`` on first use).
_LAZY = {
    "VerifyProblem": "api",
    "VerifyResult": "api",
    "is_nvcomp_checkpoint": "api",
    "load": "api",
    "open": "api",
    "save": "api",
    "verify": "api",
    "AsyncSaveHandle": "async_save",
    "AsyncSaver": "async_save",
    "save_async": "async_save",
    "load_broadcast": "broadcast",
    "GPU_ONLY_CODECS": "codecs",
    "PORTABLE_CODECS": "codecs",
    "gpu_available": "codecs",
    "ChainPolicy": "delta",
    "retained": "delta",
    "serve_metrics": "metrics",
    "has_pending_save": "pending",
    "wait_for_saves": "pending",
    "CodecPolicy": "policy",
    "CodecSpec": "policy",
    "Component": "policy",
    "classify": "policy",
    "CheckpointReader": "reader",
    "ComponentStats": "report",
    "SaveReport": "report",
    "CheckpointManager": "tiers",
    "Restored": "tiers",
    "Tier": "tiers",
    "disable_torch_load": "torchload",
    "enable_torch_load": "torchload",
    "torch_load_reads_nvc": "torchload",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # A submodule (``nc.tiers``): an attribute once imported, as it was when everything was.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
