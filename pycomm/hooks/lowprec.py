"""16-bit hooks: fp16 and bf16, on every backend (torch's bf16 hook refuses gloo)."""

from typing import Any

import torch

from pycomm._validate import check_bool
from pycomm.hooks.codec import Codec, HalfCodec
from pycomm.hooks.compressed import CompressedState


class _HalfState(CompressedState):
    """Options: ``two_phase`` (default False: one 16-bit all-reduce; True: the two-phase
    exchange that sums in fp32), ``error_feedback`` (default False), ``start_iter`` (2)."""

    dtype: torch.dtype
    default_error_feedback = False
    # 8 MB buckets start sending while backward runs: 16% faster steps than DDP's 25 MB at
    # 2.5 Gbit/s (benchmarks/README.md), where the wire, not the codec, is the cost.
    default_bucket_cap_mb = 8.0
    option_names = (*CompressedState.option_names, "two_phase")

    def make_codec(self, options: dict[str, Any]) -> Codec:
        two_phase = check_bool(self.where, "two_phase", options.get("two_phase", False))
        return HalfCodec(self.dtype, two_phase=two_phase)

    @property
    def two_phase(self) -> bool:
        """Whether this hook takes the two-phase exchange (its codec's ``two_phase``)."""
        return self.codec.two_phase

    def options(self) -> dict[str, Any]:
        return {**super().options(), "two_phase": self.two_phase}


class Fp16State(_HalfState):
    """State of the ``fp16`` hook (:func:`pycomm.hooks.compressed_hook`).

    Example:
        >>> ddp.register_comm_hook(Fp16State(None), compressed_hook)
    """

    hook_name, dtype = "fp16", torch.float16


class Bf16State(_HalfState):
    """State of the ``bf16`` hook (:func:`pycomm.hooks.compressed_hook`).

    Example:
        >>> ddp.register_comm_hook(Bf16State(None, two_phase=True), compressed_hook)
    """

    hook_name, dtype = "bf16", torch.bfloat16
