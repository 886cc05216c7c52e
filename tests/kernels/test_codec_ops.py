"""Codec kernels (encode16, quantize_int8, quantize_int4, quantize_fp8, quantize_onebit and their
*_sum decoders) against
pycomm.reference, bit for bit, on every backend (``be``: cpu, emu, cuda; see conftest.py): odd
sizes, padding, every dtype and block, strides, misaligned views, NaN/Inf, fp32 and bf16
residuals, bad input; and, on the CPU, meta tensors and torch.library.opcheck."""

import re

import pytest
import torch
from kernel_data import (
    DTYPES,
    NAN,
    as_tuple,
    bf16_residual,
    bits_equal,
    codec_input,
    padded_numel,
    poisoned_like,
    residual,
)

from pycomm import ops, reference

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1, 8, 64, 256 the usual; 3, 5, 100, 1500 not multiples of 8; 2048 one CUDA tile; 2560 and
# 4096 longer than a tile (the CPU's on-stack tile is 2048 elements too)
INT8_BLOCKS = [1, 3, 8, 64, 100, 256, 1500, 2048, 2560, 4096]
ONEBIT_BLOCKS = [8, 64, 256, 2048, 4096]
# int4 blocks are even: 2 the smallest, 6 not a multiple of 4 or 8 (a CUDA thread's 8 elements
# span two blocks, a byte never does), 2048 a tile, 4096 past one
INT4_BLOCKS = [2, 6, 32, 64, 128, 2048, 4096]
SCALE_DTYPES = [torch.float32, torch.bfloat16]
FP8_BLOCKS = [1, 3, 64, 256, 2048, 4096]
ENCODERS = ["quantize_int8", "quantize_int4", "quantize_fp8", "quantize_onebit", "encode16"]


def _large(be):
    # past the CPU's 32768-element parallel task, or past a few CUDA waves of tiles
    return (1000, 100003) if be.name == "cpu" else (3000, 20011)


def _sizes(be, block):
    return sorted({0, 1, max(block - 1, 0), block, block + 1, 7, 9, *_large(be)})


def _check_encoder(be, name, x, scale, arg, numel, with_residual, updates=True, extra=()):
    """be's encoder and the reference on copies of one residual; compares everything. extra:
    arguments after numel (residual_out, scale_dtype)."""
    r_ref = residual(numel) if with_residual else None
    r_dev = be.to(r_ref)
    got = as_tuple(be(name, be.to(x), r_dev, scale, arg, numel, *extra))
    want = as_tuple(getattr(reference, name)(x, r_ref, scale, arg, numel, *extra))
    for g, w in zip(got, want):
        bits_equal(g, w)
    if with_residual:
        bits_equal(r_dev, r_ref)
        if numel and updates:
            assert not torch.equal(r_ref, residual(numel)), "residual was not updated"
    return tuple(g.cpu() for g in got)


# --- encoders against the reference --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", INT8_BLOCKS)
def test_quantize_int8(be, dtype, block):
    for n in _sizes(be, block):
        for pad in (0, 3):
            numel = padded_numel(n, block, pad)
            x = codec_input(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                codes, scales = _check_encoder(
                    be, "quantize_int8", x, 0.5, block, numel, with_residual
                )
                assert codes.shape == (numel,) and scales.shape == (numel // block,)
    # the NaN and Inf blocks of the last x: scale NaN, codes 0
    assert scales.isnan().sum() >= 2
    assert not codes.view(-1, block)[scales.isnan()].any()


# x's dtype and the scales' are dispatched apart: each of both is run, not every pair
@pytest.mark.parametrize(
    "dtype, scale_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.bfloat16)],
    ids=["x32-s32", "x16b-s16b", "x16-s16b"],
)  # fmt: skip
@pytest.mark.parametrize("block", INT4_BLOCKS)
def test_quantize_int4(be, dtype, block, scale_dtype):
    for n in _sizes(be, block):
        for pad in (0, 2):
            numel = padded_numel(n, block, pad)
            x = codec_input(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                codes, scales = _check_encoder(
                    be, "quantize_int4", x, 0.5, block, numel, with_residual,
                    extra=(None, scale_dtype),
                )  # fmt: skip
                assert codes.shape == (numel // 2,) and scales.shape == (numel // block,)
                assert codes.dtype == torch.uint8 and scales.dtype == scale_dtype
    # the NaN and Inf blocks of the last x: scale NaN, codes 0; the others use all of [-7, 7]
    assert scales.isnan().sum() >= 2
    assert not codes.view(-1, block // 2)[scales.isnan()].any()
    nibbles = torch.stack([codes & 15, codes >> 4], 1).view(-1, block)[~scales.isnan()]
    assert set(nibbles.unique().tolist()) <= set(range(8)) | set(range(9, 16))  # never -8
    if block >= 32:
        assert {7, 9} <= set(nibbles.unique().tolist())  # +7 and -7 both taken


def test_int4_nibble_order_and_rounding(be):
    # absmax 7: s = 1, q = round_half_even(y): 0.5 -> 0, 1.5 -> 2, -2.5 -> -2; element 2k in
    # the low nibble of byte k
    x = torch.tensor([7.0, -7.0, 0.5, 1.5, -2.5, -0.0, 3.0, -1.0])
    codes, scales = be("quantize_int4", be.to(x), None, 1.0, 8, 8)
    assert scales.cpu().tolist() == [1.0]
    assert codes.cpu().tolist() == [0x7 | 0x9 << 4, 0x0 | 0x2 << 4, 0xE | 0x0 << 4, 0x3 | 0xF << 4]
    out = be.to(torch.empty(8))
    be("dequantize_int4_sum", codes[None], scales[None], 8, 1.0, out)
    assert out.cpu().tolist() == [7.0, -7.0, 0.0, 2.0, -2.0, 0.0, 3.0, -1.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", FP8_BLOCKS)
def test_quantize_fp8(be, dtype, block):
    for n in _sizes(be, block):
        for pad in (0, 1):
            numel = padded_numel(n, block, pad)
            x = codec_input(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                codes, scales = _check_encoder(
                    be, "quantize_fp8", x, 0.5, block, numel, with_residual
                )
                assert codes.shape == (numel,) and codes.dtype == torch.float8_e4m3fn
    assert scales.isnan().sum() >= 2
    assert not codes.view(torch.uint8).view(-1, block)[scales.isnan()].any()


def test_fp8_codes_are_torchs_cast(be):
    # every e4m3fn rounding boundary, subnormals (below 2^-6) and signed zeros: one block whose
    # absmax is 448 (scale 1), so the codes are torch's own cast of the values
    grid = torch.linspace(-448, 448, 40001)
    tiny = torch.logspace(-12, 2.6, 4001)
    x = torch.cat([torch.tensor([448.0, 0.0, -0.0, 2.0**-6, 1.5 * 2.0**-9]), grid, tiny, -tiny])
    codes, scales = be("quantize_fp8", be.to(x), None, 1.0, x.numel(), x.numel())
    assert scales.cpu().tolist() == [1.0]
    bits_equal(codes.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    # and every byte decodes as torch's cast back (NaN for 0x7F, 0xFF; -0 added to +0 is +0)
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)[None]
    out = be.to(torch.empty(256))
    be("dequantize_fp8_sum", be.to(every), be.to(torch.ones(1, 1)), 256, 1.0, out)
    bits_equal(out, 0.0 + every[0].float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", ONEBIT_BLOCKS)
def test_quantize_onebit(be, dtype, block):
    for n in _sizes(be, block):
        for pad in (0, 2):
            numel = padded_numel(n, block, pad)
            x = codec_input(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                bits, scales = _check_encoder(
                    be, "quantize_onebit", x, 2.0, block, numel, with_residual
                )
                assert bits.shape == (numel // 8,) and scales.dtype == torch.bfloat16
    assert scales.isnan().sum() >= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_encode16(be, dtype, out_dtype):
    # around 8 (CUDA: elements per thread step) and 16 (CPU: one vector step), past a CUDA
    # block's 2048 and a CPU task's 32768
    extra = (1000, 32767, 32769, 100003) if be.name == "cpu" else (33, 2049, 20011)
    for n in sorted({0, 1, 7, 8, 9, *extra}):
        for pad in (0, 5):
            x = codec_input(n, dtype, 8, seed=pad)
            if n > 20:
                x[5] = 1e6 if dtype != torch.float16 else 6e4  # overflows fp16 after scale
            for with_residual in (False, True):
                _check_encoder(be, "encode16", x, 3.0, out_dtype, n + pad, with_residual)


@pytest.mark.parametrize(
    "name", ["quantize_int8", "quantize_int4", "quantize_fp8", "quantize_onebit"]
)
def test_encoders_large_block_and_scale_one(be, name):
    # blocks longer than the kernels' tile, and a scale of 1
    numel = 3 * 4096
    x = codec_input(numel - 100, torch.bfloat16, 4096)
    _check_encoder(be, name, x, 1.0, 4096, numel, True)
    _check_encoder(be, name, x, 1.0, 2560, 5 * 2560, True)
    _check_encoder(be, name, x, 1.0, 64, numel, True)


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoders_non_contiguous(be, name, dtype):
    base = (torch.randn(300, 70) * 2).to(dtype)
    arg = torch.bfloat16 if name == "encode16" else 64
    # transposed, strided both ways, a column, and a contiguous view 3 elements in (misaligned)
    for x in (base.t(), base[::3, ::2], base[:, 5], base.reshape(-1)[3:6403]):
        numel = padded_numel(x.numel(), 64, 1)
        _check_encoder(be, name, x, 0.25, arg, numel, True)
        _check_encoder(be, name, x, 0.25, arg, numel, False)


@pytest.mark.parametrize("name", ENCODERS)
def test_encoders_misaligned_residual(be, name):
    # a residual one element into its buffer: the CUDA kernels' scalar paths
    arg = torch.bfloat16 if name == "encode16" else 64
    x = codec_input(1000, torch.float32, 64)
    r_ref = residual(1025)[1:]
    r_dev = be.to(residual(1025))[1:]
    want = as_tuple(getattr(reference, name)(x, r_ref, 1.0, arg, 1024))
    got = as_tuple(be(name, be.to(x), r_dev, 1.0, arg, 1024))
    for g, w in zip(got, want):
        bits_equal(g, w)
    bits_equal(r_dev, r_ref)


def test_encoders_zero_and_tiny_values(be):
    # absmax 0 (inv 0) and absmax so small that 127 / absmax overflows: that block quantizes
    # to 0 and keeps y in the residual (never a NaN that would poison later steps); signed
    # zeros, subnormals, the largest finite values
    rows = [
        [0.0] * 16,
        [-0.0] * 16,
        [1e-38, 0.0, -1e-38, -0.0] * 4,
        [1e-40, 0.0, 3e-41, -1e-45] * 4,
        [3.4e38, -3.4e38] * 8,
    ]
    for vals in rows:
        x = torch.tensor(vals)
        for block in (1, 4, 8, 16):
            _check_encoder(be, "quantize_int8", x, 1.0, block, 16, True)
            _check_encoder(be, "quantize_fp8", x, 1.0, block, 16, True)
            if block % 2 == 0:
                for sd in SCALE_DTYPES:
                    _check_encoder(be, "quantize_int4", x, 1.0, block, 16, True, extra=(None, sd))
            if block % 8 == 0:
                _check_encoder(be, "quantize_onebit", x, 1.0, block, 16, True)
        _check_encoder(be, "encode16", x, 1.0, torch.float16, 16, True, updates=False)
        _check_encoder(be, "encode16", x, 1.0, torch.bfloat16, 16, True, updates=False)
    r = be.to(torch.zeros(2))
    codes, _ = be("quantize_int8", be.to(torch.tensor([1e-38, 0.0])), r, 1.0, 2, 2)
    assert codes.tolist() == [0, 0] and torch.equal(r.cpu(), torch.tensor([1e-38, 0.0]))


def test_padding_adds_residual_to_positive_zero(be):
    # the reference pads with +0 and adds the residual: a -0 residual there gives +0
    x = torch.tensor([-0.0, 1.0, -2.0])
    for name, arg in (
        ("encode16", torch.bfloat16),
        ("quantize_onebit", 8),
        ("quantize_int8", 8),
        ("quantize_int4", 8),
        ("quantize_fp8", 8),
    ):
        r_ref = torch.full((16,), -0.0)
        r_dev = be.to(r_ref)
        got = as_tuple(be(name, be.to(x), r_dev, 1.0, arg, 16))
        want = as_tuple(getattr(reference, name)(x, r_ref, 1.0, arg, 16))
        for g, w in zip(got, want):
            bits_equal(g, w)
        bits_equal(r_dev, r_ref)
    out = be("encode16", be.to(x), be.to(torch.full((16,), -0.0)), 1.0, torch.bfloat16, 16)
    out = out.cpu()
    assert torch.signbit(out[0]) and not torch.signbit(out[3:]).any()


def test_onebit_bit_order_and_scale(be):
    x = torch.tensor([1.0, -1.0, -0.0, NAN, 2.0, -2.0, 0.0, -3.0] + [1.0] * 8)
    bits, scales = be("quantize_onebit", be.to(x), None, 1.0, 16, 16)
    # y >= 0 at elements 0, 2 (-0), 4, 6 -> bits 0, 2, 4, 6; NaN is not >= 0
    assert bits.tolist() == [0b01010101, 0xFF]
    assert scales.isnan().all()


def test_encoders_zero_size(be):
    x = be.to(torch.empty(0, dtype=torch.bfloat16))
    assert be("encode16", x, None, 1.0, torch.float16, 0).shape == (0,)
    r = be.to(torch.zeros(4))
    assert be("encode16", x, r, 1.0, torch.float16, 4).tolist() == [0, 0, 0, 0]
    codes, scales = be("quantize_int8", x, be.to(torch.empty(0)), 1.0, 8, 0)
    assert codes.shape == (0,) and scales.shape == (0,)
    bits, scales = be("quantize_onebit", x, None, 1.0, 8, 0)
    assert bits.shape == (0,) and scales.shape == (0,)
    codes, scales = be("quantize_int4", x, None, 1.0, 8, 0, None, torch.bfloat16)
    assert codes.shape == (0,) and scales.shape == (0,) and scales.dtype == torch.bfloat16
    codes, scales = be("quantize_fp8", x, None, 1.0, 3, 0)
    assert codes.shape == (0,) and codes.dtype == torch.float8_e4m3fn and scales.shape == (0,)


# --- residual_out and bf16 residuals ---------------------------------------------------------


@pytest.mark.parametrize(
    "name, arg, block",
    [("quantize_int8", 64, 64), ("quantize_int8", 3, 3), ("quantize_int8", 4096, 4096),
     ("quantize_int4", 64, 64), ("quantize_int4", 6, 6), ("quantize_int4", 4096, 4096),
     ("quantize_fp8", 64, 64), ("quantize_fp8", 3, 3),
     ("quantize_onebit", 64, 64), ("quantize_onebit", 4096, 4096), ("encode16", torch.bfloat16, 8)],
    ids=["int8-64", "int8-3", "int8-4096", "int4-64", "int4-6", "int4-4096", "fp8-64", "fp8-3",
         "onebit-64", "onebit-4096", "encode16-bf16"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rdtype", [torch.float32, torch.bfloat16])
def test_residual_out_leaves_residual_and_matches_in_place(be, name, arg, block, dtype, rdtype):
    # What the hooks rely on to drop a step's residuals when it turns out non-finite: the new
    # residual in residual_out (NaN blocks keep the old value there too), the old one intact,
    # everything else as the in-place update gives it, and as the reference's.
    for n in _sizes(be, block):
        numel = padded_numel(n, block, pad_blocks=1)
        x = codec_input(n, dtype, block)
        old = residual(numel, dtype=rdtype)
        r_in, out = be.to(old), be.to(torch.full((numel,), NAN, dtype=rdtype))
        got = as_tuple(be(name, be.to(x), r_in, 0.5, arg, numel, out))
        bits_equal(r_in, old)
        in_place = be.to(old)
        want = as_tuple(be(name, be.to(x), in_place, 0.5, arg, numel))
        bits_equal(out, in_place.cpu())
        ref_in, ref_out = old.clone(), torch.full((numel,), 123.0, dtype=rdtype)
        ref = as_tuple(getattr(reference, name)(x, ref_in, 0.5, arg, numel, residual_out=ref_out))
        bits_equal(out, ref_out)
        bits_equal(ref_in, old)
        for a, b, c in zip(got, want, ref):
            bits_equal(a, b.cpu())
            bits_equal(a, c)


# (op, arg, block): the tile kernels at small, odd and whole-tile blocks, the one-block-per-CTA
# CUDA kernel past a tile (4096), 16-bit to both output dtypes
_BF16_CASES = [
    ("quantize_int8", 1, 1), ("quantize_int8", 3, 3), ("quantize_int8", 5, 5),
    ("quantize_int8", 64, 64), ("quantize_int8", 256, 256), ("quantize_int8", 2048, 2048),
    ("quantize_int8", 4096, 4096),
    ("quantize_int4", 6, 6), ("quantize_int4", 4096, 4096),
    ("quantize_fp8", 1, 1), ("quantize_fp8", 4096, 4096),
    ("quantize_onebit", 8, 8), ("quantize_onebit", 64, 64), ("quantize_onebit", 4096, 4096),
    ("encode16", torch.bfloat16, 8), ("encode16", torch.float16, 8),
]  # fmt: skip
_BF16_IDS = [f"{n}-{str(a).replace('torch.', '')}" for n, a, _ in _BF16_CASES]


def _check_bf16_encoder(be, name, x, scale, arg, numel, separate, r0=None):
    """be's encoder vs the reference with a bf16 residual (r0, or a random one): in place, or
    into residual_out (then residual is only read). Returns (outputs, new residual) on the
    CPU."""
    old = bf16_residual(numel) if r0 is None else r0
    r_ref = old.clone()
    out_ref = torch.full((numel,), 123.0).bfloat16() if separate else None
    want = as_tuple(getattr(reference, name)(x, r_ref, scale, arg, numel, out_ref))
    r_dev = be.to(old)
    out_dev = be.to(torch.full((numel,), NAN).bfloat16()) if separate else None
    got = as_tuple(be(name, be.to(x), r_dev, scale, arg, numel, out_dev))
    for g, w in zip(got, want):
        bits_equal(g, w)
    if separate:
        bits_equal(out_dev, out_ref)
        bits_equal(r_dev, old)
        return tuple(g.cpu() for g in got), out_dev.cpu()
    bits_equal(r_dev, r_ref)
    return tuple(g.cpu() for g in got), r_dev.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, arg, block", _BF16_CASES, ids=_BF16_IDS)
def test_bf16_residual(be, dtype, name, arg, block):
    # A bf16 residual is widened exactly, y is computed in fp32 as with an fp32 residual, and
    # only the new residual is rounded (to nearest even): the codes are those of the same
    # residual held in fp32, and the new residual is that run's, rounded. NaN/Inf blocks keep
    # their old residual. Bit for bit against the reference, in place and into residual_out.
    sizes = {0, 1, 7, 9, block + 1, 3000} | ({20011} if block in (3, 64) else set())
    if be.name == "cpu":
        sizes |= {max(block - 1, 0), block, 1000, 100003}
    for n in sorted(sizes):
        for pad in (0, 1):
            numel = padded_numel(n, block, pad)
            x = codec_input(n, dtype, block, seed=pad)  # n > 2 * block: NaN and ±Inf blocks
            got, r16 = _check_bf16_encoder(be, name, x, 0.5, arg, numel, False)
            _check_bf16_encoder(be, name, x, 0.5, arg, numel, True)
            r32 = be.to(bf16_residual(numel).float())
            want = as_tuple(be(name, be.to(x), r32, 0.5, arg, numel))
            for a, b in zip(got, want):
                bits_equal(a, b.cpu())
            bits_equal(r16, r32.cpu().to(torch.bfloat16))


def _block_of(i, block):
    return range(i // block * block, (i // block + 1) * block)


@pytest.mark.parametrize("name, arg, block", _BF16_CASES, ids=_BF16_IDS)
def test_bf16_residual_nonfinite_block_kept_bit_for_bit(be, name, arg, block):
    numel = padded_numel(max(4 * block, 64), block)
    x = codec_input(numel, torch.float32, block, special=False)
    old = bf16_residual(numel)
    bits = old.view(torch.int16)
    # residual NaNs with payloads (a signalling pattern; negative), +Inf, and an x of Inf: each
    # makes its block (16-bit: element) non-finite
    bits[1], bits[block + 2], bits[numel - 2] = 0x7F81, -0x3F, 0x7F80  # -0x3F: 0xFFC1
    x[numel - 1] = float("inf")
    bad = [1, block + 2, numel - 2, numel - 1]
    kept = bad if name == "encode16" else sorted({j for i in bad for j in _block_of(i, block)})
    for separate in (False, True):
        _, new = _check_bf16_encoder(be, name, x, 1.0, arg, numel, separate, old.clone())
        # the reference's NaNs are torch's canonical one; the kernels store the old bits, but
        # for the CPU's encode16, whose kept residual goes through fp32 and its vectorized
        # conversion to bf16: the same values there, NaN payloads not kept
        if be.name == "cpu" and name == "encode16":
            bits_equal(new[kept], old[kept])
        else:
            assert torch.equal(new.view(torch.int16)[kept], bits[kept]), separate
        kept_set = set(kept)
        updated = [i for i in range(numel) if i not in kept_set]
        assert not torch.equal(new.view(torch.int16)[updated], bits[updated])


@pytest.mark.parametrize("name", ENCODERS)
def test_bf16_residual_misaligned_and_strided_x(be, name):
    arg = torch.bfloat16 if name == "encode16" else 64
    # views 1 element (2 bytes: the CUDA scalar path) and 8 (16 bytes: vectors) into their
    # buffers
    for offset in (1, 8):
        buf = bf16_residual(1024 + offset)
        x = codec_input(1000, torch.float16, 64)
        want_r = buf[offset:].clone()
        want = as_tuple(getattr(reference, name)(x, want_r, 1.0, arg, 1024))
        got_r = be.to(buf)[offset:]
        got = as_tuple(be(name, be.to(x), got_r, 1.0, arg, 1024))
        for g, w in zip(got, want):
            bits_equal(g, w)
        bits_equal(got_r, want_r)
        # residual_out misaligned too
        out_buf = torch.full((1024 + offset,), NAN).bfloat16()
        want_o = out_buf[offset:].clone()
        getattr(reference, name)(x, buf[offset:], 1.0, arg, 1024, want_o)
        got_o = be.to(out_buf)[offset:]
        be(name, be.to(x), be.to(buf)[offset:], 1.0, arg, 1024, got_o)
        bits_equal(got_o, want_o)
    base = (torch.randn(300, 70) * 2).to(torch.bfloat16)
    for x in (base.t(), base[::3, ::2]):
        numel = padded_numel(x.numel(), 64, 1)
        for separate in (False, True):
            _check_bf16_encoder(be, name, x, 0.5, arg, numel, separate)


# --- decoders against the reference --------------------------------------------------------


def _out(m, dtype, short):
    return torch.full((max(m - short, 0),), 7.0, dtype=dtype)


def _check_sum(be, name, args, out):
    """be's decoder into a poisoned copy of out vs the reference into out; returns (stats,
    out) on the CPU."""
    got_out = be.to(poisoned_like(out))
    got = be(name, *(be.to(a) if isinstance(a, torch.Tensor) else a for a in args), got_out)
    want_out = out.clone()
    want = getattr(reference, name)(*args, want_out)
    bits_equal(got_out, want_out)
    got = got.cpu()
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got[1] == want[1]
    torch.testing.assert_close(got[0], want[0], rtol=be.norm_rtol, atol=0)
    return got, got_out.cpu()


def _encode_rows(name, rows, n, block, numel, special, *extra):
    # R ranks' encodings of different data: row r scaled by r + 1, NaN/Inf in some blocks
    outs = [
        getattr(reference, name)(
            codec_input(n, torch.float32, block, special, seed=r),
            None,
            r + 1.0,
            block,
            numel,
            *extra,
        )  # fmt: skip
        for r in range(rows)
    ]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


def _decode_sizes(be, block, large_blocks):
    small, large = _large(be)
    return (1, block + 1, small) + ((large,) if block in large_blocks else ())


def _shorts(n, block, special):
    # out as long as the rows, a few short, short of a whole block (+5)
    return (0, 3, block + 5) if n < 10000 else (special * (block + 5),)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_int8_sum(be, rows, out_dtype):
    large_blocks = (1, 100) if be.name == "cpu" else (3, 64)
    for block in (1, 3, 8, 64, 100, 256):
        for n in _decode_sizes(be, block, large_blocks):
            numel = padded_numel(n, block, 1)
            for special in (False, True):
                codes, scales = _encode_rows("quantize_int8", rows, n, block, numel, special)
                for short in _shorts(n, block, special):
                    out = _out(numel, out_dtype, short)
                    _check_sum(be, "dequantize_int8_sum", (codes, scales, block, 0.5), out)
    stats, _ = _check_sum(
        be, "dequantize_int8_sum", (codes, scales, block, 0.5), _out(numel, out_dtype, 0)
    )
    assert stats[1] > 0 and stats[0] > 0


# rows, out's dtype and the scales' dtype are independent: each value is run, not every triple
@pytest.mark.parametrize(
    "rows, out_dtype, scale_dtype",
    [(1, torch.float32, torch.float32), (2, torch.bfloat16, torch.bfloat16),
     (3, torch.float16, torch.float32), (4, torch.float32, torch.bfloat16),
     (5, torch.bfloat16, torch.float32)],
    ids=["r1-o32-s32", "r2-o16b-s16b", "r3-o16-s32", "r4-o32-s16b", "r5-o16b-s32"],
)  # fmt: skip
def test_dequantize_int4_sum(be, rows, out_dtype, scale_dtype):
    for block in (2, 6, 64, 256):
        for n in _decode_sizes(be, block, (6, 64)):
            numel = padded_numel(n, block, 1)
            for special in (False, True):
                codes, scales = _encode_rows(
                    "quantize_int4", rows, n, block, numel, special, None, scale_dtype
                )
                for short in _shorts(n, block, special):
                    out = _out(numel, out_dtype, short)
                    _check_sum(be, "dequantize_int4_sum", (codes, scales, block, 0.5), out)
    stats, _ = _check_sum(
        be, "dequantize_int4_sum", (codes, scales, block, 0.5), _out(numel, out_dtype, 0)
    )
    assert stats[1] > 0 and stats[0] > 0


@pytest.mark.parametrize(
    "rows, out_dtype",
    [(1, torch.float32), (2, torch.bfloat16), (3, torch.float16), (5, torch.float32)],
    ids=["r1-o32", "r2-o16b", "r3-o16", "r5-o32"],
)  # fmt: skip
def test_dequantize_fp8_sum(be, rows, out_dtype):
    for block in (1, 3, 64, 256):
        for n in _decode_sizes(be, block, (3, 64)):
            numel = padded_numel(n, block, 1)
            for special in (False, True):
                codes, scales = _encode_rows("quantize_fp8", rows, n, block, numel, special)
                for short in _shorts(n, block, special):
                    out = _out(numel, out_dtype, short)
                    _check_sum(be, "dequantize_fp8_sum", (codes, scales, block, 0.5), out)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_onebit_sum(be, rows, out_dtype):
    for block in (8, 64, 256):
        for n in _decode_sizes(be, block, (64,)):
            numel = padded_numel(n, block, 1)
            for special in (False, True):
                bits, scales = _encode_rows("quantize_onebit", rows, n, block, numel, special)
                for short in _shorts(n, block, special):
                    out = _out(numel, out_dtype, short)
                    _check_sum(be, "dequantize_onebit_sum", (bits, scales, block, 0.25), out)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("chunk_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_decode16_sum(be, rows, chunk_dtype, out_dtype):
    extra = (1000, 100003) if be.name == "cpu" else (2049, 20011)
    for m in (1, 7, 9, 33, *extra):
        chunks = torch.stack(
            [codec_input(m, torch.float32, 8, seed=r) * (r + 1) for r in range(rows)]
        )
        chunks = chunks.to(chunk_dtype)
        for short in (0, 1, 5) if m < 10000 else (0, 5):
            _check_sum(be, "decode16_sum", (chunks, 3.0), _out(m, out_dtype, short))


@pytest.mark.parametrize("hook", ["bf16", "int8", "int4", "int4-bf16", "fp8", "onebit"])
@pytest.mark.parametrize("rows, m", [(1, 256), (3, 1024), (3, 2048), (4, 20480)])
def test_decoders_read_row_slices_of_a_packed_buffer(be, hook, rows, m):
    # As the hooks decode: codes and scales are column slices of one [R, codes | scales] uint8
    # receive buffer (Codec.pack / Codec.split), read in place, no contiguous copy.
    from pycomm.codec import codecs as codec_mod

    codec = {
        "bf16": lambda: codec_mod.HalfCodec(torch.bfloat16),
        "int8": lambda: codec_mod.Int8Codec(256),
        "int4": lambda: codec_mod.Int4Codec(64),
        "int4-bf16": lambda: codec_mod.Int4Codec(32, torch.bfloat16),
        "fp8": lambda: codec_mod.Fp8Codec(64),
        "onebit": lambda: codec_mod.OneBitCodec(64),
    }[hook]()
    x = torch.stack(
        [codec_input(m, torch.float32, codec.block, seed=r) * (r + 1) for r in range(rows)]
    )
    enc = [codec.encode(x[r], None, 1.0, m) for r in range(rows)]
    scales = None if enc[0][1] is None else torch.cat([e[1] for e in enc])
    packed = codec.pack(torch.cat([e[0] for e in enc]), scales, rows)
    codes, scales = codec.split(packed, m)
    assert not codes.is_contiguous() or scales is None or rows == 1
    name = {
        "bf16": "decode16_sum",
        "int8": "dequantize_int8_sum",
        "onebit": "dequantize_onebit_sum",
    }
    name = name.get(hook, f"dequantize_{hook[:4]}_sum")
    args = (codes, 0.5) if scales is None else (codes, scales, codec.block, 0.5)
    stats, got = _check_sum(be, name, args, torch.full((m,), 7.0))
    # the same as from contiguous copies of the rows
    dense = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    stats_dense, got_dense = _check_sum(be, name, dense, torch.full((m,), 7.0))
    bits_equal(got, got_dense)
    assert torch.equal(stats, stats_dense)  # [squared norm, non-finite count]
    assert stats[0] > 0 and (stats[1] > 0) == (m > 2 * codec.block)  # NaN/Inf blocks counted


# (decoder, its encoder, block): the CUDA decoders fetch a row's codes 16, 8 or 4 bytes at a
# time as their alignment allows (else bytewise) and store out 16 bytes at a time when aligned
_DECODER_CASES = [
    ("decode16_sum", None, 1), ("dequantize_int8_sum", "quantize_int8", 64),
    ("dequantize_int8_sum", "quantize_int8", 24), ("dequantize_int4_sum", "quantize_int4", 64),
    ("dequantize_fp8_sum", "quantize_fp8", 64), ("dequantize_onebit_sum", "quantize_onebit", 64),
    ("dequantize_onebit_sum", "quantize_onebit", 24),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, encoder, block", _DECODER_CASES, ids=[f"{c[0]}-{c[2]}" for c in _DECODER_CASES]
)
def test_decoders_read_misaligned_codes_and_write_misaligned_out(be, name, encoder, block):
    # rows that start 1, 2, 4 and 8 bytes into their buffer (each row of a different
    # alignment too), into an out 1 and 4 elements in: as from the aligned tensors, bit for bit
    rows, m = 3, 2048 + 192 + 24  # past one block of threads; a short last run
    m -= m % 192
    if encoder is None:
        x = torch.stack([codec_input(m, torch.float32, 8, seed=r) for r in range(rows)])
        args = (x.to(torch.bfloat16), 0.5)
    else:
        codes, scales = _encode_rows(encoder, rows, m, block, m, True)
        args = (codes, scales, block, 0.5)
    codes = args[0]
    want_out = torch.full((m - 5,), 7.0)
    want_stats = getattr(reference, name)(*args, want_out)
    for offset in (1, 2, 4, 8):
        if offset % codes.element_size():
            continue
        shift = offset // codes.element_size()
        buf = torch.zeros(rows, codes.shape[1] + shift + 1, dtype=codes.dtype)
        view = buf[:, shift : shift + codes.shape[1]]
        view.copy_(codes)
        for out_offset in (1, 4):
            out = torch.full((m - 5 + out_offset,), NAN)[out_offset:]
            dev_out = be.to(out)
            stats = be(name, be.to(view), *(be.to(a) if isinstance(a, torch.Tensor) else a
                                            for a in args[1:]), dev_out)  # fmt: skip
            bits_equal(dev_out, want_out)
            assert stats.cpu()[1] == want_stats[1] and stats.cpu()[1] > 0
            torch.testing.assert_close(stats.cpu()[0], want_stats[0], rtol=be.norm_rtol, atol=0)


def test_sum_out_shapes_and_overflow(be):
    # a 2-D out, and a sum that overflows out's dtype: counted as non-finite, not in the norm
    chunks = torch.full((2, 12), 60000.0, dtype=torch.float16)
    out = torch.empty(3, 4, dtype=torch.float16)
    stats, got = _check_sum(be, "decode16_sum", (chunks, 1.0), out)
    assert got.isinf().all() and stats.tolist() == [0.0, 12.0]
    codes = torch.full((1, 16), 127, dtype=torch.int8)
    scales = torch.tensor([[2.0, NAN]])
    stats, got = _check_sum(be, "dequantize_int8_sum", (codes, scales, 8, 1.0), torch.empty(2, 8))
    assert stats.tolist() == [8 * 254.0**2, 8.0]
    # an out one element into its buffer: the CUDA kernels' scalar stores
    chunks = torch.randn(2, 40).bfloat16()
    buf = torch.full((41,), 7.0)
    want = buf[1:].clone()
    reference.decode16_sum(chunks, 0.5, want)
    got = be.to(buf)[1:]
    be("decode16_sum", be.to(chunks), 0.5, got)
    bits_equal(got, want)


def test_sum_zero_size(be):
    out = be.to(torch.empty(0))
    chunks = be.to(torch.empty(2, 0, dtype=torch.bfloat16))
    assert be("decode16_sum", chunks, 1.0, out).tolist() == [0, 0]
    z = be.to(torch.empty(1, 0, dtype=torch.int8))
    assert be("dequantize_int8_sum", z, be.to(torch.empty(1, 0)), 8, 1.0, out).tolist() == [0, 0]
    zb = be.to(torch.empty(3, 0, dtype=torch.uint8))
    s = be.to(torch.empty(3, 0, dtype=torch.bfloat16))
    assert be("dequantize_onebit_sum", zb, s, 8, 1.0, out).tolist() == [0, 0]
    assert be("dequantize_int4_sum", zb, s, 8, 1.0, out).tolist() == [0, 0]
    z8 = be.to(torch.empty(2, 0, dtype=torch.float8_e4m3fn))
    assert be("dequantize_fp8_sum", z8, be.to(torch.empty(2, 0)), 3, 1.0, out).tolist() == [0, 0]
    # out shorter than m, even empty, leaves the rest alone
    codes = be.to(torch.ones(2, 8, dtype=torch.int8))
    stats = be("dequantize_int8_sum", codes, be.to(torch.ones(2, 1)), 8, 1.0, out)
    assert stats.tolist() == [0, 0] and stats.device == out.device


# --- round trip: decode(encode(y)) + new residual == y --------------------------------------


@pytest.mark.parametrize("name", ENCODERS)
def test_round_trip_error_feedback(be, name):
    n, block = 10000, 64
    numel = padded_numel(n, block, 1)
    x = codec_input(n, torch.bfloat16, block, special=False)
    r = be.to(residual(numel))
    y = torch.zeros(numel)
    y[:n] = x.float() * 0.5
    y += r.cpu()
    out = be.to(torch.empty(numel))
    x = be.to(x)
    if name == "encode16":
        payload = be("encode16", x, r, 0.5, torch.bfloat16, numel)
        stats = be("decode16_sum", payload[None], 1.0, out)
    elif name in ("quantize_int8", "quantize_int4", "quantize_fp8"):
        codes, scales = be(name, x, r, 0.5, block, numel)
        decoder = name.replace("quantize", "dequantize") + "_sum"
        stats = be(decoder, codes[None], scales[None], block, 1.0, out)
    else:
        bits, scales = be("quantize_onebit", x, r, 0.5, block, numel)
        stats = be("dequantize_onebit_sum", bits[None], scales[None], block, 1.0, out)
    out, r, stats = out.cpu(), r.cpu(), stats.cpu()
    # y - dec was rounded once to fp32: adding dec back is within one rounding of |y| + |dec|
    tol = torch.finfo(torch.float32).eps * (y.abs() + out.abs())
    assert bool(((out + r - y).abs() <= tol).all())
    assert not torch.equal(out, y)  # the codec is lossy: the residual carried the error
    torch.testing.assert_close(stats[0], (out.double() ** 2).sum(), rtol=1e-6, atol=0)
    assert stats[1] == 0


# --- bad input -------------------------------------------------------------------------------

_X = torch.ones(10)
_R = torch.zeros(16)
_I8 = torch.zeros(2, 16, dtype=torch.int8)
_U8 = torch.zeros(2, 2, dtype=torch.uint8)
_H8 = torch.ones(2, 8, dtype=torch.half)


def _overlapping_residuals():
    big = torch.zeros(24)
    return torch.ones(16), big[:16], 1.0, 8, 16, big[8:]


_BAD_CODECS = [
    ("encode16", lambda: (_X.long(), None, 1.0, torch.float16, 16),
     r"pycomm.encode16: x has dtype Long, expected Float, Half or BFloat16"),
    ("encode16", lambda: (_X, None, 1.0, torch.float32, 16),
     r"pycomm.encode16: dtype is Float, expected Half or BFloat16"),
    ("encode16", lambda: (_X, None, 1.0, torch.float16, 9),
     r"pycomm.encode16: numel is 9, expected >= x.numel\(\) = 10"),
    ("encode16", lambda: (_X, _R.half(), 1.0, torch.float16, 16),
     r"pycomm.encode16: residual has dtype Half, expected Float or BFloat16"),
    ("quantize_int8", lambda: (_X, torch.zeros(15), 1.0, 8, 16),
     r"pycomm.quantize_int8: residual has 15 elements, expected numel = 16"),
    ("quantize_int8", lambda: (_X, torch.zeros(32)[::2], 1.0, 8, 16),
     r"pycomm.quantize_int8: residual has strides \[2\], expected a contiguous tensor"),
    ("quantize_int8", lambda: (_X, None, 1.0, 0, 16),
     r"pycomm.quantize_int8: block is 0, expected >= 1"),
    ("quantize_int8", lambda: (_X, None, 1.0, 6, 16),
     r"pycomm.quantize_int8: numel is 16, expected a multiple of block = 6"),
    ("quantize_int8", lambda: (_X, None, 1.0, -8, 16),
     r"pycomm.quantize_int8: block is -8, expected >= 1"),
    ("quantize_int4", lambda: (_X, None, 1.0, 3, 12),
     r"pycomm.quantize_int4: block is 3, expected a multiple of 2"),
    ("quantize_int4", lambda: (_X, None, 1.0, 4, 18),
     r"pycomm.quantize_int4: numel is 18, expected a multiple of block = 4"),
    ("quantize_int4", lambda: (_X, None, 1.0, 8, 16, None, torch.float16),
     r"pycomm.quantize_int4: scale_dtype is Half, expected Float or BFloat16"),
    ("quantize_int4", lambda: (_X, torch.zeros(16).half(), 1.0, 8, 16),
     r"pycomm.quantize_int4: residual has dtype Half, expected Float or BFloat16"),
    ("quantize_fp8", lambda: (_X, None, 1.0, 0, 16),
     r"pycomm.quantize_fp8: block is 0, expected >= 1"),
    ("quantize_fp8", lambda: (_X, None, 1.0, 3, 16),
     r"pycomm.quantize_fp8: numel is 16, expected a multiple of block = 3"),
    ("quantize_fp8", lambda: (_X.double(), None, 1.0, 8, 16),
     r"pycomm.quantize_fp8: x has dtype Double, expected Float, Half or BFloat16"),
    ("quantize_onebit", lambda: (_X, None, 1.0, 4, 16),
     r"pycomm.quantize_onebit: block is 4, expected a multiple of 8"),
    ("quantize_onebit", lambda: (_X, None, 1.0, 16, 24),
     r"pycomm.quantize_onebit: numel is 24, expected a multiple of block = 16"),
    ("quantize_onebit", lambda: (_X, None, 1.0, 8, 8),
     r"pycomm.quantize_onebit: numel is 8, expected >= x.numel\(\) = 10"),
    # residual_out
    ("quantize_int8", lambda: (torch.ones(16), None, 1.0, 8, 16, torch.zeros(16)),
     "pycomm.quantize_int8: residual_out is given without residual"),
    ("quantize_onebit", lambda: (torch.ones(16), _R, 1.0, 8, 16, torch.zeros(8)),
     "pycomm.quantize_onebit: residual_out has 8 elements, expected numel = 16"),
    ("encode16", lambda: (torch.ones(16), _R, 1.0, torch.float16, 16, torch.zeros(16).half()),
     "pycomm.encode16: residual_out has dtype Half"),
    ("quantize_int8", lambda: (torch.ones(16), _R, 1.0, 8, 16, torch.zeros(16).bfloat16()),
     "pycomm.quantize_int8: residual_out has dtype BFloat16, expected Float like residual"),
    ("quantize_int8", _overlapping_residuals,
     "pycomm.quantize_int8: residual_out overlaps residual"),
    # decoders
    ("decode16_sum", lambda: (torch.ones(2, 8), 1.0, torch.empty(8)),
     r"pycomm.decode16_sum: chunks has dtype Float, expected Half or BFloat16"),
    ("decode16_sum", lambda: (torch.ones(8, dtype=torch.half), 1.0, torch.empty(8)),
     r"pycomm.decode16_sum: chunks has shape \[8\], expected a 2-D \[R, m\] tensor"),
    ("decode16_sum", lambda: (torch.ones(0, 8, dtype=torch.half), 1.0, torch.empty(8)),
     r"pycomm.decode16_sum: chunks has shape \[0, 8\], expected R >= 1 rows"),
    ("decode16_sum", lambda: (torch.ones(8, 2, dtype=torch.half).t(), 1.0, torch.empty(8)),
     r"pycomm.decode16_sum: chunks has shape \[2, 8\] and strides \[1, 2\], expected "
     r"contiguous rows"),
    ("decode16_sum", lambda: (_H8, 1.0, torch.empty(9)),
     r"pycomm.decode16_sum: out has 9 elements, expected <= m = 8"),
    ("decode16_sum", lambda: (_H8, 1.0, torch.empty(8, dtype=torch.int32)),
     r"pycomm.decode16_sum: out has dtype Int, expected Float, Half or BFloat16"),
    ("decode16_sum", lambda: (_H8, 1.0, torch.empty(8)[::2]),
     r"pycomm.decode16_sum: out has strides \[2\], expected a contiguous tensor"),
    ("dequantize_int8_sum", lambda: (_I8.byte(), torch.ones(2, 2), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_int8_sum: codes has dtype Byte, expected Char \(int8\)"),
    ("dequantize_int8_sum", lambda: (_I8, torch.ones(2, 3), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_int8_sum: scales has shape \[2, 3\], expected \[2, 2\]"),
    ("dequantize_int8_sum", lambda: (_I8, torch.ones(2, 2).half(), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_int8_sum: scales has dtype Half, expected Float"),
    ("dequantize_int8_sum", lambda: (_I8, torch.ones(2, 3), 6, 1.0, torch.empty(16)),
     r"pycomm.dequantize_int8_sum: codes has m = 16 columns, expected a multiple of "
     r"block = 6"),
    ("dequantize_int8_sum", lambda: (_I8, torch.ones(2, 2), 0, 1.0, torch.empty(16)),
     r"pycomm.dequantize_int8_sum: block is 0, expected >= 1"),
    ("dequantize_int8_sum", lambda: (_I8, torch.ones(2, 2), 8, 1.0, torch.empty(17)),
     r"pycomm.dequantize_int8_sum: out has 17 elements, expected <= m = 16"),
    ("dequantize_int4_sum", lambda: (_I8, torch.ones(2, 4), 8, 1.0, torch.empty(32)),
     r"pycomm.dequantize_int4_sum: codes has dtype Char, expected Byte \(uint8\)"),
    ("dequantize_int4_sum", lambda: (_U8, torch.ones(2, 2).half(), 2, 1.0, torch.empty(4)),
     r"pycomm.dequantize_int4_sum: scales has dtype Half, expected Float or BFloat16"),
    ("dequantize_int4_sum", lambda: (_U8, torch.ones(2, 4), 1, 1.0, torch.empty(4)),
     r"pycomm.dequantize_int4_sum: block is 1, expected a multiple of 2"),
    ("dequantize_int4_sum", lambda: (_U8, torch.ones(2, 1), 6, 1.0, torch.empty(4)),
     r"pycomm.dequantize_int4_sum: codes has m = 4 elements \(2 per column\), expected a "
     r"multiple of block = 6"),
    ("dequantize_int4_sum", lambda: (_U8, torch.ones(2, 3), 2, 1.0, torch.empty(4)),
     r"pycomm.dequantize_int4_sum: scales has shape \[2, 3\], expected \[2, 2\]"),
    ("dequantize_int4_sum", lambda: (_U8, torch.ones(2, 2), 2, 1.0, torch.empty(5)),
     r"pycomm.dequantize_int4_sum: out has 5 elements, expected <= m = 4"),
    ("dequantize_int4_sum", lambda: (_U8.t(), torch.ones(2, 2), 2, 1.0, torch.empty(4)),
     r"pycomm.dequantize_int4_sum: codes has shape \[2, 2\] and strides \[1, 2\], expected "
     r"contiguous rows"),
    ("dequantize_fp8_sum", lambda: (_I8, torch.ones(2, 2), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_fp8_sum: codes has dtype Char, expected Float8_e4m3fn"),
    ("dequantize_fp8_sum",
     lambda: (_I8.to(torch.float8_e4m3fn), torch.ones(2, 2).bfloat16(), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_fp8_sum: scales has dtype BFloat16, expected Float"),
    ("dequantize_fp8_sum",
     lambda: (_I8.to(torch.float8_e4m3fn), torch.ones(2, 3), 6, 1.0, torch.empty(16)),
     r"pycomm.dequantize_fp8_sum: codes has m = 16 columns, expected a multiple of block = 6"),
    ("dequantize_fp8_sum",
     lambda: (_I8.to(torch.float8_e4m3fn), torch.ones(2, 2), 8, 1.0, torch.empty(16)[::2]),
     r"pycomm.dequantize_fp8_sum: out has 8 elements|out has strides \[2\]"),
    ("dequantize_onebit_sum",
     lambda: (_U8.char(), torch.ones(2, 2).bfloat16(), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_onebit_sum: bits has dtype Char, expected Byte \(uint8\)"),
    ("dequantize_onebit_sum", lambda: (_U8, torch.ones(2, 2), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_onebit_sum: scales has dtype Float, expected BFloat16"),
    ("dequantize_onebit_sum",
     lambda: (_U8, torch.ones(2, 4).bfloat16(), 4, 1.0, torch.empty(16)),
     r"pycomm.dequantize_onebit_sum: block is 4, expected a multiple of 8"),
    ("dequantize_onebit_sum",
     lambda: (_U8, torch.ones(2, 1).bfloat16(), 24, 1.0, torch.empty(16)),
     r"pycomm.dequantize_onebit_sum: bits has m = 16 elements \(8 per column\), "
     r"expected a multiple of block = 24"),
    ("dequantize_onebit_sum",
     lambda: (_U8, torch.ones(1, 2).bfloat16(), 8, 1.0, torch.empty(16)),
     r"pycomm.dequantize_onebit_sum: scales has shape \[1, 2\], expected \[2, 2\]"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, make, pattern",
    _BAD_CODECS,
    ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(_BAD_CODECS)],
)
def test_bad_input(be, name, make, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        be(name, *be.args(make()))


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("r_dtype, out_dtype", [(torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16)])  # fmt: skip
def test_residual_out_of_another_dtype_refused(be, name, r_dtype, out_dtype):
    arg = torch.float16 if name == "encode16" else 8
    r, out = be.to(torch.zeros(16, dtype=r_dtype)), be.to(torch.zeros(16, dtype=out_dtype))
    names = {torch.float32: "Float", torch.bfloat16: "BFloat16"}
    msg = (
        f"pycomm.{name}: residual_out has dtype {names[out_dtype]}, "
        f"expected {names[r_dtype]} like residual"
    )
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        be(name, be.to(torch.ones(16)), r, 1.0, arg, 16, out)
    assert not r.cpu().any() and not out.cpu().any()  # nothing written
    with pytest.raises(RuntimeError, match=r"residual has dtype Half, expected Float or BFloat16"):
        be(name, be.to(torch.ones(16)), be.to(torch.zeros(16).half()), 1.0, arg, 16)


def test_mismatched_devices_rejected():
    # meta stands in for a second device: the Meta kernels check what the real kernels check
    meta = torch.zeros(16, device="meta")
    with pytest.raises(RuntimeError, match=r"pycomm.quantize_int8: residual is on meta"):
        ops.quantize_int8(_X, meta, 1.0, 8, 16)
    with pytest.raises(RuntimeError, match=r"pycomm.encode16: residual is on cpu"):
        ops.encode16(_X.to("meta"), _R, 1.0, torch.float16, 16)
    with pytest.raises(RuntimeError, match=r"pycomm.dequantize_int8_sum: scales is on meta"):
        ops.dequantize_int8_sum(_I8, torch.ones(2, 2, device="meta"), 8, 1.0, torch.empty(16))
    with pytest.raises(RuntimeError, match=r"pycomm.decode16_sum: out is on meta"):
        ops.decode16_sum(torch.ones(2, 8, dtype=torch.half), 1.0, meta)


def test_meta_shapes():
    x = torch.empty(1000, device="meta", dtype=torch.bfloat16)
    r = torch.empty(1024, device="meta")
    out = ops.encode16(x, r, 1.0, torch.float16, 1024)
    assert out.shape == (1024,) and out.dtype == torch.float16 and out.is_meta
    codes, scales = ops.quantize_int8(x, r, 1.0, 256, 1024)
    assert (codes.shape, codes.dtype, scales.shape, scales.dtype) == (
        (1024,),
        torch.int8,
        (4,),
        torch.float32,
    )
    codes4, scales4 = ops.quantize_int4(x, r, 1.0, 64, 1024, scale_dtype=torch.bfloat16)
    assert (codes4.shape, codes4.dtype, scales4.shape, scales4.dtype) == (
        (512,),
        torch.uint8,
        (16,),
        torch.bfloat16,
    )
    assert codes4.is_meta and scales4.is_meta
    codes8, scales8 = ops.quantize_fp8(x, r, 1.0, 64, 1024)
    assert (codes8.shape, codes8.dtype, scales8.shape, scales8.dtype) == (
        (1024,),
        torch.float8_e4m3fn,
        (16,),
        torch.float32,
    )
    bits, scales = ops.quantize_onebit(x, None, 1.0, 64, 1024)
    assert (bits.shape, bits.dtype, scales.shape, scales.dtype) == (
        (128,),
        torch.uint8,
        (16,),
        torch.bfloat16,
    )
    o = torch.empty(1000, device="meta")
    for stats in (
        ops.decode16_sum(torch.empty(2, 1024, device="meta", dtype=torch.half), 1.0, o),
        ops.dequantize_int8_sum(
            codes.expand(3, -1).contiguous(), torch.empty(3, 4, device="meta"), 256, 1.0, o
        ),
        ops.dequantize_onebit_sum(bits[None], scales[None], 64, 1.0, o),
        ops.dequantize_int4_sum(
            codes4.expand(2, -1).contiguous(), scales4.expand(2, -1).contiguous(), 64, 1.0, o
        ),
        ops.dequantize_fp8_sum(codes8[None], scales8[None], 64, 1.0, o),
    ):
        assert stats.shape == (2,) and stats.dtype == torch.float64 and stats.is_meta
    with pytest.raises(RuntimeError, match=r"pycomm.quantize_onebit: block is 12"):
        ops.quantize_onebit(x, None, 1.0, 12, 1032)
    with pytest.raises(RuntimeError, match=r"pycomm.quantize_int4: block is 5"):
        ops.quantize_int4(x, None, 1.0, 5, 1030)


# --- opcheck: schema, fake kernel, autograd registration and aot dispatch -------------------


def _samples():
    # opcheck compares eager and traced outputs without equal_nan: finite values only
    for dtype in DTYPES:
        x = codec_input(300, dtype, 64, special=False).view(20, 15)
        yield "encode16", (x, residual(320), 0.5, torch.bfloat16, 320)
        yield "encode16", (x.t(), None, 2.0, torch.float16, 300)
        yield "quantize_int8", (x, residual(320), 0.5, 64, 320)
        yield "quantize_int8", (x.t(), None, 1.0, 100, 300)
        yield "quantize_onebit", (x, residual(320), 0.5, 64, 320)
        yield "quantize_onebit", (x.t(), None, 1.0, 8, 320)
        yield "quantize_int4", (x, residual(320), 0.5, 64, 320)
        yield "quantize_int4", (x.t(), None, 1.0, 6, 300, None, torch.bfloat16)
        yield "quantize_int4", (x, residual(320), 0.5, 64, 320, torch.zeros(320))
        yield "quantize_fp8", (x, residual(320), 0.5, 64, 320)
        r16 = residual(300, dtype=torch.bfloat16)
        yield "quantize_fp8", (x.t(), r16, 1.0, 3, 300, torch.zeros(300).to(torch.bfloat16))
        yield "quantize_int8", (x, residual(320), 0.5, 64, 320, torch.zeros(320))
        yield "quantize_onebit", (x, residual(320), 0.5, 64, 320, torch.zeros(320))
        yield "encode16", (x, residual(320), 0.5, torch.float16, 320, torch.zeros(320))
        bf = torch.bfloat16
        yield "quantize_int8", (x, residual(320, dtype=bf), 0.5, 64, 320, torch.zeros(320).to(bf))
        yield "quantize_onebit", (x, residual(320, dtype=bf), 0.5, 64, 320)
        yield "encode16", (x, residual(320, dtype=bf), 0.5, bf, 320)
    for out_dtype in OUT_DTYPES:
        codes, scales = _encode_rows("quantize_int8", 2, 300, 64, 320, False)
        yield "dequantize_int8_sum", (codes, scales, 64, 0.5, torch.empty(310, dtype=out_dtype))
        codes4, scales4 = _encode_rows(
            "quantize_int4", 2, 300, 64, 320, False, None, torch.bfloat16
        )
        yield "dequantize_int4_sum", (codes4, scales4, 64, 0.5, torch.empty(311, dtype=out_dtype))
        codes8, scales8 = _encode_rows("quantize_fp8", 2, 300, 3, 300, False)
        yield "dequantize_fp8_sum", (codes8, scales8, 3, 0.5, torch.empty(299, dtype=out_dtype))
        bits, bscales = _encode_rows("quantize_onebit", 3, 300, 64, 320, False)
        yield "dequantize_onebit_sum", (bits, bscales, 64, 0.5, torch.empty(320, dtype=out_dtype))
        chunks = torch.randn(2, 77).bfloat16()
        yield "decode16_sum", (chunks, 0.5, torch.empty(70, dtype=out_dtype))


@pytest.mark.parametrize(
    "name, args", list(_samples()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_opcheck(name, args):
    tests = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    if name == "dequantize_fp8_sum":
        # the schema check compares float8 inputs with arithmetic torch's CPU lacks for them
        # ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn): codes are only read, and
        # the Meta kernel, autograd registration and aot dispatch are still checked
        tests = tuple(t for t in tests if t != "test_schema")
    torch.library.opcheck(getattr(torch.ops.pycomm, name).default, args, test_utils=tests)
