"""``nvckpt`` before any command runs: ``--help`` and ``--version`` answer without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvcomp_checkpoint.cli.main import COMMANDS, build_parser

SRC = Path(__file__).resolve().parents[1] / "src"

# A real interpreter (not tests/fresh_process.py's fork, which has torch imported already): what is
# tested is what the interpreter imports. The modules it holds at exit are printed by an atexit hook.
_PROBE = """
import atexit, json, sys
atexit.register(lambda: sys.__stderr__.write("MODULES " + json.dumps(sorted(sys.modules)) + "\\n"))
from nvcomp_checkpoint.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _modules_after(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=60, env=env)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES "))
    return proc, set(json.loads(line[len("MODULES ") :]))


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["-q", "--help"], []])
def test_help_and_version_import_no_torch(args: list[str]) -> None:
    proc, modules = _modules_after(*args)
    assert "torch" not in modules and "numpy" not in modules, sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy"))
    if args == ["--version"]:
        assert proc.returncode == 0 and proc.stdout.startswith("nvckpt (nvcomp-checkpoint) "), proc
    elif args:
        assert proc.returncode == 0 and all(name in proc.stdout for name in COMMANDS), proc
    else:  # no command: a usage error, exit 2, naming the commands
        assert proc.returncode == 2 and "COMMAND" in proc.stderr, proc


def test_a_mistyped_command_is_a_usage_error_without_torch() -> None:
    proc, modules = _modules_after("inspct", "x.pt")
    assert proc.returncode == 2 and "invalid choice: 'inspct'" in proc.stderr, proc
    assert "torch" not in modules


def test_a_command_still_imports_what_it_needs() -> None:
    proc, modules = _modules_after("inspect", "--help")
    assert proc.returncode == 0 and "--depth" in proc.stdout, proc
    assert "nvcomp_checkpoint.cli.inspect" in modules


def test_the_command_table_is_the_command_modules_own() -> None:
    # The light parser answers --help from COMMANDS; the real one from each module's add_parser.
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {c.dest: c.help for c in sub._choices_actions} == COMMANDS
