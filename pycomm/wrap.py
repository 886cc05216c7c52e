"""wrap / register / hook_state: DDP with a pycomm hook, checked across ranks first."""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm._validate import check_int, hook_options_of
from pycomm.codec.agree import ERROR, agree, dtype_names, error_field
from pycomm.codec.registry import codec_names
from pycomm.dist import settle_at_exit
from pycomm.exchange.managed import ManagedExchange, check_manager
from pycomm.hooks import HookState
from pycomm.hooks.accumulate import Accumulate, accumulate_hook
from pycomm.hooks.auto import AutoState
from pycomm.hooks.config import resolved_config
from pycomm.hooks.ddp import accepts_dtype, unbound
from pycomm.hooks.registry import hook_names, hook_spec, registration

logger = logging.getLogger(__name__)

# What wrap and register take as ``hook``: a registered name (pycomm.hooks.register_hook), a
# HookState instance (its hook function is the registered one of its class), or a
# (state, hook function) pair.
HookArg = Union[str, HookState, tuple[HookState, Callable]]

STATE_ATTR = "_pycomm_hook_state"
# the states registered on a DDP model: one state serves one model
_REGISTERED: weakref.WeakSet[HookState] = weakref.WeakSet()


def check_args(hook: Any, accumulate_steps: Any, hook_options: Optional[dict] = None) -> None:
    """Raise the error for a bad ``hook``, ``hook_options`` or ``accumulate_steps`` on this
    rank alone, before any process group exists (a framework adapter's constructor); ``wrap``
    and ``register`` raise the same errors on every rank (:func:`pycomm.hooks.config.agree`)."""
    if isinstance(hook, str):
        spec = hook_spec(hook)
        if spec.state is AutoState:
            AutoState.check_options(dict(hook_options or {}))
    else:
        hook_pair(hook)
        if hook_options:
            raise ValueError(
                f"pycomm: hook_options={dict(hook_options)!r} with a hook state instance; "
                "expected no hook_options (the state carries its own options)"
            )
    check_int("pycomm", "accumulate_steps", accumulate_steps)


def hook_pair(hook: Any) -> tuple[HookState, Callable]:
    """``(state, hook function)`` of a user's ``hook=`` (a HookState instance, whose class is
    registered, or a pair), or a ValueError naming what is wrong."""
    if isinstance(hook, tuple):
        if len(hook) != 2 or not isinstance(hook[0], HookState) or not callable(hook[1]):
            got = ", ".join(type(h).__name__ for h in hook)
            raise ValueError(f"pycomm: hook=({got}), expected (HookState instance, hook function)")
        return hook
    if isinstance(hook, HookState):
        fn = _registered_fn(hook)
        if fn is not None:
            return hook, fn
        raise ValueError(
            f"pycomm: hook={type(hook).__name__} instance: its class is not registered, so "
            "its hook function is unknown; expected hook=(state, hook_function) or a state of "
            "a registered hook (pycomm.hooks.register_hook)"
        )
    raise ValueError(
        f"pycomm: hook={hook!r}, expected a registered hook name, a pycomm.hooks.HookState "
        "instance or a (state, hook function) pair"
    )


def _registered_fn(state: HookState) -> Optional[Callable]:
    """The registered hook function of ``state``'s class, or None."""
    for name in hook_names():
        spec = hook_spec(name)
        if type(state) is spec.state:
            return spec.hook
    return None


# DDP hands the reducer int(bucket_cap_mb * 2**20) bytes, an int64
_MAX_BUCKET_CAP_MB = float(2**63 - 1) / 2**20 * (1 - 1e-12)


