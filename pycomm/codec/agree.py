"""What the ranks compare: their resolved configurations before the first collective
(:func:`agree`), an adapter's own checks (:func:`checked_everywhere`), and a saved state
against the one it is loaded into (:func:`check_saved`).

A rank's configuration is compared as it resolved it, never as the caller spelled it:
``{"block": 64}`` on one rank and ``{}`` on another, where 64 is the default, is one
configuration, while a codec name bound to another class on one node is a ValueError on every
rank naming the first difference.

Example:
    >>> agree("pycomm.Exchange", {"codec": "int8", "option 'block'": 64})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from pycomm.dist import all_gather_objects

__all__ = [
    "ERROR", "agree", "check_owner", "check_saved", "checked_everywhere", "dtype_names",
    "error_field", "first_difference", "with_strict_skip",
]  # fmt: skip

# The field a rank sets when it could not resolve its configuration (its hook or options are
# bad there): (exception type name, message); raised on every rank.
ERROR = "error"
_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}
_ABSENT = "(absent)"


def error_field(exc: Optional[BaseException]) -> dict[str, Any]:
    """The :data:`ERROR` field: the error of a rank that could not resolve its configuration,
    or None. Set it (to None) before the configuration's fields, and again on an error: the
    ranks compare it where it stands, so an error on one rank comes before the fields that
    rank could not fill in."""
    if exc is None:
        return {ERROR: None}
    kind = next((k for k, t in _ERRORS.items() if isinstance(exc, t)), "RuntimeError")
    # an error of another type (a user's codec failing in its constructor): its type named
    name = type(exc).__name__
    return {ERROR: (kind, str(exc) if name == kind else f"{name}: {exc}")}


def agree(
    where: str,
    fields: dict[str, Any],
    group: Optional[dist.ProcessGroup] = None,
    call: Optional[str] = None,
) -> None:
    """Gather every rank's ``fields`` and raise the same error on every rank at the first
    field, in order, where the ranks differ: a ValueError naming the field and each value, or,
    at the :data:`ERROR` field, the error some rank met (its type and message, with the rank
    when not every rank met it). A single rank checks its own error only. ``call`` (default
    ``where``) names the call the gather belongs to: ranks in different calls are a
    RuntimeError naming each rank's (see :func:`pycomm.dist.all_gather_objects`).

    Example:
        >>> agree("pycomm.wrap", {"hook": "int8", "hook option 'block'": 64})
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [fields] if world == 1 else all_gather_objects(fields, group, call or where)
    keys = list(dict.fromkeys(k for g in gathered for k in g))
    for key in keys:
        values = [g.get(key, _ABSENT) for g in gathered]
        if key == ERROR:
            _raise_error(where, values)
            continue
        first = next((r for r, v in enumerate(values) if v != values[0]), None)
        if first is None:
            continue
        a, b = values[0], values[first]
        if key in _TENSOR_LISTS and a != _ABSENT and b != _ABSENT:
            raise ValueError(
                f"{where}: ranks disagree on {_tensor_list_difference(a, b, first, key)}"
            )
        raise ValueError(
            f"{where}: ranks disagree on {key}: rank 0 has {a!r}, rank {first} has {b!r}"
        )


T = TypeVar("T")


def checked_everywhere(
    where: str, check: Callable[[], T], group: Optional[dist.ProcessGroup] = None
) -> T:
    """``check()`` on this rank, its ValueError or TypeError raised on every rank of ``group``
    (naming the rank when not every rank raised it): an adapter's own checks of its arguments,
    so that a refusal on one rank is not left to the others' next collective. Without a
    process group, this rank's alone. Returns what ``check()`` returned.

    Example:
        >>> options = checked_everywhere("pycomm.ray.prepare_model", lambda: dict(opts))
    """
    error: Optional[Exception] = None
    result: Any = None
    try:
        result = check()
    except (TypeError, ValueError) as e:
        error = e
    agree(where, error_field(error), group)
    return result


