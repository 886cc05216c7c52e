"""Bucket-fusion kernels (pack, pack_into_, unpack_, accumulate_, scale_) against the
pure-PyTorch references, bit for bit, on every backend (``be``: cpu, emu, cuda; see
conftest.py): odd sizes, every dtype, strides, misaligned views, NaN/Inf, many tensors, bad
input; and, on the CPU, meta tensors and torch.library.opcheck."""

import pytest
import torch
from conftest import pycomm_ops
from kernel_data import DTYPES, NAN, bits_equal, poisoned_like, rand, size_of

from pycomm import ops, reference

# Sizes around each backend's own boundaries (kernel_data.size_of): 0, 1, one vector step
# +-1, the next unit +-1, one parallel task or multi-tensor chunk +-1, large.
SIZES = ["0", "1", "step-1", "step+1", "tile-1", "tile+1", "grain-1", "grain+1", "large"]


def _mixed_list(dtype, count=40, seed=1, special=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (0,), (1,), (3, 5), (17,), (33, 3), (2, 0, 4), (1000,), (129, 7), (4096,)]
    out = []
    for i in range(count):
        shape = shapes[i % len(shapes)]
        t = (torch.randn(shape, generator=g) * 2).to(dtype)
        if i % 4 == 3 and t.dim() == 2:
            t = t.t()  # non-contiguous
        if i % 7 == 5 and t.dim() == 1 and t.numel() > 4:
            t = t[::2]  # strided
        if i % 11 == 6 and t.dim() == 1 and t.numel() > 4:
            t = t[1:]  # contiguous, misaligned
        out.append(t)
    if special:
        out[1] = torch.tensor([NAN, float("inf"), -float("inf")], dtype=dtype)
    return out


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_pack_unpack_sizes(be, in_dtype, out_dtype, size):
    n = size_of(be, size)
    tensors = [rand(n, in_dtype), rand(n + 3, in_dtype, seed=5)]
    dev = [be.to(t) for t in tensors]
    for scale in (0.5, 1.0):
        want = reference.pack(tensors, scale, out_dtype)
        flat = be("pack", dev, scale, out_dtype)
        bits_equal(flat, want)
        into = be.to(poisoned_like(want))
        be("pack_into_", into, dev, scale)
        bits_equal(into, want)
        back_want = [torch.full_like(t, NAN) for t in tensors]
        reference.unpack_(want, back_want, 3.0)
        back = [be.to(t) for t in back_want]
        for b in back:
            b.fill_(7.0)
        be("unpack_", flat, back, 3.0)
        for b, w in zip(back, back_want):
            bits_equal(b, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_many_mixed_strided(be, dtype):
    # 300 tensors: more than one CUDA launch's table; strided ones are staged there
    tensors = _mixed_list(dtype, count=300)
    dev = [be.to(t) for t in tensors]
    for scale, out_dtype in ((0.25, None), (1.0, None), (2.0, torch.float32)):
        bits_equal(be("pack", dev, scale, out_dtype), reference.pack(tensors, scale, out_dtype))
    # into a flat that starts 1 element into its buffer: every piece misaligned
    want = reference.pack(tensors, 0.5)
    buf = be.to(torch.full((want.numel() + 9,), NAN, dtype=dtype))
    into = buf[1 : 1 + want.numel()]
    be("pack_into_", into, dev, 0.5)
    bits_equal(into, want)
    assert buf[0].isnan() and buf[-8:].isnan().all()  # nothing written around it
    # unpack_ into non-contiguous targets, and back from the misaligned flat
    targets = [
        torch.zeros(t.shape[::-1], dtype=dtype).t() if t.dim() == 2 else torch.zeros_like(t)
        for t in tensors
    ]
    assert any(not t.is_contiguous() for t in targets)
    dev_targets = [be.to(t) for t in targets]
    reference.unpack_(want, targets, 4.0)
    be("unpack_", into, dev_targets, 4.0)
    for g, w in zip(dev_targets, targets):
        bits_equal(g, w)


def test_pack_roundtrip_exact_without_scale(be):
    tensors = [be.to(t) for t in _mixed_list(torch.float32)]
    back = [torch.empty_like(t) for t in tensors]
    be("unpack_", be("pack", tensors, 1.0, None), back, 1.0)
    for b, t in zip(back, tensors):
        bits_equal(b, t.cpu())


def test_pack_empty_list_and_zero_size(be):
    if be.name == "cpu":  # an empty list has no device: the CPU kernel answers it
        assert ops.pack([]).shape == (0,)
        assert ops.pack([], dtype=torch.bfloat16).dtype == torch.bfloat16
        ops.unpack_(torch.empty(0), [])
    z = [be.to(torch.empty(0)), be.to(torch.empty(2, 0))]
    flat = be("pack", z, 1.0, None)
    assert flat.shape == (0,) and flat.device == z[0].device
    be("unpack_", be.to(torch.empty(0)), z, 1.0)
    be("pack_into_", be.to(torch.empty(0)), z, 2.0)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("fp32_dst", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_accumulate(be, src_dtype, fp32_dst, size):
    n = size_of(be, size)
    dst_dtype = torch.float32 if fp32_dst else src_dtype
    src = rand(n, src_dtype)
    dst = rand(n, dst_dtype, special=False, seed=9)
    got = be.to(dst)
    be("accumulate_", got, be.to(src), 0.3)
    # d + a*s in fp32, rounded once to dst's dtype (the build fuses no multiply-add)
    reference.accumulate_(dst, src, 0.3)
    bits_equal(got, dst)


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.t(),  # both transposed alike: one dense pass on CUDA
        lambda b: b[:, ::2],  # strided: staged on CUDA
        lambda b: b[1:, 3:],  # offset, non-contiguous
    ],
    ids=["transposed", "strided", "offset"],
)
def test_accumulate_and_scale_strided(be, make):
    base_d, base_s = torch.randn(64, 48), torch.randn(64, 48).bfloat16()
    dst, src = make(base_d), make(base_s)
    got = be.to(dst)
    be("accumulate_", got, be.to(src), -2.0)
    reference.accumulate_(dst, src, -2.0)
    bits_equal(got, dst)
    got = be.to(src)
    be("scale_", got, 3.0)
    reference.scale_(src, 3.0)
    bits_equal(got, src)
    # a transposed src into a contiguous dst: staged on CUDA; and a strided one into a strided
    for dst, src in (
        (torch.randn(48, 64), torch.randn(64, 48).t()),
        (torch.zeros(64, 48)[:, ::2], torch.randn(48, 64).t()[:, ::2]),
    ):
        got = be.to(dst)
        be("accumulate_", got, be.to(src), 0.5)
        reference.accumulate_(dst, src, 0.5)
        bits_equal(got, dst)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_scale(be, dtype, size):
    n = size_of(be, size)
    for t, s in (
        (rand(n, dtype), 0.125),
        (rand(n + 1, dtype)[1:], 3.0),  # misaligned: the CUDA kernel's scalar path
        (torch.randn(40, 30).to(dtype).t(), 3.0),  # non-contiguous
    ):
        got = be.to(t)
        be("scale_", got, s)
        reference.scale_(t, s)
        bits_equal(got, t)