def _bucket_cap(value: Any) -> bool:
    """A bucket_cap_mb DDP can take: a positive number whose bytes fit in int64."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0 < value <= _MAX_BUCKET_CAP_MB
    )


def resolve_hook(
    hook: HookArg,
    hook_options: Any,
    accumulate_steps: Any,
    group: Any,
    where: str = "pycomm.wrap",
    legacy: Optional[dict[str, Any]] = None,
) -> tuple[dict[str, Any], Optional[HookState], Optional[Callable]]:
    """This rank's side of the cross-rank check, and the hook's state (built unbound: binding
    may create groups, which waits until the ranks agree) and function; the state is None when
    the hook or its options (``hook_options`` as given, with ``legacy`` keyword options) are
    bad here, and the fields then carry the error."""
    fields: dict[str, Any] = {}
    if isinstance(hook, str):  # a name registered on some ranks only: named on every rank
        fields["hook"] = hook
        fields[f"registration of hook {hook!r}"] = registration(hook)
    fields.update(error_field(None))
    state = fn = None
    try:
        hook_options = hook_options_of(where, hook_options, legacy or {})
        check_args(hook, accumulate_steps, hook_options)
        if isinstance(hook, str):
            spec = hook_spec(hook)
            with unbound():
                state, fn = spec.state(group, **hook_options), spec.hook
        else:
            state, fn = hook_pair(hook)
        fields.update(resolved_config(state, fn))
    except Exception as e:  # noqa: BLE001 - a user's hook or codec failing on one rank too
        fields.update(error_field(e))
        state = fn = None
    fields["accumulate_steps"] = accumulate_steps
    return fields, state, fn


Signature = list[tuple[str, tuple[int, ...], str]]


def _signature(named: Any) -> Signature:
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in named]


def params_signature(module: torch.nn.Module) -> Signature:
    return _signature((n, p) for n, p in module.named_parameters() if p.requires_grad)


def buffers_signature(module: torch.nn.Module) -> Signature:
    """The module's buffers as DDP broadcasts them from rank 0 when it is built (and at every
    forward with ``broadcast_buffers``): a buffer of another shape on one rank aborts that
    broadcast, and one more on a rank is silently overwritten."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    return _signature((n, b) for n, b in module.named_buffers() if n not in ignored)


def _model_fields(module: torch.nn.Module) -> dict[str, Any]:
    """What wrap and register compare of the model across ranks: a difference aborts or
    hangs DDP (its broadcast of the module's state, its sparse and dense buckets)."""
    return {
        "parameters": params_signature(module),
        "parameters with sparse gradients": sparse_signature(module),
        "buffers": buffers_signature(module),
    }


def sparse_signature(module: torch.nn.Module) -> list[str]:
    """The names of the parameters whose gradients DDP expects sparse (as
    :func:`sparse_parameters` finds them): ranks that differ here exchange a sparse gradient
    against a dense one (gloo aborts)."""
    ids = _sparse_ids(module)
    return [n for n, p in module.named_parameters() if id(p) in ids]


def named_ddp_parameters(ddp: DDP) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters DDP reduces, with their names, in
    ``module.named_parameters()`` order: those excluded from DDP
    (``_set_params_and_buffers_to_ignore_for_model``) are left out."""
    ignored = getattr(ddp, "parameters_to_ignore", None) or ()
    return [
        (n, p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored
    ]


def ddp_parameters(ddp: DDP) -> list[torch.Tensor]:
    """The trainable parameters DDP reduces, in ``module.parameters()`` order (see
    :func:`named_ddp_parameters`)."""
    return [p for _, p in named_ddp_parameters(ddp)]


def sparse_parameters(ddp: DDP) -> list[torch.Tensor]:
    """The parameters DDP expects sparse gradients for, as DDP decides it: those of
    ``nn.Embedding`` and ``nn.EmbeddingBag`` modules built with ``sparse=True``. DDP gives each
    a bucket of its own, which every pycomm hook reduces exactly."""
    ids = _sparse_ids(ddp.module)
    return [p for p in ddp.module.parameters() if id(p) in ids]


def _sparse_ids(module: torch.nn.Module) -> set[int]:
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, kinds) and m.sparse
        for p in m.parameters(recurse=False)
        if p.requires_grad
    }


def _reduced_dtype(ddp: DDP, param: torch.Tensor) -> torch.dtype:
    """The dtype DDP reduces ``param``'s gradient in: its own, or DDP's mixed precision's."""
    mp = getattr(ddp, "mixed_precision", None)
    if mp is None:
        return param.dtype
    return mp.reduce_dtype or mp.param_dtype or param.dtype


