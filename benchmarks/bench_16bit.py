"""16-bit hooks: one 16-bit all-reduce against the two-phase exchange that sums in fp32.

Both run side by side (interleaved step by step) in one launch; per variant: median step time,
and the relative L2 error of the reduced gradient against DDP's exact fp32 mean (measured on
an untimed reference model fed the same batch). Run under a shaped link by wrapping the
command in the same namespace the bench runner uses, or plain on loopback:

    python benchmarks/bench_16bit.py --nprocs 2 4 [--json benchmarks/results/16bit.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

VARIANTS = {
    "bf16": ("bf16", {}),
    "bf16-2phase": ("bf16", {"two_phase": True}),
    "fp16": ("fp16", {}),
    "fp16-2phase": ("fp16", {"two_phase": True}),
}


def _mlp(width, layers):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def _rank(width, layers, batch, steps, warmup):
    torch.set_num_threads(1)
    models = {
        k: pycomm.wrap(_mlp(width, layers), hook=h, hook_options=o)
        for k, (h, o) in VARIANTS.items()
    }
    exact = DDP(_mlp(width, layers))
    g = torch.Generator().manual_seed(dist.get_rank())
    times = {k: [] for k in models}
    errors = {k: [] for k in models}
    for step in range(warmup + steps):
        x = torch.randn(batch, width, generator=g)
        exact.zero_grad()
        exact(x).square().mean().backward()
        ref = _grads(exact)
        for k, m in models.items():
            m.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            if step >= warmup:
                times[k].append(time.perf_counter() - t0)
                errors[k].append(((_grads(m) - ref).norm() / ref.norm()).item())
    return {
        k: {"median_ms": statistics.median(times[k]) * 1e3, "rel_err": statistics.median(errors[k])}
        for k in models
    }


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for n in args.nprocs:
        res = pycomm.launch(
            _rank, n, args.width, args.layers, args.batch, args.steps, 3, timeout=900
        )[0]
        out[n] = res
        print(
            f"{n} ranks, MLP {args.layers}x{args.width}, batch {args.batch}, "
            f"median of {args.steps} steps (forward+backward+reduction)"
        )
        for k, r in res.items():
            print(f"  {k:<13}{r['median_ms']:>9.2f} ms   rel. L2 error {r['rel_err']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
