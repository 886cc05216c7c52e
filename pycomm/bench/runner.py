"""Per-rank side of ``python -m pycomm.bench``: the hooks it knows, and the training loop that
times them side by side (one DDP model per hook, hooks interleaved step by step)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.bench.hooks import FailState, compute_hook, fail_hook
from pycomm.bench.link import lo_tx_bytes
from pycomm.hooks.state import ring_bytes

COMPUTE = "compute"  # the bucket comes back untouched: no communication at all
BASELINE = "ddp"  # plain DDP, no hook: torch's own reduction
FAIL = "_fail"  # test-only: a hook that raises; not listed, not in "all"

# torch's own hooks, registered the way a user would: name -> (description, factory of
# (state, hook)); PowerSGD from iteration 2 so that the warm-up steps reach compression.
TORCH_HOOKS: dict[str, tuple[str, Callable[[], tuple[Any, Callable]]]] = {
    "torch-allreduce": (
        "torch allreduce_hook",
        lambda: (None, default_hooks.allreduce_hook),
    ),
    "torch-fp16": (
        "torch fp16_compress_hook",
        lambda: (None, default_hooks.fp16_compress_hook),
    ),
    "torch-powersgd1": (
        "torch powerSGD_hook, rank 1",
        lambda: (
            torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
            torch_powersgd.powerSGD_hook,
        ),
    ),
    "torch-powersgd4": (
        "torch powerSGD_hook, rank 4",
        lambda: (
            torch_powersgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2),
            torch_powersgd.powerSGD_hook,
        ),
    ),
}

# Options for pycomm hooks whose defaults would not show them working within a benchmark's
# few steps (torch's PowerSGD only compresses from iteration 1000 by default).
PYCOMM_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
}

# pycomm's powersgd is torch's PowerSGD delegated: torch-powersgd1 already stands for it in
# the default set.
_NOT_DEFAULT = {"powersgd"}


def pycomm_hooks() -> list[str]:
    """pycomm's hook names, read from the registry now (hooks get added): allreduce first."""
    from pycomm.wrap import HOOKS

    return sorted(HOOKS, key=lambda name: (name != "allreduce", name))


def available_hooks() -> list[str]:
    """Every hook the benchmark can run (``--hooks all``)."""
    return [COMPUTE, BASELINE, *TORCH_HOOKS, *pycomm_hooks()]


def default_hooks_set() -> list[str]:
    """compute, ddp, torch's fp16 and PowerSGD rank 1, and pycomm's own hooks."""
    return [
        COMPUTE,
        BASELINE,
        "torch-fp16",
        "torch-powersgd1",
        *(h for h in pycomm_hooks() if h not in _NOT_DEFAULT),
    ]


def describe(name: str) -> str:
    """One line on what the benchmark runs under ``name``."""
    if name == COMPUTE:
        return "no communication (the bucket is returned untouched): compute only"
    if name == BASELINE:
        return "plain DDP, no hook"
    if name in TORCH_HOOKS:
        return TORCH_HOOKS[name][0]
    if name == FAIL:
        return "test-only hook that raises"
    options = PYCOMM_OPTIONS.get(name)
    return f"pycomm {name} hook" + (f" {options}" if options else "")


