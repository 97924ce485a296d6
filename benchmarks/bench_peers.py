"""nvcomp-checkpoint against the peer coders, on the same training states, in one run.

Peers: ZipNN (Huffman on byte groups, its exponent byte cleaned by a bit rotation), OpenZL (its
byte-plane graph, a struct transpose then its generic ``Compress`` graph, and its float graph,
``Float32Deconstruct`` / ``BFloat16Deconstruct`` then ``Compress``), blosc2 (shuffle, bitshuffle
and shuffle+bytedelta, each with zstd at clevel 1 and 5), safetensors + zstd -1 and torch.save +
zstd -1. Every method's ratio is given per component (bf16 weights, fp32 AdamW moments, bf16
gradients) and for the whole file; save and load are timed in wall seconds and in CPU seconds of
this process and its children (the ``zstd`` tool), min and median of ``--repeat`` rounds in which
the methods take turns (A B C ... A B C ...), so that each sees the same load; every load is
checked bit for bit against the saved state. The load average is printed at the start and end of
each checkpoint, and the targets of issue 32 that these methods decide are checked at the end:
our default's load faster than every compressed peer's, and ``max_ratio()`` at or above the
best-of-peers combination.

The peers are optional (``pip install 'nvcomp-checkpoint[bench]'``); a peer that does not import
is named and skipped. Run ``python benchmarks/bench_peers.py``; ``--max-mb`` keeps a subset of
the parameters (the same ones in weights, moments and gradients) so that a run stays short. Each
run is stored with its commit, machine and load (``results_store``; ``--store`` makes it the
baseline that ``compare.py`` compares later runs with).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402  (benchmarks/ is not a package)
import nvcomp_checkpoint as nc  # noqa: E402
from methods import map_tensors  # noqa: E402
from nvcomp_checkpoint import delta as delta_module  # noqa: E402
from nvcomp_checkpoint.filters import byteplane  # noqa: E402
from nvcomp_checkpoint.report import format_table  # noqa: E402
from results_store import environment, metric, write_run  # noqa: E402

__all__ = ["main", "subset_state", "PEER_METHODS"]

COMPONENTS = ("weights", "exp_avg", "exp_avg_sq", "gradients")
#: Peers compress floating tensors at least this large (as our policy's min_compress_bytes).
MIN_BYTES = 2048
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_THREADS = os.cpu_count() or 1


# -- the states -------------------------------------------------------------------------------
def subset_state(state: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """``state`` with every k-th parameter kept (weights, optimizer state and gradient alike).

    A parameter is kept in full or not at all, so every kept tensor is a real trained tensor;
    k is the smallest step that brings the tensor bytes under ``max_bytes``.
    """
    model, opt, grads = state["model"], state["optimizer"], state["gradients"]
    params = [k for k, v in model.items() if v.is_floating_point()]
    indices = [i for g in opt["param_groups"] for i in g["params"]]
    if indices != list(range(len(params))):
        raise ValueError(f"{len(params)} float model tensors but optimizer indices {indices[:3]}...: cannot pair them")

    def size(keep: list[int]) -> int:
        total = 0
        for i in keep:
            total += model[params[i]].nbytes + sum(
                t.nbytes for t in opt["state"].get(i, {}).values() if isinstance(t, torch.Tensor)
            )
            total += grads[params[i]].nbytes if params[i] in grads else 0
        return total

    step = 1
    while size(list(range(0, len(params), step))) > max_bytes and step < len(params):
        step += 1
    keep = list(range(0, len(params), step))
    kept = {params[i] for i in keep}
    # Parameter 0 is always kept: on dense it is the word-embedding table, 140.6 MB with its moments
    # and gradient, so any --max-mb under that keeps it alone.
    print(f"subset: every {step}th parameter, {len(keep)} of {len(params)} ({size(keep) / 1e6:.1f} MB)", flush=True)
    return {
        "model": {k: v for k, v in model.items() if k in kept or not v.is_floating_point()},
        "optimizer": {
            "state": {i: opt["state"][i] for i in keep if i in opt["state"]},
            "param_groups": [{**g, "params": [i for i in g["params"] if i in set(keep)]} for g in opt["param_groups"]],
        },
        "gradients": {k: v for k, v in grads.items() if k in kept},
    }


def tensor_bytes_by_component(state: Any) -> dict[str, int]:
    out: dict[str, int] = {}

    def add(p: tuple[str, ...], t: torch.Tensor) -> None:
        if t.dtype in _FLOATS and t.nbytes >= MIN_BYTES:
            comp = nc.classify(p).value
            out[comp] = out.get(comp, 0) + t.nbytes

    map_tensors(state, add)
    return out


def all_tensor_bytes(state: Any) -> int:
    total = 0

    def add(_p: tuple[str, ...], t: torch.Tensor) -> None:
        nonlocal total
        total += t.nbytes

    map_tensors(state, add)
    return total


def identical(a: Any, b: Any, where: str) -> None:
    """Raise unless every tensor of ``a`` is in ``b`` at the same path with the same bytes."""

    def check(p: tuple[str, ...], t: torch.Tensor) -> None:
        node = b
        for k in p:
            node = node[int(k)] if isinstance(node, (list, tuple)) else node[k if k in node else int(k)]
        same = isinstance(node, torch.Tensor) and node.dtype == t.dtype and node.shape == t.shape
        if not same or not torch.equal(node.contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)):
            raise AssertionError(f"{where}: tensor {'/'.join(p)} did not round-trip bit for bit")

    map_tensors(a, check)


# -- the container for per-tensor peers -------------------------------------------------------
def _fsync_write(path: Path, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def per_tensor_save(encode: Callable[[torch.Tensor], bytes]) -> Callable[[Any, Path], dict[str, int]]:
    """A save that compresses every float tensor with ``encode`` (on a thread per core) into a
    uint8 tensor of a torch.save tree; returns the compressed bytes per component."""

    def save(obj: Any, path: Path) -> dict[str, int]:
        jobs: list[tuple[tuple[str, ...], torch.Tensor]] = []
        map_tensors(obj, lambda p, t: jobs.append((p, t)) if t.dtype in _FLOATS and t.nbytes >= MIN_BYTES else None)
        with ThreadPoolExecutor(_THREADS) as pool:
            encoded = dict(zip((p for p, _ in jobs), pool.map(lambda j: encode(j[1]), jobs)))
        sizes: dict[str, int] = {}

        def swap(p: tuple[str, ...], t: torch.Tensor) -> Any:
            data = encoded.get(p)
            if data is None:
                return t
            comp = nc.classify(p).value
            sizes[comp] = sizes.get(comp, 0) + len(data)
            # In a uint8 tensor: pickled `bytes` would grow ~1.5x.
            return {
                "__peer__": torch.frombuffer(bytearray(data), dtype=torch.uint8),
                "dtype": str(t.dtype),
                "shape": list(t.shape),
            }

        tree = map_tensors(obj, swap)
        _fsync_write(path, lambda f: torch.save(tree, f))
        return sizes

    save.encode = encode  # type: ignore[attr-defined]  # the peer's coder, for --delta
    return save


def per_tensor_load(decode: Callable[[bytes, torch.dtype, list[int]], torch.Tensor]) -> Callable[[Path], Any]:
    def load(path: Path) -> Any:
        tree = torch.load(path, map_location="cpu", weights_only=True)
        found: list[dict[str, Any]] = []

        def collect(node: Any) -> None:
            if isinstance(node, dict):
                if "__peer__" in node:
                    found.append(node)
                    return
                for v in node.values():
                    collect(v)
            elif isinstance(node, (list, tuple)):
                for v in node:
                    collect(v)

        collect(tree)
        with ThreadPoolExecutor(_THREADS) as pool:
            out = list(
                pool.map(
                    lambda n: decode(n["__peer__"].numpy().tobytes(), getattr(torch, n["dtype"].split(".")[-1]), n["shape"]),
                    found,
                )
            )
        by_id = {id(n): t for n, t in zip(found, out)}

        def rebuild(node: Any) -> Any:
            if isinstance(node, dict):
                if "__peer__" in node:
                    return by_id[id(node)]
                return {k: rebuild(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return type(node)(rebuild(v) for v in node)
            return node

        return rebuild(tree)

    return load


def _uint_view(t: torch.Tensor) -> np.ndarray:
    return (
        t.detach()
        .contiguous()
        .view(-1)
        .view({2: torch.int16, 4: torch.int32}[t.element_size()])
        .numpy()
        .view({2: np.uint16, 4: np.uint32}[t.element_size()])
    )


def _from_bytes(data: bytes | np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    buf = bytearray(data) if not isinstance(data, np.ndarray) else bytearray(data.tobytes())
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


# -- ZipNN ------------------------------------------------------------------------------------
def zipnn_method() -> tuple[Callable[[Any, Path], dict[str, int]], Callable[[Path], Any]]:
    from zipnn import ZipNN

    def encode(t: torch.Tensor) -> bytes:
        # ZipNN 0.5.4 rotates the bits of its input in place: it gets a copy (timed with it).
        return bytes(ZipNN(input_format="torch", threads=1).compress(t.detach().clone().contiguous()))

    def decode(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return ZipNN(input_format="torch", threads=1).decompress(data).view(dtype).reshape(shape)

    return per_tensor_save(encode), per_tensor_load(decode)


# -- OpenZL -----------------------------------------------------------------------------------
def openzl_method(graph: str) -> tuple[Callable[[Any, Path], dict[str, int]], Callable[[Path], Any]]:
    """``graph``: "byteplane" (struct transpose, then Compress per plane) or "float" (exponent
    split from sign+fraction, then Compress on each)."""
    import openzl.ext as zl

    class Planes(zl.FunctionGraph):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.width = width

        def function_graph_description(self) -> Any:
            return zl.FunctionGraphDescription(name=f"nvckpt_bench_{graph}_{self.width}", input_type_masks=[zl.TypeMask.Numeric])

        def graph(self, state: Any) -> None:
            edge = state.edges[0]
            if graph == "byteplane":
                outs = zl.nodes.TransposeSplit().run(zl.nodes.ConvertNumToStructLE().run(edge)[0])
            elif self.width == 4:
                outs = zl.nodes.Float32Deconstruct().run(edge)
            else:
                outs = zl.nodes.BFloat16Deconstruct().run(edge)
            for out in outs:
                zl.graphs.Compress().set_destination(out)

    compressors: dict[int, Any] = {}
    for width in (2, 4):
        comp = zl.Compressor()
        comp.select_starting_graph(comp.register_function_graph(Planes(width)))
        compressors[width] = comp

    def encode(t: torch.Tensor) -> bytes:
        if t.dtype == torch.float16 and graph == "float":
            raise ValueError("no float16 graph used here")
        cctx = zl.CCtx()
        cctx.ref_compressor(compressors[t.element_size()])
        cctx.set_parameter(zl.CParam.FormatVersion, zl.MAX_FORMAT_VERSION)
        return cctx.compress([zl.Input(zl.Type.Numeric, _uint_view(t))])

    def decode(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return _from_bytes(zl.DCtx().decompress(data)[0].content.as_nparray(), dtype, shape)

    return per_tensor_save(encode), per_tensor_load(decode)


# -- blosc2 -----------------------------------------------------------------------------------
def blosc2_method(filt: str, clevel: int) -> tuple[Callable[[Any, Path], dict[str, int]], Callable[[Path], Any]]:
    import blosc2

    filters = {
        "shuffle": [blosc2.Filter.SHUFFLE],
        "bitshuffle": [blosc2.Filter.BITSHUFFLE],
        "bytedelta": [blosc2.Filter.SHUFFLE, blosc2.Filter.BYTEDELTA],
    }[filt]

    def encode(t: torch.Tensor) -> bytes:
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        cparams = {"codec": blosc2.Codec.ZSTD, "clevel": clevel, "typesize": t.element_size(), "filters": filters, "nthreads": 1}
        return blosc2.SChunk(chunksize=4 << 20, data=data, cparams=cparams).to_cframe()

    def decode(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return _from_bytes(blosc2.schunk_from_cframe(data)[:], dtype, shape)

    return per_tensor_save(encode), per_tensor_load(decode)


# -- file formats + the zstd command-line tool ------------------------------------------------
def _zstd_file(raw: Path, out: Path) -> None:
    subprocess.run(["zstd", "-q", "-f", "-T0", "-1", str(raw), "-o", str(out)], check=True)
    with open(out, "rb+") as f:
        os.fsync(f.fileno())
    raw.unlink()


def _unzstd_file(path: Path) -> Path:
    raw = path.with_name(path.name + ".raw")
    subprocess.run(["zstd", "-q", "-f", "-d", str(path), "-o", str(raw)], check=True)
    return raw


def torch_zstd_method() -> tuple[Callable[[Any, Path], None], Callable[[Path], Any]]:
    def save(obj: Any, path: Path) -> None:
        raw = path.with_name(path.name + ".raw")
        with open(raw, "wb") as f:
            torch.save(obj, f)
        _zstd_file(raw, path)

    def load(path: Path) -> Any:
        raw = _unzstd_file(path)
        try:
            return torch.load(raw, map_location="cpu", weights_only=True)
        finally:
            raw.unlink()

    return save, load


def safetensors_zstd_method() -> tuple[Callable[[Any, Path], None], Callable[[Path], Any]]:
    from safetensors.torch import load_file, save_file

    def flat(obj: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        map_tensors(obj, lambda p, t: out.__setitem__("/".join(p), t.contiguous()))
        return out

    def save(obj: Any, path: Path) -> None:
        raw = path.with_name(path.name + ".raw")
        save_file(flat(obj), str(raw))  # tensors only: what safetensors stores
        _zstd_file(raw, path)

    def load(path: Path) -> Any:
        raw = _unzstd_file(path)
        try:
            tensors = load_file(str(raw))
        finally:
            raw.unlink()
        return _unflatten(tensors)

    return save, load


def _unflatten(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for key, t in flat.items():
        node = root
        parts = key.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = t
    return _int_keys(root)


def _int_keys(node: Any) -> Any:
    # optimizer state is keyed by int; safetensors keys are str.
    if isinstance(node, dict):
        return {(int(k) if k.isdigit() else k): _int_keys(v) for k, v in node.items()}
    return node


# -- ours -------------------------------------------------------------------------------------
def ours_method(policy: Any, numpy_planes: bool = False) -> tuple[Callable[[Any, Path], dict[str, int]], Callable[[Path], Any]]:
    """Our save and load; ``numpy_planes`` runs them with the numpy split/join where the compiled
    one is built, so that both are measured in the same run (the same bytes either way)."""

    def save(obj: Any, path: Path) -> dict[str, int]:
        with _planes_kernel(numpy_planes):
            nc.save(obj, path, policy=policy)
        with nc.open(path) as reader:
            return {name: s.stored_bytes for name, s in reader.summary().items()}

    def load(path: Path) -> Any:
        with _planes_kernel(numpy_planes):
            return nc.load(path)

    return save, load


@contextlib.contextmanager
def _planes_kernel(numpy_planes: bool) -> Iterator[None]:
    # The byte-plane filter holds the compiled module in one global (None: numpy); the environment
    # switch (byteplane.PURE_PYTHON_ENV) is read once at import, too late for a per-call choice.
    if not numpy_planes:
        yield
        return
    held = byteplane._planes
    byteplane._planes = None
    try:
        yield
    finally:
        byteplane._planes = held


@dataclass
class Peer:
    name: str
    build: Callable[[], tuple[Callable[[Any, Path], Any], Callable[[Path], Any]]]
    needs: str = ""


#: Our policies measured: the default, max_ratio, and the filters one might make the default.
OUR_POLICIES: dict[str, Callable[[], Any]] = {
    "ours (default)": lambda: None,
    "ours (max_ratio)": lambda: nc.CodecPolicy.max_ratio(),
    "ours (byteplane)": lambda: nc.CodecPolicy.uniform("zstd:1:byteplane"),
    "ours (rotplane)": lambda: nc.CodecPolicy.uniform("zstd:1:rotplane"),
}


def _peers() -> list[Peer]:
    peers = [
        Peer(name, lambda p=policy: ours_method(p()), "max_ratio" if "max_ratio" in name else "")
        for name, policy in OUR_POLICIES.items()
    ]
    if getattr(byteplane, "KERNELS", "numpy") == "compiled":
        peers.append(Peer("ours (default, numpy planes)", lambda: ours_method(None, numpy_planes=True)))
    peers += [
        Peer("torch.save+zstd -1", torch_zstd_method, "zstd"),
        Peer("safetensors+zstd -1", safetensors_zstd_method, "safetensors"),
        Peer("ZipNN", zipnn_method, "zipnn"),
        Peer("OpenZL byte-plane", lambda: openzl_method("byteplane"), "openzl"),
        Peer("OpenZL float", lambda: openzl_method("float"), "openzl"),
    ]
    for filt in ("shuffle", "bitshuffle", "bytedelta"):
        for clevel in (1, 5):
            peers.append(Peer(f"blosc2 {filt}+zstd-{clevel}", lambda f=filt, c=clevel: blosc2_method(f, c), "blosc2"))
    return peers


PEER_METHODS = [p.name for p in _peers()]


# -- the run ----------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """CPU seconds of this process (all its threads) and of its waited-for children (``zstd``)."""
    # process_time() reads the process clock to the nanosecond; os.times() counts in clock ticks
    # (10 ms here, 5-10% of a load), so it is used only for the children.
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


#: The distributions whose versions decide the numbers, printed and stored with each run.
VERSIONS = ("torch", "numpy", "zstandard", "zipnn", "openzl", "blosc2", "safetensors", "nvcomp-checkpoint")


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in VERSIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["zstd tool"] = (
        subprocess.run(["zstd", "--version"], capture_output=True, text=True).stdout.split(" v")[-1].split(",")[0].strip()
        if shutil.which("zstd")
        else "not installed"
    )
    out["byte planes"] = getattr(byteplane, "KERNELS", "numpy")  # which split/join "ours (default)" runs
    return out


def _available(peer: Peer) -> bool:
    if peer.needs == "max_ratio" and not hasattr(nc.CodecPolicy, "max_ratio"):
        print(f"skipped {peer.name}: this nvcomp_checkpoint has no CodecPolicy.max_ratio", flush=True)
        return False
    if peer.needs and peer.needs not in ("zstd", "max_ratio"):
        try:
            __import__(peer.needs)
        except ImportError:
            print(f"skipped {peer.name}: {peer.needs} does not import (pip install 'nvcomp-checkpoint[bench]')", flush=True)
            return False
    if peer.needs == "zstd" and shutil.which("zstd") is None:
        print(f"skipped {peer.name}: no zstd command-line tool", flush=True)
        return False
    return True


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    out = fn()
    return out, time.perf_counter() - wall, cpu_seconds() - cpu


def measure_all(
    peers: list[Peer], state: Any, workdir: Path, repeat: int, label: str, once: frozenset[str] = frozenset()
) -> dict[str, dict[str, Any]]:
    """Every peer's save and load, ``repeat`` rounds, the peers taking turns within each round
    (each round starts one peer later, so no peer always follows the same one); the peers named
    in ``once`` run in the first round only."""
    built = {p.name: p.build() for p in peers}
    samples: dict[str, dict[str, list[float]]] = {p.name: {"save": [], "save_cpu": [], "load": [], "load_cpu": []} for p in peers}
    exact = dict.fromkeys(built, 0)
    results: dict[str, dict[str, Any]] = {}
    for r in range(repeat):
        order = peers[r % len(peers) :] + peers[: r % len(peers)]
        for peer in order:
            if r and peer.name in once:
                continue
            save, load = built[peer.name]
            path = workdir / (peer.name.replace(" ", "_").replace("/", "_") + ".bin")
            for leftover in workdir.glob(path.name + "*"):
                leftover.unlink()
            out, wall, cpu = _timed(lambda: save(state, path))
            s = samples[peer.name]
            s["save"].append(wall)
            s["save_cpu"].append(cpu)
            back, wall, cpu = _timed(lambda: load(path))
            s["load"].append(wall)
            s["load_cpu"].append(cpu)
            try:
                identical(state, back, peer.name)
                exact[peer.name] += 1
            except AssertionError as e:
                print(f"  {label}: NOT BIT-EXACT: {e}", flush=True)
            del back
            results[peer.name] = {"file_bytes": path.stat().st_size, "components": out if isinstance(out, dict) else None}
            path.unlink()
            print(
                f"  {label} round {r + 1}: {peer.name}: save {s['save'][-1]:.2f}s ({s['save_cpu'][-1]:.2f} CPU-s)  "
                f"load {s['load'][-1]:.2f}s ({s['load_cpu'][-1]:.2f} CPU-s)",
                flush=True,
            )
    for name, res in results.items():
        for key, values in samples[name].items():
            res[f"{key}_s"] = min(values)
            res[f"{key}_s_median"] = statistics.median(values)
            res[f"{key}_s_all"] = values
        res["exact"] = exact[name]
        res["rounds"] = len(samples[name]["load"])
    return results


def run(name: str, max_mb: float, repeat: int, only: list[str] | None, once: frozenset[str] = frozenset()) -> dict[str, Any]:
    state = checkpoints.load_pair(name)["later"]
    if max_mb:
        state = subset_state(state, int(max_mb * 1e6))
    raw_by_comp = tensor_bytes_by_component(state)
    total = all_tensor_bytes(state)
    results: dict[str, Any] = {"checkpoint": name, "tensor_bytes": total, "raw_by_component": raw_by_comp, "repeat": repeat}
    peers = [p for p in _peers() if (not only or p.name in only) and _available(p)]
    results["loadavg_start"] = loadavg()
    print(f"{name}: load average at start {results['loadavg_start']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nvckpt-peers-", dir=os.environ.get("BENCH_DIR")) as tmp:
        results["methods"] = measure_all(peers, state, Path(tmp), repeat, name, once)
    results["loadavg_end"] = loadavg()
    print(f"{name}: load average at end {results['loadavg_end']}", flush=True)
    return results


# -- deltas (--delta) ---------------------------------------------------------------------------
def _delta_forms(t: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    """``t`` plain, XORed with ``b`` and their wrapping integer difference, as bit patterns of ``t``'s dtype."""
    word = {2: torch.int16, 4: torch.int32}[t.element_size()]
    x, y = t.detach().contiguous().view(word), b.detach().contiguous().view(word)
    return [t, torch.bitwise_xor(x, y).view(t.dtype), (x - y).view(t.dtype)]  # the difference wraps


