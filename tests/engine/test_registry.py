"""The hook registry, the codec protocol's self-check and a user's own state and hook:
registration errors name what is wrong; every registered hook trains through pycomm.wrap, and
so does a codec written against the protocol before keeps_residual_on_nonfinite; a
HookState instance or a (state, fn) pair gets the cross-rank check, accumulation and
checkpoints; every pycomm bucket satisfies the Bucket protocol."""

import ast
import functools
import importlib
import itertools
import os

import pytest
import torch
import torch.distributed as dist
from ddp_harness import Fixed
from harness import ROOT, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.codec.engine import Workspace, completed
from pycomm.hooks import (
    Bucket,
    Codec,
    Fp8Codec,
    HalfCodec,
    HookState,
    Int4Codec,
    Int8Codec,
    OneBitCodec,
    check_codec,
    hook_names,
    hook_spec,
    register_hook,
    unregister_hook,
)
from pycomm.hooks.registry import user_modules


def _padded_y(x, residual, scale, numel):
    """``y = x * scale + residual`` in fp32, ``x`` read as if zero-padded to ``numel``."""
    y = torch.zeros(numel, device=x.device)
    y[: x.numel()] = x.float() * scale
    if residual is not None:
        y += residual.float()
    return y


def _write_sum(out, acc, scale):
    """``out`` = ``scale`` times the rows' sum ``acc``, and its statistics (the decode
    contract)."""
    out.copy_(acc[: out.numel()] * scale)
    o = out.float()
    fin = torch.isfinite(o)
    return torch.stack([torch.where(fin, o, 0.0).double().square().sum(), (~fin).sum().double()])


class PlainCodec(Codec):
    """fp32 codes, no scales, no loss: the smallest codec that follows the protocol, declaring
    that it keeps the residual in place where y is not finite."""

    code_dtype, block = torch.float32, 4
    keeps_residual_on_nonfinite = True

    def __init__(self, block: int = 4) -> None:
        self.block = block

    def code_bytes(self, m):
        return 4 * m

    def encode(self, x, residual, scale, numel, residual_out=None):
        y = _padded_y(x, residual, scale, numel)
        if residual is not None:
            kept = torch.where(torch.isfinite(y), 0.0, residual.float())  # lossless: 0
            (residual if residual_out is None else residual_out).copy_(kept)
        return y, None

    def decode_sum(self, codes, scales, scale, out):
        return _write_sum(out, codes.float().sum(0), scale)


def _broken(**overrides):
    block = overrides.pop("block", 4)
    overrides["__init__"] = lambda self: setattr(self, "block", block)
    return type("Broken", (PlainCodec,), overrides)


def _drop_residual(self, x, residual, scale, numel, residual_out=None):
    codes, _ = PlainCodec.encode(self, x, None, scale, numel)
    return codes, None  # the residual left as it was: error feedback would drift


def _zero_input(self, x, residual, scale, numel, residual_out=None):
    out = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    x.zero_()  # the caller's gradient: the protocol has encode read it only
    return out


def _residual_off(self, x, residual, scale, numel, residual_out=None):
    codes, _ = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    (residual if residual_out is None else residual_out).fill_(0.25)
    return codes, None


def _poison_residual(self, x, residual, scale, numel, residual_out=None):
    codes, _ = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    (residual if residual_out is None else residual_out).copy_(codes - codes)  # NaN - NaN
    return codes, None


def _decode_unscaled(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes, scales, 1.0, out)  # scale ignored


def _decode_finite(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes.nan_to_num(), scales, scale, out)


def _count_nothing(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes, scales, scale, out) * torch.tensor([1.0, 0.0])


def _out_only(self, x, residual, scale, numel, residual_out=None):
    # the new residual written to residual_out alone: in place (the engine's default) the
    # residual stays as it was, and error feedback never runs
    spare = residual_out if residual is None or residual_out is not None else residual.clone()
    return PlainCodec.encode(self, x, residual, scale, numel, spare)


def _decode_two_rows(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes[:2], scales, scale, out)  # a third rank lost


_CALLS = itertools.count()


def _counted(self, x, residual, scale, numel, residual_out=None):
    # a counter of the codec's own in its codes (as a private random generator would be)
    codes, _ = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    return codes * (1 + 1e-7 * next(_CALLS)), None


def _meta_codes(self, x, residual, scale, numel, residual_out=None):
    codes, _ = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    return codes.to("meta"), None


def _half_uncast(self, x, residual, scale, numel, residual_out=None):
    if x.dtype == torch.float32 or residual is not None:
        return PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    codes = torch.zeros(numel, dtype=x.dtype, device=x.device)  # a 16-bit input kept as is
    codes[: x.numel()] = x * scale
    return codes, None


def _half_bits(self, x, residual, scale, numel, residual_out=None):
    if x.dtype == torch.float32:
        return PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    # a 16-bit input's bits zero-extended as fp32 codes: the right dtype, the wrong values
    codes = torch.zeros(numel, dtype=torch.int32, device=x.device)
    codes[: x.numel()] = x.view(torch.int16).to(torch.int32)
    if residual is not None:
        (residual if residual_out is None else residual_out).zero_()
    return codes.view(torch.float32), None


def _reversed_codes(self, x, residual, scale, numel, residual_out=None):
    codes, _ = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    return codes.flip(0), None  # the whole input's order: a row of several is not its chunk


