"""A 2-rank DeepSpeed ZeRO-2 run on the CPU (gloo) for tests/test_deepspeed_identity.py: loads of a tag whose rank-1 file is not the one committed.

``python -m torch.distributed.run --nproc_per_node 2 tests/deepspeed_identity.py ROOT``: saves tag
``t2`` through ``attach`` (codec ``none``), then loads it twice: once with its rank-1 optimizer file
replaced by another save's of the same size (the same tree with one value changed: ``swapped``),
once with a byte of that file's tensor data flipped (``damaged``). Each rank writes what its ``load_checkpoint``
returned or raised to ``ROOT/identity_<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import nvcomp_checkpoint as nc
from deepspeed_train import init, make_engine, train
from nvcomp_checkpoint.deepspeed import attach, deepspeed_policy, deepspeed_safe_globals, load_deepspeed_file

RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def outcome(engine, root: str) -> str:  # noqa: ANN001
    try:
        engine.load_checkpoint(root, tag="t2")
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main() -> None:
    root = sys.argv[1]
    init()
    rank = torch.distributed.get_rank()
    engine = make_engine(2, layers=1)
    attach(engine, policy="none")
    seen: dict[str, object] = {}
    train(engine, 1)
    engine.save_checkpoint(root, tag="t2")
    target, other = os.path.join(root, "t2", RANK1), os.path.join(root, "other_save.pt")
    if rank == 0:
        tree = load_deepspeed_file(target)
        moments = tree["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"]
        # The index records each frame's xxh3 as a decimal number, so the size can move by a byte:
        # another value is tried until the other save's file has the committed file's size.
        for _ in range(100):
            moments[0] += 1.0
            with deepspeed_safe_globals():
                nc.save(tree, other, deepspeed_policy("none"))  # as attach(policy="none") saved it
            if os.path.getsize(target) == os.path.getsize(other):
                break
        seen["same_size"] = os.path.getsize(target) == os.path.getsize(other)
    with open(target, "rb") as f:
        original = f.read()
    for case in ("swapped", "damaged"):
        torch.distributed.barrier()
        if rank == 0:
            if case == "swapped":
                with open(other, "rb") as f:
                    data = f.read()
            else:
                # A byte in the middle of the file: tensor data (the codec is none), not the index or footer.
                data = bytearray(original)
                data[len(data) // 2] ^= 0xFF
            with open(target, "wb") as f:
                f.write(data)
        torch.distributed.barrier()
        seen[case] = outcome(engine, root)
        torch.distributed.barrier()
        if rank == 0:
            with open(target, "wb") as f:
                f.write(original)
    torch.distributed.barrier()
    seen["restored"] = outcome(engine, root)
    with open(os.path.join(root, f"identity_{rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
