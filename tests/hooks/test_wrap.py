"""pycomm.wrap / register / hook_state and the exact all-reduce hook, on gloo ranks."""

import re

import pytest
import torch
import torch.distributed as dist
from harness import error_text, errors_of, run_ranks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.codec.engine import ring_bytes

STEPS = 5


def _model(seed=0, hidden=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 4),
    )


def _train(ddp, steps=STEPS):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    dtype = next(ddp.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        x, y = x.to(dtype), y.to(dtype)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _rank_ddp_vs_pycomm(bucket_cap_mb, as_view=False):
    kw = dict(bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    plain = _train(DDP(_model(), **kw))
    ddp = pycomm.wrap(_model(), hook="allreduce", **kw)
    ours = _train(ddp)
    numel = sum(p.numel() for p in ddp.module.parameters())
    return plain, ours, dict(pycomm.hook_state(ddp).stats), numel


@pytest.mark.parametrize(
    "nprocs, as_view", [(1, False), (2, False), (3, False), (3, True), (4, False)]
)
def test_allreduce_bitwise_equal_to_ddp(nprocs, as_view):
    # 0.01 MB buckets: several buckets per step, and DDP's rebuild after the first iteration.
    # 3 ranks: 1/3 is inexact, so the hook must scale exactly as DDP does.
    results = run_ranks(_rank_ddp_vs_pycomm, nprocs, 0.01, as_view, timeout=120)
    for plain, ours, stats, numel in results:
        assert len(plain) == len(ours)
        for a, b in zip(plain, ours):
            assert torch.equal(a, b)
        assert stats["steps"] == STEPS
        assert stats["buckets"] > STEPS  # several buckets per step
        assert stats["bytes_sent"] == stats["bytes_fp32"] > 0 or nprocs == 1
        # ring accounting per bucket sums to (within rounding of each bucket) the whole model
        whole = STEPS * ring_bytes(numel * 4, nprocs)
        assert abs(stats["bytes_sent"] - whole) <= stats["buckets"]
        assert stats["compression"] == 1.0
    # every rank ends with the same parameters, and training moved them
    first = results[0][1]
    for _, ours, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, ours))
    assert not torch.equal(first[0], _model()[0].weight)


def _rank_powersgd():
    opts = dict(matrix_approximation_rank=1, start_powerSGD_iter=2)
    ref = DDP(_model(hidden=96))
    ref.register_comm_hook(torch_psgd.PowerSGDState(None, **opts), torch_psgd.powerSGD_hook)
    plain = _train(ref)
    ddp = pycomm.wrap(_model(hidden=96), hook="powersgd", hook_options=opts)
    ours = _train(ddp)
    return plain, ours, dict(pycomm.hook_state(ddp).stats)


def test_powersgd_is_torchs_own():
    for plain, ours, stats in run_ranks(_rank_powersgd, 2, timeout=90):
        assert all(torch.equal(a, b) for a, b in zip(plain, ours))
        assert stats["steps"] == STEPS
        # after start_powerSGD_iter the 96x96 and 96x32 weights travel as rank-1 factors
        assert stats["compression"] > 1.5


