"""The public face of the exchange: :class:`Exchange`, its options, its three calls and their
argument checks (every refusal a TypeError or ValueError naming the call, the argument and what
was expected)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.codec.agree import agree, error_field
from pycomm.codec.config import Config, check_hierarchy, resolve
from pycomm.codec.registry import codec_names, codec_spec, find_codec, qualified_name
from pycomm.exchange import checks
from pycomm.exchange.issue import Issuer, Stream, Work
from pycomm.exchange.keys import Keys
from pycomm.exchange.managed import ManagedExchange

__all__ = ["Exchange"]

_CHECKS = ("first", "every", "off")


class Exchange:
    """A compressed collective over ``process_group`` (default: the default group).

    Args:
        codec: a registered codec (:meth:`codecs` lists them: ``"int8"``, a user's...), or
            ``"allreduce"`` for the exact exchange (fp32 sums; float64
            tensors too, summed in float64).
        process_group: the ranks that exchange; every one of them builds the ``Exchange``.
        start_iter: the warm-up, per key: the first ``start_iter`` calls of each ``key`` (and
            call: an ``all_reduce`` and a ``reduce_scatter`` of one key count apart) run
            exact, its later calls through the codec (default 0). The counts are in
            :meth:`state_dict`.
        check_order: how the ranks check that they issue the same calls in the same order
            (the call, the key, each tensor's shape and dtype, the call's place):
            ``"every"`` (default: every call, the calls queued together by one 272-byte
            all-reduce of their digests), ``"first"`` (each key's first call since built or
            loaded, one object gather) or ``"off"``. A difference is a ValueError on every
            rank naming each rank's call: raised by a key's first call, else by ``wait()``.
        **options: the codec's options (``block``, ``error_feedback``, ``residual_dtype``,
            ``local_feedback``, ``hierarchy``, a user's codec's own), as in
            ``pycomm.wrap(hook_options=...)``.
        manager: a ``torchft.manager.Manager`` (keyword, not with ``process_group``): the
            exchange across torchft's replica groups instead, with the manager's semantics
            (quorum, participants, commit or roll back, heal): a
            :class:`~pycomm.exchange.managed.ManagedExchange` (docs/fault-tolerance.md).

    Raises:
        ValueError or TypeError, on every rank: an unknown codec or option, a bad value on
        any rank, or ranks that resolved different configurations.

    Example:
        >>> ex = pycomm.Exchange("int8", block=128, residual_dtype="bfloat16")
        >>> ex.all_reduce(params_delta, key="outer").wait()
    """

    where = "pycomm.Exchange"

    def __new__(
        cls,
        codec: str = "int8",
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        manager: Any = None,
        **options: Any,
    ) -> Any:
        """With ``manager=`` (a torchft ``Manager``): the exchange across its replica groups,
        a :class:`~pycomm.exchange.managed.ManagedExchange` (docs/fault-tolerance.md)."""
        if manager is None:
            return super().__new__(cls)
        if process_group is not None:
            raise ValueError(
                f"{cls.where}: manager= and process_group= were both given; expected one: "
                "under a torchft manager the exchange runs over the manager's own group "
                "across the replica groups"
            )
        return ManagedExchange(codec, manager, **options)

    def __init__(
        self,
        codec: str = "int8",
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        start_iter: int = 0,
        check_order: str = "every",
        manager: None = None,
        **options: Any,
    ) -> None:
        _check_group(self.where, process_group)
        fields: dict[str, Any] = {"codec": codec}
        if isinstance(codec, str):
            spec = find_codec(codec)
            fields[f"registration of codec {codec!r}"] = (
                "not registered" if spec is None else qualified_name(spec.codec)
            )
        fields.update(error_field(None))  # where the ranks compare it: before the config
        config, hierarchy = None, "auto"
        try:
            config, hierarchy = self._build(codec, start_iter, options)
            fields.update({"option 'hierarchy'": hierarchy} if config is None else config.fields())
            if check_order not in _CHECKS:
                raise ValueError(
                    f"{self.where}: check_order={check_order!r}, expected "
                    f"{', '.join(map(repr, _CHECKS))}"
                )
        except Exception as e:  # noqa: BLE001 - a user's codec failing on one rank too
            fields.update(error_field(checks.as_exchange(e, codec, self.where)))
        fields["start_iter"] = start_iter
        fields["check_order"] = check_order
        agree(self.where, fields, process_group)
        # the group's issuing thread, on a group of its own: it issues every collective of
        # the Exchanges over that group, so none meets the caller's own in another order
        self._issuer = Issuer.of(process_group)
        self.codec_name, self.process_group = codec, process_group
        self.start_iter, self.check_order = start_iter, check_order
        self._keys = Keys(codec, config, hierarchy, self._issuer.group, start_iter)
        self._stream = Stream(self._keys, check_order, self.where, self._keys.serial)

    def _build(self, codec: Any, start_iter: Any, options: dict) -> tuple[Optional[Config], str]:
        """The codec's resolved configuration (None for ``"allreduce"``) and ``hierarchy``."""
        if not isinstance(codec, str):
            raise TypeError(
                f"{self.where}: codec={codec!r}, expected the name of a registered codec, or "
                f"'allreduce' ({', '.join(self.codecs())})"
            )
        if codec not in self.codecs():
            raise ValueError(
                f"{self.where}: codec={codec!r} is not a registered codec; expected one of "
                f"{', '.join(self.codecs())}"
            )
        check_int(self.where, "start_iter", start_iter, 0)
        if "start_iter" in options:
            raise TypeError(f"{self.where}: start_iter is given twice")
        where = f"{self.where} (codec {codec!r})"
        if codec == "allreduce":
            for name in options:
                if name != "hierarchy":
                    raise ValueError(
                        f"{self.where}: option {name!r} is not an option of codec {codec!r}, "
                        "expected its options (hierarchy)"
                    )
            return None, check_hierarchy(where, options.get("hierarchy", "auto"))
        config = resolve(codec_spec(codec), where, options, start_iter=start_iter)
        return config, config.hierarchy

    @staticmethod
    def codecs() -> list[str]:
        """What ``codec=`` takes: ``"allreduce"`` and every registered codec
        (:func:`pycomm.codec.codec_names`).

        Example:
            >>> pycomm.Exchange.codecs()[:3]
            ['allreduce', 'bf16', 'fp16']
        """
        return ["allreduce", *codec_names()]

    # --- the calls ----------------------------------------------------------------------

    def all_reduce(
        self, tensor: Union[torch.Tensor, Sequence[torch.Tensor]], key: Hashable,
        op: str = "mean", *, async_op: bool = True,
    ) -> Work:  # fmt: skip
        """Replace ``tensor`` (contiguous, float32, bfloat16 or float16; float64 too with
        ``"allreduce"``) by its mean over the ranks (``op="sum"``: the sum), sent through the
        codec with the error-feedback residual of ``key``. Every rank holds the same bits
        after it. A list (or tuple) of tensors of one dtype and device, any shapes and
        strides, is one exchange: copied into one flat buffer of ``key``, exchanged with
        one residual, and copied back. ``async_op``: see :meth:`reduce_scatter`.

        Example:
            >>> ex.all_reduce(delta, key="delta").wait()
            >>> ex.all_reduce([p.data for p in model.parameters()], key="params").wait()
        """
        where, dtypes = f"{self.where}.all_reduce", self._keys.grad_dtypes
        flat, err = None, None
        try:
            if isinstance(tensor, (list, tuple)):
                numel = checks.check_tensors(where, key, tensor, op, dtypes)
                flat = self._keys.flat(key, numel, tensor[0])
            else:
                flat = checks.check_tensor(where, "tensor", tensor, op, dtypes)
        except (TypeError, ValueError) as e:
            err = e
        body = lambda: self._keys.all_reduce(tensor, key, op, flat)  # noqa: E731
        return self._submit("all_reduce", key, flat, f"op={op!r}", err, _shape(tensor),
                            body, (tensor, key, op, flat), async_op)  # fmt: skip

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        key: Hashable,
        op: str = "mean",
        *,
        scale: Optional[float] = None,
        async_op: bool = True,
    ) -> Work:
        """``dist.reduce_scatter_tensor``'s shapes: ``input`` holds N chunks of
        ``output.numel()`` elements, and ``output`` becomes this rank's chunk of their mean
        (``op="sum"``: sum) over the ranks: each rank encodes its input (with ``key``'s
        residual), sends chunk j to rank j, and decodes and sums the N it receives. The exact
        exchange sums the N chunks in rank order (:func:`rank_order_sum`). ``scale``: each
        rank's input times ``scale``, then the sum (``ReduceOp.PREMUL_SUM``; it overrides
        ``op``).

        ``async_op=False``, as ``torch.distributed``'s: issued on this thread (after the calls
        made before it) and done when it returns, for a caller that waits at once
        (``pycomm.fsdp``). On a GPU a call works on the caller's current stream as it stood.

        Example:
            >>> ex.reduce_scatter(shard, grads, key="grads").wait()
            >>> ex.reduce_scatter(shard, grads, key="grads", scale=1 / 8).wait()
        """
        where, n, x, out, factor, err = f"{self.where}.reduce_scatter", self._world, *[None] * 4
        try:
            x, out = _pair(where, "reduce_scatter", output, input, op, n,
                                 self._keys.grad_dtypes, self._hierarchy)  # fmt: skip
            factor = _scale_of(where, op, scale, n, x.dtype)
        except (TypeError, ValueError) as e:
            err = e
        how = f"op={op!r}" if scale is None else f"scale={scale!r}"
        shape = f"{_shape(input)} into {_shape(output)}"
        body = lambda: self._keys.reduce_scatter(output, key, x, out, factor)  # noqa: E731
        return self._submit("reduce_scatter", key, x, how, err, shape, body, None, async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, key: Hashable, *, async_op: bool = True
    ) -> Work:
        """``dist.all_gather_into_tensor``'s shapes: ``output`` holds N chunks of
        ``input.numel()`` elements and becomes every rank's input, rank j's at chunk j, each
        sent encoded and decoded (this rank's own too, so every rank holds the same bits).
        No residual; ``key`` names the call for the order of calls. ``async_op``: see
        :meth:`reduce_scatter`.

        Example:
            >>> ex.all_gather(full_weights, my_shard, key="weights").wait()
        """
        where, x, out, err = f"{self.where}.all_gather", None, None, None
        try:
            x, out = _pair(where, "all_gather", output, input, "mean", self._world,
                                 self._keys.grad_dtypes, self._hierarchy)  # fmt: skip
        except (TypeError, ValueError) as e:
            err = e
        shape = f"{_shape(input)} into {_shape(output)}"
        body = lambda: self._keys.all_gather(output, key, x, out)  # noqa: E731
        return self._submit("all_gather", key, x, "", err, shape, body, None, async_op)

    def _submit(self, call: str, key: Hashable, t: Any, how: str, err: Any, shape: str,
                body: Any, fuse: Any = None, async_op: bool = True) -> Work:  # fmt: skip
        _submittable(f"{self.where}.{call}", self.process_group, async_op)
        work = self._issuer.submit(self._stream, (call, key), t, how, err, shape, body, fuse,
                                   inline=not async_op)  # fmt: skip
        if not async_op:
            work.wait()
        return work

    def _drain(self) -> None:
        """Wait until every call of this Exchange is issued and done (what one raised is
        raised here once, unless its ``wait()`` gave it to the caller already)."""
        self._issuer.drain()
        self._stream.settle()

    @property
    def _world(self) -> int:
        return self._keys.world_size

    @property
    def _hierarchy(self) -> Any:
        return self._keys.hierarchy

    # --- state --------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """This rank's counters, once every call is done: ``steps`` (calls), ``bytes_sent``
        (this rank's), ``bytes_fp32``, ``compression``, ``nonfinite_buckets``, and for a
        codec ``codec_*`` and ``residual_bytes``: the table of docs/exchange.md, "Counters"."""
        self._drain()
        return self._keys.stats()

    def residual_bytes(self, key: Hashable) -> int:
        """Bytes of the error-feedback residuals this rank keeps for ``key`` (0 without error
        feedback, or before its first compressed call); reads no device value.

        Example:
            >>> ex.residual_bytes("grads")
        """
        self._issuer.drain()
        return self._keys.residual_bytes(key)

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (per key), counters, calls per key (the warm-up) and
        configuration, once every call is done; load it with :meth:`load_state_dict` into
        an ``Exchange`` of the same codec and options, on the same rank.

        Example:
            >>> torch.save(ex.state_dict(), f"exchange-rank{rank}.pt")
        """
        self._drain()
        return self._keys.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the residuals, counters, keys and their calls; another
        codec, option, rank or world size is refused naming it."""
        where = f"{self.where}.load_state_dict"
        keys, calls = checks.loadable(where, state)  # checked before anything changes
        self._drain()
        try:
            self._keys.load(state, keys, calls)
        except (ValueError, TypeError, KeyError) as e:
            raise checks.as_exchange(e, self.codec_name, where) from e
        self._stream.compared, self._stream.seq = set(), sum(calls)

    def load_key(
        self,
        key: Hashable,
        calls: int,
        residual: Optional[torch.Tensor] = None,
        call: str = "reduce_scatter",
    ) -> None:
        """Give ``key``, without calls yet, the history of ``calls`` calls of ``call`` (the
        warm-up counts them) and, for a reduce-scatter with error feedback, ``residual``: its
        input's residual as the codec keeps it (N chunks, each padded to whole blocks, in
        ``residual_dtype``). What converts a state of another format (an older
        ``pycomm.fsdp`` checkpoint); a residual of another size or dtype is refused.

        Example:
            >>> ex.load_key("layers.0", calls=12, residual=saved_residual)
        """
        where = f"{self.where}.load_key"
        if call not in checks.CALLS:
            raise ValueError(f"{where}: call={call!r}, expected one of {', '.join(checks.CALLS)}")
        check_int(where, "calls", calls, 0)
        self._drain()
        try:
            if (call, key) in self._keys.keys:
                raise ValueError(
                    f"{where}: key={key!r} has calls of {call} already; expected a key "
                    "without history (a fresh Exchange, or one just loaded)"
                )
        except TypeError:
            raise TypeError(f"{where}: key={key!r} is not hashable") from None
        if residual is not None:
            checks.residual(where, call, residual, self._keys, self.codec_name)
        self._keys.load_key((call, key), calls, residual)


def _torchft_backend(group: Any) -> bool:
    """Whether ``group`` is a torchft group registered with torch.distributed (torchft's
    ``ProcessGroup.register``): one rank to torch, the replica groups behind it."""
    if not isinstance(group, dist.ProcessGroup) or not dist.is_initialized():
        return False
    try:
        return str(dist.get_backend(group)).lower().startswith("torchft")
    except (ValueError, RuntimeError):
        return False


def _check_group(where: str, group: Any) -> None:
    """Refuse an Exchange without a process group, or on a group this rank is not in."""
    if type(group).__module__.startswith("torchft.") or _torchft_backend(group):
        raise ValueError(
            f"{where}: process_group is torchft's {type(group).__name__}, whose ranks change "
            "with each quorum; expected pycomm.Exchange(codec, manager=manager) for an "
            "exchange across torchft's replica groups (docs/fault-tolerance.md)"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where}: no process group; call pycomm.init() (or "
            "torch.distributed.init_process_group) on every rank first"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{where}: this rank (global rank {dist.get_rank()}) is not in process_group "
            "(dist.new_group returned GroupMember.NON_GROUP_MEMBER here); expected the "
            "Exchange built by the group's ranks alone, as its collectives run"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{where}: process_group={group!r}, expected a torch.distributed.ProcessGroup or "
            "None (the default group)"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"{where}: this rank (global rank {dist.get_rank()}) is not in process_group "
            f"(ranks {dist.get_process_group_ranks(group)}); expected the Exchange built by "
            "the group's ranks alone, as its collectives run"
        )


# the argument checks of the calls, beside them: a call passes no other module to be checked
def _pair(
    where: str, call: str, output: Any, input: Any, op: str, n: int, dtypes, hierarchy: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat input and output of a reduce-scatter or all-gather over ``n`` ranks: the one
    of N chunks (reduce_scatter's input, all_gather's output) holds N times the other's
    elements."""
    x = checks.check_tensor(where, "input", input, op, dtypes)
    out = checks.check_tensor(where, "output", output, "mean", dtypes)
    if out.dtype != x.dtype or out.device != x.device:
        raise TypeError(
            f"{where}: output is {out.dtype} on {out.device} and input {x.dtype} on "
            f"{x.device}, expected the same dtype and device"
        )
    (whole, wname), (part, pname) = (
        ((x, "input"), (out, "output")) if call == "reduce_scatter" else
        ((out, "output"), (x, "input"))
    )  # fmt: skip
    if whole.numel() != n * part.numel():
        raise ValueError(
            f"{where}: {wname} has {whole.numel()} elements, expected {n} x {pname}'s "
            f"{part.numel()} = {n * part.numel()}"
        )
    if hierarchy == "node":  # asked for; "auto" runs these two flat, over every rank
        raise ValueError(
            f"{where}: hierarchy='node' runs all_reduce alone; expected hierarchy='flat' "
            "or 'auto' (flat for reduce_scatter and all_gather)"
        )
    return x, out


