"""The model, the sharding and the data that the FSDP2 tests (fsdp/test_fsdp.py,
fsdp/test_hsdp.py) share."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard


def model(seed: int = 0) -> torch.nn.Module:
    """Three linear blocks; 63 x 64 elements make chunks that are not whole blocks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(30, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 63),  # 63 * 64 elements: chunks that are not whole blocks
        torch.nn.Tanh(),
        torch.nn.Linear(63, 5),
    )


def shard(m: torch.nn.Module, per_block: bool = True, **kw) -> torch.nn.Module:
    """``fully_shard`` on each block (or not) and on the root, with ``kw`` (mesh=...)."""
    if per_block:
        for i in (0, 2, 4):
            fully_shard(m[i], **kw)
    fully_shard(m, **kw)
    return m


def set_divide_factor(m: torch.nn.Module, factor: float) -> None:
    """``set_gradient_divide_factor`` on every FSDP module of ``m`` (FSDP2 sets it on the
    module's own parameters alone)."""
    for sub in m.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(factor)


def data(n: int, seed: int = 0) -> list:
    """``n`` (input, target) batches of this rank's own."""
    g = torch.Generator().manual_seed(100 * seed + dist.get_rank())
    return [(torch.randn(8, 30, generator=g), torch.randn(8, 5, generator=g)) for _ in range(n)]


def full(m: torch.nn.Module) -> torch.Tensor:
    """Every parameter, gathered over its mesh, flat."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in m.parameters()])


def grads(m: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, gathered over its mesh, flat."""
    return torch.cat([p.grad.full_tensor().reshape(-1) for p in m.parameters()])


def straight_and_resumed(
    build, batches: list, cut: int, folder=None, state=None, loaded=None
) -> tuple:
    """Train ``build()``'s (model, comm, optimizer) on ``batches`` straight; then again, saving
    the model, the optimizer and ``comm`` after ``cut`` batches (``folder``: each rank its own
    file, through pycomm.checkpoint; ``state``: what to save of the comm instead of its
    ``state_dict()``), loading them into a fresh ``build()`` (``loaded``: called with its comm
    right after) and going on. Returns (the parameters of both runs, the resumed comm, what it
    saved, the straight run's comm's stats)."""
    import copy

    import pycomm.checkpoint

    def step(m, opt, x, y):
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()

    m, comm, opt = build()
    for x, y in batches:
        step(m, opt, x, y)
    straight, straight_stats = full(m), comm.stats
    m, comm, opt = build()
    for x, y in batches[:cut]:
        step(m, opt, x, y)
    comm_state = comm.state_dict() if state is None else state(comm)
    saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict(), "comm": comm_state})
    if folder is not None:
        pycomm.checkpoint.save_rank_state(comm, folder)
    m, comm, opt = build()
    m.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    if folder is not None:
        assert pycomm.checkpoint.load_rank_state(comm, folder)
    else:
        comm.load_state_dict(saved["comm"])
    if loaded is not None:
        loaded(comm)
    for x, y in batches[cut:]:
        step(m, opt, x, y)
    return straight, full(m), comm, saved["comm"], straight_stats


def train(m: torch.nn.Module, comm, steps: int, k: int = 1, seed: int = 0) -> tuple:
    """``steps`` SGD steps of ``k`` micro-batches each (FSDP's own set_requires_gradient_sync
    for accumulation): the parameters, the gradients of every step and ``comm``'s stats after
    each (None without a comm)."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    grad_steps, stats = [], []
    for i, (x, y) in enumerate(data(steps * k, seed)):
        final = (i + 1) % k == 0
        m.set_requires_gradient_sync(final)
        (torch.nn.functional.mse_loss(m(x), y) / k).backward()
        if final:
            grad_steps.append(grads(m))
            opt.step()
            opt.zero_grad()
            stats.append(None if comm is None else comm.stats)
    return full(m), grad_steps, stats
