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
from fsdp_harness import set_divide_factor, straight_and_resumed, train
from fsdp_harness import shard as _shard
from harness import error_text, run_ranks
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
        set_divide_factor(m, divide)
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
    # a divide factor of 1: FSDP asks for a plain SUM; 8: PREMUL_SUM(1/8), which gloo has not
    # for FSDP2's own: the first step's gradient is FSDP2's mean times 2 / factor
    ref = _reference(2, True, 1, {})
    for divide in (1.0, 8.0):
        ours = run_ranks(_rank_train, 2, "allreduce", True, 1, {}, divide, timeout=120)
        for (_, ref_g, _), (_, g, _) in zip(ref, ours):
            torch.testing.assert_close(g[0], ref_g[0] * (2 / divide), rtol=1e-6, atol=1e-7)


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


def _rank_resume(options, folder=None, all_gather=None):
    def build():
        m = _shard(_model())
        return (
            m,
            pycomm.fsdp.compress(m, hook="int8", hook_options=options, all_gather=all_gather),
            torch.optim.Adam(m.parameters(), lr=1e-2),
        )

    run = straight_and_resumed(build, _data(6, seed=3), 3, folder)
    straight, resumed, comm, _, straight_stats = run
    return straight, resumed, comm.stats, straight_stats


@pytest.mark.parametrize(
    "options", [{"error_feedback": True}, {"error_feedback": True, "residual_dtype": "bfloat16"}]
)
def test_resume_is_bitwise(options, tmp_path):
    folder = str(tmp_path) if "residual_dtype" in options else None
    for straight, resumed, stats, _ in run_ranks(_rank_resume, 2, options, folder, timeout=120):
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
    attempt(
        "start_iter",
        lambda: pycomm.fsdp.compress(
            _shard(_model()), hook="int8", hook_options={"start_iter": -1}
        ),
    )
    twice = _shard(_model())
    pycomm.fsdp.compress(twice, hook="int8")
    attempt("twice", lambda: pycomm.fsdp.compress(twice, hook="bf16"))
    if dist.get_world_size() == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        attempt("hsdp", lambda: pycomm.fsdp.compress(_shard(_model(), mesh=mesh), hook="int8"))

        def regather():  # reshard_after_forward=2: backward all-gathers over 2 of 4 ranks
            m = _shard(_model(), reshard_after_forward=2)
            pycomm.fsdp.compress(m, hook="int8", all_gather="int8")
            x, y = _data(1)[0]
            torch.nn.functional.mse_loss(m(x), y).backward()

        attempt("reshard to 2", regather)
    return errors


@pytest.mark.parametrize("nprocs", [2, 4])
def test_refusals_are_clear_and_the_same_on_every_rank(nprocs):
    ranks = run_ranks(_rank_refusals, nprocs, timeout=120)
    regathers = [e.pop("reshard to 2", None) for e in ranks]  # each rank names its own pair
    for other in ranks[1:]:
        assert other == ranks[0]
    e = ranks[0]
    differ = "ranks disagree on option 'block': rank 0 has 64, rank 1 has 32"
    assert differ in e["options differ"]
    assert "ranks disagree on hook" in e["hook differs"]
    assert "has no FSDPModule" in e["not sharded"]
    assert "'powersgd' is not a reduce-scatter" in e["powersgd"]
    assert "hook='int3'" in e["unknown hook"]
    assert "hierarchy='node'" in e["hierarchy"]
    assert "'bloc'" in e["bad option"]
    assert "block" in e["bad value"]
    assert e["start_iter"].startswith(
        "pycomm.fsdp.compress: hook_options['start_iter']=-1, expected an int >= 0"
    ), e["start_iter"]
    assert e["twice"] == (
        "pycomm.fsdp.compress: module 'root' is already compressed (hook='int8', "
        "all_gather=None) by an earlier compress(), expected a model compressed once, with "
        "every option in that one call"
    )
    if nprocs == 4:
        assert "2-D device mesh (FSDP2's native HSDP" in e["hsdp"]
        assert "shard on pycomm.fsdp.node_mesh()" in e["hsdp"]
        for rank, message in enumerate(regathers):
            pair = [0, 1] if rank < 2 else [2, 3]
            assert message.startswith(
                f"pycomm.fsdp (4): FSDP all-gathers on the process group of ranks {pair}, a "
                "part of the mesh's ranks [0, 1, 2, 3]: the module was fully_shard-ed with "
                "reshard_after_forward an int"
            ), message
            assert "expected reshard_after_forward=True or False with it" in message


