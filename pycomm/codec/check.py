"""The self-check a codec passes when it is registered (:func:`check_codec`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from pycomm.codec.codecs import MAX_BLOCK

__all__ = ["check_codec"]


def _fail(where: str, what: str) -> None:
    raise ValueError(f"{where}: {what}")


def _run(where: str, call: str, fn: Callable[..., Any], *args: Any) -> Any:
    """One call of the codec under the self-check: what it raises is reported with the call."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any error of the codec's own code
        raise ValueError(f"{where}: {call} raised {type(exc).__name__}: {exc}") from exc


def _check_bytes(where: str, codec: Any, name: str, m: int, dtype) -> int:
    nbytes = _run(where, f"{name}({m})", getattr(codec, name), m)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        _fail(where, f"{name}({m}) returned {nbytes!r}, expected a non-negative int")
    if dtype is None and nbytes:
        _fail(where, f"{name}({m}) returned {nbytes} with scale_dtype None, expected 0")
    size = 1 if dtype is None else dtype.itemsize
    if nbytes % size:
        _fail(where, f"{name}({m}) returned {nbytes}, expected a multiple of {size} ({dtype})")
    return nbytes


def _check_out(where: str, call: str, name: str, t: Any, dtype, nbytes: int, device) -> None:
    if dtype is None:
        if t is not None:
            _fail(where, f"{call} returned {name} {type(t).__name__}, expected None")
        return
    if not isinstance(t, torch.Tensor):
        _fail(where, f"{call} returned {name}={type(t).__name__}, expected a tensor")
    if t.dtype != dtype or t.dim() != 1 or t.numel() * t.element_size() != nbytes:
        _fail(
            where,
            f"{call} returned {name} of dtype {t.dtype} and shape {list(t.shape)}, expected "
            f"a 1-D {dtype} tensor of {nbytes} bytes (the codec's byte count)",
        )
    if t.device != device:
        _fail(where, f"{call} returned {name} on {t.device}, expected the input's {device}")


# where decode_sum's sum and statistics are stated, for the self-check's messages
_CONTRACT = 'see docs/custom_hooks.md, "The decode contract"'


def _check_stats_type(where: str, stats: Any, device) -> None:
    if (
        not isinstance(stats, torch.Tensor)
        or stats.dtype != torch.float64
        or tuple(stats.shape) != (2,)
        or stats.device != device
    ):
        got = (
            stats
            if not isinstance(stats, torch.Tensor)
            else f"{stats.dtype} {list(stats.shape)} on {stats.device}"
        )
        _fail(
            where,
            f"decode_sum returned {got}, expected float64 [2] (squared norm, non-finite count) "
            f"on out's device ({device}): {_CONTRACT}",
        )


