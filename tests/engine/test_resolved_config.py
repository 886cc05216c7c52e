"""The ranks compare what each resolved, not what the caller spelled: the same hook name bound
to another codec on one rank, a codec with another default there, or one whose format differs
is a ValueError on every rank, within the run's deadline, naming the difference, through
wrap, register, a framework adapter and pycomm.fsdp.compress; an option spelled out at its
default on one rank only is one configuration, and trains with the ranks bitwise equal."""

import types

import torch
import torch.distributed as dist
from harness import error_text as _error
from harness import run_ranks
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
import pycomm.accelerate
import pycomm.fsdp
from pycomm.hooks import Fp8Codec, Int8Codec, register_hook, unregister_hook

# what pycomm.accelerate.register reads of an Accelerator prepared without a comm_hook
_ACCELERATOR = types.SimpleNamespace(
    num_processes=2, ddp_handler=None, gradient_accumulation_steps=1
)

# a module-level value a codec reads in __init__: another on one rank is "an older copy of the
# module on one node" whose default is not a parameter default
HIDDEN_BLOCK = {"value": 64}


class TwinInt8(Int8Codec):
    """The codec rank 0 binds to the name "twin"."""

    def __init__(self, block: int = 64) -> None:
        super().__init__(block)


class TwinFp8(Fp8Codec):
    """The codec rank 1 binds to the same name."""

    def __init__(self, block: int = 64) -> None:
        super().__init__(block)


class Hidden(Int8Codec):
    """A codec whose block is set inside __init__, not by a parameter."""

    def __init__(self) -> None:
        super().__init__(HIDDEN_BLOCK["value"])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _rank_mismatches():
    rank = dist.get_rank()
    out = {}
    # 1. the same name bound to another codec on rank 1
    register_hook("twin", codec=TwinInt8 if rank == 0 else TwinFp8)
    try:
        out["wrap: other codec"] = _error(lambda: pycomm.wrap(_model(), hook="twin"))
        out["register: other codec"] = _error(lambda: pycomm.register(DDP(_model()), hook="twin"))
    finally:
        unregister_hook("twin")
    # 2. the same codec class with another default on rank 1
    old = TwinInt8.__init__.__defaults__
    if rank == 1:
        TwinInt8.__init__.__defaults__ = (32,)
    register_hook("twin", codec=TwinInt8)
    try:
        out["wrap: other default"] = _error(lambda: pycomm.wrap(_model(), hook="twin"))
        out["accumulate: other default"] = _error(
            lambda: pycomm.wrap(_model(), hook="twin", accumulate_steps=2)
        )
        out["accelerate: other default"] = _error(
            lambda: pycomm.accelerate.register(_ACCELERATOR, DDP(_model()), hook="twin")
        )
    finally:
        unregister_hook("twin")
        TwinInt8.__init__.__defaults__ = old
    # 3. a default inside __init__: the codec's format differs
    HIDDEN_BLOCK["value"] = 64 if rank == 0 else 128
    register_hook("hidden", codec=Hidden)
    try:
        out["wrap: other format"] = _error(lambda: pycomm.wrap(_model(), hook="hidden"))
    finally:
        unregister_hook("hidden")
        HIDDEN_BLOCK["value"] = 64
    # 4. an engine option's default on one rank only
    opts = {"start_iter": 3} if rank == 0 else {"start_iter": 2}
    out["engine option"] = _error(lambda: pycomm.wrap(_model(), hook="int8", hook_options=opts))
    # 5. a bad value on one rank only: raised on every rank, not left to hang the other
    bad = {"block": 64} if rank == 0 else {"block": 0}
    out["bad value on rank 1"] = _error(
        lambda: pycomm.wrap(_model(), hook="int8", hook_options=bad)
    )
    out["bad accumulate_steps on rank 1"] = _error(
        lambda: pycomm.wrap(_model(), hook="int8", accumulate_steps=2 if rank == 0 else 0)
    )
    # 6. auto allowed other hooks on rank 1: named as its option, not as a candidate
    allow = ["allreduce", "int8"] if rank == 0 else ["allreduce", "bf16"]
    out["auto allow"] = _error(
        lambda: pycomm.wrap(_model(), hook="auto", hook_options={"allow": allow})
    )
    return out


