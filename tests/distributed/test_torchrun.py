"""Multi-node is torchrun's job: two torchrun agents on this machine act as two nodes."""

import json
import os
import socket
import subprocess
import sys

import pytest
from harness import TESTS

SCRIPT = os.path.join(TESTS, "scripts", "train_torchrun.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_of_two(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"pycomm-test-{port}",
        "--max-restarts",
        "0",
        SCRIPT,
        str(tmp_path),
    ]
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    logs = []
    try:
        for a in agents:
            out, _ = a.communicate(timeout=180)
            logs.append(out)
    finally:
        for a in agents:
            a.kill()
            a.wait()
    for a, log in zip(agents, logs):
        assert a.returncode == 0, log[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert {r["world_size"] for r in records} == {4}
    assert sorted((r["group_rank"], r["local_rank"]) for r in records) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert len({r["params"] for r in records}) == 1  # every rank holds the same parameters
    assert {r["steps"] for r in records} == {3}
