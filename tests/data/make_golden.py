"""Writes ``golden_v1.nvc`` and its digests once; tests decode them forever after.

Run once: ``python tests/data/make_golden.py``. Never regenerate a committed golden file: a
reader that cannot decode it any more is a broken reader. A new format version gets a new file.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import torch
import zstandard

__all__ = ["golden_tree", "golden_policy", "GOLDEN_METADATA", "tensor_digest", "HERE"]

HERE = Path(__file__).resolve().parent

#: Passed to ``save`` so that the file holds no timestamp and no version strings; a re-save of
#: the same tree with the same metadata must reproduce the file byte for byte.
GOLDEN_METADATA: dict[str, Any] = {
    "created_by": "nvcomp-checkpoint golden v1",
    "torch": "pinned",
    "created": 0.0,
    "run": {"name": "golden", "step": 40},
}


def _lcg_words(n: int, seed: int) -> list[int]:
    """Pseudo-random 32-bit words from pure integer arithmetic (identical on every machine)."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(x >> 32)
    return out


def _floats(n: int, seed: int, scale: float) -> list[float]:
    # Small, centred values like trained weights: exponent bytes repeat, mantissas are noise.
    return [((w % 20001) - 10000) / 10000 * scale for w in _lcg_words(n, seed)]


def golden_tree() -> dict[str, Any]:
    """A small training checkpoint covering the format's features; built without torch RNG."""
    w1 = torch.tensor(_floats(32 * 24, 1, 0.05), dtype=torch.float32).reshape(32, 24)
    emb = torch.nn.Parameter(torch.tensor(_floats(16 * 8, 2, 1.0), dtype=torch.bfloat16).reshape(16, 8))
    exp_avg = torch.tensor(_floats(32 * 24, 3, 1e-3), dtype=torch.float32).reshape(32, 24)
    exp_avg_sq = torch.tensor([abs(v) for v in _floats(32 * 24, 4, 1e-6)], dtype=torch.float32).reshape(32, 24)
    words = _lcg_words(64, 5)
    nan_payloads = struct.pack("<4I", 0x7FC00000, 0x7FC12345, 0xFF800000, 0x80000000)
    return {
        "model": {
            "embed.weight": emb,
            "fc.weight": w1,
            "fc.bias": torch.tensor(_floats(32, 6, 0.1), dtype=torch.float16),
            "head.weight": emb,  # tied to the embedding: stored once
            "mask": torch.tensor([w % 3 == 0 for w in words[:40]], dtype=torch.bool),
            "fp8": torch.tensor([w % 256 for w in words], dtype=torch.uint8).view(torch.float8_e4m3fn),
            "codes": torch.tensor([w % 60000 for w in words[:20]], dtype=torch.int32).to(torch.uint16),
            "phase": torch.tensor(_floats(12, 7, 1.0), dtype=torch.float64).view(torch.complex128),
            "special": torch.frombuffer(bytearray(nan_payloads), dtype=torch.float32).clone(),
            "empty": torch.empty(0, 4),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(40.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": [0]}],
        },
        "epoch": 3,
        "global_step": 40,
        "best_metric": float("nan"),
        "tags": ["golden", None, True, (1, 2.5)],
    }


def golden_policy():
    """Every codec/filter pair and a multi-chunk tensor with a partial last chunk."""
    import nvcomp_checkpoint as nc

    return nc.CodecPolicy(
        weights=nc.CodecSpec(codec="zstd", level=3, filter="byteplane", chunk_bytes=1024),
        exp_avg=nc.CodecSpec(codec="zstd", level=1, filter="none", chunk_bytes=2048),
        exp_avg_sq=nc.CodecSpec(codec="none", level=None, filter="none"),
        overrides={"model/fp8": nc.CodecSpec(codec="none", level=None, filter="byteplane")},
        min_compress_bytes=256,
    )


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's element bytes (little-endian, C order)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(data).hexdigest()


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.format.skeleton import flatten
    from nvcomp_checkpoint.policy import key_string

    target = HERE / "golden_v1.nvc"
    if target.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{target} exists; golden files are written once (pass --force to overwrite)")
    tree = golden_tree()
    metadata = dict(
        GOLDEN_METADATA,
        generated_with={
            "nvcomp_checkpoint": nc.__version__,
            "torch": torch.__version__,
            "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        },
    )
    nc.save(tree, target, golden_policy(), metadata=metadata, workers=1)
    _, tensors = flatten(tree)
    expected = {
        "metadata": metadata,
        "tensors": {
            key_string(path): {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": tensor_digest(t)} for path, t in tensors
        },
    }
    (HERE / "golden_v1.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
