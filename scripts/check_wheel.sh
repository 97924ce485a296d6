#!/usr/bin/env bash
# Builds the sdist and the wheel (the wheel from the sdist, as pip builds one from PyPI), checks
# them (twine: metadata, README rendering; entry points, extras, py.typed), installs the wheel into
# a new virtual environment and uses it there: import, `nvckpt --version` and `nvckpt inspect`,
# a save and a load, the Lightning integration and its entry point.
#
# The new environment is clean of this package: it has no system site-packages and no checkout on
# its path (run from a temporary folder, PYTHONPATH empty), and the check asserts the package
# imports from the environment's own site-packages. Its heavy dependencies (torch, Lightning ...)
# come from the running environment's site-packages through a folder of links that leaves out
# nvcomp-checkpoint itself (the editable install), so pip resolves the wheel's declared
# requirements and extras against them without downloading anything.
#
# Usage: bash scripts/check_wheel.sh   (in an environment with the test extra: build, twine)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd -P)"
PY="${PYTHON:-python}"
"$PY" -c "import build, twine" 2>/dev/null || {
  echo "check_wheel.sh: needs build and twine: pip install -e '.[test]'" >&2
  exit 1
}
started=$SECONDS
work="$(mktemp -d "${TMPDIR:-/tmp}/nvckpt-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# 1. sdist, then the wheel built from it (a file missing from the sdist fails here). No isolation:
# the build backend of the running environment (setuptools, as pyproject.toml requires), no download.
"$PY" -m build --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
wheel="$(ls "$work"/dist/*.whl)"
sdist="$(ls "$work"/dist/*.tar.gz)"

# 2. The metadata: twine's checks (README renders as the long description), then what twine does not check.
"$PY" -m twine check --strict "$wheel" "$sdist"
"$PY" - "$wheel" "$sdist" <<'EOF'
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
problems = []
for extra in ("s3", "lightning", "accelerate", "transformers", "deepspeed", "metrics", "cu12", "cu13", "all", "test"):
    if f"Provides-Extra: {extra}" not in meta:
        problems.append(f"extra {extra!r} missing from METADATA")
for req in ("torch", "numpy", "zstandard", "xxhash", "fsspec", "rich"):
    if not any(line.startswith(f"Requires-Dist: {req}") for line in meta.splitlines()):
        problems.append(f"requirement {req!r} missing from METADATA")
if "Description-Content-Type: text/markdown" not in meta:
    problems.append("the README is not declared as markdown")
if "nvckpt = nvcomp_checkpoint.cli.main:main" not in entry:
    problems.append("console script nvckpt missing")
if "[lightning.pytorch.callbacks_factory]" not in entry:
    problems.append("Lightning's callbacks_factory entry point missing")
for needed in ("nvcomp_checkpoint/py.typed", "nvcomp_checkpoint/cli/main.py", "nvcomp_checkpoint/integrations/lightning.py"):
    if needed not in names:
        problems.append(f"{needed} missing from the wheel")
if any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names):
    problems.append("the wheel carries tests, benchmarks or examples")
members = tarfile.open(sdist).getnames()
for needed in ("README.md", "pyproject.toml", "setup.py", "src/nvcomp_checkpoint/__init__.py", "src/nvcomp_checkpoint/filters/_planes.c"):
    if not any(m.endswith("/" + needed) for m in members):
        problems.append(f"{needed} missing from the sdist")
if problems:
    sys.exit("check_wheel.sh: " + "; ".join(problems))
print(f"check_wheel.sh: {len(names)} files in the wheel; metadata, extras and entry points present")
EOF

# 3. A new environment: no system site-packages, no pip of its own (the running one installs into it).
"$PY" -m venv --without-pip "$work/venv"
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" - "$work/deps" <<'EOF'
# Links to every distribution of the running environment except nvcomp-checkpoint (its editable
# install would hand pip and Python this checkout instead of the wheel).
import os, re, sys, sysconfig
src, dst = sysconfig.get_paths()["purelib"], sys.argv[1]
os.makedirs(dst)
for name in os.listdir(src):
    if re.match(r"(__editable__|_?nvcomp_checkpoint|nvcomp-checkpoint)", name, re.I) or name.endswith(".pth"):
        continue
    os.symlink(os.path.join(src, name), os.path.join(dst, name))
EOF
echo "$work/deps" >"$site/running-environment-deps.pth"
# Resolved without an index: every requirement of the core and of the two extras must be met.
PYTHONPATH= "$PY" -m pip --python "$work/venv/bin/python" install -q --no-index --find-links "$work/dist" \
  "nvcomp-checkpoint[s3,lightning]" 2>&1 | grep -v -e "^WARNING: Location" -e '^$' >&2 || true
PYTHONPATH= "$PY" -m pip --python "$work/venv/bin/python" show -q nvcomp-checkpoint >/dev/null

# 4. Use it, from a folder with nothing of the checkout in it.
mkdir "$work/use"
cd "$work/use"
export PYTHONPATH=
# Output captured first: `cmd | grep -q` under pipefail fails when grep stops reading early (SIGPIPE).
version="$("$work/venv/bin/nvckpt" --version)"
grep -q "^nvckpt (nvcomp-checkpoint) " <<<"$version"
"$work/venv/bin/python" - "$work/venv" "$root" <<'EOF'
import importlib.metadata, os, sys
venv, root = (os.path.realpath(p) for p in sys.argv[1:])
import torch
import nvcomp_checkpoint as nc
where = os.path.realpath(nc.__file__)
assert where.startswith(venv + os.sep) and not where.startswith(root + os.sep), f"imported from {where}, not the new environment"
state = {"w": torch.randn(256, 256), "step": 3}
report = nc.save(state, "c.nvc")
back = nc.load("c.nvc")
assert torch.equal(back["w"], state["w"]) and back["step"] == 3 and report.stored_bytes == os.path.getsize("c.nvc")
import shutil
from nvcomp_checkpoint.filters import KERNELS
# The wheel was built here, where a C compiler is: its byte-plane kernel must be in it and load.
assert KERNELS == "compiled" or not shutil.which("cc"), f"the wheel's byte-plane code is {KERNELS!r}, not the compiled kernel"
from nvcomp_checkpoint.lightning import NvcompCheckpointIO  # the integration and its extra's requirement
NvcompCheckpointIO()
group = importlib.metadata.entry_points(group="lightning.pytorch.callbacks_factory")
assert any(e.value == "nvcomp_checkpoint.integrations.lightning_entry:callbacks" for e in group), list(group)
print(f"check_wheel.sh: the wheel imports from {os.path.dirname(where)}; save, load and the Lightning plugin work")
EOF
inspected="$("$work/venv/bin/nvckpt" inspect --no-tree c.nvc)"
grep -q "nvcomp-checkpoint" <<<"$inspected"
echo "check_wheel.sh: $(basename "$wheel") and $(basename "$sdist") check out ($((SECONDS - started)) s)"
