"""The exact all-reduce hook: DDP's own reduction, with byte accounting."""

import torch
import torch.distributed as dist

from pycomm.hooks.state import HookState, check_bucket, completed, ring_bytes


class AllreduceState(HookState):
    """State of :func:`allreduce_hook`: the process group and the stats.

    Example:
        >>> state = AllreduceState(process_group=None)
        >>> ddp.register_comm_hook(state, allreduce_hook)
    """

    hook_name = "allreduce"


def allreduce_hook(
    state: AllreduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with one asynchronous fp32 (or bucket-dtype)
    all-reduce: bit for bit what DDP does without a hook.

    DDP without a hook multiplies each gradient by 1/N (a double rounded to the bucket's
    dtype) before summing, so this hook scales the same way before the same all-reduce: a
    division by N would round differently whenever N is not a power of two.

    Example:
        >>> ddp.register_comm_hook(AllreduceState(None), allreduce_hook)
    """
    tensor = check_bucket("allreduce", bucket)
    if state.world_size == 1:
        state.count(bucket, 0, collectives=0)
        return completed(tensor)
    return exact_allreduce(state, bucket, tensor, state.process_group)


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
