#!/usr/bin/env bash
# Compile check of the CUDA kernels on a machine without a GPU (CI runs it after `make test`).
#
# Installs torch 2.14.1 (a CUDA 13 build) into its own venv, copies the checkout's files into a
# separate tree (so the main tree's in-place build, used by .venv, is never touched), builds
# pycomm._C there WITH the CUDA kernels using nvcc, checks that every op has a CUDA kernel,
# and runs the kernel tests against that build (the kernel cases of tests/kernels/test_fusion_ops.py
# and tests/kernels/test_codec_ops.py on the cpu backend; the build's C++ runtime check;
# tests/kernels/test_cuda.py), then the dry run of scripts/gpu_validate.sh (--cpu) against
# that build.
# The emulated CUDA backend is left to make test: it compiles the .cu sources with the host
# compiler, apart from this build, so it would only run again against another torch. The hooks,
# launch and training tests use no code that differs between the two builds: make test runs
# them. Prints the time of every phase.
#
#   scripts/cuda_check.sh [--venv-only]   (--venv-only: create the venv and stop; CI starts it
#                                          early, beside other steps, as it mostly waits on disk)
#
# Environment (defaults in brackets):
#   CUDA_CHECK_VENV [.venv-cuda]      the venv; created when missing
#   CUDA_CHECK_TREE [build-cuda]      the copy of the checkout that is built and tested
#   CUDA_CHECK_TESTS [the kernel tests] what pytest runs (CUDA_CHECK_TESTS=tests: the whole suite)
#   TORCH_CUDA_ARCH_LIST [9.0]        the architectures to compile for (one: the kernels have no
#                                     per-architecture code, and each one more repeats the device
#                                     compile; a build's own default is setup.py's 8.0;9.0)
#   CUDA_HOME [/usr/local/cuda]       nvcc 13.0 lives in $CUDA_HOME/bin
#   MAX_JOBS [2]                      parallel compile jobs
#   NICE ["nice -n 19"]               prefix of the heavy commands ("" to run at full priority)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${CUDA_CHECK_VENV:-.venv-cuda}
TREE=${CUDA_CHECK_TREE:-build-cuda}
KERNEL_TESTS="tests/kernels/test_fusion_ops.py tests/kernels/test_codec_ops.py
  tests/kernels/test_fuzz_ops.py tests/kernels/test_cuda.py tests/repo/test_import.py
  tests/repo/test_build.py"
