"""The argument checks shared by the public entry points: one message format everywhere,
``<where>: <name>=<value>, expected <what>``, raised as ValueError."""

from typing import Any


def check_int(where: str, name: str, value: Any, minimum: int = 1, source: str = "") -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else a ValueError naming it.

    Args:
        where: who checks, e.g. ``"pycomm int8 hook"``; starts the message.
        name: the argument's name.
        value: what was given.
        minimum: the smallest value accepted.
        source: where the value came from, e.g. ``"argument"``; shown in brackets when given.

    Returns:
        ``value``, unchanged.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        origin = f" ({source})" if source else ""
        raise ValueError(f"{where}: {name}={value!r}{origin}, expected an int >= {minimum}")
    return value


def check_bool(where: str, name: str, value: Any) -> bool:
    """``value`` if it is True or False, else a ValueError naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name}={value!r}, expected True or False")
    return value
