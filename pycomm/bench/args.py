"""The command-line pieces the step-time bench and the quality suite share."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1, else an error naming the text."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_import_argument(group: Any) -> None:
    """``--import MODULE`` (repeatable): modules that register hooks, imported in this process
    before ``--hooks`` is read and on every rank (the bench's and the quality suite's)."""
    group.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, here and on every rank (repeatable): a module that "
        "registers hooks (pycomm.hooks.register_hook), run by name in --hooks",
    )
