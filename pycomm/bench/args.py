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


def positive_float(
    what: str, most: Optional[float] = None, least: Optional[float] = None, why: str = ""
) -> Any:
    """argparse type: a positive finite number of ``what`` (e.g. "seconds"), at least ``least``
    and at most ``most`` when given (``why``: what sets those bounds, for the message), else an
    error naming the text.

    Example:
        >>> positive_float("MB", most=1e6)("64")
        64.0
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of {what}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(
                f"{text!r} is more than {most:g} {what}; expected at most {most:g}{why}"
            )
        if least is not None and value < least:
            raise argparse.ArgumentTypeError(
                f"{text!r} is less than {least:g} {what}; expected at least {least:g}{why}"
            )
        return value

    return parse


# What pycomm.launch (pycomm.dist.to_timedelta) takes as a timeout: a timedelta of at least a
# microsecond (its resolution) and at most 1e9 seconds.
TIMEOUT_S = (1e-6, 1e9)


def timeout_seconds() -> Any:
    """argparse type of a launch's ``--timeout``: seconds that pycomm.launch takes."""
    least, most = TIMEOUT_S
    return positive_float("seconds", most, least, " (what pycomm.launch takes as a timeout)")


# Memory a rank takes before any model: the interpreter, torch, the process group (about).
RANK_RUNTIME_BYTES = 500 * 10**6


def available_memory() -> Optional[int]:
    """Bytes of memory available to new processes (MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(
    ap: argparse.ArgumentParser,
    what: str,
    need: int,
    have: Optional[int],
    where: str = "available",
    advice: str = "pick fewer --hooks or --nprocs or a smaller model",
) -> None:
    """An argparse error when a run needs more memory than there is (``have`` None: unknown,
    no error): ``what`` names the flags that drive the need and how it adds up.

    Example:
        >>> check_memory(argparse.ArgumentParser(), "--nprocs 4: 4 ranks", 2 * 10**9, 10**10)
    """
    if have is not None and need > have:
        ap.error(f"{what} need about {need / 1e9:.1f} GB, {have / 1e9:.1f} GB is {where}; {advice}")


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
