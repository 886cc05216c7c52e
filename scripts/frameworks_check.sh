#!/usr/bin/env bash
# The Hugging Face Trainer and Ray Train integrations (pycomm.transformers, pycomm.ray) against
# the real packages: installs transformers and ray[train] into the venv without changing its
# torch, then runs the tests marked `frameworks` (2 CPU ranks under torchrun; Ray's local CPU
# workers). CI runs it after `make test`, which leaves these tests out: the installs and the
# runs (about 4 minutes on 2 busy cores) do not fit its 5 minutes.
#
# Environment: VENV [.venv], TORCH [torch==2.13.0] (as the Makefile).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
make -s deps-frameworks
T1=$(date +%s)
echo "frameworks_check: installs $((T1 - T0)) s"
make -s frameworks
echo "frameworks_check: tests $(($(date +%s) - T1)) s"
