"""pycomm's DDP communication hooks and their states, usable with ``ddp.register_comm_hook``."""

from pycomm.hooks.accumulate import AccumulateState, accumulate_hook
from pycomm.hooks.allreduce import AllreduceState, allreduce_hook
from pycomm.hooks.auto import AutoState, auto_hook
from pycomm.hooks.compressed import CompressedState, compressed_hook
from pycomm.hooks.lowprec import Bf16State, Fp16State
from pycomm.hooks.powersgd import PowerSGDHookState, powersgd_hook
from pycomm.hooks.quantized import Int8State, OneBitState
from pycomm.hooks.state import HookState

__all__ = [
    "AccumulateState",
    "accumulate_hook",
    "AllreduceState",
    "AutoState",
    "auto_hook",
    "Bf16State",
    "CompressedState",
    "Fp16State",
    "Int8State",
    "OneBitState",
    "compressed_hook",
    "HookState",
    "PowerSGDHookState",
    "allreduce_hook",
    "powersgd_hook",
]
