"""The codec hooks' DDP side (fp16, bf16, int8, fp8, int4, onebit and users' codecs): the
state of a registered codec hook (:class:`CompressedState`: its options, warm-up, bucket layout,
node hierarchy, advice, stats and checkpoints) and the one hook function of every codec
(:func:`compressed_hook`). The exchange itself is the engine's (:mod:`pycomm.hooks.engine`),
which ``pycomm.Exchange`` and ``pycomm.fsdp`` run too: each DDP bucket goes to
:meth:`Engine.all_reduce <pycomm.hooks.engine.Engine.all_reduce>` once it is past the warm-up.
"""

import inspect
import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm._validate import check_bool, check_dtype, check_int
from pycomm.hooks import advice
from pycomm.hooks import hierarchy as hier
from pycomm.hooks.allreduce import exact_allreduce, per_bucket
from pycomm.hooks.codec import Codec, check_codec
from pycomm.hooks.engine import Engine, ResidualStore, summed_numel
from pycomm.hooks.groups import phase_groups
from pycomm.hooks.layout import BucketLayout
from pycomm.hooks.state import (
    HookState,
    is_sparse,
    ring_bytes,
)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

logger = logging.getLogger(__name__)


_RESIDUAL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


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

    grad_dtypes = _FLOATS  # the engine encodes from fp32, bf16 or fp16 buckets
    default_error_feedback = True
    default_local_feedback = True
    default_start_iter = 2
    option_names: tuple = (
        "start_iter", "error_feedback", "local_feedback", "residual_dtype", "strict_skip",
        "hierarchy",
    )  # fmt: skip

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, **options: Any):
        hook = self.hook_name
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            raise ValueError(
                f"pycomm {hook} hook: unknown option {unknown[0]!r}; valid options: "
                f"{', '.join(self.option_names)}"
            )
        # before binding, which resolves it
        self.hierarchy = hier.check_hierarchy(hook, options.get("hierarchy", "auto"))
        super().__init__(process_group)
        self.start_iter = check_int(
            self.where, "start_iter", options.get("start_iter", self.default_start_iter), 2
        )
        engine_options = _engine_options(self, options)
        self.iter = 0
        self._fold_next = False  # the next hook call starts a new step: commit the last one
        self._stats.update(nonfinite_buckets=0, residual_bytes=0, rebucketed_steps=0)
        # the exchange (codec, residuals kept per bucket and committed once a step is finite,
        # buffers, phase groups) is the engine's; the hook's own parts: its bucket layout over
        # the bound parameters, the warm-up, the node hierarchy, the optimizer advice
        self.engine = Engine(self.where, self.make_codec(options), self._stats, **engine_options)
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
        kwargs = {k: options[k] for k in self.codec_option_names if k in options}
        self.codec_kwargs = kwargs
        try:
            codec = self.codec_factory(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.where}: {_refusal(str(e), kwargs)}") from e
        check_codec(codec, self.where)
        return codec

    def codec_options(self) -> dict[str, Any]:
        """A registered codec's options as this state runs them (its factory's defaults
        filled in): part of :meth:`options`, so compared across ranks and checkpointed."""
        if self.codec_factory is None:
            return {}
        sig = inspect.signature(self.codec_factory)
        given = getattr(self, "codec_kwargs", {})
        out = {k: given.get(k, sig.parameters[k].default) for k in self.codec_option_names}
        # a dtype by its name: "bfloat16" and torch.bfloat16 are one option value
        return {k: _named(v) for k, v in out.items()}

    def identity(self) -> dict[str, Any]:
        """The state class, and the codec's class and format (:func:`codec_identity`)."""
        return {**super().identity(), **codec_identity(self.codec)}

    def options(self) -> dict[str, Any]:
        return {
            "start_iter": self.start_iter,
            "error_feedback": self.error_feedback,
            "local_feedback": self.local_feedback,
            "residual_dtype": _RESIDUAL_DTYPES[self.residual_dtype],
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


def with_strict_skip(state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A checkpoint of a version without ``strict_skip`` (which kept two copies) as one with
    this state's: its residuals are those of either way."""
    options = state.get("fingerprint", {}).get("options")
    if isinstance(options, dict) and "strict_skip" not in options:
        fingerprint = {**state["fingerprint"], "options": {**options, "strict_skip": strict}}
        state = {**state, "fingerprint": fingerprint}
    return state


def check_residuals(where: str, engine: Engine, loaded: dict[tuple, dict]) -> None:
    """Refuse (ValueError naming the bucket) loaded residuals of another size or dtype than
    ``engine`` keeps for their keys; ``where`` starts the message."""
    for key, res in loaded.items():
        for name, numel in engine.key_sizes(key).items():
            got = res[name].numel() if name in res else 0
            what = f"{where}: cannot load the residual of bucket {key[0]} ({key[1]} elements)"
            if got != numel:
                raise ValueError(
                    f"{what}: {name} has {got} elements, expected {numel} for this world size "
                    "and block"
                )
            if res[name].dtype != engine.residual_dtype:
                raise ValueError(
                    f"{what}: {name} has dtype {res[name].dtype}, expected "
                    f"{engine.residual_dtype} (residual_dtype)"
                )


def _engine_options(state: CompressedState, options: dict[str, Any]) -> dict[str, Any]:
    """The engine's options of ``state`` from the hook's ``options``, each checked, with the
    hook's defaults."""
    where = state.where
    return {
        "error_feedback": check_bool(
            where, "error_feedback", options.get("error_feedback", state.default_error_feedback)
        ),
        "local_feedback": check_bool(
            where, "local_feedback", options.get("local_feedback", state.default_local_feedback)
        ),
        "residual_dtype": check_dtype(
            where,
            "residual_dtype",
            options.get("residual_dtype", "float32"),
            tuple(_RESIDUAL_DTYPES),
        ),  # fmt: skip
        "strict_skip": check_bool(where, "strict_skip", options.get("strict_skip", False)),
    }


def _named(value: Any) -> Any:
    """A dtype as its name (``"bfloat16"``), any other option value as it is."""
    return str(value).split(".")[-1] if isinstance(value, torch.dtype) else value


def _refusal(message: str, kwargs: dict[str, Any]) -> str:
    """A codec's refusal of its options as the hook's: ``block=12, expected ...`` when the
    codec's message names one of them after its own prefix, else the options and the message."""
    for name in kwargs:
        head, sep, rest = message.partition(": ")
        if sep and rest.startswith(f"{name}="):
            return rest
    return f"the codec refused options {kwargs}: {message}"


def codec_identity(codec: Codec) -> dict[str, Any]:
    """What two ranks' codecs must agree on to exchange codes: the codec's class and its
    format (block, dtypes, phases, bytes of 8 blocks), so that a codec edited on one node, or
    one with another default, is named before the first collective instead of hanging it."""
    cls, m = type(codec), 8 * codec.block
    return {
        "codec": f"{cls.__module__}.{cls.__qualname__}",
        "codec format": (
            f"block {codec.block}, codes {codec.code_dtype}, scales {codec.scale_dtype}, "
            f"{'two-phase' if codec.two_phase else 'one-phase'}, "
            f"{codec.code_bytes(m)} + {codec.scale_bytes(m)} bytes per {m} elements"
        ),
    }


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


def codec_cross(engine: Engine, plan: hier.NodePlan, n: int, issue: Callable) -> hier.Cross:
    """Stage 2 through ``engine``'s codec across the nodes, for an n-element bucket:
    ``issue(shard_bucket, shard)`` starts the exchange of the shard; what it sends, a
    two-phase exchange's rows or a one-phase codec's summed codes."""
    codec, m = engine.codec, plan.nodes
    s = hier.shard_size(n, plan.local_size)
    if codec.two_phase:
        c = engine.chunk(s)
        return hier.Cross(issue, 2 * (m - 1) * (codec.code_bytes(c) + codec.scale_bytes(c)), 2)
    return hier.Cross(issue, ring_bytes(codec.code_bytes(summed_numel(codec, s)), m), 1)


def _node(state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor):
    """The hook on the node hierarchy (pycomm.hooks.hierarchy): exact inside the node, this
    hook's exchange across nodes on the rank's shard; the exact one while warming up."""
    plan = state.node_plan
    L, m = plan.local_size, plan.nodes
    if state.iter < state.start_iter:
        cross = hier.exact_cross(plan, x.numel(), 1.0 / m)
        return hier.node_reduce(state, plan, bucket, x, bucket.index(), cross, postscale=1.0 / L)

    def reduce(state: CompressedState, bucket, x: torch.Tensor, index: int):
        step = state.iter  # now, in the hook: stage 2 runs later, from a callback

        def issue(shard_bucket, shard: torch.Tensor):
            return state.exchange(shard_bucket, shard, index, step)

        cross = codec_cross(state.engine, plan, x.numel(), issue)
        return hier.node_reduce(
            state, plan, bucket, x, index, cross, postscale=1.0 / L, finite_step=step
        )

    if state.bucket_layout.bound:
        return state.bucket_layout.run(bucket, x, lambda b, t, i: reduce(state, b, t, i))
    return reduce(state, bucket, x, bucket.index())
