#!/usr/bin/env bash
# The portable CPU build (PYCOMM_CPU=default: no AVX2/FMA/F16C flags, at::vec's scalar paths)
# on this machine, whatever its CPU: builds pycomm._C that way in a copy of the checkout and
# runs the kernel tests against it. CI runs it after `make test`, whose build takes the build
# machine's instruction set.
#
# Environment: PYTHON [.venv/bin/python], PORTABLE_TREE [build-portable], MAX_JOBS [2].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute, the venv's own (no realpath)
TREE=${PORTABLE_TREE:-build-portable}
T0=$(date +%s)
rm -rf "$TREE"
mkdir -p "$TREE"
git ls-files -co --exclude-standard -z | xargs -0 -I{} sh -c '[ -f "{}" ] && echo "{}"' \
  | tar -cf - -T - | tar -xf - -C "$TREE"
cd "$TREE"
echo "portable_check: building with PYCOMM_CPU=default USE_CUDA=0 in $TREE"
if ! PYCOMM_CPU=default USE_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --inplace \
  >build.log 2>&1; then
  tail -40 build.log
  exit 1
fi
PYTHONPATH=$PWD "$PY" -c "
import pycomm.ops as ops
assert ops._C.CPU_CAPABILITY == 'DEFAULT', ops._C.CPU_CAPABILITY
print('portable_check: pycomm._C from', ops._C.__file__, 'CPU capability', ops._C.CPU_CAPABILITY)"
PYTHONPATH=$PWD PYCOMM_CUDA_EMU=0 "$PY" -m pytest -q -p no:cacheprovider \
  tests/kernels/test_fusion_ops.py tests/kernels/test_codec_ops.py tests/kernels/test_fuzz_ops.py \
  tests/repo/test_build.py
echo "portable_check: $(($(date +%s) - T0)) s"
