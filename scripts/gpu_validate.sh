#!/usr/bin/env bash
# Builds pycomm with its CUDA kernels on a GPU machine and validates them, in one call:
#   1. build pycomm._C (USE_CUDA=1, sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise) in a copy
#      of the checkout ($GPU_VALIDATE_TREE, default /tmp/pycomm-gpu-validate), so that the
#      checkout's own in-place build is never replaced
#   2. the toolchain (sysconfig, flags, compiler) and tests/test_build.py: the built _C shares
#      torch's libstdc++ and an error message with an integer raises instead of crashing
#   3. scripts/gpu_validate.py: every op against pycomm.reference on fresh random data, then
#      the timing table against the device's copy bandwidth (25 MB buckets)
#   4. where ncu is installed, Nsight Compute on the decoder kernels ($OUT/ncu_decoders.txt)
#   5. pytest on the GPU: the kernel cases of tests/test_ops.py and tests/test_codecs.py on
#      their cuda backend, and tests/test_cuda.py: streams, opcheck, and the hooks on CUDA
#      tensors (2 ranks sharing the GPU over gloo, NCCL at world size 1); the cpu and emulated
#      backends are left to CI (make test, scripts/cuda_check.sh), they need no GPU
#   6. python -m pycomm.bench --device cuda: 2 ranks sharing the GPU over gloo, --link 10gbit,
#      a GPT-2 small sized transformer, the hooks side by side with their peak GPU memory
# Logs, tables and JSON go to $OUT (the device tool's folder that comes back), else to
# gpu_validate_out/. Nothing is installed: the machine's python3 and torch are used as found.
#
#   scripts/gpu_validate.sh [--skip-build] [--skip-pytest] [--skip-bench] [--cpu]
#                           [gpu_validate.py arguments]
#
# --cpu: a dry run of this script on a machine without a GPU (the CPU kernels stand in for the
# CUDA ones; the build still needs a torch with CUDA and nvcc, e.g. PYTHON=.venv-cuda/bin/python
# CUDA_HOME=/usr/local/cuda CPATH=.venv-cuda/lib/python3.11/site-packages/nvidia/cu13/include).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_validate_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUILD=1
PYTEST=1
BENCH=1
CPU=0
ARGS=()
for a in "$@"; do
  case $a in
    --skip-build) BUILD=0 ;;
    --skip-pytest) PYTEST=0 ;;
    --skip-bench) BENCH=0 ;;
    --cpu)
      CPU=1
      ARGS+=("$a")
      ;;
    *) ARGS+=("$a") ;;
  esac
done
if [ "$CPU" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_validate: no CUDA device here (scripts/cuda_check.sh is the check for CPU machines)"
  exit 2
fi
TREE=${GPU_VALIDATE_TREE:-${TMPDIR:-/tmp}/pycomm-gpu-validate}
# a fresh copy to build in; --skip-build refreshes the sources and keeps the last build
[ "$BUILD" = 1 ] && rm -rf "$TREE"
mkdir -p "$TREE"
tar --exclude=./.git --exclude='./.venv*' --exclude='./build*' --exclude='*.so' \
  --exclude=./gpu_validate_out -cf - . | tar -xf - -C "$TREE"
cd "$TREE"
ROOT=$PWD
export USE_CUDA=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYCOMM_EXPECT_CUDA=1
# headers of the pip CUDA 13 wheels (cuBLAS, cuSPARSE, ...), searched after the toolkit's own
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -d "$SITE/nvidia/cu13/include" ] && export CPATH=${CPATH:+$CPATH:}$SITE/nvidia/cu13/include
STATUS=0
T0=$(date +%s)
LAST=$T0
phase() {
  local now
  now=$(date +%s)
  echo "gpu_validate: $1 took $((now - LAST)) s (total $((now - T0)) s)"
  LAST=$now
}

if [ "$CPU" = 0 ]; then
  { nvidia-smi || true; } 2>&1 | tee "$OUT/nvidia-smi.txt"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
else
  export PYCOMM_CUDA_EMU=0  # the dry run checks this script, not the kernels
fi

if [ "$BUILD" = 1 ]; then
  if ! "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    echo "gpu_validate: the build failed (log in $OUT/build.log)"
    exit 1
  fi
  grep -E "csrc/cuda/.*(warning|error)" "$OUT/build.log" | head -20
  phase build
