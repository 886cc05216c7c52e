"""pycomm.dist.settle_at_exit: before the interpreter finalizes, a process that used a process
group gives other threads the GIL for a moment (torch's gloo worker threads need it to free a
finished collective; without it such a process can abort at exit, see benchmarks/bench_exit.py).

A daemon thread stands in for the worker: it is released by an atexit handler that runs just
before pycomm's, and must take the GIL a few times before it can write its marker. Without the
pause the interpreter finalizes first and the thread never writes it."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import atexit, sys, threading, time
import torch.distributed as dist
import pycomm
marker, how = sys.argv[1], sys.argv[2]
if how == "armed":
    pycomm.dist.settle_at_exit()
elif how == "group":  # a group still initialized at exit, made without pycomm
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
gate = threading.Lock()
gate.acquire()
def late():
    with gate:  # blocked, the GIL released, until the handler below
        pass
    for _ in range(5):
        time.sleep(0.001)  # gives up and takes back the GIL each time
    with open(marker, "w") as f:
        f.write("ran")
threading.Thread(target=late, daemon=True).start()
atexit.register(gate.release)  # runs before pycomm's handler: atexit runs the last one first
"""


@pytest.mark.slow  # whole launches (about 20 s): make frameworks
def test_a_process_that_used_a_group_lets_other_threads_run_before_it_finalizes(tmp_path):
    hows = ("armed", "group", "none")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {
        how: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(tmp_path / how), how],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for how in hows
    }
    for how, p in procs.items():
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, (how, out)
    ran = {how: (tmp_path / how).exists() for how in hows}
    # the control: a process that never used a group exits at once, and the thread never runs
    assert ran == {"armed": True, "group": True, "none": False}
