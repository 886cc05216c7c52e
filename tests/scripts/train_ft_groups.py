"""Two torchft replica groups of two ranks each, DDP or FSDP2 inside each group and
``pycomm.DiLoCo(manager=...)`` across them (tests/ft/test_groups.py).

Run with ``--inner ddp`` or ``--inner fsdp`` and no ``REPLICA_GROUP_ID``: it starts a
lighthouse and one torchrun per replica group, which run this file again to train; each rank
prints ``OUTER RANK DIGEST SYNCS``, the sha256 of its outer copy (the whole model with DDP, its
shard with FSDP2), and the launcher checks that rank r of both groups holds the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import socket
import subprocess
import sys
import sysconfig
from datetime import timedelta

import torch
from torch.distributed.fsdp import fully_shard

import pycomm


def train(inner: str) -> None:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    group = int(os.environ["REPLICA_GROUP_ID"])
    info = pycomm.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    if inner == "ddp":
        net = pycomm.wrap(model)
    else:
        fully_shard(model[0])
        fully_shard(model[2])
        net = fully_shard(model)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        state_dict=lambda: {"model": net.state_dict(), "opt": opt.state_dict()},
        load_state_dict=lambda s: (net.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
        min_replica_size=2,
        replica_id=f"groups_{group}",
        use_async_quorum=False,
        init_sync=False,
        timeout=timedelta(seconds=20),
    )
    outer = pycomm.DiLoCo(net, sync_every=5, codec="int4", manager=manager)
    data = torch.Generator().manual_seed(10 * group + info.rank)
    while manager.current_step() < 4:
        x = torch.randn(32, 16, generator=data)
        loss = (net(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        outer.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in outer.outer))
    print(f"OUTER {info.rank} {digest.hexdigest()[:16]} {outer.stats['syncs']}", flush=True)
    manager.shutdown(wait=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(inner: str) -> None:
    port = _free_port()
    lighthouse = subprocess.Popen([
        os.path.join(sysconfig.get_path("scripts"), "torchft_lighthouse"),
        "--min_replicas", "2", "--bind", f"[::]:{port}", "--join_timeout_ms", "5000",
    ])  # fmt: skip
    groups = []
    try:
        for group in range(2):
            env = dict(os.environ, REPLICA_GROUP_ID=str(group),
                       TORCHFT_LIGHTHOUSE=f"http://localhost:{port}")  # fmt: skip
            groups.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(_free_port()), __file__, "--inner", inner],
                env=env, stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        outs = [g.communicate(timeout=200)[0] for g in groups]
        assert all(g.returncode == 0 for g in groups), outs
        # the ranks of a torchrun share its stdout: their lines may be cut into one another
        lines = [m for out in outs for m in re.findall(r"OUTER (\d+) ([0-9a-f]{16}) (\d+)", out)]
        by_rank: dict[str, set] = {}
        for rank, digest, syncs in lines:
            by_rank.setdefault(rank, set()).add(digest)
            assert int(syncs) == 4, lines
        assert len(lines) == 4 and all(len(d) == 1 for d in by_rank.values()), lines
        if inner == "ddp":  # the whole model on every rank
            assert len({d for ds in by_rank.values() for d in ds}) == 1, lines
        print("ok", inner, lines)
    finally:
        for g in groups:
            g.kill()
        lighthouse.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner", choices=["ddp", "fsdp"], required=True)
    args = parser.parse_args()
    train(args.inner) if "REPLICA_GROUP_ID" in os.environ else launch(args.inner)