def _check_grad_dtypes(ddp: DDP, state: HookState) -> None:
    """Refuse, at registration and on every rank (they hold the same model), a hook that
    cannot reduce the dtype of a gradient DDP will hand it; AutoState narrows its candidates
    to the hooks that can. Sparse gradients are reduced exactly by every hook."""
    sparse = {id(p) for p in sparse_parameters(ddp)}
    dtypes: dict[torch.dtype, str] = {}
    for name, p in named_ddp_parameters(ddp):
        if id(p) not in sparse:
            dtypes.setdefault(_reduced_dtype(ddp, p), name)
    if isinstance(state, AutoState):
        state.expect_dtypes(tuple(dtypes))
        return
    for dtype, name in dtypes.items():
        if not accepts_dtype(state, dtype):
            fits = sorted(h for h in hook_names() if accepts_dtype(hook_spec(h).state, dtype))
            raise TypeError(
                f"pycomm.register: the {state.hook_name} hook reduces "
                f"{dtype_names(state.grad_dtypes)} gradients, and parameter {name!r} has dtype "
                f"{str(dtype).replace('torch.', '')}; expected a model of those dtypes (such as "
                f"model.float()), or a hook that reduces it: {', '.join(fits) or 'none'}"
            )


# the gradient dtypes the accumulate stage sums (its kernel's)
_ACCUMULATED = (torch.float32, torch.bfloat16, torch.float16)


def _refuse_join(ddp: DDP, k: int) -> None:
    """DDP's ``join()`` (uneven inputs) refused on a model with the accumulate stage: a rank
    that runs out of data shadows every micro-step's all-reduce with zero buckets, which the
    stage sums into its window (its partial sum sent without bucket views, a second join
    epoch out of step). Every rank enters ``join()`` at the same point, so every rank raises
    there, before any collective."""

    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(
            f"pycomm: join() on a model with accumulate_steps={k} is not supported: a rank "
            "that runs out of inputs would shadow every micro-step's all-reduce, which the "
            "accumulate stage sums into its window. Give every rank the same number of "
            "micro-steps (e.g. DistributedSampler(drop_last=True)), or use accumulate_steps=1 "
            "with join()"
        )

    ddp.join = refused  # DDP's own join() and the Join context's join_hook()
    ddp.join_hook = refused


def _attach(ddp: DDP, state: HookState, fn: Callable, accumulate_steps: int) -> HookState:
    settle_at_exit()
    state.bind()
    _check_grad_dtypes(ddp, state)
    params = ddp_parameters(ddp)
    if hasattr(state, "bind_parameters"):  # the hook's own bucket layout (resumes bit for bit)
        sparse = {id(p) for p in sparse_parameters(ddp)}
        state.bind_parameters([p for p in params if id(p) not in sparse])
    if accumulate_steps > 1:
        wide = [str(p.dtype) for p in params if p.dtype not in _ACCUMULATED]
        if wide:  # the same on every rank: the ranks compared the parameters' dtypes
            raise TypeError(
                f"pycomm: accumulate_steps={accumulate_steps} with parameters of "
                f"{sorted(set(wide))}: the accumulate stage keeps float32, bfloat16 and float16 "
                "gradients; expected accumulate_steps=1 (DDP's no_sync() for the micro-steps) "
                "or those dtypes"
            )
        Accumulate(  # the stage in front of the hook, part of its state
            state,
            fn,
            accumulate_steps,
            params,
            write_grads=ddp.find_unused_parameters and not ddp.gradient_as_bucket_view,
            bucket_view=ddp.gradient_as_bucket_view,
        )
        fn = accumulate_hook
        _refuse_join(ddp, accumulate_steps)
    if isinstance(state, AutoState):  # forward and the start of backward, for its measurements
        auto = state
        ddp.register_forward_pre_hook(lambda _module, _args: auto.forward_start())
        ddp.register_forward_hook(lambda _module, _args, _out: auto.forward_done())
    ddp.register_comm_hook(state, fn)
    _REGISTERED.add(state)
    setattr(ddp, STATE_ATTR, state)
    ddp.register_forward_pre_hook(_forward_guard)
    logger.info("pycomm: registered the %s hook with options %s", state.hook_name, state.options())
    return state


