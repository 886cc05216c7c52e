"""pycomm: DDP communication hooks that send fewer bytes, and get the numbers right.

Example:
    >>> import pycomm
    >>> info = pycomm.init()                      # torchrun, SLURM or a single process
    >>> ddp = pycomm.wrap(model.to(info.device), hook="allreduce")
"""

from pycomm import checkpoint, codec, hooks, ops
from pycomm.dist import DistInfo, init, shutdown
from pycomm.exchange import Exchange, Work
from pycomm.hsdp import cross_node_group, node_group
from pycomm.launcher import LaunchError, launch
from pycomm.outer import DiLoCo, LocalSGD
from pycomm.topology import Topology, topology
from pycomm.train import TrainLoop
from pycomm.wrap import hook_state, register, wrap

__version__ = "0.1.0"

__all__ = [
    "DiLoCo",
    "DistInfo",
    "Exchange",
    "LaunchError",
    "LocalSGD",
    "Topology",
    "TrainLoop",
    "Work",
    "checkpoint",
    "codec",
    "cross_node_group",
    "hook_state",
    "hooks",
    "init",
    "launch",
    "node_group",
    "ops",
    "register",
    "shutdown",
    "topology",
    "wrap",
]
