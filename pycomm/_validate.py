"""The argument checks shared by the public entry points: one message format everywhere,
``<where>: <name>=<value>, expected <what>``, raised as ValueError."""

from typing import Any, Optional

import torch


def check_int(
    where: str,
    name: str,
    value: Any,
    minimum: int = 1,
    source: str = "",
    maximum: Optional[int] = None,
) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum`` (and <= ``maximum`` when given),
    else a ValueError naming it.

    Args:
        where: who checks, e.g. ``"pycomm int8 hook"``; starts the message.
        name: the argument's name.
        value: what was given.
        minimum: the smallest value accepted.
        source: where the value came from, e.g. ``"argument"``; shown in brackets when given.
        maximum: the largest value accepted (None: no limit).

    Returns:
        ``value``, unchanged.
    """
    origin = f" ({source})" if source else ""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name}={value!r}{origin}, expected an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(
            f"{where}: {name}={value!r}{origin}, expected an int from {minimum} to {maximum}"
        )
    return value


def check_dtype(where: str, name: str, value: Any, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    """The dtype of ``allowed`` that ``value`` names, given as the dtype (``torch.bfloat16``)
    or its name (``"bfloat16"``), else a ValueError naming it and the choices."""
    for dtype in allowed:
        if value is dtype or (isinstance(value, str) and value == str(dtype).split(".")[-1]):
            return dtype
    names = " or ".join(repr(str(d).split(".")[-1]) for d in allowed)
    raise ValueError(f"{where}: {name}={value!r}, expected {names} (or the torch dtype)")


def check_bool(where: str, name: str, value: Any) -> bool:
    """``value`` if it is True or False, else a ValueError naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name}={value!r}, expected True or False")
    return value


def check_hook_args(where: str, hook: Any, hook_options: Any) -> dict:
    """A copy of ``hook_options`` (None: empty) if ``hook`` is a string and ``hook_options`` a
    dict or None, else a ValueError naming the argument. Whether the name and the options are
    the hook's is :func:`pycomm.register`'s to check."""
    if not isinstance(hook, str):  # (hook_options_of passes "": it checks the dict alone)
        raise ValueError(
            f"{where}: hook={hook!r}, expected a hook name such as 'allreduce', 'int8' or 'auto'"
        )
    if hook_options is not None and not isinstance(hook_options, dict):
        raise ValueError(
            f"{where}: hook_options={hook_options!r}, expected a dict of the hook's options or None"
        )
    return dict(hook_options or {})


def hook_options_of(where: str, hook_options: Any, legacy: dict[str, Any]) -> dict[str, Any]:
    """The options of a hook as one dict, ``hook_options={...}``, the spelling of every entry
    point (``wrap``, ``register``, the framework adapters, ``pycomm.fsdp.compress``). Options
    given as keyword arguments (``register(ddp, hook="int8", block=64)``, the older spelling)
    still work, with a FutureWarning; the same option both ways is a ValueError.

    Example:
        >>> hook_options_of("pycomm.register", {"block": 64}, {})
        {'block': 64}
    """
    options = check_hook_args(where, "", hook_options)
    if legacy:
        import warnings

        both = sorted(set(legacy) & set(options))
        if both:
            raise ValueError(
                f"{where}: option {both[0]!r} given both in hook_options and as a keyword "
                "argument; expected it once, in hook_options"
            )
        spelled = ", ".join(f"{k!r}: ..." for k in sorted(legacy))
        warnings.warn(
            f"{where}: options as keyword arguments ({', '.join(sorted(legacy))}) are "
            f"deprecated; pass hook_options={{{spelled}}}",
            FutureWarning,
            stacklevel=3,
        )
        options.update(legacy)
    return options
