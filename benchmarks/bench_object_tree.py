"""Reading an object tree: what the forged-file checks cost next to torch's weights-only unpickler.

The tree is a large optimizer state's skeleton (Adam entries and a parameter list for 50,000
tensors), as ``save`` writes it. Columns: the pickle scan that runs before unpickling, the
weights-only unpickling itself, and the tree walk (``check_skeleton``) that runs after it.
Run: ``python benchmarks/bench_object_tree.py [--tensors N]``.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from nvcomp_checkpoint.format.skeleton import (  # noqa: E402
    _archive_pickle,
    _check_weights_only_pickle,
    check_skeleton,
    decode_skeleton,
    encode_skeleton,
    flatten,
)
from nvcomp_checkpoint.report import format_table  # noqa: E402


def _state(n: int) -> dict:
    t = torch.zeros(1)
    return {
        "state": {i: {"step": torch.tensor(float(i)), "exp_avg": t.clone(), "exp_avg_sq": t.clone()} for i in range(n)},
        "param_groups": [{"params": list(range(n)), "lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01}],
        "epoch": 3,
    }


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=50_000)
    args = parser.parse_args()
    skeleton, tensors = flatten(_state(args.tensors))
    data = encode_skeleton(skeleton)
    pkl = _archive_pickle(io.BytesIO(data), len(data), "bench")
    scan = _best(lambda: _check_weights_only_pickle(pkl, "bench"))
    decode = _best(lambda: decode_skeleton(data, weights_only=True, where="bench"))  # scan included
    tree = decode_skeleton(data, weights_only=True, where="bench")
    walk = _best(lambda: check_skeleton(tree, len(tensors), "bench"))
    unpickle = decode - scan
    rows = [
        ["pickle scan (before unpickling)", f"{scan:.3f}", f"{scan / unpickle:.0%}"],
        ["torch weights-only unpickling", f"{unpickle:.3f}", "100%"],
        ["tree walk (after unpickling)", f"{walk:.3f}", f"{walk / unpickle:.0%}"],
    ]
    print(f"object tree of {args.tensors} tensors: {len(pkl) / 1e6:.1f} MB of pickle, {len(tensors)} tensor references")
    print(format_table(["step", "seconds (best of 3)", "of unpickling"], rows))


if __name__ == "__main__":
    main()
