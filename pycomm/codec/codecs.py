"""The codec protocol of pycomm's compression engine, its built-in implementations, and the
self-check a codec passes when it is registered.

A codec turns a flat gradient into codes (and optional scales) and decodes-and-sums rows of
them. The engine (:mod:`pycomm.codec.engine`, under ``pycomm.Exchange``, DDP's
:func:`pycomm.hooks.compressed_hook`, ``pycomm.fsdp`` and the outer loops) does everything
else: the two-phase exchange, error feedback (the residuals' storage, ``residual_dtype``,
keeping a step's new residuals apart until the step is known finite), ``start_iter``,
``hierarchy="node"``, the statistics, ``state_dict`` and resume, the accumulate stage and
``TrainLoop``'s norm.

The rules every codec follows (:class:`Codec` states each one):

- **Blocks and padding.** ``block`` is the unit of a chunk: every length the engine hands to
  :meth:`~Codec.encode` (``numel``) or decodes (``m``) is a multiple of ``block``. A bucket of
  ``n`` elements is padded with zeros: a one-phase codec (``two_phase=False``) to the next
  multiple of ``block``; a two-phase codec to ``N`` equal chunks, one per rank, of
  ``c = ceil(n / (N * block)) * block`` elements (``N * c`` in all, ``N`` the ranks of the
  exchange). The codec reads ``x`` (``n <= numel`` elements) as if zero-padded.
- **Scale.** ``encode`` multiplies ``x`` by ``scale`` before adding the residual (the engine
  passes ``1/N`` in phase 1, so the sum of N rows is the mean, and 1 in phase 2);
  ``decode_sum`` multiplies the sum by its ``scale``. A codec honours any scale in both.
- **Bytes.** ``code_bytes(m)`` and ``scale_bytes(m)`` are the bytes of the codes and scales of
  ``m`` elements (multiples of the dtypes' sizes); the engine packs both into one uint8 row per
  rank, so they must be exact; the engine encodes N chunks in one call and cuts them into rows,
  so the counts add up chunk by chunk and a chunk's codes and scales depend on it alone. The
  scales may start at any byte (int8 codes of an odd count before fp32 scales):
  :meth:`~Codec.split` copies a part its dtype cannot be read at.
- **The decode.** :meth:`~Codec.decode_sum` sums its rows in a fixed order and returns their
  statistics, which the non-finite skip and ``TrainLoop``'s clipping read: the decode
  contract, stated once in docs/custom_hooks.md, "The decode contract".
- **Non-finite input.** A NaN or Inf in ``x`` must decode to a non-finite value (not a finite
  one), so that every rank sees it and skips the step (:func:`check_codec` checks it). What
  the new residual holds there is the engine's concern unless the codec declares
  ``keeps_residual_on_nonfinite`` (below).
- **Devices.** Every call runs on the bucket's device (CPU or CUDA), with every tensor it
  gets and returns there; a codec never synchronizes with the host (no ``.item()``): on an
  accelerator the engine only enqueues work.

The protocol grows by capabilities a codec declares, class attributes read with a default,
never by duties that refuse a codec written before: one written against an earlier protocol
registers and trains unchanged. ``keeps_residual_on_nonfinite = True`` (every built-in codec)
declares that ``encode`` with ``residual_out=None`` updates the residual in place, with the
codes it gives with ``residual_out``, and keeps the old value where ``y`` is not finite:
:func:`check_codec` checks both, and the engine passes None (one copy of the residuals, no
extra pass). Without it (the default) the engine always passes a ``residual_out``, a scratch
buffer that it merges into the residual where the new value is finite, keeping the old one
elsewhere (a NaN in the one copy would poison every later step): one more pass over the
residual per encode and a scratch buffer the size of the largest encode, the residuals' own
memory the same.

Example:
    >>> codec = pycomm.hooks.Int8Codec(block=64)
    >>> pycomm.hooks.check_codec(codec)  # what register_hook runs on a user's codec
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pycomm import ops
from pycomm._validate import check_bool, check_dtype, check_int

__all__ = [
    "MAX_BLOCK", "Bf16Codec", "Codec", "Fp8Codec", "Fp16Codec", "HalfCodec", "Int4Codec",
    "Int8Codec", "OneBitCodec", "check_block", "onebit_advice",
]  # fmt: skip


class Codec:
    """A compression format for :func:`pycomm.hooks.compressed_hook`: subclass it (or write
    a class with the same attributes and methods) and register it with
    :func:`pycomm.hooks.register_hook`.

    Attributes:
        block: elements per scale, and the unit every chunk is padded to (a positive int).
        code_dtype: dtype of the codes (e.g. torch.int8).
        scale_dtype: dtype of the scales, or None when the format has none.
        two_phase: True (default): the two-phase exchange (each rank decodes and sums its
            chunk of every rank's codes in fp32, re-encodes the sum and sends it to all).
            False: the codes themselves are summed by one all-reduce in ``code_dtype`` (a
            linear format without scales, as fp16), then decoded once.
        keeps_residual_on_nonfinite: False (default): the engine always passes
            ``residual_out`` and keeps the old residual where the new one is not finite, at one
            more pass over it per encode. True declares that ``encode(..., residual_out=None)``
            updates ``residual`` in place, with the same codes, and keeps its old value where
            ``y`` is not finite (:func:`check_codec` checks it): no extra pass.

    Example:
        >>> class Half(pycomm.hooks.Codec):
        ...     code_dtype, block = torch.float16, 8
        ...     def code_bytes(self, m): return 2 * m
        ...     def encode(self, x, residual, scale, numel, residual_out=None): ...
        ...     def decode_sum(self, codes, scales, scale, out): ...
    """

    block: int  # set by the subclass (a class attribute or in __init__)
    code_dtype: torch.dtype
    scale_dtype: Optional[torch.dtype] = None
    two_phase: bool = True
    keeps_residual_on_nonfinite: bool = False

    def code_bytes(self, m: int) -> int:
        """Bytes of the codes of ``m`` elements (``m`` a multiple of ``block``)."""
        raise NotImplementedError

    def scale_bytes(self, m: int) -> int:
        """Bytes of the scales of ``m`` elements (0 without scales)."""
        return 0

    def encode(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        scale: float,
        numel: int,
        residual_out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Encode ``y = x * scale + residual`` over ``numel`` elements.

        Args:
            x: the flat input, fp32, bf16 or fp16, ``n <= numel`` elements (read as if
                zero-padded to ``numel``); never written.
            residual: the error-feedback residual (fp32 or bf16, ``numel`` elements), or None
                for no error feedback.
            scale: multiplies ``x`` first (the engine passes 1/N in phase 1, 1 in phase 2).
            numel: elements to encode, a multiple of ``block``.
            residual_out: where the new residual ``y - decode(codes)`` goes, every one of its
                ``numel`` elements (same size and dtype as ``residual``); what it holds where
                ``y`` is not finite does not matter. None, passed only to a codec declaring
                ``keeps_residual_on_nonfinite``: into ``residual`` in place, its old value
                kept where ``y`` is not finite (a whole block may keep it).

        Returns:
            ``(codes, scales)``: 1-D tensors of ``code_dtype`` and ``scale_dtype`` with
            ``code_bytes(numel)`` and ``scale_bytes(numel)`` bytes; scales None without a
            ``scale_dtype``.
        """
        raise NotImplementedError

    def decode_sum(
        self,
        codes: torch.Tensor,
        scales: Optional[torch.Tensor],
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Write ``out = scale * sum_r decode(codes[r], scales[r])`` for the first
        ``out.numel()`` elements, in the order and with the statistics of the decode contract
        (docs/custom_hooks.md, "The decode contract").

        Args:
            codes: ``[R, code_bytes(m) / itemsize]`` of ``code_dtype``: R rows of ``m``
                elements each; possibly a strided view (rows of a packed receive buffer).
            scales: ``[R, scale_bytes(m) / itemsize]`` of ``scale_dtype``, or None.
            scale: multiplies the sum; any float, so a codec must not assume 1.
            out: the destination, ``<= m`` elements, fp32, bf16 or fp16 (the bucket's
                dtype); may have 0 elements (the padding past a bucket's end).

        Returns:
            the statistics: float64 ``[squared norm, non-finite count]`` of ``out``, on its
            device.
        """
        raise NotImplementedError

    def pack(
        self,
        codes: torch.Tensor,
        scales: Optional[torch.Tensor],
        rows: int,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Codes and scales of ``rows`` equal chunks as one [rows, bytes] uint8 tensor (written
        into ``out`` when given)."""
        for name, t, dtype in (("codes", codes, self.code_dtype), ("scales", scales,
                                self.scale_dtype)):  # fmt: skip
            if (None if t is None else t.dtype) != dtype:
                raise ValueError(
                    f"pycomm codec {type(self).__name__}: encode returned {name} of "
                    f"{None if t is None else t.dtype}, expected its {name[:-1]}_dtype {dtype}"
                )
        nc = codes.numel() * codes.element_size()
        ns = 0 if scales is None else scales.numel() * scales.element_size()
        cb, width = nc // rows, (nc + ns) // rows
        if nc % rows or ns % rows or (out is not None and tuple(out.shape) != (rows, width)):
            expected = "" if out is None else f" into rows of {out.shape[-1]} bytes"
            raise ValueError(
                f"pycomm codec {type(self).__name__}: encode returned {nc} bytes of codes and "
                f"{ns} of scales for {rows} chunks, expected a whole row per chunk{expected} "
                "(code_bytes and scale_bytes must add up chunk by chunk: docs/custom_hooks.md)"
            )
        if out is None:
            out = torch.empty(rows, width, dtype=torch.uint8, device=codes.device)
        out[:, :cb] = codes.view(torch.uint8).view(rows, cb)
        if scales is not None:
            out[:, cb:] = scales.view(torch.uint8).view(rows, -1)
        return out

    def split(self, rows: torch.Tensor, m: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The inverse of :meth:`pack` for chunks of ``m`` elements: ``(codes, scales)``, views
        of ``rows`` with codes ``[R, code_bytes(m) / code_dtype's itemsize]`` (``[R, m]`` for
        one code per element; fewer columns for a packed format such as int4's two codes a
        byte) and scales ``[R, scale_bytes(m) / scale_dtype's itemsize]`` or None."""
        cb = self.code_bytes(m)
        # row slices, read in place by the decoders (CPU and CUDA): no copy, unless a part
        # starts at a byte its dtype cannot be read at (int8 codes of an odd block count
        # before fp32 scales): that part is copied to a buffer of its own
        codes = _viewed(rows[:, :cb], self.code_dtype)
        if self.scale_dtype is None:
            return codes, None
        return codes, _viewed(rows[:, cb:], self.scale_dtype)


def _viewed(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part`` (uint8 rows, a slice of packed rows) read as ``dtype``: a view where its
    offset and row stride are multiples of the dtype's size, else a copy."""
    size = dtype.itemsize
    if part.storage_offset() % size or (part.shape[0] > 1 and part.stride(0) % size):
        part = torch.empty(part.shape, dtype=torch.uint8, device=part.device).copy_(part)
    return part.view(dtype)


# Elements a scale covers, at most: a bucket is padded to whole blocks on every rank, so a
# larger block costs memory (and bytes) for nothing; 2^16 is already one scale per 256 KB.
MAX_BLOCK = 1 << 16


def check_block(where: str, block: Any, multiple: int, why: str = "") -> int:
    """``block`` if it is an int in [1, :data:`MAX_BLOCK`] and a multiple of ``multiple``,
    else a ValueError starting with ``where`` (``why``: the reason for the multiple). The one
    check of every built-in codec's block, whether the codec or its hook is built.

    Example:
        >>> check_block("pycomm onebit hook", 64, 8, " (8 bits a byte)")
        64
    """
    check_int(where, "block", block, 1, maximum=MAX_BLOCK)
    if block % multiple:
        what = "an even number" if multiple == 2 else f"a multiple of {multiple}"
        raise ValueError(f"{where}: block={block}, expected {what}{why}")
    return block


# --- the built-in codecs -------------------------------------------------------------


class HalfCodec(Codec):
    """fp16 or bf16 codes (``dtype``), no scales, 16-byte aligned chunks (block 8).

    ``two_phase`` (default False): one 16-bit all-reduce of the codes; True: the two-phase
    exchange, which sums in fp32.

    Example:
        >>> codec = HalfCodec(torch.bfloat16, two_phase=True)
    """

    scale_dtype = None
    keeps_residual_on_nonfinite = True  # pycomm.ops' encoders keep the rule

    def __init__(self, dtype: torch.dtype = torch.bfloat16, two_phase: bool = False) -> None:
        where = f"pycomm {type(self).__name__}"
        self.code_dtype = check_dtype(where, "dtype", dtype, (torch.bfloat16, torch.float16))
        self.two_phase = check_bool(where, "two_phase", two_phase)
        self.block = 8

    def code_bytes(self, m: int) -> int:
        return 2 * m

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.encode16(x, residual, scale, self.code_dtype, numel, residual_out), None

    def decode_sum(self, codes, scales, scale, out):
        return ops.decode16_sum(codes, scale, out)


class Bf16Codec(HalfCodec):
    """The ``bf16`` hook's codec: :class:`HalfCodec` with bf16 codes.

    Example:
        >>> codec = Bf16Codec(two_phase=True)
    """

    def __init__(self, two_phase: bool = False) -> None:
        super().__init__(torch.bfloat16, two_phase)


class Fp16Codec(HalfCodec):
    """The ``fp16`` hook's codec: :class:`HalfCodec` with fp16 codes.

    Example:
        >>> codec = Fp16Codec()
    """

    def __init__(self, two_phase: bool = False) -> None:
        super().__init__(torch.float16, two_phase)


class Int8Codec(Codec):
    """Symmetric int8 codes, one fp32 scale (absmax / 127) per ``block`` elements.

    Example:
        >>> codec = Int8Codec(block=64)
    """

    code_dtype, scale_dtype = torch.int8, torch.float32
    keeps_residual_on_nonfinite = True  # pycomm.ops' encoders keep the rule

    def __init__(self, block: int = 64) -> None:
        self.block = check_block("pycomm Int8Codec", block, 1)

    def code_bytes(self, m: int) -> int:
        return m

    def scale_bytes(self, m: int) -> int:
        return 4 * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.quantize_int8(x, residual, scale, self.block, numel, residual_out)

    def decode_sum(self, codes, scales, scale, out):
        return ops.dequantize_int8_sum(codes, scales, self.block, scale, out)


class OneBitCodec(Codec):
    """One sign bit per element, one bf16 scale (mean |y|) per ``block`` (a multiple of 8).

    Example:
        >>> codec = OneBitCodec(block=64)
    """

    code_dtype, scale_dtype = torch.uint8, torch.bfloat16
    keeps_residual_on_nonfinite = True  # pycomm.ops' encoders keep the rule

    def __init__(self, block: int = 64) -> None:
        self.block = check_block("pycomm OneBitCodec", block, 8, " (8 bits a byte)")

    def code_bytes(self, m: int) -> int:
        return m // 8

    def scale_bytes(self, m: int) -> int:
        return 2 * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.quantize_onebit(x, residual, scale, self.block, numel, residual_out)

    def decode_sum(self, codes, scales, scale, out):
        return ops.dequantize_onebit_sum(codes, scales, self.block, scale, out)


class Int4Codec(Codec):
    """Signed 4-bit codes (q in [-7, 7], two a byte: element 2k in the low nibble of byte k,
    two's complement), one scale ``s = absmax / 7`` per ``block`` elements (even; default
    128), stored as ``scale_dtype`` ("float32" or "bfloat16", or the torch dtype);
    ``q = round_half_even(y / s)``, decoded ``q * s``. Runs the fused ops
    :func:`pycomm.ops.quantize_int4` and :func:`pycomm.ops.dequantize_int4_sum`.

    Example:
        >>> codec = Int4Codec(block=128)
    """

    code_dtype = torch.uint8
    keeps_residual_on_nonfinite = True  # pycomm.ops' encoders keep the rule

    def __init__(self, block: int = 128, scale_dtype: Any = "float32") -> None:
        self.block = check_block("pycomm Int4Codec", block, 2, " (2 a byte)")
        self.scale_dtype = check_dtype(
            "pycomm Int4Codec", "scale_dtype", scale_dtype, (torch.float32, torch.bfloat16)
        )

    def code_bytes(self, m: int) -> int:
        return m // 2

    def scale_bytes(self, m: int) -> int:
        return self.scale_dtype.itemsize * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.quantize_int4(
            x, residual, scale, self.block, numel, residual_out, self.scale_dtype
        )

    def decode_sum(self, codes, scales, scale, out):
        return ops.dequantize_int4_sum(codes, scales, self.block, scale, out)


class Fp8Codec(Codec):
    """float8 e4m3 codes (``torch.float8_e4m3fn``, rounded as torch's cast rounds), one fp32
    scale ``s = absmax / 448`` per ``block`` elements; code ``fp8(y / s)``, decoded ``code * s``.
    Runs the fused ops :func:`pycomm.ops.quantize_fp8` and :func:`pycomm.ops.dequantize_fp8_sum`.

    Example:
        >>> codec = Fp8Codec(block=64)
    """

    code_dtype, scale_dtype = torch.float8_e4m3fn, torch.float32
    keeps_residual_on_nonfinite = True  # pycomm.ops' encoders keep the rule

    def __init__(self, block: int = 64) -> None:
        self.block = check_block("pycomm Fp8Codec", block, 1)

    def code_bytes(self, m: int) -> int:
        return m

    def scale_bytes(self, m: int) -> int:
        return 4 * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.quantize_fp8(x, residual, scale, self.block, numel, residual_out)

    def decode_sum(self, codes, scales, scale, out):
        return ops.dequantize_fp8_sum(codes, scales, self.block, scale, out)


# where the quality suite's figures behind onebit's advice are kept (not copied here)
_ONEBIT_FIGURES = 'benchmarks/README.md, "Training quality"'


def onebit_advice(state: Any, optimizer: Any) -> Optional[str]:
    """The ``onebit`` hook's advice: with an Adam-family optimizer or SGD with momentum,
    onebit fell behind the exact all-reduce beyond its limit in the quality suite (the figures:
    benchmarks/README.md, "Training quality"); None for plain SGD.

    Example:
        >>> onebit_advice(pycomm.hook_state(ddp), torch.optim.Adam(model.parameters()))
        'pycomm onebit hook: with an Adam-family optimizer (Adam), onebit fell behind ...'
    """
    name = type(optimizer).__name__
    if "Adam" in name:
        family = f"an Adam-family optimizer ({name})"
    elif any(g.get("momentum", 0) for g in getattr(optimizer, "param_groups", [])):
        family = f"SGD with momentum ({name})"
    else:
        return None
    where = (
        "in the quality suite (python -m pycomm.bench.quality: a character-level transformer's "
        "held-out loss, beyond onebit's limit"
    )
    if not state.error_feedback:
        return (
            f"pycomm onebit hook: without error feedback (error_feedback=False), with "
            f"{family}, onebit fell behind the exact all-reduce {where}; the figures: "
            f"{_ONEBIT_FIGURES}). Use the int8 hook for such models"
        )
    if state.local_feedback:
        return (
            f"pycomm onebit hook: error feedback on each rank's own gradient (local_feedback"
            f"=True) with {family} fell behind the exact all-reduce {where}, further than "
            f"onebit's default local_feedback=False; the figures: {_ONEBIT_FIGURES}). Use the "
            "int8 hook"
        )
    return (
        f"pycomm onebit hook: with {family}, onebit fell behind the exact all-reduce {where}; "
        f"the digits MLPs held; the figures: {_ONEBIT_FIGURES}). Use the int8 hook for such "
        "models"
    )
