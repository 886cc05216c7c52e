"""Pure-PyTorch reference of every pycomm op: the oracle the kernels are tested against.

Each reference computes in fp32 and rounds once to the output dtype, as the kernels do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def pack(
    tensors: Sequence[torch.Tensor], scale: float = 1.0, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    out = dtype or (tensors[0].dtype if tensors else torch.float32)
    if not tensors:
        return torch.empty(0, dtype=out)
    return torch.cat([(t.reshape(-1).float() * scale).to(out) for t in tensors])


def pack_into_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    flat.copy_(pack(tensors, scale, flat.dtype))


def unpack_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_((flat[offset : offset + n].float() * scale).to(t.dtype).view(t.shape))
        offset += n


def accumulate_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> None:
    dst.copy_((dst.float() + src.float() * alpha).to(dst.dtype))


def scale_(t: torch.Tensor, scale: float) -> None:
    t.copy_((t.float() * scale).to(t.dtype))


# --- compression codecs -------------------------------------------------------------------
#
# Every encoder reads x (any float dtype, n elements), pre-scales it, adds the error-feedback
# residual when one is given, and encodes ``numel`` >= n elements (x padded with zeros). The
# residual (fp32 or bf16, ``numel`` elements; y is computed in fp32 either way, and a bf16
# residual stores the new value rounded to nearest even) is updated in place to
# y - decode(code), except where the
# block (or, for 16-bit, the element) is non-finite: there it keeps its old value, so that a
# NaN never poisons later steps. With ``residual_out`` the new residual goes there instead and
# ``residual`` is left as it was. Non-finite input never becomes finite output: a non-finite
# block gets a NaN scale, so it decodes to NaN on every rank.


def _prepare(x, residual, scale, numel):
    n = x.numel()
    if numel < n:
        raise ValueError(f"numel={numel} is smaller than x.numel()={n}")
    y = torch.zeros(numel, dtype=torch.float32, device=x.device)
    y[:n] = x.reshape(-1).float() * scale
    if residual is not None:
        y += residual
    return y


def encode16(x, residual, scale, dtype, numel, residual_out=None):
    """y = x * scale (+ residual), padded to numel, rounded to dtype (Half or BFloat16)."""
    y = _prepare(x, residual, scale, numel)
    out = y.to(dtype)
    if residual is not None:
        back = out.float()
        new = torch.where(back.isfinite(), y - back, residual)
        (residual if residual_out is None else residual_out).copy_(new)
    return out


def quantize_int8(x, residual, scale, block, numel, residual_out=None):
    """Symmetric int8 per block of ``block`` elements: s = absmax / 127 (fp32),
    q = round_half_even(y * (127 / absmax)), decode q * s. Returns (codes int8 [numel],
    scales fp32 [numel / block])."""
    y = _prepare(x, residual, scale, numel).view(-1, block)
    finite = y.isfinite().all(1)
    absmax = y.abs().amax(1)
    s = torch.where(finite, absmax / 127.0, torch.full_like(absmax, float("nan")))
    inv = 127.0 / absmax
    # absmax below ~127 / FLT_MAX: inv = inf, and y = 0 would give NaN codes; such a block
    # quantizes to 0 and keeps all of y in the residual
    inv = torch.where(finite & (absmax > 0) & inv.isfinite(), inv, torch.zeros_like(absmax))
    q = torch.round(y * inv[:, None]).clamp_(-127, 127)
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    if residual is not None:
        r = residual.view(-1, block)
        new = torch.where(finite[:, None], y - q * s[:, None], r)
        (residual if residual_out is None else residual_out).view(-1, block).copy_(new)
    return q.to(torch.int8).view(-1), s


def quantize_onebit(x, residual, scale, block, numel, residual_out=None):
    """Sign bits per element (1 for y >= 0), 8 per byte, element 8k+j at bit j of byte k; one
    bf16 scale per block: mean |y| summed in fp64, rounded to fp32 then bf16. Decode: +s or
    -s. Returns (bits uint8 [numel / 8], scales bf16 [numel / block])."""
    y = _prepare(x, residual, scale, numel).view(-1, block)
    finite = y.isfinite().all(1)
    mean = (y.double().abs().sum(1) / block).float()
    s = torch.where(finite, mean, torch.full_like(mean, float("nan"))).to(torch.bfloat16)
    pos = y >= 0
    if residual is not None:
        dec = torch.where(pos, s.float()[:, None], -s.float()[:, None])
        r = residual.view(-1, block)
        new = torch.where(finite[:, None], y - dec, r)
        (residual if residual_out is None else residual_out).view(-1, block).copy_(new)
    weights = (2 ** torch.arange(8, device=y.device)).to(torch.uint8)
    bits = (pos.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
    return bits, s


def _finish(acc, scale, out):
    m = out.numel()
    res = acc[:m] * scale
    out.copy_(res.to(out.dtype).view(out.shape))
    stored = out.reshape(-1).float()
    finite = stored.isfinite()
    sq = (stored[finite].double() ** 2).sum()
    return torch.stack([sq, (~finite).sum().double()])


def decode16_sum(chunks, scale, out):
    """out = scale * sum over rows r (in order, fp32) of chunks[r, :out.numel()].
    chunks: [R, m] Half/BFloat16. Returns fp64 [squared norm, non-finite count] (the decode
    contract: docs/custom_hooks.md, "The decode contract")."""
    acc = torch.zeros(chunks.shape[1], dtype=torch.float32, device=chunks.device)
    for r in range(chunks.shape[0]):
        acc += chunks[r].float()
    return _finish(acc, scale, out)


def dequantize_int8_sum(codes, scales, block, scale, out):
    """codes [R, m] int8, scales [R, m / block] fp32; out = scale * sum_r codes[r] * s[r]."""
    acc = torch.zeros(codes.shape[1], dtype=torch.float32, device=codes.device)
    for r in range(codes.shape[0]):
        acc += (codes[r].float().view(-1, block) * scales[r][:, None]).view(-1)
    return _finish(acc, scale, out)


def dequantize_onebit_sum(bits, scales, block, scale, out):
    """bits [R, m / 8] uint8, scales [R, m / block] bf16; out = scale * sum_r (+-s[r])."""
    rows, m = bits.shape[0], bits.shape[1] * 8
    acc = torch.zeros(m, dtype=torch.float32, device=bits.device)
    shifts = torch.arange(8, device=bits.device)
    for r in range(rows):
        pos = ((bits[r][:, None] >> shifts) & 1).bool().view(-1, block)
        s = scales[r].float()[:, None]
        acc += torch.where(pos, s, -s).view(-1)
    return _finish(acc, scale, out)


def quantize_int4(x, residual, scale, block, numel, residual_out=None, scale_dtype=torch.float32):
    """Signed int4 per block of ``block`` (even) elements: s = absmax / 7 rounded to
    ``scale_dtype`` (fp32 or bf16), q = round_half_even(y * (1 / s)) in [-7, 7], decode q * s;
    two codes a byte, element 2k in the low nibble of byte k (two's complement). Returns
    (codes uint8 [numel / 2], scales scale_dtype [numel / block])."""
    y = _prepare(x, residual, scale, numel).view(-1, block)
    finite = y.isfinite().all(1)
    absmax = y.abs().amax(1)
    s = torch.where(finite, absmax / 7.0, torch.full_like(absmax, float("nan"))).to(scale_dtype)
    sf = s.float()
    inv = 1.0 / sf
    inv = torch.where(finite & (sf > 0) & inv.isfinite(), inv, torch.zeros_like(inv))
    q = torch.round(y * inv[:, None]).clamp(-7, 7)
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    if residual is not None:
        r = residual.view(-1, block)
        new = torch.where(finite[:, None], y - q * sf[:, None], r)
        (residual if residual_out is None else residual_out).view(-1, block).copy_(new)
    q = q.to(torch.int64).view(-1)
    nibbles = torch.where(q < 0, q + 16, q).view(-1, 2)
    return (nibbles[:, 0] + 16 * nibbles[:, 1]).to(torch.uint8), s


def dequantize_int4_sum(codes, scales, block, scale, out):
    """codes [R, m / 2] uint8, scales [R, m / block] (fp32 or bf16);
    out = scale * sum_r q[r] * s[r]."""
    rows, m = codes.shape[0], codes.shape[1] * 2
    acc = torch.zeros(m, dtype=torch.float32, device=codes.device)
    for r in range(rows):
        b = codes[r].to(torch.int64)
        q = torch.stack([b % 16, b // 16], 1).view(-1)
        q = torch.where(q >= 8, q - 16, q).float()
        acc += (q.view(-1, block) * scales[r].float()[:, None]).view(-1)
    return _finish(acc, scale, out)


def quantize_fp8(x, residual, scale, block, numel, residual_out=None):
    """float8 e4m3 per block: s = absmax / 448 (fp32), code = e4m3(clamp(y * (448 / absmax),
    -448, 448)) by torch's cast (round to nearest even), decode code * s. Returns (codes
    float8_e4m3fn [numel], scales fp32 [numel / block])."""
    y = _prepare(x, residual, scale, numel).view(-1, block)
    finite = y.isfinite().all(1)
    absmax = y.abs().amax(1)
    s = torch.where(finite, absmax / 448.0, torch.full_like(absmax, float("nan")))
    inv = 448.0 / absmax
    inv = torch.where(finite & (absmax > 0) & inv.isfinite(), inv, torch.zeros_like(absmax))
    v = (y * inv[:, None]).clamp(-448.0, 448.0)
    v = torch.where(finite[:, None], v, torch.zeros_like(v))
    codes = v.to(torch.float8_e4m3fn)
    if residual is not None:
        r = residual.view(-1, block)
        new = torch.where(finite[:, None], y - codes.float() * s[:, None], r)
        (residual if residual_out is None else residual_out).view(-1, block).copy_(new)
    return codes.view(-1), s


def dequantize_fp8_sum(codes, scales, block, scale, out):
    """codes [R, m] float8_e4m3fn, scales [R, m / block] fp32; out = scale * sum_r c[r] * s[r]."""
    acc = torch.zeros(codes.shape[1], dtype=torch.float32, device=codes.device)
    for r in range(codes.shape[0]):
        acc += (codes[r].float().view(-1, block) * scales[r][:, None]).view(-1)
    return _finish(acc, scale, out)
