"""Resumable training under ``torchrun --max-restarts``: checkpoints every few steps with
pycomm.checkpoint; on the first attempt rank 1 is killed mid-run, torchrun restarts every rank,
and they resume from the last checkpoint. At the end each rank also trains the same model
without interruption, in the same process group, and writes both results to
``{out_dir}/rank{rank}.json``.

Usage: train_restart.py OUT_DIR STEPS EVERY KILL_STEP
"""

import hashlib
import json
import os
import sys

import torch

import pycomm


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _step(ddp, opt, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)  # the data of step s, wherever it runs
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    loss = ((ddp(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _digest(module):
    return hashlib.sha256(
        b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())
    ).hexdigest()


def main(out_dir, steps, every, kill_step):
    info = pycomm.init(timeout=60)  # a hang in the test is an error after a minute
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = os.path.join(out_dir, "ckpt.pt")
    ddp = pycomm.wrap(_model(), hook="allreduce")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    start = pycomm.checkpoint.load(ckpt, ddp, opt)["step"] if os.path.exists(ckpt) else 0
    for step in range(start, steps):
        if restart == 0 and step == kill_step and info.rank == 1:
            with open(os.path.join(out_dir, "killed.txt"), "w") as f:
                f.write(f"rank 1 killed at step {step}")
            os._exit(13)
        _step(ddp, opt, step, info.rank)
        if (step + 1) % every == 0:
            pycomm.checkpoint.save(ckpt, ddp, opt, step=step + 1)
    ref = pycomm.wrap(_model(), hook="allreduce")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        _step(ref, ref_opt, step, info.rank)
    record = {
        "rank": info.rank,
        "restart": restart,
        "resumed_from": start,
        "final": _digest(ddp.module),
        "uninterrupted": _digest(ref.module),
    }
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(record, f)
    pycomm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
