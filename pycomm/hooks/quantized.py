"""8-bit, fp8, 4-bit and 1-bit hooks with error feedback, over the two-phase all-reduce."""

from typing import Any, Optional

import torch

from pycomm._validate import check_dtype
from pycomm.hooks.codec import (
    Codec,
    Fp8Codec,
    Int4Codec,
    Int8Codec,
    OneBitCodec,
    check_block,
)
from pycomm.hooks.compressed import CompressedState


class Int8State(CompressedState):
    """State of the ``int8`` hook: symmetric int8 codes, one fp32 scale (absmax / 127) per
    ``block`` elements (default 64), error feedback on by default.

    The default block is 64: with 256, one large gradient in a block flattened the small ones
    of a transformer's, and plain SGD fell 2.4% of the loss behind the exact all-reduce in the
    quality suite (0.4% with 64, for 4.6% more bytes: a 4-byte scale per 64 codes).

    Example:
        >>> ddp.register_comm_hook(Int8State(None, block=64), compressed_hook)
    """

    hook_name = "int8"
    option_names = (*CompressedState.option_names, "block")
    default_bucket_cap_mb = 8.0  # as the 16-bit hooks; onebit keeps DDP's 25 MB (faster)
    default_block = 64

    def make_codec(self, options: dict[str, Any]) -> Codec:
        return Int8Codec(check_block(self.where, options.get("block", self.default_block), 1))

    def options(self) -> dict[str, Any]:
        return {**super().options(), "block": self.codec.block}


class Fp8State(CompressedState):
    """State of the ``fp8`` hook: float8 e4m3 codes (``torch.float8_e4m3fn``), one fp32
    scale (absmax / 448) per ``block`` elements (default 64: the bytes of int8's), error
    feedback on by default.

    Example:
        >>> ddp.register_comm_hook(Fp8State(None, block=64), compressed_hook)
    """

    hook_name = "fp8"
    option_names = (*CompressedState.option_names, "block")
    default_bucket_cap_mb = 8.0
    default_block = 64

    def make_codec(self, options: dict[str, Any]) -> Codec:
        return Fp8Codec(check_block(self.where, options.get("block", self.default_block), 1))

    def options(self) -> dict[str, Any]:
        return {**super().options(), "block": self.codec.block}


_SCALE_DTYPES = (torch.float32, torch.bfloat16)


class Int4State(CompressedState):
    """State of the ``int4`` hook: signed 4-bit codes (two a byte, q in [-7, 7]), one scale
    (absmax / 7) per ``block`` elements (default 128, even: the block that held int8's limits
    on every task and optimizer of the quality suite, where 64 did not), stored as
    ``scale_dtype`` ("float32", the default, or "bfloat16", or the torch dtype), error feedback
    on by default.

    Example:
        >>> ddp.register_comm_hook(Int4State(None, block=128), compressed_hook)
    """

    hook_name = "int4"
    option_names = (*CompressedState.option_names, "block", "scale_dtype")
    default_bucket_cap_mb = 8.0
    default_block = 128
    default_scale_dtype = "float32"

    def make_codec(self, options: dict[str, Any]) -> Codec:
        block = check_block(self.where, options.get("block", self.default_block), 2, " (2 a byte)")
        scale = options.get("scale_dtype", self.default_scale_dtype)
        return Int4Codec(block, check_dtype(self.where, "scale_dtype", scale, _SCALE_DTYPES))

    def options(self) -> dict[str, Any]:
        scale = str(self.codec.scale_dtype).split(".")[-1]
        return {**super().options(), "block": self.codec.block, "scale_dtype": scale}


class OneBitState(CompressedState):
    """State of the ``onebit`` hook: one sign bit per element, one bf16 scale (mean |x|) per
    ``block`` elements (default 64, a multiple of 8). Error feedback on the re-encoded reduced
    chunk (phase 2) only (``local_feedback=False``) and the exact all-reduce for the first 20
    iterations (``start_iter=20``) by default: with each rank's own residual, or without the
    warm-up, it fell further behind the exact all-reduce in the quality suite. Even so it falls
    behind on a small transformer with SGD with momentum and with Adam: it warns at such an
    optimizer's first step, whatever the training loop (:meth:`optimizer_advice`; README,
    "Choosing a hook").

    Example:
        >>> ddp.register_comm_hook(OneBitState(None, block=64), compressed_hook)
    """

    hook_name = "onebit"
    option_names = (*CompressedState.option_names, "block")
    default_local_feedback = False
    default_start_iter = 20
    default_block = 64

    def make_codec(self, options: dict[str, Any]) -> Codec:
        block = check_block(
            self.where, options.get("block", self.default_block), 8, " (8 bits a byte)"
        )
        return OneBitCodec(block)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "block": self.codec.block}

    def optimizer_advice(self, optimizer: Any) -> Optional[str]:
        name = type(optimizer).__name__
        # held-out loss above the exact all-reduce's on the quality suite's transformer (full
        # run, seeds 0-2): (local_feedback=True, defaults, start_iter=40, error_feedback=False)
        if "Adam" in name:
            family, local, default, longer, plain = (
                f"an Adam-family optimizer ({name})", "+11%", "+5.3%", "+4.9%", "+6.1%",
            )  # fmt: skip
        elif any(g.get("momentum", 0) for g in getattr(optimizer, "param_groups", [])):
            family, local, default, longer, plain = (
                f"SGD with momentum ({name})", "diverging", "+3.9%", "+3.4%", "+3.3%",
            )  # fmt: skip
        else:
            return None
        where = (
            "in the quality suite (python -m pycomm.bench.quality, 4 ranks, a character-level "
            "transformer: held-out loss "
        )
        if not self.error_feedback:
            return (
                f"pycomm onebit hook: without error feedback (error_feedback=False), with "
                f"{family}, onebit fell behind the exact all-reduce {where}{plain} after 150 "
                "steps, against a 3% limit). Use the int8 hook for such models"
            )
        if self.local_feedback:
            return (
                f"pycomm onebit hook: error feedback on each rank's own gradient (local_feedback"
                f"=True) with {family} fell behind the exact all-reduce {where}{local}; "
                f"{default} with onebit's default local_feedback=False). Use the int8 hook"
            )
        return (
            f"pycomm onebit hook: with {family}, onebit fell behind the exact all-reduce {where}"
            f"{default} after 150 steps, against a 3% limit; {longer} with start_iter=40; the "
            "digits MLPs held within 1 point). Use the int8 hook for such models"
        )