def _rank_mismatch(kind):
    rank = dist.get_rank()
    hook, options, hidden = "allreduce", {}, 64
    if kind == "hook" and rank == 1:
        hook = "powersgd"
    if kind == "options":
        hook, options = "powersgd", {"matrix_approximation_rank": 1 + rank}
    if kind == "model" and rank == 1:
        hidden = 65
    ddp_kwargs = {}
    if kind in ("find_unused_parameters", "static_graph"):
        ddp_kwargs[kind] = rank == 1
    if kind == "broadcast_buffers":
        ddp_kwargs[kind] = rank == 0
    if kind == "bucket_cap_mb":
        ddp_kwargs[kind] = 1 + rank
    if kind == "one rank's bucket_cap_mb" and rank == 1:
        ddp_kwargs["bucket_cap_mb"] = "x"
    if kind == "one rank's huge bucket_cap_mb" and rank == 1:
        ddp_kwargs["bucket_cap_mb"] = 1e300  # DDP's reducer failed on its int64 bytes
    if kind == "one rank's options" and rank == 1:
        options = "ab"
    if kind == "mixed_precision" and rank == 1:  # DDP's own hook: torch's error on rank 1
        from torch.nn.parallel.distributed import _MixedPrecision

        ddp_kwargs["mixed_precision"] = _MixedPrecision(param_dtype=torch.bfloat16)
    model = _model(hidden=hidden)
    if kind == "sparse embedding":  # gloo aborted on the sparse gradient against a dense one
        model = torch.nn.Sequential(torch.nn.Embedding(10, 32, sparse=rank == 1), model)
    if kind == "buffer shape":  # DDP's broadcast of the buffers aborted
        model.register_buffer("counts", torch.zeros(6 - rank))
    if kind == "one more buffer" and rank == 1:  # silently overwritten by rank 0's
        model.register_buffer("extra", torch.ones(3))
    try:
        pycomm.wrap(model, hook=hook, hook_options=options, **ddp_kwargs)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "kind, pattern",
    [
        ("hook", "ranks disagree on hook: rank 0 has 'allreduce', rank 1 has 'powersgd'"),
        (
            "options",
            "ranks disagree on hook option 'matrix_approximation_rank': rank 0 has 1, rank 1 has 2",
        ),
        (
            "model",
            r"ranks disagree on parameter 0: rank 0 has 0.weight \(64, 32\) float32, "
            r"rank 1 has 0.weight \(65, 32\)",
        ),
        (
            "find_unused_parameters",
            "ranks disagree on DDP option find_unused_parameters: rank 0 has False, rank 1 "
            "has True",
        ),
        ("static_graph", "ranks disagree on DDP option static_graph: rank 0 has False"),
        ("one rank's options", "pycomm.wrap: on rank 1: hook_options='ab'"),
        ("broadcast_buffers", "ranks disagree on DDP option broadcast_buffers: rank 0 has True"),
        ("bucket_cap_mb", "ranks disagree on DDP option bucket_cap_mb: rank 0 has 1, rank 1 has 2"),
        (
            "one rank's bucket_cap_mb",
            "pycomm.wrap: on rank 1: bucket_cap_mb='x', expected a positive number of MB",
        ),
        (
            "sparse embedding",
            r"ranks disagree on parameters with sparse gradients: rank 0 has \[\], rank 1 has "
            r"\['0.weight'\]",
        ),
        ("buffer shape", r"ranks disagree on buffer 0: rank 0 has counts \(6,\) float32, rank 1"),
        ("one more buffer", "ranks disagree on the model: rank 0 has 0 buffers, rank 1 has 1"),
        (
            "mixed_precision",
            "pycomm.wrap: on rank 1: mixed_precision=.*: DDP's mixed precision reduces the "
            "gradients through a communication hook of its own",
        ),
        (
            "one rank's huge bucket_cap_mb",
            r"pycomm.wrap: on rank 1: bucket_cap_mb=1e\+300, expected a positive number of MB, "
            r"at most 8.796e\+12 \(its bytes an int64\)",
        ),
    ],
)
def test_mismatch_raises_on_every_rank(kind, pattern):
    messages = run_ranks(_rank_mismatch, 2, kind, timeout=60)
    assert len(messages) == 2
    for m in messages:
        assert m is not None
        assert re.search(pattern, m), m


def _rank_register_ddp_options(kind):
    """A DDP model a framework built, its options differing across ranks (or bad on one):
    pycomm.register reads them from the model and names them on every rank."""
    rank = dist.get_rank()
    kwargs = {
        "find_unused_parameters": {"find_unused_parameters": rank == 0},
        "static_graph": {"static_graph": rank == 1},
        "bucket_cap_mb": {"bucket_cap_mb": 1 + rank},
        "negative bucket_cap_mb": {"bucket_cap_mb": -5 if rank == 1 else 25},
    }[kind]
    ddp = DDP(_model(), **kwargs)
    return error_text(lambda: pycomm.register(ddp, hook="int8"))