def make_mlp(width: int, layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _build(name: str, module: torch.nn.Module, cap: Optional[float]) -> tuple[DDP, Any]:
    """The DDP model for hook ``name`` (buckets of ``cap`` MB, None: the hook's default) and
    the state its byte count is read from."""
    kw = {} if cap is None else {"bucket_cap_mb": cap}
    if name in (BASELINE, COMPUTE, FAIL) or name in TORCH_HOOKS:
        ddp = DDP(module, **kw)
        state: Any = None
        if name == COMPUTE:
            ddp.register_comm_hook(None, compute_hook)
        elif name == FAIL:
            state = FailState()
            ddp.register_comm_hook(state, fail_hook)
        elif name in TORCH_HOOKS:
            state, hook = TORCH_HOOKS[name][1]()
            ddp.register_comm_hook(state, hook)
        return ddp, state
    ddp = pycomm.wrap(module, hook=name, hook_options=PYCOMM_OPTIONS.get(name), **kw)
    return ddp, pycomm.hook_state(ddp)


def _counters(name: str, state: Any) -> dict[str, float]:
    """Cumulative (bytes sent, steps) as the hook itself counts them, where it does."""
    if isinstance(state, torch_powersgd.PowerSGDState):
        # fp32 elements all-reduced while compressing (P, Q and the uncompressed tensors)
        return {"elements": float(state.total_numel_after_compression)}
    if state is not None and hasattr(state, "stats"):
        return {"bytes": float(state.stats["bytes_sent"]), "steps": float(state.stats["steps"])}
    return {}


def _bytes_per_step(
    name: str, params: int, world: int, before: dict, after: dict, steps: int
) -> tuple[Optional[float], str]:
    """Bytes one rank puts on the wire per step, and where that number comes from."""
    if name in (COMPUTE, FAIL) or world == 1:
        return 0.0, "no communication"
    if name in (BASELINE, "torch-allreduce"):
        return float(ring_bytes(params * 4, world)), "fp32 ring all-reduce of every parameter"
    if name == "torch-fp16":
        return float(ring_bytes(params * 2, world)), "fp16 ring all-reduce of every parameter"
    if "elements" in after:
        elements = (after["elements"] - before.get("elements", 0.0)) / max(steps, 1)
        return (
            float(ring_bytes(int(elements * 4), world)),
            "ring all-reduce of the elements torch's PowerSGDState counts",
        )
    if "bytes" in after:
        done = after["steps"] - before.get("steps", 0.0)
        if done > 0:
            return (after["bytes"] - before.get("bytes", 0.0)) / done, "hook stats (bytes_sent)"
    return None, "unknown"


class _Progress:
    """Where this rank is, in a file the parent reads when a launch fails: a rank killed by a
    gloo abort reports nothing else."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self, text: str) -> None:
        os.pwrite(self.fd, text.encode().ljust(128)[:128], 0)


def _capture_stderr(path: str) -> None:
    """Send this rank's fd 2 to ``path``: what gloo prints before it aborts is kept there for
    the parent's failure report (it would otherwise scroll by between the ranks' output)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def run_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train one model per hook, interleaving the hooks step by step (the order rotates each
    step); every rank's per-step times, bytes per step and, when ``measure_lo``, what crossed
    this namespace's ``lo`` during each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = cfg.get("workdir")
    if workdir:
        _capture_stderr(os.path.join(workdir, f"rank{rank}.stderr"))
        progress = _Progress(os.path.join(workdir, f"rank{rank}.progress"))
    else:
        progress = lambda text: None  # noqa: E731
    hooks: list[str] = cfg["hooks"]
    steps, warmup = cfg["steps"], cfg["warmup"]
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    models, states, opts = {}, {}, {}
    for name in hooks:
        progress(f"setup {name}")
        models[name], states[name] = _build(
            name, make_mlp(cfg["width"], cfg["layers"]), cfg.get("bucket_cap_mb")
        )
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
    params = sum(p.numel() for p in models[hooks[0]].parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g)

    measure = bool(cfg.get("measure_lo")) and rank == 0
    times: dict[str, list[float]] = {name: [] for name in hooks}
    wire: dict[str, list[int]] = {name: [] for name in hooks}
    before: dict[str, dict] = {}
    pending: Optional[tuple[str, int]] = None  # the step whose traffic the next barrier ends

    def barrier(next_name: str) -> None:
        nonlocal pending
        progress(f"barrier before {next_name}")
        dist.barrier()
        if measure:
            now = lo_tx_bytes()
            if pending is not None:
                wire[pending[0]].append(now - pending[1])
            pending = (next_name, now) if next_name else None

    for step in range(warmup + steps):
        if step == warmup:
            before = {name: _counters(name, states[name]) for name in hooks}
        for i in range(len(hooks)):
            name = hooks[(i + step) % len(hooks)]
            barrier(name if step >= warmup else "")
            progress(f"step {name} {step}")
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(models[name](x), y)
            opts[name].zero_grad(set_to_none=False)
            loss.backward()
            opts[name].step()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    barrier("")
    progress("done")

    out: dict[str, Any] = {"rank": rank, "params": params, "hooks": {}}
    for name in hooks:
        sent, source = _bytes_per_step(
            name, params, world, before.get(name, {}), _counters(name, states[name]), steps
        )
        try:  # a private API: the bucket layout is a nicety (after DDP's rebuild, if any)
            data = models[name]._get_ddp_logging_data()
            buckets = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        except Exception:
            buckets = ""
        out["hooks"][name] = {
            "times_s": times[name],
            "bytes_per_step": sent,
            "bytes_source": source,
            "lo_bytes": wire[name] if measure else None,
            "bucket_sizes": [int(b) for b in buckets.split(",") if b.strip().isdigit()],
        }
    return out
