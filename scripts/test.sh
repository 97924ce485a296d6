#!/usr/bin/env bash
# Sets up .venv with the test extras, checks the code's shape (ruff, mypy), and runs the whole test
# suite on the CPU in parallel (pytest-xdist). Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"      # the fast loop
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
. .venv/bin/activate
ruff check src tests benchmarks examples
ruff format --check -q src tests benchmarks examples || { echo "ruff format would change files: run 'ruff format src tests benchmarks examples'" >&2; exit 1; }
# The docs site (mkdocs.yml): every page, link, anchor and API reference entry, or the build fails
# (not with -q: mkdocs then no longer counts the warnings that --strict fails on).
site_dir="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site_dir" || { rm -rf "$site_dir"; echo "mkdocs build --strict failed: see the warnings above" >&2; exit 1; }
rm -rf "$site_dir"
# mypy's cache outside the checkout: a fresh clone (CI) re-checks only the files that changed.
# mypy validates each cached module by its source hash, so a stale entry is never used.
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/nvcomp-checkpoint/mypy}"
mypy
# The package as a user installs it: the sdist and wheel built, checked, installed into a new environment and used.
bash scripts/check_wheel.sh
set +e
python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --durations=25 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
# The whole suite (no arguments) also runs each integration's resume test once more with real
# interpreters and torchrun instead of processes forked from the preloaded server (tests/fresh_process.py).
if [ "$rc" -eq 0 ] && [ "$#" -eq 0 ]; then
  echo "test.sh: the resume tests again, as real processes (tests/real_process_tests.txt)" >&2
  set +e
  NVCKPT_TEST_PROCESSES=real python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" \
    $(grep -v -e '^#' -e '^$' tests/real_process_tests.txt)
  rc=$?
  set -e
fi
exit "$rc"
