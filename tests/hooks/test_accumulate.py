"""The fp32 accumulate stage and TrainLoop on gloo ranks: k micro-steps equal one step on the
k-times larger batch, communicate a k-th as much, keep bf16 models closer to fp64, survive
DDP's re-bucketing mid-window and a checkpoint mid-window, and skip non-finite steps on every
rank together."""

import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import errors_of, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

K = 4
WIDTH = 24


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 5),
    )
    return m.to(dtype)


def _batches(rank, n, size=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [
        (
            torch.randn(size, WIDTH, generator=g).to(dtype),
            torch.randn(size, 5, generator=g).to(dtype),
        )
        for _ in range(n)
    ]


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.seen = []

    def step(self, closure=None):
        self.seen.append(
            torch.cat([p.grad.reshape(-1).clone() for g in self.param_groups for p in g["params"]])
        )
        return super().step(closure)


def _loop(ddp, opt, batches, **kw):
    loop = pycomm.TrainLoop(ddp, opt, **kw)
    for x, y in batches:
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    return loop


# --- k micro-steps == one step on the concatenated batch ---------------------------------


def _rank_equivalence(mode):
    rank = dist.get_rank()
    windows = 3  # the first spans DDP's re-bucketing after its first iteration
    batches = _batches(rank, K * windows)
    if mode == "plain":
        ddp, kw = DDP(_model(), bucket_cap_mb=0.004), {"accumulate_steps": K}
    else:
        # "allreduce": gradients as bucket views (wrap's default), summed in place;
        # "allreduce-copy": DDP's copies, summed in the stage's fp32 buffers
        ddp = pycomm.wrap(
            _model(),
            hook="allreduce",
            accumulate_steps=K,
            bucket_cap_mb=0.004,
            gradient_as_bucket_view=mode == "allreduce",
        )
        kw = {}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loop = _loop(ddp, opt, batches, **kw)

    ref = DDP(_model(), bucket_cap_mb=0.004)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for w in range(windows):
        chunk = batches[w * K : (w + 1) * K]
        x = torch.cat([b[0] for b in chunk])
        y = torch.cat([b[1] for b in chunk])
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    ours, theirs = _flat(ddp.module), _flat(ref.module)
    buckets = len(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(","))
    return {
        "rel": ((ours - theirs).norm() / theirs.norm()).item(),
        "params": ours,
        "optimizer_steps": loop.optimizer_steps,
        "skipped": loop.skipped_steps,
        "buckets": buckets,
        "stats": dict(pycomm.hook_state(ddp).stats) if mode != "plain" else {},
    }


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("mode", ["allreduce", "allreduce-copy", "plain"])
def test_k_micro_steps_equal_one_large_batch_step(nprocs, mode):
    results = run_ranks(_rank_equivalence, nprocs, mode, timeout=120)
    for r in results:
        assert r["rel"] <= 1e-6, r["rel"]
        assert r["optimizer_steps"] == 3 and r["skipped"] == 0
        assert torch.equal(r["params"], results[0]["params"])
    if mode != "plain":
        stats = results[0]["stats"]
        assert results[0]["buckets"] >= 3  # several buckets, re-bucketed mid-window
        assert stats["micro_steps"] == 3 * K and stats["steps"] == 3
        n = sum(p.numel() for p in _model().parameters())
        assert stats["accumulate_bytes"] == (0 if mode == "allreduce" else 4 * n)


def _rank_compressed_stage(hook):
    # With a compression hook the result is close to, not equal to, the large-batch step;
    # error feedback sees one step per window.
    rank = dist.get_rank()
    batches = _batches(rank, K * 4)
    ddp = pycomm.wrap(
        _model(),
        hook=hook,
        accumulate_steps=K,
        bucket_cap_mb=0.004,
        hook_options={"start_iter": 2},  # onebit's default is 20: compress steps 2 and 3
    )
    opt = RecordingSGD(ddp.parameters(), lr=0.05)
    _loop(ddp, opt, batches)
    ref = DDP(_model(), bucket_cap_mb=0.004)
    ref_opt = RecordingSGD(ref.parameters(), lr=0.05)
    for w in range(4):
        chunk = batches[w * K : (w + 1) * K]
        ref_opt.zero_grad()
        x, y = torch.cat([b[0] for b in chunk]), torch.cat([b[1] for b in chunk])
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    # the two runs stepped the same parameters only up to the first compressed step
    a, b = opt.seen[2], ref_opt.seen[2]
    return ((a - b).norm() / b.norm()).item(), dict(pycomm.hook_state(ddp).stats)


@pytest.mark.parametrize("hook, bound", [("bf16", 1e-2), ("int8", 5e-2), ("onebit", 1.5)])
def test_stage_composes_with_compression(hook, bound):
    results = run_ranks(_rank_compressed_stage, 2, hook, timeout=120)
    for rel, stats in results:
        assert 0 < rel <= bound, rel
        assert stats["steps"] == 4 and stats["micro_steps"] == 4 * K
        assert stats["bytes_sent"] < stats["bytes_fp32"]  # two of the four steps compressed


# --- bytes and collectives ---------------------------------------------------------------


def _rank_traffic(hook):
    rank = dist.get_rank()
    windows = 5
    batches = _batches(rank, K * windows)
    out = {}
    for k in (1, K):
        ddp = pycomm.wrap(_model(), hook=hook, accumulate_steps=k, bucket_cap_mb=0.004)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        loop = pycomm.TrainLoop(ddp, opt)
        before = None
        for i, (x, y) in enumerate(batches):
            if i == 3 * K:  # after DDP's re-bucketing and the compression warm-up
                before = dict(pycomm.hook_state(ddp).stats)
            loop.step(lambda x=x, y=y, m=ddp: torch.nn.functional.mse_loss(m(x), y))
        after = pycomm.hook_state(ddp).stats
        out[k] = {c: after[c] - before[c] for c in ("bytes_sent", "collectives", "buckets")}
    return out


@pytest.mark.parametrize("hook", ["allreduce", "int8"])
def test_accumulation_communicates_a_kth(hook):
    out = run_ranks(_rank_traffic, 2, hook, timeout=120)[0]
    assert out[1]["collectives"] > 0 and out[1]["bytes_sent"] > 0
    assert out[1]["collectives"] == K * out[K]["collectives"]
    assert out[1]["bytes_sent"] == K * out[K]["bytes_sent"]


# --- bf16 models: the fp32 buffer beats bf16 no_sync -------------------------------------


def _rank_bf16(k):
    rank, world = dist.get_rank(), dist.get_world_size()
    all_batches = [_batches(r, k, size=8, seed=3, dtype=torch.bfloat16) for r in range(world)]
    mine = all_batches[rank]
    seen = {}
    for mode in ("stage", "no_sync"):
        if mode == "stage":
            ddp = pycomm.wrap(_model(dtype=torch.bfloat16), accumulate_steps=k)
        else:
            ddp = DDP(_model(dtype=torch.bfloat16))
        opt = RecordingSGD(ddp.parameters(), lr=0.0)
        _loop(ddp, opt, mine, **({} if mode == "stage" else {"accumulate_steps": k}))
        seen[mode] = opt.seen[-1].double()
    # fp64: the mean over every rank's micro-batches of the micro-batch losses
    ref = _model(dtype=torch.bfloat16).double()
    for r in range(world):
        for x, y in all_batches[r]:
            loss = torch.nn.functional.mse_loss(ref(x.double()), y.double()) / (k * world)
            loss.backward()
    exact = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    return {m: ((g - exact).norm() / exact.norm()).item() for m, g in seen.items()}


def test_bf16_model_accumulates_closer_to_fp64_than_bf16_no_sync():
    for errs in run_ranks(_rank_bf16, 2, 16, timeout=120):
        assert errs["stage"] < errs["no_sync"], errs
        assert errs["stage"] < 1e-2, errs


# --- parameters used in some micro-steps only --------------------------------------------


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = torch.nn.Linear(WIDTH, 32)
        self.a = torch.nn.Linear(32, 5)
        self.b = torch.nn.Linear(32, 5)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.b(h) if self.use_b else self.a(h)


def _uses_b(rank, micro):
    # head b on rank 0 in micro-steps 0-1 of each window and on rank 1 in micro-step 2; never
    # in the k-th, where DDP sees it unused by every rank
    return (rank == 0 and micro % K < 2) or (rank == 1 and micro % K == 2)


def _rank_unused(mode, bucket_view):
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(rank, K * 2, seed=7)
    model = TwoHeads()
    kw = {"find_unused_parameters": True, "gradient_as_bucket_view": bucket_view}
    if mode == "plain":
        ddp, lkw = DDP(model, **kw), {"accumulate_steps": K}
    else:
        ddp, lkw = pycomm.wrap(model, hook=mode, accumulate_steps=K, **kw), {}
    opt = RecordingSGD(ddp.parameters(), lr=0.1)
    loop = pycomm.TrainLoop(ddp, opt, **lkw)
    for i, (x, y) in enumerate(batches):
        model.use_b = _uses_b(rank, i)
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    # the same on one process: the mean over ranks and micro-steps
    ref = TwoHeads()
    ref_opt = RecordingSGD(ref.parameters(), lr=0.1)
    for w in range(2):
        ref_opt.zero_grad()
        for r in range(world):
            for i, (x, y) in enumerate(_batches(r, K * 2, seed=7)):
                if i // K != w:
                    continue
                ref.use_b = _uses_b(r, i)
                (torch.nn.functional.mse_loss(ref(x), y) / (K * world)).backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
    return opt.seen, ref_opt.seen


@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("mode", ["allreduce", "plain"])
def test_parameters_used_in_some_micro_steps(mode, bucket_view):
    results = run_ranks(_rank_unused, 2, mode, bucket_view, timeout=120)
    for seen, ref in results:
        assert len(seen) == 2
        for a, b in zip(seen, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            assert b.abs().sum() > 0
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)


# --- a NaN on one rank: every rank skips -------------------------------------------------


def _rank_nan(mode, max_grad_norm):
    rank = dist.get_rank()
    batches = _batches(rank, K * 3, seed=9)
    if mode == "plain":
        ddp, kw = DDP(_model()), {"accumulate_steps": K}
    else:
        ddp = pycomm.wrap(_model(), hook=mode, accumulate_steps=K, hook_options=_OPTS.get(mode))
        kw = {}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=max_grad_norm, **kw)
    snapshots = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches):
            if i % K == 0:
                snapshots.append(_flat(ddp.module).clone())
            if rank == 1 and i == K + 2:
                x = x.clone()
                x[0, 0] = float("nan")
            loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    snapshots.append(_flat(ddp.module).clone())
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return snapshots, loop.optimizer_steps, loop.skipped_steps, messages


