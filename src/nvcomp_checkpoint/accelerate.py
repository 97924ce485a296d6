"""Short import path for the Hugging Face Accelerate integration.

``from nvcomp_checkpoint.accelerate import register_nvcomp_hooks``; see
:mod:`nvcomp_checkpoint.integrations.accelerate` for the design.
"""

from __future__ import annotations

from .integrations.accelerate import MANIFEST_NAME, MARKER_NAME, NvcompStateHooks, is_nvcomp_state_dir, register_nvcomp_hooks

__all__ = ["register_nvcomp_hooks", "NvcompStateHooks", "MANIFEST_NAME", "MARKER_NAME", "is_nvcomp_state_dir"]
