"""The int4 and fp8 codecs (their fused ops, through the codec protocol) against their
references in pycomm.reference, their bytes against int8, and the option checks of every
built-in codec and codec hook. Their hooks on gloo ranks: hooks/test_compression.py."""

import pytest
import torch

import pycomm
from pycomm import reference
from pycomm.hooks import Fp8Codec, Int4Codec, Int8Codec, check_codec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODECS = [
    ("int4-b64", lambda: Int4Codec(64)),
    ("int4-b32-bf16", lambda: Int4Codec(32, torch.bfloat16)),
    ("int4-b128", lambda: Int4Codec()),
    ("fp8-b64", lambda: Fp8Codec(64)),
    ("fp8-b128", lambda: Fp8Codec(128)),
]
IDS = [c[0] for c in CODECS]


def _ref_encode(codec, x, residual, scale, numel, residual_out=None):
    if isinstance(codec, Int4Codec):
        return reference.quantize_int4(
            x, residual, scale, codec.block, numel, residual_out, codec.scale_dtype
        )
    return reference.quantize_fp8(x, residual, scale, codec.block, numel, residual_out)


def _ref_decode(codec, codes, scales, scale, out):
    fn = reference.dequantize_int4_sum if isinstance(codec, Int4Codec) else None
    fn = fn or reference.dequantize_fp8_sum
    return fn(codes, scales, codec.block, scale, out)


def _same(a, b):
    """Bitwise equal, NaN where NaN (codes compared as bytes)."""
    if a.dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _sizes(block):
    return [0, 1, block - 1, block, block + 1, 3 * block + 5, 40 * block + 7]


