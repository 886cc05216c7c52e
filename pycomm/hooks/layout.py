"""A compression hook's own bucket layout.

With the model's parameters bound (``pycomm.wrap`` binds them), the hook names DDP's buckets
by their parameters' positions and keeps DDP's buckets as they were at the first compressed
step. Residuals, blocks and chunks follow that layout, so a freshly built DDP that buckets its
first iteration differently (a resume) is re-bucketed into it and reduces bit for bit as the
uninterrupted run would. Before the first compressed step, the layout a checkpoint records is
DDP's latest one from a step after DDP's first (DDP rebuilds its buckets after its first
iteration), so a checkpoint taken during the exact warm-up, or just before the first compressed
step, resumes into the layout the uninterrupted run compresses with.
"""

import logging
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# reduce(bucket, x, index) -> a future of x reduced: the exchange, on hook bucket ``index``
Reduce = Callable[[Any, torch.Tensor, int], torch.futures.Future]


class BucketLayout:
    """The bound parameters and the layout of hook buckets over them.

    Args:
        where: how error messages start (``pycomm <hook> hook``).
        stats: the hook's counters; ``rebucketed_steps`` is kept here.
    """

    def __init__(self, where: str, stats: dict[str, Any]) -> None:
        self.where, self.stats = where, stats
        self.params: Optional[list[torch.Tensor]] = None
        self.param_index: dict[int, int] = {}
        self.buckets: Optional[list[tuple[int, ...]]] = None  # parameter positions per bucket
        self.index: dict[tuple[int, ...], int] = {}
        self.recording = False  # the first compressed step is defining the layout
        self.rebucket: Optional[_Rebucket] = None  # the current step's, when DDP's differ
        # DDP's buckets as the hook saw them: the steps seen by this DDP, the current (or
        # latest) step's keys, and the latest complete step's after DDP's first
        self.steps = 0
        self.current: list[tuple[int, ...]] = []
        self.seen: Optional[list[tuple[int, ...]]] = None

    @property
    def bound(self) -> bool:
        return self.params is not None

    def bind(self, params: list[torch.Tensor]) -> None:
        self.params = list(params)
        self.param_index = {id(p): i for i, p in enumerate(self.params)}

    def set(self, layout: list[tuple[int, ...]]) -> None:
        """Take a layout (from a checkpoint); the next step re-buckets into it if needed."""
        self.buckets = [tuple(k) for k in layout]
        self.index = {k: i for i, k in enumerate(self.buckets)}
        self.recording, self.rebucket = False, None

    def load(self, layout: Optional[list[list[int]]]) -> None:
        """Take a checkpoint's layout (None: none was recorded) after checking that it covers
        each bound parameter once; a ValueError naming the difference, before any change."""
        if layout is not None and self.params is not None:
            seen = sorted(i for k in layout for i in k)
            if seen != list(range(len(self.params))):
                raise ValueError(
                    f"{self.where}: the checkpoint's bucket layout covers parameters "
                    f"{seen[:8]}..., expected each of the {len(self.params)} bound parameters "
                    "once"
                )
        if layout is not None:
            self.set(layout)
        self.end_step()

    def observe(self, bucket: dist.GradBucket) -> None:
        """Note DDP's dense ``bucket`` of this step (at every hook call, exact steps too)."""
        self.current.append(self.key(bucket))

    def saved(self) -> Optional[list[tuple[int, ...]]]:
        """The layout a checkpoint records: the hook's own once it compressed a step; before
        that, DDP's latest from a step after DDP's first (its buckets are rebuilt then), so that
        a resume compresses in the layout the uninterrupted run does; None if there is none."""
        if self.buckets is not None:
            return self.buckets
        if self.current and self.steps >= 1:
            return list(self.current)
        return self.seen

    def key(self, bucket: dist.GradBucket) -> tuple[int, ...]:
        """The positions of ``bucket``'s parameters among the bound ones."""
        try:
            return tuple(self.param_index[id(p)] for p in bucket.parameters())
        except KeyError:
            raise ValueError(
                f"{self.where}: bucket {bucket.index()} holds a parameter that is not among the "
                "bound parameters (bind_parameters)"
            ) from None

    def end_step(self) -> None:
        """Between two steps: the step whose buckets were observed is complete."""
        self.rebucket = None
        if self.current:
            if self.steps >= 1:
                self.seen = self.current
            self.steps += 1
            self.current = []

    @property
    def loaded(self) -> bool:
        """Whether a layout is set that is not being recorded (a checkpoint's, or the one the
        first compressed step recorded): exact steps run on it too, so that a resumed DDP's
        first step, bucketed as a fresh DDP buckets it, sums as the uninterrupted run does
        (with 3 ranks or more an all-reduce's sums depend on where an element sits)."""
        return self.bound and self.buckets is not None and not self.recording

    def run(self, bucket: dist.GradBucket, x: torch.Tensor, reduce: Reduce):
        """``reduce`` (the two-phase or the 16-bit path) on the hook's layout: directly when
        DDP's bucket is one of the layout's, else through a re-bucketing of this step."""
        key = self.key(bucket)
        if self.buckets is None or self.recording:  # the first compressed step defines it
            if self.buckets is None:
                self.set([])
                self.recording = True
            self.buckets.append(key)
            r = self.index[key] = len(self.buckets) - 1
            if bucket.is_last():
                self.recording = False
            if bucket.index() != r:  # the hook's bucket r from the first step on (DDP numbers
                # a sparse bucket among them: a dense one after it is DDP's 1, the hook's 0)
                bucket = _HookBucket(r, x, bucket.is_last(), [self.params[i] for i in key])
            return reduce(bucket, x, r)
        r = self.index.get(key)
        if r is not None:
            if bucket.index() != r:  # the hook's bucket r, whatever DDP numbers it
                bucket = _HookBucket(r, x, bucket.is_last(), [self.params[i] for i in key])
            return reduce(bucket, x, r)
        rb = self.rebucket
        if rb is None:
            logger.info("%s: DDP's buckets differ from the hook's layout; re-bucketing", self.where)
            rb = self.rebucket = _Rebucket(self, x.dtype, x.device)
            self.stats["rebucketed_steps"] = self.stats.get("rebucketed_steps", 0) + 1
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        pending = set(key)
        off, complete = 0, []
        for i in key:
            n = self.params[i].numel()
            r, o = rb.where[i]
            if r not in rb.buffers:
                rb.buffers[r] = torch.empty(rb.sizes[r], dtype=rb.dtype, device=rb.device)
            rb.buffers[r][o : o + n].copy_(x[off : off + n])
            rb.owner[i] = (x, off, pending, fut)
            rb.missing[r].discard(i)
            if not rb.missing[r]:
                complete.append(r)
            off += n
        if off != x.numel():
            raise RuntimeError(
                f"{self.where}: bucket {bucket.index()} has {x.numel()} elements but its "
                f"parameters {off}"
            )
        complete.sort()
        for r in complete:
            # the step is counted once: on DDP's last bucket, by the last hook bucket it completes
            last = bucket.is_last() and r == complete[-1]
            hb = _HookBucket(r, rb.buffers[r], last, [self.params[i] for i in self.buckets[r]])
            reduced = reduce(hb, rb.buffers[r], r)
            reduced.then(lambda f, r=r: self._scatter(rb, r, f))
        if bucket.is_last():
            self.rebucket = None
        return fut

    def _scatter(self, rb: "_Rebucket", r: int, f: torch.futures.Future) -> None:
        """Copy a reduced hook bucket back into the DDP buckets it came from; complete those
        whose parameters are all back."""
        try:
            out = f.value()
        except BaseException as e:  # noqa: BLE001 - handed to every waiting DDP bucket
            for i in self.buckets[r]:
                _x, _o, _pending, fut = rb.owner[i]
                if not fut.done():
                    fut.set_exception(e)
            return
        done = []
        for i in self.buckets[r]:
            x, off, pending, fut = rb.owner[i]
            n = self.params[i].numel()
            o = rb.where[i][1]
            x[off : off + n].copy_(out[o : o + n])
            with rb.lock:
                pending.discard(i)
                if not pending:
                    done.append((x, fut))
        for x, fut in done:
            fut.set_result(x)


