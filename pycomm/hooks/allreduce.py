"""The exact all-reduce hook: DDP's own reduction, with byte accounting."""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm.hooks import hierarchy as hier
from pycomm.hooks.groups import surfaced
from pycomm.hooks.layout import BucketLayout
from pycomm.hooks.state import (
    HookState,
    check_bucket,
    completed,
    dtype_names,
    is_sparse,
    ring_bytes,
)


class AllreduceState(HookState):
    """State of :func:`allreduce_hook`: the process group and the stats.

    ``hierarchy``: ``"auto"`` (default: ``"node"`` when the ranks span several nodes with
    several ranks on each, else ``"flat"``), ``"flat"`` (one all-reduce over the group) or
    ``"node"`` (fp32 reduce-scatter inside each node, all-reduce across nodes on 1/L of the
    bucket, all-gather inside the node; see :mod:`pycomm.hooks.hierarchy`).

    With the model's parameters bound (``pycomm.wrap`` binds them), a checkpoint records DDP's
    buckets (after its first step), and a resumed run reduces its fresh DDP's first step in
    them: with 3 ranks or more an all-reduce's sums depend on where an element sits, so that
    step sums as the uninterrupted run's does.

    Example:
        >>> state = AllreduceState(process_group=None, hierarchy="node")
        >>> ddp.register_comm_hook(state, allreduce_hook)
    """

    hook_name = "allreduce"
    node_plan: Optional[hier.NodePlan] = None

    def __init__(
        self, process_group: Optional[dist.ProcessGroup] = None, hierarchy: str = "auto"
    ) -> None:
        self.hierarchy = hier.check_hierarchy(self.hook_name, hierarchy)
        super().__init__(process_group)
        self.bucket_layout = BucketLayout(self.where, self._stats)

    def bind_parameters(self, params: list[torch.Tensor]) -> None:
        """The model's trainable parameters in ``module.parameters()`` order: names DDP's
        buckets, for the layout a checkpoint records. ``pycomm.wrap`` calls it."""
        self.bucket_layout.bind(params)

    def state_dict(self) -> dict[str, Any]:
        saved = self.bucket_layout.saved()
        return {
            **super().state_dict(),
            "layout": None if saved is None else [list(k) for k in saved],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_fingerprint(state)
        self.bucket_layout.load(state.get("layout"))  # checked before anything changes
        super().load_state_dict(state)

    def _bound(self) -> None:
        self.node_plan = hier.resolve(self.hook_name, self.process_group, self.hierarchy)

    def options(self) -> dict[str, Any]:
        return {"hierarchy": self.hierarchy}

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "topology": hier.fingerprint(self.node_plan)}


