"""The exchange under a torchft ``Manager``: ``pycomm.Exchange(codec, manager=manager)``, an
all-reduce across torchft's replica groups, compressed, with torchft's semantics.

torchft (``pip install 'pycomm[ft]'``) keeps the live replica groups training when one is
lost and heals a rejoining one from a live peer. Its ``Manager`` decides, per step, which
replica groups take part (the quorum) and whether the step counts (``should_commit``). An
all-reduce of this module behaves as the manager's own ``manager.allreduce``:

- It waits for the quorum (``manager.start_quorum()`` must have been called for the step, as
  torchft's ``OptimizerWrapper.zero_grad`` and pycomm's outer loops do), and averages over
  ``manager.num_participants()``.
- A replica group that is healing (not participating) sends zeros, receives the average, and
  leaves its residuals untouched.
- After an error (the manager's ``errored()``) a call does nothing; an error in the
  collective (a lost peer, a timeout) is reported to the manager (``report_error``), so that
  ``should_commit()`` is False for the step.
- Error feedback is kept in two copies, the committed residuals and the call's new ones. A
  call's new residuals count once its step commits and are dropped when it does not: a step
  that does not commit leaves the residuals as they were before it, nothing counted twice,
  nothing lost. :meth:`ManagedExchange.should_commit` (in place of the manager's) settles the
  calls at once. Without it a call is settled at the next call: kept once the manager's step
  has moved past the step it was made in, and replaced when its key is exchanged again in
  the same step (the retry of a step that did not commit: DDP's buckets, an outer loop's
  fragment).
- The quorum may change between calls. The residual of this rank's own error (r1, laid out
  as the tensor) is kept across a change of the number of replica groups, re-padded; the
  residual of the chunk this rank reduced for the others (r2) starts from zeros when the
  ranks' chunks change, as its elements then belong to another rank's chunk. A replica group
  that heals from a peer starts with zero residuals (they are its own errors, not state it
  shares).
- The replica groups compare their options (codec, every option, the caller's fields) in one
  small all-gather before a call's data moves: a difference is a ValueError on every replica
  group, with nothing applied.

Guide: docs/fault-tolerance.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.codec.config import Config, resolve
from pycomm.codec.engine import Engine, completed, ring_bytes
from pycomm.codec.groups import Stage
from pycomm.codec.registry import codec_names, codec_spec, find_codec, qualified_name
from pycomm.exchange import checks
from pycomm.exchange.issue import Work

__all__ = [
    "FT_EXTRA", "ManagedExchange", "check_manager", "manager_group", "require_torchft",
]  # fmt: skip

FT_EXTRA = "pip install 'pycomm[ft]'"
_SLOTS = 32  # fields compared per call, one 8-byte digest each


def require_torchft(where: str) -> Any:
    """torchft's ``Manager`` class, or an ImportError that names the extra to install."""
    try:
        from torchft.manager import Manager
    except ImportError as e:
        raise ImportError(
            f"{where}: manager= takes a torchft Manager, and torchft is not installed; "
            f"install the extra: {FT_EXTRA}"
        ) from e
    return Manager


def check_manager(where: str, manager: Any, *, sync_quorum: bool = False) -> None:
    """Refuse what is not a torchft ``Manager`` (TypeError), or, with ``sync_quorum``, one
    built with ``use_async_quorum=True`` (ValueError): an outer loop heals a replica at the
    quorum of its sync, which an asynchronous quorum would run beside the step instead."""
    manager_class = require_torchft(where)
    if not isinstance(manager, manager_class):
        raise TypeError(
            f"{where}: manager is a {type(manager).__name__}, expected a torchft.manager.Manager"
        )
    # torchft has no accessor for it; its own DiLoCo reads the same attribute
    if sync_quorum and getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            f"{where}: the manager was built with use_async_quorum=True; expected "
            "torchft.manager.Manager(..., use_async_quorum=False): a sync heals a replica "
            "group at its quorum, before its pseudo-gradient is taken"
        )


def manager_group(manager: Any) -> dist.ProcessGroup:
    """The manager's process group across the replica groups (reconfigured at each new
    quorum); torchft keeps it as ``_pg`` and offers no accessor."""
    return manager._pg


