"""The accumulate stage: gradient accumulation in fp32 that communicates once per k micro-steps.

The stage stands in front of the hook, as part of the hook's own state (``state.accumulate``):
DDP calls :func:`accumulate_hook` with the hook's state, and the stage hands the hook function
one bucket in k. Every micro-step (one backward pass) adds each bucket into a persistent fp32
buffer. On the first k - 1 micro-steps the stage then returns the bucket zeroed, without
communicating, so that the next backward's gradients hold only the next micro-batch; on the
k-th it runs the hook (all-reduce, 16-bit, int8, 1-bit, PowerSGD, a user's) on the fp32 sum,
writes the reduced result back into the bucket (in the gradients' dtype, rounded once) and
starts a new window.

Accumulators are kept per parameter, in segments laid out as DDP's buckets are, so that each
bucket is one fused add and is handed to the hook as it is, with no gather. DDP rebuilds its
buckets after the first iteration, which can fall inside an accumulation window: a bucket whose
parameters live in other segments gets a new segment and their sums move into it. The
checkpoint stores the sums per parameter, so it does not depend on the layout either.
"""

import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pycomm import ops
from pycomm._validate import check_int
from pycomm.hooks.ddp import HookState, check_bucket, completed, is_sparse


class _Fp32Bucket:
    """What the hook sees on a boundary micro-step: DDP's bucket, with the fp32 sum as
    its buffer (``index``, ``is_last``, ``parameters`` and ``gradients`` as DDP's)."""

    def __init__(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
        self._bucket = bucket
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def parameters(self) -> list[torch.Tensor]:
        return self._bucket.parameters()

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._bucket.parameters():
            out.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class _Segment:
    """The fp32 sums of one bucket's parameters, in the bucket's order."""

    def __init__(self, key: tuple[int, ...], buffer: torch.Tensor, offsets: list[int]) -> None:
        self.key = key  # parameter indices, in bucket order
        self.buffer = buffer
        self.offsets = offsets
        self.live = set(key)  # parameters whose sums live here (not moved to a newer segment)


# id(parameter) -> the live stage accumulating it: optimizer.step() on such a parameter in the
# middle of the stage's window steps with gradients that were never reduced across ranks.
_STAGE_OF: "weakref.WeakValueDictionary[int, Accumulate]" = weakref.WeakValueDictionary()
_STEP_HOOK: list = []


def _watch(stage: "Accumulate") -> None:
    for p in stage.params:
        _STAGE_OF[id(p)] = stage
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_check_step))


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuse optimizer.step() inside an accumulation window (two accumulators: a framework or
    loop deciding when to step while pycomm's stage decides when to communicate)."""
    if not _STAGE_OF:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            stage = _STAGE_OF.get(id(p))
            if stage is None or stage.micro_step % stage.accumulate_steps == 0:
                continue
            k = stage.accumulate_steps
            raise RuntimeError(
                f"pycomm accumulate: optimizer.step() after micro-step "
                f"{stage.micro_step % k} of a window of accumulate_steps={k}: the gradients "
                f"are not reduced across ranks yet (pycomm's stage communicates on every "
                f"{k}-th backward). Two accumulators: when a framework or your loop decides "
                "when to step (Lightning's accumulate_grad_batches, Accelerate's "
                "gradient_accumulation_steps), pass accumulate_steps=1 to pycomm; else step "
                f"once every {k} backward passes (pycomm.TrainLoop does)"
            )


class Accumulate:
    """The accumulate stage in front of a hook: ``accumulate_steps``, the fp32 sums, the
    micro-step counter, and the hook function it hands each window's sum to.

    It is part of the hook's state (``state.accumulate``; building it attaches it there), and
    DDP runs it through :func:`accumulate_hook` on that state. The state's ``stats`` count
    ``micro_steps``, ``accumulate_steps`` and ``accumulate_bytes`` (the fp32 sums' bytes), and
    its ``state_dict()`` holds the stage's part under ``"accumulate"`` (the micro-step, the sums
    per parameter mid-window, the parameters used so far in the window).

    Args:
        state: the hook's state (a :class:`~pycomm.hooks.HookState`).
        hook: the hook function that reduces the sum on every k-th micro-step.
        accumulate_steps: k >= 1.
        parameters: the model's trainable parameters, in ``module.parameters()`` order (the
            checkpoint names them by position).
        write_grads: also copy the result into each parameter's ``.grad`` on boundary steps:
            needed with ``find_unused_parameters=True`` and ``gradient_as_bucket_view=False``,
            where DDP leaves the gradient of a parameter unused in that micro-step untouched
            (it would lose the sum of the earlier micro-steps). ``pycomm.wrap`` sets it. A
            parameter that no rank used in any micro-step of the window keeps ``.grad`` as it
            was (None after ``zero_grad()``), as DDP's own ``no_sync()`` accumulation leaves
            it, so the optimizer skips it.
        bucket_view: DDP was built with ``gradient_as_bucket_view=True``. Then an fp32 bucket
            needs no buffer: the gradients are views of it, autograd adds each micro-step into
            them in fp32, and the hook only leaves them alone until the k-th micro-step.

    Example:
        >>> state = pycomm.hooks.hook_spec("int8").state(None)
        >>> params = [p for p in model.parameters() if p.requires_grad]
        >>> Accumulate(state, pycomm.hooks.compressed_hook, 4, params)
        >>> ddp.register_comm_hook(state, accumulate_hook)
    """

    def __init__(
        self,
        state: HookState,
        hook: Callable,
        accumulate_steps: int,
        parameters: Iterable[torch.Tensor],
        write_grads: bool = False,
        bucket_view: bool = False,
    ) -> None:
        check_int("pycomm accumulate", "accumulate_steps", accumulate_steps)
        if state.accumulate is not None:
            raise ValueError(
                f"pycomm accumulate: the {state.hook_name} hook's state already has an "
                "accumulate stage; expected a state of its own for each model"
            )
        self.hook = hook
        self.accumulate_steps = accumulate_steps
        self.params = list(parameters)
        self.write_grads = write_grads
        self.bucket_view = bucket_view
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.micro_step = 0  # backward passes seen
        self._segments: dict[tuple[int, ...], _Segment] = {}
        self._home: dict[int, _Segment] = {}  # parameter index -> segment holding its sum
        self._pending: Optional[dict[int, torch.Tensor]] = None  # loaded sums, placed lazily
        # parameters some rank used earlier in the window the checkpoint was saved in: their
        # gradients, which that run held, do not exist in this process
        self._used_loaded: set[int] = set()
        self.loads = 0  # load_state_dict calls (save_state/load_state see a state skip it)
        self._counters = state.counters  # the state's live counters: the stage's go there too
        self._count()
        state.accumulate = self
        if accumulate_steps > 1:
            _watch(self)
            # the hook sees DDP's k-th iterations alone, after DDP's first (whose buckets DDP
            # rebuilds): the first it sees is a layout a checkpoint may record
            layout = getattr(state, "bucket_layout", None)
            if layout is not None and layout.steps == 0:
                layout.steps = 1

    def _count(self) -> None:
        self._counters["micro_steps"] = self.micro_step
        self._counters["accumulate_steps"] = self.accumulate_steps
        self._counters["accumulate_bytes"] = sum(
            s.buffer.numel() * s.buffer.element_size() for s in self._segments.values()
        )

    def boundary(self) -> bool:
        """Whether the next micro-step is the k-th of its window (the one that communicates)."""
        return self.micro_step % self.accumulate_steps == self.accumulate_steps - 1

    # --- layout ---------------------------------------------------------------------------

    def segment(self, bucket: dist.GradBucket, x: torch.Tensor) -> _Segment:
        params = bucket.parameters()
        try:
            key = tuple(self._index[id(p)] for p in params)
        except KeyError:
            raise ValueError(
                f"pycomm accumulate: bucket {bucket.index()} holds a parameter that is not "
                "among the parameters this state was built with"
            ) from None
        seg = self._segments.get(key)
        if seg is not None:
            return seg
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        if total != x.numel():
            raise RuntimeError(
                f"pycomm accumulate: bucket {bucket.index()} has {x.numel()} elements but its "
                f"parameters {total}"
            )
        seg = _Segment(key, torch.zeros(total, dtype=torch.float32, device=x.device), offsets)
        for i, off, p in zip(key, offsets, params):
            old = self._home.get(i)
            if old is not None:  # DDP re-bucketed mid-window: move this parameter's sum
                o = old.offsets[old.key.index(i)]
                seg.buffer[off : off + p.numel()].copy_(old.buffer[o : o + p.numel()])
                old.live.discard(i)
                if not old.live:
                    del self._segments[old.key]
            elif self._pending is not None and i in self._pending:
                seg.buffer[off : off + p.numel()].copy_(self._pending.pop(i).reshape(-1))
            self._home[i] = seg
        self._segments[key] = seg
        self._count()
        return seg

    def in_place(self, dtype: torch.dtype) -> bool:
        return self.bucket_view and dtype == torch.float32

    def loaded(self) -> bool:
        """Whether sums loaded from a checkpoint are still to be placed or were placed this
        micro-step (the buffers then hold them, not a fresh window)."""
        return self._pending is not None

    def loading(self) -> bool:
        """Whether loaded sums are still waiting to be placed into their buckets."""
        return bool(self._pending)

    def end_micro_step(self, bucket: dist.GradBucket) -> None:
        """After each bucket: at DDP's last one, count the micro-step; loaded sums, all
        placed, are forgotten."""
        if bucket.is_last():
            self.micro_step += 1
            if self._pending is not None and not self._pending:
                self._pending = None
            if self.micro_step % self.accumulate_steps == 0:
                self._used_loaded = set()
            self._counters["micro_steps"] = self.micro_step

    def used(self, i: int, p: torch.Tensor) -> bool:
        """Whether some rank used parameter ``i`` in a micro-step of this window before the
        current one. DDP decides it for every rank alike: after a micro-step it gives a
        gradient (zeros here, or a view of the bucket) to exactly the parameters some rank
        used, and leaves the others' untouched; a resume carries the decision over."""
        return p.grad is not None or i in self._used_loaded

    def place_loaded(self, bucket: dist.GradBucket, x: torch.Tensor) -> None:
        """After a resume mid-window: add the loaded sums of this bucket's parameters (the
        gradients, views of ``x``). A parameter used earlier in the window gets its view as
        its gradient, as it had in the saved run, where DDP would leave it without one when
        no rank uses it again before the window ends."""
        off = 0
        for p in bucket.parameters():
            i = self._index[id(p)]
            t = self._pending.pop(i, None)
            view = x[off : off + p.numel()]
            if t is not None:
                view.add_(t.reshape(-1).to(x.device))
            if p.grad is None and i in self._used_loaded:
                p.grad = view.view(p.shape)
            off += p.numel()

    def place_loaded_sparse(self, bucket: dist.GradBucket) -> None:
        """After a resume mid-window: add the loaded sum into a sparse gradient."""
        (p,) = bucket.parameters()
        t = self._pending.pop(self._index[id(p)], None)
        if t is not None:
            bucket.buffer().add_(t.to(bucket.buffer().device))

    # --- checkpoint -------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint's stage must match: k and the parameters' shapes."""
        return {
            "accumulate_steps": self.accumulate_steps,
            "parameters": [tuple(p.shape) for p in self.params],
        }

    def state_dict(self) -> dict[str, Any]:
        """The micro-step counter, the sums per parameter (only mid-window) and the parameters
        some rank used so far in the window (mid-window only)."""
        sums: dict[int, torch.Tensor] = {}
        mid = self.micro_step % self.accumulate_steps != 0
        if mid:
            for i, seg in self._home.items():
                o = seg.offsets[seg.key.index(i)]
                sums[i] = seg.buffer[o : o + self.params[i].numel()].clone()
            for i, p in enumerate(self.params):  # sums kept in the gradients themselves
                if i in sums or p.grad is None:
                    continue
                if p.grad.is_sparse:
                    sums[i] = p.grad.detach().coalesce().float().clone()
                elif self.in_place(p.dtype):
                    sums[i] = p.grad.detach().reshape(-1).float().clone()
            if self._pending:
                sums.update({i: t.clone() for i, t in self._pending.items()})
        used = [i for i, p in enumerate(self.params) if self.used(i, p)] if mid else []
        return {
            "accumulate_steps": self.accumulate_steps,
            "micro_step": self.micro_step,
            "sums": sums,
            "used": used,
        }

    def check_saved(self, saved: dict[str, Any]) -> None:
        """Refuse (ValueError naming what differs) a saved stage of another k, or whose sums
        do not fit the parameters."""
        k = saved.get("accumulate_steps", self.accumulate_steps)
        if k != self.accumulate_steps:
            raise ValueError(
                f"pycomm accumulate: the checkpoint's stage has accumulate_steps={k}, this "
                f"model's accumulate_steps={self.accumulate_steps}; expected the same k"
            )
        for i, t in saved["sums"].items():
            if not 0 <= i < len(self.params) or t.numel() != self.params[i].numel():
                want = self.params[i].numel() if 0 <= i < len(self.params) else "no parameter"
                raise ValueError(
                    f"pycomm accumulate: the checkpoint's sum of parameter {i} has {t.numel()} "
                    f"elements, expected {want}"
                )

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.check_saved(saved)
        self.loads += 1
        self.micro_step = int(saved["micro_step"])
        self._segments, self._home = {}, {}
        self._pending = {i: t.detach().to(torch.float32).clone() for i, t in saved["sums"].items()}
        # checkpoints without the list: every parameter with a sum counts as used
        self._used_loaded = set(saved.get("used", saved["sums"].keys()))
        self._count()


def save_state(state: Any) -> dict[str, Any]:
    """``state.state_dict()``, with the stage's part under ``"accumulate"`` even where a
    user's ``state_dict()`` does not extend the base's (``pycomm.checkpoint`` saves this)."""
    saved = state.state_dict()
    stage = getattr(state, "accumulate", None)  # (pycomm.LocalSGD and DiLoCo have none)
    if stage is not None and "accumulate" not in saved:
        saved = {**saved, "accumulate": stage.state_dict()}
    return saved


def check_state(state: Any, saved: dict[str, Any]) -> None:
    """``state.check_fingerprint(saved)``, and the stage's part checked against the state's
    stage whatever the state's own check covers: a ValueError when one side accumulates and
    the other does not, or when the two stages differ."""
    state.check_fingerprint(saved)
    stage, part = getattr(state, "accumulate", None), saved.get("accumulate")
    if (stage is None) != (part is None):
        mine = "none" if stage is None else f"accumulate_steps={stage.accumulate_steps}"
        theirs = "none" if part is None else f"accumulate_steps={part.get('accumulate_steps')}"
        raise ValueError(
            f"{getattr(state, 'where', 'pycomm')}: the checkpoint's accumulate stage is {theirs}, "
            f"this model's is {mine}; expected the same accumulate_steps"
        )
    if stage is not None:
        stage.check_saved(part)


def load_state(state: Any, saved: dict[str, Any]) -> None:
    """``state.load_state_dict(saved)``, and the stage's part loaded where a user's
    ``load_state_dict()`` does not extend the base's (``pycomm.checkpoint`` loads this)."""
    stage = getattr(state, "accumulate", None)
    loads = None if stage is None else stage.loads
    state.load_state_dict(saved)
    if stage is not None and stage.loads == loads:
        stage.load_state_dict(saved["accumulate"])


def upgrade(saved: Any) -> Any:
    """A hook state saved while the stage wrapped the hook's state (its fingerprint's hook
    ``"accumulate(<hook>)"``, the hook's own state under ``"inner"``), as the hook's state
    with the stage's part under ``"accumulate"``; any other value as it is."""
    if not isinstance(saved, dict) or "inner" not in saved:
        return saved
    fingerprint = upgrade_fingerprint(saved.get("fingerprint"))
    if fingerprint is saved.get("fingerprint"):
        return saved
    stage = {k: saved[k] for k in ("micro_step", "sums", "used") if k in saved}
    stage["accumulate_steps"] = fingerprint["accumulate"]["accumulate_steps"]
    return {**saved["inner"], "fingerprint": fingerprint, "accumulate": stage}


def upgrade_fingerprint(fingerprint: Any) -> Any:
    """The fingerprint of a state :func:`upgrade` reads, as the hook's own now has it."""
    hook = fingerprint.get("hook") if isinstance(fingerprint, dict) else None
    if not (isinstance(hook, str) and hook.startswith("accumulate(")):
        return fingerprint
    stage = {k: fingerprint[k] for k in ("accumulate_steps", "parameters")}
    return {**fingerprint["inner"], "accumulate": stage}


def accumulate_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The accumulate stage (``state.accumulate``, an :class:`Accumulate`) in front of the
    hook: add the bucket into its fp32 sum, and only on every ``accumulate_steps``-th
    micro-step hand the sum to the hook (``stage.hook(state, bucket)``), returning the reduced
    sum; else return zeros.

    The gradient the optimizer sees after k micro-steps is what one step on the k times larger
    batch gives, when each micro-batch's loss is scaled by 1/k (``pycomm.TrainLoop`` does).

    Args:
        state: the hook's state, with its stage (``pycomm.wrap(..., accumulate_steps=k)``
            builds it).
        bucket: the DDP bucket that is ready.

    Returns:
        On a window's last micro-step, the hook's future of the reduced sum; on the others, a
        completed future of zeros (or of the running sum held in the gradients when they are
        views of the bucket).

    Example:
        >>> ddp = pycomm.wrap(model, hook="int8", accumulate_steps=4)
        >>> pycomm.hook_state(ddp).stats["accumulate_bytes"]
    """
    stage = state.accumulate
    if stage is None:
        raise RuntimeError(
            f"pycomm accumulate: the {state.hook_name} hook's state has no accumulate stage; "
            "expected one built by pycomm.wrap(..., accumulate_steps=k) or Accumulate(state, ...)"
        )
    hook = stage.hook
    k = stage.accumulate_steps
    first = stage.micro_step % k == 0
    final = stage.boundary()
    if is_sparse(bucket):
        # DDP hands the sparse gradient itself, and autograd adds each micro-step into it, as
        # under no_sync(): leave it until the k-th, whose hook reduces it exactly
        try:
            if stage.loading():
                stage.place_loaded_sparse(bucket)
            if not final:
                return completed(bucket.buffer())
            return hook(state, bucket)
        finally:
            stage.end_micro_step(bucket)
    x = check_bucket(f"{state.hook_name} (accumulate)", bucket)
    if stage.in_place(x.dtype):
        try:
            if stage.loading():
                stage.place_loaded(bucket, x)
            if not final:  # the gradients (views of x) hold the sum so far: leave them
                return completed(x)
            return hook(state, bucket)
        finally:
            stage.end_micro_step(bucket)
    try:
        seg = stage.segment(bucket, x)
        if first and not stage.loaded():
            seg.buffer.copy_(x)
        else:
            ops.accumulate_(seg.buffer, x)
        if not final:
            x.zero_()
            return completed(x)
        # decided now: the window's end (end_micro_step) forgets what a resume carried over
        used = [stage.used(i, p) for i, p in zip(seg.key, bucket.parameters())]
        fut = hook(state, _Fp32Bucket(bucket, seg.buffer))
    finally:
        stage.end_micro_step(bucket)

    def write_back(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()
        x.copy_(out)
        if stage.write_grads:
            for p, off, was_used in zip(bucket.parameters(), seg.offsets, used):
                if not was_used:  # no rank used it in the window: DDP leaves it untouched
                    continue
                src = x[off : off + p.numel()].view(p.shape)
                if p.grad is None:
                    p.grad = src.clone()
                else:
                    p.grad.copy_(src)
        return x

    return fut.then(write_back)
