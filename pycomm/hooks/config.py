"""What the ranks compare before a hook's first collective: each rank's resolved configuration,
never the options as the caller spelled them.

A rank's configuration is the hook's name, what it is (:meth:`HookState.identity`: its state
class and, for a codec hook, the codec's class and format) and every option with its default
filled in (:meth:`HookState.options`). ``pycomm.wrap``, ``pycomm.register`` (and so the
framework adapters, which call it) and ``pycomm.fsdp.compress`` build the state unbound
(:func:`pycomm.hooks.ddp.unbound`), gather every rank's fields with
:func:`pycomm.codec.agree.agree`, and bind only once they agree: so ``{"block": 64}`` on one
rank and ``{}`` on another, where 64 is the default, is one configuration, while a hook name
bound to another codec on one node, or a codec with another default there, is a ValueError on
every rank that names the first difference.

Example:
    >>> with pycomm.hooks.ddp.unbound():
    ...     state = pycomm.hooks.hook_spec("int8").state(None)
    >>> resolved_config(state)["hook option 'block'"]
    64
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pycomm.codec.registry import qualified_name
from pycomm.hooks.ddp import HookState

__all__ = ["resolved_config"]


def resolved_config(state: HookState, fn: Optional[Callable] = None) -> dict[str, Any]:
    """The fields every rank must agree on for ``state`` (and its hook function ``fn``): the
    hook's name, :meth:`~HookState.identity`, the function, and one field per resolved option.

    Example:
        >>> resolved_config(pycomm.hooks.hook_spec("int8").state(None))["codec"]
        'pycomm.codec.codecs.Int8Codec'
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