TESTS=${CUDA_CHECK_TESTS:-$KERNEL_TESTS}
TORCH_SPEC=torch==2.14.1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-2}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
NICE=${NICE-nice -n 19}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
case $TREE in /*) ;; *) TREE=$ROOT/$TREE ;; esac
PY=$VENV/bin/python

T0=$(date +%s)
LAST=$T0
TIMES=()
phase() {  # phase NAME: ends the running phase and records how long it took
  local now
  now=$(date +%s)
  TIMES+=("$(printf '%-8s %5d s' "$1" $((now - LAST)))")
  echo "cuda_check: $1 took $((now - LAST)) s"
  LAST=$now
}
report() {
  echo "cuda_check: phase times"
  for t in "${TIMES[@]}"; do echo "  $t"; done
  echo "  total    $(printf '%5d' $(($(date +%s) - T0))) s"
}
trap report EXIT

echo "cuda_check: venv $VENV"
[ -x "$PY" ] || python3 -m venv "$VENV"
# what the build and the kernel tests import
DEPS="setuptools wheel ninja numpy pytest pytest-timeout hypothesis"
# pip takes torch 2.14.1 from this machine's disk; the exact pin never pulls a newer one
# shellcheck disable=SC2086 # DEPS is a list of names
$NICE "$PY" -m pip install -q "$TORCH_SPEC" $DEPS
"$PY" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.14.1') and torch.version.cuda else 'cuda_check: torch ' + v + ' is not 2.14.1 with CUDA')"
phase venv
if [ "${1:-}" = "--venv-only" ]; then exit 0; fi

echo "cuda_check: copying the checkout to $TREE"
mkdir -p "$TREE"
LIST=$(mktemp)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # tracked files and untracked ones that are not ignored: what a commit would hold
  git ls-files -co --exclude-standard | while IFS= read -r f; do [ -f "$f" ] && echo "$f"; done \
    | sort >"$LIST"
else
  find . -type f ! -path './.git/*' ! -path './.venv*' ! -path './build*' ! -name '*.so' \
    ! -path '*/__pycache__/*' -printf '%P\n' | sort >"$LIST"
fi
# tar keeps modification times, so an unchanged file is not rebuilt on a second run
tar -cf - -T "$LIST" | tar -xf - -C "$TREE"
# files gone from the checkout go from the copy too (build outputs stay)
(cd "$TREE" && find . -type f ! -path './build/*' ! -name '_C*.so' ! -path '*/__pycache__/*' \
  ! -path './.pytest_cache/*' ! -path './.hypothesis/*' ! -path './*.egg-info/*' -printf '%P\n' \
  | sort | comm -23 - "$LIST" | while IFS= read -r f; do rm -f "$f"; done)
rm -f "$LIST"
phase copy

echo "cuda_check: building with nvcc ($("$CUDA_HOME/bin/nvcc" --version | tail -1))," \
  "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# the CUDA 13 wheels' headers (cuBLAS, cuSPARSE, ...) that torch's headers include
export CPATH=$SITE/nvidia/cu13/include${CPATH:+:$CPATH}
export PATH=$CUDA_HOME/bin:$PATH
# the compiler's output goes to a log (torch's headers warn a lot); what nvcc says about
# csrc/cuda is shown, all of it on failure
if ! (cd "$TREE" && USE_CUDA=1 $NICE "$PY" setup.py -q build_ext --inplace) >"$TREE/cuda_build.log" 2>&1; then
  tail -60 "$TREE/cuda_build.log"
  echo "cuda_check: the build failed (log: $TREE/cuda_build.log)"
  exit 1
fi
grep -E "csrc/cuda/.*(warning|error)" "$TREE/cuda_build.log" || true
phase build

echo "cuda_check: checking the build"
(cd "$TREE" && "$PY" - <<'EOF'
import glob
import re

import torch

import pycomm
from pycomm import ops

assert ops.WITH_CUDA, "pycomm._C was built without its CUDA kernels"
names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
               if n.startswith("pycomm::"))
missing = [n for n in names
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"pycomm::{n}", "CUDA")]
assert not missing, f"ops without a CUDA kernel: {missing}"
archs = set()
for f in glob.glob("build/**/build.ninja", recursive=True):
    archs |= set(re.findall(r"code=sm_(\d+)", open(f).read()))
print(f"cuda_check: pycomm from {pycomm.__file__}, torch {torch.__version__}; "
      f"{len(names)} ops, each with a CUDA kernel; compiled for sm_{', sm_'.join(sorted(archs))}")
EOF
)
phase check

echo "cuda_check: pytest $TESTS (against the CUDA build)"
# shellcheck disable=SC2086 # TESTS is a list of paths
(cd "$TREE" && PYTHONPATH=$TREE PYCOMM_EXPECT_CUDA=1 PYCOMM_CUDA_EMU=0 $NICE "$PY" -m pytest -q -p no:cacheprovider \
  $TESTS)
phase tests

# the GPU script's dry run against this build: every phase a device call runs, with the CPU
# standing in for the GPU (the tests that need no device kernel run on the CPU, the others are
# listed as skipped), so that what would fail the first device run fails here
echo "cuda_check: scripts/gpu_validate.sh --cpu (the dry run of the device calls)"
DRY=$TREE/gpu_dry_run
rm -rf "$DRY"
if ! GPU_VALIDATE_TREE=$TREE PYTHON=$PY OUT=$DRY $NICE scripts/gpu_validate.sh --cpu --skip-build \
  --big 3001 --reps 1 >"$TREE/gpu_dry_run.log" 2>&1; then
  cat "$TREE/gpu_dry_run.log"
  [ -f "$DRY/pytest_cuda.log" ] && tail -80 "$DRY/pytest_cuda.log"
  echo "cuda_check: the dry run of scripts/gpu_validate.sh failed"
  exit 1
fi
# what ran on the CPU stand-in, one line each, and the count of what needs a GPU
grep -E "^PASSED" "$DRY/pytest_cuda.log" | sed 's/ - .*//'
grep -E "^[0-9]+ passed" "$DRY/pytest_cuda.log" | tail -1
tail -3 "$TREE/gpu_dry_run.log"
phase dry-run