def register(
    ddp: DDP,
    hook: HookArg = "allreduce",
    accumulate_steps: int = 1,
    hook_options: Optional[dict[str, Any]] = None,
    **options: Any,
) -> HookState:
    """Register a pycomm hook on an existing DDP model and return its state.

    ``hook``: a registered name (``pycomm.hooks.hook_names()``), a
    :class:`~pycomm.hooks.HookState` instance of a registered hook, or a ``(state,
    hook_function)`` pair of one's own (docs/custom_hooks.md): every form gets the cross-rank
    check, ``accumulate_steps``, ``TrainLoop``, ``pycomm.checkpoint`` and the framework
    integrations. A state instance must be built over DDP's process group (or None for the
    default group) and not be used by another model.

    ``hook_options``: the hook's options, one dict, as in ``wrap`` (options as keyword
    arguments, the older spelling, still work with a FutureWarning).

    Every rank must call it with the same hook, options and model: that is checked across ranks
    first, and a difference raises a ValueError on every rank naming it.

    Example:
        >>> ddp = DistributedDataParallel(model)
        >>> state = pycomm.register(ddp, hook="int8", hook_options={"block": 128})
        >>> state = pycomm.register(ddp2, hook=(MyState(None), my_hook), accumulate_steps=4)
    """
    if not isinstance(ddp, DDP):
        raise TypeError(f"pycomm.register: expected a DistributedDataParallel, got {type(ddp)}")
    # Compared across ranks with the rest, so that every rank raises the same error instead
    # of one raising while the others wait for it in the next collective.
    problem = _registration_problem(ddp) or _state_problem(ddp.process_group, hook)
    fields, state, fn = resolve_hook(
        hook, hook_options, accumulate_steps, ddp.process_group, "pycomm.register", options
    )
    cap = getattr(ddp, "bucket_bytes_cap", None)
    if fields.get(ERROR) is None and isinstance(cap, int) and cap <= 0:
        fields.update(
            error_field(
                ValueError(
                    f"pycomm.register: the DDP model's bucket_cap_mb={cap / 2**20:g}, expected a "
                    "positive number of MB"
                )
            )
        )
    agree(
        "pycomm.register",
        {
            **fields,
            # DDP's options that change its collectives, read from the model a framework built
            # (a difference hangs or aborts DDP, or pairs buckets of other sizes in the hook)
            "DDP option find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", 0)),
            "DDP option static_graph": bool(getattr(ddp, "static_graph", False)),
            "DDP option broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", True)),
            "DDP option bucket_cap_mb": None if cap is None else cap / 2**20,
            **_model_fields(ddp.module),
            "state of the DDP model": problem,
        },
        ddp.process_group,
    )
    if problem is not None:
        raise RuntimeError(f"pycomm.register: {problem}")
    return _attach(ddp, state, fn, accumulate_steps)


def _python_reducer() -> bool:
    """Whether a DDP built now runs compiled DDP's Python reducer: it reads
    ``torch._dynamo.config.optimize_ddp`` when built, as here."""
    from torch._dynamo.utils import get_optimize_ddp_mode  # what DDP's constructor reads

    return get_optimize_ddp_mode() == "python_reducer"


_PYTHON_REDUCER = (
    "torch._dynamo.config.optimize_ddp = 'python_reducer' (compiled autograd with DDP's "
    "Python reducer) calls a communication hook once per parameter with a (gradient, "
    "parameter) pair, inside the compiled backward, instead of with DDP's buckets; pycomm's "
    "hooks (bucketed compression, error feedback, accumulation, stats) cannot run there. "
    "Keep torch's default optimize_ddp = 'ddp_optimizer' (torch.compile(ddp) then compiles "
    "the model in pieces at bucket boundaries and DDP's reducer calls the pycomm hook), or "
    "train without a pycomm hook under 'python_reducer'"
)


def _forward_guard(ddp: DDP, args: Any) -> None:
    """Refuse, before DDP's forward, the setups that would run on silently wrong: this DDP
    inside another one (every gradient reduced twice), and a caller skipping synchronization
    (``no_sync()``) while pycomm's accumulate stage counts the micro-steps too. Every rank runs
    the same forward, so every rank raises."""
    outer = getattr(DDP, "_active_ddp_module", None)
    state = getattr(ddp, STATE_ATTR, None)
    name = getattr(state, "hook_name", "?")
    if outer is not None and outer is not ddp:
        raise RuntimeError(
            f"pycomm: this DistributedDataParallel model (with the pycomm {name} hook) runs "
            "inside a second DistributedDataParallel (e.g. accelerator.prepare() or a Lightning "
            "strategy after pycomm.wrap): every gradient would be all-reduced twice. Hand the "
            "plain module to the framework and register the hook on its DDP instead "
            "(pycomm.accelerate.register, pycomm.lightning.DDPStrategy, pycomm.register)"
        )
    stage = getattr(state, "accumulate", None)
    k = 1 if stage is None else stage.accumulate_steps
    if k > 1 and torch.is_grad_enabled() and not ddp.require_backward_grad_sync:
        raise RuntimeError(
            f"pycomm: two gradient accumulators: this model has pycomm's accumulate stage "
            f"(accumulate_steps={k}) and the caller also skips gradient synchronization "
            "(DDP's no_sync(), as Lightning's accumulate_grad_batches and Accelerate's "
            "accumulate() do), so the stage would miss micro-steps and the ranks drift apart. "
            "Pass accumulate_steps=1 to pycomm and let the caller accumulate, or accumulate "
            "with pycomm alone (pycomm.TrainLoop)"
        )


