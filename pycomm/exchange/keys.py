"""What an :class:`~pycomm.exchange.Exchange` keeps, and how each call is issued on the
engine: the codec's engine (codec, residuals, workspace, phase groups; none for the exact
exchange), the counters, the calls of each key (its warm-up), a list call's flat buffer, each
call's step and its commit, the exact paths, the node hierarchy (exact inside the node, the
codec across), compressed all-reduces of several keys fused into one exchange
(:meth:`pycomm.exchange.engine.Engine.all_reduce_many`), and the checkpoint. Tensors and keys
only: no DDP bucket, hook function or bucket layout. Runs on the issuing thread
(:mod:`pycomm.exchange.issue`), in call order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm.codec.agree import check_saved, with_strict_skip
from pycomm.codec.config import Config
from pycomm.codec.engine import add_call, completed, exact_mean, ring_bytes
from pycomm.codec.groups import compare_steps, phase_groups
from pycomm.codec.residuals import PHASE_1, check_residuals
from pycomm.exchange import hierarchy as hier
from pycomm.exchange.issue import Issued

__all__ = ["Keys", "Ledger", "rank_order_sum", "returning"]


def rank_order_sum(rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The sum of ``rows`` ([N, s], every rank's chunk as received) in rank order, in fp32
    (float64's own for float64), times ``scale``: every rank sums its chunk the same way, so
    an exact reduce-scatter's result is the same bits wherever it runs.

    Example:
        >>> rank_order_sum(torch.ones(2, 3), 0.5)
        tensor([1., 1., 1.])
    """
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    acc = rows[0].clone()
    for r in range(1, rows.shape[0]):
        acc += rows[r]
    return acc.mul_(scale) if scale != 1.0 else acc


def returning(result: Any, flat: Optional[torch.Tensor] = None) -> Callable:
    """A future's callback that raises what the future raised, else returns ``result`` (a
    list of tensors: ``flat`` copied back into them first)."""

    def done(f: torch.futures.Future) -> Any:
        f.value()
        if flat is not None:
            with torch.no_grad():
                for t, part in zip(result, flat.split([t.numel() for t in result])):
                    t.copy_(part.view(t.shape))
        return result

    return done


def _sent(counters: dict[str, Any]) -> tuple[int, int]:
    """``bytes_sent`` and ``bytes_fp32`` so far."""
    return counters["bytes_sent"], counters["bytes_fp32"]


