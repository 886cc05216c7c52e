"""Hooks that break, for the benchmark's failure tests: run as ``--hooks tests.bench_hooks:fail``
(a ``module:factory`` the bench imports on every rank; the factory returns ``(state, hook)``).

No ``from __future__ import annotations``: DDP compares a hook's annotations to the real
GradBucket and Future types.
"""

import torch
import torch.distributed as dist

from pycomm.bench.hooks import compute_hook


class FailState:
    """Counts hook calls; the hooks below break from the ``fail_at``-th call on."""

    def __init__(self, fail_at: int = 2) -> None:
        self.calls = 0
        self.fail_at = fail_at


def fail_hook(state: FailState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.calls += 1
    if state.calls >= state.fail_at:
        raise RuntimeError(f"fail hook: deliberate failure in call {state.calls}")
    return compute_hook(None, bucket)


def hang_hook(state: FailState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """From the ``fail_at``-th call on, a future nobody completes: DDP waits on it forever, the
    way a collective that two ranks issued in different orders hangs."""
    state.calls += 1
    if state.calls >= state.fail_at:
        return torch.futures.Future()
    return compute_hook(None, bucket)


def fail():
    """raises from its second step on, on every rank"""
    return FailState(), fail_hook


def hang():
    """never completes its second step"""
    return FailState(), hang_hook


def badsetup():
    """raises while being set up"""
    raise RuntimeError("badsetup hook: deliberate failure while setting up")
