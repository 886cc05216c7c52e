"""Codec kernels (encode16, quantize_int8, quantize_int4, quantize_fp8, quantize_onebit and their
*_sum decoders) against the machine's copy bandwidth and the same math in torch eager ops; then
int4 and fp8 against int8 at the same block, side by side (time per call of one bucket: per
element, as every codec encodes and decodes the same n elements).

The eager side is pycomm.reference: the definition of each codec, written as plain torch ops.
For each op: GB/s (bytes read + written per call / median time), the ratio to a plain
``dst.copy_(src)`` of the bucket (``copy/ours``: 1.0 is the floor a memory-bound op can reach),
and the speedup over eager (second table: over int8). Timing as in kernel_bench.py. The
decoders sum R rows of m = bucket elements each into an fp32 out of m elements.

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
    ap.add_argument("--int4-block", type=int, default=64, help="elements per int4/fp8 scale")
    args = ap.parse_args()
    b8, b1, rows, b4 = args.int8_block, args.onebit_block, args.rows, args.int4_block
    lcm = b8 * b1 // math.gcd(b8, b1)
    lcm = lcm * b4 // math.gcd(lcm, b4)
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

    # int4 and fp8 as the hooks call them (residual in, new residual out), against eager
    o_ours, o_eager = torch.empty(n), torch.empty(n)
    enc8 = lambda: ops.quantize_int8(x, r_ours, 0.5, b4, n, o_ours)  # noqa: E731
    enc4 = lambda: ops.quantize_int4(x, r_ours, 0.5, b4, n, o_ours)  # noqa: E731
    enc_fp8 = lambda: ops.quantize_fp8(x, r_ours, 0.5, b4, n, o_ours)  # noqa: E731
    case(
        f"quantize_int4 +residual_out b{b4}",
        n * (4 + 4 + 4) + n // 2 + 4 * n // b4,
        enc4,
        lambda: reference.quantize_int4(x, r_eager, 0.5, b4, n, o_eager),
    )
    case(
        f"quantize_fp8 +residual_out b{b4}",
        n * (4 + 4 + 4 + 1) + 4 * n // b4,
        enc_fp8,
        lambda: reference.quantize_fp8(x, r_eager, 0.5, b4, n, o_eager),
    )

    def rows_of(encode):
        enc = [encode(torch.randn(n), None, 1.0, b4, n) for _ in range(rows)]
        return torch.stack([c for c, _ in enc]), torch.stack([s for _, s in enc])

    c8, s8 = rows_of(ops.quantize_int8)
    c4, s4 = rows_of(ops.quantize_int4)
    cf, sf = rows_of(ops.quantize_fp8)
    dec8 = lambda: ops.dequantize_int8_sum(c8, s8, b4, 0.5, out_ours)  # noqa: E731
    dec4 = lambda: ops.dequantize_int4_sum(c4, s4, b4, 0.5, out_ours)  # noqa: E731
    dec_fp8 = lambda: ops.dequantize_fp8_sum(cf, sf, b4, 0.5, out_ours)  # noqa: E731
    case(
        f"dequantize_int4_sum R={rows}",
        rows * (n // 2 + 4 * n // b4) + n * 4,
        dec4,
        lambda: reference.dequantize_int4_sum(c4, s4, b4, 0.5, out_eager),
    )
    case(
        f"dequantize_fp8_sum R={rows}",
        rows * (n + 4 * n // b4) + n * 4,
        dec_fp8,
        lambda: reference.dequantize_fp8_sum(cf, sf, b4, 0.5, out_eager),
    )

    # the same n elements through int4 or fp8 and through int8, at one block: the speedup
    # column is int8's time over ours (> 1: faster per element than int8)
    vs8 = kernel_bench.Bench(args, n, "int8")
    vs8.case(f"quantize_int4 b{b4}", n * (4 + 4 + 4) + n // 2 + 4 * n // b4, enc4, enc8)
    vs8.case(f"quantize_fp8 b{b4}", n * (4 + 4 + 4 + 1) + 4 * n // b4, enc_fp8, enc8)
    vs8.case(f"dequantize_int4_sum R={rows}", rows * (n // 2 + 4 * n // b4) + n * 4, dec4, dec8)
    vs8.case(f"dequantize_fp8_sum R={rows}", rows * (n + 4 * n // b4) + n * 4, dec_fp8, dec8)

    bench.report(int8_block=b8, onebit_block=b1, decode_rows=rows, int4_block=b4, vs_int8=vs8.rows)
    print(f"int4 and fp8 against int8 at block {b4}:")
    vs8.print_table()


if __name__ == "__main__":
    main()