def check_codec(codec: Any, where: str = "pycomm.hooks.check_codec", device: Any = "cpu") -> None:
    """Run ``codec`` once on a few blocks on ``device`` (default the CPU; pass "cuda" to check
    a codec there too) and raise a ValueError naming what breaks the
    :class:`Codec` protocol: its attributes, byte counts, the dtypes and sizes ``encode``
    returns, the residual it leaves (``y - decode(codes)``) and the statistics of
    ``decode_sum``; for a codec that declares ``keeps_residual_on_nonfinite``, that it
    updates the residual in place as well, keeping the old value where ``y`` is not finite.
    :func:`pycomm.hooks.register_hook` runs it on every codec it registers.

    Example:
        >>> check_codec(pycomm.hooks.Int8Codec(block=64))
    """
    where = f"{where}: codec {type(codec).__name__}"
    block, code_dtype, scale_dtype = _check_attributes(where, codec)
    # Two blocks, or more where blocks are short: decode_sum below writes 3 elements fewer.
    # Three rows: the sum of more than two (three ranks and more).
    m, rows = block * max(2, -(-8 // block)), 3
    cb = _check_bytes(where, codec, "code_bytes", m, code_dtype)
    sb = _check_bytes(where, codec, "scale_bytes", m, scale_dtype)
    if cb + sb == 0:
        _fail(where, f"code_bytes({m}) + scale_bytes({m}) is 0, expected bytes to send")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, m - 1, generator=gen).to(device)  # one short: the padding rule
    dev = x.device  # "cuda" resolved to "cuda:0"
    residual = (torch.randn(rows, m, generator=gen) * 1e-3).to(dev)
    y = torch.nn.functional.pad(x * 0.5, (0, 1)) + residual
    packed, out_res = _check_encode(where, codec, x, residual, m, cb + sb)
    codes, scales = _run(where, f"split(packed, {m})", codec.split, packed, m)
    if codes.dtype != code_dtype or codes.shape[0] != rows:
        _fail(where, f"split() gave codes {codes.dtype} {list(codes.shape)}, expected {rows} rows")
    ones = [_check_row(where, codec, codes, scales, r, y[r], out_res[r]) for r in range(rows)]
    keeps = getattr(codec, "keeps_residual_on_nonfinite", False)
    if keeps:  # its promise: the engine passes residual_out=None
        _check_in_place(where, codec, x, residual, m, packed, out_res)
    _check_sum(where, codec, codes, scales, ones, m)
    _check_chunks(where, codec, m, cb, sb, dev)
    _check_nonfinite(where, codec, m, dev, keeps)
    _check_half_inputs(where, codec, m, cb + sb, dev)


def _check_attributes(where: str, codec: Any) -> tuple[int, torch.dtype, Any]:
    """The codec's block, code and scale dtypes, once its attributes and methods are checked."""
    block = getattr(codec, "block", None)
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= MAX_BLOCK:
        _fail(where, f"block={block!r}, expected an int in [1, {MAX_BLOCK}]")
    for attr in ("code_bytes", "scale_bytes", "encode", "decode_sum", "pack", "split"):
        if not callable(getattr(codec, attr, None)):
            _fail(where, f"has no method {attr}(), expected the pycomm.hooks.Codec protocol")
    code_dtype, scale_dtype = getattr(codec, "code_dtype", None), getattr(codec, "scale_dtype", 0)
    if not isinstance(code_dtype, torch.dtype):
        _fail(where, f"code_dtype={code_dtype!r}, expected a torch.dtype")
    if scale_dtype is not None and not isinstance(scale_dtype, torch.dtype):
        _fail(where, f"scale_dtype={scale_dtype!r}, expected a torch.dtype or None")
    two_phase = getattr(codec, "two_phase", None)
    if not isinstance(two_phase, bool):
        _fail(where, f"two_phase={two_phase!r}, expected True or False")
    if not two_phase and scale_dtype is not None:
        _fail(where, "two_phase=False with scales: only scale-free codes can be summed as they are")
    return block, code_dtype, scale_dtype


def _check_encode(
    where: str, codec: Any, x: torch.Tensor, residual: torch.Tensor, m: int, row_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` encoded (scale 0.5, with its residual) and packed: the packed rows and
    the residuals encode wrote (NaN where it wrote none), once the outputs are checked."""
    rows, dev = x.shape[0], x.device
    cb = codec.code_bytes(m)
    before, x_before = residual.clone(), x.clone()
    out_res = torch.full_like(residual, float("nan"))  # what encode does not write stays NaN
    packed = torch.empty(rows, row_bytes, dtype=torch.uint8, device=dev)
    for r in range(rows):
        call = f"encode(x of {m - 1}, residual, 0.5, {m}, residual_out)"
        encoded = _run(where, call, codec.encode, x[r], residual[r], 0.5, m, out_res[r])
        if not isinstance(encoded, tuple) or len(encoded) != 2:
            _fail(where, f"{call} returned {type(encoded).__name__}, expected (codes, scales)")
        codes, scales = encoded
        _check_out(where, call, "codes", codes, codec.code_dtype, cb, dev)
        _check_out(where, call, "scales", scales, codec.scale_dtype, row_bytes - cb, dev)
        pack = functools.partial(codec.pack, out=packed[r : r + 1])
        _run(where, "pack(codes, scales, 1, out)", pack, codes, scales, 1)
    if not torch.equal(residual, before):
        _fail(where, "encode(..., residual_out) changed residual, expected it only read")
    if not torch.equal(x, x_before):
        _fail(where, "encode changed its input x, expected it only read (x is the caller's "
              "gradient or tensor)")  # fmt: skip
    return packed, out_res


def _check_in_place(
    where: str,
    codec: Any,
    x: torch.Tensor,
    residual: torch.Tensor,
    m: int,
    packed: torch.Tensor,
    out_res: torch.Tensor,
) -> None:
    """Each row encoded again with ``residual_out=None`` (what the engine passes a codec that
    declares ``keeps_residual_on_nonfinite``: the residual updated in place): the same packed
    row, and the same new residual in place as written to ``residual_out`` before."""
    for r in range(x.shape[0]):
        res = residual[r].clone()
        call = f"encode(x of {m - 1}, residual, 0.5, {m}) in place (residual_out=None)"
        codes, scales = _run(where, call, codec.encode, x[r], res, 0.5, m, None)
        row = _run(where, "pack(codes, scales, 1)", codec.pack, codes, scales, 1)
        if not torch.equal(row.reshape(-1), packed[r]):
            _fail(
                where,
                f"{call} gave other codes or scales than with residual_out, expected the "
                "same: encode must be a function of its arguments (a codec's own random "
                "state or counter would differ on resume, and between the two calls)",
            )
        if not torch.allclose(res, out_res[r], rtol=1e-6, atol=1e-7, equal_nan=True):
            unchanged = torch.equal(res, residual[r])
            _fail(
                where,
                f"{call} "
                + ("left the residual as it was" if unchanged else "wrote another residual")
                + " where encode(..., residual_out) wrote y - decode(codes); expected the same "
                "residual, in place: the engine passes residual_out=None to a codec declaring "
                "keeps_residual_on_nonfinite, so error feedback would never run; or leave "
                "keeps_residual_on_nonfinite False and the engine passes a residual_out",
            )


def _check_row(
    where: str,
    codec: Any,
    codes: torch.Tensor,
    scales: Optional[torch.Tensor],
    r: int,
    y: torch.Tensor,
    res: torch.Tensor,
) -> torch.Tensor:
    """Row ``r`` decoded alone, once its statistics, its finiteness and the residual encode
    wrote for it (``res``, ``y - decode``) are checked."""
    m = y.numel()
    one = torch.empty(m, device=y.device)
    st = _run(
        where,
        f"decode_sum(codes of 1 row, scales, 1.0, out of {m})",
        codec.decode_sum,
        codes[r : r + 1],
        None if scales is None else scales[r : r + 1],
        1.0,
        one,
    )
    _check_stats_type(where, st, y.device)
    unset = (~torch.isfinite(res)).nonzero()
    if unset.numel():
        _fail(
            where,
            f"the residual encode() wrote has {unset.numel()} of {m} elements that are not "
            f"finite (the first at index {int(unset[0])}) for a finite y: encode must "
            "write y - decode(codes) to every element of residual_out",
        )
    if not torch.isfinite(one).all():
        _fail(where, f"decode_sum(codes of row {r}) wrote non-finite values for a finite y")
    if not torch.allclose(one + res, y, rtol=1e-3, atol=1e-5):
        worst = (one + res - y).abs().max().item()
        _fail(
            where,
            "the residual encode() wrote is not y - decode(codes) (off by up to "
            f"{worst:.3g}): error feedback would drift",
        )
    return one


def _check_sum(
    where: str,
    codec: Any,
    codes: torch.Tensor,
    scales: Optional[torch.Tensor],
    ones: list[torch.Tensor],
    m: int,
) -> None:
    """Every row decoded and summed, scaled by 0.5, into an output shorter than a chunk (the
    last rank's part): its statistics, and 0.5 times the sum of the rows decoded alone."""
    rows, dev = len(ones), ones[0].device
    out = torch.full((m - 3,), float("nan"), device=dev)
    stats = _run(
        where,
        f"decode_sum(codes of {rows} rows, scales, 0.5, out of {m - 3})",
        codec.decode_sum,
        codes,
        scales,
        0.5,
        out,
    )
    _check_stats_type(where, stats, dev)
    again = torch.full_like(out, float("nan"))
    codec.decode_sum(codes, scales, 0.5, again)
    if not torch.equal(out, again):
        _fail(
            where,
            f"decode_sum of the same {rows} rows wrote other bits the second time (up to "
            f"{float((out - again).abs().max()):.3g} apart), expected the same: every rank "
            f"that decodes the same rows must hold the same bits ({_CONTRACT})",
        )
    sq, bad = out.double().pow(2).sum().item(), float((~torch.isfinite(out)).sum())
    if bad or not torch.allclose(
        stats.cpu(), torch.tensor([sq, bad], dtype=torch.float64), rtol=1e-4
    ):
        _fail(
            where,
            f"decode_sum returned stats {stats.tolist()}, expected [{sq:.6g}, {bad:g}] "
            f"(squared norm, non-finite count) for the out it wrote: {_CONTRACT}",
        )
    want = (0.5 * sum(ones))[: m - 3]
    if not torch.allclose(out, want, rtol=1e-5, atol=1e-6):
        ratio = (out.double().norm() / want.double().norm().clamp_min(1e-30)).item()
        _fail(
            where,
            f"decode_sum(codes of {rows} rows, scales, 0.5, out) wrote {ratio:.3g} times the "
            "size of 0.5 * (the sum of the rows decoded one by one), expected 1: decode_sum "
            "must add the rows and multiply the sum by its scale argument",
        )


def _check_chunks(where: str, codec: Any, m: int, cb: int, sb: int, dev: torch.device) -> None:
    """Three chunks of ``m`` encoded in one call, as the engine encodes a bucket before it
    cuts the codes into one row per rank: the byte counts add up chunk by chunk, and each row
    decodes to its own chunk (its codes and scales depend on that chunk alone)."""
    k = 3
    for name, nbytes in (("code_bytes", cb), ("scale_bytes", sb)):
        got = _run(where, f"{name}({k * m})", getattr(codec, name), k * m)
        if got != k * nbytes:
            _fail(
                where,
                f"{name}({k * m}) returned {got!r}, expected {k} * {name}({m}) = {k * nbytes}: "
                "the engine encodes several chunks in one call and cuts the codes and scales "
                "into a row per chunk, so the byte counts must add up chunk by chunk",
            )
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(k * m, generator=gen) * torch.logspace(0, 2, k).repeat_interleave(m)
    x, residual = x.to(dev), (torch.randn(k * m, generator=gen) * 1e-3).to(dev)
    res_out = torch.empty_like(residual)
    call = f"encode(x of {k * m}, residual, 1.0, {k * m}, residual_out)"
    encoded = _run(where, call, codec.encode, x, residual, 1.0, k * m, res_out)
    if not isinstance(encoded, tuple) or len(encoded) != 2:
        _fail(where, f"{call} returned {type(encoded).__name__}, expected (codes, scales)")
    _check_out(where, call, "codes", encoded[0], codec.code_dtype, k * cb, dev)
    _check_out(where, call, "scales", encoded[1], codec.scale_dtype, k * sb, dev)
    packed = _run(where, f"pack(codes, scales, {k})", codec.pack, *encoded, k)
    codes, scales = _run(where, f"split(packed, {m})", codec.split, packed, m)
    y = x + residual
    for r in range(k):
        out = torch.empty(m, device=dev)
        _run(where, f"decode_sum(row {r} of {k} chunks encoded in one call, alone)",
             codec.decode_sum, codes[r : r + 1],
             None if scales is None else scales[r : r + 1], 1.0, out)  # fmt: skip
        part = slice(r * m, (r + 1) * m)
        if not torch.allclose(out + res_out[part], y[part], rtol=1e-3, atol=1e-5):
            worst = float((out + res_out[part] - y[part]).abs().max())
            _fail(
                where,
                f"{call}: row {r} of the {k} chunks decodes, with its residual, up to "
                f"{worst:.3g} off chunk {r} (|y| up to {float(y[part].abs().max()):.3g}); "
                "expected each chunk's codes and scales to depend on that chunk alone: the "
                "engine sends row r to rank r, which decodes it alone",
            )


def _check_half_inputs(where: str, codec: Any, m: int, row_bytes: int, dev: torch.device) -> None:
    """bf16 and fp16 inputs, with an fp32 residual, a bf16 one and none (what a
    mixed-precision bucket, ``residual_dtype="bfloat16"`` and an all-gather hand the codec):
    the codes and scales keep their dtypes and byte counts, and the rows decode, into an
    ``out`` of the input's dtype, to ``y`` less the residual encode wrote, to that dtype's
    rounding."""
    gen = torch.Generator().manual_seed(1)
    for dtype, res_dtype in (
        (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
        (torch.bfloat16, None), (torch.float16, None),
    ):  # fmt: skip
        x = torch.randn(m - 1, generator=gen).to(dev, dtype)
        residual = res_out = None
        if res_dtype is not None:
            residual = (torch.randn(m, generator=gen) * 1e-3).to(dev, res_dtype)
            res_out = torch.empty_like(residual)
        call = f"encode(x of {m - 1} {dtype}, residual of {res_dtype}, 1.0, {m}, residual_out)"
        encoded = _run(where, call, codec.encode, x, residual, 1.0, m, res_out)
        if not isinstance(encoded, tuple) or len(encoded) != 2:
            _fail(where, f"{call} returned {type(encoded).__name__}, expected (codes, scales)")
        codes, scales = encoded
        cb = codec.code_bytes(m)
        _check_out(where, call, "codes", codes, codec.code_dtype, cb, dev)
        _check_out(where, call, "scales", scales, codec.scale_dtype, row_bytes - cb, dev)
        row = _run(where, "pack(codes, scales, 1)", codec.pack, codes, scales, 1)
        codes, scales = _run(where, f"split(row, {m})", codec.split, row, m)
        out = torch.empty(m - 1, dtype=dtype, device=dev)
        st = _run(where, f"decode_sum(codes, scales, 1.0, out of {dtype})", codec.decode_sum,
                  codes, scales, 1.0, out)  # fmt: skip
        _check_stats_type(where, st, dev)
        if residual is not None:  # decode + the new residual is y, as in fp32
            y, got = x.float() + residual[: m - 1].float(), out.float() + res_out[: m - 1].float()
            what = "decode + the residual is off y = x + residual"
        else:  # no residual: the decode of the same values sent as fp32
            y, got = _round_trip32(where, codec, x.float(), m), out.float()
            what = "the decode is off that of the same x sent as fp32"
        # out and the residual are rounded to their dtypes: a few of their ulps apart
        if not torch.allclose(got, y, rtol=2e-2, atol=2e-2 * float(y.abs().max())):
            worst = float((got - y).abs().max())
            _fail(
                where,
                f"{call}, then decode_sum into an out of {dtype}: {what} by up to {worst:.3g} "
                f"(|y| up to {float(y.abs().max()):.3g}); expected x read as the dtype it has "
                "(fp32, bf16 or fp16) and out written in its own",
            )


def _round_trip32(where: str, codec: Any, x: torch.Tensor, m: int) -> torch.Tensor:
    """fp32 ``x`` encoded without a residual, packed, split and decoded into fp32."""
    codes, scales = _run(where, f"encode(x of {m - 1}, None, 1.0, {m})", codec.encode, x, None,
                         1.0, m)  # fmt: skip
    codes, scales = codec.split(codec.pack(codes, scales, 1), m)
    out = torch.empty(x.numel(), device=x.device)
    _run(where, "decode_sum(codes, scales, 1.0, out)", codec.decode_sum, codes, scales, 1.0, out)
    return out


def _check_nonfinite(where: str, codec: Any, m: int, dev: torch.device, keeps: bool) -> None:
    """A NaN, then an Inf, in the input decodes to a non-finite value and is counted; with
    ``keeps`` (the codec declares ``keeps_residual_on_nonfinite``) the residual, updated in
    place, keeps its old value there and stays finite."""
    for bad in (float("nan"), float("inf")):
        x = torch.ones(m, device=dev)
        x[1] = bad
        residual = torch.full((m,), 0.125, device=dev)
        call = f"encode(x holding {bad}, residual, 1.0, {m}" + (
            ") in place" if keeps else ", residual_out)"
        )
        out_res = None if keeps else torch.empty_like(residual)
        codes, scales = _run(where, call, codec.encode, x, residual, 1.0, m, out_res)
        if keeps and not (bool(torch.isfinite(residual).all()) and float(residual[1]) == 0.125):
            _fail(
                where,
                f"{call} left the residual {float(residual[1]):g} where x holds {bad} (it was "
                "0.125), and non-finite values at "
                f"{int((~torch.isfinite(residual)).sum())} elements; expected the old value "
                "where y is not finite and a finite residual everywhere, as a codec declaring "
                "keeps_residual_on_nonfinite promises (the engine keeps one copy of its "
                "residuals, which a non-finite one would poison for good); or leave "
                "keeps_residual_on_nonfinite False and the engine keeps the old residual for you",
            )
        row = _run(where, "pack(codes, scales, 1)", codec.pack, codes, scales, 1)
        codes, scales = _run(where, f"split(row, {m})", codec.split, row, m)
        out = torch.zeros(m, device=dev)
        st = _run(where, f"decode_sum(codes of x holding {bad})", codec.decode_sum, codes,
                  scales, 1.0, out)  # fmt: skip
        if bool(torch.isfinite(out).all()):
            _fail(
                where,
                f"an input holding {bad} decoded to finite values only, expected a non-finite "
                "value where it was: every rank must see it to skip the step",
            )
        if not float(st[1]) > 0:
            _fail(
                where,
                f"decode_sum counted {float(st[1]):g} non-finite elements in an out holding "
                f"{int((~torch.isfinite(out)).sum())}, expected the count",
            )
