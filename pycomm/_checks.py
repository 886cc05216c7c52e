"""The ops' argument checks for their fake kernels: ``csrc/checks.h`` line for line, with the
same messages (dtypes as C++ names them, shapes as ``[2, 8]``), so that FakeTensorMode and
torch.compile refuse what the kernels refuse, in the kernels' words. Each function has the name
of its C++ twin; ``tests/test_cuda.py::test_bad_input_same_message_in_fake_mode`` runs every bad
input through both and compares the messages.

Shapes are read as Python ints: the checks need concrete sizes (fake tensors of a traced
program with dynamic shapes go through the shape-only parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CPP_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as c10 prints a ScalarType (``Float``, ``Half``, ``Char``)."""
    return _CPP_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _dims(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(v)) for v in values) + "]"


def _fail(*parts: object) -> None:
    raise RuntimeError("".join(str(p) for p in parts))


def check_float(op: str, arg: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        _fail(
            op, ": ", arg, " has dtype ", dtype_name(t.dtype), ", expected Float, Half or BFloat16"
        )


def check_same_device(op: str, arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor):
    if t.device != ref.device:
        _fail(op, ": ", arg, " is on ", t.device, ", expected ", ref.device, " like ", ref_arg)


# --- bucket fusion -------------------------------------------------------------------------


def check_list(op: str, tensors: Sequence[torch.Tensor]) -> list[int]:
    offsets = [0]
    for i, t in enumerate(tensors):
        arg = f"tensors[{i}]"
        check_float(op, arg, t)
        if i > 0:
            if t.dtype != tensors[0].dtype:
                _fail(
                    op,
                    ": ",
                    arg,
                    " has dtype ",
                    dtype_name(t.dtype),
                    ", expected ",
                    dtype_name(tensors[0].dtype),
                    " like tensors[0] (one dtype per call)",
                )
            check_same_device(op, arg, t, "tensors[0]", tensors[0])
        offsets.append(offsets[-1] + t.numel())
    return offsets


def check_flat(op: str, flat: torch.Tensor) -> None:
    check_float(op, "flat", flat)
    if not (flat.dim() == 1 and flat.is_contiguous()):
        _fail(
            op,
            ": flat has shape ",
            _dims(flat.shape),
            " and strides ",
            _dims(flat.stride()),
            ", expected a 1-D contiguous tensor",
        )


def check_flat_total(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], total: int):
    if flat.numel() != total:
        _fail(
            op,
            ": flat has ",
            flat.numel(),
            " elements, expected ",
            total,
            " (the total numel of tensors)",
        )
    if len(tensors):
        check_same_device(op, "tensors[0]", tensors[0], "flat", flat)


def check_pack_into(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[int]:
    offsets = check_list(op, tensors)
    check_flat(op, flat)
    check_flat_total(op, flat, tensors, offsets[-1])
    return offsets


def check_pack(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype]):
    """The output's dtype and numel."""
    out = dtype if dtype is not None else (tensors[0].dtype if len(tensors) else torch.float32)
    if dtype is not None and dtype not in _FLOATS:
        _fail("pycomm.pack: dtype is ", dtype_name(out), ", expected Float, Half or BFloat16")
    return out, check_list("pycomm.pack", tensors)[-1]


def check_unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[int]:
    op = "pycomm.unpack_"
    check_flat(op, flat)
    offsets = check_list(op, tensors)
    check_flat_total(op, flat, tensors, offsets[-1])
    return offsets


def check_accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    op = "pycomm.accumulate_"
    check_float(op, "dst", dst)
    check_float(op, "src", src)
    if dst.dtype not in (torch.float32, src.dtype):
        _fail(
            op,
            ": dst has dtype ",
            dtype_name(dst.dtype),
            ", expected Float or src's dtype ",
            dtype_name(src.dtype),
        )
    check_same_device(op, "src", src, "dst", dst)
    if tuple(dst.shape) != tuple(src.shape):
        _fail(op, ": src has shape ", _dims(src.shape), ", expected dst's shape ", _dims(dst.shape))


def check_scale(t: torch.Tensor) -> None:
    check_float("pycomm.scale_", "t", t)


# --- encoders ------------------------------------------------------------------------------


def check_residual(op: str, arg: str, r: torch.Tensor, x: torch.Tensor, numel: int) -> None:
    if r.dtype not in (torch.float32, torch.bfloat16):
        _fail(op, ": ", arg, " has dtype ", dtype_name(r.dtype), ", expected Float or BFloat16")
    check_same_device(op, arg, r, "x", x)
    if r.numel() != numel:
        _fail(op, ": ", arg, " has ", r.numel(), " elements, expected numel = ", numel)
    if not r.is_contiguous():
        _fail(op, ": ", arg, " has strides ", _dims(r.stride()), ", expected a contiguous tensor")


def check_encoder(op: str, x, residual, numel: int, residual_out) -> None:
    check_float(op, "x", x)
    if numel < x.numel():
        _fail(op, ": numel is ", numel, ", expected >= x.numel() = ", x.numel())
    if residual is not None:
        check_residual(op, "residual", residual, x, numel)
    if residual_out is None:
        return
    if residual is None:
        _fail(op, ": residual_out is given without residual, expected both or residual alone")
    check_residual(op, "residual_out", residual_out, x, numel)
    a, b = residual, residual_out
    if b.dtype != a.dtype:
        _fail(
            op,
            ": residual_out has dtype ",
            dtype_name(b.dtype),
            ", expected ",
            dtype_name(a.dtype),
            " like residual",
        )
    # both contiguous [numel]: they overlap when they share storage at different offsets
    # closer than numel elements
    apart = abs(a.storage_offset() - b.storage_offset())
    if numel and torch._C._is_alias_of(a, b) and 0 < apart < numel:
        _fail(op, ": residual_out overlaps residual, expected separate tensors (or the same one)")


