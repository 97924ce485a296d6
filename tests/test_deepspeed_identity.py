"""A DeepSpeed tag whose rank-1 file is another tag's, or damaged, is refused on every rank (2 CPU ranks, gloo).

tests/deepspeed_identity.py saves two tags through ``attach`` and loads the second with its rank-1
file replaced (same size) or damaged; every rank must raise, naming rank 1's file, and the tag must
load again once the file is restored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fresh_process

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")

SCRIPT = Path(__file__).with_name("deepspeed_identity.py")
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_a_swapped_or_damaged_rank_file_fails_the_load_on_every_rank_naming_it(tmp_path: Path) -> None:
    env = {
        "DS_ACCELERATOR": "cpu",
        "DS_BUILD_OPS": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1] / "src"), str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = fresh_process.run_ranks((str(SCRIPT), str(tmp_path)), 2, cwd=os.getcwd(), env=dict(os.environ, **env), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    seen = [json.loads((tmp_path / f"identity_{rank}.json").read_text()) for rank in range(2)]
    assert seen[0]["same_size"], "the two tags' rank-1 files must have one size: only a digest tells them apart"
    # Rank 1 reads the file and names it; rank 0, whose own files are fine, raises too, naming rank 1 and the file.
    assert seen[1]["swapped"].startswith("MixedSaveError") and RANK1 in seen[1]["swapped"], seen[1]
    assert seen[1]["damaged"].startswith("ChecksumError") and RANK1 in seen[1]["damaged"], seen[1]
    for case in ("swapped", "damaged"):
        assert seen[0][case].startswith("CheckpointError") and "rank 1" in seen[0][case] and RANK1 in seen[0][case], seen[0]
    assert seen[0]["restored"] == seen[1]["restored"] == "ok"
