"""The models and the simulated nodes that the DDP hook tests (hooks/test_resume.py,
hooks/test_hierarchy.py, hooks/test_auto.py, hooks/test_compression.py,
engine/test_registry.py) share; call them inside a rank."""

import contextlib
import copy
import os

import torch
import torch.distributed as dist

import pycomm

_TORCHRUN = ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def model() -> torch.nn.Module:
    """Five 40 x 40 blocks and a head: several buckets at a small ``bucket_cap_mb``."""
    torch.manual_seed(0)
    layers = []
    for _ in range(5):
        layers += [torch.nn.Linear(40, 40), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(40, 3))


@contextlib.contextmanager
def nodes(layout, launcher="torchrun"):
    """This rank's launcher variables for ``layout``, a node id per rank, e.g. [0, 0, 1, 1]:
    torchrun's, or SLURM's (``launcher="slurm"``, torchrun's then unset)."""
    rank = dist.get_rank()
    node = layout[rank]
    members = [r for r, n in enumerate(layout) if n == node]
    if launcher == "torchrun":
        env = dict(
            zip(
                _TORCHRUN,
                (str(node), str(len(set(layout))), str(members.index(rank)), str(len(members))),
            )
        )
    else:
        counts = [layout.count(n) for n in sorted(set(layout))]
        env = {
            "SLURM_NODEID": str(node),
            "SLURM_NNODES": str(len(counts)),
            "SLURM_LOCALID": str(members.index(rank)),
            # SLURM's compressed form: '2(x2)' for two nodes of 2, '3,1' when uneven
            "SLURM_TASKS_PER_NODE": (
                f"{counts[0]}(x{len(counts)})"
                if len(set(counts)) == 1
                else ",".join(map(str, counts))
            ),
            **{k: None for k in _TORCHRUN},
        }
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Fixed(torch.nn.Module):
    """A parameter of ``n`` elements whose gradient is whatever the forward is given: fixed
    gradients, and so a bucket the hook's input is known of."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(n))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.p * c).sum()


def flat(m: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flat."""
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def straight_and_resumed(build, train, data: list, cut: int) -> tuple:
    """``build()``'s (ddp, optimizer) trained by ``train(ddp, optimizer, batches)`` on
    ``data`` straight; then again, its model, optimizer and hook state saved after ``cut``
    batches, rebuilt, loaded and trained on the rest. Returns (the straight run's parameters,
    the resumed run's, the saved hook state, the resumed ddp)."""
    ddp, opt = build()
    train(ddp, opt, data)
    straight = flat(ddp.module)
    ddp, opt = build()
    train(ddp, opt, data[:cut])
    saved = copy.deepcopy(
        {"model": ddp.module.state_dict(), "opt": opt.state_dict(),
         "hook": pycomm.hook_state(ddp).state_dict()}
    )  # fmt: skip
    ddp, opt = build()
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    pycomm.hook_state(ddp).load_state_dict(saved["hook"])
    train(ddp, opt, data[cut:])
    return straight, flat(ddp.module), saved["hook"], ddp
