"""``pycomm.Exchange``: a compressed collective on any tensor, outside DDP's hook.

Model averaging every k steps, an outer optimizer's sync (local SGD, DiLoCo), a user's own
optimizer: each averages a tensor across ranks and may send it compressed. An ``Exchange``
runs pycomm's engine on a tensor of the caller's: any registered codec, a user's too
(:meth:`Exchange.codecs` lists them), or the exact ``"allreduce"``; error feedback kept per
``key``; the two-phase exchange, the node hierarchy (``hierarchy="node"``, all_reduce), the
non-finite rule, per call (docs/failures.md, "A non-finite gradient skips the step
everywhere") and the byte counts are the engine's, as under DDP.
``pycomm.fsdp.compress`` is an adapter over it: FSDP2's reduce-scatter of each module is a
``reduce_scatter`` of an ``Exchange``, keyed by the module's name. The guide, with code that
runs: docs/exchange.md.

Example:
    >>> ex = pycomm.Exchange("int8")                    # collective: every rank, same options
    >>> ex.all_reduce(model_delta, key="delta").wait()  # model_delta: the mean over ranks
    >>> ex.reduce_scatter(shard, full, key="grads").wait()
    >>> ex.all_gather(full, shard, key="weights").wait()
    >>> ex.stats["bytes_sent"], ex.state_dict()
    >>> work = ex.reduce_scatter(shard, full, key="grads", scale=0.25)  # premultiplied sum
    >>> work.wait(); work.bytes_sent                    # this call's bytes, no device wait

Rules a caller keeps, as for any collective of ``torch.distributed``:

- Constructing an ``Exchange`` is collective (as ``dist.new_group`` is): every rank of the
  group builds it, with the same codec and options. The ranks compare what each resolved
  (the codec's class and format, every option with its default) before any exchange; a
  difference is a ValueError on every rank naming it.
- Every rank issues the same calls in the same order (the same ``key``, shapes and dtypes).
  The ranks check it (``check_order``): by default every call is compared, the calls queued
  together by one small all-reduce of their digests, before their collectives; a difference
  is a ValueError on every rank naming each rank's call (raised by a key's first call, by
  the ``wait()`` of a later one).
- A call returns at once: the Exchange's own thread issues its collectives in call order, on
  process groups of its own, while the caller goes on. Calls on different keys are in flight
  together; a key's next call starts once its last one is done. A list of tensors is one
  exchange.
"""

from __future__ import annotations

import collections
import hashlib
import inspect
import math
import queue
import threading
import time
import weakref
from collections.abc import Hashable, Sequence
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.hooks.config import agree, error_field, resolved_config
from pycomm.hooks.engine import PHASE_1
from pycomm.hooks.groups import new_groups
from pycomm.hooks.registry import hook_names, hook_spec, registration
from pycomm.hooks.state import HookState, completed, dtype_names, ring_bytes, unbound

__all__ = ["Exchange", "Work", "rank_order_sum"]

_OPS = ("mean", "sum")
_CALLS = ("all_reduce", "reduce_scatter", "all_gather")
_CHECKS = ("first", "every", "off")
# what the exact exchange ("allreduce") takes; a codec, its state's grad_dtypes
_EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class Work:
    """An issued call of an :class:`Exchange`: ``wait()`` blocks until the result is in the
    caller's tensor and returns it; ``get_future()`` is the ``torch.futures.Future`` of it.

    Attributes (read-only, known when the call is issued; no wait for the device):
        bytes_sent: the bytes this rank puts on the wire for the call (what ``stats``
            adds to its ``bytes_sent``).
        bytes_fp32: what the exact fp32 collective of the same tensors sends (what ``stats``
            adds to its ``bytes_fp32``).

    Example:
        >>> work = ex.all_reduce(t, key="t")
        >>> work.wait() is t
        True
        >>> work.bytes_sent, work.bytes_fp32  # this call's bytes, and an fp32 collective's
    """

    def __init__(
        self,
        future: Optional[torch.futures.Future] = None,
        result: Any = None,
        bytes_sent: int = 0,
        bytes_fp32: int = 0,
    ) -> None:
        self._observed = False  # wait() raised, or would have, to its caller
        self._ready = threading.Event()  # issued: the future and the bytes are known
        if future is not None:
            self._set(future, result, bytes_sent, bytes_fp32)

    def _set(self, future: torch.futures.Future, result: Any, sent: int, fp32: int) -> None:
        self._future, self._result, self._bytes = future, result, (sent, fp32)
        self._ready.set()

    def _fail(self, exc: BaseException, observed: bool = False) -> None:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(exc)
        self._observed = self._observed or observed
        self._set(future, None, 0, 0)

    @property
    def bytes_sent(self) -> int:
        self._ready.wait()
        return self._bytes[0]

    @property
    def bytes_fp32(self) -> int:
        self._ready.wait()
        return self._bytes[1]

    def wait(self) -> Any:
        self._observed = True
        self._ready.wait()
        self._future.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        self._ready.wait()
        return self._future

    def is_completed(self) -> bool:
        return self._ready.is_set() and self._future.done()


# calls whose digests one check compares at most
_SLOTS = 16


class _Issued(NamedTuple):
    """What a call's body issued: the future of its result, and its bytes."""

    future: torch.futures.Future
    result: Any
    bytes_sent: int
    bytes_fp32: int


