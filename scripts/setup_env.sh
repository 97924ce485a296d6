#!/usr/bin/env bash
# Creates ./.venv (if needed) and installs the package with the given extras.
# torch is pinned first to the CPU build this machine kind ships; an unpinned torch would pull
# a multi-GB CUDA build. A second run with the same extras and the same pyproject.toml does not
# reinstall: a stamp in .venv records what was installed, and the package must still import
# from this checkout's src/. The install compiles the byte-plane kernel (setup.py) into src/ when a C
# compiler is there; without one it still succeeds and the numpy code runs instead.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=".venv/.nvcomp-checkpoint-installed-${extras:-base}"
# What the install depends on: the declared dependencies and the compiled byte-plane kernel's build.
want="$(python -c 'import hashlib; print(hashlib.sha256(b"".join(open(p, "rb").read() for p in ("pyproject.toml", "setup.py", "src/nvcomp_checkpoint/filters/_planes.c"))).hexdigest())')"
here="$(PYTHONPATH= python -c 'import os, nvcomp_checkpoint; print(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(nvcomp_checkpoint.__file__)))))' 2>/dev/null || true)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$here" = "$(pwd -P)" ] && python -c "import torch" 2>/dev/null; then
  exit 0
fi
# pip's own exit status decides (its warnings about the install location are filtered out).
pip_install() {
  local out rc=0
  out="$(python -m pip install -q "$@" 2>&1)" || rc=$?
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e '^$' >&2 || true
  return "$rc"
}
# pip is quiet: say what the next minutes are spent on (a fresh .venv takes a few minutes).
echo "setup_env.sh: installing nvcomp-checkpoint${extras:+[$extras]} and its dependencies into .venv (torch 2.13 CPU first; a few minutes the first time)..." >&2
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# DeepSpeed (a test extra) builds no C++ ops at install: the CPU tests need none (DS_BUILD_OPS=0).
export DS_BUILD_OPS=0
python -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
pip_install -e ".${extras:+[${extras}]}"
PYTHONPATH= python -c "import nvcomp_checkpoint" || { echo "setup failed: nvcomp_checkpoint does not import" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup_env.sh: .venv is ready" >&2
