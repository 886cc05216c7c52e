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
