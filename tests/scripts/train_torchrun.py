"""Trains a small model with pycomm's hook under whatever launched it (torchrun here).

Unchanged for 1 process, torchrun on one node, or torchrun across nodes: pycomm.init() reads
the launcher's environment. Writes one JSON line per rank into the folder given as argv[1].
"""

import hashlib
import json
import os
import sys

import torch

import pycomm


def main(out_dir: str) -> None:
    info = pycomm.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    ddp = pycomm.wrap(model.to(info.device), hook="allreduce")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(info.rank)
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 2, generator=g)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest = hashlib.sha256(
        b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    ).hexdigest()
    record = {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "group_rank": int(os.environ.get("GROUP_RANK", -1)),
        "params": digest,
        "steps": pycomm.hook_state(ddp).stats["steps"],
    }
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(record, f)
    pycomm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
