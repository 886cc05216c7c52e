"""HSDP on FSDP2's public hooks: shard inside each node, all-reduce each shard's gradient across
the nodes through a pycomm codec (``pycomm.fsdp.node_mesh``, ``pycomm.fsdp.compress``).

FSDP2's own 2-D HSDP mesh runs its cross-node all-reduce itself, with no hook to replace it.
The "custom HSDP" path of FSDP2's public API is used instead: the model is ``fully_shard``-ed
on a 1-D mesh of the node's ranks (:func:`node_mesh`), FSDP reduce-scatters each module's
gradient inside the node, and ``FSDPModule.set_all_reduce_hook`` hands each reduce-scatter's
output (this rank's shard of the node's sum) to a :class:`NodeAllReduce`, which averages it
across the nodes with a :class:`pycomm.Exchange` on the ranks that hold the same shard, one per
node (:func:`cross_group`). FSDP skips its own all-reduce then. The in-node reduce-scatter
stays FSDP's own (exact, over the fast links), the cross-node exchange is the codec's.

Example:
    >>> mesh = pycomm.fsdp.node_mesh()                 # this rank's node, a 1-D DeviceMesh
    >>> for block in model.blocks:
    ...     fully_shard(block, mesh=mesh)
    >>> fully_shard(model, mesh=mesh)
    >>> comm = pycomm.fsdp.compress(model, hook="int8")  # int8 across nodes, exact inside
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pycomm.codec.groups import new_groups
from pycomm.dist import all_gather_objects
from pycomm.exchange import Exchange
from pycomm.topology import Topology, topology

__all__ = [
    "NodeAllReduce", "cross_group", "cross_node_group", "is_node_group", "node_group",
    "node_mesh",
]  # fmt: skip

_WHERE = "pycomm.fsdp.node_mesh"
# the default group -> (it, the topology read, this rank's node group): made once per topology
_NODE: dict[int, tuple[dist.ProcessGroup, Any, dist.ProcessGroup]] = {}
# shard group -> (the group, the cross group of this rank): created once, collectively
_CROSS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
# the groups node_mesh() made (held, so that their ids are not reused)
_NODE_GROUPS: dict[int, dist.ProcessGroup] = {}


def _new_group(parts: list[list[int]]) -> dist.ProcessGroup:
    """The group of the part of ``parts`` (disjoint, together every rank) that holds this rank,
    with the default group's timeout. Collective over the default group."""
    return new_groups(dist.group.WORLD, parts, count=1)[0]


def node_group() -> dist.ProcessGroup:
    """This rank's node as a process group, from :func:`pycomm.topology` (torchrun's, SLURM's
    variables or ``pycomm.init(nodes=...)``): the inner group of a run across nodes (DDP or
    FSDP2 inside the node). Collective over the default group the first time (every rank
    calls it); the same group afterwards.

    Raises:
        ValueError on every rank: a topology that cannot be read, or nodes with different
        numbers of ranks.

    Example:
        >>> ddp = pycomm.wrap(model, process_group=pycomm.node_group())
        >>> outer = pycomm.LocalSGD(ddp, sync_every=50, process_group=pycomm.cross_node_group())
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{_WHERE}: no process group; call pycomm.init() first")
    world = dist.group.WORLD
    mine: Any
    try:
        mine = topology()
    except ValueError as e:  # named on every rank, after the gather
        mine = str(e)
    cached = _NODE.get(id(world))
    if cached is not None and cached[0] is world and cached[1] == mine:
        return cached[2]
    everyone = all_gather_objects(mine, None, _WHERE)
    bad = next((t for t in everyone if not isinstance(t, Topology)), None)
    if bad is not None:
        raise ValueError(f"{_WHERE}: cannot read the topology: {bad}")
    nodes: dict[int, list[int]] = {}
    for rank, t in enumerate(everyone):
        nodes.setdefault(t.node_rank, []).append(rank)
    sizes = {n: len(r) for n, r in sorted(nodes.items())}
    if len(set(sizes.values())) != 1:
        shape = ", ".join(f"node {n}: {s}" for n, s in sizes.items())
        raise ValueError(
            f"{_WHERE}: nodes of {shape} ranks (from {everyone[0].source}); expected the same "
            "number of ranks on every node (each shard is replicated once per node)"
        )
    group = _new_group([sorted(nodes[n]) for n in sorted(nodes)])
    _NODE_GROUPS[id(group)] = group
    _NODE[id(world)] = (world, mine, group)
    return group


def cross_node_group() -> dist.ProcessGroup:
    """The ranks at this rank's place on every node, one per node (:func:`node_group`'s
    ranks split across the nodes): the outer group of a run across nodes, over which
    ``pycomm.LocalSGD``, ``pycomm.DiLoCo`` or an HSDP all-reduce sync. Collective over the
    default group the first time.

    Example:
        >>> pycomm.cross_node_group()  # ranks 0 and 2 of 2 nodes of 2 ranks, on rank 0
    """
    return cross_group(node_group())


def node_mesh(device_type: Optional[str] = None) -> DeviceMesh:
    """This rank's node as a 1-D ``DeviceMesh`` (over :func:`node_group`): shard a model on it
    with ``fully_shard(module, mesh=node_mesh())`` and :func:`pycomm.fsdp.compress`
    all-reduces each shard's gradient across the nodes. Collective: every rank calls it.

    Args:
        device_type: the mesh's device type (default ``"cuda"`` under NCCL, else ``"cpu"``).

    Raises:
        ValueError on every rank: a topology that cannot be read, or nodes with different
        numbers of ranks (each shard needs its replica on every node).

    Example:
        >>> mesh = pycomm.fsdp.node_mesh()
        >>> fully_shard(model, mesh=mesh)
    """
    group = node_group()
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device_type)


def is_node_group(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` is the group of a mesh :func:`node_mesh` made: what makes a model
    sharded on it HSDP for :func:`pycomm.fsdp.compress` (a mesh of some ranks made otherwise,
    a pipeline stage's say, keeps FSDP2's meaning: sharded and reduced within those ranks).

    Example:
        >>> is_node_group(pycomm.fsdp.node_mesh().get_group())
        True
    """
    return group is not None and _NODE_GROUPS.get(id(group)) is group


