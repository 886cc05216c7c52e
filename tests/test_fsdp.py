"""pycomm.fsdp: FSDP2's gradient reduce-scatter through pycomm's codecs, against FSDP2's own
reduction, on 2 and 4 gloo ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from fsdp_harness import data as _data
from fsdp_harness import full as _full
from fsdp_harness import grads as _grads
from fsdp_harness import model as _model
from fsdp_harness import shard as _shard
from fsdp_harness import straight_and_resumed, train
from harness import run_ranks
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import pycomm
import pycomm.fsdp

_REFERENCES: dict = {}


def _reference(nprocs, *args):
    """FSDP2's own run ``_rank_train("fsdp", *args)``, once for every test comparing to it."""
    key = (nprocs, repr(args))
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(_rank_train, nprocs, "fsdp", *args, timeout=120)
    return _REFERENCES[key]


def _rank_train(hook, per_block, steps, options, divide=None, k=1):
    """``steps`` optimizer steps of ``k`` micro-batches each (FSDP's own
    set_requires_gradient_sync for accumulation); the gradients of every step, the params."""
    m = _shard(_model(), per_block)
    if divide is not None:
        m.set_gradient_divide_factor(divide)
    comm = pycomm.fsdp.compress(m, hook=hook, hook_options=options) if hook != "fsdp" else None
    return train(m, comm, steps, k)


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("per_block", [True, False], ids=["per-block", "root"])
def test_allreduce_is_fsdp_reduction_within_rounding(nprocs, per_block):
    ref = _reference(nprocs, per_block, 3, {})
    ours = run_ranks(_rank_train, nprocs, "allreduce", per_block, 3, {}, timeout=120)
    for (ref_p, ref_g, _), (p, g, stats) in zip(ref, ours):
        for a, b in zip(g, ref_g):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
        assert stats[-1]["calls"] == 3 * (3 if per_block else 1)  # the root holds none
        assert stats[-1]["bytes_sent"] == stats[-1]["bytes_fp32"]


def test_gradient_divide_factor_and_sum_are_honoured():
    # a divide factor of 1: FSDP asks for a plain SUM; 8: PREMUL_SUM(1/8)
    for divide in (1.0, 8.0):
        ref = _reference(2, True, 2, {}, divide)
        ours = run_ranks(_rank_train, 2, "allreduce", True, 2, {}, divide, timeout=120)
        for (_, ref_g, _), (_, g, _) in zip(ref, ours):
            for a, b in zip(g, ref_g):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hook,nprocs", [("bf16", 2), ("int8", 2), ("int8", 4)])
def test_compressed_hooks_train_and_ranks_agree(hook, nprocs):
    ref = _reference(nprocs, True, 6, {})
    ours = run_ranks(_rank_train, nprocs, hook, True, 6, {}, timeout=120)
    for r in range(1, nprocs):
        assert torch.equal(ours[0][0], ours[r][0])
        assert all(torch.equal(a, b) for a, b in zip(ours[0][1], ours[r][1]))
    p, grads, stats = ours[0]
    ref_grads = ref[0][1]
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-6, atol=1e-7)  # warm-up: exact
    for a, b in zip(grads[2:], ref_grads[2:]):  # compressed: close, not equal
        assert not torch.equal(a, b)
        assert (a - b).norm() / b.norm() < (0.02 if hook == "int8" else 0.01)
    # bytes of the compressed steps against an fp32 reduce-scatter of the same inputs
    sent = stats[-1]["bytes_sent"] - stats[1]["bytes_sent"]
    fp32 = stats[-1]["bytes_fp32"] - stats[1]["bytes_fp32"]
    assert sent / fp32 <= (0.3 if hook == "int8" else 0.56), sent / fp32


def test_accumulation_through_fsdp_no_sync_equals_one_large_batch():
    k = 3
    ours = run_ranks(_rank_train, 2, "allreduce", True, 2, {}, None, k, timeout=120)
    ref = _reference(2, True, 2, {}, None, k)
    for (p, _, stats), (ref_p, _, _) in zip(ours, ref):
        assert stats[-1]["calls"] == 2 * 3  # one reduce-scatter per block per window
        torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
    int8 = run_ranks(_rank_train, 2, "int8", True, 3, {}, None, k, timeout=120)
    assert torch.equal(int8[0][0], int8[1][0])