def _by_path(state: Any) -> dict[tuple[str, ...], torch.Tensor]:
    out: dict[tuple[str, ...], torch.Tensor] = {}
    map_tensors(state, lambda p, t: out.__setitem__(p, t))
    return out


def peer_delta(encode: Callable[[torch.Tensor], bytes], later: Any, base: Any) -> dict[str, int]:
    """Stored bytes per component of ``later`` when each float tensor keeps the smallest of its plain,
    XORed and subtracted forms (against the same tensor of ``base``) under the peer's coder; "_rest"
    counts the other tensors' bytes, raw."""
    base_of = _by_path(base)
    jobs: list[tuple[tuple[str, ...], torch.Tensor]] = []
    sizes: dict[str, int] = {"_rest": 0}

    def add(p: tuple[str, ...], t: torch.Tensor) -> None:
        if t.dtype in _FLOATS and t.nbytes >= MIN_BYTES:
            jobs.append((p, t))
        else:
            sizes["_rest"] += t.nbytes

    map_tensors(later, add)

    def smallest(job: tuple[tuple[str, ...], torch.Tensor]) -> int:
        p, t = job
        b = base_of.get(p)
        forms = _delta_forms(t, b) if b is not None and b.dtype == t.dtype and b.shape == t.shape else [t]
        return min(len(encode(f)) for f in forms)

    with ThreadPoolExecutor(_THREADS) as pool:
        for (p, _), size in zip(jobs, pool.map(smallest, jobs)):
            comp = nc.classify(p).value
            sizes[comp] = sizes.get(comp, 0) + size
    return sizes


