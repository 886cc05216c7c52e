"""Data and comparisons shared by the kernel tests (kernels/: test_fusion_ops, test_codec_ops,
test_cuda)."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAN = float("nan")


def bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (so -0.0 != 0.0), except that any NaN equals any NaN (payloads may differ);
    ``got`` may be on another device."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape)
    if not got.is_floating_point():
        assert torch.equal(got, want), (got != want).nonzero()[:8]
        return
    nan = got.isnan()
    assert torch.equal(nan, want.isnan()), (nan != want.isnan()).nonzero()[:8]
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    a, b = got.contiguous().view(ints)[~nan], want.contiguous().view(ints)[~nan]
    assert torch.equal(a, b), (a != b).nonzero()[:8]


def rand(n: int, dtype: torch.dtype, special: bool = True, seed: int = 0) -> torch.Tensor:
    """``n`` Gaussian values times 3; with ``special``, NaN first, Inf mid-way, -Inf last."""
    g = torch.Generator().manual_seed(seed * 7919 + n)
    t = torch.randn(n, generator=g) * 3
    if special and n >= 3:
        t[0], t[n // 2], t[-1] = NAN, float("inf"), -float("inf")
    return t.to(dtype)


def codec_input(n: int, dtype: torch.dtype, block: int, special=True, seed=0) -> torch.Tensor:
    """An encoder's x: with ``special``, NaN in block 1, Inf at the end, -Inf mid-way."""
    g = torch.Generator().manual_seed(seed * 7919 + n)
    t = torch.randn(n, generator=g) * 3
    if special and n > 2 * block:
        t[block + 1] = NAN
        t[-1] = float("inf")
        t[n // 2] = -float("inf")
    return t.to(dtype)


def residual(numel: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + numel)
    return (torch.randn(numel, generator=g) * 0.1).to(dtype)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """t's shape and dtype, every element NaN (an integer tensor: 0x55)."""
    return torch.full_like(t, NAN) if t.is_floating_point() else torch.full_like(t, 0x55)


# Sizes around a backend's own boundaries, by name: the CPU kernels step 16 fp32 lanes at a
# time (two vectors: 32) and split work in 32768-element tasks; the CUDA kernels move 8
# elements per thread, 2048 per block and copy 8192-element chunks.
_SIZES = {
    "cpu": {"step": 16, "tile": 32, "grain": 32768, "large": 100003},
    "cuda": {"step": 8, "tile": 2048, "grain": 8192, "large": 30011},
}


def size_of(be, name: str) -> int:
    """The size ``name`` ("0", "1", "large", "step-1", "tile+1", "grain-1", ...) on backend
    ``be`` (emu and cuda run the same kernels: the CUDA sizes)."""
    sizes = _SIZES["cpu" if be.name == "cpu" else "cuda"]
    if name.isdigit():
        return int(name)
    if name in sizes:
        return sizes[name]
    base, sign, delta = name.rpartition("-") if "-" in name else name.rpartition("+")
    return sizes[base] + (int(delta) if sign == "+" else -int(delta))


def bf16_residual(numel: int, seed: int = 1) -> torch.Tensor:
    """A bf16 residual from about y's rounding error down to 1e-6 of it: the new residuals need
    all of bf16's exponent range and most of them round (a truncation or an fp32 store would
    show)."""
    return (residual(numel, seed) * torch.logspace(0, -6, numel)).bfloat16()


def padded_numel(n: int, block: int, pad_blocks: int = 0) -> int:
    """n rounded up to whole blocks, plus pad_blocks more."""
    return -(-n // block) * block + pad_blocks * block


def as_tuple(out):
    """An op's outputs as a tuple (one tensor: a 1-tuple)."""
    return out if isinstance(out, tuple) else (out,)