def test_resolved_differences_are_named_on_every_rank():
    ranks = run_ranks(_rank_mismatches, 2, timeout=60)
    assert ranks[0] == ranks[1]  # the same error on every rank
    e = ranks[0]
    for via in ("wrap", "register"):
        assert (
            f"pycomm.{via}: ranks disagree on codec: rank 0 has 'test_resolved_config.TwinInt8', "
            "rank 1 has 'test_resolved_config.TwinFp8'" in e[f"{via}: other codec"]
        ), e
    for case in ("wrap", "accumulate", "accelerate"):
        assert (
            "ranks disagree on hook option 'block': rank 0 has 64, rank 1 has 32"
            in e[f"{case}: other default"]
        ), e
    assert "ranks disagree on codec format: rank 0 has 'block 64," in e["wrap: other format"]
    assert "rank 1 has 'block 128," in e["wrap: other format"]
    assert (
        "ranks disagree on hook option 'start_iter': rank 0 has 3, rank 1 has 2"
        in e["engine option"]
    )
    assert e["bad value on rank 1"].startswith("ValueError: pycomm.wrap: on rank 1: ")
    assert "block=0" in e["bad value on rank 1"]
    assert "ranks disagree on hook option 'allow'" in e["auto allow"], e["auto allow"]
    assert "on rank 1: " in e["bad accumulate_steps on rank 1"]
    assert "accumulate_steps" in e["bad accumulate_steps on rank 1"]


def _rank_explicit_default(hook, k):
    """``{"block": B}`` (the default) on rank 0, ``{}`` on rank 1: trains."""
    rank = dist.get_rank()
    default = pycomm.hooks.hook_spec(hook).codec().block
    opts = {"block": default} if rank == 0 else {}
    model = _model()
    ddp = pycomm.wrap(model, hook=hook, hook_options=opts, accumulate_steps=k)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loop = pycomm.TrainLoop(ddp, opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6 * k):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    state = pycomm.hook_state(ddp)
    return [p.detach().clone() for p in model.parameters()], dict(state.stats)


def test_an_option_spelled_at_its_default_on_one_rank_is_one_configuration():
    for hook, k in (("int8", 1), ("int4", 2)):
        (a, stats), (b, _) = run_ranks(_rank_explicit_default, 2, hook, k, timeout=60)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert stats["bytes_sent"] < stats["bytes_fp32"]  # it compressed


def _rank_fsdp_default():
    rank = dist.get_rank()
    old = TwinInt8.__init__.__defaults__
    if rank == 1:
        TwinInt8.__init__.__defaults__ = (32,)
    register_hook("twin", codec=TwinInt8)
    out = {}
    try:
        model = _model()
        fully_shard(model)
        out["other default"] = _error(lambda: pycomm.fsdp.compress(model, hook="twin"))
    finally:
        unregister_hook("twin")
        TwinInt8.__init__.__defaults__ = old
    model = _model()
    fully_shard(model)
    spelled = {"block": 64} if rank == 0 else {}
    out["spelled default"] = _error(
        lambda: pycomm.fsdp.compress(model, hook="int8", hook_options=spelled)
    )
    return out


def test_fsdp_compares_what_each_rank_resolved():
    ranks = run_ranks(_rank_fsdp_default, 2, timeout=60)
    assert ranks[0] == ranks[1]
    assert (
        "pycomm.fsdp.compress: ranks disagree on option 'block': rank 0 has 64, rank 1 "
        "has 32" in ranks[0]["other default"]
    )
    assert ranks[0]["spelled default"] is None


def test_a_checkpoint_of_another_hook_names_the_hook_before_its_options():
    from pycomm.codec.agree import first_difference

    saved = {"options": {"block": 64, "hook": "int8"}, "world_size": 2}
    mine = {"options": {"hook": "bf16"}, "world_size": 2}
    assert first_difference(saved, mine) == ("options['hook']", "'int8'", "'bf16'")
    assert first_difference(saved, saved) is None
