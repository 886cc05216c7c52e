"""Codec kernels (encode16, quantize_int8, quantize_onebit and their *_sum decoders) against the
machine's copy bandwidth and the same math in torch eager ops; and the int4 and fp8 codecs
(pycomm.hooks.Int4Codec, Fp8Codec: pure PyTorch, no fused kernels yet), side by side with
int8 at the same block (``--int8-block 64`` for int8's default).

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
from pycomm.hooks import Fp8Codec, Int4Codec


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

    # int4 and fp8: the codecs as the hooks call them (residual in, new residual out)
    o_ours, o_eager = torch.empty(n), torch.empty(n)
    for name, codec, code_bytes in (
        (f"Int4Codec b{b4}", Int4Codec(b4), n // 2),
        (f"Fp8Codec b{b4}", Fp8Codec(b4), n),
    ):
        int4 = isinstance(codec, Int4Codec)
        sd = codec.scale_dtype
        ref = (
            (lambda sd=sd: reference.quantize_int4(x, r_eager, 0.5, b4, n, sd, o_eager))
            if int4
            else (lambda: reference.quantize_fp8(x, r_eager, 0.5, b4, n, o_eager))
        )
        case(
            f"{name} encode +residual_out",
            n * (4 + 4 + 4) + code_bytes + 4 * n // b4,
            lambda c=codec: c.encode(x, r_ours, 0.5, n, o_ours),
            ref,
        )
        enc = [codec.encode(torch.randn(n), None, 1.0, n) for _ in range(rows)]
        c4, s4 = torch.stack([c for c, _ in enc]), torch.stack([s for _, s in enc])
        dec = reference.dequantize_int4_sum if int4 else reference.dequantize_fp8_sum
        case(
            f"{name} decode_sum R={rows}",
            rows * (code_bytes + 4 * n // b4) + n * 4,
            lambda c=codec, c4=c4, s4=s4: c.decode_sum(c4, s4, 0.5, out_ours),
            lambda d=dec, c4=c4, s4=s4: d(c4, s4, b4, 0.5, out_eager),
        )

    bench.report(int8_block=b8, onebit_block=b1, decode_rows=rows, int4_block=b4)


if __name__ == "__main__":
    main()
