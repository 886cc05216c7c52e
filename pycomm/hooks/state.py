"""HookState: what every pycomm hook keeps between calls (stats, config, checkpointable state)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N of the payload."""
    return 2 * (world_size - 1) * nbytes // world_size


class HookState:
    """Base of every pycomm hook state.

    ``stats`` counts ``steps`` (iterations, one per last bucket), ``buckets`` (hook calls),
    ``collectives`` (collective calls issued), ``bytes_sent`` (the payload this rank put on the
    wire), ``bytes_fp32`` (what an fp32 ring all-reduce of the same buckets sends) and
    ``compression`` (bytes_fp32 / bytes_sent).

    Example:
        >>> state = pycomm.hooks.AllreduceState(process_group=None)
        >>> ddp.register_comm_hook(state, pycomm.hooks.allreduce_hook)
        >>> state.stats["bytes_sent"]
    """

    hook_name = "base"
    # DDP bucket size pycomm.wrap picks for this hook when the caller gives none (None: DDP's)
    default_bucket_cap_mb: Optional[float] = None

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._stats: dict[str, Any] = {
            "steps": 0,
            "buckets": 0,
            "collectives": 0,
            "bytes_sent": 0,
            "bytes_fp32": 0,
            "compression": 1.0,
        }

    @property
    def stats(self) -> dict[str, Any]:
        """The counters (a live dict)."""
        return self._stats

    def options(self) -> dict[str, Any]:
        """The hook's configuration: compared across ranks and stored in the fingerprint."""
        return {}

    def optimizer_advice(self, optimizer: Any) -> Optional[str]:
        """Why this hook, as configured, is known to train worse with ``optimizer`` and what to
        use instead (``pycomm.TrainLoop`` warns with it), or None."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What must be equal for state to be shared across ranks or loaded from a checkpoint."""
        return {"hook": self.hook_name, "options": self.options(), "world_size": self.world_size}

    def count(self, bucket: dist.GradBucket, bytes_sent: int, collectives: int = 1) -> None:
        """Account one hook call on ``bucket`` that put ``bytes_sent`` bytes on the wire in
        ``collectives`` collective calls."""
        s = self._stats
        s["buckets"] += 1
        s["collectives"] += collectives
        s["bytes_sent"] += bytes_sent
        s["bytes_fp32"] += ring_bytes(bucket.buffer().numel() * 4, self.world_size)
        s["compression"] = s["bytes_fp32"] / s["bytes_sent"] if s["bytes_sent"] else 1.0
        if bucket.is_last():
            s["steps"] += 1

    def reduced_sqnorm(self) -> Optional[float]:
        """The squared L2 norm of the latest step's reduced gradients when the hook computed it
        in its decode pass (no extra pass over the gradients); None when it did not."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Counters and config fingerprint; subclasses add their tensors."""
        return {"fingerprint": self.fingerprint(), "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another hook or config is refused."""
        self.check_fingerprint(state)
        self._stats = dict(state["stats"])

    def check_fingerprint(self, state: dict[str, Any]) -> None:
        """Refuse (ValueError naming the field) a checkpoint of another hook or config."""
        mine, theirs = self.fingerprint(), state.get("fingerprint", {})
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                raise ValueError(
                    f"pycomm: cannot load hook state: {key} is {theirs.get(key)!r} in the "
                    f"checkpoint but {mine.get(key)!r} here"
                )


def check_bucket(hook: str, bucket: dist.GradBucket) -> torch.Tensor:
    """The bucket's flat buffer, or an error naming the hook, the dtype and the bucket."""
    t = bucket.buffer()
    if not t.is_floating_point() or t.layout != torch.strided:
        raise TypeError(
            f"pycomm {hook} hook: bucket {bucket.index()} has dtype {t.dtype} and layout "
            f"{t.layout}, expected a dense floating-point gradient bucket"
        )
    return t


def completed(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``t``: what a hook returns when it does not communicate."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut
