"""The codec layer: what every user of a codec stands on.

- The :class:`Codec` protocol, the built-in codecs (bf16, fp16, int8, fp8, int4, onebit) and
  the self-check a codec passes when registered (:func:`check_codec`).
- One registry keyed by codec name (:func:`register_codec`, :func:`codec_names`), read by
  ``pycomm.Exchange``, DDP's hooks, ``pycomm.fsdp`` and the outer loops alike.
- The engine (:mod:`pycomm.codec.engine`): encode, exchange and decode of tensors by key and
  step, the error-feedback residuals and their non-finite rule (:mod:`pycomm.codec.residuals`),
  the bytes each call sent.
- The process groups of the exchanges (:mod:`pycomm.codec.groups`) and what the ranks compare
  (:mod:`pycomm.codec.agree`).

It imports nothing of pycomm above it: the exchange, DDP's hooks, FSDP2 and the outer loops
stand on it side by side.

Example:
    >>> pycomm.codec.register_codec("topk", TopKCodec, description="top-k, 1%")
    >>> pycomm.codec.codec_names()[-1]
    'topk'
"""

from pycomm.codec.check import check_codec
from pycomm.codec.codecs import (
    Bf16Codec,
    Codec,
    Fp8Codec,
    Fp16Codec,
    HalfCodec,
    Int4Codec,
    Int8Codec,
    OneBitCodec,
    onebit_advice,
)
from pycomm.codec.registry import (
    CodecSpec,
    codec_names,
    codec_spec,
    register_codec,
    unregister_codec,
)

__all__ = [
    "Bf16Codec",
    "Codec",
    "CodecSpec",
    "Fp16Codec",
    "Fp8Codec",
    "HalfCodec",
    "Int4Codec",
    "Int8Codec",
    "OneBitCodec",
    "check_codec",
    "codec_names",
    "codec_spec",
    "register_codec",
    "unregister_codec",
]

# The built-in codecs, in auto's order of exactness (the tie-break): the most exact first,
# registered as a user's are. bucket_cap_mb: pycomm.wrap's DDP bucket size for them
# (docs/reference.md, "The DDP bucket size"); onebit keeps DDP's.
for _name, _codec in (("bf16", Bf16Codec), ("fp16", Fp16Codec)):
    register_codec(
        _name,
        _codec,
        auto=True,
        defaults={"error_feedback": False},
        bucket_cap_mb=8.0,
        description=f"{_name} all-reduce",
    )
for _name, _codec, _text in (
    ("int8", Int8Codec, "int8 codes, a fp32 scale per 64"),
    ("fp8", Fp8Codec, "float8 e4m3 codes, a fp32 scale per 64"),
    ("int4", Int4Codec, "int4 codes (two a byte), a fp32 scale per 128"),
):
    register_codec(
        _name,
        _codec,
        auto=True,
        bucket_cap_mb=8.0,
        description=f"{_text}, error feedback, two-phase exchange",
    )
del _name, _codec, _text
# error feedback on the reduced chunk alone and 20 exact iterations: with each rank's own
# residual, or without the warm-up, onebit fell further behind the exact all-reduce in the
# quality suite (benchmarks/README.md, "Training quality"); and it advises against momentum
# and Adam (onebit_advice)
register_codec(
    "onebit",
    OneBitCodec,
    auto=True,
    defaults={"start_iter": 20, "local_feedback": False},
    advice=onebit_advice,
    description="sign bits, a bf16 scale per 64, error feedback, two-phase exchange",
)
