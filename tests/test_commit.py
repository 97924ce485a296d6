"""``entrypoint.commit``: the one collective commit (every rank durable, one agreement, the coordinator
finalizes, a barrier) and its agreement, on one process and on two gloo ranks."""

from __future__ import annotations

import json
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fresh_process import spawn_ranks
from nvcomp_checkpoint.entrypoint.commit import commit_on_every_rank, gather_outcomes, true_on_every_rank
from nvcomp_checkpoint.errors import CheckpointWriteError

RECORD = {"bytes": 3, "index_xxh3": "ab"}


def test_one_process_finalizes_with_its_records() -> None:
    calls = []
    records = commit_on_every_rank("ckpt/t1", lambda: {"a.pt": RECORD}, lambda r, w: calls.append((r, w)))
    assert records == {"a.pt": RECORD}
    assert calls == [({"a.pt": RECORD}, 1)]
    assert true_on_every_rank(True) and not true_on_every_rank(False)


def test_one_process_failure_names_the_rank_and_file_and_finalizes_nothing() -> None:
    calls = []

    def durable() -> dict[str, Any]:
        raise OSError(28, "No space left on device", "ckpt/t1/a.pt")

    with pytest.raises(
        CheckpointWriteError, match=r"ckpt/t1: rank 0 failed to write its files \(OSError: .*ckpt/t1/a\.pt"
    ) as info:
        commit_on_every_rank("ckpt/t1", durable, lambda r, w: calls.append(r))
    assert isinstance(info.value.__cause__, OSError)
    assert calls == []


def test_one_process_failed_finalize_is_raised() -> None:
    def finalize(records: dict[str, Any], world: int) -> None:
        raise OSError(5, "Input/output error", "ckpt/latest")

    with pytest.raises(CheckpointWriteError, match=r"ckpt/t1: finalizing the commit failed \(OSError: .*ckpt/latest"):
        commit_on_every_rank("ckpt/t1", lambda: {"a.pt": RECORD}, finalize)


def _outcome(action: Any) -> str:
    try:
        action()
    except CheckpointWriteError as exc:
        return f"raised: {exc}"
    return "ok"


def _ranks(rank: int, world: int, port: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out: dict[str, Any] = {}
    finalized = Path(root) / "finalized"

    def finalize(records: dict[str, Any], world_size: int) -> None:
        time.sleep(0.3)  # a slow coordinator: no rank may return before it is done
        finalized.write_text(json.dumps([records, world_size]))

    try:
        records = commit_on_every_rank("ckpt/t1", lambda: {f"r{rank}.pt": RECORD}, finalize)
        out["ok"] = {"records": records, "finalized_before_return": json.loads(finalized.read_text())}

        def rank_1_fails() -> dict[str, Any]:
            if rank == 1:
                raise OSError(28, "No space left on device", "ckpt/t2/r1.pt")
            return {"r0.pt": RECORD}

        out["rank_failed"] = _outcome(lambda: commit_on_every_rank("ckpt/t2", rank_1_fails, finalize))
        out["conflict"] = _outcome(lambda: commit_on_every_rank("ckpt/t3", lambda: {"same.pt": {"bytes": rank}}, finalize))

        def coordinator_fails(records: dict[str, Any], world_size: int) -> None:
            raise OSError(5, "Input/output error", "ckpt/latest")

        out["finalize_failed"] = _outcome(lambda: commit_on_every_rank("ckpt/t4", lambda: {}, coordinator_fails))
        out["all_true"] = [true_on_every_rank(True), true_on_every_rank(rank == 0)]
        _, error, outcomes = gather_outcomes(lambda: rank * 10)
        out["gathered"] = [error is None, [o.value for o in outcomes]]
    finally:
        dist.destroy_process_group()
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))


def test_two_ranks_agree_on_every_outcome(tmp_path: Path) -> None:
    spawn_ranks(_ranks, 2, str(tmp_path), timeout=120)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        records = {"r0.pt": RECORD, "r1.pt": RECORD}
        assert out["ok"] == {"records": records, "finalized_before_return": [records, 2]}, rank
        assert out["rank_failed"].startswith("raised: ckpt/t2: rank 1 failed to write its files (OSError: "), out
        assert "ckpt/t2/r1.pt" in out["rank_failed"] and "not committed on any rank" in out["rank_failed"]
        assert (
            out["conflict"]
            == "raised: ckpt/t3: ranks 0 and 1 both wrote same.pt with different contents; not committed on any rank"
        )
        if rank == 0:
            assert out["finalize_failed"].startswith("raised: ckpt/t4: finalizing the commit failed (OSError: "), out
        else:
            assert out["finalize_failed"].startswith("raised: ckpt/t4: rank 0 failed to finalize the commit (OSError: "), out
        assert "ckpt/latest" in out["finalize_failed"]
        assert out["all_true"] == [True, False]
        assert out["gathered"] == [True, [0, 10]]