@pytest.mark.parametrize("make", [c[1] for c in CODECS], ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rdtype", [None, torch.float32, torch.bfloat16])
def test_encode_matches_the_reference(make, dtype, rdtype):
    codec = make()
    g = torch.Generator().manual_seed(1)
    for n in _sizes(codec.block):
        numel = -(-n // codec.block) * codec.block
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        r = None if rdtype is None else (torch.randn(numel, generator=g) * 0.1).to(rdtype)
        r_ref = None if r is None else r.clone()
        r_old = None if r is None else r.float().clone()
        codes, scales = codec.encode(x, r, 0.25, numel)
        want_codes, want_scales = _ref_encode(codec, x, r_ref, 0.25, numel)
        assert codes.dtype == codec.code_dtype and scales.dtype == codec.scale_dtype
        assert codes.numel() * codes.element_size() == codec.code_bytes(numel)
        assert scales.numel() * scales.element_size() == codec.scale_bytes(numel)
        assert _same(codes, want_codes) and _same(scales, want_scales), n
        if r is not None:
            assert _same(r, r_ref), n
            if rdtype == torch.float32:  # the new residual is what decoding lost
                out = torch.empty(numel)
                codec.decode_sum(codes[None], scales[None], 1.0, out)
                y = torch.zeros(numel)
                y[:n] = x.float() * 0.25
                assert torch.allclose(out + r, y + r_old, atol=1e-6)


@pytest.mark.parametrize("make", [c[1] for c in CODECS], ids=IDS)
def test_residual_out_leaves_the_residual_and_matches_in_place(make):
    codec = make()
    numel = 5 * codec.block
    x, r = torch.randn(numel - 3), torch.randn(numel) * 0.1
    before, out = r.clone(), torch.full((numel,), float("nan"))
    a = codec.encode(x, r, 0.5, numel, out)
    assert torch.equal(r, before) and out.isfinite().all()
    b = codec.encode(x, r, 0.5, numel)
    assert torch.equal(r, out) and all(_same(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("make", [c[1] for c in CODECS], ids=IDS)
def test_non_contiguous_input(make):
    codec = make()
    numel = 4 * codec.block
    base = torch.randn(2 * numel)
    x = base[::2]
    assert not x.is_contiguous()
    r1, r2 = torch.zeros(numel), torch.zeros(numel)
    got, want = codec.encode(x, r1, 1.0, numel), codec.encode(x.contiguous(), r2, 1.0, numel)
    assert all(_same(u, v) for u, v in zip(got, want)) and torch.equal(r1, r2)


@pytest.mark.parametrize("make", [c[1] for c in CODECS], ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_decodes_non_finite_and_keeps_the_residual(make, bad):
    codec = make()
    b = codec.block
    numel = 4 * b
    x = torch.randn(numel)
    x[b + 3] = bad  # block 1
    r = torch.randn(numel) * 0.01
    old = r.clone()
    codes, scales = codec.encode(x, r, 1.0, numel)
    assert torch.equal(r[b : 2 * b], old[b : 2 * b])  # the non-finite block kept its residual
    assert not torch.equal(r[:b], old[:b])  # the others were updated
    out = torch.empty(numel)
    stats = codec.decode_sum(codes[None], scales[None], 1.0, out)
    assert (~out[b : 2 * b].isfinite()).all() and out[:b].isfinite().all()
    assert out[2 * b :].isfinite().all()
    assert stats[1].item() == b
    ref = torch.empty(numel)
    assert torch.allclose(stats, _ref_decode(codec, codes[None], scales[None], 1.0, ref))


@pytest.mark.parametrize("make", [c[1] for c in CODECS], ids=IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_decode_sum_matches_the_reference_on_packed_rows(make, rows, out_dtype):
    codec = make()
    m = 6 * codec.block
    g = torch.Generator().manual_seed(rows)
    packed = torch.empty(rows, codec.code_bytes(m) + codec.scale_bytes(m), dtype=torch.uint8)
    for r in range(rows):
        codes, scales = codec.encode(torch.randn(m, generator=g), None, 1.0, m)
        codec.pack(codes, scales, 1, out=packed[r : r + 1])
    codes, scales = codec.split(packed, m)  # strided row slices of the packed buffer
    for length in (0, 1, m - codec.block - 1, m):
        out, want = torch.empty(length, dtype=out_dtype), torch.empty(length, dtype=out_dtype)
        stats = codec.decode_sum(codes, scales, 0.5, out)
        ref = _ref_decode(codec, codes, scales, 0.5, want)
        assert torch.equal(out, want), length
        assert stats.dtype == torch.float64 and torch.allclose(stats, ref, rtol=1e-6)


def test_int4_nibbles_rounding_and_clamp():
    # block of 8 with absmax 7: s = 1, codes are y rounded half to even
    y = torch.tensor([7.0, -7.0, 0.5, 1.5, 2.5, -2.5, -0.4, 3.0])
    codes, scales = Int4Codec(8).encode(y, None, 1.0, 8)
    assert scales.tolist() == [1.0]
    q = [7, -7, 0, 2, 2, -2, 0, 3]
    nib = [v & 15 for v in q]
    assert codes.tolist() == [nib[2 * k] | (nib[2 * k + 1] << 4) for k in range(4)]
    out = torch.empty(8)
    Int4Codec(8).decode_sum(codes[None], scales[None], 1.0, out)
    assert out.tolist() == [float(v) for v in q]


def test_fp8_codes_are_torchs_cast():
    y = torch.tensor([448.0, -224.0, 1.0, 0.3, -17.0, 0.0, 100.0, 3.0])  # absmax 448: s = 1
    codes, scales = Fp8Codec(8).encode(y, None, 1.0, 8)
    assert scales.tolist() == [1.0]
    assert torch.equal(codes.view(torch.uint8), y.to(torch.float8_e4m3fn).view(torch.uint8))


def test_zero_and_tiny_blocks_keep_everything_in_the_residual():
    for codec in (Int4Codec(8), Fp8Codec(8)):
        y = torch.cat([torch.zeros(8), torch.full((8,), 1e-44)])
        r = torch.zeros(16)
        codes, scales = codec.encode(y, r, 1.0, 16)
        out = torch.empty(16)
        stats = codec.decode_sum(codes[None], scales[None], 1.0, out)
        assert out.isfinite().all() and stats[1].item() == 0
        assert torch.equal(out + r, y)


@pytest.mark.parametrize("make", [c[1] for c in CODECS], ids=IDS)
def test_the_codecs_pass_the_self_check(make):
    check_codec(make())


def test_bytes_against_int8():
    m = 64 * 1024
    int8 = Int8Codec(64)
    int8_bytes = int8.code_bytes(m) + int8.scale_bytes(m)
    for codec, most in ((Int4Codec(), 0.55), (Fp8Codec(), 1.0)):
        assert (codec.code_bytes(m) + codec.scale_bytes(m)) / int8_bytes <= most


def test_dtype_options_take_the_torch_dtype_or_its_name():
    by_name = pycomm.hooks.hook_spec("int4").state(
        None, scale_dtype="bfloat16", residual_dtype="bfloat16"
    )
    by_dtype = pycomm.hooks.hook_spec("int4").state(
        None, scale_dtype=torch.bfloat16, residual_dtype=torch.bfloat16
    )
    assert (
        by_dtype.codec.scale_dtype == torch.bfloat16 and by_dtype.residual_dtype == torch.bfloat16
    )
    # the same options, so ranks that spell them differently still agree
    assert by_dtype.options() == by_name.options()
    assert by_dtype.options()["scale_dtype"] == "bfloat16"
    assert pycomm.hooks.hook_spec("int4").state(None).options()["scale_dtype"] == "float32"


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: Int4Codec(block=3), r"Int4Codec: block=3, expected an even number \(2 a byte\)"),
        (lambda: Int4Codec(block=0), r"Int4Codec: block=0, expected"),
        (lambda: Int4Codec(scale_dtype=torch.float16), r"scale_dtype=torch.float16, expected"),
        (lambda: Fp8Codec(block=True), r"Fp8Codec: block=True, expected an int >= 1"),
        # every built-in codec checks its own block, as its hook does
        (lambda: pycomm.hooks.Int8Codec(block=0), r"Int8Codec: block=0, expected an int >= 1"),
        (
            lambda: pycomm.hooks.OneBitCodec(block=12),
            r"OneBitCodec: block=12, expected a multiple of 8 \(8 bits a byte\)",
        ),
        (lambda: Fp8Codec(block=1 << 17), r"Fp8Codec: block=131072, expected an int from 1"),
        (
            lambda: pycomm.hooks.hook_spec("int4").state(None, block=33),
            r"pycomm int4 hook.*block=33, expected an even number",
        ),
        (
            lambda: pycomm.hooks.hook_spec("int4").state(None, scale_dtype="float16"),
            r"pycomm int4 hook.*scale_dtype='float16', expected 'float32' or 'bfloat16' \(or",
        ),
        (
            lambda: pycomm.hooks.hook_spec("int4").state(None, scale_dtype=torch.float16),
            r"pycomm int4 hook.*scale_dtype=torch.float16, expected 'float32' or 'bfloat16'",
        ),
        (lambda: pycomm.hooks.hook_spec("fp8").state(None, block=0), r"pycomm fp8 hook.*block"),
        # a bucket is padded to whole blocks: a huge block would allocate gigabytes
        *(
            (
                lambda state=state: state(None, block=10**9),
                rf"pycomm {name} hook: .*block=1000000000, expected an int from \d+ to 65536",
            )
            for name, state in (
                ("int8", pycomm.hooks.hook_spec("int8").state),
                ("fp8", pycomm.hooks.hook_spec("fp8").state),
                ("int4", pycomm.hooks.hook_spec("int4").state),
                ("onebit", pycomm.hooks.hook_spec("onebit").state),
            )
        ),
    ],
)
def test_bad_input_names_argument_value_and_expectation(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_int4_kernel_refuses_a_short_numel():
    # the fused kernel's own check (the same from its Meta kernel: tests/kernels/test_codec_ops.py)
    with pytest.raises(RuntimeError, match=r"quantize_int4: numel is 64, expected >= x.numel"):
        Int4Codec().encode(torch.ones(65), None, 1.0, 64)
