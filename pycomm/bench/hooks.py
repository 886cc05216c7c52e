"""The benchmark's own comm hooks: ``compute`` (no communication) and the test-only ``_fail``.

No ``from __future__ import annotations``: DDP compares a hook's annotations to the real
GradBucket and Future types.
"""

import torch
import torch.distributed as dist


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
