#!/usr/bin/env bash
# Creates ./.venv (if needed) and installs the package with the given extras.
# torch is pinned first to the CPU build this machine kind ships; an unpinned torch would pull
# a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" || true
else
  python -m pip install -q -e . 2>&1 | grep -v "^WARNING: Location" || true
fi
python -c "import nvcomp_checkpoint" || { echo "setup failed: nvcomp_checkpoint does not import" >&2; exit 1; }
