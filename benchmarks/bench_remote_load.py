"""Loads from object storage: wall and CPU time, peak memory beyond the result, requests made.

The same checkpoint (an MLP trained a few AdamW steps: weights and both moments, about 300 MB)
is loaded from two local endpoints, each in a process of its own:

- ``s3``: moto's standalone S3 server through s3fs. moto answers a ranged GET by reading the
  whole object first, so its time per request grows with the object: it favours few large
  requests, which real S3 does not.
- ``http``: an aiohttp static file server (ranged GETs served from the file, as object stores
  do) through fsspec's HTTP file system.

Each load runs in a fresh process (peak RSS beyond the RSS before the load and the result's
bytes is the extra memory); ``--src`` names source trees to compare (``label=path/to/src``,
e.g. a checkout of main), run interleaved, A B A B ..., so every variant sees the same load.

Run: ``python benchmarks/bench_remote_load.py --src old=/path/to/main/src --src new=src``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "bench"

_HTTP_SERVER = """
import logging
import sys
from aiohttp import web
logging.basicConfig(level=logging.INFO)  # the access log: a line per request
app = web.Application()
app.router.add_static("/", sys.argv[1])
web.run_app(app, host="127.0.0.1", port=0, print=lambda line: print(line, file=sys.stderr, flush=True))
"""


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert found is not None, field
    return int(found.group(1))


def child(url: str, options: str, src: str) -> None:
    """One load in this fresh process; prints its measurements as JSON."""
    sys.path.insert(0, src)
    import torch
    import xxhash

    import nvcomp_checkpoint as nc

    assert Path(nc.__file__).resolve().is_relative_to(Path(src).resolve()), nc.__file__
    import fsspec

    fsspec.core.url_to_fs(url, **json.loads(options))  # the back end imported and its client made: not the load's
    rss = _status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    state = nc.load(url, storage_options=json.loads(options) or None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _status_kib("VmHWM")
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    result = sum(t.untyped_storage().nbytes() for t in tensors)
    digest = xxhash.xxh3_64()
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    print(json.dumps({"wall": wall, "cpu": cpu, "extra": (peak - rss) * 1024 - result, "digest": digest.hexdigest()}))


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


def _state(hidden: int, layers: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, hidden)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _server(args: list[str], log: Path, pattern: str) -> tuple[subprocess.Popen[bytes], int]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=out, env=dict(os.environ, **_ENV))
    deadline = time.monotonic() + 60
    while (found := re.search(pattern.encode(), log.read_bytes())) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return proc, int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", action="append", default=[], help="label=path of a source tree to load with (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--storage", action="append", choices=["s3", "http"], default=[])
    parser.add_argument("--child", nargs=3, metavar=("URL", "OPTIONS", "SRC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    srcs = dict(s.split("=", 1) for s in args.src) or {"this": str(HERE.parent / "src")}
    storages = args.storage or ["s3", "http"]
    sys.path.insert(0, str(HERE.parent / "src"))
    os.environ.update(_ENV)  # dummies: nothing reaches real AWS credentials
    import boto3

    import nvcomp_checkpoint as nc

    print(f"loadavg at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "www").mkdir()
        path = folder / "www" / "ckpt.nvc"
        report = nc.save(_state(args.hidden, args.layers), path)
        print(f"checkpoint: {report.raw_bytes / 1e6:.0f} MB raw, {path.stat().st_size / 1e6:.0f} MB stored")
        moto, moto_port = _server(
            ["-m", "moto.server", "-H", "127.0.0.1", "-p", "0"], folder / "moto.log", r"Running on http://127\.0\.0\.1:(\d+)"
        )
        http, http_port = _server(["-c", _HTTP_SERVER, str(folder / "www")], folder / "http.log", r"http://127\.0\.0\.1:(\d+)")
        try:
            endpoint = f"http://127.0.0.1:{moto_port}"
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket=BUCKET)
            client.upload_file(str(path), BUCKET, "ckpt.nvc")
            where = {
                "s3": (f"s3://{BUCKET}/ckpt.nvc", {"client_kwargs": {"endpoint_url": endpoint}}, folder / "moto.log"),
                "http": (f"http://127.0.0.1:{http_port}/ckpt.nvc", {}, folder / "http.log"),
            }
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                for storage in storages:
                    url, options, log = where[storage]
                    for label, src in srcs.items():
                        before = log.read_text(errors="replace").count("GET /")
                        out = subprocess.run(
                            [sys.executable, __file__, "--child", url, json.dumps(options), src],
                            capture_output=True,
                            text=True,
                            env=dict(os.environ, **_ENV),
                        )
                        if out.returncode:
                            raise RuntimeError(f"{storage} {label}: the load failed:\n{out.stderr[-3000:]}")
                        run = json.loads(out.stdout.strip().splitlines()[-1])
                        run["requests"] = log.read_text(errors="replace").count("GET /") - before
                        runs.setdefault((storage, label), []).append(run)
        finally:
            for proc in (moto, http):
                proc.kill()
                proc.wait()
    digests = {r["digest"] for rs in runs.values() for r in rs}
    assert len(digests) == 1, f"the variants loaded different bytes: {digests}"
    print(f"{'storage':8} {'variant':8} {'wall min/med s':>16} {'CPU min/med s':>15} {'extra MB min/max':>17} {'GETs':>5}")
    for (storage, label), rs in runs.items():
        wall = [r["wall"] for r in rs]
        cpu = [r["cpu"] for r in rs]
        extra = [r["extra"] / 1e6 for r in rs]
        print(
            f"{storage:8} {label:8} {min(wall):7.2f}/{statistics.median(wall):<8.2f} {min(cpu):6.2f}/{statistics.median(cpu):<8.2f}"
            f" {min(extra):7.0f}/{max(extra):<9.0f} {statistics.median(r['requests'] for r in rs):5.0f}"
        )
    print(f"loadavg at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
