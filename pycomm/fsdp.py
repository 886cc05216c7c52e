"""Compressed gradient reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 reduces each sharded module's gradients with one reduce-scatter of a flat input of
``world_size`` equal chunks, chunk j going to rank j. :func:`compress` builds one
:class:`pycomm.Exchange` on the process group of the FSDP mesh and installs a
:class:`ModuleReduceScatter` on every ``FSDPModule`` of a model through torch's own extension
point (``FSDPModule.set_custom_reduce_scatter``): a module's reduce-scatter is the Exchange's
``reduce_scatter``, keyed by the module's name. The codec (int8, bf16, fp16, onebit, or a
user's, see :func:`pycomm.hooks.register_hook`), the padding of each chunk to whole blocks,
the error-feedback residual and the byte counts are therefore the engine's: each rank encodes
its whole input, exchanges the codes all-to-all, and decodes and sums its chunk in fp32 into
its output shard (the bytes a rank sends are (N-1)/N of the compressed input).
``hook="allreduce"`` is the Exchange's exact reduce-scatter (one all-to-all, the rows summed in
rank order in fp32, float64 gradients in float64). This module keeps no codec or residual of
its own: what it adds is FSDP's side, below.

FSDP's reduction is honoured as it asks for it: its op (``AVG`` the Exchange's
``op="mean"``, ``SUM`` ``op="sum"``, ``PREMUL_SUM`` from ``set_gradient_divide_factor`` its
factor as ``scale``), its post-division and its ``reduce_dtype``
(``MixedPrecisionPolicy``; a codec's other dtypes are refused before any collective);
accumulation without communication is FSDP's own ``set_requires_gradient_sync(False)`` on the
micro-steps that should not reduce. The warm-up is per module: the first ``start_iter``
reduce-scatters of each module are exact (default: the hook's own ``start_iter``).

Error feedback keeps, on every rank, a residual of each module's whole unsharded gradient:
the memory FSDP exists to save (4 bytes a parameter in fp32, 2 with
``residual_dtype="bfloat16"``, on every rank, against FSDP's 4/N for the sharded gradient).
It is therefore off by default here (``error_feedback=True`` turns it on); ``stats`` reports
``residual_bytes``. The residual follows the engine's non-finite rule: a block whose input
holds a NaN or Inf keeps its residual as it was.

HSDP: a model sharded on :func:`node_mesh` (this rank's node) keeps FSDP's own reduce-scatter
inside the node, and each shard's gradient is all-reduced across the nodes through the hook
(:class:`NodeAllReduce`, FSDP2's ``set_all_reduce_hook``, see :mod:`pycomm.hsdp`).

Example:
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> comm = pycomm.fsdp.compress(model, hook="int8")
    >>> loss = model(x).sum(); loss.backward()   # every module's gradients sent as int8
    >>> comm.stats["compression"]
"""

from __future__ import annotations

import copy
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
from pycomm.exchange import Exchange
from pycomm.hooks import CompressedState, hook_spec
from pycomm.hooks.allreduce import AllreduceState
from pycomm.hooks.config import agree, error_field, resolved_config
from pycomm.hooks.registry import registration
from pycomm.hooks.state import HookState, accepts_dtype, dtype_names, unbound
from pycomm.hsdp import NodeAllReduce, cross_group, node_mesh

__all__ = ["FSDPCompression", "ModuleReduceScatter", "NodeAllReduce", "compress", "node_mesh"]

logger = logging.getLogger(__name__)

# the version of FSDPCompression.state_dict (1: per module its residual, before the Exchange)
FORMAT = 2

# options of the DDP hooks that have no meaning for a one-phase reduce-scatter
_NOT_HERE = {
    "hierarchy": "the node hierarchy is DDP's; FSDP2 reduce-scatters within its mesh",
    "local_feedback": "FSDP's reduce-scatter has one phase: use error_feedback",
    "strict_skip": "FSDP's residuals are one copy, updated in place (a non-finite block keeps "
    "its residual)",
}

_COUNTERS = ("calls", "bytes_sent", "bytes_fp32")


