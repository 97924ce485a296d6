"""Fresh Python processes without the import bill: ``run(argv, cwd=..., env=...)`` as ``python ARGV``.

Many tests prove something in a fresh process: a resume that reads only the files, a README
snippet as a user pastes it, a CLI call. What makes such a process *fresh* is that it holds none of
the state of the process that wrote the files; what makes it *slow* on our 2-core machines is that
it imports torch, and often Lightning or Transformers, again: 1.5 to 4.5 CPU-seconds each time,
most of what those tests cost.

So :func:`run` forks the process from a server (multiprocessing's forkserver) that is itself a new
interpreter which did nothing but import :data:`PRELOAD` (no test state, no torch op run, no
thread started), and runs the script there as ``python ARGV`` would run it:

- ``ARGV`` is ``-c CODE [ARGS]``, ``-m MODULE [ARGS]`` or ``SCRIPT [ARGS]``: the code runs as
  ``__main__`` with that ``sys.argv`` and ``sys.path[0]`` ('' for ``-c``, the current directory for
  ``-m``, the script's folder), then the ``PYTHONPATH`` of ``env``, then the interpreter's own path;
- the working directory and the environment are ``cwd`` and ``env``; ``PYTHONWARNINGS`` is applied;
- stdout and stderr are captured; the return code is the exit status (``sys.exit(n)``, 1 for an
  uncaught exception, ``-N`` for a signal, ``os._exit(n)`` as it is);
- at the end the interpreter's own exit sequence runs: non-daemon threads are joined, then the
  ``atexit`` handlers (the saves a process leaves pending at exit must land, as in a real exit).

Not for what depends on the interpreter starting or on the imports themselves (a test of what an
import without a package says, ``python -X``, a console script's own entry): those keep
``subprocess``. A module of :data:`PRELOAD` read its environment once, at import, with the
server's: the server starts with :data:`SERVER_ENV` on top of the test process's environment.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.process
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, Sequence

#: Imported once by the server: what the fresh processes of the suite import (each import that a
#: forked process does not repeat saves its CPU time); the server pays for them once per worker.
PRELOAD = [
    "fresh_process",
    "pytest",
    "torch",
    "numpy",
    "nvcomp_checkpoint",
    "nvcomp_checkpoint.cli.main",
    "nvcomp_checkpoint.lightning",
    "lightning.pytorch",
    "transformers",
    "accelerate",
    "safetensors.torch",
    "nvcomp_checkpoint.transformers",
    "nvcomp_checkpoint.accelerate",
    "s3fs",
]
#: What the preloaded modules read at import (offline Hugging Face, no display).
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}

#: Read by torch (or OpenMP) once: a forked process sets its thread count from them itself.
_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: Read as the interpreter starts, and followed here (``PYTHONPATH``, ``PYTHONWARNINGS``) or the same
#: for every process (``PYTHONUNBUFFERED``: the output is read at the end). Another ``PYTHON*`` variable
#: of ``env`` that differs from the server's gets a real interpreter.
_FOLLOWED = {"PYTHONPATH", "PYTHONWARNINGS", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}

_context: Any = None
_base_path: list[str] | None = None


def _server() -> Any:
    """The forkserver context, its server started with :data:`SERVER_ENV` (once per process)."""
    global _context, _base_path
    if _context is None:
        here = str(Path(__file__).parent)
        # A plain interpreter's sys.path (no PYTHONPATH): the base every fresh process starts from.
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run(
            [sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
            env=clean,
            capture_output=True,
            text=True,
            check=True,
        )
        import json

        _base_path = json.loads(out.stdout)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in (*SERVER_ENV, *_THREADS)}
        os.environ.update(SERVER_ENV)
        for k in _THREADS:  # a fresh process without them computes with every core
            os.environ.pop(k, None)
        if here not in sys.path:
            sys.path.insert(0, here)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _context = ctx
    return _context


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def adopt_environment(env: dict[str, str]) -> None:
    """In a forked process: ``env`` as the environment, and torch's thread count as ``env`` sets it
    (torch read it in the server, without ``OMP_NUM_THREADS``: every core, as a fresh process)."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def start_method() -> str:
    """``"forkserver"`` with the preloaded server running, for ``torch.multiprocessing``'s ranks
    (which then call :func:`adopt_environment` with the parent's environment)."""
    _server()
    return "forkserver"


