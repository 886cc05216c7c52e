"""How often 2 gloo ranks abort at exit right after a collective, with and without pycomm.

torch's gloo worker threads free a finished collective after they have woken its waiter; when
the waiter has already dropped the tensors (``all_gather_object`` does), the free takes the
GIL. A process that exits at once can reach interpreter finalization first, and then the
worker thread is ended inside torch's noexcept code: SIGABRT, "terminate called without an
active exception", after all the work is done. ``pycomm.dist.settle_at_exit`` (armed by
pycomm's entry points, and at exit while a group is initialized) releases the GIL for
``pycomm.dist.SETTLE_S`` seconds before finalization.

Each trial launches 2 ranks (gloo, loopback) that gather a small object 3 times and exit;
the variants alternate trial by trial, on a machine kept busy by ``--load`` spinning
processes (the race needs a rank descheduled at the wrong moment):
- ``torch``: torch.distributed alone;
- ``pycomm``: the same script after ``import pycomm`` (which arms nothing else).

Usage: python benchmarks/bench_exit.py --trials 40 --load 2 [--destroy] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

WORKER = r"""
import sys
if sys.argv[3] == "pycomm":
    import pycomm  # noqa: F401
import torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
for _ in range(3):
    out = [None, None]
    dist.all_gather_object(out, {"rank": rank, "payload": list(range(100))})
if sys.argv[4] == "destroy":
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spin() -> None:
    while True:
        pass


def trial(variant: str, destroy: bool) -> list[int]:
    """The exit codes of the 2 ranks of one launch."""
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    end = "destroy" if destroy else "exit"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), port, variant, end],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        codes.append(p.returncode)
    return codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=40, help="launches per variant")
    ap.add_argument("--load", type=int, default=2, help="spinning processes beside the ranks")
    ap.add_argument("--destroy", action="store_true", help="destroy_process_group before exit")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for s in spinners:
        s.start()
    results: dict[str, dict[str, int]] = {
        v: {"launches": 0, "aborted_launches": 0, "aborted_ranks": 0, "other_failures": 0}
        for v in ("torch", "pycomm")
    }
    start = time.perf_counter()
    try:
        for _ in range(args.trials):
            for variant in ("torch", "pycomm"):  # side by side, alternating
                codes = trial(variant, args.destroy)
                r = results[variant]
                r["launches"] += 1
                aborted = sum(c == -6 for c in codes)  # SIGABRT
                r["aborted_ranks"] += aborted
                r["aborted_launches"] += aborted > 0
                r["other_failures"] += sum(c not in (0, -6) for c in codes)
    finally:
        for s in spinners:
            s.terminate()
    out = {
        "trials": args.trials,
        "load": args.load,
        "destroy": args.destroy,
        "seconds": round(time.perf_counter() - start, 1),
        "results": results,
    }
    for variant, r in results.items():
        print(
            f"{variant:7s} {r['aborted_launches']:3d} of {r['launches']} launches aborted "
            f"({r['aborted_ranks']} ranks), {r['other_failures']} other failures"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
