"""Async and pipelined saves against torch.save, Lightning's AsyncCheckpointIO and DCP's async_save.

Each method runs in its own process (so peak RSS is its own) on the same ~280 MB checkpoint of a
small BERT fine-tuned a few AdamW steps on the CPU. Run: ``python benchmarks/bench_async.py``;
``--state bf16`` saves a mixed-precision training state instead (bf16 weights, fp32 AdamW
moments, bf16 gradients).

``--paired N`` runs ``--methods`` in one process instead, N rounds, each method once per round in
a rotating order, and reports per method the best and median durable and blocked times and the
CPU time per save, and the median of the per-round ratios against ``nc_sync``: on a shared,
noisy machine a ratio of two saves made seconds apart is steadier than one of two bests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
CACHE = OUT / "async_bert_small.v1.pt"
# --src DIR: the library of another checkout (to compare two versions on one machine, in turns).
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv[:-1] else str(HERE.parent / "src")
sys.path.insert(0, _SRC)

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.report import format_bytes, format_table  # noqa: E402

METHODS = {
    "torch_save": "torch.save (sync)",
    "lightning_async": "Lightning AsyncCheckpointIO(TorchCheckpointIO)",
    "dcp_async": "DCP async_save",
    "dcp_async_zstd": "DCP async_save + ZStandard",
    "nc_sync": "nvcomp_checkpoint.save",
    "nc_async": "nvcomp_checkpoint.save_async",
    "nc_async_serial": "AsyncSaver(overlap=False)",
}


# -- the checkpoint ------------------------------------------------------------------------------
def _config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        intermediate_size=1536,
        max_position_embeddings=512,
    )


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(_config())
    return model, torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)


def build_cache(steps: int = 4) -> None:
    """Fine-tune a config-built BERT (~23 M parameters) a few masked-LM steps; cache its state."""
    if CACHE.exists():
        return
    OUT.mkdir(parents=True, exist_ok=True)
    model, opt = _model_and_optimizer()
    model.train()
    for _ in range(steps):
        tokens = torch.randint(1000, 30522, (8, 64))
        mask = torch.rand(tokens.shape) < 0.15
        labels = tokens.masked_fill(~mask, -100)
        loss = model(input_ids=tokens.masked_fill(mask, 103), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    tmp = CACHE.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    tmp.replace(CACHE)


def live_checkpoint(state_kind: str = "fp32") -> dict[str, Any]:
    """The cached training state loaded into a live model and optimizer, as a trainer holds it.

    ``bf16``: the state of mixed-precision training: bf16 weights, the optimizer's fp32 moments,
    and bf16 gradients of one more masked-LM batch.
    """
    model, opt = _model_and_optimizer()
    state = torch.load(CACHE, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if state_kind == "fp32":
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 4}
    torch.manual_seed(1)
    tokens = torch.randint(1000, 30522, (8, 64))
    mask = torch.rand(tokens.shape) < 0.15
    model(input_ids=tokens.masked_fill(mask, 103), labels=tokens.masked_fill(~mask, -100)).loss.backward()
    grads = {name: p.grad.to(torch.bfloat16) for name, p in model.named_parameters() if p.grad is not None}
    weights = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    return {"model": weights, "optimizer": opt.state_dict(), "grads": grads, "step": 4}


# -- storage helpers -----------------------------------------------------------------------------
class ThrottledStream:
    """Storage that drains ``rate`` bytes/s behind a ``buffer``-byte write cache.

    ``write`` returns once the bytes fit in the cache, as with a page cache or a disk queue; the
    device never gets credit for time it sat idle, so every stall in feeding it is lost time.
    ``drained_at`` is when the device has written the last byte (the end of a durable save).
    A sleeping writer that wakes late (a busy machine) does not idle the device while the cache
    still holds data, so the emulation measures the pipeline, not the scheduler.
    """

    def __init__(self, inner: IO[bytes], rate: float, buffer: int = 16 << 20) -> None:
        self.inner, self.rate, self.buffer = inner, rate, buffer
        self.drained_at = 0.0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.inner.write(data)
        now = time.perf_counter()
        self.drained_at = max(now, self.drained_at) + n / self.rate
        wait = self.drained_at - self.buffer / self.rate - now
        if wait > 0:
            time.sleep(wait)
        return n


class DiscardStream:
    """Counts bytes and drops them: what a save costs with infinitely fast storage."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _status_kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(match.group(1)) if match else 0


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


