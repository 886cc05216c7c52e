"""pycomm's DDP communication hooks and their states, usable with ``ddp.register_comm_hook``."""

from pycomm.hooks.allreduce import AllreduceState, allreduce_hook
from pycomm.hooks.powersgd import PowerSGDHookState, powersgd_hook
from pycomm.hooks.state import HookState

__all__ = [
    "AllreduceState",
    "HookState",
    "PowerSGDHookState",
    "allreduce_hook",
    "powersgd_hook",
]
