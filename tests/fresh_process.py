"""Fresh Python processes without the import bill: ``run(argv, cwd=..., env=...)`` as ``python ARGV``.

Many tests prove something in a fresh process: a resume that reads only the files, a README
snippet as a user pastes it, a CLI call, the ranks of a distributed run. What makes such a process
*fresh* is that it holds none of the state of the process that wrote the files; what made it
*slow* on our 2-core machines is that it imports torch, and often Lightning or Transformers, again:
1.4 to 4.5 CPU-seconds each time, most of what those tests cost.

So :func:`run` forks the process from a server (multiprocessing's forkserver) that is itself a new
interpreter which did nothing but import :data:`PRELOAD` (no test state, no torch op run, no
thread started, CUDA not initialised), and runs the code there as ``python ARGV`` would:

- ``ARGV`` is ``-c CODE [ARGS]``, ``-m MODULE [ARGS]`` or ``SCRIPT [ARGS]``: the code runs in a module
  ``__main__`` (its classes pickle by that name, also at exit) with that ``sys.argv`` and
  ``sys.path[0]`` ('' for ``-c``, the current directory for ``-m``, the script's folder), then the
  ``PYTHONPATH`` of ``env``, then the interpreter's own path;
- the working directory and the environment are ``cwd`` and ``env``; ``PYTHONWARNINGS``,
  ``PYTHONUNBUFFERED``, ``PYTHONIOENCODING`` and ``PYTHONDONTWRITEBYTECODE`` are applied, and torch's
  thread count follows ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` as at a fresh start;
- stdout and stderr go through pipes (a file-size limit the code sets does not reach them); the
  return code is the exit status (``sys.exit(n)``, 1 for an uncaught exception, ``-N`` for a signal,
  ``-SIGINT`` for an uncaught KeyboardInterrupt, ``os._exit(n)`` as it is);
- at the end the interpreter's own exit sequence runs: non-daemon threads are joined, then the
  ``atexit`` handlers (the saves a process leaves pending at exit must land, as in a real exit).

:func:`run_ranks` runs N ranks so, as ``torchrun --standalone --nproc_per_node N`` would, and
:func:`spawn_ranks` runs a function as N ranks: the suite's ways to start a process, in one module.
``NVCKPT_TEST_PROCESSES=real`` (:func:`mode`) makes each of them start new interpreters instead
(``python``, ``torchrun``, spawned ranks): scripts/test.sh runs the resume tests of every integration
once so (tests/real_process_tests.txt). :func:`ended_by_signal` reads a killed rank's signal from either.
This package is not preloaded: each process imports it as a user's does.

What differs, and so stays with ``subprocess``: what the interpreter's start or the imports
themselves decide. The forked process has :data:`PRELOAD` (and what they import) already in
``sys.modules`` and their warning filters installed, so tests of what an import without a package
says, of which modules get imported, of warnings, of ``RLIMIT_AS`` (the server's address space is
larger) and of the console script's own entry keep a real interpreter. A variable that a
preloaded module or the interpreter reads at start (:func:`_forkable`) and that ``env`` sets
otherwise than the server's environment also gets a real interpreter, as a fallback.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

#: Imported once by the server: the third-party modules the fresh processes of the suite import (each
#: import that a forked process does not repeat saves its CPU time); the server pays for them once per
#: worker. nvcomp_checkpoint itself is NOT preloaded: every fresh process imports it as a user's
#: process does, so a broken lazy import or a module-level side effect fails the test that meets it
#: (0.24 CPU-s for the package and its five entry modules, measured, once those below are loaded).
PRELOAD = [
    "fresh_process",
    "pytest",
    "torch",
    "numpy",
    "zstandard",
    "xxhash",
    "rich.progress",
    "rich.tree",
    "torch.distributed.checkpoint",
    "torch.distributed._composable.fsdp",
    "torch.distributed.elastic",
    "lightning.pytorch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.trainer",
    "accelerate",
    "safetensors.torch",
    "huggingface_hub.serialization",
    "s3fs",
]

#: ``NVCKPT_TEST_PROCESSES``: ``forked`` (the default) forks fresh processes and ranks from the
#: preloaded server; ``real`` runs every one as a new interpreter (``python``, ``torchrun``, spawned
#: ranks), so that the same tests check what the server could hide. CI runs the integrations' resume
#: tests once in that mode (scripts/test.sh).
MODES = ("forked", "real")


def mode() -> str:
    """The process mode of this run (:data:`MODES`), from ``NVCKPT_TEST_PROCESSES``."""
    value = os.environ.get("NVCKPT_TEST_PROCESSES", "") or "forked"
    if value not in MODES:
        raise ValueError(f"NVCKPT_TEST_PROCESSES={value!r}: expected one of {', '.join(MODES)}")
    return value


#: Read by torch (or OpenMP) once: the server starts without them, and a forked process sets torch's
#: thread count from them itself.
_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: Applied by :func:`_child` (or the same for every process of the suite).
_FOLLOWED = {"PYTHONPATH", "PYTHONWARNINGS", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", *_THREADS}
#: Variables read as the interpreter or a preloaded module starts: a process whose ``env`` sets one
#: of them otherwise than the server's environment gets a real interpreter.
_AT_START = ("PYTHON", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "TORCHDYNAMO", "TORCHINDUCTOR", "PYTORCH_",
             "LD_", "LC_", "LANG", "OPENBLAS", "MKL_", "KMP_", "GOMP_", "OMP_", "MPLBACKEND", "CUDA_", "NVIDIA_")  # fmt: skip

_context: Any = None
_base_path: list[str] | None = None
_server_env: dict[str, str] = {}


def _server() -> Any:
    """The forkserver context, its server started (once per process) with this environment less
    :data:`_THREADS`."""
    global _context, _base_path, _server_env
    if _context is None:
        here = str(Path(__file__).parent)
        # A plain interpreter's sys.path (no PYTHONPATH): the base every fresh process starts from.
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        probe = "import sys, json; print(json.dumps(sys.path[1:]))"
        out = subprocess.run([sys.executable, "-c", probe], env=clean, capture_output=True, text=True, check=True)
        import json

        _base_path = json.loads(out.stdout)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.pop(k) for k in _THREADS if k in os.environ}
        if here not in sys.path:
            sys.path.insert(0, here)
        try:
            from multiprocessing import forkserver

            _server_env = dict(os.environ)
            forkserver.ensure_running()
        finally:
            os.environ.update(saved)
        _context = ctx
    return _context


def _forkable(env: dict[str, str]) -> bool:
    """Whether a process forked from the server starts as ``python`` with ``env`` would: every
    variable of :data:`_AT_START` that :func:`_child` does not apply is as in the server's environment."""
    server = _server_env or dict(os.environ)
    keys = {k for k in (*env, *server) if k.startswith(_AT_START)} - _FOLLOWED
    return all(env.get(k) == server.get(k) for k in keys)


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def adopt_environment(env: dict[str, str]) -> None:
    """In a forked process: ``env`` as the environment, and what the preloaded modules read from the
    environment at import as they would have read ``env``: torch's thread count (the server started
    without ``OMP_NUM_THREADS``: every core, as a fresh process without it) and Lightning's rank for
    ``rank_zero_only`` (the server imported Lightning without ``RANK``: every rank would be rank 0)."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        # What lightning/fabric/utilities/rank_zero.py sets at import in a new interpreter.
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0


def start_method() -> str:
    """The start method for ``torch.multiprocessing``'s ranks (which then call :func:`adopt_environment`
    with the parent's environment): ``"forkserver"`` with the preloaded server running, or ``"spawn"``
    (new interpreters) in the ``real`` :func:`mode`."""
    if mode() == "real":
        return "spawn"
    _server()
    return "forkserver"


def _streams(env: dict[str, str], unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on fds 0/1/2 as a fresh interpreter opens them with ``env``."""
    encoding, _, errors = env.get("PYTHONIOENCODING", "utf-8").partition(":")
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    kw: dict[str, Any] = {"encoding": encoding or "utf-8", "closefd": False}
    sys.stdout = open(1, "w", errors=errors or "strict", **kw)  # noqa: SIM115
    sys.stderr = open(2, "w", errors=errors or "backslashreplace", buffering=1, **kw)  # noqa: SIM115
    sys.stderr.reconfigure(write_through=True)
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
    sys.stdin = open(0, **kw)  # noqa: SIM115
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))


