"""Shared harness for multi-rank tests: run a module-level function on N gloo ranks.

Per-rank functions must be defined at module level in the test module (spawn pickles them by
name). Every run has a deadline, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

from typing import Any, Callable

import pycomm


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` ranks via :func:`pycomm.launch`; results in rank order.

    Example:
        >>> run_ranks(_sum_ranks, 2)   # _sum_ranks defined at module level
        [1.0, 1.0]
    """
    return pycomm.launch(fn, nprocs, *args, backend=backend, timeout=timeout)
