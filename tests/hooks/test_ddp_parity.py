"""Where DDP itself works, pycomm behaves as DDP does: parameters no rank used in an
accumulation window keep no gradient (and so do not move), sparse gradients are reduced
exactly, and compiled DDP (compiled autograd with DDP's Python reducer) is refused before
any step. Each case runs against plain DDP on 2 gloo ranks."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

K = 3
HOOKS = ["allreduce", "bf16", "fp16", "int8", "onebit", "powersgd", "auto"]
_REFERENCES: dict = {}


def _reference(fn, *args):
    """The plain-DDP run ``fn(*args)`` on 2 ranks, run once for every test that compares to it."""
    key = (fn.__name__, args)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(fn, 2, *args, timeout=120)
    return _REFERENCES[key]


# --- 1. parameters no rank used in a window ------------------------------------------------


class Heads(torch.nn.Module):
    """``a`` always used, ``b`` only when ``use_b``, ``c`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = torch.nn.Linear(8, 16)
        self.a = torch.nn.Linear(16, 4)
        self.b = torch.nn.Linear(16, 4)
        self.c = torch.nn.Linear(16, 4)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.b(h) if self.use_b else self.a(h)


def _uses_b(rank, micro, static):
    # rank 0 in the first micro-step of each window only: DDP sees b unused by every rank in
    # the window's last micro-step, yet it was used in the window
    return not static and rank == 0 and micro % K == 0


def _optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _build(hook, bucket_view, static, opt_name):
    model = Heads()
    kw = {
        "find_unused_parameters": True,
        "gradient_as_bucket_view": bucket_view,
        # DDP's no_sync() (the reference's accumulation) does not run with a static graph
        "static_graph": static and hook != "plain",
    }
    if hook == "plain":
        ddp, loop_kw = DDP(model, **kw), {"accumulate_steps": K}
    else:
        ddp, loop_kw = pycomm.wrap(model, hook=hook, accumulate_steps=K, **kw), {}
    opt = _optimizer(opt_name, ddp.parameters())
    return model, ddp, opt, loop_kw


def _rank_unused(hook, bucket_view, static, opt_name, cut):
    """Train 3 windows; ``cut``: checkpoint after that many micro-steps and resume in a fresh
    process state (a new DDP, hook state, optimizer). Returns the parameters, which
    parameters had no gradient at each optimizer step, and the never-used head."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3 * K)]
    model, ddp, opt, loop_kw = _build(hook, bucket_view, static, opt_name)
    start_c = copy.deepcopy(model.c.state_dict())
    no_grad = []

    def record(o, args, kwargs):
        no_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is None))

    handle = opt.register_step_pre_hook(record)
    loop = pycomm.TrainLoop(ddp, opt, **loop_kw)
    for i, (x, y) in enumerate(data):
        if i == cut:
            saved = copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "hook": pycomm.hook_state(ddp).state_dict(),
                }
            )
            handle.remove()
            model, ddp, opt, loop_kw = _build(hook, bucket_view, static, opt_name)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            pycomm.hook_state(ddp).load_state_dict(saved["hook"])
            handle = opt.register_step_pre_hook(record)
            loop = pycomm.TrainLoop(ddp, opt, **loop_kw)
        model.use_b = _uses_b(rank, i, static)
        loop.step(lambda x=x, y=y, ddp=ddp: torch.nn.functional.mse_loss(ddp(x), y))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    c_moved = any(not torch.equal(v, model.c.state_dict()[k]) for k, v in start_c.items())
    return params, no_grad, c_moved


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize(
    "bucket_view,static,cut",
    [(False, False, None), (True, False, None), (False, True, None), (True, True, None)]
    + [(False, False, K + 1), (True, False, K + 1)],
    ids=["copy", "view", "copy-static", "view-static", "copy-resume", "view-resume"],
)
def test_unused_parameters_match_ddp_no_sync_bitwise(bucket_view, static, cut, opt_name):
    ref = _reference(_rank_unused, "plain", bucket_view, static, opt_name, None)
    ours = run_ranks(_rank_unused, 2, "allreduce", bucket_view, static, opt_name, cut, timeout=120)
    for (ref_p, ref_none, _), (p, none, c_moved) in zip(ref, ours):
        assert not c_moved
        assert none == ref_none and all("c.weight" in n for n in none), (none, ref_none)
        for name in ref_p:
            assert torch.equal(p[name], ref_p[name]), name


@pytest.mark.parametrize("hook", [h for h in HOOKS if h != "allreduce"])
def test_unused_parameters_stay_put_with_every_hook(hook):
    results = run_ranks(_rank_unused, 2, hook, False, False, "adamw", None, timeout=120)
    for _, no_grad, c_moved in results:
        assert not c_moved
        assert len(no_grad) == 3 and all(n == ["c.bias", "c.weight"] for n in no_grad), no_grad
    for name in results[0][0]:
        assert torch.equal(results[0][0][name], results[1][0][name]), name


# --- 2. sparse gradients --------------------------------------------------------------------


class Sparse(torch.nn.Module):
    """Two sparse-gradient modules beside a dense MLP. The loss is a sum of a dense term and
    a linear term in the embeddings, so the embeddings' gradients do not depend on the dense
    weights: under any hook they must move exactly as under plain DDP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.bag = torch.nn.EmbeddingBag(40, 8, sparse=True, mode="sum")
        self.l1 = torch.nn.Linear(12, 32)
        self.l2 = torch.nn.Linear(32, 1)
        self.register_buffer("c", torch.randn(8))

    def forward(self, x, i, j):
        dense = self.l2(torch.tanh(self.l1(x)))
        return dense, (self.emb(i).mean(1) @ self.c) + (self.bag(j) @ self.c)


def _sparse_data(rank, n):
    g = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(6, 12, generator=g),
            torch.randint(0, 50, (6, 3), generator=g),
            torch.randint(0, 40, (6, 4), generator=g),
            torch.randn(6, 1, generator=g),
        )
        for _ in range(n)
    ]


def _sparse_loss(ddp, x, i, j, y):
    dense, lin = ddp(x, i, j)
    return torch.nn.functional.mse_loss(dense, y) + lin.mean()


def _build_sparse(hook, k):
    model = Sparse()
    if hook == "plain":
        return model, DDP(model), {"accumulate_steps": k}
    opts = {"start_iter": 2} if hook in ("onebit", "auto") else {}
    return model, pycomm.wrap(model, hook=hook, accumulate_steps=k, hook_options=opts), {}


def _rank_sparse(hook, k, steps, max_grad_norm, cut=None):
    """``steps`` optimizer steps through TrainLoop; ``cut``: resume mid-window there."""
    data = _sparse_data(dist.get_rank(), steps * k)
    model, ddp, loop_kw = _build_sparse(hook, k)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=max_grad_norm, **loop_kw)
    norms = []
    for n, batch in enumerate(data):
        if n == cut:
            saved = copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "hook": pycomm.hook_state(ddp).state_dict(),
                }
            )
            assert any(t.is_sparse for t in saved["hook"]["accumulate"]["sums"].values())
            model, ddp, loop_kw = _build_sparse(hook, k)
            model.load_state_dict(saved["model"])
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            opt.load_state_dict(saved["opt"])
            pycomm.hook_state(ddp).load_state_dict(saved["hook"])
            loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=max_grad_norm, **loop_kw)
        before = loop.optimizer_steps
        loop.step(lambda b=batch, ddp=ddp: _sparse_loss(ddp, *b))
        if loop.optimizer_steps > before:
            norms.append(loop.last_grad_norm)
    stats = dict(pycomm.hook_state(ddp).stats) if hook != "plain" else {}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms, stats


def _rank_sparse_by_hand(k, steps, max_grad_norm):
    """The same run without pycomm: DDP's no_sync() accumulation, the norm over the dense
    values of every gradient, clipping and SGD by hand."""
    data = _sparse_data(dist.get_rank(), steps * k)
    model = Sparse()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    norms = []
    for n, batch in enumerate(data):
        final = (n + 1) % k == 0
        with ddp.no_sync() if not final else contextlib.nullcontext():
            (_sparse_loss(ddp, *batch) / k).backward()
        if not final:
            continue
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
        norm = float(torch.stack([g.double().square().sum() for g in grads]).sum().sqrt())
        norms.append(norm)
        if norm > max_grad_norm:
            for p in model.parameters():
                p.grad.mul_(max_grad_norm / (norm + 1e-6))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.mark.parametrize("k", [1, K])
def test_sparse_gradients_allreduce_is_plain_ddp(k):
    """allreduce over sparse gradients, with TrainLoop's norm and clipping: bitwise TrainLoop
    over plain DDP, and within float rounding of the loop written by hand."""
    ref = _reference(_rank_sparse, "plain", k, 4, 0.5)
    ours = run_ranks(_rank_sparse, 2, "allreduce", k, 4, 0.5, timeout=120)
    hand = run_ranks(_rank_sparse_by_hand, 2, k, 4, 0.5, timeout=120)
    for (ref_p, ref_norms, _), (p, norms, stats), (hand_p, hand_norms) in zip(ref, ours, hand):
        assert norms == ref_norms
        assert all(n > 0.5 for n in norms)  # every step clipped
        torch.testing.assert_close(norms, hand_norms, rtol=1e-6, atol=0)
        for name in ref_p:
            assert torch.equal(p[name], ref_p[name]), name
            torch.testing.assert_close(p[name], hand_p[name], rtol=1e-5, atol=1e-7)
        assert stats["buckets"] > 0 and stats["compression"] == 1.0


@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("hook", [h for h in HOOKS if h != "allreduce"])
def test_sparse_buckets_are_exact_under_every_hook(hook, k):
    """The embeddings (sparse, reduced exactly) move bitwise as under plain DDP; the dense
    buckets are compressed; the ranks agree."""
    ref = _reference(_rank_sparse, "plain", k, 5, None)
    ours = run_ranks(_rank_sparse, 2, hook, k, 5, None, timeout=120)
    for (ref_p, _, _), (p, _, stats) in zip(ref, ours):
        for name in ("emb.weight", "bag.weight"):
            assert torch.equal(p[name], ref_p[name]), name
        assert not torch.equal(p["emb.weight"], Sparse().emb.weight.detach())
        if hook not in ("powersgd", "auto"):  # those stay exact here (warm-up, or a choice)
            assert stats["bytes_sent"] < stats["bytes_fp32"]
    for name in ours[0][0]:
        assert torch.equal(ours[0][0][name], ours[1][0][name]), name


@pytest.mark.parametrize("hook", ["allreduce", "int8"])
def test_sparse_accumulation_resumes_mid_window_bitwise(hook):
    straight = run_ranks(_rank_sparse, 2, hook, K, 3, 0.5, timeout=120)
    resumed = run_ranks(_rank_sparse, 2, hook, K, 3, 0.5, K + 1, timeout=120)
    for (a, norms_a, _), (b, norms_b, _) in zip(straight, resumed):
        assert norms_a == norms_b
        for name in a:
            assert torch.equal(a[name], b[name]), name


# --- 3. compiled DDP ------------------------------------------------------------------------


def _rank_python_reducer():
    """Under optimize_ddp='python_reducer' every hook, with and without accumulate_steps, is
    refused by wrap and by register before any step."""
    import torch._dynamo

    errors = {}
    old = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        for hook in HOOKS:
            for k in (1, K):
                for via in ("wrap", "register"):
                    model = torch.nn.Linear(8, 4)
                    with pytest.raises(RuntimeError) as err:
                        if via == "wrap":
                            pycomm.wrap(model, hook=hook, accumulate_steps=k)
                        else:
                            pycomm.register(DDP(model), hook=hook, accumulate_steps=k)
                    assert model.weight.grad is None
                    errors[hook, k, via] = str(err.value)
    finally:
        torch._dynamo.config.optimize_ddp = old
    return errors


def test_python_reducer_is_refused_before_any_step():
    ranks = run_ranks(_rank_python_reducer, 2, timeout=120)
    assert ranks[0] == ranks[1]  # the same error on every rank
    assert len(ranks[0]) == len(HOOKS) * 4
    for (_, _, via), message in ranks[0].items():
        assert message.startswith(f"pycomm.{via}: "), message
        assert "optimize_ddp = 'python_reducer'" in message
        assert "'ddp_optimizer'" in message  # what to use instead


def _rank_compiled(hook):
    """torch.compile(ddp) with torch's default optimize_ddp ('ddp_optimizer'): DDP's reducer
    calls the hook."""
    import torch._dynamo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model) if hook == "plain" else pycomm.wrap(model, hook=hook)
    compiled = torch.compile(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    try:
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(compiled(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch._dynamo.reset()
    steps = pycomm.hook_state(ddp).stats["steps"] if hook != "plain" else 4
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), steps


def test_compiled_ddp_with_ddp_optimizer_runs_the_hooks():
    ref = run_ranks(_rank_compiled, 2, "plain", timeout=180)
    ours = run_ranks(_rank_compiled, 2, "allreduce", timeout=180)
    for (a, _), (b, steps) in zip(ref, ours):
        assert steps == 4
        assert torch.equal(a, b)


def _norms_the_optimizer_gets(model, opt):
    """A list that each optimizer step appends the norm of the gradients it steps with to (read
    in a step pre-hook, sparse ones densified)."""
    seen = []

    def read(optimizer, args, kwargs):
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
        seen.append(float(torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()))

    opt.register_step_pre_hook(read)
    return seen


def _rank_sparse_norm_is_the_optimizers(hook, k, steps):
    """TrainLoop's last_grad_norm beside the norm of the gradients the optimizer then steps
    with (read in an optimizer step pre-hook, sparse ones densified)."""
    data = _sparse_data(dist.get_rank(), steps * k)
    model, ddp, loop_kw = _build_sparse(hook, k)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = _norms_the_optimizer_gets(model, opt)
    loop = pycomm.TrainLoop(ddp, opt, **loop_kw)
    norms = []
    for batch in data:
        before = loop.optimizer_steps
        loop.step(lambda b=batch: _sparse_loss(ddp, *b))
        if loop.optimizer_steps > before:
            norms.append(loop.last_grad_norm)
    return norms, seen


@pytest.mark.parametrize("hook", ["plain", *HOOKS, "fp8", "int4"])
def test_sparse_accumulation_norm_is_the_optimizers_gradient(hook):
    """With sparse gradients summed over 2 micro-steps, the norm TrainLoop clips with is the
    norm of the gradient the optimizer receives, to 1e-6, as for dense models."""
    for norms, seen in run_ranks(_rank_sparse_norm_is_the_optimizers, 2, hook, 2, 4, timeout=120):
        assert len(norms) == len(seen) == 4
        torch.testing.assert_close(norms, seen, rtol=1e-6, atol=0)


def _split_flagged(_, bucket):
    """torch's all-reduce, whose sparse result is handed on with each index twice (half the
    value each) and still flagged coalesced: the same gradient, as a user's hook may give it."""
    fut = default_hooks.allreduce_hook(None, bucket)
    if not bucket.buffer().is_sparse:
        return fut

    def split(f):
        g = f.value()
        g = g[0] if isinstance(g, list) else g
        idx, val = g._indices(), g._values() / 2
        return torch.sparse_coo_tensor(
            torch.cat([idx, idx], 1),
            torch.cat([val, val]),
            g.shape,
            is_coalesced=True,
            check_invariants=False,
        )

    return fut.then(split)


def _rank_flagged_norm():
    data = _sparse_data(dist.get_rank(), 4)
    model = Sparse()
    ddp = DDP(model)
    ddp.register_comm_hook(None, _split_flagged)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = _norms_the_optimizer_gets(model, opt)
    loop = pycomm.TrainLoop(ddp, opt)
    norms = []
    for batch in data:
        loop.step(lambda b=batch: _sparse_loss(ddp, *b))
        norms.append(loop.last_grad_norm)
    return norms, seen


def test_sparse_norm_sums_repeated_indices_whatever_the_flag():
    """A sparse gradient that repeats indices while flagged coalesced (``coalesce()`` then
    returns it as it is): the norm is still that of the gradient the optimizer adds in."""
    for norms, seen in run_ranks(_rank_flagged_norm, 2, timeout=60):
        assert len(norms) == len(seen) == 4
        torch.testing.assert_close(norms, seen, rtol=1e-6, atol=0)


# --- powersgd's compressed steps beside DDP's own collectives ------------------------------


class _SparseUnused(torch.nn.Module):
    """An embedding (a sparse bucket, DDP's last), an MLP, and a layer no step uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16, sparse=True)
        self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64)
        self.c, self.unused = torch.nn.Linear(64, 3), torch.nn.Linear(64, 64)

    def forward(self, i):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(self.emb(i).mean(1))))))


def _rank_powersgd_unused(k):
    g = torch.Generator().manual_seed(dist.get_rank())
    ddp = pycomm.wrap(
        _SparseUnused(), hook="powersgd", accumulate_steps=k, bucket_cap_mb=0.01,
        find_unused_parameters=True,
        hook_options={"start_powerSGD_iter": 2, "matrix_approximation_rank": 1},
    )  # fmt: skip
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=1.0)
    for _ in range(8 * k):
        x, y = torch.randint(0, 50, (8, 5), generator=g), torch.randn(8, 3, generator=g)
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    state = pycomm.hook_state(ddp)
    stats = state.stats
    return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]), stats


@pytest.mark.parametrize("k", [1, 2])
def test_powersgd_compresses_beside_find_unused_parameters(k):
    """DDP all-reduces the used-parameter map on its group while torch's PowerSGD issues its
    P and Q all-reduces from callbacks: on one group the ranks met them in other orders (a
    hang); powersgd's own group keeps them apart."""
    (a, stats), (b, _) = run_ranks(_rank_powersgd_unused, 2, k, timeout=90)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    assert stats["compression"] > 1.5


class _SparseFirst(torch.nn.Module):
    """An MLP and, registered last, an embedding: DDP's bucket 0 is the sparse one, and the
    dense bucket DDP's 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3)
        self.emb = torch.nn.Embedding(50, 16, sparse=True)

    def forward(self, i):
        return self.b(torch.tanh(self.a(self.emb(i).mean(1))))


def _rank_powersgd_sparse_first():
    g = torch.Generator().manual_seed(dist.get_rank())
    ddp = pycomm.wrap(
        _SparseFirst(), hook="powersgd",
        hook_options={"start_powerSGD_iter": 2, "matrix_approximation_rank": 1},
    )  # fmt: skip
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loop = pycomm.TrainLoop(ddp, opt)
    for _ in range(5):
        x, y = torch.randint(0, 50, (8, 5), generator=g), torch.randn(8, 3, generator=g)
        loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
    state = pycomm.hook_state(ddp)
    return sorted(state.torch_state.error_dict), len(state.bucket_layout.buckets)


def test_powersgd_keys_its_memories_by_the_hooks_bucket_from_the_first_compressed_step():
    # torch keys error feedback and P/Q by the bucket's index: the first compressed step (the
    # layout's recording) passed DDP's bucket 1, the later ones the hook's bucket 0, so the
    # first step's error feedback was dropped (and a stale entry kept)
    for keys, buckets in run_ranks(_rank_powersgd_sparse_first, 2, timeout=90):
        assert keys == list(range(buckets)) and buckets == 1
