"""``--nodes M``: ranks split into M simulated nodes, each in its own network namespace.

Inside the bench's private namespace (``unshare -n``, see :mod:`pycomm.bench.link`) the bench
starts M holder processes, each in a fresh network namespace of its own: a node. A veth pair
joins each node to a bridge in the bench's namespace, the switch. Ranks of one node talk over
their node's address, which the kernel routes through the node's own ``lo``: unshaped, as
inside a real node. Traffic between nodes leaves through the node's veth, shaped by a token
bucket to RATE (the node's uplink, shared by its ranks), and enters the other node through
the switch's end of its veth, shaped to RATE as well (the downlink). The bytes a node sends
across its uplink are the veth's transmit counter, read inside the node.

Each rank enters its node's namespace first thing, before it joins the process group
(``setns`` on the holder's ``/proc/PID/ns/net``), and sees torchrun's multi-node variables:
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``. The holders exit
when the bench closes their stdin, or dies: the namespaces vanish with them.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from typing import Optional

from pycomm.bench.link import BURST, LATENCY

SUBNET = "10.78.0"
SWITCH_ADDR = f"{SUBNET}.254"
_CLONE_NEWNET = 0x40000000


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _tbf(dev: str, bits: int) -> list[str]:
    return [
        "tc", "qdisc", "add", "dev", dev, "root", "tbf",
        "rate", f"{bits}bit", "burst", BURST, "latency", LATENCY,
    ]  # fmt: skip


def node_iface(node: int) -> str:
    """The node's end of its veth: its uplink."""
    return f"pcn{node}"


class Nodes:
    """M node namespaces joined by a bridge, each uplink shaped to ``bits`` bit/s; a context
    manager that removes everything it made.

    Example:
        >>> with Nodes(2, 2_500_000_000) as nodes:
        ...     pycomm.launch(fn, 4, setup=nodes.setup(4))
    """

    def __init__(self, count: int, bits: int) -> None:
        self.count, self.bits = count, bits
        self.holders: list[subprocess.Popen] = []
        self.qdiscs: dict[str, str] = {}

    def __enter__(self) -> Nodes:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _run(["ip", "link", "set", "lo", "up"])
        _run(["ip", "link", "add", "pcbr", "type", "bridge"])
        _run(["ip", "addr", "add", f"{SWITCH_ADDR}/24", "dev", "pcbr"])
        _run(["ip", "link", "set", "pcbr", "up"])
        for i in range(self.count):
            holder = subprocess.Popen(
                ["unshare", "-n", "--", "sh", "-c", "read _"], stdin=subprocess.PIPE
            )
            self.holders.append(holder)
            node, switch = node_iface(i), f"pcs{i}"
            _run(["ip", "link", "add", node, "type", "veth", "peer", "name", switch])
            _run(["ip", "link", "set", switch, "master", "pcbr", "up"])
            _run(_tbf(switch, self.bits))  # the node's downlink
            _run(["ip", "link", "set", node, "netns", str(holder.pid)])
            inside = ["nsenter", "-t", str(holder.pid), "-n", "--"]
            _run([*inside, "ip", "link", "set", "lo", "up"])
            _run([*inside, "ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", node])
            _run([*inside, "ip", "link", "set", node, "up"])
            _run([*inside, *_tbf(node, self.bits)])  # the node's uplink
            self.qdiscs[node] = _run([*inside, "tc", "qdisc", "show", "dev", node]).strip()

    def setup(self, nprocs: int) -> NodeSetup:
        """What each rank runs before it joins the process group (picklable)."""
        return NodeSetup([h.pid for h in self.holders], nprocs)

    def close(self) -> None:
        for h in self.holders:
            try:
                h.stdin.close()
                h.wait(timeout=10)
            except (OSError, subprocess.SubprocessError):
                h.kill()
        self.holders = []
        subprocess.run(["ip", "link", "del", "pcbr"], capture_output=True, timeout=30)


class NodeSetup:
    """Puts rank r into node r // (nprocs / M)'s namespace with torchrun's multi-node variables,
    the rendezvous on the switch's address and gloo on the node's uplink."""

    def __init__(self, pids: list[int], nprocs: int) -> None:
        self.pids, self.nprocs = pids, nprocs

    def __call__(self, rank: int) -> None:
        m = len(self.pids)
        per = self.nprocs // m
        node = rank // per
        fd = os.open(f"/proc/{self.pids[node]}/ns/net", os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into node {node}'s namespace: {os.strerror(err)}")
        finally:
            os.close(fd)
        os.environ.update(
            GROUP_RANK=str(node),
            GROUP_WORLD_SIZE=str(m),
            LOCAL_RANK=str(rank % per),
            LOCAL_WORLD_SIZE=str(per),
            MASTER_ADDR=SWITCH_ADDR,
            GLOO_SOCKET_IFNAME=node_iface(node),
            PYCOMM_BENCH_UPLINK=node_iface(node),
        )


def uplink() -> Optional[str]:
    """This rank's uplink when it is the first rank of a simulated node (it reads the counter),
    else None."""
    dev = os.environ.get("PYCOMM_BENCH_UPLINK")
    return dev if dev and os.environ.get("LOCAL_RANK") == "0" else None