def _decode_reversed(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes.flip(1), scales, scale, out)


def _one_scale(self, x, residual, scale, numel, residual_out=None):
    codes, _ = PlainCodec.encode(self, x, residual, scale, numel, residual_out)
    top = codes.abs().max().clamp_min(1e-30)
    return codes / top, top.reshape(1)  # one scale for however many chunks


def _decode_one_scale(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes * scales, None, scale, out)


def _decode_noisy(self, codes, scales, scale, out):
    return PlainCodec.decode_sum(self, codes + 1e-6 * torch.randn(codes.shape), scales, scale, out)


# --- codecs written against the protocol before keeps_residual_on_nonfinite --------------
# (docs/custom_hooks.md then: the engine always passed residual_out, and what the residual
# held where x was not finite did not matter). They write y - decode to residual_out, NaN
# where y is NaN, and ignore residual_out=None.


class OldTernaryCodec(Codec):
    """2-bit ternary codes (q in {-1, 0, 1}, four a byte), one fp32 scale (absmax) a block."""

    code_dtype, scale_dtype, block = torch.uint8, torch.float32, 16

    def code_bytes(self, m):
        return m // 4

    def scale_bytes(self, m):
        return 4 * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        y = _padded_y(x, residual, scale, numel)
        blocks = y.view(-1, self.block)
        s = blocks.abs().amax(1, keepdim=True)  # NaN or Inf in a block: the scale too
        q = torch.round(blocks / s.clamp_min(1e-30)).nan_to_num(0.0)
        if residual_out is not None:
            residual_out.copy_((blocks - q * s).view(-1))
        c = (q + 1).to(torch.uint8).view(-1, 4)
        return c[:, 0] | c[:, 1] << 2 | c[:, 2] << 4 | c[:, 3] << 6, s.view(-1)

    def decode_sum(self, codes, scales, scale, out):
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)
        acc = torch.zeros(4 * codes.shape[1], device=out.device)
        for r in range(codes.shape[0]):
            q = ((codes[r].unsqueeze(1) >> shifts) & 3).float() - 1
            acc += (q.view(-1, self.block) * scales[r].view(-1, 1)).view(-1)
        return _write_sum(out, acc, scale)


class OldDitherCodec(Codec):
    """bf16 codes rounded with a dither of the element's position (deterministic), summed as
    they are by one bf16 all-reduce."""

    code_dtype, block, two_phase = torch.bfloat16, 8, False

    def code_bytes(self, m):
        return 2 * m

    def encode(self, x, residual, scale, numel, residual_out=None):
        y = _padded_y(x, residual, scale, numel)
        dither = ((torch.arange(numel, device=x.device) * 40503) & 0xFFFF).to(torch.int32)
        codes = ((y.view(torch.int32) + dither) & -65536).view(torch.float32).bfloat16()
        if residual_out is not None:
            residual_out.copy_(y - codes.float())
        return codes, None

    def decode_sum(self, codes, scales, scale, out):
        acc = torch.zeros(codes.shape[1], device=out.device)
        for r in range(codes.shape[0]):
            acc += codes[r].float()
        return _write_sum(out, acc, scale)


OLD_CODECS = [OldTernaryCodec, OldDitherCodec]


def _finite_decode(cls):
    """``cls`` with a decode that turns NaN and Inf into finite values."""

    def decode_sum(self, codes, scales, scale, out):
        st = cls.decode_sum(self, codes, scales, scale, out)
        out.nan_to_num_(0.0, 0.0, 0.0)
        return st

    return type("Broken", (cls,), {"decode_sum": decode_sum})