def _reduction(op: Any) -> dict[str, Any]:
    """``Exchange.reduce_scatter``'s arguments for FSDP's ``op``: AVG the mean, SUM the sum,
    PREMUL_SUM its factor as ``scale``."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return {"op": "mean"}
    if kind == dist.ReduceOp.SUM:
        return {"op": "sum"}
    if kind == dist.ReduceOp.PREMUL_SUM:
        return {"scale": float(op.factor)}
    raise ValueError(f"pycomm.fsdp: FSDP asked for a reduce-scatter with op {op!r}")


def _ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


class ModuleReduceScatter(ReduceScatter):
    """The ``ReduceScatter`` of one ``FSDPModule`` (installed by :func:`compress`): the
    model's :class:`pycomm.Exchange`, called with the module's name as key, and the module's
    counters.

    Attributes:
        name: the module's name in the model ("" for the root).
        exchange: the :class:`pycomm.Exchange` of the model (one for every module).
        iter: reduce-scatters run (one per synchronized backward).
        stats: ``calls``, ``bytes_sent``, ``bytes_fp32`` (what an fp32 reduce-scatter of the
            same input sends) and ``residual_bytes`` (the module's residual in the Exchange).

    Example:
        >>> rs = pycomm.fsdp.compress(model, hook="int8").modules[""]
        >>> rs.stats["bytes_sent"]
    """

    def __init__(
        self,
        name: str,
        hook: str,
        exchange: Exchange,
        grad_dtypes: Optional[tuple[torch.dtype, ...]] = None,
    ) -> None:
        self.name = name
        self.hook = hook
        self.exchange = exchange
        self.grad_dtypes = grad_dtypes  # None: every floating dtype (the exact exchange)
        self.counters = {key: 0 for key in _COUNTERS}
        self._group: Any = exchange.process_group  # the last group FSDP passed, once checked

    @property
    def iter(self) -> int:
        return self.counters["calls"]

    @property
    def stats(self) -> dict[str, int]:
        return {**self.counters, "residual_bytes": self.exchange.residual_bytes(self.name)}

    @property
    def collectives(self) -> dict[str, dict[str, int]]:
        """``reduce_scatter``: its ``bytes_sent`` and ``bytes_fp32``."""
        c = self.counters
        return {"reduce_scatter": {"bytes_sent": c["bytes_sent"], "bytes_fp32": c["bytes_fp32"]}}

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
        ``output_tensor`` on ``group``, as FSDP's ``op`` asks, through the Exchange;
        synchronous (FSDP runs it in its reduce-scatter stream)."""
        where = f"pycomm.fsdp ({self.name or 'root'})"
        n = dist.get_world_size(group)
        s = output_tensor.numel()
        if input_tensor.numel() != n * s:
            raise ValueError(
                f"{where}: input of {input_tensor.numel()} elements for an output of {s} on "
                f"{n} ranks, expected {n * s}"
            )
        if group is not self._group:
            ours, theirs = _ranks(self.exchange.process_group), _ranks(group)
            if theirs != ours:
                raise ValueError(
                    f"{where}: FSDP reduce-scatters on the process group of ranks {theirs}, "
                    f"expected the group of ranks {ours} that compress() built its Exchange "
                    "on (the sharded parameters' mesh); call pycomm.fsdp.compress after "
                    "fully_shard, with every module on that mesh"
                )
            self._group = group
        reduction = _reduction(op)
        if self.grad_dtypes is not None and not accepts_dtype(self, input_tensor.dtype):
            # every rank reduces the same dtype: each raises here, none waits in a collective
            raise TypeError(
                f"{where}: the {self.hook} hook reduces {dtype_names(self.grad_dtypes)} "
                f"gradients, and FSDP reduces this module's in "
                f"{str(input_tensor.dtype).replace('torch.', '')}; expected a model of those "
                "dtypes, MixedPrecisionPolicy(reduce_dtype=torch.float32), or hook='allreduce'"
            )
        out = output_tensor
        if not out.is_contiguous():
            out = torch.empty_like(output_tensor, memory_format=torch.contiguous_format)
        work = self.exchange.reduce_scatter(
            out, input_tensor.contiguous(), key=self.name, **reduction
        )
        work.wait()
        if out is not output_tensor:
            output_tensor.copy_(out)
        c = self.counters
        c["calls"] += 1
        c["bytes_sent"] += work.bytes_sent
        c["bytes_fp32"] += work.bytes_fp32
        return None

    def state_dict(self) -> dict[str, Any]:
        """The module's counters (its residual and warm-up are the Exchange's)."""
        return {"stats": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.update({key: int(state["stats"][key]) for key in _COUNTERS})


class FSDPCompression(HookState):
    """What :func:`compress` returns for a model: the :class:`pycomm.Exchange` that reduces
    its gradients (``exchange``), one :class:`ModuleReduceScatter` per ``FSDPModule``
    (``modules``, by name), their summed ``stats`` and one checkpointable state per rank. A
    :class:`~pycomm.hooks.HookState`, so ``pycomm.checkpoint``'s
    ``save_rank_state``/``load_rank_state`` take it as they take a DDP hook's state.

    Example:
        >>> comm = pycomm.fsdp.compress(model, hook="int8", hook_options={"error_feedback": True})
        >>> pycomm.checkpoint.save_rank_state(comm, "out/step-100")   # every rank its own file
        >>> pycomm.checkpoint.load_rank_state(comm, "out/step-100")   # on resume, every rank
    """

    hook_name = "fsdp"

    def __init__(
        self,
        hook: str,
        options: dict[str, Any],
        modules: dict[str, Any],
        exchange: Exchange,
    ) -> None:
        # the rank that owns the state: in the mesh, or under HSDP in every rank
        hsdp = any(isinstance(m, NodeAllReduce) for m in modules.values())
        super().__init__(None if hsdp else exchange.process_group)
        self.hook = hook
        self.hook_options = options
        self.modules = modules
        self.exchange = exchange
        self._fresh = copy.deepcopy(exchange.state_dict())  # what a format 1 loads into

    @property
    def stats(self) -> dict[str, Any]:
        """``calls``, ``bytes_sent``, ``bytes_fp32``, ``residual_bytes`` summed over the
        modules and their collectives, ``compression`` (bytes_fp32 / bytes_sent), and one dict
        per collective with its ``bytes_sent`` and ``bytes_fp32`` (what FSDP2's own fp32
        collective sends): ``reduce_scatter``, and under HSDP ``all_reduce`` (the cross-node
        exchange; the reduce-scatter inside the node is FSDP's own)."""
        out: dict[str, Any] = {"calls": 0, "bytes_sent": 0, "bytes_fp32": 0, "residual_bytes": 0}
        per: dict[str, dict[str, int]] = {}
        for m in self.modules.values():
            for key, value in m.stats.items():
                out[key] += value
            for name, counts in m.collectives.items():
                mine = per.setdefault(name, {"bytes_sent": 0, "bytes_fp32": 0})
                for key in mine:
                    mine[key] += counts[key]
        out["compression"] = out["bytes_fp32"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        out.update(per)
        return out

    def options(self) -> dict[str, Any]:
        return {"hook": self.hook, **self.hook_options}

    def fingerprint(self) -> dict[str, Any]:
        fp = {**super().fingerprint(), "modules": sorted(self.modules)}
        if self.hsdp:  # the ranks of a node (absent: not HSDP, as before it existed)
            fp["hsdp ranks per node"] = next(iter(self.modules.values())).local_size
        return fp

    @property
    def hsdp(self) -> bool:
        """Whether the model is sharded inside each node and all-reduced across (HSDP)."""
        return any(isinstance(m, NodeAllReduce) for m in self.modules.values())

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the Exchange's (every module's residual and warm-up count) and
        every module's counters."""
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint(),
            "rank": self.rank,
            "world_size": self.world_size,
            "exchange": self.exchange.state_dict(),
            "modules": {name: m.state_dict() for name, m in self.modules.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank; another hook, option or model (or another
        rank's state) is a ValueError naming it. A state of format 1 (before the Exchange:
        per module its warm-up count, residual and counters) is converted."""
        version = state.get("format", 1) if isinstance(state, dict) else None
        if version not in (1, FORMAT):
            raise ValueError(
                f"pycomm.fsdp: cannot load a state of format {version!r}; this pycomm reads "
                f"formats 1 and {FORMAT} (a newer pycomm wrote it? load it with that version)"
            )
        self.check_fingerprint(state)
        if version == 1:
            self._load_format_1(state)
            return
        self.exchange.load_state_dict(state["exchange"])
        for name, m in self.modules.items():
            m.load_state_dict(state["modules"][name])

    def _load_format_1(self, state: dict[str, Any]) -> None:
        """Per module ``{"iter", "residual", "stats"}``: its calls and residual go to a fresh
        Exchange state under the module's key, its counters to the module; all or nothing."""
        before = self.state_dict()
        self.exchange.load_state_dict(self._fresh)
        for name in self.modules:
            old = state["modules"][name]
            try:
                self.exchange.load_key(name, int(old["iter"]), old["residual"])
            except ValueError as e:
                self.load_state_dict(before)
                raise ValueError(
                    f"pycomm.fsdp: cannot load module {name or 'root'!r} of a state written by "
                    f"pycomm.fsdp format 1 (before the Exchange): {e}; expected the model, hook "
                    "and options that wrote it, or start the compression state afresh"
                ) from e
        for name, m in self.modules.items():
            m.load_state_dict(state["modules"][name])


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _mesh_group(modules: list[tuple[str, FSDPModule]]) -> tuple[Any, Optional[str]]:
    """The process group of the sharded parameters' mesh (None: no sharded parameter, the
    default group), or the problem with their meshes."""
    found: Optional[tuple[str, Any]] = None
    for name, module in modules:
        for pname, p in module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                continue
            if mesh.ndim != 1:
                return None, (
                    f"parameter {pname!r} of module {name or 'root'!r} is sharded on a "
                    f"{mesh.ndim}-D device mesh (FSDP2's native HSDP, whose cross-node "
                    "all-reduce has no hook to replace): expected a 1-D mesh; for HSDP shard "
                    "on pycomm.fsdp.node_mesh(), and compress() all-reduces each shard across "
                    "the nodes through the hook"
                )
            group = mesh.get_group()
            if found is None:
                found = (f"{pname!r} of module {name or 'root'!r}", group)
            elif group is not found[1] and _ranks(group) != _ranks(found[1]):
                return None, (
                    f"parameter {pname!r} of module {name or 'root'!r} is sharded over ranks "
                    f"{_ranks(group)}, and parameter {found[0]} over ranks "
                    f"{_ranks(found[1])}: pycomm.fsdp compresses one mesh's reduce-scatter; "
                    "expected every module on one mesh"
                )
    return (None if found is None else found[1]), None


def _replicated(modules: list[tuple[str, FSDPModule]]) -> Optional[str]:
    """The first module ``replicate()``-ed (torch's FSDP2-based DDP), named, or None."""
    for name, module in modules:
        if any(c.__name__ == "ReplicateModule" for c in type(module).__mro__):
            return name or "root"
    return None


def _check(
    hook: Any, options: dict[str, Any], modules: list[tuple[str, FSDPModule]]
) -> tuple[Any, dict[str, Any], Any]:
    """The hook's spec, the options its Exchange gets and the mesh's group, or the error for
    this rank's ``hook``, ``options`` or modules."""
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
    replicated = _replicated(modules)
    if replicated is not None:
        raise ValueError(
            f"pycomm.fsdp.compress: module {replicated!r} is replicate()-ed, whose all-reduce "
            "pycomm cannot reach; expected fully_shard(module, reshard_after_forward=False) on "
            "one mesh (ZeRO-2: the parameters stay gathered, the gradients reduce-scattered "
            "through the hook), or pycomm.wrap for DDP"
        )
    group, problem = _mesh_group(modules)
    if problem is not None:
        raise ValueError(f"pycomm.fsdp.compress: {problem}")
    hsdp = _is_hsdp(group)
    for key, why in _NOT_HERE.items():
        if key in options and (not hsdp or key == "hierarchy"):
            raise ValueError(f"pycomm.fsdp.compress: option {key}={options[key]!r}: {why}")
    if exact and options:
        raise ValueError(
            f"pycomm.fsdp.compress: hook='allreduce' takes no options, got {sorted(options)}"
        )
    opts = dict(options)
    if compressed and not hsdp:  # a residual of the whole unsharded gradient: opt-in
        opts.setdefault("error_feedback", False)
    return spec, opts, group


def _is_hsdp(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the mesh's group holds some ranks only (a node's: HSDP), not every rank."""
    return group is not None and dist.get_world_size(group) < dist.get_world_size()


def compress(
    model: torch.nn.Module,
    hook: str = "int8",
    hook_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> FSDPCompression:
    """Send the gradients of every ``fully_shard``-ed module of ``model`` with ``hook``,
    through one :class:`pycomm.Exchange` on the FSDP mesh's process group.

    Call it on every rank, after ``fully_shard`` and before the first backward. The hook,
    the options and the sharded modules (names, parameter shapes) are compared across ranks
    first: a difference is a ValueError on every rank.

    On a mesh of some ranks only (a node's, :func:`node_mesh`: HSDP), the reduce-scatter
    inside the node stays FSDP's own and each module's shard is all-reduced across the nodes
    through ``hook`` (:class:`NodeAllReduce`), with the hook's own defaults (error feedback on
    the shard included).

    Args:
        model: a model whose modules (the root included, or not) were ``fully_shard``-ed, on
            one 1-D mesh: every rank, or each node's (HSDP).
        hook: ``"allreduce"`` (the exact reduce-scatter, summed in fp32, or in float64 for
            float64 gradients) or a compressed hook of the
            registry (``"bf16"``, ``"fp16"``, ``"int8"``, ``"onebit"``, a user's codec).
        hook_options: the hook's options, one dict as in ``pycomm.wrap`` (``block``,
            ``start_iter`` (per module: its first reduce-scatters run exact; default the
            hook's own), ``error_feedback`` (default False here), ``residual_dtype``, a user
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
    # (the same error on every rank); the Exchange is built, creating groups, only afterwards
    fields: dict[str, Any] = {}
    if isinstance(hook, str):  # a name registered on some ranks only: named on every rank
        fields["hook"] = hook
        fields[f"registration of hook {hook!r}"] = registration(hook)
    fields.update(error_field(None))
    group = None
    try:
        spec, opts, group = _check(hook, options, modules)
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
    fields["ranks of the mesh"] = None if group is None else dist.get_world_size(group)
    agree("pycomm.fsdp.compress", fields)
    compressed = issubclass(spec.state, CompressedState)
    ex_opts = dict(opts)
    start_iter = ex_opts.pop("start_iter", getattr(spec.state, "default_start_iter", 0))
    ex_opts["hierarchy"] = "flat"  # the mesh decides the nodes
    if _is_hsdp(group):
        # FSDP's own reduce-scatter inside the node, the hook's all-reduce across the nodes
        exchange = Exchange(hook, cross_group(group), start_iter=start_iter, **ex_opts)
        nodes = _install_node_all_reduce(modules, exchange, dist.get_world_size(group))
        logger.info("pycomm.fsdp: HSDP, %s across nodes on %d FSDP modules", hook, len(nodes))
        return FSDPCompression(hook, opts, nodes, exchange)
    if compressed:
        ex_opts["local_feedback"] = True  # error feedback is on the reduce-scatter's input
    exchange = Exchange(hook, group, start_iter=start_iter, **ex_opts)
    grad_dtypes = spec.state.grad_dtypes if compressed else None
    installed: dict[str, ModuleReduceScatter] = {}
    for name, module in modules:
        rs = ModuleReduceScatter(name, hook, exchange, grad_dtypes)
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
    return FSDPCompression(hook, opts, installed, exchange)


def _install_node_all_reduce(
    modules: list[tuple[str, FSDPModule]], exchange: Exchange, local_size: int
) -> dict[str, NodeAllReduce]:
    """A :class:`NodeAllReduce` on every module (``set_all_reduce_hook``), on a stream of its
    own on a GPU, so that the cross-node exchange overlaps the next module's backward."""
    installed: dict[str, NodeAllReduce] = {}
    for name, module in modules:
        hook = NodeAllReduce(name, exchange, local_size)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        module.set_all_reduce_hook(hook, stream=stream)
        installed[name] = hook
    return installed