def _rank_resume(options, folder=None):
    def build():
        m = _shard(_model())
        return (
            m,
            pycomm.fsdp.compress(m, hook="int8", hook_options=options),
            torch.optim.Adam(m.parameters(), lr=1e-2),
        )

    straight, resumed, comm, _ = straight_and_resumed(build, _data(6, seed=3), 3, folder)
    return straight, resumed, comm.stats


@pytest.mark.parametrize(
    "options", [{"error_feedback": True}, {"error_feedback": True, "residual_dtype": "bfloat16"}]
)
def test_resume_is_bitwise(options, tmp_path):
    folder = str(tmp_path) if "residual_dtype" in options else None
    for straight, resumed, stats in run_ranks(_rank_resume, 2, options, folder, timeout=120):
        assert torch.equal(straight, resumed)
        assert stats["residual_bytes"] > 0


def _rank_mixed_precision():
    m = _shard(_model(), mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    comm = pycomm.fsdp.compress(m, hook="int8", hook_options={"start_iter": 2})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for x, y in _data(8):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return _full(m), losses, comm.stats


def test_mixed_precision_reduce_dtype():
    ranks = run_ranks(_rank_mixed_precision, 2, timeout=120)
    assert torch.equal(ranks[0][0], ranks[1][0])
    assert ranks[0][2]["compression"] > 1.5


def _rank_float64(hook):
    """Gradients of 2 steps of a float64 model, or the error of the first backward."""
    m = _shard(_model().double())
    if hook != "fsdp":
        pycomm.fsdp.compress(m, hook=hook)
    grads = []
    try:
        for x, y in _data(2):
            torch.nn.functional.mse_loss(m(x.double()), y.double()).backward()
            grads.append(_grads(m))
            m.zero_grad()
    except TypeError as e:
        return str(e)
    return grads


def test_float64_is_reduced_in_float64_and_refused_by_a_compressed_hook():
    ref = run_ranks(_rank_float64, 2, "fsdp", timeout=120)
    ours = run_ranks(_rank_float64, 2, "allreduce", timeout=120)
    for ref_g, g in zip(ref, ours):
        for a, b in zip(g, ref_g):
            assert a.dtype == torch.float64
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)  # not summed in fp32
    for message in run_ranks(_rank_float64, 2, "int8", timeout=120):
        assert message == (
            "pycomm.fsdp (4): the int8 hook reduces float32, bfloat16 or float16 gradients, "
            "and FSDP reduces this module's in float64; expected a model of those dtypes, "
            "MixedPrecisionPolicy(reduce_dtype=torch.float32), or hook='allreduce'"
        )


def _rank_refusals():
    errors = {}

    def attempt(key, fn):
        try:
            fn()
            errors[key] = None
        except (ValueError, TypeError, RuntimeError) as e:
            errors[key] = str(e)

    rank = dist.get_rank()
    attempt(
        "options differ",
        lambda: pycomm.fsdp.compress(
            _shard(_model()), hook="int8", hook_options={"block": 64 if rank == 0 else 32}
        ),
    )
    attempt(
        "hook differs",
        lambda: pycomm.fsdp.compress(_shard(_model()), hook="int8" if rank == 0 else "bf16"),
    )
    attempt("not sharded", lambda: pycomm.fsdp.compress(_model(), hook="int8"))
    attempt("powersgd", lambda: pycomm.fsdp.compress(_shard(_model()), hook="powersgd"))
    attempt("unknown hook", lambda: pycomm.fsdp.compress(_shard(_model()), hook="int3"))
    attempt(
        "hierarchy",
        lambda: pycomm.fsdp.compress(
            _shard(_model()), hook="int8", hook_options={"hierarchy": "node"}
        ),
    )
    attempt(
        "bad option",
        lambda: pycomm.fsdp.compress(_shard(_model()), hook="int8", hook_options={"bloc": 64}),
    )
    attempt(
        "bad value",
        lambda: pycomm.fsdp.compress(_shard(_model()), hook="int8", hook_options={"block": 0}),
    )
    if dist.get_world_size() == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        attempt("hsdp", lambda: pycomm.fsdp.compress(_shard(_model(), mesh=mesh), hook="int8"))
    return errors