class ManagedExchange:
    """An all-reduce across torchft's replica groups through a pycomm codec (see the module
    docstring for its semantics). Built by ``pycomm.Exchange(codec, manager=manager)``.

    Args:
        codec: a registered codec (``pycomm.Exchange.codecs()``) or ``"allreduce"`` (exact).
        manager: the replica group's ``torchft.manager.Manager``.
        name: the exchange's name with the manager: its heal hook is registered as
            ``pycomm.exchange.<name>`` (``manager.register_state_dict_fn``), unique per
            manager.
        start_iter: the first ``start_iter`` steps of the manager (``current_step()``) run
            exact, the later ones through the codec: a step every replica group agrees on.
        fields: more values the replica groups compare before each call (an outer loop's
            schedule), ``{name: value}``.
        **options: the codec's options, as ``pycomm.Exchange`` takes them (``hierarchy``
            must stay ``"auto"`` or ``"flat"``: the manager's group is one level).

    Example:
        >>> ex = pycomm.Exchange("int4", manager=manager)
        >>> manager.start_quorum()
        >>> ex.all_reduce(delta, key="delta").wait()
        >>> if ex.should_commit(): apply(delta)
    """

    where = "pycomm.Exchange(manager=...)"

    def __init__(
        self,
        codec: str = "int8",
        manager: Any = None,
        *,
        name: str = "exchange",
        start_iter: int = 0,
        fields: Optional[dict[str, Any]] = None,
        **options: Any,
    ) -> None:
        check_manager(self.where, manager)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.where}: name={name!r}, expected a non-empty str")
        check_int(self.where, "start_iter", start_iter, 0)
        if not isinstance(codec, str) or codec not in ["allreduce", *codec_names()]:
            raise ValueError(
                f"{self.where}: codec={codec!r}, expected one of "
                f"{', '.join(['allreduce', *codec_names()])}"
            )
        hierarchy = options.get("hierarchy", "auto")
        if hierarchy not in ("auto", "flat"):
            raise ValueError(
                f"{self.where}: hierarchy={hierarchy!r}, expected 'auto' or 'flat': the "
                "manager's group spans the replica groups, one level (a hierarchy inside a "
                "replica group is its own DDP or FSDP2)"
            )
        self.config: Optional[Config] = None
        if codec != "allreduce":
            self.config = resolve(
                codec_spec(codec), f"{self.where} (codec {codec!r})", options, start_iter
            )
        elif set(options) - {"hierarchy"}:
            raise ValueError(
                f"{self.where}: option {sorted(set(options) - {'hierarchy'})[0]!r} is not an "
                "option of codec 'allreduce', expected its options (hierarchy)"
            )
        spec = find_codec(codec)
        self.fields: dict[str, str] = {
            "codec": repr(codec),
            "registration": "built in" if spec is None else qualified_name(spec.codec),
            "start_iter": repr(start_iter),
            **(
                {} if self.config is None else {k: repr(v) for k, v in self.config.fields().items()}
            ),
            **{str(k): repr(v) for k, v in (fields or {}).items()},
        }
        self.codec_name, self.manager, self.name, self.start_iter = codec, manager, name, start_iter
        self._stats: dict[str, Any] = {
            "calls": 0, "bytes_sent": 0, "bytes_fp32": 0, "not_participating": 0,
            "commits": 0, "rollbacks": 0, "resized": 0, "heals": 0,
        }  # fmt: skip
        self.engine: Optional[Engine] = None
        if self.config is not None:
            engine_options = {**self.config.engine_options, "strict_skip": True}
            self.engine = Engine(self.where, self.config.codec, self._stats, **engine_options)
        self._keys: dict[Hashable, int] = {}
        self._flats: dict[Hashable, torch.Tensor] = {}
        self._pending: dict[tuple, int] = {}  # residual key -> the manager's step of its call
        self._last: Optional[torch.futures.Future] = None
        try:
            manager.register_state_dict_fn(f"pycomm.exchange.{name}", self._healed, self._shared)
        except AssertionError:  # torchft refuses a key twice with a bare assert
            raise ValueError(
                f"{self.where}: name={name!r} is taken: the manager has a state registered "
                f"as 'pycomm.exchange.{name}'; expected a name unique per manager"
            ) from None

    # --- the call -----------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: Union[torch.Tensor, Sequence[torch.Tensor]],
        key: Hashable,
        op: str = "mean",
        *,
        async_op: bool = True,
        compare: bool = True,
    ) -> Work:
        """Replace ``tensor`` (or a list of tensors of one dtype, one exchange) by its mean
        over the participating replica groups (``op="sum"``: the sum), through the codec
        with ``key``'s residual. ``async_op=False``: done when it returns. ``compare``: the
        replica groups compare their options first (one 264-byte all-gather; pycomm's DDP
        hook compares at each step's first bucket). Calls run one at a time: a call waits
        for the one before it.

        Example:
            >>> ex.all_reduce([p.grad for p in params], key="grads").wait()
        """
        where = f"{self.where}.all_reduce"
        dtypes = None if self.config is None else self.config.grad_dtypes
        if isinstance(tensor, (list, tuple)):
            numel = checks.check_tensors(where, key, tensor, op, dtypes)
            flat = self._flats.get(key)
            if flat is None or (flat.numel(), flat.dtype) != (numel, tensor[0].dtype):
                flat = self._flats[key] = torch.empty(
                    numel, dtype=tensor[0].dtype, device=tensor[0].device
                )
            torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
        else:
            flat = checks.check_tensor(where, "tensor", tensor, op, dtypes)
            checks.check_tensors(where, key, [tensor], op, dtypes)  # the key too
        if not isinstance(async_op, bool) or not isinstance(compare, bool):
            raise TypeError(
                f"{where}: async_op={async_op!r}, compare={compare!r}, expected True or False"
            )
        if self._last is not None:  # one call at a time: their collectives stay in order
            self._last.wait()
        manager = self.manager
        if manager.errored() is not None:  # as manager.allreduce: the step is lost already
            return Work(completed(flat), tensor)
        try:
            manager.wait_quorum()
        except AssertionError:
            raise RuntimeError(
                f"{where}: no quorum: call manager.start_quorum() for the step first "
                "(torchft's OptimizerWrapper does it in zero_grad, pycomm's outer loops at "
                "each sync)"
            ) from None
        group = manager_group(manager)
        step, size = manager.current_step(), group.size()
        participants, participating = manager.num_participants(), manager.is_participating()
        self._settle_older(step)
        try:
            if compare:
                call = f"key {key!r}, {flat.numel()} elements of {str(flat.dtype)[6:]}"
                self.compare(group, where, call)
            future, sent, fp32 = self._issue(flat, key, op, step, group, size, participating)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the collective's failure: the step is lost
            manager.report_error(e)
            return Work(completed(flat), tensor)
        s = self._stats
        s["calls"] += 1
        s["bytes_sent"] += sent
        s["bytes_fp32"] += fp32
        s["not_participating"] += int(not participating)
        ratio = size / max(participants, 1) if op == "mean" else float(size)
        exact_sum = self.engine is None or step < self.start_iter or flat.dtype == torch.float64

        def finish(fut: torch.futures.Future) -> Any:
            fut.value()
            if exact_sum:
                if op == "mean":
                    flat.div_(max(participants, 1))
            elif ratio != 1.0:  # the codec averages over the group's size
                flat.mul_(ratio)
            if isinstance(tensor, (list, tuple)):
                offset = 0
                for t in tensor:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
            return tensor

        done = manager.wrap_future(future.then(finish), tensor)
        self._last = done
        work = Work(done, tensor, sent, fp32)
        if not async_op:
            work.wait()
        return work

    def _issue(
        self, flat: torch.Tensor, key: Hashable, op: str, step: int, group: Any, size: int,
        participating: bool,
    ) -> tuple[torch.futures.Future, int, int]:  # fmt: skip
        """Start the call's collectives: the exact sum, or the codec's exchange."""
        n = flat.numel()
        fp32 = ring_bytes(n * 4, size)
        if not participating:
            flat.zero_()
        engine = self.engine
        if engine is None or step < self.start_iter or flat.dtype == torch.float64:
            work = dist.all_reduce(flat, group=group, async_op=True)
            return work.get_future(), ring_bytes(n * flat.element_size(), size), fp32
        index = self._keys.setdefault(key, len(self._keys))
        rkey = (index, n, str(flat.dtype))
        engine.bind(Stage((group, group), nccl=False), size)
        store = engine.store
        before = store.residuals.get(rkey)
        store.resize(rkey, engine.key_sizes(rkey))
        self._stats["resized"] += int(store.residuals.get(rkey) is not before)
        sent = [0]

        def count(nbytes: int, _collectives: int) -> None:
            sent[0] += nbytes

        feedback = engine.error_feedback
        engine.error_feedback = feedback and participating  # a healing replica keeps its own
        try:
            future = engine.all_reduce(flat, rkey, step, count)
        finally:
            engine.error_feedback = feedback
        if feedback and participating:
            self._pending[rkey] = step
        return future, sent[0], fp32

    # --- commit, heal, compare ----------------------------------------------------------

    def should_commit(self, timeout: Any = None) -> bool:
        """``manager.should_commit()``, and this exchange's calls settled by its answer:
        their residuals kept when True, dropped when False.

        Example:
            >>> if ex.should_commit(): outer_optimizer.step()
        """
        ok = bool(self.manager.should_commit(timeout))
        self.settle(ok)
        return ok

    def settle(self, committed: bool) -> None:
        """Keep (``committed``) or drop the new residuals of every call not settled yet: for
        a caller that asked the manager's ``should_commit`` itself."""
        if self._last is not None:
            self._last.wait()
        self._settle(set(self._pending), committed)

    def _settle_older(self, step: int) -> None:
        """At a call: the calls of steps the manager has moved past committed."""
        self._settle({k for k, s in self._pending.items() if s < step}, True)

    def _settle(self, keys: set, committed: bool) -> None:
        """The calls of ``keys`` settled: their new residuals kept when ``committed`` and
        their step decoded finite, dropped otherwise."""
        if not keys or self.engine is None:
            return
        store = self.engine.store
        store.fold()
        keep = {k for k in keys if committed and self._pending[k] not in store.bad_steps}
        store.settle(keep, True)
        store.settle(keys - keep, False)
        self._stats["commits" if committed else "rollbacks"] += 1
        for k in keys:
            del self._pending[k]

    def _shared(self) -> dict[str, Any]:
        """What a healing peer takes from this replica group: nothing but the count (the
        residuals are this replica's own errors)."""
        return {"calls": self._stats["calls"]}

    def _healed(self, state: dict[str, Any]) -> None:
        """This replica group healed from a peer: its residuals start from zeros."""
        self.reset()
        self._stats["heals"] += 1

    def reset(self) -> None:
        """Forget every residual and call in flight (a healed replica group starts here)."""
        if self.engine is not None:
            self.engine.store.load({})
        self._pending = {}

    def compare(self, group: Any, where: str, call: str = "") -> None:
        """The replica groups compare :attr:`fields` and ``call`` (one all-gather of their
        digests): a difference is a ValueError on every replica group, naming the field and
        this group's value."""
        items = list(self.fields.items())  # in order: an option before the codec's format
        if call:
            items.append(("the call", call))
        digests = [
            int.from_bytes(hashlib.blake2b(f"{k}={v}".encode(), digest_size=7).digest(), "little")
            for k, v in items
        ]
        if len(digests) > _SLOTS:  # the rest folded into the last slot
            digests[_SLOTS - 1] = hash(tuple(digests[_SLOTS - 1 :])) & (2**56 - 1)
        vec = torch.zeros(_SLOTS + 1, dtype=torch.int64)
        vec[0] = len(items)
        vec[1 : 1 + min(len(digests), _SLOTS)] = torch.tensor(digests[:_SLOTS])
        rows = [torch.empty_like(vec) for _ in range(group.size())]
        dist.all_gather(rows, vec, group=group)
        table = torch.stack(rows)
        differs = (table != table[:1]).any(dim=0).nonzero().flatten().tolist()
        if not differs:
            return
        col = differs[0]
        mine = group.rank()
        others = [r for r in range(len(rows)) if not torch.equal(rows[r], vec)]
        what = "the number of fields" if col == 0 else f"{items[min(col, len(items)) - 1][0]}"
        value = len(items) if col == 0 else items[min(col, len(items)) - 1][1]
        raise ValueError(
            f"{where}: the replica groups resolved different options: {what} is {value} on "
            f"this replica group (rank {mine} of the manager's group) and differs on ranks "
            f"{others}; expected every replica group to build the same exchange (codec, "
            "options, schedule) and make the same calls"
        )

    # --- counters and state -------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """``calls``, ``bytes_sent`` (this replica's), ``bytes_fp32`` (an fp32 ring
        all-reduce of the same tensors), ``compression``, ``not_participating`` (calls made
        while healing), ``commits``/``rollbacks`` (settlements), ``resized`` (residuals
        refitted to a new quorum), ``heals``."""
        if self.engine is not None:
            self.engine.store.fold()
        s = dict(self._stats)
        s["compression"] = s["bytes_fp32"] / max(s["bytes_sent"], 1)
        return s

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Work:
        """Refused: under a manager the exchange is an all-reduce (a replica group's shards
        are its own FSDP2's)."""
        raise ValueError(_ONLY_ALL_REDUCE.format(where=self.where, call="reduce_scatter"))

    def all_gather(self, *args: Any, **kwargs: Any) -> Work:
        """Refused, as :meth:`reduce_scatter`."""
        raise ValueError(_ONLY_ALL_REDUCE.format(where=self.where, call="all_gather"))

    def state_dict(self) -> dict[str, Any]:
        """This replica's residuals (the committed ones) and keys, for its own checkpoint."""
        return {
            "format": 1,
            "keys": list(self._keys),
            "residuals": {} if self.engine is None else self.engine.store.snapshot(),
            "fields": dict(self.fields),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same codec and options."""
        where = f"{self.where}.load_state_dict"
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError(f"{where}: expected what state_dict() returns")
        if state.get("fields") != self.fields:
            theirs = state.get("fields") or {}
            diff = next(k for k in self.fields if theirs.get(k) != self.fields[k])
            raise ValueError(
                f"{where}: the state has {diff}={theirs.get(diff)}, this exchange "
                f"{self.fields[diff]}; expected the same"
            )
        self._keys = {k: i for i, k in enumerate(state["keys"])}
        self._pending = {}
        if self.engine is not None:
            self.engine.store.load(state["residuals"])
            self.engine.store.place_loaded()


_ONLY_ALL_REDUCE = (
    "{where}.{call}: under a torchft manager the exchange is an all-reduce across the replica "
    "groups; expected all_reduce (shard inside a replica group with its own FSDP2)"
)
