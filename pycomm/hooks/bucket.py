"""The bucket protocol: what a hook function may call on the bucket it is given.

DDP's ``GradBucket`` implements it, and so does each bucket pycomm hands a hook function: the
accumulate stage's fp32 sum (a boundary micro-step), the hook's own bucket layout (a bucket
cut from the bound parameters) and the node hierarchy's shard (the cross-node stage). A hook
written against these four methods runs under every one of them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Bucket"]


@runtime_checkable
class Bucket(Protocol):
    """A gradient bucket as a hook sees it.

    ``buffer()``: the flat tensor to reduce, in place or into the tensor the hook's future
    returns (same shape and dtype); a dense floating-point tensor. ``index()``: the bucket's
    position, the same on every rank (key per-bucket state with it, with the buffer's size).
    ``is_last()``: whether it is the step's last bucket (a step's end). ``parameters()``: the
    parameters whose gradients the buffer comes from, in order (for a shard of the node
    hierarchy, those of the whole bucket it was cut from).

    DDP's ``GradBucket`` also has ``gradients()`` and ``set_buffer()``; a hook that needs to
    run under pycomm's accumulate stage, layout and hierarchy does not call them.

    Example:
        >>> def my_hook(state, bucket: pycomm.hooks.Bucket):
        ...     x = bucket.buffer()
        ...     return pycomm.codec.engine.completed(x)
        >>> isinstance(bucket, pycomm.hooks.Bucket)
        True
    """

    def index(self) -> int:
        """The bucket's position in the step (0 first), the same on every rank."""
        ...

    def buffer(self) -> torch.Tensor:
        """The flat tensor to reduce."""
        ...

    def is_last(self) -> bool:
        """Whether this is the step's last bucket."""
        ...

    def parameters(self) -> list[torch.Tensor]:
        """The parameters the buffer's gradients belong to, in order."""
        ...
