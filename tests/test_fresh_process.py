"""tests/fresh_process.py: a forked process behaves as ``python ARGV`` would, and ranks as torchrun's.

The suite's fresh-process tests (resumes, README snippets, the CLI, DDP and DeepSpeed ranks) rely
on it: each case here is a difference a forked process could show and a real one does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import fresh_process

_PROBE = """
import json, os, sys, threading, atexit, multiprocessing
import torch
def at_exit():
    print("atexit ran", flush=True)
atexit.register(at_exit)
def late():
    import time
    time.sleep(0.2)
    print("thread joined", flush=True)
threading.Thread(target=late).start()
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "extra": os.environ.get("PROBE_EXTRA"),
    "threads": torch.get_num_threads(), "main": multiprocessing.current_process().name,
    "parent": multiprocessing.parent_process() is None, "name": __name__,
    "on_path": "/probe/path" in sys.path,
}))
"""


def _both(
    argv: list[str], tmp_path: Path, **env: str
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    full = dict(os.environ, **env)
    real = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=120)
    forked = fresh_process.run(argv, cwd=tmp_path, env=full, timeout=120)
    return real, forked


def test_code_argv_cwd_path_environment_threads_and_the_exit_sequence_match_a_real_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    env = {"PROBE_EXTRA": "x", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/probe/path"}
    for argv in (["-c", _PROBE, "a", "b"], [str(script), "a", "b"]):
        real, forked = _both(argv, tmp_path, **env)
        assert real.returncode == forked.returncode == 0, (real.stderr, forked.stderr)
        # The same lines in the same order: the report, then the non-daemon thread joined, then atexit.
        assert forked.stdout == real.stdout, (forked.stdout, real.stdout)
        assert forked.stdout.splitlines()[1:] == ["thread joined", "atexit ran"]


@pytest.mark.parametrize(
    "code, expected",
    [
        ("import sys; sys.exit(3)", 3),
        ("import os; os._exit(17)", 17),
        ("raise ValueError('boom')", 1),
        ("import sys; sys.exit('a message')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
        ("pass", 0),
    ],
)
def test_exit_codes_and_stderr_match_a_real_interpreter(code: str, expected: int, tmp_path: Path) -> None:
    real, forked = _both(["-c", code], tmp_path)
    assert real.returncode == forked.returncode == expected
    if expected == 1:
        assert real.stderr.splitlines()[-1] == forked.stderr.splitlines()[-1]


def test_classes_of_the_script_pickle_at_exit_and_the_start_method_is_the_platforms(tmp_path: Path) -> None:
    code = (
        "import atexit, multiprocessing, pickle\n"
        "class Net: pass\n"
        "atexit.register(lambda: print(len(pickle.dumps(Net())) > 0, multiprocessing.get_start_method()))\n"
    )
    script = tmp_path / "net.py"
    script.write_text(code)
    for argv in (["-c", code], [str(script)]):
        real, forked = _both(argv, tmp_path)
        assert real.returncode == forked.returncode == 0, forked.stderr
        assert forked.stdout == real.stdout, (forked.stdout, real.stdout)


def test_output_is_not_bound_by_a_file_size_limit_the_code_sets(tmp_path: Path) -> None:
    code = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); print('x' * 20000)"
    real, forked = _both(["-c", code], tmp_path)
    assert real.returncode == forked.returncode == 0, forked.stderr
    assert forked.stdout == real.stdout


def test_a_module_runs_as_main(tmp_path: Path) -> None:
    (tmp_path / "probe_module.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    real, forked = _both(["-m", "probe_module", "x"], tmp_path)
    assert real.stdout == forked.stdout == "__main__ ['x']\n"


def test_an_interpreter_setting_the_server_cannot_have_gets_a_real_interpreter(tmp_path: Path) -> None:
    fresh_process.start_method()  # the server runs: its environment is the reference
    env = dict(os.environ, PYTHONHASHSEED="123")
    assert not fresh_process._forkable(env)
    assert fresh_process._forkable(dict(os.environ, PYTHONPATH="/x", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    assert not fresh_process._forkable(dict(os.environ, HF_HUB_OFFLINE="0"))
    assert not fresh_process._forkable({k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"})
    assert not fresh_process._forkable(dict(os.environ, HF_HOME="/elsewhere"))
    code = "print(hash('nvcomp'))"
    real = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert fresh_process.run(["-c", code], cwd=tmp_path, env=env).stdout == real.stdout


_RANK = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print("rank", rank, "of", dist.get_world_size(), os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_RUN_ID"] != "")
dist.barrier()
if len(sys.argv) > 1 and rank == int(sys.argv[1]):
    os.kill(os.getpid(), 9)
if len(sys.argv) > 1:
    time.sleep(60)  # the other rank: ended by the launcher once its peer is gone
dist.destroy_process_group()
"""


