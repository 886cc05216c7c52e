"""Validate and time pycomm's CUDA kernels on a GPU (run by scripts/gpu_validate.sh).

1. Every op on CUDA against pycomm.reference (and the CPU kernels) on fresh random data: odd
   sizes (0, 1, block-1, block, block+1, around a thread block's share, large, a 25 MB
   bucket; ``--big`` sets the largest, ``--small`` stops at 8193 for compute-sanitizer), every
   dtype, NaN/Inf, strided and misaligned inputs, outputs poisoned before each run (NaN, or
   0x55 bytes, in the outputs passed in; 0xFF in every free byte of the caching allocator
   for the outputs an op allocates). Bit for bit, except the decoders' squared norm (fp64,
   another summation order: rtol 1e-9; 1e-5 with --cpu, whose kernels square in fp32).
2. Times each kernel at a 25 MB fp32 bucket with CUDA events over CUDA-graph replays of 20
   calls or more (rotating among input sets larger than L2 together, the 200 small tensors'
   case too), against a device-to-device copy that moves the same bytes (read + written,
   rotating likewise), and prints a table: op, GB/s, % of copy bandwidth; the target for the
   encoders and decoders is >= 80%, for pack/unpack of 200 small tensors >= 60%. A bucket of
   odd-sized tensors (each one misaligned after the first) is timed beside them.
3. Writes everything to OUT/gpu_validate.json.

``--cpu`` runs the same script on the CPU (CPU kernels, wall-clock timing), to check the
script itself on a machine without a GPU.

    python scripts/gpu_validate.py [--out DIR] [--mb 25] [--cpu] [--skip-timing]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

from pycomm import ops, reference

NAN = float("nan")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TARGET = 0.80  # of copy bandwidth, for the encoders and decoders
SMALL_TARGET = 0.60  # for pack and unpack of 200 small tensors


class Run:
    """The device under test, a fresh random generator, and the checks' record."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)
        self.checks: list[dict[str, Any]] = []
        # the CUDA decoders square in fp64; the CPU kernels (--cpu) in fp32 lanes within a tile
        # the CPU kernels square in fp32 lanes, up to 128 values a lane per tile: ~1e-5 worst
        # case (1.01e-6 seen on a random seed)
        self.norm_rtol = 1e-9 if device.type == "cuda" else 1e-5

    def randn(self, n: int, dtype=torch.float32, special: bool = True) -> torch.Tensor:
        t = torch.randn(n, generator=self.gen) * 3
        if special and n >= 8:
            idx = torch.randint(0, n, (3,), generator=self.gen)
            t[idx[0]], t[idx[1]], t[idx[2]] = NAN, float("inf"), -float("inf")
        return t.to(dtype)

    def to(self, t):
        """t on the device with the same shape, strides and storage offset (alignment)."""
        if t is None:
            return None
        n = t.untyped_storage().nbytes() // t.element_size()
        whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
        return whole.to(self.device, copy=True).as_strided(t.shape, t.stride(), t.storage_offset())

    def poison_allocator(self, nbytes: int) -> None:
        """Fill every byte the caching allocator can hand the next allocations with 0xFF (NaN
        in every float format), so that an output the kernel leaves unwritten shows, whatever
        its size: each free block of its cached segments (the small pool's, under 1 MB, as
        the large pool's), then a fresh segment of each pool for what none of them fits
        (``nbytes``: the outputs' size)."""
        if self.device.type != "cuda" or nbytes <= 0:
            return
        held = []
        for seg in torch.cuda.memory_snapshot():
            for block in seg["blocks"]:
                if block["state"] == "inactive":  # a free block: taken by its exact size
                    held.append(torch.empty(block["size"], dtype=torch.uint8, device=self.device))
        small = (1 << 20) - 512  # two of them fill a fresh 2 MB segment of the small pool
        held += [torch.empty(small, dtype=torch.uint8, device=self.device) for _ in range(2)]
        held.append(torch.empty(nbytes + (2 << 20), dtype=torch.uint8, device=self.device))
        for t in held:
            t.fill_(0xFF)
        del held  # back to the cache, poisoned

    def check(self, name: str, fn: Callable[[], None]) -> bool:
        try:
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            self.checks.append({"check": name, "ok": False, "detail": detail[:2000]})
            print(f"FAIL {name}: {detail[:500]}", flush=True)
            return False
        self.checks.append({"check": name, "ok": True})
        return True


def bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.is_floating_point():
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"{what}: {bad.shape[0]} elements differ, first at {bad[:4]}"
        return
    nan = got.isnan()
    bad = (nan != want.isnan()).nonzero()
    assert bad.numel() == 0, f"{what}: NaN at different places, first {bad[:4].tolist()}"
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    a, b = got.contiguous().view(ints), want.contiguous().view(ints)
    bad = ((a != b) & ~nan).nonzero()
    first = bad[:4].view(-1)
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} elements differ, first at {first.tolist()}: "
        f"{got.reshape(-1)[first].float().tolist()} != {want.reshape(-1)[first].float().tolist()}"
    )


def poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, NAN) if t.is_floating_point() else torch.full_like(t, 0x55)


# --- 1. correctness ---------------------------------------------------------------------------


def sizes(block: int, big: int) -> list[int]:
    """Sizes around the CUDA kernels' boundaries (a block, a 2048-element tile, 8192-element
    chunks, a million) up to the sweep's large size ``big`` (at least the chunks')."""
    every = {0, 1, max(block - 1, 0), block, block + 1, 2047, 2049, 8191, 8193, 1_000_003, big}
    return sorted(n for n in every if n <= max(big, 8193))


def check_fusion(run: Run, big: int) -> None:
    dev = run.to
    # around the 16-byte vectors (7, 9) and the chunks, up to the sweep's large size
    every = {0, 1, 7, 9, 2047, 2049, 8191, 8193, 1_000_003, big}
    for n in sorted(m for m in every if m <= max(big, 8193)):
        for din in DTYPES:
            for dout in DTYPES:
                ts = [run.randn(n, din), run.randn(n + 3, din)]
                for scale in (0.5, 1.0):

                    def pack(ts=ts, scale=scale, dout=dout):
                        want = reference.pack(ts, scale, dout)
                        run.poison_allocator(want.numel() * want.element_size())
                        bits_equal(ops.pack([dev(t) for t in ts], scale, dout), want, "pack")
                        flat = dev(poisoned(want))
                        ops.pack_into_(flat, [dev(t) for t in ts], scale)
                        bits_equal(flat, want, "pack_into_")
                        back = [poisoned(t) for t in ts]
                        reference.unpack_(want, back, 3.0)
                        got = [dev(poisoned(t)) for t in ts]
                        ops.unpack_(dev(want), got, 3.0)
                        for g, w in zip(got, back):
                            bits_equal(g, w, "unpack_")

                    run.check(f"pack/pack_into_/unpack_ n={n} {din}->{dout} scale={scale}", pack)
            for dst_dtype in {torch.float32, din}:

                def acc(n=n, din=din, dst_dtype=dst_dtype):
                    src, dst = run.randn(n, din), run.randn(n, dst_dtype, special=False)
                    got = dev(dst)
                    reference.accumulate_(dst, src, 0.3)
                    ops.accumulate_(got, dev(src), 0.3)
                    bits_equal(got, dst, "accumulate_")

                run.check(f"accumulate_ n={n} {dst_dtype}+={din}", acc)

            def scale(n=n, din=din):
                t = run.randn(n + 1, din)[1:]  # misaligned too
                for v in (run.randn(n, din), t):
                    got = dev(v)
                    reference.scale_(v, 0.125)
                    ops.scale_(got, 0.125)
                    bits_equal(got, v, "scale_")

            run.check(f"scale_ n={n} {din}", scale)

    def many():
        g = run.gen
        shapes = [(), (0,), (1,), (3, 5), (17,), (33, 3), (1000,), (129, 7), (4096,)]
        ts = []
        for i in range(300):
            t = torch.randn(shapes[i % len(shapes)], generator=g).bfloat16()
            ts.append(t.t() if t.dim() == 2 and i % 3 == 0 else t)
        want = reference.pack(ts, 0.25, torch.float32)
        bits_equal(ops.pack([dev(t) for t in ts], 0.25, torch.float32), want, "pack 300")
        targets = [
            torch.zeros(t.shape[::-1]).bfloat16().t() if t.dim() == 2 else poisoned(t) for t in ts
        ]
        got = [dev(t) for t in targets]
        reference.unpack_(want, targets, 4.0)
        ops.unpack_(dev(want), got, 4.0)
        for a, b in zip(got, targets):
            bits_equal(a, b, "unpack_ 300")

    run.check("pack/unpack_ 300 tensors, strided", many)


