#!/usr/bin/env bash
# GPU check of nvcomp-checkpoint: the gpu-marked tests, the codec benchmark, then sync/async
# saves of a GPU-resident checkpoint. Runs on the GPU machine (python3 3.12 with PyTorch, no
# network) from the repo root, with the wheels carried in .whl/ (git-ignored). The steps' timeouts
# add up to 420 s (typically far less); give the device tool timeout_s=600.
#
# Fetch the wheels here first (the GPU machine's python3 is 3.12, its driver is CUDA 13):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 zstandard==0.25.0
# (nvidia-nvcomp-cu13 holds the Python module, nvidia-libnvcomp-cu13 the libnvcomp.so.6 it loads;
# zstandard is the CPU codec's dependency, absent from that machine's image.)
# Then run it through the device tool: command "bash benchmarks/gpu_check.sh", carry [".whl"].
# Results also land in $OUT (pytest log, benchmark log and JSON) when the tool sets OUT.

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: no wheels in .whl/; download them first (see the header of $0)" >&2
    exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD/src

# If the image's own `nvidia` directory is a regular package (it has an __init__.py), it hides
# the namespace portion in /tmp/site: then install the wheels into the interpreter itself.
if ! "$PY" -c "import nvidia.nvcomp" 2>/dev/null; then
    echo "gpu_check: nvidia.nvcomp not importable from /tmp/site; installing the wheels into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 2
fi

echo "== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" - <<'EOF' || echo "gpu_check: the version check failed (above); the GPU tests will say why they skip"
import sys, torch, zstandard
from nvidia import nvcomp
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" cuda available {torch.cuda.is_available()}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}")
print(f"nvCOMP {nvcomp.__version__} (CUDA {nvcomp.__cuda_version__}) from {nvcomp.__file__}; zstandard {zstandard.__version__}")
EOF

echo "== gpu-marked tests"
# Only the modules that hold gpu-marked tests: collecting the whole suite would import Lightning,
# Transformers and moto, which the image may lack. A per-test timeout (pytest-timeout, when the
# image has it) keeps one hung nvCOMP call from eating the step and its log.
PER_TEST=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=90")
timeout 170 "$PY" -m pytest tests/test_gpu_codecs.py tests/test_gpu_save.py tests/test_async.py -m gpu -q \
    -p no:cacheprovider $PER_TEST -rfEsxX 2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark"
timeout 150 "$PY" benchmarks/gpu_codec_bench.py --size-mib 128 --repeats 2 --budget-s 110 --json "$OUT/gpu_codec_bench.json" 2>&1 | tee "$OUT/gpu_codec_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== async / sync saves of a GPU-resident checkpoint"
timeout 100 "$PY" benchmarks/gpu_async_bench.py --mb 512 --reps 2 --json "$OUT/gpu_async_bench.json" 2>&1 | tee "$OUT/gpu_async_bench.log"
async_rc=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc, async benchmark exit $async_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$async_rc" -eq 0 ]
