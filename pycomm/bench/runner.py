"""Per-rank training loop of ``python -m pycomm.bench``: step times per hook, side by side."""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.hooks.state import ring_bytes

BASELINE = "ddp"  # plain DDP, no hook: torch's own reduction


def make_mlp(width: int, layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def run_rank(
    hooks: list[str],
    width: int,
    layers: int,
    batch: int,
    steps: int,
    warmup: int,
    threads: Optional[int],
) -> dict[str, Any]:
    """Train one model per hook, interleaving the hooks step by step; per-step times."""
    if threads:
        torch.set_num_threads(threads)
    models, opts = {}, {}
    for name in hooks:
        module = make_mlp(width, layers)
        models[name] = DDP(module) if name == BASELINE else pycomm.wrap(module, hook=name)
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    times: dict[str, list[float]] = {name: [] for name in hooks}
    for step in range(warmup + steps):
        for name in hooks:
            dist.barrier()
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(models[name](x), y)
            opts[name].zero_grad(set_to_none=False)
            loss.backward()
            opts[name].step()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"params": sum(p.numel() for p in models[hooks[0]].parameters())}
    for name in hooks:
        ts = times[name]
        if name == BASELINE:  # DDP's own fp32 ring all-reduce of every parameter
            sent = ring_bytes(out["params"] * 4, dist.get_world_size())
        else:
            stats = pycomm.hook_state(models[name]).stats
            sent = stats["bytes_sent"] / max(stats["steps"], 1)
        out[name] = {
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "max_s": max(ts),
            "bytes_per_step": sent,
        }
    return out
