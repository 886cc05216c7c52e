"""Replica groups of two ranks each, as torchrun starts them, under a torchft lighthouse: DDP
or FSDP2 inside each group, ``pycomm.DiLoCo(manager=...)`` across the groups; rank r of every
group ends with the same outer bits (tests/scripts/train_ft_groups.py)."""

import os
import subprocess
import sys

import pytest
from harness import ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("inner", ["ddp", "fsdp"])
def test_ddp_or_fsdp2_inside_replica_groups_and_diloco_across_them(inner, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHFT_"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    script = os.path.join(ROOT, "tests", "scripts", "train_ft_groups.py")
    out = subprocess.run(
        [sys.executable, script, "--inner", inner],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert f"ok {inner}" in out.stdout
