"""What an :class:`~pycomm.exchange.Exchange` loads, checked (a state, a key's history) and
its refusals named as the Exchange's: every refusal a TypeError or ValueError that names the
call, the argument and what was expected. A call's own arguments are checked where the call is
made (:mod:`pycomm.exchange.core`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional

import torch

from pycomm.codec.agree import dtype_names
from pycomm.codec.residuals import PHASE_1

__all__ = [
    "CALLS", "EXACT_DTYPES", "OPS", "as_exchange", "check_tensor", "check_tensors", "loadable",
    "residual",
]  # fmt: skip

CALLS = ("all_reduce", "reduce_scatter", "all_gather")


def loadable(where: str, state: Any) -> tuple[list, list[int]]:
    """The keys and calls per key of an Exchange's ``state``, once its shape is checked (its
    codec state's fields are checked by that state's load), or the ValueError naming what is
    wrong."""
    if not isinstance(state, dict) or not isinstance(state.get("exchange"), dict):
        raise ValueError(
            f"{where}: got {type(state).__name__} without an 'exchange' dict, expected "
            "what Exchange.state_dict() returns"
        )
    keys = state.get("keys")
    if not isinstance(keys, list) or not all(
        isinstance(k, tuple) and len(k) == 2 and k[0] in CALLS for k in keys
    ):
        raise ValueError(
            f"{where}: keys={keys!r}, expected a list of (call, key) pairs, call one of "
            f"{', '.join(CALLS)}, as Exchange.state_dict() writes it"
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
            f"{where}: calls={calls!r}, expected a list of {len(keys)} ints >= 0 (the calls "
            "of each key)"
        )
    for name, kept in (state["exchange"].get("residuals") or {}).items():
        for part, t in kept.items() if isinstance(kept, dict) else ():
            if isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"{where}: residual {part} of {name!r} holds non-finite values, expected "
                    "finite residuals (a NaN there would reach every later call)"
                )
    return keys, calls


def as_exchange(exc: Exception, codec: Any, where: str) -> Exception:
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


def residual(where: str, call: str, residual: Any, keys: Any, codec: str) -> None:
    """Refuse a residual :meth:`Exchange.load_key` cannot give its key: not a tensor, not a
    reduce-scatter's with error feedback, not the size and dtype the engine of ``keys``
    keeps, or not finite."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(
            f"{where}: residual is a {type(residual).__name__}, expected a tensor or None"
        )
    engine = keys.engine
    feedback = engine is not None and engine.error_feedback
    if call != "reduce_scatter" or not feedback:
        raise ValueError(
            f"{where}: a residual for a {call} of codec={codec!r} with "
            f"error_feedback={feedback}; expected residual=None, or reduce_scatter with "
            "error feedback"
        )
    n, block, dtype = keys.world_size, engine.codec.block, engine.residual_dtype
    numel = residual.numel()
    kept = engine.key_sizes((0, numel, PHASE_1)).get("r1")
    if numel % (n * block) or kept != numel or residual.dtype != dtype:
        raise ValueError(
            f"{where}: residual of {numel} elements of {residual.dtype}, expected {n} chunks "
            f"of whole blocks of {block} elements of {dtype}, as this configuration keeps it "
            f"({kept or 'none'} for {numel} elements)"
        )
    if not bool(torch.isfinite(residual).all()):
        raise ValueError(
            f"{where}: residual holds non-finite values, expected finite residuals (a NaN "
            "there would reach every later call)"
        )


OPS = ("mean", "sum")
# what the exact exchange ("allreduce") takes; a codec, its state's grad_dtypes
EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_tensor(where: str, name: str, t: Any, op: str, dtypes: Optional[tuple]) -> torch.Tensor:
    """``t`` flat, once it is a dense, contiguous tensor of ``dtypes`` with data, and ``op``
    one of ``"mean"``, ``"sum"``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} is a {type(t).__name__}, expected a tensor")
    dtypes = dtypes or EXACT_DTYPES
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
    if op not in OPS:
        raise ValueError(f"{where}: op={op!r}, expected 'mean' or 'sum'")
    # written as torch.distributed's collectives write: in place, outside autograd (a
    # parameter too, as dist.all_reduce(p) does)
    return t.detach().view(-1)


def check_tensors(where: str, key: Hashable, ts: Sequence[Any], op: str, dtypes) -> int:
    """The elements of a list call's tensors, once each is checked and they share one dtype
    and device (any shapes and strides: the list is copied into one flat buffer)."""
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            f"{where}: key={key!r} is not hashable; expected a str, int or tuple"
        ) from None
    if not ts:
        raise ValueError(f"{where}: tensor is an empty list, expected at least one tensor")
    for i, t in enumerate(ts):
        dense = (
            isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"
        )
        check_tensor(where, f"tensor[{i}]", t.reshape(-1) if dense else t, op, dtypes)
        if t.dtype != ts[0].dtype or t.device != ts[0].device:
            raise TypeError(
                f"{where}: tensor[{i}] is {t.dtype} on {t.device} and tensor[0] {ts[0].dtype} "
                f"on {ts[0].device}, expected one dtype and device (the list is exchanged as "
                "one flat tensor)"
            )
    return sum(t.numel() for t in ts)
