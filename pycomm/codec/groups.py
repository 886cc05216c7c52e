"""The process groups of the exchanges: :class:`Stage` (one level's two groups and the chain
that keeps its second collective in issue order), :func:`phase_groups` (the two-phase
exchange's, shared per parent group) and :func:`new_groups` (the node hierarchy's), each with
its parent's timeout.

And the small collectives every layer above shares: :func:`compare_steps`.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from pycomm.codec.engine import completed
from pycomm.dist import all_gather_objects

__all__ = [
    "Stage", "compare_steps", "group_timeout", "new_groups", "phase_groups",
]  # fmt: skip


def group_timeout(group: dist.ProcessGroup) -> Optional[datetime.timedelta]:
    """The timeout ``group`` was created with (None: unknown, torch's default applies).

    Example:
        >>> group_timeout(dist.group.WORLD)
        datetime.timedelta(seconds=1800)
    """
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:  # torch keeps it only in the backend's options (private, checked by a test)
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def new_groups(
    parent: dist.ProcessGroup, parts: list[list[int]], count: int = 2
) -> tuple[dist.ProcessGroup, ...]:
    """``count`` new process groups over the part of ``parts`` (disjoint lists of global ranks,
    together ``parent``'s ranks) that holds this rank, with ``parent``'s timeout: new_group()
    alone would give them torch's default (30 minutes), and a stalled peer must fail them
    within the timeout the user set, as it fails DDP's own all-reduce. Collective over
    ``parent``: every rank of it calls with the same ``parts``.

    A group's rendezvous in torch's store is keyed by its name, and the ranks of a group must
    agree on it. A parent holding every rank of the job creates each part's groups with every
    rank (torch names them from a count all ranks keep alike). A smaller parent's ranks create
    only their own part's (``use_local_synchronization``), and torch names such a group from
    its ranks and how many groups this rank already holds: ranks that joined different groups
    before (``dist.new_group([0, 1])`` called by every rank of three, overlapping subgroups)
    would wait for each other under different names until the timeout. So the ranks of the
    parent first agree on that number (:func:`_align_group_names`).

    Example:
        >>> intra = new_groups(dist.group.WORLD, [[0, 1], [2, 3]])  # this rank's pair, twice
    """
    timeout = group_timeout(parent)
    me = dist.get_rank()
    if dist.get_world_size(parent) == dist.get_world_size():
        mine: tuple[dist.ProcessGroup, ...] = ()
        for part in parts:
            made = tuple(dist.new_group(part, timeout=timeout) for _ in range(count))
            if me in part:
                mine = made
        return mine
    _align_group_names(parent)
    part = next(p for p in parts if me in p)
    return tuple(
        dist.new_group(part, timeout=timeout, use_local_synchronization=True) for _ in range(count)
    )


def _held_groups() -> Optional[int]:
    """How many process groups this rank holds, as torch counts them when it names a group
    created with ``use_local_synchronization`` (None: this torch keeps no such count)."""
    world = getattr(dist.distributed_c10d, "_world", None)  # private, checked by a test
    names = getattr(world, "pg_names", None)
    return len(names) if isinstance(names, dict) else None


def _align_group_names(parent: dist.ProcessGroup) -> None:
    """Bring every rank of ``parent`` to the same count of held process groups, so that the
    groups they create next over the same ranks get the same name: a rank behind creates
    groups of itself alone (no rendezvous with any other rank) until it catches up."""
    held = _held_groups()
    counts = all_gather_objects(held, parent, "pycomm (a codec's process groups)")
    if any(c is None for c in counts):
        return
    me = [dist.get_rank()]
    for _ in range(max(counts) - held):
        dist.new_group(me, timeout=group_timeout(parent), use_local_synchronization=True)


class Stage:
    """The two process groups of one level and the chain that keeps its second collective
    issued in bucket order (``issued``: the latest bucket's was issued).

    Shared by every state over the same groups and kept for the life of the parent group: a
    process group must never be released from inside one of its own callbacks (gloo would
    join its own worker thread and abort), so no hook state owns one.

    Example:
        >>> stage = Stage(new_groups(dist.group.WORLD, [[0, 1]]))
        >>> stage.groups[0], stage.nccl
    """

    def __init__(self, groups: tuple, nccl: Optional[bool] = None) -> None:
        self.groups = groups
        self.nccl = dist.get_backend(groups[-1]) == "nccl" if nccl is None else nccl
        self.issued: torch.futures.Future = completed(torch.empty(0))


_PHASE_GROUPS: dict[int, tuple[dist.ProcessGroup, Stage]] = {}


def phase_groups(parent: Optional[dist.ProcessGroup]) -> Stage:
    """The :class:`Stage` of the two-phase exchange over ``parent`` (None: the default group),
    created at the first call on every rank of it (a collective) and shared afterwards.

    Example:
        >>> g1, g2 = phase_groups(None).groups
    """
    # Keyed by the parent object (held by the entry, so its id cannot be reused); a new
    # default group after destroy_process_group() gets new phase groups.
    world = parent or dist.group.WORLD
    entry = _PHASE_GROUPS.get(id(world))
    if entry is None or entry[0] is not world:
        stage = Stage(new_groups(world, [dist.get_process_group_ranks(world)]))
        entry = _PHASE_GROUPS[id(world)] = (world, stage)
    return entry[1]


def compare_steps(where: str, steps: int, group: Any, device: torch.device) -> None:
    """The ranks of ``group`` compare the steps their states had run (0 for a fresh one), in
    one small all-reduce: a difference is a ValueError on every rank. Each rank loads its own
    state, and ranks that loaded states of different saves, or some a state and some none,
    would otherwise pair a warm-up's collectives with a compressed call's (a hang until the
    group's timeout) or train apart.

    Example:
        >>> compare_steps("pycomm.Exchange", 12, None, torch.device("cpu"))
    """
    nccl = dist.get_backend(group) == "nccl"
    v = torch.tensor([steps, -steps], dtype=torch.int64, device=device if nccl else "cpu")
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    most, least = v.tolist()
    if most != -least:
        raise ValueError(
            f"{where}: the ranks' states have run different numbers of steps "
            f"(from {-least} to {most}): some ranks loaded a state of another save, or "
            "none; expected every rank to load the same save (pycomm.checkpoint.load and "
            "load_rank_state check it as they load)"
        )