# -- one method, in this process ------------------------------------------------------------------
def _torch_save(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    t = time.perf_counter() - t0
    return t, t


def _lightning(ckpt: dict[str, Any], path: Path, io: Any) -> tuple[float, float]:
    t0 = time.perf_counter()
    io.save_checkpoint(ckpt, path)
    blocked = time.perf_counter() - t0
    io.teardown()  # waits for the background torch.save
    fsync_path(path)  # Lightning writes without fsync; durability is part of the comparison
    return blocked, time.perf_counter() - t0


def _dcp(ckpt: dict[str, Any], path: Path, zstd: bool) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(path, ignore_errors=True)
    writer = None
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        writer = dcp.FileSystemWriter(str(path), _extensions=[ZStandard()])
    t0 = time.perf_counter()
    fut = dcp.async_save(ckpt, checkpoint_id=str(path), storage_writer=writer)
    blocked = time.perf_counter() - t0
    fut.result()  # FileSystemWriter fsyncs every file (sync_files=True)
    return blocked, time.perf_counter() - t0


def _nc_sync(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
    report = nc.save(ckpt, path)
    return report.seconds, report.seconds


def _nc_async(ckpt: dict[str, Any], path: Path, saver: Any = None) -> tuple[float, float]:
    t0 = time.perf_counter()
    handle = nc.save_async(ckpt, path) if saver is None else saver.save(ckpt, path)
    blocked = time.perf_counter() - t0
    handle.result()
    return blocked, time.perf_counter() - t0


def run_method(method: str, reps: int, workdir: Path, state_kind: str = "fp32") -> dict[str, Any]:
    ckpt = live_checkpoint(state_kind)
    raw = sum(t.numel() * t.element_size() for t in _tensors(ckpt))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{method}.ckpt"
    fn: Callable[[], tuple[float, float]]
    if method == "torch_save":
        fn = lambda: _torch_save(ckpt, path)  # noqa: E731
    elif method == "lightning_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        io = AsyncCheckpointIO(TorchCheckpointIO())
        fn = lambda: _lightning(ckpt, path, io)  # noqa: E731
    elif method in ("dcp_async", "dcp_async_zstd"):
        import torch.distributed as dist

        store = workdir / f"{method}.pg"
        store.unlink(missing_ok=True)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        fn = lambda: _dcp(ckpt, path, zstd=method.endswith("zstd"))  # noqa: E731
    elif method == "nc_sync":
        fn = lambda: _nc_sync(ckpt, path)  # noqa: E731
    elif method == "nc_async":
        fn = lambda: _nc_async(ckpt, path)  # noqa: E731
    elif method == "nc_async_serial":
        serial = nc.AsyncSaver(overlap=False)
        fn = lambda: _nc_async(ckpt, path, serial)  # noqa: E731
    else:
        raise SystemExit(f"unknown method {method}")
    base_rss = _status_kib("VmRSS")
    reset_peak_rss()
    runs = [fn() for _ in range(reps)]
    peak = _status_kib("VmHWM")
    out = {
        "method": method,
        "raw_bytes": raw,
        "stored_bytes": tree_bytes(path),
        "blocked_s": min(b for b, _ in runs),
        "durable_s": min(d for _, d in runs),
        "runs": runs,
        "peak_extra_rss_bytes": max(0, peak - base_rss) * 1024,
    }
    if method == "nc_sync":
        out.update(pipeline(ckpt, workdir))
    if method.startswith("dcp"):
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    from nvcomp_checkpoint.format.skeleton import flatten

    return [t for _, t in flatten(obj)[1]]


def pipeline(ckpt: dict[str, Any], workdir: Path, rate: float = 200e6, reps: int = 3) -> dict[str, Any]:
    """Is compression hidden behind writing? Compress-only time vs a save to throttled storage.

    The throttled saves go to a RAM file system where there is one: the throttle is the storage
    under test, and fsyncing the same bytes to this machine's disk as well would count twice.
    """
    shm = Path("/dev/shm")
    path = (shm if shm.is_dir() and os.access(shm, os.W_OK) else workdir) / f"nvckpt-pipeline-{os.getpid()}.nvc"
    compress = min(nc.save(ckpt, path, stream_wrapper=DiscardStream).seconds for _ in range(reps))
    stored = nc.save(ckpt, path).stored_bytes
    throttled = []
    for _ in range(reps):
        streams: list[ThrottledStream] = []

        def wrap(s: IO[bytes]) -> ThrottledStream:
            streams.append(ThrottledStream(s, rate))
            return streams[-1]

        start = time.perf_counter()
        nc.save(ckpt, path, stream_wrapper=wrap)
        throttled.append(max(time.perf_counter(), streams[0].drained_at) - start)
    path.unlink(missing_ok=True)
    return {"rate": rate, "compress_only_s": compress, "throttled_s": min(throttled), "write_only_s": stored / rate}


# -- paired: every method in one process, in turns ------------------------------------------------
def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system  # every thread of this process: the background save's too


def run_paired(methods: list[str], rounds: int, workdir: Path, state_kind: str) -> dict[str, Any]:
    """Each round saves once with every method, starting one method later each round."""
    ckpt = live_checkpoint(state_kind)
    workdir.mkdir(parents=True, exist_ok=True)
    fns: dict[str, Callable[[], tuple[float, float]]] = {}
    for method in methods:
        path = workdir / f"paired-{method}.ckpt"
        if method == "torch_save":
            fns[method] = lambda p=path: _torch_save(ckpt, p)
        elif method == "nc_sync":
            fns[method] = lambda p=path: _nc_sync(ckpt, p)
        elif method == "nc_async":
            fns[method] = lambda p=path: _nc_async(ckpt, p)
        elif method == "nc_async_serial":
            # The copy done before the background save starts (as before overlapping them).
            serial = nc.AsyncSaver(overlap=False)
            fns[method] = lambda p=path, s=serial: _nc_async(ckpt, p, s)
        else:
            raise SystemExit(f"--paired runs torch_save, nc_sync, nc_async and nc_async_serial, not {method}")
    for fn in fns.values():
        fn()  # warm-up: snapshot arena, thread pools, page cache of the target files
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    for r in range(rounds):
        for k in range(len(methods)):
            method = methods[(r + k) % len(methods)]
            cpu = _cpu_seconds()
            blocked, durable = fns[method]()
            samples[method].append((blocked, durable, _cpu_seconds() - cpu))
    raw = sum(t.numel() * t.element_size() for t in _tensors(ckpt))
    stored = {m: tree_bytes(workdir / f"paired-{m}.ckpt") for m in methods}
    return {"raw_bytes": raw, "stored_bytes": stored, "samples": samples}


def report_paired(result: dict[str, Any], state_kind: str, src: str) -> None:
    samples: dict[str, list[tuple[float, float, float]]] = result["samples"]
    rounds = len(next(iter(samples.values())))
    what = "fp32 weights + AdamW state" if state_kind == "fp32" else "bf16 weights + fp32 AdamW state + bf16 gradients"
    print(
        f"checkpoint: BERT (6 x 384, config-built), {what}, {format_bytes(result['raw_bytes'])} raw; "
        f"{os.cpu_count()} CPUs; {rounds} rounds, methods in turn in one process; library {src}"
    )

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    sync = [d for _, d, _ in samples.get("nc_sync", [])]
    rows = []
    for method, runs in samples.items():
        blocked, durable, cpu = ([r[i] for r in runs] for i in range(3))
        ratios = [d / s for d, s in zip(durable, sync)] if sync else []
        rows.append(
            [
                METHODS[method],
                f"{min(blocked):.3f} / {med(blocked):.3f}",
                f"{min(durable):.3f} / {med(durable):.3f}",
                f"{med(cpu):.2f}",
                f"{min(durable) / min(sync):.3f}x / {med(ratios):.3f}x" if sync else "-",
                format_bytes(result["stored_bytes"][method]),
            ]
        )
    print(
        format_table(
            [
                "method",
                "blocked s (best / median)",
                "to durable s (best / median)",
                "CPU s per save (median)",
                "durable vs nc_sync (best/best / median of pairs)",
                "file",
            ],
            rows,
        )
    )
    if "nc_async" in samples and sync:
        durable = [d for _, d, _ in samples["nc_async"]]
        ratios = sorted(d / s for d, s in zip(durable, sync))
        best = min(durable) / min(sync)
        print()
        print(f"async/sync per round: {', '.join(f'{x:.2f}' for x in ratios)}")
        print(f"[{'PASS' if best <= 1.15 else 'FAIL'}] async to durable, best against best: {best:.3f}x <= 1.15x")
        print(
            f"[{'PASS' if med(ratios) <= 1.15 else 'FAIL'}] async to durable, median of paired ratios: "
            f"{med(ratios):.3f}x <= 1.15x"
        )


# -- driver --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3, help="saves per method per round (best is reported)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all methods, one process each")
    parser.add_argument("--rate", type=float, default=200e6, help="throttled storage rate, bytes/s")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    parser.add_argument(
        "--state",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32: weights and AdamW moments; bf16: bf16 weights, fp32 moments, bf16 gradients",
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="N",
        help="N rounds of --methods (torch_save, nc_sync, nc_async) in turns, in one process",
    )
    parser.add_argument("--src", default=_SRC, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = OUT / "bench_async"
    if args.paired:
        build_cache()
        result = run_paired(args.methods.split(","), args.paired, workdir / f"paired-{os.getpid()}", args.state)
        shutil.rmtree(workdir / f"paired-{os.getpid()}", ignore_errors=True)
        report_paired(result, args.state, args.src)
        (OUT / f"bench_async_paired_{args.state}.json").write_text(json.dumps(result, indent=2))
        return
    if args.method:
        print(json.dumps(run_method(args.method, args.reps, workdir, args.state)))
        return

    build_cache()
    results: dict[str, dict[str, Any]] = {}
    # Round-robin, so that a burst of load from other processes hits every method alike.
    for _ in range(args.rounds):
        for method in args.methods.split(","):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--method",
                    method,
                    "--reps",
                    str(args.reps),
                    "--state",
                    args.state,
                    "--src",
                    args.src,
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            if proc.returncode != 0:
                print(f"{method}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            results[method] = _merge(results.get(method), json.loads(proc.stdout.strip().splitlines()[-1]))
    shutil.rmtree(workdir, ignore_errors=True)
    report(results, args.reps * args.rounds, args.state)
    (OUT / f"bench_async_{args.state}.json").write_text(json.dumps(results, indent=2))


def _merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Best times and the largest peak RSS over rounds."""
    if old is None:
        return new
    out = dict(new)
    for key in ("blocked_s", "durable_s", "compress_only_s", "throttled_s"):
        if key in new:
            out[key] = min(old[key], new[key])
    out["peak_extra_rss_bytes"] = max(old["peak_extra_rss_bytes"], new["peak_extra_rss_bytes"])
    out["runs"] = old["runs"] + new["runs"]
    return out


def report(results: dict[str, dict[str, Any]], reps: int, state_kind: str = "fp32") -> None:
    any_result = next(iter(results.values()))
    what = "fp32 weights + AdamW state" if state_kind == "fp32" else "bf16 weights + fp32 AdamW state + bf16 gradients"
    print(
        f"checkpoint: BERT (6 x 384, config-built), {what}, {format_bytes(any_result['raw_bytes'])} raw; "
        f"{os.cpu_count()} CPUs; best of {reps}"
    )
    rows = []
    for method, r in results.items():
        durable = sorted(d for _, d in r["runs"])
        rows.append(
            [
                METHODS[method],
                f"{r['blocked_s']:.3f}",
                f"{r['durable_s']:.3f}",
                f"{durable[len(durable) // 2]:.3f}",
                format_bytes(r["stored_bytes"]),
                f"{r['raw_bytes'] / r['stored_bytes']:.3f}x",
                format_bytes(r["peak_extra_rss_bytes"]),
            ]
        )
    print(format_table(["method", "blocked s", "to durable s", "median durable s", "file", "ratio", "peak extra RSS"], rows))

    checks = []
    if "nc_sync" in results and "nc_async" in results:
        s, a = results["nc_sync"], results["nc_async"]
        checks.append(
            (
                f"async blocked {a['blocked_s']:.3f} s <= 0.3 x sync save {s['durable_s']:.3f} s",
                a["blocked_s"] <= 0.3 * s["durable_s"],
            )
        )
        checks.append(
            (
                f"async to durable {a['durable_s']:.3f} s <= 1.15 x sync save {s['durable_s']:.3f} s "
                f"({a['durable_s'] / s['durable_s']:.2f}x)",
                a["durable_s"] <= 1.15 * s["durable_s"],
            )
        )
        if "dcp_async" in results:
            d = results["dcp_async"]
            checks.append(
                (
                    f"async blocked {a['blocked_s']:.3f} s <= DCP async blocked {d['blocked_s']:.3f} s",
                    a["blocked_s"] <= d["blocked_s"],
                )
            )
    if "nc_sync" in results and "throttled_s" in results["nc_sync"]:
        p = results["nc_sync"]
        print()
        print(
            format_table(
                ["pipeline (nc.save, sync)", "seconds"],
                [
                    ["compress only (storage discards bytes)", f"{p['compress_only_s']:.3f}"],
                    [f"write only (stored bytes / {p['rate'] / 1e6:.0f} MB/s)", f"{p['write_only_s']:.3f}"],
                    ["sum, if nothing overlapped", f"{p['compress_only_s'] + p['write_only_s']:.3f}"],
                    ["measured, throttled storage", f"{p['throttled_s']:.3f}"],
                ],
            )
        )
        checks.append(
            (
                f"throttled sync save {p['throttled_s']:.3f} s <= 1.1 x write only {p['write_only_s']:.3f} s",
                p["throttled_s"] <= 1.1 * p["write_only_s"],
            )
        )
    print()
    for text, ok in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {text}")


if __name__ == "__main__":
    main()
