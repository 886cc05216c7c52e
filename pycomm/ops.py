"""Typed wrappers over ``torch.ops.pycomm.*``.

Importing this module loads the C++ extension ``pycomm._C``; when it is missing, or was built
against another torch than the one running, the ImportError says which and how to rebuild.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Optional

import torch

REBUILD = "pip install --no-build-isolation -e .  (from the pycomm checkout; or `make install`)"


def _load_extension():
    _refuse_private_runtime()
    try:  # by its full name: the extension, not the package's __init__
        _C = importlib.import_module("pycomm._C")
    except ModuleNotFoundError as e:
        if e.name != "pycomm._C":
            raise
        raise ImportError(
            f"pycomm's C++ extension pycomm._C is missing (not built, or built for another "
            f"Python). Build it with: {REBUILD}"
        ) from e
    except ImportError as e:
        raise ImportError(
            f"pycomm's C++ extension pycomm._C failed to load, most likely because it was built "
            f"against another torch than the installed torch {torch.__version__} ({e}). "
            f"Rebuild it with: {REBUILD}"
        ) from e
    built = getattr(_C, "TORCH_VERSION", None)
    if built != torch.__version__:
        raise ImportError(
            f"pycomm's C++ extension pycomm._C was built against torch {built}, but torch "
            f"{torch.__version__} is installed. Rebuild it with: {REBUILD}"
        )
    if _C.CPU_CAPABILITY == "AVX2" and not _cpu_has_avx2():
        raise ImportError(
            "pycomm._C was built for AVX2+FMA+F16C CPUs and this CPU lacks them. Rebuild it for "
            f"this machine with: PYCOMM_CPU=default {REBUILD}"
        )
    return _C


def _refuse_private_runtime() -> None:
    # Checked before loading: such a build segfaults on its first formatted error message.
    import importlib.util

    from pycomm import _buildcheck

    try:
        spec = importlib.util.find_spec("pycomm._C")
    except (ImportError, ValueError):
        return  # not loadable at all: the import below says why
    path = getattr(spec, "origin", None) if spec is not None else None
    if path and os.path.isfile(path):
        problems = _buildcheck.check(path)
        if problems:
            raise ImportError(f"{_buildcheck.message(path, problems)} Then: {REBUILD}")


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return True  # cannot tell: trust the build
    return {"avx2", "fma", "f16c"} <= flags


_C = _load_extension()
WITH_CUDA: bool = bool(_C.WITH_CUDA)


# No Python fakes: each op's Meta kernel (csrc/meta.cpp) is its host entry, the CPU and CUDA
# kernels' own argument checks and output allocation, which meta tensors, FakeTensorMode and
# torch.compile run.


def pack(
    tensors: Sequence[torch.Tensor], scale: float = 1.0, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Copy ``tensors`` (any shapes and strides, one float dtype) into one flat buffer, times
    ``scale``, in one pass; ``dtype`` converts on the way (default: the tensors' dtype).

    Example:
        >>> flat = pycomm.ops.pack([p.grad for p in model.parameters()], 1 / world_size)
    """
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32)
    return torch.ops.pycomm.pack(tensors, float(scale), dtype)


def pack_into_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """:func:`pack` into an existing 1-D buffer (reused across steps, never reallocated).

    Example:
        >>> pycomm.ops.pack_into_(buffer, [p.grad for p in model.parameters()], 0.5)
    """
    torch.ops.pycomm.pack_into_(flat, list(tensors), float(scale))


def unpack_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Write ``flat * scale`` back into ``tensors`` in place: the inverse of :func:`pack`.

    Example:
        >>> pycomm.ops.unpack_(flat, [p.grad for p in model.parameters()])
    """
    torch.ops.pycomm.unpack_(flat, list(tensors), float(scale))


def accumulate_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> None:
    """``dst += alpha * src`` in fp32; ``dst`` is fp32 or ``src``'s dtype.

    Example:
        >>> pycomm.ops.accumulate_(fp32_buffer, bf16_grad, 1 / accumulate_steps)
    """
    torch.ops.pycomm.accumulate_(dst, src, float(alpha))


def scale_(t: torch.Tensor, scale: float) -> None:
    """``t *= scale`` in place, computed in fp32.

    Example:
        >>> pycomm.ops.scale_(bucket, 1 / world_size)
    """
    torch.ops.pycomm.scale_(t, float(scale))


def encode16(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    scale: float,
    dtype: torch.dtype,
    numel: int,
    residual_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Round ``y = x * scale + residual`` (x padded with zeros to ``numel``) to ``dtype``
    (fp16 or bf16) in one pass; ``residual`` (fp32, ``numel``, optional) becomes the rounding
    error, except where the result is not finite. With ``residual_out`` the new residual is
    written there and ``residual`` is only read (the encoders all take it).

    Example:
        >>> payload = pycomm.ops.encode16(bucket, residual, 1 / world_size, torch.bfloat16, n)
    """
    return torch.ops.pycomm.encode16(x, residual, float(scale), dtype, int(numel), residual_out)


