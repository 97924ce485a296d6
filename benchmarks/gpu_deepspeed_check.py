"""Lightning's DeepSpeedStrategy on a GPU: the one DeepSpeed path the CPU suite cannot run unmodified.

One step of ``benchmarks/gpu_check.sh``. ``tests/deepspeed_frameworks_train.py lightning`` with
``NVCKPT_DS_GPU=1`` (one process, CUDA device 0, ZeRO-2, Lightning's own strategies): the first
process saves plain (``DeepSpeedStrategy``) and ours (``NvcompDeepSpeedStrategy``) at step 3 and
trains 2 more steps; a fresh process resumes from each and must see the same 2 losses. Prints one
line ``gpu_deepspeed_check: {json}``; exits 1 if a check fails. Without CUDA or without DeepSpeed
it says so in that line and exits 0 (the dry run; the image lacks DeepSpeed unless its wheels are carried).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "deepspeed_frameworks_train.py"


def main() -> int:
    row: dict[str, object] = {"case": "lightning_deepspeed_zero2"}
    try:
        import deepspeed  # noqa: F401
        import torch
    except ImportError as exc:
        row.update(status="skipped", why=f"{exc.name} is not installed")
        print("gpu_deepspeed_check:", json.dumps(row), flush=True)
        return 0
    if not torch.cuda.is_available():
        row.update(status="skipped", why="no CUDA device")
        print("gpu_deepspeed_check:", json.dumps(row), flush=True)
        return 0
    from nvcomp_checkpoint.filetype import NVCOMP, TORCH, kind_of

    env = dict(os.environ, NVCKPT_DS_GPU="1", DS_ACCELERATOR="cuda", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for mode in ("first", "resume"):
            proc = subprocess.run(
                [sys.executable, str(SCRIPT), "lightning", mode, root], env=env, capture_output=True, text=True, timeout=150
            )
            if proc.returncode != 0:
                row.update(status="failed", why=f"{mode}: {proc.stderr[-1500:]}")
                print("gpu_deepspeed_check:", json.dumps(row), flush=True)
                return 1
        ref = json.loads(Path(root, "ref.json").read_text())
        resumed = json.loads(Path(root, "resumed.json").read_text())
        kinds = {}
        for name, want in (("ours", NVCOMP), ("plain", TORCH)):
            for path in sorted(Path(root, name, "checkpoint").glob("*.pt")):
                with open(path, "rb") as f:
                    kinds[f"{name}/{path.name}"] = (kind_of(f.read(16), path.stat().st_size), want)
        bad = {k: v for k, v in kinds.items() if v[0] != v[1]}
        ok = resumed == {"ours": ref, "plain": ref} and len(ref) == 2 and kinds and not bad
        row.update(
            status="ok" if ok else "failed",
            ref=ref,
            resumed=resumed,
            files=len(kinds),
            wrong_kind=sorted(bad),
            seconds=round(time.perf_counter() - started, 1),
        )
    print("gpu_deepspeed_check:", json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