def _rank_first_step(options):
    m = _shard(_model())
    comm = pycomm.fsdp.compress(m, hook="int8", hook_options=options)
    x, y = _data(1)[0]
    torch.nn.functional.mse_loss(m(x), y).backward()
    sent = comm.stats["reduce_scatter"]
    return sent["bytes_sent"] / sent["bytes_fp32"]


def test_start_iter_counts_from_zero_under_fsdp():
    """FSDP has no bucket rebuild: start_iter=0 (refused by a DDP hook) compresses the first
    reduce-scatter; the hook's default (2) sends it exact."""
    at_once = run_ranks(_rank_first_step, 2, {"start_iter": 0}, timeout=60)
    default = run_ranks(_rank_first_step, 2, {}, timeout=60)
    assert all(r < 0.5 for r in at_once), at_once
    assert all(r == 1.0 for r in default), default


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_fsdp_all_gather_counts_both_collectives(tmp_path, capfd):
    """python -m pycomm.bench --fsdp --all-gather int8: int8 both ways against FSDP2's own
    traffic, every collective on the wire; a codec that cannot carry weights refused."""
    import json

    from pycomm.bench import link
    from pycomm.bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["--fsdp", "--all-gather", "onebit"])
    assert "--all-gather onebit: a relative error of" in capfd.readouterr().err
    path = tmp_path / "ag.json"
    args = ["--steps", "3", "--warmup", "2", "--layers", "2", "--width", "256", "--batch", "8"]
    args += ["--hooks", "fsdp,int8", "--all-gather", "int8", "--json", str(path)]
    if link.cannot_shape() is None:
        args += ["--link", "10gbit"]
    assert main(["--fsdp", *args]) == 0, capfd.readouterr().err
    doc = json.loads(path.read_text())
    int8 = doc["hooks"]["int8"]
    assert doc["all_gather"] == "int8" and int8["counted_bytes_per_step"] > 0
    if doc["link"]["shaped"]:
        assert int8["wire_vs_fsdp"] < 0.3
        assert int8["rs_wire_bytes_per_step"] is None  # not separable from the all-gather's


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
    loaded = {}

    def build():
        m = _shard(_model())
        comm = pycomm.fsdp.compress(m, hook="int8", hook_options=options)
        return m, comm, torch.optim.Adam(m.parameters(), lr=1e-2)

    def on_load(comm):
        loaded.update({name: (rs.iter, dict(rs.stats)) for name, rs in comm.modules.items()})

    straight, resumed, comm, old, straight_stats = straight_and_resumed(
        build, _data(6, seed=3), 3, state=_format_1, loaded=on_load
    )
    version = comm.state_dict()["format"]
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
        torch.equal(straight, resumed),
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


# --- the parameter all-gather through a codec (all_gather=) ----------------------------------


class _Recording:
    """An FSDP ``AllGather`` around pycomm's: every output it wrote, in call order."""

    def __init__(self, inner):
        self.inner, self.outputs = inner, []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        work = self.inner(output_tensor, input_tensor, group, async_op)
        self.outputs.append(output_tensor.clone())
        return work


def _loss(m, x, y):
    return torch.nn.functional.mse_loss(m(x), y)


def _mean_grads(model, x, y):
    """The gradient FSDP reduces (the mean over the ranks of each rank's), of a plain model."""
    model.zero_grad()
    _loss(model, x, y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(g)
    return g / dist.get_world_size()


def _set_flat(model, flat):
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat.float(), model.parameters())