_BAD = [
    (
        _broken(encode=_reversed_codes, decode_sum=_decode_reversed),
        r"row 0 of the 3 chunks decodes, with its residual, up to .* off chunk 0",
    ),  # fmt: skip
    (
        _broken(
            encode=_one_scale,
            decode_sum=_decode_one_scale,
            scale_dtype=torch.float32,
            scale_bytes=lambda self, m: 4,
        ),
        r"scale_bytes\(24\) returned 4, expected 3 \* scale_bytes\(8\) = 12",
    ),  # fmt: skip
    (_broken(decode_sum=_decode_noisy), "decode_sum of the same 3 rows wrote other bits"),
    (
        _broken(encode=_out_only),
        r"in place \(residual_out=None\) left the residual as it was.* to a codec declaring "
        "keeps_residual_on_nonfinite",
    ),  # fmt: skip
    (
        _broken(decode_sum=_decode_two_rows),
        r"decode_sum\(codes of 3 rows, scales, 0.5, out\) wrote",
    ),
    (_broken(encode=_counted), "gave other codes or scales than with residual_out"),
    (
        _broken(encode=_half_uncast),
        "x of 7 torch.bfloat16, residual of None.* returned codes of dtype torch.bfloat16",
    ),  # fmt: skip
    (
        _broken(encode=_half_bits),
        r"x of 7 torch.bfloat16, residual of torch.float32.*off y = "
        r"x \+ residual by up to",
    ),  # fmt: skip
    (_broken(encode=_meta_codes), "returned codes on meta, expected the input's cpu"),
    (_broken(code_bytes=lambda self, m: 4 * m + 4), "encode(.*) returned codes .* of 36 bytes"),
    (_broken(code_bytes=lambda self, m: 4.0 * m), r"code_bytes\(8\) returned 32.0"),
    (_broken(scale_bytes=lambda self, m: m), "returned 8 with scale_dtype None, expected 0"),
    (_broken(code_dtype=torch.int16), "returned codes of dtype torch.float32"),
    (_broken(two_phase=1), "two_phase=1, expected True or False"),
    (_broken(code_dtype=None), "code_dtype=None, expected a torch.dtype"),
    (_broken(block=0), r"block=0, expected an int in \[1, 65536\]"),
    (_broken(block=2**40), r"block=1099511627776, expected an int in \[1, 65536\]"),
    (_broken(encode=_zero_input), "encode changed its input x, expected it only read"),
    (_broken(encode=_drop_residual), "8 of 8 elements .* every element of residual_out"),
    (_broken(encode=_residual_off), r"is not y - decode\(codes\) \(off by up to"),
    (_broken(decode_sum=_decode_unscaled), "must add the rows and multiply the sum by its scale"),
    (
        _broken(encode=_poison_residual),
        "left the residual nan where x holds nan .* as a codec declaring "
        "keeps_residual_on_nonfinite promises .*; or leave keeps_residual_on_nonfinite False",
    ),  # fmt: skip
    (_broken(decode_sum=_decode_finite), "holding nan decoded to finite values only"),
    # a codec of the old protocol still decodes a NaN to a non-finite value
    (_finite_decode(OldTernaryCodec), "holding nan decoded to finite values only"),
    (_broken(decode_sum=_count_nothing), "counted 0 non-finite elements in an out holding"),
    (_broken(encode=lambda self, *a: torch.zeros(8)), r"returned Tensor, expected \(codes, s"),
    (
        _broken(decode_sum=lambda self, c, s, sc, out: out.view(3, -1)),
        r"decode_sum\(codes of 1 row, scales, 1.0, out of 8\) raised RuntimeError: shape",
    ),
    (_broken(code_bytes=lambda self, m: m // 0), r"code_bytes\(8\) raised ZeroDivisionError"),
    (
        _broken(decode_sum=lambda self, c, s, sc, out: torch.zeros(2)),
        'expected float64 .2. .*: see docs/custom_hooks.md, "The decode contract"$',
    ),
    (
        _broken(
            decode_sum=lambda self, c, s, sc, out: PlainCodec.decode_sum(self, c, s, sc, out) * 2
        ),
        'decode_sum returned stats .*: see docs/custom_hooks.md, "The decode contract"$',
    ),
]


@pytest.mark.parametrize("codec, pattern", _BAD, ids=[str(i) for i in range(len(_BAD))])
def test_a_codec_breaking_the_protocol_is_refused_at_registration(codec, pattern):
    try:
        with pytest.raises(ValueError, match=pattern) as info:
            register_hook("broken", codec=codec)
    finally:
        if "broken" in hook_names():
            unregister_hook("broken")
    assert "register_hook('broken'): codec Broken" in str(info.value)


def test_a_factory_without_a_name_registers():
    register_hook("partial_plain", codec=functools.partial(PlainCodec, block=2))
    try:
        state = hook_spec("partial_plain").state(None)
        assert state.codec.block == 2 and "functools.partial" in type(state).__doc__
    finally:
        unregister_hook("partial_plain")


def test_pack_refuses_codes_that_are_not_a_whole_row_per_chunk():
    codec = PlainCodec()
    assert codec.pack(torch.arange(8.0), None, 2).shape == (2, 16)
    with pytest.raises(ValueError, match="36 bytes of codes and 0 of scales for 5 chunks"):
        codec.pack(torch.zeros(9), None, 5)
    out = torch.empty(2, 20, dtype=torch.uint8)  # rows wider than the codes: a tail unwritten
    with pytest.raises(ValueError, match="expected a whole row per chunk into rows of 20 bytes"):
        codec.pack(torch.zeros(8), None, 2, out=out)


def test_built_in_codecs_pass_the_self_check():
    for codec in (
        HalfCodec(torch.float16),
        HalfCodec(torch.bfloat16, two_phase=True),
        Int8Codec(64),
        Int8Codec(256),
        OneBitCodec(64),
        Int4Codec(64),
        Int4Codec(32, torch.bfloat16),
        Fp8Codec(64),
        PlainCodec(),
        PlainCodec(block=1),  # short blocks: the check still decodes into a shorter out
        PlainCodec(block=3),
    ):
        check_codec(codec)
    for name in hook_names():
        factory = hook_spec(name).codec
        if factory is not None:
            check_codec(factory())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_codecs_pass_the_self_check_on_cuda():
    for codec in (
        HalfCodec(torch.float16),
        Int8Codec(64),
        OneBitCodec(64),
        Int4Codec(64),
        Fp8Codec(64),
        PlainCodec(),
    ):
        check_codec(codec, device="cuda")


class MyState(HookState):
    hook_name = "mine"


def my_hook(state, bucket):
    return completed(bucket.buffer())


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        (
            ("int8", MyState, my_hook),
            {},
            "the name is taken by codec pycomm.codec.codecs.Int8Codec",
        ),
        # a taken name is the first problem reported, before the codec's self-check
        (
            ("int8",),
            {"codec": _broken(code_dtype=torch.int16)},
            "the name is taken by codec pycomm",
        ),
        # pycomm's own codec under a built-in name, from a user's module: still taken
        (
            ("int8",),
            {"codec": Int8Codec, "defaults": {"start_iter": 50}},
            "the name is taken by codec pycomm.codec.codecs.Int8Codec, registered by module "
            "'pycomm.codec'",
        ),
        (("My-Hook", MyState, my_hook), {}, "name='My-Hook', expected lowercase letters"),
        (("mine", object, my_hook), {}, "state=<class 'object'>, expected a pycomm.hooks.Hook"),
        (("mine", MyState, 3), {}, "hook=3, expected a function hook"),
        (("mine", MyState, lambda state: None), {}, r"cannot take \(state, bucket\)"),
        (("mine", MyState, my_hook), {"auto": True}, "auto=True without a codec"),
        (("mine", MyState, my_hook), {"description": 5}, "description=5, expected a str"),
        (("mine",), {}, "expected codec=..., or state=... and hook=..."),
        (("mine",), {"codec": lambda block: PlainCodec(block)}, "cannot be built without"),
        (("mine",), {"codec": 3}, "codec=3, expected a Codec class or factory"),
        (
            ("mine",),
            {"codec": lambda start_iter=2: PlainCodec()},
            "codec option 'start_iter' is also an option of the engine",
        ),
    ],
)
def test_registration_errors_name_the_argument(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        register_hook(*args, **kwargs)
    assert "mine" not in hook_names()


def test_a_users_module_registering_pycomms_codec_is_its_module():
    spec = register_hook("int8_wide", codec=Int8Codec, description="int8, its own name")
    try:
        assert spec.module == __name__ and __name__ in user_modules()
        assert register_hook("int8_wide", codec=Int8Codec).module == __name__  # imported again
    finally:
        unregister_hook("int8_wide")


class OtherPlainCodec(PlainCodec):
    """Another codec class of this module (a name registered to PlainCodec is taken)."""


def test_the_same_module_registering_another_codec_under_its_name_is_refused():
    register_hook("mine", codec=PlainCodec)
    try:
        assert register_hook("mine", codec=PlainCodec).codec is PlainCodec  # imported again
        with pytest.raises(ValueError, match="the name is taken by codec .*test_registry.Plain"):
            register_hook("mine", codec=OtherPlainCodec)
        assert hook_spec("mine").codec is PlainCodec
    finally:
        unregister_hook("mine")


class FailingLateCodec(PlainCodec):
    """Follows the protocol at the self-check's sizes; its decode fails on a bucket's."""

    def decode_sum(self, codes, scales, scale, out):
        if out.numel() > 1000:
            raise ValueError("FailingLateCodec: decode_sum of 1000 elements or more")
        return super().decode_sum(codes, scales, scale, out)


def _rank_a_codec_failing_in_a_callback():
    register_hook("failing_late", codec=FailingLateCodec)
    try:
        torch.manual_seed(0)
        model = pycomm.wrap(torch.nn.Linear(64, 64), hook="failing_late",
                            hook_options={"start_iter": 2})  # fmt: skip
        x = torch.randn(8, 64)
        try:
            for _ in range(3):
                model(x).sum().backward()
        except Exception as e:  # noqa: BLE001 - what DDP's backward raised
            return f"{type(e).__name__}: {e}"
        return "no error"
    finally:
        unregister_hook("failing_late")


def test_a_codec_failing_inside_a_callback_reaches_backward_with_its_message():
    for text in run_ranks(_rank_a_codec_failing_in_a_callback, 2, timeout=60):
        assert "FailingLateCodec: decode_sum of 1000 elements or more" in text
        assert "Unable to cast" not in text


def test_registering_again_from_the_same_module_returns_the_spec():
    spec = register_hook("mine", MyState, my_hook)
    try:
        assert register_hook("mine", MyState, my_hook) == spec
        assert hook_spec("mine").state is MyState and "mine" in hook_names()
        assert "mine" not in hook_names(auto=True)
    finally:
        unregister_hook("mine")
    with pytest.raises(ValueError, match="hook='mine' is not one of allreduce"):
        hook_spec("mine")


def test_a_registered_codec_gets_its_options_checked_and_fingerprinted():
    register_hook("plain", codec=PlainCodec)
    try:
        cls = hook_spec("plain").state
        assert "block" in cls.option_names and "residual_dtype" in cls.option_names
        with pytest.raises(ValueError, match="unknown option 'ratio'"):
            cls(None, ratio=2)
    finally:
        unregister_hook("plain")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _rank_every_hook_trains():
    register_hook("plain", codec=PlainCodec)
    try:
        out = {}
        for name in hook_names():
            model = _model()
            ddp = pycomm.wrap(model, hook=name, accumulate_steps=2)
            loop = pycomm.TrainLoop(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
            g = torch.Generator().manual_seed(dist.get_rank())
            for _ in range(2 * 4):
                x = torch.randn(8, 12, generator=g)
                loop.step(lambda d=ddp, x=x: d(x).square().mean())
            flat = _flat(model)
            everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, flat)
            out[name] = (
                all(torch.equal(everyone[0], f) for f in everyone),
                bool(torch.isfinite(flat).all()),
                not torch.equal(flat, _flat(_model())),
            )
        return out
    finally:
        unregister_hook("plain")


def test_every_registered_hook_trains():
    for out in run_ranks(_rank_every_hook_trains, 2, timeout=120):
        assert set(out) == {*hook_names(), "plain"}
        for name, (same, finite, moved) in out.items():
            assert same and finite and moved, (name, same, finite, moved)


def _train_old_codec(name, feedback):
    ddp = pycomm.wrap(_model(), hook=name, hook_options={"error_feedback": feedback})
    loop = pycomm.TrainLoop(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(dist.get_rank())
    w = torch.randn(12, 3, generator=torch.Generator().manual_seed(42))
    losses = []
    for _ in range(12):
        x = torch.randn(16, 12, generator=g)
        losses.append(loop.step(lambda x=x: (ddp(x) - x @ w).square().mean()).item())
    flat = _flat(ddp.module)
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    state = pycomm.hook_state(ddp)
    residuals = [t for r in state.state_dict()["residuals"].values() for t in r.values()]
    return {
        "losses": losses,
        "same": all(torch.equal(everyone[0], f) for f in everyone),
        "flat": flat,
        "residual_bytes": state.stats["residual_bytes"],
        "moved": any(bool(t.ne(0).any()) for t in residuals),
    }


def _rank_old_codec(cls):
    """Train with a codec of the old protocol (with and without error feedback), then a step
    whose gradient holds a NaN on rank 1: the residuals before it and after it, and the
    phase-1 residual the codec's own encode gives from them."""
    name = f"old_{cls.__name__.lower()}"
    register_hook(name, codec=cls)
    try:
        out = {"trained": _train_old_codec(name, True), "plain": _train_old_codec(name, False)}
        n, nan_step, size = 300, 4, dist.get_world_size()
        ddp = pycomm.wrap(Fixed(n), hook=name)
        state = pycomm.hook_state(ddp)
        c = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
        for step in range(nan_step + 1):
            x = c.clone()
            if step == nan_step and dist.get_rank() == 1:
                x[n // 3] = float("nan")
            before = state.state_dict()["residuals"]
            ddp.zero_grad()
            ddp(x).backward()
        ((key, after),) = state.state_dict()["residuals"].items()
        new = torch.empty_like(before[key]["r1"])
        cls().encode(x, before[key]["r1"], 1 / size, new.numel(), new)
        out["nan"] = (before[key], after, new, state.stats["nonfinite_buckets"])
        return out
    finally:
        unregister_hook(name)


@pytest.mark.parametrize("cls", OLD_CODECS, ids=lambda c: c.__name__)
def test_a_codec_of_the_old_protocol_registers_trains_and_keeps_finite_residuals(cls):
    """A codec written before keeps_residual_on_nonfinite (residual_out always written, NaN
    where y is NaN, residual_out=None ignored) registers, trains with error feedback (one
    copy of the residuals), its ranks bitwise equal, and a NaN step leaves every residual
    finite: the old one kept where the new one is not finite, the new one elsewhere."""
    for rank, out in enumerate(run_ranks(_rank_old_codec, 2, cls, timeout=60)):
        trained, plain = out["trained"], out["plain"]
        losses = trained["losses"]
        assert trained["same"] and sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses
        assert trained["residual_bytes"] > 0 and trained["moved"]  # error feedback ran
        assert not torch.equal(trained["flat"], plain["flat"])
        before, after, new, nonfinite = out["nan"]
        assert nonfinite == 1 and bool(new.isfinite().all()) == (rank == 0)  # rank 1's NaN
        assert all(t.isfinite().all() for t in after.values())
        assert torch.equal(after["r1"], torch.where(new.isfinite(), new, before["r1"]))


def test_the_engine_keeps_the_old_residual_for_a_codec_that_does_not_declare_it():
    """Workspace.encode in place (no residual_out): a codec without keeps_residual_on_nonfinite
    encodes into a reused scratch buffer, merged where finite; a codec with it is passed
    residual_out=None; and a residual_out given (strict_skip) reaches either codec."""
    x = torch.randn(61, generator=torch.Generator().manual_seed(3))
    x[[2, 33]] = torch.tensor([float("nan"), float("inf")])
    for codec in (OldTernaryCodec(), OldDitherCodec()):
        ws = Workspace()
        old = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 1e-2
        new, r = torch.empty_like(old), old.clone()
        want = codec.pack(*codec.encode(x, old, 0.5, 64, new), 1)
        assert torch.equal(codec.pack(*ws.encode(codec, x, r, 0.5, 64, None), 1), want)
        assert new.isfinite().any() and not new.isfinite().all()
        assert torch.equal(r, torch.where(new.isfinite(), new, old))
        scratch = ws.scratch[torch.float32]
        ws.encode(codec, x, r, 0.5, 64, None)
        assert ws.scratch[torch.float32] is scratch  # reused, not allocated
        out, r = torch.empty_like(old), old.clone()
        ws.encode(codec, x, r, 0.5, 64, out)  # strict_skip: the codec's own residual_out
        assert torch.equal(r, old) and torch.allclose(out, new, 0, 0, equal_nan=True)
    ws, r = Workspace(), torch.ones(64)
    ws.encode(PlainCodec(), x, r, 0.5, 64, None)
    assert not ws.scratch and r[2] == 1 and r[0] == 0  # in place, NaN: kept


class CountingState(HookState):
    """A user's state: counts the buckets it saw, checkpoints the count."""

    hook_name = "counting"

    def __init__(self, process_group=None, scale: float = 1.0):
        super().__init__(process_group)
        self.scale, self.seen, self.types = scale, 0, set()

    def options(self):
        return {"scale": self.scale}

    def state_dict(self):
        return {**super().state_dict(), "seen": self.seen}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.seen = state["seen"]


def counting_hook(state, bucket):
    state.seen += 1
    state.types.add(isinstance(bucket, Bucket) and len(bucket.parameters()) > 0)
    x = bucket.buffer()
    state.count(bucket, 4 * x.numel())
    x.mul_(1.0 / state.world_size)
    fut = dist.all_reduce(x, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: x)


class SoloState(CountingState):
    hook_name = "solo"


def _rank_user_state(tmp):
    out = {}
    rank = dist.get_rank()
    # a (state, fn) pair through wrap, with accumulation and a checkpoint
    model = _model()
    state = CountingState()
    ddp = pycomm.wrap(model, hook=(state, counting_hook), accumulate_steps=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loop = pycomm.TrainLoop(ddp, opt)
    for i in range(4):
        loop.step(lambda i=i: ddp(torch.full((4, 12), float(i + rank))).square().mean())
    out["reduced_every_second_micro_step"] = (
        state.stats["steps"] == 2 and state.seen == state.stats["buckets"] > 0
    )
    out["buckets_follow_the_protocol"] = state.types == {True}
    out["hook_state"] = pycomm.hook_state(ddp) is state
    pycomm.checkpoint.save(f"{tmp}/user.ckpt", ddp, opt, step=4)
    again = CountingState()
    ddp2 = pycomm.wrap(_model(), hook=(again, counting_hook), accumulate_steps=2)
    pycomm.checkpoint.load(f"{tmp}/user.ckpt", ddp2, torch.optim.SGD(ddp2.parameters(), lr=0.1))
    out["resumed"] = again.seen == state.seen and again.stats["steps"] == state.stats["steps"]
    # an instance of a registered class through register
    register_hook("counting", CountingState, counting_hook)
    try:
        ddp3 = DDP(_model())
        st = pycomm.register(ddp3, hook=CountingState(None, scale=2.0))
        ddp3(torch.randn(2, 12)).sum().backward()
        out["registered_instance"] = st.seen == 1 and st.options() == {"scale": 2.0}
    finally:
        unregister_hook("counting")
    # errors, the same on every rank
    if rank == 0:
        register_hook("solo", SoloState, counting_hook)
    for name, call in {
        "options_differ": lambda: pycomm.wrap(
            _model(), hook=(CountingState(None, scale=1.0 + rank), counting_hook)
        ),
        "unregistered": lambda: pycomm.register(DDP(_model()), hook=CountingState()),
        "with_options": lambda: pycomm.wrap(
            _model(), hook=(CountingState(), counting_hook), hook_options={"scale": 3}
        ),
        "reused": lambda: pycomm.wrap(_model(), hook=(state, counting_hook)),
        "not_a_state": lambda: pycomm.wrap(_model(), hook=(object(), counting_hook)),
        "registered_on_rank_0": lambda: pycomm.wrap(_model(), hook="solo"),
        "instance_registered_on_rank_0": lambda: pycomm.wrap(_model(), hook=SoloState()),
        "other_group": lambda: pycomm.wrap(
            _model(), hook=(CountingState(dist.new_group([0, 1])), counting_hook)
        ),
    }.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test inspects type and message
            out[name] = f"{type(e).__name__}: {e}"
    if rank == 0:
        unregister_hook("solo")
    return out


class OwnDictState(HookState):
    """A user's state whose state_dict() and load_state_dict() do not extend the base's."""

    hook_name = "own_dict"

    def __init__(self, process_group=None):
        super().__init__(process_group)
        self.seen, self.types = 0, set()

    def state_dict(self):
        return {"fingerprint": self.fingerprint(), "rank": self.rank,
                "world_size": self.world_size, "seen": self.seen}  # fmt: skip

    def load_state_dict(self, state):
        self.check_fingerprint(state)
        self.seen = state["seen"]


def _rank_own_dict(tmp):
    rank = dist.get_rank()
    data = [torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * i + rank))
            for i in range(7)]  # fmt: skip

    def build():
        ddp = pycomm.wrap(_model(), hook=(OwnDictState(), counting_hook), accumulate_steps=2)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        return ddp, opt, pycomm.TrainLoop(ddp, opt)

    def train(ddp, loop, part):
        for x in part:
            loop.step(lambda x=x: ddp(x).square().mean())

    ddp, _, loop = build()
    train(ddp, loop, data)
    straight = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    ddp, opt, loop = build()
    train(ddp, loop, data[:3])  # mid-window
    pycomm.checkpoint.save(f"{tmp}/own.ckpt", ddp, opt)
    ddp, opt, _ = build()
    pycomm.checkpoint.load(f"{tmp}/own.ckpt", ddp, opt)
    loop = pycomm.TrainLoop(ddp, opt)
    at = (loop.micro_steps, pycomm.hook_state(ddp).seen)
    train(ddp, loop, data[3:])
    resumed = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return {"at": at, "bitwise": torch.equal(straight, resumed)}


def test_a_users_state_dict_that_skips_the_base_still_keeps_the_stage(tmp_path):
    """pycomm.checkpoint saves and loads the accumulate stage's sums beside a user's own
    state_dict() that does not extend HookState's: the resume mid-window is bitwise."""
    for r in run_ranks(_rank_own_dict, 2, str(tmp_path), timeout=120):
        assert r["at"][0] == 3 and r["at"][1] > 0 and r["bitwise"], r


def test_a_users_state_and_hook_get_accumulation_checks_and_checkpoints(tmp_path):
    results = run_ranks(_rank_user_state, 2, str(tmp_path), timeout=120)
    assert results[0] == results[1]  # every rank: the same outcome, the same errors
    out = results[0]
    for key in (
        "reduced_every_second_micro_step",
        "buckets_follow_the_protocol",
        "hook_state",
        "resumed",
        "registered_instance",
    ):
        assert out[key] is True, (key, out)
    assert (
        "ranks disagree on hook option 'scale': rank 0 has 1.0, rank 1 has 2.0"
        in out["options_differ"]
    )
    assert "CountingState instance: its class is not registered" in out["unregistered"]
    assert "hook_options={'scale': 3} with a hook state instance" in out["with_options"]
    assert "already registered on a DDP model" in out["reused"]
    assert "expected (HookState instance, hook function)" in out["not_a_state"]
    assert "another process group than the DDP model's" in out["other_group"]
    assert (
        "pycomm.wrap: on rank 1: pycomm: hook=SoloState instance: its class is not registered"
        in out["instance_registered_on_rank_0"]
    )
    assert (
        "ranks disagree on registration of hook 'solo': rank 0 has 'test_registry.SoloState', "
        "rank 1 has 'not registered'" in out["registered_on_rank_0"]
    )


def test_no_module_imports_another_modules_private_names():
    bad = []
    for folder, _, files in os.walk(os.path.join(ROOT, "pycomm")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or node.module in (None, "__future__"):
                    continue
                for alias in node.names:
                    if not alias.name.startswith("_"):
                        continue
                    try:  # a private module of the package (pycomm._validate) is fine
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {alias.name}")
    assert not bad, bad


class SeenState(pycomm.hooks.CompressedState):
    """A compressed hook that records the buckets its exchange is handed."""

    hook_name = "seen"

    def make_codec(self, options):
        self.seen = set()
        return PlainCodec()

    def count_exchange(self, bucket, nbytes, collectives):
        ok = isinstance(bucket, Bucket) and all(
            isinstance(p, torch.Tensor) for p in bucket.parameters()
        )
        self.seen.add((type(bucket).__name__, ok, bucket.buffer().dim() == 1))
        super().count_exchange(bucket, nbytes, collectives)


def _rank_buckets():
    from pycomm.topology import set_nodes

    register_hook("seen", SeenState, pycomm.hooks.compressed_hook)
    pycomm.init(nodes=2)  # 2 nodes x 2 ranks
    try:
        out = {}
        for h in ("flat", "node"):
            ddp = pycomm.wrap(_model(), hook="seen", hook_options={"hierarchy": h})
            for _ in range(3):
                ddp(torch.randn(4, 12)).sum().backward()
            out[h] = sorted(pycomm.hook_state(ddp).seen)
        return out
    finally:
        unregister_hook("seen")
        set_nodes(None)


def test_the_buckets_pycomm_hands_an_exchange_follow_the_protocol():
    for out in run_ranks(_rank_buckets, 4, timeout=120):
        # the flat exchange gets DDP's buckets (or the hook's own, cut from the bound
        # parameters, where they differ); the node hierarchy hands the engine the shard, a
        # tensor, and counts the bucket itself: no bucket stand-in below the hook
        assert out["flat"] and all(ok and flat for _, ok, flat in out["flat"]), out
        assert {kind for kind, _, _ in out["flat"]} <= {"GradBucket", "_HookBucket"}, out
        assert out["node"] == [], out


BUILT_IN_CODECS = {
    "bf16": pycomm.hooks.Bf16Codec,
    "fp16": pycomm.hooks.Fp16Codec,
    "int8": Int8Codec,
    "fp8": Fp8Codec,
    "int4": Int4Codec,
    "onebit": OneBitCodec,
}


@pytest.mark.parametrize("name", sorted(BUILT_IN_CODECS))
def test_built_in_codecs_are_registered_as_a_users_codec(name):
    """A built-in codec hook is its codec class through register_hook(codec=...): the same
    codec registered by a user, with the built-in's defaults, resolves to the same options,
    codec format and bucket size."""
    spec = hook_spec(name)
    assert spec.codec is BUILT_IN_CODECS[name] and spec.hook is pycomm.hooks.compressed_hook
    builtin = spec.state(None)
    defaults = {
        k: getattr(spec.state, f"default_{k}")
        for k in ("start_iter", "error_feedback", "local_feedback")
    }
    register_hook(
        "user_copy",
        codec=BUILT_IN_CODECS[name],
        defaults=defaults,
        bucket_cap_mb=spec.state.default_bucket_cap_mb,
    )
    try:
        mine = hook_spec("user_copy").state(None)
        assert mine.options() == builtin.options()
        assert mine.identity()["codec format"] == builtin.identity()["codec format"]
        assert mine.default_bucket_cap_mb == builtin.default_bucket_cap_mb
    finally:
        unregister_hook("user_copy")


def test_built_in_defaults_and_advice_come_from_the_registration():
    onebit = hook_spec("onebit").state(None)
    assert (onebit.start_iter, onebit.local_feedback, onebit.default_bucket_cap_mb) == (
        20, False, None,
    )  # fmt: skip
    assert onebit.optimizer_advice(torch.optim.Adam([torch.zeros(1, requires_grad=True)]))
    assert onebit.optimizer_advice(torch.optim.SGD([torch.zeros(1, requires_grad=True)])) is None
    assert hook_spec("bf16").state(None).error_feedback is False
    assert hook_spec("int8").state(None).optimizer_advice(object()) is None
    assert hook_spec("int4").state(None, scale_dtype=torch.bfloat16).options()["scale_dtype"] == (
        "bfloat16"
    )


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"defaults": {"block": 4}}, r"defaults has 'block', expected some of start_iter"),
        ({"defaults": {"start_iter": 1}}, r"defaults\['start_iter'\]=1, expected an int >= 2"),
        ({"defaults": {"error_feedback": 1}}, r"defaults\['error_feedback'\]=1, expected True"),
        ({"defaults": [("start_iter", 3)]}, r"defaults=\[\('start_iter', 3\)\], expected a dict"),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0, expected a number > 0"),
        ({"advice": 3}, r"advice=3, expected a function \(state, optimizer\)"),
    ],
)
def test_a_codec_hooks_defaults_are_checked(kwargs, pattern):
    with pytest.raises(ValueError, match=r"register_hook\('mine'\): " + pattern):
        register_hook("mine", codec=PlainCodec, **kwargs)
    assert "mine" not in hook_names()


