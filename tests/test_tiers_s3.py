"""An object-store tier on a real S3 endpoint: moto's standalone server in its own process, reached by s3fs over HTTP.

Covers the multipart copy, retention on S3, a fresh-node restore from S3 only, a save process
SIGKILLed mid-upload, and the endpoint stopped mid-upload and restarted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal, start_moto_server
from nvcomp_checkpoint.errors import CheckpointWriteError

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "tiers"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    """``moto_server -H 127.0.0.1`` as a child process; start, stop, start again on the same port."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.port = 0  # the first start binds a port the kernel picks; restarts bind it again
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc, self.port = start_moto_server(dict(os.environ, **_AWS_ENV), self.log, self.port)
        self.client().create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    #: botocore's timeouts (s) in :meth:`options`.
    connect_timeout, read_timeout = 2, 10

    def options(self) -> dict[str, Any]:
        # One botocore attempt per call and short timeouts: the tier's own retries are under test.
        return {
            "client_kwargs": {"endpoint_url": self.endpoint},
            "key": "x",
            "secret": "y",
            "config_kwargs": {
                "retries": {"max_attempts": 1},
                "connect_timeout": self.connect_timeout,
                "read_timeout": self.read_timeout,
            },
            "skip_instance_cache": True,
        }

    def keys(self, prefix: str = "") -> list[str]:
        out = self.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        return sorted(o["Key"] for o in out)

    def uploads(self) -> list[str]:
        return [u["Key"] for u in self.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


@contextlib.contextmanager
def served(server: MotoServer) -> Iterator[MotoServer]:
    """``server`` started, with dummy AWS credentials in the environment (nothing ever reaches real
    AWS); stopped and the environment put back after."""
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with served(MotoServer(tmp_path_factory.mktemp("moto") / "moto_server.log")) as server:
        yield server


def _state(step: int, mib: int = 0) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    state: dict[str, Any] = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
    if mib:  # incompressible bytes, so the file has several 5 MiB parts
        g = torch.Generator().manual_seed(100 + step)
        state["model"]["blob"] = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, generator=g)
    return state


def test_s3_tier_retention_and_fresh_node_restore(moto, tmp_path):
    url = f"s3://{BUCKET}/run1"
    tiers = [
        nc.Tier(tmp_path / "local", keep=1),
        nc.Tier(url, keep=2, name="object", storage_options=moto.options(), part_size=5 << 20),
    ]
    states = {}
    with nc.CheckpointManager(tiers) as mgr:
        for step in (10, 20, 30):
            states[step] = _state(step, mib=12 if step == 30 else 0)  # step 30 goes up in parts
            mgr.save(step, states[step])
            mgr.wait()
        assert mgr.steps(0) == [30] and mgr.steps(1) == [20, 30]
    assert moto.keys("run1/") == [
        "run1/step-0000000020.manifest.json",
        "run1/step-0000000020.nvc",
        "run1/step-0000000030.manifest.json",
        "run1/step-0000000030.nvc",
    ]
    head = moto.client().head_object(Bucket=BUCKET, Key="run1/step-0000000030.nvc")
    size = (tmp_path / "local" / "step-0000000030.nvc").stat().st_size
    assert head["ContentLength"] == size
    assert head["ETag"].strip('"').endswith(f"-{-(-size // (5 << 20))}")  # a multipart upload in 5 MiB parts
    assert moto.uploads() == []

    # A fresh node: an empty local tier, the object store as it is.
    fresh = [nc.Tier(tmp_path / "fresh-node", keep=1), tiers[1]]
    r = nc.CheckpointManager(fresh).restore()
    assert (r.step, r.tier_name, r.path) == (30, "object", f"{url}/step-0000000030.nvc")
    assert_tree_equal(states[30], r.state)
    # The object store alone.
    r = nc.CheckpointManager([tiers[1]]).restore(step=20)
    assert_tree_equal(states[20], r.state)


_KILLED_SAVER = textwrap.dedent(
    """
    import sys, time, torch
    import nvcomp_checkpoint as nc
    local, url, endpoint = sys.argv[1:4]
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "x", "secret": "y"}
    seen = [0]
    def hold(tier, step, nbytes):
        seen[0] += nbytes
        if step == 2 and seen[0] >= 8 << 20:  # one 5 MiB part is up, the rest in flight
            print("UPLOADING", flush=True)
            time.sleep(600)
    mgr = nc.CheckpointManager([nc.Tier(local), nc.Tier(url, storage_options=opts, part_size=5 << 20)], on_copy_progress=hold)
    g = torch.Generator().manual_seed(7)
    mgr.save(1, {"w": torch.arange(1000.0), "step": 1})
    mgr.wait()
    mgr.save(2, {"w": torch.randint(0, 256, (24 << 20,), dtype=torch.uint8, generator=g), "step": 2})
    time.sleep(600)
    """
)


