"""Storage tiers end to end: a local tier, a shared folder and a real S3 endpoint (moto's server).

Trains a small model, saves every 10 steps (copies to the shared folder every 20 steps and to S3
every 30), "loses the node" (tier 0 is deleted), resumes on a fresh node from the newest verified
copy, and checks that the next losses are the ones the uninterrupted run computed.
Run: ``python examples/tiers_example.py`` (needs ``moto[server]`` and ``s3fs``): about 12 s on an
idle 2-core CPU machine (longer on a busy one); its temporary folder (``$TMPDIR/tiers-example-*``) and the S3 server are
removed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

import nvcomp_checkpoint as nc


def check_packages() -> None:
    """Fail at once, naming what to install, instead of waiting on an endpoint that never starts."""
    import importlib.util

    missing = [
        pip
        for module, pip in (("moto", "moto[server]"), ("s3fs", "s3fs"), ("boto3", "boto3"))
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        sys.exit(
            f"tiers_example.py needs {', '.join(missing)}: pip install {' '.join(repr(m) for m in missing)} "
            "(or the test extra: pip install -e '.[test]')"
        )


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """``moto_server -H 127.0.0.1 -p PORT`` in its own process, with a bucket ``ckpt``."""
    check_packages()
    os.environ.update({"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_DEFAULT_REGION": "us-east-1"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(
                    f"moto's S3 server did not answer at {endpoint} within 30 s "
                    f"({'it exited with code ' + str(proc.returncode) if proc.poll() is not None else 'still starting'}); "
                    f"try `{sys.executable} -m moto.server -H 127.0.0.1 -p {port}` to see why"
                )
            time.sleep(0.1)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ckpt")
    return proc, endpoint


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_loss(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 64, generator=g)
    loss = (model(x) - x.flip(1)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    moto, endpoint = start_moto()
    work = Path(tempfile.mkdtemp(prefix="tiers-example-"))
    options = {"client_kwargs": {"endpoint_url": endpoint}}
    tiers = [
        nc.Tier(work / "nvme", keep=2, name="local"),
        nc.Tier(work / "shared", every_steps=20, keep=2, name="shared"),
        nc.Tier("s3://ckpt/run1", every_steps=30, keep=3, name="object", storage_options=options),
    ]
    try:
        model, opt = make()
        losses = {}
        mgr = nc.CheckpointManager(tiers, full_every=2)
        for step in range(1, 101):
            losses[step] = step_loss(model, opt, step)
            if step % 10 == 0 and step < 100:
                mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
        mgr.close()
        for i, t in enumerate(tiers):
            print(f"{t.name:7s} {t.url:40s} steps {mgr.steps(i)}")

        shutil.rmtree(work / "nvme")  # the node is gone
        fresh = nc.CheckpointManager([nc.Tier(work / "fresh-nvme", keep=2, name="local"), *tiers[1:]])
        r = fresh.restore()
        print(f"restored step {r.step} from {r.tier_name} ({r.path}); skipped: {len(r.skipped)}")
        model, opt = make()
        model.load_state_dict(r.state["model"])
        opt.load_state_dict(r.state["optimizer"])
        resumed = {s: step_loss(model, opt, s) for s in range(r.step + 1, r.step + 6)}
        for s, loss in resumed.items():
            assert loss == losses[s], (s, loss, losses[s])
        print(f"steps {r.step + 1}-{r.step + 5}: the same losses as the uninterrupted run")
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
