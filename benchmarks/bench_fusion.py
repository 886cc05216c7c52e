"""Bucket-fusion kernels against the machine's copy bandwidth and torch's own path.

``pack`` allocates its result (as ``_flatten_dense_tensors`` does); ``pack_into_`` writes into a
buffer that lives across steps, which is what the hooks use and what the copy floor measures.

For each op: GB/s (bytes read + written per call / median time), the ratio to a plain
``dst.copy_(src)`` of the same size (the floor a memory-bound op can reach), and the speedup
over what torch users write today (``_flatten_dense_tensors`` / ``_unflatten_dense_tensors``
plus ``mul_`` / ``copy_``). Ours and torch's are timed in alternation, rep by rep, so that
noise on this shared machine hits both alike.

    python benchmarks/bench_fusion.py [--mb 25] [--reps 41] [--json benchmarks/results/fusion.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pycomm import ops


def _median_pair(fa, fb, reps: int) -> tuple[float, float]:
    for _ in range(3):
        fa()
        fb()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def _split(total: int, count: int) -> list[torch.Tensor]:
    base = total // count
    return [torch.randn(base + (i % 3)) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mb", type=float, default=25.0, help="bucket size in MB (fp32)")
    ap.add_argument("--reps", type=int, default=41, help="timed repetitions per case")
    ap.add_argument("--small", type=int, default=200, help="tensor count of the small-tensor case")
    ap.add_argument("--small-numel", type=int, default=4096, help="elements per small tensor")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    n = int(args.mb * 1e6 / 4)
    src, dst = torch.randn(n), torch.empty(n)
    copy_t, _ = _median_pair(lambda: dst.copy_(src), lambda: None, args.reps)
    copy_gbs = 2 * n * 4 / copy_t / 1e9

    rows = []

    def case(name, nbytes, ours, theirs):
        t_ours, t_torch = _median_pair(ours, theirs, args.reps)
        gbs = nbytes / t_ours / 1e9
        rows.append(
            {
                "case": name,
                "bytes": nbytes,
                "ours_ms": t_ours * 1e3,
                "torch_ms": t_torch * 1e3,
                "ours_gbs": gbs,
                "copy_over_ours": copy_gbs / gbs,
                "speedup_vs_torch": t_torch / t_ours,
            }
        )

    for label, tensors in (("4 large", _split(n, 4)), (f"{args.small} small", None)):
        if tensors is None:
            tensors = _split(args.small * args.small_numel, args.small)
        total = sum(t.numel() for t in tensors)
        moved = 2 * total * 4
        flat = ops.pack(tensors)
        buf = torch.empty_like(flat)
        case(
            f"pack_into_ x0.5, {label}",
            moved,
            lambda ts=tensors, b=buf: ops.pack_into_(b, ts, 0.5),
            lambda ts=tensors, b=buf: torch.cat([t.view(-1) for t in ts], out=b).mul_(0.5),
        )
        case(
            f"pack x0.5, {label}",
            moved,
            lambda ts=tensors: ops.pack(ts, 0.5),
            lambda ts=tensors: _flatten_dense_tensors(ts).mul_(0.5),
        )

        def torch_unpack(ts=tensors, f=flat):
            views = _unflatten_dense_tensors(f, ts)
            for t, v in zip(ts, views):
                t.copy_(v)
            torch._foreach_mul_(ts, 2.0)

        case(
            f"unpack_ x2, {label}",
            moved,
            lambda ts=tensors, f=flat: ops.unpack_(f, ts, 2.0),
            torch_unpack,
        )

    acc, x = torch.zeros(n), torch.randn(n)
    case(
        "accumulate_ fp32+=fp32",
        3 * n * 4,
        lambda: ops.accumulate_(acc, x, 0.25),
        lambda: acc.add_(x, alpha=0.25),
    )
    xb = x.bfloat16()
    case(
        "accumulate_ fp32+=bf16",
        n * (4 + 2 + 4),
        lambda: ops.accumulate_(acc, xb, 0.25),
        lambda: acc.add_(xb, alpha=0.25),
    )
    y = torch.randn(n)
    case("scale_ fp32", 2 * n * 4, lambda: ops.scale_(y, -1.0), lambda: y.mul_(-1.0))
    yb = y.bfloat16()
    case("scale_ bf16", 2 * n * 2, lambda: ops.scale_(yb, -1.0), lambda: yb.mul_(-1.0))

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.mb:g} MB buckets, median of {args.reps}"
    )
    print(f"copy_ floor: {copy_gbs:.2f} GB/s ({copy_t * 1e3:.2f} ms for {args.mb:g} MB)")
    print(
        f"{'case':<28}{'ours ms':>9}{'torch ms':>10}{'ours GB/s':>11}{'copy/ours':>11}"
        f"{'vs torch':>10}"
    )
    for r in rows:
        print(
            f"{r['case']:<28}{r['ours_ms']:>9.3f}{r['torch_ms']:>10.3f}{r['ours_gbs']:>11.2f}"
            f"{r['copy_over_ours']:>10.2f}x{r['speedup_vs_torch']:>9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "machine": platform.machine(),
                    "mb": args.mb,
                    "reps": args.reps,
                    "copy_gbs": copy_gbs,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