def run_delta(name: str, max_mb: float, repeat: int, only: list[str] | None) -> dict[str, Any]:
    """Deltas of the pair's later state against its base (40 steps earlier): ours written by
    ``save(base=)`` and loaded back, each per-tensor peer as the smallest of plain / XOR /
    difference per tensor (sizes only: no peer has a delta file)."""
    pair = checkpoints.load_pair(name)
    later, base = pair["later"], pair["base"]
    if max_mb:
        later, base = subset_state(later, int(max_mb * 1e6)), subset_state(base, int(max_mb * 1e6))
    total = all_tensor_bytes(later)
    results: dict[str, Any] = {"checkpoint": name, "tensor_bytes": total, "raw_by_component": tensor_bytes_by_component(later)}
    methods: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nvckpt-peers-", dir=os.environ.get("BENCH_DIR")) as tmp:
        work = Path(tmp)
        ours = [(label, make, False) for label, make in OUR_POLICIES.items()]
        ours.append(("ours (default), every component, every op", OUR_POLICIES["ours (default)"], True))
        for label, make, every in ours:
            if only and label not in only:
                continue
            policy = make()
            if every:
                # The writer's choice per plane among plain / XOR / difference, tried on every
                # component (delta.XOR_COMPONENTS and SUB_COMPONENTS name the ones it tries).
                tried = delta_module.XOR_COMPONENTS, delta_module.SUB_COMPONENTS
                delta_module.XOR_COMPONENTS = delta_module.SUB_COMPONENTS = frozenset(c.value for c in nc.Component)
            nc.save(base, work / "base.nvc", policy=policy)
            fulls, deltas = [], []
            for _ in range(repeat):
                start = time.perf_counter()
                nc.save(later, work / "full.nvc", policy=policy)
                fulls.append(time.perf_counter() - start)
                start = time.perf_counter()
                nc.save(later, work / "delta.nvc", policy=policy, base=work / "base.nvc")
                deltas.append(time.perf_counter() - start)
            if every:
                delta_module.XOR_COMPONENTS, delta_module.SUB_COMPONENTS = tried
            identical(later, nc.load(work / "delta.nvc"), f"{label} delta")
            with nc.open(work / "delta.nvc") as reader:
                comps = {c: s.stored_bytes for c, s in reader.summary().items()}
            methods[label] = {
                "components": comps,
                "whole": total / (work / "delta.nvc").stat().st_size,
                "full_whole": total / (work / "full.nvc").stat().st_size,
                "save_s": min(deltas),
                "full_save_s": min(fulls),
            }
            print(
                f"  {name} delta: {label}: {methods[label]['whole']:.4f}  save {min(deltas):.2f}s (full {min(fulls):.2f}s)",
                flush=True,
            )
        for peer in _peers():
            if peer.name.startswith("ours") or (only and peer.name not in only) or peer.needs in ("zstd", "safetensors"):
                continue
            try:
                __import__(peer.needs)
            except ImportError:
                print(f"skipped {peer.name}: {peer.needs} does not import", flush=True)
                continue
            save, _ = peer.build()
            sizes = peer_delta(save.encode, later, base)  # type: ignore[attr-defined]
            rest = sizes.pop("_rest")
            methods[peer.name] = {"components": sizes, "whole": total / (sum(sizes.values()) + rest), "rest": rest}
            print(f"  {name} delta: {peer.name}: {methods[peer.name]['whole']:.4f}", flush=True)
    results["methods"] = methods
    return results


