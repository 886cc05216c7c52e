"""What the ranks compare before a hook's first collective: each rank's resolved configuration,
never the options as the caller spelled them.

A rank's configuration is the hook's name, what it is (:meth:`HookState.identity`: its state
class and, for a codec hook, the codec's class and format) and every option with its default
filled in (:meth:`HookState.options`). ``pycomm.wrap``, ``pycomm.register`` (and so the
framework adapters, which call it) and ``pycomm.fsdp.compress`` build the state unbound
(:func:`pycomm.hooks.state.unbound`), gather every rank's fields with :func:`agree`, and bind
only once they agree: so ``{"block": 64}`` on one rank and ``{}`` on another, where 64 is the
default, is one configuration, while a hook name bound to another codec on one node, or a codec
with another default there, is a ValueError on every rank that names the first difference.

Example:
    >>> with pycomm.hooks.state.unbound():
    ...     state = pycomm.hooks.hook_spec("int8").state(None)
    >>> resolved_config(state)["hook option 'block'"]
    64
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from pycomm.dist import all_gather_objects
from pycomm.hooks.registry import qualified_name
from pycomm.hooks.state import HookState

__all__ = ["agree", "checked_everywhere", "error_field", "resolved_config"]

# The field a rank sets when it could not resolve its configuration (its hook or options are
# bad there): (exception type name, message); raised on every rank.
ERROR = "error"
_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}
_ABSENT = "(absent)"


def resolved_config(state: HookState, fn: Optional[Callable] = None) -> dict[str, Any]:
    """The fields every rank must agree on for ``state`` (and its hook function ``fn``): the
    hook's name, :meth:`~HookState.identity`, the function, and one field per resolved option.

    Example:
        >>> resolved_config(pycomm.hooks.hook_spec("int8").state(None))["codec"]
        'pycomm.hooks.codec.Int8Codec'
    """
    identity = state.identity()
    # what the options decide after them (the codec's format, auto's candidates, which its
    # allow option lists): a difference in both is named as the option
    late = {
        k: identity.pop(k)
        for k in list(identity)
        if k == "codec format" or k.startswith("auto candidate ")
    }
    fields: dict[str, Any] = {"hook": state.hook_name, **identity}
    if fn is not None:
        fields["hook function"] = qualified_name(fn)
    for key, value in state.options().items():
        fields[f"hook option {key!r}"] = value
    return {**fields, **late}


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
