#!/usr/bin/env bash
# GPU check of nvcomp-checkpoint, made to fit one device loan twice: install the carried wheels,
# the gpu-marked tests, the codec benchmark (the writer's GPU settings next to smaller chunks), and
# sync/async saves of a checkpoint trained on the GPU with bit-exact CPU and GPU reloads. Prints
# ONE table and writes it to $OUT/gpu_check_table.md (with the logs and JSON it is made from).
#
# Step limits: install 20 + versions 15 + tests 95 + codec bench 55 + saves 45 + framework wheels 60
# + sharded checkpoints 150 + DeepSpeed 60 + table 4 = 504 s, under 8.5 minutes; give the device tool
# timeout_s=520 (the machine's start is not in it).
#
# Wheels (git-ignored .whl/, ~38 MiB; the device image has Python 3.12, torch 2.11 for CUDA 13,
# numpy, xxhash, fsspec, rich, pytest and pytest-timeout, but not these):
#   nvidia-nvcomp-cu13==6.0.0.12     the nvidia.nvcomp Python module
#   nvidia-libnvcomp-cu13==6.0.0.12  the libnvcomp.so.6 it loads
#   zstandard==0.25.0 (cp312)        the CPU codec
# Fetch them here, from the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 zstandard==0.25.0
# The sharded-checkpoint step (benchmarks/gpu_fsdp_check.py: Accelerate FSDP1/FSDP2, the HF Trainer
# with FSDP2, Lightning's NvcompFSDPStrategy, CUDA shards through NvcompWriter) needs Accelerate,
# Transformers and Lightning, which the image lacks: 21 wheels (~23 MiB, git-ignored .whl-fw/):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-fw \
#     accelerate==1.15.0 transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
#     regex==2026.11.19 pyyaml==6.0.4 psutil==7.2.2 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 \
#     h11==0.16.0 certifi==2026.10.19.post1 idna==3.20 click==8.5.1 typer==0.29.2 shellingham==1.5.4 \
#     lightning==2.6.6 lightning_utilities==0.15.3 torchmetrics==1.8.2
# Run through the device tool: command "bash benchmarks/gpu_check.sh", carry [".whl", ".whl-fw"]
# (about 61 MiB of the tool's 64).
#
# DRY_RUN=1 runs every step here, without a GPU: the wheels are installed for Python 3.12 into a
# scratch folder (never into this interpreter), the tests are collected and skip, the codec
# benchmark runs its CPU rows, the save benchmark runs on the CPU, and the table is made.
# Environment: PYTHON (default python3), OUT (default /tmp/gpu_check_out), SITE (default /tmp/site).

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
SITE=${SITE:-/tmp/site}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.tsv"
: >"$LOG"
: >"$STEPS"
started=$(date +%s.%N)

# step NAME LIMIT COMMAND...: run COMMAND under a time limit, append its output to the log, and
# record its exit code and seconds for the table.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)" | tee -a "$LOG"
    local t0 t1 rc
    t0=$(date +%s.%N)
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")" "$limit" >>"$STEPS"
    return "$rc"
}

