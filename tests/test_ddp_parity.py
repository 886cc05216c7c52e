"""Where DDP itself works, pycomm behaves as DDP does: parameters no rank used in an
accumulation window keep no gradient (and so do not move), sparse gradients are reduced
exactly, and compiled DDP (compiled autograd with DDP's Python reducer) is refused before
any step. Each case runs against plain DDP on 2 gloo ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

K = 3
HOOKS = ["allreduce", "bf16", "fp16", "int8", "onebit", "powersgd", "auto"]


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
    ref = run_ranks(_rank_unused, 2, "plain", bucket_view, static, opt_name, None, timeout=120)
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
