"""Short import path for the Hugging Face Trainer integration.

``from nvcomp_checkpoint.transformers import NvcompTrainerCallback, NvcompTrainer``.
"""

from __future__ import annotations

from .integrations.transformers import (
    COMPRESSED_SUFFIX,
    MARKER_NAME,
    NvcompTrainer,
    NvcompTrainerCallback,
    NvcompTrainerMixin,
    compress_checkpoint,
    decompress_checkpoint,
)

__all__ = [
    "NvcompTrainerCallback",
    "NvcompTrainerMixin",
    "NvcompTrainer",
    "compress_checkpoint",
    "decompress_checkpoint",
    "COMPRESSED_SUFFIX",
    "MARKER_NAME",
]
