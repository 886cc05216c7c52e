"""pycomm's DDP communication hooks, their states, the codec protocol and the hook registry.

Every hook here works with ``ddp.register_comm_hook(state, hook)``; ``pycomm.wrap`` and
``pycomm.register`` take a registered name (:func:`register_hook`), a :class:`HookState`
instance, or a ``(state, hook)`` pair.
"""

import torch

from pycomm.hooks.accumulate import AccumulateState, accumulate_hook
from pycomm.hooks.allreduce import AllreduceState, allreduce_hook
from pycomm.hooks.auto import AutoState, auto_hook
from pycomm.hooks.bucket import Bucket
from pycomm.hooks.codec import (
    Codec,
    Fp8Codec,
    HalfCodec,
    Int4Codec,
    Int8Codec,
    OneBitCodec,
    check_codec,
)
from pycomm.hooks.compressed import CompressedState, compressed_hook
from pycomm.hooks.lowprec import Bf16State, Fp16State
from pycomm.hooks.powersgd import PowerSGDHookState, powersgd_hook
from pycomm.hooks.quantized import Fp8State, Int4State, Int8State, OneBitState
from pycomm.hooks.registry import HookSpec, hook_names, hook_spec, register_hook, unregister_hook
from pycomm.hooks.state import HookState

# The built-in hooks, in auto's order of exactness (the tie-break): the most exact first.
# The codec factories are the hooks' codecs at their defaults, for auto's cost model.
register_hook(
    "allreduce", AllreduceState, allreduce_hook, auto=True, description="exact fp32 all-reduce"
)
for _name, _state, _codec, _text in (
    ("bf16", Bf16State, lambda: HalfCodec(torch.bfloat16), "bf16 all-reduce"),
    ("fp16", Fp16State, lambda: HalfCodec(torch.float16), "fp16 all-reduce"),
    (
        "int8",
        Int8State,
        lambda: Int8Codec(Int8State.default_block),
        "int8 codes, a fp32 scale per 64, error feedback, two-phase exchange",
    ),
    (
        "fp8",
        Fp8State,
        lambda: Fp8Codec(Fp8State.default_block),
        "float8 e4m3 codes, a fp32 scale per 64, error feedback, two-phase exchange",
    ),
    (
        "int4",
        Int4State,
        lambda: Int4Codec(Int4State.default_block),
        "int4 codes (two a byte), a fp32 scale per 128, error feedback, two-phase exchange",
    ),
    (
        "onebit",
        OneBitState,
        lambda: OneBitCodec(OneBitState.default_block),
        "sign bits, a bf16 scale per 64, error feedback, two-phase exchange",
    ),
):
    register_hook(_name, _state, compressed_hook, codec=_codec, auto=True, description=_text)
del _name, _state, _codec, _text
register_hook("powersgd", PowerSGDHookState, powersgd_hook, description="torch's PowerSGD")
register_hook("auto", AutoState, auto_hook, description="measured choice among the hooks above")

__all__ = [
    "AccumulateState",
    "accumulate_hook",
    "AllreduceState",
    "AutoState",
    "auto_hook",
    "Bf16State",
    "Bucket",
    "Codec",
    "CompressedState",
    "check_codec",
    "HalfCodec",
    "Fp16State",
    "Fp8Codec",
    "Fp8State",
    "HookSpec",
    "hook_names",
    "hook_spec",
    "Int4Codec",
    "Int4State",
    "Int8Codec",
    "Int8State",
    "OneBitCodec",
    "OneBitState",
    "compressed_hook",
    "HookState",
    "PowerSGDHookState",
    "allreduce_hook",
    "powersgd_hook",
    "register_hook",
    "unregister_hook",
]