def delta_tables(results: dict[str, Any]) -> str:
    raw = results["raw_by_component"]
    comps = [c for c in COMPONENTS if c in raw]
    rows = []
    for name, res in results["methods"].items():
        per = res["components"]
        cells = [f"{raw[c] / per[c]:.4f}" if per.get(c) else "-" for c in comps]
        ours = "save_s" in res
        rows.append(
            [
                name,
                *cells,
                f"{res['whole']:.4f}",
                f"{res['full_whole']:.4f}" if ours else "",
                f"{res['save_s']:.2f}" if ours else "",
                f"{res['save_s'] / res['full_save_s']:.2f}x" if ours else "",
            ]
        )
    peers = {n: r for n, r in results["methods"].items() if "save_s" not in r}
    if peers:
        best, stored = [], 0
        for c in comps:
            pname, size = min(((n, r["components"][c]) for n, r in peers.items() if r["components"].get(c)), key=lambda x: x[1])
            best.append(f"{raw[c] / size:.4f} ({pname})")
            stored += size
        rest = min(r["rest"] for r in peers.values())
        other = results["tensor_bytes"] - sum(raw[c] for c in comps) - rest
        rows.append(
            [
                "best peer delta per component",
                *best,
                f"{results['tensor_bytes'] / (stored + rest + max(other, 0)):.4f}",
                "",
                "",
                "",
            ]
        )
    header = ["method", *comps, "whole", "full save's", "delta save s", "vs full save"]
    return format_table(header, rows)


