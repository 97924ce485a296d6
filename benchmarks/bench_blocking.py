"""The blocking window of a save, Orbax-style, for every async entry point of ours and of the others.

For each method, in its own process (so peak memory is its own), on the same training state (the
``moe`` checkpoint with bf16 weights, fp32 AdamW moments, bf16 gradients, plus Python scalars:
the optimizer's hyper-parameters and a top-level ``step`` and ``epoch``), each trial measures:

- ``save_blocking``: from the save call until it returns, i.e. until training may go on (for DCP
  with a ``DefaultStager``, until its ``staging_completion`` is done, which is its contract);
- ``durable``: from the save call until the checkpoint is durable (fsynced), the background part
  of it (Orbax's ``save_background``) overlapping the in-place change of the state below, whose
  own time is given too (for a synchronous save, ``durable`` is the save plus that change);
- ``load``: reading it back with the method's own loader;
- held between saves: RSS before the trial minus RSS before the first save (DCP's stagers keep
  their staging copy of the state from one save to the next);
- peak extra host memory: the process's peak RSS during the save minus its RSS before (glibc
  told to return freed blocks of 128 KiB or more at once, so a trial cannot reuse pages an
  earlier one left resident and look free).

Torn-write check: right after the save call returns, every tensor (``add_`` / ``logical_not_``)
and every Python scalar of the state is changed in place (the optimizer's ``step`` included); the
checkpoint loaded back is compared bit for bit with the state as it was at the call. A method
passes a trial only if it came back exact. The first save of each method is a warm-up (DCP's
process checkpointer starts its process then) and is not counted.

    python benchmarks/bench_blocking.py                  # every method, 3 trials each
    python benchmarks/bench_blocking.py --methods nc_save_async,dcp_thread --trials 5 --store

On a machine without an accelerator DCP's pinned ``DefaultStager`` (``StagingOptions()``) cannot
be built ("Non-blocking copy requires that the current accelerator is available"): the stager
configurations here are the ones a CPU allows (no pinned memory, no non-blocking copy), named so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
from results_store import environment, metric, write_run  # noqa: E402

METHODS = {
    "torch_save": "torch.save (sync, fsync)",
    "lightning_async": "Lightning AsyncCheckpointIO(TorchCheckpointIO)",
    "dcp_thread": "DCP async_save, thread checkpointer",
    "dcp_thread_stager": "DCP async_save, thread, DefaultStager (CPU: shm, async staging)",
    "dcp_process": "DCP async_save, process checkpointer",
    "dcp_process_stager": "DCP async_save, process, DefaultStager (CPU: shm, async staging)",
    "nc_save": "nc.save (sync)",
    "nc_save_async": "nc.save_async",
    "nc_async_serial": "nc.AsyncSaver(overlap=False)",
    "nc_lightning_async": "NvcompCheckpointIO(async_save=True)",
}


# -- the state ------------------------------------------------------------------------------------
def training_state() -> dict[str, Any]:
    """``moe`` with bf16 weights (as bench_limits.py), and the Python scalars a trainer saves."""
    state = checkpoints.load_cached("moe")
    state["model"] = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state["model"].items()}
    state["step"] = 40
    state["epoch"] = 2
    return state


def mutate(node: Any) -> Any:
    """Change every tensor in place and every Python scalar in its container; returns ``node`` (or,
    for a scalar or a tuple, its changed value)."""
    if isinstance(node, torch.Tensor):
        if node.dtype == torch.bool:
            node.logical_not_()
        else:
            node.add_(1)
        return node
    if isinstance(node, dict):
        for k in list(node):
            node[k] = mutate(node[k])
        return node
    if isinstance(node, list):
        for i in range(len(node)):
            node[i] = mutate(node[i])
        return node
    if isinstance(node, tuple):
        return tuple(mutate(v) for v in node)
    if isinstance(node, bool):
        return not node
    if isinstance(node, (int, float)):
        return node + 1
    return node


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two trees (tensors by their bytes, scalars by value and type)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def restore(live: Any, want: Any) -> Any:
    """Put ``want``'s values back into ``live`` in place (tensors copied, scalars replaced)."""
    if isinstance(live, torch.Tensor):
        live.copy_(want)
        return live
    if isinstance(live, dict):
        for k in live:
            live[k] = restore(live[k], want[k])
        return live
    if isinstance(live, list):
        for i in range(len(live)):
            live[i] = restore(live[i], want[i])
        return live
    return copy.deepcopy(want)


