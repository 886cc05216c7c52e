"""Compressed gradient reduce-scatter, and optionally parameter all-gather, for FSDP2
(``torch.distributed.fsdp.fully_shard``).

FSDP2 reduces each sharded module's gradients with one reduce-scatter of a flat input of
``world_size`` equal chunks, chunk j going to rank j. :func:`compress` builds one
:class:`pycomm.Exchange` on the process group of the FSDP mesh and installs a
:class:`ModuleReduceScatter` on every ``FSDPModule`` of a model through torch's own extension
point (``FSDPModule.set_custom_reduce_scatter``): a module's reduce-scatter is the Exchange's
``reduce_scatter``, keyed by the module's name. The codec (any registered one, a user's too:
``pycomm.Exchange.codecs()`` lists them), the padding of each chunk to whole blocks,
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
``residual_bytes``. The residual follows the engine's non-finite rule (docs/failures.md, "A
non-finite gradient skips the step everywhere").

The parameter all-gather (ZeRO++'s quantized weights, on FSDP2's public API) is FSDP2's own
unless ``all_gather=`` names a codec: then a :class:`ModuleAllGather` on every ``FSDPModule``
(``FSDPModule.set_custom_all_gather``) runs an all-gather of a second :class:`pycomm.Exchange`
(keyed by the module's name). FSDP hands it this rank's shard (in ``param_dtype``, padded to
FSDP's equal shards) and its unsharded buffer; the rank encodes its shard once, the codes are
gathered, and every rank decodes every rank's chunk, its own too, into the buffer. Every rank
therefore computes with the same bits, and a shard gathered again in backward (after a reshard
after forward) decodes to the same weights as in forward. The sharded master parameters, which
the optimizer updates, are never written: the codec's error is in what forward and backward
compute with, never accumulated from step to step, and there is no residual and no warm-up.
A codec is accepted for weights when its round trip of a fixed normal vector
(:func:`weight_error`) stays within :data:`WEIGHT_ERROR_LIMIT`, a test that applies to a user's
codec as to the built-in ones (onebit and int4 fail it). ``stats`` reports both collectives.

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
    >>> comm = pycomm.fsdp.compress(model, hook="int8", all_gather="int8")  # weights too
    >>> comm.stats["all_gather"]["bytes_sent"]
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

try:  # the interfaces set_custom_reduce_scatter/all_gather document (not exported by torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # FSDP calls allocate() and __call__(), nothing else
    AllGather = ReduceScatter = object  # type: ignore[misc,assignment]

from pycomm._validate import check_int, hook_options_of
from pycomm.codec.agree import agree, check_saved, dtype_names, error_field
from pycomm.codec.config import FLOATS, build_codec, codec_options, resolve
from pycomm.codec.registry import ENGINE_OPTIONS, codec_identity, find_codec, qualified_name
from pycomm.exchange import Exchange
from pycomm.hsdp import NodeAllReduce, cross_group, is_node_group, node_mesh

__all__ = [
    "WEIGHT_ERROR_LIMIT",
    "FSDPCompression",
    "ModuleAllGather",
    "ModuleReduceScatter",
    "compress",
    "weight_error",
    "NodeAllReduce",
    "node_mesh",
]

logger = logging.getLogger(__name__)

# the FSDP modules a compress() installed its collectives on, with its hook and all_gather:
# a second compress() of one of them is refused (FSDP would run the second's, and the first's
# stats and state_dict would go stale)
_COMPRESSED: weakref.WeakKeyDictionary[FSDPModule, str] = weakref.WeakKeyDictionary()

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

# The largest relative L2 error a codec may have on weights (:func:`weight_error` of its probe
# vector) to carry FSDP's parameter all-gather: every forward and backward computes with the
# decoded weights, with no error feedback to average the error out over steps.
WEIGHT_ERROR_LIMIT = 0.05

# the probe weight_error() sends through a codec and back: a fixed normal vector, on the CPU
_PROBE_ELEMENTS, _PROBE_SEED = 4096, 0

# the engine's options that mean nothing for an all-gather (no residual, no warm-up, no node
# hierarchy); any other engine option of a codec's state is refused as well
_NOT_FOR_ALL_GATHER = {
    "error_feedback": "an all-gather of weights keeps no residual (the master shards stay exact)",
    "local_feedback": "an all-gather of weights keeps no residual",
    "residual_dtype": "an all-gather of weights keeps no residual",
    "strict_skip": "an all-gather of weights keeps no residual",
    "hierarchy": "FSDP2 all-gathers within its 1-D mesh",
    "start_iter": "an exact warm-up has no reason for weights (the codec is used from the "
    "first all-gather); for exact all-gathers use all_gather=None",
}


# FSDP2 hands every rank the same shard shapes (its own collectives need them): each module's
# first reduce-scatter is compared, not every one
_CHECK = "first"


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


def _check_group(where: str, verb: str, exchange: Exchange, group: dist.ProcessGroup) -> None:
    """A ValueError naming both unless ``group`` (what FSDP passed) has the ranks of the
    group ``exchange`` runs on."""
    ours, theirs = _ranks(exchange.process_group), _ranks(group)
    if verb == "all-gathers" and len(theirs) < len(ours) and set(theirs) <= set(ours):
        raise ValueError(
            f"{where}: FSDP all-gathers on the process group of ranks {theirs}, a part of the "
            f"mesh's ranks {ours}: the module was fully_shard-ed with reshard_after_forward "
            "an int, which re-gathers the parameters in backward over a smaller mesh; "
            "all_gather= a codec all-gathers over the whole mesh, so expected "
            "reshard_after_forward=True or False with it, or all_gather=None"
        )
    if theirs != ours:
        raise ValueError(
            f"{where}: FSDP {verb} on the process group of ranks {theirs}, "
            f"expected the group of ranks {ours} that compress() built its Exchange "
            "on (the sharded parameters' mesh); call pycomm.fsdp.compress after "
            "fully_shard, with every module on that mesh"
        )


class _ModuleCollective:
    """What a module's reduce-scatter and all-gather share: its name, the Exchange, the dtypes
    the codec takes, the counters, and one call's checks and bookkeeping."""

    verb = ""  # what the collective does, in an error ("reduce-scatters", "all-gathers")

    def __init__(
        self, name: str, exchange: Exchange, dtypes: Optional[tuple[torch.dtype, ...]]
    ) -> None:
        self.name = name
        self.exchange = exchange
        self.grad_dtypes = dtypes  # what the codec takes; None: any
        self.counters = {key: 0 for key in _COUNTERS}
        self._group: Any = exchange.process_group  # the last group FSDP passed, once checked

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def _where(self, group: dist.ProcessGroup, whole: tuple[str, torch.Tensor],
               part: tuple[str, torch.Tensor]) -> str:  # fmt: skip
        """This call's name in errors, once its sizes (``whole`` holds N of ``part``) and its
        group (the Exchange's ranks) are checked: the same on every rank, so each raises here
        and none waits in a collective."""
        where = f"pycomm.fsdp ({self.name or 'root'})"
        n = dist.get_world_size(group)
        (whole_name, w), (part_name, p) = whole, part
        if w.numel() != n * p.numel():
            raise ValueError(
                f"{where}: {whole_name} of {w.numel()} elements for {part_name} of {p.numel()} "
                f"on {n} ranks, expected {n * p.numel()}"
            )
        if group is not self._group:
            _check_group(where, self.verb, self.exchange, group)
            self._group = group
        return where

    def _run(self, output_tensor: torch.Tensor, call: Any) -> None:
        """``call(out)`` into a contiguous ``out`` (``output_tensor`` or a copy), waited on;
        its bytes counted."""
        out = output_tensor
        if not out.is_contiguous():
            out = torch.empty_like(output_tensor, memory_format=torch.contiguous_format)
        work = call(out)
        work.wait()
        if out is not output_tensor:
            output_tensor.copy_(out)
        c = self.counters
        c["calls"] += 1
        c["bytes_sent"] += work.bytes_sent
        c["bytes_fp32"] += work.bytes_fp32

    def state_dict(self) -> dict[str, Any]:
        """The module's counters (residuals and warm-ups are the Exchange's)."""
        return {"stats": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.update({key: int(state["stats"][key]) for key in _COUNTERS})


class ModuleReduceScatter(_ModuleCollective, ReduceScatter):
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

    verb = "reduce-scatters"

    def __init__(
        self,
        name: str,
        hook: str,
        exchange: Exchange,
        grad_dtypes: Optional[tuple[torch.dtype, ...]] = None,
    ) -> None:
        super().__init__(name, exchange, grad_dtypes)  # None: any dtype (the exact exchange)
        self.hook = hook

    @property
    def iter(self) -> int:
        return self.counters["calls"]

    @property
    def stats(self) -> dict[str, int]:
        return {**self.counters, "residual_bytes": self.exchange.residual_bytes(self.name)}

    @property
    def collectives(self) -> dict[str, dict[str, int]]:
        """``reduce_scatter``: its ``calls``, ``bytes_sent`` and ``bytes_fp32``."""
        return {"reduce_scatter": dict(self.counters)}

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
        where = self._where(group, ("input", input_tensor), ("an output", output_tensor))
        reduction = _reduction(op)
        if self.grad_dtypes is not None and input_tensor.dtype not in self.grad_dtypes:
            # every rank reduces the same dtype: each raises here, none waits in a collective
            raise TypeError(
                f"{where}: the {self.hook} hook reduces {dtype_names(self.grad_dtypes)} "
                f"gradients, and FSDP reduces this module's in "
                f"{str(input_tensor.dtype).replace('torch.', '')}; expected a model of those "
                "dtypes, MixedPrecisionPolicy(reduce_dtype=torch.float32), or hook='allreduce'"
            )
        x = input_tensor.contiguous()
        self._run(
            output_tensor,
            lambda out: self.exchange.reduce_scatter(
                out, x, key=self.name, **reduction, async_op=False
            ),
        )
        return None


class ModuleAllGather(_ModuleCollective, AllGather):
    """The parameter ``AllGather`` of one ``FSDPModule`` (installed by :func:`compress` with
    ``all_gather=`` a codec): the all-gathers' :class:`pycomm.Exchange` (one for the model,
    apart from the reduce-scatter's), called with the module's name as key, and the module's
    counters.

    Each call encodes this rank's shard once (FSDP's all-gather input, in its ``param_dtype``),
    gathers every rank's codes and decodes them all, this rank's own too, into FSDP's unsharded
    buffer: every rank computes with the same bits, and the same shard gives the same weights
    in forward and in backward (a reshard after forward all-gathers it again). The sharded
    master parameters are not written, and nothing is kept from one call to the next.

    Attributes:
        name: the module's name in the model ("" for the root).
        exchange: the all-gathers' :class:`pycomm.Exchange` (one for every module).
        stats: ``calls``, ``bytes_sent`` and ``bytes_fp32`` (what FSDP2's own all-gather of
            fp32 shards sends: (N-1) x the shard's elements x 4).

    Example:
        >>> ag = pycomm.fsdp.compress(model, all_gather="int8").all_gathers["layers.0"]
        >>> ag.stats["bytes_sent"]
    """

    verb = "all-gathers"

    def __init__(
        self, name: str, codec: str, exchange: Exchange, dtypes: tuple[torch.dtype, ...]
    ) -> None:
        super().__init__(name, exchange, dtypes)
        self.codec = codec

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        """All-gather ``input_tensor`` (this rank's shard; FSDP passes a view of its chunk of
        ``output_tensor``) into ``output_tensor`` (N chunks) on ``group``, through the codec;
        synchronous (FSDP runs it in its all-gather stream and waits on its event)."""
        where = self._where(group, ("all-gather output", output_tensor), ("an input", input_tensor))
        if input_tensor.dtype not in self.grad_dtypes:
            # every rank gathers the same dtype: each raises here, none waits in a collective
            raise TypeError(
                f"{where}: all_gather={self.codec!r} encodes {dtype_names(self.grad_dtypes)} "
                f"weights, and FSDP all-gathers this module's in "
                f"{str(input_tensor.dtype).replace('torch.', '')}; expected a model (or "
                "MixedPrecisionPolicy(param_dtype=...)) of those dtypes, or all_gather=None"
            )
        # the input is encoded before any chunk of the output is written: FSDP's input may
        # be a view of this rank's chunk of the output
        x = input_tensor.contiguous()
        self._run(
            output_tensor,
            lambda out: self.exchange.all_gather(out, x, key=self.name, async_op=False),
        )
        return None


class FSDPCompression:
    """What :func:`compress` returns for a model: the :class:`pycomm.Exchange` that reduces
    its gradients (``exchange``), one :class:`ModuleReduceScatter` per ``FSDPModule``
    (``modules``, by name), with ``all_gather=`` a codec the all-gathers' Exchange
    (``all_gather_exchange``, else None) and one :class:`ModuleAllGather` per ``FSDPModule``
    (``all_gathers``, by name; empty without), their summed ``stats`` and one checkpointable
    state per rank (its ``rank`` and ``world_size`` among every rank), which
    ``pycomm.checkpoint``'s ``save_rank_state``/``load_rank_state`` take as they take a DDP
    hook's state.

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
        all_gather: Optional[str] = None,
        all_gather_options: Optional[dict[str, Any]] = None,
        all_gathers: Optional[dict[str, ModuleAllGather]] = None,
        all_gather_exchange: Optional[Exchange] = None,
    ) -> None:
        # the rank that owns the state, among every rank (a mesh of some ranks numbers them
        # again from 0: two ranks' states would share a file, and load each other's)
        self.process_group = None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.hook = hook
        self.hook_options = options
        self.modules = modules
        self.exchange = exchange
        self.all_gather = all_gather
        self.all_gather_options = dict(all_gather_options or {})  # the codec's, resolved
        self.all_gathers = dict(all_gathers or {})
        self.all_gather_exchange = all_gather_exchange
        self._fresh = copy.deepcopy(exchange.state_dict())  # what a format 1 loads into
        # set by compress: the options resolved, what resolves the hook's defaults, each module's
        # parameter shapes (all in the fingerprint)
        self.resolved: Optional[dict[str, Any]] = None
        self.spec: Any = None  # the hook's spec, and the options compress set itself
        self.given: dict[str, Any] = {}
        self.shapes: Optional[dict[str, list]] = None

    @property
    def stats(self) -> dict[str, Any]:
        """``bytes_sent`` and ``bytes_fp32`` of every collective together and ``compression``
        (bytes_fp32 / bytes_sent); ``calls`` (each module's reduce-scatters, or under HSDP its
        cross-node all-reduces) and ``residual_bytes`` summed over the modules; and one dict per
        collective, each with its ``calls``, ``bytes_sent`` and ``bytes_fp32`` (what FSDP2's own
        fp32 collective sends): ``reduce_scatter``, ``all_gather`` (zeros for FSDP's own
        all-gather, which pycomm does not count) and under HSDP ``all_reduce`` (the cross-node
        exchange; the reduce-scatter inside the node is then FSDP's own, counted by its size)."""
        per: dict[str, dict[str, int]] = {
            "reduce_scatter": {key: 0 for key in _COUNTERS},
            "all_gather": {key: 0 for key in _COUNTERS},
        }
        calls = residual = 0
        for m in self.modules.values():
            stats = m.stats
            calls += stats["calls"]
            residual += stats["residual_bytes"]
            for name, counts in m.collectives.items():
                mine = per.setdefault(name, {key: 0 for key in _COUNTERS})
                for key in _COUNTERS:
                    mine[key] += counts[key]
        for g in self.all_gathers.values():
            for key in _COUNTERS:
                per["all_gather"][key] += g.counters[key]
        sent = sum(c["bytes_sent"] for c in per.values())
        fp32 = sum(c["bytes_fp32"] for c in per.values())
        return {
            "calls": calls,
            "bytes_sent": sent,
            "bytes_fp32": fp32,
            "residual_bytes": residual,
            "compression": fp32 / sent if sent else 1.0,
            **per,
        }

    def options(self) -> dict[str, Any]:
        """The hook and its options as resolved (defaults filled in): a state saved with
        ``{"block": 64}`` loads where the default 64 was left out, and the other way."""
        return {"hook": self.hook, **(self.resolved or self.hook_options)}

    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must match: the hook and its options, the world size, the
        modules and their shapes, the all-gather's codec, HSDP's ranks per node."""
        gather = None
        if self.all_gather is not None:
            gather = {"codec": self.all_gather, "options": dict(self.all_gather_options)}
        fp = {"hook": self.hook_name, "options": self.options(), "world_size": self.world_size}
        fp.update(modules=sorted(self.modules), all_gather=gather)
        if self.shapes is not None:  # each module's parameters: another model is refused
            fp["module shapes"] = self.shapes
        if self.hsdp:  # the ranks of a node (absent: not HSDP, as before it existed)
            fp["hsdp ranks per node"] = next(iter(self.modules.values())).local_size
        return fp

    def check_fingerprint(self, state: dict[str, Any]) -> None:
        """As every hook's, with the options compared as resolved: a state that left a default
        out (written before the options were resolved) stands for that default; a state
        written before the module shapes were recorded is checked without them."""
        fingerprint = state.get("fingerprint")
        if isinstance(fingerprint, dict):
            fingerprint = dict(fingerprint)
            options = fingerprint.get("options")
            if isinstance(options, dict) and self.spec is not None:
                defaults = _resolved_options(self.spec, self.given)
                fingerprint["options"] = {"hook": self.hook, **defaults, **options}
            if "module shapes" not in fingerprint and self.shapes is not None:
                fingerprint["module shapes"] = self.shapes
            state = {**state, "fingerprint": fingerprint}
        check_saved(self.hook_name, state, self.fingerprint(), self.rank, self.world_size)

    @property
    def hsdp(self) -> bool:
        """Whether the model is sharded inside each node and all-reduced across (HSDP)."""
        return any(isinstance(m, NodeAllReduce) for m in self.modules.values())

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the Exchange's (every module's residual and warm-up count),
        every module's counters and, with ``all_gather=`` a codec, the all-gathers' Exchange
        (its counters) and every module's all-gather counters."""
        out = {
            "format": FORMAT,
            "fingerprint": self.fingerprint(),
            "rank": self.rank,
            "world_size": self.world_size,
            "exchange": self.exchange.state_dict(),
            "modules": {name: m.state_dict() for name, m in self.modules.items()},
        }
        if self.all_gather_exchange is not None:
            out["all_gather"] = {
                "exchange": self.all_gather_exchange.state_dict(),
                "modules": {name: g.state_dict() for name, g in self.all_gathers.items()},
            }
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank; another hook, option, ``all_gather`` or
        model (or another rank's state) is a ValueError naming it. A state of format 1
        (before the Exchange: per module its warm-up count, residual and counters) is
        converted; a state without an ``all_gather`` in its fingerprint (format 1, or 2 before
        the all-gather) was written with FSDP's own all-gather (``all_gather=None``)."""
        version = state.get("format", 1) if isinstance(state, dict) else None
        if version not in (1, FORMAT):
            raise ValueError(
                f"pycomm.fsdp: cannot load a state of format {version!r}; this pycomm reads "
                f"formats 1 and {FORMAT} (a newer pycomm wrote it? load it with that version)"
            )
        fingerprint = state.get("fingerprint")
        if isinstance(fingerprint, dict) and "all_gather" not in fingerprint:
            state = {**state, "fingerprint": {**fingerprint, "all_gather": None}}
        self.check_fingerprint(state)
        if version == 1:
            self._load_format_1(state)
            return
        self.exchange.load_state_dict(state["exchange"])
        for name, m in self.modules.items():
            m.load_state_dict(state["modules"][name])
        if self.all_gather_exchange is not None:
            self.all_gather_exchange.load_state_dict(state["all_gather"]["exchange"])
            for name, g in self.all_gathers.items():
                g.load_state_dict(state["all_gather"]["modules"][name])

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
    """The hook's codec spec (None: ``"allreduce"``), the options its Exchange gets and the
    mesh's group, or the error for this rank's ``hook``, ``options`` or modules."""
    spec = find_codec(hook)
    compressed, exact = spec is not None, hook == "allreduce"
    if not modules:
        raise ValueError(
            "pycomm.fsdp.compress: model has no FSDPModule; call "
            "torch.distributed.fsdp.fully_shard on its modules (and the root) first"
        )
    if not (compressed or exact):
        raise ValueError(
            f"pycomm.fsdp.compress: hook={hook!r} is not a reduce-scatter: use 'allreduce' or "
            f"a registered codec ({', '.join(n for n in Exchange.codecs() if n != 'allreduce')})"
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
    """Whether the mesh is a node's, made by :func:`node_mesh` (HSDP); any other mesh, of
    every rank or of some, is reduced within its ranks as FSDP2 does."""
    return is_node_group(group)


def _weight_codecs() -> str:
    """The registered codecs that carry weights at their defaults (their probe's error within
    :data:`WEIGHT_ERROR_LIMIT`), for an error message: ``'bf16', 'fp16', ...``."""
    fit = []
    for name in Exchange.codecs():
        if name == "allreduce":
            continue
        try:
            if _error_of(find_codec(name).codec()) <= WEIGHT_ERROR_LIMIT:
                fit.append(name)
        except Exception:  # noqa: BLE001 - a codec that fails here is not listed
            continue
    return ", ".join(map(repr, fit))


def _round_trip(codec: Any, x: torch.Tensor) -> torch.Tensor:
    """``x`` (flat) encoded by ``codec`` and decoded, as :meth:`pycomm.Exchange.all_gather`
    sends one rank's chunk: padded to whole blocks, packed, split, decoded."""
    m = x.numel()
    c = -(-m // codec.block) * codec.block
    codes, scales = codec.encode(x, None, 1.0, c)
    rcodes, rscales = codec.split(codec.pack(codes, scales, 1), c)
    out = torch.empty_like(x)
    codec.decode_sum(rcodes, rscales, 1.0, out)
    return out


def _gather_codec(
    all_gather: Any, options: Any, where: str = "pycomm.fsdp.compress"
) -> tuple[Any, dict[str, Any]]:
    """Codec ``all_gather`` built with ``options`` and its own options resolved, or the
    ValueError/TypeError naming the argument, its value and what was expected."""
    what = f"{where}: all_gather={all_gather!r}"
    if not isinstance(all_gather, str):
        raise TypeError(
            f"{what}, expected None (FSDP's own all-gather) or a codec's name ({_weight_codecs()})"
        )
    if all_gather == "allreduce":
        raise ValueError(
            f"{what}: the exact exchange is FSDP's own all-gather, expected all_gather=None "
            f"for it (or a codec: {_weight_codecs()})"
        )
    spec = find_codec(all_gather)
    if spec is None:
        raise ValueError(
            f"{what}: not a registered codec, expected None (FSDP's own all-gather) or a codec "
            f"({_weight_codecs()}; pycomm.codec.register_codec adds one)"
        )
    if options is not None and not isinstance(options, dict):
        raise TypeError(
            f"{where}: all_gather_options={options!r}, expected a dict of the codec's options "
            "or None"
        )
    options = dict(options or {})
    own = spec.option_names
    for key in options:
        if key not in own and key not in ENGINE_OPTIONS:
            raise ValueError(
                f"{where}: all_gather_options option {key!r}: not an option of codec "
                f"{all_gather!r}, expected its own options ({', '.join(own) or 'none'})"
            )
        if key in _NOT_FOR_ALL_GATHER or key not in own:
            why = _NOT_FOR_ALL_GATHER.get(key, "an option of the engine, not of the codec")
            raise ValueError(
                f"{where}: all_gather_options option {key}={options[key]!r}: {why}; expected "
                f"the codec's own options ({', '.join(own) or 'none'})"
            )
    try:
        codec, kwargs = build_codec(f"pycomm {all_gather} hook", spec.codec, own, options)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: all_gather_options={options!r} for {all_gather!r}: {e}") from e
    return codec, codec_options(spec.codec, own, kwargs)


def weight_error(
    all_gather: str,
    all_gather_options: Optional[dict[str, Any]] = None,
    tensor: Optional[torch.Tensor] = None,
) -> float:
    """The relative L2 error ``||decode(encode(x)) - x|| / ||x||`` of codec ``all_gather``
    (with ``all_gather_options``) on ``x``: ``tensor`` (flattened, one chunk as
    :meth:`pycomm.Exchange.all_gather` sends it), or by default a fixed normal vector on the
    CPU, the probe :func:`compress` refuses a codec with: above :data:`WEIGHT_ERROR_LIMIT`, the
    codec cannot carry weights. A user's codec is probed as the built-in ones.

    Example:
        >>> pycomm.fsdp.weight_error("int8") <= pycomm.fsdp.WEIGHT_ERROR_LIMIT
        True
        >>> pycomm.fsdp.weight_error("onebit") > pycomm.fsdp.WEIGHT_ERROR_LIMIT
        True
    """
    codec, _ = _gather_codec(all_gather, all_gather_options, "pycomm.fsdp.weight_error")
    return _error_of(codec, tensor)


def _error_of(codec: Any, tensor: Optional[torch.Tensor] = None) -> float:
    if tensor is None:
        gen = torch.Generator().manual_seed(_PROBE_SEED)
        x = torch.randn(_PROBE_ELEMENTS, generator=gen)
    else:
        x = tensor.detach().reshape(-1)
    with torch.no_grad():
        y = _round_trip(codec, x).double()
    err = float((y - x.double()).norm() / x.double().norm())
    return err if math.isfinite(err) else math.inf


def _check_all_gather(
    all_gather: Any, options: Any
) -> Optional[tuple[Any, dict[str, Any], tuple[torch.dtype, ...]]]:
    """None for FSDP's own all-gather, else the fields the ranks compare for ``all_gather``,
    its codec's resolved options and the dtypes it encodes; or the error naming the
    argument."""
    if all_gather is None:
        if options:
            raise ValueError(
                f"pycomm.fsdp.compress: all_gather_options={options!r} with all_gather=None "
                "(FSDP's own all-gather takes no options), expected all_gather set to a codec "
                "(e.g. 'int8') with them, or no all_gather_options"
            )
        return None
    codec, own = _gather_codec(all_gather, options)
    err = _error_of(codec)
    if not err <= WEIGHT_ERROR_LIMIT:
        raise ValueError(
            f"pycomm.fsdp.compress: all_gather={all_gather!r}: the codec cannot carry weights: "
            f"its round trip of a fixed normal vector has a relative L2 error of {err:.3g}, "
            f"above WEIGHT_ERROR_LIMIT={WEIGHT_ERROR_LIMIT} (pycomm.fsdp.weight_error); "
            f"expected a codec within it ({_weight_codecs()}), or all_gather=None "
            "(FSDP's own all-gather)"
        )
    # what the codec is, its own options, then its format (a difference in both named as the
    # option); the engine's options mean nothing here
    identity = codec_identity(codec)
    late = {"all_gather codec format": identity.pop("codec format")}
    fields = {f"all_gather {k}": v for k, v in identity.items()}
    fields.update({f"all_gather option {key!r}": value for key, value in own.items()})
    return {**fields, **late}, own, FLOATS


def compress(
    model: torch.nn.Module,
    hook: str = "int8",
    hook_options: Optional[dict[str, Any]] = None,
    *,
    all_gather: Optional[str] = None,
    all_gather_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> FSDPCompression:
    """Send the gradients of every ``fully_shard``-ed module of ``model`` with ``hook``,
    through one :class:`pycomm.Exchange` on the FSDP mesh's process group, and, with
    ``all_gather`` a codec, its parameters' all-gathers through another.

    Call it on every rank, after ``fully_shard`` and before the first forward. The hook,
    the options, ``all_gather`` and its options and the sharded modules (names, parameter
    shapes) are compared across ranks first: a difference is a ValueError on every rank.

    On a mesh of some ranks only (a node's, :func:`node_mesh`: HSDP), the reduce-scatter
    inside the node stays FSDP's own and each module's shard is all-reduced across the nodes
    through ``hook`` (:class:`NodeAllReduce`), with the hook's own defaults (error feedback on
    the shard included).

    Args:
        model: a model whose modules (the root included, or not) were ``fully_shard``-ed, on
            one 1-D mesh: every rank, or each node's (HSDP).
        hook: ``"allreduce"`` (the exact reduce-scatter, summed in fp32, or in float64 for
            float64 gradients) or any compressed hook of the registry, a user's codec too
            (``pycomm.Exchange.codecs()`` lists them).
        hook_options: the hook's options, one dict as in ``pycomm.wrap`` (``block``,
            ``start_iter`` (per module: its first reduce-scatters run exact; default the
            hook's own), ``error_feedback`` (default False here), ``residual_dtype``, a user
            codec's own); as keyword arguments, the older spelling, with a FutureWarning.
        all_gather: None (default): FSDP2's own parameter all-gather, untouched. A codec's
            name (``"bf16"``, ``"fp16"``, ``"fp8"``, ``"int8"``, a user's codec): every
            ``FSDPModule`` all-gathers its parameters through it (a :class:`ModuleAllGather`,
            ``FSDPModule.set_custom_all_gather``): each rank encodes its shard once, every
            rank decodes every shard into FSDP's unsharded buffer, so all ranks, and forward
            and backward, compute with the same decoded weights, while the sharded master
            parameters stay exact (no error feedback, nothing carried between steps). A codec
            whose :func:`weight_error` exceeds :data:`WEIGHT_ERROR_LIMIT` (``"onebit"``;
            ``"int4"``) is refused, as is ``"allreduce"`` (FSDP's own is exact: use None).
        all_gather_options: the codec's own options (e.g. ``{"block": 128}``); the engine's
            (``error_feedback``, ``local_feedback``, ``residual_dtype``, ``strict_skip``,
            ``hierarchy``, ``start_iter``) mean nothing for an all-gather and are refused.

    Returns:
        An :class:`FSDPCompression`: ``stats``, ``state_dict()``, ``load_state_dict()``.

    Example:
        >>> fully_shard(model)
        >>> comm = pycomm.fsdp.compress(model, hook="int8", hook_options={"block": 128})
        >>> comm = pycomm.fsdp.compress(model, hook="int8", all_gather="int8")  # ZeRO++ qwZ
    """
    options = hook_options_of("pycomm.fsdp.compress", hook_options, legacy)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pycomm.fsdp.compress: no process group; call pycomm.init() first")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"pycomm.fsdp.compress: model is a {type(model).__name__}, expected an nn.Module"
        )
    modules = _fsdp_modules(model)
    spec, opts, group, gather, resolved = _agreed(
        hook, options, all_gather, all_gather_options, modules
    )
    gather_exchange, gather_options, gathers = None, None, {}
    if gather is not None:
        _, gather_options, gather_dtypes = gather
        # the codec from the first call, no residual: the same codes for the same shard
        gather_exchange = Exchange(
            all_gather, group, start_iter=0, error_feedback=False, hierarchy="flat",
            check_order=_CHECK, **gather_options,
        )  # fmt: skip
    exchange, installed = _reduction_comms(hook, spec, opts, group, modules)
    if gather_exchange is not None:
        for name, module in modules:
            gathers[name] = ModuleAllGather(name, all_gather, gather_exchange, gather_dtypes)
            _install(name, module.set_custom_all_gather, gathers[name])
    for _, module in modules:
        _COMPRESSED[module] = f"hook={hook!r}, all_gather={all_gather!r}"
    logger.info(
        "pycomm.fsdp: %s %s and %s all-gather on %d FSDP modules with options %s",
        hook,
        "across nodes (HSDP)" if _is_hsdp(group) else "reduce-scatter",
        all_gather or "FSDP's own",
        len(installed),
        opts,
    )
    comm = FSDPCompression(
        hook, opts, installed, exchange, all_gather, gather_options, gathers, gather_exchange
    )
    comm.resolved = resolved
    # the defaults (what compress fills in itself, error_feedback off outside HSDP, over the
    # hook's own), resolved only to read a checkpoint
    comm.given = {k: v for k, v in opts.items() if k not in options}
    comm.spec = spec
    comm.shapes = {name: [list(p.shape) for p in m.parameters()] for name, m in modules}
    return comm


def _resolved_options(spec: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """The hook's options ``opts`` with its defaults filled in, as a checkpoint's fingerprint
    holds them (a dtype by its name): codec ``spec``'s, or (None) the exact exchange's."""
    if spec is None:
        return {"hierarchy": "auto"}
    own = {k: v for k, v in opts.items() if k != "start_iter"}
    return resolve(spec, f"pycomm {spec.name} hook", own, opts.get("start_iter")).options()


def _agreed(
    hook: Any,
    options: dict[str, Any],
    all_gather: Any,
    all_gather_options: Any,
    modules: list[tuple[str, FSDPModule]],
) -> tuple[Any, dict[str, Any], Any, Any, Any]:
    """Every check this rank can make, then every rank's resolved configuration compared
    (the same error on every rank): the hook's spec, its options, the mesh's group, the
    all-gather's checked codec (None: FSDP's own) and the hook's options as resolved (what
    the checkpoint's fingerprint holds). Nothing is built, and no group created,
    before the ranks agree."""
    fields: dict[str, Any] = {}
    if isinstance(hook, str):  # a name registered on some ranks only: named on every rank
        fields["hook"] = hook
        fields[f"registration of hook {hook!r}"] = _registration(hook)
    fields["all_gather"] = (
        all_gather if all_gather is None or isinstance(all_gather, str) else repr(all_gather)
    )
    if isinstance(all_gather, str):
        fields[f"registration of all_gather {all_gather!r}"] = _registration(all_gather)
    fields.update(error_field(None))
    spec, opts, group, gather, resolved = None, {}, None, None, None
    try:
        for name, module in modules:
            if module in _COMPRESSED:
                raise ValueError(
                    f"pycomm.fsdp.compress: module {name or 'root'!r} is already compressed "
                    f"({_COMPRESSED[module]}) by an earlier compress(), expected a model "
                    "compressed once, with every option in that one call"
                )
        spec, opts, group = _check(hook, options, modules)
        fields["hook"] = hook
        if spec is not None:
            # start_iter is the Exchange's (per module, from 0); the DDP hook's own check
            # (>= 2, for DDP's bucket rebuild) does not apply
            if "start_iter" in opts:
                check_int(
                    "pycomm.fsdp.compress", "hook_options['start_iter']", opts["start_iter"], 0
                )
            own = {k: v for k, v in opts.items() if k != "start_iter"}
            config = resolve(spec, f"pycomm {hook} hook", own, opts.get("start_iter"))
            fields.update(config.fields())
            resolved = config.options()
        else:
            resolved = {"hierarchy": "auto"}
        gather = _check_all_gather(all_gather, all_gather_options)
        if gather is not None:
            fields.update(gather[0])
    except Exception as e:  # noqa: BLE001 - a user's codec failing on one rank too
        fields.update(error_field(e))
    fields["sharded modules"] = [
        (name, [tuple(p.shape) for p in m.parameters()]) for name, m in modules
    ]
    fields["ranks of the mesh"] = None if group is None else dist.get_world_size(group)
    fields["HSDP (a mesh of pycomm.fsdp.node_mesh())"] = _is_hsdp(group)
    agree("pycomm.fsdp.compress", fields)
    return spec, opts, group, gather, resolved


def _reduction_comms(
    hook: str,
    spec: Any,
    opts: dict[str, Any],
    group: Optional[dist.ProcessGroup],
    modules: list[tuple[str, FSDPModule]],
) -> tuple[Exchange, dict[str, Any]]:
    """The gradients' Exchange and what runs it on every module: a
    :class:`ModuleReduceScatter` each (``set_custom_reduce_scatter``), or under HSDP a
    :class:`NodeAllReduce` each (FSDP's own reduce-scatter inside the node, the hook's
    all-reduce across the nodes)."""
    compressed = spec is not None
    ex_opts = dict(opts)
    default = spec.defaults.get("start_iter", 2) if compressed else 0
    start_iter = ex_opts.pop("start_iter", default)
    ex_opts["hierarchy"] = "flat"  # the mesh decides the nodes
    if _is_hsdp(group):
        exchange = Exchange(
            hook, cross_group(group), start_iter=start_iter, check_order=_CHECK, **ex_opts
        )
        return exchange, _install_node_all_reduce(modules, exchange, dist.get_world_size(group))
    if compressed:
        ex_opts["local_feedback"] = True  # error feedback is on the reduce-scatter's input
    exchange = Exchange(hook, group, start_iter=start_iter, check_order=_CHECK, **ex_opts)
    grad_dtypes = FLOATS if compressed else None
    installed: dict[str, Any] = {}
    for name, module in modules:
        installed[name] = ModuleReduceScatter(name, hook, exchange, grad_dtypes)
        _install(name, module.set_custom_reduce_scatter, installed[name])
    return exchange, installed


def _install(name: str, setter: Any, comm: Any) -> None:
    """``setter(comm)``, FSDP's refusal of it named with the module."""
    try:
        setter(comm)
    except ValueError as e:
        raise ValueError(
            f"pycomm.fsdp.compress: module {name or 'root'!r}: {e} (parameters placed on "
            "several meshes by shard_placement_fn are not supported)"
        ) from e


def _divide_factor(module: FSDPModule) -> Optional[float]:
    """The factor ``module.set_gradient_divide_factor`` set (torch keeps it on the module's
    parameter groups and has no getter for it), or None (FSDP2's mean)."""
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
    factors = {getattr(g, "gradient_divide_factor", None) for g in groups}
    return factors.pop() if len(factors) == 1 else None


def _install_node_all_reduce(
    modules: list[tuple[str, FSDPModule]], exchange: Exchange, local_size: int
) -> dict[str, NodeAllReduce]:
    """A :class:`NodeAllReduce` on every module (``set_all_reduce_hook``), on a stream of its
    own on a GPU, so that the cross-node exchange overlaps the next module's backward."""
    installed: dict[str, NodeAllReduce] = {}
    for name, module in modules:
        hook = NodeAllReduce(name, exchange, local_size, functools.partial(_divide_factor, module))
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        module.set_all_reduce_hook(hook, stream=stream)
        installed[name] = hook
    return installed


def _registration(name: str) -> str:
    """Codec ``name``'s class in this process, ``exact`` for ``"allreduce"``, or ``not
    registered``: what ranks compare first, so that a name registered on some ranks only is
    named as such."""
    if name == "allreduce":
        return "exact"
    spec = find_codec(name)
    return "not registered" if spec is None else qualified_name(spec.codec)
