"""The benchmark's own comm hooks: ``compute`` (no communication), the ``*-wire`` diagnostics
(a compressed hook's exchange without its codecs) and the test-only ``_fail`` and ``_hang``.

No ``from __future__ import annotations``: DDP compares a hook's annotations to the real
GradBucket and Future types.
"""

from typing import Optional

import torch
import torch.distributed as dist

from pycomm.hooks.compressed import Codec, CompressedState


def compute_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket untouched: what a step costs without any communication.

    Each rank then keeps its own gradients, so the replicas drift apart: fine for timing.

    Example:
        >>> ddp.register_comm_hook(None, compute_hook)
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class FailState:
    """Counts hook calls; :func:`fail_hook` raises from the ``fail_at``-th call on."""

    def __init__(self, fail_at: int = 2) -> None:
        self.calls = 0
        self.fail_at = fail_at


def fail_hook(state: FailState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A hook that breaks after a few calls, on every rank: tests that a failing hook is
    reported as failed while the others are measured.

    Example:
        >>> ddp.register_comm_hook(FailState(), fail_hook)
    """
    state.calls += 1
    if state.calls >= state.fail_at:
        raise RuntimeError(f"_fail hook: deliberate failure in call {state.calls}")
    return compute_hook(None, bucket)


def hang_hook(state: FailState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A hook that, from the ``fail_at``-th call on, returns a future nobody completes: DDP
    waits on it forever, the way a collective that two ranks issued in different orders hangs.
    Tests the per-step deadline.

    Example:
        >>> ddp.register_comm_hook(FailState(), hang_hook)
    """
    state.calls += 1
    if state.calls >= state.fail_at:
        return torch.futures.Future()
    return compute_hook(None, bucket)


class WireOnlyCodec(Codec):
    """Puts the bytes of codec ``like`` on the wire and computes nothing: no encoding (the send
    buffers go out as they are), no decoding (each rank keeps its own gradient, as with
    ``compute``). Run through the compressed hooks' two-phase exchange it measures what the
    exchange itself costs (gloo, the sockets, the hook's bookkeeping), so that a step's time
    splits into compute, exchange and codecs.

    Example:
        >>> state = pycomm.hooks.Int8State(None, error_feedback=False)
        >>> state.codec = WireOnlyCodec(state.codec)
    """

    def __init__(self, like: Codec) -> None:
        super().__init__(like.block)
        self.like = like
        self.code_dtype, self.scale_dtype = like.code_dtype, like.scale_dtype

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