def _main_module(name: str = "__main__", file: str | None = None) -> types.ModuleType:
    main = types.ModuleType(name)
    main.__dict__["__builtins__"] = __builtins__
    if file is not None:
        main.__file__ = file
    sys.modules["__main__"] = main
    return main


def _child(argv: list[str], cwd: str, env: dict[str, str], out: Any, err: Any, base_path: list[str], unbuffered: bool) -> None:
    """In the forked process: become ``python ARGV`` and exit as the interpreter would."""
    import runpy
    import traceback

    # The main process of its own program, not a child of multiprocessing's, with the default
    # start method its platform gives a fresh interpreter.
    main_process = next(c for c in multiprocessing.process.BaseProcess.__subclasses__() if c.__name__ == "_MainProcess")
    multiprocessing.process._current_process = main_process()  # type: ignore[attr-defined]
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]
    multiprocessing.process._children = set()  # type: ignore[attr-defined]
    multiprocessing.context._default_context._actual_context = None  # type: ignore[attr-defined]
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _streams(env, unbuffered)
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        print("fresh_process: the server initialised CUDA; a forked process cannot use it", file=sys.stderr)
        os._exit(70)
    os.chdir(cwd)
    adopt_environment(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))  # type: ignore[attr-defined]
    code, interrupted = 0, False
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *extra, *base_path]
            exec(compile(argv[1], "<string>", "exec"), _main_module().__dict__)
        elif argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined] - what ``python -m`` calls
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(script), *extra, *base_path]
            source = Path(script).read_bytes()
            exec(compile(source, argv[0], "exec"), _main_module(file=argv[0]).__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's exit: non-daemon threads joined, then the atexit handlers.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:  # as CPython: the process ends by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class _Captured:
    """The read ends of a process's stdout and stderr pipes, drained by threads until EOF."""

    def __init__(self, ctx: Any) -> None:
        (self._out_r, self.out_w), (self._err_r, self.err_w) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
        self._chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        self._threads = [
            threading.Thread(target=self._drain, args=(self._out_r, "out"), daemon=True),
            threading.Thread(target=self._drain, args=(self._err_r, "err"), daemon=True),
        ]

    def _drain(self, conn: Any, key: str) -> None:
        fd = conn.fileno()
        while chunk := os.read(fd, 1 << 16):
            self._chunks[key].append(chunk)
        conn.close()

    def started(self) -> None:
        """The child has the write ends: close ours, so that EOF comes when the child's close."""
        self.out_w.close()
        self.err_w.close()
        for t in self._threads:
            t.start()

    def text(self, timeout: float = 30) -> tuple[str, str]:
        for t in self._threads:
            t.join(timeout)
        return tuple(b"".join(self._chunks[k]).decode("utf-8", errors="replace") for k in ("out", "err"))  # type: ignore[return-value]


def torchrun_args(argv: Sequence[str]) -> tuple[int, list[str]] | None:
    """``(N, SCRIPT_ARGS)`` of ``-m torch.distributed.run --standalone --nproc_per_node N SCRIPT_ARGS``."""
    head = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    if list(argv[: len(head)]) != head or len(argv) < len(head) + 2:
        return None
    return int(argv[len(head)]), list(argv[len(head) + 1 :])


def run(
    argv: Sequence[str], *, cwd: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, in a process forked from the preloaded server (see the module's text).
    ``-m torch.distributed.run --standalone --nproc_per_node N ...`` runs its ranks by :func:`run_ranks`."""
    torchrun = torchrun_args(argv)
    if torchrun is not None:
        return run_ranks(torchrun[1], torchrun[0], cwd=cwd, env=env, timeout=timeout)
    env = dict(os.environ if env is None else env)
    if mode() == "real":
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ctx = _server()
    if not _forkable(env):
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    pipes = _Captured(ctx)
    proc = ctx.Process(target=_child, args=(list(argv), os.fspath(cwd), env, pipes.out_w, pipes.err_w, _base_path, False))
    try:
        proc.start()
        pipes.started()
        proc.join(timeout)
    finally:
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
    out, err = pipes.text()
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out, err)
    return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode, out, err)


def _rank_env(env: dict[str, str], rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    """``torchrun --standalone --nproc_per_node WORLD``'s environment for ``rank`` (``MASTER_PORT``:
    the rendezvous store the caller hosts, as torchrun's agent does)."""
    ranks = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "GROUP_RANK": 0,
        "ROLE_RANK": rank,
        "ROLE_NAME": "default",
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world,
        "ROLE_WORLD_SIZE": world,
        "GROUP_WORLD_SIZE": 1,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
    }
    out = {**env, **{k: str(v) for k, v in ranks.items()}}
    out.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for more than one rank per node
    return out


def run_ranks(
    argv: Sequence[str], world: int, *, cwd: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node WORLD ARGV`` with its ranks forked from the server.

    Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``,
    ``TORCHELASTIC_*``: frameworks see an elastic launch and start no processes of their own), an
    unbuffered stdout (torchrun runs ``python -u``), and rendezvous at a TCPStore this process
    hosts, as at torchrun's agent. As torchrun does, the first rank to fail ends the others
    (SIGTERM, then SIGKILL after 5 s). The return code is the failed rank's own: a rank killed by a
    signal before one that then failed on its absence (torchrun itself would return 1); 0 when
    every rank exits 0. ``rank_exitcodes`` lists every rank's (None where a real ``torchrun`` ran,
    for an environment the server cannot match); stdout/stderr hold every rank's output, rank by rank.
    """
    import uuid
    from multiprocessing.connection import wait

    import torch.distributed as dist

    env = dict(os.environ if env is None else env)
    if mode() == "real" or not _forkable(env):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *argv]
        real = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        real.rank_exitcodes = None  # type: ignore[attr-defined]
        return real
    ctx = _server()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    run_id = uuid.uuid4().hex
    procs: list[Any] = []
    pipes: list[_Captured] = []
    ended_by_us: set[int] = set()
    timed_out = False
    try:
        for rank in range(world):
            pipes.append(_Captured(ctx))
            rank_env = _rank_env(env, rank, world, store.port, run_id)
            args = (list(argv), os.fspath(cwd), rank_env, pipes[-1].out_w, pipes[-1].err_w, _base_path, True)
            procs.append(ctx.Process(target=_child, args=args))
            procs[-1].start()
            pipes[-1].started()
        deadline = time.monotonic() + timeout
        pending = list(procs)
        while pending and not any(p.exitcode not in (None, 0) for p in procs):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            wait([p.sentinel for p in pending], timeout=left)
            pending = [p for p in pending if p.exitcode is None]
        if pending and not timed_out:
            # A rank failed: the ranks it takes down with it end within a moment; then end the rest.
            wait([p.sentinel for p in pending], timeout=1.0)
    finally:
        alive = [p for p in procs if p.exitcode is None]
        ended_by_us = {id(p) for p in alive}
        for p in alive:
            p.terminate()
        grace = time.monotonic() + 5
        for p in alive:
            p.join(max(0.0, grace - time.monotonic()))
            if p.exitcode is None:
                p.kill()
            p.join()
        del store
    texts = [c.text() for c in pipes]
    stdout = "".join(f"[rank {r}]\n{o}" for r, (o, _) in enumerate(texts))
    stderr = "".join(f"[rank {r}]\n{e}" for r, (_, e) in enumerate(texts))
    if timed_out:
        raise subprocess.TimeoutExpired(["torchrun", *argv], timeout, stdout, stderr)
    failed = [p for p in procs if p.exitcode != 0 and id(p) not in ended_by_us]
    # A rank killed by a signal is the cause; the others failed on its absence.
    cause = min(failed, key=lambda p: (p.exitcode or 0) >= 0) if failed else None
    code = 0 if cause is None else cause.exitcode
    if code != 0:
        stderr += "\n[ranks] exit codes " + ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs)) + "\n"
    result = subprocess.CompletedProcess(["torchrun", *argv], code, stdout, stderr)
    result.rank_exitcodes = [p.exitcode for p in procs]  # type: ignore[attr-defined]
    return result


def ended_by_signal(result: subprocess.CompletedProcess[str]) -> int | None:
    """The signal that ended the run of :func:`run` or :func:`run_ranks` (a rank's, for ranks), or None.

    A forked run returns ``-N`` as the failed rank's exit code; a real ``torchrun`` returns 1 and names
    the rank's ``exitcode  : -N`` in its error summary, read here, so a test asks the same question in
    either :func:`mode`.
    """
    if result.returncode < 0:
        return -result.returncode
    if getattr(result, "rank_exitcodes", ()) is None:  # a real torchrun
        import re

        found = re.search(r"exitcode\s*:\s*-(\d+)", result.stderr)
        return int(found.group(1)) if found else None
    return None


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any, timeout: float = 600.0) -> None:
    """Runs ``fn(rank, world, port, *args)`` in ``world`` fresh processes; raises as ``mp.start_processes``.

    The ranks are forked from the preloaded server (``forkserver``), with this process's environment:
    fresh as spawned ones, without importing torch again; spawned (new interpreters) in the ``real``
    :func:`mode`.

    The ranks rendezvous (``tcp://127.0.0.1:<port>`` or ``env://`` with ``MASTER_PORT=<port>``) at a
    TCPStore this process hosts on a port the kernel picked: a port probed free and bound later
    by rank 0 could be taken in between by another process (a parallel test run). Ranks still
    running after ``timeout`` seconds are killed and the test fails: a hang (a collective that some
    rank never reached) fails fast instead of holding CI until its limit.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    try:
        ctx = mp.start_processes(
            _rank_entry,
            args=(world, store.port, fn, args, dict(os.environ)),
            nprocs=world,
            start_method=start_method(),
            join=False,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(
                    f"{fn.__name__}: ranks {hung} of {world} still running after {timeout:.0f} s (a hang: a collective "
                    "some rank never reached?); killed"
                )
    finally:
        del store


def _rank_entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...], env: dict[str, str]) -> None:
    adopt_environment(env)  # the parent's, as a spawned rank would have it
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank is a client of the parent's store
    fn(rank, world, port, *args)
    # Ends the rank without interpreter finalization: a gloo worker thread may still hold the last
    # reference to a finished collective's tensors (torch's ProcessGroupGloo::runLoop), and
    # dropping it needs the GIL, which a finalizing interpreter answers with SIGABRT
    # ("terminate called without an active exception"; seen on a loaded machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
