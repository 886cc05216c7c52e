"""``pycomm.Exchange``: a compressed collective on any tensor, outside DDP's hook.

Model averaging every k steps, an outer optimizer's sync (local SGD, DiLoCo), a user's own
optimizer: each averages a tensor across ranks and may send it compressed. An ``Exchange``
runs pycomm's engine on a tensor of the caller's: the codec of a registered hook (``"int8"``,
``"fp8"``, ``"int4"``, ``"onebit"``, ``"bf16"``, ``"fp16"``, a user's codec), or the exact
``"allreduce"``; error feedback kept per ``key``; the two-phase exchange, the node hierarchy
(``hierarchy="node"``, all_reduce), the non-finite rule (a call whose decode holds a NaN or Inf
drops the residuals it wrote) and the byte counts are the engine's, as under DDP.

Example:
    >>> ex = pycomm.Exchange("int8")                    # collective: every rank, same options
    >>> ex.all_reduce(model_delta, key="delta").wait()  # model_delta: the mean over ranks
    >>> ex.reduce_scatter(shard, full, key="grads").wait()
    >>> ex.all_gather(full, shard, key="weights").wait()
    >>> ex.stats["bytes_sent"], ex.state_dict()

Rules a caller keeps, as for any collective of ``torch.distributed``:

- Constructing an ``Exchange`` is collective (as ``dist.new_group`` is): every rank of the
  group builds it, with the same codec and options. The ranks compare what each resolved
  (the codec's class and format, every option with its default) before any exchange; a
  difference is a ValueError on every rank naming it.
- Every rank issues the same calls in the same order (the same ``key``, shapes and dtypes).
- Calls on one ``Exchange`` run one after another: a call waits for the previous call's
  exchange to finish before it starts, so that the previous call's residual is kept or dropped
  first. Use one ``Exchange`` per stream of calls that should overlap.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Optional

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.hooks.config import agree, error_field, resolved_config
from pycomm.hooks.registry import hook_names, hook_spec, registration
from pycomm.hooks.state import HookState, completed, dtype_names, unbound

__all__ = ["Exchange", "Work", "rank_order_sum"]

_OPS = ("mean", "sum")


class Work:
    """An issued call of an :class:`Exchange`: ``wait()`` blocks until the result is in the
    caller's tensor and returns it; ``get_future()`` is the ``torch.futures.Future`` of it.

    Example:
        >>> work = ex.all_reduce(t, key="t")
        >>> work.wait() is t
        True
    """

    def __init__(self, future: torch.futures.Future, result: torch.Tensor) -> None:
        self._future, self._result = future, result

    def wait(self) -> torch.Tensor:
        self._future.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


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


class _CallBucket:
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


class Exchange:
    """A compressed collective over ``process_group`` (default: the default group).

    Args:
        codec: a registered hook with a codec (``pycomm.hooks.hook_names()``, e.g. ``"int8"``
            or a user's), or ``"allreduce"`` for the exact fp32 exchange.
        process_group: the ranks that exchange; every one of them builds the ``Exchange``.
        start_iter: how many calls of the ``Exchange`` run exact before the codec starts
            (default 0: compressed from the first call; DDP's default of 2 is for its bucket
            rebuild).
        **options: the hook's options (``block``, ``error_feedback``, ``residual_dtype``,
            ``local_feedback``, ``hierarchy``, a user's codec's own), as in
            ``pycomm.wrap(hook_options=...)``.

    Raises:
        ValueError or TypeError, on every rank: an unknown codec or option, a bad value on
        any rank, or ranks that resolved different configurations.

    Example:
        >>> ex = pycomm.Exchange("int8", block=128, residual_dtype="bfloat16")
        >>> ex.all_reduce(params_delta, key="outer").wait()
    """

    where = "pycomm.Exchange"

    def __init__(
        self,
        codec: str = "int8",
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        start_iter: int = 0,
        **options: Any,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{self.where}: no process group; call pycomm.init() (or "
                "torch.distributed.init_process_group) on every rank first"
            )
        fields: dict[str, Any] = {"hook": codec}
        if isinstance(codec, str):
            fields[f"registration of hook {codec!r}"] = registration(codec)
        fields.update(error_field(None))
        state = None
        try:
            state = self._build(codec, process_group, start_iter, options)
            fields.update(resolved_config(state, hook_spec(codec).hook))
        except (ValueError, TypeError) as e:
            fields.update(error_field(e))
            state = None
        fields["start_iter"] = start_iter
        agree(self.where, fields, process_group)
        assert state is not None  # agree raised on every rank otherwise
        state.bind()
        self.codec_name = codec
        self.process_group = process_group
        self.start_iter = start_iter
        self._state: HookState = state
        self._fn = hook_spec(codec).hook
        self._codec = getattr(state, "codec", None)
        self._keys: dict[Hashable, int] = {}
        self._last: Optional[torch.futures.Future] = None

    def _build(self, codec: Any, group: Any, start_iter: Any, options: dict) -> HookState:
        if not isinstance(codec, str):
            raise TypeError(
                f"{self.where}: codec={codec!r}, expected the name of a registered hook "
                f"with a codec, or 'allreduce' ({', '.join(self.codecs())})"
            )
        if codec not in hook_names():
            raise ValueError(
                f"{self.where}: codec={codec!r} is not registered; expected one of "
                f"{', '.join(self.codecs())}"
            )
        if codec not in self.codecs():
            raise ValueError(
                f"{self.where}: codec={codec!r} is a hook without a codec (DDP's alone); "
                f"expected one of {', '.join(self.codecs())}"
            )
        check_int(self.where, "start_iter", start_iter, 0)
        if "start_iter" in options:
            raise TypeError(f"{self.where}: start_iter is given twice")
        with unbound():
            state = hook_spec(codec).state(group, **options)
        if hasattr(state, "start_iter"):
            state.start_iter = start_iter  # DDP's warm-up (its bucket rebuild) is not ours
        return state

    @staticmethod
    def codecs() -> list[str]:
        """What ``codec=`` takes: ``"allreduce"`` and every registered hook with a codec.

        Example:
            >>> pycomm.Exchange.codecs()[:3]
            ['allreduce', 'bf16', 'fp16']
        """
        return [n for n in hook_names() if n == "allreduce" or hook_spec(n).codec is not None]

    # --- the calls ----------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, key: Hashable, op: str = "mean") -> Work:
        """Replace ``tensor`` (contiguous, float32, bfloat16 or float16) by its mean over the
        ranks (``op="sum"``: the sum, the mean times N), sent through the codec, with the
        error-feedback residual of ``key``. Every rank holds the same bits after it.

        Example:
            >>> ex.all_reduce(delta, key="delta").wait()
        """
        flat = self._check("all_reduce", "tensor", tensor, op)
        index = self._start("all_reduce", key)
        world = self._state.world_size
        fut = self._fn(self._state, _CallBucket(index, flat))
        if op == "sum" and world > 1:
            fut = fut.then(lambda f: f.value().mul_(world))

        def into(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()
            if out.data_ptr() != flat.data_ptr():
                flat.copy_(out)
            return tensor

        return self._issued(fut.then(into), tensor, end=False)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, key: Hashable, op: str = "mean"
    ) -> Work:
        """``dist.reduce_scatter_tensor``'s shapes: ``input`` holds N chunks of
        ``output.numel()`` elements, and ``output`` becomes this rank's chunk of their mean
        (``op="sum"``: sum) over the ranks: each rank encodes its input (with ``key``'s
        residual), sends chunk j to rank j, and decodes and sums the N it receives.

        Example:
            >>> ex.reduce_scatter(shard, grads, key="grads").wait()
        """
        x, out = self._check_pair("reduce_scatter", output, input, op)
        n, s = self._state.world_size, out.numel()
        index = self._start("reduce_scatter", key)
        state, scale = self._state, (1.0 / n if op == "mean" else 1.0)
        bucket, fp32 = _CallBucket(index, x), (n - 1) * s * 4
        if n == 1:
            state.count(bucket, 0, collectives=0, bytes_fp32=0)
            out.copy_(x)
            return self._issued(completed(output), output)
        if not self._compressing():
            state.count(bucket, (n - 1) * s * x.element_size(), bytes_fp32=fp32)
            return self._issued(self._exact_reduce_scatter(x, out, n, s, scale), output)
        codec = self._codec
        c = -(-s // codec.block) * codec.block  # each chunk padded to whole blocks
        if c != s:
            padded = torch.zeros(n * c, dtype=x.dtype, device=x.device)
            padded.view(n, c)[:, :s].copy_(x.view(n, s))
            x = padded
        step, state.device = state.iter, x.device
        # the engine's residual of a bucket of n * c elements: its r1 is phase 1's, all of it
        r1, _, r1_out, _ = state.residual((index, n * c, str(x.dtype)), n * c)
        codes, scales = codec.encode(x, r1, scale, n * c, r1_out)
        send = codec.pack(codes, scales, n)
        recv = torch.empty_like(send)
        nbytes = (n - 1) * send.shape[1]
        state.count_codec(n * s, nbytes, fp32)
        state.count(bucket, nbytes, bytes_fp32=fp32)
        work = dist.all_to_all_single(recv, send, group=self.process_group, async_op=True)

        def decode(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            rcodes, rscales = codec.split(recv, c)
            state.note_decode(codec.decode_sum(rcodes, rscales, 1.0, out), step)
            return output  # out is its flat view

        return self._issued(work.get_future().then(decode), output)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, key: Hashable) -> Work:
        """``dist.all_gather_into_tensor``'s shapes: ``output`` holds N chunks of
        ``input.numel()`` elements and becomes every rank's input, rank j's at chunk j, each
        sent encoded and decoded (this rank's own chunk too, so that every rank holds the same
        bits). No residual: an all-gather carries no state between calls; ``key`` names the
        call for the order of calls.

        Example:
            >>> ex.all_gather(full_weights, my_shard, key="weights").wait()
        """
        x, out = self._check_pair("all_gather", output, input, "mean")
        n, m = self._state.world_size, x.numel()
        index = self._start("all_gather", key)
        state = self._state
        bucket, fp32 = _CallBucket(index, x), (n - 1) * m * 4
        if n == 1:
            state.count(bucket, 0, collectives=0, bytes_fp32=0)
            out.copy_(x)
            return self._issued(completed(output), output)
        codec = self._codec
        if not self._compressing():
            gathered = torch.empty(n * m, dtype=x.dtype, device=x.device)
            state.count(bucket, (n - 1) * m * x.element_size(), bytes_fp32=fp32)
            work = self._gather_rows(gathered.view(n, m), x.view(1, m))

            def place(f: torch.futures.Future) -> torch.Tensor:
                f.value()
                output.copy_(gathered.view_as(output))
                return output

            return self._issued(work.then(place), output)
        c = -(-m // codec.block) * codec.block
        codes, scales = codec.encode(x, None, 1.0, c)
        row = codec.pack(codes, scales, 1)
        rows = torch.empty(n, row.shape[1], dtype=torch.uint8, device=x.device)
        nbytes = (n - 1) * row.shape[1]
        state.count_codec(m, nbytes, fp32)
        state.count(bucket, nbytes, bytes_fp32=fp32)
        state.device = x.device
        work = self._gather_rows(rows, row)
        step = state.iter

        def decode(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            rcodes, rscales = codec.split(rows, c)
            flat = out.view(n, m)
            st = None
            for j in range(n):
                part = codec.decode_sum(
                    rcodes[j : j + 1], None if rscales is None else rscales[j : j + 1], 1.0,
                    flat[j],
                )  # fmt: skip
                st = part if st is None else st + part
            state.note_decode(st, step)
            return output  # out is its flat view

        return self._issued(work.then(decode), output)

    # --- state --------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """The engine's counters: ``steps`` (calls), ``bytes_sent``, ``bytes_fp32`` (what
        the exact fp32 collective of the same tensors sends), ``compression``, and for a codec
        ``codec_compression``, ``residual_bytes``, ``nonfinite_buckets`` (calls whose decode
        held a NaN or Inf)."""
        self._settle()
        return self._state.stats

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (per key), counters and configuration; load it with
        :meth:`load_state_dict` into an ``Exchange`` of the same codec and options, on the
        same rank, with the same keys. Waits for the last call.

        Example:
            >>> torch.save(ex.state_dict(), f"exchange-rank{rank}.pt")
        """
        self._settle()
        return {"exchange": self._state.state_dict(), "keys": list(self._keys)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the residuals, counters and keys; another
        codec, option, rank or world size is refused naming it."""
        if not isinstance(state, dict) or "exchange" not in state:
            raise ValueError(
                f"{self.where}: load_state_dict got {type(state).__name__}, expected what "
                "Exchange.state_dict() returns"
            )
        self._settle()
        self._state.load_state_dict(state["exchange"])
        self._keys = {k: i for i, k in enumerate(state["keys"])}

    # --- the call's path ----------------------------------------------------------------

    def _check(self, call: str, name: str, t: Any, op: str) -> torch.Tensor:
        where = f"{self.where}.{call}"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}, expected a tensor")
        dtypes = getattr(self._state, "grad_dtypes", None) or (
            torch.float32, torch.bfloat16, torch.float16,
        )  # fmt: skip
        if t.dtype not in dtypes or t.layout != torch.strided:
            raise TypeError(
                f"{where}: {name} has dtype {t.dtype} and layout {t.layout}, expected a dense "
                f"{dtype_names(dtypes)} tensor"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"{where}: {name} of shape {list(t.shape)} is not contiguous; expected a "
                "contiguous tensor (the result is written into it)"
            )
        if op not in _OPS:
            raise ValueError(f"{where}: op={op!r}, expected 'mean' or 'sum'")
        return t.view(-1)

    def _check_pair(
        self, call: str, output: Any, input: Any, op: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat input and output of a reduce-scatter or all-gather: the one of N chunks
        (reduce_scatter's input, all_gather's output) holds N times the other's elements."""
        where = f"{self.where}.{call}"
        x = self._check(call, "input", input, op)
        out = self._check(call, "output", output, "mean")
        if out.dtype != x.dtype or out.device != x.device:
            raise TypeError(
                f"{where}: output is {out.dtype} on {out.device} and input {x.dtype} on "
                f"{x.device}, expected the same dtype and device"
            )
        n = self._state.world_size
        (whole, wname), (part, pname) = (
            ((x, "input"), (out, "output")) if call == "reduce_scatter" else
            ((out, "output"), (x, "input"))
        )  # fmt: skip
        if whole.numel() != n * part.numel():
            raise ValueError(
                f"{where}: {wname} has {whole.numel()} elements, expected {n} x {pname}'s "
                f"{part.numel()} = {n * part.numel()}"
            )
        if getattr(self._state, "node_plan", None) is not None:
            raise ValueError(
                f"{where}: hierarchy='node' runs all_reduce alone; expected hierarchy='flat' "
                "for reduce_scatter and all_gather"
            )
        return x, out

    def _start(self, call: str, key: Hashable) -> int:
        """The position of ``(call, key)`` (new ones in order of first use), once the last
        call's exchange is done and its step committed (its residuals kept, or dropped after
        a non-finite decode)."""
        try:
            index = self._keys.setdefault((call, key), len(self._keys))
        except TypeError:
            raise TypeError(
                f"{self.where}.{call}: key={key!r} is not hashable; expected a str, int or tuple"
            ) from None
        self._settle()
        new_step = getattr(self._state, "new_step", None)
        if new_step is not None:
            new_step()
        return index

    def _compressing(self) -> bool:
        """Whether this call goes through the codec (after ``start_iter`` exact calls)."""
        return self._codec is not None and self._state.iter >= self.start_iter

    def _issued(self, fut: torch.futures.Future, result: torch.Tensor, end: bool = True) -> Work:
        """``end``: close the call's step (all_reduce's hook closes its own: its bucket is the
        step's last)."""
        end_step = getattr(self._state, "end_step", None)
        if end and end_step is not None:
            end_step()
        self._last = fut
        return Work(fut, result)

    def _settle(self) -> None:
        if self._last is not None:
            self._last.wait()
            self._last = None

    def _gather_rows(self, rows: torch.Tensor, row: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``row`` into ``rows`` (rank order)."""
        backend = dist.get_backend(self.process_group)
        if backend == "nccl":
            work = dist.all_gather_into_tensor(rows, row, group=self.process_group, async_op=True)
        else:  # gloo: all_to_all of the row sent to every rank
            send = row.expand(rows.shape[0], -1).contiguous()
            work = dist.all_to_all_single(rows, send, group=self.process_group, async_op=True)
        return work.get_future()

    def _exact_reduce_scatter(
        self, x: torch.Tensor, out: torch.Tensor, n: int, s: int, scale: float
    ) -> torch.futures.Future:
        recv = torch.empty_like(x)
        work = dist.all_to_all_single(recv, x, group=self.process_group, async_op=True)

        def total(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            out.copy_(rank_order_sum(recv.view(n, s), scale))
            return out

        return work.get_future().then(total)