@pytest.mark.parametrize(
    "kind, text",
    [
        ("find_unused_parameters", "ranks disagree on DDP option find_unused_parameters: rank 0 "
         "has True, rank 1 has False"),
        ("static_graph", "ranks disagree on DDP option static_graph: rank 0 has False, rank 1 "
         "has True"),
        ("bucket_cap_mb", "ranks disagree on DDP option bucket_cap_mb: rank 0 has 1.0, rank 1 "
         "has 2.0"),
        ("negative bucket_cap_mb", "pycomm.register: on rank 1: the DDP model's "
         "bucket_cap_mb=-5, expected a positive number of MB"),
    ],
)  # fmt: skip
def test_register_compares_the_options_of_a_ddp_a_framework_built(kind, text):
    messages = run_ranks(_rank_register_ddp_options, 2, kind, timeout=60)
    assert messages[0] == messages[1] and text in messages[0], messages


# torch's PowerSGD options that torch takes and fails on (or trains on silently) later
_PSGD_BAD = [
    ("matrix_approximation_rank", 0),
    ("matrix_approximation_rank", 1.5),
    ("start_powerSGD_iter", "3"),
    ("min_compression_rate", -1.0),
    ("warm_start", 1),
    ("orthogonalization_epsilon", float("nan")),
]


def _rank_api_errors():
    model = _model()
    out = errors_of(
        {
            "unknown_hook": lambda: pycomm.wrap(model, hook="zstd"),
            "zero_steps": lambda: pycomm.wrap(model, accumulate_steps=0),
            "float_steps": lambda: pycomm.wrap(model, accumulate_steps=2.0),
            "accumulate": lambda: pycomm.hook_state(pycomm.wrap(_model(), accumulate_steps=4)),
            "psgd_option": lambda: pycomm.wrap(model, hook="powersgd", hook_options={"rank": 2}),
            **{
                f"psgd {name}={value!r}": lambda o={name: value}: pycomm.wrap(
                    model, hook="powersgd", hook_options=o
                )
                for name, value in _PSGD_BAD
            },
            "no_state": lambda: pycomm.hook_state(DDP(_model())),
            "not_a_module": lambda: pycomm.wrap(5),
            "not_a_group": lambda: pycomm.wrap(_model(), process_group=5),
            "not_ddp": lambda: pycomm.register(model),
        }
    )
    ddp = DDP(_model())
    pycomm.register(ddp, hook="allreduce")
    try:
        pycomm.register(ddp, hook="allreduce")
        out["twice"] = None
    except RuntimeError as e:
        out["twice"] = ("RuntimeError", str(e))
    return out


def test_api_errors():
    (out,) = run_ranks(_rank_api_errors, 1, timeout=60)
    assert out["unknown_hook"] == (
        "ValueError",
        "pycomm: hook='zstd' is not one of allreduce, auto, bf16, fp16, fp8, int4, int8, onebit, "
        "powersgd "
        "(the registered hooks; pycomm.hooks.register_hook adds one)",
    )
    assert out["zero_steps"][0] == "ValueError" and "accumulate_steps=0" in out["zero_steps"][1]
    assert out["float_steps"][0] == "ValueError" and "accumulate_steps=2.0" in out["float_steps"][1]
    assert out["accumulate"] is None
    assert (
        out["psgd_option"][0] == "ValueError" and "unknown option 'rank'" in out["psgd_option"][1]
    )
    for name, value in _PSGD_BAD:
        kind, message = out[f"psgd {name}={value!r}"]
        assert kind == "ValueError" and f"pycomm powersgd hook: {name}={value!r}" in message
    assert out["no_state"][0] == "ValueError" and "no pycomm hook" in out["no_state"][1]
    assert out["not_a_module"] == (
        "TypeError",
        "pycomm.wrap: module is a int, expected a torch.nn.Module",
    )
    assert (
        out["not_a_group"][0] == "TypeError"
        and "process_group=5, expected" in (out["not_a_group"][1])
    )
    assert out["not_ddp"][0] == "TypeError"
    assert out["twice"][0] == "RuntimeError" and "already has a pycomm hook" in out["twice"][1]