def _child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, base_path: list[str]) -> None:
    """In the forked process: become ``python ARGV`` and exit as the interpreter would."""
    # This process is the main process of its own program, not a child of multiprocessing's.
    main_process = next(c for c in multiprocessing.process.BaseProcess.__subclasses__() if c.__name__ == "_MainProcess")
    multiprocessing.process._current_process = main_process()  # type: ignore[attr-defined]
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]
    multiprocessing.process._children = set()  # type: ignore[attr-defined]
    fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)
    os.close(fd_out)
    os.close(fd_err)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    adopt_environment(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))  # type: ignore[attr-defined]
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *extra, *base_path]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(script), *extra, *base_path]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
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
    os._exit(code)


def _forkable(env: dict[str, str]) -> bool:
    """Whether a process forked from the server starts as ``python`` with ``env`` would."""
    server = {**{k: v for k, v in os.environ.items() if k.startswith("PYTHON")}, **SERVER_ENV}
    for key in {k for k in (*env, *server) if k.startswith("PYTHON")} - _FOLLOWED:
        if env.get(key, server.get(key)) != server.get(key):
            return False
    return all(env.get(k, v) == v for k, v in SERVER_ENV.items())


def run(
    argv: Sequence[str], *, cwd: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, in a process forked from the preloaded server (see the module's text)."""
    env = dict(os.environ if env is None else env)
    if not _forkable(env):
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ctx = _server()
    with tempfile.TemporaryDirectory(prefix="fresh-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = ctx.Process(target=_child, args=(list(argv), os.fspath(cwd), env, out, err, _base_path))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, Path(out).read_text(), Path(err).read_text())
        return subprocess.CompletedProcess(
            [sys.executable, *argv],
            proc.exitcode,
            Path(out).read_text(encoding="utf-8", errors="replace"),
            Path(err).read_text(encoding="utf-8", errors="replace"),
        )


#: ``torchrun --standalone --nproc_per_node N``'s environment for rank ``r`` of ``n`` (besides
#: ``MASTER_PORT``: the rendezvous store the caller hosts, as torchrun's agent does).
def _rank_env(env: dict[str, str], rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
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
    }
    out = {**env, **{k: str(v) for k, v in ranks.items()}}
    out.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for more than one rank per node
    return out


def run_ranks(
    argv: Sequence[str], world: int, *, cwd: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node WORLD ARGV`` with its ranks forked from the server.

    Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``,
    ``TORCHELASTIC_*``; frameworks see an elastic launch and start no processes of their own) and
    rendezvous at a TCPStore this process hosts, as at torchrun's agent. As torchrun does, the first
    rank to fail ends the others; the return code is that rank's (one killed by a signal before one
    that failed on its absence; 0 when every rank exits 0), ``rank_exitcodes`` lists every rank's, and
    stdout/stderr hold every rank's output, rank by rank.
    """
    import time
    import uuid
    from multiprocessing.connection import wait

    import torch.distributed as dist

    env = dict(os.environ if env is None else env)
    ctx = _server()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="fresh-ranks-") as tmp:
        outs = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(world)]
        procs = []
        for rank, (out, err) in enumerate(outs):
            rank_env = _rank_env(env, rank, world, store.port, run_id)
            procs.append(ctx.Process(target=_child, args=(list(argv), os.fspath(cwd), rank_env, out, err, _base_path)))
        for p in procs:
            p.start()
        deadline, failed, timed_out = time.monotonic() + timeout, None, False
        try:
            pending = list(procs)
            while pending and failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                wait([p.sentinel for p in pending], timeout=left)
                pending = [p for p in pending if p.exitcode is None]
                done = [p for p in procs if p.exitcode not in (None, 0)]
                # A rank killed by a signal is the cause; the others failed on its absence.
                failed = min(done, key=lambda p: (p.exitcode or 0) >= 0) if done else None
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
            del store

        def text(path: str) -> str:
            return Path(path).read_text(encoding="utf-8", errors="replace")

        stdout = "".join(f"[rank {r}]\n{text(o)}" for r, (o, _) in enumerate(outs))
        stderr = "".join(f"[rank {r}]\n{text(e)}" for r, (_, e) in enumerate(outs))
        if timed_out:
            raise subprocess.TimeoutExpired(["torchrun", *argv], timeout, stdout, stderr)
        code = 0 if failed is None else failed.exitcode
        if code != 0:
            stderr += "\n[ranks] exit codes " + ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs)) + "\n"
        result = subprocess.CompletedProcess(["torchrun", *argv], code, stdout, stderr)
        result.rank_exitcodes = [p.exitcode for p in procs]  # type: ignore[attr-defined]
        return result
