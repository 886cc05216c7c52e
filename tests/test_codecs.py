"""Codec kernels (encode16, quantize_int8, quantize_onebit and their *_sum decoders) against
pycomm.reference, bit for bit: odd sizes, padding, every dtype, strides, NaN/Inf, bad input,
meta tensors and torch.library.opcheck."""

import pytest
import torch
from kernel_data import DTYPES
from kernel_data import bits_equal as _bits_equal
from kernel_data import codec_input as _x
from kernel_data import residual as _residual

from pycomm import ops, reference

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _sizes(block):
    return sorted({0, 1, max(block - 1, 0), block, block + 1, 7, 9, 1000, 100003})


def _numel(n, block, pad_blocks=0):
    return -(-n // block) * block + pad_blocks * block


def _check_encoder(name, x, scale, arg, numel, with_residual, updates=True):
    """Runs ops.<name> and reference.<name> on copies of one residual; compares everything."""
    r_ops = _residual(numel) if with_residual else None
    r_ref = r_ops.clone() if with_residual else None
    got = getattr(ops, name)(x, r_ops, scale, arg, numel)
    want = getattr(reference, name)(x, r_ref, scale, arg, numel)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        _bits_equal(g, w)
    if with_residual:
        _bits_equal(r_ops, r_ref)
        if numel and updates:
            assert not torch.equal(r_ops, _residual(numel)), "residual was not updated"
    return got


# --- encoders against the reference --------------------------------------------------------


@pytest.mark.parametrize(
    "name, arg, block",
    [("quantize_int8", 64, 64), ("quantize_onebit", 64, 64), ("encode16", torch.bfloat16, 8)],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rdtype", [torch.float32, torch.bfloat16])
def test_residual_out_leaves_residual_and_matches_in_place(name, arg, block, dtype, rdtype):
    # What the hooks rely on to drop a step's residuals when it turns out non-finite: the new
    # residual in residual_out (NaN blocks keep the old value there too), the old one intact,
    # everything else as the in-place update gives it.
    for n in _sizes(block):
        numel = _numel(n, block, pad_blocks=1)
        x = _x(n, dtype, block)
        old = _residual(numel, dtype=rdtype)
        r_in, out = old.clone(), torch.full((numel,), 123.0, dtype=rdtype)
        got = getattr(ops, name)(x, r_in, 0.5, arg, numel, residual_out=out)
        _bits_equal(r_in, old)
        in_place = old.clone()
        want = getattr(ops, name)(x, in_place, 0.5, arg, numel)
        _bits_equal(out, in_place)
        ref_in, ref_out = old.clone(), torch.full((numel,), 123.0, dtype=rdtype)
        ref = getattr(reference, name)(x, ref_in, 0.5, arg, numel, residual_out=ref_out)
        _bits_equal(ref_out, out)
        _bits_equal(ref_in, old)
        got, want, ref = ((t,) if isinstance(t, torch.Tensor) else t for t in (got, want, ref))
        for a, b, c in zip(got, want, ref):
            _bits_equal(a, b)
            _bits_equal(a, c)


@pytest.mark.parametrize(
    "name, arg, block",
    [
        ("quantize_int8", 256, 256),
        ("quantize_int8", 5, 5),
        ("quantize_onebit", 64, 64),
        ("quantize_onebit", 8, 8),
        ("encode16", torch.bfloat16, 8),
        ("encode16", torch.float16, 8),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bf16_residual_is_the_fp32_update_rounded(name, arg, block, dtype):
    # A bf16 residual is widened exactly, y is computed in fp32 as with an fp32 residual, and
    # only the new residual is rounded (to nearest even): the codes are those of the same
    # residual held in fp32, and the new residual is that run's, rounded. NaN/Inf blocks keep
    # their old residual. Also bit for bit against the reference.
    for n in _sizes(block):
        numel = _numel(n, block, pad_blocks=1)
        x = _x(n, dtype, block)
        r16 = _residual(numel, dtype=torch.bfloat16)
        r32 = r16.float()
        got = getattr(ops, name)(x, r16, 0.5, arg, numel)
        want = getattr(ops, name)(x, r32, 0.5, arg, numel)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            _bits_equal(a, b)
        _bits_equal(r16, r32.to(torch.bfloat16))
        ref_r = _residual(numel, dtype=torch.bfloat16)
        ref = getattr(reference, name)(x, ref_r, 0.5, arg, numel)
        ref = ref if isinstance(ref, tuple) else (ref,)
        for a, b in zip(got, ref):
            _bits_equal(a, b)
        _bits_equal(r16, ref_r)


@pytest.mark.parametrize("name", ["quantize_int8", "quantize_onebit", "encode16"])
def test_decoders_read_row_slices_of_a_packed_buffer(name):
    # The hooks receive [R, codes | scales] rows and decode the column slices in place.
    rows, n, block = 3, 1000, 64
    numel = _numel(n, block)
    arg = torch.bfloat16 if name == "encode16" else block
    enc = [
        getattr(ops, name)(_x(n, torch.float32, block, seed=r), None, 1.0, arg, numel)
        for r in range(rows)
    ]
    enc = [e if isinstance(e, tuple) else (e, None) for e in enc]
    codes = torch.stack([e[0] for e in enc])
    cb = codes.shape[1] * codes.element_size()
    scales = None if enc[0][1] is None else torch.stack([e[1] for e in enc])
    sb = 0 if scales is None else scales.shape[1] * scales.element_size()
    packed = torch.zeros(rows, cb + sb + 8, dtype=torch.uint8)  # + 8: rows further apart
    packed[:, :cb] = codes.view(torch.uint8).view(rows, cb)
    if scales is not None:
        packed[:, cb : cb + sb] = scales.view(torch.uint8).view(rows, sb)
    c_view = packed[:, :cb].view(codes.dtype)
    s_view = None if scales is None else packed[:, cb : cb + sb].view(scales.dtype)
    assert not c_view.is_contiguous()
    got, want = torch.empty(n), torch.empty(n)
    if name == "encode16":
        a, b = ops.decode16_sum(c_view, 0.5, got), ops.decode16_sum(codes, 0.5, want)
    else:
        dec = getattr(
            ops, "dequantize_int8_sum" if name == "quantize_int8" else "dequantize_onebit_sum"
        )
        a, b = dec(c_view, s_view, block, 0.5, got), dec(codes, scales, block, 0.5, want)
    _bits_equal(got, want)
    assert torch.equal(a, b) and a[1] > 0  # [squared norm, non-finite count]


def test_residual_out_bad_input():
    x, r = torch.ones(16), torch.zeros(16)
    with pytest.raises(RuntimeError, match="residual_out is given without residual"):
        ops.quantize_int8(x, None, 1.0, 8, 16, residual_out=r)
    with pytest.raises(RuntimeError, match="residual_out has 8 elements, expected numel = 16"):
        ops.quantize_onebit(x, r, 1.0, 8, 16, residual_out=torch.zeros(8))
    with pytest.raises(RuntimeError, match="residual_out has dtype Half"):
        ops.encode16(x, r, 1.0, torch.float16, 16, residual_out=torch.zeros(16).half())
    with pytest.raises(RuntimeError, match="residual_out has dtype BFloat16, expected Float like"):
        ops.quantize_int8(x, r, 1.0, 8, 16, residual_out=torch.zeros(16).bfloat16())
    big = torch.zeros(24)
    with pytest.raises(RuntimeError, match="residual_out overlaps residual"):
        ops.quantize_int8(x, big[:16], 1.0, 8, 16, residual_out=big[8:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [1, 8, 64, 100, 256])
def test_quantize_int8(dtype, block):
    for n in _sizes(block):
        for pad in (0, 3):
            numel = _numel(n, block, pad)
            x = _x(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                codes, scales = _check_encoder("quantize_int8", x, 0.5, block, numel, with_residual)
                assert codes.shape == (numel,) and scales.shape == (numel // block,)
    # the NaN and Inf blocks of the last x: scale NaN, codes 0
    assert scales.isnan().sum() >= 2
    assert not codes.view(-1, block)[scales.isnan()].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [8, 64, 256])
def test_quantize_onebit(dtype, block):
    for n in _sizes(block):
        for pad in (0, 2):
            numel = _numel(n, block, pad)
            x = _x(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                bits, scales = _check_encoder(
                    "quantize_onebit", x, 2.0, block, numel, with_residual
                )
                assert bits.shape == (numel // 8,) and scales.dtype == torch.bfloat16
    assert scales.isnan().sum() >= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_encode16(dtype, out_dtype):
    for n in _sizes(8) + [32767, 32769]:
        for pad in (0, 5):
            numel = n + pad
            x = _x(n, dtype, 8, seed=pad)
            if n > 20:
                x[5] = 1e6 if dtype != torch.float16 else 6e4  # overflows fp16 after scale
            for with_residual in (False, True):
                _check_encoder("encode16", x, 3.0, out_dtype, numel, with_residual)


@pytest.mark.parametrize("name, arg", [("quantize_int8", 64), ("quantize_onebit", 64)])
def test_encoders_large_block_and_scale_one(name, arg):
    # a block longer than the kernels' on-stack tile, and a scale of 1
    numel = 3 * 4096
    x = _x(numel - 100, torch.bfloat16, 4096)
    _check_encoder(name, x, 1.0, 4096, numel, True)
    _check_encoder(name, x, 1.0, 2560, 5 * 2560, True)
    _check_encoder(name, x, 1.0, arg, numel, True)


@pytest.mark.parametrize("name", ["quantize_int8", "quantize_onebit", "encode16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoders_non_contiguous(name, dtype):
    base = (torch.randn(300, 70) * 2).to(dtype)
    arg = torch.bfloat16 if name == "encode16" else 64
    for x in (base.t(), base[::3, ::2], base[:, 5]):
        assert not x.is_contiguous()
        numel = _numel(x.numel(), 64, 1)
        _check_encoder(name, x, 0.25, arg, numel, True)
        _check_encoder(name, x, 0.25, arg, numel, False)


def test_encoders_zero_and_tiny_values():
    # absmax 0 (inv 0) and absmax so small that 127 / absmax overflows: that block quantizes
    # to 0 and keeps y in the residual (never a NaN that would poison later steps).
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
            _check_encoder("quantize_int8", x, 1.0, block, 16, True)
            if block % 8 == 0:
                _check_encoder("quantize_onebit", x, 1.0, block, 16, True)
        _check_encoder("encode16", x, 1.0, torch.float16, 16, True, updates=False)
        _check_encoder("encode16", x, 1.0, torch.bfloat16, 16, True, updates=False)
    r = torch.zeros(2)
    codes, _ = ops.quantize_int8(torch.tensor([1e-38, 0.0]), r, 1.0, 2, 2)
    assert codes.tolist() == [0, 0] and torch.equal(r, torch.tensor([1e-38, 0.0]))


def test_padding_adds_residual_to_positive_zero():
    # the reference pads with +0 and adds the residual: a -0 residual there gives +0
    x = torch.tensor([-0.0, 1.0, -2.0])
    for name, arg in (("encode16", torch.bfloat16), ("quantize_onebit", 8), ("quantize_int8", 8)):
        r_ops, r_ref = torch.full((16,), -0.0), torch.full((16,), -0.0)
        got = getattr(ops, name)(x, r_ops, 1.0, arg, 16)
        want = getattr(reference, name)(x, r_ref, 1.0, arg, 16)
        for g, w in zip(got, want) if isinstance(got, tuple) else ((got, want),):
            _bits_equal(g, w)
        _bits_equal(r_ops, r_ref)
    out = ops.encode16(x, torch.full((16,), -0.0), 1.0, torch.bfloat16, 16)
    assert torch.signbit(out[0]) and not torch.signbit(out[3:]).any()


def test_onebit_bit_order_and_scale():
    x = torch.tensor([1.0, -1.0, -0.0, float("nan"), 2.0, -2.0, 0.0, -3.0] + [1.0] * 8)
    bits, scales = ops.quantize_onebit(x, None, 1.0, 16, 16)
    # y >= 0 at elements 0, 2 (-0), 4, 6 -> bits 0, 2, 4, 6; NaN is not >= 0
    assert bits.tolist() == [0b01010101, 0xFF]
    assert scales.isnan().all()


# --- decoders against the reference --------------------------------------------------------


def _out(m, dtype, short):
    return torch.full((max(m - short, 0),), 7.0, dtype=dtype)


def _check_sum(name, args, out):
    got_out, want_out = out.clone(), out.clone()
    got = getattr(ops, name)(*args, got_out)
    want = getattr(reference, name)(*args, want_out)
    _bits_equal(got_out, want_out)
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got[1] == want[1]
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    return got, got_out


def _encode_rows(name, rows, n, block, numel, special):
    # R ranks' encodings of different data: row r scaled by r + 1, NaN/Inf in some blocks
    outs = [
        getattr(ops, name)(
            _x(n, torch.float32, block, special, seed=r), None, r + 1.0, block, numel
        )
        for r in range(rows)
    ]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_int8_sum(rows, out_dtype):
    for block in (1, 8, 64, 100, 256):
        for n in (1, block + 1, 1000) + ((100003,) if block in (1, 100) else ()):
            numel = _numel(n, block, 1)
            for special in (False, True):
                codes, scales = _encode_rows("quantize_int8", rows, n, block, numel, special)
                for short in (0, 3, block + 5) if n < 10000 else (special * (block + 5),):
                    out = _out(numel, out_dtype, short)
                    _check_sum("dequantize_int8_sum", (codes, scales, block, 0.5), out)
    stats, _ = _check_sum(
        "dequantize_int8_sum", (codes, scales, block, 0.5), _out(numel, out_dtype, 0)
    )
    assert stats[1] > 0 and stats[0] > 0


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_onebit_sum(rows, out_dtype):
    for block in (8, 64, 256):
        for n in (1, block + 1, 1000) + ((100003,) if block == 64 else ()):
            numel = _numel(n, block, 1)
            for special in (False, True):
                bits, scales = _encode_rows("quantize_onebit", rows, n, block, numel, special)
                for short in (0, 3, block + 5) if n < 10000 else (special * (block + 5),):
                    out = _out(numel, out_dtype, short)
                    _check_sum("dequantize_onebit_sum", (bits, scales, block, 0.25), out)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("chunk_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_decode16_sum(rows, chunk_dtype, out_dtype):
    for m in (1, 7, 9, 33, 1000, 100003):
        chunks = torch.stack([_x(m, torch.float32, 8, seed=r) * (r + 1) for r in range(rows)])
        chunks = chunks.to(chunk_dtype)
        for short in (0, 1, 5) if m < 10000 else (5,):
            _check_sum("decode16_sum", (chunks, 3.0), _out(m, out_dtype, short))


def test_sum_out_shapes_and_overflow():
    # a 2-D out, and a sum that overflows out's dtype: counted as non-finite, not in the norm
    chunks = torch.full((2, 12), 60000.0, dtype=torch.float16)
    out = torch.empty(3, 4, dtype=torch.float16)
    stats, got = _check_sum("decode16_sum", (chunks, 1.0), out)
    assert got.isinf().all() and stats.tolist() == [0.0, 12.0]
    codes = torch.full((1, 16), 127, dtype=torch.int8)
    scales = torch.tensor([[2.0, float("nan")]])
    stats, got = _check_sum("dequantize_int8_sum", (codes, scales, 8, 1.0), torch.empty(2, 8))
    assert stats.tolist() == [8 * 254.0**2, 8.0]


def test_sum_zero_size():
    out = torch.empty(0)
    assert ops.decode16_sum(torch.empty(2, 0, dtype=torch.bfloat16), 1.0, out).tolist() == [0, 0]
    z = torch.empty(1, 0, dtype=torch.int8)
    assert ops.dequantize_int8_sum(z, torch.empty(1, 0), 8, 1.0, out).tolist() == [0, 0]
    zb = torch.empty(3, 0, dtype=torch.uint8)
    s = torch.empty(3, 0, dtype=torch.bfloat16)
    assert ops.dequantize_onebit_sum(zb, s, 8, 1.0, out).tolist() == [0, 0]
    # out shorter than m, even empty, leaves the rest alone
    codes = torch.ones(2, 8, dtype=torch.int8)
    assert ops.dequantize_int8_sum(codes, torch.ones(2, 1), 8, 1.0, out).tolist() == [0, 0]


def test_encoders_zero_size():
    x = torch.empty(0, dtype=torch.bfloat16)
    assert ops.encode16(x, None, 1.0, torch.float16, 0).shape == (0,)
    assert ops.encode16(x, torch.zeros(4), 1.0, torch.float16, 4).tolist() == [0, 0, 0, 0]
    codes, scales = ops.quantize_int8(x, torch.empty(0), 1.0, 8, 0)
    assert codes.shape == (0,) and scales.shape == (0,)
    bits, scales = ops.quantize_onebit(x, None, 1.0, 8, 0)
    assert bits.shape == (0,) and scales.shape == (0,)


# --- round trip: decode(encode(y)) + new residual == y --------------------------------------


@pytest.mark.parametrize("name", ["encode16", "quantize_int8", "quantize_onebit"])
def test_round_trip_error_feedback(name):
    n, block = 10000, 64
    numel = _numel(n, block, 1)
    x = _x(n, torch.bfloat16, block, special=False)
    r = _residual(numel)
    y = torch.zeros(numel)
    y[:n] = x.float() * 0.5
    y += r
    out = torch.empty(numel)
    if name == "encode16":
        payload = ops.encode16(x, r, 0.5, torch.bfloat16, numel)
        stats = ops.decode16_sum(payload[None], 1.0, out)
    elif name == "quantize_int8":
        codes, scales = ops.quantize_int8(x, r, 0.5, block, numel)
        stats = ops.dequantize_int8_sum(codes[None], scales[None], block, 1.0, out)
    else:
        bits, scales = ops.quantize_onebit(x, r, 0.5, block, numel)
        stats = ops.dequantize_onebit_sum(bits[None], scales[None], block, 1.0, out)
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


@pytest.mark.parametrize(
    "call, pattern",
    [
        (
            lambda: ops.encode16(_X.long(), None, 1.0, torch.float16, 16),
            r"pycomm.encode16: x has dtype Long, expected Float, Half or BFloat16",
        ),
        (
            lambda: ops.encode16(_X, None, 1.0, torch.float32, 16),
            r"pycomm.encode16: dtype is Float, expected Half or BFloat16",
        ),
        (
            lambda: ops.encode16(_X, None, 1.0, torch.float16, 9),
            r"pycomm.encode16: numel is 9, expected >= x.numel\(\) = 10",
        ),
        (
            lambda: ops.encode16(_X, _R.half(), 1.0, torch.float16, 16),
            r"pycomm.encode16: residual has dtype Half, expected Float or BFloat16",
        ),
        (
            lambda: ops.quantize_int8(_X, torch.zeros(15), 1.0, 8, 16),
            r"pycomm.quantize_int8: residual has 15 elements, expected numel = 16",
        ),
        (
            lambda: ops.quantize_int8(_X, torch.zeros(32)[::2], 1.0, 8, 16),
            r"pycomm.quantize_int8: residual has strides \[2\], expected a contiguous tensor",
        ),
        (
            lambda: ops.quantize_int8(_X, None, 1.0, 0, 16),
            r"pycomm.quantize_int8: block is 0, expected >= 1",
        ),
        (
            lambda: ops.quantize_int8(_X, None, 1.0, 6, 16),
            r"pycomm.quantize_int8: numel is 16, expected a multiple of block = 6",
        ),
        (
            lambda: ops.quantize_int8(_X, None, 1.0, -8, 16),
            r"pycomm.quantize_int8: block is -8, expected >= 1",
        ),
        (
            lambda: ops.quantize_onebit(_X, None, 1.0, 4, 16),
            r"pycomm.quantize_onebit: block is 4, expected a multiple of 8",
        ),
        (
            lambda: ops.quantize_onebit(_X, None, 1.0, 16, 24),
            r"pycomm.quantize_onebit: numel is 24, expected a multiple of block = 16",
        ),
        (
            lambda: ops.quantize_onebit(_X, None, 1.0, 8, 8),
            r"pycomm.quantize_onebit: numel is 8, expected >= x.numel\(\) = 10",
        ),
        (
            lambda: ops.decode16_sum(torch.ones(2, 8), 1.0, torch.empty(8)),
            r"pycomm.decode16_sum: chunks has dtype Float, expected Half or BFloat16",
        ),
        (
            lambda: ops.decode16_sum(torch.ones(8, dtype=torch.half), 1.0, torch.empty(8)),
            r"pycomm.decode16_sum: chunks has shape \[8\], expected a 2-D \[R, m\] tensor",
        ),
        (
            lambda: ops.decode16_sum(torch.ones(0, 8, dtype=torch.half), 1.0, torch.empty(8)),
            r"pycomm.decode16_sum: chunks has shape \[0, 8\], expected R >= 1 rows",
        ),
        (
            lambda: ops.decode16_sum(torch.ones(8, 2, dtype=torch.half).t(), 1.0, torch.empty(8)),
            r"pycomm.decode16_sum: chunks has shape \[2, 8\] and strides \[1, 2\], expected "
            r"contiguous rows",
        ),
        (
            lambda: ops.decode16_sum(torch.ones(2, 8, dtype=torch.half), 1.0, torch.empty(9)),
            r"pycomm.decode16_sum: out has 9 elements, expected <= m = 8",
        ),
        (
            lambda: ops.decode16_sum(
                torch.ones(2, 8, dtype=torch.half), 1.0, torch.empty(8, dtype=torch.int32)
            ),
            r"pycomm.decode16_sum: out has dtype Int, expected Float, Half or BFloat16",
        ),
        (
            lambda: ops.decode16_sum(torch.ones(2, 8, dtype=torch.half), 1.0, torch.empty(8)[::2]),
            r"pycomm.decode16_sum: out has strides \[2\], expected a contiguous tensor",
        ),
        (
            lambda: ops.dequantize_int8_sum(_I8.byte(), torch.ones(2, 2), 8, 1.0, torch.empty(16)),
            r"pycomm.dequantize_int8_sum: codes has dtype Byte, expected Char \(int8\)",
        ),
        (
            lambda: ops.dequantize_int8_sum(_I8, torch.ones(2, 3), 8, 1.0, torch.empty(16)),
            r"pycomm.dequantize_int8_sum: scales has shape \[2, 3\], expected \[2, 2\]",
        ),
        (
            lambda: ops.dequantize_int8_sum(_I8, torch.ones(2, 2).half(), 8, 1.0, torch.empty(16)),
            r"pycomm.dequantize_int8_sum: scales has dtype Half, expected Float",
        ),
        (
            lambda: ops.dequantize_int8_sum(_I8, torch.ones(2, 3), 6, 1.0, torch.empty(16)),
            r"pycomm.dequantize_int8_sum: codes has m = 16 columns, expected a multiple of "
            r"block = 6",
        ),
        (
            lambda: ops.dequantize_int8_sum(_I8, torch.ones(2, 2), 0, 1.0, torch.empty(16)),
            r"pycomm.dequantize_int8_sum: block is 0, expected >= 1",
        ),
        (
            lambda: ops.dequantize_int8_sum(_I8, torch.ones(2, 2), 8, 1.0, torch.empty(17)),
            r"pycomm.dequantize_int8_sum: out has 17 elements, expected <= m = 16",
        ),
        (
            lambda: ops.dequantize_onebit_sum(
                _U8.char(), torch.ones(2, 2).bfloat16(), 8, 1.0, torch.empty(16)
            ),
            r"pycomm.dequantize_onebit_sum: bits has dtype Char, expected Byte \(uint8\)",
        ),
        (
            lambda: ops.dequantize_onebit_sum(_U8, torch.ones(2, 2), 8, 1.0, torch.empty(16)),
            r"pycomm.dequantize_onebit_sum: scales has dtype Float, expected BFloat16",
        ),
        (
            lambda: ops.dequantize_onebit_sum(
                _U8, torch.ones(2, 4).bfloat16(), 4, 1.0, torch.empty(16)
            ),
            r"pycomm.dequantize_onebit_sum: block is 4, expected a multiple of 8",
        ),
        (
            lambda: ops.dequantize_onebit_sum(
                _U8, torch.ones(2, 1).bfloat16(), 24, 1.0, torch.empty(16)
            ),
            r"pycomm.dequantize_onebit_sum: bits has m = 16 elements \(8 per column\), "
            r"expected a multiple of block = 24",
        ),
        (
            lambda: ops.dequantize_onebit_sum(
                _U8, torch.ones(1, 2).bfloat16(), 8, 1.0, torch.empty(16)
            ),
            r"pycomm.dequantize_onebit_sum: scales has shape \[1, 2\], expected \[2, 2\]",
        ),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_mismatched_devices_rejected():
    # meta stands in for a second device: the fake kernels check what the real kernels check
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
    ):
        assert stats.shape == (2,) and stats.dtype == torch.float64 and stats.is_meta
    with pytest.raises(RuntimeError, match=r"pycomm.quantize_onebit: block is 12"):
        ops.quantize_onebit(x, None, 1.0, 12, 1032)


# --- opcheck: schema, fake kernel, autograd registration and aot dispatch -------------------


def _samples():
    # opcheck compares eager and traced outputs without equal_nan: finite values only
    for dtype in DTYPES:
        x = _x(300, dtype, 64, special=False).view(20, 15)
        yield "encode16", (x, _residual(320), 0.5, torch.bfloat16, 320)
        yield "encode16", (x.t(), None, 2.0, torch.float16, 300)
        yield "quantize_int8", (x, _residual(320), 0.5, 64, 320)
        yield "quantize_int8", (x.t(), None, 1.0, 100, 300)
        yield "quantize_onebit", (x, _residual(320), 0.5, 64, 320)
        yield "quantize_onebit", (x.t(), None, 1.0, 8, 320)
        yield "quantize_int8", (x, _residual(320), 0.5, 64, 320, torch.zeros(320))
        yield "quantize_onebit", (x, _residual(320), 0.5, 64, 320, torch.zeros(320))
        yield "encode16", (x, _residual(320), 0.5, torch.float16, 320, torch.zeros(320))
        bf = torch.bfloat16
        yield "quantize_int8", (x, _residual(320, dtype=bf), 0.5, 64, 320, torch.zeros(320).to(bf))
        yield "quantize_onebit", (x, _residual(320, dtype=bf), 0.5, 64, 320)
        yield "encode16", (x, _residual(320, dtype=bf), 0.5, bf, 320)
    for out_dtype in OUT_DTYPES:
        codes, scales = _encode_rows("quantize_int8", 2, 300, 64, 320, False)
        yield "dequantize_int8_sum", (codes, scales, 64, 0.5, torch.empty(310, dtype=out_dtype))
        bits, bscales = _encode_rows("quantize_onebit", 3, 300, 64, 320, False)
        yield "dequantize_onebit_sum", (bits, bscales, 64, 0.5, torch.empty(320, dtype=out_dtype))
        chunks = torch.randn(2, 77).bfloat16()
        yield "decode16_sum", (chunks, 0.5, torch.empty(70, dtype=out_dtype))


@pytest.mark.parametrize(
    "name, args", list(_samples()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.pycomm, name).default, args)
