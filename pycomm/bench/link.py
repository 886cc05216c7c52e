"""``--link RATE``: shape loopback to a per-rank rate inside a private network namespace.

The benchmark re-executes itself under ``unshare -n``: the new namespace has its own ``lo``
(down, no qdisc), which the child brings up and shapes with a token bucket of
``ranks x RATE``; the ranks then rendezvous on 127.0.0.1 inside it, so every byte between
them crosses the shaped ``lo`` and nothing else on the machine is slowed down or counted.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``unshare`` (util-linux) and ``tc`` (iproute2;
on Debian/Ubuntu ``apt-get install iproute2``).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Optional

# tc's rate units (iproute2 tc_util.c, matched case-insensitively); a bare number is bit/s.
_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
_RATE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

# Below this a 1 MB burst and 100 ms of queue make the shaping meaningless; above it the
# kernel's 64-bit tbf rate still copes but loopback on a CPU does not.
MIN_BITS = 10**5
# Above this (1 Tbit/s a rank) loopback on a CPU is far slower than the link: nothing is shaped.
# tc_command hands tc ranks x RATE in bit/s, which its 64-bit bytes/s rate takes up to ~1.5e20
# bit/s (iproute2's get_rate64), so 1 Tbit/s a rank leaves room for millions of ranks.
MAX_BITS = 10**12

BURST = "1mb"
LATENCY = "100ms"


def parse_rate(text: str) -> int:
    """Bits per second of a tc rate (``2.5gbit``, ``500mbit``, ``100MBps``); ValueError if not,
    or if outside :data:`MIN_BITS` to :data:`MAX_BITS` (an infinite one too).

    Example:
        >>> parse_rate("2.5gbit")
        2500000000
    """
    m = _RATE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a tc rate; expected a number and a unit such as 2.5gbit, "
            f"500mbit, 100mbps ({', '.join(u for u in _UNITS if u)})"
        )
    value = float(m.group(1)) * _UNITS[unit]  # inf for 1e400gbit
    if not math.isfinite(value) or value > MAX_BITS:
        raise ValueError(
            f"{text!r} is more than {MAX_BITS} bit/s; expected at most 1tbit (beyond it "
            "loopback on a CPU is slower than the link: nothing would be shaped)"
        )
    bits = int(value)
    if bits < MIN_BITS:
        raise ValueError(f"{text!r} is {bits} bit/s; expected at least {MIN_BITS} bit/s")
    return bits


def format_rate(bits: float) -> str:
    """``2500000000`` -> ``2.5 Gbit/s``."""
    for scale, unit in (
        (10**12, "Tbit/s"),
        (10**9, "Gbit/s"),
        (10**6, "Mbit/s"),
        (10**3, "kbit/s"),
    ):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def tc_command(total_bits: int) -> list[str]:
    """The qdisc that gives ``lo`` ``total_bits`` bit/s: every rank's traffic shares it."""
    return [
        "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
        "rate", f"{total_bits}bit", "burst", BURST, "latency", LATENCY,
    ]  # fmt: skip


def cannot_shape() -> Optional[str]:
    """Why this process cannot shape a private loopback, or None when it can try."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "shaping needs root (a private network namespace and tc)"
    missing = [tool for tool in ("unshare", "tc", "ip") if shutil.which(tool) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found (unshare is in util-linux, tc and ip in iproute2: "
            "apt-get install iproute2 util-linux)"
        )
    return None


def probe(total_bits: int) -> Optional[str]:
    """Try the namespace and the qdisc once, in a throwaway namespace; None if both work."""
    cmd = ["unshare", "-n", "--", *tc_command(total_bits)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(cmd)} failed: {exc}"
    if out.returncode != 0:
        return f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}"
    return None


def shape_loopback(total_bits: int) -> str:
    """Inside the private namespace: bring ``lo`` up and shape it; returns tc's view of it."""
    for cmd in (["ip", "link", "set", "lo", "up"], tc_command(total_bits)):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    out = subprocess.run(
        ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


def in_private_netns() -> bool:
    """True when ``lo`` is the only interface: nobody else's traffic shares its counters."""
    try:
        with open("/proc/net/dev") as f:
            names = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    except OSError:
        return False
    return names == ["lo"]


def lo_tx_bytes() -> int:
    """Bytes sent on this namespace's ``lo`` so far (-1 when unreadable)."""
    return tx_bytes("lo")


def tx_bytes(dev: str) -> int:
    """Bytes ``dev`` sent so far, in this process's network namespace (-1 when unreadable).

    /proc/net/dev is per network namespace, unlike /sys/class/net (the namespace that mounted
    sysfs).
    """
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == dev:
                    return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return -1


NETNS_FLAG = "--_in-netns"


def rerun_in_netns(argv: list[str]) -> int:
    """Re-run ``python -m pycomm.bench *argv`` in a private network namespace (``unshare -n``),
    with :data:`NETNS_FLAG` added; its exit status. The namespace has no DNS: c10d would warn
    on every connection that it cannot name the peer, so its C++ log is kept to errors."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    cmd = ["unshare", "-n", "--", sys.executable, "-m", "pycomm.bench", *argv, NETNS_FLAG]
    return subprocess.call(cmd, env=env)


def in_shaped_netns(ap: Any, rate: str, nprocs: int, in_netns: bool, argv: list[str]):
    """``--link rate`` for ``nprocs`` ranks: (the loopback's total bits, None) inside the
    private namespace; outside it, (total, the exit status of ``argv`` re-run in one,
    :func:`rerun_in_netns`), or ``ap.error`` naming why the link cannot be shaped here."""
    try:
        bits = parse_rate(rate)
    except ValueError as e:
        ap.error(f"--link {rate}: {e}")
    total = bits * nprocs
    if in_netns:
        return total, None
    reason = cannot_shape() or probe(total)
    if reason:
        ap.error(f"--link {rate}: {reason}")
    return total, rerun_in_netns(argv)