def best_of_peers(results: dict[str, Any]) -> tuple[dict[str, tuple[float, str]], float] | None:
    """The best peer's ratio (and its name) per component, and the whole ratio of a file made of
    those (the tensors no peer compresses counted raw); None without a per-tensor peer."""
    raw = results["raw_by_component"]
    comps = [c for c in COMPONENTS if c in raw]
    peers = {n: r for n, r in results["methods"].items() if not n.startswith("ours") and r["components"]}
    if not peers:
        return None
    best: dict[str, tuple[float, str]] = {}
    stored = 0
    for c in comps:
        name, size = min(((n, r["components"][c]) for n, r in peers.items() if r["components"].get(c)), key=lambda x: x[1])
        best[c] = (raw[c] / size, name)
        stored += size
    other = results["tensor_bytes"] - sum(raw[c] for c in comps)
    return best, results["tensor_bytes"] / (stored + other)


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a checkpoint's table (per method; the best peer per component last)."""
    raw = results["raw_by_component"]
    comps = [c for c in COMPONENTS if c in raw]
    ref = results["methods"].get("torch.save+zstd -1")
    mb = results["tensor_bytes"] / 1e6
    rows = []
    for name, res in results["methods"].items():
        per = res["components"] or {}
        cells = [f"{raw[c] / per[c]:.4f}" if per.get(c) else "-" for c in comps]
        rows.append(
            [
                name,
                *cells,
                f"{results['tensor_bytes'] / res['file_bytes']:.4f}",
                f"{res['save_s']:.2f} / {res['save_s_median']:.2f}",
                f"{res['save_cpu_s']:.2f}",
                f"{res['load_s']:.3f} / {res['load_s_median']:.3f}",
                f"{res['load_cpu_s']:.3f}",
                f"{mb / res['load_s']:.0f}",
                f"{res['load_s'] / ref['load_s']:.2f}x" if ref else "-",
                f"{res['exact']}/{res['rounds']}",
            ]
        )
    best = best_of_peers(results)
    if best:
        per_comp, whole = best
        rows.append(
            ["best peer per component", *(f"{per_comp[c][0]:.4f} ({per_comp[c][1]})" for c in comps), f"{whole:.4f}"] + [""] * 7
        )
    header = [
        "method",
        *comps,
        "whole",
        "save s min/med",
        "save CPU s",
        "load s min/med",
        "load CPU s",
        "load MB/s",
        "load vs zstd",
        "bit-exact",
    ]
    return header, rows