def check_encoder(run: Run, name: str, x, scale, arg, numel, rdtype) -> None:
    """rdtype: the residual's dtype (float32 or bfloat16), None without one."""
    with_residual = rdtype is not None
    r = (run.randn(numel, special=False) * 0.1).to(rdtype) if with_residual else None
    r_dev = run.to(r)
    want = getattr(reference, name)(x, r, scale, arg, numel)
    want = want if isinstance(want, tuple) else (want,)
    run.poison_allocator(sum(w.numel() * w.element_size() for w in want) + 4 * x.numel())
    got = getattr(ops, name)(run.to(x), r_dev, scale, arg, numel)
    got = got if isinstance(got, tuple) else (got,)
    for i, (g, w) in enumerate(zip(got, want)):
        bits_equal(g, w, f"{name} output {i}")
    if with_residual:
        bits_equal(r_dev, r, f"{name} residual")


def check_codecs(run: Run, big: int) -> None:
    for name, blocks, scale in (
        ("quantize_int8", [1, 3, 64, 100, 256, 2048, 2560, 4096], 0.5),
        ("quantize_int4", [2, 6, 64, 256, 2048, 4096], 0.5),
        ("quantize_fp8", [1, 3, 64, 256, 4096], 0.5),
        ("quantize_onebit", [8, 64, 256, 4096], 2.0),
        ("encode16", [torch.float16, torch.bfloat16], 3.0),
    ):
        for arg in blocks:
            block = 8 if name == "encode16" else arg
            for n in sizes(block, big):
                for dtype in DTYPES:
                    for pad, rdtype in (
                        (0, torch.float32),
                        (3, torch.float32),
                        (0, torch.bfloat16),
                        (1, None),
                    ):
                        numel = n + pad if name == "encode16" else (-(-n // block) + pad) * block
                        x = run.randn(n, dtype)
                        run.check(
                            f"{name} {arg} n={n} numel={numel} {dtype} residual={rdtype}",
                            lambda x=x, nm=name, s=scale, a=arg, k=numel, rd=rdtype: check_encoder(
                                run, nm, x, s, a, k, rd
                            ),
                        )
    base = run.randn(300 * 70, torch.float16).view(300, 70)
    for i, x in enumerate((base.t(), base[::3, ::2], base[:, 5], base.reshape(-1)[3:6403])):
        for name, arg in (
            ("quantize_int8", 64),
            ("quantize_int4", 64),
            ("quantize_fp8", 64),
            ("quantize_onebit", 64),
            ("encode16", torch.bfloat16),
        ):
            numel = -(-x.numel() // 64) * 64 + 64
            run.check(
                f"{name} strided/misaligned x #{i}",
                lambda x=x, name=name, arg=arg, numel=numel: check_encoder(
                    run, name, x, 0.5, arg, numel, torch.float32
                ),
            )


def check_sum(run: Run, name: str, args: tuple, out: torch.Tensor) -> None:
    want_out = out.clone()
    want = getattr(reference, name)(*args, want_out)
    got_out = run.to(poisoned(out))
    run.poison_allocator(1 << 20)
    got = getattr(ops, name)(
        *(run.to(a) if isinstance(a, torch.Tensor) else a for a in args), got_out
    )
    bits_equal(got_out, want_out, f"{name} out")
    got = got.cpu()
    assert got.dtype == torch.float64 and got.shape == (2,), (got.dtype, got.shape)
    assert got[1] == want[1], f"{name}: non-finite count {got[1].item()} != {want[1].item()}"
    assert math.isclose(got[0].item(), want[0].item(), rel_tol=run.norm_rtol), (
        f"{name}: squared norm {got[0].item()!r} != {want[0].item()!r}"
    )


def check_decoders(run: Run, big: int) -> None:
    for rows in (1, 2, 4):
        for out_dtype in DTYPES:
            for block in (1, 64, 100, 256):
                for n in (1, block + 1, 20011, big // rows):
                    numel = (-(-n // block) + 1) * block
                    enc = [
                        ops.quantize_int8(run.randn(n), None, r + 1.0, block, numel)
                        for r in range(rows)
                    ]
                    codes, scales = (
                        torch.stack([c for c, _ in enc]),
                        torch.stack([s for _, s in enc]),
                    )
                    for short in (0, 3, block + 5):
                        out = torch.full((max(numel - short, 0),), 7.0, dtype=out_dtype)
                        run.check(
                            f"dequantize_int8_sum R={rows} b={block} m={numel} out={out.numel()} "
                            f"{out_dtype}",
                            lambda a=(codes, scales, block, 0.5), o=out: check_sum(
                                run, "dequantize_int8_sum", a, o
                            ),
                        )
            for name, blocks in (("int4", (2, 6, 64, 256)), ("fp8", (1, 3, 64, 256))):
                for block in blocks:
                    for n in (1, block + 1, 20011, big // rows):
                        numel = (-(-n // block) + 1) * block
                        sd = {"scale_dtype": torch.bfloat16} if block == 6 else {}
                        enc = [
                            getattr(ops, f"quantize_{name}")(
                                run.randn(n), None, r + 1.0, block, numel, **sd
                            )
                            for r in range(rows)
                        ]
                        codes, scales = (
                            torch.stack([c for c, _ in enc]),
                            torch.stack([s for _, s in enc]),
                        )
                        for short in (0, 3, block + 5):
                            out = torch.full((max(numel - short, 0),), 7.0, dtype=out_dtype)
                            op = f"dequantize_{name}_sum"
                            run.check(
                                f"{op} R={rows} b={block} m={numel} out={out.numel()} {out_dtype}",
                                lambda a=(codes, scales, block, 0.5), o=out, op=op: check_sum(
                                    run, op, a, o
                                ),
                            )
            for block in (8, 64, 256):
                for n in (1, block + 1, 20011, big // rows):
                    numel = (-(-n // block) + 1) * block
                    enc = [
                        ops.quantize_onebit(run.randn(n), None, r + 1.0, block, numel)
                        for r in range(rows)
                    ]
                    bits, scales = (
                        torch.stack([c for c, _ in enc]),
                        torch.stack([s for _, s in enc]),
                    )
                    for short in (0, 3, block + 5):
                        out = torch.full((max(numel - short, 0),), 7.0, dtype=out_dtype)
                        run.check(
                            f"dequantize_onebit_sum R={rows} b={block} m={numel} out={out.numel()} "
                            f"{out_dtype}",
                            lambda a=(bits, scales, block, 0.25), o=out: check_sum(
                                run, "dequantize_onebit_sum", a, o
                            ),
                        )
            for chunk_dtype in (torch.float16, torch.bfloat16):
                for m in (1, 7, 9, 2049, 20011, big // rows):
                    chunks = torch.stack([run.randn(m) * (r + 1) for r in range(rows)]).to(
                        chunk_dtype
                    )
                    for short in (0, 1, 5):
                        out = torch.full((max(m - short, 0),), 7.0, dtype=out_dtype)
                        run.check(
                            f"decode16_sum R={rows} {chunk_dtype} m={m} out={out.numel()} "
                            f"{out_dtype}",
                            lambda a=(chunks, 3.0), o=out: check_sum(run, "decode16_sum", a, o),
                        )


# --- 2. timing --------------------------------------------------------------------------------


def time_calls(
    device: torch.device, calls: list[Callable[[], Any]], reps: int, batch: int
) -> float:
    """Median seconds per call: `batch` calls (cycling through `calls`) per timed replay."""
    seq = [calls[i % len(calls)] for i in range(batch)]
    for f in seq:
        f()  # warm-up: first-call costs out of the numbers
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in seq:
                f()
            times.append((time.perf_counter() - t0) / batch)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in seq:
            f()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):  # one graph replay: launch gaps stay out of the numbers
        for f in seq:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / batch)
    return statistics.median(times)


def timing(run: Run, mb: float, reps: int) -> list[dict[str, Any]]:
    d = run.device
    b8, b1, rows = 256, 64, 2
    n = int(mb * 1e6 / 4) // (b8 * b1) * (b8 * b1)
    # input sets together several times the L2 (60 MB on an H200), so no call hits in cache
    sets = max(2, math.ceil(4 * 60e6 / (n * 4 * 3))) if d.type == "cuda" else 1
    bf16 = torch.bfloat16
    rnd = [torch.randn(n, device=d) for _ in range(sets)]
    res = [torch.randn(n, device=d) * 0.01 for _ in range(sets)]
    outs = [torch.empty(n, device=d) for _ in range(sets)]
    big4 = [[t.view(4, -1)[i] for i in range(4)] for t in rnd]
    # 200 small tensors are 6.5 MB a call with their flat buffer: more sets than for the large
    # cases, so that a replay's calls together exceed the L2 (60 MB on an H200)
    small_sets = max(2, math.ceil(4 * 60e6 / (2 * 200 * 4096 * 4))) if d.type == "cuda" else 1
    small = [list(torch.randn(200 * 4096, device=d).split(4096)) for _ in range(small_sets)]
    small_flat = [torch.empty(200 * 4096, device=d) for _ in range(small_sets)]
    # a DDP bucket of odd-sized parameters (a bias of 3, a vocabulary of 50257, ...): after the
    # first, every tensor starts at an offset that is not 16-byte aligned in the flat buffer
    odd_sizes = [50257 * 7, 3, 768 * 3 + 1, 1023, 4097, 65537, 5, 131071] * 4
    odd_n = sum(odd_sizes)
    odd = [list(torch.randn(odd_n, device=d).split(odd_sizes)) for _ in range(sets)]
    odd_flat = [torch.empty(odd_n, device=d) for _ in range(sets)]
    # the same bucket with each size rounded up to 8 elements (every tensor aligned): the
    # misaligned copies' cost is the ratio of the two
    even_sizes = [-(-k // 8) * 8 for k in odd_sizes]
    even = [list(torch.randn(sum(even_sizes), device=d).split(even_sizes)) for _ in range(sets)]
    even_flat = [torch.empty(sum(even_sizes), device=d) for _ in range(sets)]
    halves = [t.to(bf16) for t in rnd]
    chunks = [torch.stack([t.to(bf16), t.flip(0).to(bf16)]) for t in rnd]
    q8 = [ops.quantize_int8(t, None, 1.0, b8, n) for t in rnd]
    codes = [torch.stack([c, c.flip(0)]) for c, _ in q8]
    scales8 = [torch.stack([s, s.flip(0)]) for _, s in q8]
    b4 = 64  # int4 and fp8 at their default block
    q4 = [ops.quantize_int4(t, None, 1.0, b4, n) for t in rnd]
    codes4 = [torch.stack([c, c.flip(0)]) for c, _ in q4]
    scales4 = [torch.stack([s, s.flip(0)]) for _, s in q4]
    qf = [ops.quantize_fp8(t, None, 1.0, b4, n) for t in rnd]
    codes_f = [torch.stack([c, c.view(torch.uint8).flip(0).view(c.dtype)]) for c, _ in qf]
    scales_f = [torch.stack([s, s.flip(0)]) for _, s in qf]
    q1 = [ops.quantize_onebit(t, None, 1.0, b1, n) for t in rnd]
    bits = [torch.stack([c, c.flip(0)]) for c, _ in q1]
    scales1 = [torch.stack([s, s.flip(0)]) for _, s in q1]

    cases = []

    def case(name, nbytes, target, f, nsets=sets):
        cases.append((name, nbytes, target, [lambda i=i: f(i) for i in range(nsets)]))

    case("pack x0.5, 4 large", 2 * n * 4, False, lambda i: ops.pack_into_(outs[i], big4[i], 0.5))
    # pack_into_ and unpack_ of the same tensors and flat buffer, each moving 2 x 4 bytes an
    # element: 200 small tensors (with their target), a bucket of odd sizes
    for what, tensors, flats, nsets, target in (
        ("200 small", small, small_flat, small_sets, SMALL_TARGET),
        (f"{len(odd_sizes)} odd sizes", odd, odd_flat, sets, None),
        (f"{len(odd_sizes)} sizes rounded to 8", even, even_flat, sets, None),
    ):
        nbytes = 2 * flats[0].numel() * 4
        case(f"pack x0.5, {what}", nbytes, target,
             lambda i, t=tensors, f=flats: ops.pack_into_(f[i], t[i], 0.5), nsets)  # fmt: skip
        case(f"unpack_ x2, {what}", nbytes, target,
             lambda i, t=tensors, f=flats: ops.unpack_(f[i], t[i], 2.0), nsets)  # fmt: skip
    case("unpack_ x2, 4 large", 2 * n * 4, False, lambda i: ops.unpack_(outs[i], big4[i], 2.0))
    case(
        "accumulate_ fp32+=fp32", 3 * n * 4, False, lambda i: ops.accumulate_(outs[i], rnd[i], 0.5)
    )
    case(
        "accumulate_ fp32+=bf16",
        n * (4 + 2 + 4),
        False,
        lambda i: ops.accumulate_(outs[i], halves[i], 0.5),
    )
    case("scale_ fp32", 2 * n * 4, False, lambda i: ops.scale_(outs[i], 1.0001))
    case("encode16 bf16", n * (4 + 2), True, lambda i: ops.encode16(rnd[i], None, 0.5, bf16, n))
    case(
        "encode16 bf16 +residual",
        n * (4 + 4 + 2 + 4),
        True,
        lambda i: ops.encode16(rnd[i], res[i], 0.5, bf16, n),
    )
    case(
        f"quantize_int8 +residual b{b8}",
        n * (4 + 4 + 1 + 4) + 4 * n // b8,
        True,
        lambda i: ops.quantize_int8(rnd[i], res[i], 0.5, b8, n),
    )
    case(
        f"quantize_onebit +residual b{b1}",
        n * (4 + 4 + 4) + n // 8 + 2 * n // b1,
        True,
        lambda i: ops.quantize_onebit(rnd[i], res[i], 0.5, b1, n),
    )
    case(
        f"quantize_int4 +residual b{b4}",
        n * (4 + 4 + 4) + n // 2 + 4 * n // b4,
        True,
        lambda i: ops.quantize_int4(rnd[i], res[i], 0.5, b4, n),
    )
    case(
        f"quantize_fp8 +residual b{b4}",
        n * (4 + 4 + 4 + 1) + 4 * n // b4,
        True,
        lambda i: ops.quantize_fp8(rnd[i], res[i], 0.5, b4, n),
    )
    case(
        f"decode16_sum bf16 R={rows}",
        rows * n * 2 + n * 4,
        True,
        lambda i: ops.decode16_sum(chunks[i], 0.5, outs[i]),
    )
    case(
        f"dequantize_int8_sum R={rows}",
        rows * (n + 4 * n // b8) + n * 4,
        True,
        lambda i: ops.dequantize_int8_sum(codes[i], scales8[i], b8, 0.5, outs[i]),
    )
    case(
        f"dequantize_int4_sum R={rows}",
        rows * (n // 2 + 4 * n // b4) + n * 4,
        True,
        lambda i: ops.dequantize_int4_sum(codes4[i], scales4[i], b4, 0.5, outs[i]),
    )
    case(
        f"dequantize_fp8_sum R={rows}",
        rows * (n + 4 * n // b4) + n * 4,
        True,
        lambda i: ops.dequantize_fp8_sum(codes_f[i], scales_f[i], b4, 0.5, outs[i]),
    )
    case(
        f"dequantize_onebit_sum R={rows}",
        rows * (n // 8 + 2 * n // b1) + n * 4,
        True,
        lambda i: ops.dequantize_onebit_sum(bits[i], scales1[i], b1, 0.5, outs[i]),
    )
    batch = 20
    rows_out = []
    copies: dict[int, float] = {}
    for name, nbytes, target, calls in cases:
        half = nbytes // 2  # a copy of half the bytes reads and writes nbytes in all
        if half not in copies:  # rotating over as many bytes as the op's calls do
            csets = len(calls)
            srcs = [
                torch.empty(half, dtype=torch.uint8, device=d).random_(0, 255) for _ in range(csets)
            ]
            dsts = [torch.empty(half, dtype=torch.uint8, device=d) for _ in range(csets)]
            copy = [lambda i=i, s=srcs, t=dsts: t[i].copy_(s[i]) for i in range(csets)]
            copies[half] = time_calls(d, copy, reps, max(batch, csets))
            del srcs, dsts
        t = time_calls(d, calls, reps, max(batch, len(calls)))
        row = {
            "op": name,
            "bytes": nbytes,
            "ms": t * 1e3,
            "gbps": nbytes / t / 1e9,
            "copy_gbps": nbytes / copies[half] / 1e9,
            "pct_of_copy": copies[half] / t,
            "target": TARGET if target is True else target or None,
        }
        row["meets_target"] = None if not row["target"] else row["pct_of_copy"] >= row["target"]
        rows_out.append(row)
    return rows_out


def big_copy_gbps(device: torch.device, reps: int) -> float:
    n = 1 << 30 if device.type == "cuda" else 1 << 26
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = time_calls(device, [lambda: dst.copy_(src)], reps, 5)
    return 2 * n / t / 1e9


def print_table(rows: list[dict[str, Any]], big: float, device_name: str, mb: float) -> None:
    gpu = device_name != "cpu"
    copy = "device-to-device copy" if gpu else "copy"
    print(f"\n{device_name}: {copy} of 1 GiB: {big:.0f} GB/s (bytes read + written)")
    how = "CUDA events over a CUDA graph of 20 calls" if gpu else "wall clock, 20 calls"
    print(f"{mb:g} MB fp32 bucket; GB/s = bytes read + written / median time ({how})")
    print(f"copy% = time of a {copy} moving the same bytes / time of the op")
    print(f"{'op':34s} {'ms':>8s} {'GB/s':>8s} {'copy%':>7s}  target")
    for r in rows:
        target = r["target"]
        mark = "" if target is None else ("ok" if r["meets_target"] else f"BELOW {target:.0%}")
        print(
            f"{r['op']:34s} {r['ms']:8.4f} {r['gbps']:8.0f} {100 * r['pct_of_copy']:6.0f}%  {mark}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--out", default=os.environ.get("OUT", "gpu_validate_out"), help="JSON and logs"
    )
    ap.add_argument("--mb", type=float, default=25.0, help="bucket size for the timing, MB")
    ap.add_argument("--reps", type=int, default=15, help="timed graph replays per op (median)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU: checks this script only")
    ap.add_argument("--skip-checks", action="store_true", help="timing only")
    ap.add_argument("--skip-timing", action="store_true", help="correctness only")
    ap.add_argument("--big", type=int, default=None, help="the large size of the sweep (elements)")
    ap.add_argument(
        "--small", action="store_true", help="the sweep up to 8193 elements (compute-sanitizer)"
    )
    args = ap.parse_args(argv)

    if args.cpu:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("gpu_validate: no CUDA device (use --cpu to check the script itself)")
            return 2
        if not ops.WITH_CUDA:
            print("gpu_validate: pycomm._C was built without CUDA kernels (USE_CUDA=1)")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    seed = args.seed if args.seed is not None else int(time.time() * 1e3) % (1 << 31)
    run = Run(device, seed)
    bucket = int(args.mb * 1e6 / 4)
    big = args.big or (4099 if args.small else bucket if not args.cpu else 100_003)
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "seed": seed,
        "bucket_elements": bucket,
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name,
            sm_count=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
        )
    name = info.get("name", "cpu")
    print(f"gpu_validate: {name}, torch {torch.__version__}, seed {seed}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {"info": info}
    t0 = time.time()
    if not args.skip_checks:
        for section in (check_fusion, check_codecs, check_decoders):
            t = time.time()
            section(run, big)
            print(f"gpu_validate: {section.__name__} done in {time.time() - t:.0f} s", flush=True)
        failed = [c for c in run.checks if not c["ok"]]
        print(f"gpu_validate: {len(run.checks) - len(failed)}/{len(run.checks)} checks passed")
        result["checks"] = run.checks
        result["checks_failed"] = len(failed)
    if not args.skip_timing:
        reps = args.reps if device.type == "cuda" else 3
        mb = args.mb if device.type == "cuda" else 1.0
        rows = timing(run, mb, reps)
        big_copy = big_copy_gbps(device, reps)
        result["timing"] = rows
        result["copy_1gib_gbps"] = big_copy
        print_table(rows, big_copy, name, mb)
        below = [r["op"] for r in rows if r["meets_target"] is False]
        if below:
            print(f"gpu_validate: below their target of copy bandwidth: {', '.join(below)}")
    result["seconds"] = time.time() - t0
    path = os.path.join(args.out, "gpu_validate.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"gpu_validate: wrote {path}")
    return 1 if result.get("checks_failed") else 0


if __name__ == "__main__":
    sys.exit(main())
