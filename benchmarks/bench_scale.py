"""Save and load cost from tens of millions to a billion-plus parameters, per method, fitted against the state size.

Each size is a training state (bf16 weights, fp32 AdamW ``exp_avg``/``exp_avg_sq``, bf16 gradients,
a Llama-shaped layout: hidden 2048, an 8192-token embedding, layers of q/k/v/o, gate_up and down
projections and two norms) tiled from a real trained checkpoint of ``checkpoints.py`` (``moe`` by
default): each component is the real one's stream of values (every trained parameter's elements in
order) repeated, the weight, both moments and the gradient of a parameter taken at the same place.
Local structure (rows, all-zero gradients of experts that got no token) stays as trained, and a
repeat lies a whole real component away (35 MB of bf16 weights, 70 MB of a moment for ``moe``):
beyond every method's reach here (zstd levels 1-3 look back at most 2 MiB; ours compresses 4 MiB
chunks on their own), so no method finds a repeat that a real state would not have. The ratio per
component of ours next to the real checkpoint's shows it.

The state is written once per size to a raw file and memory-mapped (``numpy.memmap`` ->
``torch.from_numpy``): it lives in the page cache, not in the process's anonymous memory, so a
1.2B-parameter state (14.4 GB) is saved by a process whose own memory stays small. "Extra memory"
is the growth of the process's anonymous resident memory (``RssAnon`` of ``/proc/PID/status``,
which leaves out the mapped state and the page cache) during the call, polled every 5 ms by a
separate process; for a load, the bytes of the loaded tensors are subtracted.

Methods: ``nc.save`` / ``nc.load``; ours read tensor by tensor (``CheckpointReader.read_many``,
each dropped: a load whose result does not have to fit in memory); ``torch.save`` + fsync /
``torch.load``; ``torch.save`` then ``zstandard`` level 1 streamed over the file on every core,
fsync / streamed back and ``torch.load``; DCP with its ZStandard extension, one process, no
process group. Loads that hold the whole result run only where it fits under ``--max-anon-gib``.
Each cost is fitted as ``a + b * GB`` of tensor bytes (``numpy.polyfit``).

    python benchmarks/bench_scale.py --sizes 50 200                    # develop: two small sizes
    python benchmarks/bench_scale.py --store --markdown benchmarks/out/scale.md   # the full sweep
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import methods as peers  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from results_store import environment, metric, write_run  # noqa: E402

GB = 1e9
MiB = 1 << 20
#: Layout of the synthetic state (Llama-like): hidden size, MLP width, vocabulary.
HIDDEN, FFN, VOCAB = 2048, 5632, 8192
#: (component, element size) in the order the tensors lie in the state file.
COMPONENTS = (("weight", 2), ("exp_avg", 4), ("exp_avg_sq", 4), ("grad", 2))
#: Bump when the recipe changes, so stale state files are rewritten.
STATE_VERSION = 2

# -- the state: drawn from a real checkpoint, written once, memory-mapped ---------------------------


@dataclass(frozen=True)
class Streams:
    """Each component of a trained checkpoint as one flat stream: every parameter's elements in order.

    bf16 streams are held as int16 (numpy has no bf16). All four have one element per parameter
    element, so one offset names the same element in each.
    """

    weight: np.ndarray
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    grad: np.ndarray
    #: The optimizer's first param group, less its ``params``.
    group: dict[str, Any]


def source_streams(state: dict[str, Any]) -> Streams:
    """The trained parameters of ``state`` (weights as bf16), concatenated per component."""
    model, opt, grads = state["model"], state["optimizer"], state["gradients"]
    parts: dict[str, list[np.ndarray]] = {c: [] for c, _ in COMPONENTS}
    # Optimizer state ids follow model.parameters() order, as the gradients dict does.
    for i, name in enumerate(grads):
        st = opt["state"].get(i)
        if st is None or "exp_avg" not in st:
            continue
        four = {
            "weight": model[name].to(torch.bfloat16),
            "exp_avg": st["exp_avg"],
            "exp_avg_sq": st["exp_avg_sq"],
            "grad": grads[name].to(torch.bfloat16),
        }
        if len({t.shape for t in four.values()}) != 1:
            raise SystemExit(f"source parameter {name!r}: weight, moments and gradient differ in shape")
        for comp, t in four.items():
            t = t.detach().contiguous().reshape(-1)
            parts[comp].append((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())
    group = {k: v for k, v in opt["param_groups"][0].items() if k != "params"}
    return Streams(**{c: np.concatenate(p) for c, p in parts.items()}, group=group)


def layout(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of a ``layers``-layer model."""
    h, f = HIDDEN, FFN
    params: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (h // 2, h)),
            (p + "self_attn.v_proj.weight", (h // 2, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_up_proj.weight", (2 * f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    params.append(("model.norm.weight", (h,)))
    return params


def numel(layers: int) -> int:
    return sum(int(np.prod(s)) for _, s in layout(layers))


def layers_for(params_millions: float) -> int:
    return max(1, round((params_millions * 1e6 - numel(0)) / (numel(1) - numel(0))))


def write_state(path: Path, layers: int, streams: Streams) -> dict[str, Any]:
    """Tile ``streams`` into a ``layers``-layer state in the raw file ``path`` (+ a JSON description).

    Parameter after parameter, each component continues its stream where the last parameter
    stopped, from the start again at its end: the state is the real one's values in the real
    order, repeated with a period of the real state's size.
    """
    params = layout(layers)
    offset = 0
    entries: list[dict[str, Any]] = []
    for comp, size in COMPONENTS:
        for name, shape in params:
            entries.append({"component": comp, "name": name, "shape": list(shape), "offset": offset})
            offset += -(-int(np.prod(shape)) * size // 64) * 64  # 64-byte aligned views
    meta = {"version": STATE_VERSION, "layers": layers, "bytes": offset, "entries": entries, "group": streams.group}
    period = streams.weight.size
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, offset)
        for comp, size in COMPONENTS:
            stream, cursor = getattr(streams, comp), 0
            for e in (e for e in entries if e["component"] == comp):
                at, left = e["offset"], int(np.prod(e["shape"]))
                while left:
                    n = min(left, period - cursor)
                    os.pwrite(fd, stream[cursor : cursor + n].data, at)
                    at, left, cursor = at + n * size, left - n, (cursor + n) % period
    finally:
        os.close(fd)
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps(meta))
    return meta


def map_state(path: Path) -> tuple[dict[str, Any], np.memmap]:
    """The state in ``path`` as a training-state tree of tensors over one copy-on-write file mapping."""
    meta = json.loads(path.with_suffix(".json").read_text())
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    tensors: dict[str, dict[str, torch.Tensor]] = {c: {} for c, _ in COMPONENTS}
    for e in meta["entries"]:
        comp, shape = e["component"], tuple(e["shape"])
        fp32 = comp in ("exp_avg", "exp_avg_sq")
        n = int(np.prod(shape)) * (4 if fp32 else 2)
        view = mm[e["offset"] : e["offset"] + n].view(np.float32 if fp32 else np.int16).reshape(shape)
        t = torch.from_numpy(view)
        tensors[comp][e["name"]] = t if fp32 else t.view(torch.bfloat16)
    names = list(tensors["weight"])
    state = {
        "model": tensors["weight"],
        "optimizer": {
            "state": {
                i: {"step": torch.tensor(40.0), "exp_avg": tensors["exp_avg"][n], "exp_avg_sq": tensors["exp_avg_sq"][n]}
                for i, n in enumerate(names)
            },
            "param_groups": [{**meta["group"], "params": list(range(len(names)))}],
        },
        "gradients": tensors["grad"],
    }
    return state, mm


def flat_tensors(tree: Any) -> dict[str, torch.Tensor]:
    """Every tensor of ``tree`` by its path joined with ``/`` (the keys our reader uses)."""
    out: dict[str, torch.Tensor] = {}
    peers.map_tensors(tree, lambda p, t: out.__setitem__("/".join(p), t))
    return out


def tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(tree).values())


def same_tensors(a: Any, b: Any) -> bool:
    fa, fb = flat_tensors(a), flat_tensors(b)
    return fa.keys() == fb.keys() and all(
        x.dtype == fb[k].dtype and x.shape == fb[k].shape and torch.equal(x, fb[k]) for k, x in fa.items()
    )


# -- memory: a separate process polls this one's anonymous resident memory ----------------------------

_SAMPLER = r"""
import os, select, signal, sys
pid, cap = int(sys.argv[1]), int(sys.argv[2])
def anon():
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0
peak = anon()
while True:
    try:
        now = anon()
    except OSError:
        break
    peak = max(peak, now)
    if now > cap:
        sys.stderr.write(f"bench_scale: anonymous memory {now / 2**30:.2f} GiB over the cap of {cap / 2**30:.2f} GiB: killing the benchmark\n")
        os.kill(pid, signal.SIGKILL)
        break
    if select.select([sys.stdin], [], [], 0.005)[0]:
        if not sys.stdin.readline():
            break
        sys.stdout.write(f"{peak}\n")
        sys.stdout.flush()
        peak = now
"""


class AnonSampler:
    """Peak ``RssAnon`` of this process between two :meth:`mark` calls, polled by a child every 5 ms.

    A child, not a thread: a thread would need the GIL, which the measured call holds for long
    stretches, and would miss the peaks that happen then. The child also kills this process if
    its anonymous memory goes over ``cap`` bytes (the machine is shared).
    """

    def __init__(self, cap: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(os.getpid()), str(cap)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def mark(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("mark\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def anon_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap pages otherwise
    except (OSError, AttributeError):
        pass


@dataclass
class Measured:
    wall: float
    #: User + system CPU seconds of every thread of the process.
    cpu: float
    #: Of which system (kernel) time: page faults, reclaim, copies to and from files.
    sys: float
    #: Minor page faults (fresh pages handed to the process).
    faults: int
    #: Peak growth of anonymous memory during the call, bytes.
    extra: int
    result: Any = field(default=None, repr=False)


def measure(sampler: AnonSampler, fn: Callable[[], Any]) -> Measured:
    _release_freed_memory()
    base = anon_now()
    sampler.mark()
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    result = fn()
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return Measured(wall, user + sys_, sys_, after.ru_minflt - before.ru_minflt, sampler.mark() - base, result)


# -- the methods -----------------------------------------------------------------------------------


def _zstd_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".pt")
    with open(tmp, "wb") as f:
        torch.save(obj, f)  # an intermediate file: only the compressed one must be durable
    threads = len(os.sched_getaffinity(0))
    with open(tmp, "rb") as src, open(path, "wb") as dst:
        zstandard.ZstdCompressor(level=1, threads=threads).copy_stream(src, dst, read_size=4 * MiB, write_size=4 * MiB)
        dst.flush()
        os.fsync(dst.fileno())
    tmp.unlink()


def _zstd_load(path: Path, like: Any) -> Any:
    tmp = path.with_name(path.name + ".pt")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        zstandard.ZstdDecompressor().copy_stream(src, dst, read_size=4 * MiB, write_size=4 * MiB)
    try:
        return torch.load(tmp, map_location="cpu", weights_only=True)
    finally:
        tmp.unlink()


def _ours_read_many(path: Path, like: Any) -> None:
    """Every tensor read, then dropped: a load that holds nothing (checked by :func:`_ours_read_many_exact`)."""
    with nc.open(path) as reader:
        for _key, _t in reader.read_many(reader.keys()):
            pass


def _ours_read_many_exact(path: Path, like: Any) -> bool:
    """:func:`_ours_read_many`, every tensor compared with the state (not timed: the compare reads the state)."""
    want = flat_tensors(like)
    with nc.open(path) as reader:
        return all(torch.equal(t, want[key]) for key, t in reader.read_many(reader.keys()))


@dataclass(frozen=True)
class ScaleMethod:
    name: str
    suffix: str
    save: Callable[[Any, Path], Any]
    #: ``load(path, like)`` -> the loaded tree; None when the method has no load of its own here.
    load: Callable[[Path, Any], Any] | None
    #: The load returns the whole state (needs its bytes of memory).
    holds_result: bool = True


METHODS: dict[str, ScaleMethod] = {
    m.name: m
    for m in (
        ScaleMethod("ours", ".nvc", lambda o, p: nc.save(o, p), lambda p, _l: nc.load(p)),
        ScaleMethod("ours, read_many", ".nvc", lambda o, p: nc.save(o, p), _ours_read_many, holds_result=False),
        ScaleMethod("torch.save", ".pt", peers.METHODS["torch.save"].save, peers.METHODS["torch.save"].load),
        ScaleMethod("torch.save+zstd -1", ".pt.zst", _zstd_save, _zstd_load),
        ScaleMethod("DCP+ZStandard", ".dcp", peers.METHODS["DCP+ZStandard"].save, peers.METHODS["DCP+ZStandard"].load),
    )
}
#: "ours, read_many" reads the file "ours" wrote: one save serves both.
SHARES_SAVE = {"ours, read_many": "ours"}

# -- the sweep ---------------------------------------------------------------------------------------


def component_ratios(path: Path) -> dict[str, float]:
    with nc.open(path) as reader:
        return {c: s.raw_bytes / s.stored_bytes for c, s in reader.summary().items() if s.raw_bytes >= MiB}


def run_size(
    state: Any, raw: int, out_dir: Path, names: list[str], sampler: AnonSampler, max_anon: int, rounds: int
) -> dict[str, dict[str, Any]]:
    """Every method's save and load on one state, ``rounds`` interleaved rounds, best wall time kept."""
    res: dict[str, dict[str, Any]] = {n: {} for n in names}
    for r in range(rounds):
        for name in names:
            m = METHODS[name]
            this_round: dict[str, Measured] = {}
            path = out_dir / f"scale{m.suffix}"
            row = res[name]
            saver = SHARES_SAVE.get(name)
            if saver is None or saver not in names:
                peers.remove_output(path)
                got = this_round["save"] = measure(sampler, lambda: m.save(state, path))
                if "save" not in row or got.wall < row["save"].wall:
                    row["save"] = got
                row["stored"] = peers.dir_bytes(path)
                if name == "ours":
                    row["components"] = component_ratios(path)
            elif not path.exists():
                raise SystemExit(f"{name} reads the file {saver!r} wrote, which is missing: keep {saver!r} before it")
            if m.load is not None and (not m.holds_result or anon_now() + raw + (512 << 20) <= max_anon):
                got = this_round["load"] = measure(sampler, lambda: m.load(path, state))
                if m.holds_result:
                    got.extra -= raw
                    exact = same_tensors(got.result, state)
                else:
                    exact = _ours_read_many_exact(path, state)
                got.result = None
                row["exact"] = row.get("exact", True) and exact
                if "load" not in row or got.wall < row["load"].wall:
                    row["load"] = got
            elif m.load is not None:
                row["load_skipped"] = (
                    f"the result ({raw / 2**30:.1f} GiB), what the process holds and 0.5 GiB do not fit under "
                    f"--max-anon-gib={max_anon / 2**30:g}"
                )
            _release_freed_memory()
            if not any(SHARES_SAVE.get(later) == name for later in names[names.index(name) + 1 :]):
                peers.remove_output(path)
            said = [f"  round {r + 1}: {name}:"]
            said += [
                f"{op} {x.wall:.2f} s ({x.cpu:.2f} CPU s, {x.sys:.2f} sys, {x.faults} faults)" for op, x in this_round.items()
            ]
            print(*said, f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for name in names:
        saver = SHARES_SAVE.get(name)
        if saver in res:
            res[name]["stored"] = res[saver]["stored"]
    return res


def fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of ``y = a + b * x``; None with fewer than two points."""
    if len(xs) < 2:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[50, 200, 400, 600, 1200], help="millions of parameters")
    p.add_argument("--source", default="moe", choices=sorted(checkpoints.CHECKPOINTS), help="the trained checkpoint drawn from")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--rounds", type=int, default=2, help="rounds for states under --once-above GB (best kept)")
    p.add_argument("--once-above", type=float, default=3.0, help="states this many GB or larger run one round")
    p.add_argument("--max-anon-gib", type=float, default=8.0, help="cap on this process's anonymous memory")
    p.add_argument("--dir", type=Path, default=checkpoints.OUT_DIR / "scale", help="state files and outputs")
    p.add_argument("--keep-state", action="store_true", help="keep each size's state file for the next run")
    p.add_argument("--store", action="store_true", help="make this run the stored baseline (benchmarks/results/)")
    p.add_argument("--markdown", type=Path, help="also write the tables as Markdown")
    args = p.parse_args(argv)
    # DCP says once per call that it saves and loads in one process: it does, on purpose.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = time.perf_counter()
    env = environment()
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    max_anon = int(args.max_anon_gib * 2**30)
    args.dir.mkdir(parents=True, exist_ok=True)
    sampler = AnonSampler(max_anon)

    source_state = checkpoints.load_cached(args.source)
    real = args.dir / "source.nvc"
    nc.save({**source_state, "model": {k: v.to(torch.bfloat16) for k, v in source_state["model"].items()}}, real)
    real_ratios = component_ratios(real)
    real.unlink()
    del source_state

    sizes: list[dict[str, Any]] = []
    for millions in args.sizes:
        layers = layers_for(millions)
        state_path = args.dir / f"state-{args.source}-{layers}L.v{STATE_VERSION}.bin"
        if not (state_path.exists() and state_path.with_suffix(".json").exists()):
            need = numel(layers) * 12
            # The state, plus the largest output and torch.save's intermediate file beside it.
            if disk_free(args.dir) < 2.6 * need + 4 * GB:
                print(f"{millions:g}M: {need / GB:.1f} GB of state does not fit on the disk with its outputs: stopping")
                break
            t = time.perf_counter()
            # Built per size and dropped: the loads at the largest sizes need every byte under the cap.
            write_state(state_path, layers, source_streams(checkpoints.load_cached(args.source)))
            print(f"wrote {state_path.name} in {time.perf_counter() - t:.1f} s", flush=True)
        state, mm = map_state(state_path)
        raw = tensor_bytes(state)
        params = sum(t.numel() for t in state["model"].values())
        rounds = 1 if raw >= args.once_above * GB else args.rounds
        print(f"{params / 1e6:.0f}M parameters ({layers} layers), {raw / GB:.2f} GB of tensors, {rounds} round(s)", flush=True)
        res = run_size(state, raw, args.dir, args.methods, sampler, max_anon, rounds)
        sizes.append({"params": params, "gb": raw / GB, "layers": layers, "results": res})
        del state, mm
        _release_freed_memory()
        if not args.keep_state:
            state_path.unlink()
            state_path.with_suffix(".json").unlink()
    sampler.close()
    elapsed = time.perf_counter() - started

    # -- tables, fits, the stored run -------------------------------------------------------------
    lines = [
        "| parameters | GB | method | save wall s | save CPU s (sys) | save extra MB | load wall s | load CPU s (sys) "
        "| load extra MB (beyond the result) | ratio | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    metrics: dict[str, dict[str, Any]] = {}
    for s in sizes:
        tag = f"{s['params'] / 1e6:.0f}M"
        for name, row in s["results"].items():
            sv, ld = row.get("save"), row.get("load")
            cells = [tag, f"{s['gb']:.2f}", name]
            cells += [f"{sv.wall:.2f}", f"{sv.cpu:.2f} ({sv.sys:.2f})", f"{sv.extra / 1e6:.0f}"] if sv else ["(as ours)", "", ""]
            cells += [f"{ld.wall:.2f}", f"{ld.cpu:.2f} ({ld.sys:.2f})", f"{ld.extra / 1e6:.0f}"] if ld else ["skipped", "", ""]
            cells += [f"{s['gb'] * GB / row['stored']:.4f}", "yes" if row.get("exact") else ("-" if not ld else "NO")]
            lines.append("| " + " | ".join(cells) + " |")
            if sv:
                metrics[f"{name} save s @{tag}"] = metric(sv.wall, "s", "lower")
                metrics[f"{name} save CPU s @{tag}"] = metric(sv.cpu, "s", "lower")
                metrics[f"{name} save sys CPU s @{tag}"] = metric(sv.sys, "s", "lower")
                metrics[f"{name} save extra MB @{tag}"] = metric(sv.extra / 1e6, "MB", "lower")
                metrics[f"{name} ratio @{tag}"] = metric(s["gb"] * GB / row["stored"], "x", "exact")
            if ld:
                metrics[f"{name} load s @{tag}"] = metric(ld.wall, "s", "lower")
                metrics[f"{name} load CPU s @{tag}"] = metric(ld.cpu, "s", "lower")
                metrics[f"{name} load sys CPU s @{tag}"] = metric(ld.sys, "s", "lower")
                metrics[f"{name} load extra MB @{tag}"] = metric(ld.extra / 1e6, "MB", "lower")
                metrics[f"{name} load exact @{tag}"] = metric(float(row.get("exact", False)), "bool", "exact")
    lines += [
        "",
        "Fitted: cost = a + b * GB of tensors (`numpy.polyfit`, degree 1), over the sizes each ran at.",
        "",
        "| method | save wall s | save CPU s | save extra MB | load wall s | load CPU s | load extra MB | sizes fitted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.methods:
        cells, fitted = [name], set()
        for op, attr, unit, scale in (
            ("save", "wall", "s", 1.0),
            ("save", "cpu", "CPU s", 1.0),
            ("save", "extra", "extra MB", 1e-6),
            ("load", "wall", "s", 1.0),
            ("load", "cpu", "CPU s", 1.0),
            ("load", "extra", "extra MB", 1e-6),
        ):
            pts = [(s["gb"], getattr(s["results"][name][op], attr) * scale) for s in sizes if op in s["results"][name]]
            got = fit([x for x, _ in pts], [y for _, y in pts])
            if got is None:
                cells.append("-")
                continue
            a, b = got
            cells.append(f"{a:.2f} + {b:.2f} * GB" if scale == 1.0 else f"{a:.0f} + {b:.1f} * GB")
            fitted.add(f"{op}: {len(pts)} ({pts[0][0]:.1f}-{pts[-1][0]:.1f} GB)")
            metrics[f"{name} {op} {unit} per GB (fit)"] = metric(b, f"{unit}/GB", "lower")
        lines.append("| " + " | ".join(cells) + " | " + "; ".join(sorted(fitted)) + " |")
    if sizes:
        comps = list(real_ratios)
        lines += ["", "| ours, ratio per component | " + " | ".join(comps) + " |", "|---|" + "---|" * len(comps)]
        lines.append(
            f"| the real `{args.source}` checkpoint (bf16 weights) | " + " | ".join(f"{real_ratios[c]:.4f}" for c in comps) + " |"
        )
        for s in sizes:
            got = s["results"].get("ours", {}).get("components")
            if got:
                lines.append(
                    f"| tiled, {s['params'] / 1e6:.0f}M | "
                    + " | ".join(f"{got[c]:.4f}" if c in got else "-" for c in comps)
                    + " |"
                )
    skipped = {
        f"{s['params'] / 1e6:.0f}M {n}: {r['load_skipped']}"
        for s in sizes
        for n, r in s["results"].items()
        if "load_skipped" in r
    }
    end_load = os.getloadavg()[0]
    lines += ["", f"load average {env['loadavg'][0]:.2f} -> {end_load:.2f}; {elapsed / 60:.1f} min in all"]
    lines += [f"load skipped: {s}" for s in sorted(skipped)]
    text = "\n".join(lines)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    env.update(
        source=args.source,
        sizes=[{"params": s["params"], "gb": s["gb"], "layers": s["layers"]} for s in sizes],
        methods=args.methods,
        elapsed_s=elapsed,
        max_anon_gib=args.max_anon_gib,
    )
    print(f"\nstored {write_run('scale', metrics, env, store=args.store)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