def _scale_of(where: str, op: str, scale: Any, n: int, dtype: torch.dtype) -> float:
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
            f"{where}: scale={scale!r}, expected a finite float of at most {largest:.4g} in "
            f"magnitude (each rank's input is multiplied by it, in "
            f"{'float64' if dtype == torch.float64 else 'float32'}, before the sum) or None "
            "(op decides)"
        )
    return float(scale)


def _shape(t: Any) -> str:
    """A call's tensor (or list of tensors) as the order check names it: shape and dtype."""
    if isinstance(t, torch.Tensor):
        return f"shape {list(t.shape)} {str(t.dtype)[6:]}"
    if isinstance(t, (list, tuple)) and t and all(isinstance(x, torch.Tensor) for x in t):
        shapes = ", ".join(str(list(x.shape)) for x in t)
        return f"{len(t)} tensors of shapes {shapes} {str(t[0].dtype)[6:]}"
    return f"{type(t).__name__}"


def _submittable(where: str, group: Optional[dist.ProcessGroup], async_op: Any) -> None:
    """Refuse a call on a destroyed group (RuntimeError) or a bad ``async_op`` (TypeError)."""
    if not _alive(group):
        raise RuntimeError(
            f"{where}: the process group was destroyed; an Exchange lives while the group it "
            "was built on does"
        )
    if not isinstance(async_op, bool):
        raise TypeError(f"{where}: async_op={async_op!r}, expected True or False")


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