@pytest.mark.parametrize("nprocs", [2, 4])
def test_refusals_are_clear_and_the_same_on_every_rank(nprocs):
    ranks = run_ranks(_rank_refusals, nprocs, timeout=120)
    for other in ranks[1:]:
        assert other == ranks[0]
    e = ranks[0]
    differ = "ranks disagree on hook option 'block': rank 0 has 64, rank 1 has 32"
    assert differ in e["options differ"]
    assert "ranks disagree on hook" in e["hook differs"]
    assert "has no FSDPModule" in e["not sharded"]
    assert "'powersgd' is not a reduce-scatter" in e["powersgd"]
    assert "hook='int3'" in e["unknown hook"]
    assert "hierarchy='node'" in e["hierarchy"]
    assert "'bloc'" in e["bad option"]
    assert "block" in e["bad value"]
    if nprocs == 4:
        assert "2-D device mesh (FSDP2's native HSDP" in e["hsdp"]
        assert "shard on pycomm.fsdp.node_mesh()" in e["hsdp"]


def test_bench_fsdp_measures_the_reduce_scatter_on_the_wire(tmp_path, capfd):
    """python -m pycomm.bench --fsdp under --link: the reduce-scatter's bytes on the shaped
    loopback agree with what the hook counts (its own payload, plus TCP/IP headers). Its
    main() in this process, which has torch imported already (a shaped run re-runs itself
    under ``python -m pycomm.bench`` in a namespace of its own)."""
    import json

    from pycomm.bench import link
    from pycomm.bench.__main__ import main

    path = tmp_path / "fsdp.json"
    # 4 steps: the bench takes each hook's fewest bytes, and some steps carry more
    args = ["--steps", "4", "--warmup", "2", "--layers", "2", "--width", "256", "--batch", "8"]
    args += ["--hooks", "fsdp,int8", "--json", str(path)]
    if link.cannot_shape() is None:
        args += ["--link", "10gbit"]
    assert main(["--fsdp", *args]) == 0, capfd.readouterr().err
    doc = json.loads(path.read_text())
    int8 = doc["hooks"]["int8"]
    assert int8["counted_bytes_per_step"] > 0
    if doc["link"]["shaped"]:
        assert int8["rs_wire_bytes_per_step"] >= int8["counted_bytes_per_step"]
        assert int8["rs_wire_bytes_per_step"] < 1.2 * int8["counted_bytes_per_step"]
        assert doc["hooks"]["int8"]["rs_wire_vs_fsdp"] < 0.3