_OPTS = {"int8": {"start_iter": 2}}


@pytest.mark.parametrize(
    "mode, max_grad_norm", [("plain", None), ("allreduce", 1.0), ("int8", 1.0)]
)
def test_non_finite_on_one_rank_skips_everywhere(mode, max_grad_norm):
    results = run_ranks(_rank_nan, 2, mode, max_grad_norm, timeout=120)
    for snaps, steps, skipped, messages in results:
        assert steps == 2 and skipped == 1
        assert not torch.equal(snaps[0], snaps[1])  # window 0 stepped
        assert torch.equal(snaps[1], snaps[2])  # window 1 (the NaN) did not
        assert torch.isfinite(snaps[3]).all() and not torch.equal(snaps[2], snaps[3])
        assert len([m for m in messages if "non-finite" in m]) == 1
    assert torch.equal(results[0][0][-1], results[1][0][-1])


# --- clipping with the hook's norm --------------------------------------------------------


def _rank_clip(mode):
    rank = dist.get_rank()
    batches = _batches(rank, K * 4, seed=11)
    ddp = pycomm.wrap(_model(), hook=mode, accumulate_steps=K)
    opt = RecordingSGD(ddp.parameters(), lr=0.05)
    loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=0.05)
    norms = []
    for i, (x, y) in enumerate(batches):
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y) * 50)
        if (i + 1) % K == 0:
            norms.append(loop.last_grad_norm)
    return norms, [g.norm().item() for g in opt.seen]