def test_nan_inf_survive(be):
    t = be.to(torch.tensor([NAN, float("inf"), -float("inf"), 1.0]))
    flat = be("pack", [t], 2.0, torch.bfloat16).cpu()
    assert flat[0].isnan() and flat[1] == float("inf") and flat[2] == -float("inf")


# --- bad input: a clear error naming the op, the argument and what was expected ----------


@pytest.mark.parametrize(
    "name, make, pattern",
    [
        (
            "pack",
            lambda: ([torch.ones(3), torch.ones(2, dtype=torch.int64)], 1.0, None),
            r"pycomm.pack: tensors\[1\] has dtype Long, expected Float, Half or BFloat16",
        ),
        (
            "pack",
            lambda: ([torch.ones(3), torch.ones(2, dtype=torch.float16)], 1.0, None),
            r"pycomm.pack: tensors\[1\] has dtype Half, expected Float like tensors\[0\]",
        ),
        (
            "pack",
            lambda: ([torch.ones(3)], 1.0, torch.int32),
            r"pycomm.pack: dtype is Int, expected Float, Half or BFloat16",
        ),
        (
            "pack",
            lambda: ([torch.ones(3, dtype=torch.float64)], 1.0, None),
            r"pycomm.pack: tensors\[0\] has dtype Double",
        ),
        (
            "unpack_",
            lambda: (torch.ones(5), [torch.ones(2), torch.ones(2)], 1.0),
            r"pycomm.unpack_: flat has 5 elements, expected 4",
        ),
        (
            "unpack_",
            lambda: (torch.ones(2, 2), [torch.ones(4)], 1.0),
            r"pycomm.unpack_: flat has shape \[2, 2\].*expected a 1-D contiguous tensor",
        ),
        (
            "unpack_",
            lambda: (torch.ones(4, dtype=torch.int32), [torch.ones(4)], 1.0),
            r"pycomm.unpack_: flat has dtype Int",
        ),
        (
            "accumulate_",
            lambda: (torch.ones(4), torch.ones(5), 1.0),
            r"pycomm.accumulate_: src has shape \[5\], expected dst's shape \[4\]",
        ),
        (
            "accumulate_",
            lambda: (torch.ones(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float16), 1.0),
            r"pycomm.accumulate_: dst has dtype BFloat16, expected Float or src's dtype Half",
        ),
        (
            "accumulate_",
            lambda: (torch.ones(4), torch.ones(4, dtype=torch.int8), 1.0),
            r"pycomm.accumulate_: src has dtype Char",
        ),
        (
            "scale_",
            lambda: (torch.ones(4, dtype=torch.int64), 2.0),
            r"pycomm.scale_: t has dtype Long",
        ),
        (
            "unpack_",  # a target with several elements at one address
            lambda: (torch.ones(6), [torch.ones(1).expand(3, 2)], 1.0),
            "memory location",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None,
)
def test_bad_input(be, name, make, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        be(name, *be.args(make()))


def test_mismatched_devices_rejected():
    # meta stands in for a second device on a CPU-only machine: the Meta kernel runs and
    # must check what the real kernels check.
    with pytest.raises(RuntimeError, match=r"pycomm.pack: tensors\[1\] is on cpu, expected meta"):
        ops.pack([torch.ones(3, device="meta"), torch.ones(2)])
    with pytest.raises(RuntimeError, match=r"pycomm.accumulate_: src is on"):
        ops.accumulate_(torch.ones(3), torch.ones(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"pycomm.unpack_: tensors\[0\] is on"):
        ops.unpack_(torch.ones(3, device="meta"), [torch.ones(3)])


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


def test_meta_kernels_are_the_host_entries():
    # every op's Meta kernel is C++ (csrc/meta.cpp: the host entry over a launcher that runs
    # nothing), not a Python fake that would restate csrc/checks.h
    for name in pycomm_ops():
        qualname = f"pycomm::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"), name
        fake = torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel
        assert fake is None, f"{name} has a Python fake: {fake}"


def _compiled_steps(a, b, dst):
    flat = ops.pack([a, b], 0.5)
    ops.accumulate_(dst, flat, 2.0)
    ops.scale_(dst, 3.0)
    codes, scales = ops.quantize_int8(flat, None, 1.0, 1, flat.numel())
    return dst * 2, codes, scales


def test_compile_with_dynamic_shapes():
    # torch.compile traces the ops through their Meta kernels, with symbolic sizes; a bad input
    # fails while tracing with the kernels' message, the op and the argument in it
    compiled = torch.compile(_compiled_steps, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (5, 9):
        a, b = torch.randn(3, n), torch.randn(n)
        want_dst, got_dst = torch.zeros(4 * n), torch.zeros(4 * n)
        want = _compiled_steps(a, b, want_dst)
        got = compiled(a, b, got_dst)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(got_dst, want_dst)
    with pytest.raises(Exception, match=r"pycomm.accumulate_: src has shape \[.*\], expected dst"):
        compiled(torch.randn(3, 5), torch.randn(5), torch.zeros(21))


def _view(n, dtype, offset, seed, fill=None):
    """A contiguous view of ``n`` elements starting ``offset`` elements into a larger tensor
    (misaligned for 16-byte vectors unless offset is a multiple of 16 bytes), and the whole."""
    whole = rand(n + offset + 9, dtype, seed=seed, special=False)
    if fill is not None:
        whole.fill_(fill)
    return whole[offset : offset + n], whole


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_misaligned_destinations_and_sources(be, in_dtype, out_dtype):
    """Every destination offset 0-8 against source offsets 0, 1, 3: the kernels that peel a
    head to the destination's 16-byte boundary write the same bits as the reference, and
    nothing outside the views (a DDP bucket after an odd-sized parameter is misaligned)."""
    for dst_off in range(9):
        for src_off in (0, 1, 3):
            srcs = [_view(n, in_dtype, src_off, seed=n)[0] for n in (37, 1001)]
            total = sum(t.numel() for t in srcs)
            for scale in (1.0, 0.5):
                want = reference.pack(srcs, scale, out_dtype)
                flat, whole = _view(total, out_dtype, dst_off, seed=3, fill=7.0)
                got_whole = be.to(whole)
                got = got_whole[dst_off : dst_off + total]
                be("pack_into_", got, [be.to(t) for t in srcs], scale)
                flat.copy_(want)
                bits_equal(got_whole, whole)  # the view as the reference, the rest untouched
                # unpack_: a misaligned flat into misaligned tensors
                outs = [_view(t.numel(), in_dtype, dst_off, seed=4, fill=5.0) for t in srcs]
                got_outs = [be.to(w) for _, w in outs]
                views = [w[dst_off : dst_off + t.numel()] for w, t in zip(got_outs, srcs)]
                src_flat, _ = _view(total, out_dtype, src_off, seed=6)
                be("unpack_", be.to(src_flat), views, scale)
                reference.unpack_(src_flat, [v for v, _ in outs], scale)
                for g, (_, w) in zip(got_outs, outs):
                    bits_equal(g, w)
    if in_dtype == out_dtype or out_dtype == torch.float32:  # the pairs accumulate_ takes
        for dst_off in range(9):
            for src_off in (0, 1, 3):
                dst, dwhole = _view(1001, out_dtype, dst_off, seed=8)
                src, _ = _view(1001, in_dtype, src_off, seed=9)
                got_whole = be.to(dwhole)
                be("accumulate_", got_whole[dst_off : dst_off + 1001], be.to(src), 0.3)
                reference.accumulate_(dst, src, 0.3)
                bits_equal(got_whole, dwhole)
                got_whole = be.to(dwhole)
                be("scale_", got_whole[dst_off : dst_off + 1001], 0.125)
                reference.scale_(dst, 0.125)
                bits_equal(got_whole, dwhole)
