"""Bucket-fusion kernels against the machine's copy bandwidth and torch's own path.

``pack`` allocates its result (as ``_flatten_dense_tensors`` does); ``pack_into_`` writes into a
buffer that lives across steps, which is what the hooks use and what the copy floor measures.

For each op: GB/s (bytes read + written per call / median time), the ratio to a plain
``dst.copy_(src)`` of the same size (the floor a memory-bound op can reach), and the speedup
over what torch users write today (``_flatten_dense_tensors`` / ``_unflatten_dense_tensors``
plus ``mul_`` / ``copy_``). Timing as in kernel_bench.py.

    python benchmarks/bench_fusion.py [--mb 25] [--reps 41] [--json benchmarks/results/fusion.json]
"""

from __future__ import annotations

import argparse

import kernel_bench
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pycomm import ops


def _split(total: int, count: int) -> list[torch.Tensor]:
    base = total // count
    return [torch.randn(base + (i % 3)) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    kernel_bench.add_arguments(ap, reps=41)
    ap.add_argument("--small", type=int, default=200, help="tensor count of the small-tensor case")
    ap.add_argument("--small-numel", type=int, default=4096, help="elements per small tensor")
    args = ap.parse_args()
    n = int(args.mb * 1e6 / 4)
    bench = kernel_bench.Bench(args, n, "torch")
    case = bench.case

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

    bench.report(small=args.small, small_numel=args.small_numel)


if __name__ == "__main__":
    main()
