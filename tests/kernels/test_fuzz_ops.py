"""Every pycomm op, fuzzed with hypothesis: empty and zero-size inputs, non-contiguous and
expanded (stride 0) tensors, wrong dtypes, a wrong device (meta tensors stand in for another
device on a CPU-only machine), mismatched sizes, odd blocks, NaN/Inf scales. Each call must
return or raise a Python exception; it must never crash the process.

Set PYCOMM_FUZZ_LOG=FILE to append each call to FILE before it runs: after a crash (segfault,
abort), its last line is the reproducer.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pycomm  # noqa: F401 - loads the ops

OPS = torch.ops.pycomm
# What a bad input may raise: the dispatcher's and TORCH_CHECK's Python exceptions.
ALLOWED = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError, OverflowError)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.bool,
    torch.complex64,
]
SCALES = [1.0, 0.5, -3.0, 0.0, 1e-30, 1e30, math.inf, -math.inf, math.nan]
# valid blocks (multiples of 8 fit every codec) drawn more often than invalid ones
BLOCKS = [8, 16, 64, 256, 8, 64, -8, -1, 0, 1, 3]

FUZZ = settings(
    max_examples=int(os.environ.get("PYCOMM_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def _describe(t):
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return (
        f"T({tuple(t.shape)}, stride={t.stride()}, {str(t.dtype)[6:]}, {t.device.type}"
        f"{', expanded' if 0 in t.stride() and t.numel() > 1 else ''})"
    )


def _log(name, args):
    path = os.environ.get("PYCOMM_FUZZ_LOG")
    if not path:
        return
    text = ", ".join(
        "[" + ", ".join(_describe(x) for x in a) + "]" if isinstance(a, list) else _describe(a)
        for a in args
    )
    with open(path, "a") as f:
        f.write(f"{name}({text})\n")
        f.flush()
        os.fsync(f.fileno())


def _call(name, *args):
    """Call the op; return its result, or the allowed exception it raised."""
    _log(name, args)
    try:
        return getattr(OPS, name)(*args)
    except ALLOWED as exc:
        return exc


@st.composite
def tensors(draw, shape=None, dtype=None, bad=0.3):
    """A tensor of ``shape`` and ``dtype`` (drawn when None); with probability ``bad`` one
    thing about it is wrong: dtype, device, contiguity (or stride 0), or size."""
    if shape is None:
        shape = draw(st.sampled_from([(), (0,), (1,), (7,), (64,), (257,), (3, 5), (0, 4)]))
    if dtype is None:
        dtype = draw(st.sampled_from(DTYPES[:3]))
    shape = tuple(max(0, s) for s in shape)
    device, layout = "cpu", "contiguous"
    if draw(st.floats(0, 1)) < bad:
        what = draw(st.sampled_from(["dtype", "device", "layout", "size"]))
        if what == "dtype":
            dtype = draw(st.sampled_from(DTYPES))
        elif what == "device":
            device = "meta"
        elif what == "layout":
            layout = draw(st.sampled_from(["strided", "transposed", "expanded"]))
        else:
            shape = draw(
                st.sampled_from([(0,), (1,), (3,), shape + (2,), (max(0, 1 + sum(shape)),)])
            )
    full = shape
    if layout == "strided":
        full = shape[:-1] + (2 * shape[-1],) if shape else (2,)
    elif layout == "transposed" and len(shape) >= 2:
        full = shape[::-1]
    if device == "meta":
        t = torch.empty(full, dtype=dtype, device="meta")
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(full, dtype=torch.float32).to(dtype)
        if t.numel() and draw(st.booleans()):
            t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(
                st.sampled_from([math.nan, math.inf, -math.inf])
            )
    elif dtype == torch.bool:
        t = torch.randint(0, 2, full).bool()
    else:
        lo, hi = (-128, 128) if dtype == torch.int8 else (0, 100)
        t = torch.randint(lo, hi, full, dtype=dtype)
    if layout == "strided":
        t = t[..., ::2] if shape else t[:1].reshape(())
    elif layout == "transposed" and len(shape) >= 2:
        t = t.transpose(-1, -2)
    elif layout == "expanded":
        t = t.reshape(-1)[:1].expand(max(1, math.prod(shape))) if t.numel() else t
    return t


def _out_dtype(draw):
    return draw(st.sampled_from([None, torch.float32, torch.float16, torch.bfloat16, torch.int8]))


# ------------------------------------------------------------------------ fusion ops


@FUZZ
@given(st.data())
def test_fuzz_pack(data):
    ts = data.draw(st.lists(tensors(), max_size=4))
    result = _call("pack", ts, data.draw(st.sampled_from(SCALES)), _out_dtype(data.draw))
    if isinstance(result, torch.Tensor):
        assert result.dim() == 1 and result.numel() == sum(t.numel() for t in ts)


@pytest.mark.parametrize("op", ["pack_into_", "unpack_"])
@FUZZ
@given(st.data())
def test_fuzz_pack_into_and_unpack(op, data):
    dtype = data.draw(st.sampled_from(DTYPES[:3]))
    ts = data.draw(st.lists(tensors(dtype=dtype), max_size=4))
    total = sum(t.numel() for t in ts)
    flat = data.draw(tensors(shape=(total,), dtype=data.draw(st.sampled_from(DTYPES[:3]))))
    _call(op, flat, ts, data.draw(st.sampled_from(SCALES)))


@FUZZ
@given(st.data())
def test_fuzz_accumulate(data):
    dst = data.draw(tensors())
    src = data.draw(tensors(shape=tuple(dst.shape), dtype=data.draw(st.sampled_from(DTYPES[:3]))))
    _call("accumulate_", dst, src, data.draw(st.sampled_from(SCALES)))


@FUZZ
@given(st.data())
def test_fuzz_scale(data):
    _call("scale_", data.draw(tensors(bad=0.5)), data.draw(st.sampled_from(SCALES)))


# ---------------------------------------------------------------------------- encoders


def _has_residual_out(name):
    return any(a.name == "residual_out" for a in getattr(OPS, name).default._schema.arguments)


@pytest.mark.parametrize(
    "op", ["encode16", "quantize_int8", "quantize_int4", "quantize_fp8", "quantize_onebit"]
)
@FUZZ
@given(st.data())
def test_fuzz_encoders(op, data):
    x = data.draw(tensors())
    n = x.numel()
    block = 1 if op == "encode16" else data.draw(st.sampled_from(BLOCKS))
    good = max(1, block)
    padded = -(-n // good) * good if op != "quantize_onebit" or block % 8 == 0 else n
    numel = data.draw(st.sampled_from([padded] * 3 + [padded + good, n, n - 1, n + 1, 0, -8]))
    residual = data.draw(
        st.none() | tensors(shape=(max(numel, 0),), dtype=torch.float32), label="residual"
    )
    args = [x, residual, data.draw(st.sampled_from(SCALES))]
    if op == "encode16":
        args += [data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])), numel]
    else:
        args += [block, numel]
    if _has_residual_out(op) and data.draw(st.booleans()):
        args.append(data.draw(tensors(shape=(max(numel, 0),), dtype=torch.float32)))
        if residual is not None and data.draw(st.booleans()):
            args[-1] = residual  # the same tensor for residual and residual_out: overlapping
    if op == "quantize_int4":
        if len(args) == 5:
            args.append(None)
        args.append(data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    result = _call(op, *args)
    if isinstance(result, (torch.Tensor, tuple)) and x.device.type == "cpu":
        codes = result if isinstance(result, torch.Tensor) else result[0]
        per_byte = {"quantize_onebit": 8, "quantize_int4": 2}.get(op, 1)
        assert codes.numel() == numel // per_byte


# ---------------------------------------------------------------------------- decoders


@pytest.mark.parametrize(
    "op",
    [
        "decode16_sum",
        "dequantize_int8_sum",
        "dequantize_int4_sum",
        "dequantize_fp8_sum",
        "dequantize_onebit_sum",
    ],
)
@FUZZ
@given(st.data())
def test_fuzz_decoders(op, data):
    rows = data.draw(st.sampled_from([0, 1, 2, 3]))
    block = 1 if op == "decode16_sum" else data.draw(st.sampled_from(BLOCKS))
    good = max(8, block) if op == "dequantize_onebit_sum" else max(1, block)
    m = data.draw(st.sampled_from([0, good, 2 * good, 3 * good + 1, 64]))
    out = data.draw(
        tensors(
            shape=(data.draw(st.sampled_from([m, max(m - 1, 0), m + 1, 0])),),
            dtype=data.draw(st.sampled_from(DTYPES[:3])),
        )
    )
    scale = data.draw(st.sampled_from(SCALES))
    if op == "decode16_sum":
        chunks = data.draw(tensors(shape=(rows, m), dtype=torch.bfloat16))
        _call(op, chunks, scale, out)
        return
    if op == "dequantize_int8_sum":
        codes = data.draw(tensors(shape=(rows, m), dtype=torch.int8))
        scales = data.draw(tensors(shape=(rows, m // good), dtype=torch.float32))
    elif op == "dequantize_fp8_sum":
        codes = data.draw(tensors(shape=(rows, m), dtype=torch.uint8))
        codes = codes.view(torch.float8_e4m3fn) if data.draw(st.booleans()) else codes
        scales = data.draw(tensors(shape=(rows, m // good), dtype=torch.float32))
    elif op == "dequantize_int4_sum":
        codes = data.draw(tensors(shape=(rows, m // 2), dtype=torch.uint8))
        sdtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
        scales = data.draw(tensors(shape=(rows, m // good), dtype=sdtype))
    else:
        codes = data.draw(tensors(shape=(rows, m // 8), dtype=torch.uint8))
        scales = data.draw(tensors(shape=(rows, m // good), dtype=torch.bfloat16))
    _call(op, codes, scales, block, scale, out)


# ------------------------------------------------------------- the Python wrappers too


@FUZZ
@given(st.data())
def test_fuzz_python_wrappers(data):
    x = data.draw(tensors())
    block = data.draw(st.sampled_from(BLOCKS))
    numel = data.draw(st.sampled_from([x.numel(), -(-x.numel() // 8) * 8, -1]))
    calls = [
        lambda: pycomm.ops.pack([x], 0.5),
        lambda: pycomm.ops.scale_(x, 2.0),
        lambda: pycomm.ops.quantize_int8(x, None, 1.0, block, numel),
        lambda: pycomm.ops.quantize_onebit(x, None, 1.0, block, numel),
        lambda: pycomm.ops.quantize_int4(x, None, 1.0, block, numel, None, torch.bfloat16),
        lambda: pycomm.ops.quantize_fp8(x, None, 1.0, block, numel),
        lambda: pycomm.ops.encode16(x, None, 1.0, torch.bfloat16, numel),
    ]
    for call in calls:
        _log("wrapper", [x, block, numel])
        try:
            call()
        except ALLOWED:
            pass