def _rank_gather(codec, steps, mp=False, hook="allreduce", options=None, hook_options=None):
    """``steps`` SGD steps with ``all_gather=codec`` (the reduce-scatter ``hook``): what every
    all-gather wrote, the weights each forward computed with, whether the master shards were
    untouched by forward and backward, the parameters after the first step and at the end, the
    gradients (of a plain model, reduced exactly) at the first forward's weights and at the
    master weights, and the stats."""
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else None
    m = _shard(_model(), **({"mp_policy": mp_policy} if mp else {}))
    n = dist.get_world_size()
    uneven = [tuple(p.shape) for p in m.parameters() if p.shape[0] % n]
    comm = pycomm.fsdp.compress(
        m, hook=hook, hook_options=hook_options, all_gather=codec, all_gather_options=options
    )
    recorders = {}
    for name, module in m.named_modules():
        if name in comm.all_gathers:
            recorders[name] = _Recording(comm.all_gathers[name])
            module.set_custom_all_gather(recorders[name])
    seen = []  # the unsharded weights of each forward (FSDP's pre-forward hook runs first)
    for i in (0, 2, 4):
        m[i].register_forward_pre_hook(
            lambda mod, args: seen.extend([mod.weight.detach().clone(), mod.bias.detach().clone()])
        )
    p0 = _full(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    untouched, first, forward_weights, per_step = True, None, [], []
    for x, y in _data(steps):
        master = [p.to_local().clone() for p in m.parameters()]
        seen.clear()
        loss = _loss(m, x, y)
        untouched &= all(torch.equal(a, p.to_local()) for a, p in zip(master, m.parameters()))
        loss.backward()
        untouched &= all(torch.equal(a, p.to_local()) for a, p in zip(master, m.parameters()))
        forward_weights.append(torch.cat([w.reshape(-1) for w in seen]))
        opt.step()
        opt.zero_grad()
        if first is None:
            first = _full(m)
        per_step.append(copy.deepcopy(comm.stats))
    # the first step's gradients at the weights the forward used, and at the master weights
    plain = _model()
    x, y = _data(1)[0]
    _set_flat(plain, forward_weights[0])
    g_used = _mean_grads(plain, x, y)
    _set_flat(plain, p0)
    g_master = _mean_grads(plain, x, y)
    outputs = {name: r.outputs for name, r in recorders.items()}
    return {
        "uneven": uneven,
        "outputs": outputs,
        "p0": p0,
        "forward_weights": forward_weights,
        "untouched": untouched,
        "first": first,
        "final": _full(m),
        "g_used": g_used,
        "g_master": g_master,
        "stats": comm.stats,
        "per_step": per_step,
        "module_stats": {name: dict(ag.stats) for name, ag in comm.all_gathers.items()},
        "padded": {
            name: sum(-(-p.shape[0] // n) * p[0].numel() for p in module.parameters())
            for name, module in m.named_modules()
            if name in comm.all_gathers
        },
    }


@pytest.mark.parametrize("codec,nprocs", [("bf16", 2), ("int8", 2), ("fp8", 2), ("int8", 4)])
def test_all_gather_through_a_codec(codec, nprocs):
    ranks = run_ranks(_rank_gather, nprocs, codec, 3, timeout=120)
    ref = _reference(nprocs, True, 1, {})  # FSDP2's own, one SGD step
    r0 = ranks[0]
    assert r0["uneven"]  # shards of unequal sizes (63 and 5 rows) among the parameters
    for other in ranks[1:]:  # every rank computes with the same bits and ends on them
        assert torch.equal(other["final"], r0["final"])
        assert all(
            torch.equal(a, b) for a, b in zip(other["forward_weights"], r0["forward_weights"])
        )
        for name, outs in r0["outputs"].items():
            assert all(torch.equal(a, b) for a, b in zip(other["outputs"][name], outs))
    for r in ranks:
        assert r["untouched"]  # the sharded master parameters are never quantized
        for name, outs in r["outputs"].items():  # forward, then backward's all-gather again
            assert len(outs) == (0 if name == "" else 2 * 3)  # the root holds no parameter
            for step in range(len(outs) // 2):
                assert torch.equal(outs[2 * step], outs[2 * step + 1]), (name, step)
    # the weights computed with: the codec's rounding of the master weights, no more
    used, master = r0["forward_weights"][0], r0["p0"]
    err = float((used - master).norm() / master.norm())
    assert 0 < err <= pycomm.fsdp.WEIGHT_ERROR_LIMIT
    # after one step, FSDP2's own parameters plus what that rounding changes in the gradient:
    # lr x ||g(weights used) - g(master)||, with the fp32 rounding of the reduction on top
    deviation = 0.1 * float((r0["g_used"] - r0["g_master"]).norm())
    ref_first = ref[0][0]
    assert 0 < deviation
    assert float((r0["first"] - ref_first).norm()) <= deviation * (1 + 1e-3) + 1e-6 * float(
        ref_first.norm()
    )
    assert not torch.equal(r0["first"], ref_first)
    # bytes: per call (N-1) x the padded shard x 4 for FSDP's fp32 all-gather
    for name, s in r0["module_stats"].items():
        if name == "":
            assert s == {"calls": 0, "bytes_sent": 0, "bytes_fp32": 0}
            continue
        assert s["calls"] == 6
        assert s["bytes_fp32"] == 6 * (nprocs - 1) * r0["padded"][name] * 4
        assert s["bytes_sent"] < s["bytes_fp32"] * (0.3 if codec != "bf16" else 0.51)
    st = r0["stats"]
    assert st["all_gather"]["bytes_sent"] == sum(
        s["bytes_sent"] for s in r0["module_stats"].values()
    )
    assert st["bytes_sent"] == st["reduce_scatter"]["bytes_sent"] + st["all_gather"]["bytes_sent"]
    assert st["bytes_fp32"] == st["reduce_scatter"]["bytes_fp32"] + st["all_gather"]["bytes_fp32"]
    assert st["calls"] == st["reduce_scatter"]["calls"] == 3 * 3


def test_all_gather_with_mixed_precision():
    # param_dtype=bfloat16: the all-gather carries bf16 weights; the bf16 codec is then
    # lossless (the weights computed with are FSDP2's own bf16 cast), int8 rounds them
    bf16 = run_ranks(_rank_gather, 2, "bf16", 2, True, timeout=120)
    int8 = run_ranks(_rank_gather, 2, "int8", 2, True, "int8", {"block": 32}, timeout=120)
    for ranks, lossless in ((bf16, True), (int8, False)):
        r0 = ranks[0]
        assert torch.equal(ranks[1]["final"], r0["final"])
        assert torch.isfinite(r0["final"]).all()
        used = r0["forward_weights"][0]
        assert used.dtype == torch.bfloat16
        cast = r0["p0"].to(torch.bfloat16)
        assert torch.equal(used, cast) == lossless
        assert float((used.float() - cast.float()).norm() / cast.float().norm()) <= (
            pycomm.fsdp.WEIGHT_ERROR_LIMIT
        )
        for r in ranks:
            assert r["untouched"]
            assert r["final"].dtype == torch.float32
            for name, outs in r["outputs"].items():
                assert len(outs) == (0 if name == "" else 2 * 2)
                assert all(o.dtype == torch.bfloat16 for o in outs)
                assert all(torch.equal(outs[i], outs[i + 1]) for i in range(0, len(outs), 2))


def test_int8_both_ways_sends_under_a_third_of_fsdp2s_fp32_bytes():
    # int8 reduce-scatter (past its exact warm-up of 2 calls a module) and int8 all-gather,
    # against FSDP2's fp32 reduce-scatter and all-gather of the same shards
    ranks = run_ranks(_rank_gather, 2, "int8", 4, False, "int8", timeout=120)
    before, after = ranks[0]["per_step"][1], ranks[0]["per_step"][-1]

    def sent(st, key):
        return after[st][key] - before[st][key]

    both = sent("reduce_scatter", "bytes_sent") + sent("all_gather", "bytes_sent")
    fp32 = sent("reduce_scatter", "bytes_fp32") + sent("all_gather", "bytes_fp32")
    assert both == after["bytes_sent"] - before["bytes_sent"]
    assert fp32 == after["bytes_fp32"] - before["bytes_fp32"]
    assert both / fp32 <= 0.3, both / fp32
    assert after["compression"] == after["bytes_fp32"] / after["bytes_sent"]


def test_resume_with_all_gather_is_bitwise(tmp_path):
    for folder in (None, str(tmp_path)):
        ranks = run_ranks(_rank_resume, 2, {"error_feedback": True}, folder, "int8", timeout=120)
        for straight, resumed, stats, straight_stats in ranks:
            assert torch.equal(straight, resumed)
            assert stats == straight_stats
            assert stats["all_gather"]["calls"] > 0


def _rank_checkpoint_fingerprints():
    """Which states a comm of each all_gather setting loads, and the errors of the others."""

    def build(all_gather, options=None):
        m = _shard(_model())
        return pycomm.fsdp.compress(
            m, hook="int8", all_gather=all_gather, all_gather_options=options
        )

    comms = {
        "none": build(None),
        "int8": build("int8"),
        "int8-32": build("int8", {"block": 32}),
        "bf16": build("bf16"),
    }
    states = {k: copy.deepcopy(c.state_dict()) for k, c in comms.items()}
    old = copy.deepcopy(states["none"])  # format 2 before the all-gather: no field
    del old["fingerprint"]["all_gather"]
    states["old"] = old
    states["format 1"] = _format_1(comms["none"])
    del states["format 1"]["fingerprint"]["all_gather"]
    out = {}
    for target, comm in comms.items():
        for source, state in states.items():
            try:
                comm.load_state_dict(state)
                out[(target, source)] = None
            except ValueError as e:
                out[(target, source)] = str(e)
    return out


def test_checkpoints_record_the_all_gather():
    out = run_ranks(_rank_checkpoint_fingerprints, 2, timeout=120)[0]
    for target in ("none", "int8", "int8-32", "bf16"):
        assert out[(target, target)] is None
    assert out[("none", "old")] is None and out[("none", "format 1")] is None
    assert out[("int8", "none")] == (
        "pycomm: cannot load hook state: all_gather is None in the checkpoint but "
        "{'codec': 'int8', 'options': {'block': 64}} here"
    )
    assert out[("none", "int8")].startswith(
        "pycomm: cannot load hook state: all_gather is {'codec': 'int8'"
    )
    assert (
        "all_gather['options']['block'] is 32 in the checkpoint but 64 here"
        in (out[("int8", "int8-32")])
    )
    assert (
        "all_gather['codec'] is 'int8' in the checkpoint but 'bf16' here" in (out[("bf16", "int8")])
    )
    for source in ("old", "format 1"):
        assert "all_gather is None in the checkpoint" in out[("int8", source)]


def _rank_load_resolved():
    """A state loads where the same options are spelled out or left to their defaults, and is
    refused from a model of other shapes under the same module names."""
    saved = pycomm.fsdp.compress(_shard(_model()), hook="int8").state_dict()
    out = {}
    for name, options in (("block", {"block": 64}), ("start_iter", {"start_iter": 2})):
        comm = pycomm.fsdp.compress(_shard(_model()), hook="int8", hook_options=options)
        out[name] = error_text(lambda comm=comm: comm.load_state_dict(saved))
        out[name + " back"] = error_text(
            lambda comm=comm: pycomm.fsdp.compress(_shard(_model()), hook="int8").load_state_dict(
                comm.state_dict()
            )
        )
    wider = torch.nn.Sequential(
        torch.nn.Linear(30, 128), torch.nn.Tanh(), torch.nn.Linear(128, 63), torch.nn.Tanh(),
        torch.nn.Linear(63, 5),
    )  # fmt: skip
    comm = pycomm.fsdp.compress(_shard(wider), hook="int8")
    out["other model"] = error_text(lambda: comm.load_state_dict(saved))
    old = copy.deepcopy(saved)  # written before the options were resolved and the shapes kept
    old["fingerprint"]["options"] = {"hook": "int8"}
    del old["fingerprint"]["module shapes"]
    out["old"] = error_text(
        lambda: pycomm.fsdp.compress(_shard(_model()), hook="int8").load_state_dict(old)
    )
    return out


def test_checkpoints_compare_resolved_options_and_the_model():
    out = run_ranks(_rank_load_resolved, 2, timeout=120)[0]
    for name in ("block", "block back", "start_iter", "start_iter back", "old"):
        assert out[name] is None, (name, out[name])
    assert "module shapes[''] is [[64, 30], [64], [63, 64]" in out["other model"]
    assert "but [[128, 30], [128], [63, 128]" in out["other model"]


class _CoarseCodec(pycomm.hooks.OneBitCodec):
    """A user's codec too coarse for weights (signs and one scale a block)."""


class _UserInt8(pycomm.hooks.Int8Codec):
    """A user's codec that carries weights."""


def _rank_gather_refusals():
    from pycomm.hooks import register_hook, unregister_hook

    errors = {}
    rank = dist.get_rank()

    def attempt(key, all_gather, options=None, hook="int8"):
        try:
            pycomm.fsdp.compress(
                _shard(_model()), hook=hook, all_gather=all_gather, all_gather_options=options
            )
            errors[key] = None
        except (ValueError, TypeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"

    register_hook("coarse_user", codec=_CoarseCodec)
    register_hook("int8_user", codec=_UserInt8)
    try:
        attempt("unknown", "int3")
        attempt("allreduce", "allreduce")
        attempt("onebit", "onebit")
        attempt("int4", "int4")
        attempt("powersgd", "powersgd")
        attempt("not a name", 8)
        attempt("coarse user codec", "coarse_user")
        attempt("user codec", "int8_user")
        for key in ("error_feedback", "start_iter", "residual_dtype", "hierarchy"):
            value = {"hierarchy": "node", "residual_dtype": "bfloat16"}.get(key, 1)
            attempt(key, "int8", {key: value})
        attempt("unknown option", "int8", {"bloc": 32})
        attempt("bad value", "int8", {"block": 0})
        attempt("options alone", None, {"block": 32})
        attempt("options not a dict", "int8", [("block", 32)])
        attempt("codec differs", "int8" if rank == 0 else "bf16")
        attempt("one rank none", "int8" if rank == 0 else None)
        attempt("block differs", "int8", {"block": 64 if rank == 0 else 32})
        attempt("bad on one rank", "int8", {"block": 64 if rank == 0 else 0})
    finally:
        unregister_hook("coarse_user")
        unregister_hook("int8_user")
    return errors


@pytest.mark.parametrize("nprocs", [2, 4])
def test_all_gather_refusals_are_the_same_on_every_rank(nprocs):
    ranks = run_ranks(_rank_gather_refusals, nprocs, timeout=120)
    for other in ranks[1:]:
        assert other == ranks[0]
    e = ranks[0]
    p = "ValueError: pycomm.fsdp.compress: "
    assert e["unknown"].startswith(f"{p}all_gather='int3': not a registered codec, expected None")
    assert e["allreduce"].startswith(
        f"{p}all_gather='allreduce': the exact exchange is FSDP's own all-gather, expected "
        "all_gather=None"
    )
    for name in ("onebit", "int4", "coarse user codec"):
        codec = {"coarse user codec": "coarse_user"}.get(name, name)
        assert e[name].startswith(
            f"{p}all_gather={codec!r}: the codec cannot carry weights: its round trip of a "
            "fixed normal vector has a relative L2 error of "
        ), e[name]
        assert "expected a codec within it ('bf16', 'fp16', 'int8', 'fp8', 'int8_user')" in e[name]
    assert e["user codec"] is None
    assert e["powersgd"].startswith(f"{p}all_gather='powersgd': not a registered codec")
    assert e["not a name"].startswith("TypeError: pycomm.fsdp.compress: all_gather=8, expected")
    for key in ("error_feedback", "start_iter", "residual_dtype", "hierarchy"):
        assert e[key].startswith(f"{p}all_gather_options option {key}="), e[key]
        assert "expected the codec's own options (block)" in e[key]
    assert e["unknown option"] == (
        f"{p}all_gather_options option 'bloc': not an option of codec 'int8', expected its "
        "own options (block)"
    )
    assert "block" in e["bad value"] and "all_gather_options" in e["bad value"]
    assert e["options alone"].startswith(
        f"{p}all_gather_options={{'block': 32}} with all_gather=None"
    )
    assert e["options not a dict"].startswith(
        "TypeError: pycomm.fsdp.compress: all_gather_options="
    )
    assert (
        "ranks disagree on all_gather: rank 0 has 'int8', rank 1 has 'bf16'" in e["codec differs"]
    )
    assert "ranks disagree on all_gather: rank 0 has 'int8', rank 1 has None" in e["one rank none"]
    assert (
        "ranks disagree on all_gather option 'block': rank 0 has 64, rank 1 has 32"
        in e["block differs"]
    )
    assert e["bad on one rank"].startswith(
        f"{p}on rank 1: all_gather_options={{'block': 0}} for 'int8': "
    )


def test_weight_error_is_the_documented_probe():
    assert pycomm.fsdp.weight_error("int8") <= pycomm.fsdp.WEIGHT_ERROR_LIMIT
    assert pycomm.fsdp.weight_error("fp8") <= pycomm.fsdp.WEIGHT_ERROR_LIMIT
    assert pycomm.fsdp.weight_error("bf16") <= pycomm.fsdp.WEIGHT_ERROR_LIMIT
    assert pycomm.fsdp.weight_error("fp16") <= pycomm.fsdp.WEIGHT_ERROR_LIMIT
    assert pycomm.fsdp.weight_error("int4") > pycomm.fsdp.WEIGHT_ERROR_LIMIT
    assert pycomm.fsdp.weight_error("onebit") > pycomm.fsdp.WEIGHT_ERROR_LIMIT
    w = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert pycomm.fsdp.weight_error("bf16", tensor=w.to(torch.bfloat16)) == 0.0
    assert (
        0
        < pycomm.fsdp.weight_error("int8", {"block": 32}, w)
        < pycomm.fsdp.weight_error("int8", {"block": 256}, w)
    )