def quantize_int8(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    scale: float,
    block: int,
    numel: int,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``y = x * scale + residual`` per block of ``block`` elements,
    with error feedback, in one pass. Returns ``(codes int8 [numel], scales fp32
    [numel / block])``; a block holding NaN or Inf gets scale NaN and codes 0.

    Example:
        >>> codes, scales = pycomm.ops.quantize_int8(bucket, residual, 1.0, 64, n)
    """
    return torch.ops.pycomm.quantize_int8(
        x, residual, float(scale), int(block), int(numel), residual_out
    )


def quantize_int4(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    scale: float,
    block: int,
    numel: int,
    residual_out: Optional[torch.Tensor] = None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed int4 codes of ``y = x * scale + residual`` (two a byte, element ``2k`` in the
    low nibble of byte ``k``) per block of ``block`` (even) elements, with error feedback, in
    one pass: ``s = absmax / 7`` stored as ``scale_dtype`` (fp32 or bf16), ``q =
    round_half_even(y / s)`` in [-7, 7]. Returns ``(codes uint8 [numel / 2], scales
    scale_dtype [numel / block])``; a block holding NaN or Inf gets scale NaN and codes 0.

    Example:
        >>> codes, scales = pycomm.ops.quantize_int4(bucket, residual, 1.0, 64, n)
    """
    return torch.ops.pycomm.quantize_int4(
        x, residual, float(scale), int(block), int(numel), residual_out, scale_dtype
    )


def quantize_fp8(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    scale: float,
    block: int,
    numel: int,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 codes of ``y = x * scale + residual`` per block of ``block`` elements, with
    error feedback, in one pass: ``s = absmax / 448`` (fp32), ``code = e4m3(y / s)`` rounded
    to nearest even as torch's cast rounds. Returns ``(codes float8_e4m3fn [numel], scales
    fp32 [numel / block])``; a block holding NaN or Inf gets scale NaN and codes 0.

    Example:
        >>> codes, scales = pycomm.ops.quantize_fp8(bucket, residual, 1.0, 64, n)
    """
    return torch.ops.pycomm.quantize_fp8(
        x, residual, float(scale), int(block), int(numel), residual_out
    )


def quantize_onebit(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    scale: float,
    block: int,
    numel: int,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits of ``y = x * scale + residual`` (8 per byte) and one bf16 scale per block
    (the block's mean ``|y|``), with error feedback, in one pass. Returns ``(bits uint8
    [numel / 8], scales bf16 [numel / block])``; ``block`` is a multiple of 8.

    Example:
        >>> bits, scales = pycomm.ops.quantize_onebit(bucket, residual, 1.0, 64, n)
    """
    return torch.ops.pycomm.quantize_onebit(
        x, residual, float(scale), int(block), int(numel), residual_out
    )


def decode16_sum(chunks: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``out = scale * chunks.sum(0)`` over the rows of ``chunks`` ([R, m] fp16/bf16), for the
    first ``out.numel()`` columns. Returns fp64 ``[squared norm, non-finite count]``; the sum's
    order and the statistics: docs/custom_hooks.md, "The decode contract".

    Example:
        >>> stats = pycomm.ops.decode16_sum(received.view(world_size, -1), 1.0, bucket_chunk)
    """
    return torch.ops.pycomm.decode16_sum(chunks, float(scale), out)


def dequantize_int8_sum(
    codes: torch.Tensor, scales: torch.Tensor, block: int, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """``out = scale * sum_r codes[r] * scales[r]`` (per block) over the rows of ``codes``
    ([R, m] int8; ``scales`` [R, m / block] fp32). Returns fp64 ``[squared norm, non-finite
    count]``; the sum's order and the statistics: docs/custom_hooks.md, "The decode contract".

    Example:
        >>> stats = pycomm.ops.dequantize_int8_sum(codes, scales, 64, 1 / world_size, chunk)
    """
    return torch.ops.pycomm.dequantize_int8_sum(codes, scales, int(block), float(scale), out)


def dequantize_int4_sum(
    codes: torch.Tensor, scales: torch.Tensor, block: int, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """``out = scale * sum_r q[r] * scales[r]`` (per block) over the rows of ``codes`` ([R,
    m / 2] uint8, two int4 codes a byte; ``scales`` [R, m / block] fp32 or bf16). Returns fp64
    ``[squared norm, non-finite count]``; the sum's order and the statistics:
    docs/custom_hooks.md, "The decode contract".

    Example:
        >>> stats = pycomm.ops.dequantize_int4_sum(codes, scales, 64, 1 / world_size, chunk)
    """
    return torch.ops.pycomm.dequantize_int4_sum(codes, scales, int(block), float(scale), out)


def dequantize_fp8_sum(
    codes: torch.Tensor, scales: torch.Tensor, block: int, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """``out = scale * sum_r codes[r] * scales[r]`` (per block) over the rows of ``codes``
    ([R, m] float8_e4m3fn; ``scales`` [R, m / block] fp32). Returns fp64 ``[squared norm,
    non-finite count]``; the sum's order and the statistics: docs/custom_hooks.md, "The decode
    contract".

    Example:
        >>> stats = pycomm.ops.dequantize_fp8_sum(codes, scales, 64, 1 / world_size, chunk)
    """
    return torch.ops.pycomm.dequantize_fp8_sum(codes, scales, int(block), float(scale), out)


def dequantize_onebit_sum(
    bits: torch.Tensor, scales: torch.Tensor, block: int, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """``out = scale * sum_r (+scales[r] where the bit is set, else -scales[r])`` over the rows
    of ``bits`` ([R, m / 8] uint8; ``scales`` [R, m / block] bf16). Returns fp64 ``[squared
    norm, non-finite count]``; the sum's order and the statistics: docs/custom_hooks.md, "The
    decode contract".

    Example:
        >>> stats = pycomm.ops.dequantize_onebit_sum(bits, scales, 64, 1 / world_size, chunk)
    """
    return torch.ops.pycomm.dequantize_onebit_sum(bits, scales, int(block), float(scale), out)