class _Rebucket:
    """One step of DDP buckets that differ from the hook's layout: each DDP bucket is copied
    into the hook buckets holding its parameters; a hook bucket whose parameters have all
    arrived is reduced (in the order they complete, the same on every rank); a DDP bucket's
    future completes once all its parameters came back."""

    def __init__(self, layout: BucketLayout, dtype: torch.dtype, device: torch.device) -> None:
        params = layout.params
        self.lock = threading.Lock()
        self.where: dict[int, tuple[int, int]] = {}  # parameter -> (hook bucket, offset)
        self.sizes: list[int] = []
        self.buffers: dict[int, torch.Tensor] = {}  # allocated when a parameter arrives
        self.missing: list[set[int]] = []
        self.dtype, self.device = dtype, device
        for r, key in enumerate(layout.buckets):
            off = 0
            for i in key:
                self.where[i] = (r, off)
                off += params[i].numel()
            self.sizes.append(off)
            self.missing.append(set(key))
        # parameter -> (DDP bucket tensor, offset, that bucket's pending set, its future)
        self.owner: dict[int, tuple[torch.Tensor, int, set[int], torch.futures.Future]] = {}


class _HookBucket:
    """A hook bucket as the exchange sees it (:class:`pycomm.hooks.Bucket`)."""

    def __init__(
        self, index: int, buffer: torch.Tensor, last: bool, params: list[torch.Tensor]
    ) -> None:
        self._index, self._buffer, self._last, self._params = index, buffer, last, params

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def index(self) -> int:
        return self._index

    def gradients(self) -> list[torch.Tensor]:
        """The parameters' gradients as views of the buffer, as DDP's buckets give them."""
        out, off = [], 0
        for p in self._params:
            out.append(self._buffer[off : off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return self._last