class Ledger:
    """What an Exchange keeps over ``group``: built from the codec's resolved configuration
    (``state``: its hook state, bound, read once here and not kept), the engine, bound to its
    phase groups; the counters; each key's position and calls (``start_iter``: each key's
    exact calls); the calls' steps and their commit; the fingerprint and the checkpoint; the
    node plan."""

    def __init__(
        self, name: str, config: Optional[Config], hierarchy: str, group: Any, start_iter: int
    ) -> None:
        self.group, self.start_iter, self.hook_name = group, start_iter, name
        self.where = f"pycomm.Exchange (codec {name!r})"
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.hierarchy = hierarchy  # the option, as given
        self.plan = hier.resolve(name, group, hierarchy)  # the node hierarchy, resolved
        self.counters: dict[str, Any] = dict.fromkeys(
            ("steps", "buckets", "collectives", "bytes_sent", "bytes_fp32"), 0
        )
        self.counters["compression"] = 1.0
        options: dict[str, Any] = {"hierarchy": hierarchy}
        self.engine, self.serial, self.grad_dtypes = None, False, None
        if config is not None:  # the engine counts into the same dict
            self.counters.update(nonfinite_buckets=0, residual_bytes=0)
            self.engine = config.engine(self.where, self.counters, "nonfinite_buckets")
            if self.world_size > 1 or self.plan is not None:
                plan, stage = self.plan, phase_groups(group)
                size = self.world_size if plan is None else plan.nodes
                self.engine.bind(stage if plan is None else plan.cross, size)
            options, self.grad_dtypes = config.options(), config.grad_dtypes
            self.serial = bool(config.engine_options["strict_skip"])
        self.codec = None if self.engine is None else self.engine.codec
        self.fingerprint = {
            "hook": name,
            "options": options,
            "world_size": self.world_size,
            "topology": hier.fingerprint(self.plan),
        }
        self.node_buffers: dict[tuple, dict] = {}  # the node hierarchy's, per key
        self.iter = 0  # calls ended: the step of the engine's residual commits
        self.open = False  # a call ended and its step is not committed yet
        self.resumed_at: Optional[int] = 0  # steps to compare across the ranks first
        self.keys: dict[Hashable, int] = {}  # (call, key) -> its position, in order of use
        self.calls: dict[Hashable, int] = {}  # (call, key) -> calls issued (the warm-up)
        self.flats: dict[Hashable, torch.Tensor] = {}  # a list call's flat buffer, per key
        self.nonfinite: list[torch.Tensor] = []  # the exact calls' flags, not yet read
        self.bad_calls = 0

    def count(self, numel: int, nbytes: int, collectives: int = 1,
              bytes_fp32: Optional[int] = None, **levels: int) -> None:  # fmt: skip
        """Account one call on ``numel`` elements that sent ``nbytes`` in ``collectives``
        collectives (``levels``: the node hierarchy's split of them): every call is a step
        (and, as the counters have it, one "bucket" of the engine)."""
        add_call(self.counters, self.world_size, numel, nbytes, collectives, bytes_fp32,
                 **levels)  # fmt: skip

    def counting(self, numel: int) -> Any:
        """A count of one call on ``numel`` elements (:func:`~pycomm.exchange.hierarchy.
        node_reduce`'s ``count``)."""
        return lambda nbytes, **kw: self.count(numel, nbytes, **kw)

    def exact_mean(self, x: torch.Tensor, group: Any) -> torch.futures.Future:
        """The exact mean as DDP takes it: scaled by 1/N (DDP's own rounding), then one
        asynchronous all-reduce on ``group``."""
        self.count(x.numel(), ring_bytes(x.numel() * x.element_size(), self.world_size))
        return exact_mean(x, self.world_size, group)

    def end(self) -> None:
        """A call's step ends (its residuals commit at the next call's begin)."""
        self.iter += 1
        self.open = True

    def commit(self) -> None:
        """Keep the last call's new residuals unless its decode came out non-finite."""
        if self.engine is not None:
            self.engine.store.commit(self.iter - 1, self.engine.device)

    def check_resumed(self, device: torch.device) -> None:
        """At the first call, and the first after a load: the ranks compare their steps."""
        steps, self.resumed_at = self.resumed_at, None
        if steps is not None and self.world_size > 1:
            compare_steps(self.where, steps, self.group, device)

    # --- counters and state -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.store.fold()  # the decodes' counts, read once done
        stats = dict(self.counters)
        if self.codec is None:  # the exact exchange decodes nothing: its results are read
            bad, self.nonfinite = self.nonfinite, []
            self.bad_calls += sum(int(b) for b in bad)
            stats["nonfinite_buckets"] = self.bad_calls
        return stats

    def residual_bytes(self, key: Hashable) -> int:
        engine = self.engine
        if engine is None or not engine.error_feedback:
            return 0
        indices = [i for (_, k), i in self.keys.items() if k == key]
        return sum(engine.store.nbytes(i, pending=True) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """In the format of the codec's hook state (what Exchanges saved before they had
        their own): the fingerprint, rank, counters and, with a codec, the step and the
        residuals."""
        saved: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "rank": self.rank,
            "world_size": self.world_size,
            "stats": self.stats(),  # the exact exchange's nonfinite_buckets too
        }
        if self.engine is not None:
            store = self.engine.store
            if store.touched:
                self.commit()
            saved.update(iter=self.iter, residuals=store.snapshot())
        saved["layout"] = None  # DDP's buckets: none here
        return {
            "exchange": saved,
            "keys": list(self.keys),
            "calls": [self.calls.get(k, 0) for k in self.keys],
        }

    def load(self, state: dict[str, Any], keys: list, calls: list[int]) -> None:
        saved = state["exchange"]
        if self.engine is not None:
            saved = with_strict_skip(saved, self.serial)
        check_saved(self.hook_name, saved, self.fingerprint, self.rank, self.world_size)
        if saved.get("layout") is not None:
            raise ValueError(
                f"{self.where}: cannot load a state with DDP's bucket layout (a DDP hook's); "
                "expected what Exchange.state_dict() returns"
            )
        loaded = saved.get("residuals", {}) if self.engine is not None else {}
        if self.engine is not None:
            check_residuals(self.where, self.engine, loaded)
        self.counters.clear()  # in place: the engine counts into this dict
        self.counters.update(saved["stats"])
        self.counters.pop("rebucketed_steps", None)
        if self.engine is None:  # the engine's store counts a codec's itself
            self.bad_calls, self.nonfinite = self.counters.pop("nonfinite_buckets", 0), []
        steps = self.counters.get("steps")
        self.resumed_at = steps if isinstance(steps, int) else None
        if self.engine is not None:
            self.iter = int(saved["iter"])
            self.engine.store.load(loaded)
            self.engine.store.place_loaded()  # a key's first compressed call may come later
        self.keys = {k: i for i, k in enumerate(keys)}
        self.calls = dict(zip(self.keys, calls))

    def load_key(self, pair: tuple, calls: int, residual: Optional[torch.Tensor]) -> None:
        index = self.keys[pair] = len(self.keys)
        self.calls[pair] = calls
        if residual is not None:
            kept = {"r1": residual.detach().clone()}
            self.engine.store.put((index, residual.numel(), PHASE_1), kept)


