"""Ray Train with pycomm.ray on local CPU workers (a local Ray on the loopback, no dashboard, no
usage reporting), the real package: allreduce bitwise Ray's plain prepare_model, int8 resumed
from Ray's checkpoint bitwise the uninterrupted run on every worker (and not without the hook
state: the check that the test can fail), the refusals on every worker, one worker. One script
runs the three TorchTrainer runs (tests/scripts/train_ray.py)."""

import json
import os
import subprocess
import sys

import pytest
from harness import TESTS

SCRIPT = os.path.join(TESTS, "scripts", "train_ray.py")


@pytest.mark.frameworks
@pytest.mark.timeout(300)
def test_ray_matches_plain_resumes_bitwise_and_refuses(tmp_path):
    pytest.importorskip("ray.train.torch")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]

    def read(run, rank):
        return json.loads((tmp_path / f"{run}-rank{rank}.json").read_text())

    first, resumed = [read("first", r) for r in (0, 1)], [read("resume", r) for r in (0, 1)]
    for rank, (f, r) in enumerate(zip(first, resumed)):
        assert f["world_size"] == 2
        assert f["allreduce"], "pycomm's allreduce differs from Ray's plain prepare_model"
        assert f["allreduce_steps"] == 8
        assert f["saved"] == f"pycomm_hook_state_{rank}.pt"
        assert f["compressed"]
        assert "parallel_strategy='fsdp', expected 'ddp'" in f["fsdp"]
        assert "parallel_strategy=None, expected 'ddp'" in f["none"]
        assert "hook_options=[64], expected a dict" in f["options"]
        assert "hook='int9' is not one of" in f["bad_hook"]
        assert "pycomm.ray.prepare_model: on rank 1: hook_options=[64]" in f["one_worker"]
        # Ray merged every worker's folder into one checkpoint
        assert r["files"] == ["model.pt", "pycomm_hook_state_0.pt", "pycomm_hook_state_1.pt"]
        assert r["loaded"] is True
        assert r["resumed_loadTrue"] == f["full"], "int8 resumed differs from the uninterrupted run"
        assert r["resumed_loadFalse"] != f["full"]  # without the hook state it does differ
        assert "hook is 'int8' in the checkpoint but 'onebit' here" in r["other_hook"]
    assert first[0]["full"] == first[1]["full"]
    single = read("single", 0)
    assert single["world_size"] == 1 and single["bare"] == "Sequential"
    assert single["trained"] and single["saved"] is None and single["loaded"] is False
    assert len(single["messages"]) == 1 and "no int8 hook is registered" in single["messages"][0]