def _rank_grad_dtypes():
    mixed = _model()
    mixed[2].double()  # one float64 layer in an fp32 model
    out = errors_of(
        {
            "int8": lambda: pycomm.wrap(mixed, hook="int8"),
            "accumulated": lambda: pycomm.wrap(mixed, hook="fp16", accumulate_steps=2),
            "exact accumulated": lambda: pycomm.wrap(
                _model().double(), hook="allreduce", accumulate_steps=2
            ),
            "auto_allow": lambda: pycomm.wrap(
                _model().double(), hook="auto", hook_options={"allow": ["int8", "bf16"]}
            ),
        }
    )
    # auto on a float64 model: its candidates narrow to the hooks that reduce float64
    ours = pycomm.wrap(_model().double(), hook="auto", hook_options={"start_iter": 2})
    plain = DDP(_model().double())
    got, want = _train(ours, steps=6), _train(plain, steps=6)
    out["auto_choice"] = pycomm.hook_state(ours).stats["auto"]["choice"]
    out["auto_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
    return out


def test_a_hook_that_cannot_reduce_a_gradient_dtype_is_refused_at_registration():
    for out in run_ranks(_rank_grad_dtypes, 2, timeout=90):
        for name, hook in (("int8", "int8"), ("accumulated", "fp16")):
            kind, message = out[name]
            assert kind == "TypeError"
            assert message.startswith(
                f"pycomm.register: the {hook} hook reduces float32, bfloat16 or float16 "
                "gradients, and parameter '2.weight' has dtype float64"
            )
            assert "a hook that reduces it: allreduce, auto, powersgd" in message
        assert out["exact accumulated"] == (
            "TypeError",
            "pycomm: accumulate_steps=2 with parameters of ['torch.float64']: the accumulate "
            "stage keeps float32, bfloat16 and float16 gradients; expected accumulate_steps=1 "
            "(DDP's no_sync() for the micro-steps) or those dtypes",
        )
        kind, message = out["auto_allow"]
        assert kind == "TypeError"
        assert "no hook in allow=['bf16', 'int8'] reduces gradients of dtype float64" in message
        assert out["auto_choice"] == "allreduce" and out["auto_equal"]


def _rank_state_dict():
    ddp = pycomm.wrap(_model(), hook="allreduce")
    _train(ddp, steps=2)
    state = pycomm.hook_state(ddp)
    saved = state.state_dict()
    fresh = pycomm.wrap(_model(), hook="allreduce")
    pycomm.hook_state(fresh).load_state_dict(saved)
    restored = dict(pycomm.hook_state(fresh).stats)
    other = pycomm.wrap(_model(), hook="powersgd")
    try:
        pycomm.hook_state(other).load_state_dict(saved)
        err = None
    except ValueError as e:
        err = str(e)
    return saved["stats"], restored, err


def test_state_dict_roundtrip_and_mismatch():
    for saved, restored, err in run_ranks(_rank_state_dict, 2, timeout=60):
        assert saved == restored and saved["steps"] == 2
        assert err is not None and "hook is 'allreduce' in the checkpoint but 'powersgd'" in err


def _rank_powersgd_buckets(steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    ddp = pycomm.wrap(
        model,
        hook="powersgd",
        bucket_cap_mb=0.02,  # one bucket per layer: equal-sized P and Q in every bucket
        hook_options={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(16, 64, generator=gen)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_powersgd_with_many_buckets_keeps_ranks_in_step():
    """torch's PowerSGD issues P and Q from callbacks in completion order, which differs
    between ranks: on one gloo group that hung (or mixed buckets) within a few runs of this.
    pycomm runs one bucket's exchange after the other: every run ends with equal parameters."""
    for _ in range(3):
        a, b = run_ranks(_rank_powersgd_buckets, 2, 30, timeout=60)
        assert torch.equal(a, b)


def _rank_one_spelling():
    """``hook_options={...}`` everywhere; the older keyword spelling still registers the same
    hook, with a FutureWarning; an option given both ways is refused."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    new = pycomm.register(DDP(model), hook="int8", hook_options={"block": 128}).options()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = pycomm.register(DDP(torch.nn.Linear(8, 4)), hook="int8", block=128).options()
    try:
        pycomm.register(DDP(model), hook="int8", hook_options={"block": 64}, block=128)
        both = None
    except ValueError as e:
        both = str(e)
    warned = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return new == old, warned, both


def test_hook_options_is_one_dict():
    for same, warned, both in run_ranks(_rank_one_spelling, 2, timeout=60):
        assert same
        assert len(warned) == 1 and "pass hook_options={'block': ...}" in warned[0]
        assert "option 'block' given both in hook_options and as a keyword argument" in both
