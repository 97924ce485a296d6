#!/usr/bin/env bash
# Sets up .venv and runs the demo: train a tiny model, save compressed checkpoints, resume, report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python examples/demo.py "$@"
