"""Many tensors through one ``pycomm.Exchange``: one call, several keys in flight, one flat.

A model's parameters are several tensors. Three ways to average them with an ``Exchange``,
timed side by side on the same ranks, interleaved round by round (the order rotating, a
barrier before each), medians over the rounds:

- ``flat``: one tensor of the same total size, one key (the floor: one exchange);
- ``list``: the tensors in one call, ``ex.all_reduce([t1, ..., t7], key)`` (one exchange);
- ``keys``: one key per tensor, every call issued before the first ``wait()``.

The default tensors are a small character model's seven (156,384 parameters: an embedding,
three linear layers' weights and biases).

    python benchmarks/bench_exchange.py [--codec int4] [--nprocs 2] [--rounds 60]
        [--json benchmarks/results/exchange_many.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import pycomm

# (rows, cols) of each tensor: Embedding(96, 128), Linear(128, 512), Linear(512, 128),
# Linear(128, 96), weights then biases
SHAPES = [(96, 128), (512, 128), (512,), (128, 512), (128,), (96, 128), (96,)]


def run(codec: str, rounds: int, warmup: int, names: list[str], check: str) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    ex = pycomm.Exchange(codec, check_order=check)

    def flat_call() -> None:
        ex.all_reduce(flat, key="flat").wait()

    def list_call() -> None:
        ex.all_reduce(tensors, key="list").wait()

    def keys_call() -> None:
        works = [ex.all_reduce(t, key=("keys", i)) for i, t in enumerate(tensors)]
        for w in works:
            w.wait()

    ways = {"flat": flat_call, "list": list_call, "keys": keys_call}
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            ways[name]()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's
            if r >= warmup:
                times[name].append(dt.item())
    return {"times": times, "params": flat.numel(), "tensors": len(tensors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check-order", default="every", help="the Exchange's check_order")
    ap.add_argument("--ways", default="flat,list,keys", help="which ways to time")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    ways = args.ways.split(",")
    out = pycomm.launch(run, args.nprocs, args.codec, args.rounds, args.warmup, ways,
                        args.check_order)[0]  # fmt: skip
    med = {n: statistics.median(t) * 1e3 for n, t in out["times"].items()}
    base = med.get("flat") or next(iter(med.values()))
    doc = {"config": vars(args), "params": out["params"], "tensors": out["tensors"],
           "median_ms": med, "ratio_to_flat": {n: m / base for n, m in med.items()},
           "times_s": out["times"]}  # fmt: skip
    lines = [f"  {n:<5} {m:8.3f} ms   {m / base:5.2f}x flat" for n, m in med.items()]
    head = f"{args.codec}, {args.nprocs} ranks, {out['tensors']} tensors, {out['params']} "
    print(head + f"parameters, medians of {args.rounds} interleaved rounds", *lines, sep="\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
