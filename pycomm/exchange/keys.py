"""What an :class:`~pycomm.exchange.Exchange` keeps per key, and how each call is issued on
the engine: the calls of each key (its warm-up), a list call's flat buffer, the exact paths,
and compressed all-reduces of several keys fused into one exchange
(:meth:`pycomm.hooks.engine.Engine.all_reduce_many`). Runs on the issuing thread
(:mod:`pycomm.exchange.issue`), in call order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm.exchange.issue import Issued
from pycomm.hooks.engine import PHASE_1
from pycomm.hooks.state import HookState, completed, ring_bytes

__all__ = ["CallBucket", "Keys", "rank_order_sum", "returning"]


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


class CallBucket:
    """A call's tensor as the engine's bucket (:class:`pycomm.hooks.Bucket`): its key's
    position, the flat tensor, and one call a step."""

    def __init__(self, index: int, flat: torch.Tensor) -> None:
        self._index, self._flat = index, flat

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._flat

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return []


def _sent(state: HookState) -> tuple[int, int]:
    """The state's ``bytes_sent`` and ``bytes_fp32`` so far (no fold, no device wait)."""
    counters = state.counters
    return counters["bytes_sent"], counters["bytes_fp32"]


class Keys:
    """The keys of an Exchange and their calls, on the codec's state (its engine, residuals,
    counters), issued on ``group``. ``hook``: the codec's hook function, which runs the exact
    warm-up and the node hierarchy; ``start_iter``: each key's exact calls."""

    def __init__(self, state: HookState, group: Any, hook: Callable, start_iter: int) -> None:
        self.state, self.group, self.hook, self.start_iter = state, group, hook, start_iter
        self.codec = getattr(state, "codec", None)
        self.serial = bool(getattr(state, "strict_skip", False))
        self.keys: dict[Hashable, int] = {}  # (call, key) -> its position, in order of use
        self.calls: dict[Hashable, int] = {}  # (call, key) -> calls issued (the warm-up)
        self.flats: dict[Hashable, torch.Tensor] = {}  # a list call's flat buffer, per key
        self.nonfinite: list[torch.Tensor] = []  # the exact calls' flags, not yet read
        self.bad_calls = 0

    def flat(self, key: Hashable, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The flat buffer of a list call of ``key``: its last one's, if of the same size,
        dtype and device."""
        flat = self.flats.get(key)
        if flat is None or (flat.numel(), flat.dtype, flat.device) != (
            numel, like.dtype, like.device
        ):  # fmt: skip
            flat = self.flats[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return flat

    def begin(self, call: str, key: Hashable) -> tuple[int, bool]:
        """The position of ``(call, key)`` (new ones in order of first use) and whether this
        call goes through the codec (the key's ``start_iter`` exact calls done); the step
        before it committed."""
        pair = (call, key)
        index = self.keys.setdefault(pair, len(self.keys))
        done = self.calls.get(pair, 0)
        self.calls[pair] = done + 1
        new_step = getattr(self.state, "new_step", None)
        if new_step is not None:
            new_step()
        return index, self.codec is not None and done >= self.start_iter

    def issued(
        self, fut: torch.futures.Future, result: Any, sent: int = 0, fp32: int = 0, end=True
    ) -> Issued:
        """``end``: close the call's step (the hook function closes its own). An exact call's
        result is read for ``stats["nonfinite_buckets"]``."""
        end_step = getattr(self.state, "end_step", None)
        if end and end_step is not None:
            end_step()
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
        self.state.count(CallBucket(index, x), 0, collectives=0, bytes_fp32=0)
        return self.issued(completed(result), result)

    # --- the calls ----------------------------------------------------------------------

    def direct(self, pair: tuple, flat: Optional[torch.Tensor]) -> bool:
        """Whether an all-reduce of ``pair`` runs on the engine directly: compressed (its
        key's warm-up done), on several ranks, flat (not the node hierarchy), not empty."""
        state = self.state
        return (
            self.codec is not None
            and state.world_size > 1
            and getattr(state, "node_plan", None) is None
            and flat is not None
            and flat.numel() > 0
            and self.calls.get(pair, 0) >= self.start_iter
        )

    def all_reduce(self, tensor: Any, key: Hashable, op: str, flat: torch.Tensor) -> Issued:
        if self.direct(("all_reduce", key), flat):
            return self.run_fused([(tensor, key, op, flat)])[0]
        many = isinstance(tensor, (list, tuple))
        index, compress = self.begin("all_reduce", key)
        if many:  # once the key's last call is done with its flat buffer
            torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
        state, world = self.state, self.state.world_size
        if flat.numel() == 0:
            return self.nothing(index, flat, tensor)
        back = returning(tensor, flat if many else None)
        if op == "sum" and not compress and world > 1 and getattr(state, "node_plan", None) is None:
            # the exact sum: torch's own all-reduce, bit for bit (no 1/N and back)
            nbytes = ring_bytes(flat.numel() * flat.element_size(), world)
            state.count(CallBucket(index, flat), nbytes)
            fut = dist.all_reduce(flat, group=self.group, async_op=True).get_future()
            return self.issued(fut.then(back), tensor, nbytes, ring_bytes(flat.numel() * 4, world))
        before = _sent(state)
        has_start = hasattr(state, "start_iter")
        if has_start:  # the hook's own warm-up test (iter < start_iter), made this key's
            state.start_iter = 0 if compress else state.iter + 1
        try:
            fut = self.hook(state, CallBucket(index, flat))
        finally:
            if has_start:
                state.start_iter = self.start_iter
        nbytes = tuple(b - a for a, b in zip(before, _sent(state)))
        if op == "sum" and world > 1:
            fut = fut.then(lambda f: f.value().mul_(world))

        def into(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()
            if out.data_ptr() != flat.data_ptr():
                flat.copy_(out)
            return out

        return self.issued(fut.then(into).then(back), tensor, *nbytes, end=False)

    def reduce_scatter(
        self, output: torch.Tensor, key: Hashable, x: torch.Tensor, out: torch.Tensor, factor
    ) -> Issued:
        index, compress = self.begin("reduce_scatter", key)
        n, state, s = self.state.world_size, self.state, out.numel()
        if s == 0:
            return self.nothing(index, x, output)
        bucket, fp32 = CallBucket(index, x), (n - 1) * s * 4
        if n == 1:
            state.count(bucket, 0, collectives=0, bytes_fp32=0)
            out.copy_(rank_order_sum(x.view(1, s), factor))
            return self.issued(completed(output), output)
        if not compress:
            nbytes = (n - 1) * s * x.element_size()
            state.count(bucket, nbytes, bytes_fp32=fp32)
            recv = torch.empty_like(x)
            work = dist.all_to_all_single(recv, x, group=self.group, async_op=True)

            def total(f: torch.futures.Future) -> torch.Tensor:
                f.value()
                out.copy_(rank_order_sum(recv.view(n, s), factor))
                return output

            return self.issued(work.get_future().then(total), output, nbytes, fp32)
        fut, nbytes = state.engine.reduce_scatter(out, x, index, factor, state.iter, self.group, n)
        state.count(bucket, nbytes, bytes_fp32=fp32)
        return self.issued(fut.then(returning(output)), output, nbytes, fp32)

    def all_gather(
        self, output: torch.Tensor, key: Hashable, x: torch.Tensor, out: torch.Tensor
    ) -> Issued:
        index, compress = self.begin("all_gather", key)
        n, m, state = self.state.world_size, x.numel(), self.state
        if m == 0:
            return self.nothing(index, x, output)
        bucket, fp32 = CallBucket(index, x), (n - 1) * m * 4
        if n == 1:
            state.count(bucket, 0, collectives=0, bytes_fp32=0)
            out.copy_(x)
            return self.issued(completed(output), output)
        if not compress:
            gathered = torch.empty(n * m, dtype=x.dtype, device=x.device)
            nbytes = (n - 1) * m * x.element_size()
            state.count(bucket, nbytes, bytes_fp32=fp32)
            work = self.gather_rows(gathered.view(n, m), x.view(1, m))

            def place(f: torch.futures.Future) -> torch.Tensor:
                f.value()
                out.copy_(gathered)
                return output

            return self.issued(work.then(place), output, nbytes, fp32)
        fut, nbytes = state.engine.all_gather(out, x, state.iter, self.gather_rows, n)
        state.count(bucket, nbytes, bytes_fp32=fp32)
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
        state, world = self.state, self.state.world_size
        items, meta = [], []
        for tensor, key, op, flat in fuses:
            state.check_resumed(flat.device)
            index, _ = self.begin("all_reduce", key)
            many = isinstance(tensor, (list, tuple))
            if many:
                torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
            bucket, sent = CallBucket(index, flat), {}

            def count(nbytes: int, collectives: int, bucket=bucket, sent=sent) -> None:
                before = _sent(state)
                state.count_exchange(bucket, nbytes, collectives)
                sent["bytes"] = tuple(b - a for a, b in zip(before, _sent(state)))

            items.append((flat, (index, flat.numel(), str(flat.dtype)), state.iter, count))
            meta.append((tensor, op, flat if many else None, sent))
            state.end_step()
        engine = state.engine
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

    # --- counters and state -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        stats = {k: v for k, v in self.state.stats.items() if k != "rebucketed_steps"}
        if self.codec is None:  # the exact exchange decodes nothing: its results are read
            bad, self.nonfinite = self.nonfinite, []
            self.bad_calls += sum(int(b) for b in bad)
            stats["nonfinite_buckets"] = self.bad_calls
        return stats

    def residual_bytes(self, key: Hashable) -> int:
        store = getattr(self.state, "store", None)
        if store is None or not getattr(self.state, "error_feedback", False):
            return 0
        indices = [i for (_, k), i in self.keys.items() if k == key]
        return sum(store.nbytes(i, pending=True) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {
            "exchange": self.state.state_dict(),
            "keys": list(self.keys),
            "calls": [self.calls.get(k, 0) for k in self.keys],
        }

    def load(self, state: dict[str, Any], keys: list, calls: list[int]) -> None:
        self.state.load_state_dict(state["exchange"])
        store = getattr(self.state, "store", None)
        if store is not None:  # a key's first compressed call may come after the load
            store.place_loaded()
        self.keys = {k: i for i, k in enumerate(keys)}
        self.calls = dict(zip(self.keys, calls))

    def load_key(self, pair: tuple, calls: int, residual: Optional[torch.Tensor]) -> None:
        index = self.keys[pair] = len(self.keys)
        self.calls[pair] = calls
        if residual is not None:
            kept = {"r1": residual.detach().clone()}
            self.state.store.put((index, residual.numel(), PHASE_1), kept)
