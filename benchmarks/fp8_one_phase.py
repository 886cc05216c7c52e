"""Numerics only (no timing, no GPU): how far from the exact mean a one-phase fp8 all-reduce
(NCCL >= 2.24 sums float8 e4m3 buffers on SM90) lands, against pycomm's two-phase fp8 and
int8 exchanges, for one step without error feedback.

A ring all-reduce sends partial sums in the buffer's dtype: the reduce-scatter's N-1 hops
each round the running sum to e4m3, and nothing can feed that rounding back (no rank sees
it). All ranks must share the scale for the codes to add up: here one MAX all-reduce of each
block's absmax (per-block, the bytes of pycomm's scales) or of the bucket's (per-tensor),
with N x headroom so the sum cannot overflow 448. The two-phase exchange of pycomm's codecs
(each owner decodes its chunk of every rank in fp32, sums, re-encodes once) rounds twice.

Gradients: a shared signal plus per-rank noise, in "layers" whose magnitudes span 1e-4..1
(log-uniform), as a real bucket's do.

    python benchmarks/fp8_one_phase.py [--n 1048576] [--ranks 2,4,8,16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from pycomm.hooks import Fp8Codec, Int8Codec

E4M3 = torch.float8_e4m3fn


def _grads(n: int, ranks: int, gen: torch.Generator) -> torch.Tensor:
    layers = 64
    mags = 10 ** (-4 * torch.rand(layers, generator=gen))
    scale = mags.repeat_interleave(n // layers)
    signal = torch.randn(n, generator=gen)
    noise = torch.randn(ranks, n, generator=gen)
    return (signal + noise) * scale


def two_phase(codec, g: torch.Tensor) -> torch.Tensor:
    """pycomm's exchange on one bucket: phase 1 codes of g/N, owners decode-sum in fp32 and
    re-encode, every rank decodes (no error feedback)."""
    ranks, n = g.shape
    rows = [codec.encode(g[r], None, 1.0 / ranks, n) for r in range(ranks)]
    codes, scales = torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])
    summed = torch.empty(n)
    codec.decode_sum(codes, scales, 1.0, summed)
    c2, s2 = codec.encode(summed, None, 1.0, n)
    out = torch.empty(n)
    codec.decode_sum(c2[None], s2[None], 1.0, out)
    return out


def one_phase(g: torch.Tensor, block: int) -> torch.Tensor:
    """A ring all-reduce of e4m3 codes under a shared scale (block = n: per-tensor): N-1
    partial sums each rounded to e4m3, decoded once."""
    ranks, n = g.shape
    b = g.view(ranks, -1, block)
    absmax = b.abs().amax(2).amax(0)  # the MAX all-reduce of the scales
    s = torch.where(absmax > 0, absmax / 448.0, torch.ones_like(absmax))  # y / s in [-448, 448]
    codes = (b / ranks / s[None, :, None]).to(E4M3)  # headroom: the sum of N stays <= 448
    partial = codes[0]
    for r in range(1, ranks):  # each hop: add in fp32, store and send e4m3
        partial = (partial.float() + codes[r].float()).to(E4M3)
    return (partial.float() * s[:, None]).view(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 20, help="bucket elements; default 2^20")
    ap.add_argument("--ranks", default="2,4,8,16", help="comma-separated world sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"relative L2 error of one step's mean gradient, n={args.n}, no error feedback")
    print(f"{'ranks':>5} {'int8 2-phase':>13} {'fp8 2-phase':>12} {'fp8 1-phase b64':>16} "
          f"{'fp8 1-phase tensor':>19}")  # fmt: skip
    for ranks in (int(t) for t in args.ranks.split(",")):
        g = _grads(args.n, ranks, gen)
        exact = g.mean(0)

        def err(approx, exact=exact):
            return ((approx - exact).norm() / exact.norm()).item()

        row = {
            "ranks": ranks,
            "int8_two_phase": err(two_phase(Int8Codec(64), g)),
            "fp8_two_phase": err(two_phase(Fp8Codec(64), g)),
            "fp8_one_phase_block64": err(one_phase(g, 64)),
            "fp8_one_phase_tensor": err(one_phase(g, args.n)),
        }
        rows.append(row)
        values = [row[k] for k in list(row)[1:]]
        print(f"{ranks:>5} " + " ".join(f"{v:>{w}.4f}" for v, w in zip(values, (13, 12, 16, 19))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "seed": args.seed, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