def check_block(op: str, block: int, numel: int, multiple_of: int) -> None:
    if block < 1:
        _fail(op, ": block is ", block, ", expected >= 1")
    if block % multiple_of:
        _fail(op, ": block is ", block, ", expected a multiple of ", multiple_of)
    if numel % block:
        _fail(op, ": numel is ", numel, ", expected a multiple of block = ", block)


def check_encode16(x, residual, dtype: torch.dtype, numel: int, residual_out) -> None:
    op = "pycomm.encode16"
    check_encoder(op, x, residual, numel, residual_out)
    if dtype not in (torch.float16, torch.bfloat16):
        _fail(op, ": dtype is ", dtype_name(dtype), ", expected Half or BFloat16")


def check_quantize(op: str, x, residual, block: int, numel: int, residual_out, multiple_of: int):
    check_encoder(op, x, residual, numel, residual_out)
    check_block(op, block, numel, multiple_of)


# --- decoders ------------------------------------------------------------------------------


def check_row_layout(op: str, arg: str, t: torch.Tensor) -> None:
    rows, cols = t.shape
    if (cols > 1 and t.stride(1) != 1) or (rows > 1 and t.stride(0) < cols):
        _fail(
            op,
            ": ",
            arg,
            " has shape ",
            _dims(t.shape),
            " and strides ",
            _dims(t.stride()),
            ", expected contiguous rows (stride 1 within a row, rows apart by >= a row)",
        )


def check_rows(op: str, arg: str, t: torch.Tensor, dtype_ok: bool, dtype: str) -> None:
    if not dtype_ok:
        _fail(op, ": ", arg, " has dtype ", dtype_name(t.dtype), ", expected ", dtype)
    if t.dim() != 2:
        _fail(op, ": ", arg, " has shape ", _dims(t.shape), ", expected a 2-D [R, m] tensor")
    if t.shape[0] < 1:
        _fail(op, ": ", arg, " has shape ", _dims(t.shape), ", expected R >= 1 rows")
    check_row_layout(op, arg, t)


def check_out(op: str, out: torch.Tensor, ref_arg: str, ref: torch.Tensor, m: int) -> None:
    check_float(op, "out", out)
    check_same_device(op, "out", out, ref_arg, ref)
    if out.numel() > m:
        _fail(op, ": out has ", out.numel(), " elements, expected <= m = ", m)
    if not out.is_contiguous():
        _fail(op, ": out has strides ", _dims(out.stride()), ", expected a contiguous tensor")


def check_scales(
    op: str, scales, want: torch.dtype, ref_arg: str, ref, rows: int, m: int, block: int
) -> None:
    if scales.dtype != want:
        _fail(op, ": scales has dtype ", dtype_name(scales.dtype), ", expected ", dtype_name(want))
    check_same_device(op, "scales", scales, ref_arg, ref)
    if scales.dim() != 2 or tuple(scales.shape) != (rows, m // block):
        _fail(
            op,
            ": scales has shape ",
            _dims(scales.shape),
            ", expected [",
            rows,
            ", ",
            m // block,
            "] ([R, m / block])",
        )
    check_row_layout(op, "scales", scales)


def check_decode16_sum(chunks: torch.Tensor, out: torch.Tensor) -> None:
    op = "pycomm.decode16_sum"
    ok = chunks.dtype in (torch.float16, torch.bfloat16)
    check_rows(op, "chunks", chunks, ok, "Half or BFloat16")
    check_out(op, out, "chunks", chunks, chunks.shape[1])


def check_dequantize_int8_sum(codes, scales, block: int, out) -> None:
    op = "pycomm.dequantize_int8_sum"
    check_rows(op, "codes", codes, codes.dtype == torch.int8, "Char (int8)")
    rows, m = codes.shape
    if block < 1:
        _fail(op, ": block is ", block, ", expected >= 1")
    if m % block:
        _fail(op, ": codes has m = ", m, " columns, expected a multiple of block = ", block)
    check_scales(op, scales, torch.float32, "codes", codes, rows, m, block)
    check_out(op, out, "codes", codes, m)


def check_dequantize_onebit_sum(bits, scales, block: int, out) -> None:
    op = "pycomm.dequantize_onebit_sum"
    check_rows(op, "bits", bits, bits.dtype == torch.uint8, "Byte (uint8)")
    rows, m = bits.shape[0], bits.shape[1] * 8
    if block < 1:
        _fail(op, ": block is ", block, ", expected >= 1")
    if block % 8:
        _fail(op, ": block is ", block, ", expected a multiple of 8")
    if m % block:
        _fail(
            op,
            ": bits has m = ",
            m,
            " elements (8 per column), expected a multiple of block = ",
            block,
        )
    check_scales(op, scales, torch.bfloat16, "bits", bits, rows, m, block)
    check_out(op, out, "bits", bits, m)