def tables(results: dict[str, Any]) -> str:
    return format_table(*table_rows(results))


def markdown(results: dict[str, Any], repeat: int) -> str:
    """A checkpoint's table and targets in Markdown (what benchmarks/README.md shows)."""
    header, rows = table_rows(results)
    lines = [
        f"{results['checkpoint']}: {results['tensor_bytes'] / 1e6:.1f} MB of tensors, {repeat} rounds, "
        f"load average {results['loadavg_start']} -> {results['loadavg_end']}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(r + [""] * (len(header) - len(r))) + " |" for r in rows]
    lines += ["", *(f"  - {t.strip()}" if t.startswith(" ") else f"- {t}" for t in targets(results)), ""]
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> list[str]:
    """Issue 32's targets that these methods decide, each "met" or "NOT met" with the numbers."""
    methods = results["methods"]
    lines = []
    ours = methods.get("ours (default)")
    peers = {n: r for n, r in methods.items() if not n.startswith("ours")}
    if ours and peers:
        for key, what in (("load_s", "wall min"), ("load_s_median", "wall median"), ("load_cpu_s", "CPU min")):
            fastest = min(peers, key=lambda n: peers[n][key])
            ok = ours[key] < peers[fastest][key]
            lines.append(
                f"load above every compressed peer ({what}): {'met' if ok else 'NOT met'}: ours (default) "
                f"{ours[key]:.3f} s, fastest peer {fastest} {peers[fastest][key]:.3f} s ({ours[key] / peers[fastest][key]:.2f}x)"
            )
    mr = methods.get("ours (max_ratio)")
    best = best_of_peers(results)
    if mr and best:
        per_comp, whole = best
        mine = results["tensor_bytes"] / mr["file_bytes"]
        lines.append(
            f"max_ratio() at or above the best-of-peers combination (whole): {'met' if mine >= whole else 'NOT met'}: "
            f"{mine:.4f} vs {whole:.4f} ({(mine / whole - 1) * 100:+.2f}%)"
        )
        raw = results["raw_by_component"]
        for c, (ratio, name) in per_comp.items():
            got = raw[c] / mr["components"][c]
            lines.append(
                f"  {c}: max_ratio {got:.4f} vs best peer {ratio:.4f} ({name}): {(got / ratio - 1) * 100:+.2f}%"
                + ("" if got >= ratio else "  (below)")
            )
    return lines


def store_metrics(all_results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The run as results_store metrics: ratios exact, times lower-is-better."""
    out: dict[str, dict[str, Any]] = {}
    for res in all_results:
        ckpt = res["checkpoint"]
        for name, m in res["methods"].items():
            key = f"{ckpt}/{name}"
            out[f"{key}/ratio"] = metric(res["tensor_bytes"] / m["file_bytes"], "x", "exact")
            for comp, size in (m["components"] or {}).items():
                if comp in res["raw_by_component"] and size:
                    out[f"{key}/ratio/{comp}"] = metric(res["raw_by_component"][comp] / size, "x", "exact")
            for t in ("save_s", "save_cpu_s", "load_s", "load_cpu_s"):
                out[f"{key}/{t}"] = metric(m[t], "s", "lower")
            out[f"{key}/exact_rounds"] = metric(m["exact"], "rounds", "exact")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", nargs="+", default=["dense", "moe"], choices=sorted(checkpoints.PAIRS))
    ap.add_argument(
        "--max-mb", type=float, default=0.0, help="keep every k-th parameter, under this many MB if it can (default 0: all)"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="method names to run (default: all)")
    ap.add_argument(
        "--once",
        nargs="*",
        default=["ours (max_ratio)"],
        help="methods timed in the first round only (default: %(default)s, whose save is 15-50x the others')",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--markdown", type=Path, help="write the tables and targets here as Markdown")
    ap.add_argument("--delta", action="store_true", help="deltas of each pair's later state against its base instead")
    ap.add_argument("--store", action="store_true", help="make this run the stored baseline (benchmarks/results/peers.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(_THREADS)
    vers = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()), flush=True)
    env = environment()
    all_results = []
    for name in args.checkpoints:
        if args.delta:
            res = run_delta(name, args.max_mb, args.repeat, args.only)
            all_results.append(res)
            print(f"\n{name}: delta against the state 40 steps earlier, {res['tensor_bytes'] / 1e6:.1f} MB of tensors")
            print(delta_tables(res))
            continue
        res = run(name, args.max_mb, args.repeat, args.only, frozenset(args.once))
        all_results.append(res)
    for res in all_results if not args.delta else []:
        print(
            f"\n{res['checkpoint']}: {res['tensor_bytes'] / 1e6:.1f} MB of tensors, ratio = tensor bytes / stored bytes; "
            f"{args.repeat} interleaved rounds ({', '.join(n for n in args.once if n in res['methods']) or 'none'}: 1), times min / median, CPU = process + children CPU seconds (min); "
            f"load average {res['loadavg_start']} -> {res['loadavg_end']}; 'vs zstd' = time / torch.save+zstd -1's"
        )
        print(tables(res))
        for line in targets(res):
            print(line)
    if args.json:
        args.json.write_text(json.dumps({"versions": vers, "env": env, "results": all_results}, indent=1))
    if args.markdown and not args.delta:
        args.markdown.write_text("\n".join(markdown(res, args.repeat) for res in all_results))
    if not args.delta:
        env["versions"] = vers
        print(f"\nstored {write_run('peers', store_metrics(all_results), env, store=args.store)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
