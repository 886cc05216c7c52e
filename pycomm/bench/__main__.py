"""``python -m pycomm.bench``: train a model on N local ranks, one DDP per hook, step by step
in alternation, and print the median step time of each hook against plain DDP.

    python -m pycomm.bench --nprocs 2 --steps 30
"""

from __future__ import annotations

import argparse
import sys

import pycomm
from pycomm.bench.runner import BASELINE, run_rank
from pycomm.wrap import HOOKS


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nprocs", type=_positive, default=2, help="local ranks (gloo)")
    ap.add_argument(
        "--hooks",
        default=f"{BASELINE},allreduce",
        help=f"comma-separated: {BASELINE} (no hook) and any of {', '.join(sorted(HOOKS))}",
    )
    ap.add_argument("--width", type=_positive, default=1024, help="MLP width")
    ap.add_argument("--layers", type=_positive, default=4, help="MLP depth (Linear layers)")
    ap.add_argument("--batch", type=_positive, default=32, help="micro-batch per rank")
    ap.add_argument("--steps", type=_positive, default=30, help="timed steps per hook")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per hook")
    ap.add_argument("--threads", type=_positive, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before giving up")
    args = ap.parse_args(argv)

    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    for h in hooks:
        if h != BASELINE and h not in HOOKS:
            ap.error(
                f"--hooks: unknown hook {h!r}; choose from {BASELINE}, {', '.join(sorted(HOOKS))}"
            )
    if BASELINE not in hooks:
        hooks.insert(0, BASELINE)

    results = pycomm.launch(
        run_rank,
        args.nprocs,
        hooks,
        args.width,
        args.layers,
        args.batch,
        args.steps,
        args.warmup,
        args.threads,
        backend="gloo",
        timeout=args.timeout,
    )
    r0 = results[0]
    base = r0[BASELINE]["median_s"]
    print(
        f"{args.nprocs} ranks (gloo), MLP {args.layers}x{args.width} = {r0['params'] / 1e6:.1f}M "
        f"params, batch {args.batch}/rank, {args.steps} steps, rank 0's times"
    )
    print(f"{'hook':<12}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'vs ddp':>9}{'MB/step':>10}")
    for h in hooks:
        r = r0[h]
        print(
            f"{h:<12}{r['median_s'] * 1e3:>11.2f}{r['min_s'] * 1e3:>9.2f}"
            f"{r['max_s'] * 1e3:>9.2f}{r['median_s'] / base:>8.3f}x"
            f"{r['bytes_per_step'] / 1e6:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
