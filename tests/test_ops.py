"""Kernels against the pure-PyTorch references: odd sizes, every dtype, strides, NaN/Inf,
bad input, and torch.library.opcheck."""

import pytest
import torch
from kernel_data import DTYPES
from kernel_data import bits_equal as _bits_equal
from kernel_data import rand as _rand

from pycomm import ops, reference

# 0, 1, around the vector step (16 or 32 elements), around the parallel grain (32768), large.
SIZES = [0, 1, 15, 17, 31, 33, 32767, 32769, 100003]


def _mixed_list(dtype, count=40, seed=1, special=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (0,), (1,), (3, 5), (17,), (33, 3), (2, 0, 4), (1000,), (129, 7)]
    out = []
    for i in range(count):
        shape = shapes[i % len(shapes)]
        t = (torch.randn(shape, generator=g) * 2).to(dtype)
        if i % 4 == 3 and t.dim() == 2:
            t = t.t()  # non-contiguous
        if i % 7 == 5 and t.dim() == 1 and t.numel() > 4:
            t = t[::2]  # strided
        out.append(t)
    if special:
        out[1] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    return out


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_sizes(in_dtype, out_dtype, n):
    tensors = [_rand(n, in_dtype), _rand(n + 3, in_dtype, seed=5)]
    flat = ops.pack(tensors, 0.5, out_dtype)
    _bits_equal(flat, reference.pack(tensors, 0.5, out_dtype))
    into = torch.full_like(flat, 9.0)
    ops.pack_into_(into, tensors, 0.5)
    _bits_equal(into, flat)
    got = [torch.full_like(t, 7.0) for t in tensors]
    want = [torch.full_like(t, 7.0) for t in tensors]
    ops.unpack_(flat, got, 3.0)
    reference.unpack_(flat, want, 3.0)
    for g, w in zip(got, want):
        _bits_equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_many_mixed_strided(dtype):
    tensors = _mixed_list(dtype, count=300)
    flat = ops.pack(tensors, 0.25)
    _bits_equal(flat, reference.pack(tensors, 0.25))
    into, want = torch.empty_like(flat), torch.empty_like(flat)
    ops.pack_into_(into, tensors, 0.25)
    reference.pack_into_(want, tensors, 0.25)
    _bits_equal(into, want)
    # unpack_ into non-contiguous targets too
    got = [
        torch.zeros(t.shape[::-1], dtype=dtype).t() if t.dim() == 2 else torch.zeros_like(t)
        for t in tensors
    ]
    assert any(not g.is_contiguous() for g in got)
    want = [torch.zeros_like(t) for t in tensors]
    ops.unpack_(flat, got, 4.0)
    reference.unpack_(flat, want, 4.0)
    for g, w in zip(got, want):
        _bits_equal(g, w)


def test_pack_roundtrip_exact_without_scale():
    tensors = _mixed_list(torch.float32)
    back = [torch.empty_like(t) for t in tensors]
    ops.unpack_(ops.pack(tensors), back)
    for b, t in zip(back, tensors):
        _bits_equal(b, t)