def test_save_process_killed_mid_upload(moto, tmp_path):
    url = f"s3://{BUCKET}/killed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(tmp_path / "local"), url, moto.endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == b"UPLOADING", proc.stderr.read().decode()[-3000:]
        assert moto.uploads() == ["killed/step-0000000002.nvc"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Nothing of step 2 is listed on the object store; its parts are still billed.
    assert moto.keys("killed/") == ["killed/step-0000000001.manifest.json", "killed/step-0000000001.nvc"]
    assert moto.uploads() == ["killed/step-0000000002.nvc"]

    tiers = [nc.Tier(tmp_path / "local"), nc.Tier(url, storage_options=moto.options())]
    mgr = nc.CheckpointManager(tiers)  # the next manager cleans up (in the background; wait() waits for it)
    mgr.wait()
    assert moto.uploads() == []
    assert mgr.steps(1) == [1]
    assert mgr.steps(0) == [1, 2]  # the tier-0 save itself had completed
    r = nc.CheckpointManager([tiers[1]]).restore()
    assert r.step == 1
    assert_tree_equal({"w": torch.arange(1000.0), "step": 1}, r.state)


def test_endpoint_stopped_mid_upload_and_restarted(moto, tmp_path, caplog):
    url = f"s3://{BUCKET}/outage"
    reached, go = threading.Event(), threading.Event()

    def hold(tier: str, step: int, nbytes: int) -> None:
        if step == 2 and not reached.is_set():
            reached.set()
            go.wait(60)

    tiers = [
        nc.Tier(tmp_path / "local", keep=5),
        nc.Tier(url, name="object", storage_options=moto.options(), part_size=5 << 20, retries=4, backoff_s=0.5),
    ]
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr = nc.CheckpointManager(tiers, on_copy_progress=hold)
    mgr.save(1, _state(1))
    mgr.wait()
    states = {2: _state(2, mib=12)}
    mgr.save(2, states[2])
    assert reached.wait(60)
    moto.stop()  # mid-upload: the multipart upload has begun
    go.set()
    # Training goes on while the object store is down: tier-0 saves do not wait for it.
    t = time.perf_counter()
    states[3] = _state(3)
    mgr.save(3, states[3]).result()
    assert time.perf_counter() - t < 10
    deadline = time.monotonic() + 60  # the copy's first attempt against the stopped endpoint has failed
    while "copying step 2 failed" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    moto.start()  # a fresh, empty endpoint on the same port
    mgr.wait()  # retried with back-off until it was back
    assert "copying step 2 failed" in caplog.text and "retrying in" in caplog.text
    assert mgr.steps(1) == [2, 3] and mgr.steps(0) == [1, 2, 3]
    r = nc.CheckpointManager([tiers[1]]).restore()
    assert r.step == 3
    assert_tree_equal(states[3], r.state)

    # Down for good: retries run out, then one clear error; tier 0 keeps every save.
    moto.stop()
    caplog.clear()
    mgr.save(4, _state(4))
    with pytest.raises(CheckpointWriteError, match=r"object \(.*\): copying step 4 failed after 5 attempt\(s\).*stays on tier0"):
        mgr.wait()
    assert mgr.steps(0) == [1, 2, 3, 4]
    r = nc.CheckpointManager(tiers[:1]).restore()
    assert r.step == 4
    mgr.close()


def test_cli_sync_to_s3_and_ls(moto, tmp_path, capsys):
    import json

    from nvcomp_checkpoint.cli.main import main

    with nc.CheckpointManager([nc.Tier(tmp_path / "local")]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    url = f"s3://{BUCKET}/synced"
    assert main(["sync", "--json", "--endpoint-url", moto.endpoint, str(tmp_path / "local"), url, "--keep", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["kept"] == [2, 3]
    assert main(["ls", "--json", "--endpoint-url", moto.endpoint, url]) == 0
    rows = json.loads(capsys.readouterr().out)["tiers"][url]
    assert [(r["step"], r["verifies"], r["light"]) for r in rows] == [(2, True, False), (3, True, False)]
    body = moto.client().get_object(Bucket=BUCKET, Key="synced/step-0000000003.nvc")["Body"].read()
    assert body == (tmp_path / "local" / "step-0000000003.nvc").read_bytes()