def allreduce_hook(
    state: AllreduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with one asynchronous fp32 (or bucket-dtype)
    all-reduce: bit for bit what DDP does without a hook.

    DDP without a hook multiplies each gradient by 1/N (a double rounded to the bucket's
    dtype) before summing, so this hook scales the same way before the same all-reduce: a
    division by N would round differently whenever N is not a power of two.

    Args:
        state: the hook's :class:`AllreduceState` (process group, counters, hierarchy).
        bucket: the DDP bucket that is ready: its flat buffer and the parameters it holds.

    Returns:
        A future of the reduced bucket buffer (same shape and dtype), which DDP copies into
        the parameters' gradients.

    Example:
        >>> ddp.register_comm_hook(AllreduceState(None), allreduce_hook)
    """

    layout = state.bucket_layout

    def dense(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        plan = state.node_plan
        if plan is not None:
            cross = hier.exact_cross(plan, tensor.numel())
            return hier.node_reduce(
                state, plan, bucket, tensor, bucket.index(), cross, prescale=1.0 / state.world_size
            )
        if layout.bound:
            layout.observe(bucket)
            if layout.loaded:  # resumed: the checkpoint's buckets (DDP's own once rebuilt)
                exact = lambda b, t, _i: exact_allreduce(state, b, t, state.process_group)  # noqa: E731
                return layout.run(bucket, tensor, exact)
        return exact_allreduce(state, bucket, tensor, state.process_group)

    return per_bucket(state, bucket, dense, end=layout.end_step)


def per_bucket(
    state: HookState,
    bucket: dist.GradBucket,
    dense: Callable[[torch.Tensor], torch.futures.Future[torch.Tensor]],
    *,
    begin: Optional[Callable[[], Any]] = None,
    end: Optional[Callable[[], Any]] = None,
    alone: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """The routine every pycomm hook runs on a bucket, written once: the ranks' loaded
    states compared once after a load (:meth:`HookState.check_resumed`); ``begin()`` (a step's
    bookkeeping, at every call); a sparse gradient's bucket reduced exactly as DDP does
    (:func:`sparse_allreduce`); the dense bucket's buffer checked (a dense floating-point
    tensor of one of ``state.grad_dtypes``, else a TypeError naming the hook, the bucket
    and the dtype); on one rank (``alone``) the bucket as it is, counted; else
    ``dense(buffer)``, the hook's own exchange; and ``end()`` after the step's last bucket,
    whatever happened.

    Example:
        >>> def my_hook(state, bucket):
        ...     return per_bucket(state, bucket, lambda x: my_exchange(state, bucket, x))
    """
    state.check_resumed(bucket.buffer().device)
    if begin is not None:
        begin()
    try:
        if is_sparse(bucket):  # exact, as DDP reduces it; at its place in the step
            return sparse_allreduce(state, bucket)
        x = check_bucket(state.hook_name, bucket)
        dtypes = state.grad_dtypes
        if dtypes is not None and x.dtype not in dtypes:
            raise TypeError(
                f"pycomm {state.hook_name} hook: bucket {bucket.index()} has dtype {x.dtype}, "
                f"expected {dtype_names(dtypes)}"
            )
        if alone and state.world_size == 1:
            state.count(bucket, 0, collectives=0)
            return completed(x)
        return surfaced(dense(x))
    finally:
        if end is not None and bucket.is_last():
            end()


def exact_allreduce(
    state: HookState, bucket: dist.GradBucket, tensor: torch.Tensor, group
) -> torch.futures.Future[torch.Tensor]:
    """Scale by 1/N as DDP does, all-reduce on ``group`` asynchronously, count the bytes."""
    state.count(bucket, ring_bytes(tensor.numel() * tensor.element_size(), state.world_size))
    tensor.mul_(1.0 / state.world_size)
    work = dist.all_reduce(tensor, group=group, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises what the collective raised
        return tensor  # reduced in place

    return work.get_future().then(done)


def sparse_allreduce(
    state: HookState, bucket: dist.GradBucket, group: Optional[dist.ProcessGroup] = None
) -> torch.futures.Future[torch.Tensor]:
    """Reduce a sparse gradient's bucket as DDP does without a hook: divide by N, then one
    asynchronous sparse all-reduce on the state's process group (gloo gathers every rank's
    indices and values). Every pycomm hook sends its sparse buckets this way, exactly and
    uncompressed: their bytes count as sent and as the fp32 baseline alike.

    It must take the same place among the group's collectives on every rank: issued from the
    hook call itself (DDP calls the hooks in bucket order on every rank) where the hook issues
    nothing on that group from callbacks, else in the hook's own chain, on its own ``group``
    (powersgd's).

    Example:
        >>> if pycomm.hooks.is_sparse(bucket):
        ...     return sparse_allreduce(state, bucket)
    """
    grad = bucket.buffer()
    n = state.world_size
    if n == 1:
        state.count(bucket, 0, collectives=0, bytes_fp32=0)
        return completed(grad)
    # what this rank puts on the wire: its indices and values, to every other rank
    payload = grad._indices().numel() * 8 + grad._values().numel() * grad.element_size()
    state.count(bucket, (n - 1) * payload, bytes_fp32=(n - 1) * payload)
    grad.div_(n)
    work = dist.all_reduce(grad, group=group or state.process_group, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        return fut.value()[0]  # a new sparse tensor: the input is not reduced in place

    return work.get_future().then(done)