def _rank_placement(hook):
    from torch.distributed.tensor import Shard

    m = _model()
    for i in (0, 2):  # on their last dimension (FSDP needs it even: not the 63-wide head)
        fully_shard(m[i], shard_placement_fn=lambda p: Shard(p.dim() - 1))
    fully_shard(m[4])
    fully_shard(m)
    if hook != "fsdp":
        pycomm.fsdp.compress(m, hook=hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in _data(3):
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _full(m)


def test_shard_placement_fn_on_one_mesh():
    ref = run_ranks(_rank_placement, 2, "fsdp", timeout=120)
    ours = run_ranks(_rank_placement, 2, "allreduce", timeout=120)
    int8 = run_ranks(_rank_placement, 2, "int8", timeout=120)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(int8[0], int8[1])


def _format_1(comm):
    """``comm``'s state as pycomm.fsdp's state_dict wrote it before the Exchange (format 1):
    per module its warm-up count, its residual (the padded input's, None before its first
    compressed call or without error feedback) and its counters."""
    ex = comm.exchange.state_dict()
    index = {key: i for i, (_, key) in enumerate(ex["keys"])}
    residuals = {k[0]: r["r1"] for k, r in ex["exchange"]["residuals"].items()}
    return {
        "fingerprint": comm.fingerprint(),
        "rank": comm.rank,
        "world_size": comm.world_size,
        "modules": {
            name: {
                "iter": m.iter,
                "residual": residuals.get(index.get(name)),
                "stats": dict(m.stats),
            }
            for name, m in comm.modules.items()
        },
    }


def _rank_format_1(options):
    """A checkpoint of format 1 loads: the run goes on bitwise as without the cut."""
    data = _data(6, seed=3)

    def build():
        m = _shard(_model())
        comm = pycomm.fsdp.compress(m, hook="int8", hook_options=options)
        return m, comm, torch.optim.Adam(m.parameters(), lr=1e-2)

    def step(m, opt, x, y):
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()

    m, comm, opt = build()
    for x, y in data:
        step(m, opt, x, y)
    straight, straight_stats = _full(m), comm.stats
    m, comm, opt = build()
    for x, y in data[:3]:
        step(m, opt, x, y)
    old = copy.deepcopy(_format_1(comm))
    saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    version = comm.state_dict()["format"]
    m, comm, opt = build()
    m.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    comm.load_state_dict(old)
    loaded = {name: (rs.iter, dict(rs.stats)) for name, rs in comm.modules.items()}
    for x, y in data[3:]:
        step(m, opt, x, y)
    stats = comm.stats
    errors = {}
    try:
        comm.load_state_dict({**comm.state_dict(), "format": 3})
    except ValueError as e:
        errors["newer"] = str(e)
    broken = copy.deepcopy(old)
    if options.get("error_feedback"):
        broken["modules"]["2"]["residual"] = broken["modules"]["2"]["residual"][:-8]
        try:
            comm.load_state_dict(broken)
        except ValueError as e:
            errors["broken"] = str(e)
        errors["unchanged"] = comm.stats == stats  # a failed load changes nothing
    want = {name: (s["iter"], s["stats"]) for name, s in old["modules"].items()}
    return (
        version,
        torch.equal(straight, _full(m)),
        loaded == want,
        stats == straight_stats,
        errors,
    )


@pytest.mark.parametrize("options", [{"error_feedback": True}, {}])
def test_a_checkpoint_of_format_1_loads_and_resumes_bitwise(options):
    for version, same, loaded, stats, errors in run_ranks(_rank_format_1, 2, options, timeout=120):
        assert version == 2
        assert same and loaded and stats
        newer = errors["newer"]
        assert "cannot load a state of format 3; this pycomm reads formats 1 and 2" in newer
        if options:
            assert errors["broken"].startswith(
                "pycomm.fsdp: cannot load module '2' of a state written by pycomm.fsdp "
                "format 1 (before the Exchange): pycomm.Exchange.load_key: residual of "
            )
            assert errors["unchanged"]


def _rank_group_and_residual():
    """The group FSDP passes is the Exchange's (or has its ranks), else a ValueError naming
    both; error feedback keeps one residual, on the padded input (4 bytes a parameter)."""
    m = _shard(_model())
    comm = pycomm.fsdp.compress(m, hook="int8", hook_options={"error_feedback": True})
    for x, y in _data(3):
        torch.nn.functional.mse_loss(m(x), y).backward()
        m.zero_grad()
    per_param = comm.stats["residual_bytes"] / sum(p.numel() for p in m.parameters())
    n, rank = dist.get_world_size(), dist.get_rank()
    same_ranks = dist.new_group(list(range(n)))
    alone = [dist.new_group([r]) for r in range(n)][rank]
    rs = comm.modules["0"]
    out = torch.empty(8)
    rs(out, torch.ones(8 * n), same_ranks, dist.ReduceOp.SUM)
    try:
        rs(torch.empty(8), torch.ones(8), alone, dist.ReduceOp.SUM)
        other = None
    except ValueError as e:
        other = str(e)
    return per_param, torch.equal(out, torch.full((8,), float(n))), other


def test_the_group_is_checked_and_the_residual_is_one_copy():
    for rank, (per_param, summed, other) in enumerate(
        run_ranks(_rank_group_and_residual, 2, timeout=120)
    ):
        assert 4.0 <= per_param < 4.25, per_param  # padding to whole blocks; no phase 2
        assert summed
        assert other == (
            f"pycomm.fsdp (0): FSDP reduce-scatters on the process group of ranks [{rank}], "
            "expected the group of ranks [0, 1] that compress() built its Exchange on (the "
            "sharded parameters' mesh); call pycomm.fsdp.compress after fully_shard, with every "
            "module on that mesh"
        )
