"""Compressed gradient reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 reduces each sharded module's gradients with one reduce-scatter of a flat input of
``world_size`` equal chunks, chunk j going to rank j. :func:`compress` installs a pycomm
:class:`ReduceScatter` on every ``FSDPModule`` of a model through torch's own extension point
(``FSDPModule.set_custom_reduce_scatter``): each rank encodes its whole input with a
registered hook's codec (int8, bf16, fp16, onebit, or a user's, see
:func:`pycomm.hooks.register_hook`), exchanges the codes all-to-all, and decodes and sums its
chunk in fp32 into its output shard. That is phase 1 of pycomm's two-phase all-reduce: the
bytes a rank sends are (N-1)/N of the compressed input. ``hook="allreduce"`` is the exact fp32
reduce-scatter, sent the same way (one all-to-all, the rows summed in rank order).

FSDP's reduction is honoured as it asks for it: its op (``AVG``, ``SUM`` or ``PREMUL_SUM``,
from ``set_gradient_divide_factor``), its post-division and its ``reduce_dtype``
(``MixedPrecisionPolicy``); accumulation without communication is FSDP's own
``set_requires_gradient_sync(False)`` on the micro-steps that should not reduce.

Error feedback keeps, on every rank, a residual of each module's whole unsharded gradient:
the memory FSDP exists to save (4 bytes a parameter in fp32, 2 with
``residual_dtype="bfloat16"``, on every rank, against FSDP's 4/N for the sharded gradient).
It is therefore off by default here (``error_feedback=True`` turns it on); ``stats`` reports
``residual_bytes``.

Example:
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> comm = pycomm.fsdp.compress(model, hook="int8")
    >>> loss = model(x).sum(); loss.backward()   # every module's gradients sent as int8
    >>> comm.stats["compression"]
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

try:  # the interface set_custom_reduce_scatter documents (not exported by torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # FSDP calls allocate() and __call__(), nothing else
    ReduceScatter = object  # type: ignore[misc,assignment]

from pycomm._validate import hook_options_of
from pycomm.exchange import rank_order_sum
from pycomm.hooks import AllreduceState, CompressedState, hook_spec
from pycomm.hooks.config import agree, error_field, resolved_config
from pycomm.hooks.registry import registration
from pycomm.hooks.state import HookState, accepts_dtype, dtype_names, unbound

__all__ = ["FSDPCompression", "ModuleReduceScatter", "compress"]

logger = logging.getLogger(__name__)

# options of the DDP hooks that have no meaning for a one-phase reduce-scatter
_NOT_HERE = {
    "hierarchy": "the node hierarchy is DDP's; FSDP2 reduce-scatters within its mesh",
    "local_feedback": "FSDP's reduce-scatter has one phase: use error_feedback",
    "strict_skip": "FSDP's residuals are one copy, updated in place (a non-finite block keeps "
    "its residual)",
}


def _scale(op: Any, n: int) -> float:
    """The factor FSDP's ``op`` applies before summing: AVG 1/N, SUM 1, PREMUL_SUM its own."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return 1.0 / n
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        return float(op.factor)
    raise ValueError(f"pycomm.fsdp: FSDP asked for a reduce-scatter with op {op!r}")


