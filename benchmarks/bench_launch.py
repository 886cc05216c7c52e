"""pycomm.launch's start methods side by side: the wall time of a launch of N ranks that each
build a DDP model and all-reduce once, with ``start_method="spawn"`` (a fresh interpreter per
rank) and ``"forkserver"`` (ranks forked from one server that imported torch and pycomm once).

The launches alternate (spawn, forkserver, spawn, ...) so that both see the same machine; the
forkserver's first launch, which starts the server, is reported apart and left out of its
median. Prints the median of each and their ratio; ``--json`` writes them.

    python benchmarks/bench_launch.py [--nprocs 2] [--launches 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

import pycomm
from pycomm.launcher import START_METHODS


def _rank_work() -> float:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item()) + sum(p.numel() for p in model.parameters()) * 0.0


def _timed(nprocs: int, method: str) -> float:
    t0 = time.perf_counter()
    results = pycomm.launch(_rank_work, nprocs, start_method=method, timeout=120)
    elapsed = time.perf_counter() - t0
    assert results == [float(nprocs)] * nprocs, results
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--launches", type=int, default=7, help="timed launches per start method")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    first = _timed(args.nprocs, "forkserver")  # starts the server
    times: dict[str, list[float]] = {m: [] for m in START_METHODS}
    for _ in range(args.launches):
        for method in START_METHODS:
            times[method].append(_timed(args.nprocs, method))
    median = {m: statistics.median(t) for m, t in times.items()}
    ratio = median["forkserver"] / median["spawn"]
    print(f"launch of {args.nprocs} ranks (DDP model, one all-reduce), median of {args.launches}")
    for m in START_METHODS:
        print(f"  {m:<11} {median[m]:7.3f} s   ({', '.join(f'{t:.2f}' for t in times[m])})")
    print(f"  forkserver's first launch (starts the server): {first:.3f} s")
    print(f"  forkserver / spawn: {ratio:.3f}")
    if args.json:
        doc = {
            "command": "python benchmarks/bench_launch.py "
            + f"--nprocs {args.nprocs} --launches {args.launches}",
            "nprocs": args.nprocs,
            "torch": torch.__version__,
            "seconds": times,
            "median_s": median,
            "forkserver_first_s": first,
            "forkserver_vs_spawn": ratio,
        }
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
