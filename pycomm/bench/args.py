"""The command-line pieces the step-time bench and the quality suite share."""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional


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


def positive_float(what: str) -> Any:
    """argparse type: a positive finite number of ``what`` (e.g. "seconds"), else an error
    naming the text."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of {what}")
        return value

    return parse


def check_output_paths(
    ap: argparse.ArgumentParser, json_path: Optional[str], plot_path: Optional[str] = None
) -> None:
    """``--json`` and ``--plot`` writable, and ``--plot``'s format one matplotlib writes,
    before any rank starts (a run's results are not lost at its end): an argparse error naming
    the flag. A file that did not exist is not left behind."""
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            ap.error(f"{flag} {path}: the folder {folder} does not exist")
        if os.path.isdir(path):
            ap.error(f"{flag} {path}: is a folder, expected a file name")
        existed = os.path.exists(path)
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            ap.error(f"{flag} {path}: cannot be written ({e.strerror or e})")
        if not existed:
            os.remove(path)
    if plot_path:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            ap.error(f"--plot {plot_path}: needs matplotlib (pip install matplotlib)")
        formats = Figure().canvas.get_supported_filetypes()
        ext = os.path.splitext(plot_path)[1].lstrip(".").lower()
        if ext and ext not in formats:
            ap.error(
                f"--plot {plot_path}: matplotlib does not write .{ext}; expected one of "
                f"{', '.join('.' + f for f in sorted(formats))}"
            )
