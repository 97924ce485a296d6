"""Shared test helpers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import fresh_process

# The suite runs without a network and without a display, and its fresh processes (forked from the
# server of tests/fresh_process.py, started with this environment) hash strings as the tests' own
# subprocesses do: set once here, for every process the tests start.
for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}.items():
    os.environ.setdefault(_name, _value)


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh contiguous copy: a one-element view may keep any stride (view(uint8) refuses
    # it), and lazy conj/neg views must show the values they stand for.
    flat = t.detach().cpu().resolve_conj().resolve_neg().reshape(-1)
    return flat.clone(memory_format=torch.contiguous_format).view(torch.uint8)


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Bit-identical tensors (same dtype, shape, bytes) and equal plain values, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: expected a tensor, got {type(b)}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.numel():
            ab, bb = _element_bytes(a), _element_bytes(b)
            assert torch.equal(ab, bb), f"{path}: tensor bytes differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)} != {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}/{i}")
        return
    if isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{path}: NaN lost"
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def tree_equal():
    return assert_tree_equal


_SLOW_TESTS = {
    line.strip()
    for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def _is_slow(nodeid: str) -> bool:
    """Listed as itself, by its module (``tests/test_x.py``) or, parametrized, by its function
    (``tests/test_x.py::test_y``: every parameter; the README snippets' ids hold line numbers)."""
    return nodeid in _SLOW_TESTS or nodeid.split("::")[0] in _SLOW_TESTS or nodeid.split("[")[0] in _SLOW_TESTS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests listed in slow_tests.txt are ``slow``: ``pytest -m "not slow"`` is the fast loop.

    In a pytest-xdist worker the items are also put in the order :class:`_SlowFirst` hands them
    out: the heaviest work units first.
    """
    for item in items:
        if _is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput") and config.getoption("dist", "no") == "no":  # an xdist worker
        items[:] = _slow_first([item.nodeid for item in items], items)


# -- pytest-xdist: the slow work first ----------------------------------------------------------------
#
# xdist's default ``load`` schedule hands each worker a quarter of the suite in collection order,
# then more as it finishes: a long test collected late (a README snippet, a fresh-process
# training run) can start when the other worker is nearly done, and the suite then waits for it
# alone. Instead every worker gets the slow work units first, heaviest first (longest processing
# time first), then the fast tests one by one, which fill the gaps until both workers end together.
#
# A work unit is one test, or a whole module where the module has a fixture of module (or wider)
# scope: its tests stay on one worker, so the fixture (often a fresh-process training run) runs
# once, not once per worker.

_TESTS_DIR = Path(__file__).parent
_SLOW_WEIGHT, _FAST_WEIGHT = 10.0, 0.2  # slow tests take 1.5 to 30 s, fast ones well under a second
_WIDE_FIXTURE = re.compile(r"""@pytest\.fixture\([^)]*scope=["'](?:module|package|session|class)["']""")


def _unit_of(nodeid: str, _grouped: dict[str, bool] = {}) -> str:  # noqa: B006 - a cache, per process
    module = nodeid.split("::")[0]
    if module not in _grouped:
        path = _TESTS_DIR.parent / module
        _grouped[module] = path.is_file() and bool(_WIDE_FIXTURE.search(path.read_text(encoding="utf-8")))
    return module if _grouped[module] else nodeid


def _slow_first(nodeids: list[str], items: list[Any]) -> list[Any]:
    """``items`` (one per nodeid) by work unit, heaviest unit first; a unit's items keep their order."""
    weight: dict[str, float] = {}
    for nodeid in nodeids:
        unit = _unit_of(nodeid)
        weight[unit] = weight.get(unit, 0.0) + (_SLOW_WEIGHT if _is_slow(nodeid) else _FAST_WEIGHT)
    first_seen = {unit: i for i, unit in reversed(list(enumerate(_unit_of(n) for n in nodeids)))}
    order = sorted(range(len(items)), key=lambda i: (-weight[_unit_of(nodeids[i])], first_seen[_unit_of(nodeids[i])], i))
    return [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` (xdist's ``load``): :class:`_SlowFirst`; another ``--dist`` is left as asked."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _SlowFirst(LoadScopeScheduling):
        """xdist's ``loadscope`` with :func:`_unit_of` as the scope; the workers collect in
        :func:`_slow_first` order, so the units are handed out heaviest first."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    return _SlowFirst(config, log)


@pytest.fixture(autouse=True)
def _wide_cli_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's tables are as wide as a 200-column terminal unless a test says otherwise
    (tests/test_cli_width.py): whether a pytest worker's output counts as a terminal, and how
    wide, depends on how pytest was started."""
    monkeypatch.setenv("COLUMNS", "200")


#: What a launcher or an in-process run (Lightning's DDP strategy, Accelerate, DeepSpeed) leaves in
#: ``os.environ``: a later test's subprocess inherits it and acts as a rank of that finished run
#: (seen: an Accelerate script given a leaked LOCAL_RANK and MASTER_PORT bound that port, which the
#: worker's live process group held: EADDRINUSE). Lightning also sets OMP_NUM_THREADS.
_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "OMP_NUM_THREADS",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DISTRIBUTED_TYPE",
)


def _dist_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in _DIST_ENV or k.startswith(("TORCHELASTIC_", "PL_"))}


@contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, each variable put back as it was afterwards (for module-scoped
    fixtures, where ``monkeypatch`` is not available)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def traced_peak(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the peak bytes Python and numpy allocated while it ran (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def traced_load_extra(reader: Any, expected: Any) -> int:
    """Peak bytes Python and numpy allocated during ``reader.load()`` beyond the result's own traced bytes
    (torch's allocator, which holds results, is not traced); the result must equal ``expected``."""
    import tracemalloc

    tracemalloc.start()
    try:
        loaded = reader.load()
        held, peak = tracemalloc.get_traced_memory()
        assert_tree_equal(loaded, expected)
        del loaded
        result = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return peak - result


@contextmanager
def _dist_env_restored() -> Iterator[None]:
    before = _dist_env()
    yield
    for k in _dist_env():
        if k not in before:
            del os.environ[k]
    os.environ.update(before)


@pytest.fixture(autouse=True, scope="module")
def _distributed_env_restored_per_module():
    """Puts back the distributed environment a module's fixtures changed (autouse: it runs before them)."""
    with _dist_env_restored():
        yield


@pytest.fixture(autouse=True)
def _distributed_env_restored():
    """Puts back the distributed environment variables a test changed, and drops those it added."""
    with _dist_env_restored():
        yield


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Puts back the number of CPU threads torch computes with, if a test changed it.

    Some tests compare an in-process run with a subprocess bit for bit: the thread count sets the
    float reduction order, so one test's ``torch.set_num_threads(1)`` must not reach a later module.
    """
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def start_moto_server(env: dict[str, str], log: Path, port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
    """moto's standalone S3 server as a child process; returns it and its port, once it listens.

    ``port=0``: the server binds a port the kernel picks. Either way the port is read from the
    server's own "Running on" line, which it prints once bound: a port probed free here could be
    taken by another process before the server binds it, and a readiness request would then be
    answered by that process instead.
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=out,
            env=env,
        )
    deadline = time.monotonic() + 60
    while (found := re.search(rb"Running on http://127\.0\.0\.1:(\d+)", log.read_bytes())) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"moto_server did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return proc, int(found.group(1))


def run_python(*args: str, cwd: Path, timeout: float = 300, world: int = 0, own_launcher: bool = False, **env: str) -> None:
    """Run ``python ARGS`` in a fresh process (:func:`fresh_process.run`: a training script, ``-c CODE``, ``-m torch.distributed.run ...``);
    fail with the tail of its output unless it exits 0. ``env``: extra environment variables.

    ``-m torch.distributed.run --standalone --nproc_per_node N SCRIPT ...`` and ``world=N`` (a
    script whose framework would launch N ranks itself, as Lightning's DDP launcher does) run the N
    ranks as torchrun would, forked from the preloaded server of tests/fresh_process.py
    (:func:`fresh_process.run_ranks`): each rank with torchrun's environment, at a rendezvous store
    this process hosts on a port the kernel picked.

    ``own_launcher=True`` with ``world=N``: a real interpreter runs the script, and the framework's own
    launcher starts the other ranks (what ``python train.py`` with ``devices=N`` goes through); they
    rendezvous at a TCPStore this process hosts: Lightning's own port choice (probed free, bound later
    by rank 0) can be taken in between by a parallel test.
    """
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    store = None
    if world and own_launcher:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        full_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        if own_launcher:  # the framework's own launcher starts the other ranks from a real interpreter
            proc = subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
        elif world and fresh_process.torchrun_args(args) is None:
            proc = fresh_process.run_ranks(args, world, cwd=cwd, env=full_env, timeout=timeout)
        else:
            proc = fresh_process.run(args, cwd=cwd, env=full_env, timeout=timeout)
    finally:
        del store
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