def _registration_problem(ddp: DDP) -> Optional[str]:
    """Why a hook cannot be registered on ``ddp`` now (the same text on every rank), or None."""
    if isinstance(ddp.module, DDP):
        return (
            "this DDP model wraps another DistributedDataParallel: every gradient would be "
            "all-reduced twice; build one DDP around the plain module"
        )
    if getattr(ddp, "_use_python_reducer", False):
        return f"this DDP model was built with {_PYTHON_REDUCER}"
    state = getattr(ddp, STATE_ATTR, None)
    if state is not None:
        return (
            f"this DDP model already has a pycomm hook ({state.hook_name}); a DDP model takes "
            "one communication hook: build a new DDP (or pycomm.wrap) for another hook"
        )
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if hooks:
        name = getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
        return (
            f"this DDP model already has the communication hook {name!r} (registered with "
            "register_comm_hook); a DDP model takes one communication hook"
        )
    if _training_started(ddp):
        return (
            "this DDP model has already trained (a backward pass ran through it): register "
            "the hook before the first forward and backward, so that the hook's state "
            "(warm-up iterations, residuals) starts with DDP's buckets. Build the DDP model "
            "and register (or use pycomm.wrap) before training"
        )
    return None


def _state_problem(group: Any, hook: HookArg) -> Optional[str]:
    """Why a user's state instance cannot serve a DDP model over ``group``, or None."""
    if isinstance(hook, HookState):
        state = hook
    elif isinstance(hook, tuple) and hook and isinstance(hook[0], HookState):
        state = hook[0]
    else:  # a name, or a malformed hook: resolve_hook reports it
        return None
    world = dist.group.WORLD
    if (state.process_group or world) is not (group or world):
        return (
            f"the {state.hook_name} hook state was built over another process group than the "
            "DDP model's; build it with the DDP model's process_group (or None for the "
            "default group)"
        )
    if state in _REGISTERED:
        return (
            f"the {state.hook_name} hook state is already registered on a DDP model; a state "
            "keeps one model's residuals and counters: build one per model"
        )
    return None


def _training_started(ddp: DDP) -> bool:
    """Whether a backward pass has run through ``ddp`` (DDP itself does not refuse a hook
    registered afterwards). Reads DDP internals defensively: any sign is enough."""
    reducer = getattr(ddp, "reducer", None)
    try:
        # Per-parameter backward timings, recorded from the first backward on.
        if reducer is not None and any(reducer.get_backward_stats()):
            return True
    except (AttributeError, RuntimeError, TypeError):
        pass
    if getattr(ddp, "_has_rebuilt_buckets", False):  # set in the second training forward
        return True
    # A forward ran and gradients exist (e.g. backward inside no_sync()).
    return bool(getattr(ddp, "_lazy_init_ran", False)) and any(
        p.grad is not None for p in ddp.module.parameters() if p.requires_grad
    )


