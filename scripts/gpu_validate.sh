#!/usr/bin/env bash
# Builds pycomm with its CUDA kernels on a GPU machine and validates them. A lent device runs a
# command for at most 10 minutes and brings back at most 8 files of $OUT, so the work is split
# into calls that each fit with room to spare, and each writes at most 8 files:
#
#   scripts/gpu_validate.sh --quick       (~5-7 min on an H200) build; env; the correctness
#                                         sweep up to 2M elements and the timing table; pytest
#                                         on the GPU; Nsight Compute on the decoders if the
#                                         budget still allows it
#   scripts/gpu_validate.sh --bench-only  (~3-4 min) pycomm.bench --device cuda: a GPT-2 small
#                                         sized transformer, 2 ranks sharing the GPU over gloo
#                                         at --link 10gbit, and world size 1 on NCCL
#   scripts/gpu_validate.sh --sanitizer   compute-sanitizer memcheck and racecheck over the
#                                         kernel cases at small sizes
#   scripts/gpu_validate.sh               all but the sanitizer, the sweep at 25 MB (over 10
#                                         minutes on one call: for a machine of one's own)
#   scripts/gpu_validate.sh --cpu         the dry run on a machine without a GPU: every phase
#                                         that can run, with the CPU standing in for the GPU
#                                         (scripts/cuda_check.sh runs it in CI)
#
# What comes back ($OUT): env.txt (the device, torch, the toolchain, the build's csrc/cuda
# warnings, tests/repo/test_build.py), gpu_validate.log and .json, pytest_cuda.log,
# ncu_decoders.txt; bench.txt, bench_cuda.json, bench_nccl1.json; sanitizer.txt; build.log only
# when the build fails. The script counts them at the end and fails above 8.
#
# Steps (each phase prints its time):
#   1. build pycomm._C (USE_CUDA=1, sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise) in a copy
#      of the checkout ($GPU_VALIDATE_TREE, default /tmp/pycomm-gpu-validate), so that the
#      checkout's own in-place build is never replaced; --skip-build keeps the copy's last build
#      (and builds where there is none: a fresh machine)
#   2. env.txt: the device, torch, the toolchain as the build saw it, and tests/repo/test_build.py
#      (the built _C shares torch's libstdc++; an error message with an integer raises)
#   3. scripts/gpu_validate.py: every op against pycomm.reference on fresh random data, then
#      the timing table against the device's copy bandwidth
#   4. pytest on the GPU (--device-tests: the cuda backend's kernel cases of
#      tests/kernels/test_fusion_ops.py and tests/kernels/test_codec_ops.py, and the GPU tests of
#      tests/kernels/test_cuda.py; the fuzz cases are the emulator's), every outcome listed,
#      one test at most 120 s
#   5. Nsight Compute on the decoder kernels (registers, occupancy, memory throughput), with
#      its own timeout, where ncu is installed and the budget allows
#   6. the bench (--bench-only, or the full run)
#
# Environment: OUT (default gpu_validate_out/), PYTHON (default python3), GPU_VALIDATE_TREE,
# GPU_VALIDATE_BUDGET (seconds a --quick call may take before optional phases are skipped;
# default 420), TORCH_CUDA_ARCH_LIST, MAX_JOBS. Nothing is installed: the machine's python3 and
# torch are used as found.
#
# --cpu needs a torch with CUDA and nvcc for the build (e.g. PYTHON=.venv-cuda/bin/python
# CUDA_HOME=/usr/local/cuda CPATH=.venv-cuda/lib/python3.11/site-packages/nvidia/cu13/include),
# or --skip-build with GPU_VALIDATE_TREE naming a tree already built that way.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_validate_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUILD=1
VALIDATE=1
PYTEST=1
NCU=1
BENCH=1
SANITIZER=0
CPU=0
QUICK=0
ARGS=()
for a in "$@"; do
  case $a in
    --skip-build) BUILD=0 ;;
    --skip-pytest) PYTEST=0 ;;
    --skip-bench) BENCH=0 ;;
    --quick) QUICK=1 BENCH=0 ;;
    --bench-only) VALIDATE=0 PYTEST=0 NCU=0 BENCH=1 ;;
    --sanitizer) VALIDATE=0 PYTEST=0 NCU=0 BENCH=0 SANITIZER=1 ;;
    --cpu)
      CPU=1
      ARGS+=("$a")
      ;;
    *) ARGS+=("$a") ;;
  esac
