"""Hierarchical reduction (``hierarchy="node"``): exact inside a node, compressed across nodes.

A tensor of n elements (a DDP bucket, an Exchange call) on a node of L ranks (M nodes) takes
three stages:

1. intra-node reduce-scatter in fp32 (an all-to-all on the node's first group): local rank p
   receives shard p (n/L elements, padded) of every rank on its node and sums it in fp32;
2. across nodes, among the M ranks with the same local rank: the caller's exchange (the
   exact fp32 all-reduce, the 16-bit all-reduce or the compressed two-phase exchange) on that
   shard alone, so each rank's cross-node traffic is 1/L of the tensor; error feedback lives
   here only, on the shard;
3. intra-node all-gather (the node's second group) of the reduced shards.

Every rank ends with the same bits: stage 2 leaves a shard bitwise equal on the M ranks that
hold it, and stage 3 copies it. Collective order: each stage has its own process groups and
is issued in call order (a chain of futures per stage), whatever order the previous stage's
callbacks run in; the groups are created once per parent group and topology, at
registration, in the same order on every rank, with the parent group's timeout.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm.codec.engine import completed, future_on, ring_bytes, summed_numel
from pycomm.codec.groups import Stage, new_groups
from pycomm.dist import all_gather_objects
from pycomm.topology import Topology, topology

logger = logging.getLogger(__name__)


@dataclass
class NodePlan:
    """The resolved node hierarchy of one parent group, shared by every state over it."""

    nodes: int  # M
    local_size: int  # L, the same on every node
    position: int  # this rank's place on its node (its shard)
    node_index: int  # its node's place among the group's nodes
    intra: Stage  # two groups over this node's ranks
    cross: Stage  # two groups over the ranks with this position on every node
    cross_issued: torch.futures.Future  # stage 2 of the latest call was issued
    gather_issued: torch.futures.Future  # stage 3 of the latest call was issued

    def describe(self) -> str:
        return f"node: {self.nodes} nodes x {self.local_size} ranks"


_PLANS: dict[tuple, tuple[Any, NodePlan]] = {}


def resolve(hook: str, parent: Optional[dist.ProcessGroup], hierarchy: str) -> Optional[NodePlan]:
    """The node plan for ``hierarchy`` over ``parent``, or None for the flat exchange.

    Takes a collective on ``parent``: an all-gather of each rank's topology, also where this
    rank's launcher variables alone would decide (one node, or a rank per node), since another
    rank may read other variables: every rank then raises the same error instead of some
    waiting in the gather while the others go on.
    """
    world = parent or dist.group.WORLD
    size = dist.get_world_size(world)
    if hierarchy == "flat" or size == 1 and hierarchy == "auto":
        return None
    mine: Any
    try:
        mine = topology()
    except ValueError as e:  # reported on every rank, after the gather
        mine = str(e)
    whole = world is dist.group.WORLD or dist.get_world_size() == size
    everyone = all_gather_objects(mine, world, "pycomm (the node hierarchy's topology)")
    bad = next((t for t in everyone if isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"pycomm {hook} hook: hierarchy={hierarchy!r}: {bad}")
    other = next((r for r, t in enumerate(everyone) if t.nodes != everyone[0].nodes), None)
    if other is not None:
        a, b = everyone[0], everyone[other]
        raise ValueError(
            f"pycomm {hook} hook: hierarchy={hierarchy!r}: ranks disagree on the number of "
            f"nodes: rank 0 has {a.nodes} (from {a.source}), rank {other} has {b.nodes} (from "
            f"{b.source}); expected every rank to read the same launcher variables or "
            "pycomm.init(nodes=...)"
        )
    if hierarchy == "auto" and whole and everyone[0].nodes in (1, dist.get_world_size()):
        return None  # every rank reads one node, or one rank per node: nothing to split
    nodes: dict[int, list[tuple[int, int]]] = {}
    for r, t in enumerate(everyone):
        nodes.setdefault(t.node_rank, []).append((t.local_rank, r))
    for node, members in sorted(nodes.items()):
        claimed = {everyone[r].local_world_size for _, r in members}
        locals_ = sorted(lr for lr, _ in members)
        if (
            len(claimed) != 1
            or claimed.pop() != len(members)
            and whole
            or len(set(locals_)) != len(locals_)
        ):
            raise ValueError(
                f"pycomm {hook} hook: hierarchy={hierarchy!r}: impossible topology from "
                f"{everyone[members[0][1]].source}: node {node} has ranks "
                f"{sorted(r for _, r in members)} with local ranks {locals_} and "
                f"local_world_size {sorted({everyone[r].local_world_size for _, r in members})}; "
                "expected each node's ranks to have distinct local ranks and agree on its size"
            )
    sizes = sorted({len(m) for m in nodes.values()})
    shape = ", ".join(f"node {n}: {len(m)}" for n, m in sorted(nodes.items()))
    if len(sizes) > 1:
        if hierarchy == "node":
            raise ValueError(
                f"pycomm {hook} hook: hierarchy='node' needs the same number of ranks on every "
                f"node, got {shape} ranks; expected even nodes (hierarchy='auto' or 'flat' run "
                "uneven nodes flat)"
            )
        logger.info("pycomm %s hook: uneven nodes (%s ranks): flat exchange", hook, shape)
        return None
    m, per = len(nodes), sizes[0]
    if m == 1 or per == 1:
        if hierarchy == "node":
            raise ValueError(
                f"pycomm {hook} hook: hierarchy='node' needs more than one node with more than "
                f"one rank each, got {m} node(s) of {per} rank(s); expected 'auto' or 'flat' "
                "for this topology"
            )
        return None
    key = (id(world), tuple((t.node_rank, t.local_rank) for t in everyone))
    cached = _PLANS.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    plan = _make_plan(world, everyone, nodes)
    _PLANS[key] = (world, plan)
    return plan


def _make_plan(world, everyone: list[Topology], nodes: dict) -> NodePlan:
    me = dist.get_rank(world)
    global_ranks = dist.get_process_group_ranks(world)
    order = sorted(nodes)
    members = {n: [r for _, r in sorted(nodes[n])] for n in order}
    node_index = order.index(everyone[me].node_rank)
    mine = members[order[node_index]]
    position = mine.index(me)

    def groups(parts: list[list[int]]) -> tuple:
        return new_groups(world, [[global_ranks[r] for r in part] for part in parts])

    # every rank creates the nodes' groups, then the positions': the same order everywhere
    intra = groups([members[n] for n in order])
    crossg = groups([[members[n][p] for n in order] for p in range(len(mine))])
    nccl = dist.get_backend(intra[0]) == "nccl"
    return NodePlan(
        nodes=len(order),
        local_size=len(mine),
        position=position,
        node_index=node_index,
        intra=Stage(intra, nccl),
        cross=Stage(crossg, nccl),
        cross_issued=completed(torch.empty(0)),
        gather_issued=completed(torch.empty(0)),
    )


@dataclass(frozen=True)
class Cross:
    """Stage 2 of :func:`node_reduce`: ``issue(shard)`` starts the exchange of the fp32 shard
    across nodes (called in call order) and returns a future that completes once ``shard``
    holds the reduced values; ``bytes`` and ``collectives``: what it sends, for the caller's
    counters."""

    issue: Callable[[torch.Tensor], torch.futures.Future]
    bytes: int
    collectives: int


def node_reduce(
    plan: NodePlan,
    x: torch.Tensor,
    index: int,
    cross: Cross,
    *,
    buffers: dict,
    count: Callable[..., None],
    engine: Any = None,
    prescale: Optional[float] = None,
    postscale: Optional[float] = None,
    finite_step: Optional[int] = None,
) -> torch.futures.Future[torch.Tensor]:
    """Reduce ``x`` (the caller's tensor ``index``) in the three stages of the module's
    docstring, stage 2 being ``cross``. ``buffers``: the caller's dict, where each tensor's
    fp32 buffers are kept; ``count(bytes_sent, collectives=..., bytes_intra=...,
    bytes_inter=...)`` accounts the call in the caller's counters. ``prescale`` multiplies
    ``x`` before stage 1 (the exact all-reduce scales by 1/N as DDP does), ``postscale`` the
    node's summed shard.

    ``finite_step``: the step of ``engine``'s exchange (stage 2). Its decode sees only this
    rank's shard, so once stage 3 has gathered the others, their non-finite values are
    counted too (``engine.note_decode``, on the device, no host read): a NaN or Inf anywhere
    in ``x`` then keeps every rank's residuals as they were, as in the flat exchange.
    """
    L, n = plan.local_size, x.numel()
    s = shard_size(n, L)
    ws = _workspace(buffers, x, index, L, s)
    if prescale is not None:
        x.mul_(prescale)
    send = x.view(L, s) if ws["send"] is None else _padded_copy(x, ws["send"])
    intra_bytes = 2 * (L - 1) * s * 4
    count(
        intra_bytes + cross.bytes,
        collectives=2 + cross.collectives,
        bytes_intra=intra_bytes,
        bytes_inter=cross.bytes,
    )
    stages = _NodeStages(engine, plan, x, ws, send, cross, postscale, finite_step)
    return stages.start()


def _workspace(buffers: dict, x: torch.Tensor, index: int, L: int, s: int) -> dict:
    """The tensor's fp32 buffers, kept in ``buffers``: what stage 1 receives, this rank's
    shard, and a padded send buffer unless ``x`` itself can be sent."""
    key = ("node", index, x.numel(), str(x.dtype))
    ws = buffers.get(key)
    if ws is None:
        f32 = dict(dtype=torch.float32, device=x.device)
        ws = buffers[key] = {
            "recv": torch.empty(L, s, **f32),
            "shard": torch.empty(s, **f32),
            "send": None if _in_place(x, L, s) else torch.empty(L, s, **f32),
        }
    return ws


def _padded_copy(x: torch.Tensor, send: torch.Tensor) -> torch.Tensor:
    """``x`` into the [L, s] fp32 ``send``, zero after its end."""
    flat, n = send.view(-1), x.numel()
    flat[:n].copy_(x)
    flat[n:].zero_()
    return send


class _NodeStages:
    """One call's stages, each issued from the completion of the one before and after the
    previous call's issue of the same stage (``plan.cross_issued``, ``plan.gather_issued``),
    so that every rank issues each stage's collectives in call order."""

    def __init__(self, engine, plan, x, ws, send, cross, postscale, finite_step) -> None:
        self.engine, self.plan, self.x = engine, plan, x
        self.ws, self.send, self.cross = ws, send, cross
        self.postscale, self.finite_step = postscale, finite_step
        self.result: torch.futures.Future[torch.Tensor] = future_on(x.device)
        self.done = torch.empty(0)

    def start(self) -> torch.futures.Future[torch.Tensor]:
        plan = self.plan
        g1 = plan.intra.groups[0]
        recv = self.ws["recv"]
        stage1 = dist.all_to_all_single(recv, self.send, group=g1, async_op=True).get_future()
        self.prev_cross, self.cross_issued = plan.cross_issued, torch.futures.Future()
        plan.cross_issued = self.cross_issued
        self.prev_gather, self.gather_issued = plan.gather_issued, torch.futures.Future()
        plan.gather_issued = self.gather_issued
        torch.futures.collect_all([stage1, self.prev_cross]).then(self.stage2)
        return self.result

    def fail(self, e: BaseException, *chains: torch.futures.Future) -> None:
        """Releases the later calls' waits on ``chains`` and fails this call's result."""
        for c in chains:
            if not c.done():
                c.set_result(self.done)
        if not self.result.done():
            self.result.set_exception(e)

    def stage2(self, fut: torch.futures.Future) -> None:
        """The node's sum of this rank's shard, then the exchange across nodes."""
        shard = self.ws["shard"]
        try:
            for sub in fut.value():
                sub.value()
            torch.sum(self.ws["recv"], dim=0, out=shard)
            if self.postscale is not None:
                shard.mul_(self.postscale)
            reduced = self.cross.issue(shard)
        except BaseException as e:  # noqa: BLE001 - handed to DDP through the future
            self.fail(e, self.cross_issued, self.gather_issued)
            return
        self.cross_issued.set_result(self.done)
        torch.futures.collect_all([reduced, self.prev_gather]).then(self.stage3)

    def stage3(self, fut: torch.futures.Future) -> None:
        """The reduced shards gathered on the node, into ``send`` (``x`` itself when in place:
        stage 1 is done with it)."""
        ws, plan = self.ws, self.plan
        L, s = self.send.shape
        g2 = plan.intra.groups[1]
        try:
            for sub in fut.value():
                sub.value()
            if plan.intra.nccl:
                work = dist.all_gather_into_tensor(
                    self.send.view(-1), ws["shard"], group=g2, async_op=True
                )
            else:  # gloo: all_to_all_single, once timed faster than all_gather (not kept)
                ws["recv"].copy_(ws["shard"].expand(L, s))
                work = dist.all_to_all_single(self.send, ws["recv"], group=g2, async_op=True)
        except BaseException as e:  # noqa: BLE001
            self.fail(e, self.gather_issued)
            return
        self.gather_issued.set_result(self.done)
        work.get_future().then(self.finish)

    def finish(self, fut: torch.futures.Future) -> None:
        """The tensor's values back in ``x``; the other shards' non-finite values counted."""
        x, n = self.x, self.x.numel()
        try:
            fut.value()
            if self.ws["send"] is not None:
                x.copy_(self.ws["send"].view(-1)[:n])
            if self.finite_step is not None:
                s = self.send.shape[1]
                flat = x.view(-1)
                lo, hi = min(self.plan.position * s, n), min((self.plan.position + 1) * s, n)
                bad = (~torch.isfinite(flat[:lo])).sum() + (~torch.isfinite(flat[hi:])).sum()
                stats = torch.stack([bad.new_zeros(()), bad]).double()
                self.engine.note_decode(stats, self.finite_step)
            self.result.set_result(x)
        except BaseException as e:  # noqa: BLE001
            self.fail(e)


def shard_size(n: int, local_size: int) -> int:
    """Elements of each rank's shard of an n-element tensor on a node of ``local_size``."""
    return max(1, math.ceil(n / local_size))


def _in_place(x: torch.Tensor, L: int, s: int) -> bool:
    return x.dtype == torch.float32 and x.numel() == L * s and x.is_contiguous()


def exact_cross(plan: NodePlan, n: int, scale: Optional[float] = None) -> Cross:
    """Stage 2 as the exact fp32 all-reduce (sum, optionally pre-scaled) over the cross
    group, for an n-element tensor: one collective, a ring all-reduce's bytes of the shard."""

    def issue(shard: torch.Tensor) -> torch.futures.Future:
        if scale is not None:
            shard.mul_(scale)
        work = dist.all_reduce(shard, group=plan.cross.groups[0], async_op=True)
        return work.get_future()

    return Cross(issue, ring_bytes(4 * shard_size(n, plan.local_size), plan.nodes), 1)


def fingerprint(plan: Optional[NodePlan]) -> str:
    """How the state reduces, for checkpoints: 'flat' or 'node: M nodes x L ranks'."""
    return "flat" if plan is None else plan.describe()


def codec_cross(engine: Any, plan: NodePlan, n: int, issue: Callable) -> Cross:
    """Stage 2 through ``engine``'s codec across the nodes, for an n-element tensor:
    ``issue(shard)`` starts the exchange of the shard; what it sends, a
    two-phase exchange's rows or a one-phase codec's summed codes."""
    codec, m = engine.codec, plan.nodes
    s = shard_size(n, plan.local_size)
    if codec.two_phase:
        c = engine.chunk(s)
        return Cross(issue, 2 * (m - 1) * (codec.code_bytes(c) + codec.scale_bytes(c)), 2)
    return Cross(issue, ring_bytes(codec.code_bytes(summed_numel(codec, s)), m), 1)
