"""torch's own PowerSGD, delegated (not rewritten), with pycomm's stats and config checks."""

# No `from __future__ import annotations` in hook modules: DDP checks the hook's annotations
# against the real dist.GradBucket and Future types.

import inspect
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd

from pycomm._validate import check_bool, check_int
from pycomm.codec.engine import completed, ring_bytes
from pycomm.codec.groups import phase_groups
from pycomm.hooks.ddp import BucketLayout, HookState, is_sparse, sparse_allreduce

# PowerSGDState's options and their defaults, read from its signature (it does not keep all of
# them as attributes, random_seed for one).
_OPTIONS = {
    name: p.default
    for name, p in inspect.signature(_psgd.PowerSGDState.__init__).parameters.items()
    if name not in ("self", "process_group")
}


def _check_options(where: str, options: dict[str, Any]) -> None:
    """torch's options, checked before torch gets them (it takes any value, and fails, or
    trains on silently, at the first compressed step): a ValueError naming the option."""
    known = options.keys()
    for name in {"matrix_approximation_rank", "compression_stats_logging_frequency"} & known:
        check_int(where, name, options[name], 1)
    for name in {"start_powerSGD_iter", "random_seed"} & known:
        check_int(where, name, options[name], 0, maximum=2**32 - 1)
    for name in {"use_error_feedback", "warm_start", "batch_tensors_with_same_shape"} & known:
        check_bool(where, name, options[name])
    for name in {"min_compression_rate", "orthogonalization_epsilon"} & known:
        value, low = options[name], 0.0
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < low
        ):
            raise ValueError(f"{where}: {name}={value!r}, expected a finite number >= {low:g}")