class _Call:
    """A call handed to the issuing thread: its ``(call, key)``, what the ranks compare
    (``mark``, its digest; ``fields``, in full), whether it is compared, this rank's refusal
    of its arguments, the body that issues it, and its :class:`Work`."""

    def __init__(
        self,
        pair: tuple,
        mark: str,
        fields: dict,
        checked: bool,
        err: Optional[Exception],
        body: Callable[[], _Issued],
    ) -> None:
        self.pair, self.mark, self.fields, self.body = pair, mark, fields, body
        self.is_checked, self.err, self.work = checked, err, Work()
        self.checked = threading.Event()  # its check is done (passed or failed)
        self.failed: Optional[BaseException] = None
        # an all_reduce's (tensor, key, op, flat, many): what fuses it with the calls beside
        self.fuse: Optional[tuple] = None

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.work._fail(exc, observed=self.err is not None)
        self.checked.set()


def _digest(mark: str) -> int:
    """A call's 56-bit digest: what the ranks compare for it, by one all-reduce."""
    return int.from_bytes(hashlib.blake2b(mark.encode(), digest_size=7).digest(), "little")


class _Issuer:
    """The one thread that issues an :class:`Exchange`'s collectives, in call order: every
    rank issues the same collectives in the same order on the Exchange's groups, however its
    calls' exchanges progress, while the caller goes on. It holds the Exchange weakly (it ends
    with it); calls queued together are checked by one collective."""

    def __init__(self, owner: Exchange) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._owner = weakref.ref(owner)
        self._thread: Optional[threading.Thread] = None
        weakref.finalize(owner, self._queue.put, None)

    def put(self, item: _Call) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve, args=(self._owner, self._queue), name="pycomm-exchange",
                daemon=True,
            )  # fmt: skip
            self._thread.start()
        self._queue.put(item)

    def drain(self) -> None:
        """Wait until every call put before is issued (or failed)."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()


def _serve(owner: Callable[[], Optional[Exchange]], q: queue.SimpleQueue) -> None:
    """The issuing thread's loop: take the queued calls (up to a drain mark), check them
    together, issue those that passed, and put the rest back first in line."""
    pending: collections.deque = collections.deque()
    while True:
        if not pending:
            pending.append(q.get())
            time.sleep(0)  # the caller, issuing calls in a row, queues the rest of them
        while True:
            try:
                pending.append(q.get_nowait())
            except queue.Empty:
                break
        head = pending[0]
        if not isinstance(head, _Call):
            pending.popleft()
            if head is None:
                return
            head.set()  # a drain mark
            continue
        calls: list[_Call] = []
        while pending and isinstance(pending[0], _Call) and len(calls) < _SLOTS:
            calls.append(pending.popleft())
        ex = owner()
        if ex is None:
            return
        try:
            passed, again = ex._checks(calls)
        except Exception as e:  # noqa: BLE001 - the check's collective failed: every call
            for c in calls:
                c.fail(e)
            passed, again = [], []
        pending.extendleft(reversed(again))
        for run in ex._runs(passed):
            try:
                ex._run_fused(run) if len(run) > 1 else ex._run(run[0])
            except BaseException as e:  # noqa: BLE001 - never leave a call unset
                for c in run:
                    if not c.work._ready.is_set():
                        c.work._fail(e)
        del ex


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


def _returning(result: Any, flat: Optional[torch.Tensor] = None):
    """A future's callback that raises what the future raised, else returns ``result`` (a list
    of tensors: ``flat`` copied back into them first)."""

    def done(f: torch.futures.Future) -> Any:
        f.value()
        if flat is not None:
            _unflatten(flat, result)
        return result

    return done


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """``flat`` copied back into ``tensors``, in order."""
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view(t.shape))


def _shape(t: Any) -> str:
    """A call's tensor (or list of tensors) as the order check names it: shape and dtype."""
    if isinstance(t, torch.Tensor):
        return f"shape {list(t.shape)} {str(t.dtype)[6:]}"
    if isinstance(t, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in t) and t:
        shapes = ", ".join(str(list(x.shape)) for x in t)
        return f"{len(t)} tensors of shapes {shapes} {str(t[0].dtype)[6:]}"
    return f"{type(t).__name__}"


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
        codec: a registered hook with a codec (:meth:`codecs` lists them: ``"int8"``, a
            user's...), or ``"allreduce"`` for the exact exchange (fp32 sums; float64
            tensors too, summed in float64).
        process_group: the ranks that exchange; every one of them builds the ``Exchange``.
        start_iter: the warm-up, per key: the first ``start_iter`` calls of each ``key`` (and
            call: an ``all_reduce`` and a ``reduce_scatter`` of one key count apart) run
            exact, its later calls through the codec (default 0: compressed from each key's
            first call; DDP's default of 2 is for its bucket rebuild). The counts are in
            :meth:`state_dict`.
        check_order: how the ranks check that they issue the same calls in the same order
            (the call, the key, the elements, the dtype and the call's place): ``"first"``
            (default: each key's first call since construction or the last
            :meth:`load_state_dict`, one object gather each), ``"every"`` (each call,
            a 56-bit digest in one small all-reduce, with a wait for its result) or
            ``"off"``. A difference is a ValueError on every rank naming each rank's call.
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
        check_order: str = "every",
        **options: Any,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{self.where}: no process group; call pycomm.init() (or "
                "torch.distributed.init_process_group) on every rank first"
            )
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"{self.where}: this rank (global rank {dist.get_rank()}) is not in "
                "process_group (dist.new_group returned GroupMember.NON_GROUP_MEMBER here); "
                "expected the Exchange built by the group's ranks alone, as its collectives run"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"{self.where}: process_group={process_group!r}, expected a "
                "torch.distributed.ProcessGroup or None (the default group)"
            )
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(
                f"{self.where}: this rank (global rank {dist.get_rank()}) is not in "
                f"process_group (ranks {dist.get_process_group_ranks(process_group)}); "
                "expected the Exchange built by the group's ranks alone, as its collectives run"
            )
        fields: dict[str, Any] = {"hook": codec}
        if isinstance(codec, str):
            fields[f"registration of hook {codec!r}"] = registration(codec)
        fields.update(error_field(None))  # where the ranks compare it: before the config
        state = None
        try:
            state = self._build(codec, process_group, start_iter, options)
            fields.update(resolved_config(state, hook_spec(codec).hook))
            if check_order not in _CHECKS:
                raise ValueError(
                    f"{self.where}: check_order={check_order!r}, expected "
                    f"{', '.join(map(repr, _CHECKS))}"
                )
        except Exception as e:  # noqa: BLE001 - a user's codec failing on one rank too
            state = None
            fields.update(error_field(_as_exchange(e, codec, self.where)))
        fields["start_iter"] = start_iter
        fields["check_order"] = check_order
        agree(self.where, fields, process_group)
        assert state is not None  # agree raised on every rank otherwise
        # the Exchange's own group: its thread issues every collective of it there, so none
        # meets the caller's own collectives on the caller's group in another order
        parent = process_group or dist.group.WORLD
        (self._group,) = new_groups(parent, [dist.get_process_group_ranks(parent)], count=1)
        nccl = dist.get_backend(parent) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        state.process_group = self._group
        state.bind()
        self.codec_name = codec
        self.process_group = process_group
        self.start_iter = start_iter
        self.check_order = check_order
        self._state: HookState = state
        self._fn = hook_spec(codec).hook
        self._codec = getattr(state, "codec", None)
        self._keys: dict[Hashable, int] = {}  # (call, key) -> its position, in order of use
        self._calls: dict[Hashable, int] = {}  # (call, key) -> calls issued (the warm-up)
        # (call, key) pairs whose order the ranks compared since construction or the last
        # load (ranks that loaded states of different calls differ at the next call)
        self._compared: set = set()
        # the last issued call of each (call, key) not yet known done: a key's next call waits
        # for it (its residual), calls on other keys do not
        self._inflight: dict[Hashable, Work] = {}
        # strict_skip keeps a step's residuals apart until the step is known finite: each call
        # is a step, so calls run one after another
        self._serial = bool(getattr(state, "strict_skip", False))
        self._flats: dict[Hashable, torch.Tensor] = {}  # a list call's flat buffer, per key
        self._seq = 0  # calls made (refused ones too): each call's place, compared
        self._nonfinite: list[torch.Tensor] = []  # the exact calls' flags, not yet read
        self._bad_calls = 0
        self._issuer = _Issuer(self)

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
        params = inspect.signature(hook_spec(codec).state).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            own = [name for name in params if name != "process_group"]
            for name in options:
                if name not in own:
                    raise ValueError(
                        f"{self.where}: option {name!r} is not an option of codec {codec!r}, "
                        f"expected its options ({', '.join(own) or 'none'})"
                    )
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

    def all_reduce(
        self, tensor: Union[torch.Tensor, Sequence[torch.Tensor]], key: Hashable, op: str = "mean"
    ) -> Work:
        """Replace ``tensor`` (contiguous, float32, bfloat16 or float16; float64 too with
        ``"allreduce"``) by its mean over the ranks (``op="sum"``: the sum, the mean times N),
        sent through the codec, with the error-feedback residual of ``key``. Every rank holds
        the same bits after it.

        A list (or tuple) of tensors of one dtype and device, of any shapes and strides, is
        one exchange: the tensors are copied into one flat buffer of ``key`` (kept between
        calls), exchanged as one tensor with one residual, and copied back, so a model's
        parameters cost one exchange, not one per tensor.

        Example:
            >>> ex.all_reduce(delta, key="delta").wait()
            >>> ex.all_reduce([p.data for p in model.parameters()], key="params").wait()
        """
        many = isinstance(tensor, (list, tuple))
        if many:
            check = lambda: self._check_list(key, tensor, op)  # noqa: E731
        else:
            check = lambda: self._check("all_reduce", "tensor", tensor, op)  # noqa: E731
        flat, err = self._checked(check)
        body = lambda: self._all_reduce(tensor, key, op, flat, many)  # noqa: E731
        shape = _shape(tensor)
        fuse = (tensor, key, op, flat, many)
        return self._submit("all_reduce", key, flat, f"op={op!r}", err, shape, body, fuse)

    def _all_reduce(
        self, tensor: Any, key: Hashable, op: str, flat: torch.Tensor, many: bool
    ) -> _Issued:
        index, compress = self._begin("all_reduce", key)
        if many:  # once the key's last call is done with its flat buffer
            torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
        state, world = self._state, self._state.world_size
        if flat.numel() == 0:
            return self._nothing(index, flat, tensor)
        if op == "sum" and not compress and world > 1 and getattr(state, "node_plan", None) is None:
            # the exact sum: torch's own all-reduce, bit for bit (no 1/N and back)
            nbytes = ring_bytes(flat.numel() * flat.element_size(), world)
            state.count(_CallBucket(index, flat), nbytes)
            work = dist.all_reduce(flat, group=self._group, async_op=True)
            fut = work.get_future().then(_returning(tensor, flat if many else None))
            return self._issued(fut, tensor, nbytes, ring_bytes(flat.numel() * 4, world))
        before = _sent(state)
        has_start = hasattr(state, "start_iter")
        if has_start:  # the hook's own warm-up test (iter < start_iter), made this key's
            state.start_iter = 0 if compress else state.iter + 1
        try:
            fut = self._fn(state, _CallBucket(index, flat))
        finally:
            if has_start:
                state.start_iter = self.start_iter
        nbytes = tuple(b - a for a, b in zip(before, _sent(state)))
        if op == "sum" and world > 1:
            fut = fut.then(lambda f: f.value().mul_(world))

        def into(f: torch.futures.Future) -> Any:
            out = f.value()
            if out.data_ptr() != flat.data_ptr():
                flat.copy_(out)
            if many:
                _unflatten(flat, tensor)
            return tensor

        return self._issued(fut.then(into), tensor, *nbytes, end=False)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        key: Hashable,
        op: str = "mean",
        *,
        scale: Optional[float] = None,
    ) -> Work:
        """``dist.reduce_scatter_tensor``'s shapes: ``input`` holds N chunks of
        ``output.numel()`` elements, and ``output`` becomes this rank's chunk of their mean
        (``op="sum"``: sum) over the ranks: each rank encodes its input (with ``key``'s
        residual), sends chunk j to rank j, and decodes and sums the N it receives. The exact
        exchange sums the N chunks in rank order (:func:`rank_order_sum`).

        ``scale``: each rank's input is multiplied by ``scale`` before the sum (a premultiplied
        sum, as ``ReduceOp.PREMUL_SUM``); it overrides ``op`` (``op="mean"`` is ``scale=1/N``,
        ``op="sum"`` ``scale=1``).

        Example:
            >>> ex.reduce_scatter(shard, grads, key="grads").wait()
            >>> ex.reduce_scatter(shard, grads, key="grads", scale=1 / 8).wait()
        """
        n = self._state.world_size

        def checked():
            x, out = self._check_pair("reduce_scatter", output, input, op)
            return x, out, self._scale(op, scale, n, x.dtype)

        (x, out, factor), err = self._checked(checked, (None, None, None))
        how = f"op={op!r}" if scale is None else f"scale={scale!r}"
        shape = f"{_shape(input)} into {_shape(output)}"
        body = lambda: self._reduce_scatter(output, key, x, out, factor)  # noqa: E731
        return self._submit("reduce_scatter", key, x, how, err, shape, body)

    def _reduce_scatter(
        self, output: torch.Tensor, key: Hashable, x: torch.Tensor, out: torch.Tensor, factor: float
    ) -> _Issued:
        index, compress = self._begin("reduce_scatter", key)
        n, state, s = self._state.world_size, self._state, out.numel()
        if s == 0:
            return self._nothing(index, x, output)
        bucket, fp32 = _CallBucket(index, x), (n - 1) * s * 4
        if n == 1:
            state.count(bucket, 0, collectives=0, bytes_fp32=0)
            out.copy_(rank_order_sum(x.view(1, s), factor))
            return self._issued(completed(output), output)
        if not compress:
            nbytes = (n - 1) * s * x.element_size()
            state.count(bucket, nbytes, bytes_fp32=fp32)
            fut = self._exact_reduce_scatter(x, out, n, s, factor)
            return self._issued(fut.then(_returning(output)), output, nbytes, fp32)
        fut, nbytes = state.engine.reduce_scatter(out, x, index, factor, state.iter, self._group, n)
        state.count(bucket, nbytes, bytes_fp32=fp32)
        return self._issued(fut.then(_returning(output)), output, nbytes, fp32)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, key: Hashable) -> Work:
        """``dist.all_gather_into_tensor``'s shapes: ``output`` holds N chunks of
        ``input.numel()`` elements and becomes every rank's input, rank j's at chunk j, each
        sent encoded and decoded (this rank's own chunk too, so that every rank holds the same
        bits). No residual: an all-gather carries no state between calls; ``key`` names the
        call for the order of calls.

        Example:
            >>> ex.all_gather(full_weights, my_shard, key="weights").wait()
        """
        (x, out), err = self._checked(
            lambda: self._check_pair("all_gather", output, input, "mean"), (None, None)
        )
        shape = f"{_shape(input)} into {_shape(output)}"
        body = lambda: self._all_gather(output, key, x, out)  # noqa: E731
        return self._submit("all_gather", key, x, "", err, shape, body)

    def _all_gather(
        self, output: torch.Tensor, key: Hashable, x: torch.Tensor, out: torch.Tensor
    ) -> _Issued:
        index, compress = self._begin("all_gather", key)
        n, m, state = self._state.world_size, x.numel(), self._state
        if m == 0:
            return self._nothing(index, x, output)
        bucket, fp32 = _CallBucket(index, x), (n - 1) * m * 4
        if n == 1:
            state.count(bucket, 0, collectives=0, bytes_fp32=0)
            out.copy_(x)
            return self._issued(completed(output), output)
        if not compress:
            gathered = torch.empty(n * m, dtype=x.dtype, device=x.device)
            nbytes = (n - 1) * m * x.element_size()
            state.count(bucket, nbytes, bytes_fp32=fp32)
            work = self._gather_rows(gathered.view(n, m), x.view(1, m))

            def place(f: torch.futures.Future) -> torch.Tensor:
                f.value()
                out.copy_(gathered)
                return output

            return self._issued(work.then(place), output, nbytes, fp32)
        fut, nbytes = state.engine.all_gather(out, x, state.iter, self._gather_rows, n)
        state.count(bucket, nbytes, bytes_fp32=fp32)
        return self._issued(fut.then(_returning(output)), output, nbytes, fp32)

    # --- state --------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """This rank's counters since construction (or the last load), once every call is
        done: ``steps`` (calls), ``buckets`` (the same), ``collectives``, ``bytes_sent`` (what
        this rank put on the wire), ``bytes_fp32`` (what the exact fp32 collective of the same
        tensors sends), ``compression``, ``nonfinite_buckets`` (calls whose result held a NaN
        or Inf), and for a codec ``codec_bytes_sent``, ``codec_bytes_fp32``,
        ``codec_compression`` (its compressed calls alone) and ``residual_bytes``: the table
        of docs/exchange.md, "Counters"."""
        self._drain()
        stats = {k: v for k, v in self._state.stats.items() if k != "rebucketed_steps"}
        if self._codec is None:  # the exact exchange decodes nothing: its results are read
            bad, self._nonfinite = self._nonfinite, []
            self._bad_calls += sum(int(b) for b in bad)
            stats["nonfinite_buckets"] = self._bad_calls
        return stats

    def residual_bytes(self, key: Hashable) -> int:
        """Bytes of the error-feedback residuals this rank keeps for ``key`` (its calls
        together; 0 without error feedback, or before its first compressed call), as
        ``stats["residual_bytes"]`` counts them for every key; reads no device value.

        Example:
            >>> ex.residual_bytes("grads")
        """
        store = getattr(self._state, "store", None)
        if store is None or not getattr(self._state, "error_feedback", False):
            return 0
        self._drain(settle=False)
        indices = [i for (_, k), i in self._keys.items() if k == key]
        return sum(store.nbytes(i, pending=True) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (per key), counters, calls per key (the warm-up) and
        configuration; load it with :meth:`load_state_dict` into an ``Exchange`` of the same
        codec and options, on the same rank, with the same keys. Waits for the last call.

        Example:
            >>> torch.save(ex.state_dict(), f"exchange-rank{rank}.pt")
        """
        self._drain()
        return {
            "exchange": self._state.state_dict(),
            "keys": list(self._keys),
            "calls": [self._calls.get(k, 0) for k in self._keys],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the residuals, counters, keys and their calls; another
        codec, option, rank or world size is refused naming it."""
        keys, calls = self._loadable(state)  # everything checked before anything changes
        self._drain()
        try:
            self._state.load_state_dict(state["exchange"])
        except (ValueError, TypeError, KeyError) as e:
            raise _as_exchange(e, self.codec_name, f"{self.where}.load_state_dict") from e
        store = getattr(self._state, "store", None)
        if store is not None:  # a key's first compressed call may come after the load
            store.place_loaded()
        self._keys = {k: i for i, k in enumerate(keys)}
        self._calls = dict(zip(self._keys, calls))
        self._compared = set()
        self._seq = sum(calls)

    def _loadable(self, state: Any) -> tuple[list, list[int]]:
        """The keys and calls per key of ``state``, once its shape is checked (its hook
        state's fields are checked by the hook state's load), or the ValueError naming
        what is wrong."""
        where = f"{self.where}.load_state_dict"
        if not isinstance(state, dict) or not isinstance(state.get("exchange"), dict):
            raise ValueError(
                f"{where}: got {type(state).__name__} without an 'exchange' dict, expected "
                "what Exchange.state_dict() returns"
            )
        keys = state.get("keys")
        if not isinstance(keys, list) or not all(
            isinstance(k, tuple) and len(k) == 2 and k[0] in _CALLS for k in keys
        ):
            raise ValueError(
                f"{where}: keys={keys!r}, expected a list of (call, key) pairs, call one of "
                f"{', '.join(_CALLS)}, as Exchange.state_dict() writes it"
            )
        try:
            if len(set(keys)) != len(keys):
                raise ValueError(f"{where}: keys={keys!r} holds a pair twice, expected each once")
        except TypeError:
            raise ValueError(f"{where}: keys={keys!r} holds a key that is not hashable") from None
        # without counts per key (an earlier state_dict): the warm-up counted every call
        every = state["exchange"].get("iter", 0)
        calls = state.get("calls", [every] * len(keys))
        if (
            not isinstance(calls, list)
            or len(calls) != len(keys)
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in calls)
        ):
            raise ValueError(
                f"{where}: calls={calls!r}, expected a list of {len(keys)} ints >= 0 (the "
                "calls of each key)"
            )
        for name, kept in (state["exchange"].get("residuals") or {}).items():
            for part, t in kept.items() if isinstance(kept, dict) else ():
                if isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()):
                    raise ValueError(
                        f"{where}: residual {part} of {name!r} holds non-finite values, "
                        "expected finite residuals (a NaN there would reach every later call)"
                    )
        return keys, calls

    def load_key(
        self,
        key: Hashable,
        calls: int,
        residual: Optional[torch.Tensor] = None,
        call: str = "reduce_scatter",
    ) -> None:
        """Give ``key``, which has no calls yet (since construction or the last
        :meth:`load_state_dict`), the history of ``calls`` calls of ``call`` (the warm-up
        counts them) and, for a reduce-scatter with error feedback, ``residual``: the
        residual of its input as that call's codec keeps it (the N chunks, each padded to
        whole blocks, in ``residual_dtype``). What converts a state of another format (an
        older ``pycomm.fsdp`` checkpoint) into this one; a residual of another size or dtype
        is refused naming both.

        Example:
            >>> ex.load_key("layers.0", calls=12, residual=saved_residual)
        """
        where = f"{self.where}.load_key"
        if call not in _CALLS:
            raise ValueError(f"{where}: call={call!r}, expected one of {', '.join(_CALLS)}")
        check_int(where, "calls", calls, 0)
        try:
            if (call, key) in self._keys:
                raise ValueError(
                    f"{where}: key={key!r} has calls of {call} already; expected a key "
                    "without history (a fresh Exchange, or one just loaded)"
                )
        except TypeError:
            raise TypeError(f"{where}: key={key!r} is not hashable") from None
        state = self._state
        if residual is not None and not isinstance(residual, torch.Tensor):
            raise TypeError(
                f"{where}: residual is a {type(residual).__name__}, expected a tensor or None"
            )
        if residual is not None:
            feedback = getattr(state, "error_feedback", False)
            if call != "reduce_scatter" or not feedback:
                raise ValueError(
                    f"{where}: a residual for a {call} of codec={self.codec_name!r} with "
                    f"error_feedback={feedback}; expected residual=None, or reduce_scatter "
                    "with error feedback"
                )
            n, block, dtype = state.world_size, self._codec.block, state.residual_dtype
            numel = residual.numel()
            kept = state.engine.key_sizes((0, numel, PHASE_1)).get("r1")
            if numel % (n * block) or kept != numel or residual.dtype != dtype:
                raise ValueError(
                    f"{where}: residual of {numel} elements of {residual.dtype}, expected "
                    f"{n} chunks of whole blocks of {block} elements of {dtype}, as this "
                    f"configuration keeps it ({kept or 'none'} for {numel} elements)"
                )
            if not bool(torch.isfinite(residual).all()):
                raise ValueError(
                    f"{where}: residual holds non-finite values, expected finite residuals "
                    "(a NaN there would reach every later call)"
                )
        self._drain()
        index = self._keys[(call, key)] = len(self._keys)
        self._calls[(call, key)] = calls
        if residual is not None:
            kept = {"r1": residual.detach().clone()}
            state.store.put((index, residual.numel(), PHASE_1), kept)

    # --- the call's path ----------------------------------------------------------------

    def _check_list(self, key: Hashable, tensors: Sequence[Any], op: str) -> torch.Tensor:
        """The flat buffer of a list call of ``key`` (its last one's, when of the same size,
        dtype and device), once the tensors are checked (one dtype and device)."""
        where = f"{self.where}.all_reduce"
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"{where}: key={key!r} is not hashable; expected a str, int or tuple"
            ) from None
        if not tensors:
            raise ValueError(f"{where}: tensor is an empty list, expected at least one tensor")
        for i, t in enumerate(tensors):
            self._check("all_reduce", f"tensor[{i}]", t.reshape(-1) if _dense(t) else t, op)
            first = tensors[0]
            if t.dtype != first.dtype or t.device != first.device:
                raise TypeError(
                    f"{where}: tensor[{i}] is {t.dtype} on {t.device} and tensor[0] "
                    f"{first.dtype} on {first.device}, expected one dtype and device (the list "
                    "is exchanged as one flat tensor)"
                )
        numel = sum(t.numel() for t in tensors)
        flat = self._flats.get(key)
        if (
            flat is None
            or flat.numel() != numel
            or flat.dtype != first.dtype
            or (flat.device != first.device)
        ):
            flat = self._flats[key] = torch.empty(numel, dtype=first.dtype, device=first.device)
        return flat

    def _check(self, call: str, name: str, t: Any, op: str) -> torch.Tensor:
        where = f"{self.where}.{call}"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}, expected a tensor")
        dtypes = getattr(self._state, "grad_dtypes", None) or _EXACT_DTYPES
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
        if t.device.type == "meta":
            raise ValueError(
                f"{where}: {name} is on the meta device (shapes without data); expected a "
                "tensor with data (cpu, or cuda on nccl)"
            )
        if op not in _OPS:
            raise ValueError(f"{where}: op={op!r}, expected 'mean' or 'sum'")
        # written as torch.distributed's collectives write: in place, outside autograd (a
        # parameter too, as dist.all_reduce(p) does)
        return t.detach().view(-1)

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
        if getattr(self._state, "hierarchy", None) == "node":
            # asked for; "auto" runs these two flat, over every rank of the group
            raise ValueError(
                f"{where}: hierarchy='node' runs all_reduce alone; expected hierarchy='flat' "
                "or 'auto' (flat for reduce_scatter and all_gather)"
            )
        return x, out

    def _scale(self, op: str, scale: Any, n: int, dtype: torch.dtype) -> float:
        """The factor each rank's input is multiplied by before the sum (in fp32, or float64
        for float64 tensors: it must be finite there)."""
        if scale is None:
            return 1.0 / n if op == "mean" else 1.0
        largest = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
            or abs(scale) > largest
        ):
            raise ValueError(
                f"{self.where}.reduce_scatter: scale={scale!r}, expected a finite float of at "
                f"most {largest:.4g} in magnitude (each rank's input is multiplied by it, in "
                f"{'float64' if dtype == torch.float64 else 'float32'}, before the sum) or None "
                "(op decides)"
            )
        return float(scale)

    @staticmethod
    def _checked(check: Any, failed: Any = None) -> tuple[Any, Optional[Exception]]:
        """``(check(), None)``, or ``(failed, the error)`` when ``check`` refuses the call's
        arguments: :meth:`_start` raises it, on every rank where the order check runs."""
        try:
            return check(), None
        except (TypeError, ValueError) as e:
            return failed, e

    def _submit(
        self,
        call: str,
        key: Hashable,
        t: Optional[torch.Tensor],
        how: str,
        err: Optional[Exception],
        shape: str,
        body: Callable[[], _Issued],
        fuse: Optional[tuple] = None,
    ) -> Work:
        """Hand a call to the issuing thread and return its :class:`Work`: ``body`` issues
        its collectives there, in call order, once the call's order is checked across the
        ranks (``check_order``; ``how`` and ``shape`` name the call there). ``err``: this
        rank's refusal of the call's arguments, raised here; the ranks compare it like the
        call, so each of them raises the first error any of them met. A key's first call
        (and a refused call) waits for its check: a difference raises here, on every rank; a
        later call's difference fails its ``wait()``."""
        if not _alive(self.process_group):
            raise RuntimeError(
                f"{self.where}.{call}: the process group was destroyed; an Exchange lives "
                "while the group it was built on does"
            )
        pair = (call, key)
        try:
            first = pair not in self._compared
        except TypeError:
            first = True
            err = err or TypeError(
                f"{self.where}.{call}: key={key!r} is not hashable; expected a str, int or tuple"
            )
        mode, seq = self.check_order, self._seq
        self._seq += 1
        checked = self._state.world_size > 1 and (mode == "every" or (mode == "first" and first))
        if err is not None and not checked:
            raise err
        if err is None:
            self._compared.add(pair)
        tensor = "refused input" if t is None else shape
        what = f"call {seq}: {call}(key={key!r}, {tensor}, {how})"
        fields = {**error_field(err), "the order of calls": what}
        item = _Call(pair, what if err is None else f"{what} {err}", fields, checked, err, body)
        item.fuse = fuse
        self._issuer.put(item)
        if err is None and not (checked and first):
            return item.work
        item.checked.wait()
        if item.failed is not None:
            raise item.failed
        if err is not None:
            raise err
        return item.work

    def _checks(self, calls: list[_Call]) -> tuple[list[_Call], list[_Call]]:
        """On the issuing thread: the calls whose check passed, in order, and those to check
        again (past a difference, or past what every rank had queued). ``"every"``: one
        all-reduce of the calls' 56-bit digests (up to :data:`_SLOTS` calls, and how many);
        the calls every rank had queued are compared, and the first that differs is
        compared in full (one object gather), which raises the ValueError naming each
        rank's call. ``"first"``: each key's first call compared in full."""
        if self.check_order != "every" or self._state.world_size == 1:
            passed = []
            for c in calls:
                if c.checked and not self._agreed(c):
                    continue
                passed.append(c)
            return passed, []
        k, n = _SLOTS, len(calls)
        digests = [_digest(c.mark) for c in calls]
        v = torch.zeros(2 + 2 * k, dtype=torch.int64)
        v[0], v[1] = n, -n
        v[2 : 2 + n] = torch.tensor(digests)
        v[2 + k : 2 + k + n] = -v[2 : 2 + n]
        dev = self._device
        got = v.to(dev)
        dist.all_reduce(got, op=dist.ReduceOp.MAX, group=self._group)
        got = got.tolist()
        queued = -got[1]  # the fewest calls a rank had queued
        for i in range(queued):
            if got[2 + i] != digests[i] or got[2 + k + i] != -digests[i]:
                ok = self._agreed(calls[i])
                return calls[: i + ok], calls[i + 1 :]
        return calls[:queued], calls[queued:]

    def _agreed(self, c: _Call) -> bool:
        """Compare ``c`` in full across the ranks (a collective): False, with the call failed
        with the error every rank raises, where they differ."""
        try:
            agree(f"{self.where}.{c.pair[0]}", c.fields, self._group, call=self.where)
        except Exception as e:  # noqa: BLE001 - the same error on every rank
            c.fail(e)
            return False
        return True

    def _runs(self, calls: list[_Call]) -> list[list[_Call]]:
        """``calls`` (passed, in order) cut into runs to issue: consecutive compressed
        all-reduces of a two-phase codec on different keys, which every rank checked as one
        batch (``check_order="every"``), go as one exchange; every other call alone."""
        state = self._state
        fusable = (
            self.check_order == "every"
            and state.world_size > 1
            and self._codec is not None
            and self._codec.two_phase
            and getattr(state, "node_plan", None) is None
            and not self._serial
        )
        runs: list[list[_Call]] = []
        run: list[_Call] = []  # the fusable run being built
        for c in calls:
            ok = (
                fusable
                and c.err is None
                and c.fuse is not None
                and c.fuse[3].numel() > 0
                and self._calls.get(c.pair, 0) >= self.start_iter
            )
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

    def _run_fused(self, calls: list[_Call]) -> None:
        """Issue compressed all-reduces of different keys as one exchange
        (:meth:`Engine.all_reduce_many`): each call's step, residual and decode its own, the
        bits of its exchange alone."""
        state, world = self._state, self._state.world_size
        items, meta = [], []
        for c in calls:
            c.checked.set()
            tensor, key, op, flat, many = c.fuse
            state.check_resumed(flat.device)
            index, _ = self._begin("all_reduce", key)
            if many:
                torch.cat([t.detach().reshape(-1) for t in tensor], out=flat)
            bucket, sent = _CallBucket(index, flat), {}

            def count(nbytes: int, collectives: int, bucket=bucket, sent=sent) -> None:
                before = _sent(state)
                state.count_exchange(bucket, nbytes, collectives)
                sent["bytes"] = tuple(b - a for a, b in zip(before, _sent(state)))

            items.append((flat, (index, flat.numel(), str(flat.dtype)), state.iter, count))
            meta.append((c, tensor, op, flat, many, sent))
            state.end_step()
        futures = state.engine.all_reduce_many(items)
        for (c, tensor, op, flat, many, sent), fut in zip(meta, futures):
            if op == "sum":
                fut = fut.then(lambda f: f.value().mul_(world))
            fut = fut.then(_returning(tensor, flat if many else None))
            c.work._set(fut, tensor, *sent["bytes"])
            self._inflight[c.pair] = c.work

    def _run(self, c: _Call) -> None:
        """On the issuing thread, once ``c``'s check passed: issue it."""
        c.checked.set()
        if c.err is not None:  # every rank refused it alike: raised by each caller
            c.work._fail(c.err, observed=True)
            return
        try:
            issued = c.body()
        except Exception as e:  # noqa: BLE001 - handed to the caller's wait()
            c.work._fail(e)
            return
        if self._codec is None:
            issued = issued._replace(future=issued.future.then(self._note_finite))
        c.work._set(*issued)
        self._inflight[c.pair] = c.work

    def _note_finite(self, fut: torch.futures.Future) -> Any:
        """Keep whether an exact call's result holds a NaN or Inf, for ``stats`` (a device
        flag, read there); the result."""
        result = fut.value()
        parts = result if isinstance(result, (list, tuple)) else [result]
        flags = [(~torch.isfinite(t)).any() for t in parts if t.numel()]
        if flags:
            self._nonfinite.append(torch.stack(flags).any())
        return result

    def _begin(self, call: str, key: Hashable) -> tuple[int, bool]:
        """On the issuing thread: the position of ``(call, key)`` (new ones in order of first
        use) and whether this call goes through the codec (the key's ``start_iter`` exact
        calls done), once the key's last call is done (its residual written; every last
        call with ``strict_skip``, whose step commit keeps or drops them)."""
        pair = (call, key)
        self._settle(None if self._serial else pair)
        index = self._keys.setdefault(pair, len(self._keys))
        done = self._calls.get(pair, 0)
        self._calls[pair] = done + 1
        new_step = getattr(self._state, "new_step", None)
        if new_step is not None:
            new_step()
        return index, self._codec is not None and done >= self.start_iter

    def _issued(
        self,
        fut: torch.futures.Future,
        result: Any,
        bytes_sent: int = 0,
        bytes_fp32: int = 0,
        end: bool = True,
    ) -> _Issued:
        """``end``: close the call's step (all_reduce's hook closes its own: its bucket is the
        step's last)."""
        end_step = getattr(self._state, "end_step", None)
        if end and end_step is not None:
            end_step()
        return _Issued(fut, result, bytes_sent, bytes_fp32)

    def _nothing(self, index: int, x: torch.Tensor, result: Any) -> _Issued:
        """A call of 0 elements, on every rank (the order check compares them): counted,
        nothing sent."""
        self._state.count(_CallBucket(index, x), 0, collectives=0, bytes_fp32=0)
        return self._issued(completed(result), result)

    def _drain(self, settle: bool = True) -> None:
        """Wait until every call handed to the issuing thread is issued (``settle``: and
        done; what a call raised is raised here once, unless its ``wait()`` gave it to the
        caller already)."""
        self._issuer.drain()
        if settle:
            self._settle()

    def _settle(self, pair: Optional[Hashable] = None) -> None:
        """Wait for the last call of ``pair`` (``(call, key)``; None: of every key); what it
        raised is raised here once, unless its ``wait()`` gave it to the caller already."""
        if pair is None:
            works, self._inflight = list(self._inflight.values()), {}
        else:
            works = [w for w in (self._inflight.pop(pair, None),) if w is not None]
        for work in works:
            try:
                work.get_future().wait()
            except Exception:
                if not work._observed:
                    work._observed = True
                    raise

    def _gather_rows(self, rows: torch.Tensor, row: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``row`` into ``rows`` (rank order)."""
        backend = dist.get_backend(self._group)
        if backend == "nccl":
            work = dist.all_gather_into_tensor(rows, row, group=self._group, async_op=True)
        else:  # gloo: all_to_all of the row sent to every rank
            send = row.expand(rows.shape[0], -1).contiguous()
            work = dist.all_to_all_single(rows, send, group=self._group, async_op=True)
        return work.get_future()

    def _exact_reduce_scatter(
        self, x: torch.Tensor, out: torch.Tensor, n: int, s: int, scale: float
    ) -> torch.futures.Future:
        recv = torch.empty_like(x)
        work = dist.all_to_all_single(recv, x, group=self._group, async_op=True)

        def total(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            out.copy_(rank_order_sum(recv.view(n, s), scale))
            return out

        return work.get_future().then(total)


def _as_exchange(exc: Exception, codec: Any, where: str) -> Exception:
    """``exc`` of the codec's hook state, as the Exchange's: named for the codec the caller
    passed and pointing to the Exchange's own state_dict, not to DDP's hook helpers."""
    if not isinstance(exc, (ValueError, TypeError, KeyError)) or not isinstance(codec, str):
        return exc
    text = str(exc.args[0]) if exc.args else str(exc)
    text = text.replace(f"pycomm {codec} hook: ", f"{where} (codec {codec!r}): ")
    text = text.replace("pycomm: cannot load hook state", f"{where}: cannot load the state")
    text = text.replace("hook state", "Exchange state")
    text = text.replace(
        "(pycomm.checkpoint.load_hook_state does)",
        "(save Exchange.state_dict() on each rank and load it there with load_state_dict())",
    )
    return type(exc)(text)


def _dense(t: Any) -> bool:
    """Whether ``t`` is a dense tensor with data (one that reshapes to a flat tensor)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def _alive(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` (None: the default group) is still a group of this process (not
    destroyed with ``dist.destroy_process_group``)."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group or dist.group.WORLD)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _sent(state: HookState) -> tuple[int, int]:
    """The state's ``bytes_sent`` and ``bytes_fp32`` so far (no fold, no device wait)."""
    counters = state.counters
    return counters["bytes_sent"], counters["bytes_fp32"]
