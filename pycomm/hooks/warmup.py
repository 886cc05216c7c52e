"""What ``hook="auto"`` records during its exact warm-up, and its timing helpers.

:class:`Warmup` keeps, per iteration, the forward's start and end and each bucket's ready and
reduced times and size, and turns them into the measurements of :mod:`pycomm.hooks.auto`'s
docstring (:meth:`Warmup.measured`). It takes no decision and runs no collective.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from pycomm.codec.engine import ring_bytes

__all__ = ["Warmup", "timed", "timed_allreduce", "union"]


class Warmup:
    """The warm-up's timestamps, per iteration.

    Example:
        >>> w = Warmup()
        >>> w.forward_start(); w.forward_done(3)
        >>> done = w.bucket_ready(3, 1024); done.append(time.perf_counter())
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every record (after the decision)."""
        self.fwd: dict[int, tuple[float, float]] = {}  # forward start and end
        self.fwd_start = 0.0
        self.ready: dict[int, list[float]] = {}
        self.done: dict[int, list[float]] = {}
        self.numel: dict[int, list[int]] = {}
        # the first iteration each process recorded (a fresh DDP's: it rebuilds its buckets
        # after it), left out of the measurements; the next one recorded joins them
        self.first: set[int] = set()
        self._fresh = True

    def state_dict(self) -> dict[str, Any]:
        """The records, for a checkpoint taken before the decision: a resume decides at the
        step the uninterrupted run does, on the iterations measured so far.

        Example:
            >>> Warmup().state_dict()["first"]
            []
        """
        return {
            "fwd": {i: list(v) for i, v in self.fwd.items()},
            "ready": {i: list(v) for i, v in self.ready.items()},
            "done": {i: list(v) for i, v in self.done.items()},
            "numel": {i: list(v) for i, v in self.numel.items()},
            "first": sorted(self.first),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (times of another process: each measurement is a
        difference within one iteration); this process's first iteration is left out too."""
        self.reset()
        self.fwd = {int(i): (float(v[0]), float(v[1])) for i, v in state["fwd"].items()}
        self.ready = {int(i): [float(t) for t in v] for i, v in state["ready"].items()}
        self.done = {int(i): [float(t) for t in v] for i, v in state["done"].items()}
        self.numel = {int(i): [int(n) for n in v] for i, v in state["numel"].items()}
        self.first = {int(i) for i in state["first"]}

    def forward_start(self) -> None:
        """Mark the start of a training forward."""
        self.fwd_start = time.perf_counter()

    def forward_done(self, it: int) -> None:
        """Mark the end of iteration ``it``'s forward (the start of its backward)."""
        now = time.perf_counter()
        self.fwd[it] = (self.fwd_start or now, now)

    def started(self, it: int) -> bool:
        """Whether a bucket of iteration ``it`` was recorded."""
        return it in self.ready

    def bucket_ready(self, it: int, numel: int) -> list[float]:
        """Record that a bucket of ``numel`` elements of iteration ``it`` is ready now; returns
        the list its reduced time is appended to."""
        if self._fresh and it not in self.ready:
            self.first.add(it)
            self._fresh = False
        self.ready.setdefault(it, []).append(time.perf_counter())
        self.numel.setdefault(it, []).append(numel)
        return self.done.setdefault(it, [])

    def measured_iters(self, current: int) -> list[int]:
        """The iterations measured whole: all but the first each process recorded (DDP
        rebuilds its buckets after it; iteration 0, or the first after a resume) and
        ``current``."""
        skip = self.first | {current}
        return sorted(i for i in self.ready if i not in skip and self.done.get(i))

    def measured(self, current: int, world_size: int) -> dict[str, Any]:
        """The measurements over :meth:`measured_iters` (the fastest of each number)."""
        iters = self.measured_iters(current)
        if not iters:
            raise RuntimeError("pycomm auto hook: no warm-up iteration was measured")
        numel = self.numel[iters[-1]]
        fwd, exposed, ready, spb = [], [], [], []
        for i in iters:
            r, d = self.ready[i], self.done[i]
            # backward starts where the forward ends (at the first bucket without the hooks)
            start, end = self.fwd.get(i, (r[0], r[0]))
            fwd.append(end - start)
            exposed.append(max(0.0, max(d) - max(r)))
            if len(r) == len(numel):
                ready.append([t - end for t in r])
            sent = sum(ring_bytes(4 * n, world_size) for n in self.numel[i])
            spb.append(union(list(zip(r, d))) / sent if sent else 0.0)
        # The fastest of the iterations, each number on its own: on a shared machine other
        # processes only ever add time, and the first iterations run on cold caches.
        m: dict[str, Any] = {
            "forward_s": min(fwd),
            "exposed_s": min(exposed),
            "ready_s": [min(col) for col in zip(*ready)],
            "numel": list(numel),
            "wire_s_per_byte": min(spb),
        }
        m["step_s"] = m["forward_s"] + max(m["ready_s"]) + m["exposed_s"]
        return m


def union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals.

    Example:
        >>> union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
        4.0
    """
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def timed(fn: Callable[[], None], device: torch.device, reps: int = 3) -> float:
    """The fastest of ``reps`` runs of ``fn`` (after one untimed), synchronized on an
    accelerator.

    Example:
        >>> timed(lambda: torch.randn(1000).sum(), torch.device("cpu")) < 1.0
        True
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = math.inf
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def timed_allreduce(x: torch.Tensor, group) -> float:
    """:func:`timed` of a synchronous all-reduce of ``x`` on ``group`` (a collective)."""
    return timed(lambda: dist.all_reduce(x, group=group), x.device)