def cross_group(shard_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The ranks that hold this rank's shard on the other shard groups: for a model sharded on
    ``shard_group`` (a node's ranks), the rank at this rank's place in every shard group, one
    per node. Collective over the default group (every rank calls it, with its own shard
    group); created once per shard group.

    Raises:
        ValueError on every rank: shard groups that do not split the ranks into equal,
        disjoint groups.

    Example:
        >>> cross = cross_group(mesh.get_group())
    """
    cached = _CROSS.get(id(shard_group))
    if cached is not None and cached[0] is shard_group:
        return cached[1]
    mine = dist.get_process_group_ranks(shard_group)
    groups = all_gather_objects(mine, None, "pycomm.fsdp.compress (the cross-node groups)")
    distinct = sorted({tuple(g) for g in groups})
    flat = sorted(r for g in distinct for r in g)
    if flat != list(range(dist.get_world_size())) or len({len(g) for g in distinct}) != 1:
        raise ValueError(
            "pycomm.fsdp.compress: the modules are sharded on meshes of ranks "
            f"{[list(g) for g in distinct]}; expected meshes that split the "
            f"{dist.get_world_size()} ranks into equal, disjoint groups (pycomm.fsdp."
            "node_mesh() gives each node's)"
        )
    cross = _new_group([[g[p] for g in distinct] for p in range(len(mine))])
    _CROSS[id(shard_group)] = (shard_group, cross)
    return cross


class NodeAllReduce:
    """The all-reduce hook of one ``FSDPModule`` (``set_all_reduce_hook``): the module's
    reduce-scatter output, this rank's shard of the node's reduction, averaged across the nodes
    through ``exchange`` (keyed by the module's name), in place.

    FSDP2 hands it the node's mean (its reduce-scatter averages inside the node), or, once
    ``set_gradient_divide_factor(f)`` is set on the module, the node's sum divided by f (before
    or after the hook): the hook then sums across the nodes, so that the gradient is the sum
    over every rank divided by f, as FSDP2's own HSDP makes it.

    Attributes:
        name: the module's name in the model ("" for the root).
        exchange: the :class:`pycomm.Exchange` across the nodes (one for every module).
        divide_factor: returns the module's gradient divide factor (None: FSDP2's mean).
        iter: all-reduces run (one per synchronized backward).
        collectives: per collective, ``calls``, ``bytes_sent`` and ``bytes_fp32``:
            ``all_reduce``, the cross-node exchange (and an fp32 ring all-reduce of the shard
            across the nodes);
            ``reduce_scatter``, FSDP's own inside the node ((L-1) shards of the reduce dtype,
            and of fp32).
        stats: ``calls``, ``bytes_sent``, ``bytes_fp32`` (both collectives) and
            ``residual_bytes`` (the module's residuals in the Exchange).

    Example:
        >>> module.set_all_reduce_hook(NodeAllReduce("layers.0", exchange, local_size=2))
    """

    def __init__(
        self,
        name: str,
        exchange: Exchange,
        local_size: int,
        divide_factor: Optional[Callable[[], Optional[float]]] = None,
    ) -> None:
        self.name, self.exchange, self.local_size = name, exchange, local_size
        self.divide_factor = divide_factor
        self.calls = 0
        self.collectives: dict[str, dict[str, int]] = {
            "reduce_scatter": {"calls": 0, "bytes_sent": 0, "bytes_fp32": 0},
            "all_reduce": {"calls": 0, "bytes_sent": 0, "bytes_fp32": 0},
        }

    @property
    def iter(self) -> int:
        return self.calls

    @property
    def stats(self) -> dict[str, int]:
        sent = sum(c["bytes_sent"] for c in self.collectives.values())  # both collectives
        fp32 = sum(c["bytes_fp32"] for c in self.collectives.values())
        return {
            "calls": self.calls,
            "bytes_sent": sent,
            "bytes_fp32": fp32,
            "residual_bytes": self.exchange.residual_bytes(self.name),
        }

    def __call__(self, output: torch.Tensor) -> None:
        factor = None if self.divide_factor is None else self.divide_factor()
        work = self.exchange.all_reduce(
            output, key=self.name, op="mean" if factor is None else "sum", async_op=False
        )
        work.wait()
        self.calls += 1
        ar, rs = self.collectives["all_reduce"], self.collectives["reduce_scatter"]
        ar["calls"] += 1
        rs["calls"] += 1
        ar["bytes_sent"] += work.bytes_sent
        ar["bytes_fp32"] += work.bytes_fp32
        n = output.numel()
        rs["bytes_sent"] += (self.local_size - 1) * n * output.element_size()
        rs["bytes_fp32"] += (self.local_size - 1) * n * 4

    def state_dict(self) -> dict[str, Any]:
        """The module's counters (its residuals and warm-up are the Exchange's)."""
        return {"calls": self.calls, "collectives": copy.deepcopy(self.collectives)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])
        self.collectives = copy.deepcopy(state["collectives"])