done
if [ "$CPU" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_validate: no CUDA device here (--cpu is the dry run for a machine without one)"
  exit 2
fi
BUDGET=${GPU_VALIDATE_BUDGET:-420}
TREE=${GPU_VALIDATE_TREE:-${TMPDIR:-/tmp}/pycomm-gpu-validate}
SRC=$PWD
# a build is kept only with --skip-build, and only where there is one
if [ "$BUILD" = 0 ] && ! ls "$TREE"/pycomm/_C*.so >/dev/null 2>&1; then
  echo "gpu_validate: no build in $TREE: building it"
  BUILD=1
fi
[ "$BUILD" = 1 ] && [ -z "${GPU_VALIDATE_TREE:-}" ] && rm -rf "$TREE"
mkdir -p "$TREE"
if [ "$(cd "$TREE" && pwd)" != "$SRC" ]; then
  tar --exclude=./.git --exclude='./.venv*' --exclude='./build*' --exclude='*.so' \
    --exclude=./gpu_validate_out -cf - . | tar -xf - -C "$TREE"
fi
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
elapsed() { echo $(($(date +%s) - T0)); }
ENV_TXT=$OUT/env.txt
: >"$ENV_TXT"

if [ "$CPU" = 0 ]; then
  { nvidia-smi || true; } >>"$ENV_TXT" 2>&1
else
  export PYCOMM_CUDA_EMU=0 # the dry run checks this script and the host code, not the kernels
  echo "gpu_validate: dry run on the CPU (no GPU here)" | tee -a "$ENV_TXT"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no device')" \
  2>&1 | tee -a "$ENV_TXT"

# the build's log stays in the tree (torch's headers warn a lot); env.txt gets what nvcc says
# about csrc/cuda, and $OUT the whole log only when the build fails
if [ "$BUILD" = 1 ]; then
  if ! "$PY" setup.py -q build_ext --inplace >"$ROOT/build.log" 2>&1; then
    cp "$ROOT/build.log" "$OUT/build.log"
    tail -40 "$OUT/build.log"
    echo "gpu_validate: the build failed (log in $OUT/build.log)"
    exit 1
  fi
  { echo "--- build: csrc/cuda warnings"; grep -E "csrc/cuda/.*(warning|error)" "$ROOT/build.log"; } \
    | tee -a "$ENV_TXT" | head -20
  phase build
fi

# The toolchain as the build saw it. A _C linked with a private libstdc++ (-static-libstdc++
# from the interpreter's sysconfig or LDFLAGS) segfaulted here on its first error message with
# an integer; setup.py strips the flag and refuses such a build, tests/repo/test_build.py checks it.
{
  echo "--- the toolchain"
  [ -f "$ROOT/build.log" ] && grep "pycomm setup:" "$ROOT/build.log"
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
  echo "--- tests/repo/test_build.py"
} >>"$ENV_TXT" 2>&1
"$PY" -m pytest -q -p no:cacheprovider tests/repo/test_build.py >>"$ENV_TXT" 2>&1
[ $? = 0 ] || {
  STATUS=1
  echo "gpu_validate: tests/repo/test_build.py failed (env.txt)"
}
tail -1 "$ENV_TXT"
phase build-check

if [ "$VALIDATE" = 1 ]; then
  # --quick: the sweep up to 2M elements (the 25 MB one takes minutes of CPU references)
  QUICK_ARGS=()
  [ "$QUICK" = 1 ] && [ "$CPU" = 0 ] && QUICK_ARGS=(--big 2000003)
  "$PY" scripts/gpu_validate.py --out "$OUT" ${QUICK_ARGS[@]+"${QUICK_ARGS[@]}"} \
    ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/gpu_validate.log"
  [ "${PIPESTATUS[0]}" = 0 ] || STATUS=1
  phase validate
fi

if [ "$PYTEST" = 1 ]; then
  # the tests that run on the GPU, selected by fixture and backend (not -k, which would match
  # the module name test_cuda.py); --cpu-stand-in runs those that need no device kernel on the
  # CPU and lists the others as skipped
  STAND_IN=()
  [ "$CPU" = 1 ] && STAND_IN=(--cpu-stand-in)
  "$PY" -m pytest -q -p no:cacheprovider -rfEsxXp --timeout 120 --device-tests \
    ${STAND_IN[@]+"${STAND_IN[@]}"} tests/kernels/test_fusion_ops.py \
    tests/kernels/test_codec_ops.py tests/kernels/test_cuda.py >"$OUT/pytest_cuda.log" 2>&1
  [ $? = 0 ] || STATUS=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.log" | tail -20
  phase pytest
fi

# Nsight Compute on the decoders, where ncu is installed and time is left: the first launch of
# each decoder kernel (each template instance: mangled names) in a timing pass of one replay;
# speed of light (memory throughput), occupancy and launch statistics (registers a thread)
if [ "$NCU" = 1 ] && [ "$CPU" = 0 ] && command -v ncu >/dev/null 2>&1; then
  if [ "$QUICK" = 1 ] && [ $(($(elapsed) + 150)) -gt "$BUDGET" ]; then
    echo "gpu_validate: ncu skipped: $(elapsed) s of the ${BUDGET} s budget spent"
  else
    NCU_RUN=$(mktemp -d) # the profiled run's JSON stays out of $OUT
    timeout 120 ncu --kernel-name-base mangled --kernel-id ::regex:sum_rows_kernel:1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      "$PY" scripts/gpu_validate.py --skip-checks --reps 1 --mb 8 --out "$NCU_RUN" \
      >"$OUT/ncu_decoders.txt" 2>&1 || echo "gpu_validate: ncu did not finish (ncu_decoders.txt)"
    rm -rf "$NCU_RUN"
    grep -E "sum_rows_kernel|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per" \
      "$OUT/ncu_decoders.txt" | head -60
    phase ncu
  fi
fi

# pycomm.bench on the GPU: 2 ranks sharing it over gloo with CUDA tensors, a GPT-2 small sized
# transformer (124M parameters); --link 10gbit is shaped where tc and root allow, else the run
# says it is unshaped. Then world size 1 on NCCL. --cpu: the same flags' plumbing on the CPU
# with a small model.
if [ "$BENCH" = 1 ]; then
  if [ "$CPU" = 0 ]; then
    MODEL=(--device cuda --model transformer --layers 12 --d-model 768 --heads 12
      --seq-len 1024 --vocab 50257 --batch 8 --steps 10 --warmup 3 --error-steps 1)
    NCCL=(--backend nccl)
  else
    MODEL=(--model transformer --layers 2 --d-model 64 --heads 4 --seq-len 32 --vocab 512
      --batch 2 --steps 2 --warmup 2 --error-steps 1)
    NCCL=(--backend gloo) # the stand-in has no NCCL
  fi
  "$PY" -m pycomm.bench --nprocs 2 --backend gloo --link 10gbit \
    --hooks ddp,torch-fp16,allreduce,bf16,int8,int4,fp8,onebit --step-timeout 60 --timeout 300 \
    --quiet --json "$OUT/bench_cuda.json" "${MODEL[@]}" >"$OUT/bench.txt" 2>&1
  [ $? = 0 ] || STATUS=1
  tail -25 "$OUT/bench.txt"
  phase bench-gloo
  "$PY" -m pycomm.bench --nprocs 1 "${NCCL[@]}" --hooks ddp,allreduce,bf16,int8,int4,fp8,onebit \
    --step-timeout 60 --timeout 200 --quiet --json "$OUT/bench_nccl1.json" "${MODEL[@]}" \
    >"$OUT/bench_nccl1.txt" 2>&1
  [ $? = 0 ] || STATUS=1
  { echo "=== world size 1, ${NCCL[*]}"; cat "$OUT/bench_nccl1.txt"; } >>"$OUT/bench.txt"
  rm -f "$OUT/bench_nccl1.txt"
  tail -15 "$OUT/bench.txt"
  phase bench-world-1
fi

# compute-sanitizer over the kernel cases at small sizes (no timing): memcheck (out-of-bounds
# and misaligned accesses, leaks of device memory), then racecheck (shared-memory hazards)
if [ "$SANITIZER" = 1 ]; then
  if [ "$CPU" = 1 ] || ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "gpu_validate: compute-sanitizer skipped (no GPU or not installed)" | tee "$OUT/sanitizer.txt"
  else
    SAN_RUN=$(mktemp -d)
    for tool in memcheck racecheck; do
      echo "=== compute-sanitizer --tool $tool" >>"$OUT/sanitizer.txt"
      timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 50 \
        "$PY" scripts/gpu_validate.py --skip-timing --small --out "$SAN_RUN" \
        >>"$OUT/sanitizer.txt" 2>&1
      rc=$?
      echo "=== $tool exit status $rc" | tee -a "$OUT/sanitizer.txt"
      [ $rc = 0 ] || STATUS=1
      phase "sanitizer-$tool"
    done
    rm -rf "$SAN_RUN"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit status" "$OUT/sanitizer.txt"
  fi
fi

# what comes back from a lent device: at most 8 files
FILES=$(find "$OUT" -type f | wc -l)
echo "gpu_validate: $FILES files in $OUT: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
if [ "$FILES" -gt 8 ]; then
  echo "gpu_validate: more than the 8 files a device run brings back"
  STATUS=1
fi
# the table again, last, where the reply's tail shows it
[ -f "$OUT/gpu_validate.log" ] && sed -n '/copy of 1 GiB/,$p' "$OUT/gpu_validate.log"
echo "gpu_validate: exit status $STATUS after $(elapsed) s"
exit $STATUS