def wrap(
    module: torch.nn.Module,
    *,
    hook: HookArg = "allreduce",
    accumulate_steps: int = 1,
    process_group: Optional[dist.ProcessGroup] = None,
    hook_options: Optional[dict[str, Any]] = None,
    manager: Any = None,
    **ddp_kwargs: Any,
) -> DDP:
    """Wrap ``module`` in DistributedDataParallel with a pycomm hook registered.

    ``manager``: a ``torchft.manager.Manager``: per-step fault-tolerant DDP across torchft's
    replica groups (one rank each), as torchft's own ``DistributedDataParallel``, with the
    gradients averaged through ``hook`` (a codec, or ``"allreduce"``) and error feedback
    (:class:`pycomm.exchange.managed.ManagedExchange`): a lost replica group does not stop
    the others, and one that rejoins heals from a live peer (docs/fault-tolerance.md).

    ``ddp_kwargs`` go to DDP unchanged (``bucket_cap_mb``, ``device_ids``, ...), except that
    without a ``bucket_cap_mb`` DDP gets the hook's own bucket size (docs/reference.md, "The
    DDP bucket size"), and ``gradient_as_bucket_view`` defaults to True (no copies between
    gradients and buckets; pass False for DDP's behaviour). The hook name,
    its options, ``accumulate_steps`` and the parameters' shapes and dtypes are compared across
    ranks before DDP is built, so a mismatch is a ValueError on every rank, not a hang.
    ``hook`` takes what :func:`register` takes: a registered name, a HookState instance or a
    ``(state, hook_function)`` pair.

    Example:
        >>> info = pycomm.init()
        >>> ddp = pycomm.wrap(model.to(info.device), hook="allreduce")
        >>> pycomm.hook_state(ddp).stats
    """
    if manager is not None:
        return _wrap_managed(
            module, hook, manager, accumulate_steps, process_group, hook_options, ddp_kwargs
        )
    if isinstance(module, DDP):
        raise TypeError(
            "pycomm.wrap: module is already a DistributedDataParallel; wrapping it again "
            "would all-reduce every gradient twice: use pycomm.register(ddp, ...) on it"
        )
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"pycomm.wrap: module is a {type(module).__name__}, expected a torch.nn.Module"
        )
    if not dist.is_initialized():
        raise RuntimeError("pycomm.wrap: no process group; call pycomm.init() first")
    if (
        process_group is not None
        and process_group is not dist.GroupMember.NON_GROUP_MEMBER
        and not isinstance(process_group, dist.ProcessGroup)
    ):
        raise TypeError(
            f"pycomm.wrap: process_group={process_group!r}, expected a "
            "torch.distributed.ProcessGroup or None (the default group)"
        )
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"pycomm.wrap: this rank (global rank {dist.get_rank()}) is not in process_group "
            "(dist.new_group returned GroupMember.NON_GROUP_MEMBER here); expected the model "
            "wrapped by the group's ranks alone"
        )
    python_reducer = _python_reducer()
    problem = _state_problem(process_group, hook)
    fields, state, fn = resolve_hook(hook, hook_options, accumulate_steps, process_group)
    cap = ddp_kwargs.get("bucket_cap_mb", None if state is None else state.default_bucket_cap_mb)
    if fields.get(ERROR) is None and ddp_kwargs.get("mixed_precision") is not None:
        fields.update(
            error_field(
                ValueError(
                    f"pycomm.wrap: mixed_precision={ddp_kwargs['mixed_precision']!r}: DDP's "
                    "mixed precision reduces the gradients through a communication hook of "
                    "its own, and a DDP model takes one; expected mixed_precision=None (a "
                    "model in bfloat16 or float16 has its gradients reduced in that dtype by "
                    "the hooks that accept it)"
                )
            )
        )
    if fields.get(ERROR) is None and cap is not None and not _bucket_cap(cap):
        fields.update(
            error_field(
                ValueError(
                    f"pycomm.wrap: bucket_cap_mb={cap!r}, expected a positive number of MB, at "
                    f"most {_MAX_BUCKET_CAP_MB:.4g} (its bytes an int64)"
                )
            )
        )
    agree(
        "pycomm.wrap",
        {
            **fields,
            # DDP's options that change its collectives: a difference hangs or aborts DDP, or
            # (bucket sizes) pairs buckets of other sizes in the hook's collectives
            **{
                f"DDP option {name}": bool(ddp_kwargs.get(name, default))
                for name, default in (
                    ("find_unused_parameters", False),
                    ("static_graph", False),
                    ("broadcast_buffers", True),
                )
            },
            "DDP option bucket_cap_mb": cap,
            **_model_fields(module),
            "hook state": problem,
            "compiled DDP's Python reducer": python_reducer,
        },
        process_group,
    )
    if problem is not None:
        raise RuntimeError(f"pycomm.wrap: {problem}")
    if python_reducer:
        raise RuntimeError(f"pycomm.wrap: {_PYTHON_REDUCER}")
    if cap is not None and "bucket_cap_mb" not in ddp_kwargs:
        ddp_kwargs["bucket_cap_mb"] = cap
        logger.info("pycomm.wrap: bucket_cap_mb=%s for the %s hook", cap, hook)
    # Gradients as views of DDP's buckets: no copy into the buckets before the hook and none
    # back after it, and one fewer copy of the gradients in memory. torch leaves it off only
    # for compatibility (a view's detach_() fails; optimizer.zero_grad() handles it).
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    ddp = DDP(module, process_group=process_group, **ddp_kwargs)
    _attach(ddp, state, fn, accumulate_steps)
    return ddp


