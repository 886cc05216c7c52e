"""The benchmark's own comm hooks: ``compute`` (no communication) and the ``*-wire`` diagnostics
(a compressed hook's exchange without its codecs).

No ``from __future__ import annotations``: DDP compares a hook's annotations to the real
GradBucket and Future types.
"""

from typing import Optional

import torch
import torch.distributed as dist

from pycomm.codec import Codec
from pycomm.hooks.ddp import CompressedState


def compute_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket untouched: what a step costs without any communication.

    Each rank then keeps its own gradients, so the replicas drift apart: fine for timing.

    Example:
        >>> ddp.register_comm_hook(None, compute_hook)
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class WireOnlyCodec(Codec):
    """Puts the bytes of codec ``like`` on the wire and computes nothing: no encoding (the send
    buffers go out as they are), no decoding (each rank keeps its own gradient, as with
    ``compute``). Run through the compressed hooks' two-phase exchange it measures what the
    exchange itself costs (gloo, the sockets, the hook's bookkeeping), so that a step's time
    splits into compute, exchange and codecs.

    Example:
        >>> state = pycomm.hooks.hook_spec("int8").state(None, error_feedback=False)
        >>> state.codec = WireOnlyCodec(state.codec)
    """

    def __init__(self, like: Codec) -> None:
        self.block, self.like = like.block, like
        self.code_dtype, self.scale_dtype = like.code_dtype, like.scale_dtype
        self.two_phase = like.two_phase

    def code_bytes(self, m: int) -> int:
        return self.like.code_bytes(m)

    def scale_bytes(self, m: int) -> int:
        return self.like.scale_bytes(m)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return None, None

    def pack(self, codes, scales, rows: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is None:
            raise RuntimeError("the wire-only codec sends existing buffers only (gloo's path)")
        return out

    def decode_sum(self, codes, scales, scale, out):
        return torch.zeros(2, dtype=torch.float64, device=out.device)  # [sq norm, non-finite]


def wire_state(state: CompressedState) -> CompressedState:
    """``state`` (a compressed hook's, built with ``error_feedback=False``) with its codec
    swapped for a :class:`WireOnlyCodec` of the same bytes."""
    state.codec = WireOnlyCodec(state.codec)
    return state
