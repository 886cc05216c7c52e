"""Typed wrappers over ``torch.ops.pycomm.*`` and their fake (meta) kernels.

Importing this module loads the C++ extension ``pycomm._C``; when it is missing, or was built
against another torch than the one running, the ImportError says which and how to rebuild.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

REBUILD = "pip install --no-build-isolation -e .  (from the pycomm checkout; or `make install`)"


def _load_extension():
    try:
        from pycomm import _C
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


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return True  # cannot tell: trust the build
    return {"avx2", "fma", "f16c"} <= flags


_C = _load_extension()
WITH_CUDA: bool = bool(_C.WITH_CUDA)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_float(op: str, arg: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise RuntimeError(f"{op}: {arg} has dtype {t.dtype}, expected Float, Half or BFloat16")


def _check_list(op: str, tensors: Sequence[torch.Tensor]) -> int:
    for i, t in enumerate(tensors):
        _check_float(op, f"tensors[{i}]", t)
        if i and t.dtype != tensors[0].dtype:
            raise RuntimeError(
                f"{op}: tensors[{i}] has dtype {t.dtype}, expected {tensors[0].dtype} like "
                f"tensors[0] (one dtype per call)"
            )
        if i and t.device != tensors[0].device:
            raise RuntimeError(
                f"{op}: tensors[{i}] is on {t.device}, expected {tensors[0].device} like tensors[0]"
            )
    return sum(t.numel() for t in tensors)


# The fake kernels check what the C++ kernels check, so that meta tensors and torch.compile
# reject the same inputs with the same messages.
@torch.library.register_fake("pycomm::pack")
def _pack_fake(tensors, scale=1.0, dtype=None):
    total = _check_list("pycomm.pack", tensors)
    out = dtype or (tensors[0].dtype if tensors else torch.float32)
    if out not in _FLOATS:
        raise RuntimeError(f"pycomm.pack: dtype is {out}, expected Float, Half or BFloat16")
    return tensors[0].new_empty(total, dtype=out)


def _check_flat(op: str, flat, tensors) -> None:
    total = _check_list(op, tensors)
    _check_float(op, "flat", flat)
    if flat.dim() != 1 or flat.numel() != total:
        raise RuntimeError(
            f"{op}: flat has shape {tuple(flat.shape)}, expected ({total},) "
            f"(the total numel of tensors)"
        )
    if tensors and tensors[0].device != flat.device:
        raise RuntimeError(
            f"{op}: tensors[0] is on {tensors[0].device}, expected {flat.device} like flat"
        )


@torch.library.register_fake("pycomm::pack_into_")
def _pack_into_fake(flat, tensors, scale=1.0):
    _check_flat("pycomm.pack_into_", flat, tensors)


@torch.library.register_fake("pycomm::unpack_")
def _unpack_fake(flat, tensors, scale=1.0):
    _check_flat("pycomm.unpack_", flat, tensors)


@torch.library.register_fake("pycomm::accumulate_")
def _accumulate_fake(dst, src, alpha=1.0):
    _check_float("pycomm.accumulate_", "dst", dst)
    _check_float("pycomm.accumulate_", "src", src)
    if dst.dtype not in (torch.float32, src.dtype):
        raise RuntimeError(
            f"pycomm.accumulate_: dst has dtype {dst.dtype}, expected Float or src's dtype "
            f"{src.dtype}"
        )
    if dst.device != src.device:
        raise RuntimeError(f"pycomm.accumulate_: src is on {src.device}, expected {dst.device}")
    if dst.shape != src.shape:
        raise RuntimeError(
            f"pycomm.accumulate_: src has shape {tuple(src.shape)}, expected dst's shape "
            f"{tuple(dst.shape)}"
        )


@torch.library.register_fake("pycomm::scale_")
def _scale_fake(t, scale):
    _check_float("pycomm.scale_", "t", t)


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
