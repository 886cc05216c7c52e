"""Outer loops on the exchange: :class:`LocalSGD` and :class:`DiLoCo` sync a model every
``sync_every`` inner steps instead of every step, through a :class:`pycomm.Exchange`
(int4 with error feedback by default), on stock ``torch.distributed``.

Each rank trains its own replica (plain, or a DDP/FSDP2 model inside its node) and calls
``outer.step()`` after each inner ``optimizer.step()``. The outer copy is the parameters as
of the last sync, the same bits on every rank. A fragment's sync sends its pseudo-gradient
(outer copy - local parameters) through the exchange as one call (one residual, so error
feedback per fragment), averages it, steps the outer optimizer on the outer copy and puts
the new outer parameters into the model. ``fragments=F`` splits the parameters into F
fragments that sync in turn, H/F steps apart (Streaming DiLoCo); ``delay=tau`` issues a
fragment's exchange at its step and applies it ``tau`` inner steps later, while training goes
on. Merge rule: when a delayed sync lands, the fragment's parameters are replaced by the new
outer parameters (Streaming DiLoCo with mixing factor 0, torchft's default): the ``tau``
local steps taken on that fragment meanwhile are dropped, and every rank holds the same bits
in the fragment after its sync.

Guide: docs/slow-links.md.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.codec.agree import agree, error_field
from pycomm.codec.engine import ring_bytes
from pycomm.exchange import Exchange, Work
from pycomm.exchange.managed import check_manager

__all__ = ["DiLoCo", "LocalSGD"]


def _nesterov(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _averaging(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0, momentum=0.0)


class DiLoCo:
    """DiLoCo on a :class:`pycomm.Exchange`: every ``sync_every`` inner steps, the average
    pseudo-gradient (outer copy - local parameters) steps ``outer_optimizer`` on the outer
    copy, which every rank then trains from.

    Args:
        model: the rank's replica: a module, or a DDP model inside the node (its
            ``module``'s parameters are synced); every rank of ``process_group`` builds one
            with the same parameter shapes. The outer copy starts from the first rank's.
        sync_every: H, inner steps between two syncs of a fragment (>= 1).
        codec: the exchange's codec (``pycomm.Exchange.codecs()``; "allreduce" is exact).
        outer_optimizer: ``params -> torch.optim.Optimizer`` over exactly the ``params`` it
            is given (the outer copy); default Nesterov SGD, lr 0.7, momentum 0.9.
        fragments: F, fragments synced in turn, H // F steps apart (1 <= F <= H, and at most
            the number of parameter tensors).
        delay: tau, inner steps between a fragment's exchange and its application
            (0 <= tau < H // F).
        process_group: the ranks that sync (default every rank): the cross-node group when
            the model is DDP or FSDP2 inside the node (``pycomm.cross_node_group()``).
        hook_options: the codec's options, as ``pycomm.Exchange(**options)`` takes them.
        manager: a ``torchft.manager.Manager`` (built with ``use_async_quorum=False``): the
            syncs run across torchft's replica groups, each in a quorum of its own, and
            commit or roll back; a lost replica group does not stop the others, and one
            that rejoins heals from a live peer (docs/fault-tolerance.md). Not with
            ``process_group``.

    Raises:
        ValueError or TypeError on every rank: a bad argument on any rank, models of other
        shapes, an outer optimizer over other parameters, an inner DDP over the same group.

    Example:
        >>> outer = pycomm.DiLoCo(model, sync_every=50)
        >>> for batch in data:
        ...     loss_fn(model(batch)).backward(); opt.step(); opt.zero_grad()
        ...     outer.step()
        >>> outer.sync()  # before an evaluation or a save: every rank holds the same bits
    """

    where = "pycomm.DiLoCo"

    def __init__(
        self,
        model: torch.nn.Module,
        sync_every: int,
        codec: str = "int4",
        outer_optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
        fragments: int = 1,
        delay: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        hook_options: Optional[dict[str, Any]] = None,
        manager: Any = None,
    ) -> None:
        self.manager = manager
        if manager is not None:
            check_manager(self.where, manager, sync_quorum=True)
            if process_group is not None:
                raise ValueError(
                    f"{self.where}: manager= and process_group= were both given; expected "
                    "one: under a torchft manager the syncs run across the replica groups "
                    "over the manager's group (inside a replica group, DDP or FSDP2)"
                )
        elif not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{self.where}: no process group; call pycomm.init() first")
        fields: dict[str, Any] = error_field(None)
        try:
            params = _params_of(
                self.where, model, sync_every, fragments, delay, process_group, manager
            )
            outer_optimizer = outer_optimizer or self._default_outer
            if not callable(outer_optimizer):
                raise TypeError(
                    f"{self.where}: outer_optimizer={outer_optimizer!r}, expected a function "
                    "params -> torch.optim.Optimizer, or None"
                )
            if hook_options is not None and not isinstance(hook_options, dict):
                raise TypeError(f"{self.where}: hook_options={hook_options!r}, expected a dict")
        except (TypeError, ValueError) as e:
            if manager is not None:  # each replica group checks its own; see below for more
                raise
            params = []
            fields = error_field(e)
        fields["parameter shapes"] = [list(p.shape) for p in params]
        fields["parameter dtypes"] = [str(p.dtype) for p in params]
        for name, value in (("sync_every", sync_every), ("fragments", fragments),
                            ("delay", delay), ("codec", codec)):  # fmt: skip
            fields[name] = repr(value)
        self.params, self.sync_every, self.delay = params, sync_every, delay
        self.process_group = process_group
        self._own: Optional[list[torch.Tensor]] = None
        if manager is None:
            agree(self.where, fields, process_group)
            # DDP's all-reduce of the same model would span every rank of the job
            self._ddp_world = dist.get_world_size()
            # this rank's parameters as handed over, until the first step: a state loaded
            # before it (the model loaded before this was built, mid-window) puts them back
            self._own = [p.detach().clone() for p in params]
            with torch.no_grad():  # the outer copy starts from the first rank's parameters
                src = dist.get_global_rank(process_group or dist.group.WORLD, 0)
                for p in params:
                    dist.broadcast(p.data, src=src, group=process_group)
        else:  # the replica groups compare these before each sync, through the exchange
            self._ddp_world = 1
        self.outer = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.optimizer = _outer_optimizer(self.where, outer_optimizer, self.outer)
        if manager is None:
            self.exchange = Exchange(codec, process_group, **(hook_options or {}))
        else:
            self._register_with(manager)
            fields["outer optimizer"] = type(self.optimizer).__name__
            fields["outer optimizer's options"] = repr(
                [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            )
            self.exchange = Exchange(
                codec, manager=manager, name=type(self).__name__,
                fields={k: v for k, v in fields.items() if "error" not in k},
                **(hook_options or {}),
            )  # fmt: skip
        self.fragments = _split(list(range(len(params))), params, fragments)
        h = sync_every
        # fragment f is issued at the steps t with t % H == its offset: H/F apart
        self.offsets = [((f + 1) * h // fragments) % h for f in range(fragments)]
        self.step_count = 0
        self.pending: dict[int, tuple[int, Work, list[torch.Tensor]]] = {}  # f -> (due, ...)
        self._stats = {"syncs": 0, "skipped": 0, "rollbacks": 0, "bytes_sent": 0,
                       "bytes_fp32": 0, "peak_sync_bytes": 0}  # fmt: skip
        self._numel = sum(p.numel() for p in params)

    @staticmethod
    def _default_outer(params: list) -> torch.optim.Optimizer:
        return _nesterov(params)

    # --- the loop -----------------------------------------------------------------------

    def step(self) -> None:
        """Call after each inner ``optimizer.step()``: applies the fragments whose sync is
        due, then issues those whose turn it is (an exchange in flight while training goes
        on, with ``delay``)."""
        self.step_count += 1
        self._own = None
        t = self.step_count
        for f in [f for f, (due, _, _) in self.pending.items() if due <= t]:
            self._apply(f)
        for f, off in enumerate(self.offsets):
            if t % self.sync_every == off and f not in self.pending and not self.pending:
                f = self._quorum(f)
                self._issue(f, self.step_count + self.delay)
                if self.delay == 0:
                    self._apply(f)

    def hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call :meth:`step` after each ``optimizer.step()`` (a step post-hook of the inner
        optimizer), instead of calling it yourself; returns the handle (``.remove()``).

        Example:
            >>> with pycomm.LocalSGD(model, sync_every=50) as outer:
            ...     outer.hook(opt)
            ...     train(model, opt)  # every opt.step() counts; the exit syncs
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{self.where}.hook: optimizer is a {type(optimizer).__name__}, expected a "
                "torch.optim.Optimizer"
            )
        return optimizer.register_step_post_hook(lambda *_: self.step())

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        """Leaving the ``with`` block syncs every fragment (not when it raised)."""
        if kind is None:
            self.sync()

    def sync(self) -> None:
        """Sync every fragment now (those in flight land first): afterwards every rank holds
        the same bits in every parameter. Before an evaluation, a save, or at the end."""
        for f in sorted(self.pending):
            self._apply(f)
        if self.manager is not None:  # one quorum per fragment, each committed or not
            for f in range(len(self.fragments)):
                f = self._quorum(f)
                self._issue(f, self.step_count)
                self._apply(f)
            return
        for f in range(len(self.fragments)):
            self._issue(f, self.step_count)
        for f in range(len(self.fragments)):
            self._apply(f)

    def _quorum(self, f: int) -> int:
        """Under a manager: a new quorum for the sync (a replica group that rejoins heals
        here, taking a live peer's outer state), and the fragment it syncs, by the manager's
        step: one that did not commit is synced again. Without one: ``f``."""
        if self.manager is None:
            return f
        self.manager.start_quorum()
        return self.manager.current_step() % len(self.fragments)

    def _issue(self, f: int, due: int) -> None:
        with torch.no_grad():
            pseudo = [
                (self.outer[i].detach() - self.params[i].detach()).float()
                for i in self.fragments[f]
            ]
        work = self.exchange.all_reduce(pseudo, key=("fragment", f))
        self.pending[f] = (due, work, pseudo)

    def _apply(self, f: int) -> None:
        _, work, pseudo = self.pending.pop(f)
        work.wait()
        s = self._stats
        s["bytes_sent"] += work.bytes_sent
        s["bytes_fp32"] += work.bytes_fp32
        s["peak_sync_bytes"] = max(s["peak_sync_bytes"], work.bytes_sent)
        idx = self.fragments[f]
        committed = True
        if self.manager is not None:  # the manager's verdict, the residuals settled by it
            committed = self.exchange.should_commit()
            self._ddp_world = max(self._ddp_world, self.manager.num_participants())
        with torch.no_grad():
            finite = bool(torch.stack([torch.isfinite(g).all() for g in pseudo]).all())
            if not committed:  # the fragment goes back to the outer copy, synced again
                s["rollbacks"] += 1
            elif finite:  # every rank holds the same average: all skip, or none
                for i, g in zip(idx, pseudo):
                    self.outer[i].grad = g.to(self.outer[i].dtype)
                self.optimizer.step()
                for i in idx:
                    self.outer[i].grad = None
                s["syncs"] += 1
            else:
                s["skipped"] += 1
            for i in idx:
                self.params[i].copy_(self.outer[i])

    # --- under a torchft manager --------------------------------------------------------

    def _register_with(self, manager: Any) -> None:
        """The outer state, shared by the replica groups, registered with the manager: a
        replica group that heals takes a live peer's, bit for bit (its residuals start from
        zeros: the exchange's own heal)."""
        key = f"pycomm.{type(self).__name__}"
        try:
            manager.register_state_dict_fn(key, self._load_shared, self._shared_state)
        except AssertionError:  # torchft refuses a key twice with a bare assert
            raise ValueError(
                f"{self.where}: the manager has a state registered as {key!r} already; "
                "expected one outer loop per manager"
            ) from None

    def _shared_state(self) -> dict[str, Any]:
        """What a healing replica group takes: the outer copy, the outer optimizer, the step."""
        return {
            "step": self.step_count,
            "outer": [p.detach().clone() for p in self.outer],
            "outer_optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "stats": dict(self._stats),
        }

    def _load_shared(self, state: dict[str, Any]) -> None:
        """Heal from a live peer's :meth:`_shared_state`."""
        with torch.no_grad():
            for p, t in zip(self.outer, state["outer"]):
                p.copy_(t)
        self.optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        self.step_count = int(state["step"])
        self.pending = {}

    # --- counters and state -------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """``syncs`` (fragment syncs applied), ``skipped`` (non-finite pseudo-gradients, on
        every rank), ``bytes_sent`` (this rank's), ``peak_sync_bytes`` (the most one sync
        sent), ``bytes_fp32`` (the fp32 all-reduces of the same syncs), ``bytes_ddp`` (what
        DDP's fp32 all-reduce of the gradients sends over the same steps) and
        ``compression_vs_ddp``."""
        s = dict(self._stats)
        s["bytes_ddp"] = self.step_count * ring_bytes(self._numel * 4, self._ddp_world)
        s["compression_vs_ddp"] = s["bytes_ddp"] / max(s["bytes_sent"], 1)
        return s

    def state_dict(self) -> dict[str, Any]:
        """The outer copy, the outer optimizer, the exchange's residuals, the step and the
        syncs in flight (waited for and saved as they landed), for this rank.

        Example:
            >>> torch.save(outer.state_dict(), f"outer-rank{rank}.pt")
        """
        pending = {}
        for f, (due, work, pseudo) in self.pending.items():
            work.wait()
            pending[f] = (due, [g.clone() for g in pseudo])
        return {
            "format": 1,
            "step": self.step_count,
            "outer": [p.detach().clone() for p in self.outer],
            "outer_optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "exchange": self.exchange.state_dict(),
            "pending": pending,
            "stats": {**self._stats, "steps": self.step_count},
            "rank": self.rank,
            "world_size": self.world_size,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same model, options and rank): resume is bitwise,
        mid-window and with a sync in flight too, whichever came first of building this and
        loading the model's own state: the first rank's parameters, which building puts into
        every rank's model, are replaced by this rank's own as they were handed over when
        nothing has changed them since (no step, no load of the model after building).

        Example:
            >>> model.load_state_dict(saved["model"])  # before or after the next line
            >>> outer = pycomm.LocalSGD(model, sync_every=50)
            >>> outer.load_state_dict(saved["outer"])
        """
        self.check_fingerprint(state)
        outer = state["outer"]
        own, self._own = self._own, None
        with torch.no_grad():
            if own is not None and all(torch.equal(p, o) for p, o in zip(self.params, self.outer)):
                for p, t in zip(self.params, own):  # the broadcast replaced them: put back
                    p.copy_(t)
        self.exchange.load_state_dict(state["exchange"])
        # a copy: torch's load_state_dict keeps the tensors it is given as its own
        self.optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        with torch.no_grad():
            for p, t in zip(self.outer, outer):
                p.copy_(t)
        self.step_count = int(state["step"])
        self._stats.update({k: v for k, v in state["stats"].items() if k in self._stats})
        self.pending = {}
        for f, (due, pseudo) in state["pending"].items():
            work = Work(_done(pseudo), pseudo)
            self.pending[int(f)] = (due, work, [g.clone() for g in pseudo])

    @property
    def rank(self) -> int:
        if self.manager is not None:  # a replica group's state: its rank within the group
            return dist.get_rank() if dist.is_initialized() else 0
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        if self.manager is not None:
            return dist.get_world_size() if dist.is_initialized() else 1
        return dist.get_world_size(self.process_group)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            "sync_every": self.sync_every,
            "fragments": [list(f) for f in self.fragments],
            "delay": self.delay,
            "shapes": [list(p.shape) for p in self.outer],
        }

    def check_fingerprint(self, state: Any) -> None:
        """Refuse (ValueError naming the field) a state of another outer loop, model, schedule
        or rank."""
        where = f"{self.where}.load_state_dict"
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError(f"{where}: expected what {self.where}.state_dict() returns")
        theirs, mine = state.get("fingerprint", {}), self._fingerprint()
        for key, value in mine.items():
            if theirs.get(key) != value:
                raise ValueError(
                    f"{where}: the state has {key}={theirs.get(key)!r}, this {self.where} "
                    f"{value!r}; expected the same"
                )
        if state.get("rank") != self.rank or state.get("world_size") != self.world_size:
            raise ValueError(
                f"{where}: the state of rank {state.get('rank')} of {state.get('world_size')}, "
                f"this is rank {self.rank} of {self.world_size}: the state is per rank"
            )


class LocalSGD(DiLoCo):
    """Local SGD: the parameters averaged every ``sync_every`` inner steps through the
    exchange (int4 with error feedback by default): :class:`DiLoCo` with outer SGD at lr 1
    and no momentum, so each sync sets every rank's parameters to the average of the ranks'.

    Example:
        >>> outer = pycomm.LocalSGD(model, sync_every=50)
        >>> ...; opt.step(); outer.step()
    """

    where = "pycomm.LocalSGD"

    def __init__(
        self,
        model: torch.nn.Module,
        sync_every: int,
        codec: str = "int4",
        fragments: int = 1,
        delay: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        hook_options: Optional[dict[str, Any]] = None,
        manager: Any = None,
    ) -> None:
        super().__init__(
            model,
            sync_every,
            codec,
            _averaging,
            fragments,
            delay,
            process_group,
            hook_options,
            manager,
        )


def _params_of(
    where: str, model: Any, h: Any, fragments: Any, delay: Any, group: Any, manager: Any
) -> list:
    """The parameters to sync, once the arguments are checked on this rank."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model is a {type(model).__name__}, expected an nn.Module")
    inner = model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and manager is not None:
        inner = model.module  # DDP inside the replica group; the manager's group across them
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        mine = dist.get_process_group_ranks(model.process_group)
        outer = dist.get_process_group_ranks(group or dist.group.WORLD)
        if len(set(mine) & set(outer)) > 1:
            raise ValueError(
                f"{where}: the inner model is DDP over ranks {mine} and the outer sync over "
                f"ranks {outer}: they share ranks, so every step already averages what the "
                "outer sync would; expected DDP inside the node (pycomm.node_group()) and "
                "process_group=pycomm.cross_node_group(), or no DDP"
            )
        inner = model.module
    check_int(where, "sync_every", h, 1)
    check_int(where, "fragments", fragments, 1)
    check_int(where, "delay", delay, 0)
    params = [_local(p) for p in inner.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{where}: the model has no trainable parameters")
    if fragments > len(params) or fragments > h:
        raise ValueError(
            f"{where}: fragments={fragments}, expected at most the model's "
            f"{len(params)} parameter tensors and sync_every={h} (a fragment syncs every "
            "sync_every steps, H // F apart)"
        )
    if delay and delay >= h // fragments:
        raise ValueError(
            f"{where}: delay={delay}, expected 0 <= delay < sync_every // fragments = "
            f"{h // fragments} (a fragment's sync lands before the next fragment's starts)"
        )
    return params


def _outer_optimizer(where: str, factory: Callable, outer: list) -> torch.optim.Optimizer:
    """``factory(outer)``, checked: an optimizer over exactly ``outer``, in order."""
    opt = factory(outer)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: outer_optimizer returned a {type(opt).__name__}, expected a "
            "torch.optim.Optimizer"
        )
    given = [p for g in opt.param_groups for p in g["params"]]
    if len(given) != len(outer) or any(a is not b for a, b in zip(given, outer)):
        raise ValueError(
            f"{where}: outer_optimizer built an optimizer over {len(given)} tensors "
            f"that are not the {len(outer)} it was given; expected one over exactly "
            "its params argument (the outer copy), in order"
        )
    return opt


def _split(order: list[int], params: list[torch.Tensor], n: int) -> list[list[int]]:
    """``order`` (parameter positions) cut into ``n`` consecutive fragments of about equal
    elements, each holding at least one tensor."""
    total = sum(p.numel() for p in params)
    out: list[list[int]] = [[] for _ in range(n)]
    acc, f = 0, 0
    for k, i in enumerate(order):
        left = len(order) - k
        if out[f] and (acc >= (f + 1) * total / n or left == n - f - 1) and f < n - 1:
            f += 1
        out[f].append(i)
        acc += params[i].numel()
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank holds it: an FSDP2 parameter's local shard (the cross-node
    group's ranks hold the same shard), any other as it is."""
    to_local = getattr(p, "to_local", None)
    return p.to_local() if callable(to_local) else p


def _done(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
