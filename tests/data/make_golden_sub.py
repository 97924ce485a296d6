"""Writes ``golden_v3_sub.nvc``, a delta of ``golden_v1.nvc`` with "sub" frames, and its digests once.

Run once: ``python tests/data/make_golden_sub.py``. Never regenerate a committed golden file.
The tree and policy are those of ``golden_v2_delta.nvc`` (make_golden_delta.py); this file is
written with the difference tried too (format version 3), so it holds "sub" frames on byte
planes of bf16 and fp32 chunks (above plain and below XOR planes of the same chunk) and on
unfiltered fp32 chunks. Its base is ``golden_v1.nvc`` in the same directory.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import zstandard

__all__ = ["GOLDEN_SUB_METADATA"]

HERE = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("make_golden_delta", HERE / "make_golden_delta.py")
assert _spec is not None and _spec.loader is not None
make_golden_delta = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden_delta)

GOLDEN_SUB_METADATA: dict[str, Any] = {
    "created_by": "nvcomp-checkpoint golden v3 sub delta",
    "torch": "pinned",
    "created": 0.0,
    "run": {"name": "golden", "step": 41},
}


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.format.skeleton import flatten
    from nvcomp_checkpoint.policy import key_string

    target = HERE / "golden_v3_sub.nvc"
    if target.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{target} exists; golden files are written once (pass --force to overwrite)")
    tree = make_golden_delta.golden_delta_tree()
    metadata = dict(
        GOLDEN_SUB_METADATA,
        generated_with={
            "nvcomp_checkpoint": nc.__version__,
            "torch": torch.__version__,
            "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        },
    )
    nc.save(tree, target, make_golden_delta.golden_delta_policy(), metadata=metadata, workers=1, base=HERE / "golden_v1.nvc")
    _, tensors = flatten(tree)
    expected = {
        "metadata": metadata,
        "tensors": {
            key_string(path): {
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "sha256": make_golden_delta.make_golden.tensor_digest(t),
            }
            for path, t in tensors
        },
    }
    (HERE / "golden_v3_sub.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
