"""HookState: what every pycomm hook keeps between calls (stats, config, checkpointable state)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from pycomm.codec.agree import check_saved
from pycomm.codec.engine import add_call
from pycomm.codec.groups import compare_steps, completed, ring_bytes

__all__ = ["FrontStage", "HookState", "check_bucket", "completed", "ring_bytes", "unbound"]

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
        >>> with pycomm.hooks.state.unbound():
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