@pytest.mark.parametrize("mode", ["allreduce", "int8"])
def test_clipping_to_max_grad_norm(mode):
    norms, clipped = run_ranks(_rank_clip, 2, mode, timeout=120)[0]
    assert all(n > 0.05 for n in norms), norms  # every step needed clipping
    for c in clipped:
        assert abs(c - 0.05) <= 1e-4, clipped


def _rank_clip_as_torch(k, max_norm):
    """TrainLoop with allreduce against plain DDP, no_sync() and clip_grad_norm_ by hand."""
    data = _batches(dist.get_rank(), k * 4, seed=21)
    loss = lambda net, x, y: torch.nn.functional.mse_loss(net(x), y) * 20  # noqa: E731
    ddp = pycomm.wrap(_model(), accumulate_steps=k)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=max_norm)
    for x, y in data:
        loop.step(lambda x=x, y=y: loss(ddp, x, y))
    ref = DDP(_model())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(data):
        last = (i + 1) % k == 0
        with contextlib.nullcontext() if last else ref.no_sync():
            (loss(ref, x, y) / k).backward()
        if last:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            ref_opt.step()
            ref_opt.zero_grad()
    return _flat(ddp.module), _flat(ref.module)


@pytest.mark.parametrize("k, max_norm", [(1, 1.0), (3, 0.3)])
def test_clipping_is_clip_grad_norm_bit_for_bit(k, max_norm):
    for ours, theirs in run_ranks(_rank_clip_as_torch, 2, k, max_norm, timeout=120):
        assert torch.equal(ours, theirs)


