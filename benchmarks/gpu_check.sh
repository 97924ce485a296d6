#!/usr/bin/env bash
# GPU check of nvcomp-checkpoint: the gpu-marked tests, the codec benchmark, then sync/async
# saves of a GPU-resident checkpoint. Runs on the GPU machine (python3 3.12 with PyTorch, no
# network) from the repo root, with the wheels carried in .whl/ (git-ignored). The steps' timeouts
# add up to 520 s (typically far less); give the device tool timeout_s=600.
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
"$PY" - <<'EOF' || exit 2
import sys, torch, zstandard
from nvidia import nvcomp
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" cuda available {torch.cuda.is_available()}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}")
print(f"nvCOMP {nvcomp.__version__} (CUDA {nvcomp.__cuda_version__}) from {nvcomp.__file__}; zstandard {zstandard.__version__}")
EOF

echo "== gpu-marked tests"
# --continue-on-collection-errors: a test module of the suite that cannot import here (a
# dependency missing from the image) must not hide the results of the GPU tests.
timeout 150 "$PY" -m pytest tests/test_gpu_codecs.py tests -m gpu -q -p no:cacheprovider \
    --continue-on-collection-errors -rfEsxX 2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark"
timeout 250 "$PY" benchmarks/gpu_codec_bench.py --budget-s 200 --json "$OUT/gpu_codec_bench.json" 2>&1 | tee "$OUT/gpu_codec_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== async / sync saves of a GPU-resident checkpoint"
timeout 120 "$PY" benchmarks/gpu_async_bench.py --mb 1024 --json "$OUT/gpu_async_bench.json" 2>&1 | tee "$OUT/gpu_async_bench.log"
async_rc=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc, async benchmark exit $async_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$async_rc" -eq 0 ]
