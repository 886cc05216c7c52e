"""The DDP side: the base of every pycomm DDP hook state, and the state and hook function of
every pycomm DDP hook but PowerSGD and ``auto``, over the codec layer's engine
(:mod:`pycomm.codec.engine`).

- :class:`HookState`: what every hook keeps between calls (stats, config, checkpointable
  state), and :func:`unbound`.
- :func:`per_bucket`: the routine every hook runs on a bucket (the ranks' states compared
  after a load, the sparse case, the dtype, one rank, the end of the step).
- :class:`AllreduceState` and :func:`allreduce_hook`: DDP's own reduction, with byte
  accounting (flat, or exact on the node hierarchy).
- :class:`CompressedState` and :func:`compressed_hook`: every registered codec's hook (fp16,
  bf16, int8, fp8, int4, onebit and users' codecs): its options, warm-up, node hierarchy,
  advice, stats and checkpoints; past its warm-up each bucket goes to
  :meth:`Engine.all_reduce <pycomm.codec.engine.Engine.all_reduce>`.
- :class:`BucketLayout`: a compression hook's own bucket layout.

With the model's parameters bound (``pycomm.wrap`` binds them), the hook names DDP's buckets
by their parameters' positions and keeps DDP's buckets as they were at the first compressed
step. Residuals, blocks and chunks follow that layout, so a freshly built DDP that buckets its
first iteration differently (a resume) is re-bucketed into it and reduces bit for bit as the
uninterrupted run would. Before the first compressed step, the layout a checkpoint records is
DDP's latest one from a step after DDP's first (DDP rebuilds its buckets after its first
iteration), so a checkpoint taken during the exact warm-up, or just before the first compressed
step, resumes into the layout the uninterrupted run compresses with.
"""

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.codec.agree import check_saved, dtype_names, with_strict_skip
from pycomm.codec.codecs import Codec
from pycomm.codec.config import (
    FLOATS,
    RESIDUAL_DTYPES,
    build_codec,
    check_hierarchy,
    engine_options,
)
from pycomm.codec.config import codec_options as resolved_codec_options
from pycomm.codec.engine import Engine, add_call, completed, exact_mean, ring_bytes
from pycomm.codec.groups import compare_steps, phase_groups
from pycomm.codec.registry import ENGINE_OPTIONS, codec_identity
from pycomm.codec.residuals import ResidualStore, check_residuals
from pycomm.exchange import hierarchy as hier
from pycomm.hooks import advice

logger = logging.getLogger(__name__)

_UNBOUND: contextvars.ContextVar[bool] = contextvars.ContextVar("pycomm_unbound", default=False)


@contextlib.contextmanager
def unbound() -> Iterator[None]:
    """Build hook states without binding them to their group, even where the group exists:
    binding may create process groups (a collective), so ``pycomm.wrap``, ``register`` and
    ``pycomm.fsdp.compress`` build the state unbound, compare every rank's resolved
    configuration (:func:`pycomm.hooks.config.resolved_config`), and bind only once the ranks
    agree.

    Example:
        >>> with pycomm.hooks.ddp.unbound():
        ...     state = pycomm.hooks.hook_spec("int8").state(None, block=32)
        >>> state.bind()
    """
    token = _UNBOUND.set(True)
    try:
        yield
    finally:
        _UNBOUND.reset(token)


