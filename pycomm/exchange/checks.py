"""What an :class:`~pycomm.exchange.Exchange` loads, checked (a state, a key's history) and
its refusals named as the Exchange's: every refusal a TypeError or ValueError that names the
call, the argument and what was expected. A call's own arguments are checked where the call is
made (:mod:`pycomm.exchange.core`)."""

from __future__ import annotations

from typing import Any

import torch

from pycomm.codec.residuals import PHASE_1

__all__ = [
    "CALLS", "as_exchange", "loadable", "residual",
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