class PowerSGDHookState(HookState):
    """Wraps ``torch...powerSGD_hook.PowerSGDState``; options are passed through unchanged.

    Example:
        >>> state = PowerSGDHookState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        >>> ddp.register_comm_hook(state, powersgd_hook)
    """

    hook_name = "powersgd"

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, **options: Any):
        super().__init__(process_group)
        # torch's PowerSGD reduces over one group: flat only ("auto" resolves to it)
        hierarchy = options.pop("hierarchy", "auto")
        if hierarchy not in ("auto", "flat"):
            raise ValueError(
                f"pycomm powersgd hook: hierarchy={hierarchy!r}, expected 'auto' or 'flat' "
                "(torch's PowerSGD runs over one process group; the node hierarchy is for "
                "pycomm's own hooks)"
            )
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"pycomm powersgd hook: unknown option {unknown[0]!r}; valid options: "
                f"{', '.join(_OPTIONS)}, hierarchy"
            )
        _check_options(self.where, {**_OPTIONS, **options})
        self.torch_state = _psgd.PowerSGDState(process_group=process_group, **options)
        if self._world_size is not None:  # bound already (the group existed): its own group
            self.torch_state.process_group = self.exchange_group
        # the previous bucket's exchange of this step (see powersgd_hook)
        self.chain: torch.futures.Future = completed(torch.empty(0))
        self._options = {**_OPTIONS, **options}
        if hierarchy != "auto":
            self._options["hierarchy"] = hierarchy
        # torch's PowerSGD keys its error feedback and P/Q memories by bucket index: with the
        # parameters bound (pycomm.wrap binds them), its compressed steps run on the buckets of
        # the first one, so a resumed DDP, whose first iteration buckets otherwise, re-buckets
        # into them and resumes bit for bit
        self._stats["rebucketed_steps"] = 0
        self.bucket_layout = BucketLayout(self.where, self._stats)

    def _bound(self) -> None:
        # torch's hook issues its P and Q all-reduces from callbacks, in this hook's chain: on a
        # group of their own, which DDP's own collectives on its group (find_unused_parameters'
        # all-reduce of the used parameters) cannot meet in another order on another rank
        # (the first of the parent's phase groups, created once per parent and shared: one
        # hook's exchange runs in a backward at a time)
        world = self.process_group or dist.group.WORLD
        self.exchange_group = world
        if dist.get_world_size(world) > 1:
            self.exchange_group = phase_groups(self.process_group).groups[0]
        torch_state = getattr(self, "torch_state", None)
        if torch_state is not None:
            torch_state.process_group = self.exchange_group

    def bind_parameters(self, params: list[torch.Tensor]) -> None:
        """Bind the model's dense trainable parameters, in order (``pycomm.wrap`` does).

        Example:
            >>> state.bind_parameters([p for p in model.parameters() if p.requires_grad])
        """
        self.bucket_layout.bind(params)

    def options(self) -> dict[str, Any]:
        return dict(self._options)

    def scale_residuals(self, factor: float) -> None:
        # torch's error feedback; P and Q are orthogonalized from step to step: scale-free
        for error in self.torch_state.error_dict.values():
            error.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        # PowerSGDState's own pickling state: error feedback, P/Q memories, iteration, RNG;
        # its numpy RandomState as tensors and numbers, which torch.load(weights_only=True)
        # reads (pycomm.checkpoint loads that way)
        torch_state = self.torch_state.__getstate__()
        rng = torch_state.get("rng")
        if rng is not None and not isinstance(rng, dict):
            name, keys, pos, has_gauss, gauss = rng.get_state()
            torch_state["rng"] = {
                "bit_generator": str(name), "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss),
            }  # fmt: skip
        saved = self.bucket_layout.saved()
        return {
            **super().state_dict(),
            "torch_state": torch_state,
            "layout": None if saved is None else [list(k) for k in saved],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.bucket_layout.load(state.get("layout"))  # a checkpoint without one: None
        torch_state = dict(state["torch_state"])
        rng = torch_state.get("rng")
        if isinstance(rng, dict):
            import numpy as np

            restored = np.random.RandomState()
            restored.set_state((
                rng["bit_generator"], rng["keys"].numpy().astype(np.uint32), rng["pos"],
                rng["has_gauss"], rng["cached_gaussian"],
            ))  # fmt: skip
            torch_state["rng"] = restored
        self.torch_state.__setstate__(torch_state)
        self.torch_state.process_group = getattr(self, "exchange_group", self.process_group)

    def payload_bytes(self, bucket: dist.GradBucket) -> int:
        """Bytes torch's PowerSGD sends for this bucket, following its own compress test."""
        s, buffer = self.torch_state, bucket.buffer()
        if s.iter < s.start_powerSGD_iter:
            return ring_bytes(buffer.numel() * buffer.element_size(), self.world_size)
        elements = 0
        for t in bucket.gradients():
            n = t.shape[0] if t.dim() else 1
            m = t.numel() // max(n, 1)
            rank = min(n, m, s.matrix_approximation_rank)
            if _psgd._should_compress(n, m, rank, s.min_compression_rate)[0]:
                elements += (n + m) * rank
            else:
                elements += t.numel()
        return ring_bytes(elements * buffer.element_size(), self.world_size)


def powersgd_hook(
    state: PowerSGDHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` on ``state.torch_state``, counted in ``state.stats``, one
    bucket's exchange after the other (:func:`_in_turn` says why), its compressed steps on the
    hook's bucket layout once the parameters are bound.

    Args:
        state: a :class:`PowerSGDHookState` (torch's PowerSGDState inside, and counters).
        bucket: the DDP bucket that is ready: its flat buffer and the parameters it holds.

    Returns:
        A future of the reduced bucket buffer (same shape and dtype), which DDP copies into
        the parameters' gradients.

    Example:
        >>> ddp.register_comm_hook(PowerSGDHookState(None), powersgd_hook)
    """
    s, layout = state.torch_state, state.bucket_layout
    if bucket.index() == 0:  # DDP launches a step's buckets in index order
        layout.end_step()
        state.chain = completed(torch.empty(0))
    if is_sparse(bucket):  # exact, as DDP reduces it (sparse_allreduce counts it)

        def sparse() -> torch.futures.Future[torch.Tensor]:
            # torch's hook counts its iterations at the last bucket: in turn, once the earlier
            # buckets' hooks have run, so that each of them saw this step's count on every rank
            s.maybe_increase_iter(bucket)
            return sparse_allreduce(state, bucket, s.process_group)

        return _in_turn(state, sparse)
    if layout.bound:
        layout.observe(bucket)
        # compressed steps on the hook's layout; exact ones too once a layout is loaded (a
        # resume in the warm-up: the uninterrupted run's sums)
        if s.iter >= s.start_powerSGD_iter or layout.loaded:
            return layout.run(bucket, bucket.buffer(), lambda b, _x, _i: _reduce(state, b))
    return _reduce(state, bucket)


def _reduce(state: PowerSGDHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's hook on one dense bucket (DDP's, or one of the hook's layout), counted."""
    s = state.torch_state
    # before start_powerSGD_iter one all-reduce; then the uncompressed tensors, P and Q
    state.count(
        bucket,
        state.payload_bytes(bucket),
        collectives=1 if s.iter < s.start_powerSGD_iter else 3,
    )
    if s.iter < s.start_powerSGD_iter:
        return _in_turn(state, lambda: _psgd.powerSGD_hook(s, bucket))
    # torch's hook carries a bucket's error feedback and (warm start) its P and Q from step to
    # step: a NaN or Inf in one rank's gradient would make them non-finite on every rank, and
    # every later step skipped. A step whose reduced bucket is not finite (on every rank alike:
    # the reduction spreads it) keeps them as they were, as pycomm's own hooks keep residuals.
    index = bucket.index()
    memories = (s.error_dict, s.p_memory_dict, s.q_memory_dict)
    # the error is replaced by torch's hook, P and Q are written in place: copies of those
    before = [d.get(index) for d in memories]
    before[1:] = [None if t is None else t.clone() for t in before[1:]]

    def keep_finite(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()
        # (torch's hook has synchronized with the device already: this read waits no more)
        if not bool(torch.isfinite(out).all()):
            for d, old in zip(memories, before):
                if old is None:  # new this step: dropped with the step
                    d.pop(index, None)
                else:
                    d[index] = old
        return out

    return _in_turn(state, lambda: _psgd.powerSGD_hook(s, bucket)).then(keep_finite)


def _in_turn(state: PowerSGDHookState, call: Any) -> torch.futures.Future[torch.Tensor]:
    """``call()`` once the previous bucket's exchange of this step has completed.

    torch's hook issues a bucket's P and Q all-reduces from callbacks, in the order the
    buckets' earlier all-reduces complete, which differs from rank to rank: on one group gloo
    then pairs one bucket's collective with another bucket's (a hang, an abort, or, where the
    sizes match, different buckets' matrices summed). So each bucket's exchange starts once
    the previous bucket's has completed: the same order on every rank. DDP launches its
    buckets in index order (the hook's layout reduces its buckets in an order every rank
    shares), and waits for them all before the next step."""
    if state.world_size == 1:
        return call()
    prev = state.chain
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def run(_previous: torch.futures.Future) -> None:
        try:
            inner = call()
        except BaseException as e:  # noqa: BLE001 - handed to DDP through the future
            result.set_exception(e)
            return

        def done(f: torch.futures.Future) -> None:
            try:
                result.set_result(f.value())
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)

        inner.then(done)

    state.chain = result
    prev.then(run)
    return result