def test_pack_empty_list_and_zero_size():
    assert ops.pack([]).shape == (0,)
    assert ops.pack([], dtype=torch.bfloat16).dtype == torch.bfloat16
    ops.unpack_(torch.empty(0), [])
    z = [torch.empty(0), torch.empty(2, 0)]
    assert ops.pack(z).shape == (0,)
    ops.unpack_(torch.empty(0), z)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("fp32_dst", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_accumulate(src_dtype, fp32_dst, n):
    dst_dtype = torch.float32 if fp32_dst else src_dtype
    src = _rand(n, src_dtype)
    dst = _rand(n, dst_dtype, special=False, seed=9)
    before = dst.float()
    want = dst.clone()
    ops.accumulate_(dst, src, 0.3)
    reference.accumulate_(want, src, 0.3)
    # d + a*s rounded once to dst's dtype; a CPU that fuses the multiply-add may differ by one
    # rounding of the product, so the bound is one ulp of the operands' magnitude.
    got, ref = dst.float(), want.float()
    assert torch.equal(got.isnan(), ref.isnan())
    finite = ~ref.isnan()
    bound = torch.finfo(dst_dtype).eps * (before.abs() + (0.3 * src.float()).abs())
    diff = (got - ref)[finite].abs()
    diff = torch.where(got[finite] == ref[finite], torch.zeros_like(diff), diff)
    assert bool((diff <= bound[finite]).all())


def test_accumulate_strided():
    dst = torch.zeros(64, 48)[:, ::2]
    src = torch.randn(48, 64).t()[:, ::2]
    want = dst.clone()
    ops.accumulate_(dst, src, -2.0)
    reference.accumulate_(want, src, -2.0)
    torch.testing.assert_close(dst, want)
    assert dst.abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_scale(dtype, n):
    t = _rand(n, dtype)
    want = t.clone()
    ops.scale_(t, 0.125)
    reference.scale_(want, 0.125)
    _bits_equal(t, want)
    s = torch.randn(40, 30).to(dtype).t()
    want = s.clone()
    ops.scale_(s, 3.0)
    reference.scale_(want, 3.0)
    _bits_equal(s, want)


def test_nan_inf_survive():
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    flat = ops.pack([t], 2.0, torch.bfloat16)
    assert flat[0].isnan() and flat[1] == float("inf") and flat[2] == -float("inf")


# --- bad input: a clear error naming the op, the argument and what was expected ----------


@pytest.mark.parametrize(
    "call, pattern",
    [
        (
            lambda: ops.pack([torch.ones(3), torch.ones(2, dtype=torch.int64)]),
            r"pycomm.pack: tensors\[1\] has dtype Long, expected Float, Half or BFloat16",
        ),
        (
            lambda: ops.pack([torch.ones(3), torch.ones(2, dtype=torch.float16)]),
            r"pycomm.pack: tensors\[1\] has dtype Half, expected Float like tensors\[0\]",
        ),
        (
            lambda: ops.pack([torch.ones(3)], dtype=torch.int32),
            r"pycomm.pack: dtype is Int, expected Float, Half or BFloat16",
        ),
        (
            lambda: ops.pack([torch.ones(3, dtype=torch.float64)]),
            r"pycomm.pack: tensors\[0\] has dtype Double",
        ),
        (
            lambda: ops.unpack_(torch.ones(5), [torch.ones(2), torch.ones(2)]),
            r"pycomm.unpack_: flat has 5 elements, expected 4",
        ),
        (
            lambda: ops.unpack_(torch.ones(2, 2), [torch.ones(4)]),
            r"pycomm.unpack_: flat has shape \[2, 2\].*expected a 1-D contiguous tensor",
        ),
        (
            lambda: ops.unpack_(torch.ones(4, dtype=torch.int32), [torch.ones(4)]),
            r"pycomm.unpack_: flat has dtype Int",
        ),
        (
            lambda: ops.accumulate_(torch.ones(4), torch.ones(5)),
            r"pycomm.accumulate_: src has shape \[5\], expected dst's shape \[4\]",
        ),
        (
            lambda: ops.accumulate_(
                torch.ones(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float16)
            ),
            r"pycomm.accumulate_: dst has dtype BFloat16, expected Float or src's dtype Half",
        ),
        (
            lambda: ops.accumulate_(torch.ones(4), torch.ones(4, dtype=torch.int8)),
            r"pycomm.accumulate_: src has dtype Char",
        ),
        (
            lambda: ops.scale_(torch.ones(4, dtype=torch.int64), 2.0),
            r"pycomm.scale_: t has dtype Long",
        ),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_mismatched_devices_rejected():
    # meta stands in for a second device on a CPU-only machine: the fake kernel runs and
    # must check what the real kernels check.
    with pytest.raises(RuntimeError, match=r"pycomm.pack: tensors\[1\] is on cpu, expected meta"):
        ops.pack([torch.ones(3, device="meta"), torch.ones(2)])
    with pytest.raises(RuntimeError, match=r"pycomm.accumulate_: src is on"):
        ops.accumulate_(torch.ones(3), torch.ones(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"pycomm.unpack_: tensors\[0\] is on"):
        ops.unpack_(torch.ones(3, device="meta"), [torch.ones(3)])


def test_overlapping_unpack_target_rejected():
    with pytest.raises(RuntimeError, match="memory location"):
        ops.unpack_(torch.ones(6), [torch.ones(1).expand(3, 2)])


def test_meta_shapes():
    flat = ops.pack(
        [torch.empty(3, 4, device="meta"), torch.empty(5, device="meta")], dtype=torch.bfloat16
    )
    assert flat.shape == (17,) and flat.dtype == torch.bfloat16 and flat.is_meta


# --- opcheck: schema, fake kernel, autograd registration and aot dispatch ------------------


def _samples():
    for dtype in DTYPES:
        # opcheck compares eager and traced outputs without equal_nan: finite values only
        ts = _mixed_list(dtype, count=10, special=False)
        yield "pack", (ts, 0.5, None)
        yield "pack", (ts, 2.0, torch.float32)
        flat = torch.randn(sum(t.numel() for t in ts))
        yield "pack_into_", (torch.empty_like(flat), ts, 3.0)
        yield "unpack_", (flat, [torch.empty_like(t) for t in ts], 0.5)
        yield "accumulate_", (torch.randn(37), torch.randn(37).to(dtype), 0.5)
        yield "accumulate_", (torch.randn(5, 7).to(dtype), torch.randn(5, 7).to(dtype), 1.0)
        yield "scale_", (torch.randn(33).to(dtype), 3.0)


@pytest.mark.parametrize(
    "name, args", list(_samples()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.pycomm, name).default, args)