fi

# The toolchain as the build saw it. A _C linked with a private libstdc++ (-static-libstdc++
# from the interpreter's sysconfig or LDFLAGS) segfaulted here on its first error message with
# an integer; setup.py strips the flag and refuses such a build, tests/test_build.py checks it.
{
  grep "pycomm setup:" "$OUT/build.log"
  "$PY" - <<'PYEOF'
import os, platform, subprocess, sysconfig
print("python", platform.python_version(), sysconfig.get_config_var("prefix"))
for k in ("CC", "CXX", "LDSHARED", "LDFLAGS", "CFLAGS", "LDCXXSHARED"):
    print(f"sysconfig {k} = {sysconfig.get_config_var(k)!r}")
for k in ("CC", "CXX", "LDFLAGS", "CFLAGS", "CXXFLAGS"):
    print(f"env {k} = {os.environ.get(k)!r}")
print(subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
from pycomm import _buildcheck
import glob
for so in glob.glob("pycomm/_C*.so"):
    r = _buildcheck.inspect(so)
    print(so, "needs", ", ".join(r.needed))
    print("C++ runtime problems:", _buildcheck.check(so) or "none")
PYEOF
} 2>&1 | tee "$OUT/toolchain.txt"
"$PY" -m pytest -q -p no:cacheprovider tests/test_build.py 2>&1 | tee "$OUT/pytest_build.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || STATUS=1
phase build-check

"$PY" scripts/gpu_validate.py --out "$OUT" ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/gpu_validate.log"
[ "${PIPESTATUS[0]}" = 0 ] || STATUS=1
phase validate

# Nsight Compute on the decoders, where ncu is installed: the first launch of each decoder
# kernel (each template instance: mangled names) in a timing pass of one replay; speed of light
# (memory throughput), occupancy and launch statistics (registers a thread)
if [ "$CPU" = 0 ] && command -v ncu >/dev/null 2>&1; then
  timeout 240 ncu --kernel-name-base mangled --kernel-id ::regex:sum_rows_kernel:1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    "$PY" scripts/gpu_validate.py --skip-checks --reps 1 --out "$OUT/ncu_run" \
    >"$OUT/ncu_decoders.txt" 2>&1 || echo "gpu_validate: ncu did not finish (ncu_decoders.txt)"
  grep -E "sum_rows_kernel|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per" \
    "$OUT/ncu_decoders.txt" | head -60
  phase ncu
fi

if [ "$PYTEST" = 1 ]; then
  # the kernel cases' cuda backend (test_ops, test_codecs) and the whole of test_cuda.py
  "$PY" -m pytest -q -p no:cacheprovider -k "cuda and not emu" tests/test_ops.py \
    tests/test_codecs.py tests/test_cuda.py 2>&1 \
    | tee "$OUT/pytest_cuda.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || STATUS=1
  phase pytest
fi
# pycomm.bench on the GPU: 2 ranks sharing it over gloo with CUDA tensors, a GPT-2 small sized
# transformer (124M parameters); --link 10gbit is shaped where tc and root allow, else the run
# says it is unshaped. --cpu: the same flags' plumbing on the CPU with a small model.
if [ "$BENCH" = 1 ]; then
  if [ "$CPU" = 0 ]; then
    BENCH_ARGS=(--device cuda --backend gloo --model transformer --layers 12 --d-model 768
      --heads 12 --seq-len 1024 --vocab 50257 --batch 8 --steps 10 --warmup 3 --error-steps 1)
  else
    BENCH_ARGS=(--model transformer --layers 2 --d-model 64 --heads 4 --seq-len 32 --vocab 512
      --batch 2 --steps 2 --warmup 2 --error-steps 1)
  fi
  "$PY" -m pycomm.bench --nprocs 2 --link 10gbit --hooks ddp,torch-fp16,allreduce,bf16,int8,onebit \
    --step-timeout 60 --timeout 400 --quiet --json "$OUT/bench_cuda.json" "${BENCH_ARGS[@]}" 2>&1 \
    | tee "$OUT/bench_cuda.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || STATUS=1
  phase bench
fi
# the table again, last, where the reply's tail shows it
sed -n '/copy of 1 GiB/,$p' "$OUT/gpu_validate.log"
echo "gpu_validate: exit status $STATUS"
exit $STATUS