# -- memory ---------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(match.group(1)) if match else 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def _fsync(path: Path) -> None:
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- one method -----------------------------------------------------------------------------------
#: (start the save; returns a callable that waits until it is durable), and the loader.
Method = tuple[Callable[[Any, Path], Callable[[], None]], Callable[[Path, Any], Any]]


def method(name: str, workdir: Path) -> tuple[Method, Callable[[], None]]:
    """The method's save and load, and its teardown."""
    import nvcomp_checkpoint as nc

    def nc_load(path: Path, template: Any) -> Any:
        return nc.load(path, weights_only=True)

    def torch_load(path: Path, template: Any) -> Any:
        return torch.load(path, map_location="cpu", weights_only=True)

    def nothing() -> None:
        return None

    if name == "torch_save":

        def save(state: Any, path: Path) -> Callable[[], None]:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            return nothing

        return (save, torch_load), nothing
    if name == "lightning_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        io = AsyncCheckpointIO(TorchCheckpointIO())

        def save(state: Any, path: Path) -> Callable[[], None]:
            io.save_checkpoint(state, path)

            def done() -> None:
                io.teardown()  # waits for the background torch.save
                _fsync(path)  # Lightning does not fsync; durability is part of the comparison

            return done

        return (save, torch_load), nothing
    if name.startswith("dcp"):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        dist.init_process_group("gloo", init_method=f"file://{workdir / (name + '.pg')}", rank=0, world_size=1)
        kind = AsyncCheckpointerType.PROCESS if "process" in name else AsyncCheckpointerType.THREAD
        # The pinned DefaultStager needs an accelerator; this is the stager a CPU allows.
        stager = DefaultStager(StagingOptions(False, True, True, False)) if name.endswith("stager") else None

        def save(state: Any, path: Path) -> Callable[[], None]:
            shutil.rmtree(path, ignore_errors=True)
            response = dcp.async_save(state, checkpoint_id=str(path), async_checkpointer_type=kind, async_stager=stager)
            if hasattr(response, "staging_completion"):
                response.staging_completion.result()  # the state may change only after staging
                return response.upload_completion.result
            return response.result  # FileSystemWriter fsyncs every file

        def load(path: Path, template: Any) -> Any:
            out = copy.deepcopy(template)
            dcp.load(out, checkpoint_id=str(path))
            return out

        def teardown() -> None:
            if stager is not None:
                stager.close()
            dist.destroy_process_group()

        return (save, load), teardown
    if name == "nc_save":

        def save(state: Any, path: Path) -> Callable[[], None]:
            nc.save(state, path)
            return nothing

        return (save, nc_load), nothing
    if name in ("nc_save_async", "nc_async_serial"):
        saver = nc.AsyncSaver(overlap=False) if name == "nc_async_serial" else None

        def save(state: Any, path: Path) -> Callable[[], None]:
            handle = nc.save_async(state, path) if saver is None else saver.save(state, path)
            return lambda: handle.result() and None

        return (save, nc_load), (saver.close if saver is not None else nothing)
    if name == "nc_lightning_async":
        from nvcomp_checkpoint.lightning import NvcompCheckpointIO

        plugin = NvcompCheckpointIO(async_save=True)

        def save(state: Any, path: Path) -> Callable[[], None]:
            plugin.save_checkpoint(state, path)
            return plugin.wait

        return (save, nc_load), plugin.teardown
    raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def run_one(name: str, trials: int, workdir: Path) -> dict[str, Any]:
    state = training_state()
    pristine = copy.deepcopy(state)
    (save, load), teardown = method(name, workdir)
    path = workdir / f"{name}.ckpt"
    rows = []
    start_rss = _status_kib("VmRSS")
    for trial in range(trials + 1):  # trial 0: warm-up
        restore(state, pristine)
        rss = _status_kib("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        wait = save(state, path)
        t1 = time.perf_counter()
        mutate(state)  # what training does next: the checkpoint must not see it
        tm = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        peak = _status_kib("VmHWM")
        template = copy.deepcopy(state)  # the changed values: a loader that skips a value is caught
        t3 = time.perf_counter()
        loaded = load(path, template)
        t4 = time.perf_counter()
        if trial:
            rows.append(
                {
                    "blocking_s": t1 - t0,
                    "durable_s": t2 - t0,
                    "change_s": tm - t1,
                    "load_s": t4 - t3,
                    "peak_extra_bytes": max(0, peak - rss) * 1024,
                    # Memory the method keeps from one save to the next (staging buffers).
                    "held_bytes": max(0, rss - start_rss) * 1024,
                    "exact": same(loaded, pristine),
                }
            )
        del loaded, template
    teardown()
    return {"method": name, "trials": rows}


# -- driver ---------------------------------------------------------------------------------------
def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in results]
    blocking = [_median([t["blocking_s"] for t in r["trials"]]) for r in results]
    background = [_median([t["durable_s"] - t["blocking_s"] for t in r["trials"]]) for r in results]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=90)
    y = range(len(names))
    ax.barh(y, blocking, color="#c44e52", label="save_blocking (training waits)")
    ax.barh(y, background, left=blocking, color="#8fb3d9", label="after return, until durable")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median of trials)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Blocking window per save, moe state (211 MB of tensors)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one method in this process; JSON on stdout
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--store", action="store_true", help="make this run the stored baseline (benchmarks/results/)")
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown")
    p.add_argument("--plot", type=Path, help="also draw blocking and background time per method (PNG)")
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.trials, args.workdir)), flush=True)
        return 0
    env = environment()
    checkpoints.build_checkpoint("moe")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods.split(","):
            cmd = [sys.executable, __file__, "--one", name, "--trials", str(args.trials), "--workdir", tmp]
            # Freed blocks go back to the system at once, so that the peak RSS of a trial counts
            # what the save allocates even where an earlier trial's memory could be reused.
            child_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(line[len("RESULT ") :]))
            r = results[-1]["trials"]
            print(
                f"{name}: blocking {_median([t['blocking_s'] for t in r]):.3f} s, exact {sum(t['exact'] for t in r)}/{len(r)}, "
                f"load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    head = (
        "method",
        "save_blocking s (min / median)",
        "durable s",
        "state change s",
        "load s",
        "peak extra host MB",
        "held between saves MB",
        "exact trials",
    )
    rows = [head]
    metrics: dict[str, dict[str, Any]] = {}
    for r in results:
        t = r["trials"]
        b = [x["blocking_s"] for x in t]
        exact = sum(x["exact"] for x in t)
        peak = max(x["peak_extra_bytes"] for x in t) / 1e6
        rows.append(
            (
                f"{r['method']}: {METHODS[r['method']]}",
                f"{min(b):.3f} / {_median(b):.3f}",
                f"{_median([x['durable_s'] for x in t]):.3f}",
                f"{_median([x['change_s'] for x in t]):.3f}",
                f"{_median([x['load_s'] for x in t]):.3f}",
                f"{peak:.0f}",
                f"{max(x['held_bytes'] for x in t) / 1e6:.0f}",
                f"{exact}/{len(t)}",
            )
        )
        metrics[f"{r['method']} save_blocking s"] = metric(_median(b), "s", "lower")
        metrics[f"{r['method']} peak extra MB"] = metric(peak, "MB", "lower")
        metrics[f"{r['method']} held MB"] = metric(max(x["held_bytes"] for x in t) / 1e6, "MB", "lower")
        metrics[f"{r['method']} exact share"] = metric(exact / len(t), "share", "exact")
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("---" for _ in head) + "|")
    text = "\n".join(lines)
    print(f"\n{args.trials} trials per method; load average {os.getloadavg()[0]:.2f} at the end\n\n{text}")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.plot and results:
        plot(results, args.plot)
    env.update(trials=args.trials, state="moe, bf16 weights")
    print(f"\nstored {write_run('blocking', metrics, env, store=args.store)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