# --- checkpoint mid-window ----------------------------------------------------------------


def _rank_resume(view):
    rank = dist.get_rank()
    batches = _batches(rank, K * 3, seed=13)

    def build():
        ddp = pycomm.wrap(
            _model(),
            hook="allreduce",
            accumulate_steps=K,
            bucket_cap_mb=0.004,
            gradient_as_bucket_view=view,
        )
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    ddp, opt = build()
    loop = pycomm.TrainLoop(ddp, opt)
    for x, y in batches:
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    straight = _flat(ddp.module)

    cut = K + 2  # mid-window
    ddp, opt = build()
    loop = pycomm.TrainLoop(ddp, opt)
    for x, y in batches[:cut]:
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    saved = copy.deepcopy(
        {
            "model": ddp.module.state_dict(),
            "opt": opt.state_dict(),
            "hook": pycomm.hook_state(ddp).state_dict(),
        }
    )
    assert saved["hook"]["accumulate"]["micro_step"] == cut and saved["hook"]["accumulate"]["sums"]

    ddp, opt = build()  # fresh DDP: buckets its first iteration differently
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    pycomm.hook_state(ddp).load_state_dict(saved["hook"])
    loop = pycomm.TrainLoop(ddp, opt)
    assert loop.micro_steps == cut
    for x, y in batches[cut:]:
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    return straight, _flat(ddp.module)


@pytest.mark.parametrize("view", [True, False])
def test_resume_mid_window_is_bitwise_equal(view):
    for straight, resumed in run_ranks(_rank_resume, 2, view, timeout=120):
        assert torch.equal(straight, resumed)


# A hook state saved while the stage wrapped the hook's state (its hook "accumulate(int8)", the
# int8 state under "inner"), by 2 ranks after 7 micro-steps of windows of 3: mid-window.
SAVED_V1 = os.path.join(os.path.dirname(__file__), "data", "accumulate_v1.pt")


