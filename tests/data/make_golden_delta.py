"""Writes ``golden_v2_delta.nvc``, a delta of ``golden_v1.nvc``, and its digests once; tests decode them forever after.

Run once: ``python tests/data/make_golden_delta.py``. Never regenerate a committed golden file.
The delta's base is ``golden_v1.nvc`` in the same directory (recorded by that relative path).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import zstandard

__all__ = ["golden_delta_tree", "golden_delta_policy", "GOLDEN_DELTA_METADATA"]

HERE = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("make_golden", HERE / "make_golden.py")
assert _spec is not None and _spec.loader is not None
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)

GOLDEN_DELTA_METADATA: dict[str, Any] = {
    "created_by": "nvcomp-checkpoint golden v2 delta",
    "torch": "pinned",
    "created": 0.0,
    "run": {"name": "golden", "step": 41},
}


def golden_delta_tree() -> dict[str, Any]:
    """The golden tree one optimizer step later: weights and moments moved a little, the rest kept."""
    tree = make_golden.golden_tree()
    model, state = tree["model"], tree["optimizer"]["state"][0]
    step = torch.tensor(make_golden._floats(32 * 24, 8, 1e-4), dtype=torch.float32).reshape(32, 24)
    model["fc.weight"] = model["fc.weight"] - step  # elementwise float ops: the same bits everywhere
    emb = model["embed.weight"].detach().float() + 1e-2
    model["embed.weight"] = model["head.weight"] = torch.nn.Parameter(emb.to(torch.bfloat16))
    state["exp_avg"] = state["exp_avg"] * 0.9 + step * 0.1
    state["exp_avg_sq"] = state["exp_avg_sq"] * 0.999
    state["step"] = torch.tensor(41.0)
    model["extra"] = torch.tensor(make_golden._floats(64, 9, 1.0), dtype=torch.float32)  # not in the base
    tree["global_step"] = 41
    return tree


def golden_delta_policy():
    """The golden policy, second moments compressed without planes: XOR frames of both filters."""
    import nvcomp_checkpoint as nc

    return make_golden.golden_policy().with_overrides(
        exp_avg_sq=nc.CodecSpec(codec="zstd", level=1, filter="none", chunk_bytes=2048)
    )


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.format.skeleton import flatten
    from nvcomp_checkpoint.policy import key_string

    target = HERE / "golden_v2_delta.nvc"
    if target.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{target} exists; golden files are written once (pass --force to overwrite)")
    tree = golden_delta_tree()
    metadata = dict(
        GOLDEN_DELTA_METADATA,
        generated_with={
            "nvcomp_checkpoint": nc.__version__,
            "torch": torch.__version__,
            "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        },
    )
    nc.save(tree, target, golden_delta_policy(), metadata=metadata, workers=1, base=HERE / "golden_v1.nvc")
    _, tensors = flatten(tree)
    expected = {
        "metadata": metadata,
        "tensors": {
            key_string(path): {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": make_golden.tensor_digest(t)}
            for path, t in tensors
        },
    }
    (HERE / "golden_v2_delta.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