class FrontStage(Protocol):
    """A stage in front of a hook (the accumulate stage, :mod:`pycomm.hooks.accumulate`):
    its part of the hook state's fingerprint, state_dict and checks, kept by the base."""

    def fingerprint(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def check_saved(self, saved: dict[str, Any]) -> None: ...


class HookState:
    """Base of every pycomm hook state.

    ``stats`` counts ``steps`` (iterations, one per last bucket), ``buckets`` (hook calls),
    ``collectives`` (collective calls issued), ``bytes_sent`` (the payload this rank put on the
    wire), ``bytes_fp32`` (what an fp32 ring all-reduce of the same buckets sends) and
    ``compression`` (bytes_fp32 / bytes_sent): running totals over every step so far, exact
    warm-up steps included (a compression hook adds ``codec_compression``, its compressed
    exchanges' alone).

    The contract a subclass of one's own keeps (docs/custom_hooks.md, "The contracts"): built
    as ``State(process_group, **options)``, possibly before the group exists; :meth:`bind`
    once the group does (a subclass sets up in ``_bound``); :meth:`options` is compared across
    ranks by ``pycomm.wrap``/``register`` and stored in :meth:`fingerprint`; :meth:`state_dict`
    carries the rank and world size it belongs to and :meth:`load_state_dict` refuses another
    hook, config, rank or world size; :meth:`count` keeps ``stats``; ``grad_dtypes`` names
    the gradient dtypes it reduces (None: any floating dtype). One state serves one DDP
    model. Pass it as ``pycomm.wrap(model, hook=(state, hook_fn))``.

    Example:
        >>> spec = pycomm.hooks.hook_spec("allreduce")
        >>> ddp.register_comm_hook(spec.state(process_group=None), spec.hook)
        >>> state.stats["bytes_sent"]
    """

    hook_name = "base"
    # DDP bucket size pycomm.wrap picks for this hook when the caller gives none (None: DDP's)
    default_bucket_cap_mb: Optional[float] = None
    # The gradient dtypes the hook reduces (None: every floating dtype). pycomm.register
    # refuses a model with another, naming the parameter, before the first backward.
    grad_dtypes: Optional[tuple[torch.dtype, ...]] = None
    # The accumulate stage in front of the hook (pycomm.wrap(..., accumulate_steps=k) builds
    # it): its part of fingerprint(), state_dict() and stats is kept here, in the base.
    accumulate: Optional[FrontStage] = None

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.process_group = process_group
        # Bound to the group's size and this rank now if the group exists, else at the first
        # hook call (or pycomm.register): frameworks build the state before the group.
        self._world_size: Optional[int] = None
        self._rank: Optional[int] = None
        if dist.is_available() and dist.is_initialized() and not _UNBOUND.get():
            self.bind()
        self.node_buffers: dict[tuple, dict] = {}  # the node hierarchy's, per bucket
        # the steps of the state as the next bucket finds it (0: fresh; a loaded state's),
        # compared across the ranks there once (check_resumed)
        self._resumed_at: Optional[int] = 0
        self._stats: dict[str, Any] = {
            "steps": 0,
            "buckets": 0,
            "collectives": 0,
            "bytes_sent": 0,
            "bytes_fp32": 0,
            "compression": 1.0,
        }

    @property
    def where(self) -> str:
        """How this hook's messages start: ``pycomm <hook> hook``."""
        return f"pycomm {self.hook_name} hook"

    def bind(self) -> None:
        """Bind the state to its process group (world size, rank, and what a subclass needs,
        such as the compressed hooks' phase groups). Idempotent; every rank must bind at the
        same point (the first hook call, or registration), since it may create groups.

        Example:
            >>> state = pycomm.hooks.hook_spec("int8").state(None)  # no group yet: unbound
            >>> pycomm.init(); state.bind()  # or let the first hook call bind it
        """
        if self._world_size is not None:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"pycomm {self.hook_name} hook: the state is used before the process group "
                "exists; call pycomm.init() (or let the framework start it) first"
            )
        self._rank = dist.get_rank(self.process_group)
        self._world_size = dist.get_world_size(self.process_group)
        self._bound()

    def _bound(self) -> None:
        """What a subclass sets up once the group is known (called once, from :meth:`bind`)."""

    @property
    def world_size(self) -> int:
        """The process group's size (binds the state on first use)."""
        if self._world_size is None:
            self.bind()
        return self._world_size

    @property
    def rank(self) -> int:
        """This rank in the process group (binds the state on first use)."""
        if self._rank is None:
            self.bind()
        return self._rank

    @property
    def stats(self) -> dict[str, Any]:
        """The counters (a live dict)."""
        return self._stats

    @property
    def counters(self) -> dict[str, Any]:
        """The counters as they stand, without what reading :attr:`stats` does first (a
        compression hook folds its decodes' results into them, which on an accelerator waits
        for the device): the byte and call counts are current, the decode counts
        (``nonfinite_buckets``) may lag. A live dict; read it, do not write it (the hook's
        parts and its accumulate stage count into it).

        Example:
            >>> sent = state.counters["bytes_sent"]  # no wait for the device
        """
        return self._stats

    def options(self) -> dict[str, Any]:
        """The hook's configuration: compared across ranks and stored in the fingerprint."""
        return {}

    def identity(self) -> dict[str, Any]:
        """What the hook is, beside its :meth:`options`: its state class, and what a subclass
        adds (a codec's class and format). Every rank must agree on it and on the options
        (:func:`pycomm.hooks.config.resolved_config`)."""
        cls = type(self)
        return {"state class": f"{cls.__module__}.{cls.__qualname__}"}

    def optimizer_advice(self, optimizer: Any) -> Optional[str]:
        """Why this hook, as configured, is known to train worse with ``optimizer`` and what to
        use instead, or None. The single source of that warning: ``pycomm.TrainLoop`` warns
        with it when built, and any other loop at the optimizer's first step
        (:mod:`pycomm.hooks.advice`), once per hook state and optimizer."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What must be equal for state to be shared across ranks or loaded from a checkpoint
        (with an accumulate stage, its k and parameter shapes under ``"accumulate"``)."""
        fp = {"hook": self.hook_name, "options": self.options(), "world_size": self.world_size}
        if self.accumulate is not None:
            fp["accumulate"] = self.accumulate.fingerprint()
        return fp

    def count(
        self,
        bucket: dist.GradBucket,
        bytes_sent: int,
        collectives: int = 1,
        bytes_fp32: Optional[int] = None,
        **levels: int,
    ) -> None:
        """Account one hook call on ``bucket`` that put ``bytes_sent`` bytes on the wire in
        ``collectives`` collective calls; ``levels`` split them, e.g. ``bytes_intra=...,
        bytes_inter=...`` (added to those counters). ``bytes_fp32``: what DDP's own reduction
        of the bucket sends, where that is not an fp32 ring all-reduce of its elements (a
        sparse gradient's)."""
        numel, last = bucket.buffer().numel(), bucket.is_last()
        add_call(self._stats, self.world_size, numel, bytes_sent, collectives, bytes_fp32, last,
                 **levels)  # fmt: skip

    def reduced_sqnorm(self) -> Optional[float]:
        """The squared L2 norm of the latest step's reduced gradients when the hook computed it
        in its decode pass (no extra pass over the gradients); None when it did not."""
        return None

    def scale_residuals(self, factor: float) -> None:
        """Multiply what the hook carries from step to step in the gradients' units (its
        error-feedback residuals) by ``factor``. ``TrainLoop`` calls it between two steps when
        a GradScaler's scale changes (by ``factor``), so that they stay in the units of the
        next step's scaled gradients. A hook with no such state does nothing (the default).

        Example:
            >>> state.scale_residuals(0.5)  # the loss scale was halved
        """

    def state_dict(self) -> dict[str, Any]:
        """Counters, config fingerprint, and the rank and world size the state belongs to
        (error-feedback residuals differ per rank), and an accumulate stage's part under
        ``"accumulate"``; subclasses add their tensors to it."""
        out = {
            "fingerprint": self.fingerprint(),
            "rank": self.rank,
            "world_size": self.world_size,
            "stats": dict(self.stats),
        }
        if self.accumulate is not None:
            out["accumulate"] = self.accumulate.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another hook or config is refused."""
        self.check_fingerprint(state)
        self._stats.clear()  # in place: a state's parts keep counting into this dict
        self._stats.update(state["stats"])
        steps = self._stats.get("steps")
        self._resumed_at = steps if isinstance(steps, int) else None
        if self.accumulate is not None:
            self.accumulate.load_state_dict(state["accumulate"])

    def check_resumed(self, device: torch.device) -> None:
        """At the hook's first bucket, and once after each :meth:`load_state_dict`, before
        any of its collectives: the ranks compare the steps their states had run (0 for a
        fresh one), in one small all-reduce, and a difference is a ValueError on every rank.
        Each rank loads its own state (``load_state_dict``, ``checkpoint.load_hook_state``),
        and ranks that loaded states of different saves, or some a state and some none, would
        otherwise pair a warm-up's collectives with a compressed step's (a hang until the
        group's timeout) or train apart.

        Example:
            >>> state.check_resumed(bucket.buffer().device)  # pycomm's per-bucket routine
        """
        steps, self._resumed_at = getattr(self, "_resumed_at", None), None
        if steps is not None and self.world_size > 1:
            compare_steps(self.where, steps, self.process_group, device)

    def check_fingerprint(self, state: dict[str, Any]) -> None:
        """Refuse (ValueError naming the field) a checkpoint of another hook or config, or
        the state of another rank."""
        saved = state.get("fingerprint")
        hook = saved.get("hook") if isinstance(saved, dict) else None
        if isinstance(hook, str) and hook.startswith("accumulate("):
            raise ValueError(
                f"pycomm {self.hook_name} hook: the state was saved by an earlier pycomm (its "
                f"hook is {hook!r}, the accumulate stage around the hook's state); load it with "
                "pycomm.checkpoint.load, load_hook_state or load_rank_state, which read it"
            )
        check_saved(self.hook_name, state, self.fingerprint(), self.rank, self.world_size)
        if self.accumulate is not None and "accumulate" in state:
            self.accumulate.check_saved(state["accumulate"])


def accepts_dtype(state: Any, dtype: torch.dtype) -> bool:
    """Whether a hook state (or state class) reduces gradients of ``dtype``."""
    dtypes = getattr(state, "grad_dtypes", None)
    return dtype.is_floating_point if dtypes is None else dtype in dtypes


def is_sparse(bucket: dist.GradBucket) -> bool:
    """Whether ``bucket`` holds a sparse gradient (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``): DDP gives each such gradient a bucket of its own, whose
    buffer is the gradient itself. Every pycomm hook reduces it exactly
    (:func:`pycomm.hooks.ddp.sparse_allreduce`), as DDP does."""
    return bucket.buffer().is_sparse


def check_bucket(hook: str, bucket: dist.GradBucket) -> torch.Tensor:
    """The bucket's flat buffer, or an error naming the hook, the dtype and the bucket."""
    t = bucket.buffer()
    if not t.is_floating_point() or t.layout != torch.strided:
        raise TypeError(
            f"pycomm {hook} hook: bucket {bucket.index()} has dtype {t.dtype} and layout "
            f"{t.layout}, expected a dense floating-point gradient bucket"
        )
    return t


def surfaced(fut: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """``fut``, with a failure DDP can read: ``Future.set_exception`` keeps the exception as
    the future's value, raised by Python's ``wait()`` alone, and DDP's reducer, which reads
    the value in C++, would fail with "Unable to cast ... to Tensor" instead of the error. A
    callback that raises fails its future for C++ too, so the hook hands DDP this one."""
    return fut.then(_value)


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.wait()


def exact_allreduce(
    state: HookState, bucket: Any, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> torch.futures.Future[torch.Tensor]:
    """The exact mean as DDP takes it: scale by 1/N (DDP's own rounding), all-reduce on
    ``group`` asynchronously; the bytes counted by ``state.count(bucket, ...)``."""
    state.count(bucket, ring_bytes(tensor.numel() * tensor.element_size(), state.world_size))
    return exact_mean(tensor, state.world_size, group)


# reduce(bucket, x, index) -> a future of x reduced: the exchange, on hook bucket ``index``
Reduce = Callable[[Any, torch.Tensor, int], torch.futures.Future]


class AllreduceState(HookState):
    """State of :func:`allreduce_hook`: the process group and the stats.

    ``hierarchy``: ``"auto"`` (default: ``"node"`` when the ranks span several nodes with
    several ranks on each, else ``"flat"``), ``"flat"`` (one all-reduce over the group) or
    ``"node"`` (fp32 reduce-scatter inside each node, all-reduce across nodes on 1/L of the
    bucket, all-gather inside the node; see :mod:`pycomm.exchange.hierarchy`).

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
        self.hierarchy = check_hierarchy(self.where, hierarchy)
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
            return hier.node_reduce(plan, tensor, bucket.index(), cross, **node_args(state, bucket),
                                    prescale=1.0 / state.world_size)  # fmt: skip
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


class CompressedState(HookState):
    """State of a compression hook: its options, the engine (codec, residuals, buffers,
    phase groups), the DDP side (warm-up, bucket layout, node hierarchy, advice), counters.

    Options (all hooks; docs/reference.md, "The hooks", has what each does): ``start_iter``
    (default 2, onebit 20; >= 2, DDP rebuilds its buckets after its first iteration),
    ``error_feedback``, ``local_feedback`` (default True, onebit False), ``residual_dtype``
    (``"float32"`` or ``"bfloat16"``), ``strict_skip`` (a second copy of the residuals) and
    ``hierarchy``. ``stats`` adds to :class:`HookState`'s ``nonfinite_buckets``,
    ``residual_bytes``, ``rebucketed_steps`` and the codec's own ``codec_bytes_sent``,
    ``codec_bytes_fp32``, ``codec_compression`` (its compressed exchanges alone).
    """

    grad_dtypes = FLOATS  # the engine encodes from fp32, bf16 or fp16 buckets
    default_error_feedback = True
    default_local_feedback = True
    default_start_iter = 2
    option_names: tuple = ENGINE_OPTIONS

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, **options: Any):
        hook = self.hook_name
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            raise ValueError(
                f"pycomm {hook} hook: unknown option {unknown[0]!r}; valid options: "
                f"{', '.join(self.option_names)}"
            )
        # before binding, which resolves it
        self.hierarchy = check_hierarchy(f"pycomm {hook} hook", options.get("hierarchy", "auto"))
        super().__init__(process_group)
        self.start_iter = check_int(
            self.where, "start_iter", options.get("start_iter", self.default_start_iter), 2
        )
        defaults = {
            "error_feedback": self.default_error_feedback,
            "local_feedback": self.default_local_feedback,
        }
        engine_opts = engine_options(self.where, options, defaults)
        self.iter = 0
        self._fold_next = False  # the next hook call starts a new step: commit the last one
        self._stats.update(nonfinite_buckets=0, residual_bytes=0, rebucketed_steps=0)
        # the exchange (codec, residuals kept per bucket and committed once a step is finite,
        # buffers, phase groups) is the engine's; the hook's own parts: its bucket layout over
        # the bound parameters, the warm-up, the node hierarchy, the optimizer advice
        self.engine = Engine(self.where, self.make_codec(options), self._stats, **engine_opts,
                             nonfinite="nonfinite_buckets")  # fmt: skip
        if getattr(self, "_stage", None) is not None:
            self.engine.bind(self._stage, self.exchange_size)
        self.bucket_layout = BucketLayout(self.where, self._stats)
        # DDP buckets whose parameters were handed to the optimizer check (pycomm.hooks.advice)
        # when no parameters were bound: a state registered with plain register_comm_hook
        self._advice_buckets: set[int] = set()

    node_plan: Optional[hier.NodePlan] = None  # the node hierarchy, when it resolves to it

    # --- the engine's parts, as the hook and its callers read them -----------------------

    @property
    def codec(self) -> Codec:
        """The hook's codec (the engine's)."""
        return self.engine.codec

    @codec.setter
    def codec(self, codec: Codec) -> None:
        self.engine.codec = codec

    @property
    def store(self) -> ResidualStore:
        """The error-feedback residuals (the engine's)."""
        return self.engine.store

    @property
    def error_feedback(self) -> bool:
        return self.engine.error_feedback

    @property
    def local_feedback(self) -> bool:
        return self.engine.local_feedback

    @property
    def residual_dtype(self) -> torch.dtype:
        return self.engine.residual_dtype

    @property
    def strict_skip(self) -> bool:
        return self.store.strict

    @property
    def residuals(self) -> dict[tuple, dict[str, torch.Tensor]]:
        """Bucket key -> {"r1", "r2"}: the error-feedback residuals as of the last finite step
        whose backward has returned (a step's residuals are kept once all its buckets are
        decoded; read in the middle of a backward, the previous step's)."""
        if self.store.touched and self._fold_next:
            self.commit()
        return self.store.residuals

    def scale_residuals(self, factor: float) -> None:
        for res in self.residuals.values():  # (committed first: the latest step's)
            for t in res.values():
                t.mul_(factor)
        for res in (self.store.pending or {}).values():  # loaded, not placed yet
            for t in res.values():
                t.mul_(factor)

    @property
    def layout(self) -> Optional[list[tuple[int, ...]]]:
        """The hook's buckets as parameter positions (None before the first compressed step
        or without bound parameters)."""
        return self.bucket_layout.buckets

    @property
    def last_sqnorm(self) -> float:
        return self.store.last_sqnorm

    def _bound(self) -> None:
        if self.world_size > 1 or self.hierarchy == "node":  # "node" on one rank: refused
            self.node_plan = hier.resolve(self.hook_name, self.process_group, self.hierarchy)
            # with the node hierarchy the exchange runs across nodes only, on its own groups
            plan = self.node_plan
            stage = phase_groups(self.process_group) if plan is None else plan.cross
            if hasattr(self, "engine"):
                self.engine.bind(stage, self.exchange_size)
            else:  # bound while HookState.__init__ runs: the engine comes next
                self._stage = stage

    @property
    def exchange_size(self) -> int:
        """Ranks in the compressed exchange: the group's, or the nodes' with the hierarchy."""
        return self.world_size if self.node_plan is None else self.node_plan.nodes

    def count_exchange(self, bucket: dist.GradBucket, nbytes: int, collectives: int) -> None:
        """Account one compressed exchange of ``bucket`` that sends ``nbytes`` in the totals,
        which the node hierarchy counts itself (its exact in-node stages included)."""
        if self.node_plan is None:
            self.count(bucket, nbytes, collectives=collectives)

    def exchange(
        self,
        bucket: dist.GradBucket,
        x: torch.Tensor,
        index: Optional[int] = None,
        step: Optional[int] = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """The compressed exchange of ``x`` (``bucket``'s buffer, a bucket of the hook's
        layout, or the node hierarchy's shard) through the engine, as the hook's bucket
        ``index`` (default DDP's) for the hook's ``step`` (default the current one: the node
        hierarchy issues it from a callback, possibly once the hook has moved on), counted in
        the hook's totals."""
        index = bucket.index() if index is None else index
        step = self.iter if step is None else step

        def count(nbytes: int, collectives: int) -> None:
            self.count_exchange(bucket, nbytes, collectives)

        return self.engine.all_reduce(x, (index, x.numel(), str(x.dtype)), step, count)

    def bind_parameters(self, params: list[torch.Tensor]) -> None:
        """The model's trainable parameters in ``module.parameters()`` order: names buckets
        by their parameters' positions (see :attr:`layout`). ``pycomm.wrap`` calls it.

        Example:
            >>> state.bind_parameters([p for p in model.parameters() if p.requires_grad])
        """
        self.bucket_layout.bind(params)
        if advice.gives_advice(self):
            advice.watch(self, self.bucket_layout.params)

    def watch_bucket(self, bucket: dist.GradBucket) -> None:
        """Without bound parameters (a plain ``register_comm_hook``), hand each bucket's
        parameters to the optimizer check (:mod:`pycomm.hooks.advice`) once."""
        if self.bucket_layout.bound or bucket.index() in self._advice_buckets:
            return
        self._advice_buckets.add(bucket.index())
        if advice.gives_advice(self):
            advice.watch(self, bucket.parameters())

    def fingerprint(self) -> dict[str, Any]:
        fp = super().fingerprint()
        fp["topology"] = hier.fingerprint(self.node_plan)
        if self.bucket_layout.bound:
            fp["parameters"] = [list(p.shape) for p in self.bucket_layout.params]
        return fp

    # A registered codec's factory (pycomm.hooks.register_hook(name, codec=...)): its keyword
    # parameters are the hook's codec options, and make_codec calls it with them.
    codec_factory: Optional[Any] = None
    codec_option_names: tuple = ()

    def make_codec(self, options: dict[str, Any]) -> Codec:
        """The codec of this state for ``options`` (the subclass's format). The default
        calls :attr:`codec_factory` with the codec's own options (set by ``register_hook``)."""
        if self.codec_factory is None:
            raise NotImplementedError(f"{type(self).__name__} has no codec_factory")
        codec, self.codec_kwargs = build_codec(
            self.where, self.codec_factory, self.codec_option_names, options
        )
        return codec

    def codec_options(self) -> dict[str, Any]:
        """A registered codec's options as this state runs them (its factory's defaults
        filled in): part of :meth:`options`, so compared across ranks and checkpointed."""
        if self.codec_factory is None:
            return {}
        given = getattr(self, "codec_kwargs", {})
        return resolved_codec_options(self.codec_factory, self.codec_option_names, given)

    def identity(self) -> dict[str, Any]:
        """The state class, and the codec's class and format (:func:`codec_identity`)."""
        return {**super().identity(), **codec_identity(self.codec)}

    def options(self) -> dict[str, Any]:
        return {
            "start_iter": self.start_iter,
            "error_feedback": self.error_feedback,
            "local_feedback": self.local_feedback,
            "residual_dtype": RESIDUAL_DTYPES[self.residual_dtype],
            "strict_skip": self.strict_skip,
            "hierarchy": self.hierarchy,
            **self.codec_options(),
        }

    # --- layout ------------------------------------------------------------------------

    def new_step(self) -> bool:
        """Called at every hook call: at the first of a step, commit the previous step (its
        decodes are all done by then) and return True."""
        if not self._fold_next:
            return False
        self.commit()
        self._fold_next = False
        self.bucket_layout.end_step()
        return True

    def end_step(self) -> None:
        """Called after DDP's last bucket of a step."""
        self.iter += 1
        self._fold_next = True

    def commit(self) -> None:
        """End of a step (all its buckets decoded): keep its new residuals unless some bucket
        came out non-finite (see :class:`ResidualStore`)."""
        self.store.commit(self.iter - 1, self.engine.device)

    # --- stats -------------------------------------------------------------------------

    def fold(self) -> None:
        self.store.fold()

    @property
    def stats(self) -> dict[str, Any]:
        self.fold()
        return self._stats

    def reduced_sqnorm(self) -> Optional[float]:
        """The squared norm of the latest step's reduced gradients, summed over its buckets'
        decode passes; None after a warm-up (exact all-reduce) step, on one rank, or with the
        node hierarchy (each rank decodes only its shard)."""
        self.fold()
        last = self.iter - 1
        if self.world_size == 1 or last < self.start_iter or self.node_plan is not None:
            return None
        return self.store.sqnorm.get(last)

    # --- checkpoint --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.store.touched and not self._fold_next:
            raise RuntimeError(
                f"pycomm {self.hook_name} hook: state_dict() in the middle of a step; call it "
                "after backward() has returned"
            )
        if self.store.touched:
            self.commit()
        saved = self.bucket_layout.saved()
        return {
            **super().state_dict(),
            "iter": self.iter,
            "residuals": self.store.snapshot(),
            "layout": None if saved is None else [list(k) for k in saved],
        }

    def check_fingerprint(self, state: dict[str, Any]) -> None:
        super().check_fingerprint(with_strict_skip(state, self.strict_skip))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        loaded = state.get("residuals", {})
        check_residuals(self.where, self.engine, loaded)
        layout = state.get("layout")
        self.bucket_layout.load(layout)  # checked before anything changes
        self.iter = int(state["iter"])
        self.store.load(loaded)


def compressed_hook(
    state: CompressedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group through the state's codec: the one hook function of
    every registered codec, pycomm's and users' alike. The first ``state.start_iter``
    iterations use the exact fp32 all-reduce.

    Args:
        state: a registered codec hook's state (``pycomm.hooks.hook_spec(name).state``, a
            :class:`CompressedState` subclass): codec, options, residuals, counters.
        bucket: the DDP bucket that is ready: its flat buffer and the parameters it holds.

    Returns:
        A future of the reduced bucket buffer (same shape and dtype), which DDP copies into
        the parameters' gradients;
        identical on every rank.

    Example:
        >>> state = pycomm.hooks.hook_spec("int8").state(process_group=None, block=64)
        >>> ddp.register_comm_hook(state, pycomm.hooks.compressed_hook)
    """

    def begin() -> None:
        state.new_step()  # at a step's first bucket: the previous step is committed
        if not is_sparse(bucket):
            state.watch_bucket(bucket)

    def dense(x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        if state.bucket_layout.bound:
            state.bucket_layout.observe(bucket)
        if state.node_plan is not None:
            return _node(state, bucket, x)
        if state.iter < state.start_iter:
            group = state.engine.phases.groups[0]
            if state.bucket_layout.loaded:  # resumed in the warm-up: the saved layout's sums
                exact = lambda b, t, _i: exact_allreduce(state, b, t, group)  # noqa: E731
                return state.bucket_layout.run(bucket, x, exact)
            return exact_allreduce(state, bucket, x, group)
        if state.bucket_layout.bound:
            return state.bucket_layout.run(bucket, x, state.exchange)
        return state.exchange(bucket, x)

    return per_bucket(state, bucket, dense, begin=begin, end=state.end_step)


def node_args(state: HookState, bucket: Any) -> dict[str, Any]:
    """What :func:`pycomm.exchange.hierarchy.node_reduce` keeps and counts for a DDP bucket:
    the state's node buffers and its count of ``bucket``."""

    def count(nbytes: int, **kw: int) -> None:
        state.count(bucket, nbytes, **kw)

    return {"buffers": state.node_buffers, "count": count}


def _node(state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor):
    """The hook on the node hierarchy (pycomm.exchange.hierarchy): exact inside the node, this
    hook's exchange across nodes on the rank's shard; the exact one while warming up."""
    plan = state.node_plan
    L, m = plan.local_size, plan.nodes
    if state.iter < state.start_iter:
        cross = hier.exact_cross(plan, x.numel(), 1.0 / m)
        return hier.node_reduce(plan, x, bucket.index(), cross, **node_args(state, bucket),
                                postscale=1.0 / L)  # fmt: skip

    def reduce(state: CompressedState, bucket, x: torch.Tensor, index: int):
        step, engine = state.iter, state.engine  # now: stage 2 runs later, from a callback

        def issue(shard: torch.Tensor):  # counted by node_reduce, with the node's stages
            return engine.all_reduce(shard, (index, shard.numel(), str(shard.dtype)), step,
                                     lambda *_: None)  # fmt: skip

        cross = hier.codec_cross(engine, plan, x.numel(), issue)
        return hier.node_reduce(plan, x, index, cross, **node_args(state, bucket), engine=engine,
                                postscale=1.0 / L, finite_step=step)  # fmt: skip

    if state.bucket_layout.bound:
        return state.bucket_layout.run(bucket, x, lambda b, t, i: reduce(state, b, t, i))
    return reduce(state, bucket, x, bucket.index())
