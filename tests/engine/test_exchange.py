"""pycomm.Exchange: the engine's compressed collectives on tensors of the caller's, against
torch.distributed's exact ones: all_reduce, reduce_scatter and all_gather with every built-in
codec and a user's, on 2 and 4 gloo ranks; error feedback per key; the non-finite rule; a
bitwise state_dict round trip; the configuration compared across ranks at construction; bad
input named."""

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from harness import error_text as _error
from harness import run_ranks

import pycomm
from pycomm.exchange import rank_order_sum
from pycomm.hooks import Codec, HalfCodec, Int8Codec, register_hook, unregister_hook


class UserBf16(HalfCodec):
    """A user's codec: bf16 codes summed as they are (one phase), another default."""

    def __init__(self, two_phase: bool = True) -> None:
        super().__init__(torch.bfloat16, two_phase)


class OddBlockInt8(Codec):
    """A user's int8 codes with an fp16 scale per block of 5: a chunk's codes take an odd
    number of bytes, so its scales start at an odd byte of the packed row."""

    code_dtype, scale_dtype, block = torch.int8, torch.float16, 5

    def code_bytes(self, m):
        return m

    def scale_bytes(self, m):
        return 2 * (m // 5)

    def encode(self, x, residual, scale, numel, residual_out=None):
        y = torch.zeros(numel, device=x.device)
        y[: x.numel()] = x.float() * scale
        if residual is not None:
            y += residual.float()
        b = y.view(-1, 5)
        s = (b.abs().amax(1, keepdim=True) / 127).half().float()  # NaN for a non-finite block
        q = torch.where(s > 0, b / s, 0.0).round().clamp(-127, 127).nan_to_num(0.0)
        if residual is not None:
            new = torch.where(torch.isfinite(s), b - q * s, residual.float().view(-1, 5))
            (residual if residual_out is None else residual_out).copy_(new.view(-1))
        return q.to(torch.int8).view(-1), s.half().view(-1)

    def decode_sum(self, codes, scales, scale, out):
        acc = torch.zeros(codes.shape[1], device=out.device)
        for r in range(codes.shape[0]):
            acc += (codes[r].float().view(-1, 5) * scales[r].float().view(-1, 1)).view(-1)
        out.copy_(acc[: out.numel()] * scale)
        o = out.float()
        fin = torch.isfinite(o)
        return torch.stack([torch.where(fin, o, 0.0).double().square().sum(),
                            (~fin).sum().double()])  # fmt: skip


# a single call's relative error bound per codec (1-bit's is large by nature)
BOUNDS = {"allreduce": 0.0, "fp16": 1e-3, "bf16": 8e-3, "mybf16": 8e-3, "int8": 3e-2,
          "fp8": 8e-2, "int4": 0.3, "onebit": 1.2}  # fmt: skip
CODECS = [c for c in BOUNDS if c != "mybf16"]


def _exact_mean(t):
    total = t.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _gathered(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return everyone


def _rank_collectives(codec, user):
    if user:
        register_hook("mybf16", codec=UserBf16)
    try:
        r, n = dist.get_rank(), dist.get_world_size()
        ex = pycomm.Exchange(codec)
        g = torch.Generator().manual_seed(100 + r)
        out = {}
        # all_reduce: the mean, every rank the same bits
        t = torch.randn(3001, generator=g)
        exact = _exact_mean(t)
        assert ex.all_reduce(t, key="a").wait() is t
        out["all_reduce"] = float((t - exact).norm() / exact.norm())
        out["all_reduce same"] = all(torch.equal(t, o) for o in _gathered(t))
        # op="sum": N times the mean
        u = torch.randn(500, generator=g)
        total = _exact_mean(u) * n
        ex.all_reduce(u, key="s", op="sum").wait()
        out["sum"] = float((u - total).norm() / total.norm())
        # reduce_scatter: this rank's chunk of the mean (chunks of 333, not whole blocks)
        inp, shard = torch.randn(n * 333, generator=g), torch.empty(333)
        exact = _exact_mean(inp).view(n, 333)[r]
        ex.reduce_scatter(shard, inp, key="rs").wait()
        out["reduce_scatter"] = float((shard - exact).norm() / exact.norm())
        # all_gather: every rank's input at its chunk, the same bits on every rank
        mine, full = torch.randn(257, generator=g), torch.empty(n * 257)
        exact = torch.cat(_gathered(mine))
        ex.all_gather(full, mine, key="ag").wait()
        out["all_gather"] = float((full - exact).norm() / exact.norm())
        out["all_gather same"] = all(torch.equal(full, o) for o in _gathered(full))
        out["stats"] = dict(ex.stats)
        return out
    finally:
        if user:
            unregister_hook("mybf16")


# every codec on 2 ranks; on 4, the exact path, a two-phase codec and a user's
@pytest.mark.parametrize(
    "codec, nprocs",
    [(c, 2) for c in [*CODECS, "mybf16"]] + [(c, 4) for c in ("allreduce", "int8", "mybf16")],
)
def test_collectives_against_torch_distributed(codec, nprocs):
    results = run_ranks(_rank_collectives, nprocs, codec, codec == "mybf16", timeout=90)
    bound = BOUNDS[codec]
    for out in results:
        assert out["all_reduce same"] and out["all_gather same"]
        for call in ("all_reduce", "sum", "reduce_scatter", "all_gather"):
            if codec == "allreduce":
                assert out[call] < 1e-6, (call, out[call])
            else:
                assert 0 < out[call] <= bound, (call, out[call])
        stats = out["stats"]
        assert stats["steps"] == 4
        if codec != "allreduce":
            assert stats["bytes_sent"] < stats["bytes_fp32"]
            assert stats["codec_compression"] > 1.5
    assert results[0]["stats"]["bytes_sent"] == results[-1]["stats"]["bytes_sent"]


def _rank_any_byte_offset():
    """Formats whose chunks end at a byte the scales' dtype cannot start at (int8 and fp8
    with fp32 scales per 1 to 5 elements, a user's fp16 scales per 5) on 3 ranks and sizes
    of a few elements: every call within int8's bound of the exact one, ranks the same."""
    register_hook("oddint8", codec=OddBlockInt8)
    try:
        r, n = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(r)
        worst = 0.0
        same = True
        for codec, options in (("int8", {"block": 1}), ("int8", {"block": 3}),
                               ("fp8", {"block": 5}), ("oddint8", {})):  # fmt: skip
            ex = pycomm.Exchange(codec, **options)
            for size in (1, 7, 23):
                t = torch.randn(size, generator=g)
                exact = _exact_mean(t)
                ex.all_reduce(t, key=("a", size)).wait()
                inp, shard = torch.randn(n * size, generator=g), torch.empty(size)
                rs = _exact_mean(inp).view(n, size)[r]
                ex.reduce_scatter(shard, inp, key=("rs", size)).wait()
                mine, full = torch.randn(size, generator=g), torch.empty(n * size)
                ag = torch.cat(_gathered(mine))
                ex.all_gather(full, mine, key=("ag", size)).wait()
                for got, want in ((t, exact), (shard, rs), (full, ag)):
                    worst = max(worst, float((got - want).norm() / want.norm()))
                same &= all(torch.equal(t, o) for o in _gathered(t))
                same &= all(torch.equal(full, o) for o in _gathered(full))
        return worst, same
    finally:
        unregister_hook("oddint8")


def test_codes_and_scales_at_any_byte_offset():
    for worst, same in run_ranks(_rank_any_byte_offset, 3, timeout=90):
        assert same
        assert worst <= 0.08, worst


def _rank_exact_bits():
    """The exact path: all_reduce is DDP's reduction (x / N, then a sum), reduce_scatter the
    rank-order fp32 sum, all_gather the inputs as they are."""
    r, n = dist.get_rank(), dist.get_world_size()
    ex = pycomm.Exchange("allreduce")
    g = torch.Generator().manual_seed(r)
    t = torch.randn(1000, generator=g)
    want = t * (1.0 / n)  # DDP's: each gradient times 1/N, then the sum
    dist.all_reduce(want)
    ex.all_reduce(t, key=0).wait()
    inp, shard = torch.randn(n * 100, generator=g), torch.empty(100)
    rows = torch.stack(_gathered(inp)).view(n, n, 100)[:, r]
    acc = rows[0].clone()
    for row in rows[1:]:
        acc += row
    ex.reduce_scatter(shard, inp, key=1).wait()
    mine, full = torch.randn(64, generator=g), torch.empty(n * 64)
    ex.all_gather(full, mine, key=2).wait()
    sums = []
    for dtype in (torch.float32, torch.float16, torch.float64):  # op="sum": torch's own sum
        u = torch.randn(1000, generator=g).to(dtype)
        total = u.clone()
        dist.all_reduce(total)
        ex.all_reduce(u, key=("sum", dtype), op="sum").wait()
        sums.append(torch.equal(u, total))
    return (
        torch.equal(t, want),
        torch.equal(shard, acc * (1.0 / n)),
        torch.equal(full, torch.cat(_gathered(mine))),
        sums,
    )


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_exact_exchange_is_bitwise_torchs(nprocs):
    for ok in run_ranks(_rank_exact_bits, nprocs, timeout=60):
        assert ok == (True, True, True, [True, True, True])


def _rank_edges():
    """Empty tensors; a failed call's error not raised again by the next; a rank outside
    the group; a group that is not one; the default group destroyed."""
    rank = dist.get_rank()
    out = {}
    ex = pycomm.Exchange("int8")
    empty = torch.empty(0)
    ex.all_reduce(empty, key="e").wait()
    ex.reduce_scatter(torch.empty(0), torch.empty(0), key="e").wait()
    ex.all_gather(torch.empty(0), torch.empty(0), key="e").wait()
    out["empty steps"] = ex.stats["steps"]
    work = ex.all_reduce(torch.full((8,), float(rank)), key="a")
    out["after"] = work.wait().tolist()
    out["not a group"] = _error(lambda: pycomm.Exchange("int8", "x"))
    solo = dist.new_group([0])
    out["outside"] = _error(lambda: pycomm.Exchange("int8", solo)) if rank == 1 else None
    out["unknown option"] = _error(lambda: pycomm.Exchange("allreduce", blok=1))
    dist.destroy_process_group()
    out["destroyed"] = _error(lambda: ex.all_reduce(torch.ones(4), key="a"))
    return out


def test_edges_of_the_calls():
    for rank, out in enumerate(run_ranks(_rank_edges, 2, timeout=60, fresh=True)):
        assert out["empty steps"] == 3
        assert out["after"] == [0.5] * 8
        assert out["not a group"] == (
            "TypeError: pycomm.Exchange: process_group='x', expected a "
            "torch.distributed.ProcessGroup or None (the default group)"
        )
        if rank == 1:
            assert out["outside"].startswith(
                "ValueError: pycomm.Exchange: this rank (global rank 1) is not in process_group"
            )
        assert "blok" in out["unknown option"] and "hierarchy" in out["unknown option"]
        assert out["destroyed"].startswith(
            "RuntimeError: pycomm.Exchange.all_reduce: the process group was destroyed"
        )


def _rank_feedback(codec, options, calls):
    """The same tensor all-reduced ``calls`` times under one key: with error feedback, what
    one call drops is sent by the next, so the running mean of the results converges on the
    exact mean, while a single call's error stays."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(4096, generator=g)
    exact = _exact_mean(x)
    ex = pycomm.Exchange(codec, **options)
    results = []
    for _ in range(calls):
        t = x.clone()
        ex.all_reduce(t, key="x").wait()
        results.append(t)
    first = float((results[0] - exact).norm() / exact.norm())
    running = float((torch.stack(results).mean(0) - exact).norm() / exact.norm())
    return first, running


@pytest.mark.parametrize(
    "codec, options", [("int8", {}), ("int4", {}), ("onebit", {"local_feedback": True})]
)
def test_error_feedback_per_key(codec, options):
    for first, running in run_ranks(_rank_feedback, 2, codec, options, 20, timeout=60):
        assert running < 0.3 * first, (first, running)


def _rank_resume(codec, cut, total):
    """``total`` calls over three keys; at ``cut`` the state is saved and a fresh Exchange
    loads it and goes on."""
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [
        (torch.randn(700, generator=g), torch.randn(2 * 300, generator=g)) for _ in range(total)
    ]

    def run(ex, start, stop):
        outs = []
        for a, b in data[start:stop]:
            a = a.clone()
            ex.all_reduce(a, key="a").wait()
            shard = torch.empty(300)
            ex.reduce_scatter(shard, b, key="b").wait()
            full = torch.empty(2 * 300)
            ex.all_gather(full, shard, key="c").wait()
            outs += [a, shard, full]
        return outs

    straight = run(pycomm.Exchange(codec, block=32), 0, total)
    first = pycomm.Exchange(codec, block=32)
    run(first, 0, cut)
    saved = first.state_dict()
    resumed = pycomm.Exchange(codec, block=32)
    resumed.load_state_dict(saved)
    tail = run(resumed, cut, total)
    same = all(torch.equal(x, y) for x, y in zip(straight[3 * cut :], tail))
    try:
        pycomm.Exchange(codec, block=64).load_state_dict(saved)
        other = None
    except ValueError as e:
        other = str(e)
    return same, other


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_state_dict_round_trip_is_bitwise(codec):
    for same, other in run_ranks(_rank_resume, 2, codec, 3, 6, timeout=90):
        assert same
        assert other is not None and "options['block'] is 32 in the checkpoint but 64" in other


def _rank_nonfinite(strict):
    """A NaN on rank 1 at the second call: that call's result is not finite on every rank,
    the residuals stay finite (strict_skip: bitwise as after the first call), and the third
    call is finite."""
    ex = pycomm.Exchange("int8", strict_skip=strict)
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(1000, generator=g) for _ in range(3)]
    if dist.get_rank() == 1:
        xs[1][17] = float("nan")
    finite, kept = [], []
    for x in xs:
        ex.all_reduce(x, key="x").wait()
        finite.append(bool(torch.isfinite(x).all()))
        kept.append(ex.state_dict()["exchange"]["residuals"])
    (r0,), (r1,) = kept[0].values(), kept[1].values()
    unchanged = all(torch.equal(r0[k], r1[k]) for k in r0)
    residuals_finite = all(bool(torch.isfinite(t).all()) for t in r1.values())
    return finite, unchanged, residuals_finite, ex.stats["nonfinite_buckets"]


@pytest.mark.parametrize("strict", [False, True])
def test_a_non_finite_call_keeps_the_residuals_finite(strict):
    for finite, unchanged, residuals_finite, nonfinite in run_ranks(
        _rank_nonfinite, 2, strict, timeout=60
    ):
        assert finite == [True, False, True]
        assert residuals_finite and nonfinite == 1
        assert unchanged == strict  # one copy: the finite blocks took the call's update


def _rank_refusals():
    rank = dist.get_rank()
    out = {
        "block on rank 1": _error(lambda: pycomm.Exchange("int8", block=64 if rank == 0 else 32)),
        "codec on rank 1": _error(lambda: pycomm.Exchange("int8" if rank == 0 else "fp8")),
        "bad on rank 1": _error(lambda: pycomm.Exchange("int8", block=64 if rank == 0 else 0)),
        "unknown codec": _error(lambda: pycomm.Exchange("int3")),
        "powersgd": _error(lambda: pycomm.Exchange("powersgd")),
        "unknown option": _error(lambda: pycomm.Exchange("int8", blok=64)),
    }
    ex = pycomm.Exchange("int8")
    out["strided"] = _error(lambda: ex.all_reduce(torch.ones(8, 2).t(), key="x"))
    out["int tensor"] = _error(lambda: ex.all_reduce(torch.ones(8, dtype=torch.int64), key="x"))
    out["op"] = _error(lambda: ex.all_reduce(torch.ones(8), key="x", op="max"))
    out["key"] = _error(lambda: ex.all_reduce(torch.ones(8), key=["x"]))
    out["rs shape"] = _error(lambda: ex.reduce_scatter(torch.ones(3), torch.ones(7), key="y"))
    out["ag shape"] = _error(lambda: ex.all_gather(torch.ones(7), torch.ones(3), key="z"))
    out["ag dtype"] = _error(
        lambda: ex.all_gather(torch.ones(6, dtype=torch.float16), torch.ones(3), key="z")
    )
    return out


def test_refusals_name_the_problem_on_every_rank():
    a, b = run_ranks(_rank_refusals, 2, timeout=60)
    assert a == b
    assert (
        "pycomm.Exchange: ranks disagree on option 'block': rank 0 has 64, rank 1 has 32"
        in a["block on rank 1"]
    )
    assert "pycomm.Exchange: ranks disagree on " in a["codec on rank 1"]
    assert a["bad on rank 1"].startswith("ValueError: pycomm.Exchange: on rank 1: ")
    assert "codec='int3' is not a registered codec" in a["unknown codec"]
    assert "codec='powersgd' is not a registered codec" in a["powersgd"]
    assert "unknown option 'blok'" in a["unknown option"]
    assert "is not contiguous" in a["strided"]
    assert "dtype torch.int64" in a["int tensor"]
    assert "op='max', expected 'mean' or 'sum'" in a["op"]
    assert "key=['x'] is not hashable" in a["key"]
    assert "input has 7 elements, expected 2 x output's 3 = 6" in a["rs shape"]
    assert "output has 7 elements, expected 2 x input's 3 = 6" in a["ag shape"]
    assert "expected the same dtype and device" in a["ag dtype"]


def _rank_node_and_warmup():
    """On 2 nodes x 2 ranks (pycomm.topology.set_nodes): hierarchy='node' all-reduces exactly
    inside each node and compressed across them, every rank the same bits; reduce_scatter is
    refused there. start_iter=1: the first call is exact, the second compressed."""
    from pycomm.topology import set_nodes

    set_nodes(2)
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        t = torch.randn(4000, generator=g)
        exact = _exact_mean(t)
        ex = pycomm.Exchange("int8", hierarchy="node")
        ex.all_reduce(t, key="t").wait()
        node_err = float((t - exact).norm() / exact.norm())
        same = all(torch.equal(t, o) for o in _gathered(t))
        refused = _error(lambda: ex.reduce_scatter(torch.empty(10), torch.empty(40), key="r"))
        # by the nodes, exact: the codec's warm-up call, and the exact exchange's every call
        node_exact = []
        for ex2 in (pycomm.Exchange("int8", hierarchy="node", start_iter=1),
                    pycomm.Exchange("allreduce", hierarchy="node")):  # fmt: skip
            u = torch.randn(4000, generator=g)
            want = _exact_mean(u)
            ex2.all_reduce(u, key="u").wait()
            same_u = all(torch.equal(u, o) for o in _gathered(u))
            node_exact.append((float((u - want).norm() / want.norm()), same_u))
        # the default, hierarchy='auto': all_reduce by the nodes, the other two flat over all
        auto = pycomm.Exchange("int8")
        x = torch.randn(4 * 300, generator=g)
        shard, full = torch.empty(300), torch.empty(4 * 300)
        auto.reduce_scatter(shard, x.clone(), key="x").wait()
        exact = _exact_mean(x).view(4, 300)[dist.get_rank()]
        rs_err = float((shard - exact).norm() / exact.norm())
        auto.all_gather(full, shard, key="w").wait()
        ag_err = float((full.view(4, 300)[dist.get_rank()] - shard).norm() / shard.norm())
        ag_same = all(torch.equal(full, o) for o in _gathered(full))
        saved = auto.state_dict()  # the reduce-scatter's residual: N chunks of the input
        again = pycomm.Exchange("int8")
        again.load_state_dict(saved)
        a, b = torch.empty(300), torch.empty(300)
        auto.reduce_scatter(a, x.clone(), key="x").wait()
        again.reduce_scatter(b, x.clone(), key="x").wait()
        flat = (rs_err, ag_err, ag_same, torch.equal(a, b), node_exact)
    finally:
        set_nodes(None)
    warm = pycomm.Exchange("int8", start_iter=1)
    errs = []
    for _ in range(2):
        u = torch.randn(1000, generator=g)
        exact = _exact_mean(u)
        warm.all_reduce(u, key="u").wait()
        errs.append(float((u - exact).norm() / exact.norm()))
    return node_err, same, refused, errs, flat


def test_node_hierarchy_and_warm_up():
    for node_err, same, refused, errs, flat in run_ranks(_rank_node_and_warmup, 4, timeout=90):
        assert same and 0 < node_err < 3e-2
        assert "hierarchy='node' runs all_reduce alone" in refused
        assert errs[0] < 1e-6 < errs[1] < 3e-2  # exact, then int8
        assert all(err < 1e-6 and same for err, same in flat[4]), flat[4]
        rs_err, ag_err, ag_same, resumed, _ = flat
        assert 0 < rs_err < 3e-2 and 0 < ag_err < 3e-2 and ag_same and resumed


def _rank_warm_up_per_key():
    """start_iter=2: the first two calls of each key (and call) run exact, the third through
    the codec, however the keys interleave; the counts travel in state_dict."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(r)
    ex = pycomm.Exchange("int8", start_iter=2)

    def call(kind, key, ex=ex):
        if kind == "all_reduce":
            t = torch.randn(1000, generator=g)
            exact = _exact_mean(t)
            ex.all_reduce(t, key=key).wait()
            return float((t - exact).norm() / exact.norm())
        if kind == "reduce_scatter":
            inp, shard = torch.randn(n * 300, generator=g), torch.empty(300)
            exact = _exact_mean(inp).view(n, 300)[r]
            ex.reduce_scatter(shard, inp, key=key).wait()
            return float((shard - exact).norm() / exact.norm())
        mine, full = torch.randn(300, generator=g), torch.empty(n * 300)
        exact = torch.cat(_gathered(mine))
        ex.all_gather(full, mine, key=key).wait()
        return float((full - exact).norm() / exact.norm())

    errs = {}
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        errs[kind] = [call(kind, "a"), call(kind, "b"), call(kind, "a"), call(kind, "a")]
        errs[kind].append(call(kind, "b"))
    saved = ex.state_dict()
    resumed = pycomm.Exchange("int8", start_iter=2)
    resumed.load_state_dict(saved)
    after = [call("all_reduce", "b", resumed), call("all_reduce", "c", resumed)]
    return errs, after


def test_warm_up_counts_the_calls_of_each_key():
    for errs, after in run_ranks(_rank_warm_up_per_key, 2, timeout=60):
        for kind, (a1, b1, a2, a3, b2) in errs.items():
            assert max(a1, b1, a2, b2) < 1e-6 < a3, (kind, errs[kind])  # exact, exact, int8
        b3, c1 = after
        assert c1 < 1e-6 < b3  # loaded: b has had its two exact calls, c none


def _rank_scale_float64_and_bytes():
    """reduce_scatter's scale (a premultiplied sum), float64 on the exact exchange, and the
    bytes of each call on its Work against stats."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(r)
    out = {}
    exact = pycomm.Exchange("allreduce")
    inp, shard = torch.randn(n * 100, generator=g), torch.empty(100)
    rows = torch.stack(_gathered(inp)).view(n, n, 100)[:, r]
    exact.reduce_scatter(shard, inp, key="s", scale=0.3).wait()
    out["scale bitwise"] = torch.equal(shard, rank_order_sum(rows, 0.3))
    d = torch.randn(n * 100, generator=g, dtype=torch.float64)
    dshard = torch.empty(100, dtype=torch.float64)
    drows = torch.stack(_gathered(d)).view(n, n, 100)[:, r]
    exact.reduce_scatter(dshard, d, key="d", op="sum").wait()
    out["float64 bitwise"] = torch.equal(dshard, rank_order_sum(drows))
    t = torch.randn(50, generator=g, dtype=torch.float64)
    want = _exact_mean(t)
    exact.all_reduce(t, key="t").wait()
    out["float64 all_reduce"] = float((t - want).norm() / want.norm())
    ex = pycomm.Exchange("int8")
    want = _exact_mean(inp).view(n, 100)[r] * n * 0.3
    works = [ex.reduce_scatter(shard, inp, key="s", scale=0.3)]
    works[0].wait()
    out["int8 scale"] = float((shard - want).norm() / want.norm())
    t = torch.randn(777, generator=g)
    works.append(ex.all_reduce(t, key="t"))
    works.append(ex.all_gather(torch.empty(n * 333), torch.randn(333, generator=g), key="g"))
    works[-1].wait()
    stats = ex.stats
    out["bytes"] = (
        sum(w.bytes_sent for w in works) == stats["bytes_sent"],
        sum(w.bytes_fp32 for w in works) == stats["bytes_fp32"],
        all(0 < w.bytes_sent < w.bytes_fp32 for w in works),
    )
    out["int8 float64"] = _error(lambda: ex.all_reduce(torch.ones(8, dtype=torch.float64), key=1))
    for bad in ("half", float("nan"), True):
        out[f"scale {bad!r}"] = _error(
            lambda bad=bad: ex.reduce_scatter(torch.empty(3), torch.ones(3 * n), key=1, scale=bad)
        )
    return out


def test_scale_float64_and_the_bytes_of_each_call():
    a, b = run_ranks(_rank_scale_float64_and_bytes, 2, timeout=60)
    assert {k: v for k, v in a.items() if isinstance(v, str)} == {
        k: v for k, v in b.items() if isinstance(v, str)
    }
    assert a["scale bitwise"] and a["float64 bitwise"] and a["float64 all_reduce"] < 1e-15
    assert 0 < a["int8 scale"] < 3e-2
    assert a["bytes"] == (True, True, True)
    assert "has dtype torch.float64" in a["int8 float64"]
    assert "float32, bfloat16 or float16" in a["int8 float64"]
    for bad in ("'half'", "nan", "True"):
        assert f"reduce_scatter: scale={bad}, expected a finite float" in a[f"scale {bad}"]


def _rank_residuals_of_a_key(codec, options):
    """A reduce-scatter keeps one residual, on its padded input (none for phase 2), read per
    key without waiting; load_key gives a fresh Exchange a key's history."""
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    ex = pycomm.Exchange(codec, error_feedback=True, **options)
    inp, shard = torch.randn(n * 333, generator=g), torch.empty(333)
    for _ in range(2):
        ex.reduce_scatter(shard, inp, key="rs").wait()
    block = ex.state_dict()["exchange"]["fingerprint"]["options"]["block"]
    out = {
        "key": ex.residual_bytes("rs"),
        "all": ex.stats["residual_bytes"],
        "other": ex.residual_bytes("nothing"),
        "want": n * -(-333 // block) * block * 4,
    }
    (res,) = ex.state_dict()["exchange"]["residuals"].values()
    other = pycomm.Exchange(codec, error_feedback=True, **options)
    other.load_key("rs", 2, res["r1"])
    out["loaded"] = other.residual_bytes("rs")
    out["used"] = _error(lambda: other.load_key("rs", 1))
    out["size"] = _error(lambda: other.load_key("x", 0, res["r1"][:-8]))
    out["call"] = _error(lambda: other.load_key("y", 0, res["r1"], call="all_reduce"))
    a, b = shard.clone(), shard.clone()
    ex.reduce_scatter(a, inp, key="rs").wait()
    other.reduce_scatter(b, inp, key="rs").wait()
    out["same"] = torch.equal(a, b)
    return out


# onebit's default local_feedback=False drops an all-reduce's phase-1 residual; a
# reduce-scatter, phase 1 alone, keeps it all the same
@pytest.mark.parametrize(
    "codec, options", [("int8", {}), ("onebit", {"local_feedback": True}), ("onebit", {})]
)
def test_a_reduce_scatter_keeps_one_residual_per_key(codec, options):
    for out in run_ranks(_rank_residuals_of_a_key, 2, codec, options, timeout=60):
        assert out["key"] == out["all"] == out["want"] == out["loaded"]
        assert out["other"] == 0
        assert "key='rs' has calls of reduce_scatter already" in out["used"]
        assert "residual of 760 elements" in out["size"]
        assert "a residual for a all_reduce" in out["call"]
        assert out["same"]


def _rank_call_order():
    rank = dist.get_rank()
    out = {"check_order": _error(lambda: pycomm.Exchange("int8", check_order="some"))}
    first = pycomm.Exchange("int8")
    t = torch.ones(64)
    # a key's first call differs: raised by the call itself, naming both ranks' calls
    out["first key"] = _error(lambda: first.all_reduce(t, key="a" if rank == 0 else "b"))
    other = pycomm.Exchange("fp8")
    out["first shape"] = _error(lambda: other.all_reduce(torch.ones(64 + rank), key="a"))
    every = pycomm.Exchange("int8", check_order="every")
    for key in ("a", "b"):
        every.all_reduce(torch.ones(64), key=key).wait()
    # both keys known on both ranks: only "every" sees the calls cross
    # (a later call: its wait() raises)
    out["every"] = _error(lambda: every.all_reduce(torch.ones(64), key="ab"[rank]).wait())
    out["every same"] = _error(lambda: every.all_reduce(torch.ones(64), key="a").wait())
    # a refused argument on one rank: raised on every rank where the calls are compared
    bad = torch.ones(64, dtype=torch.int32 if rank == 1 else torch.float32)
    out["one rank's dtype"] = _error(lambda: first.all_reduce(bad, key="new").wait())
    out["one rank's op"] = _error(
        lambda: first.all_reduce(torch.ones(8), key="op", op="sum" if rank else "mean")
    )
    shard = torch.empty(3 + rank)  # rank 1's output is not a chunk of its input
    out["one rank's shape"] = _error(lambda: every.reduce_scatter(shard, torch.ones(6), key="a"))
    return out


def test_the_order_of_calls_is_checked_on_every_rank():
    a, b = run_ranks(_rank_call_order, 2, timeout=60)
    assert a == b
    assert "check_order='some', expected 'first', 'every', 'off'" in a["check_order"]
    assert (
        "pycomm.Exchange.all_reduce: ranks disagree on the order of calls: rank 0 has "
        "\"call 0: all_reduce(key='a', shape [64] float32, op='mean')\", rank 1 has \"call 0: "
        "all_reduce(key='b', shape [64] float32, op='mean')\"" in a["first key"]
    )
    assert (
        "[64] float32, op='mean')\", rank 1 has \"call 0: all_reduce(key='a', shape [65] float32"
        in (a["first shape"])
    )
    assert (
        "rank 0 has \"call 2: all_reduce(key='a', shape [64] float32, op='mean')\", rank 1 has "
        '"call 2: ' in (a["every"])
    )
    assert a["every same"] is None
    assert a["one rank's dtype"] == (
        "TypeError: pycomm.Exchange.all_reduce: on rank 1: tensor "
        "has dtype torch.int32 and layout torch.strided, expected a dense float32, bfloat16 or "
        "float16 tensor"
    )
    assert (
        "op='mean')\", rank 1 has \"call 2: all_reduce(key='op', shape [8] float32, op='sum')"
        in (a["one rank's op"])
    )
    assert a["one rank's shape"].startswith(
        "ValueError: pycomm.Exchange.reduce_scatter: on rank 1: "
        "input has 6 elements, expected 2 x output's 4 = 8"
    )


def _rank_bad_states():
    """A state that is refused changes nothing; garbage states are named."""
    ex = pycomm.Exchange("int8")
    t = torch.randn(300, generator=torch.Generator().manual_seed(dist.get_rank()))
    ex.all_reduce(t.clone(), key="a").wait()
    good = ex.state_dict()
    before = (dict(ex.stats), ex.residual_bytes("a"))
    out = {}
    bad = {**good, "exchange": {**good["exchange"], "stats": {**good["exchange"]["stats"]}}}
    bad["exchange"]["stats"]["steps"] = 999
    for name, state in (
        ("calls", {**bad, "calls": ["x"]}),
        ("short calls", {**bad, "calls": []}),
        ("keys", {**bad, "keys": None}),
        ("not a dict", {"exchange": 5}),
    ):
        out[name] = _error(lambda: ex.load_state_dict(state))  # noqa: B023
    nan = copy.deepcopy(good)
    for kept in nan["exchange"]["residuals"].values():
        for r in kept.values():
            r.fill_(float("nan"))
    out["nan"] = _error(lambda: ex.load_state_dict(nan))
    out["unchanged"] = (dict(ex.stats), ex.residual_bytes("a")) == before
    a, b = t.clone(), t.clone()
    ex.all_reduce(a, key="a").wait()
    fresh = pycomm.Exchange("int8")
    fresh.load_state_dict(good)
    fresh.all_reduce(b, key="a").wait()
    out["same"] = torch.equal(a, b)
    return out


def test_a_refused_state_changes_nothing():
    for out in run_ranks(_rank_bad_states, 2, timeout=60):
        assert out["unchanged"] and out["same"]
        assert out["calls"].startswith(
            "ValueError: pycomm.Exchange.load_state_dict: calls=['x'], expected a list of 1 ints"
        )
        assert "calls=[], expected a list of 1 ints >= 0" in out["short calls"]
        assert "keys=None, expected a list of (call, key) pairs" in out["keys"]
        assert "got dict without an 'exchange' dict" in out["not a dict"]
        assert "holds non-finite values" in out["nan"]


class _FailsOnRank1(Int8Codec):
    """A user's codec whose constructor fails on rank 1 alone, with an error of its own."""

    def __init__(self, block: int = 64, ratio: float = 0.5) -> None:
        self.k = int(1 / ratio)
        super().__init__(block)


def _rank_tensor_kinds():
    """Parameters are written as dist.all_reduce writes them (in place, outside autograd);
    a meta tensor, a scale past fp32 and a bad residual for load_key are refused; a codec
    failing in its constructor on one rank is an error on every rank; the exact
    reduce-scatter's future holds ``output``."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    out = {}
    for codec in ("allreduce", "int8"):
        ex, twin = pycomm.Exchange(codec), pycomm.Exchange(codec)
        t = torch.randn(8, 40, generator=g)
        p = torch.nn.Parameter(t.clone())
        shard = torch.empty(4, 40)
        pshard = torch.nn.Parameter(torch.empty(4, 40))
        full, pfull = torch.empty(8, 40), torch.nn.Parameter(torch.empty(8, 40))
        ex.all_reduce(t, key="t", op="sum").wait()
        twin.all_reduce(p, key="t", op="sum").wait()
        ex.reduce_scatter(shard, t, key="s").wait()
        twin.reduce_scatter(pshard, p, key="s").wait()
        ex.all_gather(full, shard, key="g").wait()
        gathered = twin.all_gather(pfull, pshard, key="g").get_future().wait()
        same = [torch.equal(t, p), torch.equal(shard, pshard), torch.equal(full, pfull)]
        out[codec] = same + [gathered is pfull, p.requires_grad and p.grad_fn is None]
    exact = pycomm.Exchange("allreduce")
    o = torch.empty(1, 37)
    out["future"] = exact.reduce_scatter(o, torch.ones(2, 37), key="f").get_future().wait() is o
    ex = pycomm.Exchange("int8")
    out["meta"] = _error(lambda: ex.all_reduce(torch.empty(8, device="meta"), key="m"))
    out["scale"] = _error(
        lambda: ex.reduce_scatter(torch.empty(64), torch.ones(128), key="r", scale=1e39)
    )
    out["still works"] = float(ex.all_reduce(torch.ones(64), key="x").wait()[0])
    out["stats"] = ex.stats["steps"]
    fresh = pycomm.Exchange("int8")
    out["list residual"] = _error(lambda: fresh.load_key("k", 1, residual=[0.0] * 128))
    out["nan residual"] = _error(
        lambda: fresh.load_key("k", 1, residual=torch.full((128,), float("nan")))
    )
    register_hook("fails_on_rank1", codec=_FailsOnRank1)
    try:
        out["codec fails"] = _error(
            lambda: pycomm.Exchange("fails_on_rank1", ratio=0 if rank == 1 else 0.5)
        )
    finally:
        unregister_hook("fails_on_rank1")
    return out


def test_tensors_of_every_kind_and_a_codec_failing_on_one_rank():
    for out in run_ranks(_rank_tensor_kinds, 2, timeout=60):
        assert out["allreduce"] == [True] * 5 and out["int8"] == [True] * 5
        assert out["future"]
        assert "tensor is on the meta device" in out["meta"]
        assert "scale=1e+39, expected a finite float of at most 3.403e+38" in out["scale"]
        assert out["still works"] == 1.0 and out["stats"] == 1
        assert "residual is a list, expected a tensor or None" in out["list residual"]
        assert "residual holds non-finite values" in out["nan residual"]
        assert out["codec fails"] == (
            "RuntimeError: pycomm.Exchange: on rank 1: ZeroDivisionError: division by zero"
        )


def _rank_mixed_checkpoints():
    """Ranks that load states of different calls: the next call is refused on every rank
    (one rank exact in its warm-up, the other compressing, would pair other collectives)."""
    rank = dist.get_rank()
    ex = pycomm.Exchange("int8", start_iter=2)
    states = []
    for _ in range(3):
        ex.all_reduce(torch.ones(256), key="t").wait()
        states.append(ex.state_dict())
    other = pycomm.Exchange("int8", start_iter=2)
    other.load_state_dict(states[0 if rank == 0 else 2])
    return _error(lambda: other.all_reduce(torch.ones(256), key="t"))


def test_ranks_resuming_from_different_calls_are_refused():
    a, b = run_ranks(_rank_mixed_checkpoints, 2, timeout=60)
    assert a == b
    assert 'ranks disagree on the order of calls: rank 0 has "call 1: all_reduce' in a
    assert 'rank 1 has "call 3: all_reduce' in a


def _rank_groups_made_before():
    """Groups the ranks joined before in different numbers (every rank of 3 calls
    dist.new_group([0, 1]) and new_group([1, 2]): rank 1 holds both, the others one) must not
    stall the groups an Exchange or a compressed hook makes for itself: over every rank, over
    a subgroup, over overlapping subgroups one after the other."""
    r = dist.get_rank()
    a, b = dist.new_group([0, 1]), dist.new_group([1, 2])
    out = {}
    t = torch.full((1000,), float(r))
    pycomm.Exchange("int8").all_reduce(t, key="t").wait()
    out["world"] = t[0].item()
    for name, group, ranks in (("a", a, (0, 1)), ("b", b, (1, 2))):
        if r in ranks:
            u = torch.full((1000,), float(r))
            pycomm.Exchange("int8", process_group=group).all_reduce(u, key="u").wait()
            out[name] = u[0].item()
    torch.manual_seed(0)
    model = pycomm.wrap(torch.nn.Linear(8, 4), hook="int8", hook_options={"start_iter": 2})
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(r))
    for _ in range(3):  # the third step compressed
        model.zero_grad()
        model(x).sum().backward()
    out["grad"] = model.module.weight.grad.clone()
    out["compressed"] = pycomm.hook_state(model).stats["bytes_sent"]
    out["destroyed"] = None
    if r in (0, 1):  # an Exchange outliving its group is refused, naming it
        ex = pycomm.Exchange("int8", process_group=a)
        dist.destroy_process_group(a)
        for call in (lambda: ex.all_reduce(torch.ones(8), key="t"),
                     lambda: ex.all_gather(torch.empty(16), torch.ones(8), key="g")):  # fmt: skip
            out["destroyed"] = (out["destroyed"] or []) + [_error(call)]
    return out


def test_groups_made_before_in_any_order_do_not_stall_an_exchange():
    outs = run_ranks(_rank_groups_made_before, 3, timeout=90)
    assert [o["world"] for o in outs] == [1.0] * 3  # the mean of 0, 1 and 2 (exact in int8)
    assert [o.get("a") for o in outs] == [0.5, 0.5, None]
    assert [o.get("b") for o in outs] == [None, 1.5, 1.5]
    assert all(torch.equal(outs[0]["grad"], o["grad"]) for o in outs)
    assert all(o["compressed"] > 0 for o in outs)
    for o in outs[:2]:
        assert len(o["destroyed"]) == 2
        for text in o["destroyed"]:
            assert "the process group was destroyed; an Exchange lives while the group" in text
    assert outs[2]["destroyed"] is None


def _rank_one_key_at_many_sizes(codec):
    """A key exchanged at many sizes keeps one residual, the latest size's: what one of
    another size cannot use is freed, not kept beside it."""
    ex = pycomm.Exchange(codec, error_feedback=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    single = pycomm.Exchange(codec, error_feedback=True)
    for n in (3000, 1000, 2000, 5000, 2000):
        ex.all_reduce(torch.randn(n, generator=g), key="a").wait()
        ex.reduce_scatter(torch.empty(n), torch.randn(2 * n, generator=g), key="rs").wait()
    single.all_reduce(torch.randn(2000, generator=g), key="a").wait()
    single.reduce_scatter(torch.empty(2000), torch.randn(4000, generator=g), key="rs").wait()
    return {
        "a": (ex.residual_bytes("a"), single.residual_bytes("a")),
        "rs": (ex.residual_bytes("rs"), single.residual_bytes("rs")),
        "all": (ex.stats["residual_bytes"], single.stats["residual_bytes"]),
    }


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_a_key_at_many_sizes_keeps_one_residual(codec):
    for out in run_ranks(_rank_one_key_at_many_sizes, 2, codec, timeout=60):
        for name, (many, one) in out.items():
            assert many == one > 0, name


def _rank_many_tensors_and_keys_in_flight():
    """A list call is the flat tensor's exchange, bit for bit; keys issued together give
    the bits of the same calls waited one by one; a later call of another shape on one rank
    fails its wait() on every rank, and the Exchange goes on."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    shapes = [(3, 40), (7,), (16, 9)]
    listed, flat, keys, waited = (pycomm.Exchange("int4") for _ in range(4))
    out = {"list": [], "keys": []}
    for _ in range(3):
        ts = [torch.randn(s, generator=g) for s in shapes]
        cat = torch.cat([t.reshape(-1) for t in ts])
        cols = [torch.randn(9, 5, generator=g).t()]  # a non-contiguous tensor in a list
        one = torch.cat([cat, torch.cat([c.reshape(-1) for c in cols])])
        listed.all_reduce(ts + cols, key="params").wait()
        flat.all_reduce(one, key="params").wait()
        got = torch.cat([t.reshape(-1) for t in ts + cols])
        out["list"].append(torch.equal(got, one))
        a, b = [t.clone() for t in ts], [t.clone() for t in ts]
        works = [keys.all_reduce(t, key=i) for i, t in enumerate(a)]
        for i, t in enumerate(b):
            waited.all_reduce(t, key=i).wait()
        assert [w.wait() for w in works] == a
        out["keys"].append(all(torch.equal(x, y) for x, y in zip(a, b)))
    work = keys.all_reduce(torch.ones(7 + rank), key=1)  # shapes [7] and [8]
    out["later shape"] = _error(work.wait)
    t = torch.full((7,), float(rank))
    keys.all_reduce(t, key=1).wait()
    out["after"] = t.tolist()
    out["mixed"] = _error(lambda: listed.all_reduce([torch.ones(2), torch.ones(2).half()], "m"))
    out["empty"] = _error(lambda: listed.all_reduce([], key="e"))
    out["steps"] = keys.stats["steps"]
    return out


def test_many_tensors_in_one_call_and_keys_in_flight():
    a, b = run_ranks(_rank_many_tensors_and_keys_in_flight, 2, timeout=60)
    for out in (a, b):
        assert out["list"] == [True] * 3 and out["keys"] == [True] * 3
        assert "ValueError: pycomm.Exchange.all_reduce: ranks disagree" in out["later shape"]
        assert "key=1, shape [7] float32" in out["later shape"]
        assert "key=1, shape [8] float32" in out["later shape"]
        assert out["after"] == [0.5] * 7 or max(abs(v - 0.5) for v in out["after"]) < 0.1
        assert "tensor[1] is torch.float16 on cpu and tensor[0] torch.float32" in out["mixed"]
        assert "tensor is an empty list" in out["empty"]
    assert a["later shape"] == b["later shape"] and a["after"] == b["after"]
    assert a["steps"] == 10  # 9 calls and the one after the refused call


def _rank_out_of_step(call):
    """Ranks that load states of different saves, with the order of calls not checked: the
    first call of any kind is refused on every rank (the ranks compare their steps)."""
    rank = dist.get_rank()
    ex = pycomm.Exchange("allreduce" if call == "sum" else "int8", check_order="off")

    def run(ex):
        if call == "reduce_scatter":
            return ex.reduce_scatter(torch.empty(128), torch.ones(256), key="t")
        if call == "all_gather":
            return ex.all_gather(torch.empty(256), torch.ones(128), key="t")
        return ex.all_reduce(torch.ones(256), key="t", op="sum" if call == "sum" else "mean")

    states = []
    for _ in range(3):
        run(ex).wait()
        states.append(ex.state_dict())
    other = pycomm.Exchange(ex.codec_name, check_order="off")
    other.load_state_dict(states[0 if rank == 0 else 2])
    return _error(lambda: run(other).wait())


@pytest.mark.parametrize("call", ["all_reduce", "reduce_scatter", "all_gather", "sum"])
def test_every_call_kind_compares_the_ranks_steps_after_a_load(call):
    a, b = run_ranks(_rank_out_of_step, 2, call, timeout=60)
    assert a == b
    assert "states have run different numbers of steps (from 1 to 3)" in a, a


def _rank_messages_name_the_exchange():
    rank = dist.get_rank()
    out = {"block": _error(lambda: pycomm.Exchange("int8", block=0))}
    ex = pycomm.Exchange("int8")
    ex.all_reduce(torch.ones(300), key="t").wait()
    saved = ex.state_dict()
    theirs = [None, None]
    dist.all_gather_object(theirs, saved)
    out["other rank"] = _error(lambda: pycomm.Exchange("int8").load_state_dict(theirs[1 - rank]))
    exact = pycomm.Exchange("allreduce")
    exact.all_reduce(torch.full((4,), float("nan") if rank else 1.0), key="n").wait()
    out["exact nonfinite"] = exact.stats["nonfinite_buckets"]
    resumed = pycomm.Exchange("allreduce")  # the count goes with the state
    resumed.load_state_dict(exact.state_dict())
    out["resumed nonfinite"] = resumed.stats["nonfinite_buckets"]
    out["keys"] = sorted(ex.stats)
    return out


def test_messages_and_counters_are_the_exchange_s():
    for out in run_ranks(_rank_messages_name_the_exchange, 2, timeout=60):
        assert "pycomm.Exchange (codec 'int8'): block=0" in out["block"]
        assert "hook" not in out["other rank"]
        assert "pycomm.Exchange.load_state_dict" in out["other rank"]
        assert "Exchange.state_dict() on each rank" in out["other rank"]
        assert out["exact nonfinite"] == 1 and out["resumed nonfinite"] == 1
        assert "rebucketed_steps" not in out["keys"] and "nonfinite_buckets" in out["keys"]


def _pycomm_threads():
    return sum(t.name == "pycomm-exchange" for t in threading.enumerate())


def _rank_inline():
    """The three calls with ``async_op=False`` (done on return, on this thread), and mixed
    with queued calls on one group: the same bits as every call queued."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def run(ex, modes):
        g = torch.Generator().manual_seed(rank)
        a = torch.randn(3000, generator=g)
        inp, shard = torch.randn(n * 333, generator=g), torch.empty(333)
        mine, full = torch.randn(257, generator=g), torch.empty(n * 257)
        works = [
            ex.all_reduce(a, key="a", async_op=modes[0]),
            ex.reduce_scatter(shard, inp, key="b", async_op=modes[1]),
            ex.all_gather(full, mine, key="c", async_op=modes[2]),
        ]
        done = [w.is_completed() for w, m in zip(works, modes) if not m]
        for w in works:
            w.wait()
        return torch.cat([a, shard, full]), done

    queued, _ = run(pycomm.Exchange("int8", start_iter=0), (True, True, True))
    group = dist.new_group(list(range(n)))  # an issuing thread of its own, if it started one
    before = _pycomm_threads()
    inline, done = run(pycomm.Exchange("int8", group, start_iter=0), (False, False, False))
    threads = _pycomm_threads() - before
    mixed, _ = run(pycomm.Exchange("int8", start_iter=0), (True, False, True))
    bad = _error(lambda: pycomm.Exchange("int8").all_reduce(torch.ones(4), "x", async_op="no"))
    return {
        "inline": torch.equal(queued, inline),
        "mixed": torch.equal(queued, mixed),
        "done": done,
        "threads": threads,
        # every rank's all-reduce and all-gather the same bits (the shard is each rank's own)
        "same": all(
            torch.equal(queued[:3000], x[:3000]) and torch.equal(queued[3333:], x[3333:])
            for x in _gathered(queued)
        ),
        "bad": bad,
    }


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_calls_waited_at_once_run_inline_with_the_same_bits(nprocs):
    for out in run_ranks(_rank_inline, nprocs, timeout=120):
        assert out["inline"] and out["mixed"] and out["same"], out
        assert out["done"] == [True, True, True] and out["threads"] == 0, out
        assert "async_op='no', expected True or False" in out["bad"], out