def test_defaults_belong_to_a_codec_hook():
    with pytest.raises(ValueError, match=r"defaults= without codec=\.\.\.; expected it with a"):
        register_hook("mine", MyState, my_hook, defaults={"start_iter": 3})


def test_the_old_state_class_names_still_reach_the_states_with_a_warning():
    with pytest.warns(FutureWarning, match=r"pycomm.hooks.Int8State is deprecated; use"):
        cls = pycomm.hooks.Int8State
    assert cls is hook_spec("int8").state
    with pytest.raises(AttributeError, match="no attribute 'Int9State'"):
        pycomm.hooks.Int9State  # noqa: B018


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _rank_one_codec_everywhere():
    """A codec registered once with the plain spelling, used by name by DDP, the Exchange
    and LocalSGD; a name a DDP hook holds is refused; unregistered, it is gone from all."""
    rank, n = dist.get_rank(), dist.get_world_size()
    name = "plain_everywhere"
    pycomm.codec.register_codec(name, PlainCodec, defaults={"start_iter": 2})
    try:
        out = {"listed": (name in pycomm.hooks.hook_names(), name in pycomm.Exchange.codecs())}
        t = torch.arange(8.0) + rank
        ex = pycomm.Exchange(name, block=2)
        ex.all_reduce(t, key="t").wait()  # PlainCodec is lossless: the exact mean
        out["exchange"] = torch.allclose(t, torch.arange(8.0) + (n - 1) / 2)
        out["exchange codec"] = ex.stats["codec_bytes_sent"] > 0
        ddp = pycomm.wrap(_model(), hook=name)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):  # the third past the warm-up: through the codec
            ddp(torch.randn(4, 12, generator=g)).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        state = pycomm.hook_state(ddp)
        out["ddp"] = all(torch.equal(grads, x) for x in _gathered(grads))
        out["ddp codec"] = type(state.codec) is PlainCodec and state.stats["codec_bytes_sent"] > 0
        model = _model()
        with torch.no_grad():
            model[0].weight.add_(rank)  # the ranks' replicas differ before the sync
        outer = pycomm.LocalSGD(model, sync_every=1, codec=name)
        outer.step()
        flat = _flat(model)
        out["local_sgd"] = all(torch.equal(flat, x) for x in _gathered(flat))
        out["local_sgd syncs"] = outer.stats["syncs"]
        out["taken"] = str(pytest.raises(ValueError, pycomm.codec.register_codec, "powersgd",
                                         PlainCodec).value)  # fmt: skip
    finally:
        unregister_hook(name)
    out["gone"] = name not in pycomm.hooks.hook_names() and name not in pycomm.Exchange.codecs()
    return out


def test_a_codec_registered_once_is_usable_everywhere_under_its_name():
    for out in run_ranks(_rank_one_codec_everywhere, 2, timeout=120):
        assert out.pop("listed") == (True, True) and out.pop("gone"), out
        assert "the name is taken by pycomm.hooks.powersgd.PowerSGDHookState" in out.pop("taken")
        assert out.pop("local_sgd syncs") == 1, out
        assert all(out.values()), out


def test_a_state_hook_with_a_codec_lends_the_codec_its_name():
    """register_hook(name, state, hook, codec=...): DDP runs the state, the Exchange (and
    FSDP2, the outer loops) the codec, under the one name; no other codec takes it."""
    register_hook("state_plain", MyState, my_hook, codec=PlainCodec)
    try:
        assert "state_plain" in pycomm.Exchange.codecs()
        assert hook_spec("state_plain").state is MyState
        assert pycomm.codec.codec_spec("state_plain").codec is PlainCodec
        with pytest.raises(ValueError, match="the name is taken by"):
            pycomm.codec.register_codec("state_plain", Int8Codec)
    finally:
        unregister_hook("state_plain")
    assert "state_plain" not in pycomm.Exchange.codecs() + pycomm.hooks.hook_names()