def test_ranks_rendezvous_and_the_first_failure_ends_the_others(tmp_path: Path) -> None:
    (tmp_path / "ranks.py").write_text(_RANK)
    ok = fresh_process.run_ranks([str(tmp_path / "ranks.py")], 2, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and ok.rank_exitcodes == [0, 0], ok.stderr  # type: ignore[attr-defined]
    assert "rank 0 of 2 0 True" in ok.stdout and "rank 1 of 2 1 True" in ok.stdout
    killed = fresh_process.run_ranks([str(tmp_path / "ranks.py"), "1"], 2, cwd=tmp_path, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.rank_exitcodes[1] == -signal.SIGKILL and killed.rank_exitcodes[0] != 0  # type: ignore[attr-defined]
    assert "[ranks] exit codes rank 0:" in killed.stderr


def test_this_package_is_imported_fresh_by_each_process(tmp_path: Path) -> None:
    # Not preloaded: a broken lazy import or an import-time side effect of ours shows in the process
    # that meets it, as it would for a user (the third-party modules stay preloaded).
    code = "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'nvcomp_checkpoint'))"
    real, forked = _both(["-c", code], tmp_path)
    assert real.returncode == forked.returncode == 0, (real.stderr, forked.stderr)
    assert forked.stdout == real.stdout == "[]\n"
    broken = tmp_path / "pkg"
    (broken / "nvcomp_checkpoint").mkdir(parents=True)
    (broken / "nvcomp_checkpoint" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    real, forked = _both(["-c", "import nvcomp_checkpoint"], tmp_path, PYTHONPATH=str(broken))
    assert real.returncode == forked.returncode == 1
    assert "broken on purpose" in real.stderr and "broken on purpose" in forked.stderr


_RANK_PROBE = """
import os
from lightning.fabric.utilities.rank_zero import rank_zero_only
print("rank", os.environ["RANK"], "rank_zero_only", rank_zero_only.rank)
"""


def test_ranks_see_their_rank_in_what_lightning_reads_at_import(tmp_path: Path) -> None:
    # Lightning sets rank_zero_only.rank from RANK when it is imported; the server imported it with no
    # RANK, so each forked rank must see its own as under torchrun.
    (tmp_path / "probe.py").write_text(_RANK_PROBE)
    out = fresh_process.run_ranks(["probe.py"], 2, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 0 rank_zero_only 0" in out.stdout and "rank 1 rank_zero_only 1" in out.stdout, out.stdout


def test_real_mode_runs_new_interpreters_and_refuses_an_unknown_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import sys; print('torch' in sys.modules)"
    assert fresh_process.run(["-c", code], cwd=tmp_path).stdout == "True\n"  # forked from the preloaded server
    monkeypatch.setenv("NVCKPT_TEST_PROCESSES", "real")
    assert fresh_process.mode() == "real" and fresh_process.start_method() == "spawn"
    assert fresh_process.run(["-c", code], cwd=tmp_path).stdout == "False\n"
    (tmp_path / "probe.py").write_text(_RANK_PROBE)
    ranks = fresh_process.run_ranks(["probe.py"], 2, cwd=tmp_path, timeout=120)
    assert ranks.returncode == 0 and ranks.rank_exitcodes is None, ranks.stderr  # type: ignore[attr-defined]
    assert "rank 1 rank_zero_only 1" in ranks.stdout
    monkeypatch.setenv("NVCKPT_TEST_PROCESSES", "fast")
    with pytest.raises(ValueError, match="NVCKPT_TEST_PROCESSES='fast'"):
        fresh_process.run(["-c", code], cwd=tmp_path)


@pytest.mark.parametrize("process_mode", ["forked", "real"])
def test_a_rank_killed_by_a_signal_is_named_in_either_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, process_mode: str
) -> None:
    # torchrun returns 1 for a rank killed by SIGKILL (and names -9 in its summary); forked ranks return -9.
    monkeypatch.setenv("NVCKPT_TEST_PROCESSES", process_mode)
    (tmp_path / "die.py").write_text(
        "import os, signal\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = fresh_process.run_ranks(["die.py"], 2, cwd=tmp_path, timeout=120)
    assert out.returncode != 0 and fresh_process.ended_by_signal(out) == signal.SIGKILL, (out.returncode, out.stderr[-2000:])
    ok = fresh_process.run_ranks(["-c", "pass"] if process_mode == "forked" else ["die.py"], 1, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and fresh_process.ended_by_signal(ok) is None, ok.stderr[-2000:]
