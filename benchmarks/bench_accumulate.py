"""Gradient accumulation, k micro-batches per optimizer step: TrainLoop against the naive loop
that synchronizes every micro-batch, side by side in one run (interleaved step by step).

    python benchmarks/bench_accumulate.py --link 2.5gbit --json benchmarks/results/accumulate.json

Loops (2 gloo ranks, the compression issue's MLP of 8 layers of 1024, batch 64 per micro-batch,
one thread per rank):
  naive        plain DDP, every micro-batch's backward all-reduces, step every k-th
  no_sync      TrainLoop over plain DDP: the first k - 1 micro-steps inside ddp.no_sync()
  stage        TrainLoop, pycomm.wrap(hook="allreduce", accumulate_steps=k): fp32 sums
  stage-int8   TrainLoop, pycomm.wrap(hook="int8", accumulate_steps=k)

``--link RATE`` runs the ranks in a private network namespace whose loopback is shaped to
ranks x RATE (root needed; see pycomm.bench.link).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.bench import link

LOOPS = ("naive", "no_sync", "stage", "stage-int8")


def _mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _rank(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    k, rank = cfg["k"], dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    shape = (cfg["batch"], cfg["width"])
    data = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(k)]
    models, steps = {}, {}
    for name in LOOPS:
        module = _mlp(cfg["width"], cfg["layers"])
        if name in ("naive", "no_sync"):
            ddp = DDP(module)
        else:
            hook = "int8" if name == "stage-int8" else "allreduce"
            ddp = pycomm.wrap(module, hook=hook, accumulate_steps=k)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        models[name] = ddp
        if name == "naive":

            def naive(ddp=ddp, opt=opt):
                for x, y in data:  # synchronizes on every backward
                    (torch.nn.functional.mse_loss(ddp(x), y) / k).backward()
                opt.step()
                opt.zero_grad()

            steps[name] = naive
        else:
            loop = pycomm.TrainLoop(ddp, opt, accumulate_steps=k if name == "no_sync" else None)

            def train(ddp=ddp, loop=loop):
                for x, y in data:
                    loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))

            steps[name] = train
    times: dict[str, list[float]] = {name: [] for name in LOOPS}
    for it in range(cfg["warmup"] + cfg["steps"]):
        for i in range(len(LOOPS)):
            name = LOOPS[(i + it) % len(LOOPS)]
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            if it >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
    memory = {
        name: pycomm.hook_state(models[name]).stats["accumulate_bytes"]
        for name in LOOPS
        if name.startswith("stage")
    }
    return {"times": times, "accumulate_bytes": memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    ap.add_argument("--layers", type=int, default=8, help="MLP layers (default 8)")
    ap.add_argument("--batch", type=int, default=64, help="samples per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per loop")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per loop")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--link", default=None, help="per-rank rate, e.g. 2.5gbit (needs root)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.nprocs < 1 or args.k < 1 or args.steps < 1:
        ap.error("--nprocs, --k and --steps must be >= 1")
    shaped = None
    if args.link:
        bits = link.parse_rate(args.link) * args.nprocs
        if os.environ.get("PYCOMM_BENCH_NETNS") != "1":
            why = link.cannot_shape() or link.probe(bits)
            if why is None:
                env = {**os.environ, "PYCOMM_BENCH_NETNS": "1"}
                cmd = ["unshare", "-n", "--", sys.executable, *sys.argv]
                raise SystemExit(subprocess.call(cmd, env=env))
            print(f"bench_accumulate: cannot shape the link ({why}); running unshaped")
        else:
            link.shape_loopback(bits)
            shaped = link.format_rate(bits / args.nprocs)
    cfg = vars(args)
    results = pycomm.launch(_rank, args.nprocs, cfg, timeout=900)
    # a step lasts until its slowest rank is done
    per = {
        name: [max(r["times"][name][i] for r in results) for i in range(args.steps)]
        for name in LOOPS
    }
    med = {name: statistics.median(v) * 1e3 for name, v in per.items()}
    params = sum(p.numel() for p in _mlp(args.width, args.layers).parameters())
    print(
        f"{args.nprocs} ranks, MLP {args.layers}x{args.width} = {params / 1e6:.1f}M params, "
        f"k={args.k} micro-batches of {args.batch}, {args.threads} thread(s)/rank, "
        f"link {shaped or 'unshaped'}"
    )
    print(f"{'loop':<12}{'median ms':>10}{'min':>8}{'max':>8}{'naive/this':>12}")
    for name in LOOPS:
        v = [t * 1e3 for t in per[name]]
        print(
            f"{name:<12}{med[name]:>10.1f}{min(v):>8.1f}{max(v):>8.1f}"
            f"{med['naive'] / med[name]:>11.2f}x"
        )
    mem = results[0]["accumulate_bytes"]
    print(
        "fp32 accumulation buffers per rank: "
        + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in mem.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": cfg, "link": shaped, "median_ms": med, "per_step_ms": per,
                 "accumulate_bytes": mem, "params": params},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
