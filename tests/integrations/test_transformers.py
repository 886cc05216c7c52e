"""The real Hugging Face Trainer with pycomm.transformers on 2 gloo ranks (torchrun), and as one
process: allreduce bitwise the Trainer without pycomm, int8 resumed from a checkpoint bitwise
the uninterrupted run on every rank (gradient accumulation on throughout), the refusals on
every rank, one process a no-op. One launch holds the 2-rank scenarios
(tests/scripts/train_hf.py)."""

import json
import os
import socket
import subprocess
import sys

import pytest
from harness import TESTS

SCRIPT = os.path.join(TESTS, "scripts", "train_hf.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, mode: str, nprocs: int = 2) -> list:
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.update(TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if nprocs == 1:
        cmd = [sys.executable, SCRIPT, str(tmp_path), mode]
    else:
        port = _free_port()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            SCRIPT, str(tmp_path), mode,
        ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.mark.frameworks
@pytest.mark.timeout(180)
def test_trainer_matches_plain_resumes_bitwise_and_refuses(tmp_path):
    results = _run(tmp_path, "all")
    for r in results:
        # every rank's hook state in the Trainer's checkpoint folder, beside its rng state
        assert {"pycomm_hook_state_0.pt", "pycomm_hook_state_1.pt", "rng_state_1.pth"} <= set(
            r["saved"]
        )
        assert r["compressed"]
        assert r["resume"] == [True, 0.0], "int8 resumed differs from the uninterrupted run"
        assert r["resumed_steps"] == 9  # 4 steps restored with the state, 5 after the resume
        # the same checkpoint without pycomm's files: a warning, the hook afresh, elsewhere
        assert r["afresh"][0] is False and r["afresh"][1] > 0
        assert r["afresh_steps"] == 5
        assert len(r["afresh_said"]) == 1 and "holds no pycomm hook state" in r["afresh_said"][0]
        assert r["allreduce"], "pycomm's allreduce under the Trainer differs from plain DDP"
        assert r["allreduce_steps"] == 9  # 3 epochs of 3 optimizer steps: one hook call each
        assert "accumulate_steps=2" in r["accumulate"]
        assert "gradient_accumulation_steps=k" in r["accumulate"]
        assert "hook_options=3, expected a dict" in r["options_type"]
        assert (
            "pycomm.transformers.register: on rank 1: hook_options has accumulate_steps=2"
            in (r["one_rank"])
        )
        assert r["twice"] == [True, 18]  # two train() calls of 9 steps, one hook
        assert "TrainingArguments(deepspeed=" in r["deepspeed"]
        assert "Drop deepspeed=" in r["deepspeed"]
        assert "TrainingArguments(fsdp=True)" in r["fsdp"] and "Drop fsdp=" in r["fsdp"]
        assert "hook='int9' is not one of" in r["bad_hook"]
        assert "hook is 'int8' in the checkpoint but 'onebit' here" in r["other_hook"]
        assert "rank 0:" in r["other_hook"] and "rank 1:" in r["other_hook"]
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.frameworks
@pytest.mark.timeout(120)
def test_trainer_one_process_is_a_no_op_that_says_so_once(tmp_path):
    (r,) = _run(tmp_path, "single", nprocs=1)
    assert r["state"]  # no hook state: nothing registered
    assert r["trained"]
    assert len(r["messages"]) == 1 and "no int8 hook is registered" in r["messages"][0]
