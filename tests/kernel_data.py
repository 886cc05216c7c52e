"""Data and comparisons shared by the kernel tests (test_ops, test_codecs, test_cuda)."""

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