def _raise_error(where: str, values: list) -> None:
    failed = [(r, v) for r, v in enumerate(values) if v not in (None, _ABSENT)]
    if not failed:
        return
    rank, (kind, message) = failed[0]
    if len(failed) < len(values) or any(v != failed[0][1] for _, v in failed):
        message = f"{where}: on rank {rank}: {message.removeprefix(f'{where}: ')}"
    raise _ERRORS.get(kind, RuntimeError)(message)


# the fields that hold a model's tensors as (name, shape, dtype), and what one is called
_TENSOR_LISTS = {
    "parameters": ("trainable parameters", "parameter"),
    "buffers": ("buffers", "buffer"),
}


def _tensor_list_difference(a: list, b: list, rank: int, key: str = "parameters") -> str:
    many, one = _TENSOR_LISTS[key]
    if len(a) != len(b):
        return f"the model: rank 0 has {len(a)} {many}, rank {rank} has {len(b)}"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return (
        f"{one} {i}: rank 0 has {a[i][0]} {a[i][1]} {a[i][2]}, rank {rank} has "
        f"{b[i][0]} {b[i][1]} {b[i][2]}"
    )


_MISSING = object()


def check_saved(
    hook: str, state: dict[str, Any], fingerprint: dict[str, Any], rank: int, world_size: int
) -> None:
    """Refuse (ValueError naming the field) a saved state whose fingerprint is not
    ``fingerprint``, or that another rank or world size saved (:func:`check_owner`)."""
    differ = first_difference(state.get("fingerprint", {}), fingerprint)
    if differ is not None:
        path, theirs, mine = differ
        raise ValueError(
            f"pycomm: cannot load hook state: {path} is {theirs} in the checkpoint but {mine} here"
        )
    check_owner(hook, state, rank, world_size)


def first_difference(a: Any, b: Any, path: str = "") -> Optional[tuple[str, str, str]]:
    """The first place where ``a`` and ``b`` differ, descending into dicts in sorted key
    order (``"hook"`` first): ``(path, a's value, b's value)`` as a message names them
    (``options['block']``, ``'32'``, ``'64'``; ``absent`` for a missing key), or None when
    they are equal.

    Example:
        >>> first_difference({"options": {"block": 32}}, {"options": {"block": 64}})
        ("options['block']", '32', '64')
    """
    if isinstance(a, dict) and isinstance(b, dict):
        # "hook" first: another hook is named before the options it does not have
        for key in sorted(set(a) | set(b), key=lambda k: (k != "hook", repr(k))):
            sub = f"{path}[{key!r}]" if path else str(key)
            found = first_difference(a.get(key, _MISSING), b.get(key, _MISSING), sub)
            if found is not None:
                return found
        return None
    if a is _MISSING or b is _MISSING or a != b:
        show = lambda v: "absent" if v is _MISSING else repr(v)  # noqa: E731
        return path or "the fingerprint", show(a), show(b)
    return None


def check_owner(hook: str, state: dict[str, Any], rank: int, world_size: int) -> None:
    """Refuse (ValueError naming both) a state dict saved by another rank or world size.
    State dicts of older versions, which did not record their rank, are accepted."""
    saved_rank, saved_world = state.get("rank"), state.get("world_size")
    if saved_world is not None and saved_world != world_size:
        raise ValueError(
            f"pycomm {hook} hook: cannot load hook state of world_size={saved_world} into "
            f"world_size={world_size}: the state is per rank"
        )
    if saved_rank is not None and saved_rank != rank:
        raise ValueError(
            f"pycomm {hook} hook: cannot load the hook state of rank {saved_rank} on rank "
            f"{rank}: error-feedback residuals differ per rank; hand each rank its own "
            "(pycomm.checkpoint.load_hook_state does)"
        )


def dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    """``float32, bfloat16 or float16``: dtypes as an error message lists them."""
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def with_strict_skip(state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A checkpoint of a version without ``strict_skip`` (which kept two copies) as one with
    this state's: its residuals are those of either way."""
    options = state.get("fingerprint", {}).get("options")
    if isinstance(options, dict) and "strict_skip" not in options:
        fingerprint = {**state["fingerprint"], "options": {**options, "strict_skip": strict}}
        state = {**state, "fingerprint": fingerprint}
    return state