class Keys(Ledger):
    """How an Exchange's calls are issued on its :class:`Ledger`: each key's warm-up, a list
    call's flat buffer, the exact paths, the node hierarchy, the engine's collectives, and
    compressed all-reduces of several keys fused into one exchange."""

    def flat(self, key: Hashable, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The flat buffer of a list call of ``key``: its last one's, if of the same size,
        dtype and device."""
        flat = self.flats.get(key)
        if flat is None or (flat.numel(), flat.dtype, flat.device) != (
            numel, like.dtype, like.device
        ):  # fmt: skip
            flat = self.flats[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return flat

    def begin(self, call: str, key: Hashable, device: torch.device) -> tuple[int, bool]:
        """The position of ``(call, key)`` (new ones in order of first use) and whether this
        call goes through the codec (the key's ``start_iter`` exact calls done); the step
        before it committed. The first call since built or loaded, of any kind, has the
        ranks compare their steps first (:meth:`check_resumed`)."""
        self.check_resumed(device)
        pair = (call, key)
        index = self.keys.setdefault(pair, len(self.keys))
        done = self.calls.get(pair, 0)
        self.calls[pair] = done + 1
        if self.open:  # the last call's decodes are done: its residuals are committed
            self.commit()
            self.open = False
        return index, self.codec is not None and done >= self.start_iter

    def issued(
        self, fut: torch.futures.Future, result: Any, sent: int = 0, fp32: int = 0, end=True
    ) -> Issued:
        """``end``: close the call's step. An exact call's result is read for
        ``stats["nonfinite_buckets"]``."""
        if end:
            self.end()
        if self.codec is None:
            fut = fut.then(self._note_finite)
        return Issued(fut, result, sent, fp32)

    def _note_finite(self, fut: torch.futures.Future) -> Any:
        result = fut.value()
        parts = result if isinstance(result, (list, tuple)) else [result]
        flags = [(~torch.isfinite(t)).any() for t in parts if t.numel()]
        if flags:
            self.nonfinite.append(torch.stack(flags).any())
        return result

    def nothing(self, index: int, x: torch.Tensor, result: Any) -> Issued:
        """A call of 0 elements, on every rank (the order check compares them): counted,
        nothing sent."""
        self.count(x.numel(), 0, collectives=0, bytes_fp32=0)
        return self.issued(completed(result), result)

    # --- the calls ----------------------------------------------------------------------

    def direct(self, pair: tuple, flat: Optional[torch.Tensor]) -> bool:
        """Whether an all-reduce of ``pair`` runs on the engine directly: compressed (its
        key's warm-up done), on several ranks, flat (not the node hierarchy), not empty."""
        return (
            self.codec is not None
            and self.world_size > 1
            and self.plan is None
            and flat is not None
            and flat.numel() > 0
            and self.calls.get(pair, 0) >= self.start_iter
        )

    def all_reduce(self, tensor: Any, key: Hashable, op: str, flat: torch.Tensor) -> Issued:
        if self.direct(("all_reduce", key), flat):
            return self.run_fused([(tensor, key, op, flat)])[0]
        many = isinstance(tensor, (list, tuple))
        index, compress = self.begin("all_reduce", key, flat.device)
        if many:  # once the key's last call is done with its flat buffer
            torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
        if flat.numel() == 0:
            return self.nothing(index, flat, tensor)
        back = returning(tensor, flat if many else None)
        world, plan = self.world_size, self.plan
        if op == "sum" and not compress and world > 1 and plan is None:
            # the exact sum: torch's own all-reduce, bit for bit (no 1/N and back)
            nbytes = ring_bytes(flat.numel() * flat.element_size(), world)
            self.count(flat.numel(), nbytes)
            fut = dist.all_reduce(flat, group=self.group, async_op=True).get_future()
            return self.issued(fut.then(back), tensor, nbytes, ring_bytes(flat.numel() * 4, world))
        before = _sent(self.counters)
        try:
            fut = self.reduced(index, flat, compress)
        finally:
            self.end()
        nbytes = tuple(b - a for a, b in zip(before, _sent(self.counters)))
        if op == "sum" and world > 1:
            fut = fut.then(lambda f: f.value().mul_(world))
        return self.issued(fut.then(back), tensor, *nbytes, end=False)

    def reduced(self, index: int, x: torch.Tensor, compress: bool) -> torch.futures.Future:
        """The mean of ``x`` over the ranks in place, where it is not the flat compressed
        exchange: on one rank as it is; exact (the codec's warm-up, or ``"allreduce"``), as
        DDP's all-reduce sums; on the node hierarchy, exact inside the node and exact or
        through the codec across."""
        world, plan = self.world_size, self.plan
        if world == 1:
            self.count(x.numel(), 0, collectives=0)
            return completed(x)
        if plan is None:  # exact: the codec's warm-up on its first phase group
            group = self.group if self.engine is None else self.engine.phases.groups[0]
            return self.exact_mean(x, group)
        n, L, m = x.numel(), plan.local_size, plan.nodes
        node = {"buffers": self.node_buffers, "count": self.counting(n)}
        if self.engine is None:
            cross = hier.exact_cross(plan, n)
            return hier.node_reduce(plan, x, index, cross, **node, prescale=1.0 / world)
        if not compress:
            cross = hier.exact_cross(plan, n, 1.0 / m)
            return hier.node_reduce(plan, x, index, cross, **node, postscale=1.0 / L)
        step, engine = self.iter, self.engine

        def issue(shard: torch.Tensor) -> torch.futures.Future:
            key = (index, shard.numel(), str(shard.dtype))
            return engine.all_reduce(shard, key, step, lambda *_: None)  # counted below

        cross = hier.codec_cross(engine, plan, n, issue)
        return hier.node_reduce(plan, x, index, cross, **node, engine=engine, postscale=1.0 / L,
                                finite_step=step)  # fmt: skip

    def reduce_scatter(
        self, output: torch.Tensor, key: Hashable, x: torch.Tensor, out: torch.Tensor, factor
    ) -> Issued:
        index, compress = self.begin("reduce_scatter", key, x.device)
        n, s = self.world_size, out.numel()
        if s == 0:
            return self.nothing(index, x, output)
        fp32 = (n - 1) * s * 4
        if n == 1:
            self.count(x.numel(), 0, collectives=0, bytes_fp32=0)
            out.copy_(rank_order_sum(x.view(1, s), factor))
            return self.issued(completed(output), output)
        if not compress:
            nbytes = (n - 1) * s * x.element_size()
            self.count(x.numel(), nbytes, bytes_fp32=fp32)
            recv = torch.empty_like(x)
            work = dist.all_to_all_single(recv, x, group=self.group, async_op=True)

            def total(f: torch.futures.Future) -> torch.Tensor:
                f.value()
                out.copy_(rank_order_sum(recv.view(n, s), factor))
                return output

            return self.issued(work.get_future().then(total), output, nbytes, fp32)
        fut, nbytes = self.engine.reduce_scatter(out, x, index, factor, self.iter, self.group, n)
        self.count(x.numel(), nbytes, bytes_fp32=fp32)
        return self.issued(fut.then(returning(output)), output, nbytes, fp32)

    def all_gather(
        self, output: torch.Tensor, key: Hashable, x: torch.Tensor, out: torch.Tensor
    ) -> Issued:
        index, compress = self.begin("all_gather", key, x.device)
        n, m = self.world_size, x.numel()
        if m == 0:
            return self.nothing(index, x, output)
        fp32 = (n - 1) * m * 4
        if n == 1:
            self.count(x.numel(), 0, collectives=0, bytes_fp32=0)
            out.copy_(x)
            return self.issued(completed(output), output)
        if not compress:
            gathered = torch.empty(n * m, dtype=x.dtype, device=x.device)
            nbytes = (n - 1) * m * x.element_size()
            self.count(x.numel(), nbytes, bytes_fp32=fp32)
            work = self.gather_rows(gathered.view(n, m), x.view(1, m))

            def place(f: torch.futures.Future) -> torch.Tensor:
                f.value()
                out.copy_(gathered)
                return output

            return self.issued(work.then(place), output, nbytes, fp32)
        fut, nbytes = self.engine.all_gather(out, x, self.iter, self.gather_rows, n)
        self.count(x.numel(), nbytes, bytes_fp32=fp32)
        return self.issued(fut.then(returning(output)), output, nbytes, fp32)

    def gather_rows(self, rows: torch.Tensor, row: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``row`` into ``rows`` (rank order)."""
        if dist.get_backend(self.group) == "nccl":
            work = dist.all_gather_into_tensor(rows, row, group=self.group, async_op=True)
        else:  # gloo: all_to_all of the row sent to every rank
            send = row.expand(rows.shape[0], -1).contiguous()
            work = dist.all_to_all_single(rows, send, group=self.group, async_op=True)
        return work.get_future()

    # --- several keys in one exchange ---------------------------------------------------

    def runs(self, calls: list) -> list[list]:
        """``calls`` (compared, in order) cut into runs to issue: consecutive compressed
        all-reduces of a two-phase codec on different keys go as one exchange, every other
        call alone. The ranks compared the calls as one batch, so they cut them alike."""
        fusable = self.codec is not None and self.codec.two_phase and not self.serial
        runs: list[list] = []
        run: list = []  # the fusable run being built
        for c in calls:
            ok = fusable and c.err is None and c.fuse is not None and self.direct(c.pair, c.fuse[3])
            if ok and run and all(x.pair != c.pair for x in run):
                run.append(c)
                continue
            if run:
                runs.append(run)
            run = [c] if ok else []
            if not ok:
                runs.append([c])
        if run:
            runs.append(run)
        return runs

    def run_fused(self, fuses: Sequence[tuple]) -> list[Issued]:
        """Compressed all-reduces of different keys (each ``(tensor, key, op, flat)``) on the
        engine, several of a two-phase codec as one exchange: each call's step, residual and
        decode its own, the bits of its exchange alone."""
        world, counters = self.world_size, self.counters
        items, meta = [], []
        for tensor, key, op, flat in fuses:
            index, _ = self.begin("all_reduce", key, flat.device)
            many = isinstance(tensor, (list, tuple))
            if many:
                torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
            sent: dict[str, Any] = {}

            def count(nbytes: int, collectives: int, numel=flat.numel(), sent=sent) -> None:
                before = _sent(counters)
                self.count(numel, nbytes, collectives=collectives)
                sent["bytes"] = tuple(b - a for a, b in zip(before, _sent(counters)))

            items.append((flat, (index, flat.numel(), str(flat.dtype)), self.iter, count))
            meta.append((tensor, op, flat if many else None, sent))
            self.end()
        engine = self.engine
        if len(items) > 1:
            futures = engine.all_reduce_many(items)
        else:
            futures = [engine.all_reduce(*items[0])]
        out = []
        for (tensor, op, flat, sent), fut in zip(meta, futures):
            if op == "sum":
                fut = fut.then(lambda f: f.value().mul_(world))
            out.append(Issued(fut.then(returning(tensor, flat)), tensor, *sent["bytes"]))
        return out
