"""Per-step fault-tolerant DDP through pycomm's codecs: ``pycomm.wrap(model, hook=...,
manager=manager)`` against torchft's own ``DistributedDataParallel``, and a replica group
lost and rejoined (it heals from a live peer through the manager)."""

from __future__ import annotations

import pytest
import torch
from ft_harness import Injected, Replica, run_replicas
from torchft.ddp import DistributedDataParallel as TorchftDDP
from torchft.optim import OptimizerWrapper

import pycomm

pytestmark = pytest.mark.timeout(120)


def _build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


_INIT = _build().state_dict()  # every replica group starts here (init_sync=False)


def _train(replica: Replica, hook, steps: int, fail_at=None) -> dict:
    model = _build()
    model.load_state_dict(_INIT)
    manager = replica.manager
    if hook is None:  # torchft's own, the reference
        ddp = TorchftDDP(manager, model)
    else:
        ddp = pycomm.wrap(model, hook=hook, manager=manager)
    opt = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    replica.user_state(
        lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
    )
    g = torch.Generator().manual_seed(10 * replica.replica_id + replica.attempt)
    while manager.current_step() < steps:
        opt.zero_grad()
        x = torch.randn(16, 8, generator=g)
        ddp(x).pow(2).mean().backward()
        opt.step()
        if fail_at is not None and replica.attempt == 0 and manager.current_step() >= fail_at:
            raise Injected()
    stats = pycomm.hook_state(ddp).stats if hook is not None else {}
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": stats}


def test_allreduce_under_the_manager_is_bitwise_torchfts_ddp() -> None:
    ours = run_replicas(lambda r: _train(r, "allreduce", 5), 2, min_replicas=2)
    theirs = run_replicas(lambda r: _train(r, None, 5), 2, min_replicas=2)
    for a, b in zip(ours, theirs):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)


@pytest.mark.parametrize("async_quorum", [False, True])
def test_int8_ddp_loses_a_replica_group_and_heals_it_bitwise(async_quorum: bool) -> None:
    results = run_replicas(
        lambda r: _train(r, "int8", 8, fail_at=3 if r.replica_id == 1 else None), 2,
        use_async_quorum=async_quorum,
    )  # fmt: skip
    for p, q in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p, q)
    assert results[1]["stats"]["heals"] == 1
    # int8: 1 byte a value and a 4-byte scale per block, against torchft's fp32 ring
    assert results[0]["stats"]["compression"] >= 3.5


def test_wrap_with_a_manager_refuses_what_it_does_not_run() -> None:
    def fn(replica: Replica) -> str:
        replica.user_state(dict, lambda s: None)
        model, m = _build(), replica.manager
        with pytest.raises(ValueError, match="hook='powersgd' with manager="):
            pycomm.wrap(model, hook="powersgd", manager=m)
        with pytest.raises(ValueError, match="accumulate_steps=2 with manager="):
            pycomm.wrap(model, hook="int8", manager=m, accumulate_steps=2)
        with pytest.raises(ValueError, match="manager= and process_group="):
            pycomm.wrap(model, hook="int8", manager=m, process_group=object())
        with pytest.raises(TypeError, match="expected a torchft.manager.Manager"):
            pycomm.wrap(model, hook="int8", manager=42)
        return "ok"

    assert run_replicas(fn, 1) == ["ok"]