install_wheels() {
    local wheels=(.whl/*.whl)
    local want
    for want in nvidia_nvcomp_cu13-6.0.0.12 nvidia_libnvcomp_cu13-6.0.0.12 zstandard-0.25.0-cp312; do
        if ! ls .whl/"$want"*.whl >/dev/null 2>&1; then
            echo "gpu_check: .whl/ lacks $want; fetch the wheels as the header of $0 says"
            return 2
        fi
    done
    if [ "${#wheels[@]}" -ne 3 ]; then
        echo "gpu_check: .whl/ must hold exactly the 3 wheels named in $0, found: ${wheels[*]}"
        return 2
    fi
    local for_312=()
    if [ "$DRY_RUN" = 1 ]; then
        # The device's Python is 3.12: prove the three install there, then keep this
        # interpreter's own zstandard (the cp312 build does not load here).
        for_312=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
            --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
            --platform manylinux2014_x86_64)
    fi
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${for_312[@]}" "${wheels[@]}" || return 2
    [ "$DRY_RUN" = 1 ] && rm -rf "$SITE"/zstandard "$SITE"/zstandard-*
    # The image's own `nvidia` folder may be a regular package (with an __init__.py) that hides
    # the namespace portion in $SITE: then install the nvCOMP wheels into the interpreter itself.
    if ! PYTHONPATH="$SITE" "$PY" -c "import nvidia.nvcomp" 2>/dev/null; then
        if [ "$DRY_RUN" = 1 ]; then
            echo "gpu_check: nvidia.nvcomp does not import from $SITE (dry run: this interpreter is left alone)"
            return 1
        fi
        echo "gpu_check: nvidia.nvcomp not importable from $SITE; installing the nvCOMP wheels into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/nvidia_*.whl || return 2
    fi
    echo "installed: ${wheels[*]}"
}

versions() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
    "$PY" - "$OUT/versions.json" <<'EOF'
import glob, json, sys
import torch, zstandard
from nvidia import nvcomp
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
text = (f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), {gpu}, "
        f"nvCOMP {nvcomp.__version__} (CUDA {nvcomp.__cuda_version__}), zstandard {zstandard.__version__}")
print(text)
wheels = ", ".join(sorted(p.split("/")[-1].split("-")[0] + " " + p.split("/")[-1].split("-")[1] for p in glob.glob(".whl/*.whl")))
json.dump({"text": text, "wheels": wheels}, open(sys.argv[1], "w"))
EOF
}

# Accelerate, Transformers, Lightning and what they import, for the sharded-checkpoint step.
install_frameworks() {
    if ! ls .whl-fw/*.whl >/dev/null 2>&1; then
        echo "gpu_check: .whl-fw/ holds no wheels; fetch them as the header of $0 says"
        return 2
    fi
    if [ "$DRY_RUN" = 1 ]; then
        # Prove the set installs for the device's Python 3.12; this interpreter keeps its own copies.
        local scratch="$SITE-frameworks-dry"
        rm -rf "$scratch"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$scratch" \
            --python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 .whl-fw/*.whl || return 2
        rm -rf "$scratch"
    else
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl-fw/*.whl || return 2
    fi
    PYTHONPATH="$SITE" "$PY" -c "import accelerate, transformers, lightning; print('frameworks: accelerate', accelerate.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__)"
}

# `timeout` runs programs, not shell functions: the steps below run in a child bash.
export -f install_wheels versions install_frameworks
export PY SITE DRY_RUN OUT
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: DRY_RUN=1: every step runs on this machine's CPU" | tee -a "$LOG"
fi
step install 20 bash -c install_wheels
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
step versions 15 bash -c versions

# Only the modules holding gpu-marked tests: collecting the whole suite would import Lightning,
# Transformers and moto. A per-test limit (pytest-timeout is in the image) keeps one hung nvCOMP
# call from eating the step; a test that feeds nvCOMP bad input runs in a process of its own.
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=60)
step tests 95 "$PY" -m pytest tests/test_gpu_codecs.py tests/test_gpu_save.py tests/test_async.py tests/test_dcp.py -m gpu -q \
    -p no:cacheprovider "${PER_TEST[@]}" -rfEs --junitxml="$OUT/pytest.xml"

step codec_bench 55 "$PY" benchmarks/gpu_codec_bench.py --size-mib 64 --repeats 2 --budget-s 40 \
    --json "$OUT/gpu_codec_bench.json"

if [ "$DRY_RUN" = 1 ]; then
    step save_bench 45 "$PY" benchmarks/gpu_async_bench.py --device cpu --mb 32 --reps 1 --json "$OUT/gpu_async_bench.json"
else
    step save_bench 45 "$PY" benchmarks/gpu_async_bench.py --mb 512 --reps 2 --json "$OUT/gpu_async_bench.json"
fi

step install_frameworks 60 bash -c install_frameworks
# One row per case in the log ("gpu_fsdp_check: {...}"); the dry run runs the cases the CPU allows.
if [ "$DRY_RUN" = 1 ]; then
    step fsdp 150 "$PY" benchmarks/gpu_fsdp_check.py --device cpu --budget-s 120 --phase-timeout-s 90
else
    step fsdp 150 "$PY" benchmarks/gpu_fsdp_check.py --budget-s 120 --phase-timeout-s 60
fi

# Lightning's DeepSpeedStrategy refuses the CPU: NvcompDeepSpeedStrategy save/resume on the GPU (one
# process, ZeRO-2). DeepSpeed is not in the image nor in the carried wheels (they would pass the
# tool's 64 MiB): without it the step prints "skipped" and passes.
step deepspeed 60 "$PY" benchmarks/gpu_deepspeed_check.py

echo "== table" | tee -a "$LOG"
timeout 4 "$PY" benchmarks/gpu_check_table.py --out "$OUT" 2>&1 | tee -a "$LOG"
echo "gpu_check: $(awk "BEGIN{printf \"%.0f\", $(date +%s.%N) - $started}") s in all; table in $OUT/gpu_check_table.md" | tee -a "$LOG"
! awk -F'\t' '$2 != 0 { bad = 1 } END { exit !bad }' "$STEPS"
