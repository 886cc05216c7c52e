"""Codec kernels (encode16, quantize_int8, quantize_onebit and their *_sum decoders) against the
machine's copy bandwidth and the same math in torch eager ops.

The eager side is pycomm.reference: the definition of each codec, written as plain torch ops.
For each op: GB/s (bytes read + written per call / median time), the ratio to a plain
``dst.copy_(src)`` of the bucket (``copy/ours``: 1.0 is the floor a memory-bound op can reach),
and the speedup over eager. Ours and eager are timed in alternation, rep by rep, so that noise
on this shared machine hits both alike; each timed call (copy floor included) follows untimed
calls of the same op (``--warm-ms``), or a cache scrub (``--cold``). The decoders sum R rows
of m = bucket elements each into an fp32 out of m elements.

    python benchmarks/bench_codecs.py [--mb 25] [--reps 21] [--cold] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch

from pycomm import ops, reference


def _median_pair(fa, fb, reps: int, before) -> tuple[float, float]:
    """Median seconds of fa and fb, timed in alternation; before(f) runs untimed before each."""
    for _ in range(2):
        fa()
        fb()
    ta, tb = [], []
    for _ in range(reps):
        before(fa)
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        before(fb)
        t2 = time.perf_counter()
        fb()
        t3 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t3 - t2)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mb", type=float, default=25.0, help="bucket size in MB (fp32)")
    ap.add_argument("--reps", type=int, default=21, help="timed repetitions per case")
    ap.add_argument("--int8-block", type=int, default=256, help="elements per int8 scale")
    ap.add_argument("--onebit-block", type=int, default=64, help="elements per 1-bit scale")
    ap.add_argument("--rows", type=int, default=2, help="R, rows summed by the decoders")
    ap.add_argument(
        "--warm-ms",
        type=float,
        default=10.0,
        help="untimed calls of the same op, for at least this long, before each timed call",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="instead, overwrite a --scrub-mb buffer before each timed call (copy floor "
        "included), so that every call starts from memory",
    )
    ap.add_argument("--scrub-mb", type=float, default=1024.0, help="scrub size for --cold")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    # Every timed call (ours, eager, copy floor) starts from the same state. Right after another
    # op, even after a sleep, this machine needs ~5 back-to-back calls of a 1-2 ms op to reach
    # its steady speed (caches, clocks, thread wake-up): timing ours right after eager would
    # time that transient against a copy floor timed back to back.
    if args.cold:
        scrub = torch.empty(int(args.scrub_mb * 1e6 / 4))

        def before(f):
            scrub.fill_(1.0)
    else:

        def before(f):
            end = time.perf_counter() + args.warm_ms / 1e3
            f()
            while time.perf_counter() < end:
                f()

    b8, b1, rows = args.int8_block, args.onebit_block, args.rows
    lcm = b8 * b1 // math.gcd(b8, b1)
    n = int(args.mb * 1e6 / 4) // lcm * lcm
    src, dst = torch.randn(n), torch.empty(n)
    copy_t, _ = _median_pair(lambda: dst.copy_(src), lambda: None, args.reps, before)
    copy_gbs = 2 * n * 4 / copy_t / 1e9

    rows_out = []

    def case(name, nbytes, ours, eager):
        t_ours, t_eager = _median_pair(ours, eager, args.reps, before)
        gbs = nbytes / t_ours / 1e9
        rows_out.append(
            {
                "case": name,
                "bytes": nbytes,
                "ours_ms": t_ours * 1e3,
                "eager_ms": t_eager * 1e3,
                "ours_gbs": gbs,
                "copy_over_ours": copy_gbs / gbs,
                "speedup_vs_eager": t_eager / t_ours,
            }
        )

    x = torch.randn(n)
    # one residual each, so that both sides carry their own error feedback from call to call
    r_ours, r_eager = torch.randn(n) * 0.01, torch.randn(n) * 0.01
    bf16 = torch.bfloat16

    case(
        "encode16 bf16",
        n * (4 + 2),
        lambda: ops.encode16(x, None, 0.5, bf16, n),
        lambda: reference.encode16(x, None, 0.5, bf16, n),
    )
    case(
        "encode16 bf16 +residual",
        n * (4 + 4 + 2 + 4),
        lambda: ops.encode16(x, r_ours, 0.5, bf16, n),
        lambda: reference.encode16(x, r_eager, 0.5, bf16, n),
    )
    case(
        f"quantize_int8 +residual b{b8}",
        n * (4 + 4 + 1 + 4) + 4 * n // b8,
        lambda: ops.quantize_int8(x, r_ours, 0.5, b8, n),
        lambda: reference.quantize_int8(x, r_eager, 0.5, b8, n),
    )
    case(
        f"quantize_onebit +residual b{b1}",
        n * (4 + 4 + 4) + n // 8 + 2 * n // b1,
        lambda: ops.quantize_onebit(x, r_ours, 0.5, b1, n),
        lambda: reference.quantize_onebit(x, r_eager, 0.5, b1, n),
    )

    out_ours, out_eager = torch.empty(n), torch.empty(n)
    chunks = torch.randn(rows, n).to(bf16)
    case(
        f"decode16_sum bf16 R={rows}",
        rows * n * 2 + n * 4,
        lambda: ops.decode16_sum(chunks, 0.5, out_ours),
        lambda: reference.decode16_sum(chunks, 0.5, out_eager),
    )
    enc = [ops.quantize_int8(torch.randn(n), None, 1.0, b8, n) for _ in range(rows)]
    codes, scales = torch.stack([c for c, _ in enc]), torch.stack([s for _, s in enc])
    case(
        f"dequantize_int8_sum R={rows}",
        rows * (n + 4 * n // b8) + n * 4,
        lambda: ops.dequantize_int8_sum(codes, scales, b8, 0.5, out_ours),
        lambda: reference.dequantize_int8_sum(codes, scales, b8, 0.5, out_eager),
    )
    enc = [ops.quantize_onebit(torch.randn(n), None, 1.0, b1, n) for _ in range(rows)]
    bits, bscales = torch.stack([c for c, _ in enc]), torch.stack([s for _, s in enc])
    case(
        f"dequantize_onebit_sum R={rows}",
        rows * (n // 8 + 2 * n // b1) + n * 4,
        lambda: ops.dequantize_onebit_sum(bits, bscales, b1, 0.5, out_ours),
        lambda: reference.dequantize_onebit_sum(bits, bscales, b1, 0.5, out_eager),
    )

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.mb:g} MB buckets ({n} elements), median of {args.reps}, "
        f"{'cold (scrubbed caches)' if args.cold else f'warm (after {args.warm_ms:g} ms of calls)'}"
    )
    print(f"copy_ floor: {copy_gbs:.2f} GB/s ({copy_t * 1e3:.2f} ms for {args.mb:g} MB)")
    print(
        f"{'case':<34}{'ours ms':>9}{'eager ms':>10}{'ours GB/s':>11}{'copy/ours':>11}"
        f"{'vs eager':>10}"
    )
    for r in rows_out:
        print(
            f"{r['case']:<34}{r['ours_ms']:>9.3f}{r['eager_ms']:>10.3f}{r['ours_gbs']:>11.2f}"
            f"{r['copy_over_ours']:>10.2f}x{r['speedup_vs_eager']:>9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "machine": platform.machine(),
                    "mb": args.mb,
                    "numel": n,
                    "reps": args.reps,
                    "state": "cold" if args.cold else f"warm {args.warm_ms:g} ms",
                    "int8_block": b8,
                    "onebit_block": b1,
                    "decode_rows": rows,
                    "copy_gbs": copy_gbs,
                    "rows": rows_out,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