class ModuleReduceScatter(ReduceScatter):
    """The ``ReduceScatter`` of one ``FSDPModule`` (installed by :func:`compress`): its codec's
    state, residual, warm-up count and counters.

    Attributes:
        name: the module's name in the model ("" for the root).
        iter: reduce-scatters run (one per synchronized backward).
        stats: ``calls``, ``bytes_sent``, ``bytes_fp32`` (what an fp32 ring reduce-scatter of
            the same input sends) and ``residual_bytes``.

    Example:
        >>> rs = pycomm.fsdp.compress(model, hook="int8").modules[""]
        >>> rs.stats["bytes_sent"]
    """

    def __init__(self, name: str, hook: str, state: Optional[CompressedState]) -> None:
        self.name = name
        self.hook = hook
        self.state = state  # None: the exact fp32 reduce-scatter
        self.iter = 0
        self.residual: Optional[torch.Tensor] = None
        self.stats: dict[str, int] = {
            "calls": 0,
            "bytes_sent": 0,
            "bytes_fp32": 0,
            "residual_bytes": 0,
        }
        self._pad: Optional[torch.Tensor] = None  # the chunk-padded input, when padding is due

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        """Reduce-scatter ``input_tensor`` (N chunks of ``output_tensor.numel()``) into
        ``output_tensor`` on ``group``, as FSDP's ``op`` asks; synchronous (FSDP runs it in
        its reduce-scatter stream)."""
        n = dist.get_world_size(group)
        s = output_tensor.numel()
        if input_tensor.numel() != n * s:
            raise ValueError(
                f"pycomm.fsdp ({self.name or 'root'}): input of {input_tensor.numel()} "
                f"elements for an output of {s} on {n} ranks, expected {n * s}"
            )
        scale = _scale(op, n)
        st = self.state
        if st is not None and not accepts_dtype(st, input_tensor.dtype):
            # every rank reduces the same dtype: each raises here, none waits in a collective
            raise TypeError(
                f"pycomm.fsdp ({self.name or 'root'}): the {self.hook} hook reduces "
                f"{dtype_names(st.grad_dtypes)} gradients, and FSDP reduces this module's in "
                f"{str(input_tensor.dtype).replace('torch.', '')}; expected a model of those "
                "dtypes, MixedPrecisionPolicy(reduce_dtype=torch.float32), or hook='allreduce'"
            )
        self.stats["calls"] += 1
        self.stats["bytes_fp32"] += (n - 1) * s * 4
        if st is None or self.iter < st.start_iter:
            self._exact(output_tensor, input_tensor, group, n, s, scale)
        else:
            self._compressed(output_tensor, input_tensor, group, n, s, scale)
        self.iter += 1
        return None

    def _exact(self, out, x, group, n: int, s: int, scale: float) -> None:
        recv = torch.empty_like(x)
        dist.all_to_all_single(recv, x.contiguous(), group=group)
        self.stats["bytes_sent"] += (n - 1) * s * x.element_size()
        # fp32 sums, or float64's own: exact for every dtype FSDP reduces in
        out.copy_(rank_order_sum(recv.view(n, s), scale))

    def _compressed(self, out, x, group, n: int, s: int, scale: float) -> None:
        st = self.state
        codec = st.codec
        c = -(-s // codec.block) * codec.block  # each chunk padded to whole blocks
        if c != s:  # chunk j at [j * c, j * c + s): the codec's chunks are FSDP's
            if self._pad is None or self._pad.numel() != n * c or self._pad.dtype != x.dtype:
                self._pad = torch.zeros(n * c, dtype=x.dtype, device=x.device)
            self._pad.view(n, c)[:, :s].copy_(x.view(n, s))
            x = self._pad
        residual = None
        if st.error_feedback:
            if self.residual is None or self.residual.numel() != n * c:
                self.residual = torch.zeros(n * c, dtype=st.residual_dtype, device=x.device)
                self.stats["residual_bytes"] = self.residual.numel() * self.residual.element_size()
            residual = self.residual
        codes, scales = codec.encode(x, residual, scale, n * c)
        send = codec.pack(codes, scales, n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        self.stats["bytes_sent"] += (n - 1) * send.shape[1]
        rcodes, rscales = codec.split(recv, c)
        codec.decode_sum(rcodes, rscales, 1.0, out)

    def state_dict(self) -> dict[str, Any]:
        return {
            "iter": self.iter,
            "residual": None if self.residual is None else self.residual.clone(),
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = int(state["iter"])
        res = state["residual"]
        self.residual = None if res is None else res.detach().clone()
        self.stats.clear()
        self.stats.update(state["stats"])


class FSDPCompression(HookState):
    """What :func:`compress` returns for a model: one :class:`ModuleReduceScatter` per
    ``FSDPModule`` (``modules``, by name), their summed ``stats`` and one checkpointable
    state per rank. A :class:`~pycomm.hooks.HookState`, so ``pycomm.checkpoint``'s
    ``save_rank_state``/``load_rank_state`` take it as they take a DDP hook's state.

    Example:
        >>> comm = pycomm.fsdp.compress(model, hook="int8", hook_options={"error_feedback": True})
        >>> pycomm.checkpoint.save_rank_state(comm, "out/step-100")   # every rank its own file
        >>> pycomm.checkpoint.load_rank_state(comm, "out/step-100")   # on resume, every rank
    """

    hook_name = "fsdp"

    def __init__(
        self, hook: str, options: dict[str, Any], modules: dict[str, ModuleReduceScatter]
    ) -> None:
        super().__init__(None)
        self.hook = hook
        self.hook_options = options
        self.modules = modules

    @property
    def stats(self) -> dict[str, Any]:
        """``calls``, ``bytes_sent``, ``bytes_fp32``, ``residual_bytes`` summed over the
        modules, and ``compression`` (bytes_fp32 / bytes_sent)."""
        out = {"calls": 0, "bytes_sent": 0, "bytes_fp32": 0, "residual_bytes": 0}
        for m in self.modules.values():
            for key in out:
                out[key] += m.stats[key]
        out["compression"] = out["bytes_fp32"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    def options(self) -> dict[str, Any]:
        return {"hook": self.hook, **self.hook_options}

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "modules": sorted(self.modules)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: every module's residual, warm-up count and counters."""
        return {
            "fingerprint": self.fingerprint(),
            "rank": self.rank,
            "world_size": self.world_size,
            "modules": {name: m.state_dict() for name, m in self.modules.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank; another hook, option or model (or another
        rank's state) is a ValueError naming it."""
        self.check_fingerprint(state)
        for name, m in self.modules.items():
            m.load_state_dict(state["modules"][name])


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _mesh_problem(modules: list[tuple[str, FSDPModule]]) -> Optional[str]:
    for name, module in modules:
        for pname, p in module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.ndim != 1:
                return (
                    f"parameter {pname!r} of module {name or 'root'!r} is sharded on a "
                    f"{mesh.ndim}-D device mesh (HSDP): pycomm.fsdp compresses FSDP2's "
                    "reduce-scatter over a 1-D mesh only; shard on a 1-D mesh, or keep FSDP's "
                    "own reduction for HSDP"
                )
    return None


def _check(
    hook: Any, options: dict[str, Any], modules: list[tuple[str, FSDPModule]]
) -> tuple[Any, dict[str, Any]]:
    """The hook's spec and the options its states get, or the error for this rank's
    ``hook``, ``options`` or modules."""
    spec = hook_spec(hook, "pycomm.fsdp.compress")
    compressed = isinstance(spec.state, type) and issubclass(spec.state, CompressedState)
    exact = isinstance(spec.state, type) and issubclass(spec.state, AllreduceState)
    if not modules:
        raise ValueError(
            "pycomm.fsdp.compress: model has no FSDPModule; call "
            "torch.distributed.fsdp.fully_shard on its modules (and the root) first"
        )
    if not (compressed or exact):
        raise ValueError(
            f"pycomm.fsdp.compress: hook={hook!r} is not a reduce-scatter: use 'allreduce' or "
            "a compressed hook (bf16, fp16, int8, fp8, int4, onebit, or a registered codec)"
        )
    for key, why in _NOT_HERE.items():
        if key in options:
            raise ValueError(f"pycomm.fsdp.compress: option {key}={options[key]!r}: {why}")
    if exact and options:
        raise ValueError(
            f"pycomm.fsdp.compress: hook='allreduce' takes no options, got {sorted(options)}"
        )
    problem = _mesh_problem(modules)
    if problem is not None:
        raise ValueError(f"pycomm.fsdp.compress: {problem}")
    opts = dict(options)
    if compressed:
        opts.setdefault("error_feedback", False)
    return spec, opts


def compress(
    model: torch.nn.Module,
    hook: str = "int8",
    hook_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> FSDPCompression:
    """Send the gradients of every ``fully_shard``-ed module of ``model`` with ``hook``.

    Call it on every rank, after ``fully_shard`` and before the first backward. The hook,
    the options and the sharded modules (names, parameter shapes) are compared across ranks
    first: a difference is a ValueError on every rank.

    Args:
        model: a model whose modules (the root included, or not) were ``fully_shard``-ed.
        hook: ``"allreduce"`` (the exact reduce-scatter, summed in fp32, or in float64 for
            float64 gradients) or a compressed hook of the
            registry (``"bf16"``, ``"fp16"``, ``"int8"``, ``"onebit"``, a user's codec).
        hook_options: the hook's options, one dict as in ``pycomm.wrap`` (``block``,
            ``start_iter``, ``error_feedback`` (default False here), ``residual_dtype``, a user
            codec's own); as keyword arguments, the older spelling, with a FutureWarning.

    Returns:
        An :class:`FSDPCompression`: ``stats``, ``state_dict()``, ``load_state_dict()``.

    Example:
        >>> fully_shard(model)
        >>> comm = pycomm.fsdp.compress(model, hook="int8", hook_options={"block": 128})
    """
    options = hook_options_of("pycomm.fsdp.compress", hook_options, legacy)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pycomm.fsdp.compress: no process group; call pycomm.init() first")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"pycomm.fsdp.compress: model is a {type(model).__name__}, expected an nn.Module"
        )
    modules = _fsdp_modules(model)
    # every check this rank can make, then every rank's resolved configuration compared
    # (the same error on every rank); the states bind, creating groups, only afterwards
    fields: dict[str, Any] = {}
    if isinstance(hook, str):  # a name registered on some ranks only: named on every rank
        fields["hook"] = hook
        fields[f"registration of hook {hook!r}"] = registration(hook)
    fields.update(error_field(None))
    try:
        spec, opts = _check(hook, options, modules)
        if issubclass(spec.state, CompressedState):
            with unbound():
                fields.update(resolved_config(spec.state(None, **opts)))
        else:
            fields["hook"] = hook
    except (ValueError, TypeError) as e:
        fields.update(error_field(e))
    fields["sharded modules"] = [
        (name, [tuple(p.shape) for p in m.parameters()]) for name, m in modules
    ]
    agree("pycomm.fsdp.compress", fields)
    compressed = issubclass(spec.state, CompressedState)
    installed: dict[str, ModuleReduceScatter] = {}
    for name, module in modules:
        # the codec, its options checked (a ValueError naming the option) by the hook's state
        state = spec.state(None, **opts) if compressed else None
        rs = ModuleReduceScatter(name, hook, state)
        try:
            module.set_custom_reduce_scatter(rs)
        except ValueError as e:
            raise ValueError(
                f"pycomm.fsdp.compress: module {name or 'root'!r}: {e} (parameters placed on "
                "several meshes by shard_placement_fn are not supported)"
            ) from e
        installed[name] = rs
    logger.info(
        "pycomm.fsdp: %s reduce-scatter on %d FSDP modules with options %s",
        hook,
        len(installed),
        opts,
    )
    return FSDPCompression(hook, opts, installed)
