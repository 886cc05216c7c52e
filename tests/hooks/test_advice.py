"""A onebit hook warns about an optimizer it is known to fall behind with, whatever loop drives
the training: a plain loop, pycomm.TrainLoop, Lightning, Accelerate (2 gloo ranks). Once per
(hook state, optimizer), on every rank; never for an optimizer of another model, plain SGD or
the int8 hook."""

import warnings

import pytest
import torch
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

SGD_M = "with SGD with momentum (SGD), onebit fell behind"
ADAMW = "with an Adam-family optimizer (AdamW), onebit fell behind"


def _messages(caught):
    return [str(w.message) for w in caught if "pycomm onebit hook" in str(w.message)]


def _plain_loop(ddp, opt, steps=5, other=None):
    """zero_grad, forward, backward, step: no pycomm.TrainLoop. ``other``: an optimizer of a
    model without a pycomm hook, stepped alongside."""
    g = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    extra = torch.nn.Linear(8, 8)
    other_opt = other(extra.parameters()) if other else None
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
        if other_opt is not None:
            other_opt.zero_grad()
            extra(torch.randn(2, 8, generator=g)).sum().backward()
            other_opt.step()


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _rank_plain():
    sgd_m = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)  # noqa: E731
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    plain = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    fast = {"start_iter": 2}

    def run(hook, make_opt, options=fast, other=None, steps=5):
        ddp = pycomm.wrap(_net(), hook=hook, hook_options=options, bucket_cap_mb=0.001)
        opt = make_opt(ddp.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _plain_loop(ddp, opt, steps, other)
        return _messages(caught), [w.filename for w in caught]

    out = {
        "sgd_m": run("onebit", sgd_m),
        "adamw": run("onebit", adamw),
        "adamw_defaults": run("onebit", adamw, options={}, steps=3),  # warned before it compresses
        "plain_sgd": run("onebit", plain),
        "int8": run("int8", sgd_m),
        "other_model": run("onebit", plain, other=sgd_m),
    }

    # two optimizers over one onebit model: each warned about, once
    ddp = pycomm.wrap(_net(), hook="onebit", hook_options=fast)
    first, second = sgd_m(ddp.module[0].parameters()), adamw(ddp.module[2].parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            ddp(torch.randn(4, 16)).sum().backward()
            first.step()
            second.step()
    out["two_optimizers"] = _messages(caught)

    # TrainLoop warns when built; the optimizer's steps do not warn again
    ddp = pycomm.wrap(_net(), hook="onebit", hook_options=fast)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = pycomm.TrainLoop(ddp, sgd_m(ddp.parameters()))
        built = len(_messages(caught))
        for _ in range(5):
            loop.step(lambda: ddp(torch.randn(4, 16)).square().mean())
    out["trainloop"] = (built, _messages(caught))

    # a state registered by hand on a plain DDP (no parameters bound): known from its buckets
    ddp = DDP(_net(), bucket_cap_mb=0.001)
    state = pycomm.hooks.hook_spec("onebit").state(None, start_iter=2)
    ddp.register_comm_hook(state, pycomm.hooks.compressed_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _plain_loop(ddp, adamw(ddp.parameters()))
    out["register_comm_hook"] = _messages(caught)
    return out


def test_onebit_warns_in_a_plain_loop_once_per_optimizer_on_every_rank():
    for r in run_ranks(_rank_plain, 2, timeout=120):
        (msg,), (where,) = r["sgd_m"]
        assert SGD_M in msg and "Use the int8 hook" in msg
        assert 'the figures: benchmarks/README.md, "Training quality")' in msg  # not copied
        assert where == __file__  # the user's optimizer.step(), not torch's wrapper
        (msg,), _ = r["adamw"]
        assert ADAMW in msg and "int8" in msg
        assert len(r["adamw_defaults"][0]) == 1
        assert r["plain_sgd"] == ([], [])
        assert r["int8"] == ([], [])
        assert r["other_model"] == ([], [])
        first, second = r["two_optimizers"]
        assert SGD_M in first and ADAMW in second
        built, msgs = r["trainloop"]
        assert built == 1 and len(msgs) == 1 and SGD_M in msgs[0]
        (msg,) = r["register_comm_hook"]
        assert ADAMW in msg


# ---------------------------------------------------------------------- Lightning, Accelerate


def _data(n=32):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
    )


def _rank_lightning(hook):
    import logging

    import lightning.pytorch as L

    from pycomm.lightning import DDPStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, i):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(hook=hook, hook_options={"start_iter": 2}),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), torch.utils.data.DataLoader(_data(), batch_size=4))
    return _messages(caught)


def _rank_accelerate(hook):
    from accelerate import Accelerator

    import pycomm.accelerate as pa

    acc = Accelerator(cpu=True)
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    m, opt, loader = acc.prepare(m, opt, loader)
    pa.register(acc, m, hook=hook, start_iter=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in loader:
            acc.backward(((m(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
    return _messages(caught)


@pytest.mark.parametrize(
    "client, rank_fn, expected",
    [("lightning", _rank_lightning, ADAMW), ("accelerate", _rank_accelerate, SGD_M)],
)
def test_onebit_warns_under_the_clients(client, rank_fn, expected):
    pytest.importorskip(client)
    for msgs in run_ranks(rank_fn, 2, "onebit", timeout=180):
        (msg,) = msgs
        assert expected in msg and "int8" in msg
    assert run_ranks(rank_fn, 2, "int8", timeout=180) == [[], []]