def _wrap_managed(
    module: torch.nn.Module, hook: Any, manager: Any, accumulate_steps: int, group: Any,
    hook_options: Optional[dict[str, Any]], ddp_kwargs: dict[str, Any],
) -> DDP:  # fmt: skip
    """:func:`wrap` with ``manager``: DDP over a one-rank group of its own (torchft's
    ``ProcessGroupDummy``, as torchft's DDP), its buckets averaged across the replica groups
    by a :class:`ManagedExchange` of ``hook``, each bucket waited for in the hook."""
    where = "pycomm.wrap"
    check_manager(where, manager)
    if not isinstance(module, torch.nn.Module) or isinstance(module, DDP):
        raise TypeError(
            f"pycomm.wrap: module is a {type(module).__name__}, expected a torch.nn.Module "
            "(not a DDP model)"
        )
    if group is not None:
        raise ValueError(
            f"{where}: manager= and process_group= were both given; expected one: under a "
            "torchft manager the gradients are averaged across the replica groups over the "
            "manager's group"
        )
    if accumulate_steps != 1:
        raise ValueError(
            f"{where}: accumulate_steps={accumulate_steps!r} with manager=: expected 1 (each "
            "step commits or not as the manager says; accumulate with DDP's no_sync())"
        )
    if not isinstance(hook, str) or hook not in ("allreduce", *codec_names()):
        raise ValueError(
            f"{where}: hook={hook!r} with manager=, expected 'allreduce' or a codec "
            f"({', '.join(codec_names())}); a hook with a state of its own (powersgd, auto, a "
            "user's state hook) is not run under a manager"
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{where}: manager= with a process group of {dist.get_world_size()} ranks: "
            "expected one rank per replica group (torchft's DDP), the manager's group "
            "across them; a replica group of several ranks shards the model with FSDP2 and "
            "syncs across groups with pycomm.DiLoCo(manager=) or pycomm.Exchange(manager=)"
        )
    options = hook_options_of(where, hook_options, {})
    from torchft.process_group import ProcessGroupDummy  # installed: check_manager passed

    if not ddp_kwargs.setdefault("find_unused_parameters", True):
        raise ValueError(
            f"{where}: find_unused_parameters=False with manager=: expected True (the "
            "default here, as torchft's DDP): DDP then keeps its first buckets, so a replica "
            "group that rejoins with a new DDP model has the same buckets as the others; "
            "with False DDP rebuilds them after the first step, in the order the gradients "
            "came on that replica"
        )
    exchange = ManagedExchange(hook, manager, name="wrap", **options)
    ddp = DDP(module, process_group=ProcessGroupDummy(0, 1), **ddp_kwargs)
    ddp.register_comm_hook(exchange, _managed_hook)
    setattr(ddp, STATE_ATTR, exchange)
    return ddp


def _managed_hook(exchange, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
    """A bucket's mean across the replica groups (``bucket``: a ``dist.GradBucket``), done
    before the hook returns (the manager's verdict on the step needs every bucket's
    collective finished). Unannotated: DDP checks a hook's annotations, which
    ``from __future__ import annotations`` turns into strings."""
    buffer = bucket.buffer()
    exchange.all_reduce(buffer, key=bucket.index(), compare=bucket.index() == 0, async_op=False)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def hook_state(ddp: DDP) -> HookState:
    """The state of the pycomm hook registered on ``ddp``.

    Example:
        >>> pycomm.hook_state(ddp).stats["compression"]
    """
    state = getattr(ddp, STATE_ATTR, None)
    if state is None:
        raise ValueError("pycomm.hook_state: this model has no pycomm hook; use pycomm.wrap")
    return state