def _rank_resume_v1():
    """Resume the v1 file, and the same state saved again in today's format: floating point
    differs between CPUs, so the file is compared with what loading it kept (copies, bit for
    bit), and its resume with a resume from today's format of it, both computed here."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(77 + rank)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(12)]

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        ddp = pycomm.wrap(
            model, hook="int8", accumulate_steps=3, bucket_cap_mb=0.0004,
            gradient_as_bucket_view=False, hook_options={"start_iter": 2},
        )  # fmt: skip
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        return ddp, opt

    def resume(hooks_blob):
        ddp, opt = build()
        ddp.module.load_state_dict(saved["model"])
        # a copy: the optimizer keeps the tensors it is handed, and steps them in place
        opt.load_state_dict(copy.deepcopy(saved["opt"]))
        pycomm.checkpoint.load_hook_state(ddp, copy.deepcopy(hooks_blob))
        return ddp, opt

    def train(loop, ddp, part):
        for x, y in part:
            loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
        return _flat(ddp.module)

    saved = torch.load(SAVED_V1, weights_only=True)
    ddp, _ = build()
    fresh = pycomm.hook_state(ddp)
    direct = errors_of({"v1": lambda: fresh.load_state_dict(saved["hooks"][rank])})
    old = {"format": pycomm.checkpoint.GATHERED, "world_size": 2, "states": saved["hooks"]}
    ddp, opt = resume(old)
    state, loop = pycomm.hook_state(ddp), pycomm.TrainLoop(ddp, opt)
    at = (loop.micro_steps, state.stats["micro_steps"], state.accumulate.micro_step)
    now = pycomm.checkpoint.gather_hook_state(ddp)  # today's format
    mine, v1 = now["states"][rank], saved["hooks"][rank]
    kept = (
        mine["accumulate"]["micro_step"] == v1["micro_step"]
        and all(torch.equal(mine["accumulate"]["sums"][k], t) for k, t in v1["sums"].items())
        and mine["residuals"].keys() == v1["inner"]["residuals"].keys()
        and all(
            torch.equal(mine["residuals"][k][n], t)
            for k, res in v1["inner"]["residuals"].items()
            for n, t in res.items()
        )
    )
    from_v1 = train(loop, ddp, batches[7:])
    ddp, opt = resume(now)
    from_now = train(pycomm.TrainLoop(ddp, opt), ddp, batches[7:])
    return {
        "direct": direct["v1"],
        "at": at,
        "kept": kept,
        "bitwise": torch.equal(from_v1, from_now),
    }


def test_a_state_saved_while_the_stage_wrapped_the_hook_resumes_bitwise():
    """The saved format of the stage's earlier place loads through pycomm.checkpoint, keeps
    every saved tensor, and resumes mid-window bit for bit as the same state in today's
    format does; handed to load_state_dict itself it is refused, naming the loaders that read
    it."""
    for r in run_ranks(_rank_resume_v1, 2, timeout=120):
        assert r["at"] == (7, 7, 7) and r["kept"] and r["bitwise"], r
        kind, message = r["direct"]
        assert kind == "ValueError" and "saved by an earlier pycomm" in message, r
        assert "load_hook_state" in message, r


def _rank_other_stage():
    ddp = pycomm.wrap(_model(), hook="int8", accumulate_steps=2)
    ddp(torch.randn(3, WIDTH)).sum().backward()  # mid-window: the sums are saved
    blob = pycomm.checkpoint.gather_hook_state(ddp)

    def load(k):
        into = pycomm.wrap(_model(), hook="int8", accumulate_steps=k)
        return lambda: pycomm.checkpoint.load_hook_state(into, blob)

    return errors_of({"k3": load(3), "k1": load(1), "k2": load(2)})


def test_a_state_of_another_stage_is_refused_naming_it():
    for r in run_ranks(_rank_other_stage, 2, timeout=120):
        assert r["k2"] is None, r  # the check below could pass
        for k in ("k3", "k1"):
            kind, message = r[k]
            assert kind == "ValueError" and "accumulate" in message, r
        assert "2 in the checkpoint but 3 here" in r["k3"][1], r


# --- bad input ---------------------------------------------------------------------------


def _rank_bad_input():
    ddp = pycomm.wrap(_model(), accumulate_steps=K)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    plain = DDP(_model())
    cases = {
        "conflict": lambda: pycomm.TrainLoop(ddp, opt, accumulate_steps=2),
        "norm": lambda: pycomm.TrainLoop(ddp, opt, max_grad_norm=-1.0),
        "norm_nan": lambda: pycomm.TrainLoop(ddp, opt, max_grad_norm=float("nan")),
        "k_zero": lambda: pycomm.TrainLoop(
            plain, torch.optim.SGD(plain.parameters(), lr=0.1), accumulate_steps=0
        ),
        "other_model": lambda: pycomm.TrainLoop(ddp, torch.optim.SGD(_model().parameters())),
        "not_ddp": lambda: pycomm.TrainLoop(_model(), opt),
        "not_opt": lambda: pycomm.TrainLoop(ddp, "sgd"),
        "closure": lambda: pycomm.TrainLoop(ddp, opt).step(3),
        "vector_loss": lambda: pycomm.TrainLoop(ddp, opt).step(
            lambda: ddp(torch.randn(2, WIDTH)).sum(0)
        ),
        "wrap_k": lambda: pycomm.wrap(_model(), accumulate_steps=0),
        "progress": lambda: pycomm.TrainLoop(ddp, opt, progress="yes"),
        "total": lambda: pycomm.TrainLoop(ddp, opt, total=-3),
        "save_path": lambda: pycomm.checkpoint.save(5, ddp, opt),
        "save_opt": lambda: pycomm.checkpoint.save("ckpt.pt", ddp, 5),
    }
    return errors_of(cases)


def test_bad_input_names_the_argument():
    errors = run_ranks(_rank_bad_input, 1, timeout=60)[0]
    expect = {
        "conflict": ("ValueError", "accumulate_steps=2"),
        "norm": ("ValueError", "max_grad_norm=-1.0"),
        "norm_nan": ("ValueError", "max_grad_norm=nan"),
        "k_zero": ("ValueError", "accumulate_steps=0"),
        "other_model": ("ValueError", "optimizer holds none of ddp's trainable parameters"),
        "not_ddp": ("TypeError", "ddp is a Sequential"),
        "not_opt": ("TypeError", "optimizer is a str"),
        "closure": ("TypeError", "closure is a int"),
        "vector_loss": ("TypeError", "expected a scalar loss"),
        "wrap_k": ("ValueError", "accumulate_steps=0"),
        "progress": ("ValueError", "progress='yes', expected True or False"),
        "total": ("ValueError", "total=-3"),
        "save_path": ("TypeError", "path is a int, expected a str or os.PathLike"),
        "save_opt": ("TypeError", "optimizer is a int, expected a torch.optim.Optimizer"),
    }
    for name, (kind, text) in expect.items():
        assert errors[name] is not None, name
        assert errors[name][0] == kind and text in errors[name][1], (name, errors[name])


def _rank_loop_settings_differ():
    rank = dist.get_rank()
    ddp = pycomm.wrap(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    plain = DDP(_model())
    cases = {
        "clip on one rank": lambda: pycomm.TrainLoop(
            ddp, opt, max_grad_norm=0.1 if rank == 0 else None
        ),
        "another window": lambda: pycomm.TrainLoop(
            plain, torch.optim.SGD(plain.parameters()), accumulate_steps=2 if rank == 0 else 1
        ),
        "bad on rank 1": lambda: pycomm.TrainLoop(
            ddp, opt, max_grad_norm=1.0 if rank == 0 else -1.0
        ),
        "another loss scale": lambda: pycomm.TrainLoop(
            ddp, opt, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16 if rank else 16.0)
        ),
        "a scaler disabled": lambda: pycomm.TrainLoop(
            ddp, opt, scaler=torch.amp.GradScaler("cpu", enabled=rank == 0)
        ),
    }
    return errors_of(cases)


def test_loop_settings_that_differ_between_ranks_are_an_error_on_every_rank():
    expect = {
        "clip on one rank": "ranks disagree on max_grad_norm: rank 0 has 0.1, rank 1 has None",
        "another window": "ranks disagree on accumulate_steps: rank 0 has 2, rank 1 has 1",
        "bad on rank 1": "pycomm.TrainLoop: on rank 1: max_grad_norm=-1.0, expected a positive",
        "another loss scale": "ranks disagree on scaler: rank 0 has {'class': 'GradScaler', "
        "'is_enabled': True, 'scale': 16.0",
        "a scaler disabled": "rank 1 has {'class': 'GradScaler', 'is_enabled': False}",
    }
    for errors in run_ranks(_rank_loop_settings_differ, 2, timeout=60):
        for name, text in expect.items():
            assert errors[name] is not None and errors[name][0] == "ValueError", name
            assert text in errors[name][1], (name, errors[name])


# --- a skipped step leaves the error-feedback residuals bitwise as they were -------------


def _rank_nan_residuals(hook, k):
    rank = dist.get_rank()
    batches = _batches(rank, k * 6, seed=17)
    ddp = pycomm.wrap(
        _model(),
        hook=hook,
        accumulate_steps=k,
        bucket_cap_mb=0.004,
        hook_options={"start_iter": 2, "strict_skip": True},  # the bitwise rule
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loop = pycomm.TrainLoop(ddp, opt)
    state = pycomm.hook_state(ddp)
    nan_window = 4  # after the warm-up (start_iter=2) and a few compressed steps
    snaps = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, (x, y) in enumerate(batches):
            if i % k == 0:
                snaps[i // k] = (
                    copy.deepcopy(state.state_dict()["residuals"]),
                    _flat(ddp.module).clone(),
                )
            if rank == 0 and i == nan_window * k + k - 1:
                x = x.clone()
                x[1, 2] = float("inf")
            loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    before, after = snaps[nan_window][0], snaps[nan_window + 1][0]
    moved = snaps[nan_window - 1][0]
    return {
        "skipped": loop.skipped_steps,
        "nonfinite": state.stats["nonfinite_buckets"],
        "same_residuals": all(
            torch.equal(before[key][n], after[key][n]) for key in before for n in before[key]
        )
        and before.keys() == after.keys(),
        "residuals_moved_before": any(
            not torch.equal(moved[key][n], before[key][n]) for key in before for n in before[key]
        ),
        "same_params": torch.equal(snaps[nan_window][1], snaps[nan_window + 1][1]),
        "finite_after": bool(torch.isfinite(_flat(ddp.module)).all()),
    }


@pytest.mark.parametrize("hook, k", [("int8", 1), ("onebit", 2)])
def test_skipped_step_keeps_residuals_bitwise(hook, k):
    for r in run_ranks(_rank_nan_residuals, 2, hook, k, timeout=120):
        assert r["skipped"] == 1 and r["nonfinite"] >= 1, r
        assert r["residuals_moved_before"], r  # the check below could fail
        assert r["same_residuals"] and r["same_params"] and r["finite_after"], r


# --- GradScaler, samples per second ------------------------------------------------------


def _rank_scaler(mode):
    batches = _batches(dist.get_rank(), K * 3, seed=21)
    out = {}
    for scaled in (False, True):
        if mode == "plain":
            ddp, kw = DDP(_model()), {"accumulate_steps": K}
        else:
            ddp, kw = pycomm.wrap(_model(), hook=mode, accumulate_steps=K), {}
        opt = RecordingSGD(ddp.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
        loop = pycomm.TrainLoop(ddp, opt, scaler=scaler, max_grad_norm=0.5, batch_size=6, **kw)
        for x, y in batches:
            loop.step(lambda x=x, y=y, m=ddp: torch.nn.functional.mse_loss(m(x), y))
        out[scaled] = (_flat(ddp.module), opt.seen, loop.last_grad_norm, loop.samples_per_second)
    return out


@pytest.mark.parametrize("mode", ["allreduce", "plain"])
def test_grad_scaler_unscales_before_clipping(mode):
    for out in run_ranks(_rank_scaler, 2, mode, timeout=120):
        (p0, seen0, norm0, sps0), (p1, seen1, norm1, sps1) = out[False], out[True]
        # a power-of-two scale is exact in fp32: the same steps, the same clipped gradients
        torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7)
        for a, b in zip(seen0, seen1):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
        assert norm0 == pytest.approx(norm1, rel=1e-5)
        assert sps0 > 0 and sps1 > 0


def _rank_powersgd_nan(k):
    rank = dist.get_rank()
    ddp = pycomm.wrap(
        _model(), hook="powersgd", accumulate_steps=k, bucket_cap_mb=0.004,
        hook_options={"start_powerSGD_iter": 2, "matrix_approximation_rank": 1},
    )  # fmt: skip
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loop = pycomm.TrainLoop(ddp, opt)
    state = pycomm.hook_state(ddp)
    torch_state = state.torch_state
    memories = lambda: copy.deepcopy(  # noqa: E731
        [torch_state.error_dict, torch_state.p_memory_dict, torch_state.q_memory_dict]
    )
    nan_window, snaps, skipped = 4, {}, []
    for i, (x, y) in enumerate(_batches(rank, k * 8, seed=17)):
        if i % k == 0:
            snaps[i // k] = memories()
        if rank == 0 and i == nan_window * k + k - 1:
            x = x.clone()
            x[1, 2] = float("nan")
        before = loop.skipped_steps
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
        if loop.skipped_steps > before:
            skipped.append(i // k)
    same = lambda a, b: all(  # noqa: E731
        a[j].keys() == b[j].keys() and all(torch.equal(a[j][i], b[j][i]) for i in a[j])
        for j in range(3)
    )
    return {
        "skipped": skipped,
        "kept": same(snaps[nan_window], snaps[nan_window + 1]),
        "moved before": not same(snaps[nan_window - 1], snaps[nan_window]),
        "finite": all(t.isfinite().all() for d in memories() for t in d.values()),
        "params finite": bool(torch.isfinite(_flat(ddp.module)).all()),
    }


@pytest.mark.parametrize("k", [1, 2])
def test_powersgd_skips_one_non_finite_step_and_keeps_its_memories(k):
    """torch's PowerSGD carries error feedback and P/Q from step to step: a NaN on one rank
    skips that step alone, on every rank, and leaves them as they were."""
    for r in run_ranks(_rank_powersgd_nan, 2, k, timeout=120):
        assert r["skipped"] == [4], r
        assert r["moved before"] and r["kept"] and r["finite"] and r["params finite"], r


# --- a GradScaler whose scale changes: the residuals follow it ---------------------------


def _rank_changing_scale(hook, options, k):
    """The same run without a scaler and with one that doubles its scale every step (a power
    of two: the scaled gradients, codes and residuals are exact multiples of the unscaled)."""
    data = _batches(dist.get_rank(), k * 8, seed=23)

    def run(scaler):
        ddp = pycomm.wrap(
            _model(), hook=hook, accumulate_steps=k, bucket_cap_mb=0.004, hook_options=options
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        loop = pycomm.TrainLoop(ddp, opt, scaler=scaler)
        for x, y in data:
            loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
        return _flat(ddp.module)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # onebit's advice on SGD
        plain = run(None)
        scaled = run(torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1))
    return plain, scaled


@pytest.mark.parametrize(
    "hook, options, k",
    [
        ("int8", {}, 1),
        ("onebit", {"start_iter": 2}, 2),
        ("powersgd", {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}, 1),
    ],
)
def test_residuals_follow_a_changing_loss_scale(hook, options, k):
    """TrainLoop rescales the error feedback with the GradScaler's scale: without it each
    growth weighted the residual carried over half as much as the new gradient."""
    for plain, scaled in run_ranks(_rank_changing_scale, 2, hook, options, k, timeout=120):
        assert torch.equal(plain, scaled)


def _rank_followed_scale():
    """A loop of the caller's own (as Accelerate's and the HF Trainer's optimizer steps are)
    with a GradScaler: with follow_loss_scale, a scale that doubles every step trains as a
    constant one, bit for bit; without it, not."""
    from pycomm.train import follow_loss_scale

    data = _batches(dist.get_rank(), 8, seed=29)

    def run(scaler, follow):
        ddp = pycomm.wrap(_model(), hook="int8", bucket_cap_mb=0.004)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if follow:
            follow_loss_scale(scaler, lambda: pycomm.hook_state(ddp))
            follow_loss_scale(scaler, lambda: pycomm.hook_state(ddp))  # once is once
        for x, y in data:
            scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return _flat(ddp.module)

    constant = run(torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=10**6), False)
    growing = lambda: torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)  # noqa: E731
    return torch.equal(constant, run(growing(), True)), torch.equal(constant, run(growing(), False))


def test_follow_loss_scale_keeps_a_callers_loop_bitwise():
    for followed, unfollowed in run_ranks(_rank_followed_scale, 2, timeout=120):
        assert followed and not unfollowed


def _rank_join():
    ddp = pycomm.wrap(_model(), accumulate_steps=2)
    try:
        with ddp.join():
            ddp(torch.randn(2, WIDTH)).sum().backward()
        return None
    except RuntimeError as e:
        return str(e)


def test_join_with_the_accumulate_stage_is_refused_on_every_rank():
    for message in run_ranks(_rank_join, 2, timeout=60):
        assert message is not None and "join() on a model with accumulate_steps=2" in message


def _rank_unused_without_find_unused(bucket_view):
    rank = dist.get_rank()
    model = TwoHeads()  # head b is never used
    ddp = pycomm.wrap(
        model, hook="allreduce", accumulate_steps=K, gradient_as_bucket_view=bucket_view
    )
    loop = pycomm.TrainLoop(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    try:
        for x, y in _batches(rank, K * 2, seed=3):
            loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
        return None
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_parameter_no_step_uses_names_find_unused_parameters(bucket_view):
    # plain DDP refuses this too; the refusal must point at DDP's remedy on every rank
    for message in run_ranks(_rank_unused_without_find_unused, 2, bucket_view, timeout=60):
        assert message is not None and "find_unused_parameters=True" in message, message
