"""Topology: which node each rank runs on, from the launcher's variables or init(nodes=...).

Sources, first found wins: ``pycomm.init(nodes=M)`` (ranks packed onto M nodes in rank
order); torchrun's ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
SLURM's ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_LOCALID``, ``SLURM_TASKS_PER_NODE``;
``LOCAL_WORLD_SIZE`` alone (ranks packed in order, what ``pycomm.launch`` sets); else one
node. Every value is checked; a bad one is a ValueError naming the variable, the value and
what was expected.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from pycomm._validate import check_int

_explicit_nodes: Optional[int] = None


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: ``nodes`` in the job, this rank's ``node_rank``, its
    ``local_rank`` on the node and the ``local_world_size`` (ranks on its node); ``source``
    names where that came from.

    Example:
        >>> pycomm.init(nodes=2)          # or under torchrun --nnodes 2, or SLURM
        >>> pycomm.topology()
        Topology(nodes=2, node_rank=0, local_rank=1, local_world_size=2, source='init(nodes=2)')
    """

    nodes: int
    node_rank: int
    local_rank: int
    local_world_size: int
    source: str


def set_nodes(nodes: Optional[int]) -> None:
    """Name the node count (``pycomm.init(nodes=...)``); None forgets it."""
    global _explicit_nodes
    if nodes is not None:
        check_int("pycomm.init", "nodes", nodes, source="argument")
    _explicit_nodes = nodes


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value is not None and value.strip() != "" else None


def _int(name: str, raw: Optional[str], source: str, expected: str) -> int:
    if raw is None:
        raise ValueError(f"{name} ({source}) is not set; expected {expected}")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} ({source}) is invalid; expected {expected}") from None


def _slurm_tasks_per_node(raw: str, node: int) -> int:
    """Tasks on node ``node`` from SLURM_TASKS_PER_NODE, e.g. '2(x3),1'."""
    counts: list[int] = []
    for part in raw.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={raw!r} (SLURM environment) is invalid; expected a list "
                "like '2(x3),1'"
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node >= len(counts):
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={raw!r} (SLURM environment) names {len(counts)} nodes; "
            f"expected an entry for SLURM_NODEID={node}"
        )
    return counts[node]


def topology() -> Topology:
    """This rank's topology in the default process group (see the module's docstring).

    Raises:
        ValueError: a launcher variable or ``nodes`` that cannot describe the job.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pycomm.topology: call pycomm.init() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if _explicit_nodes is not None:
        m, source = _explicit_nodes, f"init(nodes={_explicit_nodes})"
        if world % m:
            raise ValueError(
                f"pycomm.init: nodes={m} (argument) cannot split world_size={world} into equal "
                f"nodes; expected a divisor of {world}"
            )
        named = _env("GROUP_WORLD_SIZE") or _env("SLURM_NNODES")
        if named is not None and named != str(m):
            raise ValueError(
                f"pycomm.init: nodes={m} (argument) but the launcher says {named} nodes "
                "(GROUP_WORLD_SIZE or SLURM_NNODES); expected the same count or nodes=None"
            )
        per = world // m
        return _checked(Topology(m, rank // per, rank % per, per, source), world)
    if _env("GROUP_RANK") is not None:
        src = "torchrun environment"
        node = _int("GROUP_RANK", _env("GROUP_RANK"), src, "an integer node rank")
        local = _int("LOCAL_RANK", _env("LOCAL_RANK"), src, "an integer local rank")
        lw = _int("LOCAL_WORLD_SIZE", _env("LOCAL_WORLD_SIZE"), src, "an integer number of ranks")
        raw_nodes = _env("GROUP_WORLD_SIZE")
        nodes = (
            _int("GROUP_WORLD_SIZE", raw_nodes, src, "an integer node count")
            if raw_nodes is not None
            else max(1, world // lw)
        )
        return _checked(Topology(nodes, node, local, lw, "torchrun"), world)
    if _env("SLURM_NODEID") is not None and _env("SLURM_NNODES") is not None:
        src = "SLURM environment"
        node = _int("SLURM_NODEID", _env("SLURM_NODEID"), src, "an integer node id")
        nodes = _int("SLURM_NNODES", _env("SLURM_NNODES"), src, "an integer node count")
        if not 1 <= nodes <= world:
            raise ValueError(
                f"SLURM_NNODES={nodes} ({src}) is invalid; expected an int in [1, {world}] "
                f"(world_size={world})"
            )
        local = _int("SLURM_LOCALID", _env("SLURM_LOCALID"), src, "an integer local id")
        raw = _env("SLURM_TASKS_PER_NODE")
        lw = _slurm_tasks_per_node(raw, node) if raw is not None else max(1, world // nodes)
        return _checked(Topology(nodes, node, local, lw, "SLURM"), world)
    raw = _env("LOCAL_WORLD_SIZE")
    if raw is not None:
        lw = _int("LOCAL_WORLD_SIZE", raw, "environment", "an integer number of ranks")
        if lw < 1 or world % lw:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={lw} (environment) does not split world_size={world} into "
                "equal nodes; expected a divisor of the world size (or GROUP_RANK, "
                "GROUP_WORLD_SIZE and LOCAL_RANK as torchrun sets them, for nodes of other sizes)"
            )
        local = _env("LOCAL_RANK")
        if local is not None and local != str(rank % lw):
            raise ValueError(
                f"LOCAL_RANK={local!r} (environment) is not rank {rank} % LOCAL_WORLD_SIZE={lw} "
                f"= {rank % lw}; expected ranks numbered node by node (or GROUP_RANK set, as "
                "torchrun sets it)"
            )
        return _checked(Topology(world // lw, rank // lw, rank % lw, lw, "LOCAL_WORLD_SIZE"), world)
    return Topology(1, 0, rank, world, "one node (no launcher variable names nodes)")


def _checked(t: Topology, world: int) -> Topology:
    checks = (
        ("nodes", t.nodes, 1 <= t.nodes <= world, f"an int in [1, {world}] (world_size={world})"),
        ("node_rank", t.node_rank, 0 <= t.node_rank < t.nodes, f"an int in [0, {t.nodes})"),
        (
            "local_world_size",
            t.local_world_size,
            1 <= t.local_world_size <= world - (t.nodes - 1),
            f"an int in [1, {world - (t.nodes - 1)}] (world_size={world} over {t.nodes} nodes "
            "of one rank or more)",
        ),
        (
            "local_rank",
            t.local_rank,
            0 <= t.local_rank < t.local_world_size,
            f"an int in [0, {t.local_world_size}) (local_world_size)",
        ),
    )
    for name, value, ok, expected in checks:
        if not ok:
            raise ValueError(
                f"pycomm topology: {name}={value} (from {t.source}) is impossible; expected "
                f"{expected}"
            )
    return t
