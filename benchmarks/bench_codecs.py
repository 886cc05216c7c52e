"""Codec kernels (encode16, quantize_int8, quantize_onebit and their *_sum decoders) against the
machine's copy bandwidth and the same math in torch eager ops.

The eager side is pycomm.reference: the definition of each codec, written as plain torch ops.
For each op: GB/s (bytes read + written per call / median time), the ratio to a plain
``dst.copy_(src)`` of the bucket (``copy/ours``: 1.0 is the floor a memory-bound op can reach),
and the speedup over eager. Timing as in kernel_bench.py. The decoders sum R rows
of m = bucket elements each into an fp32 out of m elements.

    python benchmarks/bench_codecs.py [--mb 25] [--reps 21] [--cold] [--json FILE]
"""

from __future__ import annotations

import argparse
import math

import kernel_bench
import torch

from pycomm import ops, reference


def _has_residual_out() -> bool:
    """Whether the built encoders take ``residual_out`` (newer schemas do)."""
    schema = torch.ops.pycomm.quantize_int8.default._schema
    return any(a.name == "residual_out" for a in schema.arguments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    kernel_bench.add_arguments(ap, reps=21)
    ap.add_argument("--int8-block", type=int, default=256, help="elements per int8 scale")
    ap.add_argument("--onebit-block", type=int, default=64, help="elements per 1-bit scale")
    ap.add_argument("--rows", type=int, default=2, help="R, rows summed by the decoders")
    args = ap.parse_args()
    b8, b1, rows = args.int8_block, args.onebit_block, args.rows
    lcm = b8 * b1 // math.gcd(b8, b1)
    n = int(args.mb * 1e6 / 4) // lcm * lcm
    bench = kernel_bench.Bench(args, n, "eager")
    case = bench.case

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
        "encode16 fp16 +residual",
        n * (4 + 4 + 2 + 4),
        lambda: ops.encode16(x, r_ours, 0.5, torch.float16, n),
        lambda: reference.encode16(x, r_eager, 0.5, torch.float16, n),
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

    if _has_residual_out():
        # the hooks' path: read the residual, write the new one elsewhere (committed later)
        o_ours, o_eager = torch.empty(n), torch.empty(n)
        case(
            f"quantize_int8 +residual_out b{b8}",
            n * (4 + 4 + 1 + 4) + 4 * n // b8,
            lambda: ops.quantize_int8(x, r_ours, 0.5, b8, n, residual_out=o_ours),
            lambda: reference.quantize_int8(x, r_eager, 0.5, b8, n, residual_out=o_eager),
        )
        case(
            f"quantize_onebit +residual_out b{b1}",
            n * (4 + 4 + 4) + n // 8 + 2 * n // b1,
            lambda: ops.quantize_onebit(x, r_ours, 0.5, b1, n, residual_out=o_ours),
            lambda: reference.quantize_onebit(x, r_eager, 0.5, b1, n, residual_out=o_eager),
        )

    out_ours, out_eager = torch.empty(n), torch.empty(n)
    chunks = torch.randn(rows, n).to(bf16)
    case(
        f"decode16_sum bf16 R={rows}",
        rows * n * 2 + n * 4,
        lambda: ops.decode16_sum(chunks, 0.5, out_ours),
        lambda: reference.decode16_sum(chunks, 0.5, out_eager),
    )
    chunks16 = torch.randn(rows, n).to(torch.float16)
    case(
        f"decode16_sum fp16 R={rows}",
        rows * n * 2 + n * 4,
        lambda: ops.decode16_sum(chunks16, 0.5, out_ours),
        lambda: reference.decode16_sum(chunks16, 0.5, out_eager),
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

    bench.report(int8_block=b8, onebit_block=b1, decode_rows=rows)


if __name__ == "__main__":
    main()
